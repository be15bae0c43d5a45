"""A prepared token folder (written by launch/prepare.py, read in training).

    FOLDER/tokens.bin      every document's tokens, concatenated: raw little-endian
                           uint16 when the vocabulary fits (<= 65536), else uint32
    FOLDER/documents.npy   int64, documents + 1 entries: document d is
                           tokens[documents[d]:documents[d + 1]]
    FOLDER/index.json      format and version, tokenizer identity and vocabulary,
                           dtype, token and document counts, source files

Reading maps tokens.bin with numpy.memmap, read-only: a window is copied out of the
page cache and its pages are dropped from this process again (MADV_DONTNEED), so
resident memory stays flat whatever the file's size and however many windows are read.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import UserError

FORMAT = "meshtrain-tokens"
VERSION = 1
TOKENS = "tokens.bin"
DOCUMENTS = "documents.npy"
INDEX = "index.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_PAGE = mmap.PAGESIZE


def token_dtype(vocab_size: int) -> str:
    """uint16 when every id fits in it (vocabulary <= 65536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def prepare_hint(folder: str | Path) -> str:
    return f"python launch/prepare.py INPUT... --out {folder}"


class OutOfVocabulary(UserError):
    """A token id at or past a vocabulary, found on the host before it reaches a model."""


def id_outside(folder, position: int, token: int, vocab: int, what: str = "data.path",
               whose: str = "the model's", fix: str = "") -> OutOfVocabulary:
    """The error for token `position` of tokens.bin holding `token` >= `vocab`. In a run it
    points to `prepare.py --check`; the check gives its own `fix`."""
    fix = fix or (f"prepare the folder again, or list every such id with `python launch/prepare.py --check "
                  f"{folder} --vocab-size {vocab}`")
    return OutOfVocabulary(
        f"{what} folder {str(folder)!r}: token {position:,} of {TOKENS} is id {token:,}, outside {whose} "
        f"vocabulary of {vocab:,} (ids 0 to {vocab - 1:,}). {TOKENS} is damaged, or was written with another "
        f"tokenizer than the one its {INDEX} names: {fix}.")


@dataclass
class IdScan:
    tokens: int
    outside: int  # ids at or past the vocabulary
    first: int | None  # the position of the first of them
    first_id: int | None
    largest: int | None


def scan_ids(folder: str | Path, vocab: int, chunk: int = 1 << 24, progress=None) -> IdScan:
    """Every id of tokens.bin against `vocab`, read `chunk` tokens at a time (the memory it
    takes). `progress(tokens_read)` is called after each chunk."""
    index = read_index(folder)
    dtype, total = DTYPES[index["dtype"]], int(index["tokens"])
    scan = IdScan(total, 0, None, None, None)
    buffer, outside = np.empty(min(chunk, max(total, 1)), dtype=dtype), np.empty(min(chunk, max(total, 1)), bool)
    done = 0
    with open(Path(folder) / TOKENS, "rb") as handle:
        while done < total:
            count = handle.readinto(memoryview(buffer).cast("B")) // dtype.itemsize
            if not count:
                break
            ids, mask = buffer[:min(count, total - done)], outside[:min(count, total - done)]
            np.greater_equal(ids, vocab, out=mask)
            if mask.any():
                bad = np.flatnonzero(mask)
                if scan.first is None:
                    scan.first, scan.first_id = done + int(bad[0]), int(ids[bad[0]])
                scan.outside += len(bad)
            scan.largest = max(int(ids.max()), scan.largest or 0)
            done += len(ids)
            if progress is not None:
                progress(done)
    return scan


def read_index(folder: str | Path, what: str = "data.path") -> dict:
    """index.json of a prepared folder, checked against tokens.bin's size. Cheap: reads
    one small file and stats another. UserError naming the folder and the fix."""
    folder = Path(folder)
    if not folder.is_dir():
        partial = folder.with_name(folder.name + ".partial")
        extra = (f" ({partial} exists: a preparation was interrupted; run it again)"
                 if partial.exists() else "")
        raise UserError(f"{what} folder {str(folder)!r} does not exist{extra}. Prepare it with "
                        f"`{prepare_hint(folder)}`.")
    index_path = folder / INDEX
    if not index_path.is_file():
        raise UserError(f"{what} folder {str(folder)!r} is not a prepared token folder: it has no "
                        f"{INDEX}. Prepare it with `{prepare_hint(folder)}`, or use "
                        f"--set data.source=corpus for a text file.")
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{index_path} cannot be read as JSON ({err}). Prepare {str(folder)!r} again "
                        f"with `{prepare_hint(folder)}`.") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UserError(f"{index_path} is not a {FORMAT} index. Prepare {str(folder)!r} with "
                        f"`{prepare_hint(folder)}`.")
    if index.get("version") != VERSION:
        raise UserError(f"{str(folder)!r} was prepared in format version {index.get('version')}, and this "
                        f"engine reads version {VERSION}. Prepare it again with `{prepare_hint(folder)}`.")
    try:
        dtype = DTYPES[index["dtype"]]
        tokens = int(index["tokens"])
        vocab = int(index["tokenizer"]["vocab_size"])
        int(index["documents"])
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{index_path} lacks or garbles {err}. Prepare {str(folder)!r} again with "
                        f"`{prepare_hint(folder)}`.") from None
    token_path = folder / TOKENS
    size = token_path.stat().st_size if token_path.is_file() else None
    if size != tokens * dtype.itemsize:
        found = "is missing" if size is None else f"holds {size:,} bytes"
        raise UserError(f"{token_path} {found}, but {INDEX} says {tokens:,} {index['dtype']} tokens "
                        f"({tokens * dtype.itemsize:,} bytes). Prepare {str(folder)!r} again with "
                        f"`{prepare_hint(folder)}`.")
    if vocab < 1:
        raise UserError(f"{index_path} gives a vocabulary of {vocab}. Prepare {str(folder)!r} again.")
    return index


class TokenFile:
    """The tokens of one prepared folder, memory-mapped read-only."""

    def __init__(self, folder: str | Path, what: str = "data.path"):
        self.folder = Path(folder)
        self.index = read_index(self.folder, what)
        self.dtype = DTYPES[self.index["dtype"]]
        self.tokens = int(self.index["tokens"])
        self.vocab_size = int(self.index["tokenizer"]["vocab_size"])
        self.documents = int(self.index["documents"])
        if self.tokens == 0:
            raise UserError(f"{what} folder {str(self.folder)!r} holds no tokens. Prepare it from "
                            f"non-empty inputs.")
        self.array = np.memmap(self.folder / TOKENS, dtype=self.dtype, mode="r", shape=(self.tokens,))
        self._mmap = getattr(self.array, "_mmap", None)
        if self._mmap is not None and hasattr(self._mmap, "madvise"):
            self._mmap.madvise(mmap.MADV_RANDOM)  # windows are read at random: no readahead
        else:
            self._mmap = None

    def window(self, start: int, length: int) -> np.ndarray:
        """tokens[start:start + length] as int64, copied out of the map."""
        if start < 0 or start + length > self.tokens:
            raise IndexError(f"window [{start}, {start + length}) outside {self.tokens} tokens")
        out = np.array(self.array[start:start + length], dtype=np.int64)
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            # Unmap the pages just read: the page cache keeps them, this process's RSS does not.
            first = start * self.dtype.itemsize // _PAGE * _PAGE
            end = min(-(-(start + length) * self.dtype.itemsize // _PAGE) * _PAGE, len(self._mmap))
            self._mmap.madvise(mmap.MADV_DONTNEED, first, end - first)
        return out

    def document_offsets(self) -> np.ndarray:
        """documents.npy, memory-mapped: documents + 1 start offsets."""
        return np.load(self.folder / DOCUMENTS, mmap_mode="r")


class TokenWriter:
    """Writes a token folder incrementally into FOLDER.partial; `finish` renames it to
    FOLDER, so a crash leaves no folder that looks prepared."""

    _FLUSH = 1 << 16  # document offsets buffered before they go to disk

    def __init__(self, out: str | Path, vocab_size: int, force: bool = False):
        self.out = Path(out)
        if self.out.exists() and not force:
            raise UserError(f"--out {str(self.out)!r} already exists. Remove it, choose another folder, "
                            f"or pass --force to replace it.")
        self.partial = self.out.with_name(self.out.name + ".partial")
        if self.partial.exists():
            shutil.rmtree(self.partial)  # left by an interrupted preparation
        self.partial.mkdir(parents=True)
        self.dtype_name = token_dtype(vocab_size)
        self.dtype = DTYPES[self.dtype_name]
        self.vocab_size = vocab_size
        self.tokens_file = open(self.partial / TOKENS, "wb")
        self.offsets_file = open(self.partial / "documents.raw", "wb")
        self.pending: list[int] = []
        self.tokens = 0
        self.documents = 0

    def start_document(self) -> None:
        self.pending.append(self.tokens)
        self.documents += 1
        if len(self.pending) >= self._FLUSH:
            self._flush_offsets()

    def write(self, ids: np.ndarray) -> None:
        if len(ids):
            self.tokens_file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
            self.tokens += len(ids)

    def _flush_offsets(self) -> None:
        self.offsets_file.write(np.asarray(self.pending, dtype="<i8").tobytes())
        self.pending.clear()

    def finish(self, index: dict) -> Path:
        """Write documents.npy and index.json, then move FOLDER.partial to FOLDER."""
        self.pending.append(self.tokens)  # the end of the last document
        self._flush_offsets()
        for f in (self.tokens_file, self.offsets_file):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        raw = self.partial / "documents.raw"
        offsets = np.lib.format.open_memmap(self.partial / DOCUMENTS, mode="w+", dtype="<i8",
                                            shape=(self.documents + 1,))
        source = np.memmap(raw, dtype="<i8", mode="r", shape=(self.documents + 1,))
        for first in range(0, self.documents + 1, 1 << 20):  # in slices: never all in memory
            offsets[first:first + (1 << 20)] = source[first:first + (1 << 20)]
        offsets.flush()
        del offsets, source
        raw.unlink()
        body = {"format": FORMAT, "version": VERSION, "dtype": self.dtype_name, "tokens": self.tokens,
                "documents": self.documents, **index}
        (self.partial / INDEX).write_text(json.dumps(body, indent=1) + "\n")
        old = None
        if self.out.exists():  # --force: swap, then remove the old one
            old = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.partial, self.out)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        return self.out

    def abort(self) -> None:
        for f in (self.tokens_file, self.offsets_file):
            if not f.closed:
                f.close()
        shutil.rmtree(self.partial, ignore_errors=True)
