"""Offline plan of a checkpoint's move between two plans: boxes as DTensor cuts, every byte read once."""

import itertools
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, capture
from meshpilot.models import builtin_models
from meshpilot.planner.auto import plan
from meshpilot.planner.reshard_checkpoint import _volume, plan_reshard, shard_box


@pytest.mark.parametrize(
    "shape, layout, mesh",
    [
        ((8, 6), (Shard(0), Shard(1)), (2, 3)),
        ((7, 5), (Shard(0), Shard(0)), (2, 2)),  # uneven, the same dim cut twice
        ((9,), (Replicate(), Shard(0)), (2, 4)),
        ((4, 4), (Replicate(), Replicate()), (2, 2)),
    ],
)
def test_boxes_are_what_torch_chunk_gives_each_coordinate(shape, layout, mesh):
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    for coord in itertools.product(*(range(n) for n in mesh)):
        local = full
        for axis, p in enumerate(layout):
            if isinstance(p, Shard):
                parts = torch.chunk(local, mesh[axis], dim=p.dim)
                local = parts[coord[axis]] if coord[axis] < len(parts) else local.narrow(p.dim, 0, 0)
        box = shard_box(shape, layout, mesh, coord)
        expect = full[tuple(slice(lo, hi) for lo, hi in box)]
        assert torch.equal(local, expect), (coord, box)


@pytest.fixture(scope="module")
def plans():
    model, inputs = builtin_models()["gpt-tiny"].build("meta", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, inputs)
        out = {
            shape: plan(model, inputs, "atp-ic3", mesh_shape=shape, graph=graph)
            for shape in ((2, 2), (4, 1), (1, 4), (2, 4))
        }
    shapes = {
        n.fqn: (n.out.shape, n.out.itemsize) for n in graph.nodes if n.kind == NodeKind.PARAM and n.out is not None
    }
    return out, shapes


@pytest.mark.parametrize("src, dst", [((2, 2), (4, 1)), ((2, 4), (4, 1)), ((1, 4), (2, 2)), ((4, 1), (4, 1))])
def test_every_destination_box_is_read_exactly_once_from_a_holder(plans, src, dst):
    by_shape, shapes = plans
    a, b = by_shape[src], by_shape[dst]
    rp = plan_reshard(a, b, shapes)
    a_layout, b_layout = dict(a.params), dict(b.params)
    from meshpilot.planner.reshard_checkpoint import _ranks_by_coord
    from meshpilot.sharding.placements import from_json

    src_boxes = {
        (name, r): shard_box(shape, from_json(a_layout[name]), a.mesh_shape, c)
        for name, (shape, _) in shapes.items()
        for c, r in _ranks_by_coord(a.mesh_shape, a.mesh_ranks)
    }
    covered: dict[tuple[str, int], int] = {}
    for piece in rp.pieces:
        held = src_boxes[(piece.param, piece.src)]
        assert all(h0 <= lo and hi <= h1 for (lo, hi), (h0, h1) in zip(piece.box, held))  # the source has it
        covered[(piece.param, piece.dst)] = covered.get((piece.param, piece.dst), 0) + _volume(piece.box)
    for name, (shape, _) in shapes.items():
        for c, r in _ranks_by_coord(b.mesh_shape, b.mesh_ranks):
            assert covered.get((name, r), 0) == _volume(shard_box(shape, from_json(b_layout[name]), b.mesh_shape, c))
    need = sum(_volume(shard_box(s, from_json(b_layout[n]), b.mesh_shape, c)) * i * 3
               for n, (s, i) in shapes.items() for c, _ in _ranks_by_coord(b.mesh_shape, b.mesh_ranks))  # fmt: skip
    assert rp.total_bytes == need
    if src == dst:  # the same plan: every rank reads only its own shard
        assert rp.remote_bytes == 0 and rp.local_bytes == need


def test_different_models_are_one_line(plans):
    by_shape, shapes = plans
    a = by_shape[(2, 2)]
    import dataclasses

    b = dataclasses.replace(a, params=a.params[1:])
    with pytest.raises(UserError, match="different models: parameters"):
        plan_reshard(a, b, shapes)


def test_a_resume_says_what_moves_from_the_manifest_alone(plans):
    """``train --resume`` under another plan: the manifest's layouts (JSON) and signature are enough."""
    import json

    from meshpilot.cli.train import _reshard_line
    from meshpilot.planner.reshard_checkpoint import Layouts, shapes_from_signature

    by_shape, shapes = plans
    a, b = by_shape[(2, 4)], by_shape[(4, 1)]
    saved = json.loads(json.dumps(Layouts.of(a).to_dict()))
    assert Layouts.from_dict(saved) == Layouts.of(a)
    signature = {name: [list(shape), "float32"] for name, (shape, _) in shapes.items()}
    assert shapes_from_signature(signature) == {n: (tuple(s), 4) for n, (s, _) in shapes.items()}
    line = _reshard_line({"layouts": saved, "signature": signature}, b)
    expect = plan_reshard(a, b, shapes)
    assert line.startswith("resharded from DeviceMesh(2, 4) to DeviceMesh(4, 1): ")
    assert f"{len(expect.pieces)} pieces" in line
    assert _reshard_line({"layouts": saved, "signature": signature}, a) is None  # the same layouts: nothing said
    assert _reshard_line({"signature": signature}, b) is None  # a manifest from before layouts were kept
