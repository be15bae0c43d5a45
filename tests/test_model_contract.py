"""The model contract (models/contract.py): what a model must provide is checked on the
meta model before any process group starts; every shipped model trains through the
launcher, not only through --parity (real launches: torchrun, gloo, CPU); a model with
nothing engine-specific is initialised through its layers' reset_parameters()."""

import pytest
import torch
from torch import nn

from common.errors import UserError
from models import build_on_meta
from models.contract import MEMBERS, check_model_contract, vocab_size
from models.materialise import materialise, parameter_seed
from tests.distributed import REPO, launcher, parity_report
from tests.test_cli import assert_clean_error, losses


@pytest.mark.parametrize("name,flavor", [("llama", "debug"), ("llama", "debug_tied"), ("gpt2", "debug")])
def test_shipped_models_meet_the_contract(name, flavor):
    check_model_contract(build_on_meta(name, flavor), name)


class Bare(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def test_a_plain_module_meets_the_contract():
    check_model_contract(Bare(), "bare")
    assert vocab_size(Bare()) == 8


def test_a_parameter_without_reset_parameters_is_named():
    model = Bare()
    model.gate = Gate()
    with pytest.raises(UserError, match=r"no init_distribution or init_value, and module 'gate' holds parameters "
                                        r"but has no "
                                        r"reset_parameters\(\).*docs/plans.md"):
        check_model_contract(model, "bare")
    model.init_value = lambda fqn, shape, generator: torch.zeros(shape)
    check_model_contract(model, "bare")


def test_buffers_need_reset_buffers():
    model = Bare()
    model.register_buffer("table", torch.zeros(3))
    with pytest.raises(UserError, match=r"has buffers \(table\) but no reset_buffers\(\)"):
        check_model_contract(model, "bare")
    model.reset_buffers = lambda: None
    check_model_contract(model, "bare")


def test_vocabulary_needs_an_embedding_or_args():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(UserError, match="neither args.vocab_size nor an nn.Embedding"):
        check_model_contract(model, "linear")
    model.args = type("Args", (), {"vocab_size": 11})()
    assert vocab_size(model) == 11


def test_shared_parameters_need_tie_weights():
    model = Bare()
    model.head.weight = model.embed.weight
    with pytest.raises(UserError, match=r"shares parameters \(head.weight\) but has no tie_weights\(\)"):
        check_model_contract(model, "bare")
    model.tie_weights = lambda: None
    check_model_contract(model, "bare")


def test_reset_parameters_are_seeded_by_module_path():
    """Each module's values are exactly what its own reset_parameters() draws under the
    seed of its path, whatever else the model holds; a different seed changes them."""
    with torch.device("meta"):
        model = Bare()
    materialise(model, "cpu", seed=3)
    for path in ("embed", "head"):
        fresh = Bare()
        torch.manual_seed(parameter_seed(3, path))
        getattr(fresh, path).reset_parameters()
        assert torch.equal(getattr(model, path).weight, getattr(fresh, path).weight), path
    with torch.device("meta"):
        other = Bare()
    materialise(other, "cpu", seed=4)
    assert not torch.equal(model.head.weight, other.head.weight)


def test_docs_table_lists_every_member():
    text = (REPO / "docs" / "plans.md").read_text()
    section = text[text.index("## The model contract"):]
    for member, *_ in MEMBERS:
        assert f"`{member}" in section, member


def test_missing_member_exits_2_before_any_process_group():
    assert_clean_error(launcher("--mesh", "dp=2", "--set", "model.plugin=tests.incomplete_model,examples.gpt2_plan",
                                "--set", "model.name=no_init", "--set", "parallel.plan=gpt2", timeout=60),
                       "model 'no_init' (NoInitGPT2) has no init_distribution or init_value, and module 'gate'", "docs/plans.md")


PLAIN = ("--set", "model.plugin=examples.plain_model", "--set", "model.name=plain",
         "--set", "model.flavor=tiny", "--set", "parallel.plan=plain")


@pytest.mark.distributed
def test_a_plain_module_trains_and_matches_one_device(tmp_path):
    """examples/plain_model.py has no engine-specific member. At dp=2,tp=2 its sharded
    weights come from the same reset_parameters() draws as the single-device reference's:
    --parity (fp32, the default tolerances of docs/parity.md) passes; then it trains."""
    report, code = parity_report(tmp_path, "dp=2,tp=2", *PLAIN[1::2])
    assert code == 0 and report["verdict"] == "PASS", report
    result = launcher("--mesh", "dp=2", *PLAIN, "--set", "training.steps=6", "--set", f"run.dir={tmp_path}/train")
    assert result.returncode == 0, result.stderr[-3000:]
    run = losses(tmp_path / "train")
    assert len(run) == 6 and run[-1] < run[0] - 0.3


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
