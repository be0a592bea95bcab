#!/usr/bin/env bash
# tests/gpu.sh: every GPU test of tensormp, Go and Python, then the GPU
# bench, on this machine's first NVIDIA GPU. Run it from a clean clone:
#
#   tests/gpu.sh
#
# It prints the driver's answers to what its documentation leaves open
# (one "fact" line each), a PASS, FAIL or SKIP line per test, run once on
# device slabs and once more on the legacy IPC path (TENSORMP_GPU_LEGACY),
# the bench's table, and a last line saying whether all passed (exit 0)
# or not; it takes a few minutes. Without a GPU, the same tests run in CI
# on the stand-in driver (internal/cudastub). The tests need the NVIDIA driver (libcuda.so.1); the Python
# tests a python3 with torch and NumPy (TENSORMP_PYTHON names one). On a
# machine without Go, build the binaries elsewhere and name their folder:
#
#   TENSORMP_GPU_BIN=dir tests/gpu.sh   # dir holds tests.test, dist.test,
#                                       # cuda.test, spawn and libtensormp.so
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bin=${TENSORMP_GPU_BIN:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ -z "$bin" ]; then
  command -v go >/dev/null || { echo "FAIL no Go here: set TENSORMP_GPU_BIN to prebuilt binaries"; exit 1; }
  bin=$work/bin
  mkdir -p "$bin"
  echo "== building"
  go test -c -o "$bin/tests.test" ./tests &&
    go test -c -o "$bin/cuda.test" ./cuda &&
    (cd dist && go test -c -o "$bin/dist.test" .) &&
    go build -o "$bin/spawn" ./cmd/spawn &&
    go build -buildmode=c-shared -o "$bin/libtensormp.so" ./cmd/libtensormp ||
    { echo "FAIL build"; exit 1; }
fi
bin=$(cd "$bin" && pwd)

echo "== the GPU"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
else
  echo "(no nvidia-smi)"
fi

export TENSORMP_REQUIRE_GPU=1 TENSORMP_REQUIRE_PYTHON=1 TENSORMP_LIB=$bin/libtensormp.so
shm_before=$(ls /dev/shm | grep -cE '^(tensormp_|cuda\.shm\.)' || true)
failed=0

echo "== the driver's facts"
(cd "$root/cuda" && "$bin/cuda.test" -test.run '^TestGPUDeviceFacts$' -test.v -test.count 1 -test.timeout 2m) >"$work/facts.log" 2>&1 ||
  { echo "FAIL the facts"; tail -20 "$work/facts.log"; failed=1; }
sed -nE 's/^\s*facts_test\.go:[0-9]+: /fact /p' "$work/facts.log"

# run_tests DIR BINARY [NAME]: runs the GPU tests of a test binary in DIR
# and prints a line per test.
run_tests() {
  local dir=$1 test=$2 log=$work/$(basename "$2")${3:-}.log
  (cd "$dir" && "$test" -test.run 'GPU' -test.v -test.count 1 -test.timeout 6m) >"$log" 2>&1
  local code=$?
  grep -E '^\s*--- (PASS|FAIL|SKIP)' "$log" | sed -E 's/^\s*--- (PASS|FAIL|SKIP): /\1 /'
  if [ $code -ne 0 ] || grep -qE '^\s*--- (FAIL|SKIP)' "$log"; then
    failed=1
    echo "-- $(basename "$test") failed or skipped; its last lines:"
    tail -40 "$log"
  fi
}

echo "== Go and Python GPU tests"
run_tests "$root/tests" "$bin/tests.test"
echo "== dist GPU tests"
run_tests "$root/dist" "$bin/dist.test"
echo "== the same on the legacy IPC path"
TENSORMP_GPU_LEGACY=1 TENSORMP_GPU_KILL_RUNS=30 run_tests "$root/tests" "$bin/tests.test" .legacy

echo "== bench"
if ! "$bin/spawn" bench -device gpu:0 -trips 2000 -stream 100000 -pylib "$bin/libtensormp.so" -pypath "$root/python"; then
  echo "FAIL bench"
  failed=1
fi

shm_after=$(ls /dev/shm | grep -cE '^(tensormp_|cuda\.shm\.)' || true)
if [ "$shm_after" -gt "$shm_before" ]; then
  echo "FAIL /dev/shm: $shm_before tensormp_ and cuda.shm entries before, $shm_after after"
  failed=1
fi
if [ $failed -eq 0 ]; then
  echo "== all GPU tests passed"
else
  echo "== some GPU tests failed"
fi
exit $failed
