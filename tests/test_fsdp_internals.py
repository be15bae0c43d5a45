"""parallel/fsdp_internals.py on the torch that runs the suite (`make test-compat` runs
it on the others): everything it touches is there, and it finds the parameter groups of
a real fully_shard-ed module (a one-rank gloo group in this process)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common.errors import UserError
from parallel import fsdp_internals


@pytest.mark.compat
def test_every_internal_it_touches_is_there():
    assert fsdp_internals.missing_internals() == []
    fsdp_internals.check_supported()


@pytest.mark.compat
def test_param_groups_of_a_sharded_module(one_rank_group):
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    groups = fsdp_internals.param_groups(module)
    assert len(groups) == 1 and len(groups[0].fsdp_params) == 4


def test_a_torch_without_them_is_refused_with_the_alternatives(monkeypatch):
    monkeypatch.setitem(fsdp_internals.NEEDED, "torch.distributed.fsdp._fully_shard._fsdp_param.NoSuchClass", ())
    with pytest.raises(UserError, match="NoSuchClass.*reshard_after_forward=true or false with tp > 1"):
        fsdp_internals.check_supported()
