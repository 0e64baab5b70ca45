//! The kind of memory a benchmark's buffers are (`--memory`), for the columns of issue 19: the
//! pool (`DeviceBuffer::zeros`), `ncclMemAlloc` memory, that memory registered with the
//! communicator, or made a symmetric window of it. Every way of a run (handoff verified,
//! unverified, raw NCCL) gets its own buffers of the same kind: handoff's registered or made a
//! window through handoff (`Communicator::register`, `register_window`) with its own
//! communicator, raw NCCL's registered raw (`ncclCommRegister`, `ncclCommWindowRegister`) with
//! the communicator the raw calls use, so each column is its way over the same kind of memory.
#![allow(dead_code)]

use std::ffi::c_void;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use handoff::result::nccl as raw;
use handoff::sys::nccl::NCCL_WIN_COLL_SYMMETRIC;
use handoff::{Communicator, DeviceBuffer, NcclType, Registration, Stream, View, ViewMut, Window};

/// What `--memory` chooses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Memory {
    /// The stream-ordered pool (`DeviceBuffer::zeros`).
    Pool,
    /// `ncclMemAlloc` memory, not registered.
    Nccl,
    /// `ncclMemAlloc` memory registered with the communicator (`Communicator::register`; raw:
    /// `ncclCommRegister`).
    Registered,
    /// `ncclMemAlloc` memory made a symmetric window (`register_window`; raw:
    /// `ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`). One rank, or two processes:
    /// handoff refuses windows on ranks of one `init_all`.
    Window,
}

impl Memory {
    /// For the table's header.
    pub fn describe(self) -> &'static str {
        match self {
            Memory::Pool => "pool memory",
            Memory::Nccl => "ncclMemAlloc memory",
            Memory::Registered => {
                "ncclMemAlloc memory, registered (handoff: register; raw: ncclCommRegister)"
            }
            Memory::Window => {
                "ncclMemAlloc memory, symmetric windows (handoff: register_window; raw: ncclCommWindowRegister)"
            }
        }
    }

    /// `data` in a new buffer of this kind.
    ///
    /// # Errors
    /// CUDA's and NCCL's (`Error::Unsupported` for an NCCL without `ncclMemAlloc`).
    pub fn alloc<T: NcclType>(self, stream: &Stream, data: &[T]) -> handoff::Result<DeviceBuffer<T>> {
        match self {
            Memory::Pool => DeviceBuffer::from_slice(data, stream),
            _ => DeviceBuffer::from_slice_nccl(data, stream),
        }
    }

    /// `len` zeros in a new buffer of this kind.
    ///
    /// # Errors
    /// As [`Memory::alloc`].
    pub fn zeros<T: NcclType>(self, len: usize, stream: &Stream) -> handoff::Result<DeviceBuffer<T>> {
        match self {
            Memory::Pool => DeviceBuffer::zeros(len, stream),
            _ => DeviceBuffer::zeros_nccl(len, stream),
        }
    }

    /// `path` for this kind's run: as given for the pool, `-MEMORY` inserted before its
    /// extension (or at its end) for the others, so that runs over each kind keep their own
    /// files.
    pub fn file(self, path: &str) -> String {
        if self == Memory::Pool {
            return path.to_string();
        }
        let kind = format!("{self:?}").to_lowercase();
        let p = std::path::Path::new(path);
        match (p.file_stem(), p.extension()) {
            (Some(stem), Some(ext)) => p
                .with_file_name(format!(
                    "{}-{kind}.{}",
                    stem.to_string_lossy(),
                    ext.to_string_lossy()
                ))
                .to_string_lossy()
                .into_owned(),
            _ => format!("{path}-{kind}"),
        }
    }

    /// `buf` as the way that calls NCCL on `comm` uses it: through handoff (`raw_way` false), or
    /// by raw calls on `comm.as_raw()`.
    ///
    /// # Errors
    /// handoff's refusals (a window on one `init_all`'s ranks), NCCL's errors.
    pub fn hold<'c, 'b, T: NcclType>(
        self,
        buf: &'b mut DeviceBuffer<T>,
        comm: &'c Communicator,
        raw_way: bool,
    ) -> handoff::Result<Held<'c, 'b, T>> {
        let bytes = buf.byte_len();
        Ok(match (self, raw_way) {
            (Memory::Pool | Memory::Nccl, _) => Held::Plain(buf),
            (Memory::Registered, false) => Held::Registered(comm.register(buf)?),
            // SAFETY: every rank of the benchmark makes the same windows, in the same order, of
            // the same sizes (it allocates them alike); the buffer's memory is from
            // ncclMemAlloc (`alloc`), whole, and not yet a window.
            (Memory::Window, false) => Held::Window(unsafe { comm.register_window(buf) }?),
            (Memory::Registered, true) => {
                // SAFETY: the communicator is live and used by this thread only; the memory is
                // the buffer's, on its device, and outlives the registration: `Held` borrows
                // the buffer and deregisters when dropped.
                let handle =
                    unsafe { raw::comm_register(comm.as_raw(), buf.as_raw_mut_ptr().cast(), bytes) }?;
                Held::Raw {
                    buf,
                    comm,
                    handle,
                    window: false,
                }
            }
            (Memory::Window, true) => {
                let started = Instant::now();
                // SAFETY: as above, and as for `register_window`: every rank makes the same raw
                // windows in the same order with the same sizes; the memory is one whole
                // ncclMemAlloc allocation, 4096-aligned, not a window yet; no raw group is open.
                let (win, pending) = unsafe {
                    raw::comm_window_register(
                        comm.as_raw(),
                        buf.as_raw_mut_ptr().cast(),
                        bytes,
                        NCCL_WIN_COLL_SYMMETRIC as i32,
                    )
                }?;
                if pending {
                    // SAFETY: the communicator is live.
                    unsafe {
                        raw::wait_ready(
                            comm.as_raw(),
                            "ncclCommWindowRegister",
                            started,
                            Duration::from_secs(60),
                        )
                    }?;
                }
                Held::Raw {
                    buf,
                    comm,
                    handle: win.cast(),
                    window: true,
                }
            }
        })
    }
}

/// A buffer as one way of a benchmark holds it; dropping it deregisters what was registered.
pub enum Held<'c, 'b, T: NcclType> {
    /// Not registered.
    Plain(&'b mut DeviceBuffer<T>),
    /// Registered through handoff.
    Registered(Registration<'c, 'b, T>),
    /// A window made through handoff.
    Window(Window<'c, 'b, T>),
    /// Registered (or made a window) by raw calls.
    Raw {
        buf: &'b mut DeviceBuffer<T>,
        comm: &'c Communicator,
        handle: *mut c_void,
        window: bool,
    },
}

impl<T: NcclType> Held<'_, '_, T> {
    /// The buffer, to be read.
    pub fn view(&self) -> View<'_, T> {
        match self {
            Held::Plain(b) => b.view(),
            Held::Registered(r) => r.view(),
            Held::Window(w) => w.view(),
            Held::Raw { buf, .. } => buf.view(),
        }
    }

    /// The buffer, to be written.
    pub fn view_mut(&mut self) -> ViewMut<'_, T> {
        match self {
            Held::Plain(b) => b.view_mut(),
            Held::Registered(r) => r.view_mut(),
            Held::Window(w) => w.view_mut(),
            Held::Raw { buf, .. } => buf.view_mut(),
        }
    }
}

impl<T: NcclType> Drop for Held<'_, '_, T> {
    fn drop(&mut self) {
        let Held::Raw {
            comm, handle, window, ..
        } = self
        else {
            return;
        };
        // Raw calls are not tracked: everything queued on the device first.
        if comm.device().synchronize().is_err() {
            // Leaked registered rather than deregistered under queued work.
            return;
        }
        // SAFETY: made by `Memory::hold` on this live communicator with the matching call, and
        // deregistered once, here; nothing queued uses the memory (the device is synchronized).
        let r = unsafe {
            if *window {
                raw::comm_window_deregister(comm.as_raw(), handle.cast())
            } else {
                raw::comm_deregister(comm.as_raw(), *handle)
            }
        };
        if let Err(e) = r {
            eprintln!("deregistering a raw registration: {e}");
        }
    }
}
