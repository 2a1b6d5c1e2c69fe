"""DeepSeek-V3 / Kimi-K2: routing, YaRN rope and MLA attention against plain references, then whole
models against transformers' DeepseekV3ForCausalLM (float32, CPU) through the paged latent cache."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode
from ftransformers.attention.torch_native_mla import forward_mla
from ftransformers.cache.kv_pool import MLAKVPool, MLAKVSpec
from ftransformers.layers import rotary_yarn
from ftransformers.layers.moe.grouped_topk import grouped_topk
from ftransformers.layers.rotary_yarn import DeepseekRotaryEmbedding, softmax_scale_multiplier
from tests.model_harness import hf_greedy_reference, make_tiny_checkpoint, random_prompts, run_engineless_greedy


@pytest.fixture(autouse=True)
def _mla_rope_kernel_in_models(monkeypatch: pytest.MonkeyPatch) -> None:
    # The models here run kernels/triton_mla_rope.py under Triton's interpreter (the rest of the CPU suite
    # skips it there, being slow): the whole-model parity covers it.
    monkeypatch.setattr(rotary_yarn, "MLA_ROPE_ON_CPU", True)


NEW_TOKENS = 32
LOGITS_TOL = 1e-3
LENGTHS = [3, 10, 19, 34]
CHUNK = 7  # small: prefill chunks and decodes share steps
HEAD_SCALE = 4.0


# ---------------------------------------------------------------- grouped top-k


def _plain_grouped_topk(logits, bias, k, n_group, topk_group, renorm, scale):  # type: ignore[no-untyped-def]
    """Token by token, with sorted Python lists."""
    T, E = logits.shape
    ids_out, w_out = [], []
    for t in range(T):
        s = [1 / (1 + math.exp(-float(x))) for x in logits[t].double()]
        b = [s[e] + float(bias[e]) for e in range(E)]
        size = E // n_group
        group_score = [sum(sorted(b[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for e in range(E) if e // size in groups]
        chosen = sorted(sorted(allowed, key=lambda e: -b[e])[:k])
        w = [s[e] for e in chosen]
        if renorm:
            w = [x / sum(w) for x in w]
        ids_out.append(chosen)
        w_out.append([x * scale for x in w])
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float64)


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize(
    "E,k,n_group,topk_group,renorm", [(16, 3, 4, 2, True), (12, 4, 1, 1, True), (32, 6, 8, 3, False)]
)
def test_grouped_topk_matches_plain_reference(E: int, k: int, n_group: int, topk_group: int, renorm: bool) -> None:
    gen = torch.Generator().manual_seed(E * 7 + k)
    logits = torch.randn(9, E, generator=gen) * 2
    bias = torch.rand(E, generator=gen) - 0.5
    weights, ids = grouped_topk(logits, k, n_group, topk_group, bias, renorm, 2.5)
    ref_ids, ref_w = _plain_grouped_topk(logits, bias, k, n_group, topk_group, renorm, 2.5)
    weights, ids = _sorted_by_id(weights, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, atol=1e-6, rtol=1e-6)


def test_correction_bias_selects_but_does_not_weight() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # pushes expert 3 in, its weight stays sigmoid(0)
    weights, ids = grouped_topk(logits, 2, None, None, bias, renormalize=False, routed_scaling_factor=1.0)
    weights, ids = _sorted_by_id(weights, ids)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights, torch.tensor([[torch.sigmoid(torch.tensor(3.0)).item(), 0.5]]))


def test_grouped_topk_matches_hf_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=1.7, norm_topk_prob=True)  # fmt: skip
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    router.weight.data = torch.randn(16, 24, generator=gen)
    router.e_score_correction_bias.data = torch.rand(16, generator=gen) - 0.5
    x = torch.randn(11, 24, generator=gen)
    _, hf_w, hf_ids = router(x)
    w, ids = grouped_topk(x @ router.weight.t(), 4, 4, 2, router.e_score_correction_bias, True, 1.7)
    w, ids = _sorted_by_id(w, ids)
    hf_w, hf_ids = _sorted_by_id(hf_w, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- rope


def _plain_yarn_inv_freq(dim: int, base: float, factor: float, orig: int, beta_fast: float, beta_slow: float):  # type: ignore[no-untyped-def]
    """YaRN as in the paper: wavelength-ramped blend of interpolated and extrapolated frequencies."""
    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        ramp = min(max((i - low) / ((high - low) or 0.001), 0.0), 1.0)
        out.append(theta / factor * ramp + theta * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def _plain_rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, att: float, interleaved: bool):  # type: ignore[no-untyped-def]
    """Complex multiplication of each (re, im) pair; output half-split [re | im] as HF lays it out."""
    x = x.double()
    if interleaved:
        z = torch.complex(x[..., 0::2], x[..., 1::2])
    else:
        half = x.shape[-1] // 2
        z = torch.complex(x[..., :half], x[..., half:])
    angle = pos.double()[:, None] * inv_freq  # [T, R/2]
    rot = torch.polar(torch.full_like(angle, att), angle)[:, None, :]
    z = z * rot
    return torch.cat([z.real, z.imag], dim=-1)


ROPE_CASES = [
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}, True),
    ({"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 256,
      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, False),
    ({"rope_type": "default", "rope_theta": 10000.0}, True),
]  # fmt: skip


@pytest.mark.parametrize("params,interleaved", ROPE_CASES)
def test_rope_matches_plain_reference_and_hf(params: dict, interleaved: bool) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    R, H, T = 16, 3, 13
    max_pos = int(params.get("factor", 1) * params.get("original_max_position_embeddings", 1024))
    rope = DeepseekRotaryEmbedding(R, params, max_position_embeddings=max_pos, interleaved=interleaved)
    gen = torch.Generator().manual_seed(11)
    pos = torch.randint(0, max_pos, (T,), generator=gen)
    q, k = torch.randn(T, H, R, generator=gen), torch.randn(T, R, generator=gen)
    q_out, k_out = rope(pos, q, k)

    if params["rope_type"] == "yarn":
        args = [params[n] for n in ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")]
        inv_freq = _plain_yarn_inv_freq(R, *args)
        m = lambda s, ms: 0.1 * ms * math.log(s) + 1.0 if s > 1 else 1.0  # noqa: E731
        att = m(params["factor"], params["mscale"]) / m(params["factor"], params["mscale_all_dim"])
    else:
        inv_freq, att = params["rope_theta"] ** (-torch.arange(0, R, 2, dtype=torch.float64) / R), 1.0
    # float64 reference; float32 angles at position p carry ~p * 6e-8 rad of rounding.
    tol = 4 * float(pos.max()) * 6e-8 * float(q.abs().max()) + 1e-6
    torch.testing.assert_close(q_out.double(), _plain_rotate(q, pos, inv_freq, att, interleaved), atol=tol, rtol=0)
    torch.testing.assert_close(k_out.double(), _plain_rotate(k[:, None], pos, inv_freq, att, interleaved)[:, 0],
                               atol=tol, rtol=0)  # fmt: skip

    cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=H, qk_rope_head_dim=R, qk_nope_head_dim=8, v_head_dim=8,
                           kv_lora_rank=16, q_lora_rank=None, max_position_embeddings=max_pos,
                           rope_parameters=dict(params), rope_interleave=interleaved)  # fmt: skip
    cos, sin = hf.DeepseekV3RotaryEmbedding(cfg)(q, pos[None])
    apply = hf.apply_rotary_pos_emb_interleave if interleaved else hf.apply_rotary_pos_emb
    hf_q, hf_k = apply(q.transpose(0, 1)[None], k[None, None], cos, sin)  # [1, H, T, R], [1, 1, T, R]
    torch.testing.assert_close(q_out, hf_q[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out, hf_k[0, 0], atol=1e-6, rtol=0)
    attn = hf.DeepseekV3Attention(cfg, layer_idx=0)
    assert math.isclose(attn.scaling, (8 + R) ** -0.5 * softmax_scale_multiplier(params), rel_tol=1e-12)


# ---------------------------------------------------------------- MLA attention over the paged pool


def test_forward_mla_matches_dense_reference() -> None:
    L, R, H = 12, 4, 3
    gen = torch.Generator().manual_seed(5)
    prefix, extend = [0, 5, 9], [4, 1, 3]  # a fresh prefill, a decode, a later chunk
    seq = [p + e for p, e in zip(prefix, extend)]
    pool = MLAKVPool(MLAKVSpec(2, L, R), size=40, dtype=torch.float32, device="cpu")
    slots = torch.randperm(40, generator=gen)[: sum(seq)] + 1
    req_to_token = torch.zeros(3, 16, dtype=torch.int64)
    rows, locs, off = [], [], 0
    for i, n in enumerate(seq):
        req_to_token[i, :n] = slots[off : off + n]
        rows.append(torch.randn(n, L + R, generator=gen))  # every token's latent, positions 0..n-1
        pool.set_latent(1, slots[off : off + prefix[i]], rows[i][: prefix[i]])  # cached prefix
        locs.append(slots[off + prefix[i] : off + n])
        off += n
    T = sum(extend)
    q_nope, q_rope = torch.randn(T, H, L, generator=gen), torch.randn(T, H, R, generator=gen)
    latent = torch.cat([rows[i][prefix[i] :] for i in range(3)])

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    batch = ForwardBatch(ForwardMode.EXTEND, t([0] * T), t([0] * T), torch.cat(locs), t([0, 1, 2]), t(seq),
                         t(prefix), t(extend), seq, prefix, extend, t([T - 1]), req_to_token, pool,
                         None)  # type: ignore[arg-type]  # fmt: skip
    out = forward_mla(q_nope, q_rope, latent, 1, 0.3, batch)

    start = 0
    for i in range(3):
        kv = rows[i].double()  # [S, L+R]
        for j in range(extend[i]):
            qi = torch.cat([q_nope[start + j], q_rope[start + j]], dim=-1).double()  # [H, L+R]
            visible = kv[: prefix[i] + j + 1]
            probs = torch.softmax(qi @ visible.t() * 0.3, dim=-1)  # [H, s]
            torch.testing.assert_close(out[start + j].double(), probs @ visible[:, :L], atol=1e-5, rtol=0)
        start += extend[i]
    torch.testing.assert_close(pool.get_latent(1)[slots[: seq[0]]], rows[0])  # new rows were stored


# ---------------------------------------------------------------- whole-model parity with transformers

MAIN = dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1)
VARIANTS = {
    "q_lora": dict(MAIN),
    "no_q_lora": dict(MAIN, q_lora_rank=None, rope_interleave=False, rope_scaling={
        "type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
        "mscale": 0.9, "mscale_all_dim": 0.707}),
    # Kimi-K2 shape: many experts in one group, its YaRN settings (beta_fast = beta_slow = 1).
    "kimi": dict(n_routed_experts=48, n_group=1, topk_group=1, num_experts_per_tok=6, routed_scaling_factor=2.827,
                 first_k_dense_replace=1, rope_theta=50000.0, max_position_embeddings=2048, rope_scaling={
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64, "beta_fast": 1.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}),
}  # fmt: skip


def _as_kimi_config(path: Path) -> None:
    """Rewrite config.json the way Kimi-K2 ships it: custom model_type, remote-code auto_map."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="kimi_k2", topk_method="noaux_tc", scoring_func="sigmoid", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))


def _sharpen_head(path: Path, factor: float = HEAD_SCALE) -> Path:
    """Scale lm_head so that greedy choices are far from ties (logit gaps grow, numerical noise stays ~1e-5)."""
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * factor
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: _sharpen_head(make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp(name), seed=i + 1, **overrides))
        for i, (name, overrides) in enumerate(VARIANTS.items())
    }


# every variant, and the first once more with its decode's latent rows stored by the MLA rope kernel
# (ROPE_STORES_LATENT) instead of by the attention
PARITY_CASES = [(v, False) for v in VARIANTS] + [(next(iter(VARIANTS)), True)]


@pytest.mark.parametrize("variant,rope_stores", PARITY_CASES)
def test_parity_with_transformers(
    monkeypatch: pytest.MonkeyPatch, variant: str, rope_stores: bool, checkpoints: dict[str, Path]
) -> None:
    from ftransformers.models import deepseek_v3

    monkeypatch.setattr(deepseek_v3, "ROPE_STORES_LATENT", rope_stores)
    path = checkpoints[variant]
    prompts = random_prompts(4, 384, LENGTHS, seed=len(variant))
    ref_tokens, ref_logits = hf_greedy_reference(path, prompts, NEW_TOKENS)
    if variant == "kimi":
        _as_kimi_config(path)  # the reference read it first; transformers cannot load kimi_k2 without remote code
    tokens, logits = run_engineless_greedy(path, prompts, NEW_TOKENS, chunk_size=CHUNK)
    for i in range(len(prompts)):
        assert tokens[i] == ref_tokens[i], f"{variant}: prompt {i} greedy tokens differ"
        diff = (logits[i] - ref_logits[i]).abs().max().item()
        assert diff <= LOGITS_TOL, f"{variant}: prompt {i} logits off by {diff:.2e}"
        # The token match means something only if no reference step was a tie at our noise level.
        top2 = ref_logits[i].topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert margin > 10 * diff, f"{variant}: prompt {i} top-2 margin {margin:.2e} vs noise {diff:.2e}"


def _loaded_state(path: Path) -> dict[str, torch.Tensor]:
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.models.loader import load_model

    model = load_model(ModelConfig.from_pretrained(path, dtype="float32"), "cpu", torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_mtp_layer_tensors_are_skipped(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from ftransformers.layers.weight_utils import WeightLoadError

    src = checkpoints["q_lora"]
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp_dir = tmp_path / "with_mtp"
    shutil.copytree(src, mtp_dir)
    # A second shard holding layer n_layers the way DeepSeek-V3 ships its MTP module.
    tensors = load_file(str(src / "model.safetensors"))
    mtp = {k.replace(f"layers.{n_layers - 1}.", f"layers.{n_layers}."): v.clone()
           for k, v in tensors.items() if k.startswith(f"model.layers.{n_layers - 1}.")}  # fmt: skip
    D = tensors["model.norm.weight"].shape[0]
    mtp |= {f"model.layers.{n_layers}.{n}": torch.randn(D) for n in ("enorm.weight", "hnorm.weight")}
    mtp[f"model.layers.{n_layers}.eh_proj.weight"] = torch.randn(D, 2 * D)
    mtp[f"model.layers.{n_layers}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[f"model.layers.{n_layers}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(mtp, str(mtp_dir / "model-mtp.safetensors"))
    weight_map = {k: "model.safetensors" for k in tensors} | {k: "model-mtp.safetensors" for k in mtp}
    (mtp_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    plain, with_mtp = _loaded_state(src), _loaded_state(mtp_dir)
    assert plain.keys() == with_mtp.keys()
    assert all(torch.equal(plain[k], with_mtp[k]) for k in plain)

    # Skipping is by layer index only: a stray tensor inside a real layer is still an error.
    save_file({"model.layers.1.self_attn.bogus.weight": torch.zeros(2)}, str(mtp_dir / "model-mtp.safetensors"))
    weight_map = {k: "model.safetensors" for k in tensors} | {"model.layers.1.self_attn.bogus.weight": "model-mtp.safetensors"}
    (mtp_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(WeightLoadError, match="bogus"):
        _loaded_state(mtp_dir)
