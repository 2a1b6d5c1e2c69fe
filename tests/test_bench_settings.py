"""benchmarks/ceilings.py's NAME=V settings (bench_moe_w4_mma --ab, bench_w4a16_mma --set / --ab; ab_decode's set=
goes through them too): integers for integer and boolean knobs, decimals for float ones, a clear error otherwise."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ceilings import module_settings, module_values


def _module() -> types.ModuleType:
    mod = types.ModuleType("knobs")
    mod.ROWS, mod.ON, mod.SHARE = 16, True, 0.6  # type: ignore[attr-defined]
    return mod


def test_integer_boolean_and_float_knobs() -> None:
    mod = _module()
    settings = module_settings("ROWS=32+ON=0+SHARE=0.75", mod)
    assert settings == [("ROWS", 32), ("ON", 0), ("SHARE", 0.75)]
    with module_values(mod, settings):
        assert (mod.ROWS, mod.ON, mod.SHARE) == (32, False, 0.75)
        assert type(mod.ON) is bool and type(mod.SHARE) is float
    assert (mod.ROWS, mod.ON, mod.SHARE) == (16, True, 0.6)
    assert module_settings("SHARE=1", mod) == [("SHARE", 1.0)]


@pytest.mark.parametrize("text", ["ROWS=0.5", "ON=yes", "SHARE=x", "NOPE=1", "ROWS="])
def test_bad_settings_say_which(text: str) -> None:
    with pytest.raises(ValueError, match=text.split("=")[0]):
        module_settings(text, _module())


def test_ab_decode_set_goes_through_them() -> None:
    # set=MOD.NAME=V sets a kernel module's knob in the type it holds and restores it; a bad V or NAME is one line
    spec = importlib.util.spec_from_file_location(
        "ab_decode", Path(__file__).parents[1] / "benchmarks" / "ab_decode.py"
    )
    ab_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_decode)
    from ftransformers.kernels import gluon_moe_w4_mma as mma

    was = mma.COMPACT_MAX_SHARE, mma.GROUPED_COMPACT
    undo = [
        ab_decode._set("gluon_moe_w4_mma.COMPACT_MAX_SHARE=0.75")(),
        ab_decode._set("gluon_moe_w4_mma.GROUPED_COMPACT=0")(),
    ]
    assert (mma.COMPACT_MAX_SHARE, mma.GROUPED_COMPACT) == (0.75, False) and type(mma.GROUPED_COMPACT) is bool
    for u in undo:
        u()
    assert (mma.COMPACT_MAX_SHARE, mma.GROUPED_COMPACT) == was
    for bad in ("gluon_moe_w4_mma.GROUPED_FROM_TOKENS=0.5", "gluon_moe_w4_mma.NOPE=1"):
        with pytest.raises(SystemExit, match=bad.split(".")[1].split("=")[0]):
            ab_decode._set(bad)()
