"""Peak memory per rank against the sequence length, with and without context
parallelism (docs/parallelism.md, "Context parallelism: memory").

Each row is a real CPU run over gloo: its ranks build the debug-32K model from the seed,
take one training step of the engine's train_step on one sequence, and the peak of
tracked tensor memory of every rank is measured (engine/dryrun/observe.py, as the dry
run's validation measures it). Beside each, the dry run's prediction of the same layout.

    .venv/bin/python bench/context_memory.py [--length 4096] [--cp 4]

Rows: one rank at --length tokens, --cp ranks at cp x --length tokens, and one rank at
cp x --length tokens (what the longer sequence costs without context parallelism).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.dryrun_worker import measure_and_predict  # noqa: E402

MIB = 1024 ** 2
BASE = ["model.flavor=debug-32K", "training.global_batch=1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096, help="tokens one rank holds (default 4096)")
    parser.add_argument("--cp", type=int, default=4, help="the cp degree of the long run (default 4)")
    args = parser.parse_args()
    long = args.length * args.cp
    rows = [("dp=1", 1, args.length), (f"cp={args.cp}", args.cp, long), ("dp=1", 1, long)]
    print("| mesh | ranks | sequence | tokens per rank | peak per rank, measured | predicted (dry run) |")
    print("|---|---|---|---|---|---|")
    for mesh, ranks, length in rows:
        with tempfile.TemporaryDirectory() as out:
            measured, predicted = measure_and_predict([(mesh, [*BASE, f"training.seq_len={length}"])], Path(out),
                                                      ranks)
        peaks = [measured[0][rank]["peak_bytes"] / MIB for rank in range(ranks)]
        shown = f"{max(peaks):.1f} MiB" if ranks == 1 else f"{min(peaks):.1f} to {max(peaks):.1f} MiB"
        print(f"| {mesh} | {ranks} | {length:,} | {length // ranks:,} | {shown} | "
              f"{predicted[0]['rank0']['peak_bytes'] / MIB:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
