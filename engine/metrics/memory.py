"""Memory a rank holds: device memory on GPU, the process's resident set on CPU."""

from __future__ import annotations

import os
import resource

import torch
import torch.distributed as dist

GIB = 1024 ** 3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_memory(device: torch.device) -> tuple[float, float]:
    """(current, peak) in GiB: allocated tensors on CUDA; RSS and its high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / GIB, torch.cuda.max_memory_allocated(device) / GIB
    # ru_maxrss is in KiB on Linux.
    return _rss_bytes() / GIB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


class LargestOverRanks:
    """(current, peak) of the rank that holds the most: the one that runs out first.

    `start()` reads this rank's memory and launches the MAX all-reduce without waiting;
    `result()` waits for it. Started right after backward, the reduction overlaps with the
    loss reduction and the optimizer step instead of making every rank meet once more per
    step, which cost about 2% of the step on a 2-core CPU (docs/benchmarks.md)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.values: torch.Tensor | None = None
        self.work = None

    def start(self) -> None:
        self.values = torch.tensor(rank_memory(self.device), device=self.device, dtype=torch.float64)
        if dist.is_initialized():
            self.work = dist.all_reduce(self.values, op=dist.ReduceOp.MAX, async_op=True)

    def result(self) -> tuple[float, float]:
        if self.work is not None:
            self.work.wait()
        current, peak = self.values.tolist()
        return current, peak
