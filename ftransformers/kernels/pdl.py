"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and newer GPUs.

A decode step is a chain of ~10 small kernels per layer. Normally each one starts only after the
previous one has completed and its results are flushed, so every boundary costs a launch gap and a
ramp-up. With PDL a kernel is launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
its programs may become resident while the previous kernel still runs, once every program of that
kernel has executed `griddepcontrol.launch_dependents`.

The contract every kernel launched through `pdl_launch` keeps (`pdl_enter` at its top does both):
  1. every program executes `griddepcontrol.wait` before it reads or writes any tensor another kernel
     of the stream may touch (the wait returns once the previous grid has completed and its memory is
     visible; as every kernel of the chain waits, completion is transitive down the stream);
  2. it then signals `launch_dependents`, so the next kernel's programs queue up behind its own.
A program may start before its predecessor completes, but never before the kernel before that one has:
so a tensor written only before the predecessor (a decode step's metadata, written by host copies and
torch ops before the step's first kernel) may be read ahead of the wait. Kernels doing so are listed,
with those tensors, in tests/test_pdl.py (READ_BEFORE_WAIT), which checks nothing is stored before it.
Kernels of other origins (cuBLAS, torch) in between are ordinary launches: full serialisation.

Off on the CPU, in Triton's interpreter, below compute capability 9.0, with FTRANSFORMERS_DISABLE_PDL=1,
or through `set_pdl_enabled(False)` (`--disable-pdl`). CUDA graphs capture the launch attribute as a
programmatic edge, so replays keep the overlap.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_enabled = os.environ.get("FTRANSFORMERS_DISABLE_PDL", "0") in ("", "0") and not _INTERPRET
_by_device: dict[int, dict[str, bool]] = {}
_OFF: dict[str, bool] = {}
_ON: dict[str, bool] = {"USE_PDL": True, "launch_pdl": True}


def set_pdl_enabled(enabled: bool) -> None:
    """Turn PDL on or off for launches from now on (a captured CUDA graph keeps what it captured)."""
    global _enabled
    _enabled = bool(enabled) and not _INTERPRET


def pdl_enabled() -> bool:
    return _enabled


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Extra launch arguments for a kernel taking `USE_PDL: tl.constexpr = False`: none where PDL is off,
    else the constexpr and Triton's `launch_pdl` option."""
    if not _enabled or device.type != "cuda":
        return _OFF
    index = device.index if device.index is not None else torch.cuda.current_device()
    args = _by_device.get(index)
    if args is None:
        args = _ON if torch.cuda.get_device_capability(index)[0] >= 9 else _OFF
        _by_device[index] = args
    return args


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    # first statement of a kernel launched through pdl_launch (see the contract above)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
