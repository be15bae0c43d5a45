"""--plan-for: the layouts the engine supports for one model and world, each simulated,
those that do not fit dropped with the reason, the rest ranked by predicted tokens/s.

Each layout is simulated for rank 0 (which holds the largest shard when a dimension
does not divide: FSDP pads the others up to it) at two depths one period of the block
pattern apart (3 and 4 blocks; 3 or 4 and 2 more with selective AC every 2nd block)
and extrapolated to its full depth: the blocks are identical, so state bytes and
collectives grow by the same amount with each period, and so does each phase's peak
once the model is a few blocks deep (tests/test_dryrun.py checks the extrapolation
against a simulation at full depth). A model's leading blocks, which differ from the
rest (models.leading_blocks: DeepSeek-V3's 3 dense ones), are simulated as they are:
both depths hold them and 3 or 4 blocks after them, and under pp each stage that holds
them keeps its own count.

What is searched, and why not more:
- mesh: tp in 1, 2, 4, 8 (within a node, dividing the world, and over which the plan
  splits every module evenly); for long sequences cp in 2, 4, 8, ... as long as each
  cp rank keeps at least CP_MIN_TOKENS tokens of a sequence (shorter slices add the
  key/value all-gathers and save little) and the plan names its attention cores; FSDP
  over all the other ranks (dp) or within a node and replicated across nodes
  (hsdp x dp); with tp > 1, loss parallelism on, and sequence parallelism on when the
  plan has a sequence-parallel variant;
- ep, for a model whose plan names experts: 1, the largest that keeps the all-to-all
  within a node, and the largest of all, each dividing dp and the experts (or those of
  `dryrun.ep`; expert_degrees says why not more), each simulated at dryrun.expert_load or
  at ep where that is less (layout_config);
- reshard_after_forward: true, the node-local group size when dp spans more than one
  node (not with ep), and false (least memory first);
- activation checkpointing none, none with `parallel.recompute_cheap` (norms, SwiGLU's
  products and sequence parallel's gathers recomputed: less recompute than op, and at
  tp with sequence parallelism less memory too, for a second all-gather per sublayer),
  op, selective, full,
  then micro-batches 1, 2, 4, 8: for each mesh and reshard setting the search stops at
  the first that fits, since the later ones recompute or re-gather more and are never
  faster in the step model.
  Without pp, a mesh whose parameters and optimizer state alone do not fit ends there,
  one outcome, before any step is simulated (state_bytes).
  A layout that did not fit ends the same AC mode and micro-batch count with the later
  reshard settings, which keep more gathered; and once a count has two layouts that did
  not fit, it is tried with full AC, which needs least memory at that count, before its
  other layouts: when that does not fit either, the count's other layouts are not
  simulated (first_fit; under pp this probe simulates the first stage role only, and
  the ladder reuses it). None with recompute_cheap needs no more memory than none, nor,
  with sequence parallelism, than op (lighter_key): it is probed before none, and where
  it does not fit, neither none nor op is simulated. Once a reshard setting fits with FSDP's
  collectives hidden behind compute, the later ones are not simulated (search_job: they
  cannot be faster);
- dtype: bfloat16 compute with fp32 gradient reduction. fp32 compute runs at a
  fraction of the bf16 peak that the step model does not describe, so it is not
  offered;
- pipeline parallel: pp in `dryrun.pp` (1, 2, 4, 8, 16 by default; 1 alone leaves it
  out), outermost (each stage then takes tp and
  FSDP as above over world / pp ranks), with 1F1B, Interleaved1F1B with 2 stages per
  rank, and Interleaved1F1B with about one block per stage, up to MOST_STAGES_PER_RANK
  (the end stages then may hold only the embedding and the output layer, as Llama 3
  405B's did: pipeline_schedules), and as many micro-batches as each data rank has sequences (1F1B keeps at most pp
  of them in flight whatever their number, and more of them shrink the bubble). GPipe
  is left out (it keeps every micro-batch in flight for 1F1B's bubble), and so are the
  zero-bubble schedules, which the dry run cannot simulate (simulate.refuse_split_backward).
  Each distinct stage role is combined from short pipelines (below), with its own blocks
  or, where that would simulate more, with 2 and 3 blocks per stage and extrapolated to
  them (observe_blocks); the layout's peak is the largest role's, its step the slowest
  role's (the roles are simulated one by one, and one that does not fit ends the layout). With pp, tp is the largest the plan takes within a node (a model that needs
  pipeline stages needs its activations split as far as a node allows), and for a model
  with experts also tp=1 (tp does not split the experts; ep can then take a node).

Short pipelines. A pipeline rank's step is its stages' forwards and backwards in the
schedule's order (torch's own: torch_internals.schedule_actions), then the stages'
gradient reduction and the update. What one forward or backward sends and gathers
depends only on its stage, its kind and what that stage ran last: FSDP reshards a
stage's blocks after each forward (reshard_after_forward), but torch's pipeline stage
keeps them gathered after a backward and defers the reduce-scatters to the step's end,
so a backward after a forward gathers them again and a forward after a backward does
not. Each stage runs a forward first, a backward last and as many of each as there are
micro-batches, so the step's collectives are linear in (1, micro-batches, forwards after
a backward on each stage), and its peak grows with the most micro-batches in flight.
Rank r of a shorter pipeline with fewer micro-batches, in the same role (first stage,
last, or between), has such a vector too; the search simulates the cheapest few whose
vectors, with the most in flight, combine exactly to the layout's rank's (short_pipelines)
and combines their observations with the same weights: the collectives exactly, the
peak along the same line. They keep the schedule's shape (all forwards before the first
backward or not, and as many rounds over the rank's stages), so that the peak falls at
the same point of it. At 405B on pp=16 with 64 micro-batches that is 3 to 20
micro-batches per short pipeline instead of 16 and 17 in a pipeline of 16, and
tests/test_dryrun.py checks the combination against a simulation of the real one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction

from common.config import with_overrides
from engine.dryrun.estimate import StepEstimate, device_profile, estimate_step, float8_speedup
from engine.dryrun.observe import Observation
from common.errors import UserError
from common.workers import imap
from parallel.mesh import MeshSpec

GIB = 1024 ** 3
# (activation_checkpoint, recompute_cheap), from least recompute to most.
AC_MODES = (("none", False), ("none", True), ("op", False), ("selective", False), ("full", False))
MICRO_BATCHES = (1, 2, 4, 8)
HEADROOM = 0.10  # of GPU memory, for what is not a tensor: allocator, NCCL, CUDA context
CP_MIN_TOKENS = 8192  # the shortest slice of a sequence a cp rank is given in the search
SHORT_CANDIDATES = 12  # the short pipelines with fewest micro-batches whose combinations are tried


PIPELINE_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))  # (schedule, stages per rank)
# And Interleaved1F1B with about one block per stage, the smallest bubble, up to this many
# stages per rank (Llama 3 405B: 8 at pp=16, its first and last stage without a block).
MOST_STAGES_PER_RANK = 8


@dataclass
class Layout:
    spec: MeshSpec
    reshard: str
    activation_checkpoint: str
    micro_batches: int
    sequence_parallel: bool = True  # with tp > 1: off for a plan without a sequence-parallel variant
    schedule: str = "1F1B"  # with pp > 1
    stages_per_rank: int = 1
    recompute_cheap: bool = False

    def overrides(self) -> list[str]:
        tp = self.spec.tp > 1
        sp = tp and self.sequence_parallel
        pipeline = ([f"parallel.pp_schedule={self.schedule}", f"parallel.pp_stages_per_rank={self.stages_per_rank}"]
                    if self.spec.pp > 1 else [])
        return [f"parallel.reshard_after_forward={self.reshard}",
                f"parallel.activation_checkpoint={self.activation_checkpoint}",
                f"parallel.recompute_cheap={str(self.recompute_cheap).lower()}",
                f"training.micro_batches={self.micro_batches}", f"parallel.sequence_parallel={str(sp).lower()}",
                f"parallel.loss_parallel={str(tp).lower()}", "parallel.param_dtype=bfloat16",
                "parallel.reduce_dtype=float32", *pipeline]

    def command_line(self) -> str:
        return f"--mesh {self.spec} " + " ".join(f"--set {o}" for o in self.overrides())


@dataclass
class Outcome:
    layout: Layout
    peak_bytes: int
    estimate: StepEstimate | None  # None when it does not fit, or was not simulated
    reason: str = ""
    simulated: bool = True  # False: left out, as it cannot be faster than a layout that fits (search_job)
    error: str = ""  # what the simulation raised, where it could not be simulated (search_job)


def evaluate_layout(cfg, layout: Layout, world: int, depth: int, fpt: float, profile, usable: float,
                    seen: dict | None = None, first_role_only: bool = False) -> "Outcome | None":
    """Simulate one layout; it fits or not (the largest peak of its stage roles), and the
    step estimate of its slowest role when it does. Under pp the roles are simulated in
    order and the first that does not fit ends it: the layout's peak is then at least that.
    `seen` (pp rank -> role) keeps the roles simulated, for a later call on the same layout;
    with `first_role_only`, a pipeline layout whose first role fits gives None, as what its
    other roles need is not known yet (first_fit's probe)."""
    layout_cfg = layout_config(cfg, layout)
    spec = layout.spec
    roles = ([(observe(layout_cfg, layout, world, depth), None, *whole_flops_shares(layout_cfg, depth))]
             if spec.pp == 1 else [])
    for role in observe_stage_roles(layout_cfg, layout, world, depth, seen) if spec.pp > 1 else ():
        roles.append(role)
        if role[0].peak_bytes > usable:
            break
        if first_role_only:
            return None
    peak = max(observed.peak_bytes for observed, *_ in roles)
    if peak > usable:
        return Outcome(layout, peak, None, f"peak {peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable")
    estimates = [estimate_step(observed.comm, fpt, layout_cfg, spec, profile, stage_flops=stage_fpt,
                               float8_flops=float8, expert_flops=experts, recomputed_flops=recomputed)
                 for observed, stage_fpt, float8, experts, recomputed in roles]
    return Outcome(layout, peak, max(estimates, key=lambda e: e.step_s))


def offers_sequence_parallel(cfg) -> bool:
    from parallel.plan import plan_of
    return bool(plan_of(cfg).sequence_parallel)


def plan_takes_tp(cfg, tp: int) -> bool:
    """Whether the model's plan splits evenly over `tp` ranks, with loss parallel and, when
    the plan has it, sequence parallel."""
    from models import build_on_meta
    from parallel.apply import tensor_parallel_styles
    from parallel.plan import plan_of
    from parallel.validate import validate_plan
    if tp == 1:
        return True
    sp = offers_sequence_parallel(cfg)
    cfg = with_overrides(cfg, [f"parallel.sequence_parallel={str(sp).lower()}", "parallel.loss_parallel=true"])
    model, plan = build_on_meta(cfg.model.name, cfg.model.flavor, 1), plan_of(cfg)
    try:
        validate_plan(model, plan, tensor_parallel_styles(model, plan, cfg.parallel), tp, sp)
    except UserError:
        return False
    return not sp or cfg.training.seq_len % tp == 0  # sequence parallel splits the sequence


def context_degrees(cfg, ranks: int) -> list[int]:
    """1, and the cp degrees searched over `ranks` for this sequence length."""
    from parallel.plan import plan_of
    degrees, seq_len = [1], cfg.training.seq_len
    if plan_of(cfg).attention is None:
        return degrees
    cp = 2
    while ranks % cp == 0 and seq_len % (2 * cp) == 0 and seq_len // cp >= CP_MIN_TOKENS:
        degrees.append(cp)
        cp *= 2
    return degrees


def meshes(cfg, world: int, depth: int | None = None) -> list[MeshSpec]:
    """With `depth` (the model's blocks), pipeline sizes too: up to one block per stage."""
    gpus_per_node = cfg.dryrun.gpus_per_node
    pipeline = pipeline_sizes(cfg) if depth is not None and plan_has_stages(cfg) else (1,)
    found = []
    for pp in pipeline:
        if world % pp or (depth is not None and pp > depth):
            continue
        stage = world // pp
        takes = [tp for tp in (1, 2, 4, 8) if tp <= gpus_per_node and stage % tp == 0 and plan_takes_tp(cfg, tp)]
        # Under pp the largest tp, and with experts, which tp does not split, none as well:
        # ep then takes the node's ranks (DeepSeek-V3's layout: pp=16, ep=64, no tp).
        for tp in takes if pp == 1 else sorted({takes[0], takes[-1]}) if experts_counts(cfg) else takes[-1:]:
            for cp in context_degrees(cfg, stage // tp):
                rest = stage // (tp * cp)
                grids = [MeshSpec(dp=rest, tp=tp, cp=cp, pp=pp)]
                # HSDP: FSDP's shard group (dp x cp) within a node, replicated across nodes.
                in_node = gpus_per_node // tp
                dp_in_node = in_node // cp
                if in_node % cp == 0 and (dp_in_node > 1 or cp > 1) and dp_in_node < rest and rest % dp_in_node == 0:
                    grids.append(MeshSpec(hsdp=rest // dp_in_node, dp=dp_in_node, tp=tp, cp=cp, pp=pp))
                found += [dataclasses.replace(grid, ep=ep) for grid in grids for ep in expert_degrees(cfg, grid)]
    return found


def expert_degrees(cfg, spec: MeshSpec) -> list[int]:
    """The ep degrees searched on a mesh: 1 for a model without experts; else those of
    `dryrun.ep` that divide dp and every experts module's number of experts, by default 1,
    the largest whose all-to-all stays within a node and the largest of all. Between the
    last two, a larger ep gathers fewer experts per rank (each rank's own over edp = dp/ep)
    for an all-to-all of about the same bytes ((ep-1)/ep of each rank's routed rows), so
    only crossing nodes sets the two apart."""
    counts = experts_counts(cfg)
    if not counts:
        return [1]
    divides = [ep for ep in range(1, spec.dp + 1) if spec.dp % ep == 0 and all(n % ep == 0 for n in counts)]
    if cfg.dryrun.ep:
        return [ep for ep in expert_sizes(cfg) if ep in divides]
    in_node = [ep for ep in divides if ep * spec.cp * spec.tp <= cfg.dryrun.gpus_per_node]
    return sorted({1, in_node[-1], divides[-1]})


def experts_counts(cfg) -> tuple[int, ...]:
    """The number of experts of each experts module the plan names (Plan.experts)."""
    from parallel.plan import plan_of
    return _experts_counts(cfg.model.name, cfg.model.flavor, plan_of(cfg).name)


@functools.lru_cache(maxsize=None)
def _experts_counts(name: str, flavor: str, plan_name: str) -> tuple[int, ...]:
    """From the model's leading blocks and one more."""
    from models import build_on_meta, leading_blocks, model_args
    from parallel.expert import expert_paths
    from parallel.plan import get_plan
    args = model_args(name, flavor)
    model = build_on_meta(name, flavor, min(args.n_layers, leading_blocks(args) + 1))
    return tuple(model.get_submodule(path).w13.shape[0] for path in expert_paths(model, get_plan(plan_name)))


def expert_sizes(cfg) -> tuple[int, ...]:
    """dryrun.ep's degrees (common/config.py checks them)."""
    return tuple(int(size) for size in cfg.dryrun.ep.split(","))


def pipeline_sizes(cfg) -> tuple[int, ...]:
    try:
        sizes = tuple(int(size) for size in cfg.dryrun.pp.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise UserError(f"dryrun.pp={cfg.dryrun.pp!r}: give the pipeline sizes to search, comma-separated "
                        f"positive integers, e.g. 1,2,4,8,16 (1 alone: no pipeline parallel).")
    return sizes


def plan_has_stages(cfg) -> bool:
    from parallel.plan import plan_of
    return plan_of(cfg).stages is not None


def search_mesh(cfg, world: int) -> MeshSpec:
    """The searched mesh with the fewest data ranks, for the launcher's up-front checks
    (without pipeline parallel, whose checks each layout's simulation makes). Every ep
    degree a pipeline's mesh takes, the mesh of the same world without pp and tp takes
    too (its dp is a multiple of theirs), so where none is found here, dryrun.ep is wrong."""
    counts = experts_counts(cfg)
    if cfg.dryrun.ep and not counts:
        raise UserError(f"dryrun.ep={cfg.dryrun.ep} lists expert-parallel degrees to search, but "
                        f"{cfg.model.name}/{cfg.model.flavor} has no experts that its plan names: drop dryrun.ep.")
    found = meshes(cfg, world)
    if not found:
        raise UserError(f"dryrun.ep={cfg.dryrun.ep}: no degree of it fits {world} ranks. An ep degree must "
                        f"divide the experts of each experts module ({', '.join(map(str, sorted(set(counts))))}) "
                        f"and the data-parallel ranks of a mesh (at most {world} here). Give degrees that do, or "
                        f"leave dryrun.ep out to search the default ones.")
    return min(found, key=lambda spec: spec.hsdp * spec.dp)


def reshard_options(spec: MeshSpec, gpus_per_node: int, float8_all_gather: bool = False,
                    experts: tuple[int, ...] = ()) -> list[str]:
    """The reshard settings searched, least memory first: resharding after every forward
    frees the most, a node-local group less (not with float8 all-gathers, which cannot
    gather from it: parallel/float8.py, nor with ep, whose experts have a mesh of their
    own, nor with `experts` counts that do not divide FSDP's ranks, sharded along their
    rows: parallel/expert.py), keeping the gathered parameters none."""
    options = ["true", "false"]
    in_node = gpus_per_node // spec.tp
    rows_sharded = any(n % spec.shard_size for n in experts)
    if (1 < in_node < spec.shard_size and spec.shard_size % in_node == 0 and not float8_all_gather
            and spec.ep == 1 and not rows_sharded):
        options.insert(1, str(in_node))
    return options


def extrapolate(one: Observation, two: Observation, first: int, period: int, depth: int) -> Observation:
    """The observation at `depth` blocks from those at `first` and `first + period`."""
    grown = Fraction(depth - first, period)
    return combine([one, two], [1 - grown, grown])


def combine(observations: list[Observation], weights: list) -> Observation:
    """The weighted sum of observations whose weights add up to 1: a point on the line (or
    plane) through them, for quantities that are linear along it. Each phase's peak grows
    at its own rate (the forward's with the saved activations, the optimizer's with the
    state), so the step's peak is the largest of the combined phase peaks; `at_peak` keeps
    the simulated runs' split, combined alike."""
    def total(values) -> int:
        return round(sum(weight * value for weight, value in zip(weights, values)))

    def across(field: str) -> dict:
        dicts = [getattr(observed, field) for observed in observations]
        return {key: total(d.get(key, 0) for d in dicts) for key in dict.fromkeys(k for d in dicts for k in d)}

    comm = {}
    for dim, phase, kind in dict.fromkeys((dim, phase, kind) for observed in observations
                                          for dim in observed.comm for phase in observed.comm[dim]
                                          for kind in observed.comm[dim][phase]):
        sized = [observed.comm.get(dim, {}).get(phase, {}).get(kind, {}) for observed in observations]
        count = total(entry.get("count", 0) for entry in sized)
        if count:  # a collective that the combined step does not run is left out, as a simulation leaves it
            comm.setdefault(dim, {}).setdefault(phase, {})[kind] = {
                "count": count, "bytes": total(entry.get("bytes", 0) for entry in sized)}
    phase_peaks = across("phase_peaks")
    return Observation(param_bytes=total(o.param_bytes for o in observations),
                       grad_bytes=total(o.grad_bytes for o in observations),
                       optimizer_bytes=total(o.optimizer_bytes for o in observations),
                       peak_bytes=max(phase_peaks.values()), at_peak=across("at_peak"), comm=comm,
                       phase_peaks=phase_peaks)


def layout_config(cfg, layout: Layout):
    """The config of one layout; a mixture of experts at the load dryrun.expert_load asks
    for, or at ep where that is less (ep ranks cannot be more uneven than one taking all)."""
    load = min(cfg.dryrun.expert_load, layout.spec.ep)
    return with_overrides(cfg, [f"parallel.mesh={layout.spec}", *layout.overrides(), f"dryrun.expert_load={load}"])


def observe(cfg, layout: Layout, world: int, depth: int) -> Observation:
    """Rank 0's step at `depth` blocks, from simulations of one and two periods of the
    block pattern (selective AC checkpoints every checkpoint_every-th block) after the
    model's leading blocks (models.leading_blocks), which both simulations hold."""
    from engine.dryrun.simulate import observe_rank_zero
    from models import leading_blocks, model_args
    period = cfg.parallel.checkpoint_every if layout.activation_checkpoint == "selective" else 1
    # Below 3 blocks the backward's peak falls elsewhere (measured on 100M: growth per
    # block is constant from 3 blocks on), and `first` must fall on the pattern's phase.
    start = 3 + leading_blocks(model_args(cfg.model.name, cfg.model.flavor))
    first = next(n for n in range(start, start + period) if (depth - n) % period == 0)
    if depth <= first + period:
        return observe_rank_zero(cfg, layout.spec, world, depth)
    one, two = (observe_rank_zero(cfg, layout.spec, world, n) for n in (first, first + period))
    return extrapolate(one, two, first, period, depth)


def state_bytes(cfg, layout: Layout, world: int, depth: int) -> int:
    """Without pp: rank 0's parameters and optimizer state at `depth` blocks, from the
    model with one and two blocks after its leading ones (each block adds the same bytes).
    A step holds them throughout, so where they alone do not fit, no AC mode, micro-batch
    count or reshard setting of the mesh fits (search_job simulates none of them)."""
    from engine.dryrun.simulate import rank_zero_state_bytes
    from models import leading_blocks, model_args
    layout_cfg = layout_config(cfg, layout)
    first = 1 + leading_blocks(model_args(cfg.model.name, cfg.model.flavor))
    if depth <= first + 1:
        return rank_zero_state_bytes(layout_cfg, layout.spec, world, depth)
    one, two = (rank_zero_state_bytes(layout_cfg, layout.spec, world, n) for n in (first, first + 1))
    return one + (depth - first) * (two - one)


def runnable(cfg, layout: Layout, depth: int) -> bool:
    from parallel.pipeline import micro_batches_needed
    t, spec = cfg.training, layout.spec
    data = spec.hsdp * spec.dp
    sequence_split = spec.tp if layout.sequence_parallel else 1  # of each cp rank's tokens
    fits_batch = (t.global_batch % (data * layout.micro_batches) == 0
                  and (t.seq_len // spec.cp) % sequence_split == 0)
    if spec.pp == 1:
        return fits_batch
    return (fits_batch and spec.pp * layout.stages_per_rank <= most_stages(cfg, depth)
            and not micro_batches_needed(layout.schedule, spec.pp, layout.stages_per_rank, layout.micro_batches))


def whole_flops_shares(cfg, depth: int) -> tuple[float, float, float]:
    """Of the whole model at `depth` blocks, the FLOPs per token that parallel.float8 runs
    in float8, those of the routed experts, and those whose forward cfg's activation
    checkpointing runs again (estimate.estimate_step)."""
    from parallel.plan import plan_of
    p = cfg.parallel
    return _whole_flops_shares(cfg.model.name, cfg.model.flavor, plan_of(cfg).name, p.float8, depth,
                               p.activation_checkpoint, p.checkpoint_every, cfg.training.seq_len)


@functools.lru_cache(maxsize=None)  # one model on meta per search process and AC mode, not one per layout
def _whole_flops_shares(name: str, flavor: str, plan_name: str, recipe: str, depth: int,
                        activation_checkpoint: str, checkpoint_every: int, seq_len: int) -> tuple[float, float, float]:
    from common.config import ParallelConfig
    from engine.dryrun.estimate import expert_flops_per_token, float8_flops_per_token, recomputed_flops_per_token
    from models import build_on_meta
    from parallel.plan import expand, get_plan
    whole, plan = build_on_meta(name, flavor, depth), get_plan(plan_name)
    blocks = expand(whole, plan.blocks, plan.name)
    checkpointing = ParallelConfig(activation_checkpoint=activation_checkpoint, checkpoint_every=checkpoint_every)
    return (float8_flops_per_token(whole, blocks, recipe), expert_flops_per_token(whole, blocks),
            recomputed_flops_per_token(whole, [blocks], len(blocks), checkpointing, seq_len))


def observe_stage_roles(cfg, layout: Layout, world: int, depth: int,
                        seen: dict | None = None) -> Iterator[tuple[Observation, float, float, float, float]]:
    """Under pipeline parallel: (the observation, the FLOPs per token, those in float8, those
    of routed experts, those whose forward AC runs again) of each distinct stage role
    (simulate.pipeline_ranks) at `depth` blocks (observe_blocks), one by one; those in
    `seen` (pp rank -> role) without simulating them again, and the others added to it."""
    from engine.dryrun.estimate import (expert_flops_per_token, float8_flops_per_token, recomputed_flops_per_token,
                                        stage_flops_per_token)
    from engine.dryrun.simulate import leading_per_stage, pipeline_ranks
    from models import build_on_meta, leading_blocks
    from parallel.pipeline import blocks_per_stage, empty_ends, stages_of_rank, stage_blocks
    from parallel.plan import plan_of

    spec, per_rank = layout.spec, layout.stages_per_rank
    plan, whole = plan_of(cfg), build_on_meta(cfg.model.name, cfg.model.flavor, depth)
    split = blocks_per_stage(depth, spec.pp, per_rank, cfg.parallel.pp_split, empty_ends(plan.stages))
    leading = leading_per_stage(split, leading_blocks(whole.args))
    paths = stage_blocks(whole, plan, spec.pp, cfg.parallel)
    seen = {} if seen is None else seen
    for pp_rank in pipeline_ranks(cfg, spec, depth):
        if pp_rank not in seen:
            held = stages_of_rank(pp_rank, spec.pp, per_rank, layout.schedule)
            observed = observe_blocks(cfg, layout, world, pp_rank, [split[stage] for stage in held],
                                      [leading[stage] for stage in held], depth)
            held_paths = [path for stage in held for path in paths[stage]]
            seen[pp_rank] = (observed, stage_flops_per_token(whole, plan.stages, paths, held, cfg.training.seq_len),
                             float8_flops_per_token(whole, held_paths, cfg.parallel.float8),
                             expert_flops_per_token(whole, held_paths),
                             recomputed_flops_per_token(whole, [paths[stage] for stage in held], depth, cfg.parallel,
                                                        cfg.training.seq_len))
        yield seen[pp_rank]


def observe_blocks(cfg, layout: Layout, world: int, pp_rank: int, blocks: list[int],
                   leading: list[int], depth: int) -> Observation:
    """Pipeline rank `pp_rank`'s step with `blocks` in each stage it holds, `leading` of
    them the model's leading blocks, in a model of `depth` blocks (observe_role): simulated with them when that simulates
    no more blocks than extrapolating would, else extrapolated from 2 blocks in every stage
    and from 3 in each stage in turn. Each stage grows on its own: its blocks' collectives
    count once per forward or backward of that stage, and the stages of a rank run in
    different orders (with unequal stages, a line through 2 and 3 blocks in every stage
    got 7 of rank 0's 456 all-gathers in the wrong phase at 405B, Interleaved1F1B, pp=16).
    A stage that holds leading blocks, which differ from the rest, keeps its own count."""
    base = [n if held else 2 for n, held in zip(blocks, leading)]
    grown = [stage for stage, held in enumerate(leading) if not held]
    points = [base] + [[n + (i == stage) for i, n in enumerate(base)] for stage in grown]
    if sum(blocks) <= sum(map(sum, points)):
        return observe_role(cfg, layout, world, pp_rank, blocks, leading, depth)
    weights = [1 - sum(blocks[stage] - 2 for stage in grown)] + [blocks[stage] - 2 for stage in grown]
    return combine([observe_role(cfg, layout, world, pp_rank, point, leading, depth) for point in points], weights)


def observe_role(cfg, layout: Layout, world: int, pp_rank: int, blocks: list[int], leading: list[int],
                 depth: int) -> Observation:
    """Pipeline rank `pp_rank`'s step with `blocks` in each stage it holds (`leading` of them
    the model's leading blocks, of `depth` in all), from the short pipelines whose schedules
    combine to its own (short_pipelines)."""
    runs = short_pipelines(layout.schedule, layout.spec.pp, layout.stages_per_rank, layout.micro_batches, pp_rank)
    return combine([short_pipeline(cfg, layout, world, size, rank, micro, blocks, leading, depth)
                    for (size, rank, micro), _ in runs], [weight for _, weight in runs])


def short_pipeline(cfg, layout: Layout, world: int, size: int, rank: int, micro_batches: int,
                   blocks: list[int], leading: list[int], depth: int) -> Observation:
    """The step of pipeline rank `rank` in a pipeline of `size` ranks with the layout's other
    dimensions, over `micro_batches` micro-batches of the layout's size; the stages it holds
    have `blocks` blocks, each of the others one, or none at an end that may be empty (they
    are not simulated; the whole then has no more blocks than the model's `depth`). The
    model's leading blocks end where they end in the layout's stages: `leading` of each
    held stage's blocks, the stages before the last such one all leading (as in the model,
    whose leading blocks come first). A mixture of experts' routing figures cross the
    stages for every layer of the model (engine/routing.py: finish_step), so that
    all-reduce carries the whole model's, not the short one's."""
    from engine.dryrun.simulate import observe_rank_zero
    from parallel.pipeline import empty_ends, stages_of_rank
    from parallel.plan import plan_of

    spec, per_rank = dataclasses.replace(layout.spec, pp=size), layout.stages_per_rank
    first, last = empty_ends(plan_of(cfg).stages)
    split = [1] * (size * per_rank)
    split[0], split[-1] = int(not first), int(not last)
    held = stages_of_rank(rank, size, per_rank, layout.schedule)
    for stage, count in zip(held, blocks):
        split[stage] = count
    ending = [(stage, count) for stage, count in zip(held, leading) if count]
    dense_layers = sum(split[:ending[-1][0]]) + ending[-1][1] if ending else 0
    data = spec.hsdp * spec.dp
    rows = cfg.training.global_batch // data // layout.micro_batches  # of each micro-batch
    short = with_overrides(cfg, [f"parallel.mesh={spec}", f"parallel.pp_split={','.join(map(str, split))}",
                                 f"training.micro_batches={micro_batches}",
                                 f"training.global_batch={micro_batches * rows * data}"])
    per_stage = world // layout.spec.pp
    observed = observe_rank_zero(short, spec, size * per_stage, sum(split), rank * per_stage, dense_layers)
    if experts_counts(cfg):
        name, flavor = cfg.model.name, cfg.model.flavor
        missing = routing_bytes(name, flavor, depth, None) - routing_bytes(name, flavor, sum(split), dense_layers)
        if missing:
            observed.comm["pp"]["optimizer"]["all_reduce"]["bytes"] += missing
    return observed


@functools.lru_cache(maxsize=None)  # a model on meta per depth, not per short pipeline (405B: 1 s each)
def routing_bytes(name: str, flavor: str, n_layers: int, dense_layers: int | None) -> int:
    """engine/routing.py: stages_all_reduce_bytes of the model at that depth."""
    from engine.routing import stages_all_reduce_bytes
    from models import build_on_meta
    return stages_all_reduce_bytes(build_on_meta(name, flavor, n_layers, dense_layers))


def schedule_features(schedule: str, pp: int, per_rank: int, micro_batches: int, rank: int) -> tuple[tuple, tuple]:
    """What rank `rank`'s step is linear in: (1, the micro-batches, for each of its stages
    the forwards that follow a backward of that stage, the most micro-batches in flight);
    and the shape of its schedule, which the short pipelines keep (module docstring)."""
    from engine.dryrun.torch_internals import schedule_actions

    actions = schedule_actions(schedule, pp, per_rank, micro_batches, rank)
    last, after_backward, in_flight, most = {}, [0] * per_rank, 0, 0
    for stage, kind in actions:
        after_backward[stage] += kind == "F" and last.get(stage) == "B"
        last[stage] = kind
        in_flight += 1 if kind == "F" else -1
        most = max(most, in_flight)
    forwards = [stage for stage, kind in actions if kind == "F"]
    first_backward = next(i for i, (_, kind) in enumerate(actions) if kind == "B")
    shape = (first_backward == len(forwards), sum(a != b for a, b in zip(forwards, forwards[1:])))
    return (1, micro_batches, *after_backward, most), shape


@functools.lru_cache(maxsize=None)
def short_pipelines(schedule: str, pp: int, per_rank: int, micro_batches: int,
                    rank: int) -> tuple[tuple[tuple[int, int, int], Fraction], ...]:
    """((pipeline size, rank, micro-batches), weight) of the cheapest short pipelines, in
    micro-batches simulated, whose schedule features (schedule_features) combine to rank
    `rank`'s with these weights, among the SHORT_CANDIDATES with the fewest micro-batches;
    failing that, the layout itself. Each holds the same role, first stage, last or in
    between; a pipeline of 2 only for one of 2, where the group of the first and last
    stage's ranks (a tied weight's) is the pp group."""
    from parallel.pipeline import micro_batches_needed

    target, shape = schedule_features(schedule, pp, per_rank, micro_batches, rank)
    candidates = {}  # features -> the first (fewest micro-batches) run that has them
    for micro in range(2, micro_batches + 1):
        if len(candidates) >= SHORT_CANDIDATES:
            break
        for size in range(2 if pp == 2 else 3, min(pp, micro) + 1):
            short_rank = 0 if rank == 0 else size - 1 if rank == pp - 1 else 1
            if micro_batches_needed(schedule, size, per_rank, micro):
                continue
            features, its_shape = schedule_features(schedule, size, per_rank, micro, short_rank)
            if its_shape == shape:
                candidates.setdefault(features, (size, short_rank, micro))
    best = None
    for count in range(1, len(target) + 1):
        for chosen in itertools.combinations(candidates.items(), count):
            cost = sum(run[2] for _, run in chosen)
            weights = None if best and cost >= best[0] else solve([features for features, _ in chosen], target)
            if weights is not None:
                best = (cost, tuple(zip((run for _, run in chosen), weights)))
    return best[1] if best else (((pp, rank, micro_batches), Fraction(1)),)  # else the layout itself


def solve(columns: list[tuple], target: tuple) -> list[Fraction] | None:
    """Exact weights that combine the linearly independent `columns` to `target`, or None."""
    rows = [[Fraction(column[i]) for column in columns] + [Fraction(target[i])] for i in range(len(target))]
    for col in range(len(columns)):
        pivot = next((r for r in range(col, len(rows)) if rows[r][col]), None)
        if pivot is None:
            return None  # the columns are dependent
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r, row in enumerate(rows):
            if r != col and row[col]:
                factor = row[col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(row, rows[col])]
    if any(row[-1] for row in rows[len(columns):]):
        return None  # the target is not in their span
    return [rows[i][-1] / rows[i][i] for i in range(len(columns))]


def most_stages(cfg, depth: int) -> int:
    """The most pipeline stages a model of `depth` blocks splits into: one block each, and
    the end stages none where the plan lets them (parallel.pipeline.empty_ends)."""
    from parallel.pipeline import empty_ends
    from parallel.plan import plan_of
    return depth + sum(empty_ends(plan_of(cfg).stages))


def pipeline_schedules(cfg, pp: int, depth: int) -> list[tuple[str, int]]:
    """The (schedule, stages per rank) searched at this pp: PIPELINE_SCHEDULES, and the
    looped schedule with as many stages as the blocks allow, up to MOST_STAGES_PER_RANK,
    when that is more than 2 (the end stages may hold no block: parallel/pipeline.py)."""
    if pp == 1:
        return list(PIPELINE_SCHEDULES[:1])
    most = min(MOST_STAGES_PER_RANK, most_stages(cfg, depth) // pp)
    return [*PIPELINE_SCHEDULES, *([("Interleaved1F1B", most)] if most > 2 else [])]


def ladders(spec: MeshSpec, reshard: str, sequence_parallel: bool, rows: int,
            schedules=PIPELINE_SCHEDULES) -> list[list[Layout]]:
    """One mesh and reshard setting's layouts, in ladders climbed to their first fit: without
    pp, the AC modes each with micro-batches 1, 2, 4, 8; with pp, the AC modes for each
    schedule, every sequence its own micro-batch (module docstring)."""
    if spec.pp == 1:
        return [[Layout(spec, reshard, ac, micro, sequence_parallel, recompute_cheap=cheap)
                 for ac, cheap in AC_MODES for micro in MICRO_BATCHES]]
    return [[Layout(spec, reshard, ac, max(1, rows), sequence_parallel, schedule, per_rank, cheap)
             for ac, cheap in AC_MODES]
            for schedule, per_rank in schedules]


def memory_key(layout: Layout) -> tuple[str, bool, int]:
    """What sets a layout's memory within one mesh and schedule, besides its reshard setting."""
    return layout.activation_checkpoint, layout.recompute_cheap, layout.micro_batches


def lighter_key(layout: Layout) -> tuple[str, bool, int] | None:
    """The memory_key of a layout that needs no more memory than `layout`, where one is
    known:
    - none with recompute_cheap against none: recompute_cheap keeps a subset of what none
      keeps (the sublayers' inputs, not their norms' outputs, SwiGLU's products or sequence
      parallel's gathered inputs), and in backward recomputes one sublayer's at a time,
      which none holds for every block all along;
    - none with recompute_cheap against op-level AC under sequence parallelism. Both keep
      the outputs of matmuls and attention; op also keeps each row-parallel matmul's
      partial sum, which holds the whole sequence, where recompute_cheap keeps a sequence
      shard of the residual, and op recomputes a whole block at once in backward, where
      recompute_cheap recomputes one sublayer (docs/parallelism.md, "Activations at their
      true size"; tests/test_activation_memory.py measures both). Without sequence
      parallelism the residual is whole too; there op needed less per block at 70B until
      recompute_cheap freed the norms' outputs (2026-11-29), and the rule was not widened
      since (not measured at every depth)."""
    if layout.activation_checkpoint == "none" and not layout.recompute_cheap:
        return "none", True, layout.micro_batches
    if layout.activation_checkpoint == "op" and layout.spec.tp > 1 and layout.sequence_parallel:
        return "none", True, layout.micro_batches
    return None


def first_fit(ladder: list[Layout], evaluate, beyond: dict[tuple, Outcome], probe=None) -> list[Outcome]:
    """The outcomes of the ladder's layouts up to the first that fits, in order, without
    simulating those that cannot fit:
    - a layout whose AC mode and micro-batch count (memory_key) did not fit with a reshard
      setting needing no more memory than this ladder's, or whose lighter_key did not:
      `beyond` maps each such key to its outcome, filled ladder by ladder in
      reshard_options' order;
    - a layout whose lighter layout comes later in the ladder (none, then none with
      recompute_cheap: the first recomputes less, so it is tried first) and does not fit:
      that one is probed first, out of the ladder's order. At 405B on 16,384 GPUs no
      layout fit with AC none, and 5 of the 33 simulated were none where none with
      recompute_cheap did not fit either (commit 6565a49, 2026-12-05). Where the lighter
      one fits, it is reported only where the ladder reaches it, and no lighter layout is
      probed after it: without pp the ladder then simulates none at each micro-batch count
      before it reaches that fit, and probes at those counts would be simulations for
      nothing;
    - every layout of a micro-batch count at which full AC, which needs least memory at
      that count, does not fit. Before a third layout of a count is simulated (two have
      not fit, with this reshard setting or an earlier one), full AC at that count is
      probed, out of the ladder's order; when it does not fit, the count is done with,
      with this reshard setting and the later ones, and when it fits it is reported only
      where the ladder reaches it. (Not after the first layout that did not fit: the next
      AC mode usually fits, and the probe is then a simulation for nothing; at 405B on
      16,384 GPUs such probes were a fifth of the search. Not across counts: without pp,
      more micro-batches hold the whole model's unreduced gradients.)
    `probe(layout)` is an outcome, or None where it found only that part of the layout
    fits (search_job's: the first stage role of a pipeline); `evaluate` by default.
    A layout that could not be simulated (Outcome.error) is reported, and tells nothing of
    the others: the ladder goes on past it, up to a second layout with the same error."""
    probe = probe or evaluate
    outcomes, probed = [], {}  # memory_key of a layout probed -> its outcome, or None
    lighter_fits = False  # a lighter layout probed has fit (or its first role has)

    def probe_first(key: tuple, position: int) -> bool | None:
        """Probe the ladder's layout of `key` if it lies past `position` and was not probed:
        True where it did not fit, False where it (or the part probed) fits, else None."""
        other = next((i for i, candidate in enumerate(ladder) if memory_key(candidate) == key), None)
        if other is None or other <= position or key in probed:
            return None
        probed[key] = probe(ladder[other])
        if probed[key] is not None and probed[key].error:
            outcomes.append(probed[key])
            return None
        if probed[key] is not None and probed[key].estimate is None:
            outcomes.append(probed[key])
            beyond[key] = probed[key]
            return True
        return False

    for position, layout in enumerate(ladder):
        if repeated_error(outcomes):  # a probe's
            return outcomes
        key = memory_key(layout)
        full = ("full", False, layout.micro_batches)
        lighter = lighter_key(layout)
        if key in beyond or full in beyond or lighter in beyond:
            continue
        if lighter is not None and not lighter_fits:
            did_not_fit = probe_first(lighter, position)
            if did_not_fit:
                beyond[key] = probed[lighter]  # so this layout counts as not fitting at its count
                continue
            lighter_fits = did_not_fit is False
        failed_at_count = sum(micro == layout.micro_batches for _, _, micro in beyond) >= 2
        if failed_at_count and probe_first(full, position):
            continue
        if key in probed and probed[key] is not None and probed[key].error:
            continue  # reported where it was probed
        outcome = probed.get(key) or evaluate(layout)
        outcomes.append(outcome)
        if outcome.estimate is not None or repeated_error(outcomes):
            return outcomes
        if not outcome.error:  # one that failed says nothing of what fits
            beyond[key] = outcome
    return outcomes


def repeated_error(outcomes: list[Outcome]) -> bool:
    """Whether two layouts raised the same error: then the rest of their mesh most likely
    would too, and search_job leaves it (an error after the model is built costs as much as
    a simulation)."""
    errors = [o.error for o in outcomes if o.error]
    return len(errors) > len(set(errors))


def plan_for(cfg, world: int, depth: int, fpt: float, report=print) -> list[Outcome]:
    """Every layout searched, best first: those that fit by tokens/s, then the others.
    Each mesh's layouts with one pipeline schedule make a job (search_job); the jobs run
    side by side in `dryrun.search_workers` processes (search_workers), those of the
    pipelines with most stages, the longest to simulate, first. `report` sees each job's
    outcomes when it is done, and the result does not depend on the number of workers."""
    if cfg.dryrun.gpu_memory_gib <= 0:
        raise UserError(f"dryrun.gpu_memory_gib={cfg.dryrun.gpu_memory_gib}: give the GPU's memory in GiB, e.g. 80.")
    float8_speedup(device_profile(cfg.dryrun).name, cfg.parallel.float8)  # refused here, before any worker starts
    jobs = search_jobs(cfg, world, depth)
    found = {}
    with search_workers(cfg, len(jobs)) as run:
        ordered = sorted(enumerate(jobs), key=lambda job: -job[1][0].pp * job[1][1][1])
        for index, outcomes in run(functools.partial(search_job, cfg, world, depth, fpt), ordered):
            for outcome in outcomes:
                report(outcome)
            found[index] = outcomes
    return ranked([outcome for index in range(len(jobs)) for outcome in found[index]])


def ranked(outcomes: list[Outcome]) -> list[Outcome]:
    """Those that fit by tokens/s (then the least peak), then the others in their order."""
    fits = sorted((o for o in outcomes if o.estimate), key=lambda o: (-o.estimate.tokens_per_s, o.peak_bytes))
    return fits + [o for o in outcomes if not o.estimate]


def search_jobs(cfg, world: int, depth: int) -> list[tuple[MeshSpec, tuple[str, int]]]:
    """Each mesh searched, with each pipeline schedule (and stages per rank) searched on it."""
    jobs = [(spec, schedule) for spec in meshes(cfg, world, depth)
            for schedule in pipeline_schedules(cfg, spec.pp, depth)]
    if not jobs:  # search_mesh found a mesh without pp, so dryrun.pp left it out
        raise UserError(f"dryrun.pp={cfg.dryrun.pp}: no pipeline size of it fits {world} ranks and "
                        f"{cfg.model.name}/{cfg.model.flavor}'s {depth} blocks. A size must divide the ranks and be "
                        f"at most the blocks; add 1 to search layouts without pipeline parallel.")
    return jobs


def search_job(cfg, world: int, depth: int, fpt: float, job: tuple) -> tuple[int, list[Outcome]]:
    """(the job's index, the outcomes of its layouts in the order simulated): one mesh with
    one pipeline schedule (and stages per rank; without pp, the one ladder), every reshard
    setting, least memory first (first_fit's `beyond`), until one fits with FSDP's
    collectives hidden behind compute. The later settings are then left out (dominated):
    each keeps more parameters gathered, so it fits at the same AC mode and micro-batch
    count or at a later one, which recomputes no less (the step model's compute, bubble and
    exposed collectives do not fall along a ladder), and it only removes FSDP all-gathers
    that the step does not wait for."""
    index, (spec, (schedule, per_rank)) = job
    dry = cfg.dryrun
    profile, usable = device_profile(dry), dry.gpu_memory_gib * GIB * (1 - HEADROOM)
    sequence_parallel = offers_sequence_parallel(cfg)

    roles_seen = collections.defaultdict(dict)  # a layout's command line -> its stage roles simulated

    def evaluate(layout: Layout, first_role_only: bool = False) -> Outcome | None:
        try:
            return evaluate_layout(cfg, layout, world, depth, fpt, profile, usable,
                                   roles_seen[layout.command_line()], first_role_only)
        except Exception as err:  # an engine bug in one layout: the search goes on, and says so (launch/run.py)
            return failed(layout, err)

    outcomes, beyond = [], {}
    rows = cfg.training.global_batch // (spec.hsdp * spec.dp)
    settings = reshard_options(spec, dry.gpus_per_node, cfg.parallel.float8_all_gather, experts_counts(cfg))
    if spec.pp == 1:
        (ladder,) = ladders(spec, settings[0], sequence_parallel, rows)
        least = next((layout for layout in ladder if layout.activation_checkpoint == "full"
                      and runnable(cfg, layout, depth)), None)
        try:
            state = state_bytes(cfg, least, world, depth) if least else 0
        except Exception as err:  # every layout of the mesh would meet it
            return index, [failed(least, err, "no layout of this mesh could be simulated")]
        if state > usable:
            return index, [Outcome(least, state, None,
                                   f"parameters and optimizer state alone {state / GIB:.1f} GiB > {usable / GIB:.1f} "
                                   f"GiB usable: no layout of this mesh fits")]
    for position, reshard in enumerate(settings):
        (ladder,) = ladders(spec, reshard, sequence_parallel, rows, [(schedule, per_rank)])
        found = first_fit([layout for layout in ladder if runnable(cfg, layout, depth)], evaluate, beyond,
                          probe=functools.partial(evaluate, first_role_only=True))
        outcomes += found
        if repeated_error(outcomes):
            break
        fit = next((o for o in found if o.estimate is not None), None)
        if fit is not None and fit.estimate.overlapped_s <= fit.estimate.compute_s:
            outcomes += [dominated(fit, later) for later in settings[position + 1:]]
            break
    return index, outcomes


def failed(layout: Layout, err: Exception, reason: str = "could not be simulated") -> Outcome:
    """A layout whose simulation raised: a bug of the engine's, kept in the search's report
    rather than ending a search that may have run for an hour."""
    return Outcome(layout, 0, None, reason, error=f"{type(err).__name__}: {err}".strip())


def dominated(fit: Outcome, reshard: str) -> Outcome:
    """The reshard setting `reshard` of `fit`'s ladder, left out (search_job)."""
    e = fit.estimate
    return Outcome(dataclasses.replace(fit.layout, reshard=reshard), 0, None,
                   f"not simulated: reshard_after_forward={fit.layout.reshard} fits with FSDP's collectives "
                   f"hidden ({e.overlapped_s:.3g} s under {e.compute_s:.3g} s of compute), so keeping more "
                   f"gathered cannot shorten the step", simulated=False)


@contextmanager
def search_workers(cfg, jobs: int):
    """A map over search jobs, in completion order: in this process for one worker, else
    in a pool of spawned processes (a fork would copy torch's threads and this process's
    fake process group), each of which first registers the config's plugins and imported
    flavor as the launcher did (engine.plugins.register_model_sources) and simulates with
    one thread, as the cores are shared out by process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = cfg.dryrun.search_workers or min(4, cores)
    workers = min(workers, jobs)
    if workers <= 1:
        yield map
        return
    # common.workers: Ctrl-C is the launcher's alone (it keeps what was found, launch/run.py),
    # and a worker that dies (out of memory) is WorkerDied, not a search that waits for good.
    started = []

    def run(function, tasks):
        started.append(imap(function, tasks, workers, _start_worker, (cfg,), ordered=False))
        return started[-1]

    try:
        yield run
    finally:
        for results in started:
            results.close()


def _start_worker(cfg) -> None:
    import torch
    from engine.plugins import register_model_sources
    torch.set_num_threads(1)
    register_model_sources(cfg)
