"""The time --plan-for takes to evaluate one pipeline layout, with this search and with
the one before short pipelines (engine/dryrun/search.py at BEFORE, read with git show),
in one process, one after the other (docs/planning.md, "Pipeline parallel in the search").

The layout: Llama 3 405B on 2,048 GPUs, pp=16,dp=16,tp=8, a global batch of 1,024
sequences of 8,192 tokens (64 micro-batches a pipeline), full AC, blocks resharded after
forward, 1F1B or Interleaved1F1B. Each line gives wall and CPU seconds and what the
search predicted; both searches simulate with the same engine (simulate.py, observe.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BEFORE = "338e5cf"  # the last commit that simulated pp and pp + 1 micro-batches at the layout's pp


def search_before():
    """engine/dryrun/search.py as it was at BEFORE, as a module of its own."""
    source = subprocess.run(["git", "show", f"{BEFORE}:engine/dryrun/search.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "search_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("search_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["search_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=("1F1B", "Interleaved1F1B"), default="1F1B")
    parser.add_argument("--order", default="new,before", help="which searches, in this order")
    args = parser.parse_args()

    import parallel  # noqa: F401  (registers the built-in plans)
    from common.config import load_config
    from engine.dryrun import search
    from engine.dryrun.estimate import device_profile
    from engine.metrics.throughput import flops_per_token
    from models import build_on_meta
    from parallel.mesh import parse_mesh

    world, spec = 2048, parse_mesh("pp=16,dp=16,tp=8")
    cfg = load_config(REPO / "configs" / "debug.yaml", ["model.flavor=405B", "training.seq_len=8192",
                                                         "training.global_batch=1024", "parallel.param_dtype=bfloat16"])
    fpt = flops_per_token(build_on_meta("llama", "405B"), cfg.training.seq_len)
    profile, usable = device_profile(cfg.dryrun), cfg.dryrun.gpu_memory_gib * search.GIB * (1 - search.HEADROOM)
    per_rank = 1 if args.schedule == "1F1B" else 2
    modules = {"new": search, "before": search_before()}
    for which in args.order.split(","):
        module = modules[which]
        layout = module.Layout(spec, "true", "full", 64, True, args.schedule, per_rank)
        wall, cpu = time.perf_counter(), time.process_time()
        outcome = module.evaluate_layout(cfg, layout, world, 126, fpt, profile, usable)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        e = outcome.estimate
        result = f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}" if e else outcome.reason
        print(f"{which:6} {args.schedule}: {wall:.1f} s wall, {cpu:.1f} s CPU; peak "
              f"{outcome.peak_bytes / search.GIB:.2f} GiB; {result}", flush=True)


if __name__ == "__main__":
    main()
