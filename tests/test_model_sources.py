"""Models from anywhere (`meshpilot.models.sources`): hf:<name> built from its config without weights, a user's
package.module:factory, each planned through the CLI in-process; every mistake as one line with exit code 2;
--precision stored in the plan; train's device choice (no GPU needed: torch.cuda is monkeypatched, NCCL never
started); and a real `train` of a tiny hf:gpt2 on 2 gloo ranks whose losses equal the single device's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from meshpilot.cli.main import main
from meshpilot.cluster import load_cluster
from meshpilot.errors import UserError
from meshpilot.planner.plan import Plan, StagePlan

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "gpt2": [
        "n_layer=2",
        "n_embd=32",
        "n_head=4",
        "n_positions=32",
        "vocab_size=64",
        "bos_token_id=0",
        "eos_token_id=0",
    ],
    "llama": [
        "num_hidden_layers=2",
        "hidden_size=32",
        "intermediate_size=64",
        "num_attention_heads=4",
        "num_key_value_heads=2",
        "max_position_embeddings=32",
        "vocab_size=64",
        "bos_token_id=0",
        "eos_token_id=0",
    ],
    "bert": [
        "num_hidden_layers=2",
        "hidden_size=32",
        "intermediate_size=64",
        "num_attention_heads=4",
        "max_position_embeddings=32",
        "vocab_size=64",
    ],
    "t5": [
        "num_layers=2",
        "d_model=32",
        "d_ff=64",
        "num_heads=4",
        "d_kv=8",
        "vocab_size=64",
        "decoder_start_token_id=0",
    ],
}
PLAN = ["-c", "atp-ic3", "-n", "2", "--mesh", "2x1", "--time-limit", "10"]


def _plan_json(capsys, args: list[str]) -> StagePlan:
    assert main(["plan", *args, *PLAN, "--json"]) == 0, capsys.readouterr().err
    return StagePlan.from_json(capsys.readouterr().out)


def _one_line_error(capsys, args: list[str], *needles: str, command: str = "plan") -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"meshpilot {command}: error: "), err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("name", list(TINY))
def test_hf_model_plans_from_the_cli_without_fallback(capsys, name):
    plan = _plan_json(capsys, ["--model", f"hf:{name}", "--hf-config", *TINY[name], "--batch", "4", "--seq", "8"])
    assert not plan.fallbacks, [f.line() for f in plan.fallbacks][:3]
    assert not [w for w in plan.warnings if "replicated" in w or "fallback" in w], plan.warnings
    assert [tuple(s) for s, _ in plan.input_shapes] == [(4, 8), (4, 8)]
    assert plan.precision == "fp32"


def test_hf_builder_keeps_the_library_defaults_plus_overrides():
    from meshpilot.models.sources import build_model, parse_value

    built = build_model("hf:llama", hf_config=["num_hidden_layers=2", "hidden_size=64", "tie_word_embeddings=true"])
    cfg = built.model.model.config
    assert type(built.model.model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.tie_word_embeddings) == (2, 64, True)
    assert cfg.vocab_size == 32000 and cfg.num_attention_heads == 32  # the library's defaults, not tiny ones
    assert next(built.model.parameters()).device.type == "meta"
    assert [parse_value(v) for v in ("3", "0.5", "False", "null", "gelu", "[1, 2]")] == [
        3,
        0.5,
        False,
        None,
        "gelu",
        [1, 2],
    ]
    bert = build_model("hf:bert", hf_config=TINY["bert"])
    assert type(bert.model.model).__name__ == "BertForMaskedLM"
    moe = build_model("hf:mixtral", hf_config=["num_hidden_layers=1", "hidden_size=32", "num_local_experts=4"])
    assert "MixtralForCausalLM, experts meshpilot" in moe.label  # dropless experts as one op (ops/moe.py)
    kept = build_model("hf:mixtral", hf_config=["num_hidden_layers=1", "experts_implementation=batched_mm"])
    assert "MixtralForCausalLM, experts batched_mm" in kept.label  # transformers' static path on request
    roberta = build_model("hf:roberta", hf_config=["num_hidden_layers=1"])  # any AutoConfig model type
    assert type(roberta.model.model).__name__ == "RobertaForMaskedLM"


def test_hf_config_from_a_json_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64}))
    from meshpilot.models.sources import build_model

    built = build_model("hf:gpt2", hf_config=[str(path), "n_positions=16"], device="meta")
    cfg = built.model.model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_positions) == (1, 32, 16)
    assert [tuple(x.shape) for x in built.inputs] == [(4, 16), (4, 16)]  # seq capped at the positions


FACTORY = """
import torch
from torch import nn
from types import SimpleNamespace

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)

def pair():
    return Net(), (torch.randn(8, 16), torch.randint(0, 8, (8,)))

def obj(device=None):
    assert device is not None
    return SimpleNamespace(model=Net(), inputs=[torch.randn(8, 16), torch.randint(0, 8, (8,))])

NOT_CALLABLE = 3

def wrong():
    return 3

def boom():
    raise RuntimeError("no data here")
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_models"


@pytest.mark.parametrize("fn", ["pair", "obj"])
def test_factory_plans(capsys, factory_module, fn):
    plan = _plan_json(capsys, ["--model", f"{factory_module}:{fn}"])
    assert not plan.fallbacks
    assert [tuple(s) for s, _ in plan.input_shapes] == [(8, 16), (8,)]


def test_errors_are_one_line(capsys, factory_module, monkeypatch):
    base = [*PLAN]
    _one_line_error(capsys, ["plan", "-m", "hf:nope", *base], "hf:nope", "model_type")
    _one_line_error(capsys, ["plan", "-m", "hf:gpt2", "--hf-config", "n_layerz=2", *base], "n_layerz", "GPT2Config")
    _one_line_error(capsys, ["plan", "-m", "hf:gpt2", "--hf-config", "no-equals", *base], "key=value")
    _one_line_error(capsys, ["plan", "-m", "no_such_module_xyz:build", *base], "cannot import", "PYTHONPATH")
    _one_line_error(capsys, ["plan", "-m", f"{factory_module}:missing", *base], "has no 'missing'")
    _one_line_error(capsys, ["plan", "-m", f"{factory_module}:NOT_CALLABLE", *base], "not callable", ".model")
    _one_line_error(capsys, ["plan", "-m", f"{factory_module}:wrong", *base], "returned a int", ".inputs")
    _one_line_error(capsys, ["plan", "-m", f"{factory_module}:boom", *base], "RuntimeError", "no data here")
    _one_line_error(capsys, ["plan", "-m", "mlp", "--hf-config", "a=1", *base], "only for hf:")
    _one_line_error(capsys, ["plan", "-m", "hf:gpt2", "--layers", "2", *base], "--hf-config")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    _one_line_error(capsys, ["plan", "-m", "hf:gpt2", *base], "install meshpilot[hf]")


def test_precision_is_stored_in_the_plan(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "-m", "mlp", *PLAN, "--precision", "bf16-mixed", "--out", str(out), "--ops", "none"]) == 0
    assert json.loads(out.read_text())["stages"][0]["plan"]["precision"] == "bf16-mixed"  # the stage plan says
    assert Plan.load(out).precision == "bf16-mixed"
    capsys.readouterr()
    plan = _plan_json(capsys, ["-m", "mlp", "--precision", "bf16"])
    assert plan.precision == "bf16"
    plan = _plan_json(capsys, ["-m", "mlp", "--precision", "fp16"])  # the float32 model traced in float16
    assert plan.precision == "fp16" and plan.peak_flops == load_cluster("atp-ic3").device.flops_for("float16")
    # a float16 model (Alpa's rows are) plans as it is: once refused as "precision 'float16'"
    assert _plan_json(capsys, ["-m", "gpt-tiny", "--dtype", "float16"]).precision == "fp16"


def test_train_device_choice(monkeypatch):
    from meshpilot.cli.train import choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device("auto", 0) == (torch.device("cpu"), "gloo")
    assert choose_device("cpu", 0) == (torch.device("cpu"), "gloo")
    with pytest.raises(UserError, match="no CUDA device"):
        choose_device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert choose_device("auto", 3) == (torch.device("cuda", 3), "nccl")
    assert choose_device("cuda", 7) == (torch.device("cuda", 7), "nccl")
    assert choose_device("cpu", 3) == (torch.device("cpu"), "gloo")
    with pytest.raises(UserError, match="8 CUDA device"):
        choose_device("auto", 8)


def test_train_starts_nccl_on_cuda_local_rank(monkeypatch):
    """train --device auto on a (pretend) GPU node: set_device(cuda:LOCAL_RANK) then an NCCL group."""
    import torch.distributed as dist

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(backend=None, **kw):
        seen["backend"] = backend
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("device", torch.device(d)))
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for k, v in env.items():  # what torchrun sets
        monkeypatch.setenv(k, v)
    with pytest.raises(Stop):
        main(["train", "--model", "gpt-tiny", "--mesh", "2x2", "--steps", "1"])
    assert seen == {"device": torch.device("cuda", 2), "backend": "nccl"}


def test_train_needs_a_plan_for_non_gpt_models(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _one_line_error(capsys, ["train", "-m", "hf:gpt2"], "--plan", command="train")


@pytest.mark.dist
def test_train_hf_gpt2_on_two_gloo_ranks_equals_single_device(tmp_path, capsys):
    from meshpilot.models.sources import build_model
    from meshpilot.runtime.train import train_model

    cfg = TINY["gpt2"]
    plan_path, out = tmp_path / "plan.json", tmp_path / "losses.json"
    args = ["plan", "-m", "hf:gpt2", "--hf-config", *cfg, "--batch", "4", "--seq", "8", *PLAN, "--ops", "none"]
    args += ["--schedule", "accumulate", "--microbatches", "2"]  # train runs the plan's 2 x 2 rows of the batch of 4
    assert main([*args, "--out", str(plan_path)]) == 0
    capsys.readouterr()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "meshpilot.cli.main", "train", "--plan", str(plan_path), "-m", "hf:gpt2", "--hf-config", *cfg]
    cmd += ["--steps", "3", "--device", "cpu", "--json-out", str(out), "--verify", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(x.startswith("step ") for x in proc.stdout.splitlines()) == 3, proc.stdout
    # the progress line: the plan's predicted step beside the measured one, throughput of the 4 x 8 tokens, MFU
    last = [x for x in proc.stdout.splitlines() if x.startswith("step 2:")][0]
    assert " ms; plan " in last and " on atp-ic3" in last and " tok/s | MFU " in last and "3/3 ██████████" in last
    assert "verify: the first 2 steps' losses equal one device's (2 microbatches accumulated)" in proc.stdout, (
        proc.stdout
    )
    got = json.loads(out.read_text())
    assert (got["device"], got["backend"], got["mesh"]) == ("cpu", "gloo", [2, 1])
    single = train_model(lambda d: build_model("hf:gpt2", hf_config=cfg, batch=4, seq=8, device=d), 3, microbatches=2)
    for s, ref in zip(got["steps"], single):
        assert abs(s["loss"] - ref.loss) <= 1e-5, (s, ref)


def test_verify_fails_in_one_line_when_a_loss_differs_from_one_device(capsys):
    """--verify's comparison (no process group needed): losses one device reproduces pass, one that is off by
    1e-3 at step 1 fails with the step named; bf16 runs are refused before anything starts."""
    import argparse

    from meshpilot.cli.train import _verify
    from meshpilot.models import gpt_config
    from meshpilot.runtime.train import train_single

    cfg = gpt_config("gpt-tiny")
    args = argparse.Namespace(verify=2, seed=0, lr=1e-3, precision=None)
    good = [{"loss": s.loss} for s in train_single(cfg, 2)]
    assert _verify(args, good, cfg=cfg, plan=None, build=None, device="cpu", rank=0)
    assert "verify: the first 2 steps' losses equal one device's" in capsys.readouterr().out
    bad = [good[0], {"loss": good[1]["loss"] + 1e-3}]
    assert not _verify(args, bad, cfg=cfg, plan=None, build=None, device="cpu", rank=0)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("meshpilot train: error: --verify: step 1: loss "), err
    _one_line_error(
        capsys,
        ["train", "--nproc-per-node", "2", "--precision", "bf16", "--verify"],
        "--verify: a bf16 run",
        command="train",
    )


def test_plan_auto_is_made_once_and_handed_to_the_ranks(capsys):
    """--plan auto under --nproc-per-node: the launched ranks get the saved file instead of 'auto' and no
    --cluster; without --cluster, or --cluster without auto, one line each."""
    from pathlib import Path

    from meshpilot.cli.train import _with_plan

    argv = ["train", "--plan", "auto", "-c", "atp-ic3", "--steps", "2", "--cluster=x"]
    assert _with_plan(argv, Path("/t/p.json")) == ["train", "--plan", "/t/p.json", "--steps", "2"]
    assert _with_plan(["train", "--plan=auto"], Path("p.json")) == ["train", "--plan=p.json"]
    _one_line_error(capsys, ["train", "--nproc-per-node", "2", "--plan", "auto"], "give --cluster C", command="train")
    _one_line_error(
        capsys, ["train", "--nproc-per-node", "2", "-c", "atp-ic3"], "only with --plan auto", command="train"
    )


def test_builtin_weights_follow_the_seed():
    """`--seed` reaches the built-in models as it reaches HF's and a factory's: the same seed builds the same
    weights whatever the global RNG did before, another seed other weights."""
    from meshpilot.models.sources import build_model

    first = build_model("gpt-tiny", device="cpu", seed=1).model
    torch.rand(5)  # the global stream moves on
    again = build_model("gpt-tiny", device="cpu", seed=1).model
    other = build_model("gpt-tiny", device="cpu", seed=2).model
    for a, b in zip(first.parameters(), again.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))
