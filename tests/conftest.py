"""Fixtures shared by several test modules."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo process group in the pytest process, for code that needs one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
