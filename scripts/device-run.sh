#!/usr/bin/env bash
# Runs on the GPU machine everything that scripts/stage-device.sh staged in .device/, with
# HANDOFF_REQUIRE_GPUS set so that a missing GPU fails the tests instead of skipping them.
# Logs go to $OUT (the device tool's folder) or ./device-logs.
#   run.log     every test binary and example, in order, with a summary at the end
#   bypass.log  the GPU tests with tracking bypassed: their hazard tests are expected to FAIL
set -u
cd "$(dirname "$0")/.."
out=${OUT:-device-logs}
mkdir -p "$out"
log="$out/run.log"
: >"$log"
export HANDOFF_REQUIRE_GPUS=${HANDOFF_REQUIRE_GPUS:-1}
# NVLink multicast stays off on the shared GPU hosts, also in processes started from here.
export NCCL_NVLS_ENABLE=0
say() { printf '%s\n' "$*" | tee -a "$log"; }

say "== $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
say "HANDOFF_REQUIRE_GPUS=$HANDOFF_REQUIRE_GPUS"

failed=()
for t in .device/tests/*; do
  say "== test $(basename "$t")"
  "$t" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("test $(basename "$t")")
done
for e in .device/examples/*; do
  say "== example $(basename "$e")"
  "$e" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("example $(basename "$e")")
done
if [ -d .device/bypass ]; then
  say "== GPU tests with tracking BYPASSED (hazard and reuse tests should fail): see bypass.log"
  : >"$out/bypass.log"
  for t in .device/bypass/*; do
    echo "== bypass $(basename "$t")" >>"$out/bypass.log"
    # One test at a time: concurrent tests' long kernels occupy the GPU and can delay an
    # operation past the window in which the missing ordering would show.
    "$t" --test-threads=1 >>"$out/bypass.log" 2>&1
    rc=$?
    say "bypass $(basename "$t") exit status: $rc (non-zero expected)"
  done
  grep -E '^test .*(ok|FAILED|ignored)$' "$out/bypass.log" | tee -a "$log"
fi
if [ ${#failed[@]} = 0 ]; then
  say "== ALL PASSED"
else
  say "== FAILED: ${failed[*]}"
  exit 1
fi
