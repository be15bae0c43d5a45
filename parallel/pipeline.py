"""Pipeline parallel (`--mesh pp=N`): the model split by blocks into stages, each rank's
stages, and the schedule that runs them (torch.distributed.pipelining).

The split. The plan's blocks, in module order, go in runs of consecutive blocks to
pp x `parallel.pp_stages_per_rank` stages. The first stage also holds the plan's
`stages.first` modules (the embedding), the last its `stages.last` (final norm, output
projection). By default the split is as even as it can be when the embedding and the
output layer each count as one block of work; `parallel.pp_split` gives the blocks of
each stage instead. Every stage holds at least one block, except the first and the
last, which may hold only the embedding and the output layer when there are more
stages than blocks (as Llama 3 405B's 126 blocks ran in 16 x 8 stages).

Stages and ranks. Looped schedules give pp rank r the stages r, r + pp, r + 2pp, ...;
the V-shaped one (ZBVZeroBubble) gives it r and 2pp - 1 - r, so rank 0 holds both the
first and the last stage.

A stage's model (a "part") is a copy of the model on meta with every module it does not
hold removed; a ModuleList of blocks becomes a ModuleDict keyed by the same indices, so
every parameter keeps its name (checkpoints, parity and plans see the names of the
whole model). Its forward is replaced by the stage's computation (parallel.plan.Stages).
The engine's apply order then runs on each part as on a whole model (parallel/apply.py).
A rank that holds several parts trains them through one module, `join_parts`, whose
tree has the whole model's names and holds each part's modules.

Shared parameters (tied embeddings) whose uses land on different stages become one
copy per stage: the copies start from the first stage's values, their gradients are
summed before clipping, and identical updates keep them identical, as Megatron-LM does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from common.errors import UserError
from parallel import pipeline_internals
from parallel.plan import Plan, Stages, expand

SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    # DeepSeek-V3's DualPipe in its V form: ZBV's stages and split backward, with one
    # micro-batch's forward run beside another's backward in its steady state.
    "DualPipeV": ScheduleDualPipeV,
}
SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per rank; the others loop over several
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# Split the backward into input and weight gradients. torch finds a stage's weights in the
# autograd graph by the module's registered parameters; a block resharded after forward
# has its sharded parameters registered there, not the gathered ones the graph used, and
# the weight gradients came out wrong (the parity check measured 9% off in the grad norm
# at pp=2 with reshard_after_forward=true; PASS with false). So these need it false.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
DOCS = "docs/parallelism.md, \"Pipeline parallel\""


# -- the split ------------------------------------------------------------------------------

def even_split(blocks: int, stages: int, ends: tuple[bool, bool] = (False, False)) -> list[int]:
    """Blocks per stage, minimising the largest stage when the first stage also carries the
    embedding and the last the output layer, one block of work each. Each block goes to
    the lightest stage (the earliest among equals). Every stage holds at least one block,
    except that with more stages than blocks an end that `ends` allows (first, last) holds
    only its embedding or output layer: Llama 3 405B's 126 blocks in 128 stages."""
    empty = [stage for stage, allowed in ((0, ends[0]), (stages - 1, ends[1])) if allowed][:max(0, stages - blocks)]
    if stages > blocks and len(empty) == stages - blocks:  # the output is the heavier end: it keeps a block first
        return [0 if stage in empty else 1 for stage in range(stages)]
    counts = [1] * stages
    extra = [0] * stages
    extra[0] += 1
    extra[-1] += 1
    for _ in range(blocks - stages):
        lightest = min(range(stages), key=lambda s: (counts[s] + extra[s], s))
        counts[lightest] += 1
    return counts


def empty_ends(stages: Stages | None) -> tuple[bool, bool]:
    """Which end stages may hold no block: those that hold modules of their own."""
    return (bool(stages.first), bool(stages.last)) if stages is not None else (False, False)


def blocks_per_stage(blocks: int, pp: int, per_rank: int, explicit: str = "",
                     ends: tuple[bool, bool] = (False, False)) -> list[int]:
    """The split: `parallel.pp_split` when given, else the even one. UserError if it cannot
    be. `ends`: whether the first and the last stage may hold no block (empty_ends)."""
    stages = pp * per_rank
    most = blocks + sum(ends)
    if not explicit:
        if stages > most:
            raise UserError(
                f"pp={pp} x parallel.pp_stages_per_rank={per_rank} = {stages} pipeline stages, but the model "
                f"has {blocks} blocks and every stage needs at least one (the first and the last may hold only "
                f"the embedding and the output layer). Use a pp (times stages per rank) of at most {most}, or a "
                f"deeper model (parity.layers for --parity).")
        return even_split(blocks, stages, ends)
    try:
        counts = [int(part) for part in explicit.split(",")]
    except ValueError:
        counts = []
    least = [0 if (stage == 0 and ends[0]) or (stage == stages - 1 and ends[1]) else 1 for stage in range(stages)]
    if len(counts) != stages or any(c < low for c, low in zip(counts, least)) or sum(counts) != blocks:
        ends_note = " (0 allowed for the first and the last stage, which hold the embedding and the output layer)"
        raise UserError(
            f"parallel.pp_split={explicit!r} must give the blocks of each of the {stages} stages (pp={pp} x "
            f"parallel.pp_stages_per_rank={per_rank}), comma-separated, at least 1 each"
            f"{ends_note if any(ends) else ''} and {blocks} in all, "
            f"for example {','.join(map(str, even_split(blocks, stages, ends))) if stages <= most else '...'} "
            f"(the even split, which leaving pp_split empty gives).")
    return counts


def stages_of_rank(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + s * pp for s in range(per_rank)]


def runs_on_backend(schedule: str, backend: str | None) -> bool:
    """torch before 2.13 opens a looped schedule by sending every stage's neighbours a
    message, and in a V the turn (stages pp-1 and pp) lies on one rank, which gloo cannot
    send to (torch 2.11: "Pair is not connected"). torch 2.13 opens it without messages to
    itself. `backend` None: nothing will run (the dry run)."""
    return not (schedule in V_SHAPED and backend == "gloo" and torch.__version__ < "2.13")


def check_settings(plan: Plan, model: nn.Module, pp: int, options, micro_batches: int,
                   backend: str | None = None) -> list[int]:
    """Everything about pipeline parallel that can be refused before any process group:
    the plan's stages, the schedule against the stages per rank and the backend, the
    split, what the zero-bubble schedules cannot run with, the micro-batches the schedule
    needs. Returns the split (blocks per stage)."""
    schedule, per_rank = options.pp_schedule, options.pp_stages_per_rank
    pipeline_internals.check_supported()
    if not runs_on_backend(schedule, backend):
        raise UserError(f"parallel.pp_schedule={schedule} cannot run over gloo (CPU) on torch {torch.__version__}: "
                        f"it starts by sending a message from one of its ranks to the same rank, which gloo "
                        f"cannot do; torch 2.13 and newer start it another way. Use InterleavedZeroBubble (the "
                        f"same zero-bubble backward, looped instead of V-shaped), run on CUDA, or use torch >= 2.13.")
    if plan.stages is None:
        raise UserError(f"plan {plan.name!r} does not say how its model splits into pipeline stages, so pp={pp} "
                        f"cannot apply. Give the plan stages=Stages(first=..., last=...) (docs/plans.md, "
                        f"\"Pipeline stages\"), or use a mesh without pp.")
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise UserError(f"parallel.pp_schedule={schedule} runs one stage per rank, but parallel.pp_stages_per_rank="
                        f"{per_rank}. Set pp_stages_per_rank=1, or pick a looped schedule (Interleaved1F1B, "
                        f"InterleavedZeroBubble, ZBVZeroBubble).")
    if schedule in V_SHAPED and per_rank != 2:
        raise UserError(f"parallel.pp_schedule={schedule} needs exactly 2 stages per rank (a V: rank r holds stages "
                        f"r and 2pp-1-r), but parallel.pp_stages_per_rank={per_rank}. Set it to 2.")
    if schedule not in SINGLE_STAGE and per_rank < 2:
        raise UserError(f"parallel.pp_schedule={schedule} loops over several stages per rank, but parallel."
                        f"pp_stages_per_rank=1. Set it to 2 or more, or use GPipe or 1F1B.")
    _check_stages_cover_the_model(plan, model)
    split = blocks_per_stage(len(expand(model, plan.blocks, plan.name)), pp, per_rank, options.pp_split,
                             empty_ends(plan.stages))
    if schedule in ZERO_BUBBLE and (options.reshard_after_forward is not False or options.root_reshard_after_forward):
        raise UserError(f"parallel.pp_schedule={schedule} splits each backward into input and weight gradients, "
                        f"which gives wrong weight gradients for blocks resharded after forward (torch looks "
                        f"their weights up among the sharded parameters), and parallel.reshard_after_forward="
                        f"{options.reshard_after_forward}. Set parallel.reshard_after_forward=false (and "
                        f"root_reshard_after_forward=false), or use 1F1B, GPipe or Interleaved1F1B.")
    if schedule in ZERO_BUBBLE and options.compile:
        raise UserError(f"parallel.pp_schedule={schedule} cannot run compiled blocks: its split backward keeps "
                        f"each block's graph for a second pass, which a compiled backward does not allow (torch "
                        f"refuses torch.compile with its zero-bubble schedules). Set parallel.compile=false, or "
                        f"use 1F1B, GPipe or Interleaved1F1B with compile.")
    if schedule in ZERO_BUBBLE and options.activation_checkpoint == "op":
        raise UserError(f"parallel.pp_schedule={schedule} runs a second backward pass over each block (its weight "
                        f"gradients), which torch's selective activation checkpointing forbids (\"You are only "
                        f"allowed to backward once on any region computed under selective activation "
                        f"checkpoint\"), and parallel.activation_checkpoint=op is selective. Use none, full or "
                        f"selective (whole blocks) with this schedule, or 1F1B, GPipe or Interleaved1F1B with op.")
    needed = micro_batches_needed(schedule, pp, per_rank, micro_batches)
    if needed:
        raise UserError(f"training.micro_batches={micro_batches} is not what parallel.pp_schedule={schedule} "
                        f"runs with pp={pp}: it needs {needed}. Change training.micro_batches (and "
                        f"training.global_batch with it if it must divide), or pick GPipe, which runs any number.")
    return split


def micro_batches_needed(schedule: str, pp: int, per_rank: int, micro_batches: int) -> str:
    """Why torch's schedule would refuse this many micro-batches, or "" when it runs them."""
    if schedule == "1F1B" and micro_batches < pp:
        return f"at least one per stage, {pp}"
    if schedule == "DualPipeV" and micro_batches < 2 * pp:
        return f"at least one per stage, {2 * pp} (2 stages on each of pp={pp} ranks)"
    rounds = max(1, micro_batches // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and micro_batches % rounds:
        return f"rounds of pp={pp} micro-batches, so a multiple of {rounds} (training.micro_batches // pp)"
    return ""


def _check_stages_cover_the_model(plan: Plan, model: nn.Module) -> None:
    """Every parameter lives in a block or in a module the stages name; none hangs off a
    module that several stages share (the model itself, or the blocks' container)."""
    stages = plan.stages
    for path in (*stages.first, *stages.last):
        expand(model, path, plan.name)
    held = set(expand(model, plan.blocks, plan.name)) | set(stages.first) | set(stages.last)
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(owner == path or owner.startswith(path + ".") for path in held):
            raise UserError(
                f"plan {plan.name!r}: parameter {name!r} is in no block and in no module that stages.first or "
                f"stages.last names, so no pipeline stage would hold it. Add its module to stages.first (if it "
                f"runs before the blocks) or stages.last (after them); see docs/plans.md, \"Pipeline stages\".")


# -- one stage's part of the model ----------------------------------------------------------

def tie_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that appears under several names, first name first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _has_parameter(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make the names of each group that this part holds one parameter again: what the
    model's own tie_weights() does, for a part that may lack some of the modules."""
    for group in groups:
        present = [name for name in group if _has_parameter(model, name)]
        for name in present[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(present[0]))


def _prune(module: nn.Module, keep: set[str], prefix: str = "") -> None:
    for name in list(module._modules):
        path = f"{prefix}{name}"
        child = module._modules[name]
        if path in keep:
            continue
        if not any(k.startswith(path + ".") for k in keep):
            del module._modules[name]
            continue
        if isinstance(child, nn.ModuleList):  # same names, but a stage keeps only some indices
            child = module._modules[name] = nn.ModuleDict(child._modules)
        _prune(child, keep, path + ".")


def _run_in_turn(model: nn.Module, paths: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
    for path in paths:
        x = model.get_submodule(path)(x)
    return x


def stage_functions(stages: Stages):
    """(embed, block, head) of parallel.plan.Stages, the defaults filled in."""
    embed = stages.embed or (lambda m, tokens, positions: _run_in_turn(m, stages.first, tokens))
    block = stages.block or (lambda m, b, h, positions: b(h))
    head = stages.head or (lambda m, h: _run_in_turn(m, stages.last, h))
    return embed, block, head


def stage_forward(model: nn.Module, stages: Stages, blocks: list[nn.Module], first: bool, last: bool):
    """The computation of one stage on its part `model` (parallel.plan.Stages). `positions`,
    each local token's position in its sequence, comes from context parallelism's hook
    (parallel/context.py); None means 0, 1, ..."""
    embed, block, head = stage_functions(stages)

    def forward(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if first:
            x = embed(model, x, positions)
        for module in blocks:
            x = block(model, module, x, positions)
        return head(model, x) if last else x

    return forward


def split_part(model: nn.Module, plan: Plan, block_paths: list[str], stage: int, n_stages: int,
               sequence_split: int = 1) -> nn.Module:
    """Stage `stage`'s part: a copy of the meta `model` holding only `block_paths` (and the
    embedding or the output when it is the first or last stage). `sequence_split`: how many
    pieces of each sequence the hidden state a later stage receives is (tp with sequence
    parallel), so that the part knows its tokens' number (context parallel's positions)."""
    stages, first, last = plan.stages, stage == 0, stage == n_stages - 1
    keep = set(block_paths) | (set(stages.first) if first else set()) | (set(stages.last) if last else set())
    groups = tie_groups(model)
    part = copy.deepcopy(model)
    _prune(part, keep)
    part.stage_index = stage
    part.sequence_split = 1 if first else sequence_split
    part.forward = stage_forward(part, stages, [part.get_submodule(p) for p in block_paths], first, last)
    part.tie_weights = lambda: retie(part, groups)
    return part


def stage_blocks(model: nn.Module, plan: Plan, pp: int, options) -> list[list[str]]:
    """The block paths of each stage."""
    paths = expand(model, plan.blocks, plan.name)
    counts = blocks_per_stage(len(paths), pp, options.pp_stages_per_rank, options.pp_split, empty_ends(plan.stages))
    starts = [sum(counts[:stage]) for stage in range(len(counts))]
    return [paths[start:start + count] for start, count in zip(starts, counts)]


def split_into_parts(model: nn.Module, plan: Plan, pp: int, pp_rank: int, options, tp: int = 1) -> list[nn.Module]:
    split = stage_blocks(model, plan, pp, options)
    sequence_split = tp if options.sequence_parallel else 1
    return [split_part(model, plan, split[stage], stage, len(split), sequence_split)
            for stage in stages_of_rank(pp_rank, pp, options.pp_stages_per_rank, options.pp_schedule)]


def join_parts(parts: list[nn.Module]) -> nn.Module:
    """One module over several parts whose tree has the whole model's names: a path that
    one part holds is that part's module itself; a path several parts share (the model,
    the blocks' container) is a new container for what they hold under it."""
    if len(parts) == 1:
        return parts[0]

    def merge(sources: list[nn.Module]) -> nn.Module:
        joined = nn.Module()
        names = dict.fromkeys(name for source in sources for name in source._modules)
        for name in names:
            holders = [source._modules[name] for source in sources if name in source._modules]
            joined.add_module(name, holders[0] if len(holders) == 1 else merge(holders))
        return joined

    return merge(parts)


# -- the running pipeline --------------------------------------------------------------------

@dataclass
class TiedCopies:
    """One group of shared parameter names whose uses fall on several stages."""
    names: list[str]
    local: list[tuple[nn.Module, str]]  # this rank's copies: (part, the first of the names it holds)
    group: object = None  # the ranks holding copies, at this rank's other coordinates (None: all here)
    source: int = 0  # the global rank holding the canonical copy (the first name's)


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them; hangs off the trained module
    as `module.pipeline`."""

    parts: list[nn.Module]
    stage_indices: list[int]
    stage_blocks: list[list[str]]  # the block paths of every stage, this rank's or not
    schedule_name: str
    stages: Stages
    whole: nn.Module  # the whole model, on meta: shapes, FLOPs, names
    group: object  # the pp process group
    sequence_parallel: bool
    loss_parallel: bool
    tp: int
    param_dtype: torch.dtype
    ties: list[TiedCopies] = field(default_factory=list)
    _built: tuple | None = None

    @property
    def n_stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_indices

    def stage_of(self, path: str) -> int:
        """The stage that holds module `path` (a block, something in one, or a first or last module)."""
        def within(module: str) -> bool:
            return path == module or path.startswith(module + ".")
        if any(within(m) for m in self.stages.first):
            return 0
        if any(within(m) for m in self.stages.last):
            return self.n_stages - 1
        return next((stage for stage, blocks in enumerate(self.stage_blocks) if any(within(b) for b in blocks)), -1)

    def copies(self) -> set[str]:
        """Names of this rank's parameters that are a second copy of a shared one."""
        return {name for tie in self.ties for _, name in tie.local if name != tie.names[0]}

    def schedule(self, micro_batches: int, loss, inputs: torch.Tensor):
        """The schedule for this many micro-batches of `inputs`' shape, built on first use."""
        key = (micro_batches, loss, tuple(inputs.shape), inputs.device)
        if self._built is None or self._built[0] != key:
            self._built = (key, self._make_schedule(micro_batches, loss, inputs))
        return self._built[1]

    def _shapes(self, micro_rows: int, seq_len: int, device) -> tuple:
        """Meta tensors of a micro-batch: tokens, the hidden state between stages (each as
        this rank holds it), the logits, so the stages need not infer them at run time. The
        logits never cross ranks; torch 2.11 checks the last stage's output against them,
        by its shape, which for vocabulary-sharded logits (a DTensor) is the whole one."""
        tokens = torch.zeros(micro_rows, seq_len, dtype=torch.long, device="meta")
        hidden = self._embed_on_meta(tokens)
        logits = self._head_on_meta(hidden)
        if self.sequence_parallel and self.tp > 1:  # received into this shape, so contiguous
            hidden = hidden.tensor_split(self.tp, dim=1)[0].contiguous()
        # The activations carry gradients back: the stages derive what they receive in
        # backward from whether what they send requires grad.
        return tokens, hidden.to(self.param_dtype).requires_grad_(), logits.to(self.param_dtype).requires_grad_()

    def _embed_on_meta(self, tokens):
        embed, _, _ = stage_functions(self.stages)
        with torch.no_grad():
            return embed(self.whole, tokens, None)

    def _head_on_meta(self, hidden):
        _, _, head = stage_functions(self.stages)
        with torch.no_grad():
            return head(self.whole, hidden)

    def _make_schedule(self, micro_batches: int, loss, inputs: torch.Tensor):
        rows, seq_len = inputs.shape
        tokens, hidden, logits = self._shapes(rows // micro_batches, seq_len, inputs.device)
        built = []
        stage_class = pipeline_internals.stage_class()  # messages' buffers only while in use
        for part, index in zip(self.parts, self.stage_indices):
            stage_in = tokens if index == 0 else hidden
            stage_out = logits if index == self.n_stages - 1 else hidden
            built.append(stage_class(part, index, self.n_stages, inputs.device, input_args=stage_in,
                                     output_args=stage_out, group=self.group))
        schedule = SCHEDULES[self.schedule_name]
        stages = built[0] if self.schedule_name in SINGLE_STAGE else built
        return pipeline_internals.releasing_forward_sends(
            schedule(stages, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False))

    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int, loss) -> torch.Tensor:
        """The loss of each micro-batch, summed, on the ranks holding the last stage (0
        elsewhere), running the stages one after the other with a blocking message across
        each boundary between ranks. For evaluation: torch's looped schedules also walk
        their backward actions in eval() and fail where two neighbouring stages share a
        rank (ZBVZeroBubble, torch 2.13), and an evaluation has no bubble to fill."""
        pp_rank, per_stage = dist.get_rank(self.group), dist.get_world_size() // dist.get_world_size(self.group)
        holder = {stage: rank for rank in range(dist.get_world_size(self.group))
                  for stage in stages_of_rank(rank, dist.get_world_size(self.group), len(self.parts),
                                              self.schedule_name)}
        part_of = dict(zip(self.stage_indices, self.parts))
        tokens, hidden, _ = self._shapes(inputs.shape[0] // micro_batches, inputs.shape[1], inputs.device)
        total = torch.zeros((), device=inputs.device)
        for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
            for stage in range(self.n_stages):
                if holder[stage] != pp_rank:
                    continue
                if stage > 0 and holder[stage - 1] != pp_rank:
                    x = torch.empty(hidden.shape, dtype=hidden.dtype, device=inputs.device)
                    dist.recv(x, src=dist.get_rank() + (holder[stage - 1] - pp_rank) * per_stage, group=self.group)
                x = part_of[stage](x)
                if stage == self.n_stages - 1:
                    share = loss(x, y)
                    total += share.full_tensor() if hasattr(share, "full_tensor") else share
                elif holder[stage + 1] != pp_rank:
                    dist.send(x.contiguous(), dst=dist.get_rank() + (holder[stage + 1] - pp_rank) * per_stage,
                              group=self.group)
        return total

    def gather_on_rank0(self, found: dict) -> dict:
        """Every stage's `found` (a dict the same on all ranks of a stage), merged on rank 0;
        {} elsewhere. The first rank of each stage (its coordinate 0 on hsdp, dp and tp,
        which are the members of rank 0's pp group, pp being outermost) sends its own."""
        per_stage = dist.get_world_size() // dist.get_world_size(self.group)
        if dist.get_rank() % per_stage:
            return {}
        stages = [None] * dist.get_world_size(self.group) if dist.get_rank() == 0 else None
        dist.gather_object(found, stages, dst=0, group=self.group)
        return {key: value for stage in stages for key, value in stage.items()} if stages else {}

    def held_ties(self) -> list[TiedCopies]:
        """The ties this rank holds a copy of: a middle stage of 3 or more may hold none (it is
        then in no tie's group)."""
        return [tie for tie in self.ties if tie.local]

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Every copy of a shared parameter takes the canonical copy's values: a broadcast
        from the stage that holds the first of its names."""
        for tie in self.held_ties():
            values = [_local(part.get_parameter(name)) for part, name in tie.local]
            canonical = next((v for (_, name), v in zip(tie.local, values) if name == tie.names[0]), values[0])
            if tie.group is not None:
                dist.broadcast(canonical, src=tie.source, group=tie.group)
            for value in values:
                if value is not canonical:
                    value.copy_(canonical)

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """Each copy's gradient becomes the sum over all copies: the gradient of the one
        shared parameter."""
        for tie in self.held_ties():
            grads = [_local(part.get_parameter(name).grad) for part, name in tie.local]
            total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for grad in grads:
                grad.copy_(total)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def find_ties(parts: list[nn.Module], whole: nn.Module, plan: Plan, dims, options) -> list[TiedCopies]:
    """The shared parameters whose uses fall on different stages, with the process groups
    that join their holders (every rank builds all of them, in the same order)."""
    spec = dims.spec
    split = stage_blocks(whole, plan, spec.pp, options)
    held = {**{path: stage for stage, paths in enumerate(split) for path in paths},
            **dict.fromkeys(plan.stages.first, 0), **dict.fromkeys(plan.stages.last, len(split) - 1)}
    rank_of = {stage: rank for rank in range(spec.pp)
               for stage in stages_of_rank(rank, spec.pp, options.pp_stages_per_rank, options.pp_schedule)}

    def holder(name: str) -> int:
        return rank_of[next(stage for path, stage in held.items() if name.startswith(path + "."))]

    ties = []
    for names in tie_groups(whole):
        holders = list(dict.fromkeys(holder(name) for name in names))  # the canonical copy's first
        stages = {next(s for p, s in held.items() if name.startswith(p + ".")) for name in names}
        if len(stages) < 2:
            continue
        local = []
        for part in parts:
            present = [name for name in names if _has_parameter(part, name)]
            if present:
                local.append((part, present[0]))
        tie = TiedCopies(names, local)
        if len(holders) > 1:
            tie.group = _holder_group(dims, holders)
            per_stage = spec.world_size // spec.pp  # pp is outermost
            tie.source = dist.get_rank() + (holders[0] - dims.pp.get_local_rank()) * per_stage
        ties.append(tie)
    return ties


def _holder_group(dims, holders: list[int]):
    """The group of pp ranks `holders` at this rank's coordinates of the other dimensions."""
    rows = dims.world.mesh[holders].reshape(len(holders), -1).T.tolist()
    mine, _ = dist.new_subgroups_by_enumeration(rows)
    return mine


def build_pipeline(parts: list[nn.Module], model: nn.Module, plan: Plan, dims, options) -> Pipeline:
    """The Pipeline of this rank's `parts` of `model` (the whole model, on meta)."""
    return Pipeline(parts=parts, stage_indices=[part.stage_index for part in parts],
                    stage_blocks=stage_blocks(model, plan, dims.spec.pp, options),
                    schedule_name=options.pp_schedule, stages=plan.stages, whole=model, group=dims.pp.get_group(),
                    sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel,
                    tp=dims.spec.tp,
                    param_dtype=getattr(torch, options.param_dtype),
                    ties=find_ties(parts, model, plan, dims, options))


def parts_of(model: nn.Module) -> list[nn.Module]:
    """The modules that own this rank's parameters as whole models: its stages' parts, or
    the model itself without pipeline parallel."""
    pipeline = getattr(model, "pipeline", None)
    return pipeline.parts if pipeline is not None else [model]


def sync_tied_weights(model: nn.Module) -> None:
    """After the weights are set (materialised, imported, loaded): every stage's copy of a
    shared parameter takes the canonical values. Nothing to do without pipeline parallel."""
    pipeline = getattr(model, "pipeline", None)
    if pipeline is not None:
        pipeline.sync_tied_weights()


def whole_model(model: nn.Module) -> nn.Module:
    """The whole model (on meta under pipeline parallel): for its shapes, FLOPs and vocabulary."""
    pipeline = getattr(model, "pipeline", None)
    return pipeline.whole if pipeline is not None else model
