"""FSDP2's reduce over a one-rank group, as FSDP does it (a copy of every gradient) and
as the engine does it (parallel/fsdp_internals.py: reduce_in_place, no copy), on a stack
of square linears in one process (docs/benchmarks.md).

usage: python bench/one_rank_reduce.py [--width 4096] [--depth 4] [--tokens 64] [--pairs 20]

Both models start from the same weights and take the same batches; each pair times one
step (forward, backward, FSDP's reduce) of each, alternating which goes first. Prints
the median step of each, the median and quartiles of the per-pair ratios in place /
copy, and whether the gradients were bitwise equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from parallel.fsdp_internals import reduce_in_place, reduces_in_place  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402


def sharded_stack(width: int, depth: int, in_place: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
    mesh = init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if in_place:
        for unit in (*model, model):
            reduce_in_place(unit)
    return model


def step(model: nn.Module, batch: torch.Tensor) -> float:
    started = time.perf_counter()
    model(batch).pow(2).mean().backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=20)
    args = parser.parse_args()
    if not reduces_in_place():
        sys.exit(f"torch {torch.__version__}'s FSDP reduces differently; the engine keeps FSDP's copy on it")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    models = {"copy": sharded_stack(args.width, args.depth, False),
              "in place": sharded_stack(args.width, args.depth, True)}
    batch = torch.randn(args.tokens, args.width, generator=torch.Generator().manual_seed(1))
    for model in models.values():
        model(batch).pow(2).mean().backward()
    copied, in_place = ([p.grad.to_local().clone() for p in model.parameters()] for model in models.values())
    bitwise = all(torch.equal(a, b) for a, b in zip(copied, in_place))
    for model in models.values():
        model.zero_grad(set_to_none=True)
    times = {name: [] for name in models}
    for index in range(args.pairs):
        for name in (list(models) if index % 2 == 0 else list(reversed(models))):
            times[name].append(step(models[name], batch))
    ratios = [b / a for a, b in zip(times["copy"], times["in place"])]
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"torch {torch.__version__}, {args.depth} x Linear({args.width}) fp32, {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads, {args.pairs} interleaved pairs")
    for name, seconds in times.items():
        print(f"{name:>9}: median step {statistics.median(seconds) * 1e3:.1f} ms")
    print(f"ratio in place / copy per pair: median {statistics.median(ratios):.3f}, "
          f"quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f}; gradients bitwise equal: {bitwise}")
    dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
