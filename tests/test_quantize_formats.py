"""`ftransformers quantize` writes, for every method, tensors that decode with code independent of ours
to the weights the method intended, and a config the format's readers parse.

Decoders: compressed-tensors 0.20's own compressors (`decompress`) for rtn-int4 / mxfp4 / nvfp4 and
its `QuantizationConfig` for their configs; for AWQ, GPTQ, DeepSeek FP8 and W8A8 the unpackers below,
written from the format descriptions (AWQ's nibble order, GPTQ's K-packed qweight and `zero - 1`
qzeros, g_idx), not from our writer.

Intended weights and tolerances (float32 checkpoints, float32 comparisons):
  rtn-int4, mxfp4, fp8, w8a8-int8   exactly the round-to-nearest weight of quant/quantizers.py
  nvfp4    that weight with the global scale of the fused module (q/k/v, gate/up); compressed-tensors
           divides by the stored 1 / global scale where we multiply: rtol 1e-6
  awq      exactly the round-to-nearest asymmetric weight of the rescaled, clipped float weight AWQ's
           search produced, hence within one grid step of it (scale + 1e-6: the rounded zero point
           moves the grid's ends by up to half a step)
  gptq     exactly GPTQ's dequantized weight (in input-channel order when act order permutes columns)
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ftransformers.entrypoints.quantize import quantize_checkpoint
from ftransformers.entrypoints.quantize.writers import METHOD_SPECS, QuantOptions
from ftransformers.kernels.quant_formats import dequantize
from tests.model_harness import make_tiny_checkpoint

ct = pytest.importorskip("compressed_tensors")

G = 32  # tiny models: in_features 32..128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
CT_FORMATS = {"rtn-int4": "pack-quantized", "mxfp4": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized"}
METHODS = ["rtn-int4", "awq", "gptq", "mxfp4", "nvfp4", "fp8", "w8a8-int8"]


def calib_ids(n: int = 600, seed: int = 1) -> list[int]:
    return torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def method_kwargs(method: str) -> dict:
    kw: dict = {"group_size": G} if METHOD_SPECS[method].grouped else {}
    if METHOD_SPECS[method].needs_calibration:
        kw["calib_ids"] = calib_ids()
    return kw


# ---- independent decoders: checkpoint tensors of one module -> float32 weight [N, K] ----


def _nibbles_along_n(p: torch.Tensor, order: list[int]) -> torch.Tensor:
    """int32 [R, N/8] -> [R, N]: nibble i of column c is column 8c + order[i]."""
    out = torch.empty(p.shape[0], p.shape[1] * 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out[:, col::8] = (p.long() >> (4 * i)) & 0xF
    return out


def decode_awq(t: dict[str, torch.Tensor], group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (W [N, K], per-element scale [N, K])."""
    codes, zeros = _nibbles_along_n(t["qweight"], AWQ_ORDER), _nibbles_along_n(t["qzeros"], AWQ_ORDER)  # [K, N], [K/G, N]
    g = torch.arange(codes.shape[0]) // group
    s = t["scales"].float()[g]  # [K, N]
    return ((codes - zeros[g]) * s).t(), s.t()


def decode_gptq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    q = t["qweight"]  # [K/8, N]
    codes = torch.empty(q.shape[0] * 8, q.shape[1], dtype=torch.int64)
    for i in range(8):
        codes[i::8] = (q.long() >> (4 * i)) & 0xF  # input k = 8r + i
    zeros = _nibbles_along_n(t["qzeros"], list(range(8))) + 1  # v1 stores zero - 1
    g = t["g_idx"].long()
    return ((codes - zeros[g]) * t["scales"].float()[g]).t()


def decode_fp8(t: dict[str, torch.Tensor]) -> torch.Tensor:
    w = t["weight"].float()
    s = t["weight_scale_inv"].float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w * s[: w.shape[0], : w.shape[1]]


def decode_ct(t: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """compressed-tensors' own unpacking and dequantization, in float32 (its compressors' `decompress`
    returns the scale dtype, bfloat16 for FP4: the same steps here keep float32)."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
    if config["format"] == "pack-quantized":
        sd = dict(t) | {"weight_scale": t["weight_scale"].float()}
        return PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
    packed = t["weight_packed"]
    vals = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    if config["format"] == "mxfp4-pack-quantized":
        scale, glob = decompress_mx_scale(t["weight_scale"]).float(), None
    else:
        scale, glob = t["weight_scale"].float(), t["weight_global_scale"].float()
    return ct_dequantize(vals, scale, args=scheme.weights, dtype=torch.float32, global_scale=glob)


def decode_module(method: str, t: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    if method in CT_FORMATS:
        return decode_ct(t, config)
    if method == "awq":
        return decode_awq(t, config["group_size"])[0]
    if method == "gptq":
        return decode_gptq(t)
    if method == "fp8":
        return decode_fp8(t)
    return t["weight"].float() * t["weight_scale"].float()  # w8a8_int8


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors, json.loads((path / "config.json").read_text())["quantization_config"]


def quantized_modules(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """module -> {suffix: tensor} for every module written in a quantized layout."""
    marks = ("qweight", "weight_packed", "weight_scale", "weight_scale_inv")
    mods = {k.rsplit(".", 1)[0] for k in tensors if k.rsplit(".", 1)[1] in marks}
    return {m: {k[len(m) + 1 :]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == m} for m in mods}


def fused_key(module: str) -> str:
    for part, fused in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"), ("gate_proj", "gu"), ("up_proj", "gu")):
        if module.endswith("." + part):
            return module[: -len(part)] + fused
    return module


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {k: make_tiny_checkpoint(k, root / k) for k in ("llama", "qwen3_moe", "deepseek_v3")}


def _intended(method: str, src: Path, src_tensors: dict[str, torch.Tensor], modules: set[str]) -> dict[str, torch.Tensor]:
    spec = METHOD_SPECS[method]
    opts = QuantOptions(group_size=G, symmetric=spec.default_symmetric)
    if method == "gptq":
        from ftransformers.entrypoints.quantize.gptq import gptq_calibrate

        out = {}
        for m, qw in gptq_calibrate(src, calib_ids(), modules, G, True, False).items():
            w = dequantize(qw)
            out[m] = w if qw.perm is None else w[:, torch.argsort(qw.perm)]
        return out
    amax: dict[str, torch.Tensor] = {}
    for m in modules:
        a = src_tensors[f"{m}.weight"].abs().max()
        amax[fused_key(m)] = torch.maximum(amax.get(fused_key(m), a), a)
    return {m: dequantize(spec.quantize(src_tensors[f"{m}.weight"], opts, amax[fused_key(m)])) for m in modules}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("method", METHODS)
def test_written_tensors_decode_to_the_intended_weights(method: str, kind: str, sources: dict[str, Path],
                                                         tmp_path: Path) -> None:  # fmt: skip
    from safetensors.torch import load_file

    src = sources[kind]
    quantize_checkpoint(src, tmp_path / "q", method, **method_kwargs(method))
    tensors, config = read_checkpoint(tmp_path / "q")
    src_tensors = load_file(str(src / "model.safetensors"))
    modules = quantized_modules(tensors)
    assert any(".experts." in m for m in modules) == (kind == "qwen3_moe")  # experts are quantized too
    assert not any(m.endswith("mlp.gate") or "lm_head" in m for m in modules)  # routers and the head stay float
    assert "lm_head" in (config.get("ignore") or config.get("modules_to_not_convert") or config.get("ignored_layers"))
    if method == "awq":
        from ftransformers.entrypoints.quantize.awq import awq_calibrate

        overrides, _ = awq_calibrate(src, calib_ids(), set(modules), G)
        for m, t in modules.items():
            w, scale = decode_awq(t, G)
            want = overrides.get(f"{m}.weight", src_tensors[f"{m}.weight"]).float()
            assert ((w - want).abs() <= scale + 1e-6).all(), m
            torch.testing.assert_close(w, dequantize(METHOD_SPECS["awq"].quantize(want, QuantOptions(G))), rtol=0, atol=0)
        for name, v in overrides.items():  # the rescaled norms / routers / producers are written too
            if name.rsplit(".", 1)[0] not in modules:
                torch.testing.assert_close(tensors[name], v.to(tensors[name].dtype), rtol=0, atol=0)
        return
    intended = _intended(method, src, src_tensors, set(modules))
    for m, t in modules.items():
        got = decode_module(method, t, config)
        rtol = 1e-6 if method == "nvfp4" else 0.0
        torch.testing.assert_close(got, intended[m], rtol=rtol, atol=0.0, msg=m)


def test_layouts_and_dtypes(sources: dict[str, Path], tmp_path: Path) -> None:
    """Shapes and dtypes of docs/quantization.md for a [N=64, K=64] q_proj with G = 32."""
    want = {
        "awq": {"qweight": (torch.int32, (64, 8)), "qzeros": (torch.int32, (2, 8)), "scales": (torch.float16, (2, 64))},
        "gptq": {"qweight": (torch.int32, (8, 64)), "qzeros": (torch.int32, (2, 8)), "scales": (torch.float16, (2, 64)),
                 "g_idx": (torch.int32, (64,))},
        "rtn-int4": {"weight_packed": (torch.int32, (64, 8)), "weight_scale": (torch.float16, (64, 2)),
                     "weight_shape": (torch.int64, (2,)), "weight_zero_point": (torch.int32, (8, 2))},
        "mxfp4": {"weight_packed": (torch.uint8, (64, 32)), "weight_scale": (torch.uint8, (64, 2))},
        "nvfp4": {"weight_packed": (torch.uint8, (64, 32)), "weight_scale": (torch.float8_e4m3fn, (64, 4)),
                  "weight_global_scale": (torch.float32, (1,))},
        "fp8": {"weight": (torch.float8_e4m3fn, (64, 64)), "weight_scale_inv": (torch.float32, (1, 1))},
        "w8a8-int8": {"weight": (torch.int8, (64, 64)), "weight_scale": (torch.float32, (64, 1))},
    }  # fmt: skip
    for method, layout in want.items():
        quantize_checkpoint(sources["llama"], tmp_path / method, method, **method_kwargs(method))
        tensors, _ = read_checkpoint(tmp_path / method)
        got = quantized_modules(tensors)["model.layers.0.self_attn.q_proj"]
        assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == layout, method


@pytest.mark.parametrize("method", METHODS)
def test_written_config_parses(method: str, sources: dict[str, Path], tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    from ftransformers.quant import quant_config_for

    quantize_checkpoint(sources["deepseek_v3"], tmp_path / "q", method, **method_kwargs(method))
    _, cfg = read_checkpoint(tmp_path / "q")
    assert quant_config_for(SimpleNamespace(quantization_config=cfg)) is not None  # our loader reads it
    kv_b = [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(3)]
    if method in CT_FORMATS:
        qc = QuantizationConfig.model_validate(cfg)
        scheme = qc.config_groups["group_0"]
        assert qc.format == CT_FORMATS[method] and qc.quantization_status == "compressed"
        assert scheme.targets == ["Linear"] and scheme.input_activations is None
        w = scheme.weights
        assert (w.num_bits, w.type) == (4, "int" if method == "rtn-int4" else "float")
        assert w.group_size == {"rtn-int4": G, "mxfp4": 32, "nvfp4": 16}[method]
        assert w.strategy == ("tensor_group" if method == "nvfp4" else "group")
        assert w.symmetric == (method != "rtn-int4")  # rtn-int4 defaults to asymmetric (AWQ's grid)
        assert set(kv_b) <= set(qc.ignore) and "lm_head" in qc.ignore
    elif method == "awq":
        assert {k: cfg[k] for k in ("bits", "group_size", "zero_point", "version")} == \
            {"bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}  # fmt: skip
        assert set(kv_b) <= set(cfg["modules_to_not_convert"])
    elif method == "gptq":
        assert {k: cfg[k] for k in ("bits", "group_size", "desc_act", "sym", "checkpoint_format")} == \
            {"bits": 4, "group_size": G, "desc_act": False, "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
    elif method == "fp8":
        assert {k: cfg[k] for k in ("fmt", "activation_scheme", "weight_block_size")} == \
            {"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}  # fmt: skip
        assert set(kv_b) <= set(cfg["ignored_layers"])
    else:
        assert cfg["quant_method"] == "w8a8_int8" and set(kv_b) <= set(cfg["ignore"])


def test_gptq_act_order_writes_a_permuting_g_idx(sources: dict[str, Path], tmp_path: Path) -> None:
    from ftransformers.entrypoints.quantize.gptq import gptq_calibrate

    quantize_checkpoint(sources["llama"], tmp_path / "q", "gptq", group_size=G, desc_act=True, calib_ids=calib_ids())
    tensors, cfg = read_checkpoint(tmp_path / "q")
    assert cfg["desc_act"] is True
    modules = quantized_modules(tensors)
    results = gptq_calibrate(sources["llama"], calib_ids(), set(modules), G, True, True)
    permuted = 0
    for m, t in modules.items():
        g_idx = t["g_idx"].long()
        assert torch.bincount(g_idx).tolist() == [G] * (g_idx.numel() // G)  # every group holds G inputs
        permuted += int(not torch.equal(g_idx, torch.arange(g_idx.numel()) // G))
        qw = results[m]
        torch.testing.assert_close(decode_gptq(t), dequantize(qw)[:, torch.argsort(qw.perm)], rtol=0, atol=0)
    assert permuted > 0
