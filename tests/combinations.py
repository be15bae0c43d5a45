"""The combination matrix: rows of parallel settings in which every pair of values of
any two settings appears together at least once (a pairwise covering array), each row
run through `launch/run.py --parity` by tests/test_combinations.py.

The rows are generated, not hand-picked, so a new setting joins by adding a line to
FACTORS (and, if some values exclude others, to `allowed`). Generation is greedy and
deterministic: each new row is the best of several candidates, each started from a pair
not yet covered, with every other setting given the value that covers the most new
pairs.

usage: python -m tests.combinations              (prints the rows as launch/run.py arguments)
       python -m tests.combinations --orders N   (the rows each of the first N pair orders gives)
"""

from __future__ import annotations

import random
import re
from itertools import combinations

FACTORS: dict[str, tuple] = {
    "mesh": ("dp", "hsdp", "dp-tp", "hsdp-dp-tp"),
    # Pipeline parallel at pp=2, by schedule: one of each kind (one stage per rank; looped,
    # 2 stages per rank; V-shaped zero bubble, 2 per rank). The stages per rank follow from
    # the schedule. GPipe and InterleavedZeroBubble have parity rows of their own
    # (tests/test_pipeline.py), so as values here they would only add rows.
    "pipeline": ("off", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
    "context_parallel": (False, True),
    "sequence_parallel": (False, True),
    "loss_parallel": (False, True),
    "activation_checkpoint": ("none", "full", "selective", "op"),
    "compile": (False, True),
    "reshard_after_forward": ("true", "false", "2"),
    "param_dtype": ("float32", "bfloat16"),
    "offload": (False, True),
    "micro_batches": (1, 2),
    "prefetch_forward": (0, 1, 2),
    "prefetch_backward": (0, 1, 2),
    "optimizer": ("adamw", "sgd"),
    "evaluation": (False, True),
    # The starting weights: drawn from the seed, or imported from a Hugging Face Llama
    # folder (checkpoint.hf_import; a Mixtral one for the mixture of experts) with its own
    # lm_head or tied to the embedding, whose step-0 loss is also checked against
    # transformers' (tests/test_combinations.py).
    "weights": ("seed", "hf", "hf-tied"),
    # Blocks per pipeline stage: the even split, or parallel.pp_split with the first stage
    # heavier (UNEVEN_SPLITS), or with end stages that hold only the embedding or the
    # output layer (ENDS_SPLITS).
    "pp_split": ("even", "uneven", "ends"),
    # parallel.recompute_cheap: norms, SwiGLU's products and sequence parallel's gathers
    # recomputed in backward per sublayer, in the blocks activation checkpointing leaves.
    "recompute_cheap": (False, True),
    # parallel.float8: the blocks' linears in float8 (torchao, emulated on the CPU), by
    # scaling. Tensorwise rows without tp also all-gather those weights in float8
    # (parallel.float8_all_gather), which touches FSDP (with tp, --parity refuses it:
    # launch/run.py, check_parity); tests/test_parity.py runs tensorwise without it
    # beside tp.
    "float8": ("none", "tensorwise", "rowwise"),
    # The model: the dense debug Llama, or the mixture of experts (model.name=llama_moe:
    # 8 experts, top 2, a shared expert, or Mixtral's shapes without it where the weights
    # are imported) with its experts whole on every rank, or split over ep=2 ranks borrowed
    # from dp (parallel/expert.py).
    "experts": ("dense", "moe", "moe-ep"),
    # hsdp's replica groups as separate jobs joined through torchft (fault_tolerance.enabled,
    # parallel/replicas.py), on the meshes that have hsdp. Such a row runs alone through the
    # launcher: a Lighthouse and one torchrun job per group, each checked against its own
    # one-device reference.
    "fault_tolerance": (False, True),
}

# Sizes per mesh kind, at 4 ranks where the kind allows. An integer reshard needs a
# shard group it can split (dp = 4), which doubles the ranks.
MESHES = {
    "dp": ("dp=4", "dp=4"),
    "hsdp": ("hsdp=2,dp=2", "hsdp=2,dp=4"),
    "dp-tp": ("dp=2,tp=2", "dp=4,tp=2"),
    "hsdp-dp-tp": ("hsdp=2,dp=2,tp=2", "hsdp=2,dp=4,tp=2"),
}
# With context parallel, the same ranks with cp=2 taken out of dp (the FSDP shard group,
# dp x cp, keeps its size).
CP_MESHES = {
    "dp": ("dp=2,cp=2", "dp=2,cp=2"),
    "hsdp": ("hsdp=2,cp=2", "hsdp=2,dp=2,cp=2"),
    "dp-tp": ("cp=2,tp=2", "dp=2,cp=2,tp=2"),
    "hsdp-dp-tp": ("hsdp=2,cp=2,tp=2", "hsdp=2,dp=2,cp=2,tp=2"),
}
# With pp=2, each kind at 4 ranks: pp takes the place of one dimension of size 2; with cp
# too, cp the place of the other (FSDP then shards over the 2 cp ranks).
PIPELINE_MESHES = {"dp": "pp=2,dp=2", "hsdp": "pp=2,hsdp=2", "dp-tp": "pp=2,tp=2"}
PIPELINE_CP_MESHES = {"dp": "pp=2,cp=2"}
LAYERS, PIPELINE_LAYERS, STEPS = 2, 4, 3  # 4 blocks: 2 stages per rank at pp=2 need 4 stages
# parallel.pp_split of the uneven rows and their blocks, by stages per rank: the even
# splits would be 2,2 and 2,3,2,1 (parallel/pipeline.py: even_split). Two stages per rank
# take 8 blocks, debug-deep's depth, which the dry run of a row also builds.
UNEVEN_SPLITS = {1: ("3,1", 4), 2: ("5,1,1,1", 8)}
ENDS_SPLITS = {1: ("0,4", 4), 2: ("0,2,2,0", 4)}
SPLITS = {"uneven": UNEVEN_SPLITS, "ends": ENDS_SPLITS}
DEBUG_LAYERS = 4  # the debug flavors' blocks; deeper rows with seeded weights take debug-deep or debug-moe-deep
MOE = ("model.name=llama_moe", "parallel.plan=llama_moe")
ZERO_BUBBLE = ("ZBVZeroBubble",)


def allowed(row: dict) -> bool:
    """Sequence and loss parallel act on the tp dimension only. For time alone, compile
    runs on 4 ranks only (compiling on 8 ranks costs about a minute on 2 cores, on 16
    about three): it meets an integer reshard only on dp, where that layout keeps 4 ranks,
    and never hsdp x dp x tp, whose rows take 8. tests/test_compile_ac_tp.py compiles
    tp with activation checkpointing on its own.

    Imported Hugging Face weights run in fp32 only: on the CPU torch sums a bf16
    embedding's gradient in bf16, one token row after another (tests/test_parity.py:
    test_torch_sums_a_bf16_embedding_gradient_in_bf16_on_the_cpu), and an imported
    Llama's embedding gradient (std 0.02, which RMSNorm scales up) then missed the bf16
    gradient tolerance on every layout, the one-device reference as much as the mesh
    (9.8e-3 against a limit of 3.1e-3 at pp=2,tp=2). CUDA sums it in fp32.

    Pipeline rows keep to 4 ranks, so they leave out hsdp x dp x tp and an integer reshard
    (which needs dp=4), and with context parallel every mesh kind but dp (pp=2,cp=2):
    pp=2,dp=2,tp=2 and pp=2,dp=4 with reshard 2 are parity rows of their own in
    tests/test_pipeline.py. What the engine refuses is left out too: a
    zero-bubble schedule with a reshard after forward, with compile or with op-level
    activation checkpointing (and recompute_cheap, which it ignores for the same reason:
    parallel/apply.py, recomputes_cheap_activations), and 1F1B with fewer micro-batches than stages
    (parallel/pipeline.py: check_settings), and float8 all-gathers (the tensorwise rows)
    with an integer reshard (parallel/float8.py: check_settings); what --parity refuses:
    tensorwise scaling with cp (launch/run.py: check_parity).

    ep borrows from dp, so it needs a mesh with dp >= 2: not the pipeline meshes
    other than pp=2,dp=2, nor the cp meshes other than dp=2,cp=2; and the engine refuses
    it with an integer reshard (parallel/expert.py: check_expert_parallel).

    Fault-tolerant replica groups are hsdp's, so they need a mesh with hsdp."""
    if "tp" not in row.get("mesh", "tp") and (row.get("sequence_parallel") or row.get("loss_parallel")):
        return False
    more_ranks = row.get("reshard_after_forward") == "2" and row.get("mesh", "dp") != "dp"
    if row.get("compile") and (more_ranks or row.get("mesh") == "hsdp-dp-tp"):
        return False
    if row.get("weights", "seed") != "seed" and row.get("param_dtype") == "bfloat16":
        return False
    if row.get("float8") == "tensorwise" and row.get("reshard_after_forward") == "2":
        return False  # a float8 all-gather from a post-forward shard (parallel/float8.py: check_settings)
    if row.get("float8") == "tensorwise" and row.get("context_parallel"):
        return False  # scales per cp chunk, which --parity cannot reproduce (launch/run.py: check_parity)
    experts = row.get("experts", "dense")
    if row.get("fault_tolerance") and row.get("mesh", "hsdp") not in ("hsdp", "hsdp-dp-tp"):
        return False
    if experts == "moe-ep" and (row.get("reshard_after_forward") == "2"
                                or (row.get("context_parallel") and row.get("mesh", "dp") != "dp")):
        return False
    # A split of its own needs a pipeline: a row that names no schedule yet is held to what
    # every schedule needs.
    pipeline = row.get("pipeline", "off" if row.get("pp_split", "even") == "even" else "any")
    if pipeline == "off":
        return row.get("pp_split", "even") == "even"
    if experts == "moe-ep" and (row.get("context_parallel") or row.get("mesh", "dp") != "dp"):
        return False  # pp=2,hsdp=2, pp=2,tp=2 and pp=2,cp=2 have no dp to borrow from
    if row.get("mesh") == "hsdp-dp-tp" or row.get("reshard_after_forward") == "2":
        return False
    if row.get("context_parallel") and row.get("mesh", "dp") != "dp":
        return False
    if pipeline in ZERO_BUBBLE and (row.get("reshard_after_forward", "false") != "false" or row.get("compile")
                                    or row.get("activation_checkpoint") == "op" or row.get("recompute_cheap")):
        return False
    return not (pipeline == "1F1B" and row.get("micro_batches") == 1)


def _pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in combinations(FACTORS, 2) if a in row and b in row}


def all_pairs() -> list:
    """Every pair of values of two settings that some valid row can hold, in a fixed order."""
    return [((a, x), (b, y)) for a, b in combinations(FACTORS, 2)
            for x in FACTORS[a] for y in FACTORS[b] if allowed({a: x, b: y})]


def _complete(seed: dict, uncovered: set) -> dict:
    """Fill the settings the seed leaves open, each with the value that covers the most
    pairs still uncovered (ties: the first value listed)."""
    row = dict(seed)
    for name in FACTORS:
        if name not in row:
            candidates = [v for v in FACTORS[name] if allowed({**row, name: v})]
            row[name] = max(candidates, key=lambda v: len(_pairs({**row, name: v}) & uncovered))
    return {name: row[name] for name in FACTORS}


def generate(candidates: int = 40, order: int = 0) -> list[dict]:
    """Each new row is the best of `candidates` completions, one seeded by each of the
    first uncovered pairs, until every pair is covered. `order` > 0 shuffles the pairs
    first (random.Random(order)), which changes which of equally good rows is taken."""
    pending = all_pairs()
    if order:
        random.Random(order).shuffle(pending)
    rows: list[dict] = []
    while pending:
        uncovered = set(pending)
        options = [_complete(dict(pair), uncovered) for pair in pending[:candidates]]
        row = max(options, key=lambda r: len(_pairs(r) & uncovered))
        rows.append(row)
        covered = _pairs(row)
        pending = [pair for pair in pending if pair not in covered]
    return rows


def mesh_of(row: dict) -> str:
    if row["pipeline"] != "off":
        mesh = (PIPELINE_CP_MESHES if row["context_parallel"] else PIPELINE_MESHES)[row["mesh"]]
    else:
        mesh = (CP_MESHES if row["context_parallel"] else MESHES)[row["mesh"]][row["reshard_after_forward"] == "2"]
    return re.sub(r"\b(dp=\d+)", r"\1,ep=2", mesh) if row["experts"] == "moe-ep" else mesh


def _ranks(row: dict) -> int:
    from parallel.mesh import parse_mesh
    return parse_mesh(mesh_of(row)).world_size


def stages_per_rank(row: dict) -> int:
    return 1 if row["pipeline"] == "1F1B" else 2


def layers_of(row: dict) -> int:
    if row["pipeline"] == "off":
        return LAYERS
    return SPLITS[row["pp_split"]][stages_per_rank(row)][1] if row["pp_split"] != "even" else PIPELINE_LAYERS


def hf_folder_name(row: dict) -> str:
    return f"{row['weights']}-{'mixtral' if row['experts'] != 'dense' else 'llama'}-{layers_of(row)}"


def hf_folder(root, row: dict):
    """The Hugging Face folder a row with imported weights starts from, under `root`:
    a LlamaForCausalLM of the debug flavor's shapes (a MixtralForCausalLM of
    debug-moe-mixtral's for the experts' rows), with its own lm_head or tied, and Llama
    3.1's rope scaling, at the row's depth, written by transformers once."""
    from pathlib import Path
    mixtral = row["experts"] != "dense"
    folder = Path(root) / hf_folder_name(row)
    if not (folder / "config.json").is_file():
        import torch
        import transformers
        torch.manual_seed(layers_of(row))
        shapes = dict(
            hidden_size=256, num_hidden_layers=layers_of(row), num_attention_heads=8, num_key_value_heads=4,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=row["weights"] == "hf-tied",
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64})
        if mixtral:
            config = transformers.MixtralConfig(**shapes, intermediate_size=128, num_local_experts=8,
                                                num_experts_per_tok=2)
            transformers.MixtralForCausalLM(config).float().save_pretrained(folder)
        else:
            config = transformers.LlamaConfig(**shapes, intermediate_size=768)
            transformers.LlamaForCausalLM(config).float().save_pretrained(folder)
    return folder


def overrides(row: dict, hf_root=None) -> tuple[str, ...]:
    """The row as `--set` values for `launch/run.py --parity`; a row with imported weights
    reads them from its folder under `hf_root` (hf_folder), written there if it is not yet;
    without `hf_root`, the folder is named under HF_ROOT and not written (for printing)."""
    lower = {True: "true", False: "false"}
    deep = layers_of(row) > DEBUG_LAYERS
    parallel = ("sequence_parallel", "loss_parallel", "activation_checkpoint", "compile",
                "reshard_after_forward", "param_dtype", "offload", "recompute_cheap")
    pipeline = row["pipeline"]
    stages = (f"parallel.pp_schedule={pipeline}", f"parallel.pp_stages_per_rank={stages_per_rank(row)}",
              *((f"parallel.pp_split={SPLITS[row['pp_split']][stages_per_rank(row)][0]}",)
                if row["pp_split"] != "even" else ()))
    return (*(f"parallel.{key}={lower.get(row[key], row[key])}" for key in parallel),
            *(stages if pipeline != "off" else ()),
            f"parallel.float8={row['float8']}",
            f"parallel.float8_all_gather={lower[row['float8'] == 'tensorwise' and 'tp' not in row['mesh']]}",
            f"training.micro_batches={row['micro_batches']}",
            f"prefetch.forward={row['prefetch_forward']}", f"prefetch.backward={row['prefetch_backward']}",
            f"optim.name={row['optimizer']}", f"parity.layers={layers_of(row)}",
            *((f"eval.every={STEPS}", "eval.steps=1", "data.holdout=0.2") if row["evaluation"] else ()),
            *(MOE if row["experts"] != "dense" else ()),
            *(("fault_tolerance.enabled=true",) if row["fault_tolerance"] else ()),
            *((f"checkpoint.hf_import={hf_folder(hf_root, row) if hf_root else 'HF_ROOT/' + hf_folder_name(row)}",)
              if row["weights"] != "seed" else
              (f"model.flavor=debug-moe{'-deep' * deep}",) if row["experts"] != "dense" else
              ("model.flavor=debug-deep",) if deep else ()))


# The pair order whose rows cost least to run, of orders 0 to 119 (fewest compiled rows,
# then fewest fault-tolerant ones, which run alone with a Lighthouse and a job per group,
# then fewest ranks in all): 26 rows, 5 of them compiled, 6 fault-tolerant, 144 ranks in
# all. Compiled rows cost the most on 2 cores, then rows above 4 ranks;
# `python -m tests.combinations --orders 120` prints each order's rows, compiled rows,
# fault-tolerant rows and ranks in all.
ROW_ORDER = 64
ROWS = generate(order=ROW_ORDER)


def value_rows(rows: list[dict]) -> list[int]:
    """A few of `rows` in which every value of every setting appears at least once (greedy:
    the row adding the most values not yet seen per unit of cost, its ranks plus 16 if it
    compiles, since on 2 cores a compiled row costs about what a 16-rank one does, and 16
    more if it is fault-tolerant, since it runs alone, with a Lighthouse and a job per
    group, where the others share a job). The other torch versions run these
    (`make test-compat`); the pinned one runs every row."""
    def cost(i: int) -> int:
        return _ranks(rows[i]) + 16 * rows[i]["compile"] + 16 * rows[i]["fault_tolerance"]
    needed = {(name, row[name]) for row in rows for name in FACTORS}
    chosen: list[int] = []
    while needed:
        best = max(range(len(rows)), key=lambda i: (len({(n, rows[i][n]) for n in FACTORS} & needed) / cost(i), -i))
        chosen.append(best)
        needed -= {(name, rows[best][name]) for name in FACTORS}
    return sorted(chosen)


VALUE_ROWS = value_rows(ROWS)


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["--orders"]:
        for order in range(int(sys.argv[2])):
            rows = generate(order=order)
            print(f"order {order}: {len(rows)} rows, {sum(r['compile'] for r in rows)} compiled, "
                  f"{sum(r['fault_tolerance'] for r in rows)} fault-tolerant, "
                  f"{sum(_ranks(r) for r in rows)} ranks in all", flush=True)
        sys.exit()
    for index, row in enumerate(ROWS):
        args = " ".join(f"--set {o}" for o in overrides(row))
        print(f"row {index}: launch/run.py --parity --mesh {mesh_of(row)} --set parity.steps={STEPS} {args}")
