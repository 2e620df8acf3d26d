"""Shared fixtures: a tiny trained byte-level BPE tokenizer with swappable chat templates, the
row-invariant CPU kernels and a tiny target for their tests, and cache isolation (tests not marked
`real` never touch the user's HEADSTART_CACHE)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-3 style: a BOS, role headers, trimmed content, <|eot_id|> ends every turn.
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Gemma style: no system role (the template raises), `model` turns, a newline after <end_of_turn>.
GEMMA = (
    "{{ '<bos>' }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# A template that ignores add_generation_prompt: the assistant header is rendered inside the turn,
# and the turn is closed by the EOS special token followed by a blank line.
ALPACA = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '### Response:\\n' + message['content'] + '</s>\\n\\n' }}"
    "{% else %}{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "alpaca": ALPACA}
# What each template emits after an assistant turn's content that the model must generate.
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "alpaca": "</s>"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "</s>"]

_CORPUS = [
    "Hello! How can I help you today? The quick brown fox jumps over the lazy dog.",
    "user assistant system model Instruction Response: what is the capital of France? Paris.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Speculative decoding drafts tokens with a small head and verifies them with the target model.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols ()[]{}<>:;,.!?'\"-_=+*/\\|@#$%^&~`",
]


def make_tokenizer(template: str = "chatml"):
    """A byte-level BPE tokenizer (vocab ~400) trained here, with the named chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>" if template == "chatml" else END_OF_TURN[template],
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIALS if t != "<|endoftext|>"],
    )
    tok.chat_template = TEMPLATES[template]
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A local 'model directory' holding only what the data layer reads: config.json + tokenizer."""
    d = tmp_path_factory.mktemp("tiny-model")
    make_tokenizer("chatml").save_pretrained(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 400}))
    return d


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with the ChatML tiny tokenizer: a complete local model directory."""
    from tiny_models import make_hf_model

    d = tmp_path_factory.mktemp("chat-model")
    tok = make_tokenizer("chatml")
    make_hf_model("llama", d, seed=2, vocab_size=len(tok))
    tok.save_pretrained(d)
    return d


# The compiled CPU kernels are build products keyed by source and CPU, not data: every test shares
# the user's build (one ~30 s compile per machine, not one per isolated cache).
os.environ.setdefault("HEADSTART_KERNEL_CACHE", str(
    Path(os.environ.get("HEADSTART_CACHE") or Path.home() / ".cache" / "headstart").expanduser() / "kernels"))


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path, monkeypatch):
    if request.node.get_closest_marker("real") is None:
        monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "cache"))


def fails_with_one_line(capsys, argv: list[str], match: str) -> str:
    """`headstart argv` exits 2 with one `headstart: error:` line (its last) that holds `match`, no traceback."""
    from headstart.cli import main

    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # progress bars may come before it
    assert last.startswith("headstart: error:") and match in last and "Traceback" not in err, err
    return last


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def random_conversations(n: int, seed: int = 0, max_rounds: int = 3, user_words: tuple[int, int] = (2, 12),
                         reply_words: tuple[int, int] = (2, 30)) -> list[dict]:
    """n ShareGPT-style rows of random words over a small vocabulary (1..max_rounds user/reply rounds)."""
    import random

    rng = random.Random(seed)
    words = ["hello", "speculative", "decoding", "heads", "draft", "target", "tokens", "fast", "the", "a"]
    rows = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, max_rounds)):
            for role, span in (("human", user_words), ("gpt", reply_words)):
                turns.append({"from": role, "value": " ".join(rng.choice(words) for _ in range(rng.randint(*span)))})
        rows.append({"id": f"c{i}", "conversations": turns})
    return rows


@pytest.fixture(scope="module")
def kernels():
    """The compiled row-invariant kernels (they must build on x86-64), or a skip."""
    from headstart.kernels import rowwise

    if os.environ.get("HEADSTART_KERNELS") == "0":
        pytest.skip("HEADSTART_KERNELS=0: the kernels are switched off")
    mod = rowwise()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert mod is not None, "the row-invariant kernels must build on x86-64 (a C++ compiler and ninja)"
    if mod is None:
        pytest.skip("no row-invariant kernels on this platform")
    return mod


@pytest.fixture(scope="module")
def kernel_target_dir(tmp_path_factory):
    """A tiny random Llama target for the kernels' engine tests."""
    from tiny_models import make_hf_model

    d = tmp_path_factory.mktemp("kernels-target")
    make_hf_model("llama", d, seed=11)
    return d
