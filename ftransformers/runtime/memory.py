"""KV pool sizing: how many token slots the KV cache gets.

Rule (`kv_pool_tokens`), with `per_token = kv_spec.bytes_per_token(kv_dtype)` and
`wanted = max_req_slots * context_len` (enough for every request slot to fill its context):
- `--max-total-tokens N`: exactly N (on CUDA it must fit in the free memory).
- CUDA: like SGLang, the weights, the req_to_token table and the KV cache together take
  `mem_fraction_static` (default 0.88) of the device; the rest is the working reserve for
  activations. Measured after the weights are loaded:
  `budget = free_now - total * (1 - mem_fraction_static)`, tokens = min(budget / per_token, wanted).
- CPU: `mem_fraction_static` of the available RAM when given, else 25% of it capped at
  DEFAULT_CPU_KV_BYTES (a CPU serves few requests; a pool of zeros bigger than that only costs
  start-up time and RAM); tokens = min(budget / per_token, wanted).
- Never below one context's worth (`context_len`) while that still fits in the memory left free
  (the fraction may be too tight for a big context); never more than `wanted`.
- When not a single token fits, `KVCacheSizeError` says so in one line.
"""

from __future__ import annotations

import os

import torch

from ftransformers.cache.kv_pool import KVSpec
from ftransformers.config.server_args import ServerArgs

DEFAULT_CUDA_MEM_FRACTION = 0.88
DEFAULT_CPU_RAM_FRACTION = 0.25
DEFAULT_CPU_KV_BYTES = 2 << 30
# Never hand the KV cache the last bytes of a device: keep this much (or 5%) free for activations.
_MIN_HEADROOM_BYTES = 1 << 30


class KVCacheSizeError(RuntimeError):
    """The KV cache does not fit; the message is one line fit to show a user."""


def available_cpu_memory() -> int:
    """Bytes of RAM available to new allocations (MemAvailable on Linux, else physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    avail = available_cpu_memory()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return avail, total


def kv_pool_tokens(
    server_args: ServerArgs,
    kv_spec: KVSpec,
    kv_dtype: torch.dtype,
    device: torch.device,
    max_req_slots: int,
    context_len: int,
) -> int:
    """Usable KV slots for the pool; call after the weights are on the device. See module docstring."""
    per_token = kv_spec.bytes_per_token(kv_dtype)
    free, total = device_memory(device)
    hard_limit = max(0, min(free - _MIN_HEADROOM_BYTES, int(free * 0.95)))  # bytes we may ever take
    where = "GPU" if device.type == "cuda" else "RAM"
    if server_args.max_total_tokens is not None:
        tokens = server_args.max_total_tokens
        if device.type == "cuda" and tokens * per_token > hard_limit:
            raise KVCacheSizeError(
                f"--max-total-tokens {tokens} needs {_gib(tokens * per_token)} of KV cache "
                f"({per_token} B/token) but only {_gib(hard_limit)} of {where} is free"
            )
        return tokens

    wanted = max_req_slots * context_len
    if device.type == "cuda":
        fraction = server_args.mem_fraction_static or DEFAULT_CUDA_MEM_FRACTION
        budget = free - int(total * (1.0 - fraction))
    else:
        if server_args.mem_fraction_static is not None:
            budget = int(free * server_args.mem_fraction_static)
        else:
            budget = min(int(free * DEFAULT_CPU_RAM_FRACTION), DEFAULT_CPU_KV_BYTES)
    tokens = min(max(budget, 0) // per_token, wanted)
    # At least one full context when the memory is there, even if the fraction is tighter.
    tokens = max(tokens, min(context_len, hard_limit // per_token))
    if tokens < 1:
        raise KVCacheSizeError(
            f"the KV cache does not fit: {per_token} B/token, {_gib(max(budget, 0))} budget and "
            f"{_gib(free)} of {where} free; raise --mem-fraction-static or lower --context-length"
        )
    return int(tokens)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
