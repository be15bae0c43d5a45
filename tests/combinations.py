"""The combination matrix: rows of parallel settings in which every pair of values of
any two settings appears together at least once (a pairwise covering array), each row
run through `launch/run.py --parity` by tests/test_combinations.py.

The rows are generated, not hand-picked, so a new setting joins by adding a line to
FACTORS (and, if some values exclude others, to `allowed`). Generation is greedy and
deterministic: each new row is the best of several candidates, each started from a pair
not yet covered, with every other setting given the value that covers the most new
pairs.

usage: python -m tests.combinations      (prints the rows as launch/run.py arguments)
"""

from __future__ import annotations

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
ZERO_BUBBLE = ("ZBVZeroBubble",)


def allowed(row: dict) -> bool:
    """Sequence and loss parallel act on the tp dimension only. For time alone, compile
    meets an integer reshard only on dp, where that layout keeps 4 ranks (compiling on
    8 ranks costs about a minute on 2 cores, on 16 about three): every pair, that one
    included, is still covered.

    Pipeline rows keep to 4 ranks, so they leave out hsdp x dp x tp and an integer reshard
    (which needs dp=4), and with context parallel every mesh kind but dp (pp=2,cp=2):
    pp=2,dp=2,tp=2 and pp=2,dp=4 with reshard 2 are parity rows of their own in
    tests/test_pipeline.py. What the engine refuses is left out too: a
    zero-bubble schedule with a reshard after forward, with compile or with op-level
    activation checkpointing, and 1F1B with fewer micro-batches than stages
    (parallel/pipeline.py: check_settings)."""
    if "tp" not in row.get("mesh", "tp") and (row.get("sequence_parallel") or row.get("loss_parallel")):
        return False
    more_ranks = row.get("reshard_after_forward") == "2" and row.get("mesh", "dp") != "dp"
    if more_ranks and row.get("compile"):
        return False
    pipeline = row.get("pipeline", "off")
    if pipeline == "off":
        return True
    if row.get("mesh") == "hsdp-dp-tp" or row.get("reshard_after_forward") == "2":
        return False
    if row.get("context_parallel") and row.get("mesh", "dp") != "dp":
        return False
    if pipeline in ZERO_BUBBLE and (row.get("reshard_after_forward", "false") != "false" or row.get("compile")
                                    or row.get("activation_checkpoint") == "op"):
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


def generate(candidates: int = 40) -> list[dict]:
    """Each new row is the best of `candidates` completions, one seeded by each of the
    first uncovered pairs, until every pair is covered."""
    pending = all_pairs()
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
        return (PIPELINE_CP_MESHES if row["context_parallel"] else PIPELINE_MESHES)[row["mesh"]]
    return (CP_MESHES if row["context_parallel"] else MESHES)[row["mesh"]][row["reshard_after_forward"] == "2"]


def layers_of(row: dict) -> int:
    return LAYERS if row["pipeline"] == "off" else PIPELINE_LAYERS


def overrides(row: dict) -> tuple[str, ...]:
    """The row as `--set` values for `launch/run.py --parity`."""
    lower = {True: "true", False: "false"}
    parallel = ("sequence_parallel", "loss_parallel", "activation_checkpoint", "compile",
                "reshard_after_forward", "param_dtype", "offload")
    pipeline = row["pipeline"]
    stages = (f"parallel.pp_schedule={pipeline}", f"parallel.pp_stages_per_rank={1 if pipeline == '1F1B' else 2}")
    return (*(f"parallel.{key}={lower.get(row[key], row[key])}" for key in parallel),
            *(stages if pipeline != "off" else ()),
            f"training.micro_batches={row['micro_batches']}",
            f"prefetch.forward={row['prefetch_forward']}", f"prefetch.backward={row['prefetch_backward']}",
            f"optim.name={row['optimizer']}", f"parity.layers={layers_of(row)}",
            *((f"eval.every={STEPS}", "eval.steps=1", "data.holdout=0.2") if row["evaluation"] else ()))


ROWS = generate()


if __name__ == "__main__":
    for index, row in enumerate(ROWS):
        args = " ".join(f"--set {o}" for o in overrides(row))
        print(f"row {index}: launch/run.py --parity --mesh {mesh_of(row)} --set parity.steps={STEPS} {args}")
