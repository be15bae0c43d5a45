"""Config loading and --set overrides: unknown keys and wrong types are named."""

import pytest

from common.config import load_config
from common.errors import UserError
from launch.run import DEFAULT_CONFIG


def test_default_config_loads():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.parallel.mesh == "dp=4,tp=2" and cfg.model.flavor == "debug"


def test_overrides_are_typed():
    cfg = load_config(DEFAULT_CONFIG, ["training.steps=7", "optim.lr=1", "data.source=synthetic"])
    assert cfg.training.steps == 7 and cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.data.source == "synthetic"


def test_yaml_text_that_is_a_number_where_one_is_expected():
    """YAML 1.1 reads 1e-3 (no dot) as text; a float key takes it, a text key takes 3."""
    cfg = load_config(DEFAULT_CONFIG, ["optim.lr=1e-3", "data.weights=3", "optim.eps=1.0e-6"])
    assert cfg.optim.lr == 1e-3 and cfg.data.weights == "3" and cfg.optim.eps == 1e-6
    with pytest.raises(UserError, match="optim.lr must be of type float, but got 'fast'"):
        load_config(DEFAULT_CONFIG, ["optim.lr=fast"])


@pytest.mark.parametrize("override,fragment", [
    ("training.step=3", "unknown config key 'training.step'. Accepted keys in section 'training': steps,"),
    ("trainig.steps=3", "unknown config key 'trainig.steps'. Keys are section.key, with sections model,"),
    ("steps=3", "unknown config key 'steps'"),
    ("training.steps=three", "training.steps must be of type int, but got 'three'"),
    ("training.steps=2.5", "training.steps must be of type int"),
    ("training.steps=true", "training.steps must be of type int"),
    ("training.steps=0", "training.steps must be a whole number above 0, but got 0"),
    ("parallel.device=tpu", "accepted values: auto, cpu, cuda"),
    ("training.steps", "expected section.key=value"),
    ("parallel.pp_schedule=Zero", "accepted values: GPipe, 1F1B, Interleaved1F1B"),
    ("parallel.pp_stages_per_rank=0", "pp_stages_per_rank must be a whole number in [1, 2**63 - 1]"),
    ("parallel.pp_split=2,,2", "blocks of each pipeline stage, comma-separated whole numbers"),
    ("parallel.pp_split=2,x", "blocks of each pipeline stage"),
    ("parallel.pp_split=-2", "blocks of each pipeline stage"),
    ("dryrun.pp=", "the pipeline sizes --plan-for searches"),
    ("dryrun.pp=1,x", "the pipeline sizes --plan-for searches"),
    ("dryrun.ep=0", "the ep degrees --plan-for searches"),
    ("dryrun.ep=8,", "the ep degrees --plan-for searches"),
])
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(UserError) as err:
        load_config(DEFAULT_CONFIG, [override])
    assert fragment in str(err.value)


def test_pipeline_keys_take_their_valid_values():
    cfg = load_config(DEFAULT_CONFIG, ["parallel.pp_schedule=ZBVZeroBubble", "parallel.pp_stages_per_rank=2",
                                       "parallel.pp_split=1, 2,1", "dryrun.pp=1,2,4"])
    assert (cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank) == ("ZBVZeroBubble", 2)
    assert (cfg.parallel.pp_split, cfg.dryrun.pp) == ("1, 2,1", "1,2,4")
    assert load_config(DEFAULT_CONFIG, ["parallel.pp_split=", "dryrun.pp=8"]).dryrun.pp == "8"


def test_bad_yaml_keys_name_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  stepz: 3\n")
    with pytest.raises(UserError, match="unknown config key 'training.stepz'"):
        load_config(path)
    path.write_text("optimizer:\n  lr: 3\n")
    with pytest.raises(UserError, match="unknown config key 'optimizer.lr'"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
