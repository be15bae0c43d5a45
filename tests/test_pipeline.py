"""Pipeline parallel (parallel/pipeline.py): the split, the checks before any process
group, and `launch/run.py --parity` on what the combination matrix does not vary.

The matrix (tests/combinations.py) runs 1F1B, Interleaved1F1B and ZBVZeroBubble at
pp=2 with every other setting at 4 ranks. Here, each a real launch over gloo against
one process, held to the fp32 (or bf16) tolerances of tests/test_parity.py: the other
three schedules (GPipe, on GPT-2 whose tied embedding is copied onto both ends, with
context parallel too; InterleavedZeroBubble; DualPipeV, on the mixture of experts with
ep and both balancing terms), pp=4, the one 3-D row (pp=2,dp=2,tp=2 with sequence parallel),
an integer reshard under pp (pp=2,dp=4 with groups of 2, the engine's own post-forward
mesh), the plain model of examples/plain_model.py, and a planted bug whose module the
localizer must name on the stage that holds it.
"""

import fnmatch

import pytest

from common.errors import UserError
from launch.run import check, parse_args
from parallel.mesh import parse_mesh
from parallel.pipeline import blocks_per_stage, even_split, runs_on_backend, stages_of_rank
from tests.distributed import launcher, parity_report, run_together, selected
from tests.test_cli import assert_clean_error
from tests.test_parity import GPT2, PLANTED_BUG, assert_within_promised_tolerances

PLAIN = ("model.plugin=examples.plain_model", "model.name=plain", "model.flavor=tiny", "parallel.plan=plain")
LAYERS4 = ("parity.layers=4",)

# id: (mesh, overrides)
PIPELINE_ROWS = {
    # GPT-2 also under context parallel: its learned positions come through the stage's embed.
    "gpipe-gpt2-tied-cp": ("pp=2,cp=2", ("parallel.pp_schedule=GPipe", "training.micro_batches=2", *GPT2)),
    "interleaved-zero-bubble": ("pp=2", ("parallel.pp_schedule=InterleavedZeroBubble", "parallel.pp_stages_per_rank=2",
                                         "parallel.reshard_after_forward=false", "training.micro_batches=4")),
    # Tied embedding and output on the two ends: the middle stages hold no copy of the tie.
    "pp4-tied": ("pp=4", ("training.micro_batches=4", "model.flavor=debug_tied")),
    "pp-dp-tp-sp": ("pp=2,dp=2,tp=2", ("parallel.sequence_parallel=true", "training.micro_batches=2")),
    "pp-integer-reshard": ("pp=2,dp=4", ("parallel.reshard_after_forward=2", "training.micro_batches=2")),
    "plain-model": ("pp=2", ("training.micro_batches=2", *PLAIN)),
    # DeepSeek-V3's schedule on an MoE: a forward beside another micro-batch's backward,
    # with the balancing loss through it and the bias moved by the load over the data ranks.
    "dualpipev-moe-ep": ("pp=2,dp=2,ep=2", ("parallel.pp_schedule=DualPipeV", "parallel.pp_stages_per_rank=2",
                                            "parallel.reshard_after_forward=false", "training.micro_batches=4",
                                            "model.name=llama_moe", "model.flavor=debug-moe-sigmoid",
                                            "parallel.plan=llama_moe", "moe.load_balance=0.01", "moe.bias_rate=0.01")),
}


@pytest.mark.parametrize("blocks, stages, expected", [
    (4, 2, [2, 2]), (4, 4, [1, 1, 1, 1]), (6, 4, [1, 2, 2, 1]), (5, 2, [3, 2]),
    # 405B at pp=16: the embedding and the output each count as a block
    (126, 16, [7] + [8] * 14 + [7]),
])
def test_even_split_counts_the_embedding_and_the_output_as_a_block(blocks, stages, expected):
    counts = even_split(blocks, stages)
    assert counts == expected and sum(counts) == blocks
    loads = [c + (s == 0) + (s == stages - 1) for s, c in enumerate(counts)]
    assert max(loads) - min(loads) <= 1


def test_end_stages_hold_only_the_embedding_and_the_output_when_the_stages_outnumber_the_blocks():
    """Llama 3 405B's 126 blocks ran in pp=16 x 8 stages: the first stage held the embedding
    alone, the last the output layer (arXiv 2407.21783, section 3.3.2)."""
    both = (True, True)
    assert blocks_per_stage(126, 16, 8, ends=both) == [0] + [1] * 126 + [0]
    assert blocks_per_stage(4, 5, 1, ends=both) == [0, 1, 1, 1, 1]  # the output is the heavier end
    assert blocks_per_stage(4, 2, 2, "0,2,2,0", ends=both) == [0, 2, 2, 0]
    assert blocks_per_stage(4, 2, 2, ends=both) == even_split(4, 4)  # no empty end while there are blocks enough
    assert blocks_per_stage(4, 5, 1, ends=(False, True)) == [1, 1, 1, 1, 0]  # a plan with nothing first
    for bad in (lambda: blocks_per_stage(4, 5, 1),  # a plan without stage modules of its own
                lambda: blocks_per_stage(4, 2, 2, "0,2,2,0", ends=(False, False)),
                lambda: blocks_per_stage(4, 7, 1, ends=both)):
        with pytest.raises(UserError):
            bad()


def test_stages_of_each_rank_loop_or_v():
    assert [stages_of_rank(r, 4, 2, "Interleaved1F1B") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of_rank(r, 4, 2, "ZBVZeroBubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert blocks_per_stage(4, 2, 1, "3,1") == [3, 1]


def test_mesh_with_pp_outermost():
    spec = parse_mesh("tp=2,pp=2,dp=-1").resolve(16)
    assert (spec.pp, spec.hsdp, spec.dp, spec.tp, spec.sizes) == (2, 1, 4, 2, (2, 1, 4, 1, 2))
    assert str(spec) == "pp=2,dp=4,tp=2"
    spec = parse_mesh("cp=2,tp=2,pp=2,dp=-1").resolve(32)  # cp between dp and tp
    assert (spec.sizes, spec.shard_size, str(spec)) == ((2, 1, 4, 2, 2), 8, "pp=2,dp=4,cp=2,tp=2")


def refused(*args: str) -> str:
    parsed = parse_args(list(args))
    with pytest.raises(UserError) as err:
        check(parsed, parsed.nproc)
    return str(err.value)


@pytest.mark.parametrize("args, fragments", [
    (["--mesh", "pp=8"], ["8 pipeline stages, but the model has 4 blocks", "at most 6"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=Interleaved1F1B", "--set", "parallel.pp_stages_per_rank=3",
      "--parity", "--set", "parity.layers=2"], ["6 pipeline stages, but the model has 2 blocks"]),
    (["--mesh", "pp=2"], ["training.micro_batches=1", "1F1B", "at least one per stage, 2", "GPipe"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=Interleaved1F1B", "--set", "parallel.pp_stages_per_rank=2",
      "--set", "training.micro_batches=5", "--set", "training.global_batch=20"], ["a multiple of 2"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_stages_per_rank=2", "--set", "training.micro_batches=2"],
     ["runs one stage per rank", "pp_stages_per_rank=1"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=ZBVZeroBubble", "--set", "parallel.pp_stages_per_rank=3"],
     ["exactly 2 stages per rank"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=DualPipeV", "--set", "parallel.pp_stages_per_rank=2",
      "--set", "parallel.reshard_after_forward=false", "--set", "training.micro_batches=2"],
     ["training.micro_batches=2", "DualPipeV", "at least one per stage, 4"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=InterleavedZeroBubble", "--set",
      "parallel.pp_stages_per_rank=2"], ["wrong weight gradients", "reshard_after_forward=false"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=ZBVZeroBubble", "--set", "parallel.pp_stages_per_rank=2",
      "--set", "parallel.reshard_after_forward=false", "--set", "parallel.compile=true"], ["compiled blocks"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=ZBVZeroBubble", "--set", "parallel.pp_stages_per_rank=2",
      "--set", "parallel.reshard_after_forward=false", "--set", "parallel.activation_checkpoint=op"],
     ["selective activation checkpointing"]),
    (["--mesh", "pp=2", "--set", "training.micro_batches=2", "--set", "parallel.pp_split=1,2"],
     ["pp_split='1,2'", "2 stages", "4 in all", "for example 2,2"]),
    (["--mesh", "pp=2", "--set", "parallel.pp_schedule=Interleaved1F1B", "--set", "parallel.pp_stages_per_rank=2",
      "--set", "training.micro_batches=2", "--set", "parallel.pp_split=2,0,1,1"],
     ["pp_split='2,0,1,1'", "0 allowed for the first and the last stage"]),
    (["--mesh", "pp=2", "--set", "training.micro_batches=2", "--set", "model.plugin=tests.pipeline_plans",
      "--set", "parallel.plan=llama_without_stages"], ["does not say how its model splits", "stages=Stages"]),
    (["--mesh", "pp=2", "--set", "training.micro_batches=2", "--set", "model.plugin=tests.pipeline_plans",
      "--set", "model.name=gpt2", "--set", "parallel.plan=gpt2_without_positions"],
     ["'wpe.weight' is in no block", "stages.first"]),
])
def test_bad_pipeline_settings_are_refused_with_the_fix(args, fragments):
    message = refused(*args)
    for fragment in fragments:
        assert fragment in message, message


def test_bad_pipeline_settings_exit_2_on_the_command_line():
    assert_clean_error(launcher("--mesh", "pp=2", timeout=60), "training.micro_batches=1", "at least one per stage")


def runs_here(case: str) -> bool:
    """Whether this torch runs the case's schedule over gloo (parallel/pipeline.py: runs_on_backend)."""
    schedule = next((o.split("=", 1)[1] for o in PIPELINE_ROWS[case][1] if o.startswith("parallel.pp_schedule=")),
                    "1F1B")
    return runs_on_backend(schedule, "gloo")


@pytest.fixture(scope="module")
def reports(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("pipeline")
    run_together(root, [(*PIPELINE_ROWS[case], 3) for case in selected(request.session, __name__, "case")
                        if case in PIPELINE_ROWS and runs_here(case)])

    def get(case: str, *extra: str):
        mesh, overrides = PIPELINE_ROWS[case] if case in PIPELINE_ROWS else (case, ())
        return parity_report(root, mesh, *overrides, *extra)
    return get


@pytest.mark.distributed
@pytest.mark.compat
@pytest.mark.parametrize("case", list(PIPELINE_ROWS))
def test_pipeline_layout_passes_parity(reports, case, tmp_path):
    mesh, overrides = PIPELINE_ROWS[case]
    if not runs_here(case):  # a V over gloo before torch 2.13: refused, with the fix
        result = launcher("--parity", "--mesh", mesh, "--set", f"run.dir={tmp_path}",
                          *(arg for value in overrides for arg in ("--set", value)))
        assert result.returncode == 2 and "cannot run over gloo" in result.stderr, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        return
    report, code = reports(case)
    assert (code, report["verdict"]) == (0, "PASS"), [c for c in report["checks"] if not c["ok"]]
    assert_within_promised_tolerances(report)
    pp = parse_mesh(mesh).pp
    stages = report["pipeline"]["blocks_per_stage"]
    assert len(stages) == pp * report["pipeline"]["stages_per_rank"] and all(stages)


@pytest.mark.distributed
@pytest.mark.compat
def test_tied_embedding_copies_agree_across_stages(reports):
    """GPT-2 ties lm_head to wte; at pp=2 each end holds a copy. The copy on the last stage
    is compared under its own name with the reference's shared parameter: equal at the
    start, its gradient the sum of both uses, and equal after the steps."""
    report, _ = reports("gpipe-gpt2-tied-cp")
    assert {"wte.weight", "lm_head.weight"} <= set(report["gradient_digests"])
    assert report["gradient_digests"]["wte.weight"] == report["gradient_digests"]["lm_head.weight"]


@pytest.mark.distributed
@pytest.mark.compat
def test_integer_reshard_under_pp_reshards_onto_groups_of_two(reports):
    mesh, placements, local_shape = reports("pp-integer-reshard")[0]["post_forward_layout"]["attention.wq.weight"]
    assert (mesh, placements, local_shape) == ("(2, 2)", ["R", "S(0)"], [128, 256])


@pytest.mark.distributed
@pytest.mark.compat
def test_localizer_names_the_module_and_its_stage(reports):
    """The planted bug of tests/test_parity.py at pp=2,tp=2: every attention_norm's weight
    gradient misses its all-reduce over tp, two on each stage."""
    report, code = reports("pp=2,tp=2", *PLANTED_BUG, "training.micro_batches=2")
    assert (code, report["verdict"]) == (1, "FAIL")
    found = report["localizer"]
    assert fnmatch.fnmatch(found["first"]["module"], "layers.*.attention_norm"), found["first"]
    stages = {f["module"]: f["stage"] for f in found["differing"]}
    assert stages == {"layers.0.attention_norm": 0, "layers.1.attention_norm": 0,
                      "layers.2.attention_norm": 1, "layers.3.attention_norm": 1}
    assert {f["what"] for f in found["differing"]} == {"parameter gradient"}


@pytest.mark.distributed
@pytest.mark.compat
def test_localizer_names_the_module_and_its_stage_under_context_parallel(reports):
    """tests/planted_pp_cp_bug.py at pp=2,cp=2: the stages run their blocks without the
    positions of each cp rank's chunks, so the first attention core's output is the first
    thing wrong, on stage 0."""
    report, code = reports("pp=2,cp=2", "model.plugin=tests.planted_pp_cp_bug",
                           "parallel.plan=llama_stages_position_blind", "training.micro_batches=2")
    assert (code, report["verdict"]) == (1, "FAIL")
    first = report["localizer"]["first"]
    assert (first["module"], first["what"], first["stage"]) == ("layers.0.attention.core", "output", 0), first


# -- checkpoints: where the stage split meets a state dict --------------------------------
# One pp=2 run of the tied debug model with an uneven split: the first stage holds 3 of the
# 4 blocks and the embedding, the last one block, the final norm and its copy of the tied
# output. 3 steps, checkpoints after steps 2 and 3, the final weights exported to one file
# and as a Hugging Face folder. Then every way weights come back in: resumes from step 2 on
# other layouts, whose first loss must be within 1e-5 (fp32) of the pp=2 run's own at that
# step (on the same layout, bitwise equal); the single file through checkpoint.init_from and
# the folder through checkpoint.hf_import at pp=2,tp=2. A tied Hugging Face import under pp
# stopped every rank at start ("Unexpected key(s) in state_dict: output.weight") until
# engine/checkpoint/hf.py loaded only the keys a stage holds.

TIED_UNEVEN = ("model.flavor=debug_tied", "parallel.pp_split=3,1")


def _sets(values) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


@pytest.fixture(scope="module")
def pipeline_checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("pp-checkpoint")
    result = launcher("--mesh", "pp=2", *_sets(("training.steps=3", "checkpoint.every=2", "training.micro_batches=2",
                                                 *TIED_UNEVEN)),
                      "--set", f"run.dir={run}", "--set", f"checkpoint.export={run / 'final.pt'}",
                      "--set", f"checkpoint.hf_export={run / 'hf'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.mark.distributed
@pytest.mark.parametrize("mesh, settings", [("pp=2", TIED_UNEVEN), ("dp=1", TIED_UNEVEN[:1]),
                                            ("pp=4", TIED_UNEVEN[:1]), ("pp=2,dp=2", TIED_UNEVEN[:1]),
                                            ("pp=2,cp=2", TIED_UNEVEN[:1])])
def test_pipeline_checkpoint_reshards(pipeline_checkpoint, tmp_path, mesh, settings):
    from tests.test_checkpoint import checkpoint
    from tests.test_cli import losses

    micro_batches = max(2, parse_mesh(mesh).pp)
    loaded = launcher("--mesh", mesh, "--resume", str(checkpoint(pipeline_checkpoint, 2)),
                      *_sets(("training.steps=3", f"training.micro_batches={micro_batches}", f"run.dir={tmp_path}",
                              *settings)))
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "saved on mesh pp=2" in loaded.stdout
    ours, expected = losses(tmp_path)[0], losses(pipeline_checkpoint)[2]
    print(f"pp=2 (3,1) -> {mesh}: first loss after loading {ours!r}, pp=2's own {expected!r}, "
          f"diff {abs(ours - expected):.2e}")
    if mesh == "pp=2":
        assert ours == expected  # the same layout repeats the step bitwise
    assert abs(ours - expected) <= 1e-5


@pytest.mark.distributed
def test_pipeline_exports_hold_every_stage_and_come_back_in(pipeline_checkpoint, tmp_path):
    """Both exports hold the last checkpoint's weights bitwise, the Hugging Face folder with
    no lm_head (tied). Read back at pp=2,tp=2, the single file (init_from) and the folder
    (hf_import) start the same first step bitwise, and with lr=0 the folder exported again
    is bitwise the folder read."""
    import torch
    from safetensors.torch import load_file

    from models.llama_hf import hf_name
    from tests.test_checkpoint import assert_bitwise_equal, checkpoint, full_checkpoint
    from tests.test_cli import losses

    run = pipeline_checkpoint
    exported = torch.load(run / "final.pt", weights_only=True)
    assert_bitwise_equal(exported, full_checkpoint(checkpoint(run, 3), tmp_path)["model"])
    hf = load_file(str(run / "hf" / "model.safetensors"))
    assert set(hf) == {hf_name(key) for key in exported if key != "output.weight"}
    assert all(torch.equal(hf[hf_name(key)], value) for key, value in exported.items() if key != "output.weight")
    assert torch.equal(exported["output.weight"], exported["tok_embeddings.weight"])

    common = ("training.steps=1", "training.micro_batches=2", "optim.lr=0")
    from_file = launcher("--mesh", "pp=2,tp=2", *_sets((*common, "model.flavor=debug_tied",
                                                         f"checkpoint.init_from={run / 'final.pt'}",
                                                         f"run.dir={tmp_path / 'init'}")))
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    from_folder = launcher("--mesh", "pp=2,tp=2", *_sets((*common, f"checkpoint.hf_import={run / 'hf'}",
                                                           f"checkpoint.hf_export={tmp_path / 'hf2'}",
                                                           f"run.dir={tmp_path / 'hf'}")))
    assert from_folder.returncode == 0, from_folder.stderr[-3000:]
    assert losses(tmp_path / "init") == losses(tmp_path / "hf")
    again = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(again) == set(hf) and all(torch.equal(again[key], hf[key]) for key in hf)
