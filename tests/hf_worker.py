"""Run under torchrun by tests/test_hf_checkpoint.py: for each Hugging Face folder, the
launcher's own checks (which register the "hf:FOLDER" flavor), then the sharded model
with the imported weights (launch/build.py), its logits on fixed tokens, and an export.

usage: torchrun --nproc_per_node N tests/hf_worker.py MESH OUT_DIR FOLDER[:MAX_SHARD_BYTES] ...

Rank 0 writes OUT_DIR/logits-I.pt ({"tokens", "logits"}) for the I-th folder; every rank
takes part in writing OUT_DIR/export-I (save_hf, with MAX_SHARD_BYTES when given).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from engine.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, save_hf  # noqa: E402
from launch.build import sharded_model, start_process_group  # noqa: E402
from launch.run import check, parse_args  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402

TOKENS_SEED = 7


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 48), generator=torch.Generator().manual_seed(TOKENS_SEED))


def main(mesh: str, out: Path, folders: list[str]) -> None:
    dims = device = None
    for number, given in enumerate(folders):
        folder, _, shard = given.partition(":")
        cfg, spec = check(parse_args(["--mesh", mesh, "--set", f"checkpoint.hf_import={folder}",
                                      "--set", "data.source=synthetic", "--set", f"run.dir={out / 'run'}",
                                      "--set", "training.seq_len=48", "--set", "training.global_batch=4"]),
                          int(os.environ["WORLD_SIZE"]))
        if dims is None:
            dims, device = start_process_group(cfg, spec)
        model, _ = sharded_model(cfg, dims, device)
        with torch.no_grad():
            inputs = tokens(model.args.vocab_size)
            logits = model(inputs.to(device))
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
        if dist.get_rank() == 0:
            torch.save({"tokens": inputs, "logits": logits.cpu()}, out / f"logits-{number}.pt")
        save_hf(model, out / f"export-{number}", int(shard) if shard else DEFAULT_MAX_SHARD_BYTES,
                carried_from=folder)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
    exit_without_teardown(0)
