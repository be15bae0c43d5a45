"""Print the parity matrix as a markdown table (the figures in docs/parallelism.md).

usage: python -m tests.parity_matrix [CASE ...]     (from the repository root)
"""

import sys
import tempfile
from pathlib import Path

from tests.distributed import parity_report
from tests.test_parity import MATRIX


def main(cases: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="parity-"))
    print("| case | mesh | ranks | settings | step-0 loss diff | max grad diff | grad-norm rel diff | max later-loss diff |")
    print("|---|---|---|---|---|---|---|---|")
    for case in cases or MATRIX:
        mesh, ranks, overrides, flavor = MATRIX[case]
        report, _ = parity_report(root, mesh, ranks, *overrides, flavor=flavor)
        ours, reference = report["grad_norm_2.0"]
        later = max(abs(a - b) for a, b in zip(report["losses"], report["ref_losses"]))
        settings = " ".join(o.split(".", 1)[1] for o in overrides) or "-"
        print(f"| {case} | {mesh} | {ranks} | {settings} | {report['loss0_diff']:.1e} | "
              f"{report['grad_max_diff']:.1e} | {abs(ours - reference) / reference:.1e} | {later:.1e} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
