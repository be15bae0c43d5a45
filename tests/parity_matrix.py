"""Print the parity matrix as a markdown table (the figures in docs/parallelism.md):
`launch/run.py --parity` once per row of tests/test_parity.py.

usage: python -m tests.parity_matrix [CASE ...]     (from the repository root)
"""

import sys
import tempfile
from pathlib import Path

from tests.distributed import parity_report
from tests.test_parity import MATRIX


def main(cases: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="parity-"))
    print("| case | mesh | settings | verdict | step-0 loss diff | max grad diff | grad-norm rel diff | max later-loss diff |")
    print("|---|---|---|---|---|---|---|---|")
    for case in cases or MATRIX:
        mesh, overrides = MATRIX[case]
        report, _ = parity_report(root, mesh, *overrides)
        rows = report["steps_table"]
        later = max(row["loss_diff"] for row in rows[1:])
        settings = " ".join(o.split(".", 1)[1] for o in overrides) or "-"
        print(f"| {case} | {mesh} | {settings} | {report['verdict']} | {rows[0]['loss_diff']:.1e} | "
              f"{report['gradients']['max_abs_diff']:.1e} | {rows[0]['grad_norm_rel_diff']:.1e} | {later:.1e} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
