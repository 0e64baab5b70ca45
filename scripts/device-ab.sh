#!/bin/bash
# A/B on the device: this build's hostpath and graphs benchmarks against those of an earlier
# commit, interleaved in one call, two rounds; everything goes into $OUT/ab.txt. The earlier
# binaries are built here by hand and copied into .device/before before packing, e.g.
#   git worktree add /tmp/before REV
#   (cd /tmp/before && CARGO_TARGET_DIR=/tmp/bt cargo build --release --bench hostpath --bench graphs)
#   cp /tmp/bt/release/deps/{hostpath,graphs}-<hash> .device/before/{hostpath,graphs}
set -u
o=$OUT/ab.txt
: > "$o"
root=$(pwd)
for round in 1 2; do
  for c in 20000 200000; do
    for b in before/hostpath benches/hostpath; do
      echo "== round $round real $b --calls $c" >> "$o"
      .device/$b --calls $c >> "$o" 2>&1
    done
  done
  for b in before/hostpath benches/hostpath; do
    echo "== round $round stubs $b --calls 200000" >> "$o"
    HANDOFF_CUDART_PATH=.device/stubs/libcudart.so.13 HANDOFF_NCCL_PATH=.device/stubs/libnccl.so.2 \
      .device/$b --calls 200000 >> "$o" 2>&1
  done
  for b in before/graphs benches/graphs; do
    d=$(mktemp -d)
    echo "== round $round $b --mode self --max-bytes 64K" >> "$o"
    (cd "$d" && "$root/.device/$b" --mode self --max-bytes 64K --csv g.csv > /dev/null 2>&1; cat g.csv) >> "$o"
  done
done
