#!/usr/bin/env bash
# The quantized-weight kernels and quantized models on CUDA, one device call. The test ids of the
# compile-heavy kernel files are split over pytest processes (Triton compiles on the CPU, which has
# cores to spare): the dense-GEMM files over $JOBS_SMALL, the MoE files (GiB-sized inputs) over
# $JOBS_BIG, so the processes' caching allocators fit the GPU together; then the whole-model tests,
# which size their KV pool from free memory, alone. Logs under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_quant_validate.sh
set -u
export PYTHONPATH=$PWD
OUT=${OUT:?set OUT to a folder for the logs}
JOBS_SMALL=${JOBS_SMALL:-8}
JOBS_BIG=${JOBS_BIG:-4}
shard() {  # name jobs files...: run the files' test ids over `jobs` background processes
  local name=$1 jobs=$2; shift 2
  python -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep '::' > "$OUT/$name.ids"
  split -n "r/$jobs" -d "$OUT/$name.ids" "$OUT/$name.shard_"
  for f in "$OUT/$name".shard_??; do
    xargs -d "\n" -a "$f" python -m pytest -q -p no:cacheprovider > "$f.log" 2>&1 &
  done
}
shard small "$JOBS_SMALL" tests/test_quant_formats.py tests/test_triton_w4a16.py
shard big "$JOBS_BIG" tests/test_triton_moe_w4.py tests/test_triton_w8.py
wait
python -m pytest -q -p no:cacheprovider tests/test_quant_load_cuda.py > "$OUT/load.shard_00.log" 2>&1
status=0
for f in "$OUT"/*.shard_??.log; do
  echo "$(basename "$f"): $(tail -1 "$f")"
  tail -1 "$f" | grep -q -E "(failed|error)" && status=1
done
grep -h -E "^(FAILED|ERROR)" "$OUT"/*.shard_??.log | cut -c1-200 | head -40
cat "$OUT"/*.shard_??.log > "$OUT/quant_tests.log"; rm -f "$OUT"/*.shard_* "$OUT"/*.ids
exit $status
