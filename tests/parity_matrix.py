"""Print the combination matrix and the extra parity rows as markdown tables (the
figures in docs/parallelism.md): `launch/run.py --parity` once per row of
tests/combinations.py, of tests/test_parity.py and of tests/test_pipeline.py, and of
the pipeline table below, with each launch's wall time.

usage: python -m tests.parity_matrix [ROW ...]     (from the repository root, in .venv;
                                                   ROW: a combination index or an extra id)
"""

import sys
import tempfile
import time
from pathlib import Path

from tests.combinations import FACTORS, ROWS, STEPS, mesh_of, overrides
from tests.distributed import parity_report
from tests.test_parity import MATRIX
from tests.test_pipeline import PIPELINE_ROWS

# The pipeline layouts of docs/parallelism.md's parity table that the suite covers through
# the combination matrix instead (there with other settings varied at the same time).
PIPELINE_TABLE = {
    "pp2": ("pp=2", ("training.micro_batches=2",)),
    "pp2-dp2": ("pp=2,dp=2", ("training.micro_batches=2",)),
    "pp2-tp2-sp": ("pp=2,tp=2", ("parallel.sequence_parallel=true", "training.micro_batches=2")),
    "pp2-compile-ac": ("pp=2", ("parallel.compile=true", "parallel.activation_checkpoint=full",
                                "training.micro_batches=2")),
}

DEFAULTS = {name: values[0] for name, values in FACTORS.items()}  # each factor lists its default first
HEADER = ("| row | mesh | settings (besides the defaults) | verdict | step-0 loss diff | max grad diff | "
          "grad-norm rel diff | max later-loss diff | seconds |\n|---|---|---|---|---|---|---|---|---|")


def line(name: str, mesh: str, settings: str, report: dict, seconds: float) -> str:
    rows = report["steps_table"]
    later = max(row["loss_diff"] for row in rows[1:])
    return (f"| {name} | {mesh} | {settings or '-'} | {report['verdict']} | {rows[0]['loss_diff']:.1e} | "
            f"{report['gradients']['max_abs_diff']:.1e} | {rows[0]['grad_norm_rel_diff']:.1e} | {later:.1e} | "
            f"{seconds:.0f} |")


def timed(root: Path, mesh: str, *settings: str) -> tuple[dict, float]:
    started = time.monotonic()
    report, _ = parity_report(root, mesh, *settings, steps=STEPS)
    return report, time.monotonic() - started


def main(chosen: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="parity-"))
    print(HEADER)
    total = 0.0
    for index, row in enumerate(ROWS):
        if chosen and str(index) not in chosen:
            continue
        report, seconds = timed(root, mesh_of(row), *overrides(row, root))
        total += seconds
        settings = " ".join(f"{k}={row[k]}" for k in FACTORS if k != "mesh" and row[k] != DEFAULTS[k])
        print(line(str(index), mesh_of(row), settings, report, seconds), flush=True)
    for case, (mesh, settings) in {**MATRIX, **PIPELINE_ROWS, **PIPELINE_TABLE}.items():
        if chosen and case not in chosen:
            continue
        report, seconds = timed(root, mesh, *settings)
        total += seconds
        print(line(case, mesh, " ".join(o.split(".", 1)[1] for o in settings), report, seconds), flush=True)
    print(f"\n{total:.0f} s of launches in all")


if __name__ == "__main__":
    main(sys.argv[1:])
