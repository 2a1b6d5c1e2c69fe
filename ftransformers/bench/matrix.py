"""`--matrix seed`: the test matrix of SPEC §4, and the context-length filter every sweep goes through."""

from __future__ import annotations

from dataclasses import dataclass

SEARCH_INPUTS = (128, 1024, 4096, 8192, 32768)
SEARCH_OUTPUTS = (128, 512, 1024)
LONG_INPUTS = (65536, 131072)
LONG_OUTPUT = 1024
LONG_PARALLEL = (1, 4, 8)


@dataclass(frozen=True)
class PlanItem:
    input_len: int
    output_len: int
    parallel: tuple[int, ...] = ()  # fixed concurrencies; empty: search for the max concurrency
    numbers: tuple[int, ...] = ()

    @property
    def search(self) -> bool:
        return not self.parallel


def seed_matrix() -> list[PlanItem]:
    items = [PlanItem(i, o) for i in SEARCH_INPUTS for o in SEARCH_OUTPUTS]
    items += [PlanItem(i, LONG_OUTPUT, LONG_PARALLEL) for i in LONG_INPUTS]
    return items


def fits(input_len: int, output_len: int, context_length: int | None) -> bool:
    return context_length is None or input_len + output_len <= context_length


def split_by_context(items: list[PlanItem], context_length: int | None) -> tuple[list[PlanItem], list[str]]:
    """(items that fit, a note per item skipped because input + output exceeds the server's context)."""
    kept, notes = [], []
    for it in items:
        if fits(it.input_len, it.output_len, context_length):
            kept.append(it)
        else:
            notes.append(f"skipped input {it.input_len} x output {it.output_len}: {it.input_len + it.output_len} "
                         f"tokens exceed the server's context length {context_length}")
    return kept, notes
