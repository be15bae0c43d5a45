"""The validation table of docs/planning.md: the dry run's prediction against a real
4-rank gloo run of the same layout, for the layouts tests/test_dryrun.py checks and,
with --flavor 100M, for the 100M Llama.

    .venv/bin/python bench/dryrun_validation.py [--flavor 100M]

It holds every row to the rules of tests/test_dryrun.py (`rule_breaks`: state bytes equal
on every rank, collectives and pipeline messages equal, the peaks within PEAK_TOLERANCE)
and exits 1 when one breaks them. The documented commands, which `make test-docs` runs,
are the check of every layout on the pinned torch (the main suite and the other torch
versions check the layouts of ON_EVERY_VERSION) and of the 100M flavor.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.dryrun_worker import measure_and_predict  # noqa: E402
from tests.test_dryrun import BATCH, LAYOUTS, WORLD, layout_id, rule_breaks  # noqa: E402

MIB = 1024 ** 2
LARGER = [  # the 100M flavor: fewer, shorter rows keep the real run to a minute on 2 cores
    ("dp=4", ["training.global_batch=4", "training.seq_len=32", "model.flavor=100M"]),
    ("dp=2,tp=2", ["training.global_batch=4", "training.seq_len=32", "model.flavor=100M",
                   "parallel.activation_checkpoint=full", "parallel.sequence_parallel=true"]),
    ("hsdp=2,dp=2", ["training.global_batch=8", "training.seq_len=32", "model.flavor=100M",
                     "parallel.reshard_after_forward=false", "training.micro_batches=2"]),
]


def same_state(role: dict, real: dict) -> bool:
    return all(role[k] == real[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))


def state_cell(role: dict, real: dict) -> str:
    return f"{role['param_bytes']:,} / {role['optimizer_bytes']:,} ({'equal' if same_state(role, real) else 'DIFFERENT'})"


def comm_cell(predicted: dict, measured: dict) -> str:
    count = sum(v["count"] for phases in predicted.values() for kinds in phases.values() for v in kinds.values())
    nbytes = sum(v["bytes"] for phases in predicted.values() for kinds in phases.values() for v in kinds.values())
    return f"{count} ops, {nbytes / MIB:.2f} MiB ({'equal' if predicted == measured else 'DIFFERENT'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", choices=("debug", "100M"), default="debug")
    layouts = LAYOUTS if parser.parse_args().flavor == "debug" else LARGER
    with tempfile.TemporaryDirectory() as out:
        measured, predicted = measure_and_predict(layouts, Path(out), WORLD)
    print(f"| layout ({WORLD} ranks) | rank 0 params / optimizer bytes | rank 0 collectives | "
          f"peak predicted | peak measured | predicted / measured |")
    print("|---|---|---|---|---|---|")
    broken = []
    for layout, real, guess in zip(layouts, measured, predicted):
        role = next(r for r in guess["roles"] if 0 in r["ranks"])
        peak, real_peak = guess["rank0"]["peak_bytes"], real[0]["peak_bytes"]
        name = layout_id((layout[0], [o for o in layout[1] if o != BATCH]))
        print(f"| {name} | {state_cell(role, real[0])} | {comm_cell(guess['comm'], real[0]['comm'])} | "
              f"{peak / MIB:.2f} MiB | {real_peak / MIB:.2f} MiB | {peak / real_peak:.3f} |")
        broken += [f"{name}: {problem}" for problem in rule_breaks(real, guess)]
    if broken:
        sys.exit("outside the rules of tests/test_dryrun.py (rule_breaks):\n" + "\n".join(broken))


if __name__ == "__main__":
    main()
