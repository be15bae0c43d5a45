"""launch/prepare.py end to end: what it writes decodes back to the text, with the byte
tokenizer and a trained tokenizer.json; bad input exits 2 with one paragraph."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.data.token_file import TokenFile, token_dtype
from engine.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.distributed import REPO, cpu_env

CORPUS = REPO / "data" / "corpus.txt"
JSONL_DOCS = ["first document", "", "naïve café — 日本語 🙂", "line one\nline two\r\nthree", "x" * 5000]


def prepare(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs launch/prepare.py. One run in CI once hung (it takes a second): should one hang
    again, the failure shows where each of its processes was, from faulthandler's dump on SIGABRT."""
    command = [sys.executable, str(REPO / "launch" / "prepare.py"), *map(str, args)]
    with subprocess.Popen(command, cwd=REPO, env=cpu_env(PYTHONFAULTHANDLER="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as run:
        try:
            stdout, stderr = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGABRT)
            stdout, stderr = run.communicate()
            pytest.fail(f"launch/prepare.py {' '.join(map(str, args))} still ran after {timeout} s; the stacks of "
                        f"its processes:\n{stderr}\n{stdout}")
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def documents(folder) -> list[np.ndarray]:
    f = TokenFile(folder)
    offsets = f.document_offsets()
    tokens = np.asarray(f.array)
    return [tokens[offsets[d]:offsets[d + 1]] for d in range(f.documents)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(JSONL_DOCS))
                                     + "\n\n")
    # a text longer than one piece (64 KB): paragraphs, and one long line without a newline
    paragraphs = [f"Paragraph {i}: " + " ".join(f"word{j % 97}" for j in range(i % 50 + 5)) for i in range(1500)]
    (root / "long.txt").write_text("\n\n".join(paragraphs) + "\n" + "y" * 70_000 + "\nend")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    result = prepare("--train-tokenizer", CORPUS, "--vocab-size", 300, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "trained" in result.stdout and "300 tokens" in result.stdout
    return out


def test_byte_tokenizer_round_trip(tmp_path, inputs):
    out = tmp_path / "bytes"
    result = prepare(CORPUS, inputs / "docs.jsonl", inputs / "long.txt", "--out", out, "--workers", 2)
    assert result.returncode == 0, result.stderr
    texts = [CORPUS.read_text(), *JSONL_DOCS, (inputs / "long.txt").read_text()]
    docs = documents(out)
    assert [ByteTokenizer().decode(d) for d in docs] == texts
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["tokenizer"]["identity"] == "bytes"
    assert index["tokenizer"]["vocab_size"] == 256
    assert index["documents"] == len(texts) and index["tokens"] == sum(len(t.encode()) for t in texts)
    assert [s["documents"] for s in index["sources"]] == [1, len(JSONL_DOCS), 1]
    assert (out / "tokens.bin").stat().st_size == 2 * index["tokens"]
    assert not (tmp_path / "bytes.partial").exists()
    # progress on stderr, the summary on stdout
    assert f"prepare: {len(texts)} documents, {index['tokens']:,} tokens" in result.stderr
    assert "MB/s" in result.stderr
    assert f"prepared {out}: {len(texts)} documents, {index['tokens']:,} tokens (uint16" in result.stdout
    # one worker, in this process, writes the same bytes
    again = prepare(CORPUS, inputs / "docs.jsonl", inputs / "long.txt", "--out", tmp_path / "one", "--workers", 1)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "one" / "tokens.bin").read_bytes() == (out / "tokens.bin").read_bytes()


def test_trained_tokenizer_round_trip_with_eos(tmp_path, inputs, trained):
    out = tmp_path / "bpe"
    result = prepare(CORPUS, inputs / "docs.jsonl", inputs / "long.txt", "--out", out, "--tokenizer", trained,
                     "--append-eos", "--workers", 2)
    assert result.returncode == 0, result.stderr
    tokenizer = HFTokenizer(trained)
    assert tokenizer.vocab_size == 300 and tokenizer.eos_id is not None
    index = json.loads((out / "index.json").read_text())
    assert index["tokenizer"]["identity"] == tokenizer.identity and "sha256:" in tokenizer.identity
    assert index["tokenizer"]["vocab_size"] == 300 and index["dtype"] == "uint16"
    texts = [CORPUS.read_text(), *JSONL_DOCS, (inputs / "long.txt").read_text()]
    docs = documents(out)
    assert all(d[-1] == tokenizer.eos_id for d in docs)
    assert [tokenizer.decode(d[:-1]) for d in docs] == texts
    assert index["tokens"] < len(CORPUS.read_bytes()) + sum(len(t.encode()) for t in texts[1:])  # it merges


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"
    vocab = {f"w{i}": i for i in range(70_000)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "wide.json"))
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "w69999 w5 w65536"}) + "\n")
    result = prepare(tmp_path / "d.jsonl", "--out", tmp_path / "out", "--tokenizer", tmp_path / "wide.json",
                     "--text-key", "body", "--workers", 1)
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["dtype"] == "uint32" and index["tokenizer"]["vocab_size"] == 70_000
    assert np.fromfile(tmp_path / "out" / "tokens.bin", dtype="<u4").tolist() == [69999, 5, 65536]


def test_text_is_read_in_pieces_that_join_back():
    import launch.prepare as p

    text = (REPO / "data" / "corpus.txt").read_text()
    path = REPO / "data" / "corpus.txt"
    small, p.PIECE_CHARS = p.PIECE_CHARS, 1000
    try:
        pieces = list(p.text_pieces(path))
    finally:
        p.PIECE_CHARS = small
    assert len(pieces) > 5 and "".join(t for _, t, _ in pieces) == text
    assert all(len(t) <= 1000 for _, t, _ in pieces)
    assert all(t.endswith("\n\n") for _, t, _ in pieces[:-1])  # cut after blank lines
    assert pieces[0][0] & p.START and pieces[-1][0] & p.END
    assert sum(n for _, _, n in pieces) == path.stat().st_size


BAD = {
    "missing": (lambda d: [d / "nope.txt"], ["nope.txt", "does not exist"]),
    "bad json": (lambda d: [d / "bad.jsonl"], ["bad.jsonl line 2 is not valid JSON"]),
    "no key": (lambda d: [d / "nokey.jsonl"], ["nokey.jsonl line 1 has no 'text' key", "'body'", "--text-key"]),
    "not utf-8": (lambda d: [d / "latin1.txt"], ["latin1.txt is not UTF-8", "offset 8"]),
    "no tiktoken": (lambda d: [CORPUS, "--tokenizer", "tiktoken:cl100k_base"], ["tiktoken", "not installed"]),
    "no tokenizer": (lambda d: [CORPUS, "--tokenizer", d / "none.json"], ["none.json", "does not exist"]),
    "exists": (lambda d: [CORPUS], ["already exists", "--force"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_paragraph(tmp_path, case):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    (tmp_path / "nokey.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "latin1.txt").write_bytes("abcd caf\xe9".encode("latin-1"))
    out = tmp_path / "out"
    if case == "exists":
        out.mkdir()
    make, fragments = BAD[case]
    result = prepare(*make(tmp_path), "--out", out, "--workers", 2)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message, result.stderr
    for fragment in fragments:
        assert fragment in message, message
    assert not (tmp_path / "out.partial").exists()
    assert out.exists() == (case == "exists")


@pytest.mark.parametrize("kill", ["SIGTERM to the group", "SIGINT to the group", "SIGKILL to a worker"])
def test_a_preparation_killed_with_or_by_its_workers_ends_at_once_and_writes_nothing(tmp_path, kill):
    """A kill of the whole process group (Ctrl-C, or `kill -- -PGID` from a scheduler) reaches
    the workers too. With multiprocessing.Pool the preparation then hung for good, in its
    terminate(), about one time in two (a worker killed while it held the task queue's lock),
    and concurrent.futures' pool hung too (a worker killed while it sent a result)."""
    text = tmp_path / "big.txt"
    text.write_text("a line of text for the pool\n" * 1_500_000)  # 42 MB: seconds of work for 2 workers
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "launch" / "prepare.py"), *[str(text)] * 8, "--out", str(out),
               "--workers", "2"]
    with subprocess.Popen(command, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as run:
        def workers() -> list[int]:
            children = subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True).stdout.split()
            return [int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]

        while len(workers()) < 2 and run.poll() is None:
            time.sleep(0.05)
        time.sleep(0.3)  # the workers are tokenizing
        assert run.poll() is None, "the preparation ended before the kill: give it more text"
        if kill == "SIGKILL to a worker":
            os.kill(workers()[0], signal.SIGKILL)
        else:
            os.killpg(run.pid, getattr(signal, kill.split()[0]))
        try:
            _, stderr = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            pytest.fail(f"launch/prepare.py still ran 60 s after {kill}")
    if kill == "SIGKILL to a worker":
        assert run.returncode == 2, stderr
        assert stderr.startswith("error: a worker process ended before its work was done (killed by signal 9"), stderr
        assert stderr.count("\n") == 1, stderr
    else:
        assert run.returncode == 130, stderr
        assert stderr.strip() == "interrupted: nothing was written", stderr
    assert not out.exists() and not (tmp_path / "out.partial").exists()
