//! [`Registration`] and [`Window`]: a buffer registered with a communicator
//! (`ncclCommRegister`) or made a symmetric window of it (`ncclCommWindowRegister`), as values
//! whose lifetimes the borrow checker ties to both the buffer and the communicator.
//!
//! # The shape
//! [`Communicator::register`] and [`Communicator::register_window`] take the buffer by
//! exclusive borrow (`&'b mut DeviceBuffer<T>`) and the communicator by shared borrow
//! (`&'c Communicator`), and return a value holding both:
//! - it cannot outlive the buffer nor the communicator, and neither can be dropped, moved or
//!   freed ([`DeviceBuffer::free`]) while it lives: the memory is never freed while registered,
//!   and the communicator never destroyed under a window;
//! - while it lives, the buffer is reached only through it ([`Registration::view`],
//!   [`Registration::view_mut`], and `Deref` to `&DeviceBuffer`), so it is still read and
//!   written by kernels, copies, sends and collectives, all tracked; there is no `DerefMut`, since
//!   `mem::swap` through one would move another buffer under the registration;
//! - a buffer cannot be registered twice at once (the borrow is exclusive). One forgotten with
//!   `mem::forget` leaves a mark on the buffer ([`crate::cuda::buffer::Registrations`]): the buffer then
//!   refuses a second window, and when dropped leaks its memory rather than free it under NCCL.
//!   Verification still counts it registered with that communicator, named by a key never reused
//!   (`Communicator::key`), so no later communicator inherits the registration;
//! - dropping it first waits, on the host, for every pending use of the buffer (tracking: on
//!   any stream, by any operation), then deregisters with the call that matches
//!   (`ncclCommDeregister`, `ncclCommWindowDeregister`). Waiting in `Drop` is bounded: every
//!   queued NCCL operation is under its communicator's watchdog. Both calls are local to the rank
//!   in NCCL 2.28, so no rank waits for another to drop.
//!
//! # Which calls are collective (NCCL 2.28.3's source)
//! `ncclCommRegister` only adds the range to the communicator's registration cache (peers
//! exchange handles later, inside the collectives that use it): local, checked only here.
//! `ncclCommWindowRegister` is collective: it runs as a group task that maps every local peer's
//! memory (an intra-node all-gather of handles) and ends in a barrier of every rank, with no
//! deadline. So before NCCL is called, every rank sends every other, through an all-gather on the
//! communicator, the window's number on this rank (its registration order), its size in bytes,
//! and whether this rank can register it (memory from `ncclMemAlloc`, 4096-aligned, not already
//! a window, an NCCL that has the call); a disagreement is [`Error::Mismatch`] (or this rank's
//! own refusal) on every rank, and none calls NCCL. The communicator stays usable. The exchange
//! waits with the communicator's timeout, so a rank that never registers is a timeout, not a
//! hang.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytemuck::Pod;

use crate::cuda::buffer::DeviceBuffer;
use crate::cuda::view::{View, ViewMut};
use crate::error::{Error, Result};
use crate::nccl::communicator::{Communicator, usable};
use crate::result::nccl as nc;
use crate::sys::nccl::{NCCL_WIN_COLL_SYMMETRIC, NCCL_WIN_REQUIRED_ALIGNMENT, ncclWindow_t};

/// A buffer registered with a communicator (`ncclCommRegister`), so that NCCL's operations on
/// it may skip staging copies (zero-copy over NVLink and the network, fewer SMs). Made by
/// [`Communicator::register`]; see the module for the rules it enforces.
///
/// The buffer is used through the registration: [`Registration::view`] for reads (sends,
/// collective inputs), [`Registration::view_mut`] for writes (receives, outputs, kernels).
///
/// A registration cannot outlive its buffer:
/// ```compile_fail,E0597
/// # fn f(comm: &handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let reg = {
///     let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
///     comm.register(&mut buf)?
/// };
/// drop(reg);
/// # Ok(()) }
/// ```
/// nor its communicator:
/// ```compile_fail,E0505
/// # fn f(comm: handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
/// let reg = comm.register(&mut buf)?;
/// drop(comm);
/// drop(reg);
/// # Ok(()) }
/// ```
/// and the buffer cannot be freed (nor used directly) while registered:
/// ```compile_fail,E0505
/// # fn f(comm: &handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
/// let reg = comm.register(&mut buf)?;
/// buf.free()?;
/// drop(reg);
/// # Ok(()) }
/// ```
/// There is no `DerefMut` through which another buffer could be swapped in:
/// ```compile_fail,E0596
/// # fn f(comm: &handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
/// let mut other = handoff::DeviceBuffer::<f32>::zeros(1024, s)?;
/// let mut reg = comm.register(&mut buf)?;
/// std::mem::swap(&mut *reg, &mut other);
/// # Ok(()) }
/// ```
/// What compiles: use it through its views, then drop it (or [`Registration::deregister`]),
/// then the buffer is the caller's again.
/// ```no_run
/// # fn f(comm: &handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// use handoff::ReduceOp;
/// let mut buf = handoff::DeviceBuffer::<f32>::from_slice_nccl(&[1.0; 1024], s)?;
/// let mut reg = comm.register(&mut buf)?;
/// comm.all_reduce_in_place(reg.view_mut(), ReduceOp::Sum, s)?;
/// reg.deregister()?;
/// let values = buf.to_vec(s)?;
/// # Ok(()) }
/// ```
pub struct Registration<'c, 'b, T: Pod> {
    comm: &'c Communicator,
    buf: &'b mut DeviceBuffer<T>,
    /// NCCL's handle: null when NCCL registered nothing (`NCCL_LOCAL_REGISTER=0`).
    handle: *mut std::ffi::c_void,
    /// Not `Send`: dropping it calls NCCL on the communicator, as its thread does.
    _not_send: PhantomData<*const ()>,
}

/// A buffer made a symmetric window of a communicator (`ncclCommWindowRegister` with
/// `NCCL_WIN_COLL_SYMMETRIC`): NCCL maps it into every local peer's address space and runs its
/// symmetric kernels, and with [`CtaPolicy::Zero`](crate::CtaPolicy::Zero) its copy-engine
/// collectives, over it. Made by [`Communicator::register_window`]; see the module for the
/// rules it enforces.
///
/// A window cannot outlive its buffer:
/// ```compile_fail,E0597
/// # fn f(comm: &handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let win = {
///     let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
///     unsafe { comm.register_window(&mut buf)? }
/// };
/// drop(win);
/// # Ok(()) }
/// ```
/// nor its communicator:
/// ```compile_fail,E0505
/// # fn f(comm: handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
/// let win = unsafe { comm.register_window(&mut buf)? };
/// drop(comm);
/// drop(win);
/// # Ok(()) }
/// ```
/// the buffer cannot be dropped while it is a window:
/// ```compile_fail,E0505
/// # fn f(comm: &handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
/// let win = unsafe { comm.register_window(&mut buf)? };
/// drop(buf);
/// drop(win);
/// # Ok(()) }
/// ```
/// nor be made a window twice:
/// ```compile_fail,E0499
/// # fn f(comm: &handoff::Communicator, s: &handoff::Stream) -> handoff::Result<()> {
/// let mut buf = handoff::DeviceBuffer::<f32>::zeros_nccl(1024, s)?;
/// let a = unsafe { comm.register_window(&mut buf)? };
/// let b = unsafe { comm.register_window(&mut buf)? };
/// drop((a, b));
/// # Ok(()) }
/// ```
pub struct Window<'c, 'b, T: Pod> {
    comm: &'c Communicator,
    buf: &'b mut DeviceBuffer<T>,
    win: ncclWindow_t,
    index: u64,
    _not_send: PhantomData<*const ()>,
}

macro_rules! buffer_access {
    ($ty:ident) => {
        impl<T: Pod> $ty<'_, '_, T> {
            /// The whole buffer, to be read (a send, a collective's input, a copy out).
            pub fn view(&self) -> View<'_, T> {
                self.buf.view()
            }

            /// The whole buffer, to be written (a receive, a collective's output, a kernel).
            pub fn view_mut(&mut self) -> ViewMut<'_, T> {
                self.buf.view_mut()
            }

            /// The communicator it is registered with.
            pub fn communicator(&self) -> &Communicator {
                self.comm
            }
        }

        impl<T: Pod> std::ops::Deref for $ty<'_, '_, T> {
            type Target = DeviceBuffer<T>;
            /// The buffer, for reads (`&*reg` is a send's or a collective's input).
            fn deref(&self) -> &DeviceBuffer<T> {
                self.buf
            }
        }

        impl<T: Pod> std::fmt::Debug for $ty<'_, '_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($ty))
                    .field("buffer", &*self.buf)
                    .field("rank", &self.comm.rank())
                    .finish()
            }
        }
    };
}

buffer_access!(Registration);
buffer_access!(Window);

impl<T: Pod> Registration<'_, '_, T> {
    /// Whether NCCL made a registration: `false` when it returned no handle
    /// (`NCCL_LOCAL_REGISTER=0`), in which case its operations on the buffer take the unregistered
    /// paths.
    pub fn is_active(&self) -> bool {
        !self.handle.is_null()
    }

    /// Waits for every pending use of the buffer, then deregisters it (`ncclCommDeregister`),
    /// reporting what `Drop` has to swallow.
    ///
    /// # Errors
    /// CUDA errors from the wait, NCCL's from the call. The buffer then stays marked as
    /// registered, and leaks its memory when dropped rather than free it while NCCL may use it.
    pub fn deregister(mut self) -> Result<()> {
        let r = self.finish();
        // Finished: `Drop` must not deregister again.
        std::mem::forget(self);
        r
    }

    fn finish(&mut self) -> Result<()> {
        let handle = self.handle;
        end(self.comm, self.buf, false, |raw| {
            // SAFETY: the handle came from ncclCommRegister on this communicator, which is
            // live (the lock is held, not broken), and is deregistered once (`deregister`
            // forgets the value); no queued use of the memory is left (`end` waited).
            unsafe { nc::comm_deregister(raw, handle) }
        })
    }
}

impl<T: Pod> Drop for Registration<'_, '_, T> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

impl<T: Pod> Window<'_, '_, T> {
    /// This window's number among the window registrations of this rank of the communicator
    /// (0 for the first): the same on every rank for the same window.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Waits for every pending use of the buffer, then deregisters the window
    /// (`ncclCommWindowDeregister`), reporting what `Drop` has to swallow.
    ///
    /// # Errors
    /// As [`Registration::deregister`].
    pub fn deregister(mut self) -> Result<()> {
        let r = self.finish();
        // Finished: `Drop` must not deregister again.
        std::mem::forget(self);
        r
    }

    fn finish(&mut self) -> Result<()> {
        let win = self.win;
        end(self.comm, self.buf, true, |raw| {
            // SAFETY: the window came from ncclCommWindowRegister on this communicator, which
            // is live (the lock is held, not broken), and is deregistered once; no queued use of
            // the memory is left (`end` waited).
            unsafe { nc::comm_window_deregister(raw, win) }
        })
    }
}

impl<T: Pod> Drop for Window<'_, '_, T> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// Ends a registration of `buf` with `comm`: waits for every pending use of the buffer, then
/// deregisters with `call` (skipped if the communicator was aborted or finalized, which freed
/// NCCL's registrations with it), then clears the buffer's mark. On an error the mark stays.
fn end<T: Pod>(
    comm: &Communicator,
    buf: &mut DeviceBuffer<T>,
    window: bool,
    call: impl FnOnce(crate::sys::nccl::ncclComm_t) -> Result<()>,
) -> Result<()> {
    // NCCL may use the memory through the registration in any operation queued on it, on any
    // stream: all of them first. Bounded: the watchdogs end NCCL work that does not complete.
    buf.synchronize()?;
    {
        let state = comm.shared.lock();
        if !state.raw.is_null() {
            comm.device().set_current()?;
            call(state.raw)?;
        }
    }
    buf.registrations.count -= 1;
    if window {
        buf.registrations.window = false;
    } else {
        buf.tracked().note_deregistered(comm.key());
    }
    Ok(())
}

/// Why a rank cannot make its buffer a window: each rank sends its own to every other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The memory is not from `ncclMemAlloc`.
    NotNcclMemory = 1,
    /// Not at a multiple of `NCCL_WIN_REQUIRED_ALIGNMENT` in its allocation.
    Misaligned = 2,
    /// Already a window (one was forgotten).
    AlreadyWindow = 3,
    /// No bytes.
    Empty = 4,
    /// The loaded NCCL lacks the call.
    Unsupported = 5,
    /// `NCCL_CUMEM_ENABLE=0`: `ncclMemAlloc` gave `cudaMalloc` memory, which NCCL cannot map.
    CuMemDisabled = 6,
    /// The buffer is on another device than the communicator.
    OtherDevice = 7,
}

impl Refusal {
    fn from_code(code: u64) -> Option<Refusal> {
        use Refusal::*;
        [
            NotNcclMemory,
            Misaligned,
            AlreadyWindow,
            Empty,
            Unsupported,
            CuMemDisabled,
            OtherDevice,
        ]
        .into_iter()
        .find(|r| *r as u64 == code)
    }

    fn describe(self) -> &'static str {
        match self {
            Refusal::NotNcclMemory => {
                "a window needs memory from ncclMemAlloc (CUDA virtual memory): make the buffer \
                 with DeviceBuffer::zeros_nccl or from_slice_nccl"
            }
            Refusal::Misaligned => "a window must start at a multiple of 4096 bytes in its allocation",
            Refusal::AlreadyWindow => {
                "the buffer is already a window (an earlier Window of it was forgotten with \
                 mem::forget); registering it again is undefined in NCCL"
            }
            Refusal::Empty => "a window of no bytes registers nothing",
            Refusal::Unsupported => {
                "the loaded NCCL lacks ncclCommWindowRegister (NCCL 2.27 or newer needed)"
            }
            Refusal::CuMemDisabled => {
                "NCCL_CUMEM_ENABLE=0 makes ncclMemAlloc return cudaMalloc memory, which NCCL cannot \
                 map into a window"
            }
            Refusal::OtherDevice => "the buffer is on another device than the communicator",
        }
    }
}

/// What one rank can say about its side of a window registration, before anything reaches
/// NCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowSide {
    pub(crate) nccl_memory: bool,
    pub(crate) ptr: usize,
    pub(crate) bytes: usize,
    pub(crate) already_window: bool,
    pub(crate) same_device: bool,
    pub(crate) supported: bool,
    /// `NCCL_CUMEM_ENABLE` as set.
    pub(crate) cumem_env: Option<i64>,
}

impl WindowSide {
    /// This rank's refusal, if any: the first rule broken.
    pub(crate) fn refusal(&self) -> Option<Refusal> {
        if !self.supported {
            Some(Refusal::Unsupported)
        } else if !self.same_device {
            Some(Refusal::OtherDevice)
        } else if !self.nccl_memory {
            Some(Refusal::NotNcclMemory)
        } else if self.bytes == 0 {
            Some(Refusal::Empty)
        } else if !self.ptr.is_multiple_of(NCCL_WIN_REQUIRED_ALIGNMENT as usize) {
            Some(Refusal::Misaligned)
        } else if self.already_window {
            Some(Refusal::AlreadyWindow)
        } else if self.cumem_env == Some(0) {
            Some(Refusal::CuMemDisabled)
        } else {
            None
        }
    }
}

/// Words each rank sends the others before a window registration.
pub(crate) const CARD_WORDS: usize = 3;

/// The words this rank sends: the window's number, its size, and this rank's refusal (0 none).
pub(crate) fn window_card(index: u64, bytes: usize, refusal: Option<Refusal>) -> [u64; CARD_WORDS] {
    [index, bytes as u64, refusal.map_or(0, |r| r as u64)]
}

/// Checks every rank's card (in rank order) against this rank's: the detail of the first
/// disagreement or refusal by another rank. This rank's own refusal is its caller's to report.
pub(crate) fn check_window_cards(rank: usize, cards: &[u64]) -> std::result::Result<(), String> {
    let cards: Vec<&[u64]> = cards.chunks(CARD_WORDS).collect();
    let mine = cards.get(rank).ok_or("this rank's card is missing")?;
    for (r, c) in cards.iter().enumerate() {
        if c.len() != CARD_WORDS {
            return Err(format!("rank {r} sent {} words, not {CARD_WORDS}", c.len()));
        }
        if r == rank {
            continue;
        }
        if c[2] != 0 {
            let why = Refusal::from_code(c[2]).map_or("an unknown reason", Refusal::describe);
            return Err(format!(
                "rank {r} cannot make its buffer window #{} ({why}); nothing was registered on any rank",
                c[0]
            ));
        }
        if c[0] != mine[0] {
            return Err(format!(
                "rank {r} is at window registration #{} while rank {rank} is at #{}; nothing was \
                 registered on any rank",
                c[0], mine[0]
            ));
        }
        if c[1] != mine[1] {
            return Err(format!(
                "window #{}: rank {r} registers {} bytes, rank {rank} {} bytes (every rank registers \
                 the same size, in the same order); nothing was registered on any rank",
                mine[0], c[1], mine[1]
            ));
        }
    }
    Ok(())
}

impl Communicator {
    /// Registers `buf` with this communicator (`ncclCommRegister`), so that NCCL's operations
    /// on it may take its registered, zero-copy paths (best with memory from
    /// [`DeviceBuffer::zeros_nccl`]). Local to this rank: no other rank takes part.
    ///
    /// The buffer is then used through the [`Registration`], which cannot outlive it or the
    /// communicator; dropping the registration waits for the buffer's pending uses, then
    /// deregisters it.
    ///
    /// NCCL's registered send/receive path needs both sides of a transfer registered ("We
    /// require users registering buffers on both sides", `addP2pToPlan` in NCCL 2.28.3's
    /// `src/enqueue.cc`) and does not check it: a side registered alone would move the
    /// transfer in other steps than its peer. So verification compares, for every send,
    /// receive and collective, whether each side's memory is registered with its communicator:
    /// a transfer from registered memory into unregistered memory is [`Error::Mismatch`] on
    /// both ranks, before NCCL is called. (On a communicator made with the `unsafe`
    /// [`CommOptions::unverified`](crate::CommOptions::unverified), matching registrations are
    /// the caller's promise, with the rest of the operations.)
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer on another device, or of no bytes;
    /// [`Error::CommunicatorUnusable`]; [`Error::Unsupported`] when the loaded NCCL lacks the
    /// call; NCCL errors.
    pub fn register<'c, 'b, T: Pod>(
        &'c self,
        buf: &'b mut DeviceBuffer<T>,
    ) -> Result<Registration<'c, 'b, T>> {
        if !buf.device().same(self.device()) {
            return Err(Error::InvalidArgument(format!(
                "the buffer is on device {}, the communicator on device {}",
                buf.device().ordinal(),
                self.device().ordinal()
            )));
        }
        if buf.byte_len() == 0 {
            return Err(Error::InvalidArgument(
                "a buffer of no bytes registers nothing".into(),
            ));
        }
        nc::register_lib()?;
        let handle = {
            let state = self.shared.lock();
            let raw = usable(&state)?;
            self.device().set_current()?;
            // SAFETY: `raw` is live (not broken, lock held: no concurrent NCCL call); the
            // memory is device memory of the communicator's device (checked), exclusively
            // borrowed by the registration, which deregisters it before the borrow ends (or,
            // forgotten, leaves the mark that makes the buffer leak its memory).
            unsafe { nc::comm_register(raw, buf.as_raw_mut_ptr().cast(), buf.byte_len()) }?
        };
        buf.registrations.count += 1;
        // Verification now says, of every send, receive and collective over this memory with
        // this communicator, that it is registered.
        buf.tracked().note_registered(self.key());
        Ok(Registration {
            comm: self,
            buf,
            handle,
            _not_send: PhantomData,
        })
    }

    /// Makes `buf` a symmetric window of this communicator (`ncclCommWindowRegister` with
    /// `NCCL_WIN_COLL_SYMMETRIC`). Collective: every rank calls it, for its own buffer of the
    /// same size, in the same order among its window registrations. That is checked first, by
    /// an exchange among the ranks (see the module), together with each rank's own rules:
    /// memory from [`DeviceBuffer::zeros_nccl`], at a 4096-byte boundary, not already a
    /// window. A rank that breaks one gets its error and every other rank [`Error::Mismatch`],
    /// before any rank calls NCCL; the communicator stays usable.
    ///
    /// The buffer is then used through the [`Window`], which cannot outlive it or the
    /// communicator; dropping it waits for the buffer's pending uses, then deregisters it with
    /// `ncclCommWindowDeregister`.
    ///
    /// # Safety
    /// In every collective that uses the window's memory (as input or output), every rank
    /// passes its own window of the same [`Window::index`] at the same element offset as the
    /// others. NCCL's symmetric kernels and copy-engine collectives find a buffer's window by
    /// its start address and read and write the *peers'* memory at this rank's offset in that
    /// window: a rank that passes another window, another offset, or memory that is no window at
    /// all where the others pass one, makes them read or write a peer's window where that peer
    /// has other work tracked, a data race on its memory. So, too, every rank drops (or
    /// deregisters) its window of one index at the same place among its collectives on the
    /// communicator: a rank whose window is gone takes the ordinary path while its peers, still
    /// windowed, read and write its memory. handoff's verification compares each collective's
    /// kind, count, type and root, not yet its windows. (A one-rank communicator has no peer:
    /// there the rule always holds.)
    ///
    /// # Errors
    /// As above; [`Error::InvalidArgument`] for a communicator of several ranks made by
    /// [`Communicator::init_all`] (its ranks share a thread, and this call would wait for the
    /// others) or given to a graph; [`Error::Unsupported`]; [`Error::Timeout`] when another rank
    /// does not join within the timeout; NCCL errors (the communicator is then aborted, which
    /// ends the other ranks' wait in NCCL).
    pub unsafe fn register_window<'c, 'b, T: Pod>(
        &'c self,
        buf: &'b mut DeviceBuffer<T>,
    ) -> Result<Window<'c, 'b, T>> {
        self.check_not_in_graph()?;
        let world = self.world_size();
        if world > 1 && self.clique.is_some() {
            return Err(Error::InvalidArgument(
                "a window is registered by every rank at once, each on its own thread: make the \
                 ranks with Communicator::new (one thread each), not init_all"
                    .into(),
            ));
        }
        let lib = nc::register_lib();
        let side = WindowSide {
            nccl_memory: buf.is_nccl_alloc(),
            ptr: buf.as_raw_ptr() as usize,
            bytes: buf.byte_len(),
            already_window: buf.registrations.window,
            same_device: buf.device().same(self.device()),
            supported: lib.is_ok(),
            cumem_env: std::env::var("NCCL_CUMEM_ENABLE")
                .ok()
                .and_then(|v| v.trim().parse().ok()),
        };
        let refusal = side.refusal();
        // Every attempt takes a number and is exchanged, refused or not, so that the k-th
        // exchange is the k-th attempt on every rank.
        let index = self.shared.windows.fetch_add(1, Ordering::Relaxed);
        if world > 1 {
            let cards = self.all_gather_words(&window_card(index, side.bytes, refusal))?;
            if refusal.is_none() {
                check_window_cards(self.rank(), &cards).map_err(|detail| Error::Mismatch { detail })?;
            }
        }
        if let Some(r) = refusal {
            return Err(match (r, lib) {
                (Refusal::Unsupported, Err(e)) => e,
                _ => Error::InvalidArgument(format!("window #{index}: {}", r.describe())),
            });
        }
        let win = {
            let state = self.shared.lock();
            let raw = usable(&state)?;
            self.device().set_current()?;
            let started = Instant::now();
            // SAFETY: `raw` is live and not used concurrently (lock held); handoff's groups
            // close before they return, and raw ones are closed before handoff's calls
            // (`group_start`'s contract); every rank calls this with the same size as its
            // window #index (exchanged above; a one-rank communicator has no other); the memory
            // is one ncclMemAlloc allocation at offset 0 (a whole buffer), 4096-aligned, not a
            // window yet (checked), exclusively borrowed by the window, which deregisters it
            // before the borrow ends (or, forgotten, leaves the mark that makes the buffer leak
            // it).
            let r = unsafe {
                nc::comm_window_register(
                    raw,
                    buf.as_raw_mut_ptr().cast(),
                    side.bytes,
                    NCCL_WIN_COLL_SYMMETRIC as i32,
                )
            }
            .and_then(|(win, pending)| {
                if pending {
                    // SAFETY: `raw` is live.
                    unsafe { nc::wait_ready(raw, "ncclCommWindowRegister", started, self.timeout()) }?;
                }
                Ok(win)
            });
            drop(state);
            // Other ranks may be inside NCCL's barrier: aborting this rank ends their wait.
            r.inspect_err(|e| self.break_with(e))?
        };
        buf.registrations.count += 1;
        buf.registrations.window = true;
        Ok(Window {
            comm: self,
            buf,
            win,
            index,
            _not_send: PhantomData,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side() -> WindowSide {
        WindowSide {
            nccl_memory: true,
            ptr: 0x7f00_0020_0000,
            bytes: 4096,
            already_window: false,
            same_device: true,
            supported: true,
            cumem_env: None,
        }
    }

    #[test]
    fn a_window_needs_nccl_memory_aligned_not_already_a_window() {
        assert_eq!(side().refusal(), None);
        let cases = [
            (
                WindowSide {
                    nccl_memory: false,
                    ..side()
                },
                Refusal::NotNcclMemory,
            ),
            (
                WindowSide {
                    ptr: side().ptr + 256,
                    ..side()
                },
                Refusal::Misaligned,
            ),
            (
                WindowSide {
                    already_window: true,
                    ..side()
                },
                Refusal::AlreadyWindow,
            ),
            (WindowSide { bytes: 0, ..side() }, Refusal::Empty),
            (
                WindowSide {
                    supported: false,
                    ..side()
                },
                Refusal::Unsupported,
            ),
            (
                WindowSide {
                    cumem_env: Some(0),
                    ..side()
                },
                Refusal::CuMemDisabled,
            ),
            (
                WindowSide {
                    same_device: false,
                    ..side()
                },
                Refusal::OtherDevice,
            ),
        ];
        for (s, want) in cases {
            assert_eq!(s.refusal(), Some(want), "{s:?}");
            assert_eq!(Refusal::from_code(want as u64), Some(want));
        }
        assert_eq!(
            WindowSide {
                cumem_env: Some(1),
                ..side()
            }
            .refusal(),
            None
        );
    }

    fn cards(each: &[[u64; CARD_WORDS]]) -> Vec<u64> {
        each.iter().flatten().copied().collect()
    }

    #[test]
    fn every_rank_must_register_the_same_size_in_the_same_order() {
        let ok = cards(&[window_card(2, 8192, None), window_card(2, 8192, None)]);
        assert_eq!(check_window_cards(0, &ok), Ok(()));
        assert_eq!(check_window_cards(1, &ok), Ok(()));
        // Sizes differ: both ranks see it, each naming the other.
        let sizes = cards(&[window_card(0, 8192, None), window_card(0, 4096, None)]);
        let e0 = check_window_cards(0, &sizes).unwrap_err();
        assert!(e0.contains("rank 1 registers 4096 bytes, rank 0 8192"), "{e0}");
        let e1 = check_window_cards(1, &sizes).unwrap_err();
        assert!(e1.contains("rank 0 registers 8192 bytes, rank 1 4096"), "{e1}");
        // Order: the ranks are at different registrations.
        let order = cards(&[window_card(3, 8192, None), window_card(4, 8192, None)]);
        assert!(
            check_window_cards(0, &order)
                .unwrap_err()
                .contains("#4 while rank 0 is at #3")
        );
        // One rank refuses (its memory is not from ncclMemAlloc): the other is told why.
        let refused = cards(&[
            window_card(0, 8192, None),
            window_card(0, 8192, Some(Refusal::NotNcclMemory)),
        ]);
        let e = check_window_cards(0, &refused).unwrap_err();
        assert!(
            e.contains("rank 1 cannot make its buffer window #0") && e.contains("ncclMemAlloc"),
            "{e}"
        );
        // A short card is refused, not read past.
        assert!(check_window_cards(0, &[0, 8192, 0, 0]).is_err());
        assert!(check_window_cards(2, &ok).is_err());
    }
}
