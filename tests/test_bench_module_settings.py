"""benchmarks/ceilings.py's knob settings, which the benches' --ab / --set take: NAME=V[+NAME=V] parsed against a
module, applied in the module's own type and restored after the block."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("ceilings", Path(__file__).parents[1] / "benchmarks" / "ceilings.py")
ceilings = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ceilings)


def test_settings_parse_apply_in_the_module_type_and_restore() -> None:
    knobs = types.ModuleType("knobs")
    knobs.ON, knobs.ROWS = True, 16
    settings = ceilings.module_settings("ON=0+ROWS=32", knobs)
    assert settings == [("ON", 0), ("ROWS", 32)] and ceilings.module_settings("", knobs) == []
    with ceilings.module_values(knobs, settings):
        assert knobs.ON is False and knobs.ROWS == 32
    assert knobs.ON is True and knobs.ROWS == 16
    with pytest.raises(RuntimeError), ceilings.module_values(knobs, [("ROWS", 8)]):
        raise RuntimeError  # restored on the way out of a failing block too
    assert knobs.ROWS == 16
    assert ceilings.set_module_values(knobs, [("ROWS", -1)]) == {"ROWS": 16} and knobs.ROWS == -1
    for bad in ("NOPE=1", "ROWS=x", "ROWS"):
        with pytest.raises(ValueError, match="module-level name of knobs"):
            ceilings.module_settings(bad, knobs)
