#!/usr/bin/env bash
# The CUDA test matrix of gpu_validate.sh in about half the time: the compile-bound kernel test files in
# four parallel pytest processes (Triton compiles on the CPU), then engine parity in bf16 with graphs on
# and off, and the quantized whole-model tests (each alone: they size their KV pool from free memory).
# PDL is on by default on Hopper, so these run the kernels as the engine launches them. Logs under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_validate_parallel.sh [group ...]   (groups: see below; default all)
set -u
export PYTHONPATH=$PWD
OUT=${OUT:?set OUT to a folder for the logs}
L=$OUT/tests; mkdir -p "$L"
status=0
t() {  # name pytest-args...
  local n=$1; shift
  python -m pytest -q -p no:cacheprovider "$@" > "$L/$n.log" 2>&1 || status=1
  echo "$n: $(tail -1 "$L/$n.log")"
}
groups=${*:-"kernels parity quant_load"}
if [[ " $groups " == *" kernels "* ]]; then
  t moe_w4 tests/test_triton_moe_w4.py &
  t dense tests/test_triton_w4a16.py tests/test_triton_gemv.py tests/test_pdl.py tests/test_triton_w8.py &
  t kern tests/test_triton_moe.py tests/test_triton_router.py tests/test_triton_fusions.py \
    tests/test_triton_rope_store.py tests/test_triton_attention.py &
  t runner tests/test_cuda_graph.py tests/test_model_runner.py tests/test_sampler.py tests/test_scheduler.py &
  wait  # the background jobs' exit codes are lost: judge their logs
  for n in moe_w4 dense kern runner; do
    tail -1 "$L/$n.log" | grep -q -E "failed|error|^$" && status=1
    tail -1 "$L/$n.log" | grep -q "passed" || status=1
  done
fi
if [[ " $groups " == *" parity "* ]]; then
  FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 t parity_bf16_default tests/test_engine_parity.py
  FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 FT_TEST_DISABLE_CUDA_GRAPH=1 t parity_bf16_graph_off tests/test_engine_parity.py
fi
if [[ " $groups " == *" quant_load "* ]]; then
  t quant_load tests/test_quant_load_cuda.py
fi
grep -h -E "^(FAILED|ERROR)" "$L"/*.log | cut -c1-250 | head -20
exit $status
