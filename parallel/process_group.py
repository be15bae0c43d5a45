"""Start the default process group, also on a job that torchrun has restarted.

torchrun's workers share the agent's TCPStore, and that store keeps its keys across
`--max-restarts` restarts: gloo then reads the previous attempt's peer addresses and
fails with "connectFullMesh ... Connection refused". A key prefix per attempt is not
enough on several nodes: TORCHELASTIC_RESTART_COUNT differs between nodes when one
agent restarts because of a failure and another because the rendezvous changed, and
anything else written to the agent's store may be left over from an attempt whose
ranks died before they wrote again.

So each attempt's rank 0 hosts a fresh TCPStore for the process group and announces
its port, with a random tag, through the agent's store. A rank that reads an earlier
attempt's announcement finds no store there, or one without that tag (the port was
reused), and reads the announcement again until this attempt's appears.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

ANNOUNCEMENT = "meshtrain/process-group-store"
TAG = "meshtrain/tag"
CONNECT_TIMEOUT = timedelta(seconds=5)
# How long the other ranks look for this attempt's store before giving up.
ROUND_TIMEOUT = timedelta(minutes=10)


def host_round_store(agent_store, host: str, world_size: int):
    tag = uuid.uuid4().hex
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=default_pg_timeout,
                          wait_for_workers=False)
    store.set(TAG, tag)
    agent_store.set(ANNOUNCEMENT, f"{store.port}:{tag}")
    return store


def listening(host: str, port: int) -> bool:
    """A plain connect, which fails at once on a closed port (TCPStore would keep retrying)."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT.total_seconds()):
            return True
    except OSError:
        return False


def join_round_store(agent_store, host: str, world_size: int):
    deadline = time.monotonic() + ROUND_TIMEOUT.total_seconds()
    while True:
        port, tag = agent_store.get(ANNOUNCEMENT).decode().split(":")
        if listening(host, int(port)):
            try:
                store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=CONNECT_TIMEOUT)
                if store.get(TAG).decode() == tag:
                    store.set_timeout(default_pg_timeout)
                    return store
            except RuntimeError:  # a store of something else on a reused port, or none by now
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 of this attempt did not announce its process-group store "
                               f"within {ROUND_TIMEOUT} (last announcement read: port {port}).")
        time.sleep(0.2)


def init_process_group(backend: str) -> None:
    if dist.is_initialized():  # a process that runs several jobs keeps one (tests/shared_parity_worker.py)
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Global rank 0 runs on the node of the agent that hosts the agent's store.
    host = os.environ["MASTER_ADDR"]
    agent_store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=default_pg_timeout)
    store = (host_round_store if rank == 0 else join_round_store)(agent_store, host, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=default_pg_timeout)


def exit_without_teardown(code: int) -> NoReturn:
    """Leave the process without interpreter teardown. On torch 2.13 CPU about one exit in
    ten after destroy_process_group aborts with SIGABRT ("terminate called without an active
    exception"), after the results are printed: gloo's worker threads can still hold tensors
    that finalization frees without a live interpreter (pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
