"""A GPT-2 style decoder, different in kind from models.llama: LayerNorm with biases,
learned positions, a fused qkv projection, GELU MLP and always-tied embeddings.

The fused qkv output is laid out head by head, (head, q|k|v, head_dim), so a split
of its output features into whole heads gives each rank complete q, k, v triples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from models.attention import CausalAttention
from models.initial_values import Constant, Normal


@dataclass(frozen=True)
class GPT2Args:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int = 1024
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


FLAVORS = {
    "debug": GPT2Args(dim=128, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=256),
    "small": GPT2Args(dim=768, n_layers=12, n_heads=12, vocab_size=50304),
}


class Attention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.c_attn = nn.Linear(args.dim, 3 * args.dim)
        self.c_proj = nn.Linear(args.dim, args.dim)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.c_attn(x), "b s (h three d) -> three b h s d", three=3, d=self.head_dim)
        out = self.core(q, k, v)
        return self.c_proj(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: each token's position in its sequence (context parallelism passes
        them); None means 0, 1, ..."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def reset_buffers(self) -> None:
        """No buffers: positions are learned parameters."""

    def init_distribution(self, fqn: str) -> Normal | Constant:
        if fqn.endswith("bias"):
            return Constant(0.0)
        if ".ln_" in f".{fqn}":
            return Constant(1.0)
        return Normal(0.02 / math.sqrt(2 * self.args.n_layers) if fqn.endswith("c_proj.weight") else 0.02)
