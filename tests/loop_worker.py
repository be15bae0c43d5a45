"""Run under torchrun by tests/test_loop.py: prefetch order and numerics, gradient
accumulation, and the gradient norm and clipping on several layouts, each against a
single-process reference built from the same seed. Rank 0 writes a JSON report.

usage: torchrun --nproc_per_node N tests/loop_worker.py MESH OUT.json

The prefetch section runs only on a mesh without tensor parallelism (the order of
all-gathers does not depend on TP); the sequence-parallel section only with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # noqa: E402

import engine.metrics.memory  # noqa: E402
import parallel  # noqa: E402,F401
from common.config import Config, ParallelConfig, PrefetchConfig  # noqa: E402
from engine.data.sources import CorpusSource, local_batch  # noqa: E402
from engine.grad_norm import clip_grad_norm, grad_norm  # noqa: E402
from engine.parity.compare import digest, full, max_abs_diff  # noqa: E402
from engine.train import ONE_DEVICE, build_optimizer, forward_backward, global_mean, run_step  # noqa: E402
from models import build_on_meta  # noqa: E402
from models.materialise import materialise  # noqa: E402
from parallel.apply import apply_plan  # noqa: E402
from parallel.mesh import MeshSpec, build_mesh, parse_mesh  # noqa: E402
from parallel.plan import Plan, get_plan  # noqa: E402
from parallel.prefetch import prefetch_order, unshard_ahead  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SEED = 1234
FLAVOR = "debug"
# The data view of a one-rank run, for driving the reference through run_step.

class Recorder:
    """Logs, in issue order, which FSDP unit each all-gather is for, each gradient
    reduce-scatter, and each unit's compute: forward (its first submodule runs) and
    backward (the gradient reaches its MLP, the last thing it computed).
    Units are numbered in forward order: 0 is the root, block i is i + 1."""

    def __init__(self, model, blocks):
        self.events: list[tuple[str, int]] = []
        self.units = len(blocks) + 1
        self.unit_of_param = {}
        for unit, module in reversed(list(enumerate([model, *blocks]))):
            for param in module.parameters():
                self.unit_of_param.setdefault(id(param), unit)  # the root keeps what blocks do not
        model.tok_embeddings.register_forward_pre_hook(lambda *_: self.events.append(("forward", 0)))
        for unit, block in enumerate(blocks, start=1):
            block.attention_norm.register_forward_pre_hook(
                lambda *_, unit=unit: self.events.append(("forward", unit)))
            block.feed_forward.register_full_backward_pre_hook(
                lambda *_, unit=unit: self.events.append(("backward", unit)))
        self._patch()

    def _patch(self) -> None:
        all_gather, reduce = _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce

        def recording_all_gather(fsdp_params, *args, **kwargs):
            self.events.append(("all_gather", self.unit_of_param[id(fsdp_params[0].sharded_param)]))
            return all_gather(fsdp_params, *args, **kwargs)

        def recording_reduce(fsdp_params, *args, **kwargs):
            self.events.append(("reduce_scatter", -1))
            return reduce(fsdp_params, *args, **kwargs)

        _fsdp_param_group.foreach_all_gather = recording_all_gather
        _fsdp_param_group.foreach_reduce = recording_reduce
        self._originals = (all_gather, reduce)

    def remove(self) -> None:
        _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce = self._originals

    def index(self, kind: str, unit: int) -> int:
        return self.events.index((kind, unit))

    def forward_lead(self) -> list[int]:
        """For each unit u: the furthest unit whose all-gather was issued before u's forward
        compute, minus u. 0 means no prefetch; N means N units ahead."""
        leads = []
        for unit in range(self.units):
            before = self.events[:self.index("forward", unit)]
            leads.append(max(u for kind, u in before if kind == "all_gather") - unit)
        return leads

    def backward_lead(self) -> list[int]:
        """For each block unit u (last first): u minus the lowest unit whose backward
        all-gather was issued before u's backward compute."""
        forward_end = self.index("forward", self.units - 1)
        leads = []
        for unit in range(self.units - 1, 0, -1):
            between = self.events[forward_end:self.index("backward", unit)]
            leads.append(unit - min(u for kind, u in between if kind == "all_gather"))
        return leads

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.events if k == kind)


def sharded_model(plan: Plan, dims, prefetch: PrefetchConfig | None = None,
                  options: ParallelConfig | None = None):
    model = build_on_meta("llama", FLAVOR)
    apply_plan(model, plan, dims, options, prefetch)
    materialise(model, "cpu", SEED)
    return model


def reference_model():
    model = build_on_meta("llama", FLAVOR)
    materialise(model, "cpu", SEED)
    return model


def grads(model) -> dict[str, torch.Tensor]:
    return {name: full(p.grad) for name, p in model.named_parameters()}


def check_prefetch(dims, cfg, source, options: ParallelConfig) -> dict:
    """Per config: the all-gather leads at step 0 (the first, lazily initialised, step),
    the step-0 loss and full gradients, and the losses of three more real loop steps."""
    plan = get_plan("llama")
    report, outcomes = {}, {}
    for depth in (0, 1, 2):
        prefetch = PrefetchConfig(forward=depth, backward=depth, unshard_ahead=depth)
        model = sharded_model(plan, dims, prefetch, options)
        blocks = prefetch_order(model, plan)
        recorder = Recorder(model, blocks)
        unshard = (lambda: unshard_ahead([(model, blocks)], depth)) if depth else None
        if unshard:
            unshard()
        recorder.events.append(("batch_ready", -1))
        inputs, targets = local_batch(source, 0, cfg.training.global_batch, cfg.training.seq_len,
                                      dims.data_rank, dims.data_size)
        loss = forward_backward(model, inputs, targets)
        recorder.remove()
        ready = recorder.index("batch_ready", -1)
        report[f"depth{depth}"] = {
            "forward_lead": recorder.forward_lead(), "backward_lead": recorder.backward_lead(),
            "gathered_before_batch": sorted(u for kind, u in recorder.events[:ready] if kind == "all_gather"),
        }
        step0_grads = grads(model)
        model.zero_grad(set_to_none=True)
        optimizer, scheduler = build_optimizer(model, cfg.optim, 4)
        losses = [run_step(model, optimizer, scheduler, source, step, cfg, dims, "cpu", unshard).loss
                  for step in range(1, 4)]
        outcomes[depth] = (global_mean(loss, dims.data.get_group()), step0_grads, losses)
    base_loss, base_grads, base_losses = outcomes[0]
    for depth in (1, 2):
        loss, step_grads, losses = outcomes[depth]
        report[f"depth{depth}"]["bitwise_equal_to_depth0"] = {
            "loss0": loss == base_loss,
            "grads0": all(torch.equal(step_grads[n], base_grads[n]) for n in base_grads),
            "losses": losses == base_losses,
        }
    report["blocks"] = len(prefetch_order(model, plan))
    return report


def forward_all_gathers_with_custom_order(dims, cfg, source) -> list[int]:
    """The units whose all-gathers the forward issues, in order, at forward depth 1 under
    a plan that claims the blocks run as 1, 0, 3, 2 (they really run 0, 1, 2, 3)."""
    plan = Plan(name="llama_custom_order", blocks="layers.*", tensor_parallel=get_plan("llama").tensor_parallel,
                prefetch_order=("layers.1", "layers.0", "layers.3", "layers.2"))
    model = sharded_model(plan, dims, PrefetchConfig(forward=1))
    recorder = Recorder(model, [model.get_submodule(f"layers.{i}") for i in range(4)])
    t = cfg.training
    with torch.no_grad():
        model(local_batch(source, 0, t.global_batch, t.seq_len, dims.data_rank, dims.data_size)[0])
    recorder.remove()
    return [unit for kind, unit in recorder.events if kind == "all_gather"]


def check_accumulation(dims, cfg, source, reference) -> dict:
    """Gradient reductions per step with 1 and 4 micro-batches, and 4 micro-batches
    against the reference's one big batch."""
    plan = get_plan("llama")
    model = sharded_model(plan, dims)
    t = cfg.training
    inputs, targets = local_batch(source, 0, t.global_batch, t.seq_len, dims.data_rank, dims.data_size)
    blocks = prefetch_order(model, plan)
    report = {"units": len(blocks) + 1}
    recorder = Recorder(model, blocks)
    for micro_batches in (1, 4):
        recorder.events.clear()
        loss = forward_backward(model, inputs, targets, micro_batches)
        report[f"reduce_scatters_mb{micro_batches}"] = recorder.count("reduce_scatter")
        if micro_batches == 4:
            ref_inputs, ref_targets = local_batch(source, 0, t.global_batch, t.seq_len)
            ref_loss = forward_backward(reference, ref_inputs, ref_targets)
            ref_grads = grads(reference)
            report["loss0_diff"] = abs(global_mean(loss, dims.data.get_group()) - ref_loss.item())
            report["grad_max_diff"] = max(max_abs_diff(full(p.grad), ref_grads[n]) for n, p in model.named_parameters())
        model.zero_grad(set_to_none=True)
    recorder.remove()
    reference.zero_grad(set_to_none=True)
    accumulated = Config()
    accumulated.training.micro_batches = 4
    optimizer, scheduler = build_optimizer(model, cfg.optim, 3)
    ref_optimizer, ref_scheduler = build_optimizer(reference, cfg.optim, 3)
    report["losses"], report["ref_losses"] = [], []
    for step in range(3):
        report["losses"].append(run_step(model, optimizer, scheduler, source, step, accumulated, dims, "cpu").loss)
        report["ref_losses"].append(run_step(reference, ref_optimizer, ref_scheduler, source, step, cfg,
                                             ONE_DEVICE, "cpu").loss)
    return report


def check_norms(dims, cfg, source, options: ParallelConfig) -> dict:
    """Gradient norms (2 and inf) and clipped gradients against torch on one process."""
    model, reference = sharded_model(get_plan("llama"), dims, options=options), reference_model()
    t = cfg.training
    forward_backward(model, *local_batch(source, 0, t.global_batch, t.seq_len, dims.data_rank, dims.data_size))
    forward_backward(reference, *local_batch(source, 0, t.global_batch, t.seq_len))
    ref_grads = [p.grad for p in reference.parameters()]
    report = {"meshes": sorted({str(p.grad.device_mesh.mesh_dim_names) for p in model.parameters()})}
    for norm_type in (2.0, float("inf")):
        report[f"norm_{norm_type}"] = [grad_norm(model.parameters(), norm_type).item(),
                                       torch.nn.utils.get_total_norm(ref_grads, norm_type).item()]
    max_norm = report["norm_2.0"][1] / 4  # small enough that clipping really scales
    clip_grad_norm(model.parameters(), max_norm)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    ref_params = dict(reference.named_parameters())
    report["clipped_grad_max_diff"] = max(max_abs_diff(full(p.grad), ref_params[n].grad) for n, p in model.named_parameters())
    report["clipped_norm"] = grad_norm(model.parameters()).item()
    report["max_norm"] = max_norm
    return report


def step0_fingerprint(dims, cfg, source, options: ParallelConfig) -> dict:
    """The step-0 loss and a digest of every full gradient, for bitwise comparisons."""
    model = sharded_model(get_plan("llama"), dims, options=options)
    t = cfg.training
    inputs, targets = local_batch(source, 0, t.global_batch, t.seq_len, dims.data_rank, dims.data_size)
    loss = global_mean(forward_backward(model, inputs, targets), dims.data.get_group())
    return {"loss": loss, "grads": {name: digest(full(p.grad)) for name, p in model.named_parameters()}}


def check_neutrality(dims, cfg, source) -> dict:
    """AC modes on this mesh, and reshard settings on dp over the same ranks: each must
    give bitwise what the default gives (they change what is kept, never the math)."""
    report = {f"ac_{mode}": step0_fingerprint(dims, cfg, source, ParallelConfig(activation_checkpoint=mode))
              for mode in ("none", "full", "selective", "op")}
    dp_only = build_mesh(MeshSpec(dp=dist.get_world_size()), "cpu")
    for setting in (True, False, 2):
        report[f"reshard_{setting}"] = step0_fingerprint(dp_only, cfg, source,
                                                         ParallelConfig(reshard_after_forward=setting))
    return report


def check_memory(dims) -> dict:
    """The memory line's max over ranks, reduced in the background while the loss is
    averaged over the data ranks, as the loop does. Each rank pretends to hold its rank
    number of GiB (and ten more at peak), so every rank must see the last rank's figures."""
    real = engine.metrics.memory.rank_memory
    engine.metrics.memory.rank_memory = lambda device: (float(dist.get_rank()), 10.0 + dist.get_rank())
    try:
        memory = engine.metrics.memory.LargestOverRanks(torch.device("cpu"))
        memory.start()
        loss = global_mean(torch.tensor(float(dims.data_rank)), dims.data.get_group())
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, {"memory": list(memory.result()), "loss": loss})
    finally:
        engine.metrics.memory.rank_memory = real
    return {"seen": seen, "expected_memory": [dist.get_world_size() - 1.0, 10.0 + dist.get_world_size() - 1],
            "expected_loss": (dims.data_size - 1) / 2}


def main() -> None:
    mesh_text, out_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dims = build_mesh(parse_mesh(mesh_text).resolve(dist.get_world_size()), "cpu")
    cfg = Config()
    cfg.model.flavor = FLAVOR
    source = CorpusSource(REPO / "data" / "corpus.txt", SEED)
    report = {"mesh": mesh_text, "norms": {"llama": check_norms(dims, cfg, source, ParallelConfig())}}
    if dims.tp_enabled:
        report["norms"]["llama_sp"] = check_norms(dims, cfg, source, ParallelConfig(sequence_parallel=True))
        report["neutrality"] = check_neutrality(dims, cfg, source)
    else:
        report["prefetch"] = check_prefetch(dims, cfg, source, ParallelConfig())
        report["prefetch"]["custom_order_all_gathers"] = forward_all_gathers_with_custom_order(dims, cfg, source)
        # Recomputation runs each block's forward again inside its backward.
        report["prefetch_ac"] = check_prefetch(dims, cfg, source, ParallelConfig(activation_checkpoint="full"))
    report["accumulation"] = check_accumulation(dims, cfg, source, reference_model())
    report["memory"] = check_memory(dims)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
