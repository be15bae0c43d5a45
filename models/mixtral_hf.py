"""Hugging Face Mixtral (MixtralForCausalLM) <-> models.moe: config and parameter names.

Pure mapping, no IO, as models/llama_hf.py, whose names the attention, norms and ends
keep. The files keep one tensor per expert and projection (the layout of the published
checkpoints, and what transformers 5's save_pretrained still writes, though it fuses them
in memory), while our experts are two 3-D parameters:

    ours                                     Hugging Face
    layers.{i}.feed_forward.router.gate      model.layers.{i}.block_sparse_moe.gate.weight
      .weight
    layers.{i}.feed_forward.experts.w13[j]   model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight
                                             (first half: gate) and .w3.weight (second half: up)
    layers.{i}.feed_forward.experts.w2[j]    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight

Mixtral is the softmax router with the top k renormalised, no shared expert and no dense
blocks; a model with any of those has no Mixtral checkpoint (checkpoint.export keeps it).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from common.errors import UserError
from models import llama_hf
from models.moe import MoEArgs

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
# Carried besides Llama's token ids: the auxiliary loss transformers adds when it trains this model.
MORE_CARRIED_KEYS = ("router_aux_loss_coef", "output_router_logits")

_OURS = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.gate\.weight|experts\.w13|experts\.w2)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(?:gate\.weight|experts\.(\d+)\.(w[123])\.weight)")


def hf_tensors(fqn: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our parameter -> the Hugging Face tensors it holds, as views of `tensor` (a meta
    tensor gives the keys and shapes). KeyError for a name Mixtral lacks."""
    match = _OURS.fullmatch(fqn)
    if match is None:
        return llama_hf.hf_tensors(fqn, tensor)
    prefix = f"model.layers.{match.group(1)}.block_sparse_moe."
    if match.group(2) == "router.gate.weight":
        return {prefix + "gate.weight": tensor}
    experts = range(tensor.shape[0])
    if match.group(2) == "experts.w2":
        return {f"{prefix}experts.{j}.w2.weight": tensor[j] for j in experts}
    gate, up = tensor.chunk(2, dim=1)
    return {key: value for j in experts for key, value in
            ((f"{prefix}experts.{j}.w1.weight", gate[j]), (f"{prefix}experts.{j}.w3.weight", up[j]))}


def our_tensor(fqn: str, shape: list[int], read: Callable[[str], torch.Tensor],
               rows: list[int] | None = None) -> torch.Tensor:
    """Our parameter of this shape, assembled from the tensors `read` returns by key: the
    whole of it, or only `rows` (indices along dim 0: the experts a rank holds), so that a
    rank reads and stacks its own experts only."""
    match = _OURS.fullmatch(fqn)
    if match is None or match.group(2) == "router.gate.weight":
        (key,) = hf_tensors(fqn, torch.empty(shape, device="meta"))
        return read(key) if rows is None else read(key)[rows]
    prefix = f"model.layers.{match.group(1)}.block_sparse_moe.experts."
    experts = range(shape[0]) if rows is None else rows
    if match.group(2) == "experts.w2":
        return torch.stack([read(f"{prefix}{j}.w2.weight") for j in experts])
    return torch.stack([torch.cat([read(f"{prefix}{j}.w1.weight"), read(f"{prefix}{j}.w3.weight")])
                        for j in experts])


def our_name(hf: str) -> str:
    """Where a Hugging Face tensor goes in our model, for messages. KeyError if nowhere."""
    match = _THEIRS.fullmatch(hf)
    if match is None:
        return llama_hf.our_name(hf)
    layer, expert, projection = match.groups()
    base = f"layers.{layer}.feed_forward"
    if expert is None:
        return f"{base}.router.gate.weight"
    if projection == "w2":
        return f"{base}.experts.w2[{expert}]"
    return f"{base}.experts.w13[{expert}] ({'first' if projection == 'w1' else 'second'} half)"


def args_from_hf_config(config: dict, source: str) -> MoEArgs:
    """MoEArgs from a Mixtral config.json (already parsed). The attention, norms and rope
    are Llama's (llama_hf.args_from_hf_config checks them); what routes is checked here."""
    if not isinstance(config, dict):
        raise UserError(f"{source} holds a {type(config).__name__}, not a JSON object.")
    architectures = config.get("architectures")
    if architectures is not None and ARCHITECTURE not in architectures:
        raise llama_hf.refuse(source, "architectures", architectures, f"only {ARCHITECTURE} is read")
    window = config.get("sliding_window")
    positions = config.get("max_position_embeddings", 2048)
    if window is not None and not (isinstance(window, int) and isinstance(positions, int) and window >= positions):
        raise llama_hf.refuse(source, "sliding_window", window, f"attention here sees the whole sequence: "
                              f"null, or at least max_position_embeddings ({positions})")
    if config.get("router_jitter_noise", 0.0) not in (0, 0.0):
        raise llama_hf.refuse(source, "router_jitter_noise", config["router_jitter_noise"],
                              "the router here adds no noise: set it to 0.0")
    dense = llama_hf.args_from_hf_config({**config, "model_type": "llama", "architectures": None}, source)
    n_experts = llama_hf.get(config, "num_local_experts", int, source)
    top_k = llama_hf.get(config, "num_experts_per_tok", int, source)
    if not 1 <= top_k <= n_experts:
        raise UserError(f"{source}: num_experts_per_tok={top_k} must be between 1 and "
                        f"num_local_experts={n_experts}.")
    fields = {name: getattr(dense, name) for name in dense.__dataclass_fields__}
    return MoEArgs(**fields, n_experts=n_experts, top_k=top_k, router="softmax")


def check_exportable(args: MoEArgs, what: str) -> None:
    """Refuse a mixture of experts that a Mixtral checkpoint cannot hold, with the fix."""
    differences = [text for differs, text in (
        (args.router != "softmax", f"a {args.router} router (Mixtral's is softmax)"),
        (args.shared_hidden > 0, "a shared expert"),
        (args.dense_layers > 0, f"{args.dense_layers} dense blocks")) if differs]
    if differences:
        raise UserError(f"{what} writes Mixtral checkpoints, and this model has {', '.join(differences)}, "
                        f"which Mixtral has not. Use checkpoint.export (our own format) for it.")


def hf_config_from_args(args: MoEArgs, carried: dict | None = None, dtype: str = "float32") -> dict:
    """A config.json for MixtralForCausalLM with these shapes (check_exportable first)."""
    config = llama_hf.hf_config_from_args(args, carried, dtype)
    for key in ("attention_bias", "mlp_bias"):
        del config[key]
    config.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, intermediate_size=args.routed_hidden,
                  num_local_experts=args.n_experts, num_experts_per_tok=args.top_k, sliding_window=None,
                  router_jitter_noise=0.0, output_router_logits=False)
    for key in MORE_CARRIED_KEYS:  # llama_hf.hf_config_from_args took its own
        if carried and carried.get(key) is not None:
            config[key] = carried[key]
    return config
