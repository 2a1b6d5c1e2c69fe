"""TokenSlotAllocator / ReqSlotAllocator: all-or-nothing allocation, slot 0 never handed out,
double frees and out-of-range frees detected, conservation under random churn."""

from __future__ import annotations

import random

import pytest

from ftransformers.cache.allocator import AllocatorError, ReqSlotAllocator, TokenSlotAllocator


def test_token_alloc_basic_and_all_or_nothing() -> None:
    a = TokenSlotAllocator(10)
    assert a.available_size == 10
    s = a.alloc(4)
    assert s is not None and len(s) == 4 and len(set(s)) == 4
    assert all(1 <= x <= 10 for x in s)
    assert a.available_size == 6
    assert a.alloc(7) is None
    assert a.available_size == 6  # failed alloc takes nothing
    rest = a.alloc(6)
    assert rest is not None and sorted(s + rest) == list(range(1, 11))
    assert a.alloc(1) is None
    assert a.alloc(0) == []
    a.free(s)
    assert a.available_size == 4


def test_token_alloc_never_slot_zero() -> None:
    a = TokenSlotAllocator(3)
    got = a.alloc(3)
    assert got is not None and 0 not in got
    with pytest.raises(AllocatorError):
        a.free([0])


def test_token_double_free_and_range() -> None:
    a = TokenSlotAllocator(5)
    s = a.alloc(2)
    assert s is not None
    a.free(s)
    with pytest.raises(AllocatorError, match="twice"):
        a.free([s[0]])
    with pytest.raises(AllocatorError, match="twice"):
        a.free([3])  # never allocated
    with pytest.raises(AllocatorError, match="range"):
        a.free([6])
    b = TokenSlotAllocator(5)
    t = b.alloc(1)
    assert t is not None
    with pytest.raises(AllocatorError):
        b.free([t[0], t[0]])  # twice within one call


def test_token_random_churn_conserves_slots() -> None:
    rng = random.Random(1234)
    size = 97
    a = TokenSlotAllocator(size)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 20)
            got = a.alloc(n)
            if got is None:
                assert n > a.available_size
            else:
                held.append(got)
        live = [x for h in held for x in h]
        assert len(live) == len(set(live))
        assert len(live) + a.available_size == size
        assert all(1 <= x <= size for x in live)


def test_req_slot_allocator() -> None:
    r = ReqSlotAllocator(3)
    got = [r.alloc(), r.alloc(), r.alloc()]
    assert sorted(got) == [0, 1, 2]  # type: ignore[type-var]
    assert r.alloc() is None
    r.free(1)
    assert r.available_size == 1
    with pytest.raises(AllocatorError):
        r.free(1)
    with pytest.raises(AllocatorError):
        r.free(3)
    assert r.alloc() == 1
