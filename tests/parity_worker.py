"""Run under torchrun by tests/test_parity.py: the sharded model against a single-process
reference built from the same seed, on the same global batches. Rank 0 writes a JSON report.

usage: torchrun --nproc_per_node N tests/parity_worker.py MESH OUT.json [STEPS] [FLAVOR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import parallel  # noqa: E402,F401
from engine.config import Config  # noqa: E402
from engine.data import CorpusSource, local_batch  # noqa: E402
from engine.grad_norm import grad_norm  # noqa: E402
from engine.train import build_optimizer, loss_fn, global_mean, train_step  # noqa: E402
from models import build_on_meta  # noqa: E402
from models.materialise import materialise  # noqa: E402
from parallel.apply import apply_plan  # noqa: E402
from parallel.mesh import build_mesh, parse_mesh  # noqa: E402
from parallel.plan import get_plan  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (full(a).detach().float() - b.detach().float()).abs().max().item()


def main() -> None:
    mesh_text, out_path = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    flavor = sys.argv[4] if len(sys.argv) > 4 else "debug"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    spec = parse_mesh(mesh_text).resolve(dist.get_world_size())
    dims = build_mesh(spec, "cpu")
    cfg = Config()
    cfg.model.flavor = flavor
    cfg.training.steps = steps
    seed = 1234

    model = build_on_meta("llama", flavor)
    apply_plan(model, get_plan("llama"), dims)
    materialise(model, "cpu", seed)
    reference = build_on_meta("llama", flavor)
    materialise(reference, "cpu", seed)

    report = {"mesh": str(spec), "flavor": flavor}
    ref_params = dict(reference.named_parameters())
    report["init_max_diff"] = max(max_diff(p, ref_params[n]) for n, p in model.named_parameters())

    source = CorpusSource(REPO / "data" / "corpus.txt", seed)
    t = cfg.training
    ref_inputs, ref_targets = local_batch(source, 0, t.global_batch, t.seq_len)
    inputs, targets = local_batch(source, 0, t.global_batch, t.seq_len, dims.data_rank, dims.data_size)

    ref_loss = loss_fn(reference(ref_inputs), ref_targets)
    ref_loss.backward()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    report["loss0_ref"] = ref_loss.item()
    report["loss0_diff"] = abs(global_mean(loss, dims.data.get_group()) - ref_loss.item())
    grad_diffs = {n: max_diff(p.grad, ref_params[n].grad) for n, p in model.named_parameters()}
    report["grad_max_diff"] = max(grad_diffs.values())
    report["worst_grad"] = max(grad_diffs, key=grad_diffs.get)
    for norm_type in (2.0, float("inf")):
        ours = grad_norm(model.parameters(), norm_type).item()
        theirs = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type).item()
        report[f"grad_norm_{norm_type}"] = [ours, theirs]
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)

    optimizer, scheduler = build_optimizer(model, cfg.optim, steps)
    ref_optimizer, ref_scheduler = build_optimizer(reference, cfg.optim, steps)
    report["losses"], report["ref_losses"] = [], []
    for step in range(steps):
        x, y = local_batch(source, step, t.global_batch, t.seq_len, dims.data_rank, dims.data_size)
        rx, ry = local_batch(source, step, t.global_batch, t.seq_len)
        report["losses"].append(train_step(model, optimizer, scheduler, x, y, cfg.optim.max_norm,
                                           dims.data.get_group()).loss)
        report["ref_losses"].append(train_step(reference, ref_optimizer, ref_scheduler, rx, ry,
                                               cfg.optim.max_norm).loss)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
