"""Per-rank initialisation time against the shard degree (docs/benchmarks.md).

For each dp size, one process plays rank 0 of a fake world of that size (torch's fake
process group: materialising sends nothing, so one rank's work is measured alone),
applies the plan to the model on meta and times `materialise`, with --threads intra-op
threads (default one; the shard way draws its tiles side by side on them). Two ways:

- shard: the model's init_distribution, each rank drawing only its own shard;
- whole: the same model with an init_value that draws each whole parameter with
  torch.randn and keeps the rank's slice (how models/llama.py initialised before).

Each (way, dp) runs --repeats times, the order alternating, and the table gives
medians of wall seconds and of user CPU seconds, and each CPU median over the dp=1
median of the same way. User CPU time is the drawing; the rest of the wall time is
mostly the kernel faulting in the shard's fresh memory (system time), which on the
2-core CI machine varied from run to run and grew faster than the memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def whole_draws(model) -> None:
    """Give `model` the whole-parameter init_value that Llama had before init_distribution."""
    import torch

    from models.initial_values import Constant

    distribution_of = model.init_distribution

    def init_value(fqn, shape, generator):
        distribution = distribution_of(fqn)
        if isinstance(distribution, Constant):
            return torch.full(shape, distribution.value)
        return torch.randn(shape, generator=generator) * distribution.std

    model.init_distribution = None
    model.init_value = init_value


def one_rank(flavor: str, dp: int, way: str, threads: int) -> dict:
    import torch

    from common.config import load_config
    from engine.dryrun.simulate import _rank_model
    from models.materialise import materialise
    from parallel.mesh import MeshSpec

    torch.set_num_threads(threads)
    cfg = load_config(REPO / "configs" / "debug.yaml", [f"model.flavor={flavor}"])
    model, _ = _rank_model(cfg, MeshSpec(1, dp, 1), dp, 0)
    if way == "whole":
        whole_draws(model)
    started, cpu = time.perf_counter(), os.times()
    materialise(model, "cpu", cfg.training.seed)
    return {"wall_s": time.perf_counter() - started, "user_s": os.times().user - cpu.user,
            "local_values": sum(p.to_local().numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", nargs=4, metavar=("FLAVOR", "DP", "WAY", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_rank(args.one[0], int(args.one[1]), args.one[2], int(args.one[3]))))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runs = {}
    for repeat in range(args.repeats):
        order = [(way, dp) for dp in args.dp for way in ("shard", "whole")]
        for way, dp in order if repeat % 2 == 0 else reversed(order):
            command = [sys.executable, __file__, "--one", args.flavor, str(dp), way, str(args.threads)]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            runs.setdefault((way, dp), []).append(json.loads(out.strip().splitlines()[-1]))
    threads = "one thread" if args.threads == 1 else f"{args.threads} threads"
    print(f"{args.flavor}: materialise on rank 0, {threads}, median of {args.repeats} (wall seconds)")
    print("| dp | values on the rank | shard: wall s | shard: user CPU s | shard: CPU / dp=1 | whole: wall s "
          "| whole: user CPU s | whole: CPU / dp=1 |")
    print("|---|---|---|---|---|---|---|---|")
    median = {(key, figure): statistics.median(r[figure] for r in rs)
              for key, rs in runs.items() for figure in ("wall_s", "user_s")}
    for dp in args.dp:
        cells = [f"{dp}", f"{runs['shard', dp][0]['local_values']:,}"]
        for way in ("shard", "whole"):
            user, first = median[(way, dp), "user_s"], median[(way, args.dp[0]), "user_s"]
            cells += [f"{median[(way, dp), 'wall_s']:.2f}", f"{user:.2f}", f"{user / first:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
