#!/usr/bin/env bash
# Installs what building handoff needs on a Debian/Ubuntu machine without a CUDA toolkit:
#   - libclang (for bindgen), from apt;
#   - CUDA 13.0 headers, nvcc and the NCCL header, from NVIDIA's PyPI wheels, into .tools/cuda.
# Idempotent: quick when everything is already there. Where a CUDA toolkit (CUDA_HOME or
# /usr/local/cuda with bin/nvcc) and nccl.h are already installed, it installs no wheels.
#
# Pinned to CUDA 13.0: a newer nvcc writes a PTX ISA version that a CUDA 13.0 driver (580) rejects.
# NCCL's header is pinned to 2.28.3, the oldest NCCL the crate supports (the H200 hosts run it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.tools/cuda"
stamp="$tools/.installed-v1"

say() { printf 'setup: %s\n' "$*" >&2; }

# --- libclang for bindgen -------------------------------------------------------------------
have_libclang() {
  [ -n "${LIBCLANG_PATH:-}" ] && return 0
  # libclang.so or libclang-14.so.1 and the like; libclang-cpp is another library.
  ldconfig -p 2>/dev/null | grep -Eq 'libclang(-[0-9.]+)?\.so' && return 0
  compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null || compgen -G '/usr/lib/llvm-*/lib/libclang-[0-9]*.so*' >/dev/null
}
if ! have_libclang; then
  if command -v apt-get >/dev/null; then
    say "installing libclang-dev (bindgen needs libclang)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libclang-dev >/dev/null
  else
    say "libclang not found and apt-get is missing: install libclang (clang's shared library) and set LIBCLANG_PATH"
    exit 1
  fi
fi

# --- iproute2, for the two-host rehearsal (tests/hosts.rs: network namespaces, veth pairs) ------
# Only as root (the namespaces need it anyway); elsewhere the rehearsal reports ignored.
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  say "installing iproute2 (the two-host rehearsal's namespaces)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi

# --- CUDA headers, nvcc, NCCL header ---------------------------------------------------------
system_cuda() {
  local h=${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}
  [ -x "$h/bin/nvcc" ] && [ -f "$h/include/cuda_runtime_api.h" ] || return 1
  [ -f "${NCCL_INCLUDE_DIR:-${NCCL_HOME:-/nonexistent}/include}/nccl.h" ] || [ -f /usr/include/nccl.h ] || [ -f "$h/include/nccl.h" ]
}
if [ -f "$stamp" ]; then
  say "CUDA wheels already in $tools"
elif system_cuda; then
  say "using the installed CUDA toolkit and NCCL headers; no wheels installed"
else
  say "installing NVIDIA's CUDA 13.0 and NCCL 2.28.3 wheels into $tools"
  py=$(command -v python3 || command -v python) || { say "python3 with pip is needed to install NVIDIA's wheels"; exit 1; }
  rm -rf "$tools"; mkdir -p "$tools"
  # One pip call: several --target installs into one folder silently skip the later ones.
  "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$tools" \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-nccl-cu13==2.28.3
  touch "$stamp"
fi
say "ok"
