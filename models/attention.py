"""The attention core the built-in models share: what a plan names as `attention`
(parallel/plan.py) so that context parallelism can attend across ranks in its place."""

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v under a causal mask, on (batch, heads, seq, head_dim)
    tensors. k and v may have fewer heads than q, each serving consecutive query heads;
    SDPA's enable_gqa reads them in place, where repeating them would save copies."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
