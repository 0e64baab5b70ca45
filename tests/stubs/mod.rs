//! Building the stub libraries (the C files beside this one) that the CPU tests load in place
//! of libcudart and libnccl: one builder for every test binary that uses them.

use std::path::{Path, PathBuf};

/// Why a stub could not be built.
pub enum NoStubs {
    /// No C compiler to run.
    NoCompiler(String),
    /// Anything else.
    Failed(String),
}

impl NoStubs {
    /// What went wrong.
    pub fn text(self) -> String {
        match self {
            NoStubs::NoCompiler(e) | NoStubs::Failed(e) => e,
        }
    }
}

/// Compiles `tests/stubs/{c}` into `dir/{so}` with the system's C compiler (`CC`, else `cc`).
/// The sources are found where the crate was built or, for a staged binary run from the
/// repository's root on another machine, under the working directory.
pub fn build(dir: &Path, c: &str, so: &str) -> Result<PathBuf, NoStubs> {
    build_with(dir, c, so, &[])
}

/// [`build`] with `extra` arguments for the compiler (a soname).
pub fn build_with(dir: &Path, c: &str, so: &str, extra: &[&str]) -> Result<PathBuf, NoStubs> {
    let src = [Path::new(env!("CARGO_MANIFEST_DIR")), Path::new(".")]
        .iter()
        .map(|root| root.join("tests/stubs"))
        .find(|d| d.join(c).is_file())
        .ok_or_else(|| NoStubs::Failed(format!("tests/stubs/{c} not found")))?;
    std::fs::create_dir_all(dir).map_err(|e| NoStubs::Failed(format!("{}: {e}", dir.display())))?;
    let target = dir.join(so);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-pthread", "-I"])
        .arg(&src)
        .arg("-o")
        .arg(&target)
        .arg(src.join(c))
        .args(extra)
        .arg("-ldl")
        .status()
        .map_err(|e| NoStubs::NoCompiler(format!("could not run the C compiler {cc:?} (set CC): {e}")))?;
    if !status.success() {
        return Err(NoStubs::Failed(format!("{cc} failed to build {c}: {status}")));
    }
    Ok(target)
}

/// The stub runtime and the stub NCCL `nccl_c` built into a folder of this process's, named
/// after `binary`: `(folder, libcudart.so.13, libnccl.so.2)`. `None`, having said why, on the GPU
/// machine (`HANDOFF_REQUIRE_GPUS` set) without a C compiler: its runs need none, CI has one.
///
/// # Panics
/// When they cannot be built otherwise.
#[allow(dead_code)] // Not every test binary that builds stubs builds this pair.
pub fn build_pair(binary: &str, nccl_c: &str) -> Option<(PathBuf, PathBuf, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("handoff-{binary}-{}", std::process::id()));
    let built = (|| {
        Ok::<_, NoStubs>((
            build(&dir, "cudart.c", "libcudart.so.13")?,
            build(&dir, nccl_c, "libnccl.so.2")?,
        ))
    })();
    match built {
        Ok((cudart, nccl)) => Some((dir, cudart, nccl)),
        Err(NoStubs::NoCompiler(e)) if std::env::var_os("HANDOFF_REQUIRE_GPUS").is_some() => {
            println!("{binary}: not run here: {e}");
            None
        }
        Err(e) => panic!("the stub libraries could not be built: {}", e.text()),
    }
}

/// [`build_pair`], then points this process at the pair (`HANDOFF_CUDART_PATH`,
/// `HANDOFF_NCCL_PATH`), for a test binary whose trials all run on the stubs.
///
/// # Safety
/// As [`std::env::set_var`]: no other thread exists yet, and nothing reads the environment
/// meanwhile.
#[allow(dead_code)] // Not every test binary that builds stubs runs on them itself.
pub unsafe fn install_pair(binary: &str, nccl_c: &str) -> Option<(PathBuf, PathBuf, PathBuf)> {
    let (dir, cudart, nccl) = build_pair(binary, nccl_c)?;
    // SAFETY: the caller's promise.
    unsafe {
        std::env::set_var("HANDOFF_CUDART_PATH", &cudart);
        std::env::set_var("HANDOFF_NCCL_PATH", &nccl);
    }
    Some((dir, cudart, nccl))
}

/// The stub driver (`cuda.c`) built into `dir` as `libcuda.so`, with that soname, and opened for
/// the rest of the process: cudarc opens `libcuda.so` by name, and the dynamic linker then finds
/// this one, already loaded under it. It calls the stub runtime that `HANDOFF_CUDART_PATH` names.
#[allow(dead_code)] // Only the cudarc stub test loads a driver.
pub fn preload_driver(dir: &Path) -> Result<PathBuf, NoStubs> {
    let path = build_with(dir, "cuda.c", "libcuda.so", &["-Wl,-soname,libcuda.so"])?;
    // SAFETY: a stub library built above: plain C with no initialisers. It stays loaded
    // (leaked) for cudarc to find.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| NoStubs::Failed(format!("{}: {e}", path.display())))?;
    std::mem::forget(lib);
    Ok(path)
}

/// Calls `void name(int)` in the stub library at `lib` (one of the stubs' setters), leaving the
/// library loaded: the crate's own opening of it then finds the same statics.
#[allow(dead_code)] // Not every test binary that builds stubs sets them this way.
pub fn set(lib: &Path, name: &[u8], v: i32) -> Result<(), String> {
    // SAFETY: a stub library built by `build`: plain C with no initialisers; `name` is one of
    // its `void f(int)` setters. The library stays loaded (leaked), so the symbol stays valid.
    unsafe {
        let lib = Box::leak(Box::new(
            libloading::Library::new(lib).map_err(|e| e.to_string())?,
        ));
        let f: libloading::Symbol<unsafe extern "C" fn(i32)> = lib.get(name).map_err(|e| e.to_string())?;
        f(v);
    }
    Ok(())
}

/// The stub library at `lib`'s count of calls of `name`: this thread's, or (`all`) every
/// thread's (`long <prefix>_stub_count(const char *, int)`; `prefix`: `cudart` or `nccl`).
#[allow(dead_code)] // Not every test binary counts.
pub fn count(lib: &Path, prefix: &str, name: &str, all: bool) -> i64 {
    let sym = format!("{prefix}_stub_count\0");
    let name = std::ffi::CString::new(name).expect("a name without NUL");
    // SAFETY: a stub library built by `build`, loaded by `set` before (so the same statics);
    // `long count(const char *name, int all)`. The library stays loaded (leaked).
    unsafe {
        let lib = Box::leak(Box::new(libloading::Library::new(lib).expect("the stub loads")));
        let f: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i64> =
            lib.get(sym.as_bytes()).expect("the stub counts");
        f(name.as_ptr(), i32::from(all))
    }
}

/// The child's side of [`run_child`]: when `role` is set, runs `body` and exits with its
/// outcome (its error on standard error, for the parent to report); otherwise returns.
#[allow(dead_code)] // Not every test binary that builds stubs runs a child.
pub fn child_main(role: &str, body: impl FnOnce() -> Result<(), String>) {
    if std::env::var_os(role).is_none() {
        return;
    }
    match body() {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}

/// Runs this test binary again as a child process with the stub libraries `cudart` and `nccl`
/// and `role` set in its environment (the child's `main` looks for it), and fails with its
/// standard error unless it succeeds: for a run whose libraries must differ from the parent's
/// (the crate opens its libraries once per process).
#[allow(dead_code)] // Not every test binary that builds stubs runs a child.
pub fn run_child(role: &str, cudart: &Path, nccl: &Path) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(exe)
        .env(role, "1")
        .env("HANDOFF_CUDART_PATH", cudart)
        .env("HANDOFF_NCCL_PATH", nccl)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "the child failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Ranks of one verified communicator as threads of this process, on the stub pair (the stub
/// NCCL gathering between them, `nccl_stub_set_gather`): rank `r` makes its communicator (with
/// `timeout`) on device `r` and a stream, `make`s what its trials need from them, then all
/// meet at a barrier and run `body(rank, &made, &barrier)`. The first rank's error, if any.
#[allow(dead_code)] // Only the binaries whose ranks are threads use it.
pub fn rank_threads<T: 'static>(
    world: usize,
    timeout: std::time::Duration,
    make: impl Fn(usize, handoff::Communicator, handoff::Stream) -> handoff::Result<T> + Send + Sync + 'static,
    body: impl Fn(usize, &T, &std::sync::Barrier) -> Result<(), String> + Send + Sync + 'static,
) -> Result<(), String> {
    use std::sync::{Arc, Barrier};
    let id = handoff::UniqueId::new().map_err(|e| e.to_string())?;
    let (make, body) = (Arc::new(make), Arc::new(body));
    let barrier = Arc::new(Barrier::new(world));
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            let (id, make, body, barrier) = (id.clone(), make.clone(), body.clone(), barrier.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let e = |e: handoff::Error| format!("rank {rank}: {e}");
                let device = handoff::Device::new(rank).map_err(e)?;
                let options = handoff::CommOptions::default().with_timeout(timeout);
                let comm =
                    handoff::Communicator::with_options(world, rank, &id, options, &device).map_err(e)?;
                let stream = handoff::Stream::new(&device).map_err(e)?;
                let made = make(rank, comm, stream).map_err(e)?;
                barrier.wait();
                body(rank, &made, &barrier).map_err(|m| format!("rank {rank}: {m}"))
            })
        })
        .collect();
    for (rank, t) in ranks.into_iter().enumerate() {
        t.join().map_err(|_| format!("rank {rank} panicked"))??;
    }
    Ok(())
}

/// [`install_pair`], with the stub runtime showing two devices and the stub NCCL gathering
/// between the ranks of a communicator ([`rank_threads`]' ranks, or ranks made one by one).
///
/// # Safety
/// As [`install_pair`].
#[allow(dead_code)] // Only the binaries whose ranks are threads use it.
pub unsafe fn install_gathering_pair(binary: &str) -> Option<(PathBuf, PathBuf, PathBuf)> {
    // SAFETY: the caller's promise.
    let (dir, cudart, nccl) = unsafe { install_pair(binary, "nccl.c") }?;
    set(&cudart, b"cudart_stub_set_devices\0", 2).expect("stub runtime");
    set(&nccl, b"nccl_stub_set_gather\0", 1).expect("stub NCCL");
    Some((dir, cudart, nccl))
}
