#!/usr/bin/env bash
# compute-sanitizer over the kernels' GPU tests (issue 37): memcheck over the shape matrices and the
# flagship-shape kernel tests, racecheck over the kernels that stage tiles in shared memory (the
# tl.dot kernels: the gated-delta chunked prefill, prefill attention, the grouped MoE). Each tool's
# last lines say "ERROR SUMMARY: N errors"; the script exits non-zero when any tool reports one or a
# test fails. Run on the device from the repository root: bash tests/gpu/sanitize.sh [memcheck|racecheck|all]
# Extra pytest arguments (say `-n 4` to spread the tests over pytest-xdist workers, each one under the
# tool) come from $SANITIZE_PYTEST_ARGS.
# API errors are not reported: the VMM probe (ft.memory.vmm) asks for features the driver may refuse.
set -uo pipefail
what=${1:-all}
status=0
run() {  # run TOOL PYTEST-ARGS...: one pytest process under the tool
  local tool=$1; shift
  echo "== compute-sanitizer --tool $tool: pytest $*"
  compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 20 --error-exitcode 86 \
    python3 -m pytest -q -p no:cacheprovider ${SANITIZE_PYTEST_ARGS:-} "$@" 2>&1 | grep -v "^=========     Host Frame\|^=========         Host Frame" | tail -40
  local rc=${PIPESTATUS[0]}
  echo "== exit $rc"
  [ "$rc" -eq 0 ] || status=1
}
if [ "$what" = memcheck ] || [ "$what" = all ]; then
  run memcheck tests/gpu/test_shape_matrix_gated_delta_cuda.py tests/gpu/test_shape_matrix_dense_cuda.py \
    tests/gpu/test_shape_matrix_moe_cuda.py tests/gpu/test_shape_matrix_attention_cuda.py
fi
if [ "$what" = racecheck ] || [ "$what" = all ]; then
  run racecheck tests/gpu/test_shape_matrix_gated_delta_cuda.py -k "packed or T64- or T65-"
fi
exit $status
