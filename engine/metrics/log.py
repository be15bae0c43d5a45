"""What a run shows: one line per step on rank 0, a JSON line per step on disk, TensorBoard
scalars when asked, a summary.

The JSON lines are flushed every step, so a crash loses at most the step in flight.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class RunShape:
    """What stays fixed over a run and turns step times into rates."""
    tokens_per_step: int
    world_size: int
    flops_per_token: float
    device_name: str
    peak_flops: float | None  # per device; None when the device is not in engine/metrics/throughput.py


def step_record(step: int, result, seconds: float, shape: RunShape,
                memory: tuple[float, float]) -> dict[str, float]:
    tokens_per_s = shape.tokens_per_step / seconds
    flops_per_rank = shape.flops_per_token * tokens_per_s / shape.world_size
    record = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
              "tokens_per_s": tokens_per_s, "tokens_per_s_per_rank": tokens_per_s / shape.world_size,
              "flops_per_s_per_rank": flops_per_rank, "step_s": seconds, "data_s": result.data_s,
              "forward_backward_s": result.forward_backward_s, "optimizer_s": result.optimizer_s,
              "memory_gib": memory[0], "peak_memory_gib": memory[1], "skipped": result.skipped}
    if shape.peak_flops:
        record["mfu"] = flops_per_rank / shape.peak_flops
    if result.val_loss is not None:
        record.update(val_loss=result.val_loss, val_ppl=perplexity(result.val_loss), eval_s=result.eval_s)
    if result.routed:
        record["experts"] = result.routed
    if result.groups:  # fault-tolerant replica groups (parallel/replicas.py)
        record.update(committed=result.committed, groups=result.groups, replica_step=result.replica_step,
                      time=time.time())
        if result.fingerprint:
            record["fingerprint"] = result.fingerprint
    return record


def _experts_text(experts: dict) -> str:
    """The most unbalanced layer's load (max over mean tokens per expert), and the mean
    router entropy and load-balancing loss over the layers."""
    worst = max(experts, key=lambda layer: experts[layer]["max_over_mean"])
    mean = {key: sum(e[key] for e in experts.values()) / len(experts) for key in ("entropy", "balance_loss")}
    return (f" | experts: load max/mean {experts[worst]['max_over_mean']:.2f} ({worst}), entropy "
            f"{mean['entropy']:.3f}, balance loss {mean['balance_loss']:.3f}")


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


def _flops_text(record: dict) -> str:
    achieved = f"{record['flops_per_s_per_rank'] / 1e9:,.1f} GFLOP/s/rank"
    return f"{achieved} (MFU {record['mfu']:.1%})" if "mfu" in record else achieved


class StepLog:
    def __init__(self, total_steps: int, run_dir: str | Path | None, enabled: bool,
                 every: int = 1, stream=sys.stdout, tensorboard: bool = False, append: bool = False):
        self.total_steps = total_steps
        self.enabled = enabled
        self.every = every
        self.stream = stream
        self.started = time.perf_counter()
        self.step_seconds: list[float] = []
        self.jsonl = None
        self.writer = None
        if enabled and run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            # A resumed run appends: its steps follow the ones logged before the restart.
            self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a" if append else "w")
            if tensorboard:
                # Imported only when asked: it pulls in the tensorboard package.
                from torch.utils.tensorboard import SummaryWriter
                logdir = Path(run_dir) / "tensorboard"
                self.writer = SummaryWriter(str(logdir))
                self.print(f"tensorboard: tensorboard --logdir {logdir}")

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def describe(self, shape: RunShape) -> None:
        peak = (f"MFU against {shape.peak_flops / 1e12:,.0f} TFLOP/s dense BF16 per device"
                if shape.peak_flops else "no peak known, so achieved FLOP/s instead of MFU")
        self.print(f"device {shape.device_name}: {shape.flops_per_token / 1e6:,.1f} MFLOP per token "
                   f"(6N + attention), {peak}")

    def step(self, step: int, result, seconds: float, shape: RunShape,
             memory: tuple[float, float]) -> None:
        self.step_seconds.append(seconds)
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        # The first step pays for warm-up; later steps predict the rest better.
        recent = self.step_seconds[1:] or self.step_seconds
        remaining = sum(recent[-10:]) / len(recent[-10:]) * (self.total_steps - step - 1)
        record = step_record(step, result, seconds, shape, memory)
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.writer:
            for key, value in record.items():
                if key not in ("step", "experts"):
                    self.writer.add_scalar(key, value, step)
            for layer, figures in record.get("experts", {}).items():
                for key in ("max_over_mean", "entropy", "balance_loss"):
                    self.writer.add_scalar(f"experts/{layer}/{key}", figures[key], step)
                # The load as a histogram over the experts: a balanced layer is one narrow bar.
                self.writer.add_histogram(f"experts/{layer}/tokens_per_expert",
                                          torch.tensor(figures["tokens_per_expert"]), step)
        if step % self.every == 0 or step == self.total_steps - 1 or result.val_loss is not None:
            width = len(str(self.total_steps))
            notes = " | SKIPPED (non-finite loss)" if result.skipped else ""
            if "groups" in record:
                notes += f" | {result.groups} replica group(s)"
                if not result.committed:
                    notes += " | NOT COMMITTED (a replica group failed mid-step; this batch runs again)"
            if "experts" in record:
                notes += _experts_text(record["experts"])
            if result.val_loss is not None:
                notes += (f" | val loss {result.val_loss:.4f} ppl {record['val_ppl']:,.2f} "
                            f"({result.eval_s:.1f}s)")
            self.print(f"step {step + 1:>{width}}/{self.total_steps} | loss {result.loss:.4f} | "
                       f"grad norm {result.grad_norm:.3f} | lr {result.lr:.2e} | "
                       f"{record['tokens_per_s']:,.0f} tok/s ({record['tokens_per_s_per_rank']:,.0f}/rank) | "
                       f"{_flops_text(record)} | data {result.data_s:.3f}s fwd+bwd "
                       f"{result.forward_backward_s:.3f}s optim {result.optimizer_s:.3f}s | "
                       f"mem {memory[0]:.2f}/{memory[1]:.2f} GiB max rank | "
                       f"elapsed {_clock(elapsed)} | eta {_clock(remaining)}{notes}")

    def summary(self, results, tokens: int) -> None:
        if not self.enabled or not results:
            return
        steady = self.step_seconds[1:] or self.step_seconds
        self.print(
            f"done: {len(results)} steps in {_clock(time.perf_counter() - self.started)} | "
            f"loss {results[0].loss:.4f} -> {results[-1].loss:.4f} | "
            f"{tokens * len(steady) / sum(steady):,.0f} tok/s after the first step")
        self.close()

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.writer:
            self.writer.close()
