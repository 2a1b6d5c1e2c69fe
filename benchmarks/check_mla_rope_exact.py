"""Where kernels/triton_mla_rope.py's bf16 output differs from DeepseekRotaryEmbedding's on this GPU, stage by stage.

q_pe with x1 = 1, x2 = 0 makes the kernel's first half cos (cast to bf16) and its second half sin, so those rows
compare the cos / sin alone; random q_pe then compares the whole rotation. Prints the share of equal elements.
    PYTHONPATH=$PWD python benchmarks/check_mla_rope_exact.py
"""

from __future__ import annotations

import torch

from ftransformers.kernels.triton_mla_rope import mla_rope
from ftransformers.layers.rotary_yarn import DeepseekRotaryEmbedding

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def share(a: torch.Tensor, b: torch.Tensor) -> str:
    eq = (a == b).float().mean().item()
    return f"{eq:.4f} equal, max abs diff {(a.float() - b.float()).abs().max().item():.3g}"


def main() -> None:
    torch.manual_seed(0)
    dev, dt, t, h, r, lat = "cuda", torch.bfloat16, 64, 16, 64, 512
    for interleaved in (True, False):
        rope = DeepseekRotaryEmbedding(r, YARN, 163840, interleaved=interleaved).to(dev)
        positions = torch.randint(0, 163840, (t,), device=dev)
        cos, sin = rope.cos_sin(positions, dt)  # [T, P]
        unit = torch.zeros(t, h, r, device=dev, dtype=dt)
        if interleaved:
            unit[..., 0::2] = 1.0
        else:
            unit[..., : r // 2] = 1.0
        c_kv = torch.randn(t, lat, device=dev, dtype=dt)
        k_pe = torch.randn(t, r, device=dev, dtype=dt)
        q_out, _ = mla_rope(positions, rope.inv_freq.float(), rope.attention_factor, unit, c_kv, k_pe, interleaved)
        print(
            f"interleaved={interleaved} cos: {share(q_out[:, 0, : r // 2], cos)}; sin: {share(q_out[:, 0, r // 2 :], sin)}"
        )
        q_pe = torch.randn(t, h, r, device=dev, dtype=dt)
        ref_q, ref_k = rope(positions, q_pe, k_pe)
        q_out, latent = mla_rope(positions, rope.inv_freq.float(), rope.attention_factor, q_pe, c_kv, k_pe, interleaved)
        print(f"interleaved={interleaved} q: {share(q_out, ref_q)}; k: {share(latent[:, lat:], ref_k)}")
        x1 = q_pe[..., 0::2] if interleaved else q_pe[..., : r // 2]
        cs = cos[:, None, :]
        prod = x1 * cs  # the reference's first product, bf16
        print(f"  torch x1*cos == float(x1)*float(cos) rounded: {share(prod, (x1.float() * cs.float()).to(dt))}")


if __name__ == "__main__":
    main()
