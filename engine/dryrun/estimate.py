"""Step time, tokens/s and MFU from a device profile and one rank's observed step.

This part is analytic: the simulated step gives exact FLOP-bearing shapes and exact
collective bytes, and this turns them into seconds under stated assumptions:

- compute: the model's FLOPs per token (engine.metrics.throughput), plus the forward
  (a third of a block's training FLOPs) of each block that full or selective activation
  checkpointing runs again in backward: with `full` every block on the rank, with
  `selective` every checkpoint_every-th of each stage (recomputed_flops_per_token; the
  embedding and the output are outside any block and not repeated; op-level AC keeps
  the matmuls' results and recomputes elementwise ops, counted as free), over this rank's
  share of tokens (its data rank's tokens, split over cp and tp: the sequence split
  gives every cp rank the same attention work), at `compute_efficiency` of the peak;
  with parallel.float8, the FLOPs of the blocks' linears (6 per weight) run the profile's
  measured float8 speedup faster (FLOAT8_SPEEDUP: the float8 matmuls less their casts);
- a collective moves its bytes at ring cost, (n-1)/n of them for an all-gather, a
  reduce-scatter or an all-to-all (the rows a rank keeps do not travel) and twice that
  for an all-reduce, at the intra-node bandwidth when
  its group fits in one node and at the inter-node bandwidth otherwise;
- FSDP's collectives (dp, dp x cp, hsdp, the experts' edp and integer-reshard groups)
  overlap with compute, so only what exceeds the compute time shows; tensor-parallel,
  context-parallel (the attention's key/value all-gathers wait for their result), expert
  parallel (each mixture's dispatch and combine: the experts wait for their rows, the
  next layer for their outputs), optimizer-phase and the
  pipeline group's collectives (a tied weight's gradient summed over its first and last
  stage after the backward; the loss's scalars) sit on the critical path and add in full.

Under pipeline parallel a rank computes only its stages (their FLOPs per token: 6 per
weight they multiply by, and their blocks' share of the attention term), and the step
adds two things:
- the schedule's bubble, as a fraction of the rank's compute with p pipeline ranks, v
  stages per rank and m micro-batches, every stage equally long and a backward twice a
  forward: GPipe and 1F1B (p-1)/m; Interleaved1F1B (p-1)/(v m); the zero-bubble
  schedules (p-1)/(3 v m), their weight-gradient passes filling two thirds of the
  interleaved bubble when the forward, input-gradient and weight-gradient passes take
  equal time (the zero-bubble paper's ZB-H1; ZB-V can do better, which this does not
  claim);
- point-to-point messages between stages at link bandwidth, each direction on its own
  (a rank's sends and receives overlap); they overlap with compute, except one
  micro-batch's message across each stage boundary on the way in (forward) and on the
  way out (backward), which the fill and drain of the pipeline wait for.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import UserError

# Published dense bf16 peak (no sparsity) and per-GPU bandwidths: NVLink per direction
# inside a node, the GPU's own InfiniBand NIC between nodes.
PROFILES = {
    "H100": {"peak_tflops": 989.0, "intra_node_gbps": 450.0, "inter_node_gbps": 50.0},
    "H200": {"peak_tflops": 989.0, "intra_node_gbps": 450.0, "inter_node_gbps": 50.0},
    "A100": {"peak_tflops": 312.0, "intra_node_gbps": 300.0, "inter_node_gbps": 25.0},
}
OVERLAPPED = ("dp", "dp_cp", "hsdp", "edp", "edp_cp")
# How much faster the blocks' linears run with parallel.float8 than in bf16, by recipe: the
# whole step's change on one NVIDIA H200 (torch 2.11, torchao 0.18, compiled; bench/
# gpu_throughput.py at 8B:4:8192:1, docs/benchmarks.md "Float8 on one GPU"), divided out over
# the linears' 52.4% of the step's FLOPs. Its float8 matmul alone ran 1.82 (tensorwise) and
# 1.75 (rowwise) times its bf16 one at 8192^3; the casts and scales take the rest. Taken
# for the H100 too (the same Hopper chip, less memory bandwidth: not measured there);
# the A100 has no float8 matmuls.
FLOAT8_SPEEDUP = {"H100": {"tensorwise": 1.22, "rowwise": 1.06}, "H200": {"tensorwise": 1.22, "rowwise": 1.06}}


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


def float8_speedup(device: str, recipe: str) -> float:
    """The linears' float8 speedup on the dry run's device (FLOAT8_SPEEDUP); 1 without float8."""
    if recipe == "none":
        return 1.0
    if recipe not in FLOAT8_SPEEDUP.get(device, {}):
        measured = ", ".join(FLOAT8_SPEEDUP)
        raise UserError(f"the dry run has no float8 speed for dryrun.device={device}: it is measured on "
                        f"{measured} only ({'the A100 has no float8 matmuls' if device == 'A100' else 'a custom device'}"
                        f"). Use --set dryrun.device=H100 (or H200), or parallel.float8=none.")
    return FLOAT8_SPEEDUP[device][recipe]


def expert_flops_per_token(model, block_paths: list[str]) -> float:
    """6 per weight a token multiplies by in the routed experts (a module with an
    `active_share`: models/moe.py) inside the blocks at `block_paths` of `model`."""
    from engine.metrics.throughput import matmul_weights
    return 6.0 * sum(matmul_weights(module) for path in block_paths
                     for module in model.get_submodule(path).modules() if hasattr(module, "active_share"))


def float8_flops_per_token(model, block_paths: list[str], recipe: str) -> float:
    """6 per weight of the linears inside the blocks at `block_paths` (of `model`, converted
    or not): the FLOPs per token that parallel.float8 computes in float8; 0 without it."""
    if recipe == "none":
        return 0.0
    from torch import nn
    return 6.0 * sum(module.weight.numel() for path in block_paths
                     for module in model.get_submodule(path).modules() if isinstance(module, nn.Linear))


def group_span(dim: str, spec) -> tuple[int, int]:
    """(ranks in the group, consecutive ranks its members spread over) for a mesh dimension.
    The mesh is pp x hsdp x dp x cp x tp with tp innermost, so a group's members are `stride` apart."""
    cp_tp = spec.cp * spec.tp
    if dim == "tp":
        return spec.tp, spec.tp
    if dim == "cp":
        return spec.cp, cp_tp
    if dim == "dp":
        return spec.dp, spec.dp * cp_tp
    if dim == "dp_cp":  # FSDP's shard group with cp
        return spec.shard_size, spec.shard_size * spec.tp
    # Expert parallel splits dp into (edp, ep), ep inside (parallel/mesh.py).
    if dim == "ep":
        return spec.ep, spec.ep * cp_tp
    if dim == "edp":
        return spec.dp // spec.ep, spec.dp * cp_tp
    if dim == "edp_cp":  # the experts' FSDP shard group with cp
        return spec.dp // spec.ep * spec.cp, spec.dp * cp_tp
    if dim == "hsdp":  # within one pipeline stage's ranks
        return spec.hsdp, spec.world_size // spec.pp
    if dim == "data":
        return spec.hsdp * spec.shard_size, spec.world_size // spec.pp
    if dim == "pp":  # outermost: neighbouring stages are a whole stage of ranks apart
        return spec.pp, spec.world_size
    if dim == "pp_tie":  # a tied weight's first and last pipeline ranks
        return 2, spec.world_size
    if dim.startswith("group of "):  # an integer-reshard group: k consecutive ranks of FSDP's shard group
        size = int(dim.split()[-1])
        return size, size * spec.tp
    return 1, 1


def group_link(dim: str, spec, profile: Profile) -> tuple[int, float]:
    """(ranks in a mesh dimension's group, the bandwidth its collectives move at): the
    intra-node link where the group's members lie within one node, the inter-node one
    otherwise."""
    ranks, span = group_span(dim, spec)
    if dim in ("pp", "pp_tie"):  # ranks a stage of ranks apart share a node only if a stage fits in less than one
        in_node = spec.world_size // spec.pp < profile.gpus_per_node
    else:
        in_node = span <= profile.gpus_per_node
    return ranks, profile.intra_node_bytes_s if in_node else profile.inter_node_bytes_s


def step_place(dim: str, phase: str) -> str:
    """Where a dimension's collectives (other than point-to-point messages, which count
    through the pipeline's fill and drain: exposed_p2p_s) count in the step: "hidden" for
    FSDP's forward and backward ones, which overlap compute (only what exceeds it shows);
    "exposed" for the rest, which the step waits for: tp and cp, the optimizer phase's,
    and the pipeline group's (the loss's and the gradient norm's scalars, and a tied
    weight's gradient, summed over its first and last stage after the backward)."""
    if phase != "optimizer" and (dim in OVERLAPPED or dim.startswith("group of ")):
        return "hidden"
    return "exposed"


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
    bubble_s: float = 0.0  # pipeline parallel: the schedule's idle time
    bubble_fraction: float = 0.0  # of the rank's compute
    exposed_p2p_s: float = 0.0  # point to point between stages that the step waits for
    overlapped_s: float = 0.0  # FSDP's collectives and point to point: what exceeds compute_s is exposed

    def as_dict(self) -> dict:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "bubble_s": self.bubble_s, "bubble_fraction": self.bubble_fraction,
                "exposed_p2p_s": self.exposed_p2p_s, "overlapped_s": self.overlapped_s}


def bubble_fraction(schedule: str, pp: int, per_rank: int, micro_batches: int) -> float:
    """The schedule's idle time over a rank's compute time (this module's docstring)."""
    if pp == 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / micro_batches
    interleaved = (pp - 1) / (per_rank * micro_batches)
    return interleaved if schedule == "Interleaved1F1B" else interleaved / 3


def p2p_seconds(kinds: dict, bandwidth: float) -> tuple[float, float]:
    """(all of a rank's point-to-point time, that of its largest single message)."""
    sends, receives = kinds.get("send", {"count": 0, "bytes": 0}), kinds.get("recv", {"count": 0, "bytes": 0})
    largest = max(sends["bytes"] / max(1, sends["count"]), receives["bytes"] / max(1, receives["count"]))
    return message_seconds(max(sends["bytes"], receives["bytes"]), bandwidth), message_seconds(largest, bandwidth)


def message_seconds(nbytes: float, bandwidth: float) -> float:
    """Point to point: the bytes cross the link once, each direction on its own."""
    return nbytes / bandwidth


def estimate_step(comm: dict, flops_per_token: float, cfg, spec, profile: Profile,
                  stage_flops: float | None = None, float8_flops: float = 0.0,
                  expert_flops: float = 0.0, recomputed_flops: float = 0.0) -> StepEstimate:
    """`stage_flops`: under pipeline parallel, the FLOPs per token of the stages this rank holds;
    `float8_flops`: how many of this rank's FLOPs per token run in float8 (float8_flops_per_token);
    `expert_flops`: how many are routed experts' (expert_flops_per_token), which the busiest
    ep rank computes dryrun.expert_load times over; `recomputed_flops`: how many are in the
    blocks whose forward activation checkpointing runs again (recomputed_flops_per_token)."""
    t = cfg.training
    global_tokens = t.global_batch * t.seq_len
    own_flops = stage_flops or flops_per_token
    recompute = 1.0 + recomputed_flops / (3 * own_flops) if own_flops else 1.0
    imbalance = (cfg.dryrun.expert_load - 1) * expert_flops if spec.ep > 1 else 0.0
    bf16_equivalent = (own_flops - float8_flops + imbalance
                       + float8_flops / float8_speedup(profile.name, cfg.parallel.float8))
    rank_flops = global_tokens / (spec.hsdp * spec.dp * spec.cp) * bf16_equivalent / spec.tp
    compute = rank_flops * recompute / (profile.peak_flops * profile.compute_efficiency)
    comm_s: dict[str, float] = {}
    hidden, exposed, exposed_p2p = 0.0, 0.0, 0.0
    for dim, phases in comm.items():
        ranks, bandwidth = group_link(dim, spec, profile)
        for phase, kinds in phases.items():
            seconds = sum(collective_seconds(kind, v["bytes"], ranks, bandwidth) for kind, v in kinds.items()
                          if kind not in ("send", "recv"))
            p2p = 0.0
            if "send" in kinds or "recv" in kinds:
                p2p, message = p2p_seconds(kinds, bandwidth)
                exposed_p2p += message * (spec.pp * cfg.parallel.pp_stages_per_rank - 1)  # fill or drain
                hidden += p2p
            comm_s[dim] = comm_s.get(dim, 0.0) + seconds + p2p
            place = step_place(dim, phase)
            if place == "hidden":
                hidden += seconds
            elif place == "exposed":
                exposed += seconds
    exposed += max(0.0, hidden - compute)
    fraction = bubble_fraction(cfg.parallel.pp_schedule, spec.pp, cfg.parallel.pp_stages_per_rank, t.micro_batches)
    bubble = fraction * compute
    step = compute + exposed + bubble + exposed_p2p
    return StepEstimate(compute_s=compute, comm_s=comm_s, exposed_comm_s=exposed, step_s=step,
                        tokens_per_s=global_tokens / step,
                        mfu=global_tokens * flops_per_token / step / (spec.world_size * profile.peak_flops),
                        bubble_s=bubble, bubble_fraction=fraction, exposed_p2p_s=exposed_p2p, overlapped_s=hidden)


def recomputed_flops_per_token(whole, parts: list[list[str]], n_blocks: int, options, seq_len: int) -> float:
    """The training FLOPs per token of the blocks whose forward full or selective activation
    checkpointing runs again in backward: those parallel.apply.checkpointed_blocks picks in
    each of `parts` (the block paths of each stage a rank holds; all blocks without pp) of
    the whole model `whole` (of `n_blocks` blocks), 6 per weight they multiply by and their
    share of the attention term. 0 with `op` (its recomputed elementwise ops count as free)
    and without AC."""
    if options.activation_checkpoint not in ("full", "selective"):
        return 0.0
    from parallel.apply import checkpointed_blocks
    chosen = [path for part in parts for path in checkpointed_blocks(part, options)]
    return blocks_flops_per_token(whole, chosen, n_blocks, seq_len) if chosen else 0.0


def blocks_flops_per_token(whole, block_paths: list[str], n_blocks: int, seq_len: int,
                           other_paths: list[str] = ()) -> float:
    """The training FLOPs per token of the blocks at `block_paths` (and of the modules at
    `other_paths`, outside any block) of the whole model `whole` of `n_blocks` blocks: 6 per
    weight they multiply by, and the blocks' share of what the whole model's count adds
    beyond 6 per weight (the attention term)."""
    from engine.metrics.throughput import flops_per_token, matmul_weights
    weights = sum(matmul_weights(whole.get_submodule(path)) for path in [*block_paths, *other_paths])
    attention = flops_per_token(whole, seq_len) - 6 * matmul_weights(whole)
    return 6 * weights + attention * len(block_paths) / n_blocks


def stage_flops_per_token(whole, stages, split: list[list[str]], held: list[int], seq_len: int) -> float:
    """The training FLOPs per token of the pipeline stages `held` (a rank's), of the whole
    model `whole` (on meta) split into `split` (block paths per stage) by the plan's
    `stages` (blocks_flops_per_token, with the first and the last stage's modules outside
    the blocks)."""
    blocks = [path for stage in held for path in split[stage]]
    ends = (list(stages.first) if 0 in held else []) + (list(stages.last) if len(split) - 1 in held else [])
    return blocks_flops_per_token(whole, blocks, sum(map(len, split)), seq_len, ends)
