"""parallel/fsdp_internals.py on the torch that runs the suite (`make test-compat` runs
it on the others): everything it touches is there, and it finds the parameter groups of
a real fully_shard-ed module (a one-rank gloo group in this process)."""

import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common.config import Config
from common.errors import UserError
from models import build_on_meta
from models.materialise import materialise
from parallel.apply import apply_plan
from parallel.explain import explain
from parallel.mesh import MeshSpec, build_mesh
from parallel.plan import plan_of
from parallel import fsdp_internals
from tests.distributed import REPO, cpu_env


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


@pytest.mark.compat
def test_this_torch_reduces_as_the_in_place_reduce_expects():
    assert fsdp_internals.reduces_in_place()


def _trained_gradients(in_place: bool):
    """Two steps of two micro-batches, bf16 compute and fp32 reduce, gradients kept across
    the steps (FSDP adds the second step's to the first's): every FSDP reduce path that a
    one-rank run takes, returning the gradients and how many reduces skipped their copy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.GELU()) for _ in range(3)],
                                torch.nn.Linear(48, 5))
    mesh = init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model[:3]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    comms = [fsdp_internals.reduce_in_place(unit) for unit in (*model[:3], model)] if in_place else []
    batch = torch.randn(2, 2, 16, 48, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            model(batch[step, micro]).float().pow(2).mean().backward()
    return [p.grad.to_local().clone() for p in model.parameters()], sum(comm.aliased for comm in comms)


@pytest.mark.compat
def test_one_rank_reduce_in_place_gives_fsdps_gradients_bitwise_without_the_copy(one_rank_group):
    plain, _ = _trained_gradients(in_place=False)
    in_place, aliased = _trained_gradients(in_place=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, in_place))
    assert aliased == 4 * 2  # every unit's reduce, both steps


def test_the_in_place_reduce_refuses_a_real_reduce_scatter():
    comm = fsdp_internals._one_rank_reduce_class()()
    group = type("Group", (), {"size": lambda self: 2})()
    with pytest.raises(AssertionError, match="over 2 ranks"):
        comm(torch.empty(2), torch.empty(4), group, None)


def test_the_one_rank_reduce_benchmark_runs_and_its_two_sides_agree():
    """bench/one_rank_reduce.py at a small size (its timings are docs/benchmarks.md's)."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "one_rank_reduce.py"), "--width", "64",
                             "--depth", "2", "--tokens", "8", "--pairs", "4"],
                            capture_output=True, text=True, timeout=300, env=cpu_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradients bitwise equal: True" in result.stdout and "ratio in place / copy" in result.stdout


def test_the_plan_reduces_in_place_on_every_unit_of_a_one_rank_shard_group(one_rank_group):
    """apply_plan on the debug model over a one-rank mesh: its 4 blocks and the root, and
    --explain's line. (Where the shard group is larger, the comm is not installed: its
    __call__ raises, so every multi-rank dp test would fail if it were.)"""
    cfg = Config()
    model = build_on_meta(cfg.model.name, cfg.model.flavor)
    applied = apply_plan(model, plan_of(cfg), build_mesh(MeshSpec(dp=1), "cpu"), cfg.parallel)
    assert applied.reduced_in_place == 5
    materialise(model, "cpu", cfg.training.seed)
    assert "gradients reduced in place on 5 FSDP units" in explain(applied.model, applied)
