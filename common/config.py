"""Typed run configuration: a YAML file, then `--set section.key=value` overrides.

Every key and type is checked here, before any process group exists, so a
typo costs one line of output rather than eight hung ranks.
"""

from __future__ import annotations

import dataclasses
import math
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.errors import UserError


@dataclass
class ModelConfig:
    name: str = "llama"
    flavor: str = "debug"
    plugin: str = ""  # comma-separated modules to import first; they may register models and plans


@dataclass
class ParallelConfig:
    mesh: str = "dp=-1"
    plan: str = ""  # the parallelize plan's name; "": the plan named after model.name, else llama
    device: str = "auto"  # auto, cpu or cuda
    backend: str = "auto"  # auto, gloo or nccl
    sequence_parallel: bool = False
    loss_parallel: bool = False  # keep the logits sharded by vocabulary into the loss
    activation_checkpoint: str = "none"  # none, full, selective (every Nth block) or op
    checkpoint_every: int = 2  # N for selective
    # In the blocks activation_checkpoint leaves alone, recompute norms, SwiGLU's products
    # and sequence parallel's gathers in backward, keeping matmul and attention outputs:
    # activations at their true size, for one more tp all-gather per sublayer in backward
    # under sequence parallel (docs/parallelism.md, "activations at their true size").
    recompute_cheap: bool = False
    compile: bool = False  # torch.compile each block
    reshard_after_forward: bool | int | str = True  # true, false, auto or a group size
    root_reshard_after_forward: bool = False
    param_dtype: str = "float32"  # float32 or bfloat16: the dtype of forward and backward
    reduce_dtype: str = "float32"  # the dtype gradients are reduced in
    offload: bool = False  # keep sharded parameters, gradients and optimizer state on the CPU
    # Float8 matmuls in the blocks' linears through torchao (parallel/float8.py): none,
    # tensorwise or rowwise scaling; emulated on the CPU. float8_all_gather (tensorwise
    # only) makes FSDP all-gather those weights in float8, half the bytes of bf16.
    float8: str = "none"
    float8_all_gather: bool = False
    # Pipeline parallel (--mesh pp=N, docs/parallelism.md): the schedule, the stages each rank
    # holds (2 or more for the looped schedules), and an explicit split: blocks per stage,
    # comma-separated, one number per stage (empty: an even split that counts the embedding
    # and the output layer as a block each).
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_split: str = ""


@dataclass
class TrainingConfig:
    steps: int = 40
    global_batch: int = 16  # sequences per optimizer step, over all data-parallel ranks
    seq_len: int = 64
    seed: int = 0
    micro_batches: int = 1  # gradient accumulation: each rank's rows split into this many passes


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw, or sgd (plain, no momentum: a sharper parity check)
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 4
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    max_norm: float = 1.0  # gradient clipping; 0 turns it off


@dataclass
class DataConfig:
    source: str = "corpus"  # corpus (a text read as bytes), tokens (launch/prepare.py output) or synthetic
    path: str = "data/corpus.txt"  # the text, or for tokens one or more prepared folders, comma-separated
    weights: str = ""  # tokens: mixture weights, one per folder in path, comma-separated (default equal)
    holdout: float = 0.0  # the fraction of the data kept out of training for evaluation


@dataclass
class EvalConfig:
    every: int = 0  # evaluate every N steps and after the last; 0 never
    steps: int = 2  # global batches per evaluation
    path: str = ""  # held-out data of the same kind as data.path; empty: data.holdout's part


@dataclass
class MoEConfig:
    """A mixture of experts' balancing (models/moe.py; docs/parallelism.md, "Mixture of experts")."""
    load_balance: float = 0.0  # weight of the per-sequence load-balancing loss in the step's loss; 0: none
    bias_rate: float = 0.0  # each step, the sigmoid router's bias moves this much toward balance; 0: never


@dataclass
class MetricsConfig:
    log_every: int = 1
    tensorboard: bool = False  # write scalars under run.dir/tensorboard
    skip_nonfinite: bool = False  # a NaN/inf loss skips the update instead of stopping the run


@dataclass
class PrefetchConfig:
    """FSDP2 all-gather prefetch (parallel/prefetch.py). 0 keeps FSDP2's implicit behaviour."""
    forward: int = 0  # in forward, each block all-gathers the next N blocks ahead
    backward: int = 0  # in backward, each block all-gathers the N blocks before it ahead
    unshard_ahead: int = 0  # the loop unshards the root and the first N blocks before fetching the batch


@dataclass
class RunConfig:
    dir: str = "runs/default"


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps and at the end; 0 saves nothing
    keep: int = 3  # complete checkpoints to keep, newest first; 0 keeps all
    async_save: bool = False  # write in a background thread while training goes on
    resume: str = "auto"  # auto, always or never (docs/checkpoint.md)
    resume_from: str = ""  # a checkpoint folder or run folder to resume from, instead of run.dir
    init_from: str = ""  # a single-file full state dict (an export) whose weights start the run
    export: str = ""  # write the final weights to this single file (torch.save of full tensors)
    hf_import: str = ""  # a Hugging Face Llama folder: its config.json sets the model, its weights start the run
    hf_export: str = ""  # write the final weights and config.json to this folder in Hugging Face format


@dataclass
class ParityConfig:
    """launch/run.py --parity (docs/parity.md)."""
    steps: int = 5  # optimizer steps compared, each on the mesh and on one device
    layers: int = 0  # build both sides with this many blocks (0: the flavor's depth)
    reference: bool = True  # run the single-device reference (false: compare with check_against only)
    reference_device: str = "auto"  # auto (this rank's device) or cpu
    record: str = ""  # write this run's trajectory to this file, to check later runs against
    check_against: str = ""  # compare with a trajectory written earlier by parity.record
    report: str = ""  # the JSON report; default run.dir/parity.json
    localize: bool = True  # on failure, rerun step 0 with hooks and name the first diverging module


@dataclass
class DryRunConfig:
    # launch/run.py --dry-run (docs/planning.md): the device profile the step time is predicted for
    device: str = "H100"  # H100, H200, A100, or custom (then give the three numbers below)
    gpus_per_node: int = 8  # a mesh dimension that spans more ranks than this crosses nodes
    peak_tflops: float = 0.0  # dense bf16 peak per GPU; 0 takes the profile's
    intra_node_gbps: float = 0.0  # GB/s per GPU inside a node; 0 takes the profile's
    inter_node_gbps: float = 0.0  # GB/s per GPU between nodes; 0 takes the profile's
    # The fraction of the bf16 peak the step reaches: 0.45, the median MFU of the engine's compiled step
    # on one H100 over four 1B- and 8B-shaped runs (docs/benchmarks.md, 2026-11-25; 40.9% to 47.3%).
    compute_efficiency: float = 0.45
    # A mixture of experts' routing depends on values, which a dry run has none of: the busiest ep rank's routed
    # rows over the mean ep rank's (1: balanced; at most ep: one rank takes every row). Its all-to-all, memory and
    # expert compute are what the dry run simulates (models/moe.py: assumed_sizes).
    expert_load: float = 1.0
    report: str = ""  # also write the report as JSON to this path
    gpu_memory_gib: float = 80.0  # --plan-for: each GPU's memory; 10% is kept for what is not a tensor
    top: int = 5  # --plan-for: how many of the best layouts to print as command lines
    pp: str = "1,2,4,8,16"  # --plan-for: the pipeline sizes to search, comma-separated ("1": no pipeline)
    # --plan-for, a mixture of experts: the ep degrees to search, comma-separated; each mesh takes those that divide
    # its dp and the experts. "": 1, the largest within a node and the largest of all (search.expert_degrees)
    ep: str = ""
    # --plan-for: processes that run the search jobs side by side; 0: one per CPU core, at most 4 (each holds
    # a few GB at 405B: 3.2 to 4.5 GB resident, docs/planning.md)
    search_workers: int = 0
    # The report's goodput under failures (engine/dryrun/goodput.py): the failure rate, by default Meta's for Llama 3
    # 405B (466 interruptions in 54 days on 16,384 GPUs), and two times to set to your own: a restart (of the job,
    # or of one replica group), and the interval between checkpoints. Their defaults are assumptions, not measurements.
    gpu_failures_per_day: float = 466 / 54 / 16384
    restart_s: float = 600.0
    checkpoint_interval_s: float = 1800.0


@dataclass
class FaultToleranceConfig:
    """hsdp's replica groups as separate jobs joined through torchft (parallel/replicas.py,
    docs/fault_tolerance.md): a lost group does not stop the others."""
    enabled: bool = False
    group: int = 0  # this job's replica group, 0 to hsdp - 1
    lighthouse: str = ""  # the torchft Lighthouse's address (http://host:port); "": the TORCHFT_LIGHTHOUSE variable
    min_groups: int = 1  # a step commits only with at least this many groups in it
    rejoin: bool = False  # this group was started again: it keeps its data position and heals from a live group
    timeout_s: float = 10.0  # collectives across groups and the commit vote give up after this long
    quorum_timeout_s: float = 60.0  # how long a step waits for the groups' quorum
    quorum_retries: int = 20  # quorum requests retried when the Lighthouse does not answer (it restarted)
    fingerprint: bool = False  # log a checksum of the group's weights after each step, to compare groups


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    run: RunConfig = field(default_factory=RunConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    dryrun: DryRunConfig = field(default_factory=DryRunConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)


_CHOICES = {
    ("parallel", "device"): ("auto", "cpu", "cuda"),
    ("dryrun", "device"): ("H100", "H200", "A100", "custom"),
    ("parallel", "backend"): ("auto", "gloo", "nccl"),
    ("data", "source"): ("corpus", "tokens", "synthetic"),
    ("parallel", "activation_checkpoint"): ("none", "full", "selective", "op"),
    ("parallel", "param_dtype"): ("float32", "bfloat16"),
    ("parallel", "float8"): ("none", "tensorwise", "rowwise"),
    ("parallel", "reduce_dtype"): ("float32", "bfloat16"),
    ("parallel", "pp_schedule"): ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                                   "DualPipeV"),
    ("checkpoint", "resume"): ("auto", "always", "never"),
    ("optim", "name"): ("adamw", "sgd"),
    ("parity", "reference_device"): ("auto", "cpu"),
}

@dataclass(frozen=True)
class Range:
    """The values a numeric key takes: [low, high], each end open or closed; always finite."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""

    def holds(self, value) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'above' if self.low_open else 'at least'} {self.low:g}"
        high = "2**63 - 1" if self.high == INT64 else f"{self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1, high_open=True)
INT64 = 2**63 - 1  # the largest integer any key takes: torch and numpy count in int64

# Every numeric key, with the values that can run. Checked with the types, before any
# process group: a value outside can only fail later (a NaN at step 2, torch's own
# ValueError from the optimizer), or never finish.
RANGES = {
    ("parallel", "checkpoint_every"): POSITIVE,
    ("training", "steps"): POSITIVE,
    ("training", "global_batch"): POSITIVE,
    ("training", "seq_len"): POSITIVE,
    ("training", "seed"): Range(0, INT64, meaning="the seed of every random stream"),
    ("training", "micro_batches"): POSITIVE,
    ("optim", "lr"): NON_NEGATIVE,
    ("optim", "weight_decay"): NON_NEGATIVE,
    ("optim", "beta1"): Range(0, 1, high_open=True, meaning="AdamW's first-moment decay"),
    ("optim", "beta2"): Range(0, 1, high_open=True, meaning="AdamW's second-moment decay"),
    ("optim", "eps"): Range(0, low_open=True, meaning="added to AdamW's denominator; 0 divides by zero"),
    ("optim", "warmup_steps"): NON_NEGATIVE,
    ("optim", "min_lr_ratio"): Range(0, 1, meaning="the fraction of lr the cosine decays to"),
    ("optim", "max_norm"): Range(0, meaning="0 turns clipping off"),
    ("data", "holdout"): Range(0, 1, high_open=True, meaning="the fraction of the data kept for evaluation"),
    ("eval", "every"): NON_NEGATIVE,
    ("eval", "steps"): POSITIVE,
    ("metrics", "log_every"): POSITIVE,
    ("prefetch", "forward"): Range(0, meaning="0 keeps FSDP2's implicit behaviour"),
    ("prefetch", "backward"): Range(0, meaning="0 keeps FSDP2's implicit behaviour"),
    ("prefetch", "unshard_ahead"): Range(0, meaning="0 keeps FSDP2's implicit behaviour"),
    ("checkpoint", "every"): Range(0, meaning="0 saves nothing"),
    ("checkpoint", "keep"): Range(0, meaning="0 keeps all"),
    ("parity", "steps"): POSITIVE,
    ("parallel", "pp_stages_per_rank"): Range(1, INT64, meaning="pipeline stages on each rank"),
    ("parity", "layers"): Range(0, meaning="0 takes the flavor's depth"),
    ("moe", "load_balance"): Range(0, meaning="0 adds no load-balancing loss"),
    ("moe", "bias_rate"): Range(0, meaning="0 leaves the router's bias alone"),
    ("dryrun", "gpus_per_node"): POSITIVE,
    ("dryrun", "peak_tflops"): Range(0, meaning="0 takes the device profile's"),
    ("dryrun", "intra_node_gbps"): Range(0, meaning="0 takes the device profile's"),
    ("dryrun", "inter_node_gbps"): Range(0, meaning="0 takes the device profile's"),
    ("dryrun", "compute_efficiency"): Range(0, 1, low_open=True, meaning="the fraction of peak the matmuls reach"),
    ("dryrun", "gpu_memory_gib"): POSITIVE,
    ("dryrun", "top"): POSITIVE,
    ("dryrun", "search_workers"): Range(0, 256, meaning="0 takes one per CPU core, at most 4"),
    ("dryrun", "gpu_failures_per_day"): Range(0, meaning="failures per GPU per day; 0: none"),
    ("dryrun", "restart_s"): Range(0, meaning="seconds a restart takes"),
    ("dryrun", "checkpoint_interval_s"): Range(0, meaning="seconds between checkpoints"),
    ("fault_tolerance", "group"): Range(0, INT64, meaning="this job's replica group, counted from 0"),
    ("fault_tolerance", "min_groups"): Range(1, INT64, meaning="the replica groups a step needs"),
    ("fault_tolerance", "timeout_s"): POSITIVE,
    ("fault_tolerance", "quorum_timeout_s"): POSITIVE,
    ("fault_tolerance", "quorum_retries"): Range(0, 1_000_000, meaning="retries of a quorum request"),
}


# Text keys that hold comma-separated whole numbers: (may be empty, the least number, what to give).
_LISTS = {
    ("parallel", "pp_split"): (True, 0, "the blocks of each pipeline stage, comma-separated whole numbers (e.g. "
                                        "3,2,2,3; 0 only for a first or last stage), or nothing for the even split"),
    ("dryrun", "pp"): (False, 1, "the pipeline sizes --plan-for searches, comma-separated positive whole numbers "
                                 "(e.g. 1,2,4,8,16; 1 alone: no pipeline parallel)"),
    ("dryrun", "ep"): (True, 1, "the ep degrees --plan-for searches for a mixture of experts, comma-separated "
                                "positive whole numbers (e.g. 1,8,64), or nothing for 1, the largest within a "
                                "node and the largest of all"),
}


def _is_list_of_whole(value: str, may_be_empty: bool, least: int) -> bool:
    if not value.strip():
        return may_be_empty
    parts = [part.strip() for part in value.split(",")]
    return all(part.isascii() and part.isdigit() and least <= int(part) <= INT64 for part in parts)


def _fields(cls) -> dict[str, tuple[type, object]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _coerce(path: str, value, kind):
    """Check `value` against the annotated type; ints are accepted as floats, "1e-3" (which
    YAML reads as text) as a float, and numbers as text where text is expected."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if kind in (int, float) and isinstance(value, bool):
        ok = False
    elif isinstance(kind, types.UnionType):
        ok = isinstance(value, typing.get_args(kind))
    else:
        ok = isinstance(value, kind)
    if not ok:
        name = getattr(kind, "__name__", str(kind))
        raise UserError(
            f"config key {path} must be of type {name}, but got {value!r} "
            f"({type(value).__name__})."
        )
    return value


def _set(cfg: Config, dotted: str, value) -> None:
    parts = dotted.split(".")
    sections = _fields(Config)
    if len(parts) != 2 or parts[0] not in sections:
        raise UserError(
            f"unknown config key {dotted!r}. Keys are section.key, with sections "
            f"{', '.join(sections)}."
        )
    section_name, key = parts
    section = getattr(cfg, section_name)
    keys = _fields(type(section))
    if key not in keys:
        raise UserError(
            f"unknown config key {dotted!r}. Accepted keys in section {section_name!r}: "
            f"{', '.join(keys)}."
        )
    value = _coerce(dotted, value, keys[key][0])
    choices = _CHOICES.get((section_name, key))
    if choices and value not in choices:
        raise UserError(f"config key {dotted} is {value!r}; accepted values: {', '.join(choices)}.")
    allowed = RANGES.get((section_name, key))
    too_large = isinstance(value, int) and abs(value) > INT64
    if allowed is not None and (too_large or not allowed.holds(value)):
        number = "a whole number" if isinstance(value, int) else "a finite number"
        largest = " and at most 2**63 - 1" if too_large else ""
        meaning = f" ({allowed.meaning})" if allowed.meaning else ""
        raise UserError(f"config key {dotted} must be {number} {allowed}{largest}{meaning}, but got {value!r}.")
    form = _LISTS.get((section_name, key))
    if form is not None and not _is_list_of_whole(value, form[0], form[1]):
        raise UserError(f"config key {dotted} is {value!r}; give {form[2]}.")
    if isinstance(value, str) and "\x00" in value:
        raise UserError(f"config key {dotted} holds a NUL character ({value!r}), which no name or path can hold.")
    setattr(section, key, value)


def _apply_mapping(cfg: Config, data, source: str) -> None:
    if not isinstance(data, dict):
        raise UserError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}.")
    for section, body in data.items():
        if not isinstance(body, dict):
            if section in _fields(Config):
                raise UserError(f"{source}: section {section!r} must be a mapping of keys to values.")
            _set(cfg, str(section), body)  # raises the unknown-key error
        for key, value in body.items():
            _set(cfg, f"{section}.{key}", value)


def parse_override(text: str) -> tuple[str, object]:
    """`section.key=value` with the value read as YAML (so 3, 3.0, true, text)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {text!r}: expected section.key=value, for example --set training.steps=10.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError):  # not YAML (or nested past Python's stack): the text itself
        value = raw
    return key.strip(), value


def read_yaml(path: Path):
    """A YAML config file's content; a UserError unless it is a regular, readable UTF-8
    YAML file (a device, a pipe or a folder could only block, or fail later)."""
    what = f"config file {str(path)!r}"
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{what} does not exist. Pass an existing YAML file with --config.") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{what} cannot be read ({getattr(err, 'strerror', None) or err}). Pass a YAML file "
                        f"with --config.") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a device, pipe or socket)"
        raise UserError(f"{what} is {kind}. Pass a YAML file with --config.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{what} is not UTF-8 text (byte {err.start:,} cannot be decoded): is it a YAML "
                        f"file? Pass a YAML file with --config.") from None
    except OSError as err:
        raise UserError(f"{what} cannot be read ({err.strerror or err}).") from None
    try:
        return yaml.safe_load(text) or {}
    except (yaml.YAMLError, RecursionError) as err:
        raise UserError(f"{what} is not valid YAML: {' '.join(str(err).split()) or type(err).__name__}") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    cfg = Config()
    if path is not None:
        _apply_mapping(cfg, read_yaml(Path(path)), str(path))
    return with_overrides(cfg, overrides)


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with `key=value` overrides applied, as --set applies them."""
    import copy
    changed = copy.deepcopy(cfg)
    for text in overrides:
        _set(changed, *parse_override(text))
    return changed


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
