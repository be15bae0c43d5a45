"""Hugging Face Llama checkpoints in and out (engine/checkpoint/hf.py, models/llama_hf.py).

Tiny random LlamaForCausalLM models (transformers, fp32, Llama 3.1 rope scaling) are
saved with save_pretrained; the engine imports them on one process and at dp=2,tp=2
(one torchrun launch, tests/hf_worker.py), and its logits must equal transformers' within
1e-5. Exports must hold bitwise the imported tensors and load in transformers. Broken
checkpoints exit 2 naming the tensor. The transformers-free cases write their folder
with the engine's own writer, so they also run on other torch versions (compat).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil

import pytest
import torch

from engine.checkpoint.hf import (CONFIG, INDEX, SINGLE, check_hf_checkpoint, load_hf, read_hf_config,
                                  register_hf_flavor, tensor_index, write_hf_folder)
from common.errors import UserError
from models import build_on_meta
from models.llama import FLAVORS, Llama, LlamaArgs, rope_frequencies
from models.llama_hf import args_from_hf_config, hf_config_from_args, hf_name, our_name
from models.materialise import materialise
from tests.distributed import REPO, launcher, torchrun
from tests.test_cli import assert_clean_error, refused

TOLERANCE = 1e-5  # fp32 logits, ours against transformers'
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        # 64 puts this head size's wavelengths on all three sides of the interpolation band
        "original_max_position_embeddings": 64}
TINY = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=96, max_seq_len=256,
                 rope_theta=500000.0, norm_eps=1e-5, rope_scaling=(8.0, 1.0, 4.0, 64))


def hf_model(tied: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0 if not tied else 1)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=96, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=ROPE,
        tie_word_embeddings=tied, bos_token_id=5, eos_token_id=6, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """name -> (folder, transformers model): untied and tied in one model.safetensors,
    and untied in several files with model.safetensors.index.json."""
    root = tmp_path_factory.mktemp("hf")
    folders = {}
    for name, tied, shard in (("untied", False, None), ("tied", True, None), ("sharded", False, "60KB")):
        model = hf_model(tied)
        model.save_pretrained(root / name, **({"max_shard_size": shard} if shard else {}))
        folders[name] = (root / name, model)
    assert (root / "sharded" / INDEX).is_file() and len(list((root / "sharded").glob("*.safetensors"))) >= 2
    return folders


def read_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


# -- the mapping ------------------------------------------------------------------------

def test_names_map_both_ways():
    model = build_on_meta("llama", "debug_tied")
    names = list(model.state_dict())
    assert [our_name(hf_name(n)) for n in names] == names
    assert hf_name("layers.3.feed_forward.w1.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert hf_name("layers.3.feed_forward.w3.weight") == "model.layers.3.mlp.up_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    for bad in ("layers.0.attention.wx.weight", "rope_cos"):
        with pytest.raises(KeyError):
            hf_name(bad)
    with pytest.raises(KeyError):
        our_name("model.layers.0.self_attn.q_norm.weight")


def test_config_round_trip():
    for args in (TINY, FLAVORS["1B"], FLAVORS["debug_tied"]):
        assert args_from_hf_config(json.loads(json.dumps(hf_config_from_args(args))), "x") == args


def test_existing_flavors_keep_their_rope():
    args = FLAVORS["8B"]
    half = args.head_dim // 2
    old = 1.0 / (args.rope_theta ** (torch.arange(half, dtype=torch.float32) / half))
    assert torch.equal(rope_frequencies(args), old)
    assert not torch.equal(rope_frequencies(TINY), rope_frequencies(dataclasses.replace(TINY, rope_scaling=None)))


BASE = hf_config_from_args(TINY)


@pytest.mark.parametrize("change,fragments", [
    ({"attention_bias": True}, ["attention_bias=True", "no biases"]),
    ({"mlp_bias": True}, ["mlp_bias=True"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "silu"]),
    ({"model_type": "mistral"}, ["model_type='mistral'", "Llama"]),
    ({"architectures": ["LlamaForSequenceClassification"]}, ["architectures=", "LlamaForCausalLM"]),
    ({"head_dim": 32}, ["head_dim=32", "16"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope_scaling.rope_type='yarn'", "'llama3'"]),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     ["rope_parameters.rope_type='dynamic'"]),
    ({"num_hidden_layers": None}, ["no 'num_hidden_layers'"]),
    ({"vocab_size": "96"}, ["vocab_size='96'", "integer"]),
])
def test_unsupported_configs_are_refused(change, fragments):
    with pytest.raises(UserError) as err:
        args_from_hf_config({**BASE, **change}, "cfg.json")
    for fragment in ["cfg.json", *fragments]:
        assert fragment in str(err.value), err.value


def test_transformers_5_config_layout(hf_folders):
    """save_pretrained in transformers 5 writes rope_parameters (with rope_theta inside);
    our export writes rope_theta/rope_scaling, which transformers reads back the same."""
    transformers = pytest.importorskip("transformers")
    folder, _ = hf_folders["untied"]
    written = read_hf_config(folder)
    assert args_from_hf_config(written, "x") == TINY
    config = hf_config_from_args(TINY)
    ours = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    theirs = transformers.LlamaConfig.from_pretrained(folder)
    assert ours.rope_parameters == theirs.rope_parameters


# -- one process --------------------------------------------------------------------------

def single_device(folder):
    """What --parity's reference gets: the launcher's checks, then single_device_model."""
    from launch.build import single_device_model
    from launch.run import check, parse_args
    cfg, _ = check(parse_args(["--mesh", "dp=1", "--set", f"checkpoint.hf_import={folder}",
                               "--set", "data.source=synthetic", "--set", "training.seq_len=48",
                               "--set", "training.global_batch=4", "--parity"]), 1)
    assert cfg.model.flavor == f"hf:{folder}"
    return single_device_model(cfg, "cpu")


@pytest.mark.parametrize("name", ["untied", "tied", "sharded"])
def test_single_process_logits_match_transformers(hf_folders, name):
    folder, reference = hf_folders[name]
    model = single_device(folder)
    assert torch.equal(rope_frequencies(model.args), reference.model.rotary_emb.inv_freq)
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens) - hf_logits(reference, tokens)).abs().max().item()
    print(f"{name}: one process, max |logits - transformers| = {diff:.2e}")
    assert diff <= TOLERANCE
    if name == "tied":
        assert model.output.weight is model.tok_embeddings.weight


# -- dp=2,tp=2: one torchrun launch for all three folders ---------------------------------

@pytest.fixture(scope="module")
def worker_out(hf_folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-worker")
    folders = [str(hf_folders["untied"][0]) + ":60000", str(hf_folders["tied"][0]), str(hf_folders["sharded"][0])]
    result = torchrun(4, REPO / "tests" / "hf_worker.py", "dp=2,tp=2", str(out), *folders)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


CASES = ["untied", "tied", "sharded"]


@pytest.mark.distributed
@pytest.mark.parametrize("number,name", list(enumerate(CASES)))
def test_dp2_tp2_logits_match_transformers(hf_folders, worker_out, number, name):
    saved = torch.load(worker_out / f"logits-{number}.pt")
    diff = (saved["logits"] - hf_logits(hf_folders[name][1], saved["tokens"])).abs().max().item()
    print(f"{name}: dp=2,tp=2, max |logits - transformers| = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.parametrize("number,name", list(enumerate(CASES)))
def test_export_is_bitwise_and_loads_in_transformers(hf_folders, worker_out, number, name):
    transformers = pytest.importorskip("transformers")
    folder, reference = hf_folders[name]
    export = worker_out / f"export-{number}"
    original, exported = read_tensors(folder), read_tensors(export)
    assert sorted(exported) == sorted(original)  # a tied model has no lm_head in either
    assert all(torch.equal(exported[k], original[k]) for k in original)
    if number == 0:  # written with a small max_shard_bytes: several files and an index
        index = json.loads((export / INDEX).read_text())
        assert len(set(index["weight_map"].values())) > 1 and not (export / SINGLE).exists()
        assert sorted(index["weight_map"]) == sorted(original)
    config = read_hf_config(export)
    assert args_from_hf_config(config, "x") == args_from_hf_config(read_hf_config(folder), "y")
    assert (config["bos_token_id"], config["eos_token_id"]) == (5, 6)  # carried from the import
    # import -> export -> import: the second import holds bitwise the original tensors
    again = build_on_meta("llama", register_hf_flavor("llama", export))
    materialise(again, "cpu", 0)
    load_hf(again, export)
    assert all(torch.equal(value, original[hf_name(key)]) for key, value in again.state_dict().items()
               if key in {our_name(k) for k in original})
    loaded = transformers.LlamaForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(3))
    diff = (hf_logits(loaded, tokens) - hf_logits(reference, tokens)).abs().max().item()
    print(f"{name}: transformers on the export vs on the original, max |logits diff| = {diff:.2e}")
    assert diff == 0.0


# -- without transformers: the engine's own writer, broken folders, the command line ------

@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A checkpoint folder of TINY's shapes with random weights, written by write_hf_folder."""
    pytest.importorskip("safetensors")  # not yet in setup.cfg's install_requires
    folder = tmp_path_factory.mktemp("written") / "tiny"
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in Llama(TINY).state_dict().items()}
    tensors = {hf_name(k): torch.randn(shape, generator=generator) for k, shape in shapes.items()}
    write_hf_folder(folder, tensors, hf_config_from_args(TINY, {"bos_token_id": 5}), max_shard_bytes=50_000)
    return folder


def broken(written, tmp_path, edit) -> str:
    from safetensors.torch import save_file
    folder = tmp_path / "broken"
    shutil.copytree(written, folder)
    tensors = read_tensors(folder)
    edit(tensors)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    (folder / INDEX).unlink(missing_ok=True)
    save_file(tensors, str(folder / SINGLE), metadata={"format": "pt"})
    return str(folder)


BROKEN = {
    "missing": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                ["missing keys: model.layers.1.mlp.up_proj.weight (ours: layers.1.feed_forward.w3.weight)"]),
    "extra": (lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
              ["unexpected keys: model.layers.0.self_attn.q_norm.weight (no Llama parameter)"]),
    "reshaped": (lambda t: t.update({"model.norm.weight": torch.ones(32)}),
                 ["model.norm.weight (ours: norm.weight) [32] here vs [64] in the model"]),
}


def hf_refused(*args: str) -> str:
    """The launcher's refusal; the tiny vocabulary needs synthetic data (the corpus is bytes)."""
    return refused(*args, "--set", "data.source=synthetic")


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_is_refused_before_any_process_group(written, tmp_path, case):
    edit, fragments = BROKEN[case]
    message = hf_refused("--mesh", "dp=2", "--set", f"checkpoint.hf_import={broken(written, tmp_path, edit)}")
    for fragment in ["checkpoint.hf_import", *fragments]:
        assert fragment in message, message


def test_broken_checkpoint_on_the_command_line_exits_2(written, tmp_path):
    edit, fragments = BROKEN["missing"]
    result = launcher("--mesh", "dp=2", "--set", f"checkpoint.hf_import={broken(written, tmp_path, edit)}",
                      "--set", "data.source=synthetic", timeout=120)
    assert_clean_error(result, *fragments)


def test_other_bad_imports_are_refused(written, tmp_path):
    assert "is not a folder" in hf_refused("--set", f"checkpoint.hf_import={tmp_path / 'none'}")
    (tmp_path / "empty").mkdir()
    assert f"has no {CONFIG}" in hf_refused("--set", f"checkpoint.hf_import={tmp_path / 'empty'}")
    assert "Keep one" in hf_refused("--set", f"checkpoint.hf_import={written}",
                                    "--set", f"checkpoint.init_from={tmp_path / 'x.pt'}")
    assert "Use model.name=llama" in hf_refused("--set", f"checkpoint.hf_import={written}",
                                                "--set", "model.name=gpt2")
    stray = tmp_path / "stray"
    shutil.copytree(written, stray)
    (stray / "consolidated.safetensors").write_bytes(b"")
    assert "consolidated.safetensors" in hf_refused("--set", f"checkpoint.hf_import={stray}")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    assert "replaces the whole folder" in hf_refused("--set", f"checkpoint.hf_export={tmp_path / 'keep'}")
    assert "Use model.name=llama, or checkpoint.export" in hf_refused(
        "--set", "model.name=gpt2", "--set", f"checkpoint.hf_export={tmp_path / 'o'}")


def test_header_check_reads_no_tensor_data(written):
    found = tensor_index(written)
    assert len({path for path, _, _ in found.values()}) > 1  # the index and several files
    model = build_on_meta("llama", register_hf_flavor("llama", written))
    check_hf_checkpoint(model, written)  # on the meta device: shapes only


@pytest.mark.distributed
@pytest.mark.compat
def test_command_line_imports_and_exports(written, tmp_path):
    """launch/run.py at dp=2 with hf_import and hf_export; lr=0 keeps the weights, so the
    export (one file) holds bitwise the imported tensors (several files)."""
    out = tmp_path / "export"
    result = launcher("--mesh", "dp=2", "--set", f"checkpoint.hf_import={written}",
                      "--set", f"checkpoint.hf_export={out}", "--set", "optim.lr=0", "--set", "training.steps=1",
                      "--set", "data.source=synthetic", "--set", "training.seq_len=32",
                      "--set", "training.global_batch=4", "--set", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"weights from Hugging Face checkpoint {written}" in result.stdout
    assert f"exported Hugging Face checkpoint -> {out}" in result.stdout
    assert f"model llama/hf:{written}" in result.stdout
    original, exported = read_tensors(written), read_tensors(out)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert read_hf_config(out) == read_hf_config(written)
    assert not out.with_name("export.partial").exists() and (out / SINGLE).is_file()


@pytest.mark.slow
def test_plan_for_an_imported_checkpoint_searches_its_shapes(written, tmp_path):
    """--plan-for plans the imported model, not the config's own flavor: TINY's 2 key/value
    heads allow tp=2 at most, where the debug flavor's 4 allow tp=4; its best command trains."""
    report = tmp_path / "plan.json"
    result = launcher("--plan-for", "--world", "4", "--set", f"checkpoint.hf_import={written}",
                      "--set", "data.source=synthetic", "--set", "training.global_batch=8",
                      "--set", "training.seq_len=64", "--set", f"dryrun.report={report}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"extrapolated to {TINY.n_layers}" in result.stdout, result.stdout
    meshes = {layout["mesh"] for layout in json.loads(report.read_text())["layouts"]}
    assert "dp=2,tp=2" in meshes and not any("tp=4" in mesh for mesh in meshes), meshes
    best = next(line for line in result.stdout.splitlines() if line.strip().startswith("python launch/run.py"))
    trained = launcher(*shlex.split(best.strip())[2:], "--set", "training.steps=1", "--set", f"run.dir={tmp_path / 'run'}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: 1 steps" in trained.stdout
