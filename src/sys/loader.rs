//! Opens libcudart and libnccl once per process, at first use.
//!
//! The bindings use bindgen's dynamic loading, so the crate builds and links on machines without
//! either library. Each is looked for in this order, and the first file that opens is used:
//!
//! 1. the file named by its variable (`HANDOFF_CUDART_PATH`, `HANDOFF_NCCL_PATH`), alone, if set;
//! 2. its soname (`libcudart.so.13`, `libnccl.so.2`) through the dynamic linker's own search
//!    (`LD_LIBRARY_PATH`, the ld cache, `/usr/lib`...);
//! 3. `lib64/` then `lib/` under `$CUDA_HOME` and then `$CUDA_PATH` (toolkits use `lib64/`);
//! 4. `/usr/local/cuda/lib64`;
//! 5. NVIDIA's wheels installed with `pip install --target`: under `$HANDOFF_TOOLS_DIR` (a
//!    relative value is taken from the working directory of the running program), then under the
//!    folder the crate was built with ([`BUILD_TOOLS_DIR`]: the build's `HANDOFF_TOOLS_DIR`, by
//!    default the handoff repository's `.tools/cuda`, where `scripts/setup.sh` installs them);
//!    the wheels put the libraries in `nvidia/cu13/lib` and `nvidia/nccl/lib`;
//! 6. the same folders in the `site-packages` (and Debian's `dist-packages`) of Python
//!    environments, newest Python first within each: `$VIRTUAL_ENV`, `$CONDA_PREFIX`, the user's
//!    `~/.local` (`pip install --user`), `/usr/local` and `/usr`. Other Pythons (pyenv, a venv
//!    not activated) are not searched: name the file with the variable, or add its folder to
//!    `LD_LIBRARY_PATH`.
//!
//! A library that cannot be opened is an [`Error::LibraryNotFound`] listing every file tried and
//! why each failed; one that opens but lacks a function the crate calls is an
//! [`Error::LibraryIncompatible`]. NCCL's functions of registered memory and windows are
//! resolved apart, at their first use ([`nccl_register`]): an NCCL without them still loads, and
//! only those features fail, with [`Error::Unsupported`].

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use once_cell::sync::OnceCell;

use crate::error::Error;
use crate::sys::cudart::CudartLib;
use crate::sys::nccl::NcclLib;
use crate::sys::nccl::register::NcclRegisterLib;

/// What the loader needs to know about one library.
#[derive(Debug, Clone, Copy)]
pub struct LibrarySpec {
    /// The soname looked up on the normal search path.
    pub soname: &'static str,
    /// The variable that names the file instead.
    pub variable: &'static str,
    /// What to install, for the error message.
    pub expected: &'static str,
    /// Where NVIDIA's wheel puts the library, relative to the folder it is installed into
    /// (`site-packages`, or a `pip install --target` folder).
    pub wheel_dir: &'static str,
}

/// The CUDA runtime: CUDA 13's `libcudart.so.13`.
pub const CUDART: LibrarySpec = LibrarySpec {
    soname: "libcudart.so.13",
    variable: "HANDOFF_CUDART_PATH",
    expected: "the CUDA 13 runtime (libcudart.so.13: a CUDA 13.x toolkit, or \
               `pip install nvidia-cuda-runtime==13.0.96`)",
    wheel_dir: "nvidia/cu13/lib",
};

/// NCCL 2: `libnccl.so.2`.
pub const NCCL: LibrarySpec = LibrarySpec {
    soname: "libnccl.so.2",
    variable: "HANDOFF_NCCL_PATH",
    expected: "NCCL 2.28.3 or newer built for CUDA 13 (libnccl.so.2: the libnccl2 package, or \
               `pip install nvidia-nccl-cu13`)",
    wheel_dir: "nvidia/nccl/lib",
};

/// The folder of NVIDIA's wheels that the crate was built with: the build's `HANDOFF_TOOLS_DIR`
/// (made absolute), by default `.tools/cuda` in handoff's own folder. Searched at run time after
/// the run's own `HANDOFF_TOOLS_DIR`.
pub const BUILD_TOOLS_DIR: &str = env!("HANDOFF_BUILD_TOOLS_DIR");

/// Where the loader looks besides a library's own variable and its soname; see the module
/// documentation for the order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SearchPath {
    /// CUDA installations (`$CUDA_HOME`, `$CUDA_PATH`); `lib64/` and `lib/` under each.
    pub cuda_roots: Vec<PathBuf>,
    /// Folders NVIDIA's wheels were installed into with `pip install --target`.
    pub tools_dirs: Vec<PathBuf>,
    /// Python `site-packages` folders.
    pub site_packages: Vec<PathBuf>,
}

/// The Python installation prefixes searched, in order.
fn python_prefixes() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .into_iter()
        .filter_map(non_empty_var)
        .map(PathBuf::from)
        .collect();
    if let Some(home) = non_empty_var("HOME") {
        out.push(PathBuf::from(home).join(".local"));
    }
    out.push(PathBuf::from("/usr/local"));
    out.push(PathBuf::from("/usr"));
    out
}

fn non_empty_var(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

/// The `site-packages` and `dist-packages` folders of the Pythons installed under `prefix`
/// (`lib/python3.X/site-packages`, `lib/python3.X/dist-packages`, Debian's
/// `lib/python3/dist-packages`), newest Python first. Only folders that exist.
pub fn python_site_dirs(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    // (minor version, folder); Debian's version-less `python3` sorts last.
    let mut pythons: Vec<(i64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let minor = match name.strip_prefix("python3") {
                Some("") => -1,
                Some(rest) => rest.strip_prefix('.')?.parse().ok()?,
                None => return None,
            };
            Some((minor, e.path()))
        })
        .collect();
    pythons.sort_by(|a, b| b.cmp(a));
    pythons
        .into_iter()
        .flat_map(|(_, dir)| [dir.join("site-packages"), dir.join("dist-packages")])
        .filter(|d| d.is_dir())
        .collect()
}

impl SearchPath {
    /// Reads `CUDA_HOME`, `CUDA_PATH`, `HANDOFF_TOOLS_DIR`, `VIRTUAL_ENV`, `CONDA_PREFIX` and
    /// `HOME`, and lists the Python folders that exist.
    pub fn from_env() -> SearchPath {
        let cuda_roots = ["CUDA_HOME", "CUDA_PATH"]
            .into_iter()
            .filter_map(non_empty_var)
            .map(PathBuf::from)
            .collect();
        let mut tools_dirs = Vec::new();
        if let Some(dir) = non_empty_var("HANDOFF_TOOLS_DIR") {
            // A relative folder is the running program's business: relative to its working
            // directory, as every relative path it is given.
            tools_dirs.push(std::path::absolute(&dir).unwrap_or_else(|_| PathBuf::from(dir)));
        }
        let built = PathBuf::from(BUILD_TOOLS_DIR);
        if !tools_dirs.contains(&built) {
            tools_dirs.push(built);
        }
        let site_packages = python_prefixes()
            .iter()
            .flat_map(|p| python_site_dirs(p))
            .collect();
        SearchPath {
            cuda_roots,
            tools_dirs,
            site_packages,
        }
    }
}

impl LibrarySpec {
    /// The files to try, in order, given the value of the library's variable and where else to
    /// look. An empty variable counts as unset.
    pub fn candidates(&self, overridden: Option<OsString>, search: &SearchPath) -> Vec<PathBuf> {
        if let Some(path) = overridden.filter(|p| !p.is_empty()) {
            return vec![PathBuf::from(path)];
        }
        let mut out = vec![PathBuf::from(self.soname)];
        for root in &search.cuda_roots {
            out.push(root.join("lib64").join(self.soname));
            out.push(root.join("lib").join(self.soname));
        }
        out.push(Path::new("/usr/local/cuda/lib64").join(self.soname));
        for dir in search.tools_dirs.iter().chain(&search.site_packages) {
            out.push(dir.join(self.wheel_dir).join(self.soname));
        }
        // The same file reached twice (CUDA_HOME=/usr/local/cuda) is tried once.
        let mut seen = std::collections::HashSet::new();
        out.retain(|p| seen.insert(p.clone()));
        out
    }

    fn candidates_from_env(&self) -> Vec<PathBuf> {
        self.candidates(std::env::var_os(self.variable), &SearchPath::from_env())
    }
}

/// Opens the first candidate that dlopen accepts, then resolves every bound function with
/// `resolve`. Returns the library and the file it came from. Uncached; [`cudart`] and [`nccl`]
/// cache its result.
///
/// A candidate with a `/` is a file, tried only if it exists; a bare name goes through the
/// dynamic linker's search.
///
/// # Errors
/// [`Error::LibraryNotFound`] listing every candidate and why it did not open, or
/// [`Error::LibraryIncompatible`] when the first one that opens fails `resolve`.
///
/// # Safety
/// Opening a shared library runs its initialisers, which may do anything: every candidate must
/// be a library that is sound to load into this process (libcudart and libnccl are; NVIDIA's
/// own loaders dlopen them), and `resolve` must only bind symbols with their true signatures.
pub unsafe fn open_with<L>(
    spec: &LibrarySpec,
    candidates: &[PathBuf],
    resolve: impl FnOnce(libloading::Library) -> Result<L, libloading::Error>,
) -> Result<(L, PathBuf), Error> {
    let mut tried = Vec::new();
    for path in candidates {
        if path.components().count() > 1 && !path.exists() {
            tried.push(format!("{} (no such file)", path.display()));
            continue;
        }
        // SAFETY: the caller vouches that every candidate is sound to load.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => {
                return match resolve(lib) {
                    Ok(l) => Ok((l, path.clone())),
                    Err(e) => Err(Error::LibraryIncompatible {
                        library: spec.soname,
                        path: path.display().to_string(),
                        detail: e.to_string(),
                        expected: spec.expected,
                        variable: spec.variable,
                    }),
                };
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

static CUDART_LIB: OnceCell<Result<(CudartLib, PathBuf), Error>> = OnceCell::new();
static NCCL_LIB: OnceCell<Result<(NcclLib, PathBuf), Error>> = OnceCell::new();

fn load_cudart() -> &'static Result<(CudartLib, PathBuf), Error> {
    CUDART_LIB.get_or_init(|| {
        // SAFETY: the candidates are libcudart.so.13 by name, or the file the user named as
        // such; the symbols are resolved with the signatures bindgen read from CUDA 13.0's
        // cuda_runtime_api.h, the ABI that libcudart.so.13 exports.
        unsafe {
            open_with(&CUDART, &CUDART.candidates_from_env(), |lib| {
                CudartLib::from_library(lib)
            })
        }
    })
}

fn load_nccl() -> &'static Result<(NcclLib, PathBuf), Error> {
    NCCL_LIB.get_or_init(|| {
        // SAFETY: the candidates are libnccl.so.2 by name, or the file the user named as such;
        // the symbols are resolved with the signatures bindgen read from NCCL 2.28.3's nccl.h,
        // every one part of NCCL 2's stable C API.
        let (lib, path) = unsafe {
            open_with(&NCCL, &NCCL.candidates_from_env(), |lib| {
                NcclLib::from_library(lib)
            })
        }?;
        check_nccl_version(&lib, &path)?;
        Ok((lib, path))
    })
}

/// The CUDA runtime, opened at the first call.
///
/// # Errors
/// [`Error::LibraryNotFound`] or [`Error::LibraryIncompatible`]; the same error on every call.
pub fn cudart() -> Result<&'static CudartLib, Error> {
    load_cudart().as_ref().map(|(l, _)| l).map_err(Clone::clone)
}

/// Whether NCCL has been opened in this process (successfully or not): from then on it may have
/// read its environment variables, some of them once per process.
pub fn nccl_opened() -> bool {
    NCCL_LIB.get().is_some()
}

/// The file [`cudart`] opened (the soname alone when the dynamic linker found it).
///
/// # Errors
/// As [`cudart`].
pub fn cudart_path() -> Result<&'static Path, Error> {
    load_cudart()
        .as_ref()
        .map(|(_, p)| p.as_path())
        .map_err(Clone::clone)
}

/// NCCL, opened at the first call.
///
/// # Errors
/// [`Error::LibraryNotFound`] or [`Error::LibraryIncompatible`] (also for an NCCL older than
/// the one the bindings were generated from); the same error on every call.
pub fn nccl() -> Result<&'static NcclLib, Error> {
    load_nccl().as_ref().map(|(l, _)| l).map_err(Clone::clone)
}

/// The file [`nccl`] opened (the soname alone when the dynamic linker found it).
///
/// # Errors
/// As [`nccl`].
pub fn nccl_path() -> Result<&'static Path, Error> {
    load_nccl()
        .as_ref()
        .map(|(_, p)| p.as_path())
        .map_err(Clone::clone)
}

/// What registered memory and windows need, for [`Error::Unsupported`].
pub const REGISTER_NEEDS: &str = "NCCL 2.27 or newer (ncclMemAlloc, ncclMemFree, ncclCommRegister and \
    ncclCommDeregister since 2.19; ncclCommWindowRegister and ncclCommWindowDeregister since 2.27)";

static NCCL_REGISTER_LIB: OnceCell<Result<NcclRegisterLib, Error>> = OnceCell::new();

/// NCCL's functions of registered memory and windows, resolved at the first call from the file
/// [`nccl`] opened.
///
/// # Errors
/// As [`nccl`]; [`Error::Unsupported`] naming the missing function and the version needed when
/// the loaded NCCL lacks one; the same error on every call.
pub fn nccl_register() -> Result<&'static NcclRegisterLib, Error> {
    NCCL_REGISTER_LIB
        .get_or_init(|| {
            let (lib, path) = load_nccl().as_ref().map_err(Clone::clone)?;
            // SAFETY: the file is the NCCL opened above (opening it again returns the same
            // handle); the symbols are resolved with the signatures of NCCL 2.28.3's nccl.h.
            unsafe { open_register(path, nccl_version(lib)) }
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Resolves the registration functions in `path`, whose `ncclGetVersion` said `version`.
///
/// # Errors
/// [`Error::Unsupported`] when `path` cannot be opened or lacks one of the functions.
///
/// # Safety
/// `path` is sound to load (see [`open_with`]), and its symbols of these names have the
/// signatures of NCCL 2.28.3's nccl.h.
pub unsafe fn open_register(path: &Path, version: Option<i32>) -> Result<NcclRegisterLib, Error> {
    let unsupported = |detail: String| Error::Unsupported {
        feature: "registered memory and windows",
        needs: REGISTER_NEEDS,
        loaded: match version {
            Some(v) => format!("{}, version code {v}", path.display()),
            None => path.display().to_string(),
        },
        detail,
    };
    // SAFETY: the caller vouches for the file and the signatures.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| unsupported(e.to_string()))?;
    // SAFETY: as above.
    unsafe { NcclRegisterLib::from_library(lib) }.map_err(|e| unsupported(e.to_string()))
}

/// What NCCL's fp8 element types need, for [`Error::Unsupported`].
pub const FP8_NEEDS: &str = "NCCL 2.24.3 or newer (ncclFloat8e4m3 = 10 and ncclFloat8e5m2 = 11 \
    appeared in 2.24.3's nccl.h; older versions refuse type codes past ncclBfloat16)";

/// The first NCCL version code with fp8 element types: 2.24.3.
pub const FP8_MIN_VERSION: i32 = 22403;

static NCCL_VERSION: OnceCell<Option<i32>> = OnceCell::new();

/// The loaded NCCL's `ncclGetVersion` code (read once), with the file it came from, for
/// capability checks and their messages; `None` when it did not answer.
///
/// # Errors
/// As [`nccl`].
pub fn nccl_version_code() -> Result<(Option<i32>, &'static Path), Error> {
    let (lib, path) = load_nccl().as_ref().map_err(Clone::clone)?;
    Ok((*NCCL_VERSION.get_or_init(|| nccl_version(lib)), path.as_path()))
}

/// `ncclGetVersion`, if it answers.
fn nccl_version(lib: &NcclLib) -> Option<i32> {
    let mut version = 0;
    // SAFETY: ncclGetVersion writes one int through a valid pointer.
    let rc = unsafe { lib.ncclGetVersion(&mut version) };
    (rc.0 == 0).then_some(version)
}

/// The oldest NCCL the crate accepts: the header it is built against, 2.28.3.
pub const MIN_NCCL_VERSION: i32 = 22803;

fn check_nccl_version(lib: &NcclLib, path: &Path) -> Result<(), Error> {
    let mut version = 0;
    // SAFETY: ncclGetVersion writes one int through a valid pointer.
    let rc = unsafe { lib.ncclGetVersion(&mut version) };
    if rc.0 != 0 || version < MIN_NCCL_VERSION {
        return Err(Error::LibraryIncompatible {
            library: NCCL.soname,
            path: path.display().to_string(),
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

    fn search() -> SearchPath {
        SearchPath {
            cuda_roots: vec!["/cuda".into(), "/opt/cuda-path".into()],
            tools_dirs: vec!["/run/tools".into(), "/repo/.tools/cuda".into()],
            site_packages: vec!["/venv/lib/python3.12/site-packages".into()],
        }
    }

    #[test]
    fn override_variable_is_the_only_candidate() {
        let c = CUDART.candidates(Some("/opt/x/libcudart.so.13".into()), &search());
        assert_eq!(c, vec![PathBuf::from("/opt/x/libcudart.so.13")]);
    }

    #[test]
    fn default_candidates_follow_the_documented_order() {
        let c = NCCL.candidates(None, &search());
        let want: Vec<PathBuf> = [
            "libnccl.so.2",
            "/cuda/lib64/libnccl.so.2",
            "/cuda/lib/libnccl.so.2",
            "/opt/cuda-path/lib64/libnccl.so.2",
            "/opt/cuda-path/lib/libnccl.so.2",
            "/usr/local/cuda/lib64/libnccl.so.2",
            "/run/tools/nvidia/nccl/lib/libnccl.so.2",
            "/repo/.tools/cuda/nvidia/nccl/lib/libnccl.so.2",
            "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
        ]
        .into_iter()
        .map(PathBuf::from)
        .collect();
        assert_eq!(c, want);
        // The runtime's wheel folder is CUDA 13's.
        let c = CUDART.candidates(None, &search());
        assert!(c.contains(&PathBuf::from(
            "/repo/.tools/cuda/nvidia/cu13/lib/libcudart.so.13"
        )));
        // An empty variable counts as unset; nothing else set leaves two places.
        assert_eq!(
            NCCL.candidates(Some("".into()), &SearchPath::default()),
            [
                PathBuf::from("libnccl.so.2"),
                PathBuf::from("/usr/local/cuda/lib64/libnccl.so.2")
            ]
        );
        // CUDA_HOME=/usr/local/cuda does not try the same file twice.
        let dup = SearchPath {
            cuda_roots: vec!["/usr/local/cuda".into()],
            ..SearchPath::default()
        };
        assert_eq!(NCCL.candidates(None, &dup).len(), 3);
    }

    #[test]
    fn python_folders_newest_first_only_existing() {
        let root = std::env::temp_dir().join(format!("handoff-loader-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for d in [
            "lib/python3.9/site-packages",
            "lib/python3.11/site-packages",
            "lib/python3.11/dist-packages",
            "lib/python3/dist-packages",
            "lib/python3.10",              // no packages folder
            "lib/python2.7/site-packages", // not Python 3
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let got = python_site_dirs(&root);
        let want: Vec<PathBuf> = [
            "lib/python3.11/site-packages",
            "lib/python3.11/dist-packages",
            "lib/python3.9/site-packages",
            "lib/python3/dist-packages",
        ]
        .into_iter()
        .map(|d| root.join(d))
        .collect();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(got, want);
        assert!(python_site_dirs(Path::new("/nonexistent-prefix")).is_empty());
    }

    #[test]
    fn missing_library_lists_every_file_tried_and_the_variable() {
        let candidates = [
            PathBuf::from("libcudart-handoff-test-none.so.13"),
            PathBuf::from("/nonexistent/libcudart.so.13"),
        ];
        // SAFETY: neither file exists, so nothing is loaded.
        let err = unsafe { open_with(&CUDART, &candidates, |lib| CudartLib::from_library(lib)) }
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::LibraryNotFound { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("could not open libcudart.so.13"), "{msg}");
        assert!(msg.contains("HANDOFF_CUDART_PATH"), "{msg}");
        assert!(
            msg.contains("/nonexistent/libcudart.so.13 (no such file)"),
            "{msg}"
        );
        // The bare name went to the dynamic linker, whose reason is kept.
        assert!(
            msg.contains("libcudart-handoff-test-none.so.13 (") && msg.contains("cannot open"),
            "{msg}"
        );
        assert!(msg.contains("pip install nvidia-cuda-runtime"), "{msg}");
    }

    #[test]
    fn an_nccl_without_registration_is_unsupported_naming_the_version() {
        // libc has no ncclMemAlloc: an NCCL older than 2.19, or built without it.
        // SAFETY: libc is already loaded; resolution fails at the first symbol, nothing is called.
        let err = unsafe { open_register(Path::new("libc.so.6"), Some(21805)) }
            .map(|_| ())
            .unwrap_err();
        let Error::Unsupported {
            needs,
            loaded,
            detail,
            ..
        } = &err
        else {
            panic!("{err:?}");
        };
        assert!(
            needs.contains("2.27") && needs.contains("ncclCommWindowRegister"),
            "{needs}"
        );
        assert!(
            loaded.contains("libc.so.6") && loaded.contains("21805"),
            "{loaded}"
        );
        assert!(detail.contains("ncclMemAlloc"), "{detail}");
        assert!(err.to_string().contains("HANDOFF_NCCL_PATH"), "{err}");
    }

    #[test]
    fn wrong_library_is_incompatible_not_missing() {
        // libc opens fine but has none of NCCL's functions: the same path as an NCCL too old
        // for a function the crate binds.
        // SAFETY: libc is already loaded into every process; resolution fails at the first
        // NCCL symbol and nothing is called.
        let err = unsafe {
            open_with(&NCCL, &[PathBuf::from("libc.so.6")], |lib| {
                NcclLib::from_library(lib)
            })
        }
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
