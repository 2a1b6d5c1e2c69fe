"""ModelConfig, the registry and the weight loader: good checkpoints load, bad ones fail naming the culprit."""

from __future__ import annotations

from collections.abc import Iterator
import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftransformers.config.model_config import ModelConfig, ModelConfigError
from ftransformers.models.loader import (
    MissingWeightFilesError,
    MissingWeightsError,
    UnexpectedWeightError,
    UnsupportedArchitectureError,
    WeightLoadError,
    WeightShapeError,
    iterate_weights,
    load_model,
)
from tests.model_harness import make_tiny_checkpoint, single_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=2)


@pytest.fixture
def ckpt(llama_ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_ckpt, tmp_path / "ckpt"))


def _load(path: Path, load_format: str = "auto", seed: int = 0) -> torch.nn.Module:
    return load_model(ModelConfig.from_pretrained(path), "cpu", torch.float32, load_format, seed=seed)


def _rewrite(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_sharded_checkpoint_loads_like_single_file(llama_ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    a, b = _load(llama_ckpt), _load(sharded)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    sd = hf.state_dict()
    qkv = torch.cat([sd[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(b.model.layers[1].self_attn.qkv_proj.weight, qkv, rtol=0, atol=0)
    # A shard the index names but the folder lacks is reported by file name.
    missing = sorted(set(index["weight_map"].values()))[1]
    (sharded / missing).unlink()
    with pytest.raises(MissingWeightFilesError, match=missing):
        _load(sharded)


def test_iterate_weights_streams_one_shard_at_a_time(llama_ckpt: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import safetensors

    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(llama_ckpt)).save_pretrained(sharded, max_shard_size="60KB")
    opened: list[str] = []
    real = safetensors.safe_open

    def spy(path: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    gen = iterate_weights(sharded)
    assert inspect.isgenerator(gen) and not opened
    name, tensor = next(gen)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor) and len(opened) == 1
    assert sum(1 for _ in gen) + 1 == len(load_file(str(llama_ckpt / "model.safetensors")))


def test_dummy_load_reads_no_weight_file_and_is_seeded(ckpt: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import safetensors

    (ckpt / "model.safetensors").unlink()

    def forbidden(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("dummy load opened a weight file")

    monkeypatch.setattr(safetensors, "safe_open", forbidden)
    a, b, c = _load(ckpt, "dummy", 0), _load(ckpt, "dummy", 0), _load(ckpt, "dummy", 1)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert pa.abs().max() <= 1e-3 and (pa != 0).float().mean() > 0.99


def test_missing_weight_files(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(MissingWeightFilesError, match=r"no \*\.safetensors weight files in .*ckpt"):
        _load(ckpt)


def test_unreadable_weight_file_is_named(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        _load(ckpt)


def test_unknown_tensor_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(3)))
    with pytest.raises(UnexpectedWeightError, match="model.layers.0.mlp.extra_proj.weight"):
        _load(ckpt)


def test_shape_mismatch_names_tensor_and_shapes(ckpt: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    _rewrite(ckpt, edit)
    with pytest.raises(WeightShapeError, match=r"model.layers.1.self_attn.k_proj.weight.*expected \(32, 64\), got \(16, 64\)"):
        _load(ckpt)
    def edit2(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
        t["model.norm.weight"] = torch.ones(65)

    _rewrite(ckpt, edit2)
    with pytest.raises(WeightShapeError, match=r"model.norm.weight.*expected \(64,\), got \(65,\)"):
        _load(ckpt)


def test_missing_tensor_is_named(ckpt: Path) -> None:
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(MissingWeightsError, match=r"model.layers.1.self_attn.qkv_proj.weight \(shards \['v'\]\)"):
        _load(ckpt)
    _rewrite(ckpt, lambda t: t.update({"model.layers.1.self_attn.v_proj.weight": torch.zeros(32, 64)}))
    _rewrite(ckpt, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(MissingWeightsError, match="model.norm.weight"):
        _load(ckpt)


def test_harmless_extras_are_skipped_and_tied_head_shares_embedding(tmp_path: Path) -> None:
    path = make_tiny_checkpoint("llama", tmp_path / "tied", num_hidden_layers=1, tie_word_embeddings=True)
    _rewrite(path, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    model = _load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    emb = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    torch.testing.assert_close(model.compute_logits(torch.eye(64)[:2]), emb[:, :2].t())


def test_unsupported_architecture_names_it_and_the_supported_list(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForSequenceClassification.*supported: .*LlamaForCausalLM"):
        _load(ckpt)


def test_model_config_errors_are_one_line(tmp_path: Path) -> None:
    cases = {"missing": (tmp_path / "nope", "is not a folder")}
    (tmp_path / "empty").mkdir()
    cases["no_config"] = (tmp_path / "empty", "has no config.json")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    cases["bad_json"] = (tmp_path / "bad", "cannot read .*config.json")
    (tmp_path / "alien").mkdir()
    (tmp_path / "alien" / "config.json").write_text(json.dumps({"model_type": "no_such_model_xyz"}))
    cases["unknown_type"] = (tmp_path / "alien", "cannot read .*config.json")
    for name, (path, pattern) in cases.items():
        with pytest.raises(ModelConfigError, match=pattern) as info:
            ModelConfig.from_pretrained(path)
        assert "\n" not in str(info.value), name


def test_model_config_fields_and_old_spelling(tmp_path: Path) -> None:
    old = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "max_position_embeddings": 1024, "rope_theta": 500000.0, "torch_dtype": "float16", "eos_token_id": [5, 7],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(old))
    mc = ModelConfig.from_pretrained(tmp_path)
    assert (mc.architecture, mc.dtype, mc.context_len, mc.vocab_size) == ("LlamaForCausalLM", torch.float16, 1024, 300)
    assert mc.eos_token_ids == [5, 7]
    model = load_model(mc, "cpu", torch.float32, "dummy")
    rope = model.model.layers[0].self_attn.rotary_emb
    assert type(rope).__name__ == "Llama3RotaryEmbedding" and rope.base == 500000.0
    assert all(layer.self_attn.rotary_emb is rope for layer in model.model.layers)  # one cos|sin cache a model
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert ModelConfig.from_pretrained(tmp_path, dtype="bfloat16", context_length=100).eos_token_ids == [9]
    assert ModelConfig.from_pretrained(tmp_path, context_length=100).context_len == 100
    with pytest.raises(ModelConfigError, match="exceeds the model's maximum of 1024"):
        ModelConfig.from_pretrained(tmp_path, context_length=4096)
    del old["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert ModelConfig.from_pretrained(tmp_path).dtype == torch.bfloat16


def test_new_spelling_float32_checkpoint_stays_float32(llama_ckpt: Path) -> None:
    raw = json.loads((llama_ckpt / "config.json").read_text())
    assert "rope_parameters" in raw or "dtype" in raw  # written by transformers>=5
    assert ModelConfig.from_pretrained(llama_ckpt).dtype == torch.float32


def test_kimi_k2_style_config_falls_back_to_deepseek_v3(tmp_path: Path) -> None:
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "max_position_embeddings": 2048, "rope_theta": 50000.0, "torch_dtype": "bfloat16", "eos_token_id": 3,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    mc = ModelConfig.from_pretrained(tmp_path)
    assert type(mc.hf_config).__name__ == "DeepseekV3Config"
    assert (mc.hf_config.n_routed_experts, mc.dtype, mc.eos_token_ids) == (16, torch.bfloat16, [3])
    assert mc.architecture == "DeepseekV3ForCausalLM"
