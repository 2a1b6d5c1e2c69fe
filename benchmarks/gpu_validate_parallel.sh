#!/usr/bin/env bash
# The CUDA test matrix of gpu_validate.sh, and the Gluon / MLA-prefill / sampler files it lacks, in less time:
# the compile-bound kernel test files round-robin over eight parallel pytest processes (Triton compiles on the
# CPU), then engine parity in bf16 with graphs on and off, and the quantized whole-model tests (each alone: they size their KV pool from free memory).
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
shards() {  # name count files...: the files' tests round-robin over `count` parallel pytest processes
  local n=$1 k=$2 ids; shift 2
  local tmp; tmp=$(mktemp -d)  # id lists off $OUT (parametrize ids may hold spaces: one id a line)
  python -m pytest -q -p no:cacheprovider --collect-only "$@" 2>/dev/null | grep "::" > "$tmp/all"
  for i in $(seq 0 $((k - 1))); do
    awk -v k="$k" -v i="$i" 'NR % k == i' "$tmp/all" > "$tmp/$i"
    mapfile -t ids < "$tmp/$i"
    [ ${#ids[@]} -gt 0 ] && t "$n.$i" "${ids[@]}" &
  done
  wait
  for i in $(seq 0 $((k - 1))); do
    [ -s "$tmp/$i" ] || continue
    tail -1 "$L/$n.$i.log" | grep -q -E "failed|error|^$" && status=1
    tail -1 "$L/$n.$i.log" | grep -q "passed" || status=1
  done
  rm -rf "$tmp"
}
groups=${*:-"kernels gluon parity quant_load"}
if [[ " $groups " == *" kernels "* ]]; then  # compile-bound (Triton compiles on the CPU): 8 processes
  shards kernels 8 tests/test_triton_moe_w4.py tests/test_triton_w4a16.py tests/test_triton_gemv.py tests/test_pdl.py \
    tests/test_triton_w8.py tests/test_triton_moe.py tests/test_triton_router.py tests/test_triton_fusions.py \
    tests/test_triton_rope_store.py tests/test_triton_attention.py tests/test_decode_stage2.py \
    tests/test_cuda_graph.py tests/test_model_runner.py tests/test_sampler.py tests/test_scheduler.py \
    tests/test_kernel_specializations.py
fi
if [[ " $groups " == *" gluon "* ]]; then  # Hopper-only Gluon kernels, MLA prefill, the sampler kernels
  shards gluon 8 tests/test_gluon_moe_w4_mma.py tests/test_gluon_w4a16_mma.py tests/test_gluon_mla_compile.py \
    tests/test_gluon_mma_compile.py tests/test_w4a16_mma_rule.py tests/test_mla_prefill.py tests/test_triton_greedy.py \
    tests/test_triton_sampling.py tests/test_triton_moe_w4_gemv.py tests/test_quant_formats.py \
    tests/test_gluon_w4a16_wgmma.py tests/test_gluon_wgmma_compile.py tests/test_gluon_w4a16_rs.py \
    tests/test_gluon_rs_compile.py
fi
if [[ " $groups " == *" w4a16 "* ]]; then  # the dense 4-bit linear alone (in kernels too): for a change to its routing
  shards w4a16 8 tests/test_triton_w4a16.py tests/test_gluon_w4a16_rs.py
fi
if [[ " $groups " == *" wgmma "* ]]; then  # the int4 wgmma kernel alone (in gluon too): for a change to it
  shards wgmma 8 tests/test_gluon_w4a16_wgmma.py tests/test_gluon_wgmma_compile.py
fi
if [[ " $groups " == *" attention "* ]]; then  # decode attention, its clusters and launch cache, graphs: for a change there
  shards attention 8 tests/test_triton_attention.py tests/test_decode_stage2.py tests/test_triton_rope_store.py \
    tests/test_cuda_graph.py tests/test_launch_cache.py tests/test_cluster_launch.py tests/test_cluster_compile.py \
    tests/test_gluon_mla_compile.py tests/test_mla_early_tiles.py tests/test_triton_mla_rope.py tests/test_deepseek_v3.py
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
