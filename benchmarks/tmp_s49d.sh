#!/usr/bin/env bash
# session 49 call 4: does the folded router's +3 us follow how many GEMV programs wrote the stream it reads?
set -u
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
H="# H200, $(date -u +%F), session 49: code e9c23cd"
V="base,set=models.llama.FOLD_POST_NORM=0,set=triton_gemv.GEMV_SMALL=0,set=triton_gemv.GEMV_SMALL=0+set=triton_gemv.GEMV_MEDIUM=0,set=models.llama.FOLD_POST_NORM=0+set=triton_gemv.GEMV_SMALL=0+set=triton_gemv.GEMV_MEDIUM=0"
C1="python benchmarks/ab_decode.py --out \$OUT/r/ab_fold_rows_30b_bf16_s49_h200.json --model qwen3-30b-a3b:48 --batches 1 --context 512 --rounds 3 --timeline --variants $V"
{ echo "$H: $C1"; timeout 420 python benchmarks/ab_decode.py --out $R/ab_fold_rows_30b_bf16_s49_h200.json --model qwen3-30b-a3b:48 --batches 1 --context 512 --rounds 3 --timeline --variants $V; } > $R/ab_fold_rows_30b_bf16_s49_h200.log 2>&1
grep -E 'x floor' $R/ab_fold_rows_30b_bf16_s49_h200.log | tail -6
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r/ab_fold_rows_30b_bf16_s49_h200.json"))
for r in d["rows"]:
    tl = r.get("timeline") or {}
    print(r["variant"], round(r["replay_ms"], 3), [(k["kernel"][:22], k["critical_us"]) for k in tl.get("top", [])[:6]])
PY
