"""Checks a plan against a model and a TP degree before anything is applied, so a
wrong plan fails with the module path instead of deep inside DTensor."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from common.errors import UserError
from parallel.plan import Plan, expand, path_matches


def _split_dim(module: nn.Module, style) -> tuple[str, int] | None:
    """(what is split, its size) for the module types Colwise/Rowwise can shard."""
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        return ("output features", module.out_features) if colwise else ("input features", module.in_features)
    if isinstance(module, nn.Embedding):
        return ("embedding dim", module.embedding_dim) if colwise else ("vocabulary rows", module.num_embeddings)
    return None


def validate_plan(model: nn.Module, plan: Plan, styles: dict, tp: int, sequence_parallel: bool) -> None:
    """`styles` maps concrete module paths to styles (parallel.apply.tensor_parallel_styles)."""
    expand(model, plan.blocks, plan.name)
    if sequence_parallel and not plan.sequence_parallel:
        raise UserError(f"plan {plan.name!r} has no sequence-parallel entries, so "
                        f"parallel.sequence_parallel=true cannot apply. Set it to false, or add "
                        f"sequence_parallel styles to the plan.")
    for pattern in plan.shard_units:
        expand(model, pattern, plan.name)
    for path, style in styles.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        module = model.get_submodule(path)
        split = _split_dim(module, style)
        if split is None:
            raise UserError(
                f"plan {plan.name!r}: {type(style).__name__} on {path!r}, a {type(module).__name__}, "
                f"cannot shard it: Colwise/RowwiseParallel shard nn.Linear and nn.Embedding only. "
                f"Put the style on the Linear/Embedding submodules, or use PrepareModuleInput/"
                f"SequenceParallel for this module.")
        what, size = split
        unit = next((fn(model) for pattern, fn in plan.shard_units.items() if path_matches(pattern, path)), 1)
        if size % (unit * tp):
            detail = f" = {size // unit} units of {unit}, e.g. heads" if unit > 1 else ""
            raise UserError(
                f"plan {plan.name!r}: {type(style).__name__} splits the {what} of {path!r} "
                f"({size}{detail}) over tp={tp} ranks, which does not divide evenly. Use a tp "
                f"size that divides {size // unit}, or leave this module out of the TP plan.")
