#!/usr/bin/env bash
# Runs on the GPU machine everything that scripts/stage-device.sh staged in .device/, with
# HANDOFF_REQUIRE_GPUS set so that a missing GPU fails the tests instead of skipping them.
# Logs go to $OUT (the device tool's folder) or ./device-logs.
#   run.log     every test binary and example, in order, with a summary at the end
#   bypass.log  the GPU tests with tracking bypassed: their hazard tests are expected to FAIL
#   bench.tar   the benchmarks' rows and plots: sendrecv-MODE.{csv,svg}, coll-MODE-OP.{csv,svg},
#               graphs-MODE.csv
# HANDOFF_DEVICE_SKIP lists parts to leave out ("tests soak examples bench bypass"), for a short run;
# HANDOFF_HOST_REPEAT=N runs tests/host N times at once after the suite (its parallel flake).
set -u
cd "$(dirname "$0")/.."
# scripts/stage-device.sh packs the binaries; carried as .device.tar.gz, unpacked here.
[ -f .device.tar.gz ] && tar -xzf .device.tar.gz
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

skip() { case " ${HANDOFF_DEVICE_SKIP:-} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
failed=()
for t in .device/tests/*; do
  skip tests && break
  say "== test $(basename "$t")"
  "$t" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("test $(basename "$t")")
done
if [ "${HANDOFF_HOST_REPEAT:-0}" -gt 0 ] && [ -x .device/tests/host ]; then
  n=$HANDOFF_HOST_REPEAT
  say "== tests/host, $n runs at once"
  for i in $(seq "$n"); do .device/tests/host >"$out/host-$i.log" 2>&1 & done
  bad=0
  for i in $(seq "$n"); do wait -n || bad=$((bad + 1)); done
  say "host: $bad of $n parallel runs failed"
  grep -h -A3 -E '^---- |FAILED|panicked' "$out"/host-*.log | head -40 | tee -a "$log"
  rm -f "$out"/host-*.log
  [ "$bad" = 0 ] || failed+=("host x$n ($bad failed)")
fi
# The long soak (the normal run above has the short one). HANDOFF_SOAK_ROUNDS overrides.
if ! skip soak && [ -x .device/tests/reliability ]; then
  say "== soak, long form"
  HANDOFF_SOAK_ROUNDS=${HANDOFF_SOAK_ROUNDS:-100000} .device/tests/reliability soak_article_loop 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("long soak")
fi
for e in .device/examples/*; do
  skip examples && break
  say "== example $(basename "$e")"
  "$e" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("example $(basename "$e")")
done
# The send/recv benchmark in every mode the machine's GPUs allow; tables in run.log, CSV and SVG
# beside it. HANDOFF_BENCH_ARGS adds options (e.g. "--max-bytes 64M").
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# At most 8 files come back from the device tool: the benchmark's CSV and SVG files go into
# one archive, bench.tar.
bench=$(mktemp -d)
if ! skip bench && [ -x .device/benches/sendrecv ]; then
  modes="self"
  [ "$gpus" -ge 2 ] && modes="self inproc procs"
  for m in $modes; do
    say "== bench sendrecv --mode $m"
    # shellcheck disable=SC2086
    .device/benches/sendrecv --mode "$m" --csv "$bench/sendrecv-$m.csv" --svg "$bench/sendrecv-$m.svg" \
      ${HANDOFF_BENCH_ARGS:-} 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench sendrecv --mode $m")
  done
  # Over ncclMemAlloc memory registered with the communicator: one rank measures only the
  # memory (NCCL registers no send to oneself); two processes take NCCL's registered path.
  for m in $modes; do
    [ "$m" = inproc ] && continue
    say "== bench sendrecv --mode $m --memory registered (NCCL_DEBUG=INFO REG: sendrecv-$m-registered-nccl.log)"
    # shellcheck disable=SC2086
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG .device/benches/sendrecv --mode "$m" --memory registered \
      --csv "$bench/sendrecv-$m.csv" --svg "$bench/sendrecv-$m.svg" ${HANDOFF_BENCH_ARGS:-} >"$bench/sendrecv-$m-registered-nccl.log" 2>&1
    [ $? = 0 ] || failed+=("bench sendrecv --mode $m --memory registered")
    grep -v 'NCCL INFO' "$bench/sendrecv-$m-registered-nccl.log" | tee -a "$log"
    grep -E 'NCCL INFO.*(IPC regist|IPC reuse|[Ww]indow|failed to IPC)' "$bench/sendrecv-$m-registered-nccl.log" | sort | uniq -c | sort -rn | head -8 | tee -a "$log"
  done
  say "== bench sendrecv --mode self --nonblocking"
  # shellcheck disable=SC2086
  .device/benches/sendrecv --mode self --nonblocking --csv "$bench/sendrecv-self-nb.csv" \
    --svg "$bench/sendrecv-self-nb.svg" ${HANDOFF_BENCH_ARGS:-} 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench sendrecv --mode self --nonblocking")
fi
# The collectives benchmark: one rank always (handoff's own cost), and with two GPUs in one
# process and in two.
if ! skip bench && [ -x .device/benches/collectives ]; then
  modes="self"
  [ "$gpus" -ge 2 ] && modes="self inproc procs"
  for m in $modes; do
    say "== bench collectives --mode $m"
    # shellcheck disable=SC2086
    .device/benches/collectives --mode "$m" --csv "$bench/coll-$m" --svg "$bench/coll-$m" \
      ${HANDOFF_BENCH_ARGS:-} 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench collectives --mode $m")
  done
  # The same over NCCL's kinds of memory (HANDOFF_BENCH_MEMORY, default all three), one rank,
  # with NCCL's registration log kept beside it (which paths NCCL reports taking).
  for mem in ${HANDOFF_BENCH_MEMORY-nccl registered window}; do
    say "== bench collectives --mode self --memory $mem (NCCL_DEBUG=INFO REG: coll-self-$mem-nccl.log)"
    # shellcheck disable=SC2086
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG .device/benches/collectives --mode self --memory "$mem" \
      --csv "$bench/coll-self" --svg "$bench/coll-self" ${HANDOFF_BENCH_ARGS:-} >"$bench/coll-self-$mem-nccl.log" 2>&1
    [ $? = 0 ] || failed+=("bench collectives --memory $mem")
    grep -v 'NCCL INFO' "$bench/coll-self-$mem-nccl.log" | tee -a "$log"
    grep -E 'NCCL INFO.*([Rr]egist|[Ww]indow|symmetric|CE )' "$bench/coll-self-$mem-nccl.log" | sort | uniq -c | sort -rn | head -12 | tee -a "$log"
  done
fi
# The graphs benchmark (the article's round: handoff eager and graph, raw eager and graph): one
# GPU always, two processes when there are two GPUs.
if ! skip bench && [ -x .device/benches/graphs ]; then
  modes="self"
  [ "$gpus" -ge 2 ] && modes="self procs"
  for m in $modes; do
    say "== bench graphs --mode $m"
    # shellcheck disable=SC2086
    .device/benches/graphs --mode "$m" --csv "$bench/graphs-$m.csv" ${HANDOFF_BENCH_ARGS:-} 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench graphs --mode $m")
  done
fi
# Host time per tracked operation beside the raw calls: with the real libraries, and with the
# CPU tests' stub libraries (handoff's own work on this host's CPU).
if ! skip bench && [ -x .device/benches/hostpath ]; then
  say "== bench hostpath (real CUDA and NCCL)"
  .device/benches/hostpath 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench hostpath")
  say "== bench hostpath (stub libraries: handoff's own CPU work)"
  HANDOFF_CUDART_PATH=.device/stubs/libcudart.so.13 HANDOFF_NCCL_PATH=.device/stubs/libnccl.so.2 \
    .device/benches/hostpath 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench hostpath on stubs")
fi
# The verification channel's round trip on this host's CPUs (no GPU), beside shared files.
if ! skip bench && [ -x .device/benches/verify_channel ]; then
  say "== bench verify_channel"
  .device/benches/verify_channel 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench verify_channel")
fi
# Registered memory with NCCL's registration log: which paths NCCL reports taking.
if [ -x .device/tests/registered ]; then
  say "== registered memory, NCCL_DEBUG=INFO (REG, ALLOC)"
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=REG,ALLOC .device/tests/registered --test-threads 1 --nocapture >"$out/registered-nccl.log" 2>&1
  [ $? = 0 ] || failed+=("registered with NCCL_DEBUG")
  grep -E 'registering|REG|Registered|register' "$out/registered-nccl.log" | head -30 | tee -a "$log"
fi
tar -cf "$out/bench.tar" -C "$bench" .

if ! skip bypass && [ -d .device/bypass ]; then
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
  grep -E '^(== bypass|test result:|    [a-z0-9_]+$)' "$out/bypass.log" | tee -a "$log"
fi
# Any test binaries built against an older commit (e.g. to show a test failing before its fix),
# staged by hand into .device/old/: expected to FAIL.
if [ -d .device/old ]; then
  for t in .device/old/*; do
    say "== old build of $(basename "$t") (expected to fail)"
    "$t" --test-threads=1 2>&1 | tail -8 | tee -a "$log"
  done
fi
if [ ${#failed[@]} = 0 ]; then
  say "== ALL PASSED"
else
  say "== FAILED: ${failed[*]}"
  exit 1
fi
