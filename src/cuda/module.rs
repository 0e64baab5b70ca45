//! Users' own kernels: a [`Module`] of PTX (or cubin), its [`Function`]s, and tracked launches
//! whose arguments declare, by their types, how the kernel uses each buffer.
//!
//! ```no_run
//! # fn main() -> handoff::Result<()> {
//! use handoff::{Device, DeviceBuffer, LaunchConfig, Module, Stream};
//! let ptx = r#"
//! .version 8.0
//! .target sm_75
//! .address_size 64
//! .visible .entry add_one(.param .u64 x, .param .u64 n) { ret; }
//! "#; // PTX from nvcc, NVRTC or by hand
//! let module = Module::from_ptx(ptx)?;
//! let add_one = module.function("add_one")?;
//! let stream = Stream::new(&Device::new(0)?)?;
//! let mut x = DeviceBuffer::<f32>::zeros(1024, &stream)?;
//! let n = x.len() as u64;
//! // SAFETY: add_one(float* x, u64 n) writes x[0..n] and nothing else, and ends.
//! unsafe {
//!     stream
//!         .launch_builder(&add_one)
//!         .arg(&mut x) // a write: waits for every earlier use of x
//!         .arg(n) //      by value
//!         .launch(LaunchConfig::for_elements(1024))?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! A `&DeviceBuffer`, a [`View`] or a `&View` is a read; a `&mut DeviceBuffer`, a [`ViewMut`] or
//! a `&mut ViewMut` is a write; each goes to the kernel as its device pointer. Plain numbers go
//! by value, and any other [`Pod`] value through [`ByValue`]. Everything around the launch is
//! handoff's job, exactly as for its own kernels: waits for conflicting uses on other streams,
//! the event that tracks the launch, the buffers' lifetimes, device checks, and the launch
//! limits (typed errors). What handoff cannot check is the kernel itself: that is the
//! [`LaunchBuilder::launch`] contract.

use std::ffi::{CString, c_void};
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;

use smallvec::SmallVec;

use crate::cuda::buffer::DeviceBuffer;
use crate::cuda::view::{View, ViewMut};
use crate::engine::Tracked;
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::{cudaKernel_t, cudaLibrary_t};

/// A loaded module: PTX (JIT-compiled by the driver for each device at its first use there),
/// cubin or fatbin. Loaded once per process for all devices (`cudaLibraryLoadData`), and never
/// unloaded: a kernel of it may still be running when the last handle goes away.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

struct ModuleInner {
    library: cudaLibrary_t,
    /// Where it came from, for messages.
    origin: String,
}

// SAFETY: a context-independent library handle may be used from any thread; it is only read.
unsafe impl Send for ModuleInner {}
// SAFETY: as above.
unsafe impl Sync for ModuleInner {}

impl ModuleInner {
    /// The driver compiles PTX lazily, for each device at its first use there: a bad image can
    /// show up only then. Its errors become [`Error::Module`].
    fn image_error(&self, e: Error) -> Error {
        match e {
            // Invalid image / PTX, unsupported PTX version, no image for the device, JIT
            // compiler missing or disabled.
            Error::Cuda {
                code: 200 | 209 | 218 | 221 | 222 | 223,
                ..
            } => Error::Module {
                module: self.origin.clone(),
                source: Box::new(e),
            },
            other => other,
        }
    }
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("origin", &self.inner.origin)
            .finish()
    }
}

/// Whether an image is a binary (an ELF cubin or a fatbin) rather than PTX text.
pub(crate) fn is_binary(image: &[u8]) -> bool {
    image.starts_with(b"\x7fELF") || image.starts_with(&[0x50, 0xed, 0x55, 0xba])
}

impl Module {
    /// A module from PTX text.
    ///
    /// The driver compiles PTX for a device at its first use there, so a bad module may load
    /// and be reported only by [`Module::function`] or the first launch on each device, as
    /// [`Error::Module`] too.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for empty text or text with a NUL byte; [`Error::Module`]
    /// when the driver rejects it (bad PTX, or a PTX ISA newer than the driver takes).
    pub fn from_ptx(ptx: &str) -> Result<Module> {
        Self::load(ptx.as_bytes(), "PTX text")
    }

    /// A module from an image in memory: PTX (with or without its final NUL), cubin or fatbin.
    ///
    /// # Errors
    /// As [`Module::from_ptx`].
    pub fn from_image(image: &[u8]) -> Result<Module> {
        Self::load(image, "an image in memory")
    }

    /// A module from a `.ptx`, `.cubin` or `.fatbin` file.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the file cannot be read; as [`Module::from_ptx`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Module> {
        let path = path.as_ref();
        let image = std::fs::read(path)
            .map_err(|e| Error::InvalidArgument(format!("reading the module {}: {e}", path.display())))?;
        Self::load(&image, &path.display().to_string())
    }

    fn load(image: &[u8], origin: &str) -> Result<Module> {
        let mut owned;
        let image = if is_binary(image) {
            image
        } else {
            let text = image.strip_suffix(&[0]).unwrap_or(image);
            if text.iter().all(u8::is_ascii_whitespace) {
                return Err(Error::InvalidArgument(format!("the module {origin} is empty")));
            }
            if text.contains(&0) {
                return Err(Error::InvalidArgument(format!(
                    "the module {origin} is neither PTX text (it holds a NUL byte) nor a cubin or fatbin"
                )));
            }
            owned = text.to_vec();
            owned.push(0);
            &owned[..]
        };
        // SAFETY: PTX ends with its NUL (added above); a binary image is passed whole.
        let library = unsafe { cu::library_load_image(image) }.map_err(|e| Error::Module {
            module: origin.to_string(),
            source: Box::new(e),
        })?;
        Ok(Module {
            inner: Arc::new(ModuleInner {
                library,
                origin: origin.to_string(),
            }),
        })
    }

    /// The kernel `name` (an `extern "C"` function, or the mangled name of a C++ one).
    ///
    /// # Errors
    /// [`Error::FunctionNotFound`] when the module has none of that name;
    /// [`Error::InvalidArgument`] for a name with a NUL byte; CUDA errors.
    pub fn function(&self, name: &str) -> Result<Function> {
        let c_name = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("the kernel name {name:?} holds a NUL byte")))?;
        // SAFETY: the library is live for as long as `self` (never unloaded).
        let kernel = unsafe { cu::library_get_kernel(self.inner.library, &c_name) }.map_err(|e| match e {
            // cudaErrorSymbolNotFound, cudaErrorInvalidDeviceFunction, cudaErrorNotFound.
            Error::Cuda {
                code: 500 | 98 | 13, ..
            } => Error::FunctionNotFound {
                module: self.inner.origin.clone(),
                name: name.to_string(),
            },
            other => self.inner.image_error(other),
        })?;
        Ok(Function {
            kernel,
            name: name.to_string(),
            _module: self.inner.clone(),
            keep: self.inner.clone(),
            attributes: Mutex::new(Vec::new()),
        })
    }
}

/// One kernel of a [`Module`], launched with [`Stream::launch_builder`].
pub struct Function {
    kernel: cudaKernel_t,
    name: String,
    _module: Arc<ModuleInner>,
    /// The same module, as what a graph that captures a launch keeps alive (made once, not at
    /// each launch).
    keep: crate::engine::Keep,
    /// Per device it was loaded on: its largest block (threads) and dynamic shared memory.
    attributes: Mutex<Vec<(usize, u32, u32)>>,
}

// SAFETY: kernel handles of a context-independent library are valid on every thread and
// device; the library is never unloaded; the cache is behind a mutex.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl std::fmt::Debug for Function {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Function").field("name", &self.name).finish()
    }
}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Loads the kernel on `stream`'s device now, if not yet, and returns its launch limits
    /// there. CUDA loads modules lazily, and a lazy load can wait for work already running on
    /// the device: doing it up front keeps that wait out of the ordering the launch sets up.
    fn limits(&self, stream: &Stream) -> Result<(u32, u32)> {
        self.limits_on(stream.device())
    }

    fn limits_on(&self, on: &crate::Device) -> Result<(u32, u32)> {
        let device = on.ordinal();
        let mut cache = self.attributes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&(_, threads, shared)) = cache.iter().find(|(d, _, _)| *d == device) {
            return Ok((threads, shared));
        }
        on.set_current()?;
        // SAFETY: the handle is live (its library is never unloaded).
        let a = unsafe { cu::kernel_attributes(self.kernel) }.map_err(|e| self._module.image_error(e))?;
        let limits = (
            u32::try_from(a.maxThreadsPerBlock).unwrap_or(0),
            u32::try_from(a.maxDynamicSharedSizeBytes).unwrap_or(0),
        );
        cache.push((device, limits.0, limits.1));
        Ok(limits)
    }

    /// Loads the kernel on `device` now (the driver compiles PTX for it, if needed), instead of
    /// at its first launch there. A lazy load can wait for work already running on the device;
    /// loading up front keeps that wait out of a later launch.
    ///
    /// # Errors
    /// [`Error::Module`] when the PTX does not compile for the device; CUDA errors.
    pub fn load_on(&self, device: &crate::Device) -> Result<()> {
        self.limits_on(device).map(|_| ())
    }

    /// The raw handle.
    pub fn as_raw(&self) -> cudaKernel_t {
        self.kernel
    }
}

/// A launch's grid and blocks (x, y, z) and dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in the grid.
    pub grid: (u32, u32, u32),
    /// Threads in a block.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

/// Threads per block of [`LaunchConfig::for_elements`].
const ELEMENT_BLOCK: u32 = 256;

impl LaunchConfig {
    /// One thread per element, in blocks of 256: `ceil(n / 256)` blocks (at least one).
    pub fn for_elements(n: usize) -> LaunchConfig {
        let blocks = (n as u64).div_ceil(u64::from(ELEMENT_BLOCK)).max(1);
        LaunchConfig {
            grid: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
            block: (ELEMENT_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Checks the configuration against CUDA's limits and the kernel's (its largest block and
    /// dynamic shared memory on the device).
    pub(crate) fn check(&self, kernel: &str, max_threads: u32, max_shared: u32) -> Result<()> {
        let fail = |detail: String| {
            Err(Error::LaunchConfig {
                kernel: kernel.to_string(),
                detail,
            })
        };
        let (g, b) = (self.grid, self.block);
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return fail(format!(
                "grid {g:?} and block {b:?} need at least one in every dimension"
            ));
        }
        if g.0 > i32::MAX as u32 || g.1 > 65_535 || g.2 > 65_535 {
            return fail(format!(
                "grid {g:?} is larger than CUDA allows ({} × 65535 × 65535)",
                i32::MAX
            ));
        }
        if b.0 > 1024 || b.1 > 1024 || b.2 > 64 {
            return fail(format!(
                "block {b:?} is larger than CUDA allows (1024 × 1024 × 64)"
            ));
        }
        let threads = u64::from(b.0) * u64::from(b.1) * u64::from(b.2);
        if threads > u64::from(max_threads) {
            return fail(format!(
                "a block of {threads} threads is more than this kernel can run ({max_threads} on this \
                 device, from its registers and shared memory)"
            ));
        }
        if self.shared_mem_bytes > max_shared {
            return fail(format!(
                "{} bytes of dynamic shared memory is more than this kernel may use ({max_shared})",
                self.shared_mem_bytes
            ));
        }
        Ok(())
    }
}

/// A [`Pod`] value passed to a kernel by value (for plain numbers, pass them directly).
#[derive(Debug, Clone, Copy)]
pub struct ByValue<T: Pod>(pub T);

/// Collects a kernel's arguments and launches it on a stream; made by
/// [`Stream::launch_builder`].
pub struct LaunchBuilder<'a> {
    stream: &'a Stream,
    function: &'a Function,
    /// Every argument's bytes, each from an 8-byte word of its own (so that each is aligned
    /// for its type), inline for the usual few arguments.
    words: SmallVec<[u64; 16]>,
    /// Where each argument starts in `words`.
    starts: SmallVec<[usize; 8]>,
    uses: SmallVec<[(&'a Tracked, Access); 8]>,
    problem: Option<Error>,
}

impl std::fmt::Debug for LaunchBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchBuilder")
            .field("function", &self.function.name)
            .field("args", &self.starts.len())
            .finish()
    }
}

mod sealed {
    pub trait Sealed {}
}

/// What can be passed to a kernel: buffers and views (as device pointers, with the access
/// their type says) and values. Sealed: the access a type declares is what tracking relies on.
pub trait KernelArg<'a>: sealed::Sealed {
    /// Adds the argument.
    #[doc(hidden)]
    fn push_to(self, builder: &mut LaunchBuilder<'a>);
}

impl<'a> LaunchBuilder<'a> {
    pub(crate) fn new(stream: &'a Stream, function: &'a Function) -> Self {
        LaunchBuilder {
            stream,
            function,
            words: SmallVec::new(),
            starts: SmallVec::new(),
            uses: SmallVec::new(),
            problem: None,
        }
    }

    /// Adds the kernel's next argument.
    pub fn arg<A: KernelArg<'a>>(&mut self, arg: A) -> &mut Self {
        arg.push_to(self);
        self
    }

    fn push_value<T: Pod>(&mut self, v: T) {
        if std::mem::size_of::<T>() == 0 {
            self.problem.get_or_insert(Error::InvalidArgument(format!(
                "a kernel argument of {} has no bytes; no kernel parameter is empty",
                std::any::type_name::<T>()
            )));
        }
        if std::mem::align_of::<T>() > 8 {
            self.problem.get_or_insert(Error::InvalidArgument(format!(
                "a kernel argument of {} is aligned to {} bytes; at most 8 are supported",
                std::any::type_name::<T>(),
                std::mem::align_of::<T>()
            )));
        }
        let bytes = bytemuck::bytes_of(&v);
        let start = self.words.len();
        for _ in 0..bytes.len().div_ceil(8).max(1) {
            self.words.push(0);
        }
        bytemuck::cast_slice_mut::<u64, u8>(&mut self.words.as_mut_slice()[start..])[..bytes.len()]
            .copy_from_slice(bytes);
        self.starts.push(start);
    }

    fn push_buffer(&mut self, ptr: u64, tracked: &'a Tracked, access: Access) {
        self.push_value(ptr);
        self.uses.push((tracked, access));
    }

    /// Launches the kernel with `config` on the stream, after the conflicting earlier uses of
    /// every buffer argument (on other streams, waited for on the GPU) and tracked like any
    /// operation: later uses on any stream, host reads and frees order after it. Returns once
    /// the launch is queued. The builder keeps its arguments and can launch again.
    ///
    /// # Safety
    /// handoff cannot see inside the kernel, so the caller guarantees that:
    /// - its parameters are, in order and in number, exactly the arguments given: a pointer to
    ///   `T` for each buffer or view of `T`, and for each value, a parameter of the same size,
    ///   alignment and meaning;
    /// - it reads only elements inside each buffer or view argument, and writes only inside the
    ///   ones given as written (`&mut DeviceBuffer`, [`ViewMut`]), never through a read one;
    /// - it touches no other memory that safe code can reach (a pointer smuggled in as a value
    ///   is not tracked);
    /// - it ends: a kernel that never returns holds its stream and every wait on it forever.
    ///
    /// # Errors
    /// [`Error::LaunchConfig`] for a configuration beyond CUDA's or the kernel's limits;
    /// [`Error::Module`] when the kernel's PTX does not compile for the stream's device;
    /// [`Error::InvalidArgument`] for a buffer on another device than the stream, or an
    /// argument aligned to more than 8 bytes; CUDA errors (the launch itself, loading the
    /// kernel on the device).
    pub unsafe fn launch(&mut self, config: LaunchConfig) -> Result<()> {
        if let Some(p) = &self.problem {
            return Err(p.clone());
        }
        let (max_threads, max_shared) = self.function.limits(self.stream)?;
        config.check(&self.function.name, max_threads, max_shared)?;
        // Every pointer from one base, so that none is invalidated by taking another.
        let base = self.words.as_mut_slice().as_mut_ptr();
        let mut args: SmallVec<[*mut c_void; 8]> = self
            .starts
            .iter()
            .map(|&i| base.wrapping_add(i).cast::<c_void>())
            .collect();
        let kernel = self.function.kernel;
        // A graph that captures the launch keeps the kernel's module loaded.
        let work = crate::engine::Work::Cuda {
            keep: Some(&self.function.keep),
        };
        self.stream.enqueue_work(&self.uses, work, |s| {
            // SAFETY: the caller vouches for the kernel and the arguments (this function's
            // contract); each pointer in `args` points to an argument's bytes, alive until the
            // launch returns (CUDA copies them); the stream waits for every conflicting use.
            unsafe {
                cu::launch_kernel(
                    kernel,
                    config.grid,
                    config.block,
                    config.shared_mem_bytes,
                    args.as_mut_slice(),
                    s,
                )
            }
        })
    }
}

macro_rules! by_value {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl<'a> KernelArg<'a> for $t {
            fn push_to(self, b: &mut LaunchBuilder<'a>) {
                b.push_value(self);
            }
        }
    )*};
}

by_value!(
    u8,
    i8,
    u16,
    i16,
    u32,
    i32,
    u64,
    i64,
    f32,
    f64,
    half::f16,
    half::bf16
);

impl<T: Pod> sealed::Sealed for ByValue<T> {}
impl<'a, T: Pod> KernelArg<'a> for ByValue<T> {
    fn push_to(self, b: &mut LaunchBuilder<'a>) {
        b.push_value(self.0);
    }
}

impl<T: Pod> sealed::Sealed for &DeviceBuffer<T> {}
impl<'a, T: Pod> KernelArg<'a> for &'a DeviceBuffer<T> {
    fn push_to(self, b: &mut LaunchBuilder<'a>) {
        self.view().push_to(b);
    }
}

impl<T: Pod> sealed::Sealed for &mut DeviceBuffer<T> {}
impl<'a, T: Pod> KernelArg<'a> for &'a mut DeviceBuffer<T> {
    fn push_to(self, b: &mut LaunchBuilder<'a>) {
        self.view_mut().push_to(b);
    }
}

impl<T: Pod> sealed::Sealed for View<'_, T> {}
impl<'a, T: Pod> KernelArg<'a> for View<'a, T> {
    fn push_to(self, b: &mut LaunchBuilder<'a>) {
        b.push_buffer(self.as_raw_ptr() as u64, self.tracked(), Access::Read);
    }
}

impl<T: Pod> sealed::Sealed for &View<'_, T> {}
impl<'a, T: Pod> KernelArg<'a> for &'a View<'_, T> {
    fn push_to(self, b: &mut LaunchBuilder<'a>) {
        View::from(self).push_to(b);
    }
}

impl<T: Pod> sealed::Sealed for ViewMut<'_, T> {}
impl<'a, T: Pod> KernelArg<'a> for ViewMut<'a, T> {
    fn push_to(mut self, b: &mut LaunchBuilder<'a>) {
        b.push_buffer(self.as_raw_mut_ptr() as u64, self.tracked(), Access::Write);
    }
}

impl<T: Pod> sealed::Sealed for &mut ViewMut<'_, T> {}
impl<'a, T: Pod> KernelArg<'a> for &'a mut ViewMut<'_, T> {
    fn push_to(self, b: &mut LaunchBuilder<'a>) {
        self.reborrow().push_to(b);
    }
}

impl Stream {
    /// Starts a launch of `function` on this stream; see [`LaunchBuilder`].
    pub fn launch_builder<'a>(&'a self, function: &'a Function) -> LaunchBuilder<'a> {
        LaunchBuilder::new(self, function)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_elements_gives_a_thread_per_element() {
        let c = LaunchConfig::for_elements(1000);
        assert_eq!(c.grid, (4, 1, 1));
        assert_eq!(c.block, (256, 1, 1));
        assert_eq!(LaunchConfig::for_elements(0).grid, (1, 1, 1));
        assert_eq!(LaunchConfig::for_elements(256).grid, (1, 1, 1));
        assert!(LaunchConfig::for_elements(1000).check("k", 1024, 0).is_ok());
    }

    #[test]
    fn bad_configurations_are_typed_errors_naming_the_kernel() {
        let ok = LaunchConfig::for_elements(10);
        let cases = [
            (
                LaunchConfig {
                    grid: (0, 1, 1),
                    ..ok
                },
                1024,
                0,
                "at least one",
            ),
            (
                LaunchConfig {
                    block: (1, 0, 1),
                    ..ok
                },
                1024,
                0,
                "at least one",
            ),
            (
                LaunchConfig {
                    grid: (1, 70_000, 1),
                    ..ok
                },
                1024,
                0,
                "larger than CUDA allows",
            ),
            (
                LaunchConfig {
                    block: (2048, 1, 1),
                    ..ok
                },
                1024,
                0,
                "larger than CUDA allows",
            ),
            (
                LaunchConfig {
                    block: (1, 1, 65),
                    ..ok
                },
                1024,
                0,
                "larger than CUDA allows",
            ),
            (
                LaunchConfig {
                    block: (32, 32, 2),
                    ..ok
                },
                1024,
                0,
                "2048 threads",
            ),
            (
                LaunchConfig {
                    block: (512, 1, 1),
                    ..ok
                },
                256,
                0,
                "this kernel can run (256",
            ),
            (
                LaunchConfig {
                    shared_mem_bytes: 4096,
                    ..ok
                },
                1024,
                1024,
                "dynamic shared memory",
            ),
        ];
        for (c, threads, shared, want) in cases {
            let e = c.check("my_kernel", threads, shared).unwrap_err();
            assert!(
                matches!(&e, Error::LaunchConfig { kernel, .. } if kernel == "my_kernel"),
                "{e:?}"
            );
            assert!(e.to_string().contains(want), "{c:?}: {e}");
        }
    }

    #[test]
    fn images_are_told_apart() {
        assert!(is_binary(b"\x7fELF\x02\x01"));
        assert!(is_binary(&[0x50, 0xed, 0x55, 0xba, 1, 0]));
        assert!(!is_binary(b".version 8.0\n.target sm_75"));
    }

    #[test]
    fn empty_or_nul_ptx_is_refused_before_the_driver() {
        assert!(matches!(Module::from_ptx("  \n"), Err(Error::InvalidArgument(_))));
        assert!(matches!(
            Module::from_image(b"\0"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            Module::from_ptx(".version 8.0\0junk"),
            Err(Error::InvalidArgument(_))
        ));
        let e = Module::from_file("/nonexistent/k.ptx").unwrap_err().to_string();
        assert!(e.contains("/nonexistent/k.ptx"), "{e}");
    }

    /// Which access each argument type declares, and that it goes as its device pointer or
    /// its value, in order: on the plain structures, no GPU needed.
    #[test]
    fn argument_types_declare_their_access() {
        let device = crate::engine::device::Device::for_tests();
        let stream = Stream::for_tests(&device);
        let module = Arc::new(ModuleInner {
            library: std::ptr::null_mut(),
            origin: "test".into(),
        });
        let function = Function {
            kernel: std::ptr::null_mut(),
            name: "k".into(),
            _module: module.clone(),
            keep: module,
            attributes: Mutex::new(Vec::new()),
        };
        let (a, b) = (Tracked::new(&device), Tracked::new(&device));
        let mut backing = [0f32; 8];
        let base = backing.as_mut_ptr();
        // SAFETY: never dereferenced: the builder only records pointers and uses.
        let (read, mut write, other) = unsafe {
            (
                View::from_raw(base, 4, &a),
                ViewMut::from_raw(base.add(4), 2, &b),
                ViewMut::from_raw(base.add(6), 2, &b),
            )
        };
        let mut builder = stream.launch_builder(&function);
        #[allow(clippy::needless_borrows_for_generic_args)] // `&View` is an argument type too
        builder
            .arg(read)
            .arg(&read)
            .arg(&mut write)
            .arg(7u32)
            .arg(ByValue([1u16, 2, 3]))
            .arg(other);
        let accesses: Vec<Access> = builder.uses.iter().map(|u| u.1).collect();
        assert_eq!(
            accesses,
            [Access::Read, Access::Read, Access::Write, Access::Write]
        );
        assert!(std::ptr::eq(builder.uses[0].0, &a) && std::ptr::eq(builder.uses[2].0, &b));
        let ends = builder
            .starts
            .iter()
            .skip(1)
            .copied()
            .chain([builder.words.len()]);
        let words: Vec<Vec<u64>> = builder
            .starts
            .iter()
            .zip(ends)
            .map(|(&a, b)| builder.words[a..b].to_vec())
            .collect();
        assert_eq!(words.len(), 6);
        assert_eq!(words[0], [base as u64]);
        assert_eq!(words[2], [base as u64 + 16]);
        assert_eq!(words[3], [7]);
        assert_eq!(words[4], [1 | (2 << 16) | (3 << 32)]);
        assert_eq!(words[5], [base as u64 + 24]);
        assert!(builder.problem.is_none());
        builder.arg(ByValue(0u128));
        assert!(matches!(builder.problem, Some(Error::InvalidArgument(_))));
        let mut empty = stream.launch_builder(&function);
        empty.arg(ByValue(()));
        assert!(matches!(&empty.problem, Some(Error::InvalidArgument(m)) if m.contains("no bytes")));
    }
}
