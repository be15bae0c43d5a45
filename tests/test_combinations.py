"""The generated combination matrix (tests/combinations.py), each row one real
`launch/run.py --parity` run (over gloo on the CPU, 4 ranks; 8 for an integer reshard on
hsdp or on tp meshes and for hsdp x dp x tp; 16 for an integer reshard on hsdp x dp x
tp) against the single-device reference: the debug model, dense or a mixture of experts,
at 2 blocks (4 or 8 with pipeline parallel), 3 steps. Each row is held to the tolerances promised for its dtype
(tests/test_parity.py's docstring), whatever the command's own verdict. A row whose
weights come from a Hugging Face folder also holds its reference's step-0 loss to
transformers' on the same batch.

The rows of one world size run one after another in one torchrun job
(tests/distributed.py: run_together), real processes and process groups, started once;
a row that job did not finish runs alone through the launcher, and so does a row of
fault-tolerant replica groups (a Lighthouse and one job per group). The compiled rows run in
jobs of their own, on a compile cache of their own, and then again on the cache that
first run filled, as a user's second run does. On torch before 2.13,
the ZBVZeroBubble rows (parallel/pipeline.py: runs_on_backend) must be refused instead, so
there the pairs only they hold are checked on the newer versions alone.

Every row runs on the pinned torch (`make test-matrix`). The other versions (`make test-compat`)
run the rows of VALUE_ROWS, in which every value of every setting appears once or more
(9 rows, one of them compiled and fault-tolerant): each feature meets each version, and the pairs are
proven on the pinned one."""

from itertools import combinations

import pytest

from tests.combinations import (FACTORS, MESHES, PIPELINE_MESHES, ROWS, SPLITS, STEPS, VALUE_ROWS, ZERO_BUBBLE, _pairs,
                                all_pairs, allowed, hf_folder, layers_of, mesh_of, overrides, stages_per_rank)
from parallel.mesh import parse_mesh
from parallel.pipeline import runs_on_backend
from tests.distributed import launcher, parity_arguments, parity_report, run_together, selected
from tests.test_parity import assert_within_promised_tolerances

pytestmark = pytest.mark.matrix  # `make test-matrix`, not `make test`

# The reference's step-0 loss against transformers' (fp32, eager attention) on the same
# batch and weights, as the fp32 parity rule's step-0 loss (rows with imported weights
# run in fp32: tests/combinations.py, allowed). Rows in float8 skip it: transformers
# computes in fp32, and their parity reference computes in float8 like the mesh.
TRANSFORMERS_LOSS_TOLERANCE = 1e-5


def test_every_pair_of_values_appears_in_some_row():
    covered = set().union(*(_pairs(row) for row in ROWS))
    assert set(all_pairs()) <= covered
    assert all(allowed(row) for row in ROWS)
    assert (len(ROWS), len(all_pairs())) == (26, 1406)  # docs/parallelism.md quotes both


def test_only_the_pairs_no_valid_row_can_hold_are_left_out():
    possible = sum(len(FACTORS[a]) * len(FACTORS[b]) for a, b in combinations(FACTORS, 2))
    without_tp = [kind for kind in MESHES if "tp" not in kind]
    schedules = [value for value in FACTORS["pipeline"] if value != "off"]
    left_out = (len(without_tp) * 2  # (dp or hsdp) x (sequence_parallel or loss_parallel = true)
                + len(schedules) * 2  # a schedule x (hsdp x dp x tp, or an integer reshard): 8 ranks or more
                + len(ZERO_BUBBLE) * 4  # zero bubble x (reshard true, compile, op-level AC, recompute_cheap)
                + 1  # 1F1B x one micro-batch, fewer than its 2 stages
                + 3 * 2  # an uneven or ends split x (no pipeline, hsdp x dp x tp, or an integer reshard)
                + 2  # imported weights (untied or tied) x bf16
                + 1  # compile x hsdp x dp x tp, 8 ranks
                + 1  # float8 tensorwise (with float8 all-gathers) x an integer reshard
                + 1  # float8 tensorwise x cp, which --parity refuses
                + 1  # ep x an integer reshard
                + 2)  # fault-tolerant replica groups x a mesh without hsdp (dp, dp x tp)
    assert possible - len(all_pairs()) == left_out
    assert set(PIPELINE_MESHES) == set(MESHES) - {"hsdp-dp-tp"}


def cases(indices: list[int], hf_root) -> list[tuple]:
    return [(mesh_of(ROWS[i]), overrides(ROWS[i], hf_root), STEPS) for i in indices]


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-folders")


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """The compiled rows' own compile cache (TORCHINDUCTOR_CACHE_DIR), cold at first."""
    return tmp_path_factory.mktemp("compile-cache")


def warm_rows(indices) -> list[int]:
    """The compiled rows that run twice, first on a cold compile cache of their own, then on
    the one they filled: those whose compiled blocks hold a collective, that is those with
    tp or cp (FSDP's and the pipeline's stay outside the compiled blocks)."""
    def collectives_compiled(row: dict) -> bool:
        spec = parse_mesh(mesh_of(row))
        return spec.tp > 1 or spec.cp > 1 or spec.ep > 1
    return [i for i in indices if ROWS[i]["compile"] and collectives_compiled(ROWS[i]) and runs_here(ROWS[i])
            and not ROWS[i]["fault_tolerance"]]


# The command a user ran twice, the second time on the cache the first had filled, and
# which then failed: compiled cp=2,tp=2 with sequence parallel. It runs first in the job of
# warm rows, since the rows alone did not fail there (their keys vary from run to run).
FIRST_SEEN = ("cp=2,tp=2", ("parallel.sequence_parallel=true", "parallel.compile=true"), STEPS)


def warm_cases(indices: list[int], hf_root) -> list[tuple]:
    return [FIRST_SEEN, *cases(indices, hf_root)]


@pytest.fixture(scope="session")
def row_report(tmp_path_factory, request, hf_root, compile_cache):
    root = tmp_path_factory.mktemp("combinations")
    # A fault-tolerant row is a Lighthouse and a job per replica group: parity_report runs it
    # alone, through the launcher
    chosen = [i for i in selected(request.session, __name__, "index")
              if runs_here(ROWS[i]) and not ROWS[i]["fault_tolerance"]]
    compiled = warm_rows(chosen)
    run_together(root, cases([i for i in chosen if i not in compiled], hf_root))
    failures = run_together(root, warm_cases(compiled, hf_root), env={"TORCHINDUCTOR_CACHE_DIR": str(compile_cache)})

    def get(index: int):
        return parity_report(root, mesh_of(ROWS[index]), *overrides(ROWS[index], hf_root), steps=STEPS)
    get.compiled = None if failures else compiled  # their first run, which filled compile_cache
    return get


def transformers_loss(row: dict, hf_root, argv: list[str]) -> float:
    """transformers' mean cross-entropy on the row's step-0 global batch, with the weights
    of the row's folder (fp32)."""
    import torch
    import transformers

    from engine.data.sources import build_source, local_batch
    from launch.run import check, parse_args
    from parallel.mesh import parse_mesh

    cfg, _ = check(parse_args(argv), parse_mesh(mesh_of(row)).world_size)
    inputs, targets = local_batch(build_source(cfg, 256), 0, cfg.training.global_batch, cfg.training.seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder(hf_root, row), attn_implementation="eager")
    with torch.no_grad():
        logits = model.float().eval()(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def on_every_version(indices) -> list:
    """The rows `make test-compat` runs too: those of VALUE_ROWS (every value of every
    setting, on each torch version we claim); every row runs on the pinned one."""
    return [pytest.param(i, marks=pytest.mark.compat) if i in VALUE_ROWS else i for i in indices]


@pytest.mark.distributed
@pytest.mark.parametrize("index", on_every_version(range(len(ROWS))))
def test_combination_row_passes_parity(row_report, index, tmp_path, hf_root):
    row = ROWS[index]
    if not runs_here(row):  # refused before torch 2.13, with the fix
        result = launcher("--parity", "--mesh", mesh_of(row), "--set", f"run.dir={tmp_path}",
                          *(arg for value in overrides(row, hf_root) for arg in ("--set", value)))
        assert result.returncode == 2 and refusal(row) in result.stderr, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        return
    report, code = row_report(index)
    assert (code, report["verdict"]) == (0, "PASS"), [c for c in report["checks"] if not c["ok"]]
    assert_within_promised_tolerances(report, STEPS)
    layers = layers_of(row)
    assert report["layers"] == layers
    # 9 tensors per block (4 attention, 3 MLP, 2 norms), or 12 with experts (the MLP's 3
    # become the router's gate, the experts' 2 and the shared expert's 3; Mixtral's
    # imported shapes have no shared expert: 9), and 3 outside
    # (embedding, norm, output); a tied output is the embedding, but a pipeline's last
    # stage holds a copy
    one_output = row["weights"] == "hf-tied" and row["pipeline"] == "off"
    per_block = 9 if row["experts"] == "dense" or row["weights"] != "seed" else 12
    assert len(report["gradient_digests"]) == layers * per_block + 3 - one_output
    if row["pipeline"] != "off":
        assert report["pipeline"]["schedule"] == row["pipeline"]
        if row["pp_split"] != "even":
            split = SPLITS[row["pp_split"]][stages_per_rank(row)][0]
            assert [len(blocks) for blocks in report["pipeline"]["blocks_per_stage"]] == \
                [int(n) for n in split.split(",")]
    if row["weights"] != "seed" and row["float8"] == "none":
        argv = parity_arguments(tmp_path, tmp_path / "unused.json", mesh_of(row), overrides(row, hf_root), STEPS)
        theirs = transformers_loss(row, hf_root, argv)
        ours = report["steps_table"][0]["reference_loss"]
        print(f"row {index}: step-0 loss {ours!r}, transformers' {theirs!r}, diff {abs(ours - theirs):.1e}")
        assert abs(ours - theirs) <= TRANSFORMERS_LOSS_TOLERANCE


def cache_entries(cache) -> set[str]:
    """The graphs in a compile cache's AOT autograd part, one file per compiled graph."""
    return {str(path.relative_to(cache)) for path in (cache / "aotautograd").rglob("*") if path.is_file()}


@pytest.mark.distributed
@pytest.mark.compat
def test_compiled_rows_pass_again_on_the_cache_their_first_run_filled(row_report, hf_root, compile_cache, tmp_path):
    """A user runs one command many times, and every run after the first finds torch's
    compile cache warm. The compiled rows whose graphs hold collectives (warm_rows), after
    the command that failed so (FIRST_SEEN), run again as a new job, in the same order, on
    the cache their first run filled: each PASSes again, with graphs from that cache. On torch 2.13 the
    second run of FIRST_SEEN failed ("Could not resolve the process group registered under
    the name 16"), here as from the command line, until the engine keyed the cache on each
    rank's layout (parallel/apply.py: key_compile_cache_on_layout). Not every graph comes from the cache:
    torch 2.13's key holds a DeviceMesh's cached Python hash, which on Python 3.11 differs
    from process to process (hash(None) is its address), so graphs with a tp mesh are
    compiled again; those without one are not, and the cache gains fewer entries than the
    first run wrote."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(compile_cache)}
    first = row_report.compiled
    if first is None:  # this session has not run them yet: their first run, on the same cache
        first = warm_rows(range(len(ROWS)))
        (tmp_path / "cold").mkdir()
        assert not run_together(tmp_path / "cold", warm_cases(first, hf_root), env=env, reports={})
    filled = cache_entries(compile_cache)
    assert filled
    warm: dict = {}
    failures = run_together(tmp_path, warm_cases(first, hf_root), env=env, reports=warm)
    assert not failures, failures[0][-4000:]
    for mesh, overrides_, steps in warm_cases(first, hf_root):
        report, code = warm[(mesh, steps, overrides_)]
        assert (code, report["verdict"]) == (0, "PASS"), (mesh, [c for c in report["checks"] if not c["ok"]])
        assert_within_promised_tolerances(report, STEPS)
    assert len(cache_entries(compile_cache) - filled) < len(filled)


def refusal(row: dict) -> str | None:
    """What the engine says when it refuses the row on this torch, or None where it runs."""
    if not runs_on_backend(row["pipeline"], "gloo"):
        return "cannot run over gloo"
    return None


def runs_here(row: dict) -> bool:
    return refusal(row) is None


def rows_where(**wanted) -> list[int]:
    return [i for i, row in enumerate(ROWS) if all(row[k] == v for k, v in wanted.items())]


@pytest.mark.distributed
@pytest.mark.parametrize("index", on_every_version(rows_where(reshard_after_forward="2")))
def test_integer_reshard_really_reshards_onto_groups_of_two(row_report, index):
    """After forward, block parameters live on groups of 2 ranks instead of the whole
    shard group: natively on meshes without tp, on the engine's (groups, 2, tp) mesh
    with tp. The layout an integer reshard promises, read from the first block."""
    row = ROWS[index]
    sizes = dict(item.split("=") for item in mesh_of(row).split(","))
    tp = int(sizes.get("tp", 1))
    replicas = 1 if row["fault_tolerance"] else int(sizes.get("hsdp", 1))  # a replica group's mesh has no hsdp
    groups = replicas * int(sizes.get("dp", 1)) * int(sizes.get("cp", 1)) // 2
    mesh, placements, local_shape = row_report(index)[0]["post_forward_layout"]["attention.wq.weight"]
    assert local_shape == [256 // tp // 2, 256]  # tp splits the rows, the group of 2 halves them again
    if tp == 1:
        assert (mesh, placements) == (f"({groups}, 2)", ["R", "S(0)"])
        return
    assert mesh == f"({groups}, 2, {tp})"
    assert placements[0] == "R" and placements[1].startswith("_S(0") and placements[2] == "S(0)"
    if row["sequence_parallel"]:  # the norm is replicated over tp
        norm = row_report(index)[0]["post_forward_layout"]["ffn_norm.weight"]
        assert norm == [f"({groups}, 2, {tp})", ["R", "S(0)", "R"], [128]]


@pytest.mark.distributed
@pytest.mark.compat
def test_reshard_true_returns_to_the_whole_shard_group(row_report):
    """After forward, a block's parameters are sharded over the whole shard group (dp x cp,
    beside hsdp and tp) again, as before it."""
    candidates = rows_where(reshard_after_forward="true", pipeline="off")
    index = next((i for i in candidates if i in VALUE_ROWS), candidates[0])
    spec = parse_mesh(mesh_of(ROWS[index]))
    mesh, _, local_shape = row_report(index)[0]["post_forward_layout"]["attention.wq.weight"]
    replicated = spec.hsdp > 1 and not ROWS[index]["fault_tolerance"]  # a replica group's mesh has no hsdp
    sizes = [size for size, kept in ((spec.hsdp, replicated), (spec.shard_size, True), (spec.tp, spec.tp > 1))
             if kept]
    assert mesh == str(tuple(sizes)) and local_shape == [256 // spec.tp // spec.shard_size, 256]
