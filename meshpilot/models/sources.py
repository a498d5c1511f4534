"""Where a `--model` comes from: one place that turns the string into a module and its example inputs.

Three kinds of source, for `meshpilot plan` and `meshpilot train` alike:

- a built-in model (`meshpilot presets`): ``gpt-tiny``, ``atp-m1`` … ``atp-m4``, ``mlp``, ``bert-tiny``, …, or
  ``gpt`` sized with ``--layers/--hidden/--heads``;
- ``hf:<name>``: a Hugging Face ``transformers`` model built from its configuration class, without weights
  (random initialisation; nothing is downloaded). ``hf:gpt2`` (GPT2LMHeadModel), ``hf:llama``
  (LlamaForCausalLM), ``hf:bert`` (BertForMaskedLM), ``hf:t5`` (T5ForConditionalGeneration), ``hf:mixtral``
  (MixtralForCausalLM), and any other ``AutoConfig`` model type (``hf:mistral``, ``hf:qwen2``, …): the
  sequence-to-sequence LM head for an encoder-decoder, else the masked-LM head where the type has one, else
  the causal-LM head. The configuration is the library's default plus ``--hf-config`` overrides
  (``key=value``, values read as int / float / bool / None / JSON / text, or a ``config.json`` file); a key
  neither the configuration class defines nor the model's code reads is an error, not silently kept. An
  encoder-decoder without ``decoder_start_token_id`` gets its pad token (what T5 starts its decoder with); a
  mixture of experts (``hf:mixtral``) without ``experts_implementation`` gets ``meshpilot``: HF's dropless
  top-k experts as one op (:mod:`meshpilot.ops.moe`, data-dependent shapes inside it, expert-parallel
  strategies); ``--hf-config experts_implementation=batched_mm`` keeps transformers' static-shape path.
  The example inputs are ``(input_ids, labels)`` of ``[batch, seq]`` random tokens (default batch 4, seq 128
  capped at the model's positions) and the loss is the model's own (``labels=``);
- ``package.module:factory``: your own builder, imported (the current directory is on the import path).
  ``factory()`` is called with no arguments inside ``with torch.device(DEVICE)`` (``meta`` while planning:
  nothing is allocated; the rank's device while training, after ``torch.manual_seed(--seed)``, the same on
  every rank); if it takes a ``device`` parameter it is also passed ``device=DEVICE``. It returns either
  ``(module, inputs)`` or an object with ``.model`` and ``.inputs``, where ``inputs`` is a tensor or a
  tuple/list of tensors and ``module(*inputs)`` returns the scalar training loss (or a tuple starting with
  it, or an output with ``.loss``). ``train`` feeds those same inputs at every step.

Every mistake (transformers missing, an unknown name, a bad configuration key, a factory that cannot be
imported, is not callable or returns something else) is one :class:`~meshpilot.errors.UserError` line.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshpilot.errors import UserError, first_line

HF_PREFIX = "hf:"
HF_DEFAULT_BATCH, HF_DEFAULT_SEQ = 4, 128
# the heads the short names pin (every other model type: the rule in `_hf_model_class`)
HF_NAMES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
    "t5": "T5ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
}
# keys of a saved config.json that describe the file rather than the model
_IMPLEMENTATION_KEYS = ("attn_implementation", "experts_implementation")  # kwargs every config takes
_HF_FILE_KEYS = ("transformers_version", "_name_or_path", "architectures", "model_type")

FACTORY_PROTOCOL = (
    "factory() (called under `with torch.device(DEVICE)`, or with device=DEVICE if it takes one) returns "
    "(module, inputs) or an object with .model and .inputs; module(*inputs) returns the loss"
)


@dataclass
class Built:
    """A model on its device, its example inputs and a one-line description.

    `config` is the GPTConfig of built-in GPTs (None otherwise); `batches(steps, seed, start)` gives the
    training batches ``train`` feeds (each a tuple like `inputs`) beginning at sample `start` (the data
    position a checkpoint records), by default `inputs` at every step.
    """

    name: str
    label: str
    model: Any
    inputs: tuple
    config: Any = None
    make_batches: Callable[[int, int, int], list[tuple]] | None = None

    def batches(self, steps: int, seed: int, start: int = 0) -> list[tuple]:
        if self.make_batches is not None:
            return self.make_batches(steps, seed, start)
        return [self.inputs] * steps

    @property
    def batch_size(self) -> int:
        """Samples one step consumes: dim 0 of the first input (1 for a scalar or no input)."""
        first = self.inputs[0] if self.inputs else None
        return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 1


def kind(spec: str) -> str:
    """'hf', 'factory' or 'builtin'."""
    if spec.startswith(HF_PREFIX):
        return "hf"
    if ":" in spec:
        return "factory"
    return "builtin"


def count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def build_model(
    name: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    dtype: str | None = None,
    hf_config: list[str] | None = None,
    device: str | torch.device = "meta",
    seed: int = 0,
) -> Built:
    """The model `name` (any source in the module docstring) and its example inputs on `device`."""
    if batch is not None and batch <= 0:
        raise UserError(f"--batch {batch}: give a positive batch size")
    if seq is not None and seq <= 0:
        raise UserError(f"--seq {seq}: give a positive sequence length")
    source = kind(name)
    if source != "builtin":
        given = [f"--{k}" for k, v in (("layers", layers), ("hidden", hidden), ("heads", heads)) if v]
        if dtype is not None:
            given.append("--dtype")
        if given:
            what = "--hf-config key=value" if source == "hf" else "your factory"
            raise UserError(f"{', '.join(given)}: only for built-in GPTs; size {name!r} with {what}")
    if hf_config and source != "hf":
        raise UserError(f"--hf-config: only for hf:<name> models, not {name!r}")
    if source == "hf":
        return build_hf(name[len(HF_PREFIX) :], hf_config or [], batch=batch, seq=seq, device=device, seed=seed)
    if source == "factory":
        if batch is not None or seq is not None:
            raise UserError(f"--batch/--seq: {name!r} builds its own inputs; size them in the factory")
        return build_factory(name, device=device, seed=seed)
    return build_builtin(
        name, batch=batch, seq=seq, layers=layers, hidden=hidden, heads=heads, dtype=dtype, device=device, seed=seed
    )


# ------------------------------------------------------------------------------------------- built-in


def build_builtin(
    name: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    dtype: str | None = None,
    device: str | torch.device = "meta",
    seed: int = 0,
) -> Built:
    """A built-in model (or 'gpt' with overrides) and its (inputs..., targets) on `device`; its weights drawn
    after ``torch.manual_seed(seed)`` (on a real device), so every rank and the reference build the same."""
    from meshpilot.models import builtin_models, gpt_config

    models = builtin_models()
    if name != "gpt" and name not in models:
        raise UserError(
            f"--model {name!r}: no such built-in model; choose one of {', '.join(models)}, 'gpt' with "
            "--layers/--hidden/--heads (see `meshpilot presets`), hf:<name> (a transformers model) or "
            "package.module:factory (your own)"
        )
    entry = models.get(name)
    device = str(device)
    if device != "meta":
        torch.manual_seed(seed)
    if name == "gpt" or entry.config is not None:
        cfg = gpt_config(name, layers=layers, hidden=hidden, heads=heads, batch=batch, seq=seq, dtype=dtype)
        from meshpilot.models.gpt import GPT

        with torch.device(device):
            model = GPT(cfg)
        if device == "meta":
            idx = torch.empty(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
            inputs = (idx, idx)
        else:
            g = torch.Generator().manual_seed(0)
            tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
            inputs = (tok[:, :-1].contiguous().to(device), tok[:, 1:].contiguous().to(device))
        label = (
            f"{name}: GPT L={cfg.layers} h={cfg.hidden} heads={cfg.heads} b={cfg.batch} s={cfg.seq} {cfg.dtype}, "
            f"{count(cfg.num_params())} parameters"
        )
        return Built(name, label, model, inputs, cfg)
    given = [f"--{k}" for k, v in (("seq", seq), ("layers", layers), ("hidden", hidden), ("heads", heads)) if v]
    if dtype is not None:
        given.append("--dtype")
    if given:
        raise UserError(f"{', '.join(given)}: only for GPT models; {name!r} takes --batch only")
    model, inputs = entry.build(device, batch)
    params = sum(p.numel() for p in model.parameters())
    b = inputs[0].shape[0] if inputs and hasattr(inputs[0], "shape") else batch
    return Built(name, f"{name}: {entry.summary}, batch {b}, {count(params)} parameters", model, tuple(inputs))


# ------------------------------------------------------------------------------------------- Hugging Face


class HFLoss(nn.Module):
    """``model(input_ids=…, labels=…).loss``: HF's own loss (T5 derives its decoder inputs from the labels).

    `extra` names further keyword inputs of the model's forward (``attention_mask``, ``pixel_values``), taken
    positionally after ``labels`` in that order: a model that needs them is still called ``loss(*inputs)``."""

    def __init__(self, model: nn.Module, extra: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.extra = tuple(extra)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
        if len(more) != len(self.extra):
            names = ", ".join(("input_ids", "labels", *self.extra))
            raise UserError(f"HFLoss takes {names}; got {2 + len(more)} inputs")
        return self.model(input_ids=input_ids, labels=labels, **dict(zip(self.extra, more))).loss


def pre_shifted_labels(model: nn.Module, inputs: tuple) -> tuple[nn.Module, tuple]:
    """`model` and `inputs` with the labels shifted before the step, as Megatron-LM's data loader gives them
    (``tokens[1:]``): a Hugging Face decoder's :class:`HFLoss` given transformers' ``shift_labels`` (the labels
    shifted left, the last position ignored), so that its loss shifts nothing along the sequence. A plan that
    permutes the sequence (``planner.sequence_order``: the zig-zag order of context parallelism) cannot run
    ``ForCausalLMLoss``' own shift, a pad and a slice along it. Anything else is returned as it is."""
    if not isinstance(model, HFLoss) or "shift_labels" in model.extra or len(inputs) != 2 + len(model.extra):
        return model, inputs
    labels = inputs[1]
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    return HFLoss(model.model, (*model.extra, "shift_labels")), (*inputs, shifted)


@contextlib.contextmanager
def unpacked_sequences():
    """While capturing a Hugging Face decoder: every row one whole sequence, as eager training on these inputs
    runs it. transformers looks for packed sequences in the position ids, and under fake tensors it cannot read
    them, so it builds the causal mask as a ``[b, 1, t, t]`` tensor; on real unpacked ids it skips the mask and
    calls attention with ``is_causal``. Inside this context the search for packing answers "none", so the
    capture holds the ``is_causal`` call eager runs (context parallelism plans it without a mask tensor, which
    at 131,072 tokens would hold 17 G elements a sequence)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    was = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = was


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError(
            "hf:<name> models need transformers, which is not installed; install meshpilot[hf] "
            "(pip install 'meshpilot[hf]')"
        ) from None
    return transformers


def parse_value(text: str) -> Any:
    """A --hf-config value: true/false, none/null, int, float, JSON list/object, else the text itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.strip()[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def parse_hf_config(items: list[str]) -> dict[str, Any]:
    """`--hf-config` items (key=value, or a JSON file's path) as one dict; later items win."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if sep:
            if not key.strip():
                raise UserError(f"--hf-config {item!r}: write key=value, e.g. num_hidden_layers=2")
            out[key.strip()] = parse_value(value)
            continue
        path = Path(item)
        if not path.is_file():
            raise UserError(f"--hf-config {item!r}: neither key=value nor an existing config.json file")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--hf-config {path}: not a JSON file ({e})") from None
        if not isinstance(data, dict):
            raise UserError(f"--hf-config {path}: expected a JSON object of config keys")
        out.update(data)
    return out


def _hf_model_class(t: Any, model_type: str) -> Any:
    from transformers.models.auto import modeling_auto as ma

    if model_type in HF_NAMES:
        return getattr(t, HF_NAMES[model_type])
    for mapping in (
        ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    ):
        cls_name = mapping.get(model_type)
        if cls_name:
            return getattr(t, cls_name)
    raise UserError(
        f"--model hf:{model_type}: transformers has no language-model head (causal, masked or seq2seq LM) for "
        "this model type; write a package.module:factory that builds it and its inputs"
    )


def hf_config(name: str, overrides: dict[str, Any]) -> Any:
    """The transformers configuration of model type `name`: the library default plus `overrides` (each key
    checked against the configuration class)."""
    t = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name not in CONFIG_MAPPING_NAMES:
        raise UserError(
            f"--model hf:{name}: not a transformers model type; use {', '.join(HF_NAMES)} or another AutoConfig "
            "model_type (mistral, qwen2, gpt_neox, roberta, bart, …)"
        )
    overrides = dict(overrides)
    file_type = overrides.get("model_type")
    if file_type is not None and file_type != name:
        raise UserError(f"--hf-config: the config is for model_type {file_type!r}, not {name!r}")
    for k in _HF_FILE_KEYS:
        overrides.pop(k, None)
    from meshpilot.models.hf_families import default_config

    default = default_config(name)[0]  # a configuration refusing its own defaults: those its validator asks for
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {})) | set(_IMPLEMENTATION_KEYS)
    bad = sorted(k for k in overrides if k not in known and not hasattr(default, k))
    if bad:  # keys the model reads although its config class does not define them (T5's decoder_start_token_id)
        read = _keys_the_model_reads(t, name)
        bad = [k for k in bad if k not in read]
    if bad:
        raise UserError(
            f"--hf-config {', '.join(bad)}: not a key of {type(default).__name__}; check the spelling against "
            f"the transformers docs (e.g. {', '.join(_sample_keys(default))})"
        )
    if _has_experts(t, name, default):
        from meshpilot.ops.moe import IMPLEMENTATION, register_with_transformers

        register_with_transformers()
        if "experts_implementation" not in overrides:
            # a mixture of experts: torch's grouped_mm is bfloat16/CUDA-only and the eager experts index with
            # data-dependent shapes capture cannot see; meshpilot's op hides them in one node with EP strategies
            overrides["experts_implementation"] = IMPLEMENTATION
    rejects: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError)
    with contextlib.suppress(ImportError):  # transformers >= 5 validates its configs as strict dataclasses
        from huggingface_hub.errors import StrictDataclassError

        rejects += (StrictDataclassError,)
    try:
        return t.AutoConfig.for_model(name, **overrides)
    except rejects as e:
        why = " ".join(str(e).split())
        raise UserError(
            f"--hf-config: {type(default).__name__} rejects the values: {why}; give each key a value of its type "
            "(numbers unquoted: num_hidden_layers=2)"
        ) from None


def _model_source(t: Any, name: str) -> str:
    """The source of model type `name`'s modeling module ('' if unavailable)."""
    try:
        return inspect.getsource(sys.modules[_hf_model_class(t, name).__module__])
    except (UserError, OSError, TypeError, KeyError):
        return ""


def _has_experts(t: Any, name: str, cfg: Any) -> bool:
    """Whether model type `name`'s modeling source, or that of a part of its composite configuration `cfg` (a
    nested configuration's own model type: Nemotron-3.5-Transcribe's NemotronH text model), reads
    ``experts_implementation``: a mixture of experts somewhere in the model."""
    parts = [v.model_type for v in vars(cfg).values() if getattr(v, "model_type", None) and hasattr(v, "to_dict")]
    return any("experts_implementation" in _model_source(t, n) for n in dict.fromkeys([name, *parts]))


def _keys_the_model_reads(t: Any, name: str) -> set[str]:
    """Every ``config.<key>`` its modeling module's source mentions."""
    import re

    return set(re.findall(r"\bconfig\.([A-Za-z_]\w*)", _model_source(t, name)))


def _sample_keys(cfg: Any) -> list[str]:
    keys = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if hasattr(cfg, k)]
    return keys or sorted(cfg.to_dict())[:4]


def _max_positions(cfg: Any) -> int | None:
    for k in ("max_position_embeddings", "n_positions", "max_seq_len"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def hf_model(name: str, overrides: dict[str, Any] | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """``HFLoss`` around transformers model type `name` (train mode) built on `device` from its configuration."""
    t = _transformers()
    cfg = hf_config(name, overrides or {})
    cls = _hf_model_class(t, name)
    if cfg.is_encoder_decoder and getattr(cfg, "decoder_start_token_id", None) is None:
        # the decoder's inputs are the labels shifted right behind this token (T5: the pad token)
        cfg.decoder_start_token_id = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else 0
    try:
        with torch.device(device):
            model = cls(cfg)
    except Exception as e:  # noqa: BLE001 - a config the model cannot be built from: one line
        msg = first_line(e)
        raise UserError(f"--model hf:{name}: {cls.__name__} cannot be built from this config ({msg})") from None
    model.train()
    return HFLoss(model)


def hf_tokens(
    vocab: int, batch: int, seq: int, steps: int, seed: int, device: Any = "cpu", start: int = 0
) -> list[tuple]:
    """`steps` (input_ids, labels) batches of random tokens, beginning at sample `start`: sample j's tokens
    come from a generator seeded by (seed, j) alone (:func:`meshpilot.runtime.train.sample_generator`), so
    a run resumed at any sample position, on any number of ranks, sees the same data."""
    from meshpilot.runtime.train import sample_generator

    out = []
    for i in range(steps):
        ids, labels = [], []
        for j in range(start + i * batch, start + (i + 1) * batch):
            g = sample_generator(seed, j)
            ids.append(torch.randint(0, vocab, (seq,), generator=g))
            labels.append(torch.randint(0, vocab, (seq,), generator=g))
        out.append((torch.stack(ids).to(device), torch.stack(labels).to(device)))
    return out


def build_hf(
    name: str,
    config: list[str] | dict[str, Any],
    *,
    batch: int | None = None,
    seq: int | None = None,
    device: str | torch.device = "meta",
    seed: int = 0,
) -> Built:
    """`hf:<name>`: its model (no weights: random init, or nothing on meta) and (input_ids, labels)."""
    if not name:
        raise UserError(f"--model hf:: name a transformers model, e.g. hf:{', hf:'.join(HF_NAMES)}")
    overrides = parse_hf_config(config) if isinstance(config, list) else dict(config)
    torch.manual_seed(seed)
    model = hf_model(name, overrides, device)
    cfg = model.model.config
    vocab = getattr(cfg, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise UserError(f"--model hf:{name}: its config has no vocab_size; set one with --hf-config vocab_size=N")
    most = _max_positions(cfg)
    b = batch or HF_DEFAULT_BATCH
    s = seq or min(HF_DEFAULT_SEQ, most or HF_DEFAULT_SEQ)
    if most is not None and s > most:
        raise UserError(f"--seq {s}: hf:{name} has {most} positions: give --seq up to that or raise it in --hf-config")
    dev = torch.device(device)
    if dev.type == "meta":
        ids = torch.empty(b, s, dtype=torch.long, device="meta")
        inputs: tuple = (ids, ids)
    else:
        inputs = hf_tokens(vocab, b, s, 1, seed, dev)[0]
    params = sum(p.numel() for p in model.parameters())
    experts = getattr(cfg, "_experts_implementation", None)
    moe = experts and "experts_implementation" in _model_source(_transformers(), name)
    extra = f", experts {experts}" if moe else ""
    label = f"hf:{name}: {type(model.model).__name__}{extra}, b={b} s={s}, {count(params)} parameters"

    def make_batches(steps: int, data_seed: int, start: int = 0) -> list[tuple]:
        return hf_tokens(vocab, b, s, steps, data_seed, dev, start)

    return Built(f"hf:{name}", label, model, inputs, None, make_batches)


# ------------------------------------------------------------------------------------------- factories


def build_factory(spec: str, *, device: str | torch.device = "meta", seed: int = 0) -> Built:
    """`package.module:factory`: import it, call it on `device` and check what it returned."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in (*module_name.split("."), *attr.split("."))):
        raise UserError(f"--model {spec!r}: write package.module:factory (or hf:<name>, or a built-in name)")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # `meshpilot` run as a script: import from the current directory as python -m does
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        where = "" if e.name == module_name else f" ({e})"
        raise UserError(
            f"--model {spec}: cannot import {module_name}{where}; run from its folder or add that to PYTHONPATH"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed on import: one line
        raise UserError(f"--model {spec}: importing {module_name} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"--model {spec}: {module_name} has no {attr!r}; define def {attr}(): ... in it")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"--model {spec}: {attr} is a {type(obj).__name__}, not callable; {FACTORY_PROTOCOL}")
    kwargs = {}
    try:
        if "device" in inspect.signature(obj).parameters:
            kwargs["device"] = torch.device(device)
    except (TypeError, ValueError):
        pass
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            result = obj(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's code failed: one line naming it
        msg = first_line(e)
        on = f" on device {torch.device(device)}" if str(device) == "meta" else ""
        raise UserError(f"--model {spec}: {attr}(){on} raised {type(e).__name__}: {msg}") from None
    if hasattr(result, "model") and hasattr(result, "inputs"):
        model, inputs = result.model, result.inputs
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        model, inputs = result
    else:
        raise UserError(f"--model {spec}: {attr}() returned a {type(result).__name__}; {FACTORY_PROTOCOL}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {spec}: {attr}()'s model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise UserError(
            f"--model {spec}: {attr}()'s inputs must be a tensor or a non-empty tuple/list of tensors, got "
            f"{type(inputs).__name__}"
        )
    dev = torch.device(device)
    if dev.type != "meta":
        model.to(dev)
        inputs = tuple(x.to(dev) for x in inputs)
    params = sum(p.numel() for p in model.parameters())
    shapes = ", ".join("x".join(map(str, x.shape)) or "scalar" for x in inputs)
    label = f"{spec}: {type(model).__name__}, inputs {shapes}, {count(params)} parameters"
    return Built(spec, label, model, tuple(inputs))
