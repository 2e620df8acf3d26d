"""Prefix caching: registered full pages are reused by later prompts that start with them, exactly
(greedy outputs equal the uncached engine's), and every page comes back (no leak, no double owner)."""

import random

import pytest
from tiny_models import make_hf_model

from headstart.inference import Engine, SamplingParams
from headstart.inference.kv_cache import PageAllocator
from headstart.inference.speculation import SpecConfig
from headstart.models.llama import load_llama


def _held(a: PageAllocator, live) -> list[int]:
    return [p for s in live for p in a.page_table(s)]


def test_a_second_prompt_takes_the_registered_pages_it_starts_with():
    a = PageAllocator(num_pages=10, page_size=4, prefix_cache=True)
    first = list(range(100, 111))  # 11 tokens: pages [0:4] and [4:8] are full
    a.reserve("x", 11)
    a.commit("x", first, 11)
    assert a.match("y", first + [7, 8]) == 8  # both full pages, shared
    assert a.page_table("y") == a.page_table("x")[:2] and a.length("y") == 8
    assert a.num_free == 10 - 3  # three pages held, two of them by both
    a.release("x")
    assert a.num_free == 10 - 2  # the shared pages stay with y; x's third page (never full) is free
    a.release("y")
    assert a.num_free == 10  # idle registered pages count as free ...
    assert a.match("z", first[:9]) == 8  # ... and are still found after every holder let go


def test_the_last_token_is_always_computed_and_keys_are_exact():
    a = PageAllocator(num_pages=10, page_size=4, prefix_cache=True)
    p = [1, 2, 3, 4, 5, 6, 7, 8]
    a.reserve("x", 8)
    a.commit("x", p, 8)
    assert a.match("same", p) == 4  # a prompt of exactly two registered pages recomputes its last page
    assert a.match("one", p[:4]) == 0  # one page, nothing before its last token to reuse
    assert a.match("other-head", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0  # page 2's tokens after another page 1
    assert a.match("shifted", [5, 6, 7, 8, 1]) == 0  # page 2's tokens at position 0
    assert a.match("partial", [1, 2, 3, 0, 5]) == 0  # one token differs inside the page


def test_commit_registers_only_computed_full_pages():
    a = PageAllocator(num_pages=10, page_size=4, prefix_cache=True)
    p = list(range(1, 13))
    a.reserve("x", 12)
    a.commit("x", p, 6)  # 6 of 12 computed: page 1 only
    assert a.match("y", p + [0]) == 4
    assert a.uncommitted("x", 12) and not a.uncommitted("x", 7)
    a.commit("x", p, 12)
    assert a.match("z", p + [0]) == 12


def test_idle_pages_are_evicted_least_recently_released_first_and_the_tail_before_the_head():
    a = PageAllocator(num_pages=4, page_size=2, prefix_cache=True)
    p = [1, 2, 3, 4, 5, 6, 7, 8]
    a.reserve("x", 8)
    a.commit("x", p, 8)
    a.release("x")  # four idle registered pages
    a.reserve("fresh", 2)  # needs one page: x's last page is evicted, not its first
    assert a.match("y", p + [0]) == 6
    a.release("y")
    a.release("fresh")
    a.reserve("big", 8)  # every page: the cache forgets everything
    assert a.num_free == 0
    a.release("big")
    assert a.match("again", p + [0]) == 0


def test_random_workload_with_sharing_never_leaks_or_double_hands_a_page():
    rng = random.Random(0)
    a = PageAllocator(num_pages=40, page_size=3, prefix_cache=True)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.45 or not live:
            sid = f"s{step}"
            toks = rng.choice(stems)[: rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            cached = a.match(sid, toks)
            assert cached % 3 == 0 and cached < len(toks)
            assert toks[:cached] == live.get(sid, toks)[:cached]
            if a.can_reserve(sid, len(toks)):
                a.reserve(sid, len(toks))
                a.commit(sid, toks, len(toks))
                live[sid] = toks
            else:
                a.release(sid)
        elif op < 0.7:
            sid = rng.choice(list(live))
            toks = live[sid] + [rng.randrange(50) for _ in range(rng.randint(1, 4))]
            if a.can_reserve(sid, len(toks)):
                a.reserve(sid, len(toks))
                a.commit(sid, toks, len(toks))
                live[sid] = toks
        else:
            a.release(rng.choice(list(live)))
            live = {s: t for s, t in live.items() if a.page_table(s)}
        held = _held(a, live)
        assert len(set(held)) + a.num_free == 40  # every page is held, idle or free
        for s, toks in live.items():  # a shared page holds the same tokens for every holder
            for i, page in enumerate(a.page_table(s)[: len(toks) // 3]):
                for o, otoks in live.items():
                    if page in a.page_table(o)[: len(otoks) // 3]:
                        j = a.page_table(o).index(page)
                        assert i == j and toks[: 3 * (i + 1)] == otoks[: 3 * (j + 1)]
    for s in list(live):
        a.release(s)
    assert a.num_free == 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama-prefix")
    make_hf_model("llama", d, seed=4)
    return d


def _engine(d, **kw):
    kw.setdefault("page_size", 4)
    return Engine(load_llama(d, "fp32"), dtype="fp32", **kw)


def test_a_conversation_s_next_turns_reuse_its_history_and_decode_exactly(tiny):
    rng = random.Random(3)
    convs = [[rng.randrange(2, 320) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    cached = _engine(tiny, max_batch_size=4, prefix_cache=True)
    plain = _engine(tiny, max_batch_size=4)
    for _ in range(3):  # three turns: each prompt is the last prompt, its answer and a new user turn
        got = cached.generate(convs, params)
        ref = plain.generate(convs, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        convs = [c + o.token_ids + [rng.randrange(2, 320) for _ in range(rng.randint(1, 6))]
                 for c, o in zip(convs, got)]
    assert cached.stats.cached_tokens > 0 and plain.stats.cached_tokens == 0
    assert cached.stats.prefill_tokens + cached.stats.cached_tokens == plain.stats.prefill_tokens
    assert cached.allocator.num_free == cached.allocator.num_pages


def test_prefix_cache_under_preemption_is_exact_and_gives_every_page_back(tiny):
    rng = random.Random(9)
    stems = [[rng.randrange(2, 320) for _ in range(16)] for _ in range(3)]
    prompts = [rng.choice(stems)[: rng.randint(1, 16)] + [rng.randrange(2, 320) for _ in range(rng.randint(1, 8))]
               for _ in range(120)]
    params = [SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=True) for _ in prompts]
    need = sum(-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(prompts, params))
    eng = _engine(tiny, num_pages=need // 12, max_batch_size=48, max_batched_tokens=128, prefix_cache=True)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert eng.stats.preemptions > 0 and eng.stats.cached_tokens > 0
    assert eng.allocator.num_free == eng.allocator.num_pages
    ref = [o.token_ids for o in _engine(tiny, max_batch_size=1).generate(prompts, params)]
    assert got == ref


def test_prefix_cache_is_refused_beside_speculation(tiny):
    with pytest.raises(ValueError, match="prefix_cache.*without speculation"):
        _engine(tiny, prefix_cache=True, spec=SpecConfig(method="ngram", k=2))


def test_two_sequences_computing_the_same_pages_leave_one_reachable_chain():
    a = PageAllocator(num_pages=12, page_size=2, prefix_cache=True)
    p = [5, 6, 7, 8, 9, 10, 11]
    for s in ("x", "y"):  # admitted together: neither found the other's pages
        assert a.match(s, p) == 0
        a.reserve(s, 7)
    a.commit("x", p, 7)
    a.commit("y", p, 7)  # same tokens: y's pages stay private, its chain follows x's serials
    a.reserve("y", 9)
    a.commit("y", p + [12, 13], 9)  # y's next full page hangs off x's chain
    assert a.match("z", p + [12, 13, 14]) == 8  # every full page of the longest prefix, through both owners


def test_an_answer_s_pages_serve_the_next_turn(tiny):
    eng = _engine(tiny, prefix_cache=True)
    prompt = list(range(10, 23))  # 13 tokens
    out = eng.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    history = prompt + out.token_ids  # 23 tokens; the last answer token's K/V were never computed
    eng.generate([history + [40, 41]], SamplingParams(max_tokens=1))
    assert eng.stats.cached_tokens == (len(history) - 1) // 4 * 4  # decode steps registered their pages too


def test_a_waiting_sequence_that_cannot_be_admitted_holds_no_pages(tiny):
    """Matching a waiting sequence takes references; when its admission fails they must go back, or it
    is later recomputed into pages others share (and the engine can stall)."""
    eng = _engine(tiny, num_pages=6, max_batch_size=4, prefix_cache=True)
    stem = list(range(30, 42))  # 12 tokens: 3 pages once registered
    eng.generate([stem + [1]], SamplingParams(max_tokens=1))
    eng.add_request([7, 8, 9, 10], SamplingParams(max_tokens=19, ignore_eos=True), request_id="x")
    eng.step()
    eng.add_request(stem + list(range(50, 61)), SamplingParams(max_tokens=1), request_id="w")
    done = {}
    for _ in range(200):
        for o in eng.step():
            if o.finished:
                done[o.id] = o
        for seq in eng.scheduler.waiting:
            assert eng.allocator.page_table(seq.id) == []
        if not eng.has_unfinished():
            break
    assert set(done) == {"x", "w"} and eng.allocator.num_free == 6
