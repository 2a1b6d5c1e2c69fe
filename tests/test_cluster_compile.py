"""The GQA decode stage 1 in thread-block clusters (kernels/cluster.py) compiles for Hopper on any machine: Triton
lowers it to sm_90 PTX offline and ptxas assembles it, so CI catches a Triton that no longer takes the inline PTX
(the cluster barrier, `mapa`, distributed shared-memory loads, the `global_smem` symbol). Its GPU results are checked
in tests/test_triton_attention.py and tests/test_triton_rope_store.py on a Hopper GPU. The compile runs in a child
process: the test session runs Triton's interpreter (conftest).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")  # test_gluon_mma_compile's helper imports it

from test_gluon_mma_compile import compiled_in_child


def _compile_one(cluster: int) -> dict:  # in this process: the PTX and ptxas's return code
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from ftransformers.kernels import triton_decode_attention as m

    fn = m._decode_stage1_kernel
    pointers = {n: "*bf16" for n in ("Q", "QPE", "K", "KPE", "V", "O", "KNEW", "VNEW", "QW", "KW")}
    pointers |= dict.fromkeys(("req_to_token", "req_pool_indices", "seq_lens", "positions", "out_cache_loc"), "*i64")
    pointers |= dict.fromkeys(("mid_o", "mid_lse", "cos_sin"), "*fp32")
    # Qwen3-30B-A3B's decode: 4 KV heads of 8 query heads, head dim 128, fused q/k norm and rope
    consts = {"D": 128, "DPE": 0, "DV": 128, "BLOCK_D": 128, "BLOCK_DPE": 0, "BLOCK_DV": 128, "BLOCK_H": 16}
    consts |= {"BLOCK_N": 64, "DOT_PREC": "tf32", "SHARED_KV": False, "DIRECT": True, "ROPE": True, "QK_NORM": True}
    consts |= {"PRELOAD": True, "USE_PDL": True, "CLUSTER": cluster, "GROUP_H": 8, "STAMPS": False}
    # the launch's own values (decode_attention_fwd, with rope; bf16 rows of 128 are two lines)
    consts |= {"NEW_TILE": m.NEW_TOKEN_TILE, "NEW_BRANCH": bool(m.NEW_TOKEN_BRANCH)}
    consts |= {"PF_SECOND": bool(m.PREFETCH_SECOND_TILE), "PF_LINES": 2, "PF_STRIDE": 64}
    floats = ("sm_scale", "eps_q", "eps_k")
    sig = {
        n: pointers.get(n) or ("constexpr" if n in consts else "fp32" if n in floats else "i32") for n in fn.arg_names
    }
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 2})  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
        run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=False)  # fmt: skip
    return {"ptx": kernel.asm["ptx"], "ptxas_rc": run.returncode, "ptxas": run.stderr[-2000:]}


def _compile() -> list[dict]:  # compiled_in_child's entry: the stage 1 with a cluster of 16, then without
    return [_compile_one(16), _compile_one(1)]


@pytest.fixture(scope="module")
def kernels() -> dict[int, dict]:
    return dict(zip([16, 1], compiled_in_child("test_cluster_compile"), strict=True))


@pytest.mark.parametrize("cluster", [16, 1])
def test_gqa_decode_cluster_merge_compiles_for_hopper(kernels: dict[int, dict], cluster: int) -> None:
    """With CLUSTER 16: two cluster barriers (publish, then leave: one full, one split into arrive and wait, both
    arrives releasing, so that no peer leaves while this CTA's loads from it are in flight), the
    peers' partials read through mapa + ld.shared::cluster (three floats a peer an element), the scratch addressed
    from global_smem; without: none of it, as before. ptxas assembles both."""
    kernel = kernels[cluster]
    assert kernel["ptxas_rc"] == 0, kernel["ptxas"]
    ptx = kernel["ptx"]
    arrives = re.findall(r"barrier\.cluster\.arrive\.(\w+)\.aligned", ptx)
    waits = re.findall(r"barrier\.cluster\.wait(\.acquire)?\.aligned", ptx)
    loads = len(re.findall(r"ld\.shared::cluster\.f32", ptx))
    if cluster == 1:
        assert not arrives and not waits and loads == 0 and "mapa" not in ptx
        return
    assert arrives == ["release", "release"] and sorted(waits) == ["", ".acquire"], (arrives, waits)
    assert loads > 0 and loads % (3 * cluster) == 0 and len(re.findall(r"mapa\.shared::cluster", ptx)) == loads
    assert re.search(r"mov\.u32\s+\S+,\s*global_smem;", ptx)
