"""Shared by tests/test_quant_load_*.py: independent writers of every quantized checkpoint format, the
checks against the engine, and the transformers reference.

The writers follow the published layouts (AutoAWQ GEMM, AutoGPTQ v1 / GPTQModel v2, DeepSeek FP8,
SGLang w8a8_int8) with packing code written here from the spec; compressed-tensors checkpoints are
packed with the compressed-tensors library's own functions. Each quantizes a tiny float checkpoint by
round-to-nearest and returns, per checkpoint module, the dequantized float32 weight it stands for
and the activation quantization its format implies ("int8": per token; "fp8": per token and per
128 columns, E4M3; None: weight-only), which the reference transformers model then runs with.
"""

from __future__ import annotations

import functools
import json
import math
import types
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

GROUP = 32  # int4 group of the tiny models (hidden 64, MoE intermediate 32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
        "kv_a_proj_with_mqa", "kv_b_proj")  # fmt: skip
W8A8_ACTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}


def _ct(fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None, targets: list[str] | None = None) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head", "re:.*mlp.gate$"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": targets or ["Linear"], "weights": weights, "input_activations": acts}}}  # fmt: skip


CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ["kv_b_proj"]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
    "gptq_v2_act": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
                    "checkpoint_format": "gptq_v2"},
    "ct_int4": _ct("pack-quantized", INT4_WEIGHTS, None),
    "ct_int4_asym": _ct("pack-quantized", dict(INT4_WEIGHTS, symmetric=False), None),
    "ct_w8a8": _ct("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, W8A8_ACTS),
    "ct_fp8": _ct("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                                      "block_structure": [128, 128]},
                  {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": True}),
    "ct_nvfp4": _ct("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True,
                                             "strategy": "tensor_group", "group_size": 16}, None),
    "ct_mxfp4": _ct("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                                             "group_size": 32}, None),
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "w8a8_int8": {"quant_method": "w8a8_int8"},
}  # fmt: skip
# attention W8A8 INT8, MLPs and experts INT4, in one checkpoint
CONFIGS["ct_mixed"] = {
    "quant_method": "compressed-tensors", "format": "mixed-precision", "ignore": ["lm_head"],
    "config_groups": {
        "attn": {"targets": ["re:.*self_attn.*"], "format": "int-quantized", "input_activations": W8A8_ACTS,
                 "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}},
        "mlp": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None, "weights": INT4_WEIGHTS},
    },
}  # fmt: skip
ACT = {"ct_w8a8": "int8", "w8a8_int8": "int8", "ct_fp8": "fp8", "fp8": "fp8"}


def i32(v: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> int32 with the same bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_nibbles(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """codes [R, C] in 0..15 -> int32 [R, C/8]: nibble i of word c holds codes[:, 8c + order[i]]."""
    c = codes.long().reshape(codes.shape[0], -1, 8)[..., list(order)]
    return i32(sum(c[..., i] << (4 * i) for i in range(8)))


def rtn_int4_asym(w: torch.Tensor, members: torch.Tensor, ngroups: int) -> tuple[torch.Tensor, ...]:
    """w [N, K], members[k] = group of input k -> (codes [N, K] 0..15, zeros [N, G] 0..15, scales fp16 [N, G])."""
    scales, zeros = torch.empty(w.shape[0], ngroups), torch.empty(w.shape[0], ngroups)
    for g in range(ngroups):
        wg = w[:, members == g]
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        scales[:, g] = ((hi - lo) / 15).clamp_min(1e-8)
        zeros[:, g] = torch.round(-lo / scales[:, g].half().float()).clamp(0, 15)
    scales = scales.half()
    s, z = scales.float()[:, members], zeros[:, members]
    codes = (torch.round(w / s) + z).clamp(0, 15)
    return codes.to(torch.uint8), zeros.to(torch.uint8), scales


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (float) of each element, saturating at 6."""
    idx = (x.abs().clamp(max=6).unsqueeze(-1) - E2M1).abs().argmin(-1)
    return torch.where(x < 0, -E2M1[idx], E2M1[idx])


def fp8_blocks(w: torch.Tensor, bn: int = 128, bk: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    s = torch.zeros(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().amax().clamp_min(1e-8) / 448
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, s, q.float() * full


def act_order(module: str, k: int) -> torch.Tensor:
    """GPTQ act order of a module's input, shared by the modules reading the same input (q/k/v,
    gate/up), as GPTQ's Hessian order is: perm[j] = the j-th input column quantized."""
    key = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
    return torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def quantize_module(fmt: str, w: torch.Tensor, gen: torch.Generator, ct_scheme: str | None = None,
                    module: str = "") -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """One module's checkpoint tensors (suffix -> tensor) and its dequantized float32 weight [N, K]."""
    n, k = w.shape
    if fmt == "awq":
        codes, zeros, scales = rtn_int4_asym(w, torch.arange(k) // GROUP, k // GROUP)
        t = {"qweight": pack_nibbles(codes.t().contiguous(), AWQ_ORDER), "qzeros": pack_nibbles(zeros.t().contiguous(), AWQ_ORDER),
             "scales": scales.t().contiguous()}  # fmt: skip
        return t, (codes.float() - zeros.float().repeat_interleave(GROUP, 1)) * scales.float().repeat_interleave(GROUP, 1)
    if fmt in ("gptq", "gptq_v2_act"):
        members = torch.arange(k) // GROUP
        if fmt == "gptq_v2_act":  # act order: input perm[j] belongs to group j // G
            perm = act_order(module, k)
            members = torch.empty(k, dtype=torch.long)
            members[perm] = torch.arange(k) // GROUP
            codes, zeros, scales = rtn_int4_asym(w, members, k // GROUP)
            stored_zeros = zeros
        else:  # symmetric: zero 8, scale amax / 7.5; v1 stores zero - 1
            scales = (w.reshape(n, k // GROUP, GROUP).abs().amax(-1) / 7.5).clamp_min(1e-8).half()
            codes = (torch.round(w / scales.float()[:, members]) + 8).clamp(0, 15).to(torch.uint8)
            zeros = torch.full((n, k // GROUP), 8, dtype=torch.uint8)
            stored_zeros = (zeros.long() - 1) & 0xF
        qweight = pack_nibbles(codes.contiguous()).t().contiguous()  # [K/8, N]: row r nibble i = input 8r+i
        t = {"qweight": qweight, "qzeros": pack_nibbles(stored_zeros.t().contiguous()), "scales": scales.t().contiguous(),
             "g_idx": members.to(torch.int32), "bias": torch.zeros(n, dtype=torch.float16)}  # fmt: skip
        return t, (codes.float() - zeros.float()[:, members]) * scales.float()[:, members]
    if fmt in ("fp8", "ct_fp8"):
        q, s, deq = fp8_blocks(w)
        return {"weight": q, ("weight_scale_inv" if fmt == "fp8" else "weight_scale"): s}, deq
    if fmt in ("w8a8_int8", "ct_w8a8") or ct_scheme == "int8":
        s = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-8)
        s = s.to(torch.bfloat16) if fmt != "w8a8_int8" else s
        q = torch.round(w / s.float()).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": s}, q.float() * s.float()
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    if fmt in ("ct_int4", "ct_int4_asym", "ct_mixed"):
        wg = w.reshape(n, k // GROUP, GROUP)
        if fmt == "ct_int4_asym":
            lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-8).to(torch.bfloat16)
            zp = (torch.round(-lo / s.float()) - 8).clamp(-8, 7)  # signed zero point
        else:
            s, zp = (wg.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16), torch.zeros(n, k // GROUP)
        sf, zf = s.float().repeat_interleave(GROUP, 1), zp.repeat_interleave(GROUP, 1)
        q = (torch.round(w / sf) + zf).clamp(-8, 7)
        t = {"weight_packed": pack_to_int32(q.to(torch.int8), 4), "weight_scale": s,
             "weight_shape": torch.tensor([n, k])}  # fmt: skip
        if fmt == "ct_int4_asym":
            t["weight_zero_point"] = pack_to_int32(zp.to(torch.int8), 4, packed_dim=0)
        return t, (q - zf) * sf
    wg = w.reshape(n, -1, 16 if fmt == "ct_nvfp4" else 32)
    if fmt == "ct_nvfp4":  # compressed-tensors: global = 448*6 / amax, block scale E4M3 = amax_b / 6 * global
        glob = (448.0 * 6.0 / w.abs().amax()).reshape(1)
        ws = (wg.abs().amax(-1) / 6 * glob).to(torch.float8_e4m3fn)
        eff = (ws.float() / glob).repeat_interleave(16, 1)
        vals = e2m1_round(w / eff)
        packed = pack_fp4_to_uint8(vals)
        deq = unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32) * ws.float().repeat_interleave(16, 1) / glob
        return {"weight_packed": packed, "weight_scale": ws, "weight_global_scale": glob.float()}, deq
    scale = torch.exp2(torch.floor(torch.log2(wg.abs().amax(-1).clamp_min(1e-30))) - 2)  # power of two
    vals = e2m1_round(w / scale.repeat_interleave(32, 1))
    packed = pack_fp4_to_uint8(vals)
    deq = unpack_fp4_from_uint8(packed, n, k, dtype=torch.float32) * scale.repeat_interleave(32, 1)
    return {"weight_packed": packed, "weight_scale": compress_mx_scale(scale, torch.uint8)}, deq


def is_quantized(fmt: str, module: str) -> bool:
    leaf = module.rsplit(".", 1)[-1]
    if leaf not in PROJ or module.endswith("mlp.gate"):
        return False
    return leaf != "kv_b_proj" or fmt in ("fp8", "ct_fp8")  # DeepSeek's FP8 checkpoints quantize it


def act_of(fmt: str, module: str) -> str | None:
    if module.endswith("kv_b_proj"):  # dequantized on load and absorbed into the attention (float activations)
        return None
    if fmt == "ct_mixed":
        return "int8" if ".self_attn." in module else None
    return ACT.get(fmt)


def write_quantized(src: Path, dst: Path, fmt: str, seed: int = 0) -> dict[str, tuple[torch.Tensor, str | None]]:
    """dst: src in format `fmt`. Returns {checkpoint module: (dequantized float32 weight, activation quant)}."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, tuple[torch.Tensor, str | None]] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and is_quantized(fmt, module):
            scheme = act_of(fmt, module) if fmt == "ct_mixed" else None
            parts, w = quantize_module(fmt, t.float(), gen, scheme, module)
            out.update({f"{module}.{suffix}": v.contiguous() for suffix, v in parts.items()})
            deq[module] = (w, act_of(fmt, module))
        else:
            out[name] = t
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = CONFIGS[fmt]
    (dst / "config.json").write_text(json.dumps(cfg))
    return deq


def write_dequantized(src: Path, dst: Path, deq: dict[str, tuple[torch.Tensor, str | None]]) -> Path:
    """A float checkpoint: src with every quantized module's weight replaced by its dequantized value."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    for module, (w, _) in deq.items():
        tensors[f"{module}.weight"] = w.to(tensors[f"{module}.weight"].dtype)
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def fake_quant_act(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """x [..., K] as the engine's quantized kernels see it (written from the format descriptions)."""
    if kind is None:
        return x
    flat = x.reshape(-1, x.shape[-1]).float()
    if kind == "int8":
        s = (flat.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-10)
        return (torch.round(flat / s).clamp(-127, 127) * s).view_as(x).to(x.dtype)
    k = flat.shape[-1]
    pad = torch.nn.functional.pad(flat, (0, -k % 128)).view(flat.shape[0], -1, 128)
    s = (pad.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-10)
    q = (pad / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return q.view(flat.shape[0], -1)[:, :k].reshape(x.shape).to(x.dtype)


SNAP_RTOL = 1e-5  # float32 op-order noise after a few layers is ~1e-6 of a row's max; an E4M3 step is 1/16


class EngineActInputs:
    """The engine's activation-quantized inputs, per module name in call order: what its reference
    path (`quant_formats._fake_quant_act`, CPU) was given inside each quantized module's forward."""

    def __init__(self) -> None:
        self.by_module: dict[str, list[torch.Tensor]] = {}
        self._current: str | None = None

    def attach(self, model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if getattr(module, "quant_method", None) is not None:
                module.register_forward_pre_hook(lambda m, args, name=name: self._inside(name))
                module.register_forward_hook(lambda m, args, out: self._inside(None))

    def _inside(self, name: str | None) -> None:  # the quantized module whose forward runs now, or None
        self._current = name

    @contextmanager
    def recording(self) -> Iterator[None]:
        from ftransformers.kernels import quant_formats

        real = quant_formats._fake_quant_act

        def record(x: torch.Tensor, qw: Any) -> torch.Tensor:
            if self._current is not None and qw.fmt in ("fp8_block", "int8"):
                self.by_module.setdefault(self._current, []).append(x.detach().float().clone())
            return real(x, qw)

        quant_formats._fake_quant_act = record
        try:
            yield
        finally:
            quant_formats._fake_quant_act = real


def snap_to_engine(x: torch.Tensor, engine_x: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] with each row replaced by the engine's where the two agree to SNAP_RTOL of the row's
    max: the reference then rounds what the engine rounded, so a 1e-7 op-order difference next to an
    E4M3 / int8 rounding boundary cannot flip one element (a 1/16 step) and every later layer.
    A difference above float noise is kept and shows in the logits."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if engine_x is None or engine_x.shape != flat.shape:
        return x
    close = ((flat - engine_x).abs() <= SNAP_RTOL * flat.abs().amax(-1, keepdim=True)).all(-1, keepdim=True)
    return torch.where(close, engine_x, flat).reshape(x.shape).to(x.dtype)


class _EngineInputs:
    """The engine's inputs for the reference's calls: the n-th call of HF module `name` takes the n-th
    recorded input of the engine module holding it (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj)."""

    def __init__(self, recorded: dict[str, list[torch.Tensor]] | None) -> None:
        self.recorded, self.calls = recorded or {}, dict[str, int]()
        self.unmatched: list[str] = []  # reference calls with no engine input of their shape

    def take(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if not self.recorded:
            return x
        parent, _, leaf = name.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), leaf)
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        seen = self.recorded.get(f"{parent}.{fused}", [])
        engine_x = seen[n] if n < len(seen) else None
        if engine_x is None or engine_x.shape != x.reshape(-1, x.shape[-1]).shape:
            self.unmatched.append(f"{name} call {n} {tuple(x.shape)}")
        return snap_to_engine(x, engine_x)


def _quant_experts_forward(act: str, take: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(self: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.gate_up_proj.shape[0]):  # the engine's order: experts ascending, tokens ascending
            tok, slot = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = (fake_quant_act(take(hidden[tok]), act) @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            y = fake_quant_act(take(torch.nn.functional.silu(gate) * up), act) @ self.down_proj[e].t()
            out.index_add_(0, tok, y * top_k_weights[tok, slot, None])
        return out

    return forward


def hf_logits(float_dir: Path, deq: dict[str, tuple[torch.Tensor, str | None]], sequences: list[list[int]],
              prompt_lens: list[int] | None = None,
              engine_inputs: dict[str, list[torch.Tensor]] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """transformers (float32, eager) on the dequantized checkpoint, quantizing each quantized module's
    input as its format does: teacher-forced logits [len, V] of each sequence.

    With `prompt_lens`, each sequence runs as a decoding engine runs it: its prompt in one forward,
    then one token per forward on the KV cache; returns [len - prompt_len + 1, V], the rows that
    chose each token after the prompt. With `engine_inputs` too (EngineActInputs.by_module of the
    engine run on the same sequences, one per batch), each quantized input row within float noise of
    the engine's is replaced by the engine's before rounding (snap_to_engine): the same position's
    row summed in another order (1e-7) can carry an element across an E4M3 boundary, and on the tiny
    DeepSeek-V3 one such flip moves the logits by 0.18.
    """
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32, attn_implementation="eager").eval()
    inputs = _EngineInputs(engine_inputs)
    for name, module in model.named_modules():
        kind = deq.get(name, (None, None))[1]
        if isinstance(module, torch.nn.Linear) and kind is not None:
            module.register_forward_pre_hook(
                lambda m, args, kind=kind, name=name: (fake_quant_act(inputs.take(name, args[0]), kind),))
        if hasattr(module, "gate_up_proj") and getattr(module.gate_up_proj, "dim", lambda: 0)() == 3:
            kind = deq.get(f"{name}.0.gate_proj", (None, None))[1]
            if kind is not None:
                take = functools.partial(inputs.take, name)
                module.forward = types.MethodType(_quant_experts_forward(kind, take), module)
    with torch.no_grad():
        if prompt_lens is None:
            return [model(torch.tensor([seq]), use_cache=False).logits[0].float() for seq in sequences]
        out = []
        for seq, n in zip(sequences, prompt_lens, strict=True):
            cache = DynamicCache(config=model.config)
            rows = [model(torch.tensor([seq[:n]]), past_key_values=cache, use_cache=True).logits[0, -1]]
            for tok in seq[n:-1]:  # the last token is generated, never fed
                rows.append(model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1])
            out.append(torch.stack(rows).float())
        assert not inputs.unmatched, ("the engine and transformers ran different experts or layers; reference calls "
                                      f"without an engine input of their shape: {inputs.unmatched[:3]}")  # fmt: skip
        return out


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def engine_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's effective float32 weight per module: dequantized kernel layouts (perm undone),
    float weights as they are. Stacked experts come back per checkpoint expert module."""
    from ftransformers.kernels.quant_formats import dequantize
    from ftransformers.layers.linear import LinearBase
    from ftransformers.layers.moe.experts import FusedMoE

    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE) and m.w13_qw is not None and m.w2_qw is not None:
            w13, w2 = dequantize(m.w13_qw), dequantize(m.w2_qw)
            for e in range(m.num_experts):
                gate, up = w13[e].chunk(2, dim=0)
                out.update({f"{name}.{e}.gate_proj": gate, f"{name}.{e}.up_proj": up, f"{name}.{e}.down_proj": w2[e]})
        elif isinstance(m, LinearBase):
            qw = getattr(m, "qw", None)
            if qw is None:
                w = m.weight.float()
            else:
                w = dequantize(qw)
                if qw.perm is not None:
                    w = torch.empty_like(w).index_copy_(1, qw.perm, w)
            leaf = name.rsplit(".", 1)[-1]
            parts = FUSED.get(leaf, (leaf,))
            sizes = [s for _, s in m.output_shards()] if len(parts) > 1 else [w.shape[0]]
            for part, chunk in zip(parts, w.split(sizes)):
                out[name.rsplit(".", 1)[0] + "." + part if len(parts) > 1 else name] = chunk
    return out
