"""The mixture of experts (models/moe.py), one process: the layer against transformers'
Mixtral block on the same weights, its two ways of computing the experts against each
other, the sigmoid router's bias, and the shapes it refuses. Its runs on meshes are
parity rows in tests/test_parity.py (MATRIX, "moe-*")."""

import dataclasses

import pytest
import torch

from common.errors import UserError
from models import build_on_meta
from models.moe import FLAVORS, MoE, MoELlama, grouped_gemm_works


def expert_layer(flavor: str, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(FLAVORS[flavor])
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return layer


def run(layer: MoE, x: torch.Tensor, grouped: bool):
    """Output, input gradient and expert gradients of one forward and backward."""
    layer.experts.grouped_dtypes = frozenset({x.dtype}) if grouped else frozenset()
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), x.grad, layer.experts.w13.grad.clone(), layer.experts.w2.grad.clone()


def test_the_layer_equals_transformers_mixtral_block_both_ways():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    args = FLAVORS["debug-moe-mixtral"]
    layer = expert_layer("debug-moe-mixtral")
    config = transformers.MixtralConfig(hidden_size=args.dim, intermediate_size=args.routed_hidden,
                                        num_local_experts=args.n_experts, num_experts_per_tok=args.top_k)
    oracle = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        oracle.gate.weight.copy_(layer.router.gate.weight)
        oracle.experts.gate_up_proj.copy_(layer.experts.w13)
        oracle.experts.down_proj.copy_(layer.experts.w2)
        x = torch.randn(2, 64, args.dim)
        expected = oracle(x)
    grouped, looped = run(layer, x, grouped=True), run(layer, x, grouped=False)
    torch.testing.assert_close(grouped[0], expected, rtol=1e-6, atol=1e-6)  # fp32
    for a, b in zip(grouped, looped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_materialising_chooses_the_grouped_gemm_where_it_runs():
    """bf16 runs grouped on the CPU on every torch we claim; fp32 only where compile's meta
    kernel takes it too (torch 2.15: the eager CPU kernel takes it on all of them)."""
    model = MoELlama(dataclasses.replace(FLAVORS["debug-moe"], n_layers=1))
    model.reset_buffers()  # what materialising calls, on the model's device
    chosen = model.layers["0"].feed_forward.experts.grouped_dtypes
    assert torch.bfloat16 in chosen
    assert (torch.float32 in chosen) == grouped_gemm_works(torch.device("cpu"), torch.float32)


def test_the_sigmoid_routers_bias_moves_the_choice_but_not_the_weights():
    layer = expert_layer("debug-moe-sigmoid")
    tokens = torch.randn(32, FLAVORS["debug-moe-sigmoid"].dim)
    weights, experts = layer.router(tokens)
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    layer.router.expert_bias[:2] = 100.0  # the first two experts now win every choice
    biased_weights, biased = layer.router(tokens)
    assert set(biased.flatten().tolist()) == {0, 1}
    scores = layer.router.gate(tokens).sigmoid().gather(-1, biased)
    torch.testing.assert_close(biased_weights, scores / scores.sum(-1, keepdim=True))


def test_every_token_reaches_its_top_k_experts_and_none_is_dropped():
    layer = expert_layer("debug-moe-mixtral")
    args = FLAVORS["debug-moe-mixtral"]
    seen = []
    layer.experts.register_forward_hook(lambda module, inputs, out: seen.append(inputs[1].clone()))
    layer(torch.randn(3, 40, args.dim))
    assert int(seen[0].sum()) == 3 * 40 * args.top_k  # dropless: no capacity cuts


@pytest.mark.parametrize("change, fragment", [
    ({"top_k": 9}, "top_k=9 must be between 1 and n_experts=8"),
    ({"router": "tanh"}, "router 'tanh' is not one of softmax, sigmoid"),
    ({"dense_layers": 5}, "dense_layers=5 must be between 0 and n_layers=4"),
])
def test_shapes_the_router_cannot_take_are_refused_with_the_fix(change, fragment):
    with pytest.raises(UserError, match=fragment):
        MoELlama(dataclasses.replace(FLAVORS["debug-moe"], **change))


def test_flops_count_the_experts_a_token_uses():
    model = build_on_meta("llama_moe", "debug-moe")
    args = model.args
    per_block_experts = 3 * args.n_experts * args.routed_hidden * args.dim
    dense_equivalent = 6 * (sum(p.numel() for p in model.parameters()) - args.vocab_size * args.dim)
    idle = (1 - args.top_k / args.n_experts) * per_block_experts * args.n_layers
    assert model.flops_per_token(128) == dense_equivalent - 6 * idle + 12 * args.n_layers * args.dim * 128


def test_the_dry_run_refuses_a_mixture_of_experts_with_what_to_run_instead():
    from tests.test_cli import assert_refused
    assert_refused(("--dry-run", "--world", "8", "--mesh", "dp=4,tp=2", "--set", "model.name=llama_moe",
                    "--set", "model.flavor=mixtral-8x7B", "--set", "parallel.plan=llama_moe"),
                   "do not model a mixture of experts yet", "--parity on a real mesh")


MOE_ARGS = ("--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe", "--set", "parallel.plan=llama_moe")


@pytest.mark.distributed
def test_a_checkpoint_reshards_between_ep_degrees(tmp_path):
    """Real runs over gloo: 4 steps at dp=4,ep=2 with a checkpoint at step 2, loaded at ep=4
    and without ep (dp=2). The first loss after loading equals the saving run's loss at
    that step within the fp32 parity tolerance, 1e-5."""
    import json

    from engine.checkpoint.store import step_name
    from tests.distributed import launcher
    from tests.test_cli import losses

    source = tmp_path / "source"
    saved = launcher("--mesh", "dp=4,ep=2", *MOE_ARGS, "--set", "training.steps=4", "--set", "checkpoint.every=2",
                     "--set", f"run.dir={source}")
    assert saved.returncode == 0, saved.stderr[-3000:]
    for mesh in ("dp=4,ep=4", "dp=2"):
        run_dir = tmp_path / mesh.replace(",", "-").replace("=", "")
        resumed = launcher("--mesh", mesh, *MOE_ARGS, "--resume", str(source / "checkpoints" / step_name(2)),
                           "--set", "training.steps=3", "--set", f"run.dir={run_dir}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "saved on mesh dp=4,ep=2" in resumed.stdout
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 2 and abs(first["loss"] - losses(source)[2]) <= 1e-5, (mesh, first)
