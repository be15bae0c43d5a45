"""Step time, tokens/s and MFU from a device profile and one rank's observed step.

This part is analytic: the simulated step gives exact FLOP-bearing shapes and exact
collective bytes, and this turns them into seconds under stated assumptions:

- compute: the model's FLOPs per token (engine.metrics.throughput), times 4/3 for the
  forward that full or per-block activation checkpointing repeats (op-level AC keeps
  the matmuls' results and recomputes elementwise ops, counted as free), over this rank's
  share of tokens (its data rank's tokens, split over cp and tp: the sequence split
  gives every cp rank the same attention work), at `compute_efficiency` of the peak;
- a collective moves its bytes at ring cost, (n-1)/n of them for an all-gather or a
  reduce-scatter and twice that for an all-reduce, at the intra-node bandwidth when
  its group fits in one node and at the inter-node bandwidth otherwise;
- FSDP's collectives (dp, dp x cp, hsdp and integer-reshard groups) overlap with
  compute, so only what exceeds the compute time shows; tensor-parallel, context-parallel
  (the attention's key/value all-gathers wait for their result) and optimizer-phase
  collectives sit on the critical path and add in full.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UserError

# Published dense bf16 peak (no sparsity) and per-GPU bandwidths: NVLink per direction
# inside a node, the GPU's own InfiniBand NIC between nodes.
PROFILES = {
    "H100": {"peak_tflops": 989.0, "intra_node_gbps": 450.0, "inter_node_gbps": 50.0},
    "H200": {"peak_tflops": 989.0, "intra_node_gbps": 450.0, "inter_node_gbps": 50.0},
    "A100": {"peak_tflops": 312.0, "intra_node_gbps": 300.0, "inter_node_gbps": 25.0},
}
OVERLAPPED = ("dp", "dp_cp", "hsdp")


@dataclass(frozen=True)
class Profile:
    name: str
    peak_flops: float
    intra_node_bytes_s: float
    inter_node_bytes_s: float
    gpus_per_node: int
    compute_efficiency: float


def device_profile(dry) -> Profile:
    base = PROFILES.get(dry.device, {})
    values = {}
    for key in ("peak_tflops", "intra_node_gbps", "inter_node_gbps"):
        values[key] = getattr(dry, key) or base.get(key, 0.0)
        if values[key] <= 0:
            raise UserError(f"dryrun.device={dry.device} needs dryrun.{key}: give it with --set dryrun.{key}=N, "
                            f"or pick a known device ({', '.join(PROFILES)}).")
    if dry.gpus_per_node < 1 or not 0 < dry.compute_efficiency <= 1:
        raise UserError(f"dryrun.gpus_per_node must be at least 1 and dryrun.compute_efficiency in (0, 1]; "
                        f"got {dry.gpus_per_node} and {dry.compute_efficiency}.")
    return Profile(dry.device, values["peak_tflops"] * 1e12, values["intra_node_gbps"] * 1e9,
                   values["inter_node_gbps"] * 1e9, dry.gpus_per_node, dry.compute_efficiency)


def group_span(dim: str, spec) -> tuple[int, int]:
    """(ranks in the group, consecutive ranks its members spread over) for a mesh dimension.
    The mesh is hsdp x dp x cp x tp with tp innermost, so a group's members are `stride` apart."""
    cp_tp = spec.cp * spec.tp
    if dim == "tp":
        return spec.tp, spec.tp
    if dim == "cp":
        return spec.cp, cp_tp
    if dim == "dp":
        return spec.dp, spec.dp * cp_tp
    if dim == "dp_cp":  # FSDP's shard group with cp
        return spec.shard_size, spec.shard_size * spec.tp
    if dim == "hsdp":
        return spec.hsdp, spec.world_size
    if dim == "data":
        return spec.hsdp * spec.shard_size, spec.world_size
    if dim.startswith("group of "):  # an integer-reshard group: k consecutive ranks of FSDP's shard group
        size = int(dim.split()[-1])
        return size, size * spec.tp
    return 1, 1


def collective_seconds(kind: str, nbytes: int, ranks: int, bandwidth: float) -> float:
    if ranks <= 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * nbytes * (ranks - 1) / ranks / bandwidth


@dataclass
class StepEstimate:
    compute_s: float
    comm_s: dict[str, float]
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> dict:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


def estimate_step(comm: dict, flops_per_token: float, cfg, spec, profile: Profile) -> StepEstimate:
    t = cfg.training
    global_tokens = t.global_batch * t.seq_len
    recompute = 4 / 3 if cfg.parallel.activation_checkpoint in ("full", "selective") else 1.0
    rank_flops = global_tokens / (spec.hsdp * spec.dp * spec.cp) * flops_per_token / spec.tp
    compute = rank_flops * recompute / (profile.peak_flops * profile.compute_efficiency)
    comm_s: dict[str, float] = {}
    hidden, exposed = 0.0, 0.0
    for dim, phases in comm.items():
        ranks, span = group_span(dim, spec)
        bandwidth = profile.intra_node_bytes_s if span <= profile.gpus_per_node else profile.inter_node_bytes_s
        for phase, kinds in phases.items():
            seconds = sum(collective_seconds(kind, v["bytes"], ranks, bandwidth) for kind, v in kinds.items())
            comm_s[dim] = comm_s.get(dim, 0.0) + seconds
            if phase != "optimizer" and (dim in OVERLAPPED or dim.startswith("group of ")):
                hidden += seconds
            else:
                exposed += seconds
    exposed += max(0.0, hidden - compute)
    step = compute + exposed
    world = spec.world_size
    return StepEstimate(compute_s=compute, comm_s=comm_s, exposed_comm_s=exposed, step_s=step,
                        tokens_per_s=global_tokens / step,
                        mfu=global_tokens * flops_per_token / step / (world * profile.peak_flops))
