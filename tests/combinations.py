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
LAYERS, STEPS = 2, 3


def allowed(row: dict) -> bool:
    """Sequence and loss parallel act on the tp dimension only. For time alone, compile
    meets an integer reshard only on dp, where that layout keeps 4 ranks (compiling on
    8 ranks costs about a minute on 2 cores, on 16 about three): every pair, that one
    included, is still covered."""
    if "tp" not in row.get("mesh", "tp") and (row.get("sequence_parallel") or row.get("loss_parallel")):
        return False
    more_ranks = row.get("reshard_after_forward") == "2" and row.get("mesh", "dp") != "dp"
    return not (more_ranks and row.get("compile"))


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
    return (CP_MESHES if row["context_parallel"] else MESHES)[row["mesh"]][row["reshard_after_forward"] == "2"]


def overrides(row: dict) -> tuple[str, ...]:
    """The row as `--set` values for `launch/run.py --parity`."""
    lower = {True: "true", False: "false"}
    parallel = ("sequence_parallel", "loss_parallel", "activation_checkpoint", "compile",
                "reshard_after_forward", "param_dtype", "offload")
    return (*(f"parallel.{key}={lower.get(row[key], row[key])}" for key in parallel),
            f"training.micro_batches={row['micro_batches']}",
            f"prefetch.forward={row['prefetch_forward']}", f"prefetch.backward={row['prefetch_backward']}",
            f"optim.name={row['optimizer']}", f"parity.layers={LAYERS}",
            *((f"eval.every={STEPS}", "eval.steps=1", "data.holdout=0.2") if row["evaluation"] else ()))


ROWS = generate()


if __name__ == "__main__":
    for index, row in enumerate(ROWS):
        args = " ".join(f"--set {o}" for o in overrides(row))
        print(f"row {index}: launch/run.py --parity --mesh {mesh_of(row)} --set parity.steps={STEPS} {args}")
