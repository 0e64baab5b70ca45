//! The crate's one error type: every fallible call of the crate returns [`Error`], each variant
//! saying what failed and what to do, with the raw status code or the cause kept.

/// Everything that can go wrong in handoff. Each variant says what failed and what to do.
///
/// The raw status codes stay reachable (`code` fields) for callers who match on them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shared library could not be opened at all.
    #[error(
        "could not open {library}; tried: {tried}. Install {expected}, or set {variable} to the \
         full path of the file, or leave it unset and set HANDOFF_TOOLS_DIR to the folder \
         NVIDIA's wheels were installed into (pip install --target)"
    )]
    LibraryNotFound {
        /// The library's soname, e.g. `libcudart.so.13`.
        library: &'static str,
        /// The variable that names the file instead of the search path.
        variable: &'static str,
        /// What to install.
        expected: &'static str,
        /// Each file tried, with the loader's reason.
        tried: String,
    },

    /// A shared library opened but is not one the crate can use (a function is missing or its
    /// version is too old).
    #[error(
        "{path} opened but is not a usable {library}: {detail}. Install {expected}, or set \
         {variable} to a compatible file"
    )]
    LibraryIncompatible {
        /// The library's soname.
        library: &'static str,
        /// The file that was opened.
        path: String,
        /// What is wrong with it.
        detail: String,
        /// What to install.
        expected: &'static str,
        /// The variable that names the file to use.
        variable: &'static str,
    },

    /// A CUDA runtime call returned an error.
    #[error("{call} failed with {name} ({code}): {message}{}", cuda_hint(*.code))]
    Cuda {
        /// The runtime function, e.g. `cudaMallocAsync`.
        call: &'static str,
        /// The raw `cudaError_t`.
        code: i32,
        /// `cudaGetErrorName`, e.g. `cudaErrorMemoryAllocation`.
        name: String,
        /// `cudaGetErrorString`.
        message: String,
    },

    /// An NCCL call returned an error.
    #[error("{call} failed with {name} ({code}): {last_error}{}", nccl_hint(*.code))]
    Nccl {
        /// The NCCL function, e.g. `ncclSend`.
        call: &'static str,
        /// The raw `ncclResult_t`.
        code: i32,
        /// `ncclGetErrorString`.
        name: String,
        /// `ncclGetLastError`: NCCL's own account of the failure (empty if it had none).
        last_error: String,
    },

    /// The driver is there but no GPU can be used, or not the one asked for.
    #[error(
        "no usable CUDA device: {reason}. Check that `nvidia-smi` lists the GPU and that \
         CUDA_VISIBLE_DEVICES, if set, names it"
    )]
    NoDevice {
        /// Why none is usable.
        reason: String,
    },

    /// No NVIDIA driver is installed (`libcuda.so.1` cannot be loaded), or the one found is the
    /// CUDA toolkit's stub of it. [`Device::count`](crate::Device::count) tells this apart from
    /// [`Error::DriverTooOld`]; both come from `cudaErrorInsufficientDriver`.
    #[error(
        "no NVIDIA driver found: {detail}. Install the NVIDIA driver (580 or newer for CUDA 13) \
         on a machine with an NVIDIA GPU, or, in a container, start it with the GPUs and the \
         driver passed in (`docker run --gpus all` with the NVIDIA Container Toolkit); \
         `nvidia-smi` works once the driver is there"
    )]
    NoDriver {
        /// What was observed.
        detail: String,
    },

    /// The installed driver is older than the CUDA runtime that was loaded.
    #[error(
        "the NVIDIA driver supports CUDA up to {}.{} but the CUDA runtime loaded is {}.{}: \
         install driver 580 or newer (CUDA 13.0) or, on a data-centre GPU, NVIDIA's CUDA \
         forward-compatibility package (cuda-compat-13-0)",
        .driver / 1000, .driver % 1000 / 10, .runtime / 1000, .runtime % 1000 / 10
    )]
    DriverTooOld {
        /// `cudaDriverGetVersion`, e.g. `12080` for 12.8.
        driver: i32,
        /// `cudaRuntimeGetVersion`, e.g. `13000` for 13.0.
        runtime: i32,
    },

    /// A host-side wait passed its deadline: a peer that never came, an operation that never
    /// matched, a finalize that never completed. A communicator is aborted before this is
    /// returned.
    #[error(
        "{what} did not complete within {after:?}: a peer may have died, never started, or \
         posted a different operation; check that every rank runs and that their sends and \
         receives match, or raise the timeout"
    )]
    Timeout {
        /// What was waited for.
        what: String,
        /// The timeout that passed.
        after: std::time::Duration,
    },

    /// The communicator was aborted (explicitly, or after an error or a timeout), or is
    /// otherwise unusable; every later call on it returns this.
    #[error("the communicator is unusable: {reason}. Create a new one (all ranks must)")]
    CommunicatorUnusable {
        /// Why: the error that broke it, or an explicit abort.
        reason: String,
    },

    /// Verification found that a send and its receive disagree (count or type, in the order
    /// posted). Both ranks return this, and neither transferred anything; the communicators are
    /// aborted, as what each published can no longer be matched in order.
    #[error(
        "send/receive mismatch: {detail}. Both ranks must post matching sends and receives \
         (same peer, element count and type, in the same order); nothing was transferred"
    )]
    Mismatch {
        /// Both sides' values.
        detail: String,
    },

    /// A rank's peer broke its communicator (an error, a missed deadline, an abort) while this
    /// rank waited to verify an operation with it. This rank's communicator is aborted too.
    #[error(
        "rank {peer}'s communicator broke (an error, a timeout or an abort there) while this rank          waited to verify an operation with it; this communicator is aborted too. Create new          communicators on every rank"
    )]
    PeerBroken {
        /// The peer's rank.
        peer: usize,
    },

    /// Setting up a communicator's verification failed: the ranks disagree on it, or cannot
    /// reach each other's mailboxes. Every rank gets this; the communicator is aborted.
    #[error("setting up the communicator failed: {detail}")]
    Setup {
        /// What went wrong, and what to do.
        detail: String,
    },

    /// A module (PTX, cubin or fatbin) could not be loaded.
    #[error(
        "loading the module {module} failed: {source}. Check that the PTX comes from an nvcc or NVRTC no newer than the driver, and for the devices in use"
    )]
    Module {
        /// Where the module came from.
        module: String,
        /// The runtime's error.
        #[source]
        source: Box<Error>,
    },

    /// A module has no kernel of the name asked for.
    #[error(
        "the module {module} has no kernel named {name:?}: check the name (declare the kernel \
         extern \"C\" to keep it unmangled) against the module's .entry lines"
    )]
    FunctionNotFound {
        /// Where the module came from.
        module: String,
        /// The name asked for.
        name: String,
    },

    /// A launch's grid, blocks or shared memory are beyond CUDA's or the kernel's limits.
    #[error("cannot launch {kernel}: {detail}")]
    LaunchConfig {
        /// The kernel.
        kernel: String,
        /// What is beyond which limit.
        detail: String,
    },

    /// A cudarc call failed (feature `cudarc`).
    #[cfg(feature = "cudarc")]
    #[error("{call} failed in cudarc ({code}): {message}")]
    Cudarc {
        /// What was called.
        call: &'static str,
        /// The raw `CUresult`.
        code: i32,
        /// cudarc's message.
        message: String,
    },

    /// Exchanging the unique id between processes failed.
    #[error("bootstrap at {addr} failed: {detail}")]
    Bootstrap {
        /// The address served or contacted (MASTER_ADDR:MASTER_PORT).
        addr: String,
        /// What went wrong, and what to do.
        detail: String,
    },

    /// An operation that cannot take part in a CUDA graph capture: on a stream someone else is
    /// capturing, or of a kind a handoff graph cannot hold. Nothing was queued.
    #[error("graph capture: {detail}")]
    Capture {
        /// What was refused, and what to do instead.
        detail: String,
    },

    /// An argument was rejected before any CUDA or NCCL call was made.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The loaded NCCL lacks a feature (an older NCCL, or a build without it); nothing was done.
    #[error(
        "{feature} needs {needs}, which the loaded NCCL ({loaded}) lacks: {detail}. Install a \
         newer NCCL, or set HANDOFF_NCCL_PATH to one"
    )]
    Unsupported {
        /// What was asked for.
        feature: &'static str,
        /// The NCCL version (and functions) it needs.
        needs: &'static str,
        /// The loaded library: its file and `ncclGetVersion`.
        loaded: String,
        /// What is missing.
        detail: String,
    },

    /// The unique-id exchange ran out of time: rank 0's server saw not every rank fetch the id,
    /// or a rank fetching it got no answer it could use from rank 0.
    #[error("bootstrap at {addr} timed out after {after:?}: {detail}")]
    BootstrapTimeout {
        /// The address served or contacted (MASTER_ADDR:MASTER_PORT).
        addr: String,
        /// What was missing and what the exchange saw, and what to do.
        detail: String,
        /// The deadline that passed.
        after: std::time::Duration,
    },

    /// The unique-id exchange's authentication failed: one side holds a shared secret and the
    /// other none, or the two hold different ones. Nothing about the id was sent or trusted.
    #[error("bootstrap at {addr}: authentication failed: {detail}")]
    BootstrapAuth {
        /// The address served or contacted (MASTER_ADDR:MASTER_PORT).
        addr: String,
        /// Which side lacks the secret or that they differ, and what to set.
        detail: String,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn cuda_hint(code: i32) -> &'static str {
    match code {
        2 => ". The GPU is out of memory: free buffers or use smaller ones",
        34 => {
            ". libcuda.so.1 is the CUDA toolkit's stub, not a driver: take the `stubs` folder off \
               LD_LIBRARY_PATH and install the NVIDIA driver"
        }
        35 => {
            ". No NVIDIA driver was found, or it is older than the CUDA runtime (Device::count \
               says which): check `nvidia-smi`; CUDA 13 needs driver 580 or newer"
        }
        100 => ". No GPU is visible: check nvidia-smi and CUDA_VISIBLE_DEVICES",
        101 => ". The device ordinal is out of range: see Device::count()",
        222 => ". The PTX is newer than the driver accepts: build with an nvcc no newer than the driver",
        803 => {
            ". The NVIDIA kernel module and libcuda.so.1 are different versions: reboot after a \
                driver update, or reinstall the driver"
        }
        _ => "",
    }
}

fn nccl_hint(code: i32) -> &'static str {
    match code {
        1 => ". A CUDA call inside NCCL failed: check the device and its memory",
        2 => ". NCCL hit a system error (sockets, shared memory): NCCL_DEBUG=WARN shows more",
        3 => ". NCCL's internal check failed: set NCCL_DEBUG=WARN and report it",
        4 => ". An argument NCCL received was invalid",
        5 => ". NCCL was used wrongly (e.g. calls out of order, or two ranks on one GPU)",
        6 => ". A remote rank failed or disconnected",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_error_names_the_call_code_and_remedy() {
        let e = Error::Cuda {
            call: "cudaMallocAsync",
            code: 2,
            name: "cudaErrorMemoryAllocation".into(),
            message: "out of memory".into(),
        };
        let s = e.to_string();
        assert!(
            s.starts_with("cudaMallocAsync failed with cudaErrorMemoryAllocation (2): out of memory"),
            "{s}"
        );
        assert!(s.contains("free buffers"), "{s}");
    }

    #[test]
    fn timeout_names_what_and_how_long_in_one_clean_sentence() {
        let e = Error::Timeout {
            what: "fetching the id".into(),
            after: std::time::Duration::from_secs(3),
        };
        let s = e.to_string();
        assert!(
            s.starts_with("fetching the id did not complete within 3s: a peer may have died"),
            "{s}"
        );
        assert!(!s.contains("  "), "no runs of spaces: {s}");
    }

    #[test]
    fn nccl_error_carries_last_error_text() {
        let e = Error::Nccl {
            call: "ncclCommInitRank",
            code: 5,
            name: "invalid usage".into(),
            last_error: "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0".into(),
        };
        let s = e.to_string();
        assert!(
            s.contains("ncclCommInitRank failed with invalid usage (5)"),
            "{s}"
        );
        assert!(s.contains("Duplicate GPU detected"), "{s}");
    }
}
