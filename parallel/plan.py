"""What a parallelize plan is: plain data about one model, plus a registry by name.

A plan says which modules are the repeated blocks (FSDP units) and which
tensor-parallel style goes on which submodule. Paths are dot-separated module
names in which each part may be a shell-style glob, so "layers.*.attention.wq"
names the query projection of every block. The engine (parallel/apply.py)
decides the order in which the pieces are applied; a plan never does.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from engine.errors import UserError


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
    # Path glob of the attention cores: modules called as core(q, k, v) on (batch, heads,
    # seq, head_dim) tensors that return causal softmax attention. With cp > 1 the engine
    # attends across the cp ranks in their place (parallel/context.py); None refuses cp > 1.
    attention: str | None = None


PLANS: dict[str, Plan] = {}


def register_plan(plan: Plan) -> Plan:
    PLANS[plan.name] = plan
    return plan


def get_plan(name: str) -> Plan:
    if name not in PLANS:
        raise UserError(f"unknown plan {name!r}. Registered plans: {', '.join(sorted(PLANS)) or 'none'}.")
    return PLANS[name]


def path_matches(pattern: str, path: str) -> bool:
    """Glob match part by part, so "*" never crosses a dot."""
    parts, pattern_parts = path.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(
        fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts))


def expand(model: nn.Module, pattern: str, plan_name: str) -> list[str]:
    """The module paths `pattern` names, in model order; an error if there are none."""
    paths = [name for name, _ in model.named_modules() if name and path_matches(pattern, name)]
    if not paths:
        raise UserError(
            f"plan {plan_name!r}: pattern {pattern!r} matches no module of "
            f"{type(model).__name__}. Check the path against the model's module names "
            f"(print(dict(model.named_modules()).keys()))."
        )
    return paths
