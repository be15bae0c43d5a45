"""Tokenize text into a folder that training memory-maps (data.source=tokens).

    python launch/prepare.py INPUT... --out FOLDER [--tokenizer bytes|tokenizer.json|tiktoken:NAME]
                             [--workers N] [--text-key text] [--append-eos] [--force]
    python launch/prepare.py --train-tokenizer TEXT... --vocab-size 512 --out tokenizer.json
    python launch/prepare.py --check FOLDER [--vocab-size N]

Inputs: a .jsonl (or .ndjson) file holds one document per line, its text under
--text-key; any other file is one UTF-8 text document. Inputs are streamed: text
files in pieces of about 64 KB cut after a blank line (else after a line), JSON lines
in groups, tokenized in order by a pool of --workers processes, and written as they
come back. FOLDER is written as FOLDER.partial, then renamed. `--check` reads a prepared
folder's ids in bounded memory and reports any at or past the vocabulary (index.json's,
or --vocab-size, e.g. the model's). Format and sampling: docs/data.md. Bad input, and a
folder that fails --check, exit with code 2 and one paragraph.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import signal
import sys
import time
from contextlib import closing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from engine.data.token_file import DTYPES, INDEX, TokenWriter, id_outside, read_index, scan_ids  # noqa: E402
from engine.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402
from common.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from common.workers import WorkerDied, imap  # noqa: E402

PIECE_CHARS = 1 << 16  # a text file is tokenized in pieces of about this many characters
JOB_CHARS = 1 << 20  # characters of text (or JSON) per pool task
READ_BYTES = 1 << 20
START, END = 1, 2  # flags of a piece: it starts / ends a document
JSONL = (".jsonl", ".ndjson")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help=".txt (one document per file) or "
                        ".jsonl (one document per line) files")
    parser.add_argument("--out", help="the folder to write (or, with --train-tokenizer, the tokenizer.json)")
    parser.add_argument("--tokenizer", default="bytes", help="bytes (default, vocabulary 256), a Hugging "
                        "Face tokenizer.json, or tiktoken:NAME where tiktoken is installed")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="tokenizing processes (default: min(4, cores)); 1 tokenizes in this process")
    parser.add_argument("--text-key", default="text", help="the key of a .jsonl line's text (default: text)")
    parser.add_argument("--append-eos", action="store_true",
                        help="end every document with the tokenizer's end-of-document token")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--train-tokenizer", nargs="+", metavar="TEXT",
                        help="instead of preparing, train a byte-level BPE tokenizer.json on these files")
    parser.add_argument("--vocab-size", type=int, help="with --train-tokenizer: its size (default 512); with "
                        "--check: the vocabulary to check against (default: the one index.json names)")
    parser.add_argument("--check", metavar="FOLDER", help="instead of preparing, read FOLDER's token ids and "
                        "report any outside the vocabulary")
    return parser.parse_args(argv)


# -- reading ------------------------------------------------------------------------------

def text_pieces(path: Path):
    """(flags, text, bytes) pieces of one text file, one document, read 1 MB at a time: each
    piece is about PIECE_CHARS and ends after a blank line where there is one, else after
    a line, else where it must."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    buffer = ""
    first = True
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            carried = len(decoder.getstate()[0])  # the bytes of a character cut by the last block
            try:
                buffer += decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise UserError(f"{path} is not UTF-8 text (the byte at offset {offset - carried + err.start:,} "
                                f"cannot be decoded). Convert it to UTF-8, or leave it out.") from None
            offset += len(block)
            position = 0
            while len(buffer) - position >= PIECE_CHARS:
                limit = position + PIECE_CHARS
                cut = buffer.rfind("\n\n", position, limit)
                cut = cut + 2 if cut > position else buffer.rfind("\n", position, limit) + 1
                if cut <= position:
                    cut = limit
                piece = buffer[position:cut]
                yield (START if first else 0), piece, len(piece.encode("utf-8", "surrogatepass"))
                first = False
                position = cut
            buffer = buffer[position:]
            if not block:
                break
    yield (START if first else 0) | END, buffer, len(buffer.encode("utf-8", "surrogatepass"))


def jobs(paths: list[Path], text_key: str):
    """Pool tasks, in input order: ("text", path, [(flags, text)], bytes) or ("jsonl", path,
    first line number, [lines], bytes), each about JOB_CHARS."""
    try:
        for path in paths:
            if path.suffix in JSONL:
                lines, size, first_line = [], 0, 1
                with open(path, "rb") as f:
                    for number, line in enumerate(f, 1):
                        if not lines:
                            first_line = number
                        lines.append(line)
                        size += len(line)
                        if size >= JOB_CHARS:
                            yield ("jsonl", str(path), first_line, lines, size)
                            lines, size = [], 0
                if lines:
                    yield ("jsonl", str(path), first_line, lines, size)
            else:
                pieces, size = [], 0
                for flags, text, nbytes in text_pieces(path):
                    pieces.append((flags, text))
                    size += nbytes
                    if size >= JOB_CHARS:
                        yield ("text", str(path), pieces, size)
                        pieces, size = [], 0
                if pieces:
                    yield ("text", str(path), pieces, size)
    except OSError as err:
        raise UserError(f"cannot read {err.filename or 'an input'}: {err.strerror or err}.") from None


# -- tokenizing (in the pool's processes) ---------------------------------------------------

_worker: dict = {}


def init_worker(spec: str, text_key: str, dtype: str, in_pool: bool = True) -> None:
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    _worker.update(tokenizer=load_tokenizer(spec), text_key=text_key, dtype=np.dtype(dtype))


def encode_job(job):
    """(input path, [(flags, token array) per piece], bytes read), or (path, "error", paragraph)."""
    tokenizer, dtype = _worker["tokenizer"], _worker["dtype"]
    try:
        if job[0] == "text":
            _, path, pieces, size = job
            encoded = tokenizer.encode_many([text for _, text in pieces])
            return path, [(flags, ids.astype(dtype)) for (flags, _), ids in zip(pieces, encoded)], size
        _, path, first_line, lines, size = job
        key = _worker["text_key"]
        texts = []
        for number, raw in enumerate(lines, first_line):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as err:
                return path, "error", (f"{path} line {number} is not valid JSON ({err}). Each line of a "
                                       f".jsonl file must be one JSON object, e.g. {{\"{key}\": \"...\"}}.")
            if not isinstance(record, dict) or key not in record:
                keys = ", ".join(map(repr, list(record)[:8])) if isinstance(record, dict) else type(record).__name__
                return path, "error", (f"{path} line {number} has no {key!r} key (it has: {keys}). Give "
                                       f"the key that holds the text with --text-key.")
            text = record[key]
            if not isinstance(text, str):
                return path, "error", (f"{path} line {number}: {key!r} holds a {type(text).__name__}, not "
                                       f"text. Give the key that holds the text with --text-key.")
            texts.append(text)
        return path, [(START | END, ids.astype(dtype)) for ids in tokenizer.encode_many(texts)], size
    except Exception as err:  # a tokenizer failing on some text: name where
        return job[1], "error", f"tokenizing {job[1]} failed: {type(err).__name__}: {err}."


def encoded(stream, workers: int, initargs: tuple):
    """encode_job's results for the jobs of `stream`, in order, from `workers` processes
    (common/workers.py: at most 2 x workers jobs read ahead, so memory stays bounded
    whatever the inputs' size, and a worker's death is an error, not a hang)."""
    if workers == 1:
        init_worker(*initargs, in_pool=False)
        yield from map(encode_job, stream)
        return
    try:
        yield from imap(encode_job, stream, workers, init_worker, initargs)  # closing this closes it
    except WorkerDied as died:
        raise UserError(f"{died}; nothing was written. Run again, with fewer --workers if memory is "
                        f"short.") from None


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def human_bytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB" if count >= 100_000 else f"{count / 1e3:,.1f} KB"


# -- progress -------------------------------------------------------------------------------

class Progress:
    """One line on stderr, rewritten in place on a terminal (elsewhere a line every 10 s)."""

    def __init__(self, stream=sys.stderr, task: str = "prepare"):
        self.stream = stream
        self.task = task
        self.tty = stream.isatty()
        self.started = self.shown = time.perf_counter()
        self.documents = self.tokens = self.bytes = 0

    def line(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        mb = self.bytes / 1e6
        documents = f"{plural(self.documents, 'document')}, " if self.task == "prepare" else ""
        return (f"{self.task}: {documents}{plural(self.tokens, 'token')}, "
                f"{human_bytes(self.bytes)} read, {mb / seconds:,.2f} MB/s")

    def update(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.shown >= (0.2 if self.tty else 10.0):
            self.shown = now
            self.stream.write(f"\r{self.line()}\033[K" if self.tty else self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        self.update(force=True)
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()


# -- the whole preparation --------------------------------------------------------------------

def check_inputs(inputs: list[str]) -> list[Path]:
    if not inputs:
        raise UserError("no INPUT given. Name one or more .txt or .jsonl files to prepare, e.g. "
                        "`python launch/prepare.py data/corpus.txt --out data/corpus-tokens`.")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise UserError(f"input {str(path)!r} {what}. Give .txt files (one document each) or .jsonl "
                            f"files (one document per line).")
        if not os.access(path, os.R_OK):
            raise UserError(f"input {str(path)!r} cannot be read (permission denied).")
    return paths


def prepare(inputs: list[str], out: str, tokenizer_spec: str = "bytes", workers: int = 1,
            text_key: str = "text", append_eos: bool = False, force: bool = False) -> dict:
    """Tokenize `inputs` into the folder `out`; returns the summary."""
    paths = check_inputs(inputs)
    if workers < 1:
        raise UserError(f"--workers {workers}: give at least 1.")
    tokenizer = load_tokenizer(tokenizer_spec)
    if append_eos and tokenizer.eos_id is None:
        raise UserError(f"--append-eos: the tokenizer {tokenizer.identity} has no end-of-document token "
                        f"(none of <|endoftext|>, </s>, <eos>, ...). Leave out --append-eos, or add one.")
    writer = TokenWriter(out, tokenizer.vocab_size, force)
    eos = np.asarray([tokenizer.eos_id if append_eos else 0], dtype=writer.dtype)
    per_source = {str(p): {"path": str(p), "bytes": p.stat().st_size, "documents": 0, "tokens": 0} for p in paths}
    progress = Progress()
    try:
        initargs = (tokenizer_spec, text_key, writer.dtype.str)
        # closed on an error too, which stops the workers there and then
        with closing(encoded(jobs(paths, text_key), workers, initargs)) as results:
            for path, pieces, size in results:
                if isinstance(pieces, str):
                    raise UserError(size)
                source = per_source[path]
                for flags, ids in pieces:
                    if flags & START:
                        writer.start_document()
                        source["documents"] += 1
                    written = len(ids) + (1 if flags & END and append_eos else 0)
                    writer.write(ids)
                    if flags & END and append_eos:
                        writer.write(eos)
                    source["tokens"] += written
                progress.documents, progress.tokens = writer.documents, writer.tokens
                progress.bytes += size
                progress.update()
        progress.close()
        summary = {"documents": writer.documents, "tokens": writer.tokens, "dtype": writer.dtype_name,
                   "tokenizer": tokenizer.identity, "bytes": sum(s["bytes"] for s in per_source.values())}
        writer.finish({"tokenizer": tokenizer.describe(), "append_eos": append_eos,
                       "text_key": text_key, "sources": list(per_source.values()),
                       "created_by": "launch/prepare.py"})
        summary["seconds"] = time.perf_counter() - progress.started
        return summary
    except BaseException:
        writer.abort()
        raise


def check_folder(folder: str, vocab_size: int | None = None) -> str:
    """Every token id of a prepared folder against a vocabulary (index.json's, or a model's
    of at least that size); returns the summary line, or raises the error a run would
    meet at the first such id, with their count."""
    index = read_index(folder, "--check")
    named = int(index["tokenizer"]["vocab_size"])
    vocab = named if vocab_size is None else vocab_size
    if vocab < named:
        raise UserError(f"--check {folder!r}: its {INDEX} names a vocabulary of {named:,}, larger than --vocab-size "
                        f"{vocab:,}, so its ids may reach {named - 1:,}; launch/run.py refuses it for such a model "
                        f"before starting. Give --vocab-size of at least {named:,}, or prepare the data with a "
                        f"smaller tokenizer.")
    itemsize = DTYPES[index["dtype"]].itemsize
    progress = Progress(task="check")

    def show(done: int) -> None:
        progress.tokens, progress.bytes = done, done * itemsize
        progress.update()

    scan = scan_ids(folder, vocab, progress=show)
    whose = "the --vocab-size" if vocab_size is not None else f"its {INDEX}'s"
    if scan.outside:
        raise id_outside(folder, scan.first, scan.first_id, vocab, "prepared", whose,
                         f"{scan.outside:,} of its {scan.tokens:,} ids {'is' if scan.outside == 1 else 'are'} "
                         f"outside it (this is the first); prepare the folder again")
    progress.close()
    largest = "" if scan.largest is None else f"; the largest is {scan.largest:,}"
    return f"checked {folder}: {plural(scan.tokens, 'token')}, every id inside {whose} vocabulary of {vocab:,}{largest}"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed preparation removes FOLDER.partial too
    try:
        if args.check:
            if args.inputs or args.out or args.train_tokenizer:
                raise UserError("--check reads one prepared folder; leave out INPUT, --out and --train-tokenizer.")
            print(check_folder(args.check, args.vocab_size))
            return 0
        if not args.out:
            raise UserError("--out is missing: give the folder to write (or, with --train-tokenizer, the "
                            "tokenizer.json).")
        if args.train_tokenizer:
            if args.inputs:
                raise UserError("--train-tokenizer takes its text files itself; leave out the INPUT "
                                "arguments, and prepare with --tokenizer OUT.json afterwards.")
            done = train_bpe(args.train_tokenizer, 512 if args.vocab_size is None else args.vocab_size, args.out)
            print(f"trained {done['out']}: a byte-level BPE of {done['vocab_size']:,} tokens on "
                  f"{done['files']} file(s), {done['bytes']:,} bytes, in {done['seconds']:.2f} s")
            return 0
        done = prepare(args.inputs, args.out, args.tokenizer, args.workers, args.text_key,
                       args.append_eos, args.force)
    except UserError as err:
        sys.stderr.flush()
        print(f"\nerror: {err}" if sys.stderr.isatty() else f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted: nothing was written", file=sys.stderr)
        return 130
    seconds = done["seconds"]
    print(f"prepared {args.out}: {plural(done['documents'], 'document')}, {plural(done['tokens'], 'token')} "
          f"({done['dtype']}, tokenizer {done['tokenizer']}) from {human_bytes(done['bytes'])} in "
          f"{seconds:.2f} s ({done['bytes'] / 1e6 / max(seconds, 1e-9):,.2f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
