"""Prompt lookup (n-gram) drafting: the no-training reference proposer (vLLM's `ngram` method,
HF transformers' `prompt_lookup_num_tokens`).

The drafts are what followed the latest earlier occurrence of the sequence's last n tokens, in its
own prompt and output, trying n = ngram_max down to ngram_min. Worked example, n = 2, k = 3:

    tokens  a b c d a b      suffix (a, b) occurred at 0..1, followed by c d a  ->  drafts c d a

Nothing is trained and nothing is cached; the drafts are chosen without the verifier's random
draws, so the one-hot rule verifies them losslessly. Every report row of a trained head is
measured beside this one, so a report says what the training added.
"""

from __future__ import annotations

from headstart.inference.proposers import Proposal, _Proposer
from headstart.inference.scheduler import Sequence
from headstart.inference.speculation import SpecConfig


def lookup(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    n_tokens = len(tokens)
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = tokens[n_tokens - n:]
        first = suffix[0]
        for i in range(n_tokens - n - 1, -1, -1):  # latest first; the suffix itself is excluded
            if tokens[i] == first and tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class NgramProposer(_Proposer):
    """Drafts by prompt lookup. A step drafts as many tokens as the longest match in the batch
    (at least one, at most k); shorter matches are padded by repeating their last draft, which the
    verifier may reject without loss."""

    method = "ngram"

    def __init__(self, config: SpecConfig) -> None:
        super().__init__(config, None)

    def ready(self, seq: Sequence) -> bool:
        return True

    def absorb(self, items: list, hidden: object = None, aux: object = None) -> None:
        return None  # nothing to keep in step with the target

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        cfg = self.config
        found = [lookup(s.token_ids, k, cfg.ngram_min, cfg.ngram_max) for s in seqs]
        n = max(1, max(len(d) for d in found))
        drafts = [(d or [s.token_ids[-1]]) for d, s in zip(found, seqs)]
        drafts = [d + [d[-1]] * (n - len(d)) for d in drafts]
        return Proposal(drafts, [None] * len(seqs))

    def after_verify(self, seq: Sequence, n: int, accepted: int) -> None:
        seq.draft.cached = n
