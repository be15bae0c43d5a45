"""Run under two torchrun agents by tests/test_multinode.py: on the first attempt rank 5
exits at once, so only its own agent counts a restart, and the other agent restarts
its workers because the rendezvous changed. The second attempt must still form one
process group (parallel/process_group.py) and all-reduce across both nodes."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel.process_group import exit_without_teardown, init_process_group  # noqa: E402

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    if rank == 5 and not Path(sys.argv[1]).exists():
        Path(sys.argv[1]).write_text("rank 5 left the first attempt")
        sys.exit(1)
    init_process_group("gloo")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"rank {rank} restart count {os.environ['TORCHELASTIC_RESTART_COUNT']} sum {total.item():.0f}", flush=True)
    dist.destroy_process_group()
    exit_without_teardown(0)
