"""What the engine needs from a model, checked on the meta-device model before any
process group starts, so a model added through the plan API fails with the member
it lacks instead of a traceback mid-run. docs/plans.md lists the same table.

Nothing engine-specific is strictly required: a plain nn.Module whose layers have
`reset_parameters()` (every torch layer does) and whose vocabulary is readable from
its first nn.Embedding trains as it is. The engine-specific members take over when
present."""

from __future__ import annotations

from torch import nn

from common.errors import UserError
from models.initial_values import DISTRIBUTIONS

DOCS = "docs/plans.md, section \"The model contract\""

# (member, how it is called, when it is required, what the engine does with it)
MEMBERS = (
    ("init_distribution", "init_distribution(fqn) -> Normal | Constant", "optional",
     "each parameter's distribution (models/initial_values.py). Each rank then draws only the values "
     "of its own shard, from streams fixed by the seed, the name and the position: the cost of "
     "initialising follows the shard, and the full value is the same on every layout"),
    ("init_value", "init_value(fqn, shape, generator) -> Tensor", "optional",
     "each parameter's full initial value, from which every rank slices its part. Without it, "
     "every module that holds parameters of its own is re-initialised by its reset_parameters()"),
    ("reset_parameters", "module.reset_parameters()",
     "on every module holding parameters, without init_distribution or init_value",
     "run alone on the CPU for each such module, under a generator seeded by the run seed and the "
     "module's path, then sliced; it must set the module's own parameters"),
    ("reset_buffers", "reset_buffers()", "if the model has buffers",
     "refills non-parameter buffers (RoPE tables, say), which materialising leaves empty"),
    ("tie_weights", "tie_weights()", "if parameters are shared",
     "re-shares them after tensor parallel and materialising replace them"),
    ("args.vocab_size", "int", "if the model has no nn.Embedding",
     "the data's vocabulary is checked against it; without it, the first nn.Embedding's "
     "num_embeddings is the vocabulary"),
    ("args.max_seq_len", "int", "optional", "training.seq_len is checked against it"),
    ("flops_per_token", "flops_per_token(seq_len) -> float", "optional",
     "training FLOPs per token for the FLOP/s and MFU figures; without it the engine estimates "
     "6 x matmul parameters + 12 x n_layers x dim x seq_len (engine/metrics/throughput.py)"),
    ("args.n_layers", "int", "optional", "parity.layers (a reduced depth) and the FLOPs estimate use it"),
    ("args.dim", "int", "optional", "the FLOPs estimate's attention term uses it"),
    ("routing_totals", "a buffer of n_experts + 4 floats on each routed layer, with balance(load), load_balance, "
     "bias_rate, slices and biased", "for a mixture of experts' figures and balancing",
     "each step the loop zeroes it, sums it over the data ranks, shows the layer's load, router entropy and "
     "load-balancing loss, and calls balance(tokens per expert) (engine/routing.py; models/moe.py's MoE is one)"),
)


def _lookup(model: nn.Module, dotted: str):
    value = model
    for part in dotted.split("."):
        if not hasattr(value, part):
            return None
        value = getattr(value, part)
    return value


def vocab_size(model: nn.Module) -> int:
    """The model's vocabulary: args.vocab_size, else its first embedding's row count."""
    declared = _lookup(model, "args.vocab_size")
    if isinstance(declared, int):
        return declared
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise UserError(f"{type(model).__name__} has neither args.vocab_size nor an nn.Embedding, so its "
                    f"vocabulary is unknown. Give it an `args` with vocab_size; see {DOCS}.")


def max_seq_len(model: nn.Module) -> int | None:
    declared = _lookup(model, "args.max_seq_len")
    return declared if isinstance(declared, int) else None


def shared_parameters(model: nn.Module) -> list[str]:
    """Names under which an already-seen parameter appears again."""
    seen, repeats = set(), []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            repeats.append(name)
        seen.add(id(param))
    return repeats


def modules_without_reset(model: nn.Module) -> list[str]:
    """Paths of modules holding parameters of their own but no reset_parameters()."""
    return [path or "(the model itself)" for path, module in model.named_modules()
            if any(True for _ in module.parameters(recurse=False))
            and not callable(getattr(module, "reset_parameters", None))]


def check_distributions(model: nn.Module, what: str) -> None:
    for fqn, _ in model.named_parameters():
        distribution = model.init_distribution(fqn)
        if not isinstance(distribution, DISTRIBUTIONS):
            raise UserError(f"{what}.init_distribution({fqn!r}) returned {distribution!r}; it must return one of "
                            f"{', '.join(d.__name__ for d in DISTRIBUTIONS)} from models.initial_values for "
                            f"every parameter. See {DOCS}.")


def check_model_contract(model: nn.Module, name: str) -> None:
    what = f"model {name!r} ({type(model).__name__})"
    if callable(getattr(model, "init_distribution", None)):
        check_distributions(model, what)
    elif not callable(getattr(model, "init_value", None)):
        lacking = modules_without_reset(model)
        if lacking:
            raise UserError(f"{what} has no init_distribution or init_value, and module "
                            f"{', '.join(map(repr, lacking[:3]))} holds parameters but has no reset_parameters(), "
                            f"so the engine cannot give it initial values. Add reset_parameters() to that "
                            f"module, or init_distribution to the model; see {DOCS}.")
    buffers = [n for n, _ in model.named_buffers()]
    if buffers and not callable(getattr(model, "reset_buffers", None)):
        raise UserError(f"{what} has buffers ({', '.join(buffers[:3])}) but no reset_buffers(), so they would "
                        f"stay empty after materialising. Add a reset_buffers() that refills them; see {DOCS}.")
    repeats = shared_parameters(model)
    if repeats and not callable(getattr(model, "tie_weights", None)):
        raise UserError(f"{what} shares parameters ({', '.join(repeats[:3])}) but has no tie_weights(), "
                        f"so tensor parallel and materialising would silently untie them. Add a "
                        f"tie_weights() that re-shares them; see {DOCS}.")
    vocab_size(model)
