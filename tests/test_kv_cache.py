import random

import pytest
import torch

from headstart.inference.kv_cache import KVCacheSpec, OutOfPages, PageAllocator, pages_for_budget


def test_reserve_slots_rollback_release():
    a = PageAllocator(num_pages=8, page_size=4)
    a.reserve("x", 6)  # 2 pages
    assert a.num_free == 6 and len(a.page_table("x")) == 2
    t = a.page_table("x")
    assert a.slots("x", 0, 6) == [t[0] * 4 + i for i in range(4)] + [t[1] * 4, t[1] * 4 + 1]
    a.reserve("x", 6 + 3)  # 3 lookahead slots: a third page
    assert len(a.page_table("x")) == 3 and a.length("x") == 9
    a.rollback("x", 3)  # back to 6 tokens: the third page is returned
    assert len(a.page_table("x")) == 2 and a.num_free == 6 and a.length("x") == 6
    with pytest.raises(ValueError, match="cannot roll back"):
        a.rollback("x", 7)
    with pytest.raises(ValueError, match="reserved"):
        a.slots("x", 0, 7)
    a.release("x")
    assert a.num_free == 8 and a.page_table("x") == []


def test_page_size_one_and_out_of_pages():
    a = PageAllocator(num_pages=3, page_size=1)
    a.reserve("x", 2)
    assert a.slots("x", 0, 2) == a.page_table("x")
    assert not a.can_reserve("y", 2)
    with pytest.raises(OutOfPages):
        a.reserve("y", 2)
    assert a.num_free == 1 and a.page_table("y") == []  # a failed reserve takes nothing


def test_random_workload_never_leaks():
    rng = random.Random(0)
    a = PageAllocator(num_pages=50, page_size=3)
    live: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.4 or not live:
            sid, n = f"s{step}", rng.randint(1, 20)
            if a.can_reserve(sid, n):
                a.reserve(sid, n)
                live[sid] = n
        elif op < 0.7:
            sid = rng.choice(list(live))
            n = live[sid] + rng.randint(1, 5)
            if a.can_reserve(sid, n):
                a.reserve(sid, n)
                live[sid] = n
        elif op < 0.85:
            sid = rng.choice(list(live))
            k = rng.randint(0, live[sid])
            a.rollback(sid, k)
            live[sid] -= k
        else:
            sid = rng.choice(list(live))
            a.release(sid)
            del live[sid]
        used = sum(len(a.page_table(s)) for s in live)
        assert used + a.num_free == 50
        all_pages = [p for s in live for p in a.page_table(s)]
        assert len(all_pages) == len(set(all_pages))  # no page owned twice
    for s in list(live):
        a.release(s)
    assert a.num_free == 50


def test_pages_for_budget():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    assert spec.bytes_per_page(16) == 2 * 30 * 16 * 3 * 64 * 2
    assert pages_for_budget(1.0, [spec], 16) == 1024**3 // spec.bytes_per_page(16)
    both = pages_for_budget(1.0, [spec, spec], 16)
    assert both == 1024**3 // (2 * spec.bytes_per_page(16))  # target + draft share the page budget
