"""The engine's step time against bench/handwritten.py on the same model, mesh, batches
and initial weights, interleaved in one process group so both see the same machine load.

usage: torchrun --nproc_per_node 4 bench/overhead.py MESH [PAIRS, default 160]
   e.g. OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/overhead.py dp=4 160

A mesh with ep (ep = dp, e.g. dp=4,ep=4) times the mixture of experts instead (model
llama_moe, flavor debug-moe, plan llama_moe) against the hand-written script's expert
parallel, which dispatches the same way.

After the warm-up, each pair times one step of each, alternating which goes first, so
slow drifts in machine load hit both alike; the ratio of each pair is one sample. A step
is timed on rank 0 from a barrier to the end of the step, which both end by reading the
loss. The engine's step is its real loop step (engine.train.logged_step:
batch, forward+backward, clip, AdamW, LR schedule, metrics line and JSON record, the
memory maximum over ranks); its log goes to a scratch folder and /dev/null. Prints the median
step times and the median and quartiles of the per-pair ratios engine / hand-written.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import parallel  # noqa: E402,F401
from bench.handwritten import Handwritten  # noqa: E402
from common.config import Config  # noqa: E402
from engine.data.sources import CorpusSource  # noqa: E402
from engine.metrics.log import StepLog  # noqa: E402
from engine.train import build_optimizer, global_mean, logged_step, run_shape  # noqa: E402
from models import build_on_meta  # noqa: E402
from models.materialise import materialise  # noqa: E402
from parallel.apply import apply_plan  # noqa: E402
from parallel.mesh import build_mesh, parse_mesh  # noqa: E402
from parallel.plan import plan_of  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 3
MOE = ("llama_moe", "debug-moe", "llama_moe")  # model, flavor and plan of the runs with ep


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Engine:
    def __init__(self, mesh_text: str, total_steps: int, run_dir: str):
        self.cfg = Config()
        self.cfg.training.steps = total_steps
        self.dims = build_mesh(parse_mesh(mesh_text).resolve(dist.get_world_size()), "cpu")
        if self.dims.spec.ep > 1:
            self.cfg.model.name, self.cfg.model.flavor, self.cfg.parallel.plan = MOE
        self.model = build_on_meta(self.cfg.model.name, self.cfg.model.flavor)
        apply_plan(self.model, plan_of(self.cfg), self.dims, self.cfg.parallel, self.cfg.prefetch)
        materialise(self.model, "cpu", self.cfg.training.seed)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim, total_steps)
        self.source = CorpusSource(REPO / "data" / "corpus.txt", self.cfg.training.seed)
        self.log = StepLog(total_steps, run_dir, enabled=dist.get_rank() == 0, stream=open(os.devnull, "w"))
        self.shape = run_shape(self.model, self.cfg, torch.device("cpu"))

    def step(self, step: int) -> float:
        return logged_step(self.model, self.optimizer, self.scheduler, self.source, step, self.cfg, self.dims,
                           torch.device("cpu"), self.log, self.shape).loss


def timed(step_fn, step: int) -> tuple[float, float]:
    dist.barrier()
    started = time.perf_counter()
    loss = step_fn(step)
    return time.perf_counter() - started, loss


def main() -> None:
    mesh_text = sys.argv[1]
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    total = WARMUP_STEPS + pairs
    engine = Engine(mesh_text, total, tempfile.mkdtemp(prefix="overhead-"))
    spec = engine.dims.spec
    hand = Handwritten(spec.dp, spec.tp, engine.cfg.model.flavor, engine.cfg.training.seed, engine.cfg.optim.lr,
                       spec.ep, engine.cfg.model.name)
    with torch.no_grad():  # same starting weights: the layouts match shard for shard
        for (name, ours), (other, theirs) in zip(engine.model.named_parameters(), hand.model.named_parameters()):
            assert name == other, (name, other)
            local(theirs).copy_(local(ours))
    runners = {"engine": engine.step, "handwritten": hand.step}
    # The hand-written step returns this rank's loss; average it as the engine does.
    first_losses = {name: global_mean(torch.tensor(fn(0)), engine.dims.data.get_group())
                    for name, fn in runners.items()}
    for step in range(1, WARMUP_STEPS):
        for fn in runners.values():
            fn(step)
    times = {name: [] for name in runners}
    ratios = []
    for index in range(pairs):
        # Alternate which runs first, so that neither always follows the other's step.
        order = list(runners) if index % 2 == 0 else list(reversed(runners))
        pair = {name: timed(runners[name], WARMUP_STEPS + index)[0] for name in order}
        for name, seconds in pair.items():
            times[name].append(seconds)
        ratios.append(pair["engine"] / pair["handwritten"])
    quartiles = statistics.quantiles(ratios, n=4)
    if dist.get_rank() == 0:
        print(f"mesh {spec} on {dist.get_world_size()} ranks, {engine.cfg.model.name}/{engine.cfg.model.flavor}, "
              f"batch 16 x 64, "
              f"{pairs} interleaved step pairs after {WARMUP_STEPS} warm-up steps")
        print(f"step-0 loss (same weights and batch, so equal up to rounding): engine "
              f"{first_losses['engine']:.6f}, handwritten {first_losses['handwritten']:.6f}")
        for name, seconds in times.items():
            print(f"{name:>12}: median step {statistics.median(seconds) * 1e3:.1f} ms "
                  f"(min {min(seconds) * 1e3:.1f}, max {max(seconds) * 1e3:.1f})")
        print(f"ratio engine/handwritten per pair: median {statistics.median(ratios):.3f}, "
              f"quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f}")
        # The fastest step of each is the one least disturbed by other processes.
        print(f"ratio of the fastest steps: {min(times['engine']) / min(times['handwritten']):.3f}")
    dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
