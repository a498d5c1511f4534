"""`meshpilot train`: a few real training steps under torchrun: any `meshpilot plan` model with a saved plan
(run by `meshpilot.parallelize`), or a built-in GPT with ATP's layers on a given mesh.

Launch with torchrun, e.g.:
  torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train --model gpt-tiny --mesh 2x2 --steps 5
  meshpilot plan --model gpt-tiny --cluster atp-ic3 --devices 4 --out plan.json
  torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train --model gpt-tiny --plan plan.json
or let `meshpilot train --nproc-per-node 4 ...` launch torchrun after checking every input: a mistake is then
one line and exit 2. Under a bare torchrun rank 0 says it first, then torchrun adds its own ChildFailedError
traceback and exits 1 (it does so for any failed rank).

With --plan the batch size and sequence length come from the plan (the shapes it was made for; --batch and
--seq, when given, must match them; without --plan they size the GPT, with --plan auto the plan); --model and
its --layers/--hidden/--heads (or --hf-config) must describe the model the plan was made for (its graph
fingerprint is checked). Any `meshpilot plan` model trains with a plan: hf:<name>, package.module:factory
or a built-in; without --plan only the built-in GPTs train (ATP's layers on --mesh):
  meshpilot plan --model hf:gpt2 --hf-config n_layer=2 n_embd=64 n_head=4 --seq 32 -c atp-ic3 -n 2 --out p.json
  torchrun --standalone --nproc-per-node 2 -m meshpilot.cli.main train --plan p.json --model hf:gpt2 \
      --hf-config n_layer=2 n_embd=64 n_head=4

A pipeline plan (`meshpilot plan --pipeline --out pp.json`) of any model trains the same way, on its stages'
submeshes (meshpilot.runtime.pipeline; each stage its own intra-operator plan, which `plan --pipeline` saves
with it; a plan without them runs a data-parallel plan on every stage): the plan's batch, cut into its
microbatches; checkpoints as below (a pipeline's resume under another pipeline or a one-stage plan, and back);
no dropout (its stages would draw random numbers in another order):
  meshpilot train --nproc-per-node 4 --model gpt-tiny --layers 4 --plan pp.json --steps 3 --verify 3
  meshpilot plan --pipeline --model hf:llama --hf-config num_hidden_layers=4 hidden_size=64 \
      intermediate_size=128 num_attention_heads=4 num_key_value_heads=2 --batch 8 --seq 16 -c atp-ic3 -n 4 \
      --stages 2 --out pp.json
  meshpilot train --nproc-per-node 4 --model hf:llama --hf-config num_hidden_layers=4 hidden_size=64 \
      intermediate_size=128 num_attention_heads=4 num_key_value_heads=2 --plan pp.json --steps 3 --verify 3

Checkpoints (with --plan): --checkpoint-dir DIR saves the model, AdamW's state, the step, the data position
and the random state through torch.distributed.checkpoint every --checkpoint-every N steps, after the last
step, and on SIGTERM (then the run stops); --resume continues from the newest complete checkpoint in DIR,
under this run's plan, mesh and world size, whatever they were at the save:
  meshpilot train --nproc-per-node 8 --plan p8.json --steps 100 --checkpoint-dir ck --checkpoint-every 10
  meshpilot train --nproc-per-node 4 --plan p4.json --steps 200 --checkpoint-dir ck --resume
Under torchrun --max-restarts, a restarted run resumes from the newest checkpoint by itself.

--device auto (default) runs rank r on cuda:LOCAL_RANK with NCCL when torch sees a GPU, else on the CPU with
gloo. --precision fp32 | bf16 / fp16 (the model cast to bfloat16 / float16) | bf16-mixed (fp32 master
weights, bfloat16 autocast); with --plan the plan's precision is used (`meshpilot plan --precision`) and must
match.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace
from pathlib import Path

from meshpilot.cli.common import add_hf_config_arg, path_arg, positive_float, positive_int
from meshpilot.cli.main import COMMANDS
from meshpilot.cli.plan import PRECISIONS
from meshpilot.errors import UserError
from meshpilot.graph.capture import Precision
from meshpilot.io import atomic_write, check_writable

LAUNCHED_ENV = "MESHPILOT_LAUNCHED"
"""Set by ``meshpilot.cli.launcher`` in the ranks it starts: every rank may report a user error itself."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help=COMMANDS["train"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_args(p)
    _plan_args(p)
    _run_args(p)
    _checkpoint_args(p)
    _launch_args(p)
    p.set_defaults(func=run)


def _model_args(p: argparse.ArgumentParser) -> None:
    """What is trained: the model, its sizes and the batch."""
    g = p.add_argument_group("model and batch")
    g.add_argument(
        "--model",
        "-m",
        default="gpt-tiny",
        help="built-in GPT (default gpt-tiny; see `meshpilot presets`); with --plan also any `meshpilot plan` "
        "model: hf:<name>, package.module:factory, a built-in",
    )
    add_hf_config_arg(g, "hf:<name> models: the config overrides given to `meshpilot plan` (repeatable)")
    g.add_argument("--layers", type=positive_int, help="override the GPT's layer count")
    g.add_argument("--hidden", type=positive_int, help="override the GPT's hidden size")
    g.add_argument("--heads", type=positive_int, help="override the GPT's attention heads")
    g.add_argument(
        "--batch",
        "-b",
        type=positive_int,
        help="global batch size: with --plan FILE the plan's (read from it; given here, it must match), with "
        "--plan auto the one to plan for, without --plan the GPT's",
    )
    g.add_argument("--seq", "-s", type=positive_int, help="sequence length, as --batch")


def _plan_args(p: argparse.ArgumentParser) -> None:
    """How it is split: a saved or automatic plan, or ATP on a mesh."""
    g = p.add_argument_group("plan")
    g.add_argument("--mesh", default=None, help="ATP DeviceMesh d1xd2 (default: WORLDx1, Megatron-LM 1D)")
    g.add_argument("--chunks", type=int, default=1, choices=(1, 2, 4), help="ATP chunk-overlap chunks k")
    g.add_argument(
        "--plan",
        type=path_arg,
        metavar="FILE|auto",
        help="run this saved plan (`meshpilot plan --out FILE`) with meshpilot.parallelize instead of ATP, or a "
        "pipeline plan (`meshpilot plan --pipeline --out FILE`); 'auto': "
        "plan the model for the world size on --cluster first (once, in the launcher with --nproc-per-node; under "
        "bare torchrun on every rank, rank 0's plan trained where they differ), saved in --checkpoint-dir/plan.json "
        "or a temporary file",
    )
    g.add_argument(
        "--cluster",
        "-c",
        metavar="C",
        help="with --plan auto: the cluster to plan for (a preset, a TOML file, `meshpilot probe`'s output)",
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    """The training loop: steps, seed, data, optimizer, what is written."""
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, default=5, help="optimizer steps (default 5)")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    g.add_argument(
        "--data",
        type=path_arg,
        metavar="FILE",
        help="train on this text file as byte tokens (0-255; the model needs a vocabulary of 256 or more): "
        "windows drawn by the seed, resumable at any data position (default: random tokens)",
    )
    g.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    g.add_argument(
        "--json-out",
        type=path_arg,
        help="rank 0 writes the per-step losses and times here as JSON, rewritten (atomically) after every step",
    )


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Saving and resuming."""
    g = p.add_argument_group("checkpoints")
    g.add_argument(
        "--checkpoint-dir",
        type=path_arg,
        metavar="DIR",
        help="save checkpoints in DIR/step-N (with --plan): every --checkpoint-every steps, after the last, on SIGTERM",
    )
    g.add_argument(
        "--checkpoint-every",
        type=positive_int,
        metavar="N",
        help="save a checkpoint every N steps (default: only after the last step and on SIGTERM)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint-dir (any plan, mesh or world size); "
        "--steps counts from the start of the run",
    )


def _launch_args(p: argparse.ArgumentParser) -> None:
    """Where and how the ranks run, and the check against one device."""
    g = p.add_argument_group("launch and checks")
    g.add_argument(
        "--nproc-per-node",
        type=positive_int,
        metavar="N",
        help="launch N local ranks itself (torch.distributed.run) after checking every input: mistakes end in one line",
    )
    g.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="a collective of the steps that waits longer than S seconds (a stalled rank) ends the run, naming the "
        "ranks; the start and the first step wait up to max(S, 600) seconds",
    )
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): cuda:LOCAL_RANK with NCCL when torch.cuda.is_available(), else the CPU with gloo",
    )
    g.add_argument(
        "--verify",
        type=positive_int,
        nargs="?",
        const=VERIFY_STEPS,
        metavar="N",
        help=f"after training, run the first N steps (default {VERIFY_STEPS}) of the same model on one device and "
        f"check that every loss equals this run's within {VERIFY_TOL:g} (x |loss| above 1); exit 1 if not. Every rank "
        "runs the reference on its own device, so the model must fit one; fp32 only",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="fp32, bf16 / fp16 (model cast to bfloat16 / float16) or bf16-mixed (fp32 master weights under "
        "bfloat16 autocast); with --plan: the plan's (must match if given)",
    )


VERIFY_STEPS = 3
VERIFY_TOL = 1e-5
"""--verify: the bar every runtime test holds a plan to (the single device's loss within 1e-5)."""


def parse_mesh(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--mesh {text!r}: not a mesh shape; write two positive sizes as d1xd2, e.g. 2x2")
    return int(parts[0]), int(parts[1])


def load_plan(path: Path):
    """A saved Plan (the one format, or an older one-stage or pipeline file), or a one-line UserError saying
    what is wrong with the file (and which key)."""
    from meshpilot.planner.plan import Plan

    if not path.is_file() and not path.is_dir():
        raise UserError(f"--plan {path}: no such file; write one with `meshpilot plan ... --out {path}`")
    try:
        return Plan.load(path)
    except UserError as e:
        raise UserError(f"--plan {e}") from None


def choose_device(requested: str, local_rank: int):
    """(torch.device, process-group backend) for --device: cuda:LOCAL_RANK and NCCL, or the CPU and gloo."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {requested!r}: choose auto, cpu or cuda")
    has_cuda = requested != "cpu" and torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise UserError(
            "--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); use --device cpu, "
            "or install a CUDA build of torch"
        )
    if not has_cuda:
        return torch.device("cpu"), "gloo"
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(
            f"LOCAL_RANK {local_rank}: this node has {count} CUDA device(s); start at most {count} processes per "
            "node (torchrun --nproc-per-node)"
        )
    return torch.device("cuda", local_rank), "nccl"


def _is_gpt(name: str) -> bool:
    from meshpilot.models import builtin_models
    from meshpilot.models.sources import kind

    if kind(name) != "builtin":
        return False
    entry = builtin_models().get(name)
    return name == "gpt" or (entry is not None and entry.config is not None)


def _world() -> tuple[int, int]:
    """WORLD_SIZE and RANK from torchrun's environment, checked."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "train runs under torchrun (or give --nproc-per-node N to launch it); e.g. "
            "torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train"
        )
    values = []
    for key in ("WORLD_SIZE", "RANK"):
        text = os.environ[key]
        if not text.strip().isdigit():
            raise UserError(f"environment {key}={text!r}: must be a whole number; launch with torchrun")
        values.append(int(text))
    world, rank = values
    if world < 1 or rank >= world:
        raise UserError(
            f"environment WORLD_SIZE={world}, RANK={rank}: need 0 <= RANK < WORLD_SIZE; launch with torchrun"
        )
    return world, rank


def prepare(args: argparse.Namespace, world: int) -> dict:
    """Every check that needs no process group: the flags, the plan (version, mesh, ranks, placements, world
    size, precision, and the model's graph fingerprint), the output path. Returns _train's keyword arguments."""
    if args.json_out:
        check_writable(args.json_out, "--json-out")
    if args.plan is not None and str(args.plan) == AUTO:
        args.plan = _auto_plan(args, world)
        args.auto_planned = True
    elif args.cluster is not None:
        raise UserError("--cluster: only with --plan auto (a saved plan knows its cluster); leave it out")
    resume = check_checkpoint_flags(args)
    prep = _prepare_model(args, world)
    if args.data is not None:
        prep["data"] = _text_data(args, prep)
    if args.verify:
        precision = (prep["plan"].precision or None) if "plan" in prep else args.precision
        if precision in (Precision.BF16, Precision.FP16, Precision.BF16_MIXED):
            raise UserError(
                f"--verify: a {precision} run rounds differently on every layout, so its losses cannot equal one "
                f"device's to 1e-5; verify the plan in fp32 (`meshpilot plan --precision fp32`), then train in "
                f"{precision}"
            )
    if args.checkpoint_dir is not None:
        if "plan" not in prep:
            raise UserError(
                "--checkpoint-dir: checkpoints are for runs with --plan (ATP's layers without a plan are not "
                f"saved); make one with `meshpilot plan --model {args.model} ... --out plan.json`"
            )
        prep["resume"] = resume
    return prep


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun in its workers: above 0 in a run torchrun restarted (``--max-restarts``) after a failure."""


def check_checkpoint_flags(args: argparse.Namespace):
    """The checkpoint flags, checked: returns the checkpoint to resume from (None for a fresh start)."""
    from meshpilot.runtime.checkpoint import newest

    directory = args.checkpoint_dir
    if directory is None:
        given = [f for f, v in (("--checkpoint-every", args.checkpoint_every), ("--resume", args.resume)) if v]
        if given:
            raise UserError(
                f"{', '.join(given)}: needs --checkpoint-dir DIR (where the checkpoints are); add it or drop {given[0]}"
            )
        return None
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--checkpoint-dir {directory}: is a file; give a folder (it is created if missing)")
    parent = directory if directory.is_dir() else directory.parent if str(directory.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"--checkpoint-dir {directory}: folder {parent} does not exist; create it (mkdir -p) first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--checkpoint-dir {directory}: {parent} is not writable; save elsewhere or fix permissions")
    found = newest(directory)
    restarted = os.environ.get(RESTART_ENV, "0").strip() not in ("", "0")
    if not args.resume and not restarted:
        if found is not None:
            raise UserError(
                f"--checkpoint-dir {directory}: already holds checkpoints (newest {found.path.name}); pass --resume "
                "to continue from it, or give an empty folder"
            )
        return None
    if found is None:
        if restarted and not args.resume:
            return None  # torchrun restarted the run before its first save: a fresh start
        unfinished = sorted(p.name for p in directory.glob("step-*.tmp")) if directory.is_dir() else []
        extra = f" (only unfinished saves: {', '.join(unfinished)})" if unfinished else ""
        raise UserError(f"--resume: no complete checkpoint in {directory}{extra}; train without --resume to start one")
    if found.step >= args.steps:
        raise UserError(
            f"--resume: the newest checkpoint {found.path} is after step {found.step} and --steps is {args.steps} "
            "(steps count from the start of the run); give --steps above it"
        )
    for flag, key, value in (("--seed", "seed", args.seed), ("--lr", "lr", args.lr)):
        saved = found.manifest.get(key)
        if saved is not None and saved != value:
            raise UserError(
                f"{flag} {value:g}: the checkpoint {found.path} was trained with {flag} {saved:g} (the data order "
                f"and AdamW's state follow it); give {flag} {saved:g} or start a new --checkpoint-dir"
            )
    return found


AUTO = "auto"


def _auto_plan(args: argparse.Namespace, world: int) -> Path:
    """--plan auto: plan the model for `world` devices of --cluster now and save the plan (--checkpoint-dir's
    plan.json, else a temporary file); the run then trains with that file like any saved plan."""
    import tempfile

    from meshpilot.cli.plan import make_plan, save_plan
    from meshpilot.cluster import load_cluster
    from meshpilot.models.sources import build_model

    if args.cluster is None:
        raise UserError(
            "--plan auto: give --cluster C to plan for (a preset such as dgx-h100, a cluster file, or the file "
            "`meshpilot probe` wrote for these machines)"
        )
    if args.mesh or args.chunks != 1:
        raise UserError("--plan auto chooses the mesh and every layout; leave out --mesh and --chunks")
    cluster = load_cluster(args.cluster)
    built = build_model(
        args.model, batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
        hf_config=args.hf_config,
    )  # fmt: skip
    # tests: one rank plans on a mesh of its own (MESHPILOT_TEST_PLAN_MESH=RANK:AxB), as a rank whose solve
    # stopped at its time limit may end elsewhere: the ranks then train rank 0's plan (``_agree_on_rank0_plan``)
    test_rank, _, test_mesh = os.environ.get("MESHPILOT_TEST_PLAN_MESH", "").partition(":")
    shape = parse_mesh(test_mesh) if test_mesh and os.environ.get("RANK") == test_rank else None
    plan, _ = make_plan(built, cluster, world, shape, precision=args.precision)
    shared = None
    if args.checkpoint_dir is not None:
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        shared = args.checkpoint_dir / "plan.json"
    if shared is not None and "RANK" not in os.environ:  # the launcher (--nproc-per-node): it alone plans
        path = shared
    else:
        # under torchrun every rank plans: each trains the file it wrote itself (a shared --checkpoint-dir's
        # plan.json may hold another rank's by the time it reads it) until _agree_on_rank0_plan, which writes
        # rank 0's to --checkpoint-dir
        fd, name = tempfile.mkstemp(prefix="meshpilot-plan-", suffix=".json")
        os.close(fd)
        path = Path(name)
        args.agreed_plan_path = shared
    save_plan(plan, path, "--plan auto")
    if os.environ.get("RANK", "0") == "0":
        print(f"--plan auto: {plan.summary().splitlines()[0]}; saved to {shared or path}", flush=True)
    return path


def _with_plan(argv: list[str], path: Path) -> list[str]:
    """`argv` with ``--plan auto`` replaced by ``--plan path`` and ``--cluster`` dropped: the launched ranks train
    with the plan made once, in the launcher."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--cluster", "-c"):
            skip = True
        elif a.startswith("--cluster="):
            continue
        elif out and out[-1] == "--plan" and a == AUTO:
            out.append(str(path))
        elif a == f"--plan={AUTO}":
            out.append(f"--plan={path}")
        else:
            out.append(a)
    return out


def _text_data(args: argparse.Namespace, prep: dict):
    """--data, read and checked against the model: a token model (a GPT, hf:<name>) with 256 tokens or more."""
    import torch

    from meshpilot.runtime.data import ByteText

    text = ByteText(args.data)
    if "cfg" in prep:  # a built-in GPT, with or without a plan
        text.check(prep["cfg"].vocab, prep["cfg"].seq + 1)
        return text
    meta = prep["build"]("meta")
    vocab = getattr(getattr(meta.model, "config", None), "vocab_size", None)
    ids = meta.inputs[0] if meta.inputs else None
    if vocab is None or ids is None or ids.dim() != 2 or ids.dtype != torch.long:
        raise UserError(
            f"--data: {args.model} does not read token ids [batch, seq] with a vocab_size; --data is for token "
            "models (built-in GPTs, hf:<name>): leave it out to train on the model's own example inputs"
        )
    text.check(int(vocab), int(ids.shape[1]))
    return text


def _prepare_model(args: argparse.Namespace, world: int) -> dict:
    if not _is_gpt(args.model):
        return _prepare_any(args, world)
    if args.hf_config:
        raise UserError(f"--hf-config: only for hf:<name> models, not {args.model!r}; drop --hf-config")
    from meshpilot.models import gpt_config

    cfg = gpt_config(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads)
    if args.plan is not None:
        if args.mesh or args.chunks != 1:
            raise UserError("--plan fixes the mesh and every layout; leave out --mesh and --chunks")
        return _prepare_gpt_plan(args, load_plan(args.plan), cfg, world)
    if args.precision == "bf16-mixed":
        raise UserError(
            "--precision bf16-mixed: ATP's layers do not run under autocast; plan it (`meshpilot plan --model "
            f"{args.model} --precision bf16-mixed --out plan.json`) and train with --plan plan.json"
        )
    cfg = _sized(cfg, args)
    shape = parse_mesh(args.mesh) if args.mesh else (world, 1)
    if world % (shape[0] * shape[1]):
        raise UserError(
            f"--mesh {args.mesh}: {shape[0] * shape[1]} devices do not divide the world size {world}; "
            "give a mesh whose size divides it"
        )
    if cfg.batch % (world // (shape[0] * shape[1]) * args.chunks):
        raise UserError(
            f"batch {cfg.batch} does not split into data-parallel replicas x {args.chunks} chunks; "
            "change --mesh or --chunks"
        )
    return {"shape": shape, "cfg": cfg}


def _sized(cfg, args: argparse.Namespace):
    """The GPT `cfg` at --batch / --seq where given (a run with no plan to read them from)."""
    return replace(cfg, batch=args.batch or cfg.batch, seq=args.seq or cfg.seq)


def check_sizes(args: argparse.Namespace, batch: int | None, seq: int | None, source: str) -> None:
    """--batch / --seq given with a saved plan: the sizes it was made for (`batch`, `seq`; None: the model's
    inputs have no such size), or one line."""
    for flag, given, planned in (("--batch", args.batch, batch), ("--seq", args.seq, seq)):
        if given is None or given == planned:
            continue
        if planned is None:
            raise UserError(f"{flag} {given}: {args.model!r} takes its input shapes from itself; leave {flag} out")
        raise UserError(
            f"{flag} {given}: {source} was made for {planned}; leave {flag} out (train reads it from the plan) or plan "
            f"again with {flag} {given}"
        )


def _plan_info(plan) -> dict:
    """A plan's stages (ranks, mesh) for the run's JSON and a checkpoint's manifest; a one-stage plan's mesh too."""
    out: dict = {"stages": [{"ranks": list(s.ranks), "mesh": list(s.mesh_shape)} for s in plan.stages]}
    if plan.is_single:
        out["mesh"] = list(plan.only.mesh_shape)
    return out


def _step_items(cfg, graph, microbatches: int) -> int:
    """Tokens one step of a plan trains when its stage plans do not say (``Throughput.of_plan``): the GPT's
    batch × sequence, or for any other model the plan's microbatches × the first input's elements at one
    microbatch (`graph`'s capture)."""
    if cfg is not None:
        return cfg.batch * cfg.seq
    first = graph.input_infos[0] if graph is not None and graph.input_infos else None
    return math.prod(first.shape) * microbatches if first is not None else 0


def _prepare_gpt_plan(args: argparse.Namespace, plan, cfg, world: int) -> dict:
    """A saved plan, one stage or a pipeline, for the GPT `cfg`: the world, the precision, the batch, and the
    plan checked (``planner.validate.validate``) against the GPT captured on meta tensors at one microbatch."""
    import torch

    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT
    from meshpilot.planner.validate import validate

    source = f"--plan {args.plan}"
    _check_run(args, plan, world)
    M = plan.microbatches
    shapes = [tuple(s) for s, _ in plan.input_shapes]  # one microbatch's, as planned (a pipeline's first stage
    shapes = shapes if plan.is_single else shapes[:1]  # reads the token ids and values sent back to it)
    if shapes and (len(shapes) != (2 if plan.is_single else 1) or any(len(s) != 2 for s in shapes)):
        raise UserError(
            f"{source}: input_shapes {shapes}: train runs GPTs, whose inputs are two [batch, seq] token tensors; "
            "give a plan made for a GPT (`meshpilot plan --model gpt-tiny ...`)"
        )
    if shapes:
        (b, t) = shapes[0]
        cfg = replace(cfg, batch=int(b) * M, seq=int(t))
        check_sizes(args, cfg.batch, cfg.seq, source)
    else:  # a pipeline without its stages' plans (data-parallel stages) runs the GPT at its own sizes
        cfg = _sized(cfg, args)
    if cfg.batch % M:
        raise UserError(
            f"{source}: the model's batch {cfg.batch} does not split into the plan's {M} microbatches; "
            f"plan again for --model {args.model} (its batch is {cfg.batch})"
        )
    _check_data_parallel_stages(plan, cfg.batch // M, source)
    with torch.device("meta"):
        model = GPT(replace(cfg, batch=cfg.batch // M))
    idx = torch.empty(cfg.batch // M, cfg.seq, dtype=torch.long, device="meta")
    graph = capture(model, (idx, idx), precision=plan.precision or None)
    validate(plan, world_size=world, graph=graph, source=source)
    return {"plan": plan, "graph": graph, "cfg": cfg}


def _check_data_parallel_stages(plan, rows: int, source: str) -> None:
    """A pipeline without its stages' plans runs each stage data parallel, cutting each microbatch of `rows`
    rows over the stage's ranks: one line when they do not divide it."""
    odd = sorted({len(st.ranks) for st in plan.stages if rows % len(st.ranks)})
    if not plan.intra and odd:
        raise UserError(
            f"{source}: holds no stage plans, so every stage runs data parallel, cutting each microbatch of "
            f"{rows} rows over its ranks; stages of {odd} ranks do not divide it: save the plan again with "
            "`meshpilot plan --pipeline --out` (which saves each stage's own plan) or plan for a batch divisible by "
            "the microbatches x each stage's ranks"
        )


def _check_run(args: argparse.Namespace, plan, world: int) -> None:
    """What a plan's run needs of the command line, whatever the model: the plan itself checked with the world
    size (``validate`` without the model), the plan's precision."""
    from meshpilot.planner.validate import validate

    validate(plan, world_size=world, source=f"--plan {args.plan}")  # before any model is built or captured
    planned = plan.precision or "fp32"
    if args.precision and args.precision != planned:
        raise UserError(
            f"--precision {args.precision}: the plan {args.plan} was made for {planned}; re-plan with "
            f"`meshpilot plan ... --precision {args.precision}` or leave --precision out"
        )


def _prepare_any(args: argparse.Namespace, world: int) -> dict:
    """Any `meshpilot plan` model (hf:<name>, a factory, a built-in) with a saved plan: the model is built and
    captured on the meta device at the plan's input shapes and checked against the plan."""
    from meshpilot.graph.capture import capture
    from meshpilot.models.sources import build_model, kind
    from meshpilot.planner.auto import microbatch_inputs
    from meshpilot.planner.validate import validate

    if args.plan is None:
        raise UserError(
            f"--model {args.model}: without --plan only the built-in GPTs train (ATP); make a plan with "
            f"`meshpilot plan --model {args.model} ... --out plan.json` and pass --plan plan.json"
        )
    if args.mesh or args.chunks != 1:
        raise UserError("--plan fixes the mesh and every layout; leave out --mesh and --chunks")
    given = [f"--{k}" for k in ("layers", "hidden", "heads") if getattr(args, k)]
    if given:
        raise UserError(f"{', '.join(given)}: only for built-in GPTs, not {args.model!r}; drop {given[0]}")
    plan = load_plan(args.plan)
    source = f"--plan {args.plan}"
    _check_run(args, plan, world)
    shape0 = plan.input_shapes[0][0] if plan.input_shapes else ()  # one microbatch's (none: the model's sizes)
    m = plan.microbatches
    sizes: dict = {}
    if kind(args.model) == "hf" and len(shape0) == 2:
        sizes = {"batch": int(shape0[0]) * m, "seq": int(shape0[1])}
    elif kind(args.model) == "builtin" and shape0:
        sizes = {"batch": int(shape0[0]) * m}
    check_sizes(args, sizes.get("batch"), sizes.get("seq"), source)
    meta = build_model(args.model, hf_config=args.hf_config, device="meta", **sizes)  # its mistakes: here
    graph = capture(meta.model, microbatch_inputs(meta.inputs, m), precision=plan.precision or None)
    validate(plan, world_size=world, graph=graph, source=source)

    def build(device):
        return build_model(args.model, hf_config=args.hf_config, device=device, seed=args.seed, **sizes)

    return {"plan": plan, "build": build, "graph": graph}


BARE_TORCHRUN_WAIT_S = 5.0
"""How long a rank other than 0 that refused its input waits, under bare torchrun, for the agent to stop it
before it says why itself (rank 0 had nothing to say)."""


def run(args: argparse.Namespace) -> int:
    if args.nproc_per_node:
        if "RANK" in os.environ:
            raise UserError("--nproc-per-node starts the ranks itself; leave it out under torchrun")
        prepare(args, args.nproc_per_node)
        from meshpilot.cli.launcher import launch

        argv = _without_nproc(getattr(args, "argv", None) or [])
        return launch(_with_plan(argv, args.plan) if args.plan is not None else argv, args.nproc_per_node)
    world, rank = _world()
    try:
        prep = prepare(args, world)
    except UserError as e:
        # a mistake every rank finds alike (a flag, a file): under our launcher each rank says it and the
        # launcher prints it once (no rank can be stopped before it speaks); under bare torchrun rank 0 says it
        # and the others wait: torchrun's agent stops them at rank 0's exit. A rank still running after the
        # wait found a mistake rank 0 did not (a capture of its own) and says it, naming itself
        if rank != 0 and os.environ.get(LAUNCHED_ENV) != "1":
            import time

            time.sleep(BARE_TORCHRUN_WAIT_S)
            raise UserError(f"rank {rank} of {world} (rank 0 went on): {e}") from None
        raise
    return _train(args, world, **prep)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def _train(
    args: argparse.Namespace,
    world: int,
    *,
    cfg=None,
    shape=None,
    plan=None,
    graph=None,
    build=None,
    resume=None,
    data=None,
) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    device, backend = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # --timeout bounds the steps' collectives; the start (rendezvous, plan exchange, meshes, the first step's
    # recording) waits up to START_TIMEOUT_S, since ranks reach it at their own pace on a loaded machine
    _init_group(backend, timedelta(seconds=max(args.timeout, START_TIMEOUT_S)) if args.timeout else None)
    rank = dist.get_rank()
    if _agree_on_rank0_plan(args, plan, rank):  # every rank now trains rank 0's plan: prepared again from it
        prep = prepare(args, world)
        cfg, shape, plan, graph, build = (prep.get(k) for k in ("cfg", "shape", "plan", "graph", "build"))
        resume, data = prep.get("resume"), prep.get("data")
    checkpoint = _checkpointing(args, plan, resume)
    done = [] if resume is None else [dict(d) for d in resume.logs]
    info = _run_info(args, plan, shape, resume, rank)
    info["device"], info["backend"] = device.type, backend

    def write_json(finished: bool) -> None:
        if rank == 0 and args.json_out:
            atomic_write(args.json_out, json.dumps({**info, "finished": finished, "steps": done}))

    rate = _throughput(args, plan, cfg, graph, rank)

    started = [False]

    def on_step(s) -> None:
        done.append(dict(s.__dict__))
        write_json(False)  # before the line: whoever reads the line finds the step in the file
        if rank == 0:
            print(rate.line(s.step, s.loss, s.seconds), flush=True)
        if not started[0] and args.timeout:  # every group now exists: the steps' own bound from here on
            started[0] = True
            _collective_timeout(timedelta(seconds=args.timeout))
            _test_stall(args.timeout, rank)

    run = dict(cfg=cfg, shape=shape, plan=plan, graph=graph, build=build, data=data, device=device, done=done)
    code = _run_steps(args, run, checkpoint, on_step, rank, write_json)
    if code != STOPPED_EXIT:
        dist.destroy_process_group()
    return code


def _agree_on_rank0_plan(args: argparse.Namespace, plan, rank: int) -> bool:
    """--plan auto under torchrun, where every rank planned for itself: every rank trains rank 0's plan, and
    ``--checkpoint-dir``'s plan.json (the file a resume reads) holds it. When the ranks' plans differ (a solve
    stopped by its wall-clock time limit on a loaded machine ends somewhere else), the others take rank 0's —
    each a whole, valid plan of the same model, so the run is exact either way. True when a rank's plan was
    replaced (it is then prepared again from the file); rank 0 says so."""
    import sys

    import torch.distributed as dist

    from meshpilot.io import atomic_write

    if not getattr(args, "auto_planned", False) or plan is None:
        return False
    args.auto_planned = False
    digests, text = [plan.run_digest()], [plan.to_json() if rank == 0 else None]
    if dist.get_world_size() > 1:
        mine, digests = digests[0], [None] * dist.get_world_size()
        dist.all_gather_object(digests, mine)
        dist.broadcast_object_list(text, src=0)
    differ = len(set(digests)) > 1
    shared = getattr(args, "agreed_plan_path", None)
    if shared is not None:  # every rank writes the same bytes: each node has the file, on a shared disk or not
        args.plan = shared
    if shared is not None or differ:
        atomic_write(args.plan, text[0])
    if not differ:
        return False
    args.cluster = None  # planned: a saved plan knows its cluster
    # plans differ only among several ranks: each says where its own differs from rank 0's
    mine, where = _where_plans_differ(plan, text[0]) if digests[rank] != digests[0] else None, [None] * len(digests)
    dist.all_gather_object(where, mine)
    if rank == 0:
        groups = {d: [r for r, x in enumerate(digests) if x == d] for d in dict.fromkeys(digests)}
        which = "; ".join(
            f"ranks {ranks} {d[:8]}" + (f" (first differs from rank 0's at {where[ranks[0]]})" if ranks[0] else "")
            for d, ranks in groups.items()
        )
        print(
            f"--plan auto: the ranks planned {len(groups)} different plans ({which}; a solve stopped by its time "
            "limit?); every rank trains rank 0's",
            file=sys.stderr,
            flush=True,
        )
    return True


def _where_plans_differ(plan, rank0_text: str) -> str:
    """Where this rank's plan first differs from rank 0's (``plan.first_difference`` of their run views)."""
    from meshpilot.planner.plan import Plan, first_difference

    return first_difference(Plan.from_json(rank0_text).run_view(), plan.run_view()) or "nothing run depends on"


def _checkpointing(args: argparse.Namespace, plan, resume):
    """--checkpoint-dir: the run's Checkpointing, its manifest saying how it was trained (None without)."""
    if args.checkpoint_dir is None:
        return None
    from meshpilot.planner.reshard_checkpoint import Layouts
    from meshpilot.runtime.checkpoint import Checkpointing

    saved_with = {"seed": args.seed, "lr": args.lr, "model": args.model, "plan": str(args.plan)}
    saved_with["data"] = str(args.data) if args.data else "random tokens"
    saved_with.update(_plan_info(plan))
    if plan.is_single:  # what a resume under another one-stage plan moves (_reshard_line)
        saved_with["layouts"] = Layouts.of(plan.only).to_dict()
    return Checkpointing(args.checkpoint_dir, args.checkpoint_every, resume, saved_with)


def _run_info(args: argparse.Namespace, plan, shape, resume, rank: int) -> dict:
    """What --json-out records of the run (its plan's stages or ATP's mesh, the precision, a resume); rank 0
    says where a resume starts and what it moves."""
    if plan is not None:
        info = {**_plan_info(plan), "plan": str(args.plan), "precision": plan.precision or "fp32"}
    else:
        info = {"mesh": list(shape), "precision": args.precision or "fp32"}
    if resume is None:
        return info
    info["resumed_from"] = str(resume.path)
    if rank == 0:
        print(f"resumed from {resume.path} (after step {resume.step}, data position {resume.position})", flush=True)
        moved = _reshard_line(resume.manifest, plan.only) if plan is not None and plan.is_single else None
        if moved:
            print(moved, flush=True)
    return info


def _throughput(args: argparse.Namespace, plan, cfg, graph, rank: int):
    """The progress line's numbers: from the plan (``Throughput.of_plan``), or ATP's GPT tokens."""
    import torch.distributed as dist

    from meshpilot.runtime.progress import Throughput

    if plan is None:  # ATP's layers: the GPT's tokens, no plan to predict or count FLOPs
        return Throughput(items=cfg.batch * cfg.seq, unit="tok", steps=args.steps, world=dist.get_world_size())
    if rank == 0 and not plan.intra:
        print(
            f"note: {args.plan} holds no stage plans: each stage runs a data-parallel plan on its submesh "
            "(`meshpilot plan --pipeline --out` saves searched ones)",
            flush=True,
        )
    items = _step_items(cfg, graph, plan.microbatches)
    return Throughput.of_plan(plan, args.steps, dist.get_world_size(), items=items)


def _run_steps(args: argparse.Namespace, run: dict, checkpoint, on_step, rank: int, write_json) -> int:
    """The steps (any model under a plan, the GPT under a plan, or ATP's layers), then --verify: the exit
    code (a SIGTERM stop: STOPPED_EXIT; a timed-out collective ends the process with 124)."""
    import sys

    import torch.distributed as dist

    from meshpilot.runtime.checkpoint import Stopped
    from meshpilot.runtime.train import train_atp, train_model, train_plan

    cfg, plan, build, device, data = run["cfg"], run["plan"], run["build"], run["device"], run["data"]
    common = dict(device=device, on_step=on_step, data=data)
    try:
        if build is not None:  # any plan, one-stage or pipelined: one path (meshpilot.parallelize)
            train_model(build, args.steps, args.seed, args.lr, plan=plan, checkpoint=checkpoint, graph=run["graph"],
                        **common)  # fmt: skip
        elif plan is not None:
            train_plan(cfg, plan, args.steps, args.seed, args.lr, graph=run["graph"], checkpoint=checkpoint, **common)
        else:
            train_atp(cfg, run["shape"], args.steps, args.seed, args.lr, args.chunks, precision=args.precision,
                      **common)  # fmt: skip
        verified = not args.verify or _verify(
            args, run["done"], cfg=cfg, plan=plan, build=build, device=device, rank=rank, data=data
        )
        write_json(True)
        return 0 if verified else 1
    except Stopped as e:
        if rank == 0:
            print(
                f"meshpilot train: stopped: SIGTERM after step {e.step}; saved {e.path}; continue with --resume",
                file=sys.stderr,
                flush=True,
            )
        dist.destroy_process_group()
        return STOPPED_EXIT
    except RuntimeError as e:
        if args.timeout and _is_timeout(e):
            # one line naming this rank; the launcher merges the ranks' lines. The group may be broken:
            # leave without destroy_process_group, which could wait on the silent rank.
            print(
                f"meshpilot train: error: rank {dist.get_rank()}: a collective timed out after {args.timeout:g} s "
                "(another rank stopped answering); raise --timeout if the steps are just slow",
                file=sys.stderr,
                flush=True,
            )
            os._exit(124)
        raise


def _verify(args: argparse.Namespace, done: list[dict], *, cfg, plan, build, device, rank: int, data=None) -> bool:
    """--verify: the first steps of the same model, data and optimizer on this rank's device alone (every rank
    runs it: no rank waits on another's reference), their losses against this run's. Rank 0 says the verdict."""
    import sys

    from meshpilot.runtime.train import train_model, train_single

    n = min(args.verify, len(done))
    m = plan.microbatches if plan is not None else 1  # the same semantics: accumulation over m
    if build is not None:
        single = train_model(build, n, args.seed, args.lr, device=device, data=data, microbatches=m)
    else:
        precision = (plan.precision or None) if plan is not None else args.precision
        single = train_single(
            cfg, n, args.seed, args.lr, device=device, precision=precision or None, data=data, microbatches=m
        )
    worst = (0.0, 0)
    for step, (mine, ref) in enumerate(zip(done, single)):
        diff = abs(float(mine["loss"]) - ref.loss)
        if diff > VERIFY_TOL * max(1.0, abs(ref.loss)):
            if rank == 0:
                print(
                    f"meshpilot train: error: --verify: step {step}: loss {float(mine['loss']):.6f} here, "
                    f"{ref.loss:.6f} on one device (|Δ| {diff:.2e} > {VERIFY_TOL:g}); the plan does not compute "
                    "what the model does — please report it with the plan file",
                    file=sys.stderr,
                    flush=True,
                )
            return False
        worst = max(worst, (diff, step))
    if rank == 0:
        accumulated = f" ({m} microbatches accumulated)" if m > 1 else ""
        print(
            f"verify: the first {n} steps' losses equal one device's{accumulated} "
            f"(max |Δ| {worst[0]:.1e} at step {worst[1]}, "
            f"tolerance {VERIFY_TOL:g})",
            flush=True,
        )
    return True


def _init_group(backend: str, timeout) -> None:
    """init_process_group from torchrun's environment. In a run torchrun restarted, the keys go under a
    prefix of the attempt: torchrun's workers share its store, which keeps the first attempt's keys (gloo's
    addresses of the dead ranks), and a new rank reading one of those before its peer rewrote it waits forever
    to connect."""
    import torch.distributed as dist

    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise UserError(
            f"environment {'/'.join(missing)} not set: RANK and WORLD_SIZE alone do not make a process group; "
            "launch with torchrun (or give --nproc-per-node N)"
        )
    kw = {} if timeout is None else {"timeout": timeout}
    attempt = os.environ.get(RESTART_ENV, "0").strip()
    if attempt in ("", "0"):
        dist.init_process_group(backend, **kw)
        return
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", **kw))
    store = dist.PrefixStore(f"meshpilot/attempt-{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)


START_TIMEOUT_S = 600.0
"""With ``--timeout S``: how long the ranks' start (rendezvous, meshes, the first step) may wait, if longer than S."""


def _collective_timeout(timeout) -> None:
    """Every process group's collectives (the default group's and the meshes') time out after `timeout`."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def _test_stall(timeout: float, rank: int) -> None:
    """Tests: the rank named by ``MESHPILOT_TEST_STALL_RANK`` goes silent past --timeout after its first step."""
    stall = os.environ.get("MESHPILOT_TEST_STALL_RANK")
    if stall is not None and int(stall) == rank:
        import time

        time.sleep(3 * timeout)


STOPPED_EXIT = 143
"""A run that SIGTERM stopped after saving a checkpoint exits 128 + SIGTERM: unfinished, resumable."""


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _reshard_line(manifest: dict, plan) -> str | None:
    """What loading a checkpoint saved under another plan moves (``planner.reshard_checkpoint``), in one line;
    None when it was saved under the same layouts or its manifest does not say."""
    from meshpilot.planner.reshard_checkpoint import Layouts, plan_reshard, shapes_from_signature

    saved = manifest.get("layouts")
    if not saved:
        return None
    before, now = Layouts.from_dict(saved), Layouts.of(plan)
    if before == now:
        return None
    shapes = shapes_from_signature(manifest.get("signature", {}))
    params = {f: shapes[f] for f, _ in now.params if f in shapes}
    rp = plan_reshard(before, now, params)
    return f"resharded from DeviceMesh{before.mesh_shape} to DeviceMesh{now.mesh_shape}: {rp.summary()}"
