"""The mixture of experts (models/moe.py), one process: the layer against transformers'
Mixtral block on the same weights, its two ways of computing the experts against each
other, the sigmoid router's bias, the load-balancing loss (against transformers' and
through its gradient) and the routing totals the loop reads (engine/routing.py), and the
shapes it refuses. Real gloo runs: a checkpoint resharded between ep degrees, and the
experts' figures in the step log, metrics.jsonl and TensorBoard over a pipeline. Its
parity on meshes is the combination matrix's (tests/combinations.py, factor "experts")
and tests/test_parity.py's "moe-*" rows."""

import dataclasses
import functools
import math

import pytest
import torch

from common.errors import UserError
from models import build_on_meta
from engine import routing
from models.moe import FLAVORS, MoE, MoELlama, grouped_gemm_works
from parallel.plan import get_plan


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
    weights, experts, _ = layer.router(tokens)
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    layer.router.expert_bias[:2] = 100.0  # the first two experts now win every choice
    biased_weights, biased, _ = layer.router(tokens)
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


def test_the_balance_loss_is_transformers_mixtral_loss_over_top_k():
    """transformers' load_balancing_loss_func on one sequence and one layer is
    E x sum_e (tokens choosing e / tokens) x P_e, which is k when balanced; ours divides the
    choices by k as well, so it is 1 when balanced and theirs / k."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    args = FLAVORS["debug-moe-mixtral"]
    layer = expert_layer("debug-moe-mixtral")
    tokens = torch.randn(40, args.dim)
    _, experts, probs = layer.router(tokens)
    ours = layer.balance_loss(probs.view(1, 40, -1), experts.view(1, 40, -1))
    theirs = load_balancing_loss_func((layer.router.gate(tokens),), args.n_experts, args.top_k)
    torch.testing.assert_close(ours * args.top_k, theirs.view(1), rtol=1e-6, atol=0)
    uniform = torch.full((1, 4, args.n_experts), 1 / args.n_experts)
    every_expert_once = torch.arange(args.n_experts).view(1, 4, args.top_k)
    assert layer.balance_loss(uniform, every_expert_once).item() == pytest.approx(1.0)
    one_expert = torch.zeros(1, 4, args.n_experts)
    one_expert[..., 0] = 1.0
    assert layer.balance_loss(one_expert, torch.zeros(1, 4, args.top_k, dtype=torch.long)).item() == \
        pytest.approx(args.n_experts)


def test_the_balance_loss_reaches_the_router_as_if_added_to_the_loss():
    """With load_balance = w, the gradients of out.sum() equal those of out.sum() + w x the
    mean per-sequence balance loss computed by hand, the router's included."""
    layer = expert_layer("debug-moe")
    x = torch.randn(3, 16, FLAVORS["debug-moe"].dim)
    layer.load_balance = 0.5
    layer(x).sum().backward()
    attached = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    layer.load_balance = 0.0
    out = layer(x)
    _, experts, probs = layer.router(x.reshape(-1, x.shape[-1]))
    by_hand = layer.balance_loss(probs.view(3, 16, -1), experts.view(3, 16, -1)).mean()
    (out.sum() + 0.5 * by_hand).backward()
    assert attached["router.gate.weight"].abs().max() > 0
    for name, p in layer.named_parameters():
        torch.testing.assert_close(attached[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)  # fp32 sums, grads up to ~10
    layer.zero_grad()
    layer(x).sum().backward()  # without the loss the router's gradient differs
    assert not torch.allclose(attached["router.gate.weight"], layer.router.gate.weight.grad)


def test_routing_figures_are_the_same_when_checkpointing_runs_the_forward_again():
    """Activation checkpointing recomputes the forward in backward and adds to the totals a
    second time; every figure the loop reports is a ratio of totals, so none changes."""
    from torch.utils.checkpoint import checkpoint

    layer = expert_layer("debug-moe")
    x = torch.randn(2, 16, FLAVORS["debug-moe"].dim, requires_grad=True)
    figures = []
    for recompute in (False, True):
        layer.routing_totals.zero_()
        out = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        out.sum().backward()
        figures.append(routing.summary(layer.routing_totals.tolist(), tokens_per_step=32))
    assert figures[0] == pytest.approx(figures[1])
    assert sum(figures[0]["tokens_per_expert"]) == 32 * FLAVORS["debug-moe"].top_k


def test_the_sigmoid_routers_bias_moves_toward_the_mean_load():
    layer = expert_layer("debug-moe-sigmoid")
    layer.bias_rate = 0.01
    load = torch.tensor([10.0, 2.0, 5.0, 5.0, 5.0, 5.0, 5.0, 3.0])  # mean 5
    layer.balance(load)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0.01])
    softmax = expert_layer("debug-moe")
    softmax.bias_rate = 0.01
    softmax.balance(load)
    assert not softmax.router.expert_bias.any()


@pytest.mark.parametrize("change, fragment", [
    ({"top_k": 9}, "top_k=9 must be between 1 and n_experts=8"),
    ({"router": "tanh"}, "router 'tanh' is not one of softmax, sigmoid"),
    ({"dense_layers": 5}, "dense_layers=5 must be between 0 and n_layers=4"),
])
def test_shapes_the_router_cannot_take_are_refused_with_the_fix(change, fragment):
    with pytest.raises(UserError, match=fragment):
        MoELlama(dataclasses.replace(FLAVORS["debug-moe"], **change))


def test_flops_count_the_experts_a_token_uses_in_the_model_and_in_each_pipeline_stage():
    from engine.dryrun.estimate import stage_flops_per_token
    from engine.metrics.throughput import flops_per_token
    model = build_on_meta("llama_moe", "debug-moe")
    args = model.args
    per_block_experts = 3 * args.n_experts * args.routed_hidden * args.dim
    dense_equivalent = 6 * (sum(p.numel() for p in model.parameters()) - args.vocab_size * args.dim)
    idle = (1 - args.top_k / args.n_experts) * per_block_experts * args.n_layers
    whole = flops_per_token(model, 128)
    assert whole == dense_equivalent - 6 * idle + 12 * args.n_layers * args.dim * 128
    split = [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
    stages = [stage_flops_per_token(model, get_plan("llama_moe").stages, split, [held], 128) for held in (0, 1)]
    assert sum(stages) == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("args, fragments", [
    (("--plan-for", "--world", "8", "--set", "dryrun.ep=1,x"), ("dryrun.ep", "the ep degrees --plan-for searches")),
    (("--dry-run", "--world", "16", "--mesh", "dp=16", "--set", "parallel.reshard_after_forward=2"),
     ("reshard_after_forward=2 (an integer reshard)", "do not divide over its 16 ranks", "add ep to --mesh")),
    (("--plan-for", "--world", "8", "--set", "dryrun.expert_load=0.5"), ("dryrun.expert_load=0.5 must be at least 1",)),
    (("--dry-run", "--world", "8", "--mesh", "dp=8,ep=2", "--set", "dryrun.expert_load=3"),
     ("dryrun.expert_load=3.0 must be between 1", "ep=2")),
    (("--dry-run", "--world", "8", "--mesh", "dp=8", "--set", "dryrun.expert_load=0.5"),
     ("dryrun.expert_load=0.5 must be between 1",)),
])
def test_what_the_dry_run_cannot_simulate_of_a_mixture_of_experts_is_refused_with_the_fix(args, fragments):
    from tests.test_cli import assert_refused
    assert_refused((*args, "--set", "model.name=llama_moe", "--set", "model.flavor=mixtral-8x7B",
                    "--set", "parallel.plan=llama_moe"), *fragments)


@pytest.mark.parametrize("load, ep, expected", [
    (1.0, 1, [3] * 8),  # 24 rows over 8 experts
    (1.0, 2, [3] * 8),
    (2.0, 2, [6] * 4 + [0] * 4),  # ep rank 0 takes every row
    (1.5, 4, [5, 4] + [3, 2] * 3),  # 9 rows on ep rank 0, 5 on each other, spread over its 2 experts
    (1.0, 8, [3] * 8),
])
def test_the_rows_a_dry_run_assumes_per_expert_load_ep_rank_0_by_dryrun_expert_load(load, ep, expected):
    from models.moe import assumed_sizes
    sizes = assumed_sizes(24, 8, load, ep)
    assert sizes == expected and sum(sizes) == 24


def test_the_step_estimate_adds_the_busiest_ep_ranks_extra_expert_compute():
    """At dryrun.expert_load=L, the busiest ep rank computes L times its share of the routed
    experts' FLOPs; the rest of the step is unchanged, and without ep the load does nothing."""
    from common.config import load_config
    from engine.dryrun.estimate import device_profile, estimate_step, expert_flops_per_token
    from parallel.mesh import parse_mesh
    from parallel.plan import expand
    model = build_on_meta("llama_moe", "mixtral-8x7B")
    experts = expert_flops_per_token(model, expand(model, get_plan("llama_moe").blocks, "llama_moe"))
    args = model.args
    assert experts == 6 * args.n_layers * args.top_k * 3 * args.dim * args.ffn_hidden

    def compute(mesh, load):
        cfg = load_config(None, ["model.name=llama_moe", "model.flavor=mixtral-8x7B", f"dryrun.expert_load={load}"])
        return estimate_step({}, 1e10, cfg, parse_mesh(mesh), device_profile(cfg.dryrun),
                             expert_flops=experts).compute_s

    assert compute("dp=8,ep=4", 2.0) / compute("dp=8,ep=4", 1.0) == pytest.approx((1e10 + experts) / 1e10)
    assert compute("dp=8", 2.0) == compute("dp=8", 1.0)
MOE_ARGS = ("--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe", "--set", "parallel.plan=llama_moe")


@pytest.mark.distributed
@pytest.mark.parametrize("flavor, loaded_on", [
    ("debug-moe", ("dp=4,ep=4", "dp=2")),
    # Saved with each rank's one expert sharded along its rows (parallel/expert.py:
    # expert_placement), loaded where the experts stay whole ep shards, out of FSDP.
    ("debug-moe-2", ("dp=2,ep=2",)),
])
def test_a_checkpoint_reshards_between_ep_degrees(tmp_path, flavor, loaded_on):
    """Real runs over gloo: 4 steps at dp=4,ep=2 with a checkpoint at step 2, loaded on
    other meshes (another ep, or none). The first loss after loading equals the saving
    run's loss at that step within the fp32 parity tolerance, 1e-5."""
    import json

    from engine.checkpoint.store import step_name
    from tests.distributed import launcher
    from tests.test_cli import losses

    source = tmp_path / "source"
    model = (*MOE_ARGS, "--set", f"model.flavor={flavor}")
    saved = launcher("--mesh", "dp=4,ep=2", *model, "--set", "training.steps=4", "--set", "checkpoint.every=2",
                     "--set", f"run.dir={source}")
    assert saved.returncode == 0, saved.stderr[-3000:]
    for mesh in loaded_on:
        run_dir = tmp_path / mesh.replace(",", "-").replace("=", "")
        resumed = launcher("--mesh", mesh, *model, "--resume", str(source / "checkpoints" / step_name(2)),
                           "--set", "training.steps=3", "--set", f"run.dir={run_dir}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "saved on mesh dp=4,ep=2" in resumed.stdout
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 2 and abs(first["loss"] - losses(source)[2]) <= 1e-5, (mesh, first)


@pytest.mark.distributed
def test_expert_figures_reach_the_step_log_metrics_and_tensorboard_from_every_stage(tmp_path):
    """A real run over gloo at pp=2,dp=2 (each stage holds 2 of the 4 blocks; the first is
    dense in the sigmoid flavor) with the load-balancing loss and the bias update on: every
    routed layer of both stages appears in rank 0's metrics.jsonl each step, its tokens per
    expert summing to the step's tokens x top_k, the step line names the most loaded layer,
    and TensorBoard holds the load as a histogram per layer."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from common.config import Config
    from tests.distributed import launcher

    result = launcher("--mesh", "pp=2,dp=2", "--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe-sigmoid",
                      "--set", "parallel.plan=llama_moe", "--set", "training.micro_batches=2",
                      "--set", "moe.load_balance=0.01", "--set", "moe.bias_rate=0.01", "--set", "training.steps=3",
                      "--set", "metrics.tensorboard=true", "--set", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    layers = [f"layers.{i}.feed_forward" for i in (1, 2, 3)]
    args, training = FLAVORS["debug-moe-sigmoid"], Config().training
    for record in records:
        assert list(record["experts"]) == layers
        for figures in record["experts"].values():
            assert sum(figures["tokens_per_expert"]) == training.global_batch * training.seq_len * args.top_k
            assert figures["max_over_mean"] >= 1 and 0 < figures["entropy"] <= math.log(args.n_experts)
            assert figures["balance_loss"] > 0
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("experts: load max/mean" in line for line in lines), lines
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    assert {f"experts/{layer}/tokens_per_expert" for layer in layers} <= set(events.Tags()["histograms"])
    assert [e.step for e in events.Scalars("experts/layers.3.feed_forward/max_over_mean")] == [0, 1, 2]


@pytest.mark.parametrize("flavor, ranks, expected", [
    ("mixtral-8x7B", 8, (0, 0)),  # one expert a rank
    ("mixtral-8x7B", 64, (1, 1)),  # 8 experts over 64: along their rows
    # DeepSeek-V3's 256 experts over 2,048 ranks: w13's 4,096 rows divide, w2's 7,168 do
    # not, its 2,048 columns do (--plan-for's dp=2048 failed on it: FSDP refuses an
    # uneven dimension other than the first).
    ("deepseek-v3-gqa", 2048, (1, 2)),
    ("debug-moe", 6, (0, 0)),  # nothing divides by 6: by expert, padded to 12
])
def test_each_expert_weight_is_sharded_along_a_dimension_fsdp_can_split(flavor, ranks, expected):
    """parallel/expert.py: expert_placement, for the weights of one model's experts on meta
    (no process group): the first dimension that divides over FSDP's ranks, else the
    first, which FSDP pads (tests/test_parity.py runs the padded case at dp=6)."""
    from models.moe import Experts
    from parallel.expert import expert_placement
    experts = next(m for m in build_on_meta("llama_moe", flavor, 1, 0).modules() if isinstance(m, Experts))
    placement = expert_placement(experts, ranks)
    assert tuple(placement(param).dim for param in (experts.w13, experts.w2)) == expected


@pytest.mark.parametrize("flavor, ranks, refused", [
    ("mixtral-8x7B", 16, True),  # 8 experts over 16: along their rows
    ("mixtral-8x7B", 8, False),  # by expert
    ("debug-moe", 6, False),  # by expert, padded to 12
])
def test_an_integer_reshard_is_refused_only_for_experts_placed_along_another_dimension(flavor, ranks, refused):
    """parallel/expert.py: check_unsplit_experts, on meta: FSDP fails an integer reshard of
    a weight sharded along its rows in backward, not of one sharded by expert, padded or
    not (tests/test_parity.py's dp=6 case runs that one with reshard_after_forward=2)."""
    from parallel.expert import check_unsplit_experts
    model = build_on_meta("llama_moe", flavor, 1, 0)
    check = functools.partial(check_unsplit_experts, model, get_plan("llama_moe"), 2, ranks)
    if refused:
        with pytest.raises(UserError, match="does not run with experts that FSDP shards along their rows"):
            check()
    else:
        check()


@pytest.mark.parametrize("mesh", ["dp=64,ep=8", "dp=64"])
def test_experts_that_do_not_divide_over_fsdp_ranks_are_sharded_along_their_rows_not_padded(tmp_path, mesh):
    """Mixtral 8x7B at dp=64,ep=8: each ep rank's one expert over 8 expert-data ranks; at
    dp=64 without ep, 8 experts over 64 ranks (parallel/expert.py: expert_placement). The
    dry run (torch's fake process group) counts what each rank holds and gathers: by
    expert, FSDP padded the experts to one per rank. With ep, rank 0 held 21.1 GiB of
    parameters and rank 63 0.19 GiB of optimizer state, and each all-gather moved 8
    experts; without ep (Mixtral 8x22B at dp=128), rank 0 held 63.2 GiB of parameters and
    126.3 GiB of optimizer state, rank 127 0.31 GiB of optimizer state."""
    import json
    import subprocess
    import sys
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "launch/run.py", "--dry-run", "--world", "64", "--mesh", mesh,
                    "--set", "model.name=llama_moe", "--set", "model.flavor=mixtral-8x7B", "--set",
                    "parallel.plan=llama_moe", "--set", "parallel.param_dtype=bfloat16", "--set",
                    "training.seq_len=128", "--set", "training.global_batch=64", "--set", f"dryrun.report={report}"],
                   check=True, capture_output=True)
    result = json.loads(report.read_text())
    params = [role["param_bytes"] for role in result["roles"]]
    optimizer = [role["optimizer_bytes"] for role in result["roles"]]  # with ep 5.438 and 5.437 GiB: not the experts
    assert max(params) < 1.001 * min(params) and max(optimizer) < 1.001 * min(optimizer)
    args = FLAVORS["mixtral-8x7B"]
    one_expert_bf16 = 3 * args.dim * args.ffn_hidden * 2
    if "ep=" in mesh:
        gathered = result["comm"]["edp"]["forward"]["all_gather"]
        assert gathered["bytes"] == gathered["count"] * one_expert_bf16


@pytest.mark.parametrize("flavor, mesh, chosen, expected", [
    ("mixtral-8x7B", dict(dp=64), "", [1, 8]),  # 8 experts: within a node is all of them
    ("mixtral-8x7B", dict(dp=16, tp=2), "", [1, 4, 8]),  # ep=8 x tp=2 spans 16 ranks, 2 nodes
    ("deepseek-v3-gqa", dict(dp=128, pp=16), "", [1, 8, 128]),
    ("deepseek-v3-gqa", dict(dp=128, pp=16), "1,64,512", [1, 64]),  # 512 divides neither dp nor 256 experts
    ("debug-moe", dict(dp=6), "", [1, 2]),  # 3 does not divide 8 experts
])
def test_the_planner_searches_ep_at_1_within_a_node_and_at_the_most(flavor, mesh, chosen, expected):
    """engine/dryrun/search.py: expert_degrees (no process group)."""
    from common.config import load_config
    from engine.dryrun.search import expert_degrees
    from launch.run import DEFAULT_CONFIG
    from parallel.mesh import MeshSpec
    cfg = load_config(DEFAULT_CONFIG, ["model.name=llama_moe", f"model.flavor={flavor}", f"dryrun.ep={chosen}"])
    assert expert_degrees(cfg, MeshSpec(**mesh)) == expected
    assert expert_degrees(load_config(DEFAULT_CONFIG, []), MeshSpec(**mesh)) == [1]


@pytest.mark.slow
def test_plan_for_a_mixture_of_experts_ranks_ep_layouts_and_the_best_trains(tmp_path):
    """--plan-for searches ep beside the other dimensions; the layouts are simulated at the
    load asked, or at ep where that is less (a real run of the best command follows)."""
    import json
    import shlex
    from tests.distributed import launcher
    report = tmp_path / "plan.json"
    model = ["--set", "model.name=llama_moe", "--set", "model.flavor=debug-moe", "--set", "training.seq_len=64",
             "--set", "training.global_batch=8"]
    result = launcher("--plan-for", "--world", "4", *model, "--set", "dryrun.pp=1", "--set", "dryrun.expert_load=4",
                      "--set", f"dryrun.report={report}")
    assert result.returncode == 0, result.stderr[-3000:]
    layouts = json.loads(report.read_text())["layouts"]
    meshes = {layout["mesh"] for layout in layouts}
    assert {"dp=4", "dp=4,ep=4", "dp=2,ep=2,tp=2"} <= meshes, meshes
    assert not any("reshard_after_forward=2" in " ".join(layout["overrides"]) and "ep=" in layout["mesh"]
                   for layout in layouts)
    best = next(line for line in result.stdout.splitlines() if line.strip().startswith("python launch/run.py"))
    trained = launcher(*shlex.split(best.strip())[2:], "--set", "training.steps=1", "--set", f"run.dir={tmp_path / 'run'}")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "done: 1 steps" in trained.stdout


def test_the_planner_offers_deepseek_v3s_published_mesh_under_pp():
    """Under pp the search takes the largest tp, and for a model with experts no tp as well
    (engine/dryrun/search.py: meshes): DeepSeek-V3's pp=16, ep=64 over dp=128 (no process group)."""
    from common.config import load_config
    from engine.dryrun.search import meshes
    from launch.run import DEFAULT_CONFIG
    from parallel.mesh import MeshSpec
    cfg = load_config(DEFAULT_CONFIG, ["model.name=llama_moe", "model.flavor=deepseek-v3-gqa", "training.seq_len=4096",
                                       "dryrun.pp=16", "dryrun.ep=1,64"])
    found = meshes(cfg, 2048, 61)
    assert MeshSpec(pp=16, dp=128, ep=64) in found and MeshSpec(pp=16, dp=16, tp=8) in found
    assert not any(spec.tp in (2, 4) for spec in found)
    dense = load_config(DEFAULT_CONFIG, ["model.flavor=8B", "dryrun.pp=16"])
    assert {spec.tp for spec in meshes(dense, 2048, 32)} == {8}
