"""The steps every launch mode shares: device, process group and mesh, then the
sharded model (meta, plan, materialise) and, for parity, the single-device model."""

from __future__ import annotations

import os

from common.errors import UserError


def pick_device(cfg) -> tuple[str, str]:
    """(device type, backend) from the config and what this machine has."""
    import torch
    device = cfg.parallel.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("parallel.device=cuda but no CUDA device is visible. Use --set parallel.device=cpu.")
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


def cuda_index(local_rank: int) -> int:
    """This rank's GPU: one per local rank (launch/run.py checks the count before it starts
    ranks; this catches a user's own torchrun)."""
    import torch
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(f"local rank {local_rank} has no GPU of its own: this node shows {count} CUDA device(s), "
                        f"and the engine runs one rank per GPU. Start at most {count} ranks per node "
                        f"(--nproc_per_node {count}).")
    return local_rank


def start_process_group(cfg, spec):
    """The process group and mesh for this rank; returns (ParallelDims, torch.device)."""
    import torch

    from parallel.mesh import build_mesh
    from parallel.process_group import init_process_group

    device_type, backend = pick_device(cfg)
    if device_type == "cuda":
        torch.cuda.set_device(cuda_index(int(os.environ.get("LOCAL_RANK", "0"))))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    init_process_group(backend)
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return build_mesh(spec, device_type), device
    # This job is one of hsdp's replica groups: its own mesh has no hsdp, and torchft
    # joins the groups (parallel/replicas.py).
    from dataclasses import replace

    from parallel.replicas import Replicas
    dims = build_mesh(replace(spec, hsdp=1), device_type)
    dims.replica_group, dims.replica_groups = ft.group, spec.hsdp
    dims.replicas = Replicas(ft, spec.hsdp, backend, cfg.run.dir)
    return dims, device


def sharded_model(cfg, dims, device, n_layers: int = 0, prefetch=None, import_weights: bool = True):
    """The model built on meta, parallelized by its plan, then given its initial values
    from the seed, or with checkpoint.hf_import from that checkpoint (unless
    `import_weights` is false: a resumed run loads its own). Returns (model, AppliedPlan)."""
    from engine import routing
    from models import build_on_meta
    from models.materialise import materialise
    from parallel.apply import apply_plan
    from parallel.pipeline import parts_of, sync_tied_weights
    from parallel.plan import plan_of

    applied = apply_plan(build_on_meta(cfg.model.name, cfg.model.flavor, n_layers), plan_of(cfg),
                         dims, cfg.parallel, prefetch)
    model = applied.model
    for part in parts_of(model):  # each pipeline stage's part is a model of its own
        materialise(part, device, cfg.training.seed, parameter_device="cpu" if cfg.parallel.offload else None)
    if cfg.checkpoint.hf_import and import_weights:
        from engine.checkpoint.hf import load_hf
        load_hf(model, cfg.checkpoint.hf_import)  # a collective: each rank reads its own slices
    sync_tied_weights(model)
    routing.configure(model, cfg.moe, (dims.cp.get_group(), dims.spec.cp) if dims.spec.cp > 1 else None)
    return model, applied


def single_device_model(cfg, device, n_layers: int = 0, dtype=None):
    """The same model, whole, on one device, with the same initial values (or imported weights)."""
    from engine import routing
    from models import build_on_meta
    from models.materialise import materialise

    model = build_on_meta(cfg.model.name, cfg.model.flavor, n_layers)
    materialise(model, device, cfg.training.seed)
    if cfg.checkpoint.hf_import:
        from engine.checkpoint.hf import load_hf
        load_hf(model, cfg.checkpoint.hf_import)  # a plain model: no collective
    routing.configure(model, cfg.moe)
    return model if dtype is None else model.to(dtype)
