"""Suite-wide settings.

- Tiny models run several times faster on one intra-op thread than on two busy ones (server
  subprocesses choose their own).
- Without a GPU, Triton kernels run through Triton's interpreter: TRITON_INTERPRET=1 must be set
  before any triton code is imported, so it is set here, once, for every test module.
"""

from __future__ import annotations

import importlib.util
import os

import torch

torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into Python ints
    with int(array), which numpy >= 2.4 refuses for ndim > 0: loops bounded by a loaded value
    (`range(0, prefix_len, BLOCK_N)`) then fail. Use the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_ft_fixed", False):
        return

    def patched(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    patched._ft_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    _fix_interpreter_scalar_index()
