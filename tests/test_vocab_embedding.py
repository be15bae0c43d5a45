"""parallel/embedding.py: an nn.Embedding split by vocabulary rows over tp computes only its
own rows' gradient, and the same values as the unsplit embedding.

Each rank of a tp=4 mesh over torch's fake process group (collectives return their input,
so a rank's output is its own partial sum) in turn, in one process of its own: a
96 x 16 table with a padding row, tokens in every rank's rows. Against the same embedding
on one process: the output is the reference's rows for this rank's tokens and zero
elsewhere, the gradient is the reference's gradient at this rank's rows. During the
backward no tensor of the whole table's size exists; with torch's RowwiseParallel one
does (so the assertion can fail). The real multi-rank runs are the `--parity` rows with
tp (tests/test_parity.py: tied embeddings, GPT-2's user plan; the combination matrix),
whose embedding gradients match the one-process reference within 1e-5 (fp32).
"""

from __future__ import annotations

import pytest

from tests.distributed import call_in_own_process
VOCAB, DIM, TP, PADDING = 96, 16, 4, 50  # the padding row is in rank 2's rows


def run_ranks(vocab_parallel: bool) -> list[dict]:
    """For each tp rank: the output's and the gradient's largest difference from the
    reference, the padding row's gradient, the largest tensor made in backward (a
    DTensor's local part: what the rank holds), and the module's class."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from engine.dryrun import torch_internals
    from parallel.embedding import vocab_parallel_styles

    class LargestMade(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made = [(t._local_tensor if isinstance(t, DTensor) else t).numel() for t in tree_leaves(out)
                    if isinstance(t, torch.Tensor)]
            self.largest = max([self.largest, *made])
            return out

    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, DIM, padding_idx=PADDING)
    tokens = torch.randint(0, VOCAB, (2, 24))
    tokens[0, :4] = torch.tensor([0, 30, PADDING, VOCAB - 1])
    upstream = torch.randn(2, 24, DIM)
    expected = reference(tokens)
    expected.backward(upstream)
    results = []
    for rank in range(TP):
        torch_internals.start_fake_world(TP, rank)
        mesh = init_device_mesh("cpu", (TP,))
        model = nn.ModuleDict({"table": nn.Embedding(VOCAB, DIM, padding_idx=PADDING)})
        model.table.load_state_dict(reference.state_dict())
        styles = {"table": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
        parallelize_module(model, mesh, vocab_parallel_styles(model, styles) if vocab_parallel else styles)
        split = model.table
        rows = slice(rank * VOCAB // TP, (rank + 1) * VOCAB // TP)
        with torch.no_grad():  # the fake group's scatter moved no rows from rank 0
            split.weight.to_local().copy_(reference.weight[rows])
        mine = ((tokens >= rows.start) & (tokens < rows.stop)).unsqueeze(-1)
        out = split(tokens)
        with LargestMade() as made:
            out.backward(upstream)
        grad = split.weight.grad.to_local()
        held = grad.shape[0]
        if held == VOCAB:  # torch's rule leaves the whole table's gradient, replicated
            grad = grad[rows]
        results.append({
            "class": type(split).__name__,
            "output_diff": (out - expected.detach() * mine).abs().max().item(),
            "grad_diff": (grad - reference.weight.grad[rows]).abs().max().item(),
            "grad_rows": held,
            "padding_grad": grad[PADDING - rows.start].abs().max().item() if rows.start <= PADDING < rows.stop else 0.0,
            "largest_in_backward": made.largest,
        })
        dist.destroy_process_group()
    return results


def run_both() -> dict:
    """run_ranks with the engine's style and with torch's."""
    return {"engine": run_ranks(True), "torch": run_ranks(False)}


@pytest.mark.compat
def test_each_rank_computes_its_rows_and_only_their_gradient():
    runs = call_in_own_process("tests.test_vocab_embedding:run_both")
    for rank, result in enumerate(runs["engine"]):
        assert result["class"] == "VocabShardedEmbedding", result
        assert result["output_diff"] <= 1e-6 and result["grad_diff"] <= 1e-6, (rank, result)
        assert result["grad_rows"] == VOCAB // TP and result["padding_grad"] == 0.0, (rank, result)
        assert result["largest_in_backward"] < VOCAB * DIM, (rank, result)
    # torch's own rule computes the same values, and the whole table's gradient on every rank.
    for rank, result in enumerate(runs["torch"]):
        assert result["output_diff"] <= 1e-6 and result["grad_diff"] <= 1e-6, (rank, result)
        assert result["grad_rows"] == VOCAB and result["largest_in_backward"] >= VOCAB * DIM, (rank, result)


def test_only_a_plain_embedding_is_replaced():
    """A subclass may have a forward of its own, and max_norm, scale_grad_by_freq and sparse
    read or write rows of the whole table: those keep torch's RowwiseParallel."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from parallel.embedding import VocabParallel, vocab_parallel_styles

    class Scaled(nn.Embedding):
        def forward(self, tokens):
            return super().forward(tokens) * 2

    model = nn.ModuleDict({"plain": nn.Embedding(8, 4), "scaled": Scaled(8, 4), "renormed": nn.Embedding(8, 4, max_norm=1.0),
                           "by_frequency": nn.Embedding(8, 4, scale_grad_by_freq=True), "linear": nn.Linear(4, 4),
                           "colwise": nn.Embedding(8, 4)})
    given = {name: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) for name in model if name != "colwise"}
    given["colwise"] = ColwiseParallel()
    styles = vocab_parallel_styles(model, given)
    assert type(styles["plain"]) is VocabParallel
    assert styles["plain"].output_layouts == (Shard(1),) and styles["plain"].input_layouts == (Replicate(),)
    assert all(styles[name] is given[name] for name in given if name != "plain")
