"""Bad input, table-driven: every user mistake ends in ONE line on stderr (what, where, how to fix) and exit 2,
before any expensive work, and leaves no output file behind; the Python API raises UserError.

The CLI cases run ``meshpilot.cli.main.main`` in-process; ``train --plan`` cases run its checks with torchrun's
environment set (they all happen before ``init_process_group``); two run for real under the launcher."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshpilot.cli.main import main
from meshpilot.errors import UserError
from meshpilot.planner.plan import Plan, StagePlan
from meshpilot.planner.validate import validate_plan

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A real plan for gpt-tiny on 2 devices, damaged copies of it, and broken cluster files."""
    d = tmp_path_factory.mktemp("bad")
    good = d / "p2.json"
    assert main(["plan", "-m", "gpt-tiny", "-c", "atp-ic3", "--mesh", "2x1", "--ops", "none", "--out", str(good)]) == 0
    plan = json.loads(good.read_text())

    def variant(name: str, edit) -> None:
        p = json.loads(json.dumps(plan))
        edit(p)
        (d / name).write_text(json.dumps(p))

    def stage(p: dict) -> dict:  # the one stage's plan inside the saved Plan
        return p["stages"][0]["plan"]

    variant("v99.json", lambda p: p.update(version=99))
    variant("s9.json", lambda p: stage(p)["params"][0].__setitem__(1, ["S(9)", "R"]))
    variant("q.json", lambda p: stage(p)["params"][0].__setitem__(1, ["Q", "R"]))
    variant("dup.json", lambda p: stage(p).update(mesh_ranks=[0, 0]))
    variant("oor.json", lambda p: stage(p).update(mesh_ranks=[0, 7]))
    variant("nosolver.json", lambda p: stage(p).pop("solver"))
    variant("shape0.json", lambda p: stage(p).update(mesh_shape=[0, 1]))
    (d / "notjson.json").write_text("{not json")
    (d / "list.json").write_text("[1, 2]")
    (d / "other.json").write_text(json.dumps({"hello": 1}))
    (d / "bin.json").write_bytes(b"\xff\xfe\x00\x01")
    head = 'device = "a100-80gb"\n[[layers]]\nname = "n"\n'
    (d / "big.toml").write_text(head + "ranks = 200000\np2p_GBps = 1\ngroup_GBps = 1\nlatency_us = 1\n")
    (d / "inf.toml").write_text(head + "ranks = 2\np2p_GBps = 1e308\ngroup_GBps = 1\nlatency_us = 1\n")
    (d / "neg.toml").write_text(head + "ranks = 2\np2p_GBps = -1\ngroup_GBps = 1\nlatency_us = 1\n")
    (d / "tiny.toml").write_text(head + "ranks = 2\np2p_GBps = 1e-300\ngroup_GBps = 1\nlatency_us = 1\n")
    (d / "tinylat.toml").write_text(head + "ranks = 2\np2p_GBps = 1\ngroup_GBps = 1\nlatency_us = 1e-300\n")
    profile = '[device_profile]\nkind = "x"\npeak_tflops_fp32 = 1e-300\nmemory_GBps = 1\nmemory_GiB = 1\n'
    (d / "profile.toml").write_text(
        profile + head.split("\n", 1)[1] + "ranks = 2\np2p_GBps = 1\ngroup_GBps = 1\nlatency_us = 1\n"
    )
    (d / "cal1.toml").write_text(
        head + "ranks = 2\np2p_GBps = 1\ngroup_GBps = 1\nlatency_us = 1\n[[calibration]]\nmesh = [2, 1]\nB2_GBps = 5\n"
    )
    (d / "nodev.toml").write_text('[[layers]]\nname = "n"\nranks = 2\np2p_GBps = 1\ngroup_GBps = 1\nlatency_us = 1\n')
    (d / "dir.toml").mkdir()
    (d / "plain.txt").write_text("x")
    return {p.name: p for p in d.iterdir()} | {"dir": d}


def _one_line(capsys, argv: list[str], needles: tuple[str, ...], out: Path | None = None, env=None, mp=None) -> str:
    capsys.readouterr()  # drop what fixtures printed
    if env:
        for k, v in env.items():
            mp.setenv(k, v)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    captured = capsys.readouterr()
    err = captured.err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, (rc, err, captured.out[-2000:])
    assert len(lines) == 1, err
    assert "Traceback" not in err
    line = lines[0]
    assert line.startswith((f"meshpilot {argv[0]}: error: ", "meshpilot: error: ")), line
    assert "; " in line, f"no fix hint: {line}"  # every message: what is wrong; how to fix it
    for n in needles:
        assert n in line, (n, line)
    if out is not None:
        assert not Path(out).exists(), f"{out} left behind"
        leftovers = [p for p in Path(out).parent.glob(f".{Path(out).name}*")] if Path(out).parent.is_dir() else []
        assert not leftovers, leftovers
    return line


# ------------------------------------------------------------------------------------------------ CLI table

# (argv with {placeholders} for fixture files, needles, output path key or None, env)
T = "{dir}"
CASES = [
    # presets / topology / cluster files
    (["presets", "--bogus"], ("--bogus", "--help"), None, None),
    (["topology", "-c", "atp-ic5:1000000"], ("atp-ic5:1000000", "65,536"), None, None),
    (["topology", "-c", "atp-ic6:300"], ("atp-ic6:300", "65,536"), None, None),
    (["topology", "-c", "dgx-h100:9000"], ("dgx-h100:9000", "65,536"), None, None),
    (["topology", "-c", "atp-ic5:0"], ("atp-ic5:0", "at least 1"), None, None),
    (["topology", "-c", "atp-ic5:x"], ("atp-ic5:x", "whole number"), None, None),
    (["topology", "-c", "atp-ic3:4"], ("atp-ic3", "fixed size"), None, None),
    (["topology", "-c", "no-such-preset"], ("no-such-preset", "meshpilot presets"), None, None),
    (["topology", "-c", "{big.toml}"], ("big.toml", "layers[0].ranks", "65,536"), None, None),
    (["topology", "-c", "{inf.toml}"], ("inf.toml", "layers[0].p2p_GBps", "GB/s"), None, None),
    (["topology", "-c", "{neg.toml}"], ("neg.toml", "p2p_GBps", "greater than zero"), None, None),
    (["topology", "-c", "{nodev.toml}"], ("nodev.toml", "device", "a100-80gb"), None, None),
    (["topology", "-c", "{dir.toml}"], ("dir.toml", "is a folder"), None, None),
    (["topology", "-c", "/nonexistent/c.toml"], ("/nonexistent/c.toml", "does not exist"), None, None),
    (["topology", "-c", "atp-ic3", "--devices", "0"], ("--devices", "at least 1"), None, None),
    (["topology", "-c", "atp-ic3", "--devices", "99"], ("--devices 99", "pick 1..that"), None, None),
    (["topology"], ("--cluster",), None, None),
    (["topology", "-c", "atp-ic5:"], ("'atp-ic5:'", "nothing after ':'", "atp-ic5:64"), None, None),
    (["topology", "-c", "atp-ic5:\u0663"], ("whole number of devices",), None, None),  # an Arabic-Indic 3
    (["topology", "-c", "{tiny.toml}"], ("tiny.toml", "layers[0].p2p_GBps", "1e-300", "GB/s"), None, None),
    (["topology", "-c", "{tinylat.toml}"], ("tinylat.toml", "layers[0].latency_us", "1e-300", "or 0"), None, None),
    (["topology", "-c", "{profile.toml}"], ("profile.toml", "device_profile.peak_tflops_fp32", "TFLOP/s"), None, None),
    (["simulate", "{p2.json}", "-c", "{tiny.toml}"], ("tiny.toml", "p2p_GBps", "1e-300"), None, None),
    (["topology", "-c", "{cal1.toml}"], ("cal1.toml", "calibration[0].B2_GBps", "size 1", "remove it"), None, None),
    # atp
    (["atp", "-c", "atp-ic3", "--devices", "-2"], ("--devices", "at least 1"), None, None),
    (["atp", "-c", "atp-ic3", "--devices", "64"], ("--devices 64", "pick 1..that"), None, None),
    (["atp", "-c", "atp-ic3", "--model", "nope"], ("nope",), None, None),
    (["atp", "-c", "atp-ic3", "--sweep"], ("--sweep", "atp-ic5"), None, None),
    (
        ["atp", "-c", "atp-ic5", "--sweep", "--out", "{dir}/missing/sw"],
        ("--out", "does not exist"),
        "{dir}/missing/sw.csv",
        None,
    ),
    (["atp", "-c", "atp-ic5", "--sweep", "--max-devices", "0"], ("--max-devices",), None, None),
    (["atp", "-c", "atp-ic5", "--sweep", "--out", ""], ("argument --out", "empty"), None, None),
    (["atp", "-c", "atp-ic5:abc", "--sweep"], ("'atp-ic5:abc'", "whole number"), None, None),
    (["atp", "-c", "atp-ic6:", "--sweep"], ("'atp-ic6:'", "nothing after ':'"), None, None),
    (
        ["atp", "-c", "atp-ic5:16", "--sweep"],
        ("--cluster atp-ic5:16", "sizes the preset itself", "--cluster atp-ic5"),
        None,
        None,
    ),
    (
        ["atp", "-c", "atp-ic5", "--sweep", "--max-devices", "2", "--out", "{dir}/sw2"],
        ("--max-devices 2", "smallest N", "at least 4"),
        "{dir}/sw2.csv",
        None,
    ),
    (["atp", "-c", "atp-ic5", "--sweep", "--out", "{dir}"], ("--out", "is a folder", "atp-sweep"), None, None),
    (["atp", "-c", "{tiny.toml}"], ("tiny.toml", "p2p_GBps", "1e-300"), None, None),
    (["atp", "-c", "atp-ic5", "--sweep", "--json", "--seq", "8"], ("--seq, --json", "not used by --sweep"), None, None),
    (["atp", "-c", "atp-ic3", "--out", "x"], ("--out", "only with --sweep"), None, None),
    # plan
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--devices", "0"], ("--devices", "at least 1"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--devices", "99"], ("--devices 99", "pick 1..that"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--memory-gib", "nan"], ("--memory-gib", "finite"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--memory-gib", "-1"], ("--memory-gib", "greater than 0"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--memory-gib", "inf"], ("--memory-gib", "finite"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--time-limit", "nan"], ("--time-limit", "finite"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--time-limit", "0"], ("--time-limit",), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--batch", "0"], ("--batch",), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--mesh", "2x"], ("--mesh", "d1xd2"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "4", "--mesh", "2x4"], ("--mesh 2x4", "--devices is 4"), None, None),
    (["plan", "-m", "nope", "-c", "atp-ic3"], ("--model 'nope'", "meshpilot presets"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--layers", "2"], ("--layers", "only for GPT"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--force", "fc1.weight"], ("--force", "PATTERN=LAYOUT"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--mesh", "3x3"], ("--mesh 3x3 (9 devices)", "only 8 devices"), None, None),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "--out", ""], ("argument --out", "empty"), None, None),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--schedule", "accumulate", "--microbatches", "3"],
        ("--microbatches 3", "batch 8", "--batch divisible by 3"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--schedule", "duplex", "--batch", "3"],
        ("--schedule duplex (2 microbatches)", "batch 3", "--batch divisible by 2"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--force", "zz=XYZ"],
        ("--force 'zz=XYZ'", "not a layout", "S(0)R"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--force", "zz=S(0)"],
        ("--force 'zz=S(0)'", "1 placement", "2-D mesh"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--force", "a=RR", "--force", "a=RS(0)"],
        ("'a'", "given twice"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--force", "zz=S(7)R", "--out", "{dir}/f7.json"],
        ("--force 'zz=S(7)R'", "S(7)", "more than 2 dim", "S(1) or R"),
        "{dir}/f7.json",
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--mesh", "2x1", "--force", "layers.0.bias=S(1)R"],
        ("--force 'layers.0.bias=S(1)R'", "layers.0.bias has 1 dim", "S(0) … S(0) or R"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--mesh", "2x1", "--force", "*=RR", "--force", "?*=S(0)R"],
        ("--force '*=RR'", "--force '?*=S(0)R'", "equally specific", "exact pattern"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "--mesh", "2x1", "--batch", "3", "--force", "input:0=S(0)R"],
        ("--force 'input:0=S(0)R'", "shape (3, 32)", "cannot be S(0)R on mesh (2, 1)", "pin one of RR"),
        None,
        None,
    ),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--out", "{dir}/nope/p.json"],
        ("--out", "does not exist"),
        "{dir}/nope/p.json",
        None,
    ),
    (["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--out", "{dir}"], ("--out", "is a folder"), None, None),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--out", "{plain.txt}/p.json"],
        ("--out", "not a folder"),
        None,
        None,
    ),
    (["plan", "-m", "mlp", "-c", "{inf.toml}", "-n", "2"], ("inf.toml", "p2p_GBps"), None, None),
    (
        ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--mesh", "2x1", "--memory-gib", "1e-6"],
        ("no sharding plan fits", "1.05 KiB"),
        None,
        None,
    ),
    (["simulate", "{p2.json}", "--straggler", "1:50", "--straggler", "1:20"], ("rank 1", "more than once"), None, None),
    (["simulate", "{p2.json}", "--png", ""], ("argument --png", "empty"), None, None),
    (["simulate", "{p2.json}", "--microbatches", "2"], ("--microbatches 2", "not --schedule plan"), None, None),
    (["simulate", "{p2.json}", "--schedule", "accumulate"], ("accumulate", "--microbatches 2 or more"), None, None),
    (["simulate", ""], ("argument plan", "empty"), None, None),
    # train (torchrun's environment; every check before the process group)
    (["train", "--plan", "{v99.json}"], ("v99.json", "version", "99"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (
        ["train", "--plan", "{s9.json}"],
        ("s9.json", "params[wte.weight][0]", "S(9)"),
        None,
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    (
        ["train", "--plan", "{q.json}"],
        ("q.json", "params[wte.weight][0]", "'Q'"),
        None,
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    (
        ["train", "--plan", "{dup.json}"],
        ("dup.json", "mesh_ranks", "more than once"),
        None,
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    (["train", "--plan", "{oor.json}"], ("oor.json", "mesh_ranks", "rank 7"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train", "--plan", "{shape0.json}"], ("shape0.json", "mesh_shape"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train", "--plan", "{nosolver.json}"], ("nosolver.json", "solver"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train", "--plan", "{notjson.json}"], ("notjson.json", "not JSON"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train", "--plan", "{list.json}"], ("list.json", "not a meshpilot plan"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train", "--plan", "{bin.json}"], ("bin.json", "not a text file"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train", "--plan", "{dir}/none.json"], ("none.json", "no such file"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (
        ["train", "--plan", "{p2.json}"],
        ("p2.json", "world size is 4", "--nproc-per-node 2"),
        None,
        {"RANK": "0", "WORLD_SIZE": "4"},
    ),
    (
        ["train", "--plan", "{p2.json}", "--layers", "3"],
        ("p2.json", "fingerprint", "different model"),
        None,
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    (["train", "--plan", "{p2.json}", "--mesh", "2x1"], ("--plan", "--mesh"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (
        ["train", "--plan", "{p2.json}", "--batch", "3"],
        ("--batch 3", "p2.json", "was made for", "leave --batch out"),
        None,
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    (
        ["train", "--plan", "{p2.json}", "--seq", "7"],
        ("--seq 7", "p2.json", "was made for", "--seq 7"),
        None,
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    (
        ["train", "--plan", "{p2.json}", "--json-out", "{dir}/no/l.json"],
        ("--json-out", "does not exist"),
        "{dir}/no/l.json",
        {"RANK": "0", "WORLD_SIZE": "2"},
    ),
    (["train", "--mesh", "3x1"], ("--mesh 3x1", "world size 2"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train"], ("WORLD_SIZE=0",), None, {"RANK": "0", "WORLD_SIZE": "0"}),
    (["train"], ("WORLD_SIZE='x'", "whole number"), None, {"RANK": "0", "WORLD_SIZE": "x"}),
    (["train", "--plan", "", "--nproc-per-node", "2"], ("argument --plan", "empty"), None, None),
    (["train", "--mesh", "2x1", "--steps", "1"], ("MASTER_ADDR", "torchrun"), None, {"RANK": "0", "WORLD_SIZE": "2"}),
    (["train", "--steps", "0"], ("--steps",), None, None),
    (["train", "--timeout", "nan"], ("--timeout", "finite"), None, None),
    (["train", "--nproc-per-node", "0"], ("--nproc-per-node",), None, None),
    (["train", "--nproc-per-node", "4", "--plan", "{p2.json}"], ("world size is 4", "--nproc-per-node 2"), None, None),
    (["train", "--model", "nope", "--nproc-per-node", "2"], ("nope",), None, None),
    # probe
    (["probe", "--repeats", "0"], ("--repeats",), None, None),
    (["probe", "--out", ""], ("argument --out", "empty"), None, None),
    (
        ["probe", "--name", " "],
        ("--name", "empty"),
        None,
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    ),
    (["probe", "--p2p-budget", "-1"], ("--p2p-budget",), None, None),
    (["probe"], ("torchrun",), None, None),
    # emulate
    (["emulate", "-c", "atp-ic3", "--", "/nonexistent/cmd"], ("/nonexistent/cmd", "no such file"), None, None),
    (["emulate", "-c", "atp-ic3", "--", "no-such-program-xyz"], ("no-such-program-xyz", "PATH"), None, None),
    (["emulate", "-c", "atp-ic3", "--timeout", "-5", "--", "true"], ("--timeout",), None, None),
    (["emulate", "-c", "atp-ic3", "--bw-scale", "0", "--", "true"], ("--bw-scale",), None, None),
    (["emulate", "-c", "atp-ic3"], ("no command",), None, None),
    (["emulate", "--", "true"], ("--cluster",), None, None),
    # demo
    (["demo", "--plan-out", "{dir}/gone/p.json"], ("--plan-out", "does not exist"), "{dir}/gone/p.json", None),
    (["demo", "--procs", "0"], ("--procs",), None, None),
    (["demo", "--plan-out", ""], ("argument --plan-out", "empty"), None, None),
    (["demo", "--procs", "64"], ("--procs 64",), None, None),
    (["demo", "--steps", "-1"], ("--steps",), None, None),
    (["demo", "-c", "atp-ic5:1000000"], ("65,536",), None, None),
]


def _fill(x: str, files: dict[str, Path]) -> str:
    for name, p in files.items():
        x = x.replace("{" + name + "}", str(p))
    return x


@pytest.mark.parametrize("argv, needles, out, env", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_cli_bad_input(argv, needles, out, env, files, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    argv = [_fill(a, files) for a in argv]
    out = _fill(out, files) if out else None
    _one_line(capsys, argv, tuple(_fill(n, files) for n in needles), out=out, env=env, mp=monkeypatch)


def test_force_pattern_that_matches_nothing_warns(capsys):
    rc = main(["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--ops", "none", "--force", "fc9.weight=RR"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "'fc9.weight' matches nothing" in err and "layers.0.weight" in err.replace("\n", "")


def test_hf_config_value_of_the_wrong_type_is_one_line(capsys):
    pytest.importorskip("transformers")
    line = _one_line(
        capsys,
        ["plan", "-m", "hf:gpt2", "--hf-config", "n_layer=abc", "-c", "atp-ic3"],
        ("--hf-config", "GPT2Config rejects", "n_layer", "value of its type"),
    )
    assert "Traceback" not in line


def test_a_multi_line_user_error_prints_as_one_line(capsys, monkeypatch):
    import meshpilot.cli.topology as topology

    def run(args):
        raise UserError("a library's message\n  spread over lines; fix it")

    monkeypatch.setattr(topology, "run", run)
    line = _one_line(capsys, ["topology", "-c", "atp-ic3"], ("a library's message spread over lines; fix it",))
    assert line.endswith("fix it")


def test_preset_specs_parse_in_one_place():
    from meshpilot.cluster.presets import parse_preset

    assert parse_preset("atp-ic5")[1] == 64 and parse_preset("atp-ic5:8")[1] == 8
    assert parse_preset("atp-ic3")[1] is None
    assert parse_preset("dgx-h100:2")[0].devices(2) == 16 and parse_preset("atp-ic6:4")[0].devices(4) == 16
    for bad in ("atp-ic5:", "atp-ic5:abc", "atp-ic5:\u0663", "atp-ic3:", "atp-ic5:-1"):
        with pytest.raises(UserError):
            parse_preset(bad)


def test_written_files_honour_the_umask(tmp_path):
    from meshpilot.io import atomic_write

    old = os.umask(0o022)
    try:
        p = atomic_write(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    assert [x.name for x in tmp_path.iterdir()] == ["a.json"]


def test_plan_json_mode_follows_umask(files):
    assert stat.S_IMODE(files["p2.json"].stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# ------------------------------------------------------------------------------------------------ Python API


@pytest.fixture(scope="module")
def mlp():
    from meshpilot.cli.plan import build_model

    return build_model("mlp")


def _api(fn, *needles):
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and "; " in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def test_plan_num_devices_and_mesh_shape_disagree(mlp):
    import meshpilot

    _api(lambda: meshpilot.plan(mlp.model, mlp.inputs, "atp-ic3", num_devices=4, mesh_shape=(2, 4)), "num_devices=4")
    _api(lambda: meshpilot.plan(mlp.model, mlp.inputs, "atp-ic3", num_devices=0), "num_devices=0")
    _api(lambda: meshpilot.plan(mlp.model, mlp.inputs, "atp-ic3", mesh_shape=(0, 2)), "mesh_shape")
    _api(lambda: meshpilot.plan(mlp.model, mlp.inputs, "atp-ic3", num_devices=64), "64 devices", "atp-ic3")


def test_plan_wrong_input_shapes_is_one_user_error(mlp, capsys):
    import meshpilot

    bad = (torch.empty(3, 7), *mlp.inputs[1:])
    _api(lambda: meshpilot.plan(mlp.model, bad, "atp-ic3", num_devices=2), "layers.0", "example inputs")
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, needles",
    [
        ("notjson.json", ("notjson.json", "not JSON")),
        ("other.json", ("other.json", "mesh_shape", "not a meshpilot plan")),
        ("nosolver.json", ("nosolver.json", "solver")),
        ("v99.json", ("v99.json", "version", "99")),
        ("list.json", ("list.json", "not a meshpilot plan")),
        ("dir", ("is a folder",)),
    ],
)
def test_plan_load_bad_files(files, name, needles):
    _api(lambda: Plan.load(files[name]), *needles)


def test_plan_load_missing_file(tmp_path):
    _api(lambda: Plan.load(tmp_path / "x.json"), "x.json", "no such plan file")


@pytest.fixture(scope="module")
def good_plan(files) -> StagePlan:
    return StagePlan.load(files["p2.json"])


@pytest.mark.parametrize(
    "edit, kwargs, needles",
    [
        (dict(mesh_ranks=(1, 1)), {}, ("mesh_ranks", "more than once")),
        (dict(mesh_ranks=(0, 2)), {}, ("mesh_ranks", "rank 2")),
        (dict(mesh_ranks=(0,)), {}, ("mesh_ranks", "1 entries")),
        (dict(mesh_shape=(2, -1)), {}, ("mesh_shape",)),
        (dict(mesh_axes=("gpu", "gpu")), {}, ("mesh_axes", "'gpu'", "more than once")),
        (dict(mesh_axes=("gpu",)), {}, ("mesh_axes", "names 1 axes", "(2, 1) has 2")),
        (dict(mesh_axes=("gpu", "")), {}, ("mesh_axes", "non-empty")),
        (dict(version=99), {}, ("version", "99")),
        (dict(inputs=(("S(5)", "R"), ("R", "R"))), {}, ("inputs[0][0]", "S(5)", "2 dim")),
        (dict(inputs=(("R",), ("R", "R"))), {}, ("inputs[0]", "2 placement")),
        ({}, dict(world_size=3), ("world size is 3", "--nproc-per-node 2")),
        ({}, dict(world_size=0), ("world size 0",)),
    ],
)
def test_validate_plan(good_plan, edit, kwargs, needles):
    bad = dataclasses.replace(good_plan, **edit)
    _api(lambda: validate_plan(bad, source="p.json", **kwargs), *needles)


def test_validate_plan_with_graph(good_plan):
    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT, gpt_tiny
    from meshpilot.planner.validate import validate

    def gpt_graph(layers: int):
        (b, t), _ = good_plan.input_shapes[0]
        with torch.device("meta"):
            model = GPT(dataclasses.replace(gpt_tiny(layers=layers), batch=b, seq=t))
        idx = torch.empty(b, t, dtype=torch.long, device="meta")
        return capture(model, (idx, idx))

    graph = gpt_graph(2)
    validate(Plan.single(good_plan), world_size=2, graph=graph, source="p.json")  # the good plan passes
    params = list(good_plan.params)
    params[0] = (params[0][0], ("S(2)", "R"))  # wte.weight is 2-D
    bad = dataclasses.replace(good_plan, params=tuple(params))
    _api(lambda: validate_plan(bad, graph=graph, source="p.json"), "params[wte.weight][0]", "S(2)", "2 dim")
    other = gpt_graph(3)
    _api(lambda: validate(Plan.single(good_plan), graph=other, source="p.json"), "fingerprint", "different model")


def test_parallelize_without_process_group(good_plan):
    import meshpilot

    _api(lambda: meshpilot.parallelize(torch.nn.Linear(2, 2), good_plan), "torchrun")


# ------------------------------------------------------------------------------------------------ real launches


def _launch(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "meshpilot.cli.main", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


# The tiers (tests/tiers.py): the default runs S(9) (13-24 CPU s a torchrun launch of 2 ranks, 2-core AMD EPYC); the
# full matrix also the repeated mesh rank. Both take the same path (a rank's plan check refuses before the process
# group, rank 0 alone says it, the launcher drops torchrun's report); test_cli_bad_input checks dup.json's own line
# in-process.
@pytest.mark.dist
@pytest.mark.parametrize(
    "name, needle", [("s9.json", "S(9)"), pytest.param("dup.json", "mesh_ranks", marks=pytest.mark.full)]
)
def test_launcher_under_torchrun_one_line(files, name, needle):
    """Run under torch.distributed.run itself (2 ranks, no launcher checks): each rank finds the mistake before
    the process group; rank 0 alone says it and the launcher drops torchrun's failure report."""
    from meshpilot.cli.launcher import launch

    code = (
        "import sys; from meshpilot.cli.launcher import launch; "
        f"sys.exit(launch(['train', '--plan', {str(files[name])!r}, '--steps', '1'], 2))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert launch  # imported for the docstring's claim: the launcher is the module under test


@pytest.mark.dist
def test_bare_torchrun_rank_alone_in_its_mistake_says_it(files, tmp_path):
    """Under bare torchrun a rank other than 0 that refuses its input while rank 0 goes on (here: rank 1 alone
    is given a missing plan) says so itself, naming itself, once; it used to exit silently."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import os, sys\nfrom meshpilot.cli.main import main\n"
        f"plan = {str(files['p2.json'])!r} if os.environ['RANK'] == '0' else {str(tmp_path / 'missing.json')!r}\n"
        "sys.exit(main(['train', '--plan', plan, '--steps', '1']))\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    p = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    said = [x for x in (p.stdout + p.stderr).splitlines() if "meshpilot train: error" in x]
    assert p.returncode != 0 and len(said) == 1, p.stdout + p.stderr
    assert "rank 1 of 2 (rank 0 went on)" in said[0] and "missing.json: no such file" in said[0], said


@pytest.mark.dist
def test_collective_timeout_names_the_silent_rank(files, tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshpilot.cli.main",
            "train",
            "--nproc-per-node",
            "2",
            "--plan",
            str(files["p2.json"]),
            "--steps",
            "2",
            "--timeout",
            "3",  # the steps' bound: the start waits up to START_TIMEOUT_S; rank 1 stalls after step 1
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT), MESHPILOT_TEST_STALL_RANK="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 124, p.stderr
    assert len(lines) == 1, p.stderr
    assert "timed out after 3 s" in lines[0] and "rank(s) 0" in lines[0] and "1 went silent" in lines[0], lines
