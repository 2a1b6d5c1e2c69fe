"""Index bookkeeping for admitted requests: req_to_token rows, KV slots, and the prefix cache.

Who frees what: a request's own slots (kv_slots[cache_owned_len:]) go back on `release`, either to
the prefix cache (which takes ownership of what it did not have) or to the allocator (duplicates,
or everything when the cache is disabled). Slots owned by the cache are freed only by `evict`.
"""

from __future__ import annotations

from ftransformers.cache.allocator import ReqSlotAllocator, TokenSlotAllocator
from ftransformers.cache.radix_cache import make_prefix_cache
from ftransformers.scheduler.req import Req


class KVManager:
    def __init__(self, kv_capacity: int, max_req_slots: int, disable_radix_cache: bool) -> None:
        self.kv_capacity = kv_capacity
        self.token_allocator = TokenSlotAllocator(kv_capacity)
        self.req_allocator = ReqSlotAllocator(max_req_slots)
        self.tree_cache = make_prefix_cache(disable_radix_cache)

    def available(self) -> int:
        """Slots obtainable now: free ones plus those evictable from the prefix cache."""
        return self.token_allocator.available_size + self.tree_cache.evictable_size()

    def used_by_requests(self) -> int:
        return self.kv_capacity - self.available()

    def cached_only(self) -> int:
        return self.tree_cache.evictable_size()

    def alloc(self, n: int) -> list[int] | None:
        """`n` slots, evicting unlocked cache leaves when short; None (nothing taken) if impossible."""
        short = n - self.token_allocator.available_size
        if short > 0:
            self.tree_cache.evict(short, self.token_allocator.free)
        return self.token_allocator.alloc(n)

    def admit(self, req: Req) -> bool:
        """Give `req` a req_to_token row and lock its cached prefix; False when no row is free.

        The match leaves at least the last token uncomputed so the first step has a token to
        sample after.
        """
        idx = self.req_allocator.alloc()
        if idx is None:
            return False
        slots, node = self.tree_cache.match_prefix(req.token_slice(0, req.seq_len - 1))
        self.tree_cache.inc_lock_ref(node)
        req.req_pool_idx = idx
        req.kv_slots = slots
        req.cache_owned_len = len(slots)
        req.last_node = node
        req.send_full_slots = True
        return True

    def cache_unfinished(self, req: Req) -> None:
        """Publish the KV `req` computed so far to the prefix cache so that requests arriving while
        it runs can share it; `req` then locks the longer path and owns nothing of that prefix.

        Skipped when part of it was already cached under other slots: the worker's row points at
        `req`'s own copies, which must stay alive until `release` frees them as duplicates.
        """
        k = len(req.kv_slots)
        if k == req.cache_owned_len:
            return
        tokens = req.token_slice(0, k)
        if len(self.tree_cache.match_prefix(tokens)[0]) != req.cache_owned_len:
            return  # others cached part of it meanwhile
        if self.tree_cache.insert(tokens, req.kv_slots) != req.cache_owned_len:
            return  # the cache took nothing (disabled)
        slots, node = self.tree_cache.match_prefix(tokens)
        assert slots == req.kv_slots
        self.tree_cache.inc_lock_ref(node)
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        req.last_node = node
        req.cache_owned_len = k

    def release(self, req: Req) -> None:
        """Hand back everything `req` holds; the KV it computed stays in the prefix cache."""
        k = len(req.kv_slots)
        if k:
            present = self.tree_cache.insert(req.token_slice(0, k), req.kv_slots)
            # present >= cache_owned_len: the locked matched path is still in the tree.
            assert present >= req.cache_owned_len, (present, req.cache_owned_len)
            self.token_allocator.free(req.kv_slots[req.cache_owned_len : present])
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        if req.req_pool_idx is not None:
            self.req_allocator.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_slots = []
        req.cache_owned_len = 0
        req.last_node = None
        req.send_full_slots = True

    def flush(self) -> None:
        """Drop the whole prefix cache; only valid while no request holds anything."""
        cache = self.tree_cache
        cache.evict(cache.total_size(), self.token_allocator.free)
        cache.reset()
        if self.token_allocator.available_size != self.kv_capacity:
            raise RuntimeError("flush_cache: KV slots still held after evicting the whole cache")
