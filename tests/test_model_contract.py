"""The model contract (models/contract.py): what a model must provide is checked on the
meta model before any process group starts; every shipped model trains through the
launcher, not only through --parity (real launches: torchrun, gloo, CPU)."""

import pytest
import torch
from torch import nn

from engine.errors import UserError
from models import build_on_meta
from models.contract import OPTIONAL, REQUIRED, check_model_contract
from tests.distributed import REPO, launcher
from tests.test_cli import assert_clean_error, losses


@pytest.mark.parametrize("name,flavor", [("llama", "debug"), ("llama", "debug_tied"), ("gpt2", "debug")])
def test_shipped_models_meet_the_contract(name, flavor):
    check_model_contract(build_on_meta(name, flavor), name)


class Bare(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)


def complete(model):
    model.args = type("Args", (), {"vocab_size": 8, "max_seq_len": 16})()
    model.init_value = lambda fqn, shape, generator: torch.zeros(shape)
    model.reset_buffers = lambda: None
    return model


@pytest.mark.parametrize("member", [m for m, _, _ in REQUIRED])
def test_each_missing_required_member_is_named(member):
    model = complete(Bare())
    if member.startswith("args."):
        delattr(type(model.args), member.split(".")[1])
    else:
        delattr(model, member)
    with pytest.raises(UserError, match=f"lacks {member} .*docs/plans.md, section \"The model contract\""):
        check_model_contract(model, "bare")


def test_shared_parameters_need_tie_weights():
    model = complete(Bare())
    model.head.weight = model.embed.weight
    with pytest.raises(UserError, match=r"shares parameters \(head.weight\) but has no tie_weights\(\)"):
        check_model_contract(model, "bare")
    model.tie_weights = lambda: None
    check_model_contract(model, "bare")


def test_docs_table_lists_every_member():
    text = (REPO / "docs" / "plans.md").read_text()
    section = text[text.index("## The model contract"):]
    for member, _, _ in REQUIRED + OPTIONAL:
        assert f"`{member}" in section, member


def test_missing_member_exits_2_before_any_process_group():
    assert_clean_error(launcher("--mesh", "dp=2", "--set", "model.plugin=tests.incomplete_model,examples.gpt2_plan",
                                "--set", "model.name=no_init", "--set", "parallel.plan=gpt2", timeout=60),
                       "model 'no_init' (NoInitGPT2) lacks init_value", "docs/plans.md")


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["dp=2", "dp=2,tp=2"])
def test_model_added_through_the_plan_api_trains(tmp_path, mesh):
    """The command from docs/plans.md: GPT-2 (no flops_per_token of its own) through
    examples/gpt2_plan.py, trained by the launcher; the loss falls."""
    result = launcher("--mesh", mesh, "--set", "model.plugin=examples.gpt2_plan", "--set", "model.name=gpt2",
                      "--set", "model.flavor=debug", "--set", "parallel.plan=gpt2",
                      "--set", "training.steps=6", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan gpt2" in result.stdout and "MFLOP per token" in result.stdout
    run = losses(tmp_path)
    assert len(run) == 6 and run[-1] < run[0] - 0.5
