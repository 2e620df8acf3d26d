"""Incremental detokenisation: streamed text is always a prefix of the full decode, the final text
is the full decode, and the engine's stop strings cut where a full decode would."""

import random

import pytest
from conftest import make_tokenizer

from headstart.inference.detok import IncrementalText


def _stream(tok, ids):
    inc = IncrementalText(tok)
    for i in range(1, len(ids) + 1):
        inc.update(ids[:i])
        full = tok.decode(ids[:i], skip_special_tokens=True)
        assert full.startswith(inc.text), (inc.text, full)
    assert inc.final(ids) == tok.decode(ids, skip_special_tokens=True)
    return inc


def test_streamed_text_is_a_prefix_of_the_full_decode_and_ends_equal():
    tok = make_tokenizer()
    rng = random.Random(0)
    for _ in range(30):  # random ids include lone bytes of multi-byte characters and special tokens
        _stream(tok, [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))])
    ids = tok("héllo wörld — ünïcode ✓ 日本語", add_special_tokens=False)["input_ids"]
    assert _stream(tok, ids).text == "héllo wörld — ünïcode ✓ 日本語"


@pytest.mark.real
def test_the_real_tokenizer_streams_exactly():
    from transformers import AutoTokenizer

    from headstart.assets import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    rng = random.Random(1)
    for _ in range(20):
        _stream(tok, [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))])
    text = "Write a haiku 🌊 about the sea — naïve café, 東京\n  indented"
    assert _stream(tok, tok(text, add_special_tokens=False)["input_ids"]).text == text
