"""Token-level radix tree from token-id sequences to KV slots (SGLang's RadixCache, page size 1).

Invariants:
- Each non-root node holds `key` (token ids) and `value` (the KV slots of those tokens, same
  length); a path from the root spells a sequence and concatenates its slots. Children are keyed
  by the first token of their key, so siblings never share a first token.
- The tree owns the slots of every node. `insert` takes ownership of the slots past the part
  already present; `evict` hands slots back through `free_fn`.
- `lock_ref` > 0 on a node means some request in flight uses it (and therefore every ancestor);
  a locked node is never evicted. The root is permanently locked.
- Only leaves with lock_ref == 0 are evicted, least recently used first; `last_access` is a
  logical clock bumped by `match_prefix` and `insert` along the path they touch.
- `evictable_size() + protected_size() == total_size()` == tokens held by the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

FreeFn = Callable[[list[int]], None]


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None = None, key: list[int] | None = None,
                 value: list[int] | None = None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value: list[int] = value if value is not None else []
        self.lock_ref = 0
        self.last_access = 0


class PrefixCache(Protocol):
    """What the scheduler needs from a prefix cache (the radix tree or the disabled variant)."""

    root: TreeNode

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], TreeNode]: ...
    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int: ...
    def inc_lock_ref(self, node: TreeNode) -> None: ...
    def dec_lock_ref(self, node: TreeNode) -> None: ...
    def evict(self, num_tokens: int, free_fn: FreeFn) -> int: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def total_size(self) -> int: ...
    def reset(self) -> None: ...


def _common_len(key: list[int], token_ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(token_ids) - start)
    i = 0
    while i < n and key[i] == token_ids[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything. The caller frees the slots first (e.g. `evict(total_size(), ...)`)."""
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], TreeNode]:
        """Slots of the longest cached prefix of `token_ids`, and the node where it ends.

        A match ending inside a node splits it, so the returned node covers exactly the match.
        """
        now = self._tick()
        node = self.root
        node.last_access = now
        slots: list[int] = []
        i = 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            n = _common_len(child.key, token_ids, i)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            slots.extend(child.value)
            node = child
            i += n
            if partial:
                break
        return slots, node

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Add a sequence; returns how many leading tokens were already present.

        The tree takes ownership of `slots[returned:]`; `slots[:returned]` stay the caller's
        (duplicates of cached KV, or slots it got from `match_prefix`).
        """
        if len(token_ids) != len(slots):
            raise ValueError(f"insert: {len(token_ids)} tokens but {len(slots)} slots")
        now = self._tick()
        node = self.root
        node.last_access = now
        i = 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                leaf = TreeNode(node, list(token_ids[i:]), list(slots[i:]))
                leaf.last_access = now
                node.children[token_ids[i]] = leaf
                self._evictable += len(leaf.key)
                return i
            n = _common_len(child.key, token_ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node = child
            i += n
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens (0 < n < len); returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(parent, child.key[:n], child.value[:n])
        upper.lock_ref = child.lock_ref  # every lock through `child` also covers its prefix
        upper.last_access = child.last_access
        upper.children[child.key[n]] = child
        parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int, free_fn: FreeFn) -> int:
        """Free at least `num_tokens` (when possible) from unlocked leaves, LRU first; returns count."""
        if num_tokens <= 0:
            return 0
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            free_fn(node.value)
            evicted += len(node.value)
            self._evictable -= len(node.key)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return evicted

    def _leaves(self) -> list[TreeNode]:
        leaves: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected


class DisabledRadixCache:
    """--disable-radix-cache: matches nothing and keeps nothing (`insert` hands every slot back)."""

    def __init__(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], TreeNode]:
        return [], self.root

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        if len(token_ids) != len(slots):
            raise ValueError(f"insert: {len(token_ids)} tokens but {len(slots)} slots")
        return len(token_ids)

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int, free_fn: FreeFn) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass


def make_prefix_cache(disable: bool) -> RadixCache | DisabledRadixCache:
    return DisabledRadixCache() if disable else RadixCache()
