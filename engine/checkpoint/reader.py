"""Reading a DCP checkpoint folder as untrusted input: nothing in it runs as code.

torch.distributed.checkpoint reads a folder's `.metadata` with plain `pickle.load` and
its non-tensor items (scheduler state, RNG states, the step) with
`torch.load(weights_only=False)`, so a crafted folder runs whatever it likes
(pytorch/pytorch#189308). Here `.metadata` goes through an unpickler that resolves only
the classes DCP metadata is made of (below), and lets pickle's BUILD set attributes
only on instances of them, never on a class; the items go through
`torch.load(weights_only=True)`. Anything else is refused before it is called.

A folder that cannot be read, refused ones included, raises `Unreadable`, naming the
folder, the file and the cause. `check_readable` is the cheap check that needs no
process group (`.metadata`, then every data file it names is there and long enough);
`load` reads the data, which is the only way to prove a shard readable.

This module is the only one that knows DCP's file layout and its private per-item
storage record (`_StorageInfo`). If a torch version stores another class in
`.metadata`, reading a checkpoint it wrote is refused, naming the class: the compat
subset (tests/test_checkpoint_reader.py) fails then, and the class is added here
after reading what it does.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata, _MEM_FORMAT_ENCODING)

from common.errors import UserError

METADATA = ".metadata"

# What DCP's .metadata is made of: its records, and the values inside them.
RECORDS = (Metadata, MetadataIndex, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
           TensorProperties, StorageMeta, _StorageInfo)
_VALUES = (_MEM_FORMAT_ENCODING, torch.Size, pathlib.PosixPath)  # PosixPath: StorageMeta.checkpoint_id
_LAYOUT_BY_NAME = ("torch.serialization", "_get_layout")  # how a torch.layout pickles: a lookup by name


EARLIER = "Resume from an earlier checkpoint with --resume FOLDER."


class Unreadable(UserError):
    """A checkpoint folder that cannot be read: damaged, incomplete, or refused. `cause`
    is the sentence a fallback warning quotes, `hint` what to do when there is none."""

    def __init__(self, cause: str, hint: str = EARLIER):
        super().__init__(cause, hint)  # both in args: DCP pickles the exceptions it gathers
        self.cause, self.hint = cause, hint

    def __str__(self) -> str:
        return f"{self.cause}. {self.hint}"


def unreadable(folder, file: str, cause: str) -> Unreadable:
    return Unreadable(f"checkpoint {str(folder)!r} cannot be read: {file}: {' '.join(cause.split()).rstrip('. ')}")


def _allowed_globals() -> dict[tuple[str, str], object]:
    allowed = {(cls.__module__, cls.__qualname__): cls for cls in RECORDS + _VALUES}
    allowed.update((("torch", str(value).removeprefix("torch.")), value) for value in vars(torch).values()
                   if isinstance(value, torch.dtype))
    module, name = _LAYOUT_BY_NAME
    allowed[_LAYOUT_BY_NAME] = getattr(__import__(module, fromlist=[name]), name)
    return allowed


ALLOWED = _allowed_globals()
_STORAGE_FIELDS = {"relative_path", "offset", "length"}
if not _STORAGE_FIELDS <= {f.name for f in dataclasses.fields(_StorageInfo)}:
    raise ImportError(f"torch {torch.__version__}: DCP's _StorageInfo no longer has {sorted(_STORAGE_FIELDS)}; "
                      f"engine/checkpoint/reader.py needs updating for this torch version.")


class Refused(pickle.UnpicklingError):
    """Something in a checkpoint that the reader will not load; the message says what."""


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be guarded one by one), resolving only
    ALLOWED names and building only instances of RECORDS."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise Refused(f"it asks for {module}.{name}, which is not part of DCP metadata; "
                          f"nothing from it was run") from None

    def persistent_load(self, pid):
        raise Refused("it holds a persistent reference, which DCP metadata never does")

    def _build(self):
        target = self.stack[-2]
        if type(target) not in RECORDS:  # a class or function would be changed for the whole process
            raise Refused(f"it sets attributes of a {type(target).__name__}, which DCP metadata never does")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def _check_shape(metadata, folder: Path) -> None:
    """What the rest of the engine and DCP rely on, so that a wrong structure is a clear
    refusal here rather than an AttributeError deep inside DCP."""
    if not isinstance(metadata, Metadata):
        raise unreadable(folder, METADATA, f"it holds a {type(metadata).__name__}, not DCP metadata")
    if not (isinstance(metadata.state_dict_metadata, dict) and isinstance(metadata.storage_data, dict)
            and isinstance(metadata.storage_meta, (StorageMeta, type(None)))):
        raise unreadable(folder, METADATA, "its fields are not those of DCP metadata")
    for key, where in metadata.storage_data.items():
        if not (isinstance(key, MetadataIndex) and isinstance(where, _StorageInfo)):
            raise unreadable(folder, METADATA, f"a storage entry is a {type(where).__name__}, not a storage record")
        name = where.relative_path
        if not (isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name):
            raise unreadable(folder, METADATA, f"it places data in {name!r}, which is not a file of this folder")
        if not all(type(n) is int and n >= 0 for n in (where.offset, where.length)):
            raise unreadable(folder, METADATA, f"the entry of {key.fqn!r} has an invalid offset or length")


def read_metadata(folder: str | Path) -> Metadata:
    """The folder's `.metadata`, read without running anything from it."""
    folder = Path(folder)
    try:
        with open(folder / METADATA, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Refused as err:
        raise unreadable(folder, METADATA, f"refused: {err}") from None
    except OSError as err:
        raise unreadable(folder, METADATA, err.strerror or str(err)) from None
    except Exception as err:  # a truncated or garbled pickle: EOFError, UnpicklingError, ValueError, ...
        raise unreadable(folder, METADATA, f"not a readable pickle ({_cause(err)})") from None
    _check_shape(metadata, folder)
    return metadata


def check_readable(folder: str | Path) -> None:
    """`.metadata` reads, and every file it places data in is there and long enough.
    Stats the files, reads none of them."""
    folder = Path(folder)
    needed: dict[str, int] = {}
    for where in read_metadata(folder).storage_data.values():
        needed[where.relative_path] = max(needed.get(where.relative_path, 0), where.offset + where.length)
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            raise unreadable(folder, name, "missing (.metadata places data in it)")
        size = path.stat().st_size
        if size < end:
            raise unreadable(folder, name, f"holds {size:,} bytes, but .metadata places data up to byte "
                                           f"{end:,}: the file was cut short")


class _Reader(FileSystemReader):
    """DCP's file reader with `.metadata` read as above, and each data file's errors named."""

    def read_metadata(self) -> Metadata:  # no rank argument: DCP then never tries __RANK.metadata files
        metadata = read_metadata(self.path)
        if metadata.storage_meta is None:  # as DCP's own reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as err:
                raise unreadable(self.path, name, _cause(err)) from None
        done = torch.futures.Future()
        done.set_result(None)
        return done


def _cause(err: BaseException) -> str:
    """One line for an exception: for torch's weights-only refusal, what it refused (in
    whichever wording this torch version uses), else the type and the first line."""
    text = str(err)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f"it asks for {named.group(1).rstrip('.')}"
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def _fits(item, placeholder) -> bool:
    """The loaded value has the type of what the state dict holds there (tuples element by element)."""
    if type(item) is not type(placeholder):
        return False
    return not isinstance(item, tuple) or (len(item) == len(placeholder) and all(map(_fits, item, placeholder)))


class _Planner(DefaultLoadPlanner):
    """Non-tensor items are read with weights_only=True (plain values and containers, no
    code) and must have the type of what the state dict holds in their place. DCP's own
    load_bytes then stores them, from a copy this process wrote."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals([bytes]):  # how torch.save writes an empty bytes
                item = torch.load(value, weights_only=True)
        except Exception as err:
            raise Refused(f"item {key!r} is not a plain value ({_cause(err)}); nothing from it was run") from None
        if key in self.state_dict and not _fits(item, self.state_dict[key]):
            raise Refused(f"item {key!r} holds a {type(item).__name__} where this run keeps a "
                          f"{type(self.state_dict[key]).__name__}")
        trusted = io.BytesIO()
        torch.save(item, trusted)
        trusted.seek(0)
        super().load_bytes(read_item, trusted)


def _first_failure(err: BaseException) -> tuple[int | None, BaseException]:
    """The lowest failing rank of a DCP CheckpointException and its exception (the same on
    every rank: DCP gathers the failures), or (None, err) for any other exception."""
    failures = getattr(err, "failures", None)
    if not failures:
        return None, err
    rank = min(failures)
    cause = failures[rank]
    return rank, cause[0] if isinstance(cause, tuple) else cause  # DCP keeps (exception, traceback frames)


def root_cause(err: BaseException) -> str:
    rank, cause = _first_failure(err)
    text = str(cause) if isinstance(cause, UserError) else _cause(cause)
    return text if rank is None else f"rank {rank}: {text}"


def load(state: dict, folder: str | Path, group) -> None:
    """dcp.load of `state` from `folder` in place (a collective), reading nothing as code.
    Every rank raises the same Unreadable when any rank cannot read its part."""
    try:
        dcp.load(state, storage_reader=_Reader(str(folder)), planner=_Planner(), process_group=group)
    except CheckpointException as err:
        _, cause = _first_failure(err)
        if isinstance(cause, Unreadable):
            raise Unreadable(cause.cause, cause.hint) from None
        raise Unreadable(f"checkpoint {str(folder)!r} cannot be read: {root_cause(err).rstrip('. ')}") from None
