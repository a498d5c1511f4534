"""On one GPU: bf16 GEMM rates at Llama 3 405B's TP8 block shapes and causal flash attention's rate, for the
``llama3-h100`` preset (``meshpilot/cluster/presets.py``: ``LLAMA3_405B_TP8_GEMMS``) and docs/frontier.md.

    python benchmarks/gpu_frontier_rates.py > docs/frontier/h100_llama405b_shapes.json

One 8,192-token sequence per rank (micro-batch 1) under TP 8: the q, k / v, o, gate / up and down projections and
their input- and weight-gradient shapes, ``[m, k] @ [k, n]`` on random data; attention of 16 query heads (128 / 8)
and head size 128, causal and not, forward and forward + backward. Each the mean of 20 runs after 3 warm-ups
(CUDA events). ``fwd_bwd_tflops_meshpilot_count`` is attention's rate on meshpilot's count of its FLOPs
(``ops.attention.attention_flops``: the full, non-causal work, 3.5 times the forward's two matmuls).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

TOKENS = 8192
GEMMS = [
    (TOKENS, 2048, 16384), (TOKENS, 128, 16384), (TOKENS, 16384, 2048), (TOKENS, 6656, 16384),
    (TOKENS, 16384, 6656), (16384, 6656, TOKENS), (2048, 16384, TOKENS), (6656, 16384, TOKENS),
    (16384, 2048, TOKENS), (8192, 8192, 8192),
]  # fmt: skip


def seconds(fn, n: int = 20) -> float:
    """Mean seconds of `fn` over `n` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n / 1e3


def main() -> None:
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
