#!/usr/bin/env bash
# Checks, without the toolchain itself, that the locked dependencies build with the crate's
# rust-version: no package in Cargo.lock may declare a newer rust-version than handoff's.
# (Only Rust 1.95 can be installed where CI runs; clippy's incompatible_msrv covers the crate's
# own use of the standard library.) Needs python3, which scripts/setup.sh needs too.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo metadata --format-version 1 --locked | python3 -c '
import json, sys
meta = json.load(sys.stdin)
def version(v):
    return tuple(int(x) for x in v.split("."))[:3] if v else (0,)
ours = [p for p in meta["packages"] if p["id"] in meta["workspace_members"]][0]
msrv = ours["rust_version"]
bad = ["%s %s needs Rust %s" % (p["name"], p["version"], p["rust_version"])
       for p in meta["packages"] if version(p["rust_version"]) > version(msrv)]
if bad:
    sys.exit("check-msrv: rust-version is %s, but: %s" % (msrv, "; ".join(bad)))
print("check-msrv: every locked dependency declares Rust %s or older" % msrv, file=sys.stderr)
'
