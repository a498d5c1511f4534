"""On one GPU: bf16 GEMM rates at Llama 3 405B's TP8 block shapes and causal flash attention's rate, for the
``llama3-h100`` preset (``meshpilot/cluster/presets.py``: ``LLAMA3_405B_TP8_GEMMS``) and docs/frontier.md.

    python benchmarks/gpu_frontier_rates.py > docs/frontier/h100_llama405b_shapes.json

One 8,192-token sequence per rank (micro-batch 1) under TP 8: the q, k / v, o, gate / up and down projections and
their input- and weight-gradient shapes, ``[m, k] @ [k, n]`` on random data; attention of 16 query heads (128 / 8)
and head size 128, causal and not, forward and forward + backward. Each the mean of 20 runs after 3 warm-ups
(CUDA events). ``fwd_bwd_tflops_meshpilot_count`` is attention's rate on meshpilot's count of its FLOPs
(``ops.attention.attention_flops``: the full, non-causal work, 3.5 times the forward's two matmuls).

``--fp8`` measures instead what torchtitan's Float8 linears (tensorwise scaling) run at the same shapes, each beside
the bf16 product measured in the same loop:

* ``gemm``: ``torch._scaled_mm`` of operands already in ``float8_e4m3fn`` (one scale per tensor, bf16 out);
* ``linear``: one linear layer's forward and backward as Float8 training runs it: input and weight cast to e4m3 and
  the output gradient to e5m2, each scaled by its own amax (``amax``, a division, a cast: unfused eager kernels,
  which torchtitan fuses with torch.compile, so this is the slow side), then the three products (output, input
  gradient, weight gradient); against the same three products in bf16.

    python benchmarks/gpu_frontier_rates.py --fp8 > fp8.json
    python benchmarks/gpu_frontier_rates.py --fp8 --compile > fp8c.json  # the casts fused, as torchtitan runs them
    python benchmarks/gpu_frontier_rates.py --fp8 --device cpu --tokens 64   # smoke: tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

TOKENS = 8192
GEMMS = [
    (TOKENS, 2048, 16384), (TOKENS, 128, 16384), (TOKENS, 16384, 2048), (TOKENS, 6656, 16384),
    (TOKENS, 16384, 6656), (16384, 6656, TOKENS), (2048, 16384, TOKENS), (6656, 16384, TOKENS),
    (16384, 2048, TOKENS), (8192, 8192, 8192),
]  # fmt: skip


def seconds(fn, n: int = 20) -> float:
    """Mean seconds of `fn` over `n` runs after 3 warm-ups (CUDA events; the wall clock without a GPU)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n / 1e3


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in `dtype` scaled so its largest magnitude is the format's largest, and the inverse scale."""
    scale = torch.finfo(dtype).max / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


def scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of float8 operands (``a`` row-major, ``b`` column-major) in bf16."""
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def float8_linear(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, cast=to_float8) -> None:
    """Forward and backward of ``y = x @ w.T`` (x [m, k], w [n, k], g = dy [m, n]) as a tensorwise Float8 linear."""
    x8, sx = cast(x, E4M3)  # [m, k]
    w8, sw = cast(w, E4M3)  # [n, k]
    g8, sg = cast(g, E5M2)  # [m, n]
    scaled_mm(x8, sx, w8.t(), sw)  # y [m, n]
    scaled_mm(g8, sg, w8.t().contiguous().t(), sw)  # dx = g @ w: [m, k]
    scaled_mm(g8.t().contiguous(), sg, x8.t().contiguous().t(), sx)  # dw = g.T @ x: [n, k]


def bf16_linear(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> None:
    """The same three products in bf16."""
    x @ w.t(), g @ w, g.t() @ x


def rates(m: int, n: int, k: int, flop: int, t_bf: float, t_f8: float) -> dict:
    """One row: the shape, both rates and the speed-up of Float8."""
    return {"m": m, "n": n, "k": k, "bf16_tflops": round(flop / t_bf / 1e12, 1),
            "fp8_tflops": round(flop / t_f8 / 1e12, 1), "fp8_speedup": round(t_bf / t_f8, 3)}  # fmt: skip


def fp8(dev: str, tokens: int, compiled: bool = False) -> dict:
    """bf16 against Float8 at the block's shapes (``GEMMS`` with ``tokens`` for its 8,192); `compiled`: the casts
    fused by torch.compile, as torchtitan runs them."""
    bf = torch.bfloat16
    cast = torch.compile(to_float8) if compiled else to_float8
    out = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "gemm": [], "linear": []}  # fmt: skip
    for m, n, k in GEMMS:
        m, n, k = (tokens if d == TOKENS else d for d in (m, n, k))
        a, b = torch.randn(m, k, device=dev, dtype=bf), torch.randn(n, k, device=dev, dtype=bf)
        (a8, sa), (b8, sb) = to_float8(a, E4M3), to_float8(b, E4M3)
        t_bf = seconds(lambda a=a, b=b: a @ b.t())
        t_f8 = seconds(lambda a8=a8, b8=b8, sa=sa, sb=sb: scaled_mm(a8, sa, b8.t(), sb))
        out["gemm"].append(rates(m, n, k, 2 * m * n * k, t_bf, t_f8))
    for n, k in ((2048, 16384), (16384, 2048), (6656, 16384), (16384, 6656)):  # q, o, gate/up, down under TP 8
        m, n, k = tokens, min(n, 64 * tokens), min(k, 64 * tokens)
        x, w = torch.randn(m, k, device=dev, dtype=bf), torch.randn(n, k, device=dev, dtype=bf)
        g = torch.randn(m, n, device=dev, dtype=bf)
        t_bf = seconds(lambda x=x, w=w, g=g: bf16_linear(x, w, g))
        t_f8 = seconds(lambda x=x, w=w, g=g: float8_linear(x, w, g, cast))
        out["linear"].append(rates(m, n, k, 6 * m * n * k, t_bf, t_f8))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp8", action="store_true", help="Float8 against bf16 at the block's shapes")
    ap.add_argument("--compile", action="store_true", help="with --fp8: the casts fused by torch.compile")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help=f"tokens per rank (default {TOKENS})")
    args = ap.parse_args()
    if args.fp8:
        print(json.dumps(fp8(args.device, args.tokens, args.compile)))
        return
    dev, bf = "cuda", torch.bfloat16
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": [], "attn": {}}
    for m, n, k in GEMMS:
        x, w = torch.randn(m, k, device=dev, dtype=bf), torch.randn(k, n, device=dev, dtype=bf)
        s = seconds(lambda x=x, w=w: x @ w)
        out["gemm"].append({"m": m, "n": n, "k": k, "tflops": round(2 * m * n * k / s / 1e12, 1)})
    q, k, v = (torch.randn(1, 16, TOKENS, 128, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    full = 2 * 16 * TOKENS * TOKENS * 256  # QK^T and PV, every score
    for causal in (True, False):
        g = torch.randn_like(q)
        fwd = seconds(lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c))
        both = seconds(lambda c=causal, g=g: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=c),
                                                                  (q, k, v), g))  # fmt: skip
        out["attn"]["causal" if causal else "full"] = {
            "fwd_s": fwd, "fwd_bwd_s": both, "fwd_tflops_fullcount": round(full / fwd / 1e12, 1),
            "fwd_bwd_tflops_meshpilot_count": round(3.5 * full / both / 1e12, 1),
        }  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
