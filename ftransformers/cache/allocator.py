"""Index allocators (pure Python): KV token slots of the pool and rows of the req_to_token table.

Ownership: whoever receives indices from `alloc` frees them exactly once. Freeing an index that is
already free (or out of range) is a bug and raises `AllocatorError`; the check is a bytearray
lookup per index, cheap enough to stay on.
"""

from __future__ import annotations

from collections.abc import Iterable


class AllocatorError(RuntimeError):
    """Double free or out-of-range index: a bookkeeping bug in the caller."""


class TokenSlotAllocator:
    """KV slots 1..size of the pool; slot 0 is the padding sink and is never handed out."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"KV pool must have at least one slot, got {size}")
        self.size = size
        self.clear()

    def clear(self) -> None:
        # Kept in descending order so `alloc` hands out low slots first; freed slots are reused first.
        self._free: list[int] = list(range(self.size, 0, -1))
        self._is_free = bytearray(b"\x01") * (self.size + 1)
        self._is_free[0] = 0

    @property
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` slots, or None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        slots = self._free[-n:]
        del self._free[-n:]
        slots.reverse()
        is_free = self._is_free
        for s in slots:
            is_free[s] = 0
        return slots

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        is_free = self._is_free
        for s in slots:
            if not 0 < s <= self.size:
                raise AllocatorError(f"KV slot {s} out of range 1..{self.size}")
            if is_free[s]:
                raise AllocatorError(f"KV slot {s} freed twice")
            is_free[s] = 1
        self._free.extend(slots)


class ReqSlotAllocator:
    """Rows 0..num_slots-1 of the worker's req_to_token table."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one request slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_slots

    @property
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.pop()
        self._is_free[idx] = 0
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.num_slots:
            raise AllocatorError(f"request slot {idx} out of range 0..{self.num_slots - 1}")
        if self._is_free[idx]:
            raise AllocatorError(f"request slot {idx} freed twice")
        self._is_free[idx] = 1
        self._free.append(idx)
