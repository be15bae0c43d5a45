"""Run under torchrun by the parity tests: the sharded model against a single-process
reference built from the same seed, on the same global batches. Rank 0 writes a JSON report.

usage: torchrun --nproc_per_node N tests/parity_worker.py MESH OUT.json STEPS FLAVOR [KEY=VALUE ...]
(the model and plan come from model.name / parallel.plan, default llama)

KEY=VALUE are config overrides (e.g. parallel.compile=true). With
parallel.param_dtype=bfloat16 the reference computes in bf16 too, from fp32 master
weights, as FSDP's mixed precision does.
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
from engine.config import load_config  # noqa: E402
from engine.data import CorpusSource, local_batch  # noqa: E402
from engine.plugins import load_plugins  # noqa: E402
from engine.grad_norm import clip_grad_norm, grad_norm  # noqa: E402
from engine.train import build_optimizer, forward_backward, train_step  # noqa: E402
from models import build_on_meta  # noqa: E402
from models.materialise import materialise  # noqa: E402
from parallel.apply import apply_plan  # noqa: E402
from parallel.mesh import build_mesh, parse_mesh  # noqa: E402
from parallel.plan import get_plan  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SEED = 1234


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (full(a).detach().float() - b.detach().float()).abs().max().item()


class Reference:
    """One process, whole batch; optionally bf16 compute over fp32 master weights."""

    def __init__(self, compute_dtype: torch.dtype, cfg):
        name, flavor = cfg.model.name, cfg.model.flavor
        self.model = build_on_meta(name, flavor)
        materialise(self.model, "cpu", SEED)
        self.compute = self.model
        if compute_dtype != torch.float32:
            self.compute = build_on_meta(name, flavor)
            materialise(self.compute, "cpu", SEED)
            self.compute.to(compute_dtype)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, cfg.training.steps)
        self.max_norm = cfg.optim.max_norm

    def forward_backward(self, inputs, targets) -> float:
        if self.compute is self.model:
            return forward_backward(self.model, inputs, targets).item()
        self.compute.load_state_dict(self.model.state_dict())
        loss = forward_backward(self.compute, inputs, targets)
        for master, low in zip(self.model.parameters(), self.compute.parameters()):
            master.grad = low.grad.float()
        self.compute.zero_grad(set_to_none=True)
        return loss.item()

    def step(self, inputs, targets) -> float:
        loss = self.forward_backward(inputs, targets)
        clip_grad_norm(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def record_placements_after_forward(model, first_block: str, report):
    """The placements of the first block's parameters once the root's forward is done,
    i.e. after the block's post-forward reshard (what integer resharding changes)."""
    def hook(module, inputs, output):
        block = model.get_submodule(first_block)
        report.setdefault("after_forward", {
            name: [str(p.device_mesh.shape), [str(x) for x in p.placements], list(p.to_local().shape)]
            for name, p in block.named_parameters() if isinstance(p, DTensor)})
    return model.register_forward_hook(hook)


def main() -> None:
    mesh_text, out_path, steps, flavor, *overrides = sys.argv[1:]
    steps = int(steps)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = load_config(None, [f"training.steps={steps}", f"model.flavor={flavor}", *overrides])
    spec = parse_mesh(mesh_text).resolve(dist.get_world_size())
    dims = build_mesh(spec, "cpu")

    load_plugins(cfg.model.plugin)
    model = build_on_meta(cfg.model.name, flavor)
    applied = apply_plan(model, get_plan(cfg.parallel.plan), dims, cfg.parallel)
    materialise(model, "cpu", SEED)
    compute_dtype = getattr(torch, cfg.parallel.param_dtype)
    reference = Reference(compute_dtype, cfg)

    report = {"mesh": str(spec), "flavor": flavor, "overrides": overrides}
    ref_params = dict(reference.model.named_parameters())
    report["init_max_diff"] = max(max_diff(p, ref_params[n]) for n, p in model.named_parameters())

    source = CorpusSource(REPO / "data" / "corpus.txt", SEED)
    t = cfg.training
    group = dims.data.get_group()

    def batch(step, whole=False):
        if whole:
            return local_batch(source, step, t.global_batch, t.seq_len)
        return local_batch(source, step, t.global_batch, t.seq_len, dims.data_rank, dims.data_size)

    hook = record_placements_after_forward(model, applied.blocks[0], report)
    report["loss0_ref"] = reference.forward_backward(*batch(0, whole=True))
    loss = forward_backward(model, *batch(0)).detach()
    hook.remove()
    dist.all_reduce(loss, group=group)
    report["loss0"] = loss.item() / dims.data_size
    report["loss0_diff"] = abs(report["loss0"] - report["loss0_ref"])
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    grad_diffs = {n: max_diff(g, ref_params[n].grad) for n, g in grads.items()}
    report["grad_max_diff"] = max(grad_diffs.values())
    report["worst_grad"] = max(grad_diffs, key=grad_diffs.get)
    report["grad_max_abs"] = max(g.abs().max().item() for g in grads.values())
    for norm_type in (2.0, float("inf")):
        ours = grad_norm(model.parameters(), norm_type).item()
        theirs = torch.nn.utils.get_total_norm([p.grad for p in reference.model.parameters()], norm_type).item()
        report[f"grad_norm_{norm_type}"] = [ours, theirs]
    model.zero_grad(set_to_none=True)
    reference.optimizer.zero_grad(set_to_none=True)

    optimizer, scheduler = build_optimizer(model, cfg.optim, steps)
    report["losses"], report["ref_losses"] = [], []
    for step in range(steps):
        report["losses"].append(train_step(model, optimizer, scheduler, *batch(step),
                                           cfg.optim.max_norm, group).loss)
        report["ref_losses"].append(reference.step(*batch(step, whole=True)))
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
        torch.save(grads, out_path + ".grads.pt")  # for bitwise comparisons between runs
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
