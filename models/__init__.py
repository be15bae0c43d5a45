"""Model registry: name -> (class, flavors). Models are built on the meta device."""

from __future__ import annotations

import torch

from engine.errors import UserError
from models import llama

MODELS = {
    "llama": (llama.Llama, llama.FLAVORS),
}


def model_args(name: str, flavor: str):
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}. Known models: {', '.join(MODELS)}.")
    flavors = MODELS[name][1]
    if flavor not in flavors:
        raise UserError(f"model {name!r} has no flavor {flavor!r}. Known flavors: {', '.join(flavors)}.")
    return flavors[flavor]


def build_on_meta(name: str, flavor: str) -> torch.nn.Module:
    """The model with every parameter on the meta device: no memory is used yet."""
    args = model_args(name, flavor)
    with torch.device("meta"):
        return MODELS[name][0](args)
