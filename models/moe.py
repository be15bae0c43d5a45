"""A Llama-style mixture of experts: the Llama decoder (models/llama.py) whose feed-forward
is, from block `dense_layers` on, a set of routed SwiGLU experts, each token sent to its
top-k, plus an optional shared expert that every token passes through.

Dropless: every expert takes all the tokens routed to it (no capacity factor). The routed
tokens are sorted by expert so that all experts run as one grouped GEMM where the torch
build has one for the device and dtype (torch._grouped_mm), or one matmul per expert
elsewhere; the choice is made once, when the model is materialised on its device
(`grouped_gemm_works`), and both ways give the same values (tests/test_moe.py).

Load balance: each MoE computes, per sequence, the load-balancing loss E x sum_e f_e x P_e
(f_e: the share of the sequence's top-k choices that went to expert e; P_e: the router's
mean probability for e; 1 when balanced, E when one expert takes everything). With a
weight (config `moe.load_balance`) it joins the step's loss through the MoE's output
(`_AddLossGradient`), so its gradient is right for any micro-batch count and pipeline
schedule. Per sequence, it does not depend on how the batch is split over ranks or
micro-batches. The sigmoid router's bias instead moves toward balance after each step
(config `moe.bias_rate`, `Router.update_bias`; DeepSeek-V3's auxiliary-loss-free method).
Each MoE adds its tokens per expert, router entropy and loss into `routing_totals`, which
the loop reads once a step (engine/routing.py).

The expert weights are 3-D, one slice per expert, in the layout of transformers'
MixtralExperts: gate and up projections stacked (`w13`, experts x 2 hidden x dim) and the
down projection (`w2`, experts x dim x hidden).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.initial_values import Constant, Normal
from models.llama import Attention, FeedForward, Llama, LlamaArgs, RMSNorm

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs(LlamaArgs):
    n_experts: int = 8
    top_k: int = 2
    # Each routed expert's SwiGLU width; 0 takes ffn_hidden.
    expert_hidden: int = 0
    # Width of the shared expert every token also passes through; 0 for none.
    shared_hidden: int = 0
    # softmax: Mixtral's router (softmax over all experts, the top k renormalised);
    # sigmoid: DeepSeek-V3's (a sigmoid score per expert, the top k of score + a bias
    # chosen outside the gradient, weights the chosen scores normalised).
    router: str = "softmax"
    # The first blocks keep a dense feed-forward of width ffn_hidden (DeepSeek-V3: 3).
    dense_layers: int = 0

    @property
    def routed_hidden(self) -> int:
        return self.expert_hidden or self.ffn_hidden


FLAVORS = {
    # Small enough for CPU tests: 8 experts of width 128, top 2, a shared expert.
    "debug-moe": MoEArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=256,
                         max_seq_len=512, n_experts=8, top_k=2, expert_hidden=128, shared_hidden=128),
    # Mixtral's published shapes (its config.json), for planning.
    "mixtral-8x7B": MoEArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=32000,
                            max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2),
    "mixtral-8x22B": MoEArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_hidden=16384, vocab_size=32768,
                             max_seq_len=65536, rope_theta=1e6, n_experts=8, top_k=2),
    # DeepSeek-V3's sizes (61 blocks, the first 3 dense of width 18,432; 256 routed experts
    # of width 2,048, top 8, one shared expert; sigmoid router) with plain grouped-query
    # attention of 128 heads in place of its multi-head latent attention.
    "deepseek-v3-gqa": MoEArgs(dim=7168, n_layers=61, n_heads=128, n_kv_heads=8, ffn_hidden=18432,
                               vocab_size=129280, max_seq_len=4096, n_experts=256, top_k=8, expert_hidden=2048,
                               shared_hidden=2048, router="sigmoid", dense_layers=3),
}
# The debug MoE with Mixtral's router and no shared expert: the oracle test's shape.
FLAVORS["debug-moe-mixtral"] = dataclasses.replace(FLAVORS["debug-moe"], shared_hidden=0)
FLAVORS["debug-moe-sigmoid"] = dataclasses.replace(FLAVORS["debug-moe"], router="sigmoid", dense_layers=1)
# 2 experts, top 1, the sigmoid router: at dp=4,ep=2 each rank's one expert is sharded by
# FSDP over 2 ranks along its rows (parallel/expert.py: expert_placement).
FLAVORS["debug-moe-2"] = dataclasses.replace(FLAVORS["debug-moe"], n_experts=2, top_k=1, router="sigmoid")
# 8 blocks, as the dense debug-deep: a pipeline of 2 stages per rank with an uneven split.
FLAVORS["debug-moe-deep"] = dataclasses.replace(FLAVORS["debug-moe"], n_layers=8)
# DeepSeek-V3's pattern at CPU scale, 2 dense blocks before 6 of experts: the planner keeps
# such leading blocks where the model has them (engine/dryrun/search.py).
FLAVORS["debug-moe-deep-dense"] = dataclasses.replace(FLAVORS["debug-moe-deep"], dense_layers=2, router="sigmoid")


def check_args(args: MoEArgs, what: str) -> None:
    """Refuse shapes the layer cannot route, with the fix (common.errors.UserError)."""
    from common.errors import UserError
    if args.router not in ROUTERS:
        raise UserError(f"{what}: router {args.router!r} is not one of {', '.join(ROUTERS)}.")
    if not 1 <= args.top_k <= args.n_experts:
        raise UserError(f"{what}: top_k={args.top_k} must be between 1 and n_experts={args.n_experts}: "
                        f"a token cannot go to more experts than there are.")
    if not 0 <= args.dense_layers <= args.n_layers:
        raise UserError(f"{what}: dense_layers={args.dense_layers} must be between 0 and n_layers={args.n_layers}.")


class Router(nn.Module):
    """Each token's top-k experts and the weights their outputs are summed with."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k, self.kind = args.top_k, args.router
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        # DeepSeek-V3's auxiliary-loss-free balancing: added to the scores for the choice
        # only, so it takes no gradient; it stays zero until something updates it.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=args.router == "sigmoid")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (tokens, dim) -> (weights (tokens, k) in x's dtype, experts (tokens, k), each
        token's probability over all experts (tokens, n_experts) in fp32: the softmax, or the
        sigmoid scores over their sum)."""
        logits = self.gate(x).float()
        if self.kind == "softmax":
            probs = logits.softmax(dim=-1)
            weights, experts = probs.topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts, probs

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's balancing without a loss: each expert's bias moves by `rate` toward
        the mean load, down for an expert that took more tokens than the mean, up for one
        that took fewer. `load`: tokens per expert over all data ranks, so every rank moves
        its copy alike. The softmax router has no bias."""
        if self.kind == "sigmoid" and rate:
            self.expert_bias += rate * torch.sign(load.mean() - load.to(self.expert_bias))


def grouped_gemm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here (it needs a recent torch,
    and on CUDA a recent GPU and bf16), tried on a few rows, and whether its meta kernel,
    which torch.compile traces with, takes the dtype too (before torch 2.15 it takes bf16
    only). Called when the model is materialised (MoELlama.reset_buffers), outside any
    checkpoint or compile."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        for where in (device, torch.device("meta")):
            x = torch.ones(32, 16, device=where, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=where, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([16, 32], device=where, dtype=torch.int32)
            with torch.enable_grad():
                out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
                out.backward(torch.ones_like(out))
        return True
    except (RuntimeError, NotImplementedError):
        return False


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, all experts in one tensor each."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts = args.n_experts
        self.w13 = nn.Parameter(torch.empty(args.n_experts, 2 * args.routed_hidden, args.dim))
        self.w2 = nn.Parameter(torch.empty(args.n_experts, args.dim, args.routed_hidden))
        # The compute dtypes in which the grouped GEMM runs on this module's device, found
        # once when the model is materialised (MoELlama.reset_buffers); the others loop.
        self.grouped_dtypes: frozenset = frozenset()

        # The share of the experts' weights a token multiplies by (engine/metrics/throughput.py).
        self.active_share = args.top_k / args.n_experts

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """x: tokens sorted by expert, counts[e] of them for expert e; `sizes`: the same
        counts as a list, where they are known without reading `counts` (a dry run)."""
        return self.compute(x, counts, self.w13, self.w2, sizes)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                sizes: list[int] | None = None) -> torch.Tensor:
        """The experts whose weights are given (all of them, or an ep rank's) on their tokens.
        Expert parallelism (parallel/expert.py) calls it with this rank's experts."""
        if x.dtype in self.grouped_dtypes:
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
        outputs = []
        for expert, rows in enumerate(x.split(counts.tolist() if sizes is None else sizes)):
            gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, w2[expert]))
        return torch.cat(outputs)


def assumed_sizes(rows: int, n_experts: int, load: float, ep: int) -> list[int]:
    """Rows per expert for a step simulated without values to route by: the experts in `ep`
    equal groups (one per ep rank, in order), the first group taking `load` times the mean
    group's rows (`dryrun.expert_load`: 1 is balanced, `ep` all of them), the other groups
    sharing the rest alike, and each group's rows spread evenly over its experts. The dry
    run simulates ep rank 0, so it is the busiest rank."""
    local = n_experts // ep
    first = min(rows, round(rows * load / ep))
    groups = [first] + [(rows - first) // (ep - 1)] * (ep - 1) if ep > 1 else [rows]
    groups[-1] += rows - sum(groups)
    return [group // local + (i < group % local) for group in groups for i in range(local)]


class _AddLossGradient(torch.autograd.Function):
    """The MoE's output, unchanged; its backward also starts the backward of `loss` (the
    load-balancing loss) with `weight`, as if weight x loss had been added to the step's
    loss. Carried by the output, that gradient reaches the router whatever order a pipeline
    schedule runs its micro-batches' backwards in, and no loss value has to travel to the
    last stage (Megatron-core attaches its auxiliary losses the same way)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """Routed experts (and a shared one): the feed-forward of an MoE block."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k = args.top_k
        self.n_experts = args.n_experts
        self.router = Router(args)
        self.experts = Experts(args)
        self.shared = FeedForward(args.dim, args.shared_hidden) if args.shared_hidden else None
        # Set by the loop (engine/routing.py): the load-balancing loss's weight and the sigmoid
        # router's bias step (configure), and the parts a step's rows are split into, each
        # forward one part, whose loss weighs 1/slices (begin_step).
        self.load_balance, self.bias_rate, self.slices = 0.0, 0.0, 1
        self.context = None  # (cp group, cp size) where context parallelism splits sequences
        # Set by the dry run (engine/dryrun/simulate.py), whose tokens have no values to route
        # by: (load, ep), the rows per expert it assumes instead (assumed_sizes).
        self.assumed_load: tuple[float, int] | None = None
        self.biased = args.router == "sigmoid"  # whether bias_rate acts on its router
        # Tokens per expert, then the sums of router entropy and load-balancing loss, the
        # tokens and the sequences, added to by each forward and read by the loop.
        self.register_buffer("routing_totals", torch.zeros(args.n_experts + 4), persistent=False)

    def balance(self, load: torch.Tensor) -> None:
        """After a step: `load`, tokens per expert over all data ranks (engine/routing.py)."""
        self.router.update_bias(load, self.bias_rate)

    def balance_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Per sequence, E x sum_e f_e x P_e: probs (sequences, tokens, E), experts
        (sequences, tokens, k) -> (sequences,). f has no gradient; P carries the router's.
        Under context parallelism (`context`: the cp group and its size) each rank holds
        equal chunks of every sequence: f counts the choices of the whole sequence (summed
        over the cp ranks), and each rank's P is the mean over its own tokens. The loss is
        linear in P, so the cp ranks' values average to the sequence's, and so do their
        gradients once FSDP averages them over cp."""
        sequences, tokens, n_experts = probs.shape
        chosen = experts.reshape(sequences, -1)
        counts = torch.zeros(sequences, n_experts, device=probs.device).scatter_add_(
            1, chosen, torch.ones(chosen.shape, device=probs.device))
        parts = 1
        if self.context is not None:
            group, parts = self.context
            dist.all_reduce(counts, group=group)
        share = counts / (chosen.shape[1] * parts)
        return n_experts * (share * probs.mean(dim=1)).sum(dim=-1)

    @torch.no_grad()
    def record(self, counts: torch.Tensor, probs: torch.Tensor, balance: torch.Tensor) -> None:
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
        seen = torch.tensor([probs.shape[0] * probs.shape[1], probs.shape[0]], device=probs.device)
        self.routing_totals += torch.cat([counts.to(torch.float32), entropy.view(1), balance.sum().view(1), seen])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, probs = self.router(tokens)
        # Sort the (token, choice) pairs by expert; a stable sort keeps each expert's tokens
        # in their order, so the result does not depend on the sort's implementation.
        order = experts.flatten().argsort(stable=True)
        flat = experts.flatten()
        counts = torch.zeros(self.experts.n_experts, dtype=flat.dtype, device=flat.device).index_add_(
            0, flat, torch.ones_like(flat))
        length = shape[-2] if len(shape) > 2 else tokens.shape[0]  # (tokens, dim): one sequence
        probs = probs.view(-1, length, self.n_experts)
        balance = self.balance_loss(probs, experts.view(-1, length, self.top_k))
        self.record(counts, probs, balance)
        sizes = None if self.assumed_load is None else assumed_sizes(flat.numel(), self.n_experts, *self.assumed_load)
        routed = (self.experts(tokens[order // self.top_k], counts) if sizes is None
                  else self.experts(tokens[order // self.top_k], counts, sizes))
        # Back to (token, choice) order, then each token's k outputs summed by weight.
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)
        out = (unsorted.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.load_balance and torch.is_grad_enabled():
            out = _AddLossGradient.apply(out, balance.mean(), self.load_balance / self.slices)
        return out.view(shape)


class MoEBlock(nn.Module):
    """A Llama block whose feed-forward is an MoE (or dense, for the first blocks)."""

    def __init__(self, args: MoEArgs, index: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = (FeedForward(args.dim, args.ffn_hidden) if index < args.dense_layers else MoE(args))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class MoELlama(Llama):
    def __init__(self, args: MoEArgs):
        check_args(args, "model llama_moe")
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): MoEBlock(args, i) for i in range(args.n_layers)})

    def reset_buffers(self) -> None:
        super().reset_buffers()
        device = self.rope_cos.device
        grouped = frozenset(dtype for dtype in (torch.float32, torch.bfloat16) if grouped_gemm_works(device, dtype))
        for module in self.modules():
            if isinstance(module, Experts):
                module.grouped_dtypes = grouped
            if isinstance(module, Router):
                module.expert_bias.zero_()  # a checkpoint that holds it loads it afterwards
            if isinstance(module, MoE):
                module.routing_totals.zero_()

    def init_distribution(self, fqn: str) -> Normal | Constant:
        if fqn.endswith("experts.w2"):
            return Normal(0.02 / math.sqrt(2 * self.args.n_layers))  # a residual output, as Llama's w2
        return super().init_distribution(fqn)
