"""What the loop does for a mixture of experts' routers, once per optimizer step: sums each
routed layer's totals (tokens per expert, router entropy, the load-balancing loss) over
the data ranks, moves the sigmoid routers' bias by the global load, and brings every
stage's layers to every rank for the step log and TensorBoard.

A routed layer is any module with a `routing_totals` buffer (models/moe.py: MoE): per
expert the tokens routed to it, then the summed router entropy, the summed load-balancing
loss of its sequences, the tokens and the sequences it saw. Every figure read from them is
a ratio of two totals, so a forward that activation checkpointing runs again in backward,
which adds to the totals twice, changes none of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from common.errors import UserError

TOTALS = "routing_totals"
LOAD = "step_load"  # tokens per expert in the step, over every data rank, until `balance` applies them


def routed_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each routed layer, with the wrappers' names (compile, activation
    checkpointing) taken out of the path."""
    return [(_clean(name), module) for name, module in model.named_modules()
            if isinstance(getattr(module, TOTALS, None), torch.Tensor)]


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in ("_orig_mod", "_checkpoint_wrapped_module"))


def check(model: nn.Module, moe_cfg) -> None:
    """Refuse balancing settings the model cannot take, before any process group."""
    layers = routed_layers(model)
    if not layers and (moe_cfg.load_balance or moe_cfg.bias_rate):
        raise UserError(f"moe.load_balance={moe_cfg.load_balance} and moe.bias_rate={moe_cfg.bias_rate} act on "
                        f"a mixture of experts' routers, and this model has none. Use a model with experts "
                        f"(model.name=llama_moe) or leave both at 0.")
    if moe_cfg.bias_rate and not any(module.biased for _, module in layers):
        raise UserError(f"moe.bias_rate={moe_cfg.bias_rate} moves a sigmoid router's bias, and this model's "
                        f"routers are softmax ones, which have none. Use moe.load_balance to balance them, "
                        f"or a flavor with the sigmoid router (model.flavor=debug-moe-sigmoid).")


def configure(model: nn.Module, moe_cfg, context=None) -> None:
    """Give the routed layers the run's load-balancing weight and bias rate (config `moe`),
    and `context`, (cp group, cp size) where context parallelism splits each sequence, over
    which their per-sequence load-balancing loss counts the experts' choices."""
    for _, module in routed_layers(model):
        module.load_balance = moe_cfg.load_balance
        module.bias_rate = moe_cfg.bias_rate
        module.context = context


def begin_step(model: nn.Module, slices: int) -> None:
    """Before a step's forwards: the totals start from zero (an evaluation's forwards added
    to them too), and each forward's load-balancing loss counts 1/slices, as the loss of
    each of the `slices` equal parts (micro-batches) the step's rows are split into."""
    for _, module in routed_layers(model):
        getattr(module, TOTALS).zero_()
        module.slices = slices


def finish_step(model: nn.Module, data_group, stages, whole: nn.Module, inputs: torch.Tensor,
                across_groups: Callable | None = None) -> dict | None:
    """After a step's backward: this step's totals of each routed layer summed over the data
    ranks (hsdp x dp x cp; with `across_groups`, fault-tolerant replica groups', as
    Replicas.add_up sums them), kept for `balance`, and, with `stages` (the pipeline group),
    the layers of every stage brought to every rank; returns each layer's figures
    (`summary`), or None where `whole` (the whole model: under pp, every stage's layers) has
    no routed layer. `inputs`: this rank's rows of the step.

    Across stages the totals travel as one all-reduce of every routed layer's totals laid
    end to end, each stage filling its own layers' places: plain tensors, so a dry run's
    fake ones take the same path (an all_gather_object of the figures could not)."""
    everywhere = [(name, getattr(module, TOTALS).numel()) for name, module in routed_layers(whole)]
    if not everywhere:
        return None
    rows = {}
    groups = 1
    layers = routed_layers(model)
    if layers:
        summed = torch.stack([getattr(module, TOTALS) for _, module in layers])
        if data_group is not None:
            dist.all_reduce(summed, group=data_group)
        if across_groups is not None:
            groups = across_groups(summed)
        for (name, module), row in zip(layers, summed):
            setattr(module, LOAD, row[:-4])
            rows[name] = row
    if stages is not None:
        rows = _every_stage(rows, everywhere, stages, inputs.device)
    tokens_per_step = tokens_in_step(inputs, data_group) * groups
    totals = {name: summary(row.tolist(), tokens_per_step) for name, row in rows.items()}
    return dict(sorted(totals.items(), key=lambda item: _layer_order(item[0])))


def balance(model: nn.Module) -> None:
    """Each router's bias moved by the load finish_step kept: once the step is taken (with
    fault-tolerant replica groups, only if it commits, so that every group's bias stays the
    same)."""
    for _, module in routed_layers(model):
        load = getattr(module, LOAD, None)
        if load is not None:
            module.balance(load)
            setattr(module, LOAD, None)


def stages_all_reduce_bytes(whole: nn.Module) -> int:
    """The bytes of finish_step's all-reduce over the pipeline stages: every routed layer of
    the whole model `whole`, whichever stages a rank holds."""
    return sum(getattr(module, TOTALS).numel() for _, module in routed_layers(whole)) * torch.zeros(0).element_size()


def _every_stage(rows: dict, everywhere: list[tuple[str, int]], stages, device) -> dict:
    """Each stage's rows (name -> totals) -> every routed layer's, on every stage."""
    place, end = {}, 0
    for name, size in everywhere:
        place[name] = (end, end + size)
        end += size
    missing = sorted(set(rows) - set(place))
    if missing:
        raise RuntimeError(f"routed layers {missing} of a pipeline stage are not in the whole model's "
                           f"{sorted(place)}: a stage's layer paths must be the whole model's")
    laid_out = torch.zeros(end, device=device)
    for name, row in rows.items():
        laid_out[place[name][0]:place[name][1]] = row.to(laid_out)
    dist.all_reduce(laid_out, group=stages)
    return {name: laid_out[start:stop] for name, (start, stop) in place.items()}


def tokens_in_step(inputs, data_group) -> int:
    """The step's tokens over all data ranks, from this rank's share (every stage of a
    pipeline holds the same rows)."""
    return inputs.numel() * (dist.get_world_size(data_group) if data_group is not None else 1)


def _layer_order(name: str):
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def summary(totals: list[float], tokens_per_step: int) -> dict:
    """One layer's figures from its totals: tokens per expert in the step, the most loaded
    expert over the mean, the mean router entropy per token (nats) and the mean
    load-balancing loss per sequence (1 when balanced: models/moe.py)."""
    load, (entropy, balance, tokens, sequences) = totals[:-4], totals[-4:]
    per_step = [count / tokens * tokens_per_step for count in load] if tokens else load
    mean = sum(load) / len(load)
    return {"tokens_per_expert": per_step, "max_over_mean": max(load) / mean if mean else 0.0,
            "entropy": entropy / tokens if tokens else 0.0,
            "balance_loss": balance / sequences if sequences else 0.0}
