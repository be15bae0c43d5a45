"""Float8 training through torchao (`parallel.float8`): the linears of the plan's blocks
compute their three matmuls in float8, with tensorwise or rowwise scaling; the embedding
and the output projection stay in the compute dtype, as torchtitan leaves its output.

torchao swaps each nn.Linear for its Float8Linear in place: the weight keeps its name,
dtype and values, so checkpoints, plans and the parity runner see the same model. On a
GPU without float8 matmuls (compute capability below 8.9) there is nothing to run it
on: the run stops. On the CPU, torchao's emulation computes the same casts and scales
and multiplies the dequantised values, so every layout can be proven there.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from common.errors import UserError
from parallel.plan import path_matches

RECIPES = ("tensorwise", "rowwise")
# torch._scaled_mm takes only dimensions that are multiples of 16.
FLOAT8_MULTIPLE = 16
INSTALL = "pip install torchao (or pip install -e .[float8] in this checkout)"


# torchao's import logs a warning per CUDA kernel library it cannot load (every one on a
# CPU machine), and torch one per enum torchao registers for compile; float8 training
# needs none of them. Quieted here, before anything imports torchao: transformers does
# too, whenever it is installed.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "register_constant" not in record.getMessage())


def import_torchao():
    try:
        import torchao.float8
    except ImportError:
        raise UserError(f"parallel.float8 needs torchao, which is not installed. Install it with {INSTALL}, "
                        f"or set parallel.float8=none.") from None
    return torchao.float8


def check_device(device_type: str) -> None:
    """Stops a run on a GPU that has no float8 matmul (before Ada and Hopper)."""
    if device_type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise UserError(f"parallel.float8 needs a GPU with float8 matmuls (compute capability 8.9 or newer: "
                        f"L4, L40, H100, H200, B200), but {torch.cuda.get_device_name()} is {major}.{minor}. "
                        f"Set parallel.float8=none on this GPU.")


def float8_config(recipe: str, all_gather: bool, emulate: bool):
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def sharded_dimension(style) -> int | None:
    """Which weight dimension tensor parallel splits: 0 (output features) for a column
    style, 1 (input features) for a row style, None for anything else."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return 0 if isinstance(style, ColwiseParallel) else 1 if isinstance(style, RowwiseParallel) else None


def float8_linears(model: nn.Module, block_paths: list[str], skip: tuple[str, ...] = ()) -> list[str]:
    """The paths of the nn.Linear modules inside the blocks, but those `skip` names (globs)."""
    paths = [f"{block}.{name}" for block in block_paths
             for name, module in model.get_submodule(block).named_modules() if type(module) is nn.Linear]
    return [path for path in paths if not any(path_matches(pattern, path) for pattern in skip)]


def check_shapes(model: nn.Module, paths: list[str], tp_styles: dict, tp: int) -> None:
    """Each linear's weight, as each rank holds it under tensor parallel, must have both
    dimensions a multiple of 16."""
    for path in paths:
        out_features, in_features = model.get_submodule(path).weight.shape
        local = [out_features, in_features]
        split = sharded_dimension(tp_styles.get(path))
        if split is not None:
            local[split] //= tp
        if any(size % FLOAT8_MULTIPLE for size in local):
            held = f" (each of tp={tp} ranks holds {local[0]} x {local[1]})" if split is not None else ""
            raise UserError(f"parallel.float8 cannot run linear {path!r}: its weight is {out_features} x "
                            f"{in_features}{held}, and float8 matmuls take only dimensions that are multiples "
                            f"of {FLOAT8_MULTIPLE}. Use a model whose widths are multiples of {FLOAT8_MULTIPLE}"
                            f"{' x tp' if split is not None else ''}, or set parallel.float8=none.")


def convert_to_float8(model: nn.Module, paths: list[str], recipe: str, all_gather: bool, emulate: bool) -> None:
    """Swap the linears at `paths` for torchao's Float8Linear; `emulate` off a GPU (the dry
    run, which simulates a GPU job on fake tensors, takes the GPU's path anywhere)."""
    config = float8_config(recipe, all_gather, emulate)
    if recipe == "rowwise":
        # A compiled rowwise block recomputed in backward (activation checkpointing) may
        # otherwise fuse away a cast that eager keeps, and recompute different values than
        # forward saw (pytorch/pytorch#150859; torchtitan sets the same).
        import torch._inductor.config as inductor_config
        inductor_config.emulate_precision_casts = True
    chosen = set(paths)
    import_torchao().convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)



def check_settings(model: nn.Module, block_paths: list[str], skip: tuple[str, ...], options, reshard: bool | int,
                   tp_styles: dict, tp: int, device_type: str | None) -> None:
    """Everything float8 can refuse, before any process starts. `reshard` is the blocks'
    resolved reshard_after_forward; `device_type` None (a dry run) skips the GPU's check."""
    if options.float8_all_gather and options.float8 != "tensorwise":
        raise UserError(f"parallel.float8_all_gather=true all-gathers weights in float8 with one scale per tensor, "
                        f"which only parallel.float8=tensorwise keeps (it is {options.float8}). Set "
                        f"parallel.float8=tensorwise, or parallel.float8_all_gather=false.")
    if options.float8_all_gather and reshard is not True and reshard is not False:
        # torch's fully_shard raises NotImplementedError when it all-gathers a parameter
        # with its own all-gather (torchao's float8 weight) from the post-forward shard.
        raise UserError(f"parallel.float8_all_gather=true cannot run with parallel.reshard_after_forward="
                        f"{options.reshard_after_forward} (blocks resharded to groups of {reshard}): torch's "
                        f"fully_shard cannot all-gather a float8 weight from that partial shard. Set "
                        f"parallel.reshard_after_forward to true or false, or parallel.float8_all_gather=false.")
    if options.float8 == "none":
        return
    import_torchao()
    if device_type is not None:
        check_device(device_type)
    check_shapes(model, float8_linears(model, block_paths, skip), tp_styles, tp)
