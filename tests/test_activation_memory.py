"""Activations at their true size (parallel.recompute_cheap, parallel/apply.py step 2),
measured by the dry run: rank 0 of a simulated layout (torch's fake process group and
fake tensors, one process per layout: tests/dryrun_worker.py activations), the forward's
peak at 3 blocks less that at 2, less the third block's parameter and optimizer state.

What a Llama block's backward needs, each tensor sharded over tp under sequence
parallelism, is (6h + 2h n_kv/n_heads + 4 ffn) s/tp values (`true_size`): the two norms'
inputs and outputs (4h), q (h), k and v, the attention output (h), and the outputs of w1
and w3, SiLU's output and the product (4 ffn). Llama 70B at 8,192 tokens and tp=8 in bf16:
0.316 GiB. Keeping everything (recompute_cheap=false) kept 0.600 GiB, 1.90 times that: the
sequence-parallel linears' gathered, full-sequence inputs (2 s h, 0.25 GiB), each norm's
fp32 copy of its input (the CPU's rms_norm: the dry run runs its kernels) and SwiGLU's
products. Recomputed, with the norms' outputs freed until their sublayer's backward, a
block keeps 0.178 GiB (0.209 while it kept them), and backward all-gathers each
sublayer's input again over tp: 2 more all-gathers per block."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from models import model_args
from tests.distributed import REPO, cpu_env

SEVENTY_B = ["model.flavor=70B", "parallel.param_dtype=bfloat16", "training.seq_len=8192", "training.global_batch=1",
             "parallel.sequence_parallel=true", "parallel.loss_parallel=true"]


def true_size(flavor: str, seq_len: int, tp: int, element_bytes: int) -> int:
    args = model_args("llama", flavor)
    h = args.dim
    return (6 * h + 2 * h * args.n_kv_heads // args.n_heads + 4 * args.ffn_hidden) * seq_len // tp * element_bytes


def block_activations(tmp_path, mesh: str, overrides: list[str], world: int) -> dict:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps([mesh, overrides, world]))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "dryrun_worker.py"), "activations", str(layout),
                             str(tmp_path)], cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((tmp_path / "activations.json").read_text())


def backward_all_gathers_per_block(observed: dict, dim: str = "tp") -> int:
    count = lambda depth: (observed["comm"][depth].get(dim, {}).get("backward", {})
                           .get("all_gather", {}).get("count", 0))
    return count("deep") - count("shallow")


@pytest.mark.parametrize("recompute, limit, gathers", [
    # The goal: at most 1.2 times the true size; measured 0.56 (0.178 GiB).
    ("true", 1.2, 4),
    # The old trade, kept as a setting: 1.90 times (0.600 GiB), and no second all-gather.
    ("false", 2.0, 2),
])
def test_a_70b_block_at_tp8_keeps_its_true_size(tmp_path, recompute, limit, gathers):
    observed = block_activations(tmp_path, "tp=8", [*SEVENTY_B, "parallel.activation_checkpoint=none",
                                                    f"parallel.recompute_cheap={recompute}"], 8)
    count = true_size("70B", 8192, 8, 2)
    assert observed["block_bytes"] <= limit * count, observed["block_bytes"] / count
    if recompute == "false":
        assert observed["block_bytes"] > 1.8 * count  # what the setting trades away
    # Backward gathers the gradients of the two row-parallel outputs over tp; recomputing
    # the two sublayers gathers their inputs again.
    assert backward_all_gathers_per_block(observed) == gathers


@pytest.mark.parametrize("mesh, world", [("tp=8", 8), ("cp=2,tp=4", 8)])
def test_op_level_ac_needs_more_memory_than_recompute_cheap_under_sequence_parallel(tmp_path, mesh, world):
    """What --plan-for's lighter_key relies on to leave op-level AC out where none with
    recompute_cheap did not fit (engine/dryrun/search.py): under sequence parallelism op
    keeps more per block, and more at the step's peak, so at every depth from 3 blocks on
    (both grow linearly with the blocks)."""
    def observed(ac: str, cheap: str) -> dict:
        overrides = [*SEVENTY_B, f"parallel.activation_checkpoint={ac}", f"parallel.recompute_cheap={cheap}"]
        return block_activations(tmp_path, mesh, overrides, world)

    op, cheap = observed("op", "false"), observed("none", "true")
    assert op["block_bytes"] > cheap["block_bytes"], (op["block_bytes"], cheap["block_bytes"])
    assert op["peak_bytes"]["deep"] >= cheap["peak_bytes"]["deep"]


def test_recomputed_sublayers_keep_their_names_and_gradients_bitwise():
    """One process, no process group: the debug model with every sublayer of the plan
    recomputed, as parallel/apply.py does it eagerly (the norms' outputs freed once their
    sublayer has run), has the same state dict keys, one class per module class
    (torch.compile then compiles one graph for all blocks), and bitwise the same loss and
    gradients; between forward and backward every norm's output holds no storage."""
    import torch

    from models import build_on_meta
    from parallel.apply import recompute_call, sublayer_patterns
    from parallel.llama_plan import LLAMA
    from parallel.plan import expand

    def built():
        torch.manual_seed(0)
        model = build_on_meta("llama", "debug").to_empty(device="cpu")
        for parameter in model.parameters():
            torch.nn.init.normal_(parameter, std=0.05)
        model.reset_buffers()
        return model

    plain, recomputed = built(), built()
    paths = [path for pattern in sublayer_patterns(LLAMA) for path in expand(recomputed, pattern, LLAMA.name)]
    norms = [path for pattern in LLAMA.recomputed_outputs for path in expand(recomputed, pattern, LLAMA.name)]
    for path in paths:
        recompute_call(recomputed.get_submodule(path), compiled=False, output_recomputable=path in norms,
                       frees_inputs=True)
    assert len(paths) == 4 * 4 and len(norms) == 2 * 4 and list(plain.state_dict()) == list(recomputed.state_dict())
    assert len({type(recomputed.get_submodule(path)) for path in paths}) == 3  # RMSNorm, Attention, FeedForward
    outputs = []
    for path in norms:
        recomputed.get_submodule(path).register_forward_hook(lambda module, args, output: outputs.append(output))
    tokens = torch.randint(0, 256, (2, 32))
    losses = []
    for model in (plain, recomputed):
        loss = model(tokens).float().logsumexp(-1).mean()
        if model is recomputed:
            assert len(outputs) == len(norms) and all(out.untyped_storage().nbytes() == 0 for out in outputs)
        loss.backward()
        losses.append(loss)
    assert torch.equal(*losses)
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("mesh, world, data_ranks", [("tp=4,dp=2", 8, 2), ("dp=8", 8, 8)])
def test_recompute_cheap_needs_no_more_memory_than_keeping_everything(tmp_path, mesh, world, data_ranks):
    """What --plan-for's lighter_key relies on to leave none out where none with
    recompute_cheap did not fit (engine/dryrun/search.py), here without sequence
    parallelism (with it, test_a_70b_block_at_tp8_keeps_its_true_size measures 0.56 times
    the true size against 1.90): recompute_cheap keeps less per block, and no more at the
    step's peak."""
    def observed(cheap: str) -> dict:
        overrides = [*SEVENTY_B, f"training.global_batch={data_ranks}", "parallel.sequence_parallel=false",
                     "parallel.loss_parallel=false",
                     "parallel.activation_checkpoint=none", f"parallel.recompute_cheap={cheap}"]
        return block_activations(tmp_path, mesh, overrides, world)

    everything, cheap = observed("false"), observed("true")
    assert cheap["block_bytes"] < everything["block_bytes"], (cheap["block_bytes"], everything["block_bytes"])
    assert cheap["peak_bytes"]["deep"] <= everything["peak_bytes"]["deep"]
