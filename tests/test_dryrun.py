"""The dry run's predictions against a real run of the same layouts (docs/planning.md).

The measured side is real: 4 torchrun ranks over gloo, the debug model materialised
and trained for one step, observed by engine/dryrun/observe.py. The predicted side is
`simulate`, the dry run behind `launch/run.py --dry-run`, in one process with torch's
fake process group and fake tensors. State bytes and collectives must agree exactly;
the peak of tracked tensor memory within 10%.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from parallel.mesh import parse_mesh
from tests.distributed import call_in_own_process, launcher, selected
from tests.dryrun_worker import measure_and_predict

WORLD = 4
BATCH = "training.global_batch=8"
# A mixture of experts, simulated at dryrun.expert_load=1 (each ep rank gets the mean
# rows); the real step routes by value.
MOE = [BATCH, "model.name=llama_moe", "model.flavor=debug-moe", "parallel.plan=llama_moe"]
LAYOUTS = [
    ("cp=2,dp=2,ep=2", MOE),
    ("dp=4", MOE),
    ("dp=4,ep=2", MOE + ["parallel.activation_checkpoint=full"]),
    ("dp=2,ep=2,tp=2", MOE + ["parallel.sequence_parallel=true"]),
    ("dp=4,ep=4", MOE + ["parallel.param_dtype=bfloat16"]),
    ("pp=2,dp=2,ep=2", MOE + ["training.micro_batches=2"]),  # the stages' routing totals summed over pp
    # Every row to ep rank 0's experts: the real step is routed so (tests/dryrun_worker.py:
    # route_to_first_ep_rank). At load 1 above, the worker's tokens are all one id, so each
    # block sends every row to the same two experts, and rank 0's received rows match the
    # mean only summed over the blocks (at dp=4,ep=4: 512, 0, 0 and 512 rows against 256
    # each); this layout checks the assumption block by block.
    ("dp=4,ep=2", MOE[:2] + ["model.flavor=debug-moe-sigmoid", MOE[3], "dryrun.expert_load=2"]),
    # One expert per ep rank, sharded over 2 ranks along its rows (parallel/apply.py:
    # expert_placement), every row routed to ep rank 0's (as above).
    ("dp=4,ep=2", MOE[:2] + ["model.flavor=debug-moe-2", MOE[3], "dryrun.expert_load=2"]),
    ("dp=4", [BATCH]),
    ("dp=2,tp=2", [BATCH, "parallel.sequence_parallel=true"]),
    # Sublayers recompute their cheap activations: a second all-gather each in backward.
    ("dp=2,tp=2", [BATCH, "parallel.sequence_parallel=true", "parallel.recompute_cheap=true"]),
    ("hsdp=2,dp=2", [BATCH]),
    ("dp=4", [BATCH, "parallel.reshard_after_forward=2"]),
    ("dp=2,tp=2", [BATCH, "parallel.activation_checkpoint=full"]),
    ("hsdp=2,dp=2", [BATCH, "parallel.activation_checkpoint=selective", "parallel.reshard_after_forward=false"]),
    ("dp=2,tp=2", [BATCH, "parallel.activation_checkpoint=op", "parallel.param_dtype=bfloat16"]),
    ("dp=2,tp=2", [BATCH, "training.micro_batches=2", "parallel.reshard_after_forward=2"]),
    ("dp=4", [BATCH, "model.flavor=debug_tied", "parallel.activation_checkpoint=full"]),
    ("dp=2,cp=2", [BATCH]),
    ("cp=2,tp=2", [BATCH, "parallel.sequence_parallel=true", "parallel.activation_checkpoint=full"]),
    ("cp=2,tp=2", [BATCH, "parallel.sequence_parallel=true", "parallel.recompute_cheap=true",
                   "parallel.activation_checkpoint=selective"]),
    # Pipeline parallel: every stage role simulated, point-to-point messages counted.
    ("pp=2,dp=2", [BATCH, "training.micro_batches=2"]),
    ("pp=4", [BATCH, "training.micro_batches=4"]),
    ("pp=2,tp=2", [BATCH, "training.micro_batches=2", "parallel.sequence_parallel=true"]),
    # 6 stages for 4 blocks: the first holds only the embedding, the last only the output.
    ("pp=2,dp=2", [BATCH, "training.micro_batches=2", "parallel.pp_schedule=Interleaved1F1B",
                   "parallel.pp_stages_per_rank=3", "parallel.activation_checkpoint=full"]),
    ("pp=2,cp=2", [BATCH, "training.micro_batches=2"]),  # pp with cp: both roles' attention gathers
]
PEAK_TOLERANCE = 0.10
# The layouts this module checks, on every torch version (`make test-compat` too): one of
# each thing whose memory or collectives lean on torch's internals (ep's all-to-all beside
# cp, tp + SP and pp; experts sharded along their rows; recompute_cheap's second gather;
# integer and no resharding; op-level AC; a looped pipeline and pp beside tp and cp).
# Every layout of LAYOUTS, these included, is held to the same rules (rule_breaks) on the
# pinned torch by the documented `bench/dryrun_validation.py`, which `make test-docs` runs:
# running the others here too would run them twice in .ci/run.
ON_EVERY_VERSION = {"cp=2,dp=2,ep=2 moe", "dp=2,ep=2,tp=2 sequence_parallel=true moe",
                    "pp=2,dp=2,ep=2 micro_batches=2 moe", "dp=4,ep=2 flavor=debug-moe-2 expert_load=2",
                    "dp=2,tp=2 sequence_parallel=true recompute_cheap=true", "dp=4 reshard_after_forward=2",
                    "hsdp=2,dp=2 activation_checkpoint=selective reshard_after_forward=false",
                    "dp=2,tp=2 activation_checkpoint=op param_dtype=bfloat16",
                    "cp=2,tp=2 sequence_parallel=true recompute_cheap=true activation_checkpoint=selective",
                    "pp=2,tp=2 micro_batches=2 sequence_parallel=true",
                    "pp=2,dp=2 micro_batches=2 pp_schedule=Interleaved1F1B pp_stages_per_rank=3 "
                    "activation_checkpoint=full",
                    "pp=2,cp=2 micro_batches=2"}


def layout_id(layout) -> str:
    mesh, overrides = layout
    moe = set(MOE[1:]) <= set(overrides)  # the other MoE flavors show as flavor=...
    return " ".join([mesh, *(o.split(".", 1)[1] for o in overrides if o != BATCH and o not in MOE[1:])]
                    + (["moe"] if moe else []))


def layout_params() -> list:
    assert ON_EVERY_VERSION <= {layout_id(layout) for layout in LAYOUTS}, ON_EVERY_VERSION
    return [pytest.param(index, id=layout_id(layout)) for index, layout in enumerate(LAYOUTS)
            if layout_id(layout) in ON_EVERY_VERSION]


@pytest.fixture(scope="module")
def observations(tmp_path_factory, request):
    """index -> (measured[rank], predicted), for the layouts this session runs."""
    indices = selected(request.session, __name__, "index")
    measured, predicted = measure_and_predict([LAYOUTS[i] for i in indices], tmp_path_factory.mktemp("dryrun"), WORLD)
    return dict(zip(indices, zip(measured, predicted)))


def rule_breaks(measured: dict, predicted: dict) -> list[str]:
    """What breaks the dry run's rules in one layout (measured[rank], the dry run's report):
    parameter, gradient and optimizer bytes equal on every rank, and under pp each rank's
    peak within the tolerance above its role's; rank 0's collectives equal and its peak
    within PEAK_TOLERANCE; each simulated pipeline role's messages equal and its peak
    within it. bench/dryrun_validation.py holds its rows to the same."""
    breaks = []
    # Roles are named by ranks of the first hsdp replica of each pipeline stage; the other
    # replicas hold the same shards.
    spec = parse_mesh(predicted["mesh"]).resolve(WORLD)
    stage_size, replica_size = WORLD // spec.pp, spec.dp * spec.cp * spec.tp
    role_of = {rank: role for role in predicted["roles"] for rank in role["ranks"]}
    if not {0, replica_size - 1} <= set(role_of):
        breaks.append(f"roles cover ranks {sorted(role_of)}, not 0 and {replica_size - 1}")
    for rank, real in measured.items():
        role = role_of.get(rank // stage_size * stage_size + rank % stage_size % replica_size)
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes") if role else ():
            if role[key] != real[key]:
                breaks.append(f"rank {rank} {key}: predicted {role[key]}, measured {real[key]}")
        if spec.pp > 1 and (role is None or real["peak_bytes"] > (1 + PEAK_TOLERANCE) * role["peak_bytes"]):
            breaks.append(f"rank {rank}: no role, or a peak above its role's")
    if predicted["comm"] != measured[0]["comm"]:
        breaks.append(f"rank 0 collectives: predicted {predicted['comm']}, measured {measured[0]['comm']}")
    peak, real_peak = predicted["rank0"]["peak_bytes"], measured[0]["peak_bytes"]
    if abs(peak - real_peak) > PEAK_TOLERANCE * real_peak:
        breaks.append(f"rank 0 peak: predicted {peak} {predicted['rank0']['at_peak']}, "
                      f"measured {real_peak} {measured[0]['at_peak']}")
    for role in (predicted["pipeline"] or {}).get("roles", []):  # each simulated stage role, its own step
        real = measured[role["pp_rank"] * stage_size]
        if role["p2p"] != real["comm"]["pp"]["pipeline"]:
            breaks.append(f"pp rank {role['pp_rank']} messages: predicted {role['p2p']}, "
                          f"measured {real['comm']['pp']['pipeline']}")
        if abs(role["peak_bytes"] - real["peak_bytes"]) > PEAK_TOLERANCE * real["peak_bytes"]:
            breaks.append(f"pp rank {role['pp_rank']} peak: predicted {role['peak_bytes']}, "
                          f"measured {real['peak_bytes']}")
    return breaks


@pytest.mark.distributed
@pytest.mark.compat
@pytest.mark.parametrize("index", layout_params())
def test_dry_run_matches_a_real_run(observations, index):
    measured, predicted = observations[index]
    assert rule_breaks(measured, predicted) == []



@pytest.mark.compat
def test_a_backward_started_from_a_gradient_edge_is_counted_as_backward():
    """From torch 2.15 a pipeline stage starts a micro-batch's backward from its released
    output's GradientEdge, which torch.autograd.backward does not offer to torch-function
    modes: what FSDP does there (its pre-backward all-gathers) is still the backward's."""
    import torch
    from torch.autograd.graph import get_gradient_edge

    from engine.dryrun.record import _Phase

    seen = []
    weight = torch.ones(3, requires_grad=True)
    with _Phase() as phase:
        for from_edge in (True, False):
            hidden = weight * 2
            hidden.register_hook(lambda grad: seen.append(phase.phase))
            output = hidden * 3
            root = get_gradient_edge(output) if from_edge else output
            seen.append(phase.phase)
            torch.autograd.backward([root], grad_tensors=[torch.ones(3)])
        seen.append(phase.phase)
        phase.optimizer()
        seen.append(phase.phase)
    assert seen == ["forward", "backward", "forward", "backward", "forward", "optimizer"]


def received_input_outlives_its_backward() -> bool:
    """Whether a leaf input that requires grad (a pipeline stage's received activations)
    is still alive after its backward and its last reference, under the step's memory
    tracker: one FSDP module, real tensors, a fake world of one rank."""
    import gc
    import weakref

    import torch
    from torch.distributed.fsdp import fully_shard

    from engine.dryrun import torch_internals

    torch_internals.start_fake_world(1, 0)
    model = fully_shard(torch.nn.Linear(8, 8))
    with torch_internals.memory_tracker([model], torch.optim.SGD(model.parameters(), lr=0.1)):
        received = torch.randn(4, 8, requires_grad=True)
        alive = weakref.ref(received)
        model(received).sum().backward()
        del received
        gc.collect()
        return alive() is not None


@pytest.mark.compat
def test_the_memory_tracker_lets_a_received_input_go_after_its_backward():
    """torch's module tracker hooks each module's inputs for their gradients and keeps the
    hooks, and a hook on a leaf holds the tensor (through its gradient accumulator), so
    every micro-batch's received activations stayed to the step's end in an observed
    pipeline step, where a run without the tracker frees them at their backward
    (torch_internals._module_hooks_released_after_use)."""
    assert call_in_own_process("tests.test_dryrun:received_input_outlives_its_backward") is False


def sent_tensor_lives_with_its_work(held: bool) -> list[bool]:
    """Whether a tensor posted as a send through the schedules' `_batch_p2p` (fake world of 2
    ranks) is alive while the caller keeps the Works, and after it drops them; `held`:
    under torch_internals.fake_messages_held_as_real_ones."""
    import gc
    import weakref
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from engine.dryrun import torch_internals

    torch_internals.start_fake_world(2, 0)
    with torch_internals.fake_messages_held_as_real_ones() if held else nullcontext():
        sent = torch.ones(1024)
        alive = weakref.ref(sent)
        works = schedules._batch_p2p([dist.P2POp(dist.isend, sent, 1)])
        del sent
        gc.collect()
        seen = [alive() is not None]
        schedules._wait_batch_p2p(works)
        del works
        gc.collect()
        return seen + [alive() is not None]


@pytest.mark.compat
def test_a_simulated_send_keeps_its_tensor_as_long_as_its_work():
    """A real group's send Work keeps the tensor it sent for as long as the Work lives (gloo),
    and torch's looped schedules before 2.15 keep every send's Work to the step's end;
    the fake group's Works hold nothing, so the dry run left out every gradient a stage
    sent backward (bench/dryrun_validation.py's Interleaved1F1B row: 21.58 MiB predicted,
    21.96 measured; with the Works holding them, 21.96 both)."""
    assert call_in_own_process("tests.test_dryrun:sent_tensor_lives_with_its_work", False) == [False, False]
    assert call_in_own_process("tests.test_dryrun:sent_tensor_lives_with_its_work", True) == [True, False]


@pytest.mark.compat
def test_70b_state_bytes_match_the_analytic_shard():
    """Rank 0 of 70B on hsdp=16,dp=8,tp=8 (1,024 ranks of the fake process group, fake
    tensors): parameters and Adam's two moments are the full fp32 state over the 64-way
    shard, plus FSDP's padding, within 1%."""
    import torch.distributed as dist

    from engine.dryrun import torch_internals
    from engine.dryrun.simulate import _rank_model, held_state
    from launch.run import DEFAULT_CONFIG
    from common.config import load_config

    cfg = load_config(DEFAULT_CONFIG, ["model.flavor=70B", "parallel.reshard_after_forward=8"])
    spec = parse_mesh("hsdp=16,dp=8,tp=8").resolve(1024)
    try:
        model, _ = _rank_model(cfg, spec, 1024, 0)
        full = sum(p.numel() for p in model.parameters()) * 4
        with torch_internals.fake_tensor_mode():
            model.to_empty(device="cpu")
            params, optim = held_state(model, cfg)
    finally:
        dist.destroy_process_group()
    assert full == 70_553_706_496 * 4
    assert abs(params / (full / 64) - 1) < 0.01, params
    assert abs(optim / (2 * full / 64) - 1) < 0.01, optim


def test_dry_run_command_prints_the_report_and_writes_json(tmp_path):
    """Also for a config written for GPUs (device cuda, backend nccl), on a machine that may have none."""
    report = tmp_path / "report.json"
    result = launcher("--dry-run", "--world", "8", "--set", f"dryrun.report={report}",
                      "--set", "parallel.activation_checkpoint=full", "--set", "parallel.device=cuda",
                      "--set", "parallel.backend=nccl")
    assert result.returncode == 0, result.stderr[-3000:]
    for line in ("8 simulated ranks", "memory per rank", "communication per step", "tokens/s, MFU"):
        assert line in result.stdout, result.stdout
    data = json.loads(report.read_text())
    assert data["version"] == 1 and data["world_size"] == 8 and data["mesh"] == "dp=4,tp=2"
    assert {"param_bytes", "grad_bytes", "optimizer_bytes", "peak_bytes", "ranks"} <= set(data["roles"][0])
    assert {"compute_s", "comm_s", "step_s", "tokens_per_s", "mfu"} <= set(data["step"])
    assert data["comm"]["tp"]["forward"]["all_reduce"]["count"] > 0


@pytest.mark.parametrize("args, expected", [
    (["--world", "6"], "needs 8 ranks but the world size is 6"),
    (["--world", "0"], "at least 1"),
    (["--parity"], "does not combine with --parity"),
    (["--set", "dryrun.device=custom"], "needs dryrun.peak_tflops"),
    (["--set", "dryrun.device=TPU"], "dryrun.device"),
    # The files it writes, checked before the simulation (the launcher runs in the repository).
    (["--trace", "."], "--trace '.' is a folder; give a file to write"),
    (["--set", "dryrun.report=."], "dryrun.report '.' is a folder"),
    (["--set", "dryrun.report=README.md/report.json"], "'README.md' is a file, so no folder can be made in it"),
])
def test_dry_run_bad_input_is_one_paragraph(args, expected):
    result = launcher("--dry-run", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def combination_reports(tmp_path_factory, request):
    """`launch/run.py --dry-run` of the combination matrix's rows this session tests, two at
    a time."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.combinations import ROWS, mesh_of, overrides
    from tests.distributed import selected

    out = tmp_path_factory.mktemp("dryrun-rows")
    hf_root = tmp_path_factory.mktemp("dryrun-hf-folders")

    # Written here, one after another: importing transformers from two threads at once
    # leaves one of them a half-initialised module.
    indices = selected(request.session, __name__, "index")
    row_overrides = {index: overrides(ROWS[index], hf_root) for index in indices}

    def run(index):
        report = out / f"row-{index}.json"
        result = launcher("--dry-run", "--mesh", mesh_of(ROWS[index]), "--set", f"dryrun.report={report}",
                          *(arg for value in row_overrides[index] for arg in ("--set", value)))
        return result, json.loads(report.read_text()) if report.exists() else None

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(indices, pool.map(run, indices)))


def _row_count() -> int:
    from tests.combinations import ROWS
    return len(ROWS)


@pytest.mark.matrix
@pytest.mark.parametrize("index", range(_row_count()))
def test_dry_run_of_every_combination_row(combination_reports, index):
    """Every setting the engine has, with every other (tests/combinations.py), simulates.
    The pinned torch only: on the other versions the compat subset checks the dry run
    against real runs (test_dry_run_matches_a_real_run), and these 9 rows a version were
    what `.ci/run` could least afford on a machine 1.6 times slower (2026-11-29)."""
    from tests.combinations import ROWS, ZERO_BUBBLE

    row = ROWS[index]
    result, report = combination_reports[index]
    if row["pipeline"] in ZERO_BUBBLE:  # its split backward defeats torch's memory tracker: refused
        assert result.returncode == 2 and "cannot simulate" in result.stderr, result.stderr[-3000:]
        return
    assert result.returncode == 0 and report is not None, result.stderr[-3000:]
    assert report["rank0"]["peak_bytes"] > report["rank0"]["param_bytes"] > 0
    spec = parse_mesh(report["mesh"])
    fsdp = "dp_cp" if row["context_parallel"] else "dp"  # FSDP shards over dp x cp
    if spec.shard_size > 1:  # pipeline rows at pp=2,hsdp=2 and pp=2,tp=2 shard over no rank
        assert report["comm"][fsdp]["forward"]["all_gather"]["count"] > 0
    assert ("tp" in report["comm"]) == ("tp" in report["mesh"])
    # A split whose first stage holds only the embedding leaves rank 0 no attention to gather
    # for, and no experts to send rows to.
    attends = not report.get("pipeline") or report["pipeline"]["roles"][0]["blocks"] > 0
    assert ("ep" in report["comm"]) == (row["experts"] == "moe-ep" and attends)
    if "ep" in report["comm"]:
        assert report["comm"]["ep"]["forward"]["all_to_all"]["count"] > 0
    assert ("cp" in report["comm"]) == (row["context_parallel"] and attends)
    assert ("pp" in report["comm"]) == (row["pipeline"] != "off")
    if row["pipeline"] != "off":
        assert report["pipeline"]["roles"][0]["p2p"]["send"]["count"] > 0
    assert any("compile" in note for note in report["notes"]) == row["compile"]
    assert any("offload" in note for note in report["notes"]) == row["offload"]
    assert report["step"]["step_s"] > 0


EXTRAPOLATED = [  # ranks of the fake process group, as many as each mesh names
    ("dp=8", ["model.flavor=100M", "training.seq_len=32"]),
    ("dp=4,tp=2", ["model.flavor=100M", "training.seq_len=32", "parallel.sequence_parallel=true",
                   "parallel.activation_checkpoint=selective"]),
    ("hsdp=2,dp=4", ["model.flavor=100M", "training.seq_len=32", "parallel.reshard_after_forward=2",
                     "parallel.activation_checkpoint=full", "training.micro_batches=2"]),
    # Pipelines: each stage role combined from short pipelines (fewer ranks in the pipeline,
    # fewer micro-batches). Here 6 blocks per stage, from 2 and 3 blocks per stage.
    ("pp=2,dp=4", ["model.flavor=100M", "training.seq_len=32", "training.global_batch=32",
                   "training.micro_batches=8"]),
    # 1F1B over 8 ranks, 16 micro-batches: every role from pipelines of 3 to 5 ranks; then 8,
    # where the first stage runs every forward before its first backward, gathered blocks kept.
    ("pp=8,dp=2", ["model.flavor=100M", "training.seq_len=32", "training.global_batch=32",
                   "training.micro_batches=16"]),
    ("pp=8,dp=2", ["model.flavor=100M", "training.seq_len=32", "training.global_batch=16",
                   "training.micro_batches=8", "parallel.activation_checkpoint=op",
                   "parallel.reshard_after_forward=false"]),
    # Interleaved, 8 stages over 4 ranks, 2 rounds of 4 micro-batches, blocks resharded after
    # each forward (the collectives of a stage's forwards and backwards then depend on their
    # order), tp with sequence and loss parallelism, full AC. Rank 0's stages of 5 and 4
    # blocks, from 2 and 3 blocks in each stage in turn. Two sequences a micro-batch: torch
    # 2.11's schedule refuses a sequence-parallel stage output of one (a stride mismatch).
    ("pp=4,dp=2,tp=2", ["model.flavor=1B", "training.seq_len=32", "training.global_batch=32",
                        "training.micro_batches=8", "parallel.pp_schedule=Interleaved1F1B",
                        "parallel.pp_stages_per_rank=2", "parallel.pp_split=5,1,1,1,4,1,1,2",
                        "parallel.sequence_parallel=true", "parallel.loss_parallel=true",
                        "parallel.activation_checkpoint=full"]),
    # About one block per stage, as the search's most looped schedule has it: 10 stages over
    # 8 blocks, the first holding only the embedding, the last only the output layer.
    ("pp=2,dp=2", ["model.flavor=debug-deep", "training.seq_len=32", "training.global_batch=8",
                   "training.micro_batches=4", "parallel.pp_schedule=Interleaved1F1B",
                   "parallel.pp_stages_per_rank=5"]),
    # A mixture of experts whose first 2 blocks are dense (DeepSeek-V3's pattern): without pp
    # from 5 and 6 blocks (the dense ones and 3 or 4 of experts); under pp each short pipeline
    # keeps the dense blocks where the layout's stages have them: in the first stage's role
    # only (1F1B, the middle role's short pipelines all experts), and one in each rank's
    # second-held stage or first (about one block per stage).
    ("dp=4,ep=2", ["model.name=llama_moe", "model.flavor=debug-moe-deep-dense", "training.seq_len=32"]),
    ("pp=4,dp=2,ep=2", ["model.name=llama_moe", "model.flavor=debug-moe-deep-dense", "training.seq_len=32",
                        "training.global_batch=16", "training.micro_batches=8"]),
    ("pp=2,dp=2,ep=2", ["model.name=llama_moe", "model.flavor=debug-moe-deep-dense", "training.seq_len=32",
                        "training.global_batch=8", "training.micro_batches=4", "parallel.pp_schedule=Interleaved1F1B",
                        "parallel.pp_stages_per_rank=5"]),
]


@pytest.mark.slow
def test_plan_for_extrapolation_matches_a_full_depth_simulation(tmp_path):
    """--plan-for simulates two shallow depths and extrapolates (engine/dryrun/search.py):
    state bytes and collectives must come out exactly as at full depth, the peak within
    the 10% that the dry run itself is held to against real runs. The pinned torch only:
    the extrapolation is arithmetic over simulations whose torch internals the compat
    subset's dry-run tests check on every version, and at 98 s a version (160 s on a
    slower machine) it pushed `.ci/run` past 90 minutes there."""
    from tests.distributed import cpu_env
    from tests.dryrun_worker import REPO

    layouts = tmp_path / "layouts.json"
    layouts.write_text(json.dumps(EXTRAPOLATED))
    # The timeout only guards against a hang: on a loaded 2-core machine the 11 layouts
    # took more than 600 s (2026-12-03; 659 s beside the main suite on 2026-12-07).
    result = subprocess.run([sys.executable, str(REPO / "tests" / "dryrun_worker.py"), "extrapolation",
                             str(layouts), str(tmp_path)], cwd=REPO, env=cpu_env(), capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    for index in range(len(EXTRAPOLATED)):
        for role, pair in enumerate(json.loads((tmp_path / f"extrapolated-{index}.json").read_text())):
            full, guess = pair["full"], pair["extrapolated"]
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "comm"):
                assert guess[key] == full[key], (index, role, key)
            assert abs(guess["peak_bytes"] / full["peak_bytes"] - 1) <= PEAK_TOLERANCE, (
                index, role, guess["phase_peaks"], full["phase_peaks"])


@pytest.mark.slow
def test_plan_for_ranks_layouts_and_its_best_command_trains(tmp_path):
    report = tmp_path / "plan.json"
    result = launcher("--plan-for", "--world", "4", "--set", "training.seq_len=64", "--set", "training.global_batch=8",
                      "--set", "dryrun.gpu_memory_gib=0.025", "--set", f"dryrun.report={report}")
    assert result.returncode == 0, result.stderr[-3000:]
    # No torch warning in the output, the spawned workers' included (FSDP's of a view from
    # the root: parallel/apply.py silences it where each process shards the root).
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["complete"] is True
    fits = [layout for layout in data["layouts"] if layout["fits"]]
    dropped = [layout for layout in data["layouts"] if not layout["fits"] and layout["simulated"]]
    skipped = [layout for layout in data["layouts"] if not layout["simulated"]]
    assert fits and dropped and skipped, result.stdout  # 23 MiB for tensors: some layouts fit, some do not
    speeds = [layout["step"]["tokens_per_s"] for layout in fits]
    assert speeds == sorted(speeds, reverse=True)
    assert all(layout["peak_bytes"] <= 0.9 * 0.025 * 1024 ** 3 for layout in fits)
    assert all("usable" in layout["reason"] and layout["peak_bytes"] > 0.9 * 0.025 * 1024 ** 3 for layout in dropped)
    check_left_out_reshard_settings(data["layouts"], tmp_path)
    # The default searches meshes in 2 processes here (2 cores); one process finds the same.
    alone = tmp_path / "alone.json"
    result_alone = launcher("--plan-for", "--world", "4", "--set", "training.seq_len=64", "--set",
                            "training.global_batch=8", "--set", "dryrun.gpu_memory_gib=0.025", "--set",
                            "dryrun.search_workers=1", "--set", f"dryrun.report={alone}")
    assert result_alone.returncode == 0, result_alone.stderr[-3000:]
    assert json.loads(alone.read_text())["layouts"] == data["layouts"]
    best = next(line for line in result.stdout.splitlines() if line.strip().startswith("python launch/run.py"))
    args = shlex.split(best.strip())[2:]
    trained = launcher(*args, "--set", "training.steps=1", "--set", f"run.dir={tmp_path / 'run'}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: 1 steps" in trained.stdout


def check_left_out_reshard_settings(layouts: list[dict], tmp_path) -> None:
    """A reshard setting left out (search_job) is no faster than the earlier one that fit
    with FSDP's collectives hidden: both simulated by --dry-run, with pp and without. One
    that fit with them exposed keeps its later settings, and there keeping more gathered
    was faster."""
    def setting(layout) -> tuple:
        return layout["mesh"], tuple(o for o in layout["overrides"] if "reshard_after_forward" not in o)

    fit_of = {setting(layout): layout for layout in layouts if layout["fits"]}
    exposed = [layout for layout in layouts if layout["fits"]
               and layout["step"]["overlapped_s"] > layout["step"]["compute_s"]]
    assert any(later["step"]["tokens_per_s"] > layout["step"]["tokens_per_s"] for layout in exposed
               for later in layouts if later is not layout and later["fits"] and setting(later) == setting(layout))
    skipped = [layout for layout in layouts if not layout["simulated"]]
    for left_out in [next(l for l in skipped if "pp=" in l["mesh"]), next(l for l in skipped if "pp=" not in l["mesh"])]:
        fit = fit_of[setting(left_out)]
        assert fit["step"]["overlapped_s"] <= fit["step"]["compute_s"]
        speeds = []
        for name, layout in (("fit", fit), ("left-out", left_out)):
            report = tmp_path / f"{name}.json"
            result = launcher("--dry-run", "--world", "4", "--mesh", layout["mesh"], "--set", "training.seq_len=64",
                              "--set", "training.global_batch=8", "--set", f"dryrun.report={report}",
                              *(arg for value in layout["overrides"] for arg in ("--set", value)))
            assert result.returncode == 0, result.stderr[-3000:]
            speeds.append(json.loads(report.read_text())["step"]["tokens_per_s"])
        assert speeds[1] <= speeds[0], (left_out, speeds)


@pytest.mark.slow
def test_plan_for_searches_context_parallel_for_long_sequences(tmp_path):
    """At 16,384 tokens, cp=2 leaves each rank 8,192 (engine/dryrun/search.py: CP_MIN_TOKENS),
    cp=4 would leave 4,096: the search offers the first and not the second, and ranks the
    cp layouts with the others."""
    report = tmp_path / "plan.json"
    result = launcher("--plan-for", "--world", "4", "--set", "model.flavor=debug-32K", "--set", "training.seq_len=16384",
                      "--set", "training.global_batch=2", "--set", f"dryrun.report={report}")
    assert result.returncode == 0, result.stderr[-3000:]
    meshes = [layout["mesh"] for layout in json.loads(report.read_text())["layouts"]]
    assert any("cp=2" in mesh for mesh in meshes) and not any("cp=4" in mesh for mesh in meshes), meshes
    assert any("cp=" not in mesh for mesh in meshes), meshes


GPT2 = ["--set", "model.plugin=examples.gpt2_plan", "--set", "model.name=gpt2", "--set", "model.flavor=debug",
        "--set", "parallel.plan=gpt2"]


@pytest.mark.slow
def test_plan_for_a_model_added_through_the_plan_api(tmp_path):
    """GPT-2 from examples/gpt2_plan.py, whose plan has no sequence-parallel variant: the
    search loads the plugin, offers tensor parallel without SP, and its best command trains."""
    report = tmp_path / "plan.json"
    result = launcher("--plan-for", "--world", "4", *GPT2, "--set", "training.global_batch=8",
                      "--set", "dryrun.gpu_memory_gib=1", "--set", f"dryrun.report={report}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    layouts = json.loads(report.read_text())["layouts"]
    with_tp = [layout for layout in layouts if "tp=" in layout["mesh"]]
    assert with_tp and all("parallel.sequence_parallel=false" in layout["overrides"] for layout in with_tp)
    best = next(line for line in result.stdout.splitlines() if line.strip().startswith("python launch/run.py"))
    trained = launcher(*shlex.split(best.strip())[2:], "--set", "training.steps=1", "--set", f"run.dir={tmp_path / 'run'}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: 1 steps" in trained.stdout


@pytest.mark.parametrize("args, expected", [
    (["--plan-for", "--world", "4", "--set", "model.plugin=examples.plain_model", "--set", "model.name=plain",
      "--set", "model.flavor=tiny", "--set", "parallel.plan=plain"], "needs a model whose args are a dataclass"),
    (["--plan-for"], "--world N"),
    (["--plan-for", "--world", "8", "--mesh", "dp=8"], "no --mesh"),
    (["--plan-for", "--dry-run", "--world", "8"], "does not combine"),
    (["--plan-for", "--world", "8", "--set", "dryrun.report=."], "dryrun.report '.' is a folder"),
    (["--plan-for", "--world", "8", "--set", "dryrun.pp=3"], "dryrun.pp=3: no pipeline size of it fits 8 ranks"),
    (["--plan-for", "--world", "8", "--set", "dryrun.ep=2"], "llama/debug has no experts that its plan names"),
    (["--plan-for", "--world", "8", "--set", "dryrun.ep=16", "--set", "model.name=llama_moe", "--set",
      "model.flavor=debug-moe", "--set", "parallel.plan=llama_moe"], "dryrun.ep=16: no degree of it fits 8 ranks"),
])
def test_plan_for_bad_input_is_one_paragraph(args, expected):
    result = launcher(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow  # a --plan-for search, twice as long as the main suite's other tests of it
@pytest.mark.parametrize("stop", ["SIGINT to the group", "SIGKILL to a worker"])
def test_a_stopped_search_keeps_the_layouts_it_found(tmp_path, stop):
    """Ctrl-C in a long --plan-for, which a terminal sends to the launcher and its search
    workers alike: the report holds each layout simulated so far, ranked, marked
    incomplete, and the launcher says so and exits 130, with nothing on stderr (no
    worker's traceback, no leaked semaphores). A worker killed alone (out of memory) ends
    the search with exit 2 and the same report; multiprocessing.Pool, which the search
    used before common/workers.py, waited for its lost job for good."""
    import os
    import signal

    from tests.distributed import cpu_env
    from tests.dryrun_worker import REPO

    report = tmp_path / "plan.json"
    # SIGINT as a terminal leaves it: a job that a shell starts in the background (as .ci/run
    # starts the suite) inherits it ignored, and Python then installs no KeyboardInterrupt
    # handler, so the search would run on to its end.
    search = subprocess.Popen([sys.executable, str(REPO / "launch" / "run.py"), "--plan-for", "--world", "4", "--set",
                               "training.seq_len=64", "--set", "training.global_batch=16", "--set",
                               "dryrun.gpu_memory_gib=0.025", "--set", "dryrun.search_workers=2", "--set",
                               f"dryrun.report={report}"], cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        shown = []
        for line in search.stdout:  # a layout's first line, printed once the report holds it
            shown.append(line)
            if line.startswith(("  fits ", "  drop ", "  skip ")):
                break
        found = json.loads(report.read_text())
        if stop == "SIGINT to the group":
            os.killpg(search.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        else:
            workers = subprocess.run(["pgrep", "-P", str(search.pid), "-f", "spawn_main"], capture_output=True,
                                     text=True).stdout.split()
            assert len(workers) == 2, workers
            os.kill(int(workers[0]), signal.SIGKILL)
        out, err = search.communicate(timeout=120)
    finally:
        search.kill()
    kept = json.loads(report.read_text())  # with any found before the signal arrived
    assert found["complete"] is False and found["layouts"], found
    assert kept["complete"] is False and all(layout in kept["layouts"] for layout in found["layouts"]), kept
    if stop == "SIGINT to the group":
        assert search.returncode == 130, "".join(shown) + out + err[-3000:]
        assert "interrupted after" in out and f"they are in {report}" in out, out
        assert err == "", err[-3000:]
    else:
        assert search.returncode == 2, "".join(shown) + out + err[-3000:]
        assert err.startswith("error: the search stopped after ") and err.count("\n") == 1, err[-3000:]
        assert f"they are in {report}" in err and "killed by signal 9" in err and "dryrun.search_workers" in err, err


def test_a_report_that_cannot_be_written_at_the_end_is_one_paragraph():
    """What the up-front check of an output file cannot foresee (a full disk, a file system
    that refuses the file) is the user's to fix too."""
    from common.errors import UserError
    from launch.run import write_output

    def refused(path):
        raise OSError(28, "No space left on device", path)

    with pytest.raises(UserError, match=r"dryrun.report 'r.json' could not be written \(No space left on device\)"):
        write_output(refused, "r.json", "dryrun.report")


@pytest.mark.compat
@pytest.mark.parametrize("measuring", [False, True])
def test_the_torch_internals_the_dry_run_uses_are_checked_up_front(monkeypatch, measuring):
    """This torch has every private name the dry run (and its measured side) uses; one it
    lacked would be named before anything runs."""
    from engine.dryrun import torch_internals
    from common.errors import UserError

    torch_internals.check_supported(measuring)
    table = "MEASURING" if measuring else "NEEDED"
    monkeypatch.setattr(torch_internals, table, (*getattr(torch_internals, table), ("torch", "no_such_name")))
    with pytest.raises(UserError, match="needs torch.no_such_name"):
        torch_internals.check_supported(measuring)


STATE_BOUND_LAYOUTS = [  # (mesh, config overrides) on 8 fake ranks, each at its model's full depth
    ("dp=8", []),
    ("dp=2,tp=4", ["parallel.sequence_parallel=true", "parallel.loss_parallel=true"]),
    ("hsdp=2,dp=2,ep=2,tp=2", ["model.name=llama_moe", "model.flavor=debug-moe-deep-dense",
                               "parallel.plan=llama_moe", "parallel.sequence_parallel=true"]),
]


def state_bound_against_the_step() -> list[list[int]]:
    """For each of STATE_BOUND_LAYOUTS: search.state_bytes (built, not stepped, at one and
    two blocks after the leading ones), and the step that observe simulates at two other
    depths, extrapolated: its parameter and optimizer bytes, and its peak."""
    from common.config import load_config
    from engine.dryrun.search import Layout, layout_config, observe, state_bytes
    from launch.run import DEFAULT_CONFIG, plan_depth
    from parallel.mesh import parse_mesh

    found = []
    for mesh, overrides in STATE_BOUND_LAYOUTS:
        cfg = load_config(DEFAULT_CONFIG, [*overrides, "training.global_batch=8", "training.seq_len=64"])
        layout, depth = Layout(parse_mesh(mesh).resolve(8), "true", "none", 1), plan_depth(cfg)
        step = observe(layout_config(cfg, layout), layout, 8, depth)
        found.append([state_bytes(cfg, layout, 8, depth), step.param_bytes + step.optimizer_bytes, step.peak_bytes])
    return found


def test_the_search_bounds_a_mesh_by_its_state_before_simulating_a_step():
    """The state bound that lets --plan-for drop a mesh unsimulated (search_job) is the
    parameter and optimizer bytes its step holds, to the byte, for plain FSDP, tp with
    sequence parallelism, and experts with ep and dense leading blocks under HSDP; and
    it is below each step's peak (fake process group, in a process of its own)."""
    found = call_in_own_process("tests.test_dryrun:state_bound_against_the_step")
    assert len(found) == len(STATE_BOUND_LAYOUTS), found
    for (mesh, _), (bound, state, peak) in zip(STATE_BOUND_LAYOUTS, found):
        assert bound == state, (mesh, bound, state)
        assert state < peak, (mesh, state, peak)


def collectives_after_other_layouts(mesh: str, earlier: list[str]) -> dict:
    """Rank 0's collectives in a step of the debug mixture of experts at `mesh` (8 fake
    ranks), observed as --plan-for observes it: in one fake world, after the state bound
    of it and of each of `earlier` (meshes built, no step recorded) and a step of each of
    `earlier`, whose cached sharding decisions it then reuses. With no `earlier`, alone."""
    from common.config import load_config
    from engine.dryrun.search import Layout, layout_config, observe, state_bytes
    from launch.run import DEFAULT_CONFIG, plan_depth
    from parallel.mesh import parse_mesh

    cfg = load_config(DEFAULT_CONFIG, ["model.name=llama_moe", "model.flavor=debug-moe-deep-dense",
                                       "parallel.plan=llama_moe", "training.global_batch=8", "training.seq_len=64"])
    depth = plan_depth(cfg)
    layout, *others = (Layout(parse_mesh(text).resolve(8), "true", "none", 1) for text in (mesh, *earlier))
    if others:
        state_bytes(cfg, layout, 8, depth)
    for other in others:
        state_bytes(cfg, other, 8, depth)
        observe(layout_config(cfg, other), other, 8, depth)
    return observe(layout_config(cfg, layout), layout, 8, depth).comm


@pytest.mark.compat  # DTensor's cache and mesh equality are torch's, and change between versions
@pytest.mark.parametrize("mesh, earlier, named", [
    # The experts' all-reduces run on the earlier layout's equal mesh: without
    # record.groups_named_in_this_world they were named "group of 2".
    ("hsdp=2,dp=4,ep=2", "hsdp=2,dp=4", "edp"),
    # dp=8's FSDP runs on the default group, which ep=8 named ep before: a name kept for a
    # group the layout holds labelled dp=8's all-gathers ep.
    ("dp=8", "dp=8,ep=8", "dp"),
], ids=["an-equal-mesh-earlier", "the-world-named-ep-earlier"])
def test_a_layout_simulated_after_others_in_one_world_names_the_same_collectives(mesh, earlier, named):
    """--plan-for keeps DTensor's sharding decisions from one layout to the next in a fake
    world (simulate.enter_fake_world), and they hold the earlier layouts' meshes: the
    collectives must still be named by this layout's dimensions, as in a world of their
    own. Each side in a process of its own (fake process groups)."""
    alone, after = (call_in_own_process("tests.test_dryrun:collectives_after_other_layouts", mesh, others)
                    for others in ([], [earlier]))
    assert named in alone, alone
    assert after == alone


def test_plan_for_ends_a_mesh_whose_state_alone_does_not_fit(tmp_path):
    """--plan-for on 4 ranks, 2 to a node, with 19 MB usable: hsdp=2,dp=2, which keeps the
    debug model's parameters and Adam state sharded over 2 ranks only (19.7 MB of them),
    ends on its state, one outcome and no step simulated; dp=2,tp=2 (9.9 MB of state) is
    simulated and fits (search_job's bound, end to end)."""
    report, usable = tmp_path / "plan.json", 19e6
    result = launcher("--plan-for", "--world", "4", "--set", "dryrun.pp=1", "--set", "dryrun.gpus_per_node=2",
                      "--set", f"dryrun.gpu_memory_gib={usable / 0.9 / 2 ** 30}", "--set", "training.global_batch=4",
                      "--set", "training.seq_len=16", "--set", f"dryrun.report={report}")
    assert result.returncode == 0, result.stderr[-3000:]
    by_mesh = {}
    for layout in json.loads(report.read_text())["layouts"]:
        by_mesh.setdefault(layout["mesh"], []).append(layout)
    ended = {mesh: rows for mesh, rows in by_mesh.items() if "state alone" in (rows[0]["reason"] or "")}
    assert list(ended) == ["hsdp=2,dp=2"], by_mesh
    (row,) = ended["hsdp=2,dp=2"]
    assert not row["fits"] and row["peak_bytes"] > usable, row
    assert any(layout["fits"] and layout["simulated"] for layout in by_mesh["dp=2,tp=2"]), by_mesh


def test_plan_for_goes_on_past_a_layout_that_raises(tmp_path):
    """A layout whose simulation raises (2026-12-07: FSDP refused DeepSeek's experts at
    dp=2048 after 99 minutes of search, and the error ended the search): --plan-for reports
    it as "fail" with the error, leaves its mesh at the second layout with that error,
    searches the other meshes, writes them all to the report and exits 1. Here, in a
    search of 4 fake ranks in a process of its own, every layout of dp=4 (the first mesh
    searched) raises, and tp=4 (the last) raises where its state is counted, before any
    layout (search_job's bound)."""
    report = tmp_path / "plan.json"
    found = call_in_own_process("tests.test_dryrun:search_where_some_meshes_raise", str(report))
    assert found["code"] == 1, found["stdout"][-3000:]
    layouts = json.loads(report.read_text())["layouts"]
    failed = {}
    for layout in layouts:
        if layout["error"]:
            assert not layout["fits"], layout
            failed.setdefault(layout["mesh"], []).append((layout["error"], layout["reason"]))
    assert failed == {"dp=4": [("NotImplementedError: a bug met in a step at dp=4", "could not be simulated")] * 2,
                      "tp=4": [("NotImplementedError: a bug met in the state at tp=4",
                                "no layout of this mesh could be simulated")]}, failed
    assert any(layout["fits"] and layout["mesh"] == "dp=2,tp=2" for layout in layouts), layouts
    assert found["stdout"].count("  fail  --mesh dp=4") == 2, found["stdout"][-3000:]
    assert "3 layout(s) raised an error when simulated" in found["stdout"], found["stdout"][-3000:]


def search_where_some_meshes_raise(report: str) -> dict:
    import contextlib
    import io

    from engine.dryrun import search
    from launch.run import main

    simulate, count_state = search.evaluate_layout, search.state_bytes

    def raising_at_dp4(cfg, layout, *args, **kwargs):
        if str(layout.spec) == "dp=4":
            raise NotImplementedError("a bug met in a step at dp=4")
        return simulate(cfg, layout, *args, **kwargs)

    def raising_at_tp4(cfg, layout, *args, **kwargs):
        if str(layout.spec) == "tp=4":
            raise NotImplementedError("a bug met in the state at tp=4")
        return count_state(cfg, layout, *args, **kwargs)

    search.evaluate_layout, search.state_bytes = raising_at_dp4, raising_at_tp4
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--plan-for", "--world", "4", "--set", "training.seq_len=64", "--set", "training.global_batch=8",
                     "--set", "dryrun.gpu_memory_gib=0.05", "--set", "dryrun.pp=1", "--set",
                     "dryrun.search_workers=1", "--set", f"dryrun.report={report}"])
    return {"code": code, "stdout": printed.getvalue()}


RECOMPUTE_MESHES = ["dp=4", "pp=2,dp=2"]  # the debug model's 4 blocks: one part of 4, or 2 stages of 2


def recompute_costs() -> dict:
    """For each of RECOMPUTE_MESHES and AC mode: the dry run's (simulate's) compute seconds
    and FLOPs per token of each stage role, and with selective AC the compute seconds of
    the search's estimate of the same layout (its slowest role's)."""
    from common.config import load_config
    from engine.dryrun.estimate import device_profile
    from engine.dryrun.search import Layout, evaluate_layout
    from engine.dryrun.simulate import simulate
    from launch.run import DEFAULT_CONFIG

    found = {}
    for mesh in RECOMPUTE_MESHES:
        spec = parse_mesh(mesh).resolve(4)
        for mode in ("none", "selective", "full", "op"):
            cfg = load_config(DEFAULT_CONFIG, [f"parallel.mesh={mesh}", f"parallel.activation_checkpoint={mode}",
                                               "training.micro_batches=2"])
            result = simulate(cfg, spec, 4)
            roles = result.stage_roles or [None]
            found[f"{mesh} {mode}"] = [[role.estimate.compute_s, role.flops_per_token] if role else
                                       [result.estimate.compute_s, result.flops_per_token] for role in roles]
            if mode == "selective":
                layout = Layout(spec, "true", mode, 2, schedule=cfg.parallel.pp_schedule)
                outcome = evaluate_layout(cfg, layout, 4, 4, result.flops_per_token, device_profile(cfg.dryrun),
                                          usable=2 ** 40)
                found[f"{mesh} search"] = outcome.estimate.compute_s
    return found


def simulated_error_for_a_batch_smaller_than_the_data_ranks() -> str:
    from common.config import load_config
    from common.errors import UserError
    from engine.dryrun.simulate import simulate
    from launch.run import DEFAULT_CONFIG

    cfg = load_config(DEFAULT_CONFIG, ["parallel.mesh=dp=4", "training.global_batch=2"])
    try:
        simulate(cfg, parse_mesh("dp=4").resolve(4), 4)
    except UserError as err:
        return str(err)
    return "no error"


def test_a_simulated_step_refuses_a_batch_that_does_not_divide_over_the_data_ranks():
    """The launcher refuses such a batch; simulate's other callers (the search, the tests'
    workers) get the real step's error, not a step observed on 0 rows per rank (fake
    process group, in a process of its own)."""
    error = call_in_own_process("tests.test_dryrun:simulated_error_for_a_batch_smaller_than_the_data_ranks")
    assert error == ("training.global_batch=2 does not divide over 4 data-parallel ranks (hsdp x dp). "
                     "Use a multiple of 4.")


def test_full_and_selective_ac_cost_the_forward_of_the_blocks_they_checkpoint():
    """The step model adds a third of a block's training FLOPs for each block whose forward
    activation checkpointing runs again: all of a rank's blocks with `full`, every
    checkpoint_every-th (2) of each stage with `selective`, none with `op` (counted free);
    the dry run and the search agree (fake process group, in a process of its own)."""
    from models import build_on_meta
    found = call_in_own_process("tests.test_dryrun:recompute_costs")
    block = build_on_meta("llama", "debug").layers["0"]
    block_flops = 6 * sum(p.numel() for p in block.parameters()) + 12 * block.attention.wq.in_features * 64
    for mesh in RECOMPUTE_MESHES:
        blocks = 4 // parse_mesh(mesh).pp  # on each stage role
        for mode, checkpointed in (("op", 0), ("selective", blocks // 2), ("full", blocks)):
            for (plain, flops), (compute, _) in zip(found[f"{mesh} none"], found[f"{mesh} {mode}"]):
                assert compute / plain == pytest.approx(1 + checkpointed * block_flops / (3 * flops), rel=1e-12), (
                    mesh, mode)
        slowest = max(compute for compute, _ in found[f"{mesh} selective"])
        assert found[f"{mesh} search"] == pytest.approx(slowest, rel=1e-12), mesh


def test_the_search_leaves_out_only_layouts_that_need_more_memory_than_one_that_did_not_fit():
    """first_fit with reshard settings least memory first (no process group: a made-up
    peak that grows as reshard keeps more gathered and AC saves more): every ladder's first
    fit is the one simulating every layout finds, and with fewer simulations: none twice,
    and none whose AC mode and micro-batch count did not fit with an earlier reshard setting."""
    from engine.dryrun.search import Outcome, first_fit, ladders, memory_key, reshard_options
    from parallel.mesh import MeshSpec

    spec = MeshSpec(dp=16, tp=2)
    kept = {"true": 0, "4": 1, "false": 2}
    saved = {("full", False): 2, ("selective", False): 4, ("op", False): 6, ("none", True): 5, ("none", False): 8}

    def peak(layout) -> int:  # activations fall with more micro-batches, gathered state rises
        ac = (layout.activation_checkpoint, layout.recompute_cheap)
        return 5 * saved[ac] // layout.micro_batches + 3 * kept[layout.reshard]

    for usable in range(4, 52):
        simulated, did_not_fit = [], set()

        def evaluate(layout):
            assert layout not in simulated and memory_key(layout) not in did_not_fit, (usable, layout)
            simulated.append(layout)
            fits = peak(layout) <= usable
            if not fits:
                did_not_fit.add(memory_key(layout))
            return Outcome(layout, peak(layout), object() if fits else None)

        beyond, searched, every = {}, [], []
        assert reshard_options(spec, 8) == ["true", "4", "false"]
        for reshard in reshard_options(spec, 8):
            for ladder in ladders(spec, reshard, True, 8):
                searched += [o.layout for o in first_fit(ladder, evaluate, beyond) if o.estimate is not None]
                every += [next((layout for layout in ladder if peak(layout) <= usable), None)]
        assert searched == [layout for layout in every if layout is not None], usable
        assert len(simulated) < 3 * len(ladder), usable


def test_the_search_tries_about_one_block_per_stage_up_to_8_stages_per_rank():
    from common.config import load_config
    from engine.dryrun.search import pipeline_schedules
    from launch.run import DEFAULT_CONFIG

    cfg = load_config(DEFAULT_CONFIG)
    two = [("1F1B", 1), ("Interleaved1F1B", 2)]
    assert pipeline_schedules(cfg, 16, 126) == [*two, ("Interleaved1F1B", 8)]  # 128 stages, as Llama 3 405B
    assert pipeline_schedules(cfg, 2, 126) == [*two, ("Interleaved1F1B", 8)]
    assert pipeline_schedules(cfg, 2, 4) == [*two, ("Interleaved1F1B", 3)]  # 0,1,1,1,1,0
    assert pipeline_schedules(cfg, 4, 4) == two
    assert pipeline_schedules(cfg, 1, 126) == [("1F1B", 1)]


def test_a_pipeline_layout_stops_at_its_first_stage_role_that_does_not_fit(monkeypatch):
    """evaluate_layout simulates stage roles one by one and stops at the first over the
    memory: its peak is then that role's (no process group: made-up observations)."""
    from engine.dryrun import search
    from engine.dryrun.observe import Observation
    from parallel.mesh import MeshSpec

    simulated = []

    def roles(cfg, layout, world, depth, seen=None):
        for peak in (5, 50, 7):
            simulated.append(peak)
            yield Observation(0, 0, 0, peak, {}), 1.0, 0.0, 0.0, 0.0

    monkeypatch.setattr(search, "observe_stage_roles", roles)
    monkeypatch.setattr(search, "layout_config", lambda cfg, layout: cfg)
    layout = search.Layout(MeshSpec(dp=2, pp=4), "true", "full", 4)
    outcome = search.evaluate_layout(None, layout, 8, 8, 1.0, None, usable=10)
    assert simulated == [5, 50] and outcome.estimate is None and outcome.peak_bytes == 50
    # first_fit's probe: the first role fits, so what the layout needs is not known yet.
    simulated.clear()
    assert search.evaluate_layout(None, layout, 8, 8, 1.0, None, usable=10, first_role_only=True) is None
    assert simulated == [5]


def test_the_probe_and_the_ladder_simulate_each_stage_role_of_a_layout_once(monkeypatch):
    """search_job's evaluate keeps the roles a probe simulated (observe_stage_roles' `seen`),
    so the full evaluation of the same layout simulates only the others (no process group:
    made-up observations)."""
    from common.config import load_config
    from engine.dryrun import search
    from engine.dryrun.observe import Observation
    from launch.run import DEFAULT_CONFIG
    from parallel.mesh import MeshSpec

    simulated = []
    monkeypatch.setattr(search, "observe_blocks", lambda cfg, layout, world, rank, blocks, leading, depth: (
        simulated.append(rank) or Observation(0, 0, 0, 1, {})))
    layout = search.Layout(MeshSpec(dp=2, pp=4), "true", "full", 4)
    cfg = search.layout_config(load_config(DEFAULT_CONFIG), layout)
    seen = {}
    first = next(search.observe_stage_roles(cfg, layout, 8, 4, seen))
    assert simulated == [0] and seen == {0: first}
    roles = list(search.observe_stage_roles(cfg, layout, 8, 4, seen))
    assert simulated == [0, 1, 3] and roles[0] is first and len(roles) == 3


def test_op_level_ac_is_left_out_where_recompute_cheap_did_not_fit_under_sequence_parallel():
    """first_fit's lighter_key (no process group: made-up outcomes in which every layout
    but full AC is over the memory): with sequence parallelism op-level AC is not simulated
    once none with recompute_cheap did not fit, at this reshard setting or a later one;
    without it, op is simulated."""
    from engine.dryrun.search import Outcome, first_fit, ladders
    from parallel.mesh import MeshSpec

    for sequence_parallel in (True, False):
        simulated = []

        def evaluate(layout):
            simulated.append((layout.reshard, layout.activation_checkpoint, layout.recompute_cheap))
            fits = layout.activation_checkpoint == "full"
            return Outcome(layout, 1, object() if fits else None)

        beyond = {}
        for reshard in ("true", "false"):
            (ladder,) = ladders(MeshSpec(pp=4, dp=2, tp=2), reshard, sequence_parallel, 8, [("1F1B", 1)])
            first_fit(ladder, evaluate, beyond)
        ops = [step for step in simulated if step[1] == "op"]
        assert ops == ([] if sequence_parallel else [("true", "op", False)]), simulated


def test_none_is_left_out_where_none_with_recompute_cheap_does_not_fit():
    """first_fit's lighter_key (no process group: made-up outcomes): none with
    recompute_cheap is probed before none, which is not simulated where it does not fit;
    the first fit is the ladder's first that fits, and no layout is simulated twice. Under
    pp the probe simulates the first stage role only (None: that role fits)."""
    from engine.dryrun.search import Outcome, first_fit, ladders
    from parallel.mesh import MeshSpec

    name = lambda layout: "cheap" if layout.recompute_cheap else layout.activation_checkpoint
    expected_under_pp = {  # what fits -> what is simulated, in order
        # none and none with recompute_cheap do not fit: full AC is probed before selective
        ("full",): ["probe cheap", "probe full", "selective", "full"],
        ("cheap", "full"): ["probe cheap", "none", "cheap"],
        ("none", "cheap", "full"): ["probe cheap", "none"],
    }
    for fitting, expected in expected_under_pp.items():
        for spec in (MeshSpec(pp=4, dp=2, tp=2), MeshSpec(dp=8, tp=2)):
            simulated = []

            def evaluate(layout):
                simulated.append((name(layout), layout.micro_batches))
                return Outcome(layout, 1, object() if name(layout) in fitting else None)

            def probe_first_role(layout):
                simulated.append((f"probe {name(layout)}", layout.micro_batches))
                return None if name(layout) in fitting else Outcome(layout, 1, None)

            (ladder,) = ladders(spec, "true", True, 8, [("1F1B", 1)])
            found = first_fit(ladder, evaluate, {}, probe_first_role if spec.pp > 1 else None)
            fits = [o.layout for o in found if o.estimate is not None]
            assert fits == [next(layout for layout in ladder if name(layout) in fitting)], (fitting, spec)
            assert len(set(simulated)) == len(simulated), simulated
            if spec.pp > 1:
                assert [step for step, _ in simulated] == expected, (fitting, simulated)
            if "cheap" not in fitting:  # none, which comes first, is tried where cheap fits
                assert "none" not in [step for step, _ in simulated], (fitting, spec, simulated)


@pytest.mark.parametrize("dim", ["pp", "pp_tie"])
def test_a_tied_weights_gradient_across_stages_adds_to_the_step(dim):
    """The sum of a tied weight's gradient over its first and last stage (the pp group at
    pp=2, its own group of 2 beyond) runs after the backward, and the step waits for it
    (no process group: a made-up observation)."""
    from common.config import load_config
    from engine.dryrun.estimate import collective_seconds, device_profile, estimate_step
    from tests.dryrun_worker import REPO

    cfg = load_config(str(REPO / "configs" / "debug.yaml"), ["parallel.mesh=pp=4,dp=2", "training.micro_batches=4"])
    spec, profile = parse_mesh("pp=4,dp=2").resolve(8), device_profile(cfg.dryrun)
    messages = {"pp": {"pipeline": {"send": {"count": 8, "bytes": 2 ** 20}, "recv": {"count": 8, "bytes": 2 ** 20}}}}
    tied = {**messages, dim: {**messages.get(dim, {}), "forward": {"all_reduce": {"count": 1, "bytes": 2 ** 27}}}}
    before, after = (estimate_step(comm, 1e6, cfg, spec, profile) for comm in (messages, tied))
    ranks = 4 if dim == "pp" else 2
    added = collective_seconds("all_reduce", 2 ** 27, ranks, profile.intra_node_bytes_s)
    assert after.step_s - before.step_s == pytest.approx(added) and added > 0


def test_an_all_gather_counts_its_gathered_output():
    """c10d's all-gather names its output; a functional one (TP's DTensors use it) takes its
    input and the group size, and counts as the group size times its input."""
    import torch

    from engine.dryrun.record import collective_bytes

    shard = torch.empty(4, 8)  # 128 bytes
    assert collective_bytes("all_gather", (shard, 8, "group")) == 8 * 128
    assert collective_bytes("all_gather", (torch.empty(32, 8), shard)) == 32 * 8 * 4
    assert collective_bytes("reduce_scatter", (shard, "sum", 8, "group")) == 128  # the full input
    assert collective_bytes("all_reduce", (shard, "sum", "group")) == 128
