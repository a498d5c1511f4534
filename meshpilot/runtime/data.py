"""A user's text file as training data: byte-level tokens (``meshpilot train --data FILE``).

Every byte is a token (0…255), so any file trains any token model whose vocabulary has at least 256 entries,
with no tokenizer to ship. Sample ``j`` of the data seeded ``s`` is the window of ``length`` bytes starting
at an offset drawn from :func:`meshpilot.runtime.train.sample_generator` ``(s, j)`` alone — the same rule as
the synthetic data — so a run resumed at any data position, under any plan or world size, reads the same
samples. For a GPT the window has ``seq + 1`` bytes (input and next-token targets); a Hugging Face model gets
``input_ids = labels`` of ``seq`` bytes (its causal-LM head shifts them itself).
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshpilot.errors import UserError

BYTE_VOCAB = 256


class ByteText:
    """The bytes of one file, sampled in windows (module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise UserError(f"--data {path}: cannot read it ({e.strerror or e}); give a readable text file") from None
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() if raw else torch.empty(0)

    def check(self, vocab: int, length: int) -> None:
        """A one-line UserError unless a model with `vocab` tokens can read windows of `length` bytes."""
        if vocab < BYTE_VOCAB:
            raise UserError(
                f"--data {self.path}: byte tokens need a vocabulary of {BYTE_VOCAB}, the model has {vocab}; give a "
                "model with a larger one (built-in GPTs: atp-m1 … atp-m4; hf:<name>: --hf-config vocab_size=256)"
            )
        if self.tokens.numel() < length:
            raise UserError(
                f"--data {self.path}: {self.tokens.numel()} bytes, fewer than one sample of {length}; "
                "give a longer file"
            )

    def window(self, index: int, seed: int, length: int) -> torch.Tensor:
        """Sample `index`'s `length` tokens ``[length]``."""
        from meshpilot.runtime.train import sample_generator

        start = int(torch.randint(0, self.tokens.numel() - length + 1, (1,), generator=sample_generator(seed, index)))
        return self.tokens[start : start + length]

    def batch(self, position: int, seed: int, batch: int, length: int) -> torch.Tensor:
        """Samples ``position … position + batch - 1``: ``[batch, length]``."""
        return torch.stack([self.window(j, seed, length) for j in range(position, position + batch)])
