"""Checkpoints (``meshpilot.runtime.checkpoint``): save under one plan, resume under another, survive a SIGKILL.

One spawn per world size, made once for the module (``runs``):

* 8 gloo ranks train gpt-tiny 4 steps under Megatron TP on (2, 4), saving every 2 steps;
* 1 process (its own interpreter, a gloo group of one) trains under a (1, 1) plan, saving every step, and is
  SIGKILLed inside the save of step 2, after every shard is written and before the commit;
* 4 gloo ranks then: train 4 steps under Megatron TP on (2, 2), saving every 2 (the uninterrupted curve);
  resume its step-2 under ZeRO-3 on (4, 1); resume the 8 ranks' step-2 under (4, 1) (8 -> 4 ranks, another
  mesh); resume the killed run's newest checkpoint under (4, 1) (1 -> 4 ranks);
* 1 process then resumes the 4 ranks' step-2 under the (1, 1) plan (4 -> 1 rank, another mesh).

The 8-rank spawn (and with it 8 -> 4) runs in the full matrix only (``tests/tiers.py``: FEWER).

The resumed curves must equal the uninterrupted ones within 1e-6 at every step, the parameters, AdamW's
states and the random state right after the load must equal the saved run's at that step exactly, and the
data position must be the samples consumed. The CLI test runs ``meshpilot train --nproc-per-node 2`` with
checkpoints, stops it with SIGTERM, and resumes it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from dist_utils import captures, graph_of, run_distributed
from tiers import matrix

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-6
STEPS = 4
CLUSTER = "atp-ic3"
FEWER = matrix(("4 -> 1",), ("8 -> 4", "4 -> 1"))
"""The resumes on fewer ranks under another mesh. Default: 4 ranks' (2, 2) Megatron checkpoint under (1, 1) in
one process; full only: 8 ranks' (2, 4) under (4, 1) on the 4 ranks (the 8-rank spawn). The `runs` fixture's
CPU s (ranks included, charged to test_plans_differ): 118 before (the last full run, load ~20), 71 after
(default tier, load ~7). The file: 294 before, 136 after (22 passed, 1 full only)."""
EIGHT_TO_FOUR = "8 -> 4" in FEWER  # the 8-rank spawn runs


def _cfg():
    from meshpilot.models.gpt import gpt_tiny

    return gpt_tiny(batch=8, seq=8)


@functools.cache
def _meta_gpt() -> tuple:
    """The GPT on the meta device, its (tokens, targets) and its capture: one for every plan of the file (the
    same model and batch; a capture is ~0.7 CPU s)."""
    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT

    cfg = _cfg()
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
    return model, (idx, idx), capture(model, (idx, idx))


def _plan(shape: tuple[int, int], kind: str):
    from meshpilot.planner.auto import plan
    from meshpilot.planner.forced import forced

    model, inputs, graph = _meta_gpt()
    force = forced(kind, model, inputs, shape, **({"graph": graph} if kind == "megatron_tp" else {}))
    return plan(model, inputs, CLUSTER, mesh_shape=shape, force=force, graph=graph)


# ----------------------------------------------------------------------------------------- on the ranks


def _full_state(model, opt) -> dict:
    """Every parameter, AdamW state and the CPU random state, gathered whole (collective)."""
    from torch.distributed.tensor import DTensor

    def whole(t):  # a copy: full_tensor() of a replicated DTensor is its local tensor, which AdamW updates in place
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    names = {id(p): n for n, p in model.module.named_parameters()}
    out = {f"param:{n}": whole(p.detach()) for n, p in model.module.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim:{names[id(p)]}:{k}"] = whole(v)
    out["rng"] = torch.get_rng_state()
    return out


def _recording(base):
    """A Checkpointing that also records the whole state right after its restore and after each save."""

    class Recording(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.states: dict[str, dict] = {}

        def restore(self, model, optimizer):
            got = super().restore(model, optimizer)
            if self.resume is not None:
                self.states["restored"] = _full_state(model, optimizer)
            return got

        def after_step(self, model, optimizer, *, step, **kw):
            path = super().after_step(model, optimizer, step=step, **kw)
            if path is not None:
                self.states[f"step-{step}"] = _full_state(model, optimizer)
            return path

    return Recording


def _eight(plan, directory: str) -> dict:
    from meshpilot.models.gpt import GPT
    from meshpilot.runtime.checkpoint import Checkpointing
    from meshpilot.runtime.train import train_plan

    with torch.device("meta"):
        graph = graph_of("gpt", GPT(_cfg()), plan)  # the parent's (``runs``)
    rec = _recording(Checkpointing)(directory, every=2)
    logs = train_plan(_cfg(), plan, STEPS, graph=graph, checkpoint=rec)
    return {"losses": [s.loss for s in logs], "state2": rec.states["step-2"]}


def _four(plan_a, plan_b, tmp: str, dir8: str, dir1: str) -> dict:
    from meshpilot.models.gpt import GPT
    from meshpilot.runtime.checkpoint import Checkpointing, complete, newest
    from meshpilot.runtime.train import train_plan

    cfg, out = _cfg(), {}
    with torch.device("meta"):  # one capture for the four runs below (both plans: the same model and batch)
        graph = graph_of("gpt", GPT(cfg), plan_a)  # the parent's (``runs``)
    t0 = time.perf_counter()
    rec = _recording(Checkpointing)(f"{tmp}/a", every=2)
    out["a"] = [s.loss for s in train_plan(cfg, plan_a, STEPS, graph=graph, checkpoint=rec)]
    out["a_state2"] = rec.states["step-2"]
    out["a_saved"] = [c.step for c in complete(f"{tmp}/a")]
    out["a_seconds"] = time.perf_counter() - t0
    for name, source in (("b", f"{tmp}/a"), ("from8", dir8)):
        if source is None:  # no 8-rank run (FEWER)
            continue
        t0 = time.perf_counter()
        ck = next(c for c in complete(source) if c.step == 2)
        rec = _recording(Checkpointing)(f"{tmp}/{name}", resume=ck)
        out[name] = [s.loss for s in train_plan(cfg, plan_b, STEPS, graph=graph, checkpoint=rec)]
        out[f"{name}_restored"] = rec.states["restored"]
        out[f"{name}_position"] = ck.position
        out[f"{name}_seconds"] = time.perf_counter() - t0
    killed = newest(dir1)  # what --resume picks after the SIGKILL
    out["killed_newest"] = killed.step
    resumed = Checkpointing(f"{tmp}/c", resume=killed)
    out["from1"] = [s.loss for s in train_plan(cfg, plan_b, 3, graph=graph, checkpoint=resumed)]
    return out


def _graphs(plans: dict) -> dict:
    """The captures the ranks' ``graph_of`` finds (:func:`_four`'s for both its plans, :func:`_eight`'s), made
    here once by ``graph_of``'s own call on the same meta build: each rank traced the GPT (~0.7 CPU s a rank).
    The plans share the batch, so this is one capture."""
    from meshpilot.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(_cfg())
    return captures(*(("gpt", model, plans[k]) for k in ("a", "c") if k == "a" or EIGHT_TO_FOUR))


KILLED_RUN = """
import os, sys, torch, torch.distributed as dist
from meshpilot.planner.plan import Plan
from meshpilot.runtime.checkpoint import Checkpointing
from meshpilot.runtime.train import train_plan
from test_checkpoint import _cfg
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[3], 1), rank=0, world_size=1)
train_plan(_cfg(), Plan.load(sys.argv[1]), 4, checkpoint=Checkpointing(sys.argv[2], every=1))
"""

FEWER_RUN = """
import sys, torch, torch.distributed as dist
from meshpilot.planner.plan import Plan
from meshpilot.runtime.checkpoint import Checkpointing, complete
from meshpilot.runtime.train import train_plan
from test_checkpoint import STEPS, _cfg, _recording
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[4], 1), rank=0, world_size=1)
ck = next(c for c in complete(sys.argv[2]) if c.step == 2)
rec = _recording(Checkpointing)(sys.argv[3], resume=ck)
losses = [s.loss for s in train_plan(_cfg(), Plan.load(sys.argv[1]), STEPS, checkpoint=rec)]
torch.save({"losses": losses, "restored": rec.states["restored"], "position": ck.position}, sys.argv[5])
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from meshpilot.runtime.checkpoint import KILL_ENV

    tmp = tmp_path_factory.mktemp("ckpt")
    plans = {
        "a": _plan((2, 2), "megatron_tp"),
        "b": _plan((4, 1), "zero3"),
        "c": _plan((2, 4), "megatron_tp"),
        "one": _plan((1, 1), "data_parallel"),
    }
    times = {}
    eight = None
    graphs = _graphs(plans)
    if EIGHT_TO_FOUR:
        t0 = time.perf_counter()
        eight = run_distributed(_eight, 8, plans["c"], str(tmp / "8"), timeout=600, graphs=graphs)[0]
        times["8 ranks"] = time.perf_counter() - t0

    plans["one"].save(tmp / "one.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **{KILL_ENV: "2"})
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(tmp / "one.json"), str(tmp / "1"), str(tmp / "store1")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    times["killed"] = time.perf_counter() - t0
    listing = sorted(p.name for p in (tmp / "1").iterdir())
    tmp_files = (
        sorted(p.name for p in (tmp / "1" / "step-2.tmp").iterdir()) if (tmp / "1" / "step-2.tmp").is_dir() else []
    )

    t0 = time.perf_counter()
    dir8 = str(tmp / "8") if eight is not None else None
    four = run_distributed(
        _four, 4, plans["a"], plans["b"], str(tmp / "4"), dir8, str(tmp / "1"), timeout=600, graphs=graphs
    )
    times["4 ranks"] = time.perf_counter() - t0

    t0 = time.perf_counter()  # 4 -> 1: the 4 ranks' step-2 checkpoint under (1, 1) in one process
    env.pop(KILL_ENV)
    fewer = subprocess.run(
        [sys.executable, "-c", FEWER_RUN, str(tmp / "one.json"), str(tmp / "4" / "a"), str(tmp / "from4")]
        + [str(tmp / "store4"), str(tmp / "from4.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    from4 = torch.load(tmp / "from4.pt")
    times["4 -> 1"] = time.perf_counter() - t0
    print("checkpoint test times (s):", {k: round(v, 1) for k, v in times.items()})
    return {
        "eight": eight,
        "four": four[0],
        "from4": from4,
        "killed": killed,
        "killed_listing": listing,
        "killed_tmp_files": tmp_files,
        "plans": plans,
    }


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def _state_diff(x: dict, y: dict) -> tuple[float, str]:
    assert set(x) == set(y), sorted(set(x) ^ set(y))
    worst, where = 0.0, ""
    for k in x:
        d = (x[k].double() - y[k].double()).abs().max().item() if x[k].numel() else 0.0
        if d > worst or not where:
            worst, where = max(worst, d), k
    return worst, where


@pytest.mark.dist
def test_plans_differ(runs):
    """The resume really changes mesh and layouts (else it proves little)."""
    plans = runs["plans"]
    a, b, c = (dict(plans[k].params) for k in "abc")
    assert plans["a"].mesh_shape != plans["b"].mesh_shape != plans["c"].mesh_shape
    assert set(a) == set(b) == set(c)
    assert sum(a[n] != b[n] for n in a) >= len(a) // 2, (a, b)  # most parameters change layout
    assert sum(c[n] != b[n] for n in c) >= len(c) // 2, (c, b)


@pytest.mark.dist
def test_resume_under_another_plan_equals_the_uninterrupted_run(runs):
    four = runs["four"]
    assert four["a_saved"] == [2, 4]
    assert four["b"][:2] == four["a"][:2]  # the first two steps are the checkpoint's own record
    assert _close(four["b"], four["a"]) <= TOL, (four["a"], four["b"])
    assert four["b_position"] == 2 * _cfg().batch


@pytest.mark.dist
def test_resume_on_fewer_ranks_and_another_mesh_equals_the_uninterrupted_run(runs):
    """Saved by 4 ranks under (2, 2), resumed by 1 under (1, 1); in the full matrix (FEWER) also saved by 8 ranks
    under (2, 4), resumed by 4 ranks under (4, 1)."""
    eight, four, from4 = runs["eight"], runs["four"], runs["from4"]
    assert _close(from4["losses"], four["a"]) <= TOL, (four["a"], from4["losses"])
    assert from4["position"] == 2 * _cfg().batch
    if EIGHT_TO_FOUR:
        assert _close(four["from8"], eight["losses"]) <= TOL, (eight["losses"], four["from8"])
        assert four["from8_position"] == 2 * _cfg().batch


@pytest.mark.dist
def test_the_loaded_state_is_the_saved_state(runs):
    """Parameters, AdamW's exp_avg / exp_avg_sq / step and the random state, whole, right after the load."""
    four, eight = runs["four"], runs["eight"]
    pairs = [(four["b_restored"], four["a_state2"]), (runs["from4"]["restored"], four["a_state2"])]
    if EIGHT_TO_FOUR:
        pairs.append((four["from8_restored"], eight["state2"]))
    for restored, saved in pairs:
        assert any(k.endswith(":exp_avg_sq") for k in saved) and any(k.endswith(":step") for k in saved)
        worst, where = _state_diff(restored, saved)
        assert worst == 0.0, (worst, where)
        assert {float(v) for k, v in restored.items() if k.endswith(":step")} == {2.0}


@pytest.mark.dist
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(runs):
    killed = runs["killed"]
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert runs["killed_listing"] == ["step-1", "step-2.tmp"]
    assert ".metadata" in runs["killed_tmp_files"]  # every shard was written: only the commit was missing
    four = runs["four"]
    assert four["killed_newest"] == 1
    # resumed from step 1 on 4 ranks under (4, 1): the curve of the uninterrupted 4-rank run
    assert _close(four["from1"], four["a"][:3]) <= TOL, (four["a"], four["from1"])


# ----------------------------------------------------------------------------------------- no ranks


def test_newest_skips_unfinished_and_damaged_checkpoints(tmp_path):
    from meshpilot.runtime.checkpoint import MANIFEST, newest, read

    def make(name: str, step: int | None, text: str | None = None) -> None:
        d = tmp_path / name
        d.mkdir()
        if step is not None or text is not None:
            body = text if text is not None else json.dumps({"format": 1, "step": step, "position": 0, "logs": []})
            (d / MANIFEST).write_text(body)

    assert newest(tmp_path) is None
    make("step-2", 2)
    make("step-10.tmp", 10)  # a save in progress: its manifest may even be there, not yet renamed
    make("step-9", None)  # no manifest
    make("step-8", None, "{not json")
    make("step-7", 6)  # a manifest of another step
    make("step-3x", 3)
    assert newest(tmp_path).step == 2
    make("step-5", 5)
    assert newest(tmp_path).path.name == "step-5"
    with pytest.raises(Exception, match="not a complete meshpilot checkpoint"):
        read(tmp_path / "step-9")


def test_signature_mismatch_is_one_line():
    from meshpilot.runtime.checkpoint import _mismatch

    assert _mismatch({"w": [[2, 3], "float32"]}, {"w": [[2, 3], "float32"]}) is None
    assert "'w' is (2, 3) float32 there, (2, 4) float32 here" in _mismatch(
        {"w": [[2, 3], "float32"]}, {"w": [[2, 4], "float32"]}
    )
    assert "this model lacks" in _mismatch({"w": [[1], "float32"], "v": [[1], "float32"]}, {"w": [[1], "float32"]})


def test_data_is_a_function_of_the_sample_index():
    from meshpilot.models.sources import hf_tokens
    from meshpilot.runtime.train import batch_at, batches

    cfg = _cfg()
    four = batches(cfg, 4, seed=0)
    assert torch.equal(four[2][0], batch_at(cfg, 2 * cfg.batch, 0)[0])
    assert torch.equal(batches(cfg, 2, 0, start=2 * cfg.batch)[1][1], four[3][1])
    assert not torch.equal(four[0][0], four[1][0])
    assert not torch.equal(batch_at(cfg, 0, 0)[0], batch_at(cfg, 0, 1)[0])  # the seed matters
    # samples do not depend on the batch size: two batches of 4 are one batch of 8
    ids8 = hf_tokens(50, 8, 6, 1, 0)[0][0]
    ids4 = torch.cat([b[0] for b in hf_tokens(50, 4, 6, 2, 0)])
    assert torch.equal(ids8, ids4)


# ----------------------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """A gpt-tiny plan for 2 ranks and checkpoint folders for the flag checks (a manifest is all they read)."""
    from meshpilot.cli.main import main
    from meshpilot.runtime.checkpoint import MANIFEST

    d = tmp_path_factory.mktemp("ckcli")
    plan = d / "p2.json"
    assert main(["plan", "-m", "gpt-tiny", "-c", CLUSTER, "--mesh", "2x1", "--ops", "none", "--out", str(plan)]) == 0
    for name in ("done/step-2", "partial/step-3.tmp", "empty"):
        (d / name).mkdir(parents=True)
    manifest = {"format": 1, "step": 2, "position": 16, "logs": [], "seed": 0, "lr": 1e-3}
    (d / "done/step-2" / MANIFEST).write_text(json.dumps(manifest))
    (d / "afile").write_text("x")
    return d


FLAG_CASES = [
    (["--checkpoint-every", "2"], ("--checkpoint-every", "needs --checkpoint-dir")),
    (["--resume"], ("--resume", "needs --checkpoint-dir")),
    (["--checkpoint-dir", "{d}/afile"], ("afile", "is a file")),
    (["--checkpoint-dir", "{d}/no/such/ck"], ("no/such", "does not exist")),
    (["--checkpoint-dir", "{d}/empty", "--resume"], ("--resume", "no complete checkpoint", "without --resume")),
    (["--checkpoint-dir", "{d}/partial", "--resume"], ("no complete checkpoint", "only unfinished saves: step-3.tmp")),
    (["--checkpoint-dir", "{d}/done"], ("already holds checkpoints", "step-2", "--resume")),
    (["--checkpoint-dir", "{d}/done", "--resume", "--steps", "2"], ("after step 2", "--steps is 2", "above")),
    (["--checkpoint-dir", "{d}/done", "--resume", "--seed", "1"], ("--seed 1", "--seed 0")),
    (["--checkpoint-dir", "{d}/done", "--resume", "--lr", "0.01"], ("--lr 0.01", "--lr 0.001")),
    (["--no-plan", "--checkpoint-dir", "{d}/empty"], ("--checkpoint-dir", "with --plan")),
]


@pytest.mark.parametrize("flags, needles", FLAG_CASES, ids=[" ".join(c[0])[:50] for c in FLAG_CASES])
def test_checkpoint_flags_bad_input_is_one_line(flags, needles, cli, capsys, monkeypatch):
    """Every mistake before any process group: one line, exit 2, nothing created."""
    from meshpilot.cli.main import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    before = sorted(p.relative_to(cli) for p in cli.rglob("*"))
    flags = [f.replace("{d}", str(cli)) for f in flags]
    argv = (
        ["train", "--steps", "4"] if "--no-plan" in flags else ["train", "--plan", str(cli / "p2.json"), "--steps", "4"]
    )
    argv += [f for f in flags if f != "--no-plan"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("meshpilot train: error: "), err
    for n in needles:
        assert n in err, err
    assert sorted(p.relative_to(cli) for p in cli.rglob("*")) == before


def test_a_torchrun_restart_resumes_by_itself(cli, monkeypatch):
    """Under torchrun --max-restarts a restarted run (TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest
    checkpoint without --resume, and starts afresh when there is none yet."""
    import argparse

    from meshpilot.cli.train import check_checkpoint_flags

    def args(directory: Path) -> argparse.Namespace:
        return argparse.Namespace(
            checkpoint_dir=directory, checkpoint_every=None, resume=False, steps=4, seed=0, lr=1e-3
        )

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert check_checkpoint_flags(args(cli / "done")).step == 2
    assert check_checkpoint_flags(args(cli / "empty")) is None


@pytest.mark.dist
@pytest.mark.slow
def test_cli_sigterm_saves_and_resume_continues_the_curve(cli, tmp_path):
    """`meshpilot train --nproc-per-node 2 --checkpoint-dir`: SIGTERM to the launcher after step 1 -> every
    rank stops at the same step, saves, one `stopped:` line, exit 143; `--resume` continues; the --json-out
    curve (written after every step) equals an uninterrupted run's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    base = [
        sys.executable,
        "-m",
        "meshpilot.cli.main",
        "train",
        "--nproc-per-node",
        "2",
        "--plan",
        str(cli / "p2.json"),
    ]
    base += ["--device", "cpu", "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck")]
    first = tmp_path / "first.json"
    proc = subprocess.Popen(
        [*base, "--json-out", str(first)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = []
    assert proc.stdout is not None
    watchdog = threading.Timer(400, proc.kill)  # a hang fails the test instead of stalling the suite
    watchdog.start()
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1:"):
            # the curve so far is already on disk, valid JSON: steps 0 and 1 at least (under load the ranks may
            # have finished another step before this line is read), in order
            steps = [s["step"] for s in json.loads(first.read_text())["steps"]]
            assert len(steps) >= 2 and steps == list(range(len(steps))), steps
            proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    watchdog.cancel()
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    stops = [x for x in err.splitlines() if x.startswith("meshpilot train: stopped: ")]
    assert len(stops) == 1 and "continue with --resume" in stops[0], err[-3000:]
    from meshpilot.runtime.checkpoint import newest

    ck = newest(tmp_path / "ck")
    assert ck is not None and 2 <= ck.step < 6, (ck, lines)
    assert ck.position == ck.step * 4 and len(ck.logs) == ck.step  # gpt-tiny's batch: 4 samples a step
    assert json.loads(first.read_text())["finished"] is False

    second = tmp_path / "second.json"
    done = subprocess.run(
        [*base, "--resume", "--json-out", str(second)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ck.path}" in done.stdout
    got = json.loads(second.read_text())
    assert got["finished"] is True and [s["step"] for s in got["steps"]] == list(range(6))
    # the uninterrupted curve, in this process on one device (the plan's runs equal it within 1e-5)
    from meshpilot.models.gpt import gpt_tiny
    from meshpilot.runtime.train import train_single

    ref = train_single(gpt_tiny(), 6)
    assert max(abs(s["loss"] - r.loss) for s, r in zip(got["steps"], ref)) <= 1e-5


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun worker `rank` among `parent`'s children (read from /proc: RANK in its environment)."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.full  # 70 CPU s in the last full run. Its parts stay in the default tier: a restarted run's resume
# without --resume (test_a_torchrun_restart_resumes_by_itself), the CLI's resume continuing the curve on 2 ranks
# (test_cli_sigterm_saves_and_resume_continues_the_curve); only this end-to-end run under torchrun is full only
def test_torchrun_restart_after_a_killed_rank_resumes_the_curve(cli, tmp_path):
    """`torchrun --max-restarts=1`: rank 1 SIGKILLed after step 3; torchrun restarts both ranks, which resume
    from the newest checkpoint by themselves (no --resume), and the finished curve is the uninterrupted one."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("needs /proc to find the worker")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    out = tmp_path / "curve.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts=1"]
    cmd += ["-m", "meshpilot.cli.main", "train", "--plan", str(cli / "p2.json"), "--device", "cpu", "--steps", "6"]
    cmd += ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--json-out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    lines = []
    assert proc.stdout is not None
    watchdog = threading.Timer(400, proc.kill)  # a hang fails the test instead of stalling the suite
    watchdog.start()
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3:") and killed is None:
            killed = _rank_pid(proc.pid, 1)
            assert killed is not None, "no worker with RANK=1 under torchrun"
            os.kill(killed, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    watchdog.cancel()
    assert killed is not None, lines
    assert proc.returncode == 0, err[-3000:]
    resumed = [x for x in lines if x.startswith("resumed from ")]
    assert len(resumed) == 1, lines  # the restarted attempt said where it continued from
    got = json.loads(out.read_text())
    assert got["finished"] is True and [s["step"] for s in got["steps"]] == list(range(6))
    from meshpilot.models.gpt import gpt_tiny
    from meshpilot.runtime.train import train_single

    ref = train_single(gpt_tiny(), 6)
    assert max(abs(s["loss"] - r.loss) for s, r in zip(got["steps"], ref)) <= 1e-5
    # the steps the first attempt ran after the checkpoint it resumed from ran again: the same losses
    first = {
        int(x.split()[1].rstrip(":")): float(x.split()[3])
        for x in lines[: lines.index(resumed[0])]
        if x.startswith("step ")
    }
    for s in got["steps"]:
        if s["step"] in first:
            assert abs(round(s["loss"], 6) - first[s["step"]]) <= 2e-6, (s, first)


def test_save_and_load_without_a_process_group(tmp_path):
    """One process, no group: a plain module and AdamW round-trip exactly; another model is one line."""
    from meshpilot.errors import UserError
    from meshpilot.runtime.checkpoint import load, newest, save

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    rng = torch.get_rng_state()
    path = save(tmp_path, model, opt, step=1, position=5, logs=[{"step": 0, "loss": 1.0, "seconds": 0.1}])
    assert path == tmp_path / "step-1" and newest(tmp_path).position == 5
    torch.manual_seed(1)  # another random state, undone by the load
    again = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    load(path, again, opt2)
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n
    for p, q in zip(model.parameters(), again.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    with pytest.raises(UserError, match=r"another model \('0.bias' is \(3,\) float32 there, \(5,\) float32 here\)"):
        load(path, other, torch.optim.AdamW(other.parameters()))
