"""Hugging Face Mixtral checkpoints in and out (engine/checkpoint/hf.py, models/mixtral_hf.py).

A tiny random MixtralForCausalLM (transformers, fp32, 4 experts, top 2) is saved with
save_pretrained, which writes one tensor per expert and projection. The engine imports it
into model llama_moe: on one process its logits equal transformers' within 1e-5. Then a
fine-tune through launch/run.py (real gloo process groups: dp=2,ep=2,tp=2 and
pp=2,dp=2,ep=2, 4 ranks each) against transformers' model trained by torch.optim.AdamW in
one process on the same global batches, same hyper-parameters, constant learning rate, no
clipping: every step's loss within 1e-5, and the exported weights within 1e-4 of
transformers' after 4 steps (Adam divides each update by the gradient's running size,
so the last bits of a tiny gradient move a weight by up to lr x steps; measured 1.0e-5).
"""

from __future__ import annotations

import json

import pytest
import torch

from common.errors import UserError
from engine.checkpoint.hf import SINGLE, check_hf_export, register_hf_flavor
from models import build_on_meta
from models.mixtral_hf import args_from_hf_config, hf_config_from_args, hf_tensors, our_name
from models.moe import FLAVORS, MoELlama
from tests.distributed import launcher
from tests.test_cli import assert_clean_error, refused
from tests.test_hf_checkpoint import read_tensors

TOLERANCE = 1e-5  # fp32: logits and losses, ours against transformers'
WEIGHT_TOLERANCE = 1e-4  # fp32 weights after 4 AdamW steps (the module docstring says why)
STEPS = 4
MOE = ("--set", "model.name=llama_moe", "--set", "parallel.plan=llama_moe")
FINE_TUNE = ("--set", f"training.steps={STEPS}", "--set", "data.source=synthetic", "--set", "training.seq_len=48",
             "--set", "training.global_batch=8", "--set", "optim.warmup_steps=0", "--set", "optim.min_lr_ratio=1.0",
             "--set", "optim.max_norm=0")


def mixtral(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        bos_token_id=5, eos_token_id=6, attn_implementation="eager")
    return transformers.MixtralForCausalLM(config).float()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral") / "tiny"
    mixtral().save_pretrained(path)
    return path


def test_every_tensor_of_transformers_file_has_one_place_here(folder):
    model = build_on_meta("llama_moe", register_hf_flavor("llama_moe", folder))
    theirs = read_tensors(folder)
    ours = {hf: list(part.shape) for key, value in model.state_dict().items()
            for hf, part in hf_tensors(key, value).items()}
    assert ours == {key: list(value.shape) for key, value in theirs.items()}
    assert our_name("model.layers.1.block_sparse_moe.experts.3.w3.weight") == \
        "layers.1.feed_forward.experts.w13[3] (second half)"
    assert our_name("model.layers.0.block_sparse_moe.gate.weight") == "layers.0.feed_forward.router.gate.weight"


def test_config_round_trip(folder):
    args = args_from_hf_config(json.loads((folder / "config.json").read_text()), "x")
    assert (args.n_experts, args.top_k, args.routed_hidden, args.shared_hidden, args.router) == (4, 2, 32, 0, "softmax")
    assert args_from_hf_config(json.loads(json.dumps(hf_config_from_args(args))), "y") == args


BASE = hf_config_from_args(args_from_hf_config(hf_config_from_args(FLAVORS["debug-moe-mixtral"]), "x"))


@pytest.mark.parametrize("change,fragments", [
    ({"sliding_window": 128}, ["sliding_window=128", "whole sequence", "512"]),
    ({"router_jitter_noise": 0.1}, ["router_jitter_noise=0.1", "0.0"]),
    ({"num_experts_per_tok": 9}, ["num_experts_per_tok=9", "num_local_experts=8"]),
    ({"num_local_experts": None}, ["no 'num_local_experts'"]),
    ({"architectures": ["MixtralForSequenceClassification"]}, ["architectures=", "MixtralForCausalLM"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "silu"]),
])
def test_unsupported_configs_are_refused(change, fragments):
    with pytest.raises(UserError) as err:
        args_from_hf_config({**BASE, **change}, "cfg.json")
    for fragment in ["cfg.json", *fragments]:
        assert fragment in str(err.value), err.value


def test_single_process_logits_match_transformers(folder):
    from launch.build import single_device_model
    from launch.run import check, parse_args
    cfg, _ = check(parse_args(["--mesh", "dp=1", *MOE, "--set", f"checkpoint.hf_import={folder}",
                               "--set", "data.source=synthetic", "--parity"]), 1)
    model = single_device_model(cfg, "cpu")
    assert isinstance(model, MoELlama)
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = pytest.importorskip("transformers").MixtralForCausalLM.from_pretrained(
            folder, attn_implementation="eager").float().eval()(tokens).logits
        diff = (model(tokens) - theirs).abs().max().item()
    print(f"one process, max |logits - transformers| = {diff:.2e}")
    assert diff <= TOLERANCE


def test_wrong_model_or_an_unexportable_one_is_refused_with_the_fix(folder, tmp_path):
    message = refused("--set", f"checkpoint.hf_import={folder}", "--set", "data.source=synthetic")
    assert "'mixtral' checkpoint" in message and "model.name=llama_moe and parallel.plan=llama_moe" in message
    written = tmp_path / "dense"
    from engine.checkpoint.hf import write_hf_folder
    from models.llama import FLAVORS as LLAMA
    from models.llama_hf import hf_config_from_args as llama_config
    write_hf_folder(written, {}, llama_config(LLAMA["debug"]))
    message = refused(*MOE, "--set", f"checkpoint.hf_import={written}", "--set", "data.source=synthetic")
    assert "'llama' checkpoint" in message and "Use model.name=llama." in message
    with pytest.raises(UserError, match="a sigmoid router .* a shared expert, 1 dense blocks.*checkpoint.export"):
        check_hf_export(build_on_meta("llama_moe", "debug-moe-sigmoid"), tmp_path / "out")


@pytest.fixture(scope="module")
def transformers_fine_tune(folder):
    """transformers' losses over STEPS AdamW steps on the launcher's global batches, and
    its weights after them, by Hugging Face key."""
    transformers = pytest.importorskip("transformers")
    from engine.data.sources import build_source, local_batch
    from launch.run import check, parse_args
    cfg, _ = check(parse_args(["--mesh", "dp=1", *MOE, "--set", f"checkpoint.hf_import={folder}", *FINE_TUNE]), 1)
    source = build_source(cfg, 96)
    model = transformers.MixtralForCausalLM.from_pretrained(folder, attn_implementation="eager").float().train()
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
    losses = []
    for step in range(STEPS):
        inputs, targets = local_batch(source, step, cfg.training.global_batch, cfg.training.seq_len)
        loss = torch.nn.functional.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    export = folder.parent / "transformers-tuned"
    model.save_pretrained(export)
    return losses, read_tensors(export)


@pytest.mark.distributed
@pytest.mark.parametrize("mesh,micro_batches", [("dp=2,ep=2,tp=2", 1), ("pp=2,dp=2,ep=2", 2)])
def test_a_fine_tune_equals_transformers_with_adamw(folder, transformers_fine_tune, mesh, micro_batches, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "export"
    result = launcher("--mesh", mesh, *MOE, "--set", f"checkpoint.hf_import={folder}",
                      "--set", f"checkpoint.hf_export={out}", *FINE_TUNE, "--set", f"run.dir={tmp_path / 'run'}",
                      "--set", f"training.micro_batches={micro_batches}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    losses, tuned = transformers_fine_tune
    ours = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    loss_diff = max(abs(a - b) for a, b in zip(ours, losses, strict=True))
    exported = read_tensors(out)
    assert sorted(exported) == sorted(tuned) and (out / SINGLE).is_file()
    weight_diff = max((exported[key] - tuned[key]).abs().max().item() for key in tuned)
    print(f"{mesh}: {STEPS} steps, losses {ours}, max |loss - transformers'| {loss_diff:.1e}, "
          f"max |weight - transformers'| {weight_diff:.1e}")
    assert loss_diff <= TOLERANCE and weight_diff <= WEIGHT_TOLERANCE
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["bos_token_id"], config["num_local_experts"]) == \
        (["MixtralForCausalLM"], 5, 4)
    transformers.MixtralForCausalLM.from_pretrained(out)  # loads as it is


def test_a_bad_import_on_the_command_line_exits_2(folder, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = read_tensors(folder)
    tensors.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    from safetensors.torch import save_file
    save_file(tensors, str(broken / SINGLE))
    (broken / "config.json").write_text((folder / "config.json").read_text())
    result = launcher("--mesh", "dp=2", *MOE, "--set", f"checkpoint.hf_import={broken}",
                      "--set", "data.source=synthetic", timeout=120)
    assert_clean_error(result, "missing keys: model.layers.1.block_sparse_moe.experts.2.w3.weight "
                               "(ours: layers.1.feed_forward.experts.w13[2] (second half))")
