"""Gradient accumulation's memory, both sides: the runtime sums microbatches' gradients in place, and the
accounting prices the sum it holds (``docs/benchmarks.md``, "Gradient accumulation's memory").

Before: ``StepRun._accumulate`` made a scaled copy of every gradient and then a new sum, while the raw
gradients and the old sum were still held — 4 gradient sets at the end of microbatch 1's backward, where
the sum and that microbatch's gradients (2) are enough; and ``accounting.memory_use`` priced one
microbatch's graph without the sum (a 2-microbatch gpt-tiny plan predicted 15.8 MiB, measured 22.1).
"""

import torch

from meshpilot.cluster.memtrack import StorageTracker
from meshpilot.graph.capture import capture
from meshpilot.models.sources import build_model
from meshpilot.planner.accounting import _parts, accumulated_bytes, liveness, memory_use
from meshpilot.runtime.executor import StepRun

SHAPES = [(64, 32), (32,), (128, 16), (16,)]


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(M: int) -> StepRun:
    return StepRun([], frozenset(), {0: None}, {}, {}, (), M)  # no program runs: only the sum is tested


def test_accumulation_sums_in_place_and_equals_the_scaled_sum():
    run, g0, g1 = _run(2), _grads(0), _grads(1)
    b0, b1 = list(g0), list(g1)
    run._accumulate(0, b0)
    first = [t.untyped_storage().data_ptr() for t in run.grads[0]]
    run._accumulate(0, b1)
    assert b0 == [None] * 4 and b1 == [None] * 4  # the caller's lists let go of each gradient as it is added
    for acc, x, y in zip(run.grads[0], g0, g1):
        assert torch.equal(acc, x / 2 + y / 2)  # bit for bit what the out-of-place sum gave
    assert [t.untyped_storage().data_ptr() for t in run.grads[0]] == first  # the sum's own tensors, in place
    for acc, x, y in zip(run.grads[0], g0, g1):  # and never the tensors a program returned
        assert acc.untyped_storage().data_ptr() not in (x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr())


def test_a_later_microbatch_adds_nothing_beside_the_sum_and_its_gradients():
    run = _run(3)  # 1/3 is not a power of two: the scaled add still allocates nothing
    run._accumulate(0, _grads(0))
    incoming = _grads(1)
    one_set = sum(t.nbytes for t in incoming)
    with StorageTracker(existing=[*run.grads[0], *incoming]) as tracker:
        run._accumulate(0, incoming)  # `incoming` is the last reference, as the executor's list is
    # was 4 sets (copies and a new sum), then 2 sets and one g / M copy: the largest gradient's, which the
    # accounting's end of the backward does not hold (a vocabulary's embedding: 4 MiB over the plan's peak in
    # docs/benchmarks.md's lever table)
    assert tracker.peak == 2 * one_set, (tracker.peak, one_set)


def test_one_microbatch_keeps_its_gradients_unscaled():
    run, g = _run(1), _grads(0)
    run._accumulate(0, list(g))
    assert all(a is x for a, x in zip(run.grads[0], g))


def _tiny_graph():
    torch.manual_seed(0)
    b = build_model("gpt-tiny", device="meta", layers=2, hidden=64, heads=2, batch=4, seq=32)
    return b.model, capture(b.model, tuple(b.inputs))


def test_accounting_holds_the_summed_gradients_through_a_later_microbatch():
    model, graph = _tiny_graph()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert accumulated_bytes(graph, None, ()) == trainable  # one device: every gradient whole, once
    one, two = liveness(graph), liveness(graph, microbatches=2)
    assert one.accumulated == 0.0
    if two.peak_node != "end of backward":
        assert two.accumulated == trainable and two.grads >= trainable
    assert one.peak <= two.peak <= one.peak + trainable
    assert memory_use(graph, microbatches=2).total - memory_use(graph).total == two.peak - one.peak
    # the ILP's backward row: the sum is held at the start of a later microbatch's backward
    assert _parts(graph, None, (), 2).rows[1] - _parts(graph, None, (), 1).rows[1] == trainable
