"""Start the default process group, also on a job that torchrun has restarted.

torchrun's workers share the agent's TCPStore, and on torch 2.13 that store keeps
its keys across `--max-restarts` restarts. gloo then reads the previous attempt's
peer addresses and fails with "connectFullMesh ... Connection refused", so every
restart would fail. Prefixing the keys with the attempt number keeps attempts apart.
"""

from __future__ import annotations

import os
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout


def init_process_group(backend: str) -> None:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=default_pg_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=default_pg_timeout)
