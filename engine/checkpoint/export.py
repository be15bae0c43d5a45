"""Single-file full state dicts: the weights of a parallel run for a plain model, and back.

The file is `torch.save` of {state-dict key: full CPU tensor}, so the plain,
non-distributed model loads it with `model.load_state_dict(torch.load(path))`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)

from engine.checkpoint.store import check_keys, state_dict_shapes
from common.errors import UserError
from parallel.pipeline import sync_tied_weights, whole_model


def full_state_on_rank0(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's full weights as CPU tensors on rank 0 ({} elsewhere), a collective.
    Under pipeline parallel each stage gathers its own, and rank 0 collects them."""
    pipeline = getattr(model, "pipeline", None)
    options = StateDictOptions(full_state_dict=True, cpu_offload=pipeline is None)  # offload keeps rank 0's only
    state = get_model_state_dict(model, options=options)
    if pipeline is None:
        return state
    return pipeline.gather_on_rank0({key: value.cpu() for key, value in state.items()})


def export_full(model: torch.nn.Module, path: str | Path) -> None:
    """Gather the full weights (a collective) and write them on rank 0, atomically."""
    state = full_state_on_rank0(model)
    if dist.get_rank() == 0:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, path)
    dist.barrier()


def import_full(model: torch.nn.Module, path: str | Path) -> None:
    """Load an exported file into a (possibly sharded) model; each rank keeps its slice."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError) as err:
        raise UserError(f"checkpoint.init_from {str(path)!r} cannot be read as a full state dict "
                        f"({err}). Give a file written by checkpoint.export.") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint.init_from {str(path)!r} holds a {type(state).__name__}, not a "
                        f"state dict. Give a file written by checkpoint.export.")
    whole = whole_model(model)
    check_keys({k: list(v.shape) for k, v in state.items()}, state_dict_shapes(whole),
               f"checkpoint.init_from {str(path)!r}", type(whole).__name__)
    mine = model.state_dict()  # under pipeline parallel, this rank's stages only
    set_model_state_dict(model, {k: v for k, v in state.items() if k in mine},
                         options=StateDictOptions(full_state_dict=True))
    sync_tied_weights(model)
