"""What "the same" means in a parity check: the tolerance rule, and the comparisons
between a sharded tensor and its single-device counterpart.

The rule (docs/parity.md explains it):
- float32: step-0 loss within 1e-5 absolute, every step-0 gradient within 1e-5
  absolute, the gradient norm within 1e-5 relative. Only reduction order differs,
  which costs a few units in the last place.
- bfloat16 (parallel.param_dtype), against a reference that also computes in bf16
  from fp32 master weights: loss 1e-2, each gradient within 8e-3 x the largest
  gradient (about one bf16 rounding at that magnitude), grad norm 1e-2 relative.
- float8 (parallel.float8, either param dtype), against a reference whose linears are
  float8 too: the bfloat16 bounds, except each gradient within FLOAT8_E5M2_GRAD x the
  largest gradient with tensorwise scaling. A float8 cast keeps 3 mantissa bits (e4m3),
  so a last-place difference in its input, from another summation order (tensor
  parallel's partial sums), moves a value by a whole float8 step (6 to 12%) when it
  sits on a rounding boundary; fp32's bounds would fail on such a flip by chance.
  Tensorwise casts gradients to e5m2, 2 mantissa bits, whose flips are twice as large:
  on tp=2 with imported weights (4 blocks, tied) one moved the embedding's gradient by
  1.2e-2 x the largest gradient, where the bf16 bound is 8e-3 (docs/parallelism.md,
  "Float8").
- Later steps: plain SGD moves each weight by lr x gradient, so the step-0 noise stays
  noise and the step-0 tolerances hold at every step. AdamW divides each update by
  the gradient's running RMS, so a weight whose gradient is at noise level still moves
  by up to lr, in either direction; later losses and norms get 10 x the step-0
  tolerance, and weights after N steps are only bounded by 2 x the summed learning
  rates. Use optim.name=sgd for a sharp check of the later steps.
- Tensors replicated over the tp dimension must be bit-identical across tp ranks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

ADAMW_LATER_FACTOR = 10.0
FLOAT8_E5M2_GRAD = 3e-2  # tensorwise float8's gradient bound, relative to the largest gradient


@dataclass(frozen=True)
class Tolerance:
    dtype: str
    optimizer: str
    loss: float  # absolute, step 0
    grad: float  # absolute, or relative to the largest gradient when grad_relative
    grad_relative: bool
    norm: float  # relative, step 0
    later_factor: float  # applied to loss and norm after step 0
    activation: float  # relative to the largest reference value: the localizer's threshold

    def loss_at(self, step: int) -> float:
        return self.loss * (1.0 if step == 0 else self.later_factor)

    def norm_at(self, step: int) -> float:
        return self.norm * (1.0 if step == 0 else self.later_factor)

    def grad_limit(self, largest_grad: float) -> float:
        return self.grad * largest_grad if self.grad_relative else self.grad

    def params_limit(self, lrs: list[float], largest_grad: float) -> float:
        """How far a weight may drift after the steps run with learning rates `lrs`."""
        if self.optimizer == "adamw":
            return 2.0 * sum(lrs)
        # SGD: each step adds lr x (gradient difference), plus one rounding of the weight.
        return sum(lr * self.grad_limit(largest_grad) for lr in lrs) + 1e-6

    def describe(self) -> dict:
        return asdict(self)


def tolerance_for(param_dtype: str, optimizer: str, float8: str = "none") -> Tolerance:
    later = ADAMW_LATER_FACTOR if optimizer == "adamw" else 1.0
    if param_dtype == "bfloat16" or float8 != "none":
        dtype = param_dtype if float8 == "none" else f"{param_dtype} + float8 {float8}"
        grad = FLOAT8_E5M2_GRAD if float8 == "tensorwise" else 8e-3
        return Tolerance(dtype, optimizer, loss=1e-2, grad=grad, grad_relative=True, norm=1e-2,
                         later_factor=later, activation=5e-2)
    return Tolerance(param_dtype, optimizer, loss=1e-5, grad=1e-5, grad_relative=False, norm=1e-5,
                     later_factor=later, activation=1e-4)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for DTensors: every rank must call it in the same order).
    Shards offloaded to the CPU (parallel.offload) on a CUDA mesh are gathered on the GPU:
    NCCL takes no CPU tensors."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh, local = tensor.device_mesh, tensor.to_local()
    if local.device.type != mesh.device_type:
        tensor = DTensor.from_local(local.to(mesh.device_type), mesh, tensor.placements, shape=tensor.shape,
                                    stride=tensor.stride())
    return tensor.full_tensor()


def max_abs_diff(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return (ours.detach().float().cpu() - reference.detach().float().cpu()).abs().max().item()


def digest(tensor: torch.Tensor) -> str:
    """A hash of the exact bytes, so two runs can be checked for bitwise equality later."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def replicated_over_tp(tensor: torch.Tensor) -> bool:
    """True when every tp rank is meant to hold the same local values: a DTensor that is
    Replicate on its tp dimension, or one whose mesh has no tp dimension at all."""
    if not isinstance(tensor, DTensor):
        return True
    names = tensor.device_mesh.mesh_dim_names or ()
    return "tp" not in names or isinstance(tensor.placements[names.index("tp")], Replicate)


def replication_mismatches(named: list[tuple[str, torch.Tensor]], tp_group, device) -> tuple[int, dict[str, float]]:
    """(how many tensors were checked, those that should be identical across the tp ranks
    but are not, with the largest difference seen). Collective over the whole world; every
    rank gets the same answer, also when pipeline stages hold different tensors."""
    checked = [(name, t) for name, t in named if t is not None and replicated_over_tp(t)]
    differing: dict[str, float] = {}
    for name, tensor in checked if tp_group is not None and dist.get_world_size(tp_group) > 1 else ():
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().contiguous().to(device)
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(copies, local, group=tp_group)
        mine = local.view(torch.uint8)
        for other in copies:
            if not torch.equal(other.view(torch.uint8), mine):
                # Any byte difference counts (-0.0 against 0.0 too): report at least a tiny size.
                size = (other.double() - local.double()).abs().max().item()
                differing[name] = max(differing.get(name, 0.0), size if size > 0 else torch.finfo(torch.float64).tiny)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ([name for name, _ in checked], differing))
    names = {name for seen, _ in everyone for name in seen}
    merged: dict[str, float] = {}
    for _, found in everyone:
        for name, size in found.items():
            merged[name] = max(merged.get(name, 0.0), size)
    return len(names), merged


def relative_diff(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / abs(theirs) if theirs else abs(ours)


def check_row(name: str, value: float, limit: float, detail: str = "") -> dict:
    """One line of a parity verdict: a measured difference against its limit."""
    return {"name": name, "value": value, "limit": limit, "ok": math.isfinite(value) and value <= limit,
            "detail": detail}
