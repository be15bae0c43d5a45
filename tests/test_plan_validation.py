"""Plan validation on a meta-device model: no process group, no memory."""

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel

import parallel  # noqa: F401
from common.config import ParallelConfig, load_config
from common.errors import UserError
from models import build_on_meta
from parallel.apply import tensor_parallel_styles
from parallel.mesh import parse_mesh
from parallel.plan import Plan, get_plan, plan_of
from parallel.reshard import resolve_reshard
from parallel.validate import validate_plan


def check(plan, tp, model=None, **options):
    model = model or build_on_meta("llama", "debug")
    config = ParallelConfig(**options)
    validate_plan(model, plan, tensor_parallel_styles(model, plan, config), tp, config.sequence_parallel)


def test_builtin_plan_passes_where_heads_divide():
    for tp in (1, 2, 4):
        check(get_plan("llama"), tp, sequence_parallel=True)


def test_kv_heads_must_divide_over_tp():
    with pytest.raises(UserError) as err:
        check(get_plan("llama"), 8)
    assert "'layers.0.attention.wk'" in str(err.value) and "4 units of 32" in str(err.value)


def test_pattern_that_matches_nothing_is_named():
    plan = Plan("typo", blocks="layers.*", tensor_parallel={"layers.*.attn.wq": ColwiseParallel()})
    with pytest.raises(UserError, match="pattern 'layers.\\*.attn.wq' matches no module of Llama"):
        check(plan, 2)


def test_blocks_pattern_is_checked():
    with pytest.raises(UserError, match="pattern 'blocks.\\*' matches no module"):
        check(Plan("typo", blocks="blocks.*"), 2)


def test_style_on_a_module_it_cannot_shard():
    plan = Plan("bad", blocks="layers.*", tensor_parallel={"layers.*.attention": ColwiseParallel()})
    with pytest.raises(UserError) as err:
        check(plan, 2)
    assert "ColwiseParallel on 'layers.0.attention', a Attention" in str(err.value)


def test_dimension_not_divisible_without_units():
    plan = Plan("bad", blocks="layers.*", tensor_parallel={"layers.*.feed_forward.w1": ColwiseParallel()})
    with pytest.raises(UserError, match="output features of 'layers.0.feed_forward.w1' \\(768\\) over tp=5"):
        check(plan, 5)


def test_sequence_parallel_needs_plan_entries():
    import examples.gpt2_plan  # noqa: F401  (registers "gpt2")
    with pytest.raises(UserError, match="plan 'gpt2' has no sequence-parallel entries"):
        check(get_plan("gpt2"), 2, model=build_on_meta("gpt2", "debug"), sequence_parallel=True)


@pytest.mark.parametrize("setting,mesh,expected", [
    (True, "dp=4", True), (False, "dp=4", False), (2, "dp=4,tp=2", 2), (4, "dp=4", True),
    (1, "dp=4", False), (2, "hsdp=2,dp=4", 2)])
def test_reshard_values(setting, mesh, expected):
    assert resolve_reshard(setting, parse_mesh(mesh)) == expected


def test_auto_reshard_uses_ranks_per_node():
    spec = parse_mesh("hsdp=2,dp=8,tp=2")  # 32 ranks; 8 per node -> 4 shard ranks per node
    assert resolve_reshard("auto", spec, local_world_size=8) == 4
    assert resolve_reshard("auto", parse_mesh("dp=4,tp=2"), local_world_size=8) is True


@pytest.mark.parametrize("setting", [3, 0, 8, "sometimes"])
def test_bad_reshard_values(setting):
    with pytest.raises(UserError, match="reshard_after_forward"):
        resolve_reshard(setting, parse_mesh("dp=4,tp=2"))


def test_an_unset_plan_follows_the_model_name():
    """parallel.plan unset takes the plan named after model.name, Llama's for a model with
    no plan of its name; a set one wins."""
    assert plan_of(load_config(None)).name == "llama"
    assert plan_of(load_config(None, ["model.name=llama_moe"])).name == "llama_moe"
    assert plan_of(load_config("configs/debug.yaml", ["model.name=llama_moe"])).name == "llama_moe"
    assert plan_of(load_config(None, ["model.name=llama_moe", "parallel.plan=llama"])).name == "llama"
    assert plan_of(load_config(None, ["model.name=unplanned"])).name == "llama"
