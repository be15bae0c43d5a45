"""Where checkpoints live on disk, which one a run resumes from, and whether it fits.

    RUN_DIR/checkpoints/
        step-00000010/            complete: DCP files, .metadata, meta.json, COMPLETE
        step-00000020.partial/    being written, or left by a crash: never read
        latest                    the name of the newest complete folder

A save writes into `step-N.partial`, then meta.json, then the COMPLETE marker,
renames the folder to `step-N`, and only then replaces `latest` (a temporary
file moved over it with os.replace). Each move is atomic on a POSIX filesystem,
so a save interrupted anywhere leaves `latest` naming the previous complete
checkpoint. Nothing here needs a process group: the launcher checks a
checkpoint before any rank starts one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from engine.errors import UserError

FOLDER = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
META = "meta.json"
PARTIAL = ".partial"
DCP_METADATA = ".metadata"

# What step s means: its batch (seed, batch shape, data), the weights' shapes (model)
# and the update rule (optim). Changing any of these makes a resumed run a different run.
FIXED_SECTIONS = ("model", "optim", "data")
FIXED_KEYS = ("training.seed", "training.global_batch", "training.seq_len")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / FOLDER


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def state_dict_shapes(model) -> dict[str, list[int]]:
    """Global shapes by state-dict key; a sharded model gives the same as a plain one."""
    return {key: list(value.shape) for key, value in model.state_dict().items()}


def fixed_config(cfg_dict: dict) -> dict[str, object]:
    """The config keys that must not change across a resume, as dotted names."""
    fixed = {f"{section}.{key}": value for section in FIXED_SECTIONS
             for key, value in cfg_dict.get(section, {}).items()}
    for dotted in FIXED_KEYS:
        section, key = dotted.split(".")
        fixed[dotted] = cfg_dict.get("training", {}).get(key)
    return fixed


def check_keys(found: dict[str, list[int]], expected: dict[str, list[int]], what: str, model: str) -> None:
    """Raise a UserError listing missing, unexpected and mis-shaped keys."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    reshaped = sorted(k for k in set(found) & set(expected) if list(found[k]) != list(expected[k]))
    if not (missing or unexpected or reshaped):
        return
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    if reshaped:
        problems.append("different shapes: " + ", ".join(
            f"{k} {list(found[k])} here vs {list(expected[k])} in the model" for k in reshaped))
    raise UserError(f"{what} does not fit model {model}: {'; '.join(problems)}. "
                    f"Use the model and flavor it was saved with (see its meta.json).")


def read_meta(folder: Path) -> dict:
    """The meta.json of a complete checkpoint folder; a UserError if it is not one."""
    if not folder.is_dir():
        raise UserError(f"checkpoint folder {str(folder)!r} does not exist. Give a folder "
                        f"like RUN_DIR/{FOLDER}/{step_name(10)}, or a run folder that holds {FOLDER}/{LATEST}.")
    missing = [name for name in (COMPLETE, META, DCP_METADATA) if not (folder / name).is_file()]
    if missing:
        raise UserError(f"checkpoint folder {str(folder)!r} is not a complete checkpoint (no "
                        f"{', '.join(missing)}): the save that wrote it did not finish, or it was "
                        f"damaged. Resume from an earlier folder with --resume FOLDER.")
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint folder {str(folder)!r} has an unreadable {META} ({err}). "
                        f"Resume from an earlier folder with --resume FOLDER.") from None


def check_resumable(folder: Path, meta: dict, cfg_dict: dict, expected: dict[str, list[int]],
                    total_steps: int) -> None:
    model = f"{cfg_dict['model']['name']}/{cfg_dict['model']['flavor']}"
    check_keys(meta["state_dict"], expected, f"checkpoint {str(folder)!r} (model "
               f"{meta['config']['model']['name']}/{meta['config']['model']['flavor']})", model)
    saved, now = fixed_config(meta["config"]), fixed_config(cfg_dict)
    changed = [f"{key} was {saved[key]!r}, now {now[key]!r}" for key in sorted(set(saved) & set(now))
               if saved[key] != now[key]]
    if changed:
        raise UserError(f"cannot resume from {str(folder)!r}: {'; '.join(changed)}. These keys fix "
                        f"what each step computes; the mesh, training.steps, metrics, run and "
                        f"checkpoint keys may change. To start a new run from these weights, export "
                        f"them and use checkpoint.init_from.")
    if meta["step"] > total_steps:
        raise UserError(f"checkpoint {str(folder)!r} is at step {meta['step']}, past "
                        f"training.steps={total_steps}. Raise training.steps to continue it.")


def latest(root: Path) -> Path | None:
    """The folder `latest` names, or None when there is no pointer yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    return root / pointer.read_text().strip()


def _complete_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if not p.name.endswith(PARTIAL) and (p / COMPLETE).is_file())


def find_resume(ckpt_cfg, run_dir: str | Path) -> Path | None:
    """The checkpoint folder this run starts from, or None for a fresh start."""
    root = checkpoints_dir(run_dir)
    newest = latest(root)
    if ckpt_cfg.resume_from and ckpt_cfg.resume != "never":
        # The run folder's own checkpoint wins: a job restarted with the same command line
        # continues from its last save instead of going back to the folder it began from.
        given = Path(ckpt_cfg.resume_from)
        return newest or latest(checkpoints_dir(given)) or latest(given) or given
    if ckpt_cfg.resume == "never":
        if newest or _complete_folders(root):
            raise UserError(f"checkpoint.resume=never but {str(root)!r} holds checkpoints. Use an "
                            f"empty run.dir, or delete that folder to start over.")
        return None
    if newest is None and _complete_folders(root):
        raise UserError(f"{str(root)!r} holds checkpoints but no {LATEST!r} pointer. Pick one with "
                        f"--resume {root}/{_complete_folders(root)[-1].name}.")
    if newest is None and ckpt_cfg.resume == "always":
        raise UserError(f"--resume (checkpoint.resume=always) but {str(root)!r} holds no complete "
                        f"checkpoint. Check run.dir, or pass --resume FOLDER.")
    return newest


def resume_folder(cfg_dict: dict, ckpt_cfg, run_dir, expected: dict[str, list[int]],
                  total_steps: int) -> Path | None:
    """find_resume, then every check that can fail before training: a UserError, or the folder."""
    folder = find_resume(ckpt_cfg, run_dir)
    if folder is not None:
        check_resumable(folder, read_meta(folder), cfg_dict, expected, total_steps)
    return folder


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def partial_folder(root: Path, step: int) -> Path:
    return root / (step_name(step) + PARTIAL)


def commit(partial: Path, meta: dict, keep: int) -> Path:
    """Mark a fully written save complete, make it `latest`, drop old ones (rank 0 only)."""
    _write_durably(partial / META, json.dumps(meta, indent=1))
    _write_durably(partial / COMPLETE, "")
    final = partial.with_name(partial.name[:-len(PARTIAL)])
    if final.exists():  # the same step saved again after a restart: the new one replaces it
        shutil.rmtree(final)
    os.replace(partial, final)
    pointer = final.parent / (LATEST + ".tmp")
    _write_durably(pointer, final.name)
    os.replace(pointer, final.parent / LATEST)
    prune(final.parent, keep)
    return final


def prune(root: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest `keep`, and partial folders that a
    crash left (commit runs only when no save is being written)."""
    for stale in root.glob("step-*" + PARTIAL):
        shutil.rmtree(stale, ignore_errors=True)
    if keep:
        for old in _complete_folders(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
