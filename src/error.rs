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
    #[error("{call} failed with {name} ({code}){}{}", detail(.message), cuda_hint(*.code))]
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
    #[error("{call} failed with {name} ({code}){}{}", detail(.last_error), nccl_hint(*.code))]
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
        "rank {peer}'s communicator broke (an error, a timeout or an abort there) while this rank \
         waited to verify an operation with it; this communicator is aborted too. Create new \
         communicators on every rank"
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
        "loading the module {module} failed: {source}. Check that the PTX comes from an nvcc or \
         NVRTC no newer than the driver, and for the devices in use"
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

    /// Ranks of a job that [`spawn_local`](crate::nccl::bootstrap::spawn_local) started failed
    /// ([`JobExit::check`](crate::nccl::bootstrap::JobExit::check)): they exited
    /// unsuccessfully, were killed by a signal, or (with `after`) were still running at the
    /// deadline of [`LocalJob::wait_timeout`](crate::nccl::bootstrap::LocalJob::wait_timeout)
    /// and were killed then. Each rank's status and output are in the `JobExit`.
    #[error("{detail}")]
    RanksFailed {
        /// The ranks that failed or were killed, in rank order.
        ranks: Vec<usize>,
        /// How each of them ended.
        detail: String,
        /// The deadline that passed, when the ranks were killed for running past it.
        after: Option<std::time::Duration>,
    },
}

/// What kind of failure an [`Error`] is: one kind per family of variants, for a program to act
/// on (retry, recreate the communicators, report a setup problem) without matching every
/// variant or reading the message. As [`std::io::ErrorKind`], new kinds may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A shared library (CUDA runtime, NCCL) cannot be found: [`Error::LibraryNotFound`].
    LibraryMissing,
    /// A shared library was found but cannot be used: [`Error::LibraryIncompatible`].
    LibraryIncompatible,
    /// No NVIDIA driver, or one too old for the CUDA runtime: [`Error::NoDriver`],
    /// [`Error::DriverTooOld`].
    Driver,
    /// No usable GPU, or not the one asked for: [`Error::NoDevice`].
    NoDevice,
    /// A CUDA runtime call failed: [`Error::Cuda`].
    Cuda,
    /// An NCCL call failed: [`Error::Nccl`].
    Nccl,
    /// A cudarc call failed: `Error::Cudarc` (feature `cudarc`).
    Cudarc,
    /// A deadline passed: [`Error::Timeout`], [`Error::BootstrapTimeout`], and
    /// [`Error::RanksFailed`] with `after` set.
    Timeout,
    /// A send and its receive, or the ranks' collectives, disagree: [`Error::Mismatch`].
    Mismatch,
    /// A peer's communicator broke while this rank waited for it: [`Error::PeerBroken`].
    PeerBroken,
    /// The communicator was aborted earlier: [`Error::CommunicatorUnusable`].
    CommunicatorUnusable,
    /// Setting up a communicator's verification failed: [`Error::Setup`].
    Setup,
    /// Exchanging the unique id failed: [`Error::Bootstrap`].
    Bootstrap,
    /// The unique-id exchange's shared secrets differ or one is missing:
    /// [`Error::BootstrapAuth`].
    Authentication,
    /// A module could not be loaded, or lacks the kernel asked for: [`Error::Module`],
    /// [`Error::FunctionNotFound`].
    Module,
    /// A launch's configuration is beyond the limits: [`Error::LaunchConfig`].
    LaunchConfig,
    /// An argument was rejected: [`Error::InvalidArgument`].
    InvalidArgument,
    /// The loaded NCCL lacks a feature: [`Error::Unsupported`].
    Unsupported,
    /// An operation cannot take part in a graph capture: [`Error::Capture`].
    Capture,
    /// Ranks of a local job failed or were killed: [`Error::RanksFailed`] without `after`.
    RanksFailed,
}

impl Error {
    /// The kind of failure, for a program to act on; see [`ErrorKind`].
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::LibraryNotFound { .. } => ErrorKind::LibraryMissing,
            Error::LibraryIncompatible { .. } => ErrorKind::LibraryIncompatible,
            Error::Cuda { .. } => ErrorKind::Cuda,
            Error::Nccl { .. } => ErrorKind::Nccl,
            Error::NoDevice { .. } => ErrorKind::NoDevice,
            Error::NoDriver { .. } | Error::DriverTooOld { .. } => ErrorKind::Driver,
            Error::Timeout { .. } | Error::BootstrapTimeout { .. } => ErrorKind::Timeout,
            Error::CommunicatorUnusable { .. } => ErrorKind::CommunicatorUnusable,
            Error::Mismatch { .. } => ErrorKind::Mismatch,
            Error::PeerBroken { .. } => ErrorKind::PeerBroken,
            Error::Setup { .. } => ErrorKind::Setup,
            Error::Module { .. } | Error::FunctionNotFound { .. } => ErrorKind::Module,
            Error::LaunchConfig { .. } => ErrorKind::LaunchConfig,
            #[cfg(feature = "cudarc")]
            Error::Cudarc { .. } => ErrorKind::Cudarc,
            Error::Bootstrap { .. } => ErrorKind::Bootstrap,
            Error::Capture { .. } => ErrorKind::Capture,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::Unsupported { .. } => ErrorKind::Unsupported,
            Error::BootstrapAuth { .. } => ErrorKind::Authentication,
            Error::RanksFailed { after: Some(_), .. } => ErrorKind::Timeout,
            Error::RanksFailed { after: None, .. } => ErrorKind::RanksFailed,
        }
    }

    /// Whether a deadline passed: `self.kind() == ErrorKind::Timeout`.
    pub fn is_timeout(&self) -> bool {
        self.kind() == ErrorKind::Timeout
    }

    /// The peer rank the error is about, where the error holds one: [`Error::PeerBroken`]'s.
    /// `None` for every other variant (a verification timeout names its peer only in its
    /// message).
    pub fn peer(&self) -> Option<usize> {
        match self {
            Error::PeerBroken { peer } => Some(*peer),
            _ => None,
        }
    }

    /// The operation that failed, where the error holds it: the function called
    /// ([`Error::Cuda`]'s and [`Error::Nccl`]'s `call`, e.g. `"ncclSend"`; `Error::Cudarc`'s),
    /// what was waited for ([`Error::Timeout`]'s `what`), or the feature asked for
    /// ([`Error::Unsupported`]'s). `None` for every other variant.
    pub fn operation(&self) -> Option<&str> {
        match self {
            Error::Cuda { call, .. } | Error::Nccl { call, .. } => Some(call),
            #[cfg(feature = "cudarc")]
            Error::Cudarc { call, .. } => Some(call),
            Error::Timeout { what, .. } => Some(what),
            Error::Unsupported { feature, .. } => Some(feature),
            _ => None,
        }
    }

    /// Whether the communicator of the call that returned this error can still be used, as far
    /// as the variant alone tells:
    ///
    /// - `Some(false)` for [`Error::CommunicatorUnusable`] and [`Error::PeerBroken`]: handoff
    ///   returns these only for a communicator it has aborted (or found aborted). Every later
    ///   call on it returns [`Error::CommunicatorUnusable`]; make new communicators on every rank.
    /// - `None` where it depends on the call; [`Communicator::broken_reason`] then says for
    ///   certain. [`Error::Timeout`] aborts the communicator whose wait ran out, which is not
    ///   always the one the call was made on (a split's timeout can be its child's), and an
    ///   async wait on a stream or an event involves none. [`Error::Mismatch`] aborts the communicators when verification of a send,
    ///   receive or collective finds it (the usual case), not when a window registration's
    ///   exchange does; [`Error::Nccl`], [`Error::Cuda`], [`Error::Setup`], [`Error::Capture`],
    ///   [`Error::InvalidArgument`] and [`Error::Unsupported`] abort it when they arise while an
    ///   operation is queued or waited for after its verification (NCCL's own errors mostly do),
    ///   not when a check refuses the call before anything reached NCCL.
    /// - `Some(true)` for the rest (library, driver, device, module, launch, bootstrap, cudarc
    ///   and local-job errors): they never come from, or abort, a communicator.
    ///
    /// [`Communicator::broken_reason`]: crate::Communicator::broken_reason
    pub fn communicator_usable(&self) -> Option<bool> {
        match self {
            Error::CommunicatorUnusable { .. } | Error::PeerBroken { .. } => Some(false),
            Error::Timeout { .. }
            | Error::Mismatch { .. }
            | Error::Nccl { .. }
            | Error::Cuda { .. }
            | Error::Setup { .. }
            | Error::Capture { .. }
            | Error::InvalidArgument(_)
            | Error::Unsupported { .. } => None,
            _ => Some(true),
        }
    }
}

/// The text after a call's error name: `": {text}"`, trimmed, without a final full stop (the
/// hint that may follow starts with one); nothing when the library gave no text.
fn detail(text: &str) -> String {
    match text.trim().trim_end_matches('.') {
        "" => String::new(),
        t => format!(": {t}"),
    }
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

    /// One value of every variant, with the field values a real one has (empty texts where
    /// a library can give none), and the kind each must map to.
    fn every_variant() -> Vec<(Error, ErrorKind)> {
        use std::time::Duration;
        let s = |t: &str| t.to_string();
        #[cfg_attr(not(feature = "cudarc"), allow(unused_mut))]
        let mut all = vec![
            (
                Error::LibraryNotFound {
                    library: "libnccl.so.2",
                    variable: "HANDOFF_NCCL_PATH",
                    expected: "NCCL 2.19 or newer",
                    tried: s("libnccl.so.2 (not found)"),
                },
                ErrorKind::LibraryMissing,
            ),
            (
                Error::LibraryIncompatible {
                    library: "libcudart.so.13",
                    path: s("/x/libcudart.so.13"),
                    detail: s("cudaMallocAsync is missing"),
                    expected: "the CUDA 13 runtime",
                    variable: "HANDOFF_CUDART_PATH",
                },
                ErrorKind::LibraryIncompatible,
            ),
            (
                Error::Cuda {
                    call: "cudaMallocAsync",
                    code: 2,
                    name: s("cudaErrorMemoryAllocation"),
                    message: s("out of memory"),
                },
                ErrorKind::Cuda,
            ),
            (
                Error::Nccl {
                    call: "ncclSend",
                    code: 5,
                    name: s("invalid usage"),
                    last_error: String::new(),
                },
                ErrorKind::Nccl,
            ),
            (
                Error::NoDevice {
                    reason: s("0 devices"),
                },
                ErrorKind::NoDevice,
            ),
            (
                Error::NoDriver {
                    detail: s("libcuda.so.1 missing"),
                },
                ErrorKind::Driver,
            ),
            (
                Error::DriverTooOld {
                    driver: 12080,
                    runtime: 13000,
                },
                ErrorKind::Driver,
            ),
            (
                Error::Timeout {
                    what: s("rank 0's wait for a stream"),
                    after: Duration::from_secs(5),
                },
                ErrorKind::Timeout,
            ),
            (
                Error::CommunicatorUnusable {
                    reason: s("aborted by the program"),
                },
                ErrorKind::CommunicatorUnusable,
            ),
            (
                Error::Mismatch {
                    detail: s("rank 0 sends 4 f32, rank 1 receives 3 f32"),
                },
                ErrorKind::Mismatch,
            ),
            (Error::PeerBroken { peer: 1 }, ErrorKind::PeerBroken),
            (
                Error::Setup {
                    detail: s("the ranks disagree on verification"),
                },
                ErrorKind::Setup,
            ),
            (
                Error::Module {
                    module: s("kernels.ptx"),
                    source: Box::new(Error::Cuda {
                        call: "cudaLibraryLoadData",
                        code: 222,
                        name: s("cudaErrorUnsupportedPtxVersion"),
                        message: s("the provided PTX was compiled with an unsupported toolchain."),
                    }),
                },
                ErrorKind::Module,
            ),
            (
                Error::FunctionNotFound {
                    module: s("kernels.ptx"),
                    name: s("twice"),
                },
                ErrorKind::Module,
            ),
            (
                Error::LaunchConfig {
                    kernel: s("twice"),
                    detail: s("2048 threads per block exceed 1024"),
                },
                ErrorKind::LaunchConfig,
            ),
            (
                Error::Bootstrap {
                    addr: s("127.0.0.1:29500"),
                    detail: s("connection refused"),
                },
                ErrorKind::Bootstrap,
            ),
            (
                Error::Capture {
                    detail: s("the stream is captured elsewhere"),
                },
                ErrorKind::Capture,
            ),
            (
                Error::InvalidArgument(s("root 3 is out of range")),
                ErrorKind::InvalidArgument,
            ),
            (
                Error::Unsupported {
                    feature: "windows",
                    needs: "NCCL 2.27",
                    loaded: s("libnccl.so.2 (2.21.5)"),
                    detail: s("ncclCommWindowRegister is missing"),
                },
                ErrorKind::Unsupported,
            ),
            (
                Error::BootstrapTimeout {
                    addr: s("127.0.0.1:29500"),
                    detail: s("rank 1 never fetched the id"),
                    after: Duration::from_secs(30),
                },
                ErrorKind::Timeout,
            ),
            (
                Error::BootstrapAuth {
                    addr: s("127.0.0.1:29500"),
                    detail: s("the secrets differ"),
                },
                ErrorKind::Authentication,
            ),
            (
                Error::RanksFailed {
                    ranks: vec![1],
                    detail: s("rank 1 of 2 failed: exit status: 1"),
                    after: None,
                },
                ErrorKind::RanksFailed,
            ),
            (
                Error::RanksFailed {
                    ranks: vec![0, 1],
                    detail: s("ranks 0 and 1 of 2 were still running after 5s and were killed"),
                    after: Some(Duration::from_secs(5)),
                },
                ErrorKind::Timeout,
            ),
        ];
        #[cfg(feature = "cudarc")]
        all.push((
            Error::Cudarc {
                call: "CudaSlice::from",
                code: 1,
                message: s("invalid value"),
            },
            ErrorKind::Cudarc,
        ));
        all
    }

    /// Which variant `e` is: a match without a catch-all, so that a new variant fails to
    /// compile here until [`every_variant`] has one of it.
    fn variant_index(e: &Error) -> usize {
        match e {
            Error::LibraryNotFound { .. } => 0,
            Error::LibraryIncompatible { .. } => 1,
            Error::Cuda { .. } => 2,
            Error::Nccl { .. } => 3,
            Error::NoDevice { .. } => 4,
            Error::NoDriver { .. } => 5,
            Error::DriverTooOld { .. } => 6,
            Error::Timeout { .. } => 7,
            Error::CommunicatorUnusable { .. } => 8,
            Error::Mismatch { .. } => 9,
            Error::PeerBroken { .. } => 10,
            Error::Setup { .. } => 11,
            Error::Module { .. } => 12,
            Error::FunctionNotFound { .. } => 13,
            Error::LaunchConfig { .. } => 14,
            Error::Bootstrap { .. } => 15,
            Error::Capture { .. } => 16,
            Error::InvalidArgument(_) => 17,
            Error::Unsupported { .. } => 18,
            Error::BootstrapTimeout { .. } => 19,
            Error::BootstrapAuth { .. } => 20,
            Error::RanksFailed { .. } => 21,
            #[cfg(feature = "cudarc")]
            Error::Cudarc { .. } => 22,
        }
    }

    #[test]
    fn every_variant_reads_as_clean_sentences_and_has_its_kind() {
        let all = every_variant();
        let covered: std::collections::BTreeSet<usize> = all.iter().map(|(e, _)| variant_index(e)).collect();
        let variants = if cfg!(feature = "cudarc") { 23 } else { 22 };
        assert_eq!(covered, (0..variants).collect(), "a variant has no sample");
        for (e, kind) in &all {
            let s = e.to_string();
            assert_eq!(e.kind(), *kind, "{e:?}");
            assert_eq!(e.is_timeout(), *kind == ErrorKind::Timeout, "{e:?}");
            assert!(!s.contains("  "), "a run of spaces: {s:?}");
            assert_eq!(s.trim(), s, "leading or trailing space: {s:?}");
            assert!(!s.contains('\n'), "a line break: {s:?}");
            for bad in [" . ", " ,", " :", " ;", ":.", ": .", "..", ",.", ";."] {
                assert!(!s.contains(bad), "{bad:?} in {s:?}");
            }
            let last = s.chars().last().expect("not empty");
            assert!(
                last.is_alphanumeric() || ")\"'".contains(last),
                "ends badly: {s:?}"
            );
            let first = s.chars().next().expect("not empty");
            assert!(first.is_alphanumeric() || first == '/', "starts badly: {s:?}");
        }
    }

    #[test]
    fn accessors_give_what_the_variant_holds() {
        assert_eq!(Error::PeerBroken { peer: 3 }.peer(), Some(3));
        assert_eq!(Error::Mismatch { detail: "x".into() }.peer(), None);
        let nccl = Error::Nccl {
            call: "ncclAllReduce",
            code: 6,
            name: "remote process exited or there was a network error".into(),
            last_error: "peer closed the connection.\n".into(),
        };
        assert_eq!(nccl.operation(), Some("ncclAllReduce"));
        assert_eq!(
            nccl.to_string(),
            "ncclAllReduce failed with remote process exited or there was a network error (6): \
             peer closed the connection. A remote rank failed or disconnected"
        );
        assert_eq!(Error::InvalidArgument("x".into()).operation(), None);
        for (e, _) in every_variant() {
            let usable = e.communicator_usable();
            match e.kind() {
                ErrorKind::CommunicatorUnusable | ErrorKind::PeerBroken => assert_eq!(usable, Some(false)),
                ErrorKind::Mismatch | ErrorKind::Nccl | ErrorKind::Cuda => assert_eq!(usable, None),
                ErrorKind::LibraryMissing | ErrorKind::Bootstrap | ErrorKind::RanksFailed => {
                    assert_eq!(usable, Some(true))
                }
                _ => {}
            }
        }
        let t = Error::Timeout {
            what: "w".into(),
            after: std::time::Duration::from_secs(1),
        };
        assert_eq!(t.communicator_usable(), None);
        assert!(t.is_timeout());
    }

    #[test]
    fn peer_broken_is_one_clean_sentence() {
        let s = Error::PeerBroken { peer: 1 }.to_string();
        assert_eq!(
            s,
            "rank 1's communicator broke (an error, a timeout or an abort there) while this rank \
             waited to verify an operation with it; this communicator is aborted too. Create new \
             communicators on every rank"
        );
    }
}
