"""A minimal FSDP2 (+TP) training script written from public torch APIs only, as the
FSDP2 and tensor-parallel tutorials show it: the baseline that bench/overhead.py times
the engine against. It shares the model class and the batches with the engine (so both
do the same arithmetic on the same data), nothing else.

usage: torchrun --nproc_per_node 4 bench/handwritten.py [DP TP STEPS]
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from engine.data.sources import CorpusSource, local_batch  # noqa: E402
from models.llama import FLAVORS, Llama  # noqa: E402
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


class Handwritten:
    def __init__(self, dp: int, tp: int, flavor: str = "debug", seed: int = 0, lr: float = 3e-3):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank, self.dp = mesh["dp"].get_local_rank(), dp
        args = FLAVORS[flavor]
        with torch.device("meta"):
            model = Llama(args)
        if tp > 1:
            parallelize_module(model, mesh["tp"], tp_plan(args.n_layers))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                torch.nn.init.normal_(param.to_local(), std=0.02)
            model.reset_buffers()
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.source = CorpusSource(REPO / "data" / "corpus.txt", seed)

    def clip(self, max_norm: float) -> torch.Tensor:
        # clip_grad_norm_ rejects parameters on different meshes (pytorch#180346; TP leaves
        # the norm weights on the dp mesh), so take each mesh's norm, then combine.
        by_mesh = defaultdict(list)
        for param in self.model.parameters():
            by_mesh[param.grad.device_mesh].append(param)
        norms = []
        for params in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
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
        self.clip(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def main() -> None:
    dist.init_process_group("gloo")
    dp, tp, steps = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (dist.get_world_size(), 1, 5)
    script = Handwritten(dp, tp)
    for step in range(steps):
        loss = script.step(step)
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
