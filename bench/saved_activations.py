"""What one block keeps for backward, compiled and eager, with and without
parallel.recompute_cheap (docs/parallelism.md, "Activations at their true size").

Compiled: a real CPU run over gloo (`torchrun --nproc_per_node 2`, tp=2 with sequence
parallel, one step) with TORCH_LOGS=aot_graphs; rank 0's backward graph of a block names
every tensor the forward saved for it, with its shape. Its inputs that are neither
tangents nor parameters (AOT autograd's primals after the first, the block's input, and
the transposed weights) are the block's activations. Eager: the dry run of the same step
(tests/dryrun_worker.py activations: 3 blocks less 2).

    .venv/bin/python bench/saved_activations.py [--seq-len 512]

The count is (6h + 2h n_kv/n_heads + 4 ffn) s/tp values (tests/test_activation_memory.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models import model_args  # noqa: E402
from tests.distributed import cpu_env  # noqa: E402

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "b8": 1, "i32": 4}


def block_saved_bytes(log: str, weight_shapes: set[str]) -> int:
    """The activations a compiled block saves: the first backward graph's inputs."""
    graph = re.split(r"=+ Backward graph \d+ =+", log)[1]
    signature = re.search(r"def forward\(self, (.*?)\):", graph, re.S).group(1)
    total = 0
    for name, dtype, shape in re.findall(r'(\w+): "(\w+)\[([^\]]*)\]', signature):
        if name.startswith("tangents") or (name.startswith("primals_") and name != "primals_1") or shape in weight_shapes:
            continue
        total += math.prod(int(d) for d in shape.split(",") if d.strip()) * BYTES[dtype]
    return total


def compiled(seq_len: int, recompute: bool, scratch: Path, weight_shapes: set[str]) -> int:
    logs = scratch / f"logs-{recompute}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--redirects", "3", "--log-dir", str(logs), str(REPO / "launch" / "run.py"), "--mesh", "tp=2",
               "--set", "parallel.compile=true", "--set", "parallel.sequence_parallel=true",
               "--set", "training.steps=1", "--set", f"training.seq_len={seq_len}", "--set", "training.global_batch=1",
               "--set", f"parallel.recompute_cheap={str(recompute).lower()}", "--set", f"run.dir={scratch / 'run'}"]
    env = cpu_env(TORCH_LOGS="aot_graphs", TORCHINDUCTOR_CACHE_DIR=str(scratch / f"inductor-{recompute}"))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0 = next(path for path in logs.rglob("stderr.log") if path.parent.name == "0")
    return block_saved_bytes(rank0.read_text(), weight_shapes)


def eager(seq_len: int, recompute: bool, scratch: Path) -> int:
    layout = scratch / f"layout-{recompute}.json"
    layout.write_text(json.dumps(["tp=2", ["parallel.sequence_parallel=true", f"training.seq_len={seq_len}",
                                           "training.global_batch=1", f"parallel.recompute_cheap={str(recompute).lower()}"], 2]))
    out = scratch / f"eager-{recompute}"
    out.mkdir()
    result = subprocess.run([sys.executable, str(REPO / "tests" / "dryrun_worker.py"), "activations", str(layout), str(out)],
                            cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "activations.json").read_text())["block_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    seq_len = parser.parse_args().seq_len
    args, tp = model_args("llama", "debug"), 2
    h, kv = args.dim, args.n_kv_heads * args.head_dim
    ffn = args.ffn_hidden
    # The block's weights as tp=2 leaves them, transposed as the backward keeps them.
    weight_shapes = {f"{a}, {b}" for a, b in ((h, h // tp), (h // tp, h), (h, kv // tp), (kv // tp, h),
                                              (h, ffn // tp), (ffn // tp, h))}
    count = (6 * h + 2 * h * args.n_kv_heads // args.n_heads + 4 * ffn) * seq_len // tp * 4
    print(f"debug model, tp=2 with sequence parallel, {seq_len} tokens, fp32; count {count:,} bytes per block")
    print("| recompute_cheap | eager (dry run) | compiled (AOT graphs) |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for recompute in (False, True):
            e = eager(seq_len, recompute, Path(scratch))
            c = compiled(seq_len, recompute, Path(scratch), weight_shapes)
            print(f"| {str(recompute).lower()} | {e:,} ({e / count:.2f}x) | {c:,} ({c / count:.2f}x) |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
