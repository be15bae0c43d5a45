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


def largest_over_ranks(device: torch.device) -> tuple[float, float]:
    """(current, peak) of the rank that holds the most: the one that runs out first."""
    values = torch.tensor(rank_memory(device), device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    current, peak = values.tolist()
    return current, peak
