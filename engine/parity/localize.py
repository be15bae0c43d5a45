"""Where a sharded step 0 parts ways with the single-device one.

Hooks on every module of both models record the first call of each module in the
step: its output (forward) and the gradient with respect to its input (backward).
After backward, each module's own parameter gradients are compared too. Each rank
compares its local pieces with the matching slices of the reference's tensors, so the
hooks never communicate; the differences are reduced over the world afterwards.

The divergence is the first module, in execution order, that differs beyond
tolerance: outputs in forward order first, then input gradients in backward order,
then parameter gradients in backward order. A module's output is recorded when its
forward finishes, so an inner module comes before the block that contains it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from engine.parity.compare import Tolerance, full, max_abs_diff
from engine.train import forward_backward
from parallel.context import split_sequence

KINDS = ("output", "input gradient")


@dataclass(frozen=True)
class RankPiece:
    """Which part of the global activations this rank holds: its rows of the global batch
    (data rank), with context parallel its two chunks of the sequence (cp rank), and, for
    tensor-parallel modules, its slice of one other dimension. With `micro_batches` > 1
    (a pipeline schedule) the first call of a module sees the first micro-batch of the
    rank's rows."""

    data_rank: int = 0
    data_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    micro_batches: int = 1
    # Modules fed other ranks' tokens: the experts under ep take the tokens routed to them
    # from every rank of their ep group, so their activations have no rows to match in the
    # reference's; their parameter gradients are still compared.
    other_tokens: frozenset = frozenset()


class Recorder:
    """Forward and backward hooks on every named submodule of `model`."""

    def __init__(self, model: torch.nn.Module):
        self.values: dict[str, dict[str, list]] = {kind: {} for kind in KINDS}
        self.forward_order: list[str] = []
        self.backward_order: list[str] = []
        self._entered: set[str] = set()
        self._handles = []
        for name, module in model.named_modules():
            if name:
                # prepend: see the input as the caller passed it, before any TP input hook
                # redistributes it, so a wrong redistribution shows up as this module's.
                self._handles.append(module.register_forward_pre_hook(
                    functools.partial(self._enter, name), prepend=True, with_kwargs=True))
                self._handles.append(module.register_forward_hook(functools.partial(self._leave, name)))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, name, module, args, kwargs):
        # Only the first call: activation checkpointing calls forward again in backward.
        if name in self._entered or not torch.is_grad_enabled():
            return None
        self._entered.add(name)
        grads = self.values["input gradient"].setdefault(name, [])

        def tap(value):
            if not (isinstance(value, torch.Tensor) and value.requires_grad):
                return value
            # A view of its own gets only this module's share of the gradient, not that of
            # every other use of the same tensor (a residual stream has several).
            tapped = value.view_as(value)
            grads.append(None)
            tapped.register_hook(functools.partial(self._input_grad, name, len(grads) - 1))
            return tapped

        return tuple(tap(a) for a in args), {k: tap(v) for k, v in kwargs.items()}

    def _input_grad(self, name, slot, grad):
        self.values["input gradient"][name][slot] = grad.detach().clone()
        if name not in self.backward_order:
            self.backward_order.append(name)

    def _leave(self, name, module, args, output):
        if name in self.values["output"]:
            return
        self.values["output"][name] = [t.detach().clone() for t in tree_leaves(output)
                                       if isinstance(t, torch.Tensor)]
        self.forward_order.append(name)


def batch_rows(reference: torch.Tensor, local_rows: int, where: RankPiece) -> torch.Tensor:
    pieces = where.data_size * where.micro_batches
    if pieces > 1 and reference.dim() and reference.shape[0] == local_rows * pieces:
        return reference.chunk(pieces, 0)[where.data_rank * where.micro_batches]
    return reference


def sequence_chunks(reference: torch.Tensor, shape, where: RankPiece) -> list[torch.Tensor]:
    """`reference` as it is, and with context parallel this cp rank's chunks of each
    dimension that is cp times longer in `reference` than in `shape` (the sequence,
    wherever a module keeps it)."""
    found = [reference]
    if where.cp_size > 1 and reference.dim() == len(shape):
        found += [split_sequence(reference, where.cp_rank, where.cp_size, dim) for dim in range(reference.dim())
                  if reference.shape[dim] == shape[dim] * where.cp_size]
    return found


def expected_pieces(reference: torch.Tensor, piece: torch.Tensor, where: RankPiece) -> list[torch.Tensor]:
    """The slices of the global `reference` this rank's `piece` may stand for. A DTensor
    says exactly; a plain tensor is matched by shape: the batch rows of this data rank,
    with context parallel its chunks of the sequence, then either the whole or this tp
    rank's part of one dimension (all such candidates)."""
    if isinstance(piece, DTensor):
        expected = batch_rows(reference, piece.shape[0], where) if piece.dim() else reference
        expected = next((c for c in sequence_chunks(expected, piece.shape, where) if c.shape == piece.shape), expected)
        coordinate = piece.device_mesh.get_coordinate()
        for mesh_dim, placement in enumerate(piece.placements):
            if placement.is_partial():
                return []
            if placement.is_shard():
                expected = expected.chunk(piece.device_mesh.size(mesh_dim), placement.dim)[coordinate[mesh_dim]]
        return [expected] if expected.shape == piece.to_local().shape else []
    bases = sequence_chunks(batch_rows(reference, piece.shape[0], where) if piece.dim() else reference,
                            piece.shape, where)
    exact = [base for base in bases if base.shape == piece.shape]
    if exact or where.tp_size == 1:
        return exact
    return [base.chunk(where.tp_size, dim)[where.tp_rank] for base in bases if base.dim() == piece.dim()
            for dim in range(piece.dim())
            if base.shape[dim] == piece.shape[dim] * where.tp_size
            and all(base.shape[d] == piece.shape[d] for d in range(piece.dim()) if d != dim)]


def piece_difference(references: list, pieces: list, where: RankPiece,
                     factor: float = 1.0) -> tuple[float, float]:
    """(largest difference, largest reference magnitude) over the comparable tensors, with
    this rank's pieces multiplied by `factor` first; (-1, 0) when none is comparable."""
    diff, scale = -1.0, 0.0
    for reference, piece in zip(references, pieces):
        if reference is None or piece is None:
            continue
        local = (piece.to_local() if isinstance(piece, DTensor) else piece) * factor
        candidates = expected_pieces(reference, piece, where)
        if not candidates:
            continue
        best = min(candidates, key=lambda c: max_abs_diff(local, c))
        diff = max(diff, max_abs_diff(local, best))
        scale = max(scale, best.detach().abs().max().item() if best.numel() else 0.0)
    return diff, scale


def localize(model, reference, inputs, targets, global_inputs, global_targets, where: RankPiece,
             tolerance: Tolerance, device, stage_of=None) -> dict:
    """Run step 0's forward and backward once more on both sides, recording every module,
    and return the first divergence (None when every module agrees). Collective. Under
    pipeline parallel each rank records the modules of its own stages; modules are named
    and ordered as the whole model (the reference) runs them, and `stage_of(name)` adds
    the stage that holds each finding."""
    ours, theirs = Recorder(model), Recorder(reference.compute)
    try:
        forward_backward(model, inputs, targets, where.micro_batches)
        reference.forward_backward(global_inputs, global_targets, slices=1)  # the recorder keeps one forward
    finally:
        ours.close()
        theirs.close()
    names = [name for name, _ in reference.compute.named_modules() if name]
    # Each rank's loss is the mean over its own tokens (its rows, its chunks of them), so
    # its activation gradients are data_size x cp_size times the reference's (parameter
    # gradients are averaged by FSDP instead).
    factors = {"output": 1.0, "input gradient": 1.0 / (where.data_size * where.cp_size)}
    table = torch.full((len(names), len(KINDS), 2), -1.0, dtype=torch.float64, device=device)
    for i, name in enumerate(names):
        if name in where.other_tokens:
            continue
        for k, kind in enumerate(KINDS):
            diff, scale = piece_difference(theirs.values[kind].get(name, []), ours.values[kind].get(name, []),
                                           where, factors[kind])
            table[i, k, 0], table[i, k, 1] = diff, scale
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    rows = {(name, kind): table[i, k].tolist() for i, name in enumerate(names) for k, kind in enumerate(KINDS)}

    backward = theirs.backward_order + [n for n in reversed(theirs.forward_order) if n not in theirs.backward_order]
    param_rows, largest_grad = parameter_gradient_rows(model, reference.model, backward, names, device)
    findings = []
    for kind, order in (("output", theirs.forward_order), ("input gradient", theirs.backward_order)):
        for name in order:
            diff, scale = rows[(name, kind)]
            if diff >= 0 and diff > tolerance.activation * scale:
                findings.append(_finding(name, kind, diff, scale, tolerance.activation * scale))
    grad_limit = tolerance.grad_limit(largest_grad)
    findings += [_finding(name, "parameter gradient", diff, scale, grad_limit)
                 for name, diff, scale in param_rows if diff > grad_limit]
    compared = sum(1 for (_, kind), (diff, _) in rows.items() if diff >= 0)
    for finding in findings if stage_of is not None else ():
        finding["stage"] = stage_of(finding["module"])
    return {"first": findings[0] if findings else None, "differing": findings[:10],
            "values_compared": compared + len(param_rows),
            "modules": len(names)}


def parameter_gradient_rows(model, reference_model, backward_order: list[str], names: list[str], device):
    """(module, largest difference, largest reference gradient) for each module with
    parameters of its own, in backward order; and the largest gradient overall. The
    gathers (full_tensor) run in module order, the same on every rank of a stage; the
    table, over the whole model's module `names`, is then reduced over every rank."""
    table = torch.full((len(names), 2), -1.0, dtype=torch.float64, device=device)
    index = {name: i for i, name in enumerate(names)}
    for name, module in model.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.grad is not None]
        if not name or not params:
            continue
        theirs = reference_model.get_submodule(name)
        diff, scale = 0.0, 0.0
        for param_name, param in params:
            expected = theirs.get_parameter(param_name).grad
            diff = max(diff, max_abs_diff(full(param.grad), expected))
            scale = max(scale, expected.abs().max().item())
        table[index[name]] = torch.tensor([diff, scale], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    rows = {name: (name, *table[i].tolist()) for i, name in enumerate(names) if table[i, 0] >= 0}
    largest = max((scale for _, _, scale in rows.values()), default=0.0)
    return [rows[name] for name in backward_order if name in rows], largest


def _finding(name: str, kind: str, diff: float, scale: float, limit: float) -> dict:
    return {"module": name, "what": kind, "max_abs_diff": diff,
            "relative": diff / scale if scale > 0 else float("inf"), "tolerance": limit}
