"""The assistant-only loss mask is exact: supervised tokens are the assistant content and its
end-of-turn token, nothing else, on ChatML (tiny and real SmolLM2) and on other templates."""


import pytest
from conftest import END_OF_TURN, TEMPLATES, make_tokenizer

from headstart.data.template import ChatRenderer, TemplateMismatch, mark_supervised

TRIMS = {"llama3", "gemma"}  # templates that trim the content


def _runs(ids, mask, tok, value):
    """Decoded runs of consecutive tokens whose mask equals `value`."""
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m == value:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur)), cur.clear()
    if cur:
        out.append(tok.decode(cur))
    return out


def _check_exact(tok, template, messages, rendered):
    expected = [
        (m["content"].strip() if template in TRIMS else m["content"]) + END_OF_TURN[template]
        for m in messages if m["role"] == "assistant"
    ]
    assert _runs(rendered.input_ids, rendered.loss_mask, tok, 1) == expected
    # Everything else (headers, user/system text, separators) is unsupervised, and nothing is lost.
    unsup = "".join(_runs(rendered.input_ids, rendered.loss_mask, tok, 0))
    sup = "".join(expected)
    assert len(unsup) + len(sup) == len(rendered.text)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"].strip() in unsup


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [  # the reply repeats header words and the user's text: the split must not be fooled by content
        {"role": "user", "content": "Say assistant"},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "And the capital of France?"},
        {"role": "assistant", "content": "  Paris. \n"},
        {"role": "user", "content": "code"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ],
]


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_mask_is_exact(template, conv):
    tok = make_tokenizer(template)
    messages = CONVERSATIONS[conv]
    renderer = ChatRenderer(tok)
    if template == "gemma" and messages[0]["role"] == "system":
        with pytest.raises(TemplateMismatch) as e:
            renderer.render(messages)
        assert e.value.reason == "template_error"
        return
    r = renderer.render(messages)
    assert r.input_ids == tok(r.text, add_special_tokens=False)["input_ids"]  # one tokenisation of the text
    _check_exact(tok, template, messages, r)


def test_separator_after_end_of_turn_is_not_supervised():
    tok = make_tokenizer("chatml")
    r = ChatRenderer(tok).render(CONVERSATIONS[0])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    last_sup = max(i for i, m in enumerate(r.loss_mask) if m)
    assert r.input_ids[last_sup] == end
    assert r.loss_mask[last_sup + 1:] == [0] * (len(r.input_ids) - last_sup - 1)  # the trailing "\n"


def test_truncation():
    tok = make_tokenizer("chatml")
    r_full = ChatRenderer(tok).render(CONVERSATIONS[1])
    r = ChatRenderer(tok).render(CONVERSATIONS[1], max_length=40)
    assert r.truncated and not r_full.truncated
    assert r.input_ids == r_full.input_ids[:40] and r.loss_mask == r_full.loss_mask[:40]


def test_template_that_is_not_prefix_consistent():
    tok = make_tokenizer("chatml")
    # Drops every assistant turn but the last: earlier replies vanish from longer renderings.
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(TemplateMismatch) as e:
        ChatRenderer(tok).render(CONVERSATIONS[1])
    assert e.value.reason == "template_not_prefix_consistent"


def test_template_that_rewrites_content():
    tok = make_tokenizer("chatml")
    tok.chat_template = TEMPLATES["chatml"].replace("message['content']", "message['content'] | upper")
    with pytest.raises(TemplateMismatch) as e:
        ChatRenderer(tok).render(CONVERSATIONS[0])
    assert e.value.reason == "template_rewrites_content"


def test_no_template_is_refused():
    tok = make_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        ChatRenderer(tok)


def test_mark_supervised():
    tok = make_tokenizer("chatml")
    r = ChatRenderer(tok).render(CONVERSATIONS[0])
    plain = mark_supervised(tok, r.input_ids, r.loss_mask, color=False)
    assert "⟦Hello! How can I help you today?<|im_end|>⟧" in plain
    assert plain.replace("⟦", "").replace("⟧", "") == r.text
    assert "\x1b[" in mark_supervised(tok, r.input_ids, r.loss_mask, color=True)


@pytest.mark.real
def test_exact_on_smollm2_and_real_sharegpt():
    """The real SmolLM2 ChatML template and tokenizer over real multi-turn ShareGPT conversations."""
    from transformers import AutoTokenizer

    from headstart.assets import resolve_data, resolve_model
    from headstart.data.sources import read_conversations

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    renderer = ChatRenderer(tok)
    checked = turns = 0
    for conv in read_conversations(resolve_data("sharegpt"), limit=100).conversations[:60]:
        r = renderer.render(conv["messages"])
        _check_exact(tok, "chatml", conv["messages"], r)
        checked += 1
        turns += sum(m["role"] == "assistant" for m in conv["messages"])
    assert checked == 60 and turns > 60  # multi-turn conversations are among them


def test_long_chats_render_only_what_max_length_keeps(monkeypatch):
    """A many-turn chat is cut before the quadratic per-turn prefix renders: the result equals the
    full render truncated, and the number of template renders stays small."""
    tok = make_tokenizer("chatml")
    r = ChatRenderer(tok)
    msgs = []
    for i in range(300):
        msgs += [{"role": "user", "content": f"question {i} about heads"},
                 {"role": "assistant", "content": f"answer {i}: draft tokens fast"}]
    full = r.render(msgs)  # no max_length: the whole chat
    calls = []
    real = ChatRenderer._render
    def counting(self, m, add_generation_prompt):
        calls.append(len(m))
        return real(self, m, add_generation_prompt)

    monkeypatch.setattr(ChatRenderer, "_render", counting)
    cut = r.render(msgs, max_length=64)
    assert cut.input_ids == full.input_ids[:64] and cut.loss_mask == full.loss_mask[:64] and cut.truncated
    assert len(calls) < 40  # instead of 3 renders per assistant turn (900)
    short = r.render(msgs[:4], max_length=4096)
    assert not short.truncated and short.input_ids == r.render(msgs[:4]).input_ids
