"""Run under torchrun by tests/test_initial_values.py: for each layout, the model is built
on meta, parallelized and materialised as a real run does it (launch/build.py), and
every full parameter is compared bitwise with the one-process model of the same seed.
Rank 0 writes {layout: [names of parameters that differ]} to OUT.json.

usage: torchrun --nproc_per_node 4 tests/init_worker.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import examples.gpt2_plan  # noqa: E402,F401  (registers the gpt2 plan)
import parallel  # noqa: E402,F401
from common.config import load_config  # noqa: E402
from launch.build import sharded_model, single_device_model  # noqa: E402
from models import llama, register_model  # noqa: E402
from models.initial_values import Constant  # noqa: E402
from parallel.mesh import build_mesh, parse_mesh  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402

# Shapes that do not divide by 4, 2 or 3: FSDP pads, and TP splits the vocabulary unevenly.
UNEVEN = dataclasses.replace(llama.FLAVORS["debug"], vocab_size=250, ffn_hidden=776, n_layers=2)


class WholeDrawLlama(llama.Llama):
    """The debug Llama initialised through init_value instead: whole draws, then slices."""
    init_distribution = None

    def init_value(self, fqn, shape, generator):
        distribution = llama.Llama.init_distribution(self, fqn)
        if isinstance(distribution, Constant):
            return torch.full(shape, distribution.value)
        return torch.randn(shape, generator=generator) * distribution.std


register_model("llama_uneven", llama.Llama, {"debug": UNEVEN})
register_model("llama_whole", WholeDrawLlama, {"debug": llama.FLAVORS["debug"]})

LAYOUTS = [  # (mesh, overrides)
    ("dp=4", []),
    ("dp=2,tp=2", ["parallel.sequence_parallel=true"]),
    ("hsdp=2,dp=2", ["parallel.reshard_after_forward=false"]),
    ("tp=4", []),
    ("dp=2,tp=2", ["model.flavor=debug_tied"]),
    ("dp=4", ["model.name=llama_uneven"]),
    ("dp=2,tp=2", ["model.name=llama_uneven"]),
    ("dp=2,tp=2", ["model.name=gpt2"]),
    ("dp=2,tp=2", ["model.name=llama_whole"]),
    ("dp=4", ["parallel.reshard_after_forward=2", "parallel.param_dtype=bfloat16"]),
]


def differing(cfg, mesh: str) -> list[str]:
    dims = build_mesh(parse_mesh(mesh).resolve(dist.get_world_size()), "cpu")
    model, _ = sharded_model(cfg, dims, torch.device("cpu"))
    whole = dict(single_device_model(cfg, torch.device("cpu")).named_parameters())
    names = []
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if full.dtype != whole[name].dtype or not torch.equal(full, whole[name]):
            names.append(name)
    return names


def main() -> None:
    dist.init_process_group("gloo")
    report = {}
    for mesh, overrides in LAYOUTS:
        plan = "gpt2" if "model.name=gpt2" in overrides else "llama"
        cfg = load_config(REPO / "configs" / "debug.yaml", [f"parallel.plan={plan}", *overrides])
        report[" ".join([mesh, *overrides])] = differing(cfg, mesh)
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
