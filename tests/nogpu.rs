//! On a machine with no usable GPU (CI, a laptop): every entry point returns a typed error and
//! none panics. Reported ignored where a GPU is usable (the GPU tests cover those paths there).
//!
//! Also, wherever they apply, with real files: the loader finds the libraries that
//! `scripts/setup.sh` installed (NVIDIA's wheels), a machine without a driver gets
//! [`Error::NoDriver`], and a missing runtime gets [`Error::LibraryNotFound`] listing every file
//! tried (in a child process, since the runtime is opened once per process).

use std::path::{Path, PathBuf};
use std::process::Command;

use handoff::sys::loader::{self, CUDART, NCCL, SearchPath};
use handoff::{Communicator, Device, Error, UniqueId};
use libtest_mimic::{Arguments, Failed, Trial};

/// Set in the child process of `missing_runtime_is_library_not_found`.
const CHILD: &str = "HANDOFF_NOGPU_CHILD";

fn main() {
    let args = Arguments::from_args();
    if std::env::var_os(CHILD).is_some() {
        let trials = vec![Trial::test("child_missing_runtime", child_missing_runtime)];
        libtest_mimic::run(&args, trials).exit()
    }
    let has_gpu = matches!(Device::count(), Ok(n) if n > 0);
    let trial = |name: &str, f: fn() -> Result<(), Failed>| Trial::test(name, f).with_ignored_flag(has_gpu);
    // The wheels, and no variable that names another file instead.
    let wheels = wheel_files_installed()
        && std::env::var_os(CUDART.variable).is_none()
        && std::env::var_os(NCCL.variable).is_none();
    // "No driver" can be shown for real only where the runtime loads and the driver does not.
    let no_driver = loader::cudart().is_ok() && !driver_loads();
    let trials = vec![
        trial("device_new_is_a_typed_error", device_new),
        trial("unique_id_without_nccl_or_gpu_is_a_typed_error", unique_id),
        trial("communicator_over_no_devices_is_invalid", no_devices),
        Trial::test("loader_opens_the_wheels_setup_installed", loader_opens_wheels)
            .with_ignored_flag(!wheels),
        Trial::test("no_driver_is_reported_as_no_driver", no_driver_error).with_ignored_flag(!no_driver),
        Trial::test("missing_runtime_is_library_not_found", missing_runtime),
    ];
    libtest_mimic::run(&args, trials).exit()
}

fn device_new() -> Result<(), Failed> {
    match Device::new(0) {
        Err(
            e @ (Error::LibraryNotFound { .. }
            | Error::NoDriver { .. }
            | Error::DriverTooOld { .. }
            | Error::NoDevice { .. }
            | Error::Cuda { .. }),
        ) => {
            println!("Device::new(0): {e}");
            Ok(())
        }
        other => Err(format!("Device::new(0) without a GPU gave {other:?}").into()),
    }
}

fn unique_id() -> Result<(), Failed> {
    match UniqueId::new() {
        // NCCL may be installed on a machine without a GPU; then it makes an id.
        Ok(_) => Ok(()),
        Err(e @ (Error::LibraryNotFound { .. } | Error::LibraryIncompatible { .. } | Error::Nccl { .. })) => {
            println!("UniqueId::new(): {e}");
            Ok(())
        }
        Err(other) => Err(format!("UniqueId::new() gave {other:?}").into()),
    }
}

fn no_devices() -> Result<(), Failed> {
    match Communicator::init_all(&[]) {
        Err(Error::InvalidArgument(m)) => {
            println!("init_all(&[]): {m}");
            Ok(())
        }
        other => Err(format!("init_all(&[]) gave {other:?}").into()),
    }
}

/// Where the library's wheel sits in the folder handoff was built with (where
/// `scripts/setup.sh` installs the wheels).
fn wheel_file(spec: &loader::LibrarySpec) -> PathBuf {
    Path::new(loader::BUILD_TOOLS_DIR)
        .join(spec.wheel_dir)
        .join(spec.soname)
}

fn wheel_files_installed() -> bool {
    wheel_file(&CUDART).is_file() && wheel_file(&NCCL).is_file()
}

fn driver_loads() -> bool {
    // SAFETY: libcuda.so.1 is the NVIDIA driver's library, which libcudart loads anyway; if it is
    // there it is sound to load.
    unsafe { libloading::Library::new("libcuda.so.1") }.is_ok()
}

/// With the wheels installed and the variables unset, the loader opens the wheels' files, or a
/// file it tries before them (a system CUDA 13 or NCCL), never nothing.
fn loader_opens_wheels() -> Result<(), Failed> {
    for (spec, opened) in [(CUDART, loader::cudart_path()), (NCCL, loader::nccl_path())] {
        let wheel = wheel_file(&spec);
        let opened = opened.map_err(|e| format!("{} is installed, yet: {e}", wheel.display()))?;
        println!("{} opened from {}", spec.soname, opened.display());
        if opened != wheel {
            // Then something earlier in the documented order must have been found.
            let order = spec.candidates(None, &SearchPath::from_env());
            let pos = |p: &Path| order.iter().position(|c| c == p);
            match (pos(opened), pos(&wheel)) {
                (Some(a), Some(b)) if a < b => {}
                _ => {
                    return Err(format!(
                        "opened {} instead of the wheel's {} (order: {order:?})",
                        opened.display(),
                        wheel.display()
                    )
                    .into());
                }
            }
        }
    }
    Ok(())
}

/// The real thing: the runtime is loaded, `libcuda.so.1` is not. Before issue 13 this said the
/// driver was too old.
fn no_driver_error() -> Result<(), Failed> {
    match Device::count() {
        Err(e @ Error::NoDriver { .. }) => {
            let s = e.to_string();
            println!("Device::count(): {s}");
            if s.contains("older") {
                return Err(format!("the no-driver message talks of an old driver: {s}").into());
            }
        }
        other => return Err(format!("Device::count() without a driver gave {other:?}").into()),
    }
    match Device::new(0) {
        Err(Error::NoDriver { .. }) => Ok(()),
        other => Err(format!("Device::new(0) without a driver gave {other:?}").into()),
    }
}

/// Runs this test binary again with the runtime's variable naming a file that does not exist.
fn missing_runtime() -> Result<(), Failed> {
    let out = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "child_missing_runtime",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env(CUDART.variable, "/nonexistent/handoff-test/libcudart.so.13")
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{text}");
    if !out.status.success() || !text.contains("1 passed") {
        return Err(format!("the child process failed:\n{text}").into());
    }
    Ok(())
}

fn child_missing_runtime() -> Result<(), Failed> {
    match Device::count() {
        Err(e @ Error::LibraryNotFound { .. }) => {
            let s = e.to_string();
            println!("Device::count(): {s}");
            for part in [
                "could not open libcudart.so.13",
                "/nonexistent/handoff-test/libcudart.so.13 (no such file)",
                "HANDOFF_CUDART_PATH",
                "pip install nvidia-cuda-runtime",
            ] {
                if !s.contains(part) {
                    return Err(format!("the message lacks {part:?}: {s}").into());
                }
            }
            Ok(())
        }
        other => Err(format!("Device::count() with the runtime missing gave {other:?}").into()),
    }
}
