"""RadixCache: splits, matches, duplicate inserts, lock refs, LRU eviction, and a randomized
property test against a brute-force model (a dict from every cached prefix to its last slot)."""

from __future__ import annotations

import random

from ftransformers.cache.allocator import TokenSlotAllocator
from ftransformers.cache.radix_cache import DisabledRadixCache, RadixCache, TreeNode


def _sizes_ok(c: RadixCache) -> None:
    assert c.evictable_size() + c.protected_size() == c.total_size()
    assert c.evictable_size() >= 0 and c.protected_size() >= 0


def test_insert_match_and_split() -> None:
    c = RadixCache()
    assert c.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert c.total_size() == 4
    slots, node = c.match_prefix([1, 2, 9])
    assert slots == [10, 11]
    assert node.key == [1, 2] and node.parent is c.root
    (only,) = c.root.children.values()
    assert only is node and list(node.children.values())[0].key == [3, 4]
    assert c.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11, 12, 13]
    assert c.match_prefix([7])[0] == []
    assert c.match_prefix([])[0] == []
    # Diverging in the middle of an edge: 2 tokens present, a new leaf for the rest.
    assert c.insert([1, 2, 5, 6], [20, 21, 22, 23]) == 2
    assert c.total_size() == 6
    assert c.match_prefix([1, 2, 5, 6])[0] == [10, 11, 22, 23]
    # A prefix of something cached: all present, nothing taken.
    assert c.insert([1, 2, 3], [30, 31, 32]) == 3
    assert c.total_size() == 6
    _sizes_ok(c)


def test_match_splits_at_token_granularity() -> None:
    c = RadixCache()
    c.insert(list(range(10)), list(range(100, 110)))
    slots, node = c.match_prefix([0, 1, 2, 3, 4, 5, 6, 99])
    assert slots == list(range(100, 107))
    assert len(node.key) == 7 and len(node.children) == 1
    assert c.total_size() == 10


def test_lock_refs_protect_from_eviction() -> None:
    c = RadixCache()
    alloc = TokenSlotAllocator(32)
    s1 = alloc.alloc(4)
    s2 = alloc.alloc(2)
    assert s1 is not None and s2 is not None
    c.insert([1, 2, 3, 4], s1)
    assert c.insert([1, 2, 7, 8], [0, 0] + s2) == 2
    _, node = c.match_prefix([1, 2, 3])
    c.inc_lock_ref(node)
    assert c.protected_size() == 3 and c.evictable_size() == 3
    c.inc_lock_ref(node)  # a second request on the same prefix
    freed: list[int] = []

    def free(slots: list[int]) -> None:
        freed.extend(slots)
        alloc.free(slots)

    assert c.evict(100, free) == 3  # [4] and [7, 8]; the locked [1, 2, 3] stays
    assert sorted(freed) == sorted([s1[3]] + s2)
    assert c.match_prefix([1, 2, 3, 4])[0] == s1[:3]
    c.dec_lock_ref(node)
    assert c.protected_size() == 3
    c.dec_lock_ref(node)
    assert c.protected_size() == 0 and c.evictable_size() == 3
    assert c.evict(1, free) == 1  # the leaf [3] alone suffices
    assert c.evict(2, free) == 2
    assert c.total_size() == 0 and alloc.available_size == 32


def test_lru_eviction_order() -> None:
    c = RadixCache()
    c.insert([1, 1], [11, 12])
    c.insert([2, 2], [21, 22])
    c.insert([3, 3], [31, 32])
    c.match_prefix([1, 1])  # 1 is now the most recent; 2 the least
    order: list[list[int]] = []
    assert c.evict(2, lambda s: order.append(list(s))) == 2
    assert order == [[21, 22]]
    c.insert([2, 5], [25, 26])  # re-added, newest
    c.evict(4, lambda s: order.append(list(s)))
    assert order == [[21, 22], [31, 32], [11, 12]]
    # A parent whose children are all evicted becomes a leaf and is evicted in turn.
    c2 = RadixCache()
    c2.insert([1, 2, 3], [1, 2, 3])
    c2.insert([1, 2, 4], [1, 2, 4])
    got: list[int] = []
    assert c2.evict(10, got.extend) == 4
    assert sorted(got) == [1, 2, 3, 4] and c2.total_size() == 0


def test_reset() -> None:
    c = RadixCache()
    c.insert([1, 2], [5, 6])
    c.reset()
    assert c.total_size() == 0 and c.match_prefix([1, 2])[0] == []


def test_disabled_cache() -> None:
    c = DisabledRadixCache()
    assert c.insert([1, 2, 3], [4, 5, 6]) == 3  # caller keeps (and frees) every slot
    slots, node = c.match_prefix([1, 2, 3])
    assert slots == [] and node is c.root
    c.inc_lock_ref(node)
    c.dec_lock_ref(node)
    assert c.evict(10, lambda s: None) == 0
    assert c.total_size() == c.evictable_size() == c.protected_size() == 0


def _path_tokens(node: TreeNode) -> list[int]:
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for p in reversed(parts) for t in p]


def test_randomized_against_brute_force() -> None:
    rng = random.Random(20240607)
    for trial in range(12):
        capacity = 400
        alloc = TokenSlotAllocator(capacity)
        c = RadixCache()
        model: dict[tuple[int, ...], int] = {}  # every cached prefix -> slot of its last token
        locks: list[tuple[TreeNode, tuple[int, ...]]] = []
        vocab = rng.choice([2, 3, 5])
        for _ in range(300):
            op = rng.random()
            seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            if op < 0.35:
                slots = alloc.alloc(len(seq))
                if slots is None:
                    continue
                expect = 0
                while expect < len(seq) and tuple(seq[: expect + 1]) in model:
                    expect += 1
                got = c.insert(seq, slots)
                assert got == expect
                alloc.free(slots[:got])
                for j in range(got, len(seq)):
                    model[tuple(seq[: j + 1])] = slots[j]
            elif op < 0.6:
                slots, node = c.match_prefix(seq)
                m = 0
                while m < len(seq) and tuple(seq[: m + 1]) in model:
                    m += 1
                assert slots == [model[tuple(seq[: j + 1])] for j in range(m)]
                assert _path_tokens(node) == seq[:m]
                if rng.random() < 0.5 and m:
                    c.inc_lock_ref(node)
                    locks.append((node, tuple(seq[:m])))
            elif op < 0.75 and locks:
                node, _ = locks.pop(rng.randrange(len(locks)))
                c.dec_lock_ref(node)
            else:
                before = c.evictable_size()
                want = rng.randint(1, 30)
                freed: list[int] = []
                n = c.evict(want, lambda s: (freed.extend(s), alloc.free(s)))
                assert n == len(freed)
                assert n >= want if before >= want else n == before
                gone = set(freed)
                removed = [k for k, v in model.items() if v in gone]
                assert len(removed) == n
                for k in removed:
                    del model[k]
                    assert not any(p[: len(k)] == k for _, p in locks), "evicted a locked prefix"
            # Model and tree agree on size; the tree stays prefix-closed; slots are conserved.
            protected = {p[:j] for _, p in locks for j in range(1, len(p) + 1)}
            assert c.total_size() == len(model)
            assert c.protected_size() == len(protected)
            assert all(len(k) == 1 or k[:-1] in model for k in model)
            assert alloc.available_size + c.total_size() == capacity
            _sizes_ok(c)
        for node, _ in locks:
            c.dec_lock_ref(node)
        c.evict(c.total_size(), alloc.free)
        assert c.total_size() == 0 and alloc.available_size == capacity, trial
