"""ATP's mesh search (Eq. 2-4) and the Fig. 12 sweep, through the API and the CLI."""

from __future__ import annotations

import csv
import json

import pytest

from meshpilot.cli.main import main
from meshpilot.cluster import LogicalMesh, load_cluster, mesh_shapes_2d
from meshpilot.models import gpt_config
from meshpilot.planner.atp import closed_form, search, sweep, t_comm


def test_ic1_calibrated_chooses_2x4_46_percent_below_megatron():
    """ATP §5.3: with the calibrated bandwidths, T_comm of DeviceMesh(2,4) is 46% below DeviceMesh(8,1)."""
    r = search(load_cluster("atp-ic1-calibrated"), 8, gpt_config("atp-m2"))
    assert r.chosen.mesh == (2, 4)
    assert 1 - r.chosen.t_comm_s / r.baseline.t_comm_s == pytest.approx(0.455, abs=0.001)  # paper: "46%"


def test_ic2_chooses_megatron():
    """ATP §5.3: on NVLink pairs over PCIe, DeviceMesh(8,1) wins."""
    assert search(load_cluster("atp-ic2"), 8, gpt_config("atp-m1")).chosen.mesh == (8, 1)


def test_equations_not_prose_on_ic3():
    """The prose says ATP-1 on IC3 with 8 GPUs; Eq. 2 and 4 give DeviceMesh(4,2) (docs/atp.md explains)."""
    r = search(load_cluster("atp-ic3"), 8, gpt_config("atp-m3"))
    assert r.chosen.mesh == (4, 2)
    assert r.candidates[1].mesh == (8, 1)


def test_eq2_by_hand_on_fig7a():
    cfg = gpt_config("atp-m1")
    m = LogicalMesh(load_cluster("atp-fig7a"), (8, 2))
    b1, b2 = 8 / 14 * 12.5e9, 200e9
    expect = 2 * cfg.layers * cfg.batch * cfg.seq * 2 * (7 * cfg.hidden / (8 * b2) + 2 * cfg.hidden / (2 * b1))
    assert t_comm(m, cfg, 2) == pytest.approx(expect)


def test_sweep_matches_fig12_closed_form_on_ic5():
    ns = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    rows = sweep(lambda n: load_cluster(f"atp-ic5:{n}"), ns)
    for r in rows:
        for i, v in r.atp.items():
            assert v == pytest.approx(closed_form(r.devices // i, i))
        best = min(closed_form(r.devices // d2, d2) for d2 in range(1, r.devices + 1) if r.devices % d2 == 0)
        assert r.opt == pytest.approx(best)
    # ATP-1 grows with N (Megatron), the optimum falls (§5.4)
    assert rows[-1].atp[1] > rows[0].atp[1] and rows[-1].opt < rows[0].opt


def test_ic6_aligned_torus_mesh_matches_closed_form():
    for q in (2, 4, 8):
        c = load_cluster(f"atp-ic6:{q}")
        cfg = gpt_config("atp-m1")
        delta = 2 * cfg.layers * cfg.batch * cfg.seq * cfg.hidden * 2 / 50e9
        assert t_comm(LogicalMesh(c, (q, q)), cfg, 2) / delta == pytest.approx(closed_form(q, q))


def test_cli_json_schema(capsys):
    assert main(["atp", "--cluster", "atp-ic1-calibrated", "--devices", "8", "--model", "atp-m1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] == [2, 4]
    shapes = {tuple(c["mesh"]) for c in out["candidates"]}
    assert shapes == set(mesh_shapes_2d(8))
    for c in out["candidates"]:
        assert c["t_comm_s"] > 0 and set(c) >= {"mesh", "t_comm_s", "B1_GBps", "B2_GBps"}
    ts = [c["t_comm_s"] for c in out["candidates"]]
    assert ts == sorted(ts)


def test_cli_table_and_custom_gpt(capsys):
    args = ["atp", "-c", "atp-fig7a", "-m", "gpt", "--layers", "4", "--hidden", "1024", "--heads", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM 1D" in out and "★" in out and "chosen DeviceMesh" in out


def test_cli_sweep_writes_csv_and_png(tmp_path, capsys):
    prefix = tmp_path / "fig12"
    assert main(["atp", "--sweep", "--cluster", "atp-ic5", "--max-devices", "64", "--out", str(prefix)]) == 0
    with open(prefix.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["N"]) for r in rows] == [4, 8, 16, 32, 64]
    for r in rows:
        assert float(r["ATP-1"]) == pytest.approx(float(r["closed_form_ATP-1"]))
        assert float(r["ATP-OPT"]) == pytest.approx(float(r["closed_form_OPT"]))
    assert prefix.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_model_is_one_line(capsys):
    assert main(["atp", "-c", "atp-ic3", "-m", "atp-m9"]) == 2
    err = capsys.readouterr().err
    assert "not a GPT model" in err and "atp-m1" in err
    assert main(["atp", "--sweep", "-c", "atp-ic3"]) == 2
