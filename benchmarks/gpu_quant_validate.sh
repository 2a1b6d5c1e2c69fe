#!/usr/bin/env bash
# The quantized-weight kernels and quantized models on CUDA, one device call: the test ids of the
# compile-heavy files are split over $JOBS pytest processes (Triton compiles on the CPU, which has
# cores to spare), logs under $OUT; then the 4-bit MoE benchmark and the FP8 numerics diagnosis.
#   OUT=/tmp/out JOBS=12 bash benchmarks/gpu_quant_validate.sh
set -u
export PYTHONPATH=$PWD
OUT=${OUT:?set OUT to a folder for the logs}
JOBS=${JOBS:-12}
FILES="tests/test_quant_formats.py tests/test_triton_w4a16.py tests/test_triton_moe_w4.py tests/test_triton_w8.py tests/test_quant_load_cuda.py"
python -m pytest -q --collect-only -p no:cacheprovider $FILES 2>/dev/null | grep '::' > "$OUT/ids.txt"
echo "$(wc -l < "$OUT/ids.txt") tests over $JOBS processes"
split -n "r/$JOBS" -d "$OUT/ids.txt" "$OUT/shard_"
for f in "$OUT"/shard_*; do
  xargs -d "\n" -a "$f" python -m pytest -q -p no:cacheprovider > "$f.log" 2>&1 &
done
wait
status=0
for f in "$OUT"/shard_*.log; do
  tail -1 "$f"
  grep -q -E "(failed|error)" <(tail -1 "$f") && status=1
done
grep -h -E "^(FAILED|ERROR)" "$OUT"/shard_*.log | head -40
cat "$OUT"/shard_*.log > "$OUT/quant_tests.log"; rm -f "$OUT"/shard_*
exit $status
