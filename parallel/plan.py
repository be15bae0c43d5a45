"""What a parallelize plan is: plain data about one model, plus a registry by name.

A plan says which modules are the repeated blocks (FSDP units) and which
tensor-parallel style goes on which submodule, and how the model runs when its
blocks are split over pipeline stages. Paths are dot-separated module names in which
each part may be a shell-style glob, so "layers.*.attention.wq" names the query
projection of every block. The engine (parallel/apply.py) decides the order in which
the pieces are applied; a plan never does.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from common.errors import UserError


@dataclass(frozen=True)
class Stages:
    """How the model runs split into pipeline stages (parallel/pipeline.py). Each stage
    holds a run of consecutive blocks; the first stage also holds `first` (what runs
    before the blocks: the embedding), the last also holds `last` (what runs after
    them: final norm and output projection). A stage computes, on what it holds:

        h = embed(model, tokens, positions)        first stage only
        h = block(model, module, h, positions)     for each of its blocks, in order
        logits = head(model, h)                    last stage only

    where `model` is the stage's copy of the model: every module it does not hold is
    gone, buffers (RoPE tables, say) stay. `positions` is each local token's position in
    its sequence under context parallelism (cp > 1, where a rank holds two chunks of every
    sequence), and None otherwise, meaning 0, 1, ...: what the model's own
    forward(tokens, positions=None) takes. The defaults call the `first` modules one
    after the other on the tokens, each block on the hidden state alone, and the `last`
    modules one after the other; they ignore `positions`."""

    first: tuple[str, ...]
    last: tuple[str, ...]
    embed: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    block: Callable[[nn.Module, nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Plan:
    """`tensor_parallel` is used as is without sequence parallel; with it,
    `sequence_parallel` entries are laid over it (same path: replaced). Between
    blocks, sequence-parallel hidden states are sharded on the sequence dimension
    (Shard(1)). `output` names the final projection, whose style the engine sets
    from the sequence- and loss-parallel switches."""

    name: str
    blocks: str  # path glob of the repeated blocks, e.g. "layers.*"
    tensor_parallel: dict[str, ParallelStyle] = field(default_factory=dict)
    sequence_parallel: dict[str, ParallelStyle] = field(default_factory=dict)
    output: str | None = None
    # Path glob -> the width of one indivisible unit along the dimension TP splits
    # (an attention head), given the model: lambda model: model.args.head_dim.
    shard_units: dict[str, Callable[[nn.Module], int]] = field(default_factory=dict)
    # Block paths in forward execution order, for models that do not run their blocks in
    # module order; None means module order. Used by explicit prefetch (parallel/prefetch.py).
    prefetch_order: tuple[str, ...] | None = None
    # Path globs of the sublayers of a block (its norms, attention, MLP) whose cheap
    # activations are recomputed in backward while their matmul and attention outputs are
    # kept (parallel/apply.py, step 2). Empty: the modules the sequence-parallel overlay
    # gathers the sequence into.
    sublayers: tuple[str, ...] = ()
    # Path globs of sublayers (a norm) whose output only the next sublayer reads, as its
    # input. With recompute_cheap that output is freed once the next sublayer has run and
    # computed again just before its backward, instead of kept all the while
    # (parallel/recompute.py).
    recomputed_outputs: tuple[str, ...] = ()
    # How the model splits into pipeline stages; None refuses pp > 1.
    stages: Stages | None = None
    # Path glob of the attention cores: modules called as core(q, k, v) on (batch, heads,
    # seq, head_dim) tensors that return causal softmax attention. With cp > 1 the engine
    # attends across the cp ranks in their place (parallel/context.py); None refuses cp > 1.
    attention: str | None = None
    # Path globs of linears inside the blocks that parallel.float8 leaves in the compute
    # dtype (a router's gate, say).
    float8_skip: tuple[str, ...] = ()
    # Path glob of a mixture of experts' routed-experts modules, which ep > 1 splits by
    # expert (parallel/expert.py): each called as experts(tokens sorted by expert, counts
    # per expert[, sizes]), holding w13 and w2 stacked by expert on dim 0, with a
    # compute(tokens, counts, w13, w2[, sizes]) for a subset of them (`sizes`: the counts
    # as a list, passed by the dry run, whose counts have no values). None refuses ep > 1.
    experts: str | None = None


PLANS: dict[str, Plan] = {}


def register_plan(plan: Plan) -> Plan:
    PLANS[plan.name] = plan
    return plan


def get_plan(name: str) -> Plan:
    if name not in PLANS:
        raise UserError(f"unknown plan {name!r}. Registered plans: {', '.join(sorted(PLANS)) or 'none'}.")
    return PLANS[name]


def plan_of(cfg) -> Plan:
    """The run's plan: `parallel.plan`, or where that is unset the plan registered under
    the model's name (each built-in and example plan is named after its model), and for a
    model with no plan of its name Llama's, the plan every model took before plans
    followed model names."""
    name = cfg.parallel.plan or (cfg.model.name if cfg.model.name in PLANS else "llama")
    return get_plan(name)


def is_stage_part(model: nn.Module) -> bool:
    """Whether `model` is one pipeline stage's part of a model (parallel/pipeline.py)."""
    return hasattr(model, "stage_index")


def path_matches(pattern: str, path: str) -> bool:
    """Glob match part by part, so "*" never crosses a dot."""
    parts, pattern_parts = path.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(
        fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts))


def expand(model: nn.Module, pattern: str, plan_name: str) -> list[str]:
    """The module paths `pattern` names, in model order; an error if there are none, except
    in a pipeline stage's part of the model (parallel/pipeline.py), which holds only some
    modules (the whole model was checked before it was split)."""
    paths = [name for name, _ in model.named_modules() if name and path_matches(pattern, name)]
    if not paths and not is_stage_part(model):
        raise UserError(
            f"plan {plan_name!r}: pattern {pattern!r} matches no module of "
            f"{type(model).__name__}. Check the path against the model's module names "
            f"(print(dict(model.named_modules()).keys()))."
        )
    return paths
