"""Tokens/s, MFU and peak memory of a training step on one GPU: the engine beside
torchtitan on the same shapes, and the dry run's prediction of the engine's step.

usage: python bench/gpu_throughput.py --out DIR [--rounds 2] [--steps 10] [--shapes ...] [--variants ...]

Each measurement is its own process (a fresh CUDA context and compile caches that only
the inductor disk cache carries over), and the runners alternate shape by shape,
round by round (engine, torchtitan, engine, torchtitan, ...), so drifts in the GPU's
clocks hit both alike. A shape is FLAVOR:LAYERS:SEQ_LEN:BATCH, a built-in Llama flavor
(model llama) or mixture-of-experts flavor (model llama_moe, e.g. mixtral-8x7B) at a
reduced depth. For a Llama flavor torchtitan builds its own Llama 3 model with the same
dim, heads, kv heads, FFN width, vocabulary and depth; for a mixture of experts, its
Llama 4 model made Mixtral-like: every block an MoE of the same experts, width and top k,
a softmax router with the top k renormalised, no shared expert, rotary embeddings in every
block, no load-balancing bias, and its grouped GEMMs (torch._grouped_mm, as the engine's).

- engine: launch.build.sharded_model (plan, fully_shard over the one rank with bf16
  parameters and fp32 gradient reduction, compile per block) stepped by the real loop step
  (engine.train.logged_step: batch from the synthetic source, forward and backward, clip,
  AdamW, LR schedule, metrics record);
- torchtitan: its Transformer and parallelize_llama (compile per block and of the loss), its
  AdamW (fused) and LR schedule, and the step its Trainer takes on one GPU: autocast to
  bf16 (on one GPU torchtitan does not apply fully_shard), sum cross-entropy over the
  tokens, clip_grad_norm_, optimizer and scheduler steps.

A variant is a runner and its options, `+`-separated (`--variants`; default "engine,torchtitan"):
`float8-tensorwise` or `float8-rowwise` converts the blocks' linears to torchao's Float8Linear
(the engine through parallel.float8; torchtitan through its float8 model converter with the
same recipe, leaving its output projection alone as the engine does), and for the engine
`keep` keeps each block's bf16 weights from forward to backward
(parallel.reshard_after_forward=false), where on one rank a reshard saves no communication
and costs a second cast and copy of every weight in backward.

Both run without activation checkpointing. After the warm-up steps, `--steps` steps are
timed from one device synchronize to another (none in between, as in training); the
figure is the mean step, and with several rounds the median of the rounds' means. MFU is the
engine's FLOPs per token (6 x matmul weights + 12 x layers x dim x seq, the same count
for both models) times tokens/s over the GPU's dense bf16 peak, float8 runs too. Peak memory is
torch.cuda.max_memory_allocated over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_SHAPES = "1B:16:2048:4,1B:16:8192:1,8B:4:2048:4,8B:4:8192:1"
DEFAULT_VARIANTS = "engine,torchtitan"
OPTIONS = ("float8-tensorwise", "float8-rowwise", "keep")


@dataclass(frozen=True)
class Variant:
    runner: str
    options: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Variant":
        runner, *options = text.split("+")
        if runner not in ("engine", "torchtitan") or any(o not in OPTIONS for o in options) \
                or ("keep" in options and runner != "engine"):
            raise SystemExit(f"variant {text!r}: give engine or torchtitan, then options from {OPTIONS} "
                             f"joined by '+' (keep: engine only)")
        return cls(runner, tuple(options))

    @property
    def float8(self) -> str:
        return next((o.removeprefix("float8-") for o in self.options if o.startswith("float8-")), "none")

    def __str__(self) -> str:
        return "+".join((self.runner, *self.options))


@dataclass(frozen=True)
class Shape:
    flavor: str
    layers: int
    seq_len: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        flavor, layers, seq_len, batch = text.split(":")
        return cls(flavor, int(layers), int(seq_len), int(batch))

    def __str__(self) -> str:
        return f"{self.flavor}:{self.layers}:{self.seq_len}:{self.batch}"

    @property
    def model(self) -> str:
        """The engine's model name for the flavor: llama, or llama_moe for an MoE flavor."""
        from models.moe import FLAVORS
        return "llama_moe" if self.flavor in FLAVORS else "llama"


def timed_steps(step, first: int, steps: int, device) -> tuple[float, int]:
    """The mean seconds per step over `steps` steps from index `first`, and the peak bytes
    allocated while they ran. The device is synchronised before and after the window only,
    as a training loop runs: the host prepares the next batch while the device works."""
    import torch
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for index in range(first, first + steps):
        step(index)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / steps, torch.cuda.max_memory_allocated(device)


def profile_steps(step, first: int, path: str, steps: int = 2) -> None:
    """`steps` more steps under torch.profiler: the kernels by device time, and how much of
    the wall time the device was busy, written to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for index in range(first, first + steps):
            step(index)
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    events = prof.key_averages()
    from torch.autograd import DeviceType
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
    Path(path).write_text(f"{steps} steps: wall {wall * 1e3:.1f} ms, kernels {busy * 1e3:.1f} ms\n"
                          + events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90))


def measure(step, warmup: int, steps: int, device, profile: str) -> dict:
    """The first step (compilation included), the rest of the warm-up, the timed window,
    then the profiled steps when asked."""
    import torch
    first = time.perf_counter()
    step(0)
    torch.cuda.synchronize(device)
    first_s = time.perf_counter() - first
    for index in range(1, warmup):
        step(index)
    seconds, peak = timed_steps(step, warmup, steps, device)
    if profile:
        profile_steps(step, warmup + steps, profile)
    return {"first_step_s": first_s, "step_s": seconds, "peak_bytes": peak}


def start_one_rank_group() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def engine_config(shape: Shape, compile_blocks: bool, total_steps: int, variant: Variant = Variant("engine")):
    from common.config import Config
    cfg = Config()
    cfg.parallel.float8 = variant.float8
    cfg.parallel.reshard_after_forward = "keep" not in variant.options
    cfg.model.name = cfg.parallel.plan = shape.model
    cfg.model.flavor = shape.flavor
    cfg.parallel.mesh = "dp=1"
    cfg.parallel.device = "cuda"
    cfg.parallel.param_dtype = "bfloat16"
    cfg.parallel.compile = compile_blocks
    cfg.training.seq_len, cfg.training.global_batch, cfg.training.steps = shape.seq_len, shape.batch, total_steps
    cfg.data.source = "synthetic"
    cfg.optim.lr = 8e-4  # torchtitan's default, so that both runs' losses read alike
    return cfg


def run_engine(shape: Shape, variant: Variant, compile_blocks: bool, warmup: int, steps: int,
               profile: str = "") -> dict:
    import torch

    from engine.data.sources import build_source
    from engine.metrics.log import StepLog
    from engine.train import build_optimizer, logged_step, run_shape
    from launch.build import sharded_model, start_process_group
    from models.contract import vocab_size
    from parallel.mesh import parse_mesh

    cfg = engine_config(shape, compile_blocks, warmup + steps + 10, variant)  # room for --profile
    start_one_rank_group()
    dims, device = start_process_group(cfg, parse_mesh("dp=1").resolve(1))
    built = time.perf_counter()
    model, _ = sharded_model(cfg, dims, device, n_layers=shape.layers)
    build_s = time.perf_counter() - built
    source = build_source(cfg, vocab_size(model))
    optimizer, scheduler = build_optimizer(model, cfg.optim, cfg.training.steps)
    log = StepLog(cfg.training.steps, tempfile.mkdtemp(prefix="gpu-bench-"), enabled=True,
                  stream=open(os.devnull, "w"))
    run = run_shape(model, cfg, device)
    losses = []

    def step(index: int) -> None:
        losses.append(logged_step(model, optimizer, scheduler, source, index, cfg, dims, device, log, run).loss)

    return {"build_s": build_s, **measure(step, warmup, steps, device, profile), "losses": losses,
            "parameters": sum(p.numel() for p in model.parameters())}


def torchtitan_args(shape: Shape):
    """torchtitan's Llama 3 args with the engine flavor's shapes at the shape's depth."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    from models import model_args
    ours = model_args("llama", shape.flavor)
    # torchtitan sizes the FFN as int(8 * dim / 3) rounded up to a multiple of multiple_of;
    # with multiple_of set to the flavor's FFN width that rounding gives the width itself.
    assert int(8 * ours.dim / 3) <= ours.ffn_hidden, ours
    return TransformerModelArgs(dim=ours.dim, n_layers=shape.layers, n_heads=ours.n_heads, n_kv_heads=ours.n_kv_heads,
                                vocab_size=ours.vocab_size, multiple_of=ours.ffn_hidden, norm_eps=ours.norm_eps,
                                rope_theta=ours.rope_theta, max_seq_len=shape.seq_len)


def torchtitan_moe_args(shape: Shape):
    """torchtitan's Llama 4 args made Mixtral-like (the module docstring) with the engine
    MoE flavor's shapes at the shape's depth."""
    from torchtitan.models.llama4.model.args import TransformerModelArgs
    from torchtitan.models.moe import MoEArgs

    from models import model_args
    ours = model_args("llama_moe", shape.flavor)
    if ours.shared_hidden or ours.dense_layers or ours.router != "softmax":
        raise SystemExit(f"{shape.flavor}: only Mixtral-like flavors (softmax router, no shared expert, no dense "
                         f"blocks) have a torchtitan counterpart here")
    # Every block an MoE of width int(8 * dim / 3), times ffn_dim_multiplier, rounded up to a
    # multiple of multiple_of: multiple_of = the expert width, and a multiplier that brings a
    # wider default down to at most that width, give the width itself.
    default = int(8 * ours.dim / 3)
    moe = MoEArgs(num_experts=ours.n_experts, num_shared_experts=0, score_func="softmax", route_norm=True,
                  score_before_experts=False, top_k=ours.top_k, use_grouped_mm=True, load_balance_coeff=None)
    return TransformerModelArgs(dim=ours.dim, n_layers=shape.layers, n_heads=ours.n_heads,
                                n_kv_heads=ours.n_kv_heads, vocab_size=ours.vocab_size,
                                multiple_of=ours.routed_hidden,
                                ffn_dim_multiplier=min(1.0, ours.routed_hidden / default), norm_eps=ours.norm_eps, rope_theta=ours.rope_theta,
                                max_seq_len=shape.seq_len, every_n_layers_nope=None, moe_args=moe,
                                auto_scale_hidden_dim=False, interleave_moe_layer_step=1)


def torchtitan_model(shape: Shape):
    """(torchtitan's model on the meta device, its parallelize function, its args) for the
    shape, with the FFN or expert width checked against the engine flavor's."""
    import torch
    if shape.model == "llama_moe":
        from torchtitan.models.llama4.infra.parallelize import parallelize_llama
        from torchtitan.models.llama4.model.model import Transformer
        args = torchtitan_moe_args(shape)
        with torch.device("meta"):
            model = Transformer(args)
        width = model.layers["0"].moe.experts.w1.shape[1]
    else:
        from torchtitan.models.llama3.infra.parallelize import parallelize_llama
        from torchtitan.models.llama3.model.model import Transformer
        args = torchtitan_args(shape)
        with torch.device("meta"):
            model = Transformer(args)
        width = model.layers["0"].feed_forward.w1.weight.shape[0]
    assert width == args.multiple_of, f"torchtitan's FFN width {width} is not the flavor's {args.multiple_of}"
    return model, parallelize_llama, args


def run_torchtitan(shape: Shape, variant: Variant, compile_blocks: bool, warmup: int, steps: int,
                   profile: str = "") -> dict:
    import torch
    import torch.distributed as dist
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    import torchtitan.components.quantization  # noqa: F401  (registers the float8 converter)
    from torchtitan.protocols.model_converter import build_model_converters

    start_one_rank_group()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    job = JobConfig()
    job.training.seq_len, job.training.steps = shape.seq_len, warmup + steps + 10  # room for --profile
    job.training.mixed_precision_param = "bfloat16"
    job.activation_checkpoint.mode = "none"
    job.compile.enable = compile_blocks
    if variant.float8 != "none":
        job.model.converters = ["quantize.linear.float8"]
        job.quantize.linear.float8.recipe_name = variant.float8
        job.quantize.linear.float8.filter_fqns = ["output"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    built = time.perf_counter()
    model, parallelize_llama, args = torchtitan_model(shape)
    build_model_converters(job, dims).convert(model)  # as its Trainer does, before parallelize
    parallelize_llama(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    build_s = time.perf_counter() - built
    optimizers = build_optimizers([model], job.optimizer, dims)
    schedulers = build_lr_schedulers(optimizers, job.lr_scheduler, job.training.steps)
    loss_fn = build_cross_entropy_loss(job)
    amp = dist_utils.maybe_enable_amp(dims, job.training.mixed_precision_param, "cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    losses = []

    def step(index: int) -> None:
        tokens = torch.randint(0, args.vocab_size, (shape.batch, shape.seq_len + 1), device=device,
                               generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        optimizers.zero_grad()
        with amp:
            pred = model(inputs)
            loss = loss_fn(pred, labels) / labels.numel()
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), job.training.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        losses.append(loss.item())

    return {"build_s": build_s, **measure(step, warmup, steps, device, profile), "losses": losses,
            "parameters": sum(p.numel() for p in model.parameters())}


def predict(shape: Shape, variant: Variant, compile_blocks: bool) -> dict:
    """The dry run of the engine's step at this shape on one H100 (CPU only, fake tensors)."""
    from engine.dryrun.simulate import simulate
    from parallel.mesh import parse_mesh
    import parallel  # noqa: F401  (registers the built-in plans)

    cfg = engine_config(shape, compile_blocks, 1, variant)
    result = simulate(cfg, parse_mesh("dp=1").resolve(1), 1, n_layers=shape.layers)
    return {"peak_bytes": result.roles[0].peak_bytes, "step_s": result.estimate.step_s,
            "compute_efficiency": cfg.dryrun.compute_efficiency, "flops_per_token": result.flops_per_token}


def child(argv: list[str], timeout: float) -> dict:
    """Run one measurement in its own process; its last stdout line is the JSON result."""
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1],
                "stderr_tail": done.stderr[-4000:]}
    return json.loads(lines[-1])


def summarise(shape: Shape, runner: str, results: list[dict], peak_flops: float, fpt: float) -> dict:
    """`runner`: the variant, as text."""
    good = [r for r in results if "error" not in r]
    row = {"shape": str(shape), "runner": runner, "runs": len(good), "errors": [r["error"] for r in results
                                                                                if "error" in r]}
    if good:
        median = statistics.median(r["step_s"] for r in good)
        tokens_per_s = shape.batch * shape.seq_len / median
        row.update(step_s=median, tokens_per_s=tokens_per_s, mfu=tokens_per_s * fpt / peak_flops,
                   peak_gib=max(r["peak_bytes"] for r in good) / 2**30,
                   first_step_s=statistics.median(r["first_step_s"] for r in good),
                   build_s=statistics.median(r["build_s"] for r in good),
                   parameters=good[0]["parameters"], first_loss=good[0]["losses"][0])
    return row


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """The bf16 matrix-product rate this GPU reaches on random data: the ceiling MFU is read against."""
    import torch
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def orchestrate(args) -> None:
    import torch

    from engine.metrics.throughput import flops_per_token, peak_flops_for
    from models import build_on_meta

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    peak = peak_flops_for(name)
    header = {"gpu": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "peak_flops": peak,
              "compile": args.compile, "matmul_tflops": matmul_tflops()}
    try:
        import torchtitan
        header["torchtitan"] = getattr(torchtitan, "__version__", "installed")
    except ImportError:
        header["torchtitan"] = None
    print(json.dumps(header), flush=True)
    rows = []
    common = ["--warmup", str(args.warmup), "--steps", str(args.steps)] + ([] if args.compile else ["--eager"])
    for text in args.shapes.split(","):
        shape = Shape.parse(text)
        fpt = flops_per_token(build_on_meta(shape.model, shape.flavor, shape.layers), shape.seq_len)
        variants = [v for v in map(Variant.parse, args.variants.split(","))
                    if header["torchtitan"] or v.runner == "engine"]
        results = {str(v): [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                result = child(["--one", str(variant), "--shape", str(shape), *common], args.timeout)
                results[str(variant)].append(result)
                print(json.dumps({"shape": str(shape), "runner": str(variant),
                                  **{k: v for k, v in result.items() if k != "stderr_tail"}}), flush=True)
                partial = [summarise(shape, name, done, peak, fpt) for name, done in results.items() if done]
                (out / "throughput.json").write_text(json.dumps({**header, "rows": rows + partial}, indent=1))
        shape_rows = [summarise(shape, str(v), results[str(v)], peak, fpt) for v in variants]
        if args.predict:
            for variant, row in zip(variants, shape_rows):
                if variant.runner == "engine":
                    row["predicted"] = child(["--predict", "--one", str(variant), "--shape", str(shape), *common],
                                             args.timeout)
        rows.extend(shape_rows)
        (out / "throughput.json").write_text(json.dumps({**header, "rows": rows}, indent=1))
    print(render(rows, header))
    (out / "throughput.md").write_text(render(rows, header) + "\n")


def render(rows: list[dict], header: dict) -> str:
    lines = [f"{header['gpu']}, torch {header['torch']}, torchtitan {header['torchtitan']}, {header['date']}, "
             f"{'compiled' if header['compile'] else 'eager'}; an 8192^3 bf16 matmul runs at "
             f"{header['matmul_tflops']:.0f} TFLOP/s",
             "| shape (flavor:layers:seq:batch) | runner | tokens/s | MFU | step ms | peak GiB | "
             "first step s | predicted peak GiB | predicted step ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "step_s" not in row:
            lines.append(f"| {row['shape']} | {row['runner']} | failed: {'; '.join(row['errors'])[:200]} |||||||")
            continue
        predicted = row.get("predicted", {})
        p_peak = f"{predicted['peak_bytes'] / 2**30:.1f}" if "peak_bytes" in predicted else ""
        p_step = f"{predicted['step_s'] * 1e3:.0f}" if "step_s" in predicted else ""
        lines.append(f"| {row['shape']} | {row['runner']} | {row['tokens_per_s']:,.0f} | {row['mfu']:.1%} | "
                     f"{row['step_s'] * 1e3:.1f} | {row['peak_gib']:.1f} | {row['first_step_s']:.1f} | "
                     f"{p_peak} | {p_step} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu-bench", help="folder for throughput.json and throughput.md")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated FLAVOR:LAYERS:SEQ_LEN:BATCH")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated RUNNER[+OPTION...], runners engine and torchtitan, options {OPTIONS}")
    parser.add_argument("--rounds", type=int, default=2, help="processes per variant and shape, alternated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eager", dest="compile", action="store_false", help="no torch.compile")
    parser.add_argument("--predict", action="store_true", help="also run the dry run of each engine shape")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per measurement process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a variant
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--profile", default="", help="with --one: profile 2 more steps into this file")
    args = parser.parse_args()
    if args.shape and args.predict:
        print(json.dumps(predict(Shape.parse(args.shape), Variant.parse(args.one or "engine"), args.compile)),
              flush=True)
    elif args.one:
        import warnings
        warnings.filterwarnings("ignore")
        from parallel.process_group import exit_without_teardown
        variant = Variant.parse(args.one)
        run = run_engine if variant.runner == "engine" else run_torchtitan
        print(json.dumps(run(Shape.parse(args.shape), variant, args.compile, args.warmup, args.steps,
                             args.profile)), flush=True)
        exit_without_teardown(0)  # the result is printed
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
