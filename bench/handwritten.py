"""A minimal FSDP2 (+TP, or + expert parallel) training script written from public torch
APIs only, as the FSDP2 and tensor-parallel tutorials show it: the baseline that
bench/overhead.py times the engine against. It shares the model classes and the batches
with the engine (so both do the same arithmetic on the same data), nothing else.

Expert parallel, for the mixture of experts (models/moe.py) with ep = dp: each rank keeps
its n_experts / ep experts as plain tensors outside FSDP, and each MoE sends its tokens to
the ranks holding their experts and back with the functional collectives' differentiable
all_to_all_single (uneven splits; what torchtitan's MoE uses), the same dispatch as the
engine's parallel/expert.py.

usage: torchrun --nproc_per_node 4 bench/handwritten.py [DP TP STEPS [EP]]
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed._functional_collectives import all_to_all_single_autograd  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from engine.data.sources import CorpusSource, local_batch  # noqa: E402
from models import MODELS  # noqa: E402
from models.moe import Experts  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def tp_plan(n_layers: int) -> dict:
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate())}
    for i in range(n_layers):
        plan.update({f"layers.{i}.attention.wq": ColwiseParallel(), f"layers.{i}.attention.wk": ColwiseParallel(),
                     f"layers.{i}.attention.wv": ColwiseParallel(), f"layers.{i}.attention.wo": RowwiseParallel(),
                     f"layers.{i}.feed_forward.w1": ColwiseParallel(),
                     f"layers.{i}.feed_forward.w3": ColwiseParallel(),
                     f"layers.{i}.feed_forward.w2": RowwiseParallel()})
    return plan


def expert_parallel_forward(experts: Experts, group, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x: this rank's tokens sorted by expert, counts[e] for expert e (of all of them)."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    counts_here = torch.empty_like(counts)  # [source rank, expert of mine]
    dist.all_to_all_single(counts_here, counts, group=group)
    counts_here = counts_here.view(ep, local)
    sent, received = counts.view(ep, local).sum(1).tolist(), counts_here.sum(1).tolist()
    rows = all_to_all_single_autograd(x, received, sent, group)
    by_expert = torch.repeat_interleave(torch.arange(local).repeat(ep), counts_here.flatten()).argsort(stable=True)
    out = experts.compute(rows[by_expert], counts_here.sum(0), experts.w13, experts.w2)
    back = torch.empty_like(out).index_copy_(0, by_expert, out)
    return all_to_all_single_autograd(back, sent, received, group)


def split_experts(model: nn.Module, ep: int, group) -> list[nn.Parameter]:
    """Keep this rank's share of each Experts module's experts (on meta: shapes only) and
    route its forward through expert_parallel_forward. Returns the kept parameters."""
    kept = []
    for experts in model.modules():
        if isinstance(experts, Experts):
            for name, param in list(experts.named_parameters(recurse=False)):
                mine = nn.Parameter(torch.empty(param.shape[0] // ep, *param.shape[1:], device=param.device))
                experts.register_parameter(name, mine)
                kept.append(mine)
            experts.forward = lambda x, counts, experts=experts: expert_parallel_forward(experts, group, x, counts)
    return kept


class Handwritten:
    def __init__(self, dp: int, tp: int, flavor: str = "debug", seed: int = 0, lr: float = 3e-3,
                 ep: int = 1, model_name: str = "llama"):
        assert ep == 1 or (ep == dp and tp == 1), "expert parallel here: ep = dp, no tp"
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank, self.dp = mesh["dp"].get_local_rank(), dp
        model_class, flavors = MODELS[model_name]
        args = flavors[flavor]
        with torch.device("meta"):
            model = model_class(args)
        if tp > 1:
            parallelize_module(model, mesh["tp"], tp_plan(args.n_layers))
        self.ep_group = mesh["dp"].get_group()
        experts = set(split_experts(model, ep, self.ep_group) if ep > 1 else [])
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"], ignored_params=experts)
        fully_shard(model, mesh=mesh["dp"], ignored_params=experts)
        model.to_empty(device="cpu")  # new parameter objects: find the experts' again
        self.experts = [p for p in model.parameters() if not isinstance(p, DTensor)]
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                torch.nn.init.normal_(param.to_local() if isinstance(param, DTensor) else param, std=0.02)
            model.reset_buffers()
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.source = CorpusSource(REPO / "data" / "corpus.txt", seed)

    def clip(self, max_norm: float) -> torch.Tensor:
        # clip_grad_norm_ rejects parameters on different meshes (pytorch#180346; TP leaves
        # the norm weights on the dp mesh), so take each mesh's norm, then combine.
        # This rank's experts are plain tensors: their norm is summed over the ep ranks.
        by_mesh = defaultdict(list)
        for param in self.model.parameters():
            by_mesh[getattr(param.grad, "device_mesh", None)].append(param)
        norms = []
        for mesh, params in by_mesh.items():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if mesh is None:
                squared = norm.square()
                dist.all_reduce(squared, group=self.ep_group)
                norm = squared.sqrt()
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def step(self, step: int, global_batch: int = 16, seq_len: int = 64) -> float:
        inputs, targets = local_batch(self.source, step, global_batch, seq_len, self.dp_rank, self.dp)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        for param in self.experts:  # each expert's gradient summed the tokens of every data rank
            param.grad.div_(self.dp)
        self.clip(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def main() -> None:
    dist.init_process_group("gloo")
    dp, tp, steps = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (dist.get_world_size(), 1, 5)
    ep = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    script = Handwritten(dp, tp, ep=ep, **({"flavor": "debug-moe", "model_name": "llama_moe"} if ep > 1 else {}))
    for step in range(steps):
        loss = script.step(step)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
