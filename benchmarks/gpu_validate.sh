#!/usr/bin/env bash
# GPU correctness matrix for the fast path, one device call: kernel and runtime tests on CUDA, the
# quantized-weight kernels and quantized models on CUDA, then
# the engine parity tests against transformers in bf16 with the defaults (Triton kernels, CUDA
# graphs, overlap scheduling), with graphs off, with overlap off, and in float32. Logs under $OUT.
#   OUT=/tmp/out bash benchmarks/gpu_validate.sh
set -u
export PYTHONPATH=$PWD
OUT=${OUT:?set OUT to a folder for the logs}
status=0
run() {  # name, env..., -- pytest args...
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" python -m pytest -q -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(tail -1 "$OUT/$name.log")"
  [ $rc -eq 0 ] || status=1
}
run gpu_kernel_tests FT_NONE=1 -- tests/test_triton_attention.py tests/test_triton_moe.py tests/test_triton_router.py \
  tests/test_triton_gemv.py tests/test_triton_fusions.py tests/test_triton_rope_store.py tests/test_cuda_graph.py \
  tests/test_model_runner.py tests/test_sampler.py tests/test_scheduler.py tests/test_kernel_specializations.py
run gpu_quant_tests FT_NONE=1 -- tests/test_quant_formats.py tests/test_triton_w4a16.py tests/test_triton_moe_w4.py \
  tests/test_triton_w8.py tests/test_quant_load_cuda.py
run parity_bf16_default FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 -- tests/test_engine_parity.py
run parity_bf16_graph_off FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 FT_TEST_DISABLE_CUDA_GRAPH=1 -- tests/test_engine_parity.py
run parity_bf16_overlap_off FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16 FT_TEST_DISABLE_OVERLAP=1 -- tests/test_engine_parity.py
run parity_fp32 FT_TEST_DEVICE=cuda FT_TEST_DTYPE=float32 -- tests/test_engine_parity.py
exit $status
