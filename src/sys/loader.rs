//! Opens libcudart and libnccl once per process, at first use.
//!
//! The bindings use bindgen's dynamic loading, so the crate builds and links on machines without
//! either library. Each is looked up in this order: the file named by its variable
//! (`HANDOFF_CUDART_PATH`, `HANDOFF_NCCL_PATH`) alone if set; otherwise its soname through the
//! normal search path (`LD_LIBRARY_PATH`, the ld cache), then `$CUDA_HOME/lib64` and
//! `/usr/local/cuda/lib64`. A library that cannot be opened is an [`Error::LibraryNotFound`];
//! one that opens but lacks a function the crate calls is an [`Error::LibraryIncompatible`].

use std::ffi::OsString;
use std::path::PathBuf;

use once_cell::sync::OnceCell;

use super::cudart::CudartLib;
use super::nccl::NcclLib;
use crate::error::Error;

/// What the loader needs to know about one library.
#[derive(Debug, Clone, Copy)]
pub struct LibrarySpec {
    /// The soname looked up on the normal search path.
    pub soname: &'static str,
    /// The variable that names the file instead.
    pub variable: &'static str,
    /// What to install, for the error message.
    pub expected: &'static str,
}

/// The CUDA runtime: CUDA 13's `libcudart.so.13`.
pub const CUDART: LibrarySpec = LibrarySpec {
    soname: "libcudart.so.13",
    variable: "HANDOFF_CUDART_PATH",
    expected: "the CUDA 13 runtime (libcudart.so.13, CUDA toolkit 13.x or the nvidia-cuda-runtime wheel)",
};

/// NCCL 2: `libnccl.so.2`.
pub const NCCL: LibrarySpec = LibrarySpec {
    soname: "libnccl.so.2",
    variable: "HANDOFF_NCCL_PATH",
    expected: "NCCL 2.28 or newer built for CUDA 13 (libnccl.so.2, the libnccl2 package or the nvidia-nccl-cu13 wheel)",
};

impl LibrarySpec {
    /// The files to try, in order, given the values of the override variable and `CUDA_HOME`.
    pub fn candidates(&self, overridden: Option<OsString>, cuda_home: Option<OsString>) -> Vec<PathBuf> {
        if let Some(path) = overridden.filter(|p| !p.is_empty()) {
            return vec![PathBuf::from(path)];
        }
        let mut out = vec![PathBuf::from(self.soname)];
        if let Some(home) = cuda_home.filter(|p| !p.is_empty()) {
            out.push(PathBuf::from(home).join("lib64").join(self.soname));
        }
        out.push(PathBuf::from("/usr/local/cuda/lib64").join(self.soname));
        out
    }

    fn candidates_from_env(&self) -> Vec<PathBuf> {
        self.candidates(std::env::var_os(self.variable), std::env::var_os("CUDA_HOME"))
    }
}

/// Opens the first candidate that dlopen accepts, then resolves every bound function with
/// `resolve`. Uncached; [`cudart`] and [`nccl`] cache its result.
pub fn open_with<L>(
    spec: &LibrarySpec,
    candidates: &[PathBuf],
    resolve: impl FnOnce(libloading::Library) -> Result<L, libloading::Error>,
) -> Result<L, Error> {
    let mut tried = Vec::new();
    for path in candidates {
        // SAFETY: opening a shared library runs its initialisers. libcudart and libnccl are
        // meant to be opened this way (they are what NVIDIA's own loaders dlopen); a file the
        // user names through the variable is trusted as such.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => {
                return resolve(lib).map_err(|e| Error::LibraryIncompatible {
                    library: spec.soname,
                    path: path.display().to_string(),
                    detail: e.to_string(),
                    expected: spec.expected,
                    variable: spec.variable,
                });
            }
            Err(e) => tried.push(format!("{} ({e})", path.display())),
        }
    }
    Err(Error::LibraryNotFound {
        library: spec.soname,
        variable: spec.variable,
        expected: spec.expected,
        tried: tried.join("; "),
    })
}

static CUDART_LIB: OnceCell<Result<CudartLib, Error>> = OnceCell::new();
static NCCL_LIB: OnceCell<Result<NcclLib, Error>> = OnceCell::new();

/// The CUDA runtime, opened at the first call.
///
/// # Errors
/// [`Error::LibraryNotFound`] or [`Error::LibraryIncompatible`]; the same error on every call.
pub fn cudart() -> Result<&'static CudartLib, Error> {
    CUDART_LIB
        .get_or_init(|| {
            open_with(&CUDART, &CUDART.candidates_from_env(), |lib| {
                // SAFETY: the symbols are resolved with the signatures bindgen read from
                // CUDA 13.0's cuda_runtime_api.h, the ABI that libcudart.so.13 exports.
                unsafe { CudartLib::from_library(lib) }
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// NCCL, opened at the first call.
///
/// # Errors
/// [`Error::LibraryNotFound`] or [`Error::LibraryIncompatible`] (also for an NCCL older than
/// the one the bindings were generated from); the same error on every call.
pub fn nccl() -> Result<&'static NcclLib, Error> {
    NCCL_LIB
        .get_or_init(|| {
            let lib = open_with(&NCCL, &NCCL.candidates_from_env(), |lib| {
                // SAFETY: the symbols are resolved with the signatures bindgen read from NCCL
                // 2.28.3's nccl.h; every bound function is part of NCCL 2's stable C API.
                unsafe { NcclLib::from_library(lib) }
            })?;
            check_nccl_version(&lib)?;
            Ok(lib)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The oldest NCCL the crate accepts: the header it is built against, 2.28.3.
pub const MIN_NCCL_VERSION: i32 = 22803;

fn check_nccl_version(lib: &NcclLib) -> Result<(), Error> {
    let mut version = 0;
    // SAFETY: ncclGetVersion writes one int through a valid pointer.
    let rc = unsafe { lib.ncclGetVersion(&mut version) };
    if rc.0 != 0 || version < MIN_NCCL_VERSION {
        return Err(Error::LibraryIncompatible {
            library: NCCL.soname,
            path: NCCL.soname.to_string(),
            detail: format!(
                "ncclGetVersion returned {} with version code {version}, older than {MIN_NCCL_VERSION}",
                rc.0
            ),
            expected: NCCL.expected,
            variable: NCCL.variable,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_variable_is_the_only_candidate() {
        let c = CUDART.candidates(Some("/opt/x/libcudart.so.13".into()), Some("/cuda".into()));
        assert_eq!(c, vec![PathBuf::from("/opt/x/libcudart.so.13")]);
    }

    #[test]
    fn default_candidates_try_soname_then_cuda_home_then_usr_local() {
        let c = NCCL.candidates(None, Some("/cuda".into()));
        assert_eq!(
            c,
            vec![
                PathBuf::from("libnccl.so.2"),
                PathBuf::from("/cuda/lib64/libnccl.so.2"),
                PathBuf::from("/usr/local/cuda/lib64/libnccl.so.2"),
            ]
        );
        // An empty variable counts as unset.
        assert_eq!(NCCL.candidates(Some("".into()), None).len(), 2);
    }

    #[test]
    fn missing_library_names_the_file_and_the_variable() {
        let err = open_with(&CUDART, &[PathBuf::from("/nonexistent/libcudart.so.13")], |lib| {
            // SAFETY: never reached: the file does not exist.
            unsafe { CudartLib::from_library(lib) }
        })
        .map(|_| ())
        .unwrap_err();
        assert!(matches!(err, Error::LibraryNotFound { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("libcudart.so.13"), "{msg}");
        assert!(msg.contains("HANDOFF_CUDART_PATH"), "{msg}");
        assert!(msg.contains("/nonexistent/libcudart.so.13"), "{msg}");
    }

    #[test]
    fn wrong_library_is_incompatible_not_missing() {
        // libc opens fine but has none of NCCL's functions: the same path as an NCCL too old
        // for a function the crate binds.
        let err = open_with(&NCCL, &[PathBuf::from("libc.so.6")], |lib| {
            // SAFETY: resolution fails at the first NCCL symbol; nothing is called.
            unsafe { NcclLib::from_library(lib) }
        })
        .map(|_| ())
        .unwrap_err();
        assert!(matches!(err, Error::LibraryIncompatible { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("HANDOFF_NCCL_PATH") && msg.contains("libc.so.6"),
            "{msg}"
        );
    }
}
