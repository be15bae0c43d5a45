"""Train a model on a mesh: `python launch/run.py` or `torchrun ... launch/run.py`.

Run without torchrun, it checks the config and mesh, then runs torchrun's agent in
this process with as many ranks as the mesh needs (forked from a fork server on the
CPU, spawned on GPUs), and exits with the ranks' own code (launch/exits.py). Under torchrun, each rank checks again before any process
group exists, then: mesh, model on meta, plan, materialise, loop. Bad input exits
with code 2 and one paragraph.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from common.config import load_config  # noqa: E402
from common.errors import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NONFINITE_LOSS, EXIT_OK, EXIT_USER_ERROR,  # noqa: E402
                           NonFiniteLoss, UserError)
from common.workers import WorkerDied  # noqa: E402
from engine.plugins import register_model_sources  # noqa: E402
from launch.exits import leave_crash, leave_error, prepare_forked_rank, ranks_print_errors, run_agent  # noqa: E402
from launch.build import pick_device, sharded_model, start_process_group  # noqa: E402
from parallel.mesh import MeshSpec, parse_mesh  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402
from parallel.replicas import check_lighthouse, lighthouse_address  # noqa: E402

DEFAULT_CONFIG = REPO / "configs" / "debug.yaml"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: configs/debug.yaml)")
    parser.add_argument("--mesh", help="mesh, e.g. dp=4,tp=2 or hsdp=2,dp=2,tp=2 (overrides parallel.mesh)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set training.steps=10 (repeatable)")
    parser.add_argument("--explain", action="store_true",
                        help="print, before training, what the plan did to each module")
    parser.add_argument("--parity", action="store_true",
                        help="instead of training, run parity.steps steps on the mesh and on one "
                        "device and compare them (docs/parity.md); exit code 0 on PASS, 1 on FAIL")
    parser.add_argument("--dry-run", action="store_true",
                        help="instead of training, simulate one step of the layout in this process for "
                        "--world ranks and report per-rank memory, communication and predicted step time "
                        "(docs/planning.md); uses no accelerator and no real memory")
    parser.add_argument("--plan-for", action="store_true",
                        help="search the layouts the engine supports for --world N GPUs (dryrun.gpus_per_node, "
                        "dryrun.gpu_memory_gib), drop those that do not fit, and print the fastest as "
                        "command lines (docs/planning.md)")
    parser.add_argument("--trace", metavar="FILE",
                        help="with --dry-run: also write each simulated rank role's step as a Chrome trace "
                        "(compute, collectives, pipeline messages and bubble on a timeline) to open in "
                        "ui.perfetto.dev or chrome://tracing (docs/planning.md)")
    parser.add_argument("--world", type=int, metavar="N",
                        help="with --dry-run or --plan-for: the number of ranks (default: the mesh's size)")
    parser.add_argument("--nproc", type=int, help="processes to start when not under torchrun "
                        "(default: the mesh's size)")
    parser.add_argument("--resume", nargs="?", const="", metavar="FOLDER",
                        help="resume from the run folder's latest checkpoint, or from FOLDER "
                        "(sets checkpoint.resume=always; see docs/checkpoint.md)")
    parser.add_argument("--max-restarts", type=int, metavar="N",
                        help="when not under torchrun: restart all ranks up to N times after a "
                        "failure (default 0); each restart resumes from the latest checkpoint. With "
                        "fault-tolerant replica groups, restart a failed group up to N times (default 3)")
    return parser.parse_args(argv)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def check_simulated_model(model, cfg, spec, plan_for: bool) -> None:
    """A mixture of experts is simulated at an assumed load (dryrun.expert_load); the
    planner takes it, or ep where that is less, at each ep degree it searches."""
    from models.moe import MoE
    if not any(isinstance(module, MoE) for module in model.modules()):
        return
    from engine.dryrun.simulate import check_expert_load
    if plan_for:
        if not cfg.dryrun.expert_load >= 1:
            raise UserError(f"dryrun.expert_load={cfg.dryrun.expert_load} must be at least 1 (every ep rank gets as many "
                            f"routed rows): it is the busiest ep rank's rows over the mean, which --plan-for takes at "
                            f"each ep degree it searches, or ep where that is less.")
    else:
        check_expert_load(cfg.dryrun.expert_load, spec.ep)


def check(args: argparse.Namespace, world_size: int | None):
    """Everything that can be checked without a process group. Returns (config, mesh).
    Every path it reads was given by the user, so a path the system will not take (too
    long, unreadable, a device that fails to read) is bad input too."""
    try:
        return checked_config(args, world_size)
    except OSError as err:
        where = f" {str(err.filename)[:200]!r}" if err.filename else ""
        raise UserError(f"cannot use the path{where} ({err.strerror or err}). Check the paths in the config "
                        f"and on the command line.") from None


def checked_config(args: argparse.Namespace, world_size: int | None):
    cfg = load_config(args.config, args.overrides)
    if args.mesh is not None:
        cfg.parallel.mesh = args.mesh
    if args.resume is not None:
        cfg.checkpoint.resume = "always"
        cfg.checkpoint.resume_from = args.resume or cfg.checkpoint.resume_from
    spec = parse_mesh(cfg.parallel.mesh)
    if world_size is None:
        world_size = spec.world_size
        if world_size is None:
            raise UserError(f"--mesh {spec} has a -1 dimension, so the number of processes is not "
                            f"known. Pass --nproc N, or give every size.")
    elif world_size < 1:
        raise UserError(f"--nproc {world_size}: give the number of processes to start, at least 1.")
    if cfg.fault_tolerance.enabled and under_torchrun():
        world_size *= whole_world_factor(spec)  # torchrun started one replica group
    if cfg.fault_tolerance.enabled and args.parity:
        # A parity check compares every step with one device: each must have every group
        cfg.fault_tolerance.min_groups = spec.hsdp
    spec = spec.resolve(world_size)
    data_path = Path(cfg.data.path)
    if not data_path.is_absolute() and not data_path.exists() and (REPO / data_path).exists():
        cfg.data.path = str(REPO / data_path)  # shipped data, found from any working directory
    from models import build_on_meta
    from models.contract import check_model_contract, max_seq_len, vocab_size
    from parallel.apply import tensor_parallel_styles
    from parallel.context import check_context_parallel
    from parallel.fsdp_internals import check_supported
    from parallel.plan import expand, plan_of
    from parallel.reshard import needs_own_post_forward_mesh, resolve_reshard
    from parallel.validate import validate_plan
    register_model_sources(cfg)
    if args.dry_run or args.plan_for:
        check_writable(cfg.dryrun.report, "dryrun.report")
        check_writable(args.trace, "--trace")
    else:
        check_gpu_count(cfg, spec.world_size)  # a dry run simulates a GPU job on any machine
        check_writable(cfg.run.dir, "run.dir", folder=True)
        check_writable(cfg.checkpoint.export, "checkpoint.export")
        if args.parity:
            check_writable(cfg.parity.report, "parity.report")
            check_writable(cfg.parity.record, "parity.record")
    hf_import = cfg.checkpoint.hf_import
    model = build_on_meta(cfg.model.name, cfg.model.flavor)  # shapes only: even 70B costs nothing here
    plan = plan_of(cfg)
    check_model_contract(model, cfg.model.name)
    from engine.routing import check as check_routing
    check_routing(model, cfg.moe)
    if args.dry_run or args.plan_for:
        check_simulated_model(model, cfg, spec, bool(args.plan_for))
    if not (args.dry_run or args.plan_for):  # a dry run reads no data
        from engine.data.sources import check_data
        check_data(cfg, vocab_size(model))  # paths, prepared folders, vocabularies: index.json only
    if hf_import:
        from engine.checkpoint.hf import check_hf_checkpoint
        check_hf_checkpoint(model, hf_import)  # the safetensors headers, no tensor data
    if cfg.checkpoint.hf_export:
        from engine.checkpoint.hf import check_hf_export
        check_hf_export(model, cfg.checkpoint.hf_export)
    from parallel.expert import check_expert_parallel, expert_paths
    from parallel.replicas import check_fault_tolerance
    check_fault_tolerance(cfg, spec)
    check_expert_parallel(model, plan, spec.ep, spec.dp, resolve_reshard(cfg.parallel.reshard_after_forward, spec),
                          spec.shard_size)
    if spec.tp > 1:
        validate_plan(model, plan, tensor_parallel_styles(model, plan, cfg.parallel), spec.tp,
                      cfg.parallel.sequence_parallel)
    if cfg.parallel.float8 != "none" or cfg.parallel.float8_all_gather:
        from parallel.float8 import check_settings as check_float8
        simulated = args.dry_run or args.plan_for
        check_float8(model, expand(model, plan.blocks, plan.name), plan.float8_skip, cfg.parallel,
                     resolve_reshard(cfg.parallel.reshard_after_forward, spec),
                     tensor_parallel_styles(model, plan, cfg.parallel) if spec.tp > 1 else {}, spec.tp,
                     None if simulated else pick_device(cfg)[0])
        if simulated:
            from engine.dryrun.estimate import float8_speedup
            float8_speedup(cfg.dryrun.device, cfg.parallel.float8)  # a device without float8 stops here
    if spec.pp > 1:  # on the depth that will run: --parity may reduce it
        from parallel.pipeline import check_settings
        depth = cfg.parity.layers if args.parity else 0
        staged = build_on_meta(cfg.model.name, cfg.model.flavor, depth) if depth else model
        backend = None if args.dry_run or args.plan_for else pick_device(cfg)[1]
        check_settings(plan, staged, spec.pp, cfg.parallel, cfg.training.micro_batches, backend)
    data_size = spec.hsdp * spec.dp
    if cfg.training.global_batch % data_size:
        raise UserError(f"training.global_batch={cfg.training.global_batch} does not divide over "
                        f"{data_size} data-parallel ranks (hsdp x dp of --mesh {spec}). Use a multiple "
                        f"of {data_size}.")
    if needs_own_post_forward_mesh(resolve_reshard(cfg.parallel.reshard_after_forward, spec), spec):
        check_supported()
    if spec.tp > 1 and cfg.parallel.sequence_parallel and cfg.training.seq_len % spec.tp:
        raise UserError(f"training.seq_len={cfg.training.seq_len} does not split over tp={spec.tp} "
                        f"with parallel.sequence_parallel=true. Use a multiple of {spec.tp}.")
    check_context_parallel(model, plan, spec, cfg.training.seq_len, cfg.parallel.sequence_parallel)
    micro = cfg.training.micro_batches
    if cfg.training.global_batch % (data_size * micro):
        raise UserError(f"training.global_batch={cfg.training.global_batch} does not split into "
                        f"training.micro_batches={micro} equal micro-batches on each of {data_size} "
                        f"data-parallel ranks. Use a global batch that is a multiple of {data_size * micro}.")
    longest = max_seq_len(model)
    if longest is not None and cfg.training.seq_len > longest:
        raise UserError(f"training.seq_len={cfg.training.seq_len} exceeds the model's max_seq_len "
                        f"{longest} ({cfg.model.name}/{cfg.model.flavor}).")
    if args.parity:
        check_parity(cfg, spec)
    elif not (args.dry_run or args.plan_for):
        find_checkpoint(cfg, spec)
    if cfg.fault_tolerance.enabled:
        check_replica_group_launch(args, cfg)
    return cfg, spec


def whole_world_factor(spec: MeshSpec) -> int:
    """With fault-tolerant replica groups a torchrun job is one group: hsdp of them make the mesh."""
    if spec.hsdp == -1:
        raise UserError(f"--mesh {spec}: with fault_tolerance.enabled=true, give hsdp (the number of replica "
                        f"groups) a size; -1 cannot be worked out from one group's ranks.")
    return spec.hsdp


def check_replica_group_launch(args: argparse.Namespace, cfg) -> None:
    if args.parity and args.max_restarts is not None:
        raise UserError("--parity with fault_tolerance.enabled=true restarts no replica group: a group "
                        "started again would heal from the others instead of computing its steps. Leave "
                        "out --max-restarts.")
    if cfg.fault_tolerance.lighthouse and args.max_restarts is not None and not under_torchrun():
        raise UserError("--max-restarts restarts replica groups that `python launch/run.py` started itself, "
                        "with no fault_tolerance.lighthouse given. A group started on its own is started "
                        "again by its scheduler with fault_tolerance.rejoin=true (docs/fault_tolerance.md).")
    if lighthouse_address(cfg.fault_tolerance):
        check_lighthouse(cfg.fault_tolerance)


def check_gpu_count(cfg, ranks_here: int) -> None:
    """One rank per GPU: a launch of more local ranks than GPUs stops here."""
    if pick_device(cfg)[0] != "cuda" or under_torchrun():
        return
    import torch
    if ranks_here > torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        raise UserError(f"--mesh {cfg.parallel.mesh} needs {ranks_here} ranks and the engine runs one rank per GPU, "
                        f"but this machine shows {gpus} CUDA device{'s' * (gpus != 1)}. Use a mesh of at most "
                        f"{gpus} rank{'s' * (gpus != 1)} here, start it on several nodes (docs/multinode.md), "
                        f"or run it on the CPU with --set parallel.device=cpu.")


def check_writable(path: str, what: str, folder: bool = False) -> None:
    """A file (`folder`: a folder) that the run writes, checked before anything starts (a
    search or a run can take hours): a file where a file is asked for and a folder where a
    folder is, writable, and where it is missing, the nearest existing folder above it
    writable (it is made when written)."""
    if not path:
        return
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        kind, example = ("a file", "") if folder else ("a folder", f", e.g. {str(target / 'out.json')!r}")
        raise UserError(f"{what} {path!r} is {kind}; give {'a folder' if folder else 'a file'} to write{example}.")
    nearest = next(above for above in (target, *target.parents) if above.exists())
    if nearest != target and not nearest.is_dir():
        raise UserError(f"{what} {path!r}: {str(nearest)!r} is a file, so no folder can be made in it. Give a "
                        f"path in a folder you can write.")
    if not os.access(nearest, os.W_OK | (os.X_OK if nearest.is_dir() else 0)):
        raise UserError(f"{what} {path!r} cannot be written by this user ({str(nearest)!r}). Give a path in a "
                        f"folder you can write.")


def check_parity(cfg, spec) -> None:
    from engine.parity import trajectory
    from models import build_on_meta
    build_on_meta(cfg.model.name, cfg.model.flavor, cfg.parity.layers)  # a depth the model cannot take fails here
    if cfg.parallel.float8 == "tensorwise" and spec.cp > 1:
        raise UserError(f"--parity cannot check parallel.float8=tensorwise with cp={spec.cp}: each cp rank scales "
                        f"its own chunks of every sequence by their largest value, which no one-device forward "
                        f"reproduces (launch/parity.py, tensorwise_slices). Check this mesh with "
                        f"parallel.float8=rowwise, whose scales are per token, or tensorwise without cp.")
    if cfg.parallel.float8_all_gather and spec.tp > 1:
        raise UserError(f"--parity cannot check parallel.float8_all_gather=true with tp={spec.tp}: FSDP then scales "
                        f"each tp rank's part of a weight by that part's own largest value (torchao reduces the "
                        f"scale over the FSDP group only), which no one-device forward reproduces. Check this "
                        f"mesh with parallel.float8_all_gather=false, or the float8 all-gathers without tp.")
    if cfg.parity.check_against:
        trajectory.read(cfg.parity.check_against, cfg)
    elif not cfg.parity.reference:
        raise UserError("parity.reference=false leaves nothing to compare with. Give a recorded "
                        "trajectory with --set parity.check_against=FILE, or keep the reference.")


def find_checkpoint(cfg, spec: MeshSpec):
    """The checkpoint to resume from (engine/checkpoint/store.py: Resume), or None. Every
    way a checkpoint or an init_from file can be wrong that shows without reading its data
    surfaces here, before any process group exists."""
    from engine.checkpoint.store import resume_folder, state_dict_shapes
    from common.config import to_dict
    from models import build_on_meta
    init_from = cfg.checkpoint.init_from
    if init_from and not Path(init_from).is_file():
        raise UserError(f"checkpoint.init_from {init_from!r} does not exist. Give a file written "
                        f"by checkpoint.export.")
    # torch.save's files are zip archives; anything else would fail in every rank at once
    if init_from and not zipfile.is_zipfile(init_from):
        raise UserError(f"checkpoint.init_from {init_from!r} is not a file written by torch.save (not a zip "
                        f"archive). Give a file written by checkpoint.export.")
    ft = cfg.fault_tolerance
    if ft.enabled and ft.rejoin:
        return None  # a replica group started again heals from a live group instead
    expected = state_dict_shapes(build_on_meta(cfg.model.name, cfg.model.flavor))
    groups = spec.hsdp if ft.enabled else 0
    return resume_folder(to_dict(cfg), cfg.checkpoint, cfg.run.dir, expected, cfg.training.steps, groups)


def launch_under_torchrun(nproc: int, argv: list[str], device: str, max_restarts: int = 0) -> int:
    """Run this script on `nproc` local ranks under torchrun's agent, in this process;
    returns the ranks' exit code (launch/exits.py). On the CPU the ranks are forked from a
    fork server that imports torch and the engine once: a spawned rank spends seconds of
    CPU on those imports, most of a small CPU run. On a machine that shows a GPU the ranks
    are spawned, CPU runs included: ranks forked from this process there failed in torch's
    own CUDA checks (the optimizer's step), since torchrun's agent asks CUDA for the GPUs
    before it starts ranks and a process forked after that cannot use CUDA; the fork
    server, a new interpreter, would not inherit that, but it has not run on a GPU machine.
    device_count() asks NVML, which leaves CUDA untouched."""
    import torch
    # One thread per rank unless the user chose: ranks share the machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    sys.stdout.flush()
    fork = device == "cpu" and sys.platform.startswith("linux") and torch.cuda.device_count() == 0
    return run_agent(["--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
                      str(Path(__file__).resolve()), *argv], forked_rank if fork else None, RANK_MODULES)


# What a rank imports, for the fork server to import once before it forks the ranks.
RANK_MODULES = ("launch.run", "engine.train", "engine.checkpoint.dcp", "engine.data.sources", "engine.metrics.log",
                "launch.parity", "models", "parallel.apply", "parallel.pipeline")


def forked_rank(argv: list[str]) -> int:
    """A rank forked by launch_under_torchrun: set up as a spawned rank would be, then run.
    A failure leaves with its code; success returns, so that the agent collects it."""
    prepare_forked_rank()
    code = main(argv)
    if code != EXIT_OK:
        exit_without_teardown(code)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def launch_replica_groups(args: argparse.Namespace, argv: list[str], cfg, spec: MeshSpec) -> int:
    """One fault-tolerant replica group on this machine's torchrun agent when the Lighthouse is
    given, else the Lighthouse and every group, supervised (launch/replica_groups.py)."""
    ranks_per_group = spec.world_size // spec.hsdp
    if lighthouse_address(cfg.fault_tolerance):  # checked to answer
        return launch_under_torchrun(ranks_per_group, argv, pick_device(cfg)[0])
    from launch.replica_groups import REPORT_GRACE_S, run_replica_groups, without_restarts
    # A parity check restarts no group, and lets every group finish its report
    return run_replica_groups(Path(__file__).resolve(), without_restarts(argv), spec.hsdp, ranks_per_group,
                              cfg.fault_tolerance.min_groups, cfg.run.dir, 0 if args.parity else args.max_restarts,
                              grace_s=REPORT_GRACE_S if args.parity else 0)


def train_on_mesh(cfg, spec: MeshSpec, show_plan: bool = False) -> None:
    import torch.distributed as dist

    from engine.checkpoint.dcp import Checkpointer, agreed
    from engine.data.sources import build_source
    from models.contract import vocab_size
    from engine.metrics.log import StepLog
    from engine.train import train
    from parallel.plan import plan_of
    from parallel.pipeline import parts_of, whole_model
    from parallel.prefetch import prefetch_order, unshard_ahead
    from parallel.reshard import describe_auto

    dims, device = start_process_group(cfg, spec)
    plan = plan_of(cfg)
    resume_from = agreed(lambda: find_checkpoint(cfg, spec))  # every rank resumes from rank 0's choice
    # Each replica group logs into a folder of its own
    log_dir = dims.replicas.folder if dims.replicas is not None else cfg.run.dir
    log = StepLog(cfg.training.steps, log_dir, enabled=dist.get_rank() == 0,
                  every=cfg.metrics.log_every, tensorboard=cfg.metrics.tensorboard,
                  append=resume_from is not None or cfg.fault_tolerance.rejoin)
    if dims.replicas is not None:
        log.print(f"fault-tolerant replica group {dims.replica_group} of {dims.replica_groups} "
                  f"(torchft, Lighthouse {lighthouse_address(cfg.fault_tolerance)})")
    log.print(f"mesh {spec} on {dist.get_world_size()} ranks ({device.type}/{pick_device(cfg)[1]}) | "
              f"model {cfg.model.name}/{cfg.model.flavor} | plan {plan.name}")

    if cfg.parallel.reshard_after_forward == "auto":
        log.print(describe_auto(spec))
    model, applied = sharded_model(cfg, dims, device, prefetch=cfg.prefetch, import_weights=resume_from is None)
    if cfg.checkpoint.hf_import and resume_from is None:
        log.print(f"weights from Hugging Face checkpoint {cfg.checkpoint.hf_import} (optimizer, schedule "
                  f"and data start fresh at step 0)")
    log.print(f"parameters: {sum(p.numel() for p in whole_model(model).parameters()):,}")
    if show_plan:
        from parallel.explain import explain
        log.print(explain(model, applied))
    source = build_source(cfg, vocab_size(whole_model(model)))
    eval_source = build_source(cfg, vocab_size(whole_model(model)), split="eval") if cfg.eval.every else None
    ahead = cfg.prefetch.unshard_ahead
    unshard = None
    if ahead:  # each pipeline stage's part gathers its own root and first blocks
        orders = [(part, prefetch_order(part, plan)) for part in parts_of(model)]
        unshard = functools.partial(unshard_ahead, orders, ahead)
    checkpointer = Checkpointer(cfg, dims, log, resume_from)
    train(model, cfg, source, dims, device, log, unshard, checkpointer, eval_source)
    if cfg.checkpoint.hf_export and checkpointer.exports:
        from engine.checkpoint.hf import save_hf
        save_hf(model, cfg.checkpoint.hf_export, carried_from=cfg.checkpoint.hf_import or None)
        log.print(f"exported Hugging Face checkpoint -> {cfg.checkpoint.hf_export}")
    if dims.replicas is not None:
        dims.replicas.shutdown()
    dist.destroy_process_group()


def dry_run(args: argparse.Namespace) -> int:
    """Check as for a real launch of --world ranks, then simulate one step in this process
    (--dry-run), or one for each layout searched (--plan-for)."""
    mode = "--plan-for" if args.plan_for else "--dry-run"
    if args.parity or args.resume is not None or args.nproc is not None or (args.plan_for and args.dry_run):
        raise UserError(f"{mode} simulates training; it does not combine with --parity, --resume, --nproc or "
                        f"the other of --dry-run and --plan-for (give the number of ranks with --world N).")
    if under_torchrun():
        raise UserError(f"{mode} runs in one process; start it with python, not torchrun.")
    if args.world is not None and args.world < 1:
        raise UserError(f"--world {args.world}: give the number of ranks to simulate, at least 1.")
    if args.plan_for:
        return plan_layouts(args)
    cfg, spec = check(args, args.world)
    from engine.dryrun.report import render, write_json
    from engine.dryrun.simulate import simulate
    result = simulate(cfg, spec, spec.world_size, trace=args.trace is not None)
    print(render(result, cfg), flush=True)
    if cfg.dryrun.report:
        write_output(functools.partial(write_json, result, cfg), cfg.dryrun.report, "dryrun.report")
        print(f"report -> {cfg.dryrun.report}")
    if args.trace is not None:
        from engine.dryrun.trace import write_trace
        write_output(functools.partial(write_trace, result, cfg, spec), args.trace, "--trace")
        print(f"trace -> {args.trace}")
    return EXIT_OK


def write_output(write, path: str, what: str) -> None:
    """`write(path)`, where a failure the checks above could not foresee (a full disk, a
    file system that refuses it) is the user's to fix, not a crash."""
    try:
        write(path)
    except OSError as err:
        raise UserError(f"{what} {path!r} could not be written ({err.strerror or err}). The report is printed "
                        f"above; give a path you can write.") from None


def check_trace_request(args: argparse.Namespace) -> None:
    """--trace draws the step that --dry-run simulates, and nothing else."""
    if args.trace is not None and not args.dry_run:
        raise UserError(f"--trace {args.trace} draws the step that a dry run simulates, so it needs --dry-run "
                        f"(not a training run or --plan-for): add --dry-run --world N to this command, or drop "
                        f"--trace. To trace a layout that --plan-for suggests, rerun its command line with "
                        f"--dry-run --trace FILE.")


def plan_layouts(args: argparse.Namespace) -> int:
    from engine.dryrun.report import render_plan, render_outcome, write_plan_json
    from engine.dryrun.search import plan_for, ranked, search_jobs, search_mesh
    from engine.metrics.throughput import flops_per_token
    from models import build_on_meta

    if args.world is None or args.mesh is not None:
        raise UserError("--plan-for chooses the mesh itself: give the number of GPUs with --world N, "
                        "and no --mesh.")
    searched = load_config(args.config, args.overrides)
    register_model_sources(searched)  # the search builds the user's model under their plan
    depth = plan_depth(searched)
    # The launcher's checks, on the mesh of the search that asks least of the batch.
    args.mesh = str(search_mesh(searched, args.world))
    cfg, _ = check(args, args.world)
    search_jobs(cfg, args.world, depth)  # refuses dryrun.pp before the search's header
    fpt = flops_per_token(build_on_meta(cfg.model.name, cfg.model.flavor), cfg.training.seq_len)
    print(render_plan(cfg, args.world, depth, None), flush=True)
    report, found = cfg.dryrun.report, []

    def keep(outcomes: list, complete: bool) -> None:
        if report:
            write_output(functools.partial(write_plan_json, ranked(outcomes), cfg, args.world, complete=complete),
                         report, "dryrun.report")

    def show(outcome) -> None:  # a search can take an hour: what it found is kept as it goes
        found.append(outcome)
        keep(found, complete=False)
        print(render_outcome(outcome), flush=True)

    def kept() -> str:
        return f"; they are in {report} (\"complete\": false)" if report and found else ""

    try:
        outcomes = plan_for(cfg, args.world, depth, fpt, show)
    except KeyboardInterrupt:
        print(f"\ninterrupted after {len(found)} layouts{kept()}", flush=True)
        return EXIT_INTERRUPTED
    except WorkerDied as died:
        raise UserError(f"the search stopped after {len(found)} layouts{kept()}: {died}. Each search worker "
                        f"simulates a layout in memory of its own; run again with fewer of them "
                        f"(--set dryrun.search_workers=N, 0 takes one per core, at most 4).") from None
    print(render_plan(cfg, args.world, depth, outcomes, [o for o in args.overrides
                                                          if not o.startswith("dryrun.")]))
    keep(outcomes, complete=True)
    if report:
        print(f"report -> {report}")
    return EXIT_FAILED if any(o.error for o in outcomes) else EXIT_OK


def plan_depth(cfg) -> int:
    """The model's number of blocks, which --plan-for extrapolates to."""
    from models import model_args
    args = model_args(cfg.model.name, cfg.model.flavor)
    depth = getattr(args, "n_layers", None)
    if not dataclasses.is_dataclass(args) or not isinstance(depth, int):
        raise UserError(f"--plan-for simulates a few blocks and extrapolates, so it needs a model whose args "
                        f"are a dataclass with n_layers; {cfg.model.name}/{cfg.model.flavor} has none. Use "
                        f"--dry-run on the layouts you have in mind instead.")
    return depth


def stop_with_error(paragraph: str, code: int) -> int:
    """Bad input or a non-finite loss: one paragraph, printed once, and left for torchrun."""
    message = f"error: {paragraph}"
    leave_error(message)
    if is_rank_zero() and ranks_print_errors():
        print(message, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """The exit code (common/errors.py) of this launch, or of this rank under torchrun."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torchrun = under_torchrun()
    try:
        check_trace_request(args)
        if args.dry_run or args.plan_for:
            return dry_run(args)
        cfg, spec = check(args, int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc)
        if not torchrun and cfg.fault_tolerance.enabled:
            return launch_replica_groups(args, argv, cfg, spec)
        if not torchrun:
            return launch_under_torchrun(spec.world_size, argv, pick_device(cfg)[0], args.max_restarts or 0)
        if args.parity:
            from launch.parity import run_parity
            return run_parity(cfg, spec)
        train_on_mesh(cfg, spec, show_plan=args.explain)
    except UserError as err:
        return stop_with_error(str(err), EXIT_USER_ERROR)
    except NonFiniteLoss as err:  # every rank sees the same global loss, so all stop here
        # Under a user's torchrun, the others would be stopped as soon as one exits:
        # let rank 0 finish its message first.
        import torch.distributed as dist
        dist.barrier()
        return stop_with_error(str(err), EXIT_NONFINITE_LOSS)
    except BaseException as err:  # a bug, not bad input: keep the traceback, still exit cleanly
        traceback.print_exc()
        leave_crash(err)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    exit_without_teardown(main())
