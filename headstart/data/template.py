"""Chat rendering with the target tokenizer's own template, and the assistant-only loss mask.

The mask is derived from the template, not from hand-written separators. For assistant turn k:

    prompt_k = render(messages[:k], add_generation_prompt=True)    # what the model is given
    full_k   = render(messages[:k+1])                              # ... plus its reply
    turn_k   = full_k[len(prompt_k):]                              # = pre + content + post

`pre` and `post` are found by rendering the same turn with a sentinel in place of the content, so a
content string that also occurs in a header cannot confuse the split. Supervised characters are
the content and, in `post`, everything up to and including the first special token (the
end-of-turn token the model must emit to stop: `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...).
Role headers, `pre` (e.g. an inserted empty think block), user/system text and the separators after
the end-of-turn token are not supervised. The whole text is then tokenised once with character
offsets; a token is supervised iff it starts inside a supervised character span.

Worked example (ChatML, one turn): the text
    <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n
supervises exactly the tokens of `Hello!` and `<|im_end|>`; the trailing `\n` is not supervised.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

_SENTINEL = "\u2063HEADSTART\u2063SENTINEL\u2063"  # invisible separators: never in real data


class TemplateMismatch(Exception):
    """The template does not render this conversation in a way the mask can be derived from."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class Rendered:
    text: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 = supervised (assistant content or its end-of-turn token)
    truncated: bool  # the conversation was longer than max_length tokens


class ChatRenderer:
    """Renders normalised conversations with a tokenizer's chat template and masks them exactly."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; set one or use a chat/instruct model")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer (with character offsets) is required for exact loss masks")
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja raise_exception() and template bugs surface here
            raise TemplateMismatch("template_error", f"the chat template refused the conversation: {e}") from e

    def _within(self, messages: list[dict[str, str]], max_length: int) -> tuple[list[dict[str, str]], int | None]:
        """The leading turns whose rendering already holds more than max_length tokens (with a margin
        for merges at the cut), so that the per-turn prefix renders of `spans` never touch turns that
        truncation would drop: a 5,000-turn chat costs what its first max_length tokens cost.
        Returns (turns kept, None if all were kept else the number of turns)."""
        margin = max_length + 16
        threshold, chars = margin, 0  # a token spans at least one character: fewer chars, fewer tokens
        for k, m in enumerate(messages[:-1], start=1):
            chars += len(m["content"])
            if chars <= threshold:
                continue
            text = self._render(messages[:k], add_generation_prompt=False)
            if len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) > margin:
                return messages[:k], len(messages)
            threshold = 2 * chars  # render again only after the text has doubled
        return messages, None

    def spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int, int]]]:
        """The rendered text and, per assistant turn, (content_start, content_end, post_end) in characters."""
        text = self._render(messages, add_generation_prompt=False)
        out: list[tuple[int, int, int]] = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._render(messages[:k], add_generation_prompt=True)
            full = self._render(messages[: k + 1], add_generation_prompt=False)
            probe = self._render(messages[:k] + [{**m, "content": _SENTINEL}], add_generation_prompt=False)
            if not (full.startswith(prompt) and probe.startswith(prompt) and text.startswith(full)):
                raise TemplateMismatch(
                    "template_not_prefix_consistent",
                    f"turn {k}: rendering a prefix of the conversation is not a prefix of its rendering",
                )
            pre, sep, post = probe[len(prompt):].partition(_SENTINEL)
            if not sep:
                raise TemplateMismatch("template_error", f"turn {k}: the template does not emit the content")
            turn = full[len(prompt):]
            content = m["content"]
            if turn != pre + content + post:
                content = content.strip()  # templates that trim the content (Llama-3, Gemma, ...)
                if turn != pre + content + post:
                    raise TemplateMismatch("template_rewrites_content", f"turn {k}: content is rewritten")
            start = len(prompt) + len(pre)
            out.append((start, start + len(content), start + len(content) + len(post)))
        return text, out

    def render(self, messages: list[dict[str, str]], max_length: int | None = None) -> Rendered:
        full_length = None
        if max_length is not None:
            messages, full_length = self._within(messages, max_length)
        text, turns = self.spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids: list[int] = enc["input_ids"]
        starts = [s for s, _ in enc["offset_mapping"]]
        mask = [0] * len(ids)
        for c0, c1, post_end in turns:
            t = bisect.bisect_left(starts, c0)
            while t < len(ids) and starts[t] < c1:
                mask[t] = 1
                t += 1
            # After the content, inside this turn's `post`: supervise through the first special
            # token (the end-of-turn token); a template without one supervises the content only.
            u = t
            while u < len(ids) and starts[u] < post_end and ids[u] not in self.special_ids:
                u += 1
            if u < len(ids) and starts[u] < post_end:
                for j in range(t, u + 1):
                    mask[j] = 1
        truncated = max_length is not None and (len(ids) > max_length or full_length is not None)
        if truncated:
            ids, mask = ids[:max_length], mask[:max_length]
        return Rendered(text, ids, mask, truncated)


def mark_supervised(tokenizer: Any, input_ids: list[int], loss_mask: list[int], color: bool) -> str:
    """Decode a rendered sample with supervised spans visibly marked: ⟦supervised⟧ (green on a tty)."""
    parts: list[str] = []
    i = 0
    while i < len(input_ids):
        j = i
        while j < len(input_ids) and loss_mask[j] == loss_mask[i]:
            j += 1
        piece = tokenizer.decode(input_ids[i:j], skip_special_tokens=False)
        if loss_mask[i]:
            piece = f"\x1b[1;32m⟦{piece}⟧\x1b[0m" if color else f"⟦{piece}⟧"
        elif color:
            piece = f"\x1b[2m{piece}\x1b[0m"
        parts.append(piece)
        i = j
    return "".join(parts)
