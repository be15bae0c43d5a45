"""Applies a plan to a meta-device model. The order lives here and only here:

0. with pp > 1, the model splits into this rank's pipeline stages (parallel/pipeline.py),
   each a part of the model that keeps only its own blocks (and the embedding on the first
   stage, the output on the last); steps 1 to 7 then apply to each part as to a model,
1. tensor parallel (+ sequence and loss parallel) on the TP sub-mesh, then, with cp > 1,
   attention across the cp ranks (parallel/context.py), then, with ep > 1, the experts
   split over the ep ranks (parallel/expert.py),
2. activation checkpointing, per block; the blocks it leaves alone recompute their cheap
   activations (norms, products, sequence-parallel gathers) in backward, per sublayer,
3. torch.compile, per block,
4. fully_shard on every block (with the reshard-after-forward setting); with ep > 1 each
   block's experts first, over the expert-dp ranks (where there is more than one, or
   offload: shard_experts),
5. fully_shard on the root, which takes the remaining parameters; every unit sharded
   over one rank reduces its gradients in place (parallel/fsdp_internals.py),
6. explicit prefetch lists, when the config asks for them (parallel/prefetch.py),
7. with fault-tolerant replica groups, every FSDP unit's gradients averaged across the
   groups through torchft after its reduce-scatter (parallel/replicas.py).

AC sits inside compile and both inside FSDP, so FSDP's all-gathers stay outside
the recomputed and compiled regions. The cp step comes right after TP, so AC and
compile wrap the attention across cp ranks as they wrap the rest of the block.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.config import ParallelConfig
from parallel.context import apply_context_parallel
from parallel.embedding import vocab_parallel_styles
from parallel.recompute import free_until_backward, recomputable
from parallel.expert import apply_expert_parallel, expert_paths as all_expert_paths, expert_placement
from parallel.float8 import check_shapes, convert_to_float8, float8_linears
from parallel.mesh import ParallelDims
from parallel.pipeline import ZERO_BUBBLE, build_pipeline, join_parts, split_into_parts
from parallel.plan import Plan, expand
from parallel.prefetch import apply_prefetch, prefetch_order
from parallel.validate import validate_plan
from parallel.fsdp_internals import install_post_forward_mesh, reduce_in_place, reduces_in_place
from parallel.reshard import build_post_forward_mesh, needs_own_post_forward_mesh, resolve_reshard

# Op-level selective AC keeps the results of these (the expensive ones) and recomputes the rest.
SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
} | ({torch.ops.aten._grouped_mm.default} if hasattr(torch.ops.aten, "_grouped_mm") else set())  # the experts'


def tensor_parallel_styles(model: nn.Module, plan: Plan, options: ParallelConfig) -> dict:
    """Concrete module path -> style, after the SP overlay and the output's style; an
    nn.Embedding split by rows computes its own rows' gradient (parallel/embedding.py)."""
    patterns = dict(plan.tensor_parallel)
    if options.sequence_parallel:
        patterns.update(plan.sequence_parallel)
    styles = {path: style for pattern, style in patterns.items()
              for path in expand(model, pattern, plan.name)}
    if plan.output is not None and expand(model, plan.output, plan.name):
        styles[plan.output] = ColwiseParallel(
            input_layouts=Shard(1) if options.sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if options.loss_parallel else Replicate(),
            use_local_output=not options.loss_parallel)
    return vocab_parallel_styles(model, styles)


def apply_tensor_parallel(model: nn.Module, plan: Plan, dims: ParallelDims,
                          options: ParallelConfig) -> dict:
    styles = tensor_parallel_styles(model, plan, options)
    validate_plan(model, plan, styles, dims.spec.tp, options.sequence_parallel)
    parallelize_module(model, dims.tp, styles)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # TP replaced the parameters, which breaks any sharing
    return styles


def apply_float8(model: nn.Module, block_paths: list[str], plan: Plan, dims: ParallelDims,
                 options: ParallelConfig, emulate: bool) -> list[str]:
    """Before tensor parallel, which then splits each Float8Linear as it would a Linear."""
    linears = float8_linears(model, block_paths, plan.float8_skip)
    check_shapes(model, linears, tensor_parallel_styles(model, plan, options) if dims.tp_enabled else {},
                 dims.spec.tp)
    convert_to_float8(model, linears, options.float8, options.float8_all_gather, emulate)
    return linears


def _draws_random_numbers(op) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def checkpoint_policy(op_level: bool, compiled: bool):
    """What a checkpointed block saves, as a selective-checkpoint policy; None recomputes
    everything. `op` keeps the results of SAVED_OPS.

    A compiled block never recomputes an op that draws random numbers (SDPA counts,
    even without dropout): on torch 2.13, AOT autograd replays such an op by saving
    its RNG state, and it appends that state after the DeviceMesh that DTensor (TP)
    inputs bring into the graph, so the saved values are read back shifted by one and
    the first forward fails with "expected all tensors_saved_with_vc_check to be
    Tensors ... DeviceMesh". Saving the op's output instead leaves the numbers as
    they were (docs/parallelism.md, "compile, activation checkpointing and TP")."""
    if not (op_level or compiled):
        return None

    def policy(ctx, op, *args, **kwargs):
        keep = (op_level and op in SAVED_OPS) or (compiled and _draws_random_numbers(op))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_block(block: nn.Module, policy=None) -> None:
    """Recompute the block's activations in backward, except what `policy` saves.
    Wrapping `forward` in place keeps parameter names unchanged, so checkpoints and
    plans see the same paths."""
    forward = block.forward
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)} if policy else {}

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = checkpointed


def contracts_over_a_shard(op, args) -> bool:
    """Whether a matmul sums over a tensor-parallel shard: a row-parallel linear, whose
    output is a partial sum over the whole sequence that a reduction follows at once and
    that no backward reads. (Eager only: a compiled graph sees plain tensors, and its
    partitioner keeps only what the backward reads.)"""
    operand = args[1] if op is torch.ops.aten.addmm.default else args[0]
    return isinstance(operand, DTensor) and any(
        isinstance(p, Shard) and p.dim in (-1, operand.ndim - 1) for p in operand.placements)


def sublayer_policy(compiled: bool):
    """What a sublayer recomputed in backward keeps: the outputs of its matmuls (but not a
    row-parallel one's partial sum) and of attention. Norms, SiLU and its product, rotary
    embeddings, layout copies and the all-gathers of sequence parallelism are computed
    again from the sublayer's input, which its caller keeps (the residual stream: a
    sequence shard under SP). A linear then keeps the shard it was given, not the gathered
    sequence, as Megatron's sequence-parallel linears do."""
    def policy(ctx, op, *args, **kwargs):
        keep = ((op in SAVED_OPS and not contracts_over_a_shard(op, args))
                or (compiled and _draws_random_numbers(op)))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@functools.cache
def recomputed_class(base: type, compiled: bool, output_recomputable: bool = False,
                     frees_inputs: bool = False) -> type:
    """`base` with a __call__ that runs the module's whole call under a selective checkpoint
    (sublayer_policy): its hooks too, where tensor parallel's styles gather their inputs.
    One class per module class, so torch.compile sees the same class in every block and
    compiles one graph for them all (a class per module recompiled every block).
    `output_recomputable`: the output is registered to be freed by the sublayer that reads
    it, which `frees_inputs` does (eager only)."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, sublayer_policy(compiled))

    def __call__(self, *args, **kwargs):
        call = super(recomputed, self).__call__
        output = checkpoint(call, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        if torch.is_grad_enabled():
            if output_recomputable:
                recomputable(output, functools.partial(call, *args, **kwargs))
            if frees_inputs:
                free_until_backward(args, output)
        return output

    recomputed = type(f"Recomputed{base.__name__}", (base,), {"__call__": __call__})
    return recomputed


def recompute_call(module: nn.Module, compiled: bool, output_recomputable: bool = False,
                   frees_inputs: bool = False) -> None:
    """Recompute `module`'s cheap activations in backward. Its class becomes a subclass
    (recomputed_class), as fully_shard swaps a block's class, so parameter names, the state
    dict and the plan's paths stay as they were; early stop ends the recompute before the
    sublayer's last matmul."""
    module.__class__ = recomputed_class(type(module), compiled, output_recomputable, frees_inputs)


def sublayer_patterns(plan: Plan) -> tuple[str, ...]:
    """The plan's sublayers; for a plan that names none, the modules its sequence-parallel
    overlay gathers the sequence into (their linears would keep the gathered input)."""
    return plan.sublayers or tuple(path for path, style in plan.sequence_parallel.items()
                                   if isinstance(style, PrepareModuleInput))


def recomputes_cheap_activations(options: ParallelConfig, pp: int) -> bool:
    """A zero-bubble schedule runs a second backward over each block (its weight
    gradients), which a selective checkpoint forbids: there the activations stay."""
    return options.recompute_cheap and not (pp > 1 and options.pp_schedule in ZERO_BUBBLE)


def outside_units(model: nn.Module, path: str, units: list[str]) -> list[str]:
    """`path` when it holds none of `units` (modules that are FSDP units of their own: the
    experts under ep), else those of its descendants that hold none, largest first. A
    selective checkpoint must not contain another FSDP unit's hooks: recomputed in
    backward, FSDP runs them another way (its root pre-forward once more), and the
    checkpoint stops at an op it did not see in forward (torch 2.13)."""
    if not any(unit == path or unit.startswith(path + ".") for unit in units):
        return [path]
    if path in units:
        return []
    return [region for name, _ in model.get_submodule(path).named_children()
            for region in outside_units(model, f"{path}.{name}", units)]


def checkpointed_blocks(block_paths: list[str], options: ParallelConfig) -> list[str]:
    """Of one model part's blocks (a stage's, under pp), those activation checkpointing
    wraps: all of them with `full` or `op`, every `checkpoint_every`-th with `selective`,
    counted from the part's first block."""
    mode = options.activation_checkpoint
    return [path for index, path in enumerate(block_paths)
            if mode in ("full", "op") or (mode == "selective" and index % options.checkpoint_every == 0)]


def apply_activation_checkpoint(block_paths: list[str], model: nn.Module, plan: Plan, options: ParallelConfig,
                                pp: int, cp_cores: list[str], units: list[str] = ()) -> tuple[list[str], list[str]]:
    """Checkpoint the blocks the mode picks; in the others, recompute each sublayer's cheap
    activations. Returns (checkpointed blocks, recomputed sublayers).

    Compiled, a sublayer that holds a context-parallel attention core (`cp_cores`) keeps
    its activations: the core gathers keys and values outside the graph (a graph break),
    which a checkpoint inside a compiled block cannot hold; torch then ran the sublayer
    eagerly among the compiled parts, and cp x tp ranks waited on each other's
    collectives for ever (torch 2.13).

    `units`: modules sharded by FSDP on their own inside the blocks (the experts under
    ep). A selective checkpoint (a policy) then covers the rest of each block or sublayer
    (outside_units), and the units keep their activations."""
    mode = options.activation_checkpoint
    chosen = checkpointed_blocks(block_paths, options)
    policy = checkpoint_policy(op_level=mode == "op", compiled=options.compile)
    for path in chosen:
        for region in outside_units(model, path, units) if policy else [path]:
            checkpoint_block(model.get_submodule(region), policy)
    sublayers = []
    if recomputes_cheap_activations(options, pp):
        inside = lambda path, outer: any(path.startswith(o + ".") for o in outer)
        graph_breaks = cp_cores if options.compile else []
        sublayers = [path for pattern in sublayer_patterns(plan) for path in expand(model, pattern, plan.name)
                     if not inside(path, chosen) and not any(inside(core, [path]) for core in graph_breaks)]
        # Eager only: a compiled graph cannot free storage in place, and its partitioner
        # recomputes norms on its own.
        freeable = set() if options.compile else {
            path for pattern in plan.recomputed_outputs for path in expand(model, pattern, plan.name)}
        for path in sublayers:
            regions = outside_units(model, path, units)
            whole = regions == [path]  # a region that is part of a sublayer does not see all its input's readers
            for region in regions:
                recompute_call(model.get_submodule(region), options.compile,
                               output_recomputable=whole and path in freeable,
                               frees_inputs=whole and not options.compile)
    return chosen, sublayers


def _clone_output(module, inputs, output):
    return output.clone()


# Marks the engine's part of torch's compile cache-key tag, after any tag of the user's own.
LAYOUT_TAG = " meshtrain-layout:"


def key_compile_cache_on_layout(dims: ParallelDims) -> None:
    """Key torch's compile caches on this rank's place in the mesh and on its process
    groups' names. torch's AOT autograd cache hashes a DeviceMesh by its shape alone,
    while the code it stores names this rank's process groups and its coordinates as
    constants (pytorch/pytorch#188390). All ranks of a machine share the cache, so on a
    warm one a rank loaded a graph another rank had compiled, and its all-gather named a
    tp group this rank is not in (torch 2.13: "Could not resolve the process group
    registered under the name 16", compiled cp x tp, every run after the first)."""
    import torch.distributed as dist
    meshes = (dims.world, dims.fsdp, dims.data, *((dims.ep, dims.expert_fsdp) if dims.ep is not None else ()))
    names = [mesh.get_group(dim).group_name for mesh in meshes for dim in range(mesh.ndim)]
    user_tag = torch.compiler.config.cache_key_tag.split(LAYOUT_TAG)[0]
    torch.compiler.config.cache_key_tag = (f"{user_tag}{LAYOUT_TAG}rank {dist.get_rank()} of {dist.get_world_size()}, "
                                           f"mesh {dims.spec}, groups {','.join(names)}")


def apply_compile(model: nn.Module, blocks: list[nn.Module], tp_paths: list[str],
                  block_paths: list[str], dims: ParallelDims) -> None:
    key_compile_cache_on_layout(dims)
    for block in blocks:
        block.compile()
    # torch 2.13: a compiled block whose input comes straight out of a TP module
    # (the embedding's all-reduced output) gets a zero gradient for that module's
    # weight. Handing the block a fresh tensor avoids it (shared/research finding).
    outside = [p for p in tp_paths if not any(p == b or p.startswith(b + ".") for b in block_paths)]
    for path in outside:
        model.get_submodule(path).register_forward_hook(_clone_output)


def fsdp_policies(options: ParallelConfig, device_type: str) -> dict:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    policies = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtypes[options.param_dtype],
                                                  reduce_dtype=dtypes[options.reduce_dtype])}
    policies["offload_policy"] = (CPUOffloadPolicy(pin_memory=device_type == "cuda")
                                  if options.offload else OffloadPolicy())
    return policies


def shard_experts(dims: ParallelDims, options: ParallelConfig) -> bool:
    """Whether FSDP takes the experts (split over ep) over their own data ranks: where it
    has something to do, more than one rank to shard over and average with, or offload.
    Over one rank it would only copy (and cast) the experts' weights in and their gradients
    out each step: at dp=4,ep=4 on CPU the debug-moe step against a hand-written script went
    from 1.073 to 1.027 without it (docs/benchmarks.md); there the experts stay
    whole ep shards and cast themselves to param_dtype (parallel/expert.py). With
    fault-tolerant replica groups FSDP takes them over one rank too: its all-reduce hook is
    where their gradients are averaged across the groups (step 7)."""
    return dims.spec.ep > 1 and (dims.expert_fsdp.size() > 1 or options.offload or dims.replicas is not None)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], dims: ParallelDims, options: ParallelConfig,
               reshard: bool | int, post_forward_mesh=None, expert_modules: list[nn.Module] = (),
               unsplit_experts: list[nn.Module] = ()) -> int:
    """`post_forward_mesh`: the engine's own, for an integer reshard that fully_shard cannot
    apply by itself (parallel/reshard.py). `expert_modules`: split over ep, sharded over
    their own mesh (an integer reshard is refused with ep up front), or left out of FSDP
    where shard_experts says so. `unsplit_experts` (without ep): sharded with their block,
    placed as expert_placement says. Returns how many units reduce their gradients in place."""
    policies = fsdp_policies(options, dims.device_type)
    placed = {param: expert_placement(experts, dims.fsdp.shape[-1])(param)
              for experts in unsplit_experts for param in experts.parameters(recurse=False)}
    sharded = shard_experts(dims, options)
    left_out = set() if sharded else {param for module in expert_modules for param in module.parameters()}
    units = []
    for block in blocks:
        inside = {id(module) for module in block.modules()}
        for experts in (module for module in expert_modules if id(module) in inside and sharded):
            fully_shard(experts, mesh=dims.expert_fsdp, reshard_after_forward=reshard,
                        shard_placement_fn=expert_placement(experts, dims.expert_fsdp.shape[-1]), **policies)
            units.append((experts, dims.expert_fsdp))
        fully_shard(block, mesh=dims.fsdp, reshard_after_forward=True if post_forward_mesh is not None else reshard,
                    ignored_params=left_out, shard_placement_fn=placed.get if placed else None, **policies)
        units.append((block, dims.fsdp))
        if post_forward_mesh is not None:
            install_post_forward_mesh(block, post_forward_mesh)
    # FSDP warns when the root returns a view (TP's replicated logits are one), in case the
    # caller changes it in place; the engine's loss only reads the logits. Here, so that every
    # process that applies a plan is quiet: --plan-for's spawned workers as well as the ranks.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    fully_shard(model, mesh=dims.fsdp, reshard_after_forward=options.root_reshard_after_forward,
                ignored_params=left_out, **policies)
    units.append((model, dims.fsdp))
    # Sharded over one rank (its last mesh dimension; hsdp replicas all-reduce as before),
    # FSDP's reduce is a copy of every gradient: make it none (parallel/fsdp_internals.py).
    # The rank tensor's shape, as torch 2.11's DeviceMesh.size(-1) fails on a flattened dp x cp.
    one_rank = [unit for unit, mesh in units if mesh.mesh.shape[-1] == 1]
    if one_rank and reduces_in_place():
        for unit in one_rank:
            reduce_in_place(unit)
        return len(one_rank)
    return 0


@dataclass
class AppliedPlan:
    """What apply_plan did, for --explain; `model` is what trains: the model itself, or
    with pp > 1 the module holding this rank's stages (with `.pipeline`)."""

    plan: Plan
    options: ParallelConfig
    model: nn.Module | None = None
    tp_styles: dict[str, object] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    checkpointed: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)  # sublayers whose cheap activations are recomputed
    compiled: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)  # cores attending across cp ranks
    float8: list[str] = field(default_factory=list)  # linears that compute in float8
    experts: list[str] = field(default_factory=list)  # experts modules split over ep
    experts_sharded: bool = False  # whether FSDP shards them too (shard_experts)
    reduced_in_place: int = 0  # FSDP units sharded over one rank whose reduce copies nothing
    block_reshard: bool | int = True
    stages: list[int] = field(default_factory=list)  # the pipeline stages this rank holds


def apply_to_part(model: nn.Module, plan: Plan, dims: ParallelDims, options: ParallelConfig, prefetch,
                  applied: AppliedPlan, post_forward_mesh, emulate_float8: bool) -> None:
    """Steps 1 to 7 on one model (or one stage's part of it)."""
    paths = expand(model, plan.blocks, plan.name)
    applied.blocks += paths
    blocks = [model.get_submodule(path) for path in paths]
    if options.float8 != "none":
        applied.float8 += apply_float8(model, paths, plan, dims, options, emulate_float8)
    tp_styles = {}
    if dims.tp_enabled:
        tp_styles = apply_tensor_parallel(model, plan, dims, options)
        applied.tp_styles.update(tp_styles)
    cp_cores = apply_context_parallel(model, plan, dims, getattr(torch, options.param_dtype)) if dims.cp_enabled else []
    applied.attention += cp_cores
    sharded_experts = shard_experts(dims, options)
    expert_paths = (apply_expert_parallel(model, plan, dims.ep, None if sharded_experts else
                                          getattr(torch, options.param_dtype)) if dims.spec.ep > 1 else [])
    unsplit = [] if dims.spec.ep > 1 else [model.get_submodule(path) for path in all_expert_paths(model, plan)]
    applied.experts += expert_paths
    applied.experts_sharded = sharded_experts
    checkpointed, recomputed = apply_activation_checkpoint(paths, model, plan, options, dims.spec.pp, cp_cores,
                                                           expert_paths if sharded_experts else [])
    applied.checkpointed += checkpointed
    applied.recomputed += recomputed
    if options.compile:
        apply_compile(model, blocks, list(tp_styles), paths, dims)
        applied.compiled += paths
    applied.reduced_in_place += apply_fsdp(model, blocks, dims, options, applied.block_reshard, post_forward_mesh,
                                           [model.get_submodule(path) for path in expert_paths], unsplit)
    if prefetch is not None:
        apply_prefetch(model, prefetch_order(model, plan), prefetch.forward, prefetch.backward)
    if dims.replicas is not None:
        dims.replicas.average_gradients(model)


def apply_plan(model: nn.Module, plan: Plan, dims: ParallelDims,
               options: ParallelConfig | None = None, prefetch=None, emulate_float8: bool | None = None) -> AppliedPlan:
    """`prefetch` is the config's PrefetchConfig; None keeps FSDP2's implicit prefetch.
    `emulate_float8`: whether float8 linears emulate their matmuls (None: off CUDA).
    The model to train is the result's `model`."""
    if emulate_float8 is None:
        emulate_float8 = dims.device_type != "cuda"
    options = options or ParallelConfig()
    applied = AppliedPlan(plan, options, block_reshard=resolve_reshard(options.reshard_after_forward, dims.spec))
    post_forward_mesh = None
    if needs_own_post_forward_mesh(applied.block_reshard, dims.spec):
        post_forward_mesh = build_post_forward_mesh(dims, applied.block_reshard)
    parts = [model]
    if dims.pp_enabled:
        parts = split_into_parts(model, plan, dims.spec.pp, dims.pp.get_local_rank(), options, dims.spec.tp)
        applied.stages = [part.stage_index for part in parts]
    for part in parts:
        apply_to_part(part, plan, dims, options, prefetch, applied, post_forward_mesh, emulate_float8)
    applied.model = join_parts(parts)
    if dims.pp_enabled:
        applied.model.pipeline = build_pipeline(parts, model, plan, dims, options)
    return applied
