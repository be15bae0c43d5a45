"""What checking every batch's token ids costs, against a step of the debug model.

usage: torchrun --nproc_per_node N bench/token_check.py MESH [STEPS, default 40]
   e.g. OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/token_check.py dp=2 40

Rank 0 prepares data/corpus.txt into a token folder (byte tokenizer). Each step then
times, on rank 0 and each from a barrier: reading this rank's rows of the step's batch
without the check (a TokenSource that knows no vocabulary), reading them as the loop
does (the ids checked against the model's vocabulary as each window is read, then the
ranks' agreement, a one-integer all-reduce; engine/train.py: agree_on_ids), and the
loop's whole step (engine.train.logged_step). The cost of the check is the difference
of the first two medians; it is printed as a share of the median step.
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

from common.config import load_config  # noqa: E402
from engine.data.sources import TokenSource, build_source, local_batch  # noqa: E402
from engine.metrics.log import StepLog  # noqa: E402
from engine.train import agree_on_ids, build_optimizer, host_group, logged_step, run_shape  # noqa: E402
from launch.build import sharded_model, start_process_group  # noqa: E402
from launch.prepare import prepare  # noqa: E402
from models.contract import vocab_size  # noqa: E402
from parallel.mesh import parse_mesh  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 3


def timed(fn) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    mesh_text = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    warnings.filterwarnings("ignore")
    scratch = Path(tempfile.gettempdir()) / f"token-check-{os.environ.get('TORCHELASTIC_RUN_ID', 'bench')}"
    cfg = load_config(None, ["data.source=tokens", f"data.path={scratch / 'tokens'}",
                             f"training.steps={WARMUP_STEPS + steps}", f"run.dir={scratch / 'run'}"])
    spec = parse_mesh(mesh_text).resolve(int(os.environ["WORLD_SIZE"]))
    if os.environ["RANK"] == "0" and not (scratch / "tokens").exists():
        prepare([str(REPO / "data" / "corpus.txt")], str(scratch / "tokens"))
    dims, device = start_process_group(cfg, spec)
    dist.barrier()  # the folder is there for every rank
    model, _ = sharded_model(cfg, dims, device)
    vocab = vocab_size(model)
    checked, group = build_source(cfg, vocab), host_group()
    unchecked = TokenSource(cfg.data.path, cfg.training.seed, cfg.training.global_batch, cfg.training.seq_len)
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.training.steps)
    log = StepLog(cfg.training.steps, cfg.run.dir, enabled=dist.get_rank() == 0, stream=open(os.devnull, "w"))
    shape = run_shape(model, cfg, device)
    t = cfg.training

    def rows(source):
        return lambda step: local_batch(source, step, t.global_batch, t.seq_len, dims.data_rank, dims.data_size)

    plain, agreed = rows(unchecked), rows(checked)
    times = {"read, unchecked": [], "read, checked and agreed": [], "step": []}
    for step in range(WARMUP_STEPS + steps):
        read = timed(lambda: plain(step))
        checked_read = timed(lambda: agree_on_ids(lambda: agreed(step), checked, group))
        whole = timed(lambda: logged_step(model, optimizer, scheduler, checked, step, cfg, dims, device, log, shape,
                                          ids_group=group))
        if step >= WARMUP_STEPS:
            for name, seconds in zip(times, (read, checked_read, whole)):
                times[name].append(seconds)
    if dist.get_rank() == 0:
        medians = {name: statistics.median(seconds) for name, seconds in times.items()}
        cost = medians["read, checked and agreed"] - medians["read, unchecked"]
        print(f"mesh {spec} on {dist.get_world_size()} ranks, debug model, batch {t.global_batch} x {t.seq_len} "
              f"tokens, {steps} steps after {WARMUP_STEPS} warm-up steps, torch {torch.__version__}")
        for name, median in medians.items():
            print(f"{name:>26}: median {median * 1e3:.3f} ms")
        print(f"the check costs {cost * 1e3:.3f} ms a step, {100 * cost / medians['step']:.2f}% of the median step")
    dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
