//! [`Device`]'s public face: how many GPUs there are, opening one, its name, waiting for it. The
//! type and the state its streams and buffers share are the engine's (`src/engine`). A failure
//! to find a GPU says which of "no driver", "driver too old" and "no such device" it is.

use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::cudaError_t;

pub use crate::engine::device::Device;

impl Device {
    /// How many CUDA devices this process can see. A machine with a driver but no GPU gives 0.
    ///
    /// # Errors
    /// - [`Error::LibraryNotFound`] or [`Error::LibraryIncompatible`]: the CUDA runtime cannot be
    ///   loaded;
    /// - [`Error::NoDriver`]: no NVIDIA driver is installed (or only the toolkit's stub of it);
    /// - [`Error::DriverTooOld`]: the driver is older than the runtime;
    /// - [`Error::Cuda`] for anything else.
    pub fn count() -> Result<usize> {
        match cu::device_count() {
            Ok(n) => Ok(n.max(0) as usize),
            // The versions are asked only on failure: they tell the driver cases apart.
            Err(e) => classify_count_error(e, cu::driver_version(), cu::runtime_version()),
        }
    }

    /// Opens device `ordinal` and makes it current on this thread.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when `ordinal` is not below [`Device::count`]; the errors of
    /// [`Device::count`]; CUDA errors otherwise.
    pub fn new(ordinal: usize) -> Result<Device> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(Error::NoDevice {
                reason: no_device_reason(ordinal, count, std::env::var("CUDA_VISIBLE_DEVICES").ok()),
            });
        }
        Device::open(ordinal as i32)
    }

    /// The device's name, e.g. `NVIDIA H200`.
    ///
    /// # Errors
    /// CUDA errors.
    pub fn name(&self) -> Result<String> {
        cu::device_name(self.inner.ordinal)
    }

    /// Blocks until all work on this device has completed (`cudaDeviceSynchronize`).
    ///
    /// # Errors
    /// CUDA errors, including the sticky error of a kernel that faulted.
    pub fn synchronize(&self) -> Result<()> {
        self.set_current()?;
        cu::device_synchronize()
    }
}

/// What a failed `cudaGetDeviceCount` means, given `cudaDriverGetVersion` and
/// `cudaRuntimeGetVersion` asked afterwards. The runtime reports both "no driver" and "driver
/// too old" as `cudaErrorInsufficientDriver`; the driver version tells them apart: it is 0 when
/// `libcuda.so.1` cannot be loaded, as NVIDIA's documentation of `cudaDriverGetVersion` says and
/// CUDA 13.0's libcudart does on a machine without a driver.
fn classify_count_error(err: Error, driver: Result<i32>, runtime: Result<i32>) -> Result<usize> {
    let Error::Cuda { code, .. } = &err else {
        return Err(err);
    };
    let code = *code;
    if code == cudaError_t::cudaErrorNoDevice.0 as i32 {
        // A driver but no GPU (or none visible): zero devices, not an error.
        return Ok(0);
    }
    if code == cudaError_t::cudaErrorStubLibrary.0 as i32 {
        return Err(Error::NoDriver {
            detail: "the libcuda.so.1 found is the CUDA toolkit's stub library (lib64/stubs), \
                     which only serves linking; take its folder off LD_LIBRARY_PATH"
                .into(),
        });
    }
    if code != cudaError_t::cudaErrorInsufficientDriver.0 as i32 {
        return Err(err);
    }
    match (driver, runtime) {
        (Ok(0), _) => Err(Error::NoDriver {
            detail: "cudaGetDeviceCount returned cudaErrorInsufficientDriver (35) and \
                     cudaDriverGetVersion reports no driver: libcuda.so.1, which the NVIDIA \
                     driver installs, cannot be loaded"
                .into(),
        }),
        (Ok(driver), Ok(runtime)) if driver < runtime => Err(Error::DriverTooOld { driver, runtime }),
        // A driver at least as new as the runtime that still says "insufficient": leave the
        // runtime's own error, with its hint.
        _ => Err(err),
    }
}

/// The reason of [`Error::NoDevice`] when `ordinal` is not below `count`.
fn no_device_reason(ordinal: usize, count: usize, visible: Option<String>) -> String {
    let sees = match count {
        0 => "this process sees no GPU (the driver is installed)".to_string(),
        n => format!("this process sees {n} (ordinals 0 to {})", n - 1),
    };
    let visible = match visible {
        Some(v) => format!("; CUDA_VISIBLE_DEVICES={v:?}"),
        None => String::new(),
    };
    format!("device {ordinal} was asked for, but {sees}{visible}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(code: cudaError_t) -> Error {
        Error::Cuda {
            call: "cudaGetDeviceCount",
            code: code.0 as i32,
            name: String::new(),
            message: String::new(),
        }
    }

    fn no_versions() -> Result<i32> {
        Err(Error::InvalidArgument("not asked".into()))
    }

    #[test]
    fn no_driver_is_its_own_error() {
        let e = classify_count_error(cuda(cudaError_t::cudaErrorInsufficientDriver), Ok(0), Ok(13000))
            .unwrap_err();
        assert!(matches!(e, Error::NoDriver { .. }), "{e:?}");
        let s = e.to_string();
        assert!(s.starts_with("no NVIDIA driver found"), "{s}");
        assert!(
            s.contains("libcuda.so.1") && s.contains("driver (580 or newer"),
            "{s}"
        );
        assert!(!s.contains("older"), "no driver is not an old driver: {s}");
        // The toolkit's stub in place of the driver is no driver either.
        let e = classify_count_error(
            cuda(cudaError_t::cudaErrorStubLibrary),
            no_versions(),
            no_versions(),
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::NoDriver { detail } if detail.contains("stub")),
            "{e:?}"
        );
    }

    #[test]
    fn old_driver_names_both_versions() {
        let e = classify_count_error(
            cuda(cudaError_t::cudaErrorInsufficientDriver),
            Ok(12080),
            Ok(13000),
        )
        .unwrap_err();
        assert_eq!(
            e,
            Error::DriverTooOld {
                driver: 12080,
                runtime: 13000
            }
        );
        let s = e.to_string();
        assert!(
            s.starts_with("the NVIDIA driver supports CUDA up to 12.8 but the CUDA runtime loaded is 13.0"),
            "{s}"
        );
        assert!(s.contains("install driver 580 or newer"), "{s}");
    }

    #[test]
    fn no_gpu_is_zero_devices_then_no_device() {
        assert_eq!(
            classify_count_error(cuda(cudaError_t::cudaErrorNoDevice), no_versions(), no_versions()),
            Ok(0)
        );
        let e = Error::NoDevice {
            reason: no_device_reason(0, 0, Some("".into())),
        };
        let s = e.to_string();
        assert!(
            s.starts_with("no usable CUDA device: device 0 was asked for, but this process sees no GPU"),
            "{s}"
        );
        assert!(s.contains("CUDA_VISIBLE_DEVICES=\"\""), "{s}");
        assert!(s.contains("nvidia-smi"), "{s}");
        assert!(!s.contains("driver 580"), "a GPU is missing, not a driver: {s}");
        assert_eq!(
            no_device_reason(2, 2, None),
            "device 2 was asked for, but this process sees 2 (ordinals 0 to 1)"
        );
    }

    #[test]
    fn missing_runtime_is_passed_through() {
        // The fourth case: the library itself is missing. The loader makes the error (its own
        // tests cover the message); classification must not turn it into a driver error.
        let missing = Error::LibraryNotFound {
            library: "libcudart.so.13",
            variable: "HANDOFF_CUDART_PATH",
            expected: "the CUDA 13 runtime",
            tried: "libcudart.so.13 (not found)".into(),
        };
        assert_eq!(
            classify_count_error(missing.clone(), no_versions(), no_versions()),
            Err(missing)
        );
        // Other CUDA errors keep their code, and a driver that is new enough keeps code 35.
        let other = cuda(cudaError_t::cudaErrorUnknown);
        assert_eq!(
            classify_count_error(other.clone(), Ok(13000), Ok(13000)),
            Err(other)
        );
        let odd = cuda(cudaError_t::cudaErrorInsufficientDriver);
        assert_eq!(classify_count_error(odd.clone(), Ok(13000), Ok(13000)), Err(odd));
    }
}
