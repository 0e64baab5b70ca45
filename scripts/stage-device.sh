#!/usr/bin/env bash
# Builds every test binary and example here and stages them into .device/ (git-ignored), packed
# into .device.tar.gz to be carried to the GPU machine (the device tool carries at most 64 MiB;
# the binaries are more, packed about a third): the device tool's `run` with carry
# [".device.tar.gz"] and the command `bash scripts/device-run.sh`, which unpacks it.
#
# Also builds the GPU tests a second time with use tracking bypassed
# (--cfg handoff_bypass_tracking) into .device/bypass/: run on a GPU, their hazard tests must
# fail, which shows that they catch what tracking prevents.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh

stage=.device
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/examples" "$stage/bypass" "$stage/benches" "$stage/stubs"

# Lines like "  Executable tests/gpu.rs (target/device/deps/gpu-0123abcd)".
executables() { sed -n 's/^ *Executable \(.*\) (\(.*\))$/\1|\2/p'; }

stage_tests() { # $1: destination folder; the remaining arguments go to cargo
  local dest=$1; shift
  cargo test --profile device --no-run "$@" 2>&1 | tee /dev/stderr | executables |
    while IFS='|' read -r src exe; do
      case "$src" in
        "unittests src/lib.rs") name=unit ;;
        *) name=$(basename "${src%.rs}") ;;
      esac
      cp "$exe" "$dest/$name"
    done
}

# The cudarc feature too (its test, and the interop in every binary); cudarc's CUDA version is
# chosen by whoever builds it.
export CUDARC_CUDA_VERSION=13000
stage_tests "$stage/tests" --features cudarc,float8
cargo build --profile device --examples
find target/device/examples -maxdepth 1 -type f -executable ! -name '*-*' -exec cp {} "$stage/examples/" \;

# Benchmarks: optimised (cargo's bench profile).
cargo bench --no-run 2>&1 | tee /dev/stderr | executables | while IFS='|' read -r src exe; do
  case "$src" in benches/*) cp "$exe" "$stage/benches/$(basename "${src%.rs}")" ;; esac
done

# The stub CUDA and NCCL libraries of the CPU tests, for benches/hostpath on the device's CPU:
# handoff's own host work there, without the GPU's calls.
for lib in cudart:libcudart.so.13 nccl:libnccl.so.2; do
  ${CC:-cc} -O2 -shared -fPIC -pthread -I tests/stubs -o "$stage/stubs/${lib#*:}" "tests/stubs/${lib%%:*}.c" -ldl
done

RUSTFLAGS="--cfg handoff_bypass_tracking" stage_tests "$stage/bypass" --target-dir target/bypass --test gpu --test comm --test collectives --test graphs --test reliability --test threads --test user --test host --test cudarc --test registered --features cudarc
# And tests/gates with held groups neither compared when posted nor when their gates open
# (--cfg handoff_bypass_gate_check): its mismatch tests must fail.
mkdir -p "$stage/bypass-gate"
RUSTFLAGS="--cfg handoff_bypass_gate_check" stage_tests "$stage/bypass-gate" --target-dir target/bypass-gate --test gates
mv "$stage/bypass-gate/gates" "$stage/bypass/gates-unchecked" && rmdir "$stage/bypass-gate"
# And tests/graphs with a family's replays not verified (--cfg handoff_bypass_replay_check):
# its family mismatch test must fail.
mkdir -p "$stage/bypass-replay"
RUSTFLAGS="--cfg handoff_bypass_replay_check" stage_tests "$stage/bypass-replay" --target-dir target/bypass-replay --test graphs
mv "$stage/bypass-replay/graphs" "$stage/bypass/graphs-replays-unchecked" && rmdir "$stage/bypass-replay"

du -sh "$stage"
ls -l "$stage"/*
tar -czf .device.tar.gz "$stage"
du -sh .device.tar.gz
