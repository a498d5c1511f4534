"""Every model family of the installed ``transformers``, tiny or at a published size, for tests and benchmarks.

:func:`families` walks transformers' own auto-mappings (causal LM, masked LM, sequence-to-sequence LM, image
classification) and yields one :class:`Family` per (model type, head class). :func:`tiny_overrides` shrinks a
family's default configuration generically — layers, hidden size, heads, key/value heads, feed-forward width,
vocabulary, experts, positions, image size — from the *names* of its configuration keys, never from the model's
name, and keeps the architecture's own flags (multi-query or grouped-query attention, parallel blocks, ALiBi,
rotary settings, tied embeddings, sliding windows) and one layer of each kind its ``layer_types`` names (a
hybrid's attention layers among its recurrent ones: :func:`_kept_layers`), a layer of each section its layer
counts cut (Dory's looped block: :func:`_layer_sections`) and widths it derives from the hidden size in proportion
(:func:`_keep_derived_widths`): what is tested is the default architecture, small. A check of the configuration
the tiny sizes fail is learned from its refusal (:func:`_satisfy`), and a default the configuration itself refuses
is built with the values its validator names (:func:`default_config`).
:func:`build` gives the model (``HFLoss`` or :class:`HFImageLoss`: HF's own loss) and its example inputs
(``(input_ids, labels)`` and whatever else the family's forward needs, :func:`extra_inputs`: a mask, an
image, audio, codebook-major ids) with ``use_cache`` and the attention implementation chosen, and :func:`try_plan`
captures and plans it, returning a :class:`Outcome` whose one-line reason names what refused it (a capture
error already names the op and the model's source line: ``meshpilot.graph.capture._explain``).

:data:`PUBLISHED` holds published sizes (the keys of each model's ``config.json`` that matter for planning) as
overrides of the library default, for planning the 7B class on the meta device (:func:`build_published`):
configurations cannot be downloaded here, so they are written down.

Shared by ``tests/test_hf_families.py`` (a fast sample) and ``benchmarks/bench_hf_families.py`` (the sweep).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshpilot.errors import UserError, first_line

# the auto-mappings walked, by the short kind this module calls them
MAPPINGS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
TEXT_KINDS = ("causal", "masked", "seq2seq")

TINY_VOCAB, TINY_BATCH, TINY_SEQ, TINY_IMAGE = 128, 4, 8, 32
HIDDEN, HEADS, FFN, LAYERS, EXPERTS, POSITIONS = 32, 4, 64, 2, 4, 64

# configuration keys by meaning (the spellings transformers' configurations use)
_LAYER_KEYS = {
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
    "num_decoder_layers", "num_encoder_layers", "text_layers", "n_text_layer", "num_self_attends_per_block",
}  # fmt: skip
_HIDDEN_KEYS = {
    "hidden_size", "n_embd", "d_model", "dim", "embed_dim", "embedding_size", "n_embed", "emb_dim", "d_latents",
}  # fmt: skip
_HEAD_KEYS = {
    "num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
}  # fmt: skip
_KV_HEAD_KEYS = {"num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num", "n_kv_heads"}
_FFN_KEYS = {
    "intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size",
    "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size", "d_inner",
    "ff_intermediate_size", "mlp_dim", "intermediate_dim",
}  # fmt: skip
_EXPERT_KEYS = {"num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"}
_TOPK_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "num_selected_experts", "moe_k"}
_POSITION_KEYS = {"max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length"}
_HEAD_DIM_KEYS = {"head_dim", "d_kv", "attention_head_size", "kv_channels"}


@dataclass(frozen=True)
class Family:
    """One (model type, head class) of an auto-mapping: ``kind`` is a key of :data:`MAPPINGS`."""

    model_type: str
    class_name: str
    kind: str

    @property
    def name(self) -> str:
        return f"{self.model_type}/{self.class_name}"


def families(kinds: tuple[str, ...] = tuple(MAPPINGS)) -> list[Family]:
    """Every family of the installed transformers in the mappings of `kinds`, in mapping order, each (model
    type, class) once (BART's causal and seq2seq heads are two families; its masked head is its seq2seq
    class again, listed once)."""
    from transformers.models.auto import modeling_auto as ma

    seen: set[tuple[str, str]] = set()
    out = []
    for kind in kinds:
        for model_type, cls in getattr(ma, MAPPINGS[kind]).items():
            if isinstance(cls, (tuple, list)):
                cls = cls[0]
            if (model_type, cls) not in seen:
                seen.add((model_type, cls))
                out.append(Family(model_type, cls, kind))
    return out


# ------------------------------------------------------------------------------------------- sizes


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def tiny_overrides(model_type: str, vocab: int = TINY_VOCAB) -> dict[str, Any]:
    """Overrides that make `model_type`'s default configuration tiny, chosen by key names only: the default's
    flags (attention kind, parallel blocks, position scheme, tying) stay. Key/value heads keep their relation to
    the query heads: one stays one (multi-query), fewer stays fewer (grouped), equal stays equal."""
    default, fixes = default_config(model_type)
    d, kinds = _held_dict(default), _layer_kinds(default)
    out = _tiny_overrides_of(model_type, d, vocab, kinds, 1)
    layers = _layer_count(d)
    if len(_kept_layers(layers, kinds, 1, _layer_sections(d)) or ()) > LAYERS and _model_refused(model_type, out):
        # a kind kept once that the model refuses alone (Zamba ties every hybrid layer's shared transformer to
        # the first one's by a pattern that must match a second): two layers of each kind the rule added
        out = _tiny_overrides_of(model_type, d, vocab, kinds, 2)
    return {**fixes, **out}


def default_config(model_type: str) -> tuple[Any, dict[str, Any]]:
    """`model_type`'s library default configuration and the overrides it needed: none, unless the configuration
    refuses its own defaults (Gemma-4-Assistant's validator asks its default text part for
    ``hidden_size_per_layer_input`` 0, which that part's default is not), when each value its validator names
    ("`x` must be 0", "requires x=1": :func:`_asked`) is set, where the configuration or one of its parts
    holds the key. Raises the configuration's own refusal when that does not satisfy it."""
    fixes: dict[str, Any] = {}
    shape: dict[str, Any] | None = None
    for _ in range(16):
        try:
            return _configured(model_type, fixes), fixes
        except Exception as e:  # noqa: BLE001 - a validator's refusal; re-raised when no value it names helps
            shape = _class_shape(model_type) if shape is None else shape
            step = _asked(_text(e), shape, fixes)
            if step is None:
                raise
            _assign(fixes, shape, *step)
    return _configured(model_type, fixes), fixes


def _class_shape(model_type: str) -> dict[str, Any]:
    """The keys of `model_type`'s configuration class without building it (its defaults may be refused): its
    fields, each None, and each sub-configuration's default as a dict (where the key of a value a validator
    asks for lives)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    shape: dict[str, Any] = {k: None for c in reversed(cls.__mro__) for k in getattr(c, "__annotations__", {})}
    for key, spec in (getattr(cls, "sub_configs_defaults", None) or {}).items():
        sub_type = getattr(spec, "model_type", None)
        if sub_type is not None:
            with contextlib.suppress(Exception):  # a part whose own default is refused: its keys are not searched
                shape[key] = {**AutoConfig.for_model(sub_type).to_dict(), "model_type": sub_type}
    return shape


def _held_dict(cfg: Any) -> dict[str, Any]:
    """Configuration `cfg` as a dict of the values it holds: its ``to_dict()``, except layer counts and lists of
    layer kinds it serializes in another layout than it holds and converts back when built (Dory writes each
    layer as an attention block and an MLP block, doubling its counts, and halves them when built: overrides in
    that serialized layout would be halved again)."""
    d = cfg.to_dict()
    for k, v in d.items():
        try:
            held = getattr(cfg, k, v)
        except Exception:  # noqa: BLE001 - a per-layer value read globally (Gemma-4's): what it serializes
            continue
        if held != v and ((k.endswith("layers") and _int(v) and _int(held)) or (_strings(v) and _strings(held))):
            d[k] = held
    return d


def _tiny_overrides_of(model_type: str, d: dict[str, Any], vocab: int, kinds: list[str] | None, per_kind: int) -> dict:
    """:func:`tiny_overrides` keeping `per_kind` layers of each kind the first and last layers miss."""
    out = _tiny_dict(d, vocab, _hidden_sizes(d), kinds, per_kind)
    if _refused(model_type, out):  # a property the configuration checks that the tiny sizes lost: kept
        _keep_rotary_quads(d, out)
        _keep_chunks(d, out)
        _satisfy(model_type, d, out)
    _fill_unset_numbers(model_type, d, out)
    _keep_derived_widths(model_type, d, out)
    _keep_derived_kinds(model_type, d, out, kinds, per_kind)
    return out


def _keep_derived_widths(model_type: str, d: dict[str, Any], out: dict[str, Any]) -> None:
    """Widths a configuration derives from its hidden size (integer properties of its class named ``…_dim`` /
    ``…_size`` that change with it, head sizes apart) keep the default's proportion to it: xLSTM rounds
    ``hidden × 0.5`` up to a multiple of 64 (``qk_dim``), so at the tiny 32 its cache held 16-wide key heads where
    its layers make 4-wide ones (``modeling_xlstm.py:412`` under the cache, in plain PyTorch too). The tiny hidden
    size, and each width the default sets equal to it, doubles up to the default's until every such width is in
    proportion."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    hidden = next((k for k in _HIDDEN_KEYS if _int(d.get(k)) and _int(out.get(k))), None)
    if hidden is None:
        return
    names = []
    for c in CONFIG_MAPPING[model_type].__mro__:
        if c is PreTrainedConfig:
            break
        names += [n for n, v in vars(c).items() if isinstance(v, property) and n.endswith(("_dim", "_size"))]
    names = [n for n in names if "head" not in n]
    if not names:
        return
    default = _widths(model_type, {}, names)
    try:  # derived from the hidden size: a width that halves with it (Neo-MME's patch_dim does not)
        half = _widths(model_type, {hidden: d[hidden] // 2}, names)
    except Exception:  # noqa: BLE001 - a configuration refusing half its width: nothing is known to follow it
        return
    default = {n: w for n, w in default.items() if half.get(n) != w}
    if not default:
        return

    def in_proportion(over: dict[str, Any]) -> bool:
        tiny = _widths(model_type, over, names)
        return all(tiny.get(n, 0) * d[hidden] == w * over[hidden] for n, w in default.items())

    equal = [k for k, v in d.items() if v == d[hidden] and _int(out.get(k))]
    size = out[hidden]
    while not in_proportion(out) and size * 2 <= d[hidden]:
        size *= 2
        trial = {**out, **{k: size for k in equal}}
        if in_proportion(trial):
            out.update(trial)


def _widths(model_type: str, overrides: dict[str, Any], names: list[str]) -> dict[str, int]:
    """The integer values of properties `names` of `model_type`'s configuration under `overrides`."""
    cfg = _configured(model_type, overrides)
    return {n: v for n in names if _int(v := getattr(cfg, n, None))}


def _model_refused(model_type: str, overrides: dict[str, Any]) -> bool:
    """Whether transformers refuses to build `model_type`'s base model (on the meta device) from `overrides`."""
    return _build_refusal(model_type, overrides) is not None


def _build_refusal(model_type: str, overrides: dict[str, Any]) -> str | None:
    """Why transformers refuses to build `model_type`'s base model (on the meta device) from `overrides`, in
    one line (None: it builds)."""
    from transformers import AutoModel

    try:
        with torch.device("meta"):
            AutoModel.from_config(_configured(model_type, overrides))
    except Exception as e:  # noqa: BLE001 - any refusal; build names it in one line if the repair does not help
        return _text(e)
    return None


def _text(e: BaseException) -> str:
    """`e` as one line, a validator's reason (on the lines below its first) included."""
    return f"{type(e).__name__}: " + " ".join(str(e).split())


# a value a configuration's validator asks for by name: "`x` must be 0, got 256", "requires x=1"
_ASKED = re.compile(r"`?([A-Za-z_]\w*)`?(?: must be |=)`?(-?\d+|True|False)\b")


def _configured(model_type: str, overrides: dict[str, Any]) -> Any:
    """`model_type`'s configuration with `overrides` (deep-copied: a configuration edits the nested dicts it is
    given)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **copy.deepcopy(overrides))


def _rejection(model_type: str, overrides: dict[str, Any]) -> str | None:
    """Why `model_type`'s configuration refuses `overrides`, in one line (None: it accepts them)."""
    try:
        _configured(model_type, overrides)
    except Exception as e:  # noqa: BLE001 - any refusal is a reason
        return _text(e)
    return None


def _locate(key: str, d: dict[str, Any]) -> str | None:
    """Where configuration dict `d` holds `key`: "" (itself), the name of the sub-configuration holding it, or
    None (nowhere)."""
    if key in d:
        return ""
    return next((k for k, v in d.items() if isinstance(v, dict) and "model_type" in v and key in v), None)


def _current(key: str, where: str, d: dict[str, Any], out: dict[str, Any]) -> Any:
    """The value of `key` (held where :func:`_locate` says) under overrides `out` of default `d`."""
    if where == "":
        return out.get(key, d.get(key))
    return {**d[where], **out.get(where, {})}.get(key)


def _assign(out: dict[str, Any], d: dict[str, Any], key: str, where: str, value: Any) -> None:
    """Set `key` to `value` in overrides `out` of default `d`, in the sub-configuration `where` names (written
    back whole, as :func:`_tiny_dict` writes them)."""
    if where == "":
        out[key] = value
    else:
        out[where] = {**d[where], **out.get(where, {}), key: value}


def _asked(why: str, d: dict[str, Any], out: dict[str, Any]) -> tuple[str, str, Any] | None:
    """(key, where, value) of the first value refusal `why` asks for by name (:data:`_ASKED`) that a key of `d`
    takes and the overrides `out` do not hold yet; None where it asks for none."""
    for key, text in _ASKED.findall(why):
        where = _locate(key, d)
        value = {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else None)
        if where is not None and _current(key, where, d, out) != value:
            return key, where, value
    return None


def _satisfy(model_type: str, d: dict[str, Any], out: dict[str, Any], tries: int = 16) -> None:
    """Make the tiny overrides `out` pass the checks of `model_type`'s configuration, learning each from its
    refusal rather than from the model's name: a value the refusal asks for by name is set (:func:`_asked`:
    Qwen4-Exp's "requires indexer_kv_heads=1"); else a number the refusal names is doubled (towards its
    default) or halved to the nearest value that passes that check — its refusal changes to another one or none
    (Kolibri-1.1's "`head_dim` that is a multiple of 16": 8 becomes 16; "`index_num_heads` must be between 1
    and the number of query heads of key head 0": 4 becomes 2 of the tiny 4 / 2 heads). Checks run in order, so
    each step passes one more. `out` is left as it was where the configuration still refuses it."""
    before = copy.deepcopy(out)
    why = _rejection(model_type, out)
    seen = {why}
    for _ in range(tries):
        if why is None:
            return
        step = _asked(why, d, out) or _nearest_passing(model_type, d, out, why, seen)
        if step is None:
            break
        _assign(out, d, *step)
        why = _rejection(model_type, out)
        seen.add(why)
    if why is not None:
        out.clear()
        out.update(before)


def _nearest_passing(
    model_type: str, d: dict[str, Any], out: dict[str, Any], why: str, seen: set[str | None]
) -> tuple[str, str, int] | None:
    """(key, where, value): a number refusal `why` names (a key of `d`, in the order named), doubled up to its
    default or halved down to 1, nearest first, whose refusal is new (not one of `seen`) or none."""
    for key in dict.fromkeys(re.findall(r"[A-Za-z_]\w*", why)):
        where = _locate(key, d)
        value = _current(key, where, d, out) if where is not None else None
        if not (_int(value) and value > 0):
            continue
        default = d[key] if where == "" else d[where].get(key)
        top = default if _int(default) and default > value else 256
        ups = [value * 2**i for i in range(1, 12) if value * 2**i <= top]
        downs = [value // 2**i for i in range(1, 12) if value // 2**i >= 1]
        for trial in ups + downs:
            t = copy.deepcopy(out)
            _assign(t, d, key, where, trial)
            if _rejection(model_type, t) not in seen:
                return key, where, trial
    return None


def _fill_unset_numbers(model_type: str, d: dict[str, Any], out: dict[str, Any]) -> None:
    """Numbers (``int | None`` fields) a default leaves None yet its model reads as numbers: Qwen4-Exp's
    configuration calls its indexer's sizes optional ("setting this enables QSA") while its attention always
    builds the indexer from them (``None // None``). Only where the model refuses to be built so; each gets its
    tiny size by key name (:func:`_tiny_value`) or a small count, and the configuration's checks are then
    satisfied (:func:`_satisfy`). Token ids (None: no such token) are not numbers of this kind."""
    unset = _unset_numbers(model_type, d, out)
    if not unset:
        return
    why = _build_refusal(model_type, out)
    if why is None or "NoneType" not in why:
        return
    trial = copy.deepcopy(out)
    for key, where in unset:
        _assign(trial, d, key, where, _tiny_value(key, 1 << 20, d, TINY_VOCAB) or EXPERTS)
    _satisfy(model_type, d, trial)
    if _build_refusal(model_type, trial) is None:
        out.clear()
        out.update(trial)


def _unset_numbers(model_type: str, d: dict[str, Any], out: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, where) of each ``int | None`` field of the configuration and its sub-configurations that the default
    `d` and the overrides `out` leave None, token ids apart."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = []
    parts = [("", model_type, d)]
    parts += [
        (k, v["model_type"], v) for k, v in d.items() if isinstance(v, dict) and v.get("model_type") in CONFIG_MAPPING
    ]
    for where, mt, part in parts:
        notes = {
            k: str(t)
            for c in reversed(CONFIG_MAPPING[mt].__mro__)
            for k, t in vars(c).get("__annotations__", {}).items()
        }
        for k, v in part.items():
            note = notes.get(k, "")
            number = re.search(r"\bint\b", note) is not None and "None" in note and "list" not in note
            if v is None and number and "token" not in k and _current(k, where, d, out) is None:
                found.append((k, where))
    return found


def _layer_kinds(cfg: Any) -> list[str] | None:
    """The kind of each layer of configuration `cfg` (transformers' ``layer_types`` convention, which hybrid
    configurations follow whether they store the list — ``layer_types``, ``layers_block_type`` — or derive it
    from a period and offset, indices or a repeating ``block_types``): None where it names none."""
    kinds = getattr(cfg, "layer_types", None)
    return list(kinds) if _strings(kinds) else None


def _keep_derived_kinds(
    model_type: str, d: dict[str, Any], out: dict[str, Any], kinds: list[str] | None, per_kind: int = 1
) -> None:
    """Layer kinds a configuration derives from a period and an offset (Jamba's ``attn_layer_period`` /
    ``attn_layer_offset``: layer *i* attends where *i* mod period = offset): the tiny layer count alone would
    drop the attention layers, so each ``…_period`` / ``…_offset`` pair is searched, smallest first, for the one
    that gives the kept layers their default kinds (:func:`_kept_layers`), checked by building the
    configuration. Nothing where the tiny configuration already has every kind of the default's."""
    layers = _layer_count(d)
    keep = _kept_layers(layers, kinds, per_kind, _layer_sections(d))
    if not keep or kinds is None or len(kinds) != layers:
        return
    want = [kinds[i] for i in keep]
    if set(_tiny_kinds(model_type, out) or ()) == set(want):
        return
    for pk in [k for k in d if k.endswith("_period") and _int(d[k]) and _int(d.get(k[: -len("period")] + "offset"))]:
        ok = pk[: -len("period")] + "offset"
        for period in range(1, len(keep) + 1):
            for offset in range(period):
                trial = {**out, pk: period, ok: offset}
                if _tiny_kinds(model_type, trial) == want:
                    out.update({pk: period, ok: offset})
                    return


def _tiny_kinds(model_type: str, overrides: dict[str, Any]) -> list[str] | None:
    """The layer kinds of `model_type`'s configuration with `overrides` (None where it refuses them)."""
    try:
        return _layer_kinds(_configured(model_type, overrides))
    except Exception:  # noqa: BLE001 - a refused trial is not the one searched for
        return None


def _keep_chunks(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Chunk lengths (``…chunk…`` keys) at the default's, where the configuration refuses the tiny ones
    (VibeVoice-ASR's audio chunks must be a multiple of its hop length): the tiny sequence never fills a chunk."""
    for k in list(out):
        if "chunk" in k and _int(d.get(k)):
            out[k] = d[k]


def _refused(model_type: str, overrides: dict[str, Any]) -> bool:
    """Whether `model_type`'s configuration refuses `overrides` (its own validation: a strict dataclass)."""
    return _rejection(model_type, overrides) is not None


def _hidden_sizes(d: dict[str, Any]) -> dict[int, int]:
    """{default hidden size: its tiny size} over a configuration and its nested sub-configurations (a composite's
    text, vision and audio parts), for widths that must match one of them (:func:`_keep_widths_equal_to_hidden`)."""
    out = {v: min(v, HIDDEN) for k, v in d.items() if k in _HIDDEN_KEYS and _int(v) and v > HIDDEN}
    for v in d.values():
        if isinstance(v, dict) and "model_type" in v:
            out.update({**_hidden_sizes(v), **out})
    return out


def _tiny_dict(
    d: dict[str, Any],
    vocab: int,
    hiddens: dict[int, int] | None = None,
    kinds: list[str] | None = None,
    per_kind: int = 1,
) -> dict[str, Any]:
    """:func:`tiny_overrides` of one configuration dict; a nested sub-configuration (Fuyu's ``text_config``, a
    dict with its own ``model_type``) is shrunk the same way and written back whole. `hiddens`: the hidden sizes
    of the whole configuration (:func:`_hidden_sizes`; this dict's own when None); `kinds`: its layers' kinds
    (:func:`_layer_kinds`), of which the tiny model keeps one layer each (:func:`_kept_layers`)."""
    hiddens = _hidden_sizes(d) if hiddens is None else hiddens
    out: dict[str, Any] = {}
    layers = _layer_count(d)
    sections = _layer_sections(d)
    keep = _kept_layers(layers, kinds, per_kind, sections)
    for k, v in d.items():
        if keep and k in _LAYER_KEYS and v == layers:
            out[k] = len(keep)  # LAYERS, or more where one layer of each kind needs more
        elif keep and k in sections:
            out[k] = sum(sections[k][0] <= i < sections[k][1] for i in keep)  # the kept layers of the section
        elif keep and k.endswith("_layers") and (ids := _renumbered_layers(v, keep, kinds, layers)) is not None:
            out[k] = ids  # layer indices (Kolibri's index_layers, kv_source_layers)
        elif _int(v) and v > 0:
            new = _tiny_value(k, v, d, vocab)
            if new is not None and new != v:
                out[k] = new
        elif isinstance(v, list) and v and all(_int(x) and x > 0 for x in v) and _tiny_list(k, v) is not None:
            out[k] = _tiny_list(k, v)
        elif keep and isinstance(v, list) and len(v) == layers and not _is_layer_pattern(v):
            out[k] = [_tiny_value(k, v[i], d, vocab) or v[i] if _int(v[i]) else v[i] for i in keep]
        elif keep and isinstance(v, dict) and v and all(isinstance(i, str) and i.isdigit() for i in v):
            out[k] = _per_layer_dict(v, keep, d, vocab)  # {layer index: overrides} (Gemma-4's per_layer_config)
        elif isinstance(v, dict) and "model_type" in v:
            sub = _tiny_dict(v, vocab, hiddens)
            if sub:
                out[k] = {**v, **sub}
    for k, v in d.items():
        if layers is None and k.endswith(("block_type", "layer_types")) and _strings(v) and len(v) > LAYERS:
            out[k] = list(dict.fromkeys(v))  # layers named by a pattern only (Nemotron-H): one of each kind
    _keep_products(d, out)
    _keep_widths_equal_to_hidden(d, out, hiddens)
    _fill_unset_heads(d, out)
    _fill_unset_layer_kinds(d, out, layers)
    _fill_rope(d, out)
    _axial_positions(d, out)
    if "vocab_size" in d and d["vocab_size"] is None:
        out["vocab_size"] = vocab  # ESM's default leaves it to the tokenizer
        _fill_unset_token_ids(d, out)
    if d.get("default_language", "") is None and d.get("languages"):
        out["default_language"] = list(d["languages"])[0]  # X-MOD's adapters need a language for unnamed input
    if keep and _int(d.get("num_kv_shared_layers")) and d["num_kv_shared_layers"] > 0:
        out["num_kv_shared_layers"] = 0  # two layers cannot both produce and reuse each attention kind's cache
    if any(_int(d.get(k)) for k in _EXPERT_KEYS) or _int(d.get("moe_intermediate_size")):
        # a mixture of experts whose default leaves its expert count or top-k unset (DeepSeek-V2's top-k,
        # Dots1's both): the tiny sizes
        out.update({k: EXPERTS for k in _EXPERT_KEYS if k in d and d[k] is None})
        out.update({k: 2 for k in _TOPK_KEYS if k in d and d[k] is None})
        if "n_shared_experts" in d and d["n_shared_experts"] is None:
            out["n_shared_experts"] = 1
    for k, v in d.items():  # per-layer patterns written as [[pattern, repeats], …] (GPT-Neo's attention_types)
        if layers and _is_layer_pattern(v) and sum(len(p) * n for p, n in v) == layers:
            out[k] = [[p, max(1, LAYERS // len(p))] for p, n in v[:1]]
    for k, v in d.items():  # special tokens beyond the tiny vocabulary: the last token
        if k.endswith("token_id") and _int(v) and v >= vocab:
            out[k] = vocab - 1
        elif k.endswith("token_id") and isinstance(v, list) and any(_int(x) and x >= vocab for x in v):
            out[k] = [min(x, vocab - 1) for x in v]
    return out


def _fill_unset_token_ids(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Special-token ids (``…token_id``) left None by a default that leaves its vocabulary to the tokenizer
    (ESM's, whose embeddings mask ``input_ids.ne(pad_token_id)``): the tokenizer's too, so each gets a small id
    of its own, distinct from the ids the default sets, in the default's key order."""
    taken = {v for k, v in d.items() if k.endswith("token_id") and _int(v)}
    free = (i for i in range(TINY_VOCAB) if i not in taken)
    for k, v in d.items():
        if k.endswith("token_id") and v is None:
            out[k] = next(free)


def _fill_unset_heads(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Head sizes a default leaves ``None`` yet its model reads as numbers (HunYuan's and Ministral's
    ``head_dim``, Nemotron's ``num_key_value_heads``): what an unset value means elsewhere in transformers,
    hidden / heads and one key/value head per query head."""
    heads = out.get("num_attention_heads", d.get("num_attention_heads"))
    hidden = out.get("hidden_size", d.get("hidden_size"))
    if not (_int(heads) and _int(hidden) and heads > 0):
        return
    if "head_dim" in d and d["head_dim"] is None:
        out["head_dim"] = hidden // heads
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None:
        out["num_key_value_heads"] = heads


_NAMED_KEYS = _LAYER_KEYS | _HEAD_KEYS | _KV_HEAD_KEYS | _FFN_KEYS | _EXPERT_KEYS | _POSITION_KEYS | _HEAD_DIM_KEYS


def _keep_widths_equal_to_hidden(d: dict[str, Any], out: dict[str, Any], hiddens: dict[int, int]) -> None:
    """A width the default sets equal to a hidden size of the configuration (`hiddens`: its own or a nested
    part's) follows that hidden size's tiny value: such models add or check one against the other (xLSTM's
    ``embedding_dim``, Dots3-Note's vision adapter widths, Nemotron-3.5-Transcribe's ``audio_hidden_size``,
    OPT's ``word_embed_proj_dim``: equal, no projection), or a ``…hidden…`` width twice it (Zamba's
    ``attention_hidden_size``: its shared attention reads the hidden state and the embeddings side by side).
    Only ``…_dim`` / ``…_size`` keys no other rule names (not head sizes, feed-forward widths, positions,
    vocabularies, kernels)."""
    for k, v in d.items():
        if (
            _int(v)
            and k not in _HIDDEN_KEYS | _NAMED_KEYS
            and k.endswith(("_dim", "_size"))
            and "vocab" not in k
            and "kernel" not in k
        ):
            if v in hiddens:
                out[k] = hiddens[v]
            elif "hidden" in k and v % 2 == 0 and v // 2 in hiddens and hiddens[v // 2] < v // 2:
                out[k] = 2 * hiddens[v // 2]


def _axial_positions(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Axial position embeddings (Reformer's): the per-axis widths (``axial_pos_embds_dim``, summing to the
    hidden size) scaled to the tiny hidden size, the axes (``axial_pos_shape``, whose product a training
    sequence must equal) factors of :data:`TINY_SEQ`, and attention chunks (``…_chunk_length``, which a training
    sequence must be a multiple of) half of it: the tiny model trains on sequences of :data:`TINY_SEQ`."""
    dims, shape = d.get("axial_pos_embds_dim"), d.get("axial_pos_shape")
    hidden = d.get("hidden_size")
    if not (isinstance(dims, list) and isinstance(shape, list) and _int(hidden) and sum(dims) == hidden):
        return
    tiny = out.get("hidden_size", hidden)
    scaled = [max(1, x * tiny // hidden) for x in dims]
    out["axial_pos_embds_dim"] = [*scaled[:-1], tiny - sum(scaled[:-1])]
    out["axial_pos_shape"] = [2] * (len(shape) - 1) + [TINY_SEQ // 2 ** (len(shape) - 1)]
    for k, v in d.items():
        if k.endswith("chunk_length") and _int(v) and v > TINY_SEQ // 2:
            out[k] = TINY_SEQ // 2


def _fill_unset_layer_kinds(d: dict[str, Any], out: dict[str, Any], layers: int | None) -> None:
    """``layer_types`` a default leaves None yet its model reads per layer (LFM2-MoE): what an unset pattern means
    where transformers fills it (LFM2's, Cohere-Compass' configurations), every layer ``full_attention``."""
    if "layer_types" in d and d["layer_types"] is None and _int(layers):
        out["layer_types"] = ["full_attention"] * min(layers, LAYERS)


def _fill_rope(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Rotary settings a default leaves out yet its model reads: an empty per-layer-kind ``rope_parameters``
    (Cohere-Compass') gets transformers' default rotary (``rope_theta`` 10000) for each kind its ``layer_types``
    names; a nested attention configuration (DBRX's ``attn_config``) without ``rope_theta``
    gets the one of the configuration's own ``rope_parameters``."""
    rope = d.get("rope_parameters")
    kinds = out.get("layer_types", d.get("layer_types"))
    if rope == {} and _strings(kinds):  # empty: a kind left out of a non-empty one is a layer without rotary
        out["rope_parameters"] = {k: {"rope_type": "default", "rope_theta": 10000.0} for k in dict.fromkeys(kinds)}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    for k, v in d.items():
        if k.endswith("attn_config") and isinstance(v, dict) and "rope_theta" not in v and theta is not None:
            out[k] = {**v, **out.get(k, {}), "rope_theta": theta}


def _rotary_factors(d: dict[str, Any]) -> list[float]:
    """The partial rotary factors of a configuration: its own, its ``rope_parameters``' and each layer kind's."""
    rope = d.get("rope_parameters")
    found = [d.get("partial_rotary_factor")]
    if isinstance(rope, dict):
        found.append(rope.get("partial_rotary_factor"))
        found += [v.get("partial_rotary_factor") for v in rope.values() if isinstance(v, dict)]
    return [f for f in found if isinstance(f, float) and 0.0 < f < 1.0]


def _keep_rotary_quads(d: dict[str, Any], out: dict[str, Any]) -> None:
    """A partial rotary factor that rotates a multiple of four of the default's ``head_dim`` dims keeps doing so
    tiny, where the configuration refuses the tiny sizes (NeoMME's refuses anything else: its two M-RoPE axes
    take frequencies in alternating pairs): the tiny head grows to the least size, up to the default's, where
    every factor rotates a multiple of four. The factors themselves (the architecture) stay."""
    full, tiny = d.get("head_dim"), out.get("head_dim")
    factors = _rotary_factors(d)
    if not (_int(full) and _int(tiny) and factors):
        return

    def quads(h: int) -> bool:
        return all((h * f) % 4 == 0 for f in factors)

    if quads(full) and not quads(tiny):
        out["head_dim"] = next((h for h in range(tiny, full + 1) if quads(h)), full)


def _strings(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)


def _keep_products(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Keep ``heads × head size = hidden × expand`` where the default has it (Mamba-2's state-space heads:
    its configuration refuses anything else): the head size follows the tiny width and head count; and a
    latent-attention query head as its two parts (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``)."""
    parts = ("qk_nope_head_dim", "qk_rope_head_dim")  # multi-head latent attention: a query head is both parts
    if (
        _int(d.get("qk_head_dim"))
        and all(_int(d.get(k)) for k in parts)
        and d["qk_head_dim"] == sum(d[k] for k in parts)
    ):
        out["qk_head_dim"] = sum(out.get(k, d[k]) for k in parts)
    hidden = next((k for k in _HIDDEN_KEYS if _int(d.get(k))), None)
    expand = d.get("expand")
    if hidden is None or not _int(expand):
        return
    for h in [k for k in d if k.endswith(("num_heads", "n_heads")) and _int(d[k])]:
        for hd in [k for k in d if k.endswith("head_dim") and _int(d[k])]:
            if d[h] * d[hd] == d[hidden] * expand and h.split("num_heads")[0] == hd.split("head_dim")[0]:
                n = out.get(h, d[h])
                out[hd] = max(1, out.get(hidden, d[hidden]) * expand // n)


def _layer_count(d: dict[str, Any]) -> int | None:
    """The default's layer count: the first of its ``_LAYER_KEYS`` it sets to an integer (None: none)."""
    return next((d[k] for k in _LAYER_KEYS if _int(d.get(k))), None)


def _layer_sections(d: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Sections a configuration cuts its layers into, by counts (Dory's ``n_input_layers``,
    ``n_recurrent_layers``, ``n_output_layers``: input layers, a block looped over, output layers): {key: (first
    layer, end)}, in the configuration's key order, where two or more ``…_layers`` counts other than the layer
    count itself add up to it; empty where none do."""
    layers = _layer_count(d)
    counts = {k: v for k, v in d.items() if k.endswith("_layers") and k not in _LAYER_KEYS and _int(v) and v >= 0}
    if not layers or len(counts) < 2 or sum(counts.values()) != layers:
        return {}
    out, start = {}, 0
    for k, v in counts.items():
        out[k] = (start, start + v)
        start += v
    return out


def _kept_layers(
    layers: int | None,
    kinds: list[str] | None = None,
    per_kind: int = 1,
    sections: dict[str, tuple[int, int]] | None = None,
) -> list[int] | None:
    """Which of a default's `layers` the tiny model keeps, for per-layer lists (``layer_types``, Gemma-3n's
    per-layer ``intermediate_size``): the first ``LAYERS - 1`` and the last, so a pattern that ends its period
    with another kind of layer (five sliding-window layers, then a full one) keeps both kinds; and, where
    `kinds` (each layer's kind, :func:`_layer_kinds`) names a kind those miss, the first layer of that kind too
    (a hybrid's one attention layer in six: HF's cache needs one), or its first `per_kind`; and the first layer
    of each of its `sections` (:func:`_layer_sections`) those miss, so that every section keeps a layer (Dory's
    looped block). None where the default has no more layers than the tiny model."""
    if not layers or layers <= LAYERS:
        return None
    keep = {*range(LAYERS - 1), layers - 1}
    if kinds is not None and len(kinds) == layers:
        have = {kinds[i] for i in keep}
        keep |= {i for k in dict.fromkeys(kinds) if k not in have for i in _first(kinds, k, per_kind)}
    for start, end in (sections or {}).values():
        if end > start and not any(start <= i < end for i in keep):
            keep.add(start)
    return sorted(keep)


def _renumbered_layers(v: Any, keep: list[int], kinds: list[str] | None, layers: int) -> list[int] | None:
    """A default's list of layer indices renumbered to the `keep` layers; None where `v` is not one. Two forms:
    a per-layer list of sources (Kolibri's ``kv_source_layers``: entry i names a layer at or before i that is
    its own source) keeps each kept layer's entry; an increasing list (``index_layers``, ``mlp_only_layers``)
    keeps its members. A dropped layer stands for the kept layer of its kind (the tiny model keeps one of
    each, :func:`_kept_layers`), else is left out (a source: the layer itself); an increasing list none of whose
    members stays is left as it is (RT-DETR's ``encode_proj_layers`` count feature levels, not these layers).
    A per-layer list of flags (SmolLM3's ``no_rope_layers``, entry 0 = 1) is neither."""
    if not (isinstance(v, list) and v and all(_int(x) and 0 <= x < layers for x in v)):
        return None
    new = {old: i for i, old in enumerate(keep)}

    def stand(j: int) -> int | None:
        if j in new:
            return new[j]
        if kinds is not None and len(kinds) == layers:
            return next((new[i] for i in keep if kinds[i] == kinds[j]), None)
        return None

    if len(v) == layers and all(v[i] <= i and v[v[i]] == v[i] for i in range(layers)):
        return [s if (s := stand(v[i])) is not None else new[i] for i in keep]
    kept = sorted({s for j in v if (s := stand(j)) is not None})
    return kept if kept and all(a < b for a, b in zip(v, v[1:])) else None


def _first(kinds: list[str], kind: str, n: int) -> list[int]:
    """The indices of the first `n` layers of `kind`."""
    return [i for i, k in enumerate(kinds) if k == kind][:n]


def _per_layer_dict(v: dict[str, Any], keep: list[int], d: dict[str, Any], vocab: int) -> dict[str, Any]:
    """A ``{layer index: value}`` dict renumbered to the kept layers (entries of dropped layers dropped), each
    value shrunk as a configuration of its own."""
    out = {}
    for new, old in enumerate(keep):
        entry = next((e for i, e in v.items() if int(i) == old), None)
        if entry is not None:
            out[str(new)] = {**entry, **_tiny_dict(entry, vocab)} if isinstance(entry, dict) else entry
    return out


def _tiny_value(key: str, v: int, d: dict[str, Any], vocab: int) -> int | None:
    """The tiny value of integer key `key` (default `v`), or None to keep it."""
    if key in _LAYER_KEYS:
        return min(v, LAYERS)
    if key in _HIDDEN_KEYS:
        return min(v, HIDDEN)
    if key in _HEAD_KEYS:
        return min(v, HEADS)
    if key in _KV_HEAD_KEYS:
        q = max((d[k] for k in _HEAD_KEYS if _int(d.get(k))), default=v)
        if v == 1:
            return 1  # multi-query attention stays multi-query
        return HEADS if v >= q else min(v, HEADS // 2)
    if key in ("n_group", "num_expert_group", "num_expert_groups", "n_groups_routed", "n_groups"):
        return min(v, 2)  # expert groups (DeepSeek's routing), state-space groups: divide the tiny counts
    if key in ("topk_group", "num_limited_groups"):
        return 1
    if key.endswith("_heads") or key.endswith("n_heads"):
        return min(v, HEADS)  # a state-space head count (Mamba-2's mamba_n_heads) dividing the tiny width
    if key in _FFN_KEYS:
        return min(v, FFN)
    if key in _HEAD_DIM_KEYS:
        return min(v, HIDDEN // HEADS)
    if key in _EXPERT_KEYS:
        return min(v, EXPERTS)
    if key in _TOPK_KEYS:
        return min(v, 2)
    if key in _POSITION_KEYS:
        return min(v, POSITIONS)
    if key.startswith("vocab_size") or key.endswith("_vocab_size"):
        return min(v, vocab)  # also a per-layer input vocabulary (Gemma-3n's vocab_size_per_layer_input)
    if key.startswith("hidden_size_"):
        return min(v, HIDDEN // 2)  # a per-layer input width (hidden_size_per_layer_input)
    if key == "image_size":
        return min(v, TINY_IMAGE)
    if ("rope" in key or "rotary" in key or key.endswith("head_dim")) and key.endswith(("_dim", "_size")):
        return min(v, HIDDEN // HEADS)  # a rotary part of a head (GPT-J's rotary_dim, MLA's qk_rope_head_dim)
    if "kernel" in key and key.endswith("_size") and v > 64:
        return 16 + v % 2  # a convolution's kernel keeps its parity: an odd one keeps "same" padding (Nyströmformer)
    if key.endswith(("_rank", "_dim", "_size", "_channels")) and v > 64 and "vocab" not in key:
        return 16  # a low-rank projection (MLA's kv_lora_rank), a rope/nope split, a state size: small
    return None


def _is_layer_pattern(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], list) and _int(x[1]) for x in v)
    )


def no_dropout(model_type: str) -> dict[str, float]:
    """Every dropout probability of `model_type`'s default configuration set to 0 (keys naming dropout or LayerDrop)."""
    d = default_config(model_type)[0].to_dict()
    drops = ("dropout", "pdrop", "layerdrop")  # LayerDrop skips whole layers at random: dropout too
    return {k: 0.0 for k, v in d.items() if any(x in k for x in drops) and isinstance(v, float) and v > 0}


def _tiny_list(key: str, v: list[int]) -> list[int] | None:
    """Per-stage lists of vision models: fewer channels and blocks, as many stages."""
    if key in ("depths", "num_layers", "layer_depths", "depth"):
        return [1] * len(v)
    if key in ("hidden_sizes", "embed_dims", "embed_dim", "dims", "hidden_dims", "widths", "channels"):
        return [min(x, 16 * (2**i)) for i, x in enumerate(v)]
    if key in ("num_heads", "num_attention_heads", "heads"):
        return [min(x, 2) for x in v]
    return None


# ------------------------------------------------------------------------------------------- building


class HFImageLoss(nn.Module):
    """``model(pixel_values=…, labels=…).loss``: HF's own loss for an image classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values, labels=labels).loss


def attention(family: Family, attn: str) -> str:
    """`attn`, or ``eager`` where the family's class has no sdpa path (GPT-Neo): its only attention."""
    import transformers

    cls = getattr(transformers, family.class_name)
    return "eager" if attn == "sdpa" and getattr(cls, "_supports_sdpa", True) is False else attn


def text_config(cfg: Any) -> Any:
    """A composite configuration's text part; its decoder's where it has a text encoder too (MusicGen's)."""
    try:
        return cfg.get_text_config()
    except ValueError:  # several text configurations
        return cfg.get_text_config(decoder=True)


def config_for(family: Family, overrides: dict[str, Any], *, use_cache: bool = False, attn: str | None = "sdpa") -> Any:
    """The family's configuration: the library default, `overrides`, ``use_cache`` (where the configuration
    has it) and the attention implementation (None: the library's choice)."""
    from meshpilot.models.sources import hf_config

    over = dict(overrides)
    if attn is not None:
        over["attn_implementation"] = attention(family, attn)
    cfg = hf_config(family.model_type, over)
    for c in {id(cfg): cfg, id(text := text_config(cfg)): text}.values():  # a composite's text model too
        if hasattr(c, "use_cache"):
            c.use_cache = use_cache
    if family.kind == "causal" and not cfg.is_encoder_decoder:
        cfg.is_decoder = True  # an encoder's causal head (BERT's, Reformer's) is a decoder: causal masks
    decoder = getattr(cfg, "decoder", None)
    if cfg.is_encoder_decoder and getattr(cfg, "pad_token_id", None) is None and hasattr(decoder, "pad_token_id"):
        # a composite of two models (EncoderDecoderModel) shifts its labels with a pad id of its own: its decoder's
        cfg.pad_token_id = decoder.pad_token_id if decoder.pad_token_id is not None else 0
    if cfg.is_encoder_decoder and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else 0
    return cfg


def build(
    family: Family,
    overrides: dict[str, Any] | None = None,
    *,
    use_cache: bool = False,
    attn: str | None = "sdpa",
    batch: int = TINY_BATCH,
    seq: int = TINY_SEQ,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The family's model (train mode, seeded; tiny by default: :func:`tiny_overrides`) wrapped in HF's own
    loss, and its example inputs: ``(input_ids, labels)`` of random tokens and the further inputs the model
    needs (:func:`extra_inputs`, :func:`text_inputs`), or for an image classifier
    ``(pixel_values, labels)``. On ``meta`` the inputs are empty meta tensors."""
    import transformers

    if overrides is None:
        overrides = tiny_overrides(family.model_type)
    cfg = config_for(family, overrides, use_cache=use_cache, attn=attn)
    cls = getattr(transformers, family.class_name)
    wants = getattr(cls, "config_class", None)
    if wants is not None and not isinstance(cfg, wants) and isinstance(text_config(cfg), wants):
        cfg = text_config(cfg)  # a text head mapped to the composite's type (Emu3ForCausalLM): its text part
    torch.manual_seed(seed)
    try:
        try:
            with torch.device(device):
                model = cls(cfg)
        except ValueError as e:
            if attn != "sdpa" or "scaled_dot_product_attention" not in str(e):
                raise
            # a part of the model without an sdpa path (VibeVoice-ASR's acoustic tokenizer): eager attention,
            # as attention() gives a family whose own class has none
            return build(family, overrides, use_cache=use_cache, attn="eager", batch=batch, seq=seq,
                         device=device, seed=seed)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a configuration the model cannot be built from: one line
        msg = first_line(e, type(e).__name__)
        raise UserError(f"{family.name}: cannot be built from its tiny config ({msg})") from None
    model.train()
    meta = torch.device(device).type == "meta"
    g = torch.Generator().manual_seed(seed + 1)
    if family.kind == "image":
        pixels = pixel_shape(cfg, batch)
        classes = max(int(getattr(cfg, "num_labels", 2)), 1)
        if meta:
            return HFImageLoss(model), (
                torch.empty(pixels, device="meta"),
                torch.empty(batch, dtype=torch.long, device="meta"),
            )
        pix = torch.randn(pixels, generator=g)
        return HFImageLoss(model), (pix, torch.randint(0, classes, (batch,), generator=g))
    from meshpilot.models.sources import HFLoss

    extra = extra_inputs(family, cfg)
    frames = audio_frames(model, cfg, seq) if "input_features" in extra else None
    return HFLoss(model, tuple(extra)), text_inputs(cfg, extra, batch, seq, g, meta, frames)


def extra_inputs(family: Family, cfg: Any) -> list[str]:
    """The keyword inputs beyond ``(input_ids, labels)`` that `family`'s forward needs, read from its signature,
    its configuration and its module's source, never from its name:

    * ``attention_mask`` where the module makes its default mask only when not traced (``attention_mask is None
      and not is_torchdynamo_compiling()``): capture takes the tracing branch, where LongT5's and
      SwitchTransformers' encoders then read a mask that is None; the all-ones mask is the one eager makes;
    * ``pixel_values`` for a causal LM with a vision configuration whose forward takes them and whose loss skips
      the image's tokens (GIT's ``image_patch_tokens``): without an image the logits are shorter than that;
    * ``input_features`` for a model with an audio configuration whose forward refuses to run without audio
      (Voxtral-Realtime: ``exactly one of input_features``), mel frames of random values, as many as give one
      audio embedding per text token (:func:`audio_frames`)."""
    import inspect

    import transformers

    cls = getattr(transformers, family.class_name)
    params = inspect.signature(cls.forward).parameters
    out = []
    if "attention_mask" in params and _module_source_has(
        cls, "attention_mask is None and not is_torchdynamo_compiling"
    ):
        out.append("attention_mask")
    if (
        family.kind == "causal"
        and "pixel_values" in params
        and getattr(cfg, "vision_config", None) is not None
        and _module_source_has(cls, "image_patch_tokens")
    ):
        out.append("pixel_values")
    if (
        "input_features" in params
        and getattr(cfg, "audio_config", None) is not None
        and _module_source_has(cls, "exactly one of input_features")
    ):
        out.append("input_features")
    return out


def audio_frames(model: nn.Module, cfg: Any, seq: int) -> int:
    """Mel frames whose audio embeddings are one per text token, for a model that adds them to the token
    embeddings one for one (Voxtral-Realtime): `seq` times the configuration's ``downsample_factor`` (the
    embeddings it concatenates per token) times the strides of the audio tower's 1-D convolutions."""
    towers = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "audio_tower"]
    convs = [m for m in towers[0].modules() if isinstance(m, nn.Conv1d)] if towers else []
    return seq * int(getattr(cfg, "downsample_factor", 1) or 1) * math.prod(int(c.stride[0]) for c in convs)


def _module_source_has(cls: type, text: str) -> bool:
    """Whether the source file of `cls`'s module contains `text`."""
    import sys

    return text in _source(getattr(sys.modules.get(cls.__module__), "__file__", None))


@functools.cache
def _source(path: str | None) -> str:
    """The text of a module's source file, read once ("" when there is none)."""
    if path is None:
        return ""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


def pixel_shape(cfg: Any, batch: int) -> tuple[int, int, int, int]:
    """``(batch, channels, size, size)`` of the images configuration `cfg` (an image model's, or a vision
    part's) takes: its ``image_size`` (the first side where it gives two) and ``num_channels``."""
    size = getattr(cfg, "image_size", TINY_IMAGE)
    size = size[0] if isinstance(size, (list, tuple)) else size
    return (batch, getattr(cfg, "num_channels", 3), size, size)


def text_inputs(
    cfg: Any, extra: list[str], batch: int, seq: int, g: torch.Generator, meta: bool, frames: int | None = None
) -> tuple[torch.Tensor, ...]:
    """``(input_ids, labels, *extra)`` of random tokens for configuration `cfg` (empty meta tensors on `meta`).

    A model of several codebooks per step (MusicGen: ``num_codebooks``) takes its ids codebook-major per sample,
    ``(batch * codebooks, seq)``, and its labels ``(batch, seq, codebooks)``. A model whose decoder answers one
    query per position (Perceiver's masked LM, a latent model: ``num_latents``) reads sequences of
    ``max_position_embeddings`` tokens, the length of its logits."""
    text = text_config(cfg)
    vocab = int(getattr(cfg, "vocab_size", None) or text.vocab_size)  # a composite's: its text part's
    books = getattr(text, "num_codebooks", None)
    if _int(getattr(cfg, "num_latents", None)) and _int(getattr(cfg, "max_position_embeddings", None)):
        seq = cfg.max_position_embeddings
    ids_shape = (batch * books, seq) if _int(books) else (batch, seq)
    label_shape = (batch, seq, books) if _int(books) else (batch, seq)
    shapes = [(ids_shape, torch.long), (label_shape, torch.long)]
    for name in extra:
        if name == "attention_mask":
            shapes.append(((batch, seq), torch.long))
        elif name == "pixel_values":
            shapes.append((pixel_shape(cfg.vision_config, batch), torch.float32))
        elif name == "input_features":  # (batch, mel bins, frames): `frames` of audio_frames
            shapes.append(((batch, cfg.audio_config.num_mel_bins, frames), torch.float32))
    if meta:
        return tuple(torch.empty(s, dtype=dt, device="meta") for s, dt in shapes)
    out = []
    for name, (shape, dt) in zip(["input_ids", "labels", *extra], shapes):
        if name == "attention_mask":
            out.append(torch.ones(shape, dtype=dt))
        elif dt.is_floating_point:
            out.append(torch.randn(shape, generator=g))
        else:
            out.append(torch.randint(0, vocab, shape, generator=g))
    return tuple(out)


# ------------------------------------------------------------------------------------------- planning


@dataclass
class Outcome:
    """What planning one family did: ``status`` is ``planned`` (no fallback), ``fallback`` (planned, some
    node replicated: the first named in `reason`), ``refused`` (capture or planning refused it: `reason`, one
    line), ``unbuilt`` (transformers could not build it tiny) or ``timeout``."""

    family: Family
    status: str
    reason: str = ""
    seconds: float = 0.0
    plan: Any = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "planned"


class _Timeout(BaseException):
    """Out of time: a BaseException, so that no ``except Exception`` of the code it interrupts swallows it."""


@contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_Timeout` after `seconds` of this process' CPU time (SIGPROF: on a shared machine wall time
    counts other processes' turns; main thread only; None: no limit)."""
    if not seconds:
        yield
        return

    def ring(signum, frame):
        raise _Timeout

    old = signal.signal(signal.SIGPROF, ring)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


def one_line(e: BaseException) -> str:
    """An exception as one line (its type when it has no text)."""
    text = " ".join(x.strip() for x in str(e).strip().splitlines())[:400]  # a validator's reason is below
    return text if isinstance(e, UserError) else f"{type(e).__name__}: {text}".rstrip(": ")


_CAPTURE = "cannot capture the model: "


def _eager_too(family: Family, overrides: dict[str, Any] | None, reason: str, **kw: Any) -> str | None:
    """Capture's refusal `reason` as transformers' own failure where the model, built alike on the CPU, raises
    at the same source line in a plain PyTorch forward (no meshpilot in the way: DBRX's ``clamp`` with neither
    bound, a cache the default's layers cannot hold); None where plain PyTorch runs it or fails elsewhere.
    `kw`: :func:`build`'s ``use_cache``, ``attn``, ``seq`` and ``batch``."""
    from meshpilot.graph.capture import _where_raised

    try:
        model, inputs = build(family, overrides, device="cpu", **kw)
        model(*inputs)
    except Exception as e:  # noqa: BLE001 - any failure: is it capture's?
        where = _where_raised(e)
        if where is not None and f"({where})" in reason:
            what = reason.removeprefix(_CAPTURE).split("; check that")[0]
            return f"transformers' own failure, in plain PyTorch too: {what}"
    return None


def try_plan(
    family: Family,
    *,
    use_cache: bool = False,
    attn: str | None = "sdpa",
    mesh_shape: tuple[int, int] = (2, 2),
    cluster: str = "dgx-h100",
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    limit_s: float | None = 120.0,
    seq: int = TINY_SEQ,
    batch: int = TINY_BATCH,
) -> Outcome:
    """Build `family` and plan it on `mesh_shape` of `cluster`; never raises for the model's sake."""
    from meshpilot.planner.auto import plan

    t0 = time.perf_counter()
    try:
        with _deadline(limit_s):
            try:
                model, inputs = build(
                    family, overrides, use_cache=use_cache, attn=attn, device=device, seq=seq, batch=batch
                )
            except UserError as e:
                return Outcome(family, "unbuilt", one_line(e), time.perf_counter() - t0)
            p = plan(model, inputs, cluster, mesh_shape=mesh_shape, mappings=("row",))
    except _Timeout:
        return Outcome(family, "timeout", f"over {limit_s:.0f} s of CPU", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - every refusal is a row of the table
        reason = one_line(e)
        if reason.startswith(_CAPTURE):
            kw = dict(use_cache=use_cache, attn=attn, seq=seq, batch=batch)
            reason = _eager_too(family, overrides, reason, **kw) or reason
        return Outcome(family, "refused", reason, time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    unrunnable = [w for w in p.warnings if "cannot run" in w]  # shard -> partial steps: the plan would not run
    if unrunnable:
        return Outcome(family, "refused", unrunnable[0], dt, p)
    if p.fallbacks:
        return Outcome(family, "fallback", f"{len(p.fallbacks)} replicated: {p.fallbacks[0].line()}", dt, p)
    return Outcome(family, "planned", "", dt, p)


# ------------------------------------------------------------------------------------------- published sizes

# Published sizes as overrides of each model type's library default (the planning-relevant keys of the
# checkpoint's config.json, written down: nothing can be downloaded here). (model type, head class, overrides,
# sequence length). What each tests: head counts the mesh does not divide (gpt2-xl 25, falcon-7b 71, SmolLM 9),
# vocabularies of 150k-256k (Qwen2, BLOOM, Gemma), multi-query attention and parallel attention/MLP blocks
# (Falcon, GPT-J, GPT-NeoX), ALiBi (BLOOM), grouped-query attention (Mistral, Qwen2, Mixtral), experts.
PUBLISHED: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "gpt2-xl": ("gpt2", "GPT2LMHeadModel", dict(n_embd=1600, n_head=25, n_layer=48, n_positions=1024), 1024),
    "gpt-j-6b": (
        "gptj", "GPTJForCausalLM",
        dict(n_embd=4096, n_head=16, n_layer=28, rotary_dim=64, vocab_size=50400, n_positions=2048), 2048,
    ),
    "pythia-6.9b": (
        "gpt_neox", "GPTNeoXForCausalLM",
        dict(hidden_size=4096, num_attention_heads=32, num_hidden_layers=32, intermediate_size=16384,
             vocab_size=50432, use_parallel_residual=True, max_position_embeddings=2048),
        2048,
    ),
    "falcon-7b": (
        "falcon", "FalconForCausalLM",
        dict(hidden_size=4544, num_attention_heads=71, num_hidden_layers=32, vocab_size=65024, multi_query=True,
             parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False),
        2048,
    ),
    "bloom-7b1": (
        "bloom", "BloomForCausalLM", dict(hidden_size=4096, n_head=32, n_layer=30, vocab_size=250880), 2048,
    ),
    "llama-2-7b": (
        "llama", "LlamaForCausalLM",
        dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
             num_hidden_layers=32, vocab_size=32000, max_position_embeddings=4096),
        2048,
    ),
    "mistral-7b": (
        "mistral", "MistralForCausalLM",
        dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             num_hidden_layers=32, vocab_size=32000, sliding_window=4096),
        2048,
    ),
    "qwen2-7b": (
        "qwen2", "Qwen2ForCausalLM",
        dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
             num_hidden_layers=28, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False),
        2048,
    ),
    "gemma-7b": (
        "gemma", "GemmaForCausalLM",
        dict(hidden_size=3072, intermediate_size=24576, num_attention_heads=16, num_key_value_heads=16,
             head_dim=256, num_hidden_layers=28, vocab_size=256000),
        2048,
    ),
    "phi-2": (
        "phi", "PhiForCausalLM",
        dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=32, num_hidden_layers=32,
             vocab_size=51200, max_position_embeddings=2048,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}),
        2048,
    ),
    "stablelm-3b-4e1t": (
        "stablelm", "StableLmForCausalLM",
        dict(hidden_size=2560, intermediate_size=6912, num_attention_heads=32, num_key_value_heads=32,
             num_hidden_layers=32, vocab_size=50304, max_position_embeddings=4096),
        2048,
    ),
    "smollm-135m": (
        "llama", "LlamaForCausalLM",
        dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
             num_hidden_layers=30, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True),
        2048,
    ),
    "gpt-neo-2.7b": (
        "gpt_neo", "GPTNeoForCausalLM",
        dict(hidden_size=2560, num_heads=20, num_layers=32, attention_types=[[["global", "local"], 16]],
             vocab_size=50257, max_position_embeddings=2048),
        2048,
    ),
    "mixtral-8x7b": (
        "mixtral", "MixtralForCausalLM",
        dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             num_hidden_layers=32, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
        2048,
    ),
    "bart-large": (
        "bart", "BartForConditionalGeneration",
        dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
             decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50265),
        1024,
    ),
}  # fmt: skip


def published(name: str) -> tuple[Family, dict[str, Any], int]:
    """(family, overrides, sequence length) of the published model `name` (a key of :data:`PUBLISHED`)."""
    if name not in PUBLISHED:
        raise UserError(f"{name!r}: not a published size here; choose one of {', '.join(PUBLISHED)}")
    model_type, cls, over, seq = PUBLISHED[name]
    kind = "seq2seq" if cls.endswith("ConditionalGeneration") else "causal"
    return Family(model_type, cls, kind), dict(over), seq


def published_config(name: str) -> Any:
    """The transformers configuration of published model `name` (no model built)."""
    fam, over, _ = published(name)
    return config_for(fam, over)
