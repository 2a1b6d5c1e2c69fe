#!/usr/bin/env bash
# Issues 4 and 5: the whole-model tables (and, with KERNELS=1, the kernel shares the targets name) on
# whatever GPU the device tool lends, in one call. Each step has its own time limit so one slow step
# cannot eat the others; everything goes into one archive (the device tool returns at most 8 files).
#   OUT=/tmp/out TAG=h200 bash benchmarks/baseline_tables.sh            # models
#   OUT=/tmp/out TAG=h200 KERNELS=1 TIMELINE=1 MODELS=0 bash benchmarks/baseline_tables.sh   # kernels, B=1 timelines
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a folder}
TAG=${TAG:-h200}
R=$OUT/r
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$R/smi_$TAG.txt" 2>&1
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s | $(tail -1 "$R/$name.log")"
}
if [ "${MODELS:-1}" = 1 ]; then
  step decode_$TAG "${DECODE_S:-300}" python benchmarks/bench_decode.py --out "$R/decode_$TAG.json" \
    --models qwen3-30b-a3b:48,qwen3-8b:36 --batches "${DECODE_BATCHES:-1,8,32}" --contexts 512 --prefill 8192 --hf first --no-profile
  step quant_decode_$TAG "${QUANT_S:-200}" python benchmarks/bench_quant_decode.py --out "$R/quant_decode_$TAG.json" \
    --models qwen3-30b-a3b:48 --formats "${QUANT_FORMATS:-bf16,w4a16}" --batches "${QUANT_BATCHES:-1,8,32}"
fi
if [ "${KERNELS:-0}" = 1 ]; then
  step attention_mla_$TAG "${MLA_S:-200}" python benchmarks/bench_attention.py --out "$R/mla" --kernels mla \
    --mla-heads 128,64,16,8 --mla-batches 1,4,16,64 --mla-variants gluon,gluon_few --check-reps 2
  step w4_tokens_$TAG "${W4_S:-150}" python benchmarks/bench_w4_b1.py --out "$R/w4_tokens_$TAG.json" \
    --skip gemv,parts,pair,codes,token --tokens 1,2,4,8,16 --token-formats int4-g128-asym --token-shapes qwen3-30b-a3b
  step w4a16_mma_$TAG "${MMA_S:-150}" python benchmarks/bench_w4a16_mma.py --out "$R/w4a16_mma_$TAG.json" \
    --variants int4-asym --rows 1,2,4,8,12,16 --shapes "dsv3 o,qwen3-8b gate_up,qwen3-8b down,dsv3 q_b"
fi
if [ "${TIMELINE:-0}" = 1 ]; then
  for fmt in bf16 w4a16; do
    step timeline_30b_${fmt}_$TAG "${TIMELINE_S:-120}" python benchmarks/ab_decode.py --out "$R/timeline_30b_${fmt}_$TAG.json" \
      --model qwen3-30b-a3b:48 --format $fmt --batches 1 --rounds 3 --timeline --variants base
  done
fi
tar -C "$OUT" -czf "$OUT/results_$TAG.tgz" r && rm -rf "$R"
