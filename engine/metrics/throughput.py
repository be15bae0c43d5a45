"""Peak FLOP/s of known accelerators, for model FLOPs utilisation (MFU).

The table holds NVIDIA's published dense (no sparsity) BF16 Tensor Core peaks from the
A100, H100, H200 and B200 datasheets, per GPU. MFU is reported against the BF16 peak
whatever the training dtype, as torchtitan does, so runs are comparable. A device not
in the table (any CPU, an unlisted GPU) gets no MFU, only achieved FLOP/s.
"""

from __future__ import annotations

import torch
from torch import nn

# Checked in order: the first name fragment found in the device name wins.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
)


def peak_flops_for(device_name: str) -> float | None:
    for fragment, peak in PEAK_BF16_FLOPS:
        if fragment in device_name:
            return peak
    return None


def device_peak_flops(device: torch.device) -> tuple[str, float | None]:
    """(device name, peak FLOP/s per device or None when unknown)."""
    if device.type != "cuda":
        return device.type, None
    name = torch.cuda.get_device_name(device)
    return name, peak_flops_for(name)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the model's own `flops_per_token(seq_len)` when it has one,
    else the estimate of PaLM (appendix B), as torchtitan counts: 6 per weight used in a
    matmul (forward 2, backward 4), plus 12 * n_layers * dim * seq_len for the attention
    scores and their weighted sum (not halved for the causal mask) when the model's args
    give n_layers and dim. An embedding is a lookup, not a matmul, so its weight counts
    only when a Linear shares it (tied output projection)."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    args = getattr(model, "args", None)
    n_layers, dim = getattr(args, "n_layers", None), getattr(args, "dim", None)
    attention = 12 * n_layers * dim * seq_len if isinstance(n_layers, int) and isinstance(dim, int) else 0
    return float(6 * matmul_weights(model) + attention)


def matmul_weights(model: nn.Module) -> float:
    """The parameters a token of `model` multiplies by: all but those only looked up
    (embeddings), and of a module that declares an `active_share` (a mixture's routed
    experts, models/moe.py: top_k of n_experts) that share of its own."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - linear_weights
    share = {id(p): m.active_share for m in model.modules() if hasattr(m, "active_share")
             for p in m.parameters(recurse=False)}
    return sum(p.numel() * share.get(id(p), 1) for p in model.parameters() if id(p) not in lookups)
