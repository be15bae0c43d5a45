"""A golden trajectory: what a parity run computed, written to a small JSON file so
that later runs, on other layouts or other machines, can be checked against it.

It holds the loss and gradient norm of every step and, for every parameter, the
norm and the first values of its full step-0 gradient. The fingerprint names every
setting that changes those numbers (model, depth, data, batch, seed, optimizer,
dtype); the layout is not among them, since proving layouts equal is the point.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.parity.compare import Tolerance, check_row, relative_diff
from common.errors import UserError

FORMAT = "meshtrain-parity-trajectory/1"
HEAD = 8  # gradient values kept per parameter


def fingerprint(cfg) -> dict:
    from engine.data.sources import data_fingerprint
    data = data_fingerprint(cfg)
    return {
        "model": f"{cfg.model.name}/{cfg.model.flavor}", "layers": cfg.parity.layers, "data": data,
        "seed": cfg.training.seed, "global_batch": cfg.training.global_batch,
        "seq_len": cfg.training.seq_len, "schedule_steps": cfg.training.steps,
        "param_dtype": cfg.parallel.param_dtype,
        "optim": {k: v for k, v in vars(cfg.optim).items()},
    }


def gradient_summary(grad: torch.Tensor) -> dict:
    flat = grad.detach().float().flatten().cpu()
    return {"norm": flat.norm().item(), "head": flat[:HEAD].tolist()}


def write(path: str, cfg, mesh: str, losses: list[float], grad_norms: list[float],
          gradients: dict[str, dict]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "fingerprint": fingerprint(cfg), "recorded_on": mesh,
            "losses": losses, "grad_norms": grad_norms, "gradients": gradients}
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(body, indent=1))
    partial.replace(target)  # a crash mid-write leaves the previous file whole


def read(path: str, cfg) -> dict:
    """The trajectory at `path`, checked against this run's config (UserError if it
    cannot be compared with it)."""
    source = Path(path)
    if not source.is_file():
        raise UserError(f"parity.check_against {path!r} does not exist. Give a file written "
                        f"by an earlier run with --set parity.record=FILE.")
    try:
        body = json.loads(source.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"parity.check_against {path!r} is not a trajectory file ({err}).") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise UserError(f"parity.check_against {path!r} is not a trajectory file (expected format "
                        f"{FORMAT!r}). Record one with --set parity.record=FILE.")
    ours, theirs = fingerprint(cfg), body["fingerprint"]
    changed = [f"{key}: recorded {theirs.get(key)!r}, now {value!r}"
               for key, value in ours.items() if theirs.get(key) != value]
    if changed:
        raise UserError(f"parity.check_against {path!r} was recorded with other settings, so the "
                        f"numbers cannot match: {'; '.join(changed)}. Use the recorded settings, "
                        f"or record a new trajectory.")
    if len(body["losses"]) < cfg.parity.steps:
        raise UserError(f"parity.check_against {path!r} holds {len(body['losses'])} steps, fewer "
                        f"than parity.steps={cfg.parity.steps}. Lower parity.steps or record more.")
    return body


def compare(golden: dict, losses: list[float], grad_norms: list[float], gradients: dict[str, dict],
            tolerance: Tolerance) -> list[dict]:
    """Checks in the report's form: name, value, limit, ok, detail."""
    checks = []
    for step, (ours, theirs) in enumerate(zip(losses, golden["losses"])):
        diff = abs(ours - theirs)
        checks.append(check_row(f"golden loss, step {step + 1}", diff, tolerance.loss_at(step)))
    for step, (ours, theirs) in enumerate(zip(grad_norms, golden["grad_norms"])):
        checks.append(check_row(f"golden grad norm, step {step + 1}", relative_diff(ours, theirs),
                             tolerance.norm_at(step)))
    missing = sorted(set(golden["gradients"]) ^ set(gradients))
    if missing:
        checks.append({"name": "golden parameter names", "value": len(missing), "limit": 0, "ok": False,
                       "detail": "in one run only: " + ", ".join(missing[:10])})
    largest = max((abs(v) for g in golden["gradients"].values() for v in g["head"]), default=0.0)
    head_limit = tolerance.grad_limit(largest)
    worst_head, worst_norm = (0.0, ""), (0.0, "")
    for name in sorted(set(golden["gradients"]) & set(gradients)):
        ours, theirs = gradients[name], golden["gradients"][name]
        head = max((abs(a - b) for a, b in zip(ours["head"], theirs["head"])), default=0.0)
        worst_head = max(worst_head, (head, name))
        worst_norm = max(worst_norm, (relative_diff(ours["norm"], theirs["norm"]), name))
    checks.append(check_row("golden step-0 gradient values", worst_head[0], head_limit, worst_head[1]))
    checks.append(check_row("golden step-0 gradient norms (relative)", worst_norm[0], tolerance.norm, worst_norm[1]))
    return checks
