"""--plan-for: the layouts the engine supports for one model and world, each simulated,
those that do not fit dropped with the reason, the rest ranked by predicted tokens/s.

Each layout is simulated for rank 0 (which holds the largest shard when a dimension
does not divide: FSDP pads the others up to it) at two depths one period of the block
pattern apart (3 and 4 blocks; 3 or 4 and 2 more with selective AC every 2nd block)
and extrapolated to its full depth: the blocks are identical, so state bytes and
collectives grow by the same amount with each period, and so does each phase's peak
once the model is a few blocks deep (tests/test_dryrun.py checks the extrapolation
against a simulation at full depth).

What is searched, and why not more:
- mesh: tp in 1, 2, 4, 8 (within a node, dividing the world, and over which the plan
  splits every module evenly); for long sequences cp in 2, 4, 8, ... as long as each
  cp rank keeps at least CP_MIN_TOKENS tokens of a sequence (shorter slices add the
  key/value all-gathers and save little) and the plan names its attention cores; FSDP
  over all the other ranks (dp) or within a node and replicated across nodes
  (hsdp x dp); with tp > 1, loss parallelism on, and sequence parallelism on when the
  plan has a sequence-parallel variant;
- reshard_after_forward: false, true, and the node-local group size when dp spans
  more than one node;
- activation checkpointing none, op, selective, full, then micro-batches 1, 2, 4, 8:
  for each mesh and reshard setting the search stops at the first that fits, since
  the later ones recompute or re-gather more and are never faster in the step model;
- dtype: bfloat16 compute with fp32 gradient reduction. fp32 compute runs at a
  fraction of the bf16 peak that the step model does not describe, so it is not
  offered.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import with_overrides
from engine.dryrun.estimate import StepEstimate, device_profile, estimate_step
from engine.dryrun.observe import Observation
from engine.errors import UserError
from parallel.mesh import MeshSpec

GIB = 1024 ** 3
AC_MODES = ("none", "op", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
HEADROOM = 0.10  # of GPU memory, for what is not a tensor: allocator, NCCL, CUDA context
CP_MIN_TOKENS = 8192  # the shortest slice of a sequence a cp rank is given in the search


@dataclass
class Layout:
    spec: MeshSpec
    reshard: str
    activation_checkpoint: str
    micro_batches: int
    sequence_parallel: bool = True  # with tp > 1: off for a plan without a sequence-parallel variant

    def overrides(self) -> list[str]:
        tp = self.spec.tp > 1
        sp = tp and self.sequence_parallel
        return [f"parallel.reshard_after_forward={self.reshard}",
                f"parallel.activation_checkpoint={self.activation_checkpoint}",
                f"training.micro_batches={self.micro_batches}", f"parallel.sequence_parallel={str(sp).lower()}",
                f"parallel.loss_parallel={str(tp).lower()}", "parallel.param_dtype=bfloat16",
                "parallel.reduce_dtype=float32"]

    def command_line(self) -> str:
        return f"--mesh {self.spec} " + " ".join(f"--set {o}" for o in self.overrides())


@dataclass
class Outcome:
    layout: Layout
    peak_bytes: int
    estimate: StepEstimate | None  # None when it does not fit
    reason: str = ""


def offers_sequence_parallel(cfg) -> bool:
    from parallel.plan import get_plan
    return bool(get_plan(cfg.parallel.plan).sequence_parallel)


def plan_takes_tp(cfg, tp: int) -> bool:
    """Whether the model's plan splits evenly over `tp` ranks, with loss parallel and, when
    the plan has it, sequence parallel."""
    from models import build_on_meta
    from parallel.apply import tensor_parallel_styles
    from parallel.plan import get_plan
    from parallel.validate import validate_plan
    if tp == 1:
        return True
    sp = offers_sequence_parallel(cfg)
    cfg = with_overrides(cfg, [f"parallel.sequence_parallel={str(sp).lower()}", "parallel.loss_parallel=true"])
    model, plan = build_on_meta(cfg.model.name, cfg.model.flavor, 1), get_plan(cfg.parallel.plan)
    try:
        validate_plan(model, plan, tensor_parallel_styles(model, plan, cfg.parallel), tp, sp)
    except UserError:
        return False
    return not sp or cfg.training.seq_len % tp == 0  # sequence parallel splits the sequence


def context_degrees(cfg, ranks: int) -> list[int]:
    """1, and the cp degrees searched over `ranks` for this sequence length."""
    from parallel.plan import get_plan
    degrees, seq_len = [1], cfg.training.seq_len
    if get_plan(cfg.parallel.plan).attention is None:
        return degrees
    cp = 2
    while ranks % cp == 0 and seq_len % (2 * cp) == 0 and seq_len // cp >= CP_MIN_TOKENS:
        degrees.append(cp)
        cp *= 2
    return degrees


def meshes(cfg, world: int) -> list[MeshSpec]:
    gpus_per_node = cfg.dryrun.gpus_per_node
    found = []
    for tp in (1, 2, 4, 8):
        if tp > gpus_per_node or world % tp or not plan_takes_tp(cfg, tp):
            continue
        for cp in context_degrees(cfg, world // tp):
            rest = world // (tp * cp)
            found.append(MeshSpec(dp=rest, tp=tp, cp=cp))
            # HSDP: FSDP's shard group (dp x cp) within a node, replicated across nodes.
            in_node = gpus_per_node // tp
            dp_in_node = in_node // cp
            if in_node % cp == 0 and (dp_in_node > 1 or cp > 1) and dp_in_node < rest and rest % dp_in_node == 0:
                found.append(MeshSpec(hsdp=rest // dp_in_node, dp=dp_in_node, tp=tp, cp=cp))
    return found


def search_mesh(cfg, world: int) -> MeshSpec:
    """The searched mesh with the fewest data ranks, for the launcher's up-front checks."""
    return min(meshes(cfg, world), key=lambda spec: spec.hsdp * spec.dp)


def reshard_options(spec: MeshSpec, gpus_per_node: int) -> list[str]:
    options = ["false", "true"]
    in_node = gpus_per_node // spec.tp
    if 1 < in_node < spec.shard_size and spec.shard_size % in_node == 0:
        options.insert(1, str(in_node))
    return options


def extrapolate(one: Observation, two: Observation, first: int, period: int, depth: int) -> Observation:
    """The observation at `depth` blocks from those at `first` and `first + period`."""
    def grow(a, b):
        return a + round((depth - first) * (b - a) / period)

    def grow_comm(a: dict, b: dict) -> dict:
        out = {}
        for dim in b:
            for phase in b[dim]:
                for kind, value in b[dim][phase].items():
                    shallow = a.get(dim, {}).get(phase, {}).get(kind, {"count": 0, "bytes": 0})
                    out.setdefault(dim, {}).setdefault(phase, {})[kind] = {
                        key: grow(shallow[key], value[key]) for key in ("count", "bytes")}
        return out

    # Each phase's peak grows with depth at its own rate (the forward's with the saved
    # activations, the optimizer's with the state), so the step's peak is the largest of
    # the extrapolated phase peaks; `at_peak` keeps the shallow runs' split, grown alike.
    phase_peaks = {phase: grow(one.phase_peaks.get(phase, 0), two.phase_peaks[phase]) for phase in two.phase_peaks}
    return Observation(param_bytes=grow(one.param_bytes, two.param_bytes),
                       grad_bytes=grow(one.grad_bytes, two.grad_bytes),
                       optimizer_bytes=grow(one.optimizer_bytes, two.optimizer_bytes),
                       peak_bytes=max(phase_peaks.values()),
                       at_peak={k: grow(one.at_peak[k], two.at_peak[k]) for k in two.at_peak},
                       comm=grow_comm(one.comm, two.comm), phase_peaks=phase_peaks)


def layout_config(cfg, layout: Layout):
    return with_overrides(cfg, [f"parallel.mesh={layout.spec}", *layout.overrides()])


def observe(cfg, layout: Layout, world: int, depth: int) -> Observation:
    """Rank 0's step at `depth` blocks, from simulations of one and two periods of the
    block pattern (selective AC checkpoints every checkpoint_every-th block)."""
    from engine.dryrun.simulate import observe_rank_zero
    period = cfg.parallel.checkpoint_every if layout.activation_checkpoint == "selective" else 1
    # Below 3 blocks the backward's peak falls elsewhere (measured on 100M: growth per
    # block is constant from 3 blocks on), and `first` must fall on the pattern's phase.
    first = next(n for n in range(3, 3 + period) if (depth - n) % period == 0)
    if depth <= first + period:
        return observe_rank_zero(cfg, layout.spec, world, depth)
    one, two = (observe_rank_zero(cfg, layout.spec, world, n) for n in (first, first + period))
    return extrapolate(one, two, first, period, depth)


def runnable(cfg, layout: Layout) -> bool:
    t, spec = cfg.training, layout.spec
    data = spec.hsdp * spec.dp
    sequence_split = spec.tp if layout.sequence_parallel else 1  # of each cp rank's tokens
    return t.global_batch % (data * layout.micro_batches) == 0 and (t.seq_len // spec.cp) % sequence_split == 0


def plan_for(cfg, world: int, depth: int, fpt: float, report=print) -> list[Outcome]:
    """Every layout searched, best first: those that fit by tokens/s, then the others."""
    dry = cfg.dryrun
    profile = device_profile(dry)
    if dry.gpu_memory_gib <= 0:
        raise UserError(f"dryrun.gpu_memory_gib={dry.gpu_memory_gib}: give the GPU's memory in GiB, e.g. 80.")
    usable = dry.gpu_memory_gib * GIB * (1 - HEADROOM)
    outcomes = []
    sequence_parallel = offers_sequence_parallel(cfg)
    for spec in meshes(cfg, world):
        for reshard in reshard_options(spec, dry.gpus_per_node):
            found = False
            for ac in AC_MODES:
                for micro in MICRO_BATCHES:
                    layout = Layout(spec, reshard, ac, micro, sequence_parallel)
                    if found or not runnable(cfg, layout):
                        continue
                    layout_cfg = layout_config(cfg, layout)
                    observed = observe(layout_cfg, layout, world, depth)
                    if observed.peak_bytes > usable:
                        outcome = Outcome(layout, observed.peak_bytes, None,
                                          f"peak {observed.peak_bytes / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable")
                    else:
                        found = True
                        outcome = Outcome(layout, observed.peak_bytes,
                                          estimate_step(observed.comm, fpt, layout_cfg, spec, profile))
                    report(outcome)
                    outcomes.append(outcome)
    fits = sorted((o for o in outcomes if o.estimate), key=lambda o: (-o.estimate.tokens_per_s, o.peak_bytes))
    return fits + [o for o in outcomes if not o.estimate]
