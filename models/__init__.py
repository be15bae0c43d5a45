"""Model registry: name -> (class, flavors). Models are built on the meta device."""

from __future__ import annotations

import dataclasses

import torch

from common.errors import UserError
from models import gpt2, llama, moe

MODELS = {
    "llama": (llama.Llama, llama.FLAVORS),
    "gpt2": (gpt2.GPT2, gpt2.FLAVORS),
    "llama_moe": (moe.MoELlama, moe.FLAVORS),
}


def register_model(name: str, model_class, flavors: dict) -> None:
    """Add a model from outside this package. The class takes one flavor's args and
    must meet the contract of models/contract.py (docs/plans.md): init_distribution(fqn) or
    init_value(fqn, shape, generator), reset_buffers(), an `args` with
    vocab_size and max_seq_len, and tie_weights() if it shares parameters."""
    MODELS[name] = (model_class, flavors)


def model_args(name: str, flavor: str):
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}. Known models: {', '.join(MODELS)}.")
    flavors = MODELS[name][1]
    if flavor not in flavors:
        raise UserError(f"model {name!r} has no flavor {flavor!r}. Known flavors: {', '.join(flavors)}.")
    return flavors[flavor]


def build_on_meta(name: str, flavor: str, n_layers: int = 0, dense_layers: int | None = None) -> torch.nn.Module:
    """The model with every parameter on the meta device: no memory is used yet.
    `n_layers` > 0 builds the flavor with that many blocks instead (a reduced depth);
    `dense_layers` sets how many of them lead (leading_blocks), for the planner's short
    models, which place them where the full model has them."""
    args = model_args(name, flavor)
    if n_layers:
        args = with_depth(args, n_layers, f"{name}/{flavor}")
    if dense_layers is not None and dense_layers != leading_blocks(args):
        args = dataclasses.replace(args, dense_layers=dense_layers)
    with torch.device("meta"):
        return MODELS[name][0](args)


def leading_blocks(args) -> int:
    """The first blocks that differ from the rest: a flavor's `dense_layers` (dense
    feed-forwards before a mixture of experts', as DeepSeek-V3's first 3), else none.
    The planner, which extrapolates from a few alike blocks, keeps them apart."""
    return getattr(args, "dense_layers", 0)


def with_depth(args, n_layers: int, what: str):
    """The same model args with `n_layers` blocks, as many leading blocks kept as fit; the
    args must be a dataclass with an `n_layers` field no smaller than the request."""
    depth = getattr(args, "n_layers", None)
    if not dataclasses.is_dataclass(args) or not isinstance(depth, int):
        raise UserError(f"{what} has no n_layers in its args, so its depth cannot be reduced. "
                        f"Leave parity.layers at 0.")
    if n_layers > depth:
        raise UserError(f"parity.layers={n_layers} is deeper than {what}, which has {depth} blocks. "
                        f"Use 1 to {depth}, or 0 for the full depth.")
    if leading_blocks(args) > n_layers:
        args = dataclasses.replace(args, dense_layers=n_layers)
    return dataclasses.replace(args, n_layers=n_layers)
