"""What a run shows: one line per step on rank 0, a JSON line per step on disk, a summary.

The JSON lines are flushed every step, so a crash loses at most the step in flight.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class StepLog:
    def __init__(self, total_steps: int, run_dir: str | Path | None, enabled: bool,
                 every: int = 1, stream=sys.stdout, append: bool = False):
        self.total_steps = total_steps
        self.enabled = enabled
        self.every = every
        self.stream = stream
        self.started = time.perf_counter()
        self.step_seconds: list[float] = []
        self.jsonl = None
        if enabled and run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            # A resumed run appends: its steps follow the ones logged before the restart.
            self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a" if append else "w")

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def step(self, step: int, result, tokens: int, seconds: float) -> None:
        self.step_seconds.append(seconds)
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        # The first step pays for warm-up; later steps predict the rest better.
        recent = self.step_seconds[1:] or self.step_seconds
        remaining = sum(recent[-10:]) / len(recent[-10:]) * (self.total_steps - step - 1)
        record = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm,
                  "lr": result.lr, "tokens_per_s": tokens / seconds, "step_s": seconds}
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if step % self.every == 0 or step == self.total_steps - 1:
            width = len(str(self.total_steps))
            self.print(f"step {step + 1:>{width}}/{self.total_steps} | loss {result.loss:.4f} | "
                       f"grad norm {result.grad_norm:.3f} | lr {result.lr:.2e} | "
                       f"{tokens / seconds:,.0f} tok/s | elapsed {_clock(elapsed)} | "
                       f"eta {_clock(remaining)}")

    def summary(self, results, tokens: int) -> None:
        if not self.enabled or not results:
            return
        steady = self.step_seconds[1:] or self.step_seconds
        self.print(
            f"done: {len(results)} steps in {_clock(time.perf_counter() - self.started)} | "
            f"loss {results[0].loss:.4f} -> {results[-1].loss:.4f} | "
            f"{tokens * len(steady) / sum(steady):,.0f} tok/s after the first step")
        if self.jsonl:
            self.jsonl.close()
