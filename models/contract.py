"""What the engine needs from a model, checked on the meta-device model before any
process group starts, so a model added through the plan API fails with the member
it lacks instead of a traceback mid-run. docs/plans.md lists the same table."""

from __future__ import annotations

from torch import nn

from engine.errors import UserError

DOCS = "docs/plans.md, section \"The model contract\""

# (member, how it is called, why the engine needs it)
REQUIRED = (
    ("args.vocab_size", "int", "the data and the launcher's checks read it"),
    ("args.max_seq_len", "int", "training.seq_len is checked against it"),
    ("init_value", "init_value(fqn, shape, generator) -> Tensor",
     "each parameter's full initial value, from which every rank slices its part"),
    ("reset_buffers", "reset_buffers()", "refills non-parameter buffers after materialising"),
)
OPTIONAL = (
    ("tie_weights", "tie_weights()", "required when parameters are shared: re-shares them after "
     "tensor parallel and materialising replace them"),
    ("flops_per_token", "flops_per_token(seq_len) -> float",
     "training FLOPs per token for the FLOP/s and MFU figures; without it the engine estimates "
     "6 x matmul parameters + 12 x n_layers x dim x seq_len (engine/metrics/throughput.py)"),
    ("args.n_layers", "int", "parity.layers (a reduced depth) and the FLOPs estimate use it"),
    ("args.dim", "int", "the FLOPs estimate's attention term uses it"),
)


def _lookup(model: nn.Module, dotted: str):
    value = model
    for part in dotted.split("."):
        if not hasattr(value, part):
            return None
        value = getattr(value, part)
    return value


def shared_parameters(model: nn.Module) -> list[str]:
    """Names under which an already-seen parameter appears again."""
    seen, repeats = set(), []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            repeats.append(name)
        seen.add(id(param))
    return repeats


def check_model_contract(model: nn.Module, name: str) -> None:
    what = f"model {name!r} ({type(model).__name__})"
    for member, signature, why in REQUIRED:
        value = _lookup(model, member)
        wanted_int = signature == "int"
        if value is None or (wanted_int and not isinstance(value, int)) or (not wanted_int and not callable(value)):
            raise UserError(f"{what} lacks {member} ({signature}), which the engine needs: {why}. "
                            f"Add it to the model; see {DOCS}.")
    repeats = shared_parameters(model)
    if repeats and not callable(getattr(model, "tie_weights", None)):
        raise UserError(f"{what} shares parameters ({', '.join(repeats[:3])}) but has no tie_weights(), "
                        f"so tensor parallel and materialising would silently untie them. Add a "
                        f"tie_weights() that re-shares them; see {DOCS}.")
