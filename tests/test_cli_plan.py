"""`meshpilot plan`: the rich plan, --json / --out (atomic, round-trips), the GPT size overrides, --force,
errors as one line with exit code 2, and a 44.8B-parameter GPT planned on the meta device."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from meshpilot.cli.main import main
from meshpilot.graph.capture import capture
from meshpilot.models import builtin_models
from meshpilot.planner.plan import Plan, StagePlan


def _one_line_error(capsys, args: list[str], *needles: str) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("meshpilot plan: error: "), err
    for n in needles:
        assert n in err, err
    return err


def test_rich_plan_of_a_small_model(capsys):
    assert main(["plan", "--model", "mlp", "--cluster", "atp-ic3", "--devices", "2", "--stages", "1"]) == 0
    out = capsys.readouterr().out
    for section in (
        "Mesh candidates",
        "Predicted step time",
        "compute",
        "communication",
        "resharding",
        "Memory per device",
        "capacity",
        "Parameter layouts",
        "Per-operator strategies",
        "Collectives per step",
        "solver:",
        "gap",
    ):
        assert section in out, section
    assert "★" in out and "2 devices" in out


def test_json_is_the_plan_and_out_saves_it(tmp_path, capsys):
    path = tmp_path / "plan.json"
    args = ["plan", "-m", "gpt-tiny", "-c", "atp-ic3", "-n", "4", "--mesh", "2x2", "--json", "--out", str(path)]
    assert main(args) == 0
    captured = capsys.readouterr()
    plan = StagePlan.from_json(captured.out)  # the one-stage Plan's stage plan
    assert plan.mesh_shape == (2, 2)
    assert StagePlan.load(path) == plan and Plan.load(path).only == plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left behind
    assert json.loads(path.read_text())["cluster"] == "atp-ic3"
    assert plan.time.total_s > 0 and plan.memory.total > 0


def test_repeated_layers_shown_once(capsys, monkeypatch):
    from meshpilot.cli.common import console

    monkeypatch.setattr(console, "width", 200)
    assert main(["plan", "-m", "gpt-tiny", "--layers", "3", "-c", "atp-ic3", "-n", "2", "--mesh", "1x2"]) == 0
    ops = capsys.readouterr().out.split("Per-operator strategies")[1].split("Collectives per step")[0]
    # the node count per layer follows the capture (sdpa as one op); the stack of three is what matters
    assert re.search(r"3 identical layers \(fwd, \d+ nodes each\); one shown", ops)
    assert "blocks.*.attn.qkv.weight" in ops  # the layer's parameters, index-free
    names = {line.split("│")[1].strip() for line in ops.splitlines() if line.startswith("│")}
    assert {"addmm", "addmm_1", "addmm_2", "addmm_3"} <= names  # the first layer's four Linear layers
    assert "addmm_4" not in names and "addmm_11" not in names  # the other two layers' are not repeated


def test_force_pins_a_parameter_layout(capsys):
    args = ["plan", "-m", "gpt-tiny", "-c", "atp-ic3", "-n", "4", "--mesh", "1x4", "--json"]
    args += ["--force", "blocks.*.mlp.fc.weight=RS(0)", "--force", "blocks.*.mlp.proj.weight=RS(1)"]
    assert main(args) == 0
    plan = StagePlan.from_json(capsys.readouterr().out)
    layouts = dict(plan.params)
    assert layouts["blocks.0.mlp.fc.weight"] == ("R", "S(0)")
    assert layouts["blocks.1.mlp.proj.weight"] == ("R", "S(1)")


def test_large_gpt_plans_on_meta_in_seconds(capsys):
    """ATP's M4 (44.8B parameters, 24 layers, h=12288) on 8 H100s: nothing is allocated, the stack of
    layers is one decision group, and the chosen plan fits in 80 GiB."""
    args = ["plan", "-m", "atp-m4", "-c", "dgx-h100", "-n", "8", "--mesh", "2x4", "--dtype", "bfloat16", "--json"]
    assert main(args) == 0
    plan = StagePlan.from_json(capsys.readouterr().out)
    assert plan.mesh_shape == (2, 4)
    assert plan.memory.total <= plan.memory.capacity == 80 * 2**30
    assert plan.solver.gap < 0.01
    layouts = {name: layout for name, layout in plan.params}
    assert layouts["blocks.0.attn.qkv.weight"] == layouts["blocks.23.attn.qkv.weight"] != ("R", "R")


def test_help_explains_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--cluster", "--devices", "--mesh", "--batch", "--seq", "--layers", "--out", "--json"):
        assert opt in out
    assert "meta device" in out and "train --plan" in out
    # every built-in model is named, or its family with its first and last size (`gpt3-350m … gpt3-39b`)
    from meshpilot.models import builtin_models

    flat = re.sub(r"-\s+", "-", " ".join(out.split()))  # argparse wraps lines at hyphens
    from meshpilot.planner.schedule import PipelineKind

    for kind in PipelineKind:  # each pipeline schedule named with what it is: "gpipe (all forwards, …"
        assert re.search(rf"{re.escape(kind.value)} \(\w", flat), kind
    for name in builtin_models():
        base = name.removesuffix("-tiny") if "-tiny versions" in flat else name  # "… and their -tiny versions"
        family = re.sub(r"-?[\d.]+[mb]?$", "", base)
        assert base in flat or f"{family}-" in flat or f"{family}1" in flat, name


def test_unknown_model(capsys):
    _one_line_error(capsys, ["plan", "-m", "gpt-huge", "-c", "atp-ic3"], "'gpt-huge'", "atp-m1", "meshpilot presets")


def test_more_devices_than_the_cluster(capsys):
    _one_line_error(capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "16"], "--devices 16", "has only 8 devices")


def test_mesh_must_match_devices(capsys):
    _one_line_error(capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "4", "--mesh", "2x4"], "--mesh 2x4")
    _one_line_error(capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "--mesh", "2by2"], "d1xd2")


def test_gpt_options_on_a_non_gpt(capsys):
    _one_line_error(capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--layers", "4"], "--layers", "GPT")


def test_bad_force(capsys):
    _one_line_error(
        capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--force", "fc1.weight"], "PATTERN=LAYOUT"
    )


def test_no_plan_fits_is_the_plan_error(capsys):
    err = _one_line_error(
        capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--mesh", "2x1", "--memory-gib", "1e-6"]
    )
    assert "no sharding plan fits" in err and "1.05 KiB" in err  # 1e-6 GiB, readable (not "0.00 GiB")
    # every shape fails: one clause with the shapes and the smallest need, not one per shape
    err = _one_line_error(
        capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "4", "--memory-gib", "1e-6", "--stages", "1"]
    )
    assert "on any mesh shape ((4, 1), (2, 2), (1, 4)): the smallest per-device memory found is" in err
    assert err.count("1.05 KiB") == 1 and err.count("use more devices") == 1


def test_out_into_a_missing_folder(tmp_path, capsys):
    _one_line_error(
        capsys, ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--out", str(tmp_path / "no" / "p.json")], "folder"
    )


def test_train_plan_checks_the_file_and_the_world_size(tmp_path, capsys, monkeypatch):
    """`meshpilot train --plan` refuses, in one line and before any process group, a missing plan file and a
    plan for another number of devices than torchrun started."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--plan", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    path = tmp_path / "plan.json"
    assert main(["plan", "-m", "gpt-tiny", "-c", "atp-ic3", "-n", "4", "--mesh", "4x1", "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["train", "--plan", str(path), "--model", "gpt-tiny"]) == 2
    err = capsys.readouterr().err
    assert "has 4 devices but the world size is 2" in err and "--nproc-per-node 4" in err  # validate_plan
    assert main(["train", "--plan", str(path), "--mesh", "2x2"]) == 2
    assert "leave out --mesh" in capsys.readouterr().err


def test_duplex_schedule_from_plan_to_simulate(tmp_path, capsys):
    """`plan --schedule duplex --out` saves the duplex schedule (2 microbatches of the global batch) and shows
    the simulated step's overlap ratio; `simulate` shows the overlap ratio, the step without duplex, and draws
    both timelines."""
    out = tmp_path / "plan.json"
    args = ["plan", "-m", "gpt-tiny", "-c", "atp-ic3", "-n", "4", "--mesh", "2x2", "--ops", "none"]
    assert main([*args, "--schedule", "duplex", "--out", str(out)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "simulated, duplex schedule" in shown and "overlap ratio" in shown  # the plan's predicted overlap
    plan = Plan.load(out)
    assert plan.step_schedule().name == "duplex" and plan.step_schedule().microbatches == 2
    png = tmp_path / "both.png"
    assert main(["simulate", str(out), "--png", str(png)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "overlap ratio" in text and "without duplex (accumulate, 2 microbatches)" in text
    assert "duplex above, without below" in text and png.read_bytes()[:4] == b"\x89PNG"
    _one_line_error(capsys, [*args, "--schedule", "duplex", "--microbatches", "4"], "interleaves 2 microbatches")
    _one_line_error(capsys, [*args, "--schedule", "accumulate"], "--microbatches 2 or more")


def test_plan_weighs_one_stage_against_the_best_pipeline(capsys):
    """Without --stages, `meshpilot plan` plans one stage and the stage DP's best and keeps the shorter step,
    printing both; --stages 1 is the one-stage plan alone, --stages 2 the pipeline alone."""
    base = ["plan", "-m", "mlp", "-c", "atp-ic3", "-n", "2", "--ops", "none"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "chose " in out and "one stage (SPMD on all 2 devices): predicted step" in out
    assert "the pipeline of " in out and "simulated step" in out
    assert re.search(r"the pipeline of \d+ stages? (\[\d+,\d+\)@\dx\d ?)+ \(\d+ microbatches\)", out)  # its stages
    assert main([*base, "--stages", "1"]) == 0
    one = capsys.readouterr().out
    assert "Mesh candidates" in one and "weighed against" not in one and "the pipeline of" not in one
    assert main([*base, "--stages", "2", "--microbatches", "2"]) == 0
    two = capsys.readouterr().out
    assert "2 stages on 2 devices, 2 microbatches" in two and "chose the" not in two


def test_a_model_one_stage_cannot_hold_gets_stages(capsys):
    """When the whole batch's saved activations and the weights spread over every device are more than a device
    holds, no one-stage search is run and the plan is a pipeline (with enough microbatches), saying why. Where
    the one-stage search may recompute (the default), the floor is what recomputed blocks keep: here it fits, so
    one stage is searched (recomputing) and weighed against the pipeline."""
    from meshpilot.planner.decide import model_bytes, one_stage_floor

    args = ["plan", "-m", "gpt-tiny", "-c", "alpa-p3x8", "-n", "2", "--batch", "64", "--memory-gib", "0.002"]
    assert main([*args, "--ops", "none", "--recompute", "none"]) == 0
    out = capsys.readouterr().out
    assert "one stage does not fit: with the whole batch at once each of the 2 devices holds at least" in out
    assert "chose the pipeline of" in out and "stages on 2 devices" in out
    assert main([*args, "--ops", "none"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" not in out and "one stage (SPMD on all 2 devices): predicted step" in out
    built = builtin_models()["gpt-tiny"].build("meta", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(*built)
    assert one_stage_floor(model_bytes(graph), 2, 1) > 0.002 * 2**30


def test_a_recomputing_plan_prints_its_operators(capsys):
    """A one-stage plan that recomputes blocks is shown on the graph it was made for: its operator table lists
    the recomputed copies (it raised KeyError on a node the transform drops)."""
    args = ["plan", "-m", "gpt-tiny", "--layers", "2", "-c", "dgx-h100", "-n", "2", "--stages", "1"]
    assert main([*args, "--recompute", "full", "--ops", "all"]) == 0
    out = capsys.readouterr().out
    assert "recompute: blocks.0, blocks.1" in out and "_recomputed" in out


def test_zero_stage_from_the_command_line(capsys):
    """--zero reaches the one-stage plan's ZeRO pass: stage 2 (one gather a step) and stage 3 (a gather at every
    read of every microbatch) plan every candidate and price them apart; a pipeline refuses it in one line."""
    args = ["plan", "-m", "gpt-tiny", "-c", "dgx-h100", "-n", "4", "--batch", "16", "--stages", "1", "--mesh", "4x1",
            "--microbatches", "2", "--schedule", "accumulate", "--ops", "none", "--json"]  # fmt: skip
    steps = {}
    for z in ("2", "3"):
        assert main([*args, "--zero", z]) == 0
        plan = Plan.from_json(capsys.readouterr().out).stages[0].plan
        assert plan.zero and {s.stage.value for s in plan.zero} == {int(z)}
        steps[z] = plan.time.overlapped_s
    assert steps["2"] < steps["3"]  # one gather a step against one per read per microbatch
    assert main(["plan", "-m", "gpt-tiny", "-c", "dgx-h100", "-n", "4", "--pipeline", "--zero", "2"]) == 2
    assert "--zero 2: a pipeline's stages choose their own ZeRO switches" in capsys.readouterr().err
