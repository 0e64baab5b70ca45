//! Generated FFI bindings (bindgen, in `build.rs`) and the run-time loader that opens the
//! libraries they call.
//!
//! The bindings and the PTX are generated at build time where the CUDA 13 headers, `nccl.h`,
//! libclang and nvcc are found; elsewhere (docs.rs, a machine without CUDA) the build uses the
//! copies in `src/sys/generated/`, which the same code generated and CI keeps equal to what it
//! generates (`HANDOFF_CHECK_GENERATED=1`). Regenerate them with
//! `bash scripts/setup.sh && HANDOFF_WRITE_GENERATED=1 cargo build`.
//!
//! Nothing here is checked: every function returns the raw status code. [`crate::result`] turns
//! those into [`crate::Error`]s; the safe API sits above that.

/// CUDA runtime bindings (`cuda_runtime_api.h`), loaded from `libcudart.so.13` at run time.
#[allow(warnings, clippy::all, missing_docs, unsafe_op_in_unsafe_fn)]
pub mod cudart {
    include!(concat!(env!("OUT_DIR"), "/cudart.rs"));
}

/// NCCL bindings (`nccl.h`), loaded from `libnccl.so.2` at run time.
#[allow(warnings, clippy::all, missing_docs, unsafe_op_in_unsafe_fn)]
pub mod nccl {
    include!(concat!(env!("OUT_DIR"), "/nccl.rs"));
}

/// PTX of every `kernels/*.cu`, compiled by `build.rs`.
pub(crate) mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

pub mod loader;
pub(crate) mod posix;
