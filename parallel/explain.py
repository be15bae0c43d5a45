"""`--explain`: a table, module by module, of what the plan did on this rank."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from parallel.apply import AppliedPlan
from parallel.pipeline import whole_model


def describe_style(style) -> str:
    def layouts(value):
        if value is None:
            return "-"
        items = value if isinstance(value, (tuple, list)) else (value,)
        return ",".join("-" if p is None else type(p).__name__.replace("Replicate", "R") + (
            f"({p.dim})" if hasattr(p, "dim") else "") for p in items)

    name = type(style).__name__
    inputs = getattr(style, "input_layouts", None)
    outputs = getattr(style, "output_layouts", None)
    if inputs is None and outputs is None:
        return name
    return f"{name}[in {layouts(inputs)} -> out {layouts(outputs)}]"


def _counts(module: nn.Module) -> tuple[int, int]:
    params = list(module.parameters(recurse=False))
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return local, sum(p.numel() for p in params)


def describe_stages(model: nn.Module) -> list[str]:
    """Under pipeline parallel: what each stage holds, and which of them this rank runs."""
    pipeline = getattr(model, "pipeline", None)
    if pipeline is None:
        return []
    lines = [f"pipeline: {pipeline.schedule_name}, {pipeline.n_stages} stages over pp={dist.get_world_size(pipeline.group)}"
             f", this rank holds stage {', '.join(map(str, pipeline.stage_indices))} (table above)"]
    for stage, blocks in enumerate(pipeline.stage_blocks):
        first = list(pipeline.stages.first) if stage == 0 else []
        last = list(pipeline.stages.last) if stage == pipeline.n_stages - 1 else []
        lines.append(f"  stage {stage}: {', '.join(first + blocks + last)}")
    return lines


def explain(model: nn.Module, applied: AppliedPlan) -> str:
    options = applied.options
    header = ("module", "type", "tensor parallel", "fsdp", "reshard", "ac", "compile", "local/full params")
    rows = []
    for path, module in model.named_modules():
        style = applied.tp_styles.get(path)
        unit = isinstance(module, FSDPModule)
        local, full = _counts(module)
        if not (full or style or unit):
            continue
        in_block = path in applied.blocks
        rows.append((
            path or "(root)",
            type(module).__name__.removeprefix("FSDP").removeprefix("Recomputed"),
            describe_style(style) if style else "",
            ("root" if path == "" else "unit") if unit else "",
            str(applied.block_reshard if in_block else options.root_reshard_after_forward) if unit else "",
            (options.activation_checkpoint if path in applied.checkpointed else
             "cheap" if path in applied.recomputed else ""),
            "yes" if path in applied.compiled else "",
            f"{local:,}/{full:,}" if full else "",
        ))
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + rows]
    params = list(model.parameters())  # de-duplicated, unlike per-module counts of tied weights
    total_local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    total_full = sum(p.numel() for p in whole_model(model).parameters())
    lines += describe_stages(model)
    lines.append(f"this rank holds {total_local:,} of {total_full:,} parameters "
                 f"({100 * total_local / max(1, total_full):.1f}%); mixed precision "
                 f"{options.param_dtype}/{options.reduce_dtype}, offload {options.offload}, "
                 f"sequence parallel {options.sequence_parallel}, loss parallel {options.loss_parallel}")
    if applied.reduced_in_place:
        lines.append(f"gradients reduced in place on {applied.reduced_in_place} FSDP units (sharded over one "
                     f"rank, their reduce would only copy)")
    if applied.experts:
        lines.append(f"experts split over ep on {len(applied.experts)} modules (all_to_all_single dispatch), "
                     + ("sharded over expert-dp" if applied.experts_sharded else
                        "not sharded further (expert-dp is one rank: FSDP leaves them out)"))
    if applied.float8:
        lines.append(f"float8 {options.float8} on {len(applied.float8)} linears (type Float8Linear)"
                     f"{', weights all-gathered in float8' if options.float8_all_gather else ''}")
    return "\n".join(lines)
