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
from engine.errors import UserError


def export_full(model: torch.nn.Module, path: str | Path) -> None:
    """Gather the full weights (a collective) and write them on rank 0, atomically."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
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
    check_keys({k: list(v.shape) for k, v in state.items()}, state_dict_shapes(model),
               f"checkpoint.init_from {str(path)!r}", type(model).__name__)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
