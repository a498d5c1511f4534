"""`meshpilot train --data FILE` (``meshpilot.runtime.data``): a text file as byte tokens, sampled by position."""

from __future__ import annotations

import pytest
import torch

from meshpilot.errors import UserError
from meshpilot.models import gpt_config
from meshpilot.runtime.data import ByteText
from meshpilot.runtime.train import batch_at


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 4 + "é — unicode too".encode())
    return ByteText(path)


def test_samples_are_windows_of_the_file_fixed_by_seed_and_position(text):
    raw = text.tokens
    b = text.batch(0, seed=7, batch=4, length=9)  # [4, 9]
    assert b.shape == (4, 9) and b.dtype == torch.long and int(b.max()) < 256
    for row in b:  # each row is a contiguous run of the file's bytes
        starts = [i for i in range(raw.numel() - 8) if torch.equal(raw[i : i + 9], row)]
        assert starts, row
    # a resumed run (data position 2, any batch size) reads the same samples 2 and 3
    assert torch.equal(text.batch(2, seed=7, batch=2, length=9), b[2:])
    assert not torch.equal(text.batch(0, seed=8, batch=4, length=9), b)  # another seed, other windows


def test_a_gpt_batch_is_inputs_and_next_byte_targets(text):
    from dataclasses import replace

    cfg = replace(gpt_config("atp-m1", layers=1, hidden=64, heads=4), seq=16, batch=3)
    idx, tgt = batch_at(cfg, 0, seed=0, data=text)
    assert idx.shape == tgt.shape == (3, 16)
    assert torch.equal(idx[:, 1:], tgt[:, :-1])  # the target of each byte is the next byte
    assert torch.equal(torch.cat([idx, tgt[:, -1:]], dim=1), text.batch(0, 0, 3, 17))


def test_short_files_and_small_vocabularies_are_refused_in_one_line(text, tmp_path):
    with pytest.raises(UserError, match="vocabulary of 256, the model has 64"):
        text.check(64, 8)
    with pytest.raises(UserError, match="fewer than one sample of 5000"):
        text.check(256, 5000)
    with pytest.raises(UserError, match="cannot read it"):
        ByteText(tmp_path / "missing.txt")


def test_train_gets_text_batches_for_a_hugging_face_model(text):
    """The build path: input_ids = labels = windows of seq bytes; a single-device step runs on them."""
    from meshpilot.models.sources import build_model
    from meshpilot.runtime.train import train_model

    cfg = ["n_layer=1", "n_embd=16", "n_head=2", "n_positions=16", "vocab_size=256"]

    def build(device):
        return build_model("hf:gpt2", hf_config=cfg, batch=2, seq=8, device=device)

    logs = train_model(build, 2, data=text)
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(s.loss)) for s in logs)
    assert logs[0].loss != logs[1].loss
