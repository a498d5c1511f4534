"""Cluster files: TOML in, validated :class:`Cluster` out, and back to TOML.

A cluster file::

    name = "two-nodes"            # optional, defaults to the file's stem
    device = "a100-80gb"          # a device profile: see `meshpilot presets`

    [[layers]]                    # top-down: first the nodes ...
    name = "node"
    ranks = 2                     # R_1
    p2p_GBps = 25.0               # one number (uniform) or an R x R matrix
    group_GBps = 25.0             # one number or a list of R numbers
    latency_us = 5.0

    [[layers]]                    # ... then the GPUs of a node
    name = "gpu"
    ranks = 8
    p2p_GBps = 300.0
    group_GBps = 300.0
    latency_us = 1.0

    [[calibration]]               # optional: measured all-reduce algorithm bandwidths
    mesh = [2, 8]
    B1_GBps = 9.5                 # mesh axis 0; B2_GBps for axis 1; either may be left out
    alpha1_us = 12.0              # optional: measured per-message latency of axis 0 (alpha2_us: axis 1)
    curve1 = [[16384, 310.0], [1048576, 480.0]]   # optional: all-reduce [bytes, microseconds] points of
                                  # axis 0 (curve2: axis 1), bytes ascending; the cost model interpolates them
    busy1 = [[16384, 900.0], [1048576, 700.0]]    # optional: the same all-reduce while every rank computes
                                  # (busy2: axis 1); on CPU devices it slows collectives that overlap compute

Instead of ``device = "<kind>"`` a file may carry measured numbers (``meshpilot probe`` writes them)::

    [device_profile]
    kind = "probed-cpu"           # a name shown in tables; with the word cpu (-separated) a CPU device (gloo)
    peak_tflops_fp32 = 0.05       # the matmul rate the cost model's roofline uses for float32
    peak_tflops_bf16 = 0.9        # optional; without it bfloat16 runs at the float32 rate
    memory_GBps = 12.0
    memory_GiB = 5.8
    compute_efficiency = 1.0      # optional (default 0.6): fraction of peak_tflops that matmuls reach
    memory_efficiency = 1.0       # optional (default 0.8): fraction of memory_GBps that kernels reach
    op_overhead_us = 12.0         # optional (default 0): fixed cost of one operator beyond its roofline
    foreach_overhead_us = 10.0    # optional (default 0): per tensor of one torch._foreach_* operator
    collective_overhead_us = 1500.0   # optional (default 0): host CPU of one collective beyond its bytes
    call_overhead_us = 9.0        # optional (default 0): host time of one call of the runtime's program
    adamw_GBps = 2.0              # optional (default 0): parameter GB/s a foreach AdamW step updates
    adamw_overhead_us = 60.0      # optional (default 0): per parameter tensor of that step
    float8_cast_bytes = 5.0       # optional (default 0): bytes a Float8 product's operand element costs to cast
    attention_tflops = [593.0, 564.0, 1130.0, 1001.0]   # optional: a fused attention kernel's TFLOP/s on
                                  # the whole t x s square: forward, backward, causal forward, causal backward

    [[device_profile.matmul]]     # optional, repeatable: a GEMM [m, k] @ [k, n] measured at this rate
    m = 8192                      # (`meshpilot probe --matmul-shapes-from MODEL`); the cost model prices
    n = 4096                      # each matmul at the nearest measured shape of its dtype
    k = 1024
    dtype = "bfloat16"            # float32, bfloat16, float16 or float8_e4m3fn (float8=linears products)
    tflops = 612.0

Every mistake raises :class:`~meshpilot.errors.ClusterFileError` naming the file, the key and the fix.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from meshpilot.cluster.devices import DEVICES, FLOAT8, AttentionRates, DeviceProfile, MatmulRate
from meshpilot.cluster.topology import GB, Calibration, Cluster, Layer
from meshpilot.errors import ClusterFileError

MAX_DEVICES = 65_536
"""The most devices a cluster may have (files and sized presets): larger ones exhaust memory, not plan."""
MAX_NUMBER = 1e9
"""The largest bandwidth (GB/s), latency (us), rate (TFLOP/s) or size (GiB) a cluster file may give."""
MIN_NUMBER = 1e-6
"""The smallest non-zero number a cluster file may give in its units (1 KB/s, 1 fs, 1 MFLOP/s, 1 KiB, an
efficiency of one in a million): below it a value is a unit mistake, shown as 0 and dividing by almost zero."""

TOP_KEYS = {"name", "device", "device_profile", "layers", "calibration"}
LAYER_KEYS = {"name", "ranks", "p2p_GBps", "group_GBps", "latency_us"}
CALIBRATION_KEYS = {"mesh", "B1_GBps", "B2_GBps", "alpha1_us", "alpha2_us", "curve1", "curve2", "busy1", "busy2"}
CALIBRATION_AXIS = {k: int(k[-1] if k[-1].isdigit() else k.split("_")[0][-1]) - 1 for k in CALIBRATION_KEYS - {"mesh"}}
"""The mesh axis each calibration key measures (``B1_GBps``, ``alpha1_us``, ``curve1``, ``busy1``: axis 0)."""


class Bound(Enum):
    """What a profile number may be: more than zero, a fraction in (0, 1], or zero or more (zero: a cost not
    modelled)."""

    POSITIVE = "greater than zero"
    FRACTION = "in (0, 1]"
    NONNEGATIVE = "zero or more"

    def holds(self, value: float) -> bool:
        if self is Bound.NONNEGATIVE:
            return value >= 0
        return value > 0 and (self is Bound.POSITIVE or value <= 1)


@dataclass(frozen=True)
class ProfileNumber:
    """One number of a ``[device_profile]`` table: its key in the file, the :class:`DeviceProfile` field it sets
    (with `dtype`: that entry of the ``peak_flops`` dict) and the factor from the file's unit to the field's
    (us → s, GB/s → B/s), its :class:`Bound`, the fix a wrong value's message gives, whether the file must give
    it and whether the field holds a whole number. The table below is the one home of each key: reading,
    checking and writing a profile all walk it."""

    key: str
    field: str
    scale: float
    bound: Bound
    fix: str
    required: bool = False
    dtype: str | None = None
    whole: bool = False

    def read(self, d: DeviceProfile) -> float | None:
        """This number of profile `d` in the field's unit; None where `d` has no such peak rate."""
        return d.peak_flops.get(self.dtype) if self.dtype else getattr(d, self.field)


_P, _F, _Z = Bound.POSITIVE, Bound.FRACTION, Bound.NONNEGATIVE
PROFILE_NUMBERS = (
    ProfileNumber("peak_tflops_fp32", "peak_flops", 1e12, _P,
                  "add peak_tflops_fp32 = <float32 matmul TFLOP/s>, e.g. 19.5", required=True, dtype="float32"),
    ProfileNumber("peak_tflops_bf16", "peak_flops", 1e12, _P,
                  "give the bfloat16 matmul TFLOP/s, e.g. 312.0, or leave the key out", dtype="bfloat16"),
    ProfileNumber("memory_GBps", "memory_bandwidth", GB, _P,
                  "add memory_GBps = <device memory bandwidth in GB/s>, e.g. 2039.0", required=True),
    ProfileNumber("memory_GiB", "memory_bytes", 2**30, _P,
                  "add memory_GiB = <device memory capacity in GiB>, e.g. 80.0", required=True, whole=True),
    ProfileNumber("compute_efficiency", "compute_efficiency", 1.0, _F,
                  "give a fraction in (0, 1], e.g. 0.6, or leave the key out"),
    ProfileNumber("memory_efficiency", "memory_efficiency", 1.0, _F,
                  "give a fraction in (0, 1], e.g. 0.8, or leave the key out"),
    ProfileNumber("op_overhead_us", "op_overhead", 1e-6, _Z,
                  "give the microseconds of one tiny operator (zero or more), e.g. 5.0, or leave the key out"),
    ProfileNumber("foreach_overhead_us", "foreach_overhead", 1e-6, _Z,
                  "give the microseconds per tensor of a foreach operator (zero or more), or leave it out"),
    ProfileNumber("collective_overhead_us", "collective_overhead", 1e-6, _Z,
                  "give the host CPU microseconds of one collective (zero or more), or leave it out"),
    ProfileNumber("call_overhead_us", "call_overhead", 1e-6, _Z,
                  "give the host microseconds of one call of the runtime's program (zero or more)"),
    ProfileNumber("adamw_GBps", "adamw_bandwidth", GB, _Z,
                  "give the parameter GB/s a foreach AdamW step updates (zero or more), or leave it out"),
    ProfileNumber("adamw_overhead_us", "adamw_overhead", 1e-6, _Z,
                  "give the microseconds per parameter tensor of a foreach AdamW step (zero or more)"),
    ProfileNumber("float8_cast_bytes", "float8_cast_bytes", 1.0, _Z,
                  "give the bytes a Float8 product's operand element costs to cast (zero or more), e.g. 5.0"),
)  # fmt: skip
"""Every number of ``[device_profile]``, in the order :func:`cluster_to_toml` writes them."""
_KIND_FIX = 'add kind = "<a name for this device>", e.g. kind = "probed-cpu"'
_ATTENTION_FIX = "give four positive TFLOP/s: forward, backward, causal forward, causal backward"
PROFILE_KEYS = {"kind", "attention_tflops", "matmul"} | {n.key for n in PROFILE_NUMBERS}
MATMUL_KEYS = {"m", "n", "k", "dtype", "tflops"}
MATMUL_DTYPES = ("float32", "bfloat16", "float16", FLOAT8)


def load_cluster_file(path: str | Path) -> Cluster:
    """Read and validate a cluster TOML file."""
    path = Path(path)
    src = str(path)
    if path.is_dir():
        raise ClusterFileError(src, "file", "is a folder, not a file", "give the path of a cluster TOML file inside it")
    if not path.is_file():
        raise ClusterFileError(src, "file", "does not exist", "give the path of a cluster TOML file or a preset name")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ClusterFileError(src, "file", f"is not valid TOML ({e})", "fix the TOML syntax at that line") from None
    except UnicodeDecodeError:
        raise ClusterFileError(src, "file", "is not UTF-8 text", "save the cluster file as UTF-8 TOML") from None
    return cluster_from_dict(data, source=src, default_name=path.stem)


def cluster_from_dict(data: dict[str, Any], source: str, default_name: str = "cluster") -> Cluster:
    """Validate a parsed cluster description (a TOML table or a preset's dict)."""
    _unknown(data, TOP_KEYS, source, "")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ClusterFileError(source, "name", f"must be a non-empty string, got {name!r}", 'write name = "my-cluster"')
    device = _device(data, source)
    raw_layers = data.get("layers")
    if raw_layers is None:
        raise ClusterFileError(
            source,
            "layers",
            "is missing",
            "add at least one [[layers]] table with name, ranks, p2p_GBps, group_GBps",
        )
    if not isinstance(raw_layers, list) or not raw_layers or not all(isinstance(x, dict) for x in raw_layers):
        raise ClusterFileError(
            source, "layers", "must be a non-empty array of tables", "write each layer as [[layers]]"
        )
    n = 1
    for i, raw in enumerate(raw_layers):  # bound the size before building any R x R matrix
        ranks = raw.get("ranks")
        if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1:
            n *= ranks
            if n > MAX_DEVICES:
                raise ClusterFileError(
                    source,
                    f"layers[{i}].ranks",
                    f"makes the cluster {n:,} devices, more than meshpilot plans for ({MAX_DEVICES:,})",
                    f"describe at most {MAX_DEVICES:,} devices (the product of every layer's ranks)",
                )
    layers = tuple(_layer(raw, f"layers[{i}]", source) for i, raw in enumerate(raw_layers))
    n = math.prod(layer.ranks for layer in layers)
    raw_cal = data.get("calibration", [])
    if not isinstance(raw_cal, list) or not all(isinstance(x, dict) for x in raw_cal):
        raise ClusterFileError(
            source, "calibration", "must be an array of tables", "write each entry as [[calibration]]"
        )
    calibration = tuple(_calibration(raw, f"calibration[{i}]", source, n) for i, raw in enumerate(raw_cal))
    return Cluster(name=name, layers=layers, device=device, calibration=calibration, source=source)


def _unknown(table: dict[str, Any], known: set[str], source: str, prefix: str) -> None:
    for key in table:
        if key not in known:
            where = f"{prefix}.{key}" if prefix else key
            raise ClusterFileError(
                source, where, "is not a known key", f"remove it or use one of: {', '.join(sorted(known))}"
            )


def _device(data: dict[str, Any], source: str) -> DeviceProfile:
    kind = data.get("device")
    if "device_profile" in data:
        if kind is not None:
            raise ClusterFileError(
                source,
                "device_profile",
                "is given together with device",
                'keep one: device = "<kind>" names a built-in profile, [device_profile] gives measured numbers',
            )
        return _device_profile(data["device_profile"], source)
    if kind is None:
        raise ClusterFileError(
            source,
            "device",
            "is missing",
            f'add device = "<kind>", one of: {", ".join(DEVICES)}; or a [device_profile] table',
        )
    if not isinstance(kind, str) or kind not in DEVICES:
        raise ClusterFileError(source, "device", f"unknown device kind {kind!r}", f"use one of: {', '.join(DEVICES)}")
    return DEVICES[kind]


def _device_profile(table: Any, source: str) -> DeviceProfile:
    if not isinstance(table, dict):
        raise ClusterFileError(
            source, "device_profile", "must be a table", "write it as [device_profile] with kind, peak_tflops_fp32, ..."
        )
    _unknown(table, PROFILE_KEYS, source, "device_profile")
    if "kind" not in table:
        raise ClusterFileError(source, "device_profile.kind", "is missing", _KIND_FIX)
    kind = table["kind"]
    if not isinstance(kind, str) or not kind:
        raise ClusterFileError(source, "device_profile.kind", f"must be a non-empty string, got {kind!r}", _KIND_FIX)
    fields: dict[str, Any] = {"peak_flops": {}}
    for number in PROFILE_NUMBERS:
        where = f"device_profile.{number.key}"
        if number.key not in table:
            if number.required:
                raise ClusterFileError(source, where, "is missing", number.fix)
            continue
        value = _number(table[number.key], where, source, positive=False, fix=number.fix)
        if not number.bound.holds(value):
            raise ClusterFileError(source, where, f"is {value}, must be {number.bound.value}", number.fix)
        value *= number.scale
        if number.dtype:
            fields["peak_flops"][number.dtype] = value
        else:
            fields[number.field] = round(value) if number.whole else value
    return DeviceProfile(
        kind,
        matmul=_matmul_rates(table.get("matmul", []), source),
        attention=_attention_rates(table.get("attention_tflops"), source),
        **fields,
    )


def _attention_rates(raw: Any, source: str) -> AttentionRates | None:
    """``attention_tflops``: four positive TFLOP/s (forward, backward, causal forward, causal backward)."""
    if raw is None:
        return None
    where, fix = "device_profile.attention_tflops", _ATTENTION_FIX
    if not isinstance(raw, list) or len(raw) != 4:
        raise ClusterFileError(source, where, f"must be a list of four numbers, got {raw!r}", fix)
    rates = [_number(v, where, source, positive=True, fix=fix) * 1e12 for v in raw]
    return AttentionRates(*rates)


def _matmul_rates(raw: Any, source: str) -> tuple[MatmulRate, ...]:
    """The ``[[device_profile.matmul]]`` entries: measured GEMM rates."""
    fix = "write each as [[device_profile.matmul]] with m, n, k, dtype and tflops"
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise ClusterFileError(source, "device_profile.matmul", "must be an array of tables", fix)
    out = []
    for i, entry in enumerate(raw):
        where = f"device_profile.matmul[{i}]"
        _unknown(entry, MATMUL_KEYS, source, where)
        missing = sorted(MATMUL_KEYS - set(entry))
        if missing:
            raise ClusterFileError(source, f"{where}.{missing[0]}", "is missing", fix)
        dims = []
        for key in ("m", "n", "k"):
            v = entry[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ClusterFileError(source, f"{where}.{key}", f"must be a positive whole number, got {v!r}", fix)
            dims.append(v)
        if entry["dtype"] not in MATMUL_DTYPES:
            raise ClusterFileError(
                source, f"{where}.dtype", f"is {entry['dtype']!r}", f"use one of: {', '.join(MATMUL_DTYPES)}"
            )
        tflops = _number(entry["tflops"], f"{where}.tflops", source, positive=True, fix="give the TFLOP/s, e.g. 600.0")
        out.append(MatmulRate(dims[0], dims[1], dims[2], entry["dtype"], tflops * 1e12))
    return tuple(out)


def _number(
    value: Any,
    key: str,
    source: str,
    *,
    positive: bool,
    allow_zero: bool = False,
    fix: str = "give the bandwidth in GB/s, e.g. 25.0",
) -> float:
    """`value` as a float; `fix` is the error's hint when it is negative (or zero without `allow_zero`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ClusterFileError(source, key, f"must be a number, got {value!r}", "write a plain number such as 25.0")
    if abs(value) > MAX_NUMBER:
        raise ClusterFileError(
            source, key, f"is {value:g}, larger than any real device ({MAX_NUMBER:g})", f"{fix} (check the units)"
        )
    if value != 0 and abs(value) < MIN_NUMBER:
        raise ClusterFileError(
            source,
            key,
            f"is {value:g}, smaller than any real device ({MIN_NUMBER:g})",
            f"{fix} (check the units)" + (", or 0" if allow_zero else ""),
        )
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        need = "zero or more" if allow_zero else "greater than zero"
        raise ClusterFileError(source, key, f"is {value}, must be {need}", fix)
    return float(value)


def _layer(raw: dict[str, Any], where: str, source: str) -> Layer:
    _unknown(raw, LAYER_KEYS, source, where)
    for key in ("ranks", "p2p_GBps", "group_GBps", "latency_us"):
        if key not in raw:
            raise ClusterFileError(source, f"{where}.{key}", "is missing", _MISSING_FIX[key])
    name = raw.get("name", f"layer{where[7:-1]}")
    if not isinstance(name, str) or not name:
        raise ClusterFileError(
            source, f"{where}.name", f"must be a non-empty string, got {name!r}", 'e.g. name = "node"'
        )
    ranks = raw["ranks"]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ClusterFileError(
            source, f"{where}.ranks", f"must be a whole number of at least 1, got {ranks!r}", "e.g. ranks = 8"
        )
    p2p = _matrix(raw["p2p_GBps"], ranks, f"{where}.p2p_GBps", source)
    group = _vector(raw["group_GBps"], ranks, f"{where}.group_GBps", source)
    latency = _number(
        raw["latency_us"],
        f"{where}.latency_us",
        source,
        positive=True,
        allow_zero=True,
        fix="give the latency in microseconds per message, e.g. 5.0",
    )
    return Layer(name=name, ranks=ranks, p2p=p2p * GB, group_bw=group * GB, latency=latency * 1e-6)


_MISSING_FIX = {
    "ranks": "add ranks = <units of this layer inside one unit of the layer above>",
    "p2p_GBps": "add p2p_GBps = <GB/s> (one number for a uniform layer, or an R x R matrix)",
    "group_GBps": "add group_GBps = <GB/s> (each unit's aggregate bandwidth to the outside; one number or R numbers)",
    "latency_us": "add latency_us = <microseconds per message across this layer>, e.g. 5.0",
}


def _matrix(value: Any, r: int, key: str, source: str) -> np.ndarray:
    if not isinstance(value, list):
        v = _number(value, key, source, positive=True)
        m = np.full((r, r), v)
    else:
        rows = len(value)
        if not all(isinstance(row, list) for row in value):
            raise ClusterFileError(source, key, "must be one number or a list of rows", f"give {r} rows of {r} numbers")
        cols = {len(row) for row in value}
        if rows != r or cols != {r}:
            shape = f"{rows}x{'/'.join(str(c) for c in sorted(cols)) or 0}"
            raise ClusterFileError(
                source,
                key,
                f"matrix is {shape}, must be {r}x{r} (ranks = {r})",
                f"give {r} rows of {r} numbers",
            )
        m = np.array(
            [
                [
                    _number(x, f"{key}[{i}][{j}]", source, positive=True, allow_zero=(i == j or r > 2))
                    for j, x in enumerate(row)
                ]
                for i, row in enumerate(value)
            ]
        )
    np.fill_diagonal(m, 0.0)
    for i in range(r):
        if r > 1 and not np.any(m[i] > 0):
            raise ClusterFileError(
                source,
                f"{key}[{i}]",
                "has no link to any other rank",
                "give at least one positive off-diagonal entry",
            )
    return m


def _vector(value: Any, r: int, key: str, source: str) -> np.ndarray:
    if not isinstance(value, list):
        return np.full(r, _number(value, key, source, positive=True))
    if len(value) != r:
        raise ClusterFileError(
            source, key, f"has {len(value)} entries, must have {r} (ranks = {r})", f"give {r} numbers"
        )
    return np.array([_number(x, f"{key}[{i}]", source, positive=True) for i, x in enumerate(value)])


def _calibration(raw: dict[str, Any], where: str, source: str, n: int) -> Calibration:
    _unknown(raw, CALIBRATION_KEYS, source, where)
    mesh = raw.get("mesh")
    if (
        not isinstance(mesh, list)
        or len(mesh) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh)
    ):
        raise ClusterFileError(
            source, f"{where}.mesh", f"must be two positive whole numbers, got {mesh!r}", "e.g. mesh = [2, 4]"
        )
    if math.prod(mesh) != n:
        raise ClusterFileError(
            source,
            f"{where}.mesh",
            f"shape {mesh} has {math.prod(mesh)} devices but the layers give {n}",
            f"use a shape whose product is {n}",
        )
    for axis, size in enumerate(mesh):
        idle = [k for k in raw if CALIBRATION_AXIS.get(k) == axis]
        if size == 1 and idle:
            raise ClusterFileError(
                source,
                f"{where}.{idle[0]}",
                f"measures mesh axis {axis} of {mesh}, which has size 1 and runs no collective",
                f"remove it, or give the axis of size > 1 ({'B1_GBps' if axis else 'B2_GBps'}, ...)",
            )
    if not CALIBRATION_KEYS.difference({"mesh"}) & raw.keys():
        keys = ", ".join(sorted(CALIBRATION_KEYS - {"mesh"}))
        raise ClusterFileError(source, where, "has no measurement", f"give at least one of {keys}")

    def values(keys: tuple[str, str], unit: float) -> tuple[float | None, ...]:
        return tuple(
            None if k not in raw else _number(raw[k], f"{where}.{k}", source, positive=True) * unit for k in keys
        )

    algbw = values(("B1_GBps", "B2_GBps"), GB)
    latency = values(("alpha1_us", "alpha2_us"), 1e-6)
    curve = tuple(_curve(raw[k], f"{where}.{k}", source) if k in raw else None for k in ("curve1", "curve2"))
    busy = tuple(_curve(raw[k], f"{where}.{k}", source) if k in raw else None for k in ("busy1", "busy2"))
    for j, (alone, loaded) in enumerate(zip(curve or (None, None), busy)):
        if loaded is not None and alone is None:
            raise ClusterFileError(
                source,
                f"{where}.busy{j + 1}",
                f"needs curve{j + 1}: the busy curve slows a collective by its ratio to the curve alone",
                f"add curve{j + 1} (meshpilot probe measures both) or remove busy{j + 1}",
            )
    return Calibration(
        mesh=(mesh[0], mesh[1]),
        algbw=algbw,
        latency=latency if any(latency) else (),
        curve=curve if any(curve) else (),
        busy_curve=busy if any(busy) else (),
    )


def _curve(raw: Any, where: str, source: str) -> tuple[tuple[int, float], ...]:
    """``[[bytes, microseconds], ...]``, bytes whole, positive and ascending, as (bytes, seconds) points."""
    fix = "write it as [[bytes, microseconds], ...] with bytes ascending, e.g. [[16384, 310.0], [1048576, 480.0]]"
    if not isinstance(raw, list) or not raw:
        raise ClusterFileError(source, where, f"must be a non-empty list of [bytes, microseconds], got {raw!r}", fix)
    points = []
    for i, pair in enumerate(raw):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ClusterFileError(source, f"{where}[{i}]", f"must be [bytes, microseconds], got {pair!r}", fix)
        nbytes = pair[0]
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            got = f"bytes must be a positive whole number, got {nbytes!r}"
            raise ClusterFileError(source, f"{where}[{i}]", got, fix)
        if points and nbytes <= points[-1][0]:
            raise ClusterFileError(source, f"{where}[{i}]", f"bytes {nbytes} do not ascend", fix)
        seconds = _number(pair[1], f"{where}[{i}]", source, positive=True, fix="give microseconds, e.g. 310.0")
        points.append((nbytes, seconds * 1e-6))
    return tuple(points)


def cluster_to_toml(cluster: Cluster, comment: str = "") -> str:
    """A TOML text that :func:`load_cluster_file` reads back into an equal cluster."""
    out = [f"# {line}" for line in comment.splitlines()] if comment else []
    out += [f"name = {_q(cluster.name)}"]
    if DEVICES.get(cluster.device.kind) == cluster.device:
        out += [f"device = {_q(cluster.device.kind)}", ""]
    else:
        out += ["", *_profile_toml(cluster.device), ""]
    for layer in cluster.layers:
        out += ["[[layers]]", f"name = {_q(layer.name)}", f"ranks = {layer.ranks}"]
        if layer.uniform:
            p2p = _f(layer.p2p[0, 1] / GB) if layer.ranks > 1 else _f(layer.group_bw[0] / GB)
            out += [f"p2p_GBps = {p2p}", f"group_GBps = {_f(layer.group_bw[0] / GB)}"]
        else:
            rows = ", ".join("[" + ", ".join(_f(x / GB) for x in row) + "]" for row in layer.p2p)
            out += [
                f"p2p_GBps = [{rows}]",
                "group_GBps = [" + ", ".join(_f(x / GB) for x in layer.group_bw) + "]",
            ]
        out += [f"latency_us = {_f(layer.latency * 1e6)}", ""]
    for entry in cluster.calibration:
        out += ["[[calibration]]", f"mesh = [{entry.mesh[0]}, {entry.mesh[1]}]"]
        for key, bw in zip(("B1_GBps", "B2_GBps"), entry.algbw):
            if bw is not None:
                out.append(f"{key} = {_f(bw / GB)}")
        for key, alpha in zip(("alpha1_us", "alpha2_us"), entry.latency):
            if alpha is not None:
                out.append(f"{key} = {_f(float(f'{alpha * 1e6:.6g}'))}")  # no 977.9999999999999
        for key, curve in (*zip(("curve1", "curve2"), entry.curve), *zip(("busy1", "busy2"), entry.busy_curve)):
            if curve is not None:
                pts = ", ".join(f"[{b}, {_f(float(f'{t * 1e6:.6g}'))}]" for b, t in curve)
                out.append(f"{key} = [{pts}]")
        out.append("")
    return "\n".join(out)


def _profile_toml(d: DeviceProfile) -> list[str]:
    """A [device_profile] table for a profile that is not one of DEVICES (e.g. measured by `meshpilot probe`)."""
    out = ["[device_profile]", f"kind = {_q(d.kind)}"]
    for number in PROFILE_NUMBERS:
        value = number.read(d)
        if value is None or (number.bound is Bound.NONNEGATIVE and not value):  # a rate not given, a cost not modelled
            continue
        value /= number.scale
        if number.bound is Bound.NONNEGATIVE and number.scale != 1.0:
            value = float(f"{value:.6g}")  # the unit's conversion noise: no 12.000000000000002
        out.append(f"{number.key} = {_f(value)}")
    if d.attention is not None:
        a = d.attention
        rates = (a.forward, a.backward, a.causal_forward, a.causal_backward)
        out.append(f"attention_tflops = [{', '.join(_f(float(f'{r / 1e12:.6g}')) for r in rates)}]")
    for r in d.matmul:
        out += ["", "[[device_profile.matmul]]", f"m = {r.m}", f"n = {r.n}", f"k = {r.k}", f"dtype = {_q(r.dtype)}"]
        out.append(f"tflops = {_f(r.flops / 1e12)}")
    return out


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _f(x: float) -> str:
    return repr(float(x))
