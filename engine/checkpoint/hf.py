"""Hugging Face Llama and Mixtral checkpoints (config.json + safetensors) in and out.

    checkpoint.hf_import=FOLDER   config.json sets the model's shape (a flavor named
                                  "hf:FOLDER"), its weights start the run
    checkpoint.hf_export=FOLDER   the final weights and config.json, in the layout
                                  LlamaForCausalLM (MixtralForCausalLM for a
                                  mixture of experts) .from_pretrained reads

The launcher checks an import before any process group exists: config.json, then the
safetensors headers (names, shapes, dtypes; no tensor data) against the model. Loading
goes through torch.distributed.checkpoint's HuggingFaceStorageReader into the sharded
parameters, so each rank reads only the slices it keeps (safetensors get_slice on a
memory map), never a whole file; Mixtral's experts, one tensor per expert in the files
and one 3-D parameter here, are read whole from the memory map and each rank keeps its
slice, as materialising does. The export gathers the full weights on rank 0 (like
checkpoint.export), which writes them into FOLDER.partial and renames it into place.
Name and config mapping: models/llama_hf.py and models/mixtral_hf.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from engine.checkpoint.store import check_keys, state_dict_shapes
from common.errors import UserError
from models import llama_hf, mixtral_hf
from models.llama import Llama
from models.materialise import held_along
from models.moe import MoEArgs, MoELlama
from parallel.pipeline import whole_model

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"
FLAVOR_PREFIX = "hf:"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' own default shard size, "5GB"
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_HEADER_LIMIT = 100 * 2**20


def read_hf_config(folder: str | Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"checkpoint.hf_import {str(folder)!r} is not a folder. Give a Hugging Face "
                        f"model folder (config.json and model.safetensors), e.g. one written by "
                        f"save_pretrained or checkpoint.hf_export.")
    path = folder / CONFIG
    if not path.is_file():
        raise UserError(f"checkpoint.hf_import {str(folder)!r} has no {CONFIG}. Give a Hugging Face "
                        f"model folder (config.json and model.safetensors).")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{str(path)!r} cannot be read as JSON ({err}).") from None


def hf_format(args):
    """The name and config mapping for a model's args: Mixtral's for a mixture of experts."""
    return mixtral_hf if isinstance(args, MoEArgs) else llama_hf


def _require_model_for(model_name: str, model_type, mapping) -> None:
    from models import MODELS, model_args
    if model_name not in MODELS:
        model_args(model_name, "")  # the registry's own "unknown model" error
    model_class = MODELS[model_name][0]
    wanted, name = (MoELlama, "llama_moe") if mapping is mixtral_hf else (Llama, "llama")
    if not (isinstance(model_class, type) and issubclass(model_class, wanted)) or (
            wanted is Llama and issubclass(model_class, MoELlama)):
        raise UserError(f"checkpoint.hf_import reads a {model_type!r} checkpoint into a {wanted.__name__}, but "
                        f"model.name={model_name!r} is a {getattr(model_class, '__name__', model_class)}. "
                        f"Use model.name={name}" + (" and parallel.plan=llama_moe." if name == "llama_moe" else "."))


def register_hf_flavor(model_name: str, folder: str | Path) -> str:
    """Read folder/config.json and register its shapes as a flavor of `model_name` (a
    Llama, or a Llama mixture of experts for Mixtral); returns the flavor's name, "hf:FOLDER"."""
    from models import MODELS
    config = read_hf_config(folder)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    mapping = mixtral_hf if model_type == mixtral_hf.MODEL_TYPE else llama_hf
    _require_model_for(model_name, model_type, mapping)
    args = mapping.args_from_hf_config(config, str(Path(folder) / CONFIG))
    name = f"{FLAVOR_PREFIX}{folder}"
    MODELS[model_name][1][name] = args
    return name


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file: {name: {"dtype", "shape", "data_offsets"}}."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (size,) = struct.unpack("<Q", raw)
            if size > _HEADER_LIMIT:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(handle.read(size))
    except (OSError, ValueError) as err:
        raise UserError(f"{str(path)!r} cannot be read as a safetensors file ({err}).") from None
    header.pop("__metadata__", None)
    return header


def tensor_index(folder: str | Path) -> dict[str, tuple[Path, list[int], str]]:
    """{Hugging Face key: (file, shape, safetensors dtype)} from the headers alone: one
    model.safetensors, or the files model.safetensors.index.json names."""
    folder = Path(folder)
    present = sorted(p.name for p in folder.glob("*" + SUFFIX))
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{str(folder / INDEX)!r} cannot be read as a safetensors index "
                            f"({type(err).__name__}: {err}).") from None
        where = f"the files {INDEX} names"
    elif (folder / SINGLE).is_file():
        weight_map, files, where = None, [SINGLE], SINGLE
    else:
        raise UserError(f"checkpoint.hf_import {str(folder)!r} has neither {SINGLE} nor {INDEX} "
                        f"(found: {', '.join(present) or 'no .safetensors files'}). Only the "
                        f"safetensors format is read.")
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise UserError(f"{str(folder / INDEX)!r} names files that are not there: {', '.join(missing)}.")
    stray = sorted(set(present) - set(files))
    if stray:  # the loader reads every .safetensors file in the folder
        raise UserError(f"checkpoint.hf_import {str(folder)!r} holds .safetensors files that {where} "
                        f"does not list: {', '.join(stray)}. Move them out of the folder.")
    found: dict[str, tuple[Path, list[int], str]] = {}
    for name in files:
        for key, entry in _read_header(folder / name).items():
            if key in found:
                raise UserError(f"tensor {key!r} is in both {found[key][0].name} and {name} of "
                                f"{str(folder)!r}. Each tensor must be stored once.")
            found[key] = (folder / name, list(entry["shape"]), entry["dtype"])
    if weight_map is not None:
        misplaced = sorted(k for k, v in weight_map.items() if k not in found or found[k][0].name != v)
        if misplaced:
            raise UserError(f"{str(folder / INDEX)!r} does not match the files' contents for: "
                            f"{', '.join(misplaced[:10])}{' ...' if len(misplaced) > 10 else ''}.")
    return found


def _shown(hf: str, mapping) -> str:
    try:
        return f"{hf} (ours: {mapping.our_name(hf)})"
    except KeyError:
        return f"{hf} (no {mapping.ARCHITECTURE.removesuffix('ForCausalLM')} parameter)"


def expected_hf_shapes(model) -> dict[str, list[int]]:
    """The Hugging Face keys and shapes `model` needs (a tied model has no lm_head)."""
    tied, mapping = model.args.tie_embeddings, hf_format(model.args)
    return {hf: list(part.shape) for key, shape in state_dict_shapes(model).items()
            if not (tied and key == "output.weight")
            for hf, part in mapping.hf_tensors(key, torch.empty(shape, device="meta")).items()}


def check_hf_checkpoint(model, folder: str | Path) -> None:
    """Before any process group: the folder's tensors fit `model` (meta device is fine).
    Missing, extra and mis-shaped tensors are named with both keys."""
    found = tensor_index(folder)
    expected = expected_hf_shapes(model)
    if model.args.tie_embeddings and found.get("lm_head.weight", (None, None))[1] == expected.get(
            "model.embed_tokens.weight"):
        found.pop("lm_head.weight")  # some tied checkpoints keep a copy; transformers ignores it too
    mapping = hf_format(model.args)
    try:
        check_keys({_shown(k, mapping): v[1] for k, v in found.items()},
                   {_shown(k, mapping): v for k, v in expected.items()},
                   f"checkpoint.hf_import {str(folder)!r}", f"{type(model).__name__} built from its "
                   f"{CONFIG}")
    except UserError as err:
        text = str(err)
        cut = text.find(" Use the model and flavor")
        raise UserError(f"{text[:cut] if cut > 0 else text} Its tensors must match its {CONFIG}: "
                        f"Hugging Face names, ours in parentheses.") from None
    odd = sorted(f"{k} ({v[2]})" for k, v in found.items() if k in expected and v[2] not in _FLOAT_DTYPES)
    if odd:
        raise UserError(f"checkpoint.hf_import {str(folder)!r} has tensors of a type that cannot be "
                        f"loaded into {type(model).__name__}'s floating-point weights: {', '.join(odd)}. "
                        f"Quantized checkpoints are not read; use the {', '.join(_FLOAT_DTYPES)} release.")


def check_hf_export(model, folder: str | Path) -> None:
    """Before any process group: the export can be written without destroying anything
    but an earlier export (the folder is replaced as a whole)."""
    if not isinstance(model, Llama):
        raise UserError(f"checkpoint.hf_export writes Llama and Mixtral checkpoints, but the model is a "
                        f"{type(model).__name__}. Use model.name=llama, or checkpoint.export.")
    if isinstance(model.args, MoEArgs):
        mixtral_hf.check_exportable(model.args, "checkpoint.hf_export")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"checkpoint.hf_export {str(folder)!r} is a file. Give a folder.")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / CONFIG).is_file():
        raise UserError(f"checkpoint.hf_export {str(folder)!r} is a folder with other files in it and "
                        f"no {CONFIG}; the export replaces the whole folder. Give a new or empty folder, "
                        f"or an earlier export.")


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("Hugging Face checkpoints need the safetensors package: "
                        "pip install safetensors") from None
    return safetensors


def load_hf(model, folder: str | Path) -> None:
    """Copy the folder's weights into `model` (materialised; sharded or not). A sharded
    model is a collective: every rank calls this and reads only its own slices."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.tensor import DTensor

    _safetensors()  # its error with the install line, before anything is read
    folder = Path(folder)
    state = _model_state(model)
    args = whole_model(model).args
    mapping = hf_format(args)
    targets, assembled = {}, []  # by Hugging Face key, one tensor each; ours made of several
    for key, value in state.items():
        if args.tie_embeddings and key == "output.weight":
            continue
        parts = mapping.hf_tensors(key, value)
        if len(parts) == 1 and next(iter(parts.values())) is value:
            targets.update(parts)
        else:
            assembled.append(key)
    index = tensor_index(folder)
    if any(isinstance(value, DTensor) for value in state.values()):
        _load_distributed(targets, folder)
        with _TensorReader(index) as read, torch.no_grad():
            for key in assembled:
                _load_my_part(state[key], lambda rows: mapping.our_tensor(key, list(state[key].shape), read, rows))
        if args.tie_embeddings and "tok_embeddings.weight" in state and "output.weight" in state:
            # Both ends on this rank (no pp, or a V-shaped schedule's rank 0). A pipeline stage
            # that holds only one end has only that key, and the other end's copy comes from the
            # first stage afterwards (sync_tied_weights).
            state["output.weight"] = state["tok_embeddings.weight"]
        set_model_state_dict(model, state)
    else:
        with _TensorReader(index) as read, torch.no_grad():
            for key, target in targets.items():
                target.copy_(read(key))
            for key in assembled:
                state[key].copy_(mapping.our_tensor(key, list(state[key].shape), read))


def _load_my_part(param: torch.Tensor, assemble) -> None:
    """Copy into `param` (a DTensor shard, or a whole tensor) its part of a parameter that
    `assemble(rows)` builds from several files: only the rows (dim 0: the experts) this rank
    holds are read and stacked, then cut along the other dims as the shard is. A rank thus
    reads its own experts, not a block's all (Mixtral 8x7B in bf16: 2.8 GB a block)."""
    from torch.distributed.tensor import DTensor
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    held = [held_along(param, dim) for dim in range(param.ndim)]
    part = assemble(held[0].tolist())
    for dim in range(1, param.ndim):
        if not torch.equal(held[dim], torch.arange(param.shape[dim])):  # this dim is sharded
            part = part.index_select(dim, held[dim])
    local.copy_(part.reshape(local.shape))


class _TensorReader:
    """read(Hugging Face key) -> the tensor, from whichever file holds it; each file is
    opened once (a memory map), and closed on leaving the `with`."""

    def __init__(self, index: dict[str, tuple[Path, list[int], str]]):
        self.index, self.handles = index, {}

    def __enter__(self):
        return self.read

    def read(self, key: str) -> torch.Tensor:
        path = self.index[key][0]
        if path not in self.handles:
            self.handles[path] = _safetensors().safe_open(str(path), framework="pt").__enter__()
        return self.handles[path].get_tensor(key)

    def __exit__(self, *exc) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)


def _model_state(model) -> dict:
    """Our state-dict keys -> tensors that share storage with the parameters (DTensors on a
    sharded model); wrapper prefixes (compile, activation checkpointing) are removed."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model)


def _load_distributed(targets: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader

    # DCP's own collectives on a gloo group, as engine/checkpoint/dcp.py does: CPU objects
    # on any backend.
    group = dist.new_group(backend="gloo")
    try:
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(folder)), process_group=group)
    except CheckpointException as err:
        from engine.checkpoint.reader import root_cause
        raise UserError(f"checkpoint.hf_import {str(folder)!r} could not be read "
                        f"({root_cause(err)}).") from None
    finally:
        dist.destroy_process_group(group)


def save_hf(model, folder: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            carried_from: str | Path | None = None) -> None:
    """Gather the full weights (a collective) and write, on rank 0, a Hugging Face folder:
    config.json and model.safetensors, or shards and model.safetensors.index.json when the
    weights exceed `max_shard_bytes`. `carried_from` is an imported folder whose token ids
    the new config.json keeps."""
    from engine.checkpoint.export import full_state_on_rank0

    # Gathering FSDP+TP (_StridedShard) parameters logs a performance warning per parameter
    # on every rank; a gather is what this asks for.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        state = full_state_on_rank0(model)
    finally:
        redistribute_log.setLevel(level)
    if dist.get_rank() == 0:
        args = whole_model(model).args
        mapping = hf_format(args)
        tensors = {hf: part.contiguous() for key, value in state.items()
                   if not (args.tie_embeddings and key == "output.weight")
                   for hf, part in mapping.hf_tensors(key, value).items()}
        carried = read_hf_config(carried_from) if carried_from else None
        dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        write_hf_folder(folder, tensors, mapping.hf_config_from_args(args, carried, dtype), max_shard_bytes)
    dist.barrier()


def write_hf_folder(folder: str | Path, tensors: dict[str, torch.Tensor], config: dict,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write FOLDER.partial, then move it over FOLDER (an earlier FOLDER is removed)."""
    safetensors = _safetensors()
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = ([SINGLE] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}{SUFFIX}" for i in range(1, len(shards) + 1)])
    for name, keys in zip(names, shards):
        safetensors.torch.save_file({k: tensors[k] for k in keys}, str(partial / name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: name for name, keys in zip(names, shards) for key in keys}}
        (partial / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(folder, old)
    os.replace(partial, folder)
    shutil.rmtree(old, ignore_errors=True)
