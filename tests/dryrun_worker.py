"""Both sides of the dry run's validation, layout by layout (tests/test_dryrun.py).

    torchrun --nproc_per_node 4 tests/dryrun_worker.py measure LAYOUTS.json OUT/
        every rank builds each layout for real over gloo (mesh, model, plan, seeded
        weights), runs one observed step (engine/dryrun/observe.py) and writes
        OUT/measured-<layout>-<rank>.json;
and the prediction is the user's command, `launch/run.py --dry-run --world 4 --mesh ...
--set ... --set dryrun.report=OUT/predicted-<layout>.json`, one process per layout:
torch caches DTensor sharding decisions by mesh, and a second fake world in the same
process reuses the first one's process-group names, so one process simulates one layout.

    python tests/dryrun_worker.py activations LAYOUT.json OUT/
        what one more block adds on rank 0 of a simulated layout ([mesh, [key=value, ...],
        world size]): the forward's peak, less the block's parameter and optimizer state,
        is the activations it keeps for backward; with its collectives and the step's
        peaks at 2 and 3 blocks; OUT/activations.json.

LAYOUTS.json is a list of [mesh, [key=value, ...]] over the default config.
`measure_and_predict` runs both for tests/test_dryrun.py and bench/dryrun_validation.py.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import parallel  # noqa: E402,F401  (registers the built-in plans)
from common.config import load_config  # noqa: E402
from parallel.mesh import parse_mesh  # noqa: E402
from parallel.process_group import exit_without_teardown  # noqa: E402


def measure_and_predict(layouts, out: Path, world_size: int) -> tuple[list[dict], list[dict]]:
    """Both sides, each in its own processes: (measured[i][rank], predicted[i])."""
    from tests.distributed import launcher, torchrun

    layouts_file = out / "layouts.json"
    layouts_file.write_text(json.dumps(layouts))
    measured = torchrun(world_size, __file__, "measure", str(layouts_file), str(out), timeout=900)
    assert measured.returncode == 0, measured.stderr[-4000:]

    def predict(index: int):
        mesh, overrides = layouts[index]
        return launcher("--dry-run", "--world", str(world_size), "--mesh", mesh,
                        "--set", f"dryrun.report={out / f'predicted-{index}.json'}",
                        *(arg for value in overrides for arg in ("--set", value)))

    with ThreadPoolExecutor(2) as pool:  # one process per layout (see above), two cores
        for predicted in pool.map(predict, range(len(layouts))):
            assert predicted.returncode == 0, predicted.stdout[-2000:] + predicted.stderr[-4000:]
    return ([{rank: json.loads((out / f"measured-{i}-{rank}.json").read_text()) for rank in range(world_size)}
             for i in range(len(layouts))],
            [json.loads((out / f"predicted-{i}.json").read_text()) for i in range(len(layouts))])


def layout_config(mesh: str, overrides: list[str]):
    return load_config(REPO / "configs" / "debug.yaml", [f"parallel.mesh={mesh}", *overrides])


def route_to_first_ep_rank(model, ep: int, load: float) -> None:
    """Make a real step route as a dry run at dryrun.expert_load=ep assumes: every row to
    the experts that ep rank 0 holds, through the sigmoid router's bias (which only the
    choice sees)."""
    import torch
    from models.moe import Router
    assert load == ep, f"the real step can only be made to route at dryrun.expert_load=ep, not {load}"
    for module in model.modules():
        if isinstance(module, Router):
            assert module.kind == "sigmoid", "a routing bias needs the sigmoid router (model.flavor=debug-moe-sigmoid)"
            local = module.expert_bias.numel() // ep
            with torch.no_grad():
                module.expert_bias[:local] = 1e3


def measure(layouts, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from engine.dryrun import torch_internals
    from engine.dryrun.observe import observe_step
    from launch.build import sharded_model
    from parallel.mesh import build_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for index, (mesh, overrides) in enumerate(layouts):
        cfg = layout_config(mesh, overrides)
        spec = parse_mesh(mesh).resolve(dist.get_world_size())
        torch_internals.clear_sharding_cache()  # each layout on its own meshes' groups
        dims = build_mesh(spec, "cpu")
        model, _ = sharded_model(cfg, dims, torch.device("cpu"))
        if cfg.dryrun.expert_load > 1:
            route_to_first_ep_rank(model, spec.ep, cfg.dryrun.expert_load)
        observed = observe_step(model, cfg, dims, torch.device("cpu"), fake=False)
        (out / f"measured-{index}-{rank}.json").write_text(json.dumps(observed.as_dict()))
        dist.barrier()
    dist.destroy_process_group()


def extrapolation(layouts, out: Path) -> None:
    """For --plan-for's shortcuts: rank 0's step (with pp, each stage role's) simulated at
    full depth, and as the search simulates it (engine/dryrun/search.py: extrapolated from
    two depths; with pp, combined from short pipelines), side by side in
    OUT/extrapolated-<layout>.json. Each mesh gives every size, hence the world's."""
    from engine.dryrun.search import Layout, observe, observe_stage_roles
    from engine.dryrun.simulate import eager, observe_rank_zero, pipeline_ranks
    from models import model_args

    for index, (mesh, overrides) in enumerate(layouts):
        cfg, _ = eager(layout_config(mesh, overrides))
        spec = parse_mesh(mesh)
        world_size = spec.world_size
        p = cfg.parallel
        layout = Layout(spec, str(p.reshard_after_forward).lower(), p.activation_checkpoint,
                        cfg.training.micro_batches, schedule=p.pp_schedule, stages_per_rank=p.pp_stages_per_rank,
                        recompute_cheap=p.recompute_cheap)
        depth = model_args(cfg.model.name, cfg.model.flavor).n_layers
        if spec.pp == 1:
            pairs = [(observe_rank_zero(cfg, spec, world_size), observe(cfg, layout, world_size, depth))]
        else:  # each stage role: simulated at full depth, and extrapolated as --plan-for does
            ranks = [rank * (world_size // spec.pp) for rank in pipeline_ranks(cfg, spec)]
            guesses = [observed for observed, *_ in observe_stage_roles(cfg, layout, world_size, depth)]
            pairs = [(observe_rank_zero(cfg, spec, world_size, rank=rank), guess) for rank, guess in zip(ranks, guesses)]
        (out / f"extrapolated-{index}.json").write_text(json.dumps(
            [{"full": full.as_dict(), "extrapolated": guess.as_dict()} for full, guess in pairs]))


def activations(layout, out: Path) -> None:
    from engine.dryrun.simulate import eager, observe_rank_zero

    mesh, overrides, world_size = layout
    cfg, _ = eager(layout_config(mesh, overrides))
    spec = parse_mesh(mesh).resolve(world_size)
    shallow, deep = (observe_rank_zero(cfg, spec, world_size, n_layers=depth) for depth in (2, 3))
    state = lambda o: o.param_bytes + o.optimizer_bytes
    (out / "activations.json").write_text(json.dumps({
        "block_bytes": deep.phase_peaks["forward"] - shallow.phase_peaks["forward"] - (state(deep) - state(shallow)),
        "peak_bytes": {"shallow": shallow.peak_bytes, "deep": deep.peak_bytes},
        "comm": {"shallow": shallow.comm, "deep": deep.comm}}))


if __name__ == "__main__":
    mode, layouts_file, out_dir = sys.argv[1:]
    layouts = json.loads(Path(layouts_file).read_text())
    if mode == "measure":
        measure(layouts, Path(out_dir))
        exit_without_teardown(0)
    elif mode == "activations":
        activations(layouts, Path(out_dir))
    else:
        assert mode == "extrapolation", mode
        extrapolation(layouts, Path(out_dir))
