"""`launch/run.py --parity`: the same steps on the mesh and on one device, compared.

Every rank builds the sharded model from the seed; rank 0 also builds the whole model
from the same seed (the reference). Both take `parity.steps` optimizer steps on the
same global batches: the mesh through the engine's own train_step, the reference in
one process. Rank 0 compares the losses, the gradient norms, every full step-0
gradient and every weight after the last step; all ranks check that what should be
replicated over tp is bit-identical. On failure, every rank reruns step 0 with hooks
on every module (engine/parity/localize.py) and the report names the first module that
diverges. Returns the exit code: 0 on PASS, 1 on FAIL.

Under pipeline parallel each stage's ranks hold only that stage's parameters: the first
rank of each stage (data rank 0, tp rank 0, the members of rank 0's pp group) sends its
whole tensors to rank 0, which compares them all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.parity import trajectory
from engine.parity.compare import (check_row, digest, full, max_abs_diff, relative_diff, replication_mismatches,
                                   tolerance_for)
from engine.data.sources import TokenSource, build_source, local_batch
from models.contract import vocab_size
from engine.parity.localize import RankPiece, localize
from engine.parity.report import format_report
from engine.parity.reference import Reference
from engine.train import agree_on_ids, build_optimizer, evaluate, host_group, loss_for, rank_batch, train_step
from launch.build import pick_device, sharded_model, single_device_model, start_process_group
from parallel.expert import expert_paths
from parallel.float8 import convert_to_float8, float8_linears
from parallel.pipeline import parts_of, whole_model
from parallel.plan import expand, plan_of

WORST = 10
# full_tensor() of an FSDP+TP (_StridedShard) parameter logs a performance warning per
# call on every rank; a parity run gathers each parameter on purpose, a few times.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def tensorwise_slices(cfg, dims) -> int:
    """With float8 tensorwise scaling each forward scales its activations and gradients by
    their own largest value, so the mesh's numbers depend on the rows each forward sees:
    one data rank's rows, one micro-batch at a time. The reference then takes the same runs
    of rows (data ranks x micro-batches, in order), one forward each. (Context parallel
    splits the sequences too, which no one-device forward can copy: check_parity refuses it.)"""
    return dims.data_size * cfg.training.micro_batches if cfg.parallel.float8 == "tensorwise" else 1


def build_reference(cfg, device, slices: int = 1) -> Reference:
    where = torch.device("cpu") if cfg.parity.reference_device == "cpu" else device
    model = single_device_model(cfg, where, cfg.parity.layers)
    compute = None
    if cfg.parallel.param_dtype != "float32":  # FSDP computes in it from fp32 masters; so does this
        compute = single_device_model(cfg, where, cfg.parity.layers, getattr(torch, cfg.parallel.param_dtype))
    if cfg.parallel.float8 != "none":  # the same linears in float8, with the same scaling
        computing = compute if compute is not None else model
        plan = plan_of(cfg)
        blocks = expand(computing, plan.blocks, plan.name)
        convert_to_float8(computing, float8_linears(computing, blocks, plan.float8_skip), cfg.parallel.float8,
                          all_gather=False, emulate=where.type != "cuda")
    return Reference(model, cfg, compute, slices)


def reference_device(reference: Reference) -> torch.device:
    return next(reference.model.parameters()).device


class ParityRun:
    def __init__(self, cfg, spec):
        self.cfg, self.spec = cfg, spec
        self.dims, self.device = start_process_group(cfg, spec)
        self.rank0 = dist.get_rank() == 0
        self.tp_group = self.dims.tp.get_group() if self.dims.tp_enabled else None
        self.tolerance = tolerance_for(cfg.parallel.param_dtype, cfg.optim.name, cfg.parallel.float8)
        self.golden = trajectory.read(cfg.parity.check_against, cfg) if cfg.parity.check_against else None
        self.source = None
        self.ids_group = None  # set with the source: the ranks agree on its ids (engine/train.py)
        self.reference_grads: dict[str, torch.Tensor] | None = None
        self.gradient_summaries: dict[str, dict] = {}
        self.largest_grad = 0.0
        self.report: dict = {}
        self.checks: list[dict] = []

    # -- batches -------------------------------------------------------------------------
    def batch(self, step: int):
        inputs, targets = rank_batch(self.source, step, self.cfg.training, self.dims)
        return inputs.to(self.device), targets.to(self.device)

    def global_batch(self, step: int, device):
        t = self.cfg.training
        inputs, targets = local_batch(self.source, step, t.global_batch, t.seq_len)
        return inputs.to(device), targets.to(device)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> int:
        cfg, pc = self.cfg, self.cfg.parity
        model, applied = sharded_model(cfg, self.dims, self.device, pc.layers)
        self.source = build_source(cfg, vocab_size(whole_model(model)))
        reference = (build_reference(cfg, self.device, tensorwise_slices(cfg, self.dims))
                     if self.rank0 and pc.reference else None)
        self.describe(model, reference)
        self.compare_weights(model, reference, "initial weights (bitwise)", initial=True)
        layout_hook = self.record_post_forward_layout(model, applied.blocks[0]) if applied.blocks else None

        optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.training.steps)
        replicas = self.dims.replicas
        if replicas is not None:
            replicas.keep(model, optimizer, scheduler)
        self.ids_group = host_group() if isinstance(self.source, TokenSource) else None
        rows, lrs = [], []
        for step in range(pc.steps):
            if replicas is not None:
                replicas.start_step()
            row = {"step": step + 1}
            whole, batch = agree_on_ids(lambda: (None if reference is None else
                                                 self.global_batch(step, reference_device(reference)),
                                                 self.batch(step)), self.source, self.ids_group)
            if reference is not None:
                keep = self.keep_reference_grads if step == 0 else None
                row["reference_loss"], row["reference_grad_norm"], _ = reference.step(*whole, inspect_grads=keep)
            result = train_step(model, optimizer, scheduler, *batch, cfg.optim.max_norm,
                                self.dims.data.get_group(), cfg.training.micro_batches,
                                inspect_grads=self.compare_step0_gradients if step == 0 else None,
                                loss=loss_for(cfg.parallel), replicas=replicas)
            if replicas is not None:
                self.check_replica_groups(step, result)
            if step == 0 and layout_hook is not None:
                layout_hook.remove()
            row["loss"], row["grad_norm"] = result.loss, result.grad_norm
            rows.append(row)
            lrs.append(result.lr)
        self.report["steps_table"] = rows
        self.check_steps(rows)
        self.compare_weights(model, reference, f"weights after {pc.steps} steps", lrs=lrs)
        if cfg.eval.every:
            self.check_evaluation(model, reference)
        self.check_golden(rows)
        passed = self.verdict()
        del model, optimizer, reference
        if not passed and pc.localize and pc.reference:
            if replicas is not None:
                replicas.start_step()  # the localizer's backward averages across the groups too
            self.report["localizer"] = self.localize()
        if self.rank0:
            self.write_report()
        return 0 if passed else 1

    # -- what is compared ----------------------------------------------------------------
    def describe(self, model, reference) -> None:
        cfg = self.cfg
        self.report.update({
            "mesh": str(self.spec), "world_size": dist.get_world_size(),
            "device": f"{self.device.type}/{pick_device(cfg)[1]}",
            "reference": str(reference_device(reference)) if reference is not None else "none",
            "model": f"{cfg.model.name}/{cfg.model.flavor}", "plan": plan_of(cfg).name,
            "layers": getattr(getattr(whole_model(model), "args", None), "n_layers", None),
            "dtype": self.tolerance.dtype, "optimizer": cfg.optim.name, "steps": cfg.parity.steps,
            "micro_batches": cfg.training.micro_batches,
            "pipeline": self.describe_pipeline(model),
            "settings": {k: v for k, v in vars(cfg.parallel).items() if k not in ("device", "backend")},
            "tolerance": self.tolerance.describe(),
            "golden": cfg.parity.check_against or None, "recorded": cfg.parity.record or None,
            "replica_group": (f"{self.dims.replica_group} of {self.dims.replica_groups}"
                              if self.dims.replicas is not None else None),
        })

    @staticmethod
    def describe_pipeline(model) -> dict | None:
        """The schedule and the blocks of each stage (None without pp)."""
        pipeline = getattr(model, "pipeline", None)
        if pipeline is None:
            return None
        return {"schedule": pipeline.schedule_name, "stages_per_rank": len(pipeline.parts),
                "blocks_per_stage": pipeline.stage_blocks}

    def whole_on_rank0(self, named, pipeline) -> dict[str, torch.Tensor]:
        """Each named tensor whole (a gather within the stage, on every rank, in the same
        order), collected on rank 0 from every pipeline stage; empty elsewhere."""
        wholes = {name: full(tensor) for name, tensor in named}
        if pipeline is None:
            return wholes if self.rank0 else {}
        return pipeline.gather_on_rank0({name: t.detach().cpu() for name, t in wholes.items()})

    def keep_reference_grads(self, model) -> None:
        # Every name of a shared parameter: a pipeline stage may hold it under either.
        self.reference_grads = {name: p.grad.detach().clone()
                                for name, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}

    def compare_step0_gradients(self, model) -> None:
        """Every full gradient (a gather per parameter, on every rank) against the reference's,
        on rank 0; then what must be replicated over tp, on every rank."""
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        diffs, summaries, digests, largest = {}, {}, {}, 0.0
        for name, whole in self.whole_on_rank0(named, getattr(model, "pipeline", None)).items():
            summaries[name], digests[name] = trajectory.gradient_summary(whole), digest(whole)
            if self.reference_grads is not None:
                expected = self.reference_grads[name]
                diffs[name] = max_abs_diff(whole, expected)
                largest = max(largest, expected.abs().max().item())
        self.reference_grads = None
        self.gradient_summaries = summaries
        self.largest_grad = largest
        self.report["gradient_digests"] = digests
        self.check_replicated("step-0 gradients", named)
        if diffs:
            worst = sorted(diffs.items(), key=lambda item: -item[1])
            limit = self.tolerance.grad_limit(largest)
            self.report["gradients"] = {"max_abs_diff": worst[0][1], "largest_gradient": largest,
                                        "limit": limit, "worst": worst[:WORST]}
            self.checks.append(check_row("step-0 gradients", worst[0][1], limit, worst[0][0]))

    @torch.no_grad()
    def compare_weights(self, model, reference, what: str, initial: bool = False, lrs=()) -> None:
        # Not detach(): on CUDA with parallel.offload it fails on the CPU-held shard of a
        # DTensor ("Attempted to set the storage ... on device cpu", torch 2.11).
        named = list(model.named_parameters())
        expected = dict(reference.model.named_parameters(remove_duplicate=False)) if reference is not None else {}
        worst = (0.0, "")
        for name, whole in self.whole_on_rank0(named, getattr(model, "pipeline", None)).items():
            if name in expected:
                worst = max(worst, (max_abs_diff(whole, expected[name]), name))
        if not initial:
            self.check_replicated(what, named)
        if reference is None:
            return
        limit = 0.0 if initial else self.tolerance.params_limit(list(lrs), self.largest_grad)
        self.report["initial_max_diff" if initial else "weights_max_diff"] = worst[0]
        self.checks.append(check_row(what, worst[0], limit, worst[1]))

    def check_evaluation(self, model, reference) -> None:
        """The held-out loss after the last step (eval.every > 0), on the mesh and on one device."""
        cfg = self.cfg
        source = build_source(cfg, vocab_size(whole_model(model)), split="eval")
        self.report["val_loss"] = evaluate(model, source, cfg, self.dims, self.device, self.ids_group)
        if reference is None:
            return
        self.report["reference_val_loss"] = reference.evaluate(source, cfg, reference_device(reference))
        self.checks.append(check_row(f"validation loss after {cfg.parity.steps} steps",
                                     abs(self.report["val_loss"] - self.report["reference_val_loss"]),
                                     self.tolerance.loss_at(cfg.parity.steps)))

    def check_replica_groups(self, step: int, result) -> None:
        """With fault-tolerant replica groups, a step compares only if every group took it and it
        committed (parity runs with min_groups = hsdp, so a missing group makes it fail)."""
        missing = self.dims.replica_groups - (result.groups if result.committed else 0)
        self.checks.append(check_row(f"replica groups missing from step {step + 1}", missing, 0,
                                     "" if result.committed else "not committed"))

    def check_replicated(self, what: str, named) -> None:
        if self.tp_group is None:
            return
        checked, mismatches = replication_mismatches(named, self.tp_group, self.device)
        self.report.setdefault("replicated_over_tp", {})[what] = {"checked": checked, "differing": mismatches}
        detail = ", ".join(f"{n} ({d:.1e})" for n, d in list(mismatches.items())[:WORST])
        self.checks.append(check_row(f"replicated over tp, bit-identical: {what}", len(mismatches), 0, detail))

    def check_steps(self, rows) -> None:
        tol = self.tolerance
        for index, row in enumerate(rows):
            if "reference_loss" not in row:
                continue
            row["loss_diff"] = abs(row["loss"] - row["reference_loss"])
            row["grad_norm_rel_diff"] = relative_diff(row["grad_norm"], row["reference_grad_norm"])
            self.checks.append(check_row(f"loss, step {row['step']}", row["loss_diff"], tol.loss_at(index)))
            self.checks.append(check_row(f"grad norm (relative), step {row['step']}",
                                         row["grad_norm_rel_diff"], tol.norm_at(index)))

    def check_golden(self, rows) -> None:
        if not self.rank0:
            return
        losses, norms = [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
        if self.golden is not None:
            self.checks += trajectory.compare(self.golden, losses, norms, self.gradient_summaries, self.tolerance)
        if self.cfg.parity.record and (self.dims.replicas is None or self.dims.replicas.group == 0):
            trajectory.write(self.cfg.parity.record, self.cfg, str(self.spec), losses, norms,
                             self.gradient_summaries)

    def verdict(self) -> bool:
        passed = torch.tensor([1 if all(c["ok"] for c in self.checks) else 0], device=self.device)
        dist.broadcast(passed, src=0)
        self.report["checks"] = self.checks
        self.report["verdict"] = "PASS" if passed.item() else "FAIL"
        return bool(passed.item())

    def record_post_forward_layout(self, model, first_block: str):
        """The first block's parameter layouts once the whole forward is done, i.e. after the
        block's post-forward reshard: what an integer reshard_after_forward changes. Hooked
        on the part that holds the block (a first stage may hold only the embedding; a rank
        whose stages hold no block records none)."""
        model = next(part for part in parts_of(model) if first_block in dict(part.named_modules()))

        def hook(module, inputs, output):
            block = model.get_submodule(first_block)
            self.report.setdefault("post_forward_layout", {
                name: [str(tuple(p.device_mesh.shape)), [str(x) for x in p.placements], list(p.to_local().shape)]
                for name, p in block.named_parameters() if isinstance(p, DTensor)})
        return model.register_forward_hook(hook)

    def localize(self) -> dict:
        """Step 0 once more, with hooks, on a fresh copy of both sides on every rank.
        torch.compile is left out: hooks inside compiled blocks would be traced into them."""
        cfg = dataclasses.replace(self.cfg, parallel=dataclasses.replace(self.cfg.parallel, compile=False))
        model, _ = sharded_model(cfg, self.dims, self.device, cfg.parity.layers)
        reference = build_reference(cfg, self.device)
        dims = self.dims
        tp_size = dims.spec.tp
        pipeline = getattr(model, "pipeline", None)
        # A pipeline schedule needs its micro-batches; without one, step 0 runs in one pass.
        micro = cfg.training.micro_batches if pipeline is not None else 1
        routed_in = frozenset(expert_paths(reference.compute, plan_of(cfg))) if dims.spec.ep > 1 else frozenset()
        where = RankPiece(dims.data_rank, dims.data_size, dims.tp.get_local_rank() if tp_size > 1 else 0, tp_size,
                          dims.cp_rank, dims.cp_size, micro, routed_in)
        found = localize(model, reference, *self.batch(0), *self.global_batch(0, reference_device(reference)),
                         where, self.tolerance, self.device, pipeline.stage_of if pipeline is not None else None)
        found["compile"] = "off for the rerun" if self.cfg.parallel.compile else "off"
        return found

    def write_report(self) -> None:
        path = report_path(self.cfg, self.dims.replicas)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.report, indent=1, default=str))
        print(format_report(self.report), flush=True)
        print(f"report: {path}", flush=True)


def report_path(cfg, replicas) -> Path:
    """parity.report, or run.dir/parity.json. Every fault-tolerant replica group checks the
    whole model and reports: group 0 at that path, group N beside it as NAME.group-N.json
    (in its own folder, group-N/parity.json, without parity.report)."""
    if replicas is None:
        return Path(cfg.parity.report or Path(cfg.run.dir) / "parity.json")
    if not cfg.parity.report:
        return replicas.folder / "parity.json"
    given = Path(cfg.parity.report)
    return given if replicas.group == 0 else given.with_name(f"{given.stem}.group-{replicas.group}{given.suffix}")


def run_parity(cfg, spec) -> int:
    code = ParityRun(cfg, spec).run()
    # torchrun stops every rank as soon as one exits non-zero: hold all of them until
    # rank 0 has written and printed the report.
    dist.barrier()
    dist.destroy_process_group()
    return code
