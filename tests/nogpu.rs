//! On a machine with no usable GPU (CI, a laptop): every entry point returns a typed error and
//! none panics. Reported ignored where a GPU is usable (the GPU tests cover those paths there).

use handoff::{Communicator, Device, Error, UniqueId};
use libtest_mimic::{Arguments, Failed, Trial};

fn main() {
    let args = Arguments::from_args();
    let has_gpu = matches!(Device::count(), Ok(n) if n > 0);
    let trial = |name: &str, f: fn() -> Result<(), Failed>| Trial::test(name, f).with_ignored_flag(has_gpu);
    let trials = vec![
        trial("device_new_is_a_typed_error", device_new),
        trial("unique_id_without_nccl_or_gpu_is_a_typed_error", unique_id),
        trial("communicator_over_no_devices_is_invalid", no_devices),
    ];
    libtest_mimic::run(&args, trials).exit()
}

fn device_new() -> Result<(), Failed> {
    match Device::new(0) {
        Err(e @ (Error::LibraryNotFound { .. } | Error::NoDevice { .. } | Error::Cuda { .. })) => {
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
