#!/usr/bin/env bash
# Runs on the GPU machine everything that scripts/stage-device.sh staged in .device/, with
# HANDOFF_REQUIRE_GPUS set so that a missing GPU fails the tests instead of skipping them.
# Logs go to $OUT (the device tool's folder) or ./device-logs.
#   run.log     every test binary and example, in order, with a summary at the end
#   bypass.log  the GPU tests with tracking bypassed: their hazard tests are expected to FAIL
#   bench.tar   the benchmarks' rows and plots: sendrecv-MODE.{csv,svg}, coll-MODE-OP.{csv,svg},
#               graphs-MODE.csv (MODE procs-shared: the two ranks shared one GPU)
# HANDOFF_DEVICE_SKIP lists parts to leave out ("tests channel soak examples bench bypass"), for a
# short run;
# HANDOFF_HOST_REPEAT=N runs tests/host N times at once after the suite (its parallel flake).
# With one GPU, ranks that are processes share it (handoff's sharing mode: each process its own
# NCCL host id, NCCL's socket transport over loopback): the two-process tests and examples do so
# by themselves, and the benchmarks' procs modes run as correctness runs with a short sweep
# (HANDOFF_SHARED_BENCH_ARGS, default below). Modes whose ranks are threads of one process
# (inproc) need two GPUs. The summary lists what ran in the sharing mode.
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
# What ran in the sharing mode, for the summary.
shared=()
# The lines that say a run's ranks shared GPUs: handoff's note, once in each rank-0 process of
# a launch that shares GPUs, and the benchmarks' line before their tables.
launch_mark='HANDOFF_SHARE_GPUS=1: ranks share GPUs'
bench_mark='CORRECTNESS RUN OF THE SHARING MODE'
lines() { wc -l <"$1"; }
# Adds $1 to the summary's list when file $2 after its line $3 says ranks shared GPUs, with the
# number of launches that did (rank-0 processes that said so).
note_shared() {
  local part launches
  part=$(tail -n +"$(($3 + 1))" "$2")
  launches=$(grep -c "$launch_mark" <<<"$part")
  if [ "$launches" -gt 0 ] || grep -q "$bench_mark" <<<"$part"; then
    shared+=("$1: $launches launch(es)")
  fi
  return 0
}
for t in .device/tests/*; do
  skip tests && break
  say "== test $(basename "$t")"
  from=$(lines "$log")
  "$t" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("test $(basename "$t")")
  note_shared "test $(basename "$t")" "$log" "$from"
done
# The process-rank tests again with verification over its TCP channel, as between hosts
# (HANDOFF_VERIFY_CHANNEL=tcp: every pair, even on one host); their rank processes inherit it.
if ! skip tests && ! skip channel; then
  for name in comm collectives soundness reliability graphs registered fp8; do
    t=.device/tests/$name
    [ -x "$t" ] || continue
    say "== test $name, HANDOFF_VERIFY_CHANNEL=tcp"
    from=$(lines "$log")
    HANDOFF_VERIFY_CHANNEL=tcp "$t" 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || failed+=("test $name (tcp channel)")
    note_shared "test $name (tcp channel)" "$log" "$from"
  done
fi
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
  from=$(lines "$log")
  "$e" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("example $(basename "$e")")
  note_shared "example $(basename "$e")" "$log" "$from"
done
# The benchmarks in every mode the machine's GPUs allow; tables in run.log, CSV and SVG beside
# it. HANDOFF_BENCH_ARGS adds options (e.g. "--max-bytes 64M").
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# procs with one GPU: its two ranks share it, through NCCL's sockets (one H200, 2026-12-03: an
# all_reduce took about 4 ms at any size up to 2 MiB, a 64 MiB send about 25 ms): a correctness
# run, on a short sweep; its files are named MODE procs-shared.
# Two GPUs: one each, the full sweep.
procs_modes=""
[ "$gpus" -ge 1 ] && procs_modes="procs"
[ "$gpus" -ge 2 ] && procs_modes="inproc procs"
shared_args=${HANDOFF_SHARED_BENCH_ARGS---max-bytes 64M --iters 5 --warmup 1 --repeats 1}
# The options and the file name's mode for mode $1.
bench_args() { if [ "$1" = procs ] && [ "$gpus" -lt 2 ]; then echo "$shared_args"; else echo "${HANDOFF_BENCH_ARGS:-}"; fi; }
bench_name() { if [ "$1" = procs ] && [ "$gpus" -lt 2 ]; then echo procs-shared; else echo "$1"; fi; }
# Runs benchmark $1 ("sendrecv --mode procs"), the rest of the arguments its command, into
# run.log; lists it among the failures or the sharing mode's runs.
bench_run() {
  local what=$1 from
  shift
  say "== bench $what"
  from=$(lines "$log")
  "$@" 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=("bench $what")
  note_shared "bench $what" "$log" "$from"
}
# At most 8 files come back from the device tool: the benchmark's CSV and SVG files go into
# one archive, bench.tar.
bench=$(mktemp -d)
if ! skip bench && [ -x .device/benches/sendrecv ]; then
  for m in self $procs_modes; do
    n=$(bench_name "$m")
    # shellcheck disable=SC2046
    bench_run "sendrecv --mode $m" .device/benches/sendrecv --mode "$m" --csv "$bench/sendrecv-$n.csv" \
      --svg "$bench/sendrecv-$n.svg" $(bench_args "$m")
  done
  # Over ncclMemAlloc memory registered with the communicator: one rank measures only the
  # memory (NCCL registers no send to oneself); two processes take NCCL's registered path (two
  # that share a GPU, NCCL's socket path: whatever NCCL does with registered memory there).
  for m in self $procs_modes; do
    [ "$m" = inproc ] && continue
    n=$(bench_name "$m")
    say "== bench sendrecv --mode $m --memory registered (NCCL_DEBUG=INFO REG: sendrecv-$n-registered-nccl.log)"
    # shellcheck disable=SC2046
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,REG .device/benches/sendrecv --mode "$m" --memory registered \
      --csv "$bench/sendrecv-$n.csv" --svg "$bench/sendrecv-$n.svg" $(bench_args "$m") >"$bench/sendrecv-$n-registered-nccl.log" 2>&1
    [ $? = 0 ] || failed+=("bench sendrecv --mode $m --memory registered")
    note_shared "bench sendrecv --mode $m --memory registered" "$bench/sendrecv-$n-registered-nccl.log" 0
    grep -v 'NCCL INFO' "$bench/sendrecv-$n-registered-nccl.log" | tee -a "$log"
    grep -E 'NCCL INFO.*(IPC regist|IPC reuse|[Ww]indow|failed to IPC)' "$bench/sendrecv-$n-registered-nccl.log" | sort | uniq -c | sort -rn | head -8 | tee -a "$log"
  done
  # shellcheck disable=SC2086
  bench_run "sendrecv --mode self --nonblocking" .device/benches/sendrecv --mode self --nonblocking \
    --csv "$bench/sendrecv-self-nb.csv" --svg "$bench/sendrecv-self-nb.svg" ${HANDOFF_BENCH_ARGS:-}
fi
# The collectives benchmark: one rank always (handoff's own cost), two processes (sharing the
# GPU where there is one), and with two GPUs two ranks in one process.
if ! skip bench && [ -x .device/benches/collectives ]; then
  for m in self $procs_modes; do
    n=$(bench_name "$m")
    # shellcheck disable=SC2046
    bench_run "collectives --mode $m" .device/benches/collectives --mode "$m" --csv "$bench/coll-$n" \
      --svg "$bench/coll-$n" $(bench_args "$m")
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
# rank always, and two processes (sharing the GPU where there is one).
if ! skip bench && [ -x .device/benches/graphs ]; then
  for m in self $procs_modes; do
    [ "$m" = inproc ] && continue
    n=$(bench_name "$m")
    # shellcheck disable=SC2046
    bench_run "graphs --mode $m" .device/benches/graphs --mode "$m" --csv "$bench/graphs-$n.csv" $(bench_args "$m")
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
  note_shared "test registered, NCCL_DEBUG=INFO" "$out/registered-nccl.log" 0
  grep -E 'registering|REG|Registered|register' "$out/registered-nccl.log" | head -30 | tee -a "$log"
fi
tar -cf "$out/bench.tar" -C "$bench" .

if ! skip bypass && [ -d .device/bypass ]; then
  say "== GPU tests with tracking BYPASSED (hazard and reuse tests should fail): see bypass.log"
  : >"$out/bypass.log"
  for t in .device/bypass/*; do
    echo "== bypass $(basename "$t")" >>"$out/bypass.log"
    from=$(lines "$out/bypass.log")
    # One test at a time: concurrent tests' long kernels occupy the GPU and can delay an
    # operation past the window in which the missing ordering would show.
    "$t" --test-threads=1 >>"$out/bypass.log" 2>&1
    rc=$?
    say "bypass $(basename "$t") exit status: $rc (non-zero expected)"
    note_shared "bypass $(basename "$t") (expected to fail)" "$out/bypass.log" "$from"
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
if [ ${#shared[@]} = 0 ]; then
  say "== ran in the sharing mode: nothing"
else
  say "== ran in the sharing mode (ranks that are processes sharing a GPU, NCCL's socket transport over loopback between them; correctness runs, not performance figures):"
  for r in "${shared[@]}"; do say "   $r"; done
fi
if [ "$gpus" -lt 2 ]; then
  say "== not run with one GPU (two ranks in one process need a GPU each): bench sendrecv --mode inproc, bench collectives --mode inproc; the tests' own such cases are listed as ignored or failed above"
fi
if [ ${#failed[@]} = 0 ]; then
  say "== ALL PASSED"
else
  say "== FAILED: ${failed[*]}"
  exit 1
fi
