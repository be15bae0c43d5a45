"""Prepared token folders in training: windows, epochs, mixtures, holdout, checks, memory.

The folders here hold tokens 0, 1, 2, ... (a uint32 vocabulary), so a window's first
token says which window it is: window w starts at token w * seq_len.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from collections import Counter

import numpy as np
import pytest
import torch

from common.config import load_config
from engine.data.sampling import Mixture, parse_weights, permute, quotas
from engine.data.sources import TokenSource, build_source, check_data, local_batch
from engine.data.token_file import FORMAT, VERSION, TokenFile, TokenWriter
from common.errors import UserError
from tests.distributed import cpu_env, launcher

SEQ = 8
BIG_VOCAB = 1 << 20


def write_token_folder(out: str | Path, documents: list, vocab_size: int, identity: str = "test",
                       force: bool = False) -> Path:
    """A token folder from in-memory documents (lists of ids)."""
    writer = TokenWriter(out, vocab_size, force)
    try:
        for doc in documents:
            writer.start_document()
            writer.write(np.asarray(doc))
        return writer.finish({"tokenizer": {"kind": "ids", "identity": identity, "vocab_size": vocab_size,
                                            "eos_id": None}, "sources": []})
    except BaseException:
        writer.abort()
        raise



def counting_folder(path, windows: int, extra: int = 3):
    """A folder of tokens 0..n-1 holding `windows` windows of SEQ + 1 at stride SEQ."""
    n = windows * SEQ + 1 + extra % SEQ
    return write_token_folder(path, [np.arange(n)], BIG_VOCAB)


def window_of(sample: torch.Tensor) -> int:
    first = int(sample[0])
    assert first % SEQ == 0 and torch.equal(sample, torch.arange(first, first + SEQ + 1)), sample
    return first // SEQ


def windows_seen(source, samples: int, global_batch: int) -> list[int]:
    return [window_of(source.sample(g // global_batch, g % global_batch, SEQ + 1)) for g in range(samples)]


def test_permutation_is_a_bijection_for_every_size():
    for n in (1, 2, 3, 5, 8, 17, 100, 255, 256, 257, 1000, 4097):
        for key in (0, 1, 2**63 + 5):
            image = [permute(i, n, key) for i in range(n)]
            assert sorted(image) == list(range(n)), (n, key)
    assert [permute(i, 1000, 1) for i in range(20)] != [permute(i, 1000, 2) for i in range(20)]
    assert [permute(i, 1000, 1) for i in range(20)] != list(range(20))


def test_each_window_once_per_epoch_in_a_new_order(tmp_path):
    counting_folder(tmp_path / "f", 50)
    source = TokenSource([tmp_path / "f"], seed=3, global_batch=4, seq_len=SEQ)
    seen = windows_seen(source, 3 * 50, 4)  # epochs do not line up with steps: 50 is not a multiple of 4
    epochs = [seen[e * 50:(e + 1) * 50] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(50))
    other = TokenSource([tmp_path / "f"], seed=4, global_batch=4, seq_len=SEQ)
    assert windows_seen(other, 50, 4) != epochs[0]


def test_a_sample_is_a_pure_function_of_seed_step_and_index(tmp_path):
    counting_folder(tmp_path / "f", 37)
    first = TokenSource([tmp_path / "f"], seed=1, global_batch=8, seq_len=SEQ)
    # a fresh source (a resumed run) at step 29 reads what the first one reads there
    later = TokenSource([tmp_path / "f"], seed=1, global_batch=8, seq_len=SEQ)
    for step in (29, 0, 11, 29):
        assert torch.equal(local_batch(later, step, 8, SEQ)[0], local_batch(first, step, 8, SEQ)[0])
    for step in (0, 5, 40):
        whole, whole_targets = local_batch(first, step, 8, SEQ)
        assert torch.equal(whole[:, 1:], whole_targets[:, :-1])
        for data_size in (2, 4):
            parts = [local_batch(first, step, 8, SEQ, rank, data_size) for rank in range(data_size)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole)
            assert torch.equal(torch.cat([p[1] for p in parts]), whole_targets)
    with pytest.raises(ValueError, match="windows of 9 tokens"):
        first.sample(0, 0, SEQ + 2)


def test_mixture_gives_each_folder_its_weight_and_its_own_epochs(tmp_path):
    sizes = (7, 13, 29)
    for k, windows in enumerate(sizes):
        write_token_folder(tmp_path / f"f{k}", [np.arange(windows * SEQ + 1) + k * 10_000], BIG_VOCAB)
    folders = [tmp_path / f"f{k}" for k in range(3)]
    source = TokenSource(folders, seed=0, global_batch=10, seq_len=SEQ, weights="0.5,0.3,0.2")
    assert source.mixture.quotas == [5, 3, 2]
    per_folder: dict[int, list[int]] = {0: [], 1: [], 2: []}
    horizon = 10_000
    for g in range(horizon):
        sample = source.sample(g // 10, g % 10, SEQ + 1)
        folder, offset = divmod(int(sample[0]), 10_000)
        per_folder[folder].append(offset // SEQ)
    counts = {k: len(v) for k, v in per_folder.items()}
    assert counts == {0: 5000, 1: 3000, 2: 2000}
    for k, windows in enumerate(sizes):  # every folder runs through its own epochs
        seen = per_folder[k]
        for e in range(3):
            assert sorted(seen[e * windows:(e + 1) * windows]) == list(range(windows)), (k, e)
    # and every short stretch already holds the proportions (a period of 10)
    assert Counter(source.locate(0, i)[0] for i in range(10)) == {0: 5, 1: 3, 2: 2}


def test_weights_become_exact_integer_quotas():
    assert quotas(parse_weights("3,1", 2)) == [3, 1]
    assert quotas(parse_weights("0.7,0.3", 2)) == [7, 3]
    assert quotas(parse_weights("", 3)) == [1, 1, 1]
    mixture = Mixture(parse_weights("2,1", 2))
    assert [mixture.locate(g) for g in range(6)] == [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3)]
    for bad in ("1,0", "1,-2", "1,x"):
        with pytest.raises(UserError, match="positive"):
            parse_weights(bad, 2)
    with pytest.raises(UserError, match="one weight per folder"):
        parse_weights("1,2,3", 2)


def test_holdout_windows_never_train_and_evaluation_reads_them_in_order(tmp_path):
    counting_folder(tmp_path / "f", 100)
    train = TokenSource([tmp_path / "f"], seed=0, global_batch=5, seq_len=SEQ, holdout=0.1)
    trained = set(windows_seen(train, 5 * 90, 5))
    assert trained == set(range(90))  # five epochs of the 90 training windows, none of the last 10
    evaluation = TokenSource([tmp_path / "f"], seed=0, global_batch=4, seq_len=SEQ, holdout=0.1, split="eval")
    assert windows_seen(evaluation, 12, 4) == [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 90, 91]
    again = TokenSource([tmp_path / "f"], seed=9, global_batch=4, seq_len=SEQ, holdout=0.1, split="eval")
    assert torch.equal(local_batch(again, 1, 4, SEQ, 1, 2)[0], local_batch(evaluation, 1, 4, SEQ, 1, 2)[0])


def config(*overrides: str):
    return load_config(None, ["data.source=tokens", f"training.seq_len={SEQ}", "training.global_batch=4",
                              *overrides])


def test_build_source_for_training_and_evaluation(tmp_path):
    counting_folder(tmp_path / "a", 20)
    counting_folder(tmp_path / "b", 30)
    cfg = config(f"data.path={tmp_path / 'a'},{tmp_path / 'b'}", "data.weights=1,3")
    source = build_source(cfg, BIG_VOCAB)
    assert isinstance(source, TokenSource) and source.mixture.quotas == [1, 3]
    with pytest.raises(UserError, match="data.holdout is 0 and eval.path is empty"):
        build_source(cfg, BIG_VOCAB, split="eval")
    cfg.eval.path = str(tmp_path / "b")  # a whole folder, in order
    assert windows_seen(build_source(cfg, BIG_VOCAB, split="eval"), 5, 4) == [0, 1, 2, 3, 4]
    cfg.eval.path = ""
    cfg.data.holdout = 0.2
    evaluation = build_source(cfg, BIG_VOCAB, split="eval")
    assert [part[1:] for part in evaluation.parts] == [(16, 4), (24, 6)]
    with pytest.raises(UserError, match="larger than the model's vocabulary of 256"):
        build_source(cfg, 256)


def test_check_data_names_the_folder_and_the_fix(tmp_path):
    write_token_folder(tmp_path / "small", [np.arange(5)], 256)
    write_token_folder(tmp_path / "wide", [np.arange(100) % 512], 512)
    write_token_folder(tmp_path / "ok", [np.arange(10 * SEQ + 1) % 256], 256)  # 10 windows
    (tmp_path / "empty").mkdir()
    (tmp_path / "gone.partial").mkdir()
    cases = [
        (["data.path=" + str(tmp_path / "missing")], ["missing", "does not exist", "launch/prepare.py"]),
        (["data.path=" + str(tmp_path / "gone")], ["gone.partial", "interrupted"]),
        (["data.path=" + str(tmp_path / "empty")], ["empty", "no index.json", "launch/prepare.py"]),
        (["data.path=" + str(tmp_path / "wide")], ["wide", "vocabulary 512", "vocabulary of 256"]),
        (["data.path=" + str(tmp_path / "small")], ["small", "5 tokens", "training.seq_len + 1 = 9"]),
        ([f"data.path={tmp_path / 'small'},{tmp_path / 'small'}", "data.weights=1,2,3"], ["one weight per folder"]),
        (["data.path=" + str(tmp_path / "small"), "data.holdout=1.0"], ["data.holdout", "in [0, 1)", "got 1.0"]),
        (["data.path=" + str(tmp_path / "ok"), "data.holdout=0.95"], ["leaves no training window", "ok"]),
        (["data.path=" + str(tmp_path / "ok"), "eval.every=2"], ["eval.path is empty"]),
        (["data.path=" + str(tmp_path / "ok"), f"eval.path={tmp_path / 'wide'}"], ["eval.path folder", "512"]),
        (["data.source=corpus", "data.weights=1,1"], ["data.weights", "data.source=tokens"]),
        (["data.source=corpus", f"data.path={tmp_path / 'none.txt'}"], ["none.txt", "does not exist"]),
    ]
    for overrides, fragments in cases:
        with pytest.raises(UserError) as err:
            check_data(config(*overrides), 256)  # a data.holdout outside [0, 1) stops in config() already
        for fragment in fragments:
            assert fragment in str(err.value), (overrides, str(err.value))
    check_data(config(f"data.path={tmp_path / 'ok'}", "data.holdout=0.1", "eval.every=2"), 256)
    check_data(config(f"data.path={tmp_path / 'ok'},{tmp_path / 'ok'}", "data.weights=0.7,0.3"), 300)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_resident_memory_stays_flat_on_a_4gb_token_file(tmp_path):
    """tokens.bin of 4 GB (sparse: made with truncate, so it costs no disk), read at random
    for many samples: the process grows by far less than 100 MB."""
    folder = tmp_path / "huge"
    folder.mkdir()
    tokens = 1 << 31  # uint16: 4 GiB
    with open(folder / "tokens.bin", "wb") as f:
        f.truncate(tokens * 2)
    np.save(folder / "documents.npy", np.asarray([0, tokens], dtype=np.int64))
    (folder / "index.json").write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "dtype": "uint16", "tokens": tokens, "documents": 1,
        "tokenizer": {"kind": "bytes", "identity": "bytes", "vocab_size": 256, "eos_id": 0}, "sources": []}))
    cfg = load_config(None, ["data.source=tokens", f"data.path={folder}", "training.seq_len=256",
                             "training.global_batch=64", "data.holdout=0.01"])
    check_data(cfg, 256)
    torch.stack([torch.zeros(257, dtype=torch.long)] * 2)  # warm up torch before measuring
    before = rss_mb()
    started = time.perf_counter()
    source = build_source(cfg, 256)
    assert source.parts[0][2] == (tokens - 1) // 256 - -(-((tokens - 1) // 256) // 100)
    for step in range(1, 161):  # 10,240 windows from all over the file
        inputs, _ = local_batch(source, step * 1009, 64, 256, 1, 2)
        assert inputs.shape == (32, 256) and int(inputs.abs().sum()) == 0
    grown = rss_mb() - before
    print(f"RSS grew by {grown:.1f} MB over 10,240 windows of a 4 GB token file")
    assert grown < 100, f"RSS grew by {grown:.0f} MB reading a 4 GB token file"
    assert time.perf_counter() - started < 30


def test_token_file_reads_back_what_was_written(tmp_path):
    docs = [[1, 2, 3], [], [65535, 0]]
    write_token_folder(tmp_path / "f", docs, 65536)
    f = TokenFile(tmp_path / "f")
    assert f.dtype == np.dtype("<u2") and f.tokens == 5 and f.documents == 3
    assert f.window(0, 5).tolist() == [1, 2, 3, 65535, 0]
    assert f.document_offsets().tolist() == [0, 3, 3, 5]


@pytest.mark.distributed
def test_vocabulary_mismatch_exits_2_before_any_process_group(tmp_path):
    write_token_folder(tmp_path / "wide", [np.arange(600) % 512], 512)
    result = launcher("--mesh", "dp=2", "--set", "data.source=tokens", "--set", f"data.path={tmp_path / 'wide'}",
                      "--set", f"run.dir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n\n" not in message, message
    for fragment in ("wide", "vocabulary 512", "vocabulary of 256", "--tokenizer bytes"):
        assert fragment in message, message
    assert "mesh dp=2 on" not in result.stdout  # stopped in check(): no ranks, no process group


@pytest.mark.distributed
def test_training_reads_a_prepared_folder(tmp_path):
    import subprocess
    import sys

    from tests.distributed import REPO
    prepared = subprocess.run([sys.executable, str(REPO / "launch" / "prepare.py"), str(REPO / "data" / "corpus.txt"),
                               "--out", str(tmp_path / "corpus-tokens")], capture_output=True, text=True,
                              env=cpu_env(), timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    result = launcher("--mesh", "dp=2", "--set", "data.source=tokens", "--set", f"data.path={tmp_path / 'corpus-tokens'}",
                      "--set", "training.steps=3", "--set", f"run.dir={tmp_path / 'run'}", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "mesh dp=2 on 2 ranks" in result.stdout
    assert "step 3/3 | loss" in result.stdout, result.stdout[-2000:]


def folder_with_foreign_id(path, position: int = 700, token: int = 60000, tokens: int = 1000) -> Path:
    """A byte-vocabulary folder (index.json: 256) whose tokens.bin holds `token` at `position`."""
    ids = np.arange(tokens) % 256
    ids[position] = token
    return write_token_folder(path, [ids], 256)


def test_a_window_with_an_id_outside_the_vocabulary_is_refused_as_it_is_read(tmp_path):
    from engine.data.token_file import OutOfVocabulary
    folder = folder_with_foreign_id(tmp_path / "bad")
    source = TokenSource([folder], 0, 4, 32, model_vocab=256)
    with pytest.raises(OutOfVocabulary) as err:
        for step in range(8):  # 31 windows: each is read within 8 steps of 4
            local_batch(source, step, 4, 32)
    assert (f"data.path folder '{folder}': token 700 of tokens.bin is id 60,000, outside the model's "
            f"vocabulary of 256 (ids 0 to 255)") in str(err.value)
    assert f"launch/prepare.py --check {folder} --vocab-size 256" in str(err.value)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", [[], ["--parity"]], ids=["train", "parity"])
def test_an_id_outside_the_vocabulary_stops_every_rank_with_exit_2(tmp_path, mode):
    """Every window of the folder is in step 0's batch, split over 2 data ranks: the ranks
    agree before any forward, and all leave with the same paragraph."""
    folder = folder_with_foreign_id(tmp_path / "bad")
    result = launcher("--mesh", "dp=2", *mode, "--set", "data.source=tokens", "--set", f"data.path={folder}",
                      "--set", "training.seq_len=64", "--set", "training.steps=2", "--set", "parity.steps=2",
                      "--set", f"run.dir={tmp_path / 'run'}", timeout=300)
    from tests.test_cli import assert_clean_error
    assert_clean_error(result, f"data.path folder '{folder}': token 700 of tokens.bin is id 60,000, outside the "
                               f"model's vocabulary of 256")
    print(f"{mode or 'train'}: exit {result.returncode}: {result.stderr.strip()}")


def test_prepare_check_scans_a_folder_in_bounded_memory(tmp_path):
    """A 512 MiB tokens.bin (sparse zeros) with one foreign id near its end: --check finds it
    and names it; the scanning process stays far below the file's size."""
    import subprocess
    import sys

    from tests.distributed import REPO
    folder = tmp_path / "big"
    folder.mkdir()
    tokens = 1 << 28  # uint16: 512 MiB
    with open(folder / "tokens.bin", "wb") as f:
        f.truncate(tokens * 2)
        f.seek((tokens - 5) * 2)
        f.write(np.asarray([60000], dtype="<u2").tobytes())
    np.save(folder / "documents.npy", np.asarray([0, tokens], dtype=np.int64))
    (folder / "index.json").write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "dtype": "uint16", "tokens": tokens, "documents": 1,
        "tokenizer": {"kind": "bytes", "identity": "bytes", "vocab_size": 256, "eos_id": 0}, "sources": []}))
    # The process's own peak (VmHWM; a child's ru_maxrss would count the forked pytest too).
    measured = ("import sys; sys.path.insert(0, sys.argv[1]); from launch.prepare import main; code = main(sys.argv[2:]); "
                "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", measured, str(REPO), "--check", str(folder)],
                            capture_output=True, text=True, env=cpu_env(), timeout=300)
    stderr, peak_mb = result.stderr, int(result.stdout.split()[-1]) / 1024
    assert result.returncode == 2 and "Traceback" not in stderr, stderr
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("error: prepared folder") and f"token {tokens - 5:,} of tokens.bin is id 60,000" \
        in message and f"1 of its {tokens:,} ids is outside it" in message, stderr
    print(f"--check of a 512 MiB tokens.bin: peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 150, f"--check peaked at {peak_mb:.0f} MB on a 512 MiB file"


def test_prepare_check_accepts_a_good_folder_and_a_larger_model(tmp_path):
    import subprocess
    import sys

    from tests.distributed import REPO
    folder = write_token_folder(tmp_path / "good", [np.arange(1000) % 256], 256)
    for extra, vocabulary in (([], "its index.json's vocabulary of 256"), (["--vocab-size", "512"],
                                                                          "the --vocab-size vocabulary of 512")):
        result = subprocess.run([sys.executable, str(REPO / "launch" / "prepare.py"), "--check", str(folder), *extra],
                                capture_output=True, text=True, env=cpu_env(), timeout=120)
        assert result.returncode == 0, result.stderr
        assert f"checked {folder}: 1,000 tokens, every id inside {vocabulary}; the largest is 255" in result.stdout
    smaller = subprocess.run([sys.executable, str(REPO / "launch" / "prepare.py"), "--check", str(folder),
                              "--vocab-size", "100"], capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert smaller.returncode == 2 and "larger than --vocab-size 100" in smaller.stderr, smaller.stderr
