"""Fixtures shared by several test modules."""

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    """Deselect (not skip) the tests marked gpus(N) when this machine shows fewer than N
    CUDA devices: they can only run on a larger machine (tests/test_cuda.py)."""
    needs_more = [item for item in items
                  if (mark := item.get_closest_marker("gpus")) and mark.args[0] > torch.cuda.device_count()]
    if needs_more:
        config.hook.pytest_deselected(items=needs_more)
        items[:] = [item for item in items if item not in needs_more]


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo process group in the pytest process, for code that needs one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
