"""benchmarks/bench_attention.py names its results file after the GPU it ran on."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
_SPEC = importlib.util.spec_from_file_location("bench_attention", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
bench_attention = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_attention)


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090"),
        ("", "gpu"),
    ],
)
def test_device_tag(name: str, tag: str) -> None:
    assert bench_attention.device_tag(name) == tag
