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

Which checkpoint a run starts from (`find_resume`, `choose`): the run's own newest
complete one that reads, falling back to older ones of the run when the newest is
damaged (the damaged ones are set aside as `step-N.unreadable`, never deleted); a
folder the user named (`resume_from`) must read as it is. `latest` may only name a
step folder directly inside the run's checkpoints folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoint.reader import Unreadable, check_readable
from common.errors import UserError

FOLDER = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
META = "meta.json"
PARTIAL = ".partial"
DCP_METADATA = ".metadata"
UNREADABLE = ".unreadable"
_STEP_FOLDER = re.compile(r"step-\d{8}")

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
    """The meta.json of a complete checkpoint folder; Unreadable if it is not one."""
    if not folder.is_dir():
        raise Unreadable(f"checkpoint folder {str(folder)!r} does not exist",
                         f"Give a folder like RUN_DIR/{FOLDER}/{step_name(10)}, or a run folder that holds "
                         f"{FOLDER}/{LATEST}.")
    missing = [name for name in (COMPLETE, META, DCP_METADATA) if not (folder / name).is_file()]
    if missing:
        raise Unreadable(f"checkpoint folder {str(folder)!r} is not a complete checkpoint (no "
                         f"{', '.join(missing)}): the save that wrote it did not finish, or it was damaged")
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as err:
        raise Unreadable(f"checkpoint folder {str(folder)!r} has an unreadable {META} ({err})") from None
    if not _meta_fields_ok(meta):
        raise Unreadable(f"checkpoint folder {str(folder)!r} has a {META} without the fields a save "
                         f"writes ({', '.join(_META_FIELDS)}, config.model.name and flavor)")
    return meta


_META_FIELDS = {"step": int, "mesh": str, "world_size": int, "data_size": int, "state_dict": dict, "config": dict}


def _meta_fields_ok(meta) -> bool:
    if not (isinstance(meta, dict) and all(isinstance(meta.get(k), t) for k, t in _META_FIELDS.items())):
        return False
    model = meta["config"].get("model")
    return (meta["step"] >= 0 and meta["world_size"] >= 1 and meta["data_size"] >= 1
            and all(isinstance(section, dict) for section in meta["config"].values()) and isinstance(model, dict) and all(isinstance(model.get(k), str) for k in ("name", "flavor"))
            and all(isinstance(shape, list) for shape in meta["state_dict"].values()))


def data_positions(meta: dict, groups: int) -> list[int]:
    """Where each of `groups` fault-tolerant replica groups starts reading, from a checkpoint's
    meta.json (groups=0: a plain run, one position). A plain checkpoint, or one whose groups
    all stopped at its step, starts every group at the step. Groups that stopped at different
    global batches (one was down while the others trained) can only go on as the same groups:
    each reads its own rows of each batch."""
    step, saved = meta["step"], meta.get("fault_tolerance")
    if saved is None:
        return [step] * max(groups, 1)
    positions = saved.get("positions") if isinstance(saved, dict) else None
    if not (isinstance(positions, list) and positions and all(type(p) is int and 0 <= p <= step for p in positions)
            and type(saved.get("batches_committed")) is int):
        raise Unreadable(f"checkpoint of step {step} has a {META} whose fault_tolerance section is not "
                         f"one a save writes (positions: a list of global batches, each at most the step; "
                         f"batches_committed: a count)")
    if positions == [step] * len(positions):
        return [step] * max(groups, 1)
    if groups != len(positions):
        now = f"{groups} fault-tolerant replica groups" if groups else "a run without fault tolerance"
        raise UserError(f"the checkpoint of step {step} was saved by {len(positions)} fault-tolerant replica "
                        f"groups whose data positions ({positions} global batches) are not its step (a group "
                        f"was down while the others trained), so it only resumes as those {len(positions)} "
                        f"groups, each from its own batch, not as {now}. Resume it with hsdp={len(positions)} "
                        f"and fault_tolerance.enabled=true (the rest of the mesh may change).")
    return positions


def check_resumable(folder: Path, meta: dict, cfg_dict: dict, expected: dict[str, list[int]],
                    total_steps: int, groups: int = 0) -> None:
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
    position = max(data_positions(meta, groups))
    if position > total_steps:
        raise UserError(f"checkpoint {str(folder)!r} is at global batch {position}, past "
                        f"training.steps={total_steps}. Raise training.steps to continue it.")


def latest(root: Path) -> Path | None:
    """The folder `latest` names, or None when there is no pointer yet. A pointer naming
    anything but a step folder directly inside `root` is Unreadable: a checkpoint never
    sends the run to another folder."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise Unreadable(f"{str(pointer)!r} cannot be read ({err})") from None
    folder = root / name
    if not _STEP_FOLDER.fullmatch(name) or folder.resolve().parent != root.resolve():
        raise Unreadable(f"{str(pointer)!r} names {name[:80]!r}, which is not a checkpoint folder of "
                         f"{str(root)!r} (a {step_name(0)}-style folder inside it)")
    return folder


def _complete_folders(root: Path) -> list[Path]:
    """Complete step folders directly inside `root`, oldest first (set-aside and partial
    folders, and links that lead out of `root`, are not among them)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_FOLDER.fullmatch(p.name) and (p / COMPLETE).is_file()
                  and p.resolve().parent == root.resolve())


@dataclass
class Candidates:
    """The checkpoints a run may start from, best first. `fallback`: whether a damaged
    one may be passed over for the next (the run's own checkpoints), or must read (a
    folder the user named). `skipped`: (path, why) of what was already found damaged."""
    folders: list[Path]
    fallback: bool = False
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Resume:
    """The checkpoint a run starts from, its meta.json, and what to try if it turns out
    unreadable when its data is read."""
    folder: Path
    meta: dict
    fallback: bool
    fallbacks: list[Path]
    skipped: list[tuple[str, str]]


def _own_checkpoints(root: Path) -> Candidates:
    try:
        newest = latest(root)
    except Unreadable as err:
        return Candidates(_complete_folders(root)[::-1], True, [(str(root / LATEST), err.cause)])
    if newest is None:
        return Candidates([])
    older = [p for p in reversed(_complete_folders(root)) if p.name < newest.name]
    return Candidates([newest, *older], True)


def find_resume(ckpt_cfg, run_dir: str | Path) -> Candidates:
    """The checkpoint folders this run may start from; none for a fresh start."""
    root = checkpoints_dir(run_dir)
    if ckpt_cfg.resume == "never":
        if (root / LATEST).exists() or _complete_folders(root):
            raise UserError(f"checkpoint.resume=never but {str(root)!r} holds checkpoints. Use an "
                            f"empty run.dir, or delete that folder to start over.")
        return Candidates([])
    # The run folder's own checkpoints win over resume_from: a job restarted with the same
    # command line continues from its last save instead of going back to where it began.
    own = _own_checkpoints(root)
    if own.folders:
        return own
    if own.skipped:
        raise UserError(f"{own.skipped[0][1]}, and there is no complete checkpoint in {str(root)!r} to fall "
                        f"back to. Resume from a folder with --resume FOLDER, or start over in a new run.dir.")
    if ckpt_cfg.resume_from:
        given = Path(ckpt_cfg.resume_from)
        return Candidates([latest(checkpoints_dir(given)) or latest(given) or given])
    if _complete_folders(root):
        raise UserError(f"{str(root)!r} holds checkpoints but no {LATEST!r} pointer. Pick one with "
                        f"--resume {root}/{_complete_folders(root)[-1].name}.")
    if ckpt_cfg.resume == "always":
        raise UserError(f"--resume (checkpoint.resume=always) but {str(root)!r} holds no complete "
                        f"checkpoint. Check run.dir, or pass --resume FOLDER.")
    return Candidates([])


def choose(candidates: Candidates, cfg_dict: dict, expected: dict[str, list[int]], total_steps: int,
           groups: int = 0) -> Resume:
    """The first candidate whose meta.json and .metadata read and whose data files are all
    there, checked against this run. A damaged one is passed over only when `fallback`
    allows; a config or model that does not fit is an error whichever folder it is."""
    skipped = list(candidates.skipped)
    for number, folder in enumerate(candidates.folders):
        try:
            meta = read_meta(folder)
            check_readable(folder)
            data_positions(meta, groups)
        except Unreadable as err:
            if not candidates.fallback:
                raise
            skipped.append((str(folder), err.cause))
            continue
        check_resumable(folder, meta, cfg_dict, expected, total_steps, groups)
        return Resume(folder, meta, candidates.fallback, candidates.folders[number + 1:], skipped)
    raise UserError(f"no checkpoint of this run can be read: {'; '.join(why for _, why in skipped)}. Resume "
                    f"from a good folder with --resume FOLDER, or start over in a new run.dir (nothing was "
                    f"deleted).")


def resume_folder(cfg_dict: dict, ckpt_cfg, run_dir, expected: dict[str, list[int]],
                  total_steps: int, groups: int = 0) -> Resume | None:
    """find_resume, then every check that can fail before training: a UserError, or the
    checkpoint to start from. `groups`: fault-tolerant replica groups (0: none)."""
    candidates = find_resume(ckpt_cfg, run_dir)
    return choose(candidates, cfg_dict, expected, total_steps, groups) if candidates.folders else None


def set_aside(root: Path, skipped: list[tuple[str, str]], resumed: Path) -> list[str]:
    """After a fallback (rank 0): rename each damaged step folder of `root` to
    step-N.unreadable, out of the way of saves and `keep`, and point `latest` at the
    checkpoint resumed from. Returns the new names."""
    kept = []
    for path, _ in skipped:
        folder = Path(path)
        if folder.parent != root or not _STEP_FOLDER.fullmatch(folder.name) or not folder.is_dir():
            continue
        target = folder.with_name(folder.name + UNREADABLE)
        number = 1
        while target.exists():
            number += 1
            target = folder.with_name(f"{folder.name}{UNREADABLE}-{number}")
        os.replace(folder, target)
        kept.append(target.name)
    _point_latest(root, resumed.name)
    return kept


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _point_latest(root: Path, name: str) -> None:
    pointer = root / (LATEST + ".tmp")
    _write_durably(pointer, name)
    os.replace(pointer, root / LATEST)


def partial_folder(root: Path, step: int, writer: str = "") -> Path:
    """Where a save of `step` is written. `writer` names a fault-tolerant replica group
    (group-N): groups take turns saving, and one group's commit must not delete a save
    another group still writes."""
    return root / (step_name(step) + (f".{writer}" if writer else "") + PARTIAL)


def commit(partial: Path, meta: dict, keep: int, writer: str = "") -> Path:
    """Mark a fully written save complete, make it `latest`, drop old ones (rank 0 only)."""
    _write_durably(partial / META, json.dumps(meta, indent=1))
    _write_durably(partial / COMPLETE, "")
    final = partial.parent / step_name(meta["step"])
    if final.exists():  # the same step saved again after a restart: the new one replaces it
        shutil.rmtree(final)
    os.replace(partial, final)
    _point_latest(final.parent, final.name)
    prune(final.parent, keep, writer)
    return final


def prune(root: Path, keep: int, writer: str = "") -> None:
    """Delete complete checkpoints beyond the newest `keep`, and partial folders that a
    crash left: all of them, or with `writer` that writer's own (its commit runs only when
    it writes no other save; another replica group may be writing one)."""
    for stale in root.glob("step-*" + (f".{writer}" if writer else "") + PARTIAL):
        shutil.rmtree(stale, ignore_errors=True)
    if keep:
        for old in _complete_folders(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
