"""Programmatic dependent launch: the contract of kernels/pdl.py, checked on every Triton and Gluon kernel.

A kernel launched with PDL may start while the previous kernel still runs; it is correct only if every
program waits (`pdl_enter`) before touching memory. So each launched kernel either takes part fully
(a `USE_PDL` constexpr, `pdl_enter(USE_PDL)` as its first statement, every launch passing
`**pdl_launch(...)`) or not at all. The GPU test files run the kernels with PDL on (Hopper).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parent.parent / "ftransformers" / "kernels"


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    # the file's @triton.jit / @gluon.jit functions, and those it imports by name from another kernels/ module (a
    # launcher whose kernels live beside it, as gluon_moe_w4_mma.py's in gluon_moe_w4_kernels.py)
    out = {}
    for node in tree.body:
        decorators = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in getattr(node, "decorator_list", [])]
        if isinstance(node, ast.FunctionDef) and ("triton.jit" in decorators or "gluon.jit" in decorators):
            out[node.name] = node
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ftransformers.kernels."):
            names = {a.name for a in node.names}
            other = _jit_functions(ast.parse((KERNELS / f"{node.module.rsplit('.', 1)[1]}.py").read_text()))
            out.update({n: fn for n, fn in other.items() if n in names})
    return out


def _launches(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    # kernel[grid](...) calls
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
            calls.append((node.func.value.id, node))
    return calls


# Kernels launched without PDL, and why: none runs inside a decode graph's chain of kernels.
WITHOUT_PDL = {
    "triton_extend_attention._extend_kernel": "extend and prefill attention run eagerly",
    "triton_sampling._sample_kernel": "after the decode graph, a cooperative launch whose programs spin on row barriers",
    "triton_sampling._uniforms_kernel": "the sampling kernel's uniforms for a reference to replay (tests)",
}


# Kernels that read, before their wait, tensors no kernel of a decode step's model writes (the batch
# metadata, written by host copies and torch ops before the step, or in a CUDA graph by its first kernel,
# triton_greedy.decode_inputs, which the embedding, a torch op, follows). Nothing before the wait may store.
READ_BEFORE_WAIT = {
    "_decode_stage1_kernel": "seq_lens, req_pool_indices, req_to_token; with ROPE positions, out_cache_loc, cos|sin; "
    "with PRELOAD the first K/V tile of earlier steps' tokens (the new token's slot, which it stores, is masked)",
    "_decode_stage2_kernel": "seq_lens",
    "_mla_decode_stage1_kernel": "seq_lens, req_pool_indices",
    "mla_decode_stage1_gluon": "seq_lens, req_pool_indices; with EARLY, req_to_token (the first tile's slots)",
    "mla_decode_stage1_few_heads": "seq_lens, req_pool_indices; with EARLY_TILES req_to_token and the first tiles' "
    "latent rows where they end before the new token (COPIES_BEFORE_WAIT)",
    "_rope_store_kernel": "positions, out_cache_loc, the constant cos|sin cache",
    "_mla_rope_kernel": "the constant inv_freq",
    "_w4a16_gemv_kernel": "the first K tile of its (constant) words, with PRELOAD_SZ that of its scale_zero copy",
    "_token_down_kernel": "with PRELOAD the routing (ids, weights: read by its predecessor, the gate-up kernel, after "
    "that kernel's wait) and the first K tile of its experts' (constant) words, scales and zeros",
    "_w8_row_kernel": "its rows of the (constant) 8-bit weight and their scales (and bias)",
    "_w4a16_mma_kernel": "with PRELOAD the first chunk of its (constant) words",
    "_w4a16_wgmma_kernel": "the first chunk of its (constant) words",
    "_moe_token_down_kernel": "with PRELOAD the routing (ids: read by its predecessor, the pair gate-up kernel, after "
    "that kernel's wait) and the first K tile of its experts' (constant) 16-bit rows",
    "_token_down_w8_kernel": "the routing (ids, weights: read by its predecessor, the gate-up kernel, after that "
    "kernel's wait) and its rows of the experts' (constant) weights and scales",
}
# Kernels that prefetch into L2 ahead of their wait (an `if PREFETCH:` block): what they prefetch, and
# what they load there only to form addresses (a hint: any value is safe while the address is in bounds).
# Keyed module.kernel.
PREFETCH_BEFORE_WAIT = {
    "triton_norm._rmsnorm_kernel": "the norm weight",
    "triton_router._fused_router_kernel": "its gate rows",
}
# Kernels that trigger their successor's launch ahead of their own wait (pdl.py, "Early trigger"): a successor
# may then start before this kernel's predecessor has completed. Safe while no kernel that can follow them reads,
# ahead of its wait, a tensor that a kernel of the step writes. Only the kernels in STEP_DATA_BEFORE_WAIT do,
# and their one predecessor is not here. Keyed module.kernel: the kernels that follow it.
EARLY_TRIGGER = {
    "triton_norm._rmsnorm_kernel": "a projection (GEMV or GEMM), the fused router, the LM head",
    "triton_decode_attention._decode_stage2_kernel": "the o projection",
}
# Kernels that read, ahead of their wait, a tensor that a kernel of the step writes, and the one kernel that is
# ever launched just before them (its wait returned, so the writer had completed before they could start).
STEP_DATA_BEFORE_WAIT: dict[str, str | tuple[str, ...]] = {
    "triton_moe_w4_gemv._token_down_kernel": "triton_moe_w4_gemv._token_gate_up_kernel",
    "triton_moe_token_down._moe_token_down_kernel": "triton_fused_moe._pair_gate_up_kernel",
    "triton_moe_w8_token._token_down_w8_kernel": (
        "triton_moe_w8_token._token_gate_up_w8_kernel",  # int8
        "triton_fused_moe_w8._pair_gate_up_kernel",  # fp8
    ),
}
# Kernels that issue cp.async copies into their own shared memory ahead of their wait, of tensors no kernel of the
# step writes; keyed module.kernel. What else they may call there: shared-memory allocation, barrier set-up and the
# copy helpers.
COPIES_BEFORE_WAIT = {
    "gluon_mla_few_heads.mla_decode_stage1_few_heads": "with EARLY_TILES the first tiles' latent rows where a tile ends "
    "before the new token (rows of earlier steps' tokens; a tile holding the new token's is copied after), their slots",
    "gluon_mla_decode.mla_decode_stage1_gluon": "with EARLY (one scores warpgroup) the first tile's latent rows where it "
    "ends before the new token, as the few-heads kernel's, and its slots",
}
COPY_SETUP_CALLS = {
    "gl.allocate_shared_memory", "gl.NVMMASharedLayout.get_default_for", "gl.SwizzledSharedLayout",
    "mbarrier.MBarrierLayout", "mbarrier.init", "ready.index", "empty.index", "gl.cdiv", "gl.maximum",
    "gl.minimum", "gl.static_range", "_load_slots", "_tile_before_new_token", "_copy_tile",
}
READ_ONLY_CALLS = {
    "tl.load", "tl.arange", "tl.program_id", "tl.num_programs", "tl.minimum", "tl.maximum", "tl.cdiv",
    "tl.static_range", "_split_len", "gl.load", "gl.program_id", "gl.num_programs",
    "word_offsets",  # gluon_moe_w4_mma's index tensors of a chunk's words: aranges and expand_dims only
    "chunk_words",  # gluon_w4a16_wgmma's, the same
}


# Diagnostic timestamps (kernels/stamps.py, behind a STAMPS constexpr): the one store allowed before the wait, into a
# stamps tensor of the kernel's own that no kernel of a step reads or writes
STAMP_CALLS = {"gl_stamp", "tl_stamp"}


def _is_prefetch_block(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "PREFETCH"


def _first_statement(fn: ast.FunctionDef, key: str) -> str:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    tops = [ast.unparse(s) for s in body]
    if tops[0] == "pdl_trigger(EARLY_TRIGGER)":  # an early trigger comes first of all (pdl.py)
        body, tops = body[1:], tops[1:]
    copies = key in COPIES_BEFORE_WAIT
    if fn.name not in READ_BEFORE_WAIT and key not in PREFETCH_BEFORE_WAIT and not copies:
        return tops[0]
    assert "pdl_enter(USE_PDL)" in tops, f"{fn.name}: no top-level pdl_enter(USE_PDL)"
    before = body[: tops.index("pdl_enter(USE_PDL)")]
    for stmt in before:
        prefetch = _is_prefetch_block(stmt)
        assert not prefetch or key in PREFETCH_BEFORE_WAIT, f"{fn.name}: prefetches, not in PREFETCH_BEFORE_WAIT"
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue  # only loads, index arithmetic and (in a PREFETCH block) L2 prefetches before the wait
            name = ast.unparse(node.func)
            ok = name in READ_ONLY_CALLS or (isinstance(node.func, ast.Attribute) and node.func.attr == "to")
            ok = ok or (prefetch and name == "l2_prefetch") or name in STAMP_CALLS
            ok = ok or (copies and name in COPY_SETUP_CALLS)
            assert ok, f"{fn.name}: {ast.unparse(node)} before the PDL wait"
            if name in ("tl.load", "gl.load") and not prefetch:
                assert fn.name in READ_BEFORE_WAIT, f"{fn.name}: loads before the wait, not in READ_BEFORE_WAIT"
    return "pdl_enter(USE_PDL)"


def _passes_prefetch(call: ast.Call) -> bool:
    return any(
        kw.arg is None and isinstance(kw.value, ast.Call) and ast.unparse(kw.value.func) == "pdl_launch"
        and any(k.arg == "prefetch" for k in kw.value.keywords)
        for kw in call.keywords
    )


def _docless(fn: ast.FunctionDef) -> list[ast.stmt]:
    return [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]


def _passes_early(call: ast.Call) -> bool:
    return any(
        kw.arg is None and isinstance(kw.value, ast.Call) and ast.unparse(kw.value.func) == "pdl_launch"
        and any(k.arg == "early" for k in kw.value.keywords)
        for kw in call.keywords
    )


def _passes_pdl(call: ast.Call, pdl_names: set[str]) -> bool:
    for kw in call.keywords:
        if kw.arg is None:  # **mapping
            v = kw.value
            if isinstance(v, ast.Call) and ast.unparse(v.func) == "pdl_launch":
                return True
            if isinstance(v, ast.Name) and v.id in pdl_names:
                return True
    return False


def _pdl_names(tree: ast.Module) -> set[str]:
    # local names bound to pdl_launch(...) (a launcher computing it once for several launches)
    names = set()
    for node in ast.walk(tree):
        call = node.value if isinstance(node, ast.Assign) else None
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "pdl_launch":
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_every_launched_kernel_keeps_the_pdl_contract() -> None:
    checked = 0
    without: set[str] = set()
    for path in sorted([*KERNELS.glob("triton_*.py"), *KERNELS.glob("gluon_*.py")]):
        tree = ast.parse(path.read_text())
        jit = _jit_functions(tree)
        pdl_names = _pdl_names(tree)
        for name, call in _launches(tree):
            fn = jit.get(name)
            assert fn is not None, f"{path.name}: launch of {name}, not a @triton.jit function of this file"
            params = [a.arg for a in fn.args.args]
            takes = "USE_PDL" in params
            first = _first_statement(fn, f"{path.stem}.{name}") == "pdl_enter(USE_PDL)"
            passes = _passes_pdl(call, pdl_names)
            where = f"{path.name}:{call.lineno} {name}"
            early = "EARLY_TRIGGER" in params
            triggers_first = ast.unparse(_docless(fn)[0]) == "pdl_trigger(EARLY_TRIGGER)"
            assert early == triggers_first == (f"{path.stem}.{name}" in EARLY_TRIGGER) == _passes_early(call), (
                f"{where}: EARLY_TRIGGER param {early}, pdl_trigger first {triggers_first}, "
                f"listed {f'{path.stem}.{name}' in EARLY_TRIGGER}, launched with early {_passes_early(call)}"
            )
            prefetches = "PREFETCH" in params
            listed = f"{path.stem}.{name}" in PREFETCH_BEFORE_WAIT
            assert prefetches == listed == _passes_prefetch(call), (
                f"{where}: PREFETCH param {prefetches}, listed {listed}, launched with prefetch"
            )
            assert takes == first == passes, (
                f"{where}: USE_PDL param {takes}, pdl_enter(USE_PDL) first {first}, launched with pdl_launch {passes}"
            )
            assert passes != (f"{path.stem}.{name}" in WITHOUT_PDL), f"{where}: PDL {passes}, see WITHOUT_PDL"
            checked += 1
            if not passes:
                without.add(f"{path.stem}.{name}")
    assert checked >= 25 and without == set(WITHOUT_PDL)


def test_no_early_trigger_before_a_kernel_reading_step_data_ahead_of_its_wait() -> None:
    for reader, befores in STEP_DATA_BEFORE_WAIT.items():
        assert reader in READ_BEFORE_WAIT or reader.split(".")[1] in READ_BEFORE_WAIT, reader
        for before in (befores,) if isinstance(befores, str) else befores:
            assert before not in EARLY_TRIGGER, f"{before} triggers early; {reader} reads step data ahead of its wait"
            module, name = before.split(".")
            fn = _jit_functions(ast.parse((KERNELS / f"{module}.py").read_text()))[name]
            assert "EARLY_TRIGGER" not in [a.arg for a in fn.args.args], before


def test_copy_helpers_ahead_of_a_wait_store_nothing_to_global_memory() -> None:
    """The helpers a COPIES_BEFORE_WAIT kernel calls ahead of its wait (its own jit functions among COPY_SETUP_CALLS)
    fill shared memory only: no global store or atomic in them, which the kernel-level check above does not see."""
    checked = 0
    for key in COPIES_BEFORE_WAIT:
        module, _ = key.split(".")
        jit = _jit_functions(ast.parse((KERNELS / f"{module}.py").read_text()))
        for name in COPY_SETUP_CALLS & set(jit):
            for node in ast.walk(jit[name]):
                if isinstance(node, ast.Call):
                    call = ast.unparse(node.func)
                    assert call not in ("gl.store", "tl.store") and ".atomic" not in call, f"{name}: {call}"
            checked += 1
    assert checked >= 3


def test_pdl_launch_arguments() -> None:
    from ftransformers.kernels import pdl

    assert pdl.pdl_launch(torch.device("cpu")) == {}
    saved = pdl.pdl_enabled()
    try:
        pdl.set_pdl_enabled(False)
        assert not pdl.pdl_enabled()
        if torch.cuda.is_available():
            assert pdl.pdl_launch(torch.device("cuda")) == {}
            pdl.set_pdl_enabled(True)
            on = torch.cuda.get_device_capability()[0] >= 9 and pdl.pdl_enabled()
            assert pdl.pdl_launch(torch.device("cuda")) == ({"USE_PDL": True, "launch_pdl": True} if on else {})
    finally:
        pdl.set_pdl_enabled(saved)


def test_prefetch_families() -> None:
    from ftransformers.kernels import pdl

    saved = pdl.pdl_prefetch_families()
    try:
        with pytest.raises(ValueError, match="unknown prefetch families"):
            pdl.set_pdl_prefetch(frozenset({"gemv"}))
        pdl.set_pdl_prefetch(frozenset({"norm"}))
        assert pdl.pdl_prefetch_families() == frozenset({"norm"})
        pdl.set_pdl_prefetch(True)
        assert pdl.pdl_prefetch_families() == pdl.PREFETCH_FAMILIES
        assert pdl.prefetch_lines(2048, 2) == {"PF_STRIDE": 64, "PF_LINES": 32}
        assert pdl.prefetch_lines(100, 4) == {"PF_STRIDE": 32, "PF_LINES": 4}
        assert pdl.prefetch_lines(1 << 20, 2) == {"PF_STRIDE": 64, "PF_LINES": pdl.MAX_PREFETCH_LINES}
        assert pdl.pdl_launch(torch.device("cpu"), prefetch="norm") == {}  # no PDL, so no prefetch either
        assert pdl.pdl_launch(torch.device("cpu"), early=True) == {}
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and pdl.pdl_enabled():
            assert pdl.pdl_launch(torch.device("cuda"), prefetch="norm").get("PREFETCH") is True
            pdl.set_pdl_prefetch(frozenset({"router"}))
            assert "PREFETCH" not in pdl.pdl_launch(torch.device("cuda"), prefetch="norm")
            assert pdl.pdl_launch(torch.device("cuda"), prefetch="router", early=True) == {
                "USE_PDL": True, "launch_pdl": True, "PREFETCH": True, "EARLY_TRIGGER": True
            }
            assert "EARLY_TRIGGER" not in pdl.pdl_launch(torch.device("cuda"), prefetch="router")
    finally:
        pdl.set_pdl_prefetch(saved)


def test_disable_pdl_flag() -> None:
    from ftransformers.config.server_args import ServerArgs

    assert ServerArgs().disable_pdl is False
    assert ServerArgs.from_kwargs(disable_pdl=True).disable_pdl is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PDL needs a GPU")
@pytest.mark.parametrize("early", [False, True])
def test_pdl_chain_in_a_cuda_graph_matches_the_reference(early: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A chain of dependent kernels (norm -> GEMV -> norm -> ...) captured with PDL: any program that
    # read its input before the previous kernel finished would break the comparison. early: the norms trigger
    # the GEMVs ahead of their own waits.
    from ftransformers.kernels import pdl, triton_norm
    from ftransformers.kernels.triton_gemv import gemv, gemv_ref
    from ftransformers.kernels.triton_norm import rms_norm

    monkeypatch.setattr(triton_norm, "EARLY_TRIGGER", 2 if early else 0)

    gen = torch.Generator(device="cuda").manual_seed(0)
    d = 2048
    ws = [torch.randn(d, d, device="cuda", generator=gen, dtype=torch.bfloat16) / d**0.5 for _ in range(8)]
    nw = torch.rand(d, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    x = torch.randn(1, d, device="cuda", generator=gen, dtype=torch.bfloat16)

    def chain(x: torch.Tensor, lin) -> torch.Tensor:
        res = x
        for w in ws:
            h, res = rms_norm(x, nw, 1e-6, res)
            x = lin(h, w)
        return x + res

    ref = chain(x, gemv_ref)
    saved = pdl.pdl_enabled()
    try:
        pdl.set_pdl_enabled(True)
        static_x = x.clone()
        chain(static_x, gemv)  # compile
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(static_x, gemv)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    finally:
        pdl.set_pdl_enabled(saved)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)  # bf16 rounding of 8 layers' outputs


def _qw(n: int, k: int, zeros: bool, fmt: str = "int4") -> object:
    from ftransformers.kernels.quant_formats import QuantizedWeight

    z = torch.zeros(n, k // 128, dtype=torch.uint8) if zeros else None
    return QuantizedWeight(fmt, torch.zeros(n, k // 8, dtype=torch.int32), torch.ones(n, k // 128), n, k, 128, zeros=z)


def test_which_4bit_linears_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule that makes the kernel before a 4-bit projection trigger early: the one-row GEMV with its first
    # tile preloaded and the mma kernel with its first chunk of words preloaded, where PDL is on; not the codes
    # kernel's rows, a stack of experts, x permuted first or no PDL.
    import dataclasses

    from ftransformers.kernels import gluon_w4a16_mma as mma
    from ftransformers.kernels import triton_w4a16 as w4

    qkv, big_asym = _qw(5120, 2048, zeros=True), _qw(7168, 16384, zeros=True)
    assert not w4.w4a16_reads_ahead(qkv, 1)  # on the CPU: no PDL
    monkeypatch.setattr(w4, "pdl_launch", lambda device: {"USE_PDL": True, "launch_pdl": True})
    assert w4.w4a16_reads_ahead(qkv, 1)  # the GEMV
    assert w4.w4a16_reads_ahead(qkv, 2) and w4.w4a16_reads_ahead(qkv, 8)  # the mma kernel
    assert not w4.w4a16_reads_ahead(qkv, 9) and not w4.w4a16_reads_ahead(qkv, 64)  # the codes kernel
    assert w4.w4a16_reads_ahead(big_asym, 1) and w4.w4a16_reads_ahead(big_asym, 16)  # the mma kernel
    assert w4.w4a16_reads_ahead(_qw(7168, 16384, zeros=False), 1)  # the GEMV
    assert not w4.w4a16_reads_ahead(dataclasses.replace(qkv, perm=torch.arange(2048)), 1)  # x is permuted first
    monkeypatch.setattr(mma, "PRELOAD_WORDS", False)
    assert not w4.w4a16_reads_ahead(qkv, 2) and not w4.w4a16_reads_ahead(big_asym, 1)
    assert w4.w4a16_reads_ahead(qkv, 1)
    monkeypatch.setattr(w4, "PRELOAD_FIRST_TILE", False)
    assert not w4.w4a16_reads_ahead(qkv, 1)


def test_decoder_layer_asks_its_norm_and_attention_for_an_early_trigger(monkeypatch: pytest.MonkeyPatch) -> None:
    # LlamaDecoderLayer passes early_trigger to the input norm iff qkv reads ahead, and to the attention iff o does
    from ftransformers.layers import attention, linear, norm
    from ftransformers.models import llama

    seen: dict[str, bool] = {}

    def fake_norm(self: norm.RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None,
                  early_trigger: bool = False) -> object:  # fmt: skip
        seen.setdefault("norm", early_trigger)  # the input norm's call (the post-attention norm's comes second)
        return x if residual is None else (x, residual)

    def fake_attn(self: attention.Attention, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, rope: object, qk_norm: object = None, early_trigger: bool = False) -> torch.Tensor:  # fmt: skip
        seen["attention"] = early_trigger
        return torch.zeros(q.shape[0], self.num_heads * self.v_head_dim)

    monkeypatch.setattr(norm.RMSNorm, "forward", fake_norm)
    monkeypatch.setattr(attention.Attention, "forward_with_rope", fake_attn)
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=32, max_position_embeddings=64)  # fmt: skip
    layer = llama.LlamaDecoderLayer(cfg, 0)
    x, pos = torch.randn(1, 64), torch.zeros(1, dtype=torch.long)
    for qkv_ahead, o_ahead in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(layer.self_attn.qkv_proj, "reads_ahead_of_wait", lambda rows, a=qkv_ahead: a)
        monkeypatch.setattr(layer.self_attn.o_proj, "reads_ahead_of_wait", lambda rows, a=o_ahead: a)
        seen.clear()
        layer(pos, x, x.clone())
        assert seen == {"norm": qkv_ahead, "attention": o_ahead}
    assert not linear.ReplicatedLinear(8, 8).reads_ahead_of_wait(1)  # unquantized: no
