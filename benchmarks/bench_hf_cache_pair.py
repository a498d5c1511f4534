"""HF causal LMs as people train them (use_cache=False) and with the default cache, planned on (2, 2) of dgx-h100:
step, fallbacks and CPU seconds of each ``plan()`` call. Run it on two trees back to back to compare commits::

    PYTHONPATH=. python benchmarks/bench_hf_cache_pair.py
    (cd OLD && PYTHONPATH=OLD python /path/to/benchmarks/bench_hf_cache_pair.py)
"""

import time

import torch

from meshpilot.models.sources import hf_model
from meshpilot.planner.auto import plan

LLAMA_LIKE = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    vocab_size=64,
)
"""Llama and Mistral share their config keys: the same tiny sizes for both."""
CFG = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=64),
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
}
for name, cfg in CFG.items():
    for cache in (True, False):
        torch.manual_seed(0)
        m = hf_model(name, dict(cfg, use_cache=cache))
        ids = torch.randint(0, 64, (4, 8))
        c0 = time.process_time()
        p = plan(m, (ids, ids), "dgx-h100", mesh_shape=(2, 2))
        line = f"{name:8s} use_cache={cache!s:5s} step {p.time.total_s * 1e6:.3f} us"
        print(f"{line}  fallbacks {len(p.fallbacks)}  CPU {time.process_time() - c0:.2f} s")
