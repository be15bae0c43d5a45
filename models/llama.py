"""A Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Attention reshapes with an inferred head count, so the same code runs with
all heads on one device or a tensor-parallel slice of them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from models.attention import CausalAttention
from models.initial_values import Constant, Normal


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Llama 3.1/3.2 rope scaling ("rope_type": "llama3" in Hugging Face configs):
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rope_scaling: tuple[float, float, float, int] | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Public Llama 3 shapes. The 3.1/3.2 releases also scale rope (LlamaArgs.rope_scaling);
# these flavors leave it off (the -128K ones below have it), while a Hugging Face import
# (checkpoint.hf_import) takes it from the checkpoint's config.json.
FLAVORS = {
    "debug": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                       vocab_size=256, max_seq_len=512),
    "debug_tied": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                            vocab_size=256, max_seq_len=512, tie_embeddings=True),
    # About 100M parameters: the largest size that a CPU test of the dry run can also train.
    "100M": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048,
                      vocab_size=16384, max_seq_len=2048),
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                    vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                    vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                     vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "405B": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248,
                      vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
}


# Llama 3.1's long-context models: the same parameters, 131,072 positions and its rope
# scaling (factor 8, low and high frequency factors 1 and 4, from 8,192 positions), as in
# their config.json. Checkpoints of 8B, 70B and 405B hold the same tensors, so they load here
# (checkpoint.init_from) for long-context training. 8B-1M stretches the same scaling to
# 1,048,576 positions (factor 128): a shape to plan million-token runs with
# (docs/planning.md), not a published model.
LLAMA_3_1_ROPE_SCALING = (8.0, 1.0, 4.0, 8192)
FLAVORS["8B-128K"] = dataclasses.replace(FLAVORS["8B"], max_seq_len=131072, rope_scaling=LLAMA_3_1_ROPE_SCALING)
FLAVORS["70B-128K"] = dataclasses.replace(FLAVORS["70B"], max_seq_len=131072, rope_scaling=LLAMA_3_1_ROPE_SCALING)
FLAVORS["405B-128K"] = dataclasses.replace(FLAVORS["405B"], max_seq_len=131072, rope_scaling=LLAMA_3_1_ROPE_SCALING)
FLAVORS["8B-1M"] = dataclasses.replace(FLAVORS["8B"], max_seq_len=1048576, rope_scaling=(128.0, 1.0, 4.0, 8192))
# The debug model with room for long sequences: context parallelism's runs on a CPU.
FLAVORS["debug-32K"] = dataclasses.replace(FLAVORS["debug"], max_seq_len=32768)
# The debug model at 8 blocks: room on a CPU for looped pipelines (pp=4 with 2 stages per
# rank) and uneven splits (parallel.pp_split).
FLAVORS["debug-deep"] = dataclasses.replace(FLAVORS["debug"], n_layers=8)


def rope_frequencies(args: LlamaArgs, device=None) -> torch.Tensor:
    """The inverse frequency of each rotated pair: the same values, bit for bit, as
    Hugging Face's LlamaRotaryEmbedding.inv_freq (default and "llama3" rope types)."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    if args.rope_scaling is not None:
        inv_freq = llama3_scaled(inv_freq, *args.rope_scaling)
    return inv_freq


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_position: int) -> torch.Tensor:
    """Llama 3.1 rope scaling, in the same operations and order as transformers'
    _compute_llama3_parameters: long wavelengths are divided by `factor`, short ones kept,
    and those between are interpolated."""
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(args: LlamaArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_frequencies(args, device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head; x is (b, s, h, d).

    In x's dtype, as Hugging Face's Llama does: a bf16 run keeps no fp32 copies of q and k
    for the backward, and an fp32 run gets the same bits as an fp32 rotation."""
    seq = x.shape[1]
    cos, sin = cos[:seq, None, :].to(x.dtype), sin[:seq, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm accumulates in fp32 and rounds the normed value to x's dtype before the
        # weight multiplies it, as Hugging Face's LlamaRMSNorm does (bitwise the same in
        # fp32); on CUDA it is one fused kernel that saves x and one fp32 value per row.
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(proj(x), "b s (h d) -> b s h d", d=self.head_dim)
                   for proj in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
        # Each kv head serves n_heads / n_kv_heads consecutive query heads (a TP slice keeps that ratio).
        out = self.core(q, k, v)
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps the names "layers.0", "layers.1", ... stable for checkpoints.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection; called again after TP."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: each token's position in its sequence, when the tokens are not the
        whole sequence (context parallelism holds two chunks of it); None means 0, 1, ..."""
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def reset_buffers(self) -> None:
        cos, sin = rope_tables(self.args, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def init_distribution(self, fqn: str) -> Normal | Constant:
        """How parameter `fqn` is initialised (models/initial_values.py)."""
        if fqn.endswith("norm.weight"):
            return Constant(1.0)
        if fqn == "tok_embeddings.weight":
            return Normal(self.args.dim ** -0.5 if self.args.tie_embeddings else 1.0)
        if fqn == "output.weight":
            return Normal(self.args.dim ** -0.5)
        if fqn.endswith(("wo.weight", "w2.weight")):
            return Normal(0.02 / math.sqrt(2 * self.args.n_layers))  # residual outputs, GPT-2 style
        return Normal(0.02)
