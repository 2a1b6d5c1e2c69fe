#!/usr/bin/env bash
# session 49 call 3: the post-attention norm folded (e9c23cd): whole-step A/B, then its GPU tests and bf16 parity
set -u
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
H="# H200, $(date -u +%F), session 49: code e9c23cd"
C1="python benchmarks/ab_decode.py --out \$OUT/r/ab_fold_30b_bf16_s49_h200.json --model qwen3-30b-a3b:48 --batches 1 --context 512 --rounds 4 --timeline --variants base,set=models.llama.FOLD_POST_NORM=0"
{ echo "$H: $C1"; timeout 300 python benchmarks/ab_decode.py --out $R/ab_fold_30b_bf16_s49_h200.json --model qwen3-30b-a3b:48 --batches 1 --context 512 --rounds 4 --timeline --variants base,set=models.llama.FOLD_POST_NORM=0; } > $R/ab_fold_30b_bf16_s49_h200.log 2>&1
grep -E 'replay|median|x floor|ratio' $R/ab_fold_30b_bf16_s49_h200.log | tail -14
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r/ab_fold_30b_bf16_s49_h200.json"))
for r in d["rows"]:
    tl = r.get("timeline") or {}
    print(r["variant"], round(r["replay_ms"], 3), round(r["ratio"], 3), [(k["kernel"][:28], k["critical_us"], k["per_step"]) for k in tl.get("top", [])[:7]])
PY
C2="python -m pytest -q -p no:cacheprovider tests/test_triton_gemv.py tests/test_triton_router.py tests/test_fold_post_norm.py tests/test_pdl.py; FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 python -m pytest -q tests/test_engine_parity.py (graphs on, then FT_TEST_DISABLE_CUDA_GRAPH=1)"
{ echo "$H: $C2"; timeout 200 python -m pytest -q -p no:cacheprovider tests/test_triton_gemv.py tests/test_triton_router.py tests/test_fold_post_norm.py tests/test_pdl.py 2>&1 | tail -4
  FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 timeout 120 python -m pytest -q -p no:cacheprovider tests/test_engine_parity.py 2>&1 | tail -4
  FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 FT_TEST_DISABLE_CUDA_GRAPH=1 timeout 120 python -m pytest -q -p no:cacheprovider tests/test_engine_parity.py 2>&1 | tail -4; } > $R/gpu_tests_fold_s49_h200.log 2>&1
cat $R/gpu_tests_fold_s49_h200.log
