//! Interop with [cudarc](https://docs.rs/cudarc) 0.19 (feature `cudarc`): a handoff [`Stream`]
//! over a cudarc stream; handoff memory lent to cudarc and cudarc memory borrowed by handoff,
//! both tracked and neither moved; and buffers moved between cudarc's `CudaSlice` and
//! [`DeviceBuffer`] after their pending uses.
//!
//! cudarc drives CUDA through the driver API and handoff through the runtime; under a device's
//! *primary* context the two share handles (a `CUstream` is a `cudaStream_t`, a `CUdeviceptr`
//! a device pointer). Only primary contexts with stream-ordered allocation are accepted.
//!
//! # Lending and borrowing
//! Both go across a `Stream` made by [`Stream::from_cudarc`], inside a closure, and neither
//! blocks the host: each side's tracking waits for the other's on the GPU, and records its own
//! use where the other looks for it, on every path out of the closure, a panic included.
//!
//! - **handoff to cudarc**: [`Stream::lend_to_cudarc`] and [`Stream::lend_to_cudarc_mut`] give
//!   the closure a [`CudarcView`] or [`CudarcViewMut`] of a buffer or a view: cudarc's safe
//!   copies take them where they take a `CudaView` (`DevicePtr`, `DevicePtrMut`), and a
//!   launch builder takes their pointer (`kernel_arg`). The cudarc stream first waits for the
//!   buffer's conflicting handoff uses; afterwards an event recorded there is the buffer's use.
//! - **cudarc to handoff**: [`Stream::borrow_from_cudarc`] and
//!   [`Stream::borrow_from_cudarc_mut`] give the closure a handoff [`View`] or [`ViewMut`] of a
//!   `CudaSlice`, `CudaView` or `CudaViewMut`, usable by every handoff operation (NCCL sends,
//!   receives and collectives, copies, kernels) on any handoff stream. The stream first waits
//!   for cudarc's write (and, to write, read) event; afterwards it waits for every handoff use
//!   of the view, and cudarc's read (or write) event is recorded there, so cudarc's own
//!   tracking, and the slice's free, order after handoff's work.
//!
//! Why closures: cudarc's model lets safe code keep a pointer's `SyncOnDrop` or a view as long
//! as it likes, and forget them; handoff could then not record the use it must, and would free,
//! or hand back, memory that cudarc work still uses. Inside a closure the views cannot escape
//! (their lifetimes end with it), and the end of the lend or borrow runs on every path. What
//! cudarc's model cannot see is refused or panics instead of going untracked:
//! - while a buffer is lent, its uses on other streams that conflict with the lend (a graph's
//!   replay, the other half of a split, a read during a write lend) are refused with
//!   [`Error::InvalidArgument`]: the lent work has no event yet that they could wait for;
//! - while memory is lent or borrowed across a stream, no [`crate::Graph`] capture begins on it
//!   or joins it ([`Error::Capture`]): the lent work would be captured, untracked, and the
//!   events that end the lend would be graph nodes, not work that runs;
//! - a lent view given to cudarc with another cudarc stream than the lend's panics before
//!   cudarc queues anything: handoff can neither order work there nor know whether that stream
//!   is being captured;
//! - only cudarc's own slices and views can be borrowed ([`CudarcMemory`] is sealed): any type
//!   can implement `DevicePtr`, with any pointer.
//!
//! cudarc keeps one read event per slice, and tracks with events only while its context
//! manages synchronisation (more than one stream, event tracking on): see
//! [`Stream::borrow_from_cudarc`] for what follows.
//!
//! # Captures
//! cudarc lets any thread begin a graph capture on any of its streams from safe code, and
//! handoff cannot see one begin. So handoff queues work only on cudarc streams it wraps, and
//! wrapping one ([`Stream::from_cudarc`]) is `unsafe`: its caller promises that no capture
//! begins there outside [`crate::Graph`] while the wrapper lives. Moving a slice into handoff
//! needs such a wrapper of the slice's stream; moving a buffer out waits for its uses on the
//! host and queues nothing of handoff's on cudarc's stream. To launch through cudarc's builder
//! on buffers that stay handoff's without a lend, queue it inside the `unsafe`
//! [`Stream::raw_use`] on a wrapper of the builder's stream.
//!
//! # Moving
//! cudarc tracks a slice with one read and one write event, and only while its context manages
//! synchronisation; handoff orders a moved buffer after exactly what cudarc's own `Drop` would
//! wait for, and hands a buffer to cudarc once every handoff use has completed, with cudarc's
//! write event recorded on the slice's stream. A report of an NCCL receive cut short (see
//! [`Stream::synchronize`]) follows memory into cudarc neither when moved nor when borrowed.

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
    SyncOnDrop,
};

use crate::cuda::buffer::DeviceBuffer;
use crate::cuda::view::{View, ViewMut};
use crate::engine::Tracked;
use crate::engine::device::Device;
use crate::engine::lend::{HeldOff, Lent};
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::error::{Error, Result};
use crate::result::cudart as cu;

/// The special handles: the legacy default stream (`0`, and `cudaStreamLegacy`, `1`), which
/// names the *current* device's, and the per-thread default stream (`2`), a different stream on
/// every thread. handoff calls some runtime functions on a stream without making its device
/// current first, and orders work per stream: neither fits.
fn check_handle(raw: cudarc::driver::sys::CUstream, what: &str) -> Result<()> {
    if (raw as usize) <= 2 {
        return Err(Error::InvalidArgument(format!(
            "{what} is a default stream of cudarc's (legacy or per-thread), which names a \
             different stream by device or thread; use one made by new_stream()"
        )));
    }
    Ok(())
}

fn cudarc_error(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::Cudarc {
        call,
        code: e.0 as i32,
        message: e.to_string(),
    }
}

/// The context must be `device`'s primary one, with stream-ordered allocation, and error-free.
fn check_context(ctx: &Arc<CudaContext>, device: &Device) -> Result<()> {
    ctx.check_err().map_err(|e| cudarc_error("cudarc's context", e))?;
    let problem = if !ctx.is_primary() {
        Some("is not a primary context: handoff shares handles only under the primary context".to_string())
    } else if ctx.ordinal() != device.ordinal() {
        Some(format!(
            "is on device {}, not {}",
            ctx.ordinal(),
            device.ordinal()
        ))
    } else if !ctx.has_async_alloc() {
        Some("has no stream-ordered allocation (cuMemAllocAsync), which handoff frees with".into())
    } else {
        None
    };
    match problem {
        Some(p) => Err(Error::InvalidArgument(format!("the cudarc context {p}"))),
        None => Ok(()),
    }
}

impl Stream {
    /// A handoff stream over `stream`'s handle: the same queue, kept alive as long as the
    /// returned `Stream`. Work queued on either is in one order.
    ///
    /// # Safety
    /// While the returned `Stream` lives, no capture into a CUDA graph begins on `stream` except
    /// through [`crate::Graph`] on the returned `Stream`: not cudarc's safe
    /// `CudaStream::begin_capture`, nor a raw `cuStreamBeginCapture` or
    /// `cudaStreamBeginCapture`, on any thread. handoff refuses tracked work on a stream
    /// captured outside it, but it can only ask before it queues (cudarc takes no lock of
    /// handoff's): a capture begun between that question and the work would take the work, and
    /// the events that track it, into someone else's graph. That graph would replay the work
    /// untracked, perhaps after its buffers are freed, and later waits on those events would
    /// order nothing. Captures through [`crate::Graph`] are ordered with handoff's work by the
    /// stream's lock, and need no promise.
    ///
    /// Without `unsafe`, a call does not compile:
    /// ```compile_fail,E0133
    /// fn wrap(s: &std::sync::Arc<cudarc::driver::CudaStream>, d: &handoff::Device) {
    ///     let _ = handoff::Stream::from_cudarc(s, d);
    /// }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a context that is not `device`'s primary one, for
    /// cudarc's per-thread default stream (a different stream on each thread), or for a stream
    /// another live handoff `Stream` already wraps; [`Error::Cudarc`] for an error cudarc had
    /// stashed.
    pub unsafe fn from_cudarc(stream: &Arc<CudaStream>, device: &Device) -> Result<Stream> {
        check_context(stream.context(), device)?;
        let raw = stream.cu_stream();
        check_handle(raw, "the cudarc stream")?;
        // SAFETY: a cudarc stream of the device's primary context is a runtime stream of the
        // device; the Arc kept in the Stream keeps it alive.
        unsafe { Stream::from_owned_handle(raw.cast(), device, stream.clone()) }
    }
}

impl Stream {
    /// The cudarc stream this `Stream` wraps ([`Stream::from_cudarc`]).
    fn cudarc_stream(&self) -> Result<Arc<CudaStream>> {
        self.owner
            .clone()
            .and_then(|o| o.downcast::<CudaStream>().ok())
            .ok_or_else(|| {
                Error::InvalidArgument(
                    "memory is lent to or borrowed from cudarc only across a Stream made by \
                     Stream::from_cudarc from the cudarc stream that queues cudarc's work"
                        .into(),
                )
            })
    }

    /// Lends `buf` to cudarc, to be read by the cudarc work `f` queues on the cudarc stream
    /// this `Stream` wraps ([`Stream::from_cudarc`]), through the [`CudarcView`] it is given:
    /// a cudarc copy (`memcpy_dtoh`, `memcpy_dtod`, `clone_dtoh`, ...) or a kernel argument.
    /// Nothing blocks the host:
    /// - before `f` runs, the stream waits, on the GPU, for the buffer's last write on any
    ///   other stream;
    /// - while `f` runs, a write of the buffer on another stream (a graph's replay, the other
    ///   half of a split) is refused with [`Error::InvalidArgument`], since cudarc's work has no
    ///   event yet to wait for, and no graph capture begins on the stream;
    /// - once `f` returns, or unwinds, an event recorded on the stream after cudarc's work is
    ///   the buffer's use there, which later writes and frees wait for.
    ///
    /// The view cannot leave `f`, so cudarc's safe API cannot use the memory after the lend.
    /// On any other cudarc stream it panics before cudarc queues anything (see
    /// [`CudarcView`]).
    ///
    /// ```no_run
    /// # fn main() -> handoff::Result<()> {
    /// use handoff::{Device, DeviceBuffer, Stream};
    /// let dev = Device::new(0)?;
    /// let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    /// let cs = ctx.new_stream().unwrap();
    /// // SAFETY: no graph capture begins on `cs` outside handoff::Graph.
    /// let s = unsafe { Stream::from_cudarc(&cs, &dev)? };
    /// let x = DeviceBuffer::<f32>::from_slice(&[1.0; 256], &Stream::new(&dev)?)?;
    /// let mut host = vec![0.0f32; 256];
    /// s.lend_to_cudarc(&x, |v| cs.memcpy_dtoh(v, &mut host))?.unwrap();
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `Stream` not made by [`Stream::from_cudarc`], a buffer
    /// of another device, or one lent for writing on another stream; [`Error::Capture`] while
    /// the stream is being captured; CUDA errors (after `f`, from the event that ends the lend:
    /// the host has then waited for the stream instead).
    pub fn lend_to_cudarc<'b, T: Pod, R>(
        &self,
        buf: impl Into<View<'b, T>>,
        f: impl FnOnce(&CudarcView<'_, T>) -> R,
    ) -> Result<R> {
        let buf = buf.into();
        let cs = self.cudarc_stream()?;
        let lent = Lent::open(self, buf.tracked(), Access::Read)?;
        let view = CudarcView {
            ptr: buf.as_raw_ptr() as usize as CUdeviceptr,
            len: buf.len(),
            stream: &cs,
            _marker: PhantomData,
        };
        let out = f(&view);
        lent.close()?;
        Ok(out)
    }

    /// Lends `buf` to cudarc to be written (and read), as [`Stream::lend_to_cudarc`] lends it
    /// to be read: the stream first waits for every earlier use of the buffer on other streams;
    /// while `f` runs, every use of the buffer on another stream is refused; after it, the
    /// event recorded after cudarc's work is the buffer's last write.
    ///
    /// # Errors
    /// As [`Stream::lend_to_cudarc`]; [`Error::InvalidArgument`] also for a buffer lent on
    /// another stream at all.
    pub fn lend_to_cudarc_mut<'b, T: Pod, R>(
        &self,
        buf: impl Into<ViewMut<'b, T>>,
        f: impl FnOnce(&mut CudarcViewMut<'_, T>) -> R,
    ) -> Result<R> {
        let mut buf = buf.into();
        let cs = self.cudarc_stream()?;
        let lent = Lent::open(self, buf.tracked(), Access::Write)?;
        let mut view = CudarcViewMut {
            ptr: buf.as_raw_mut_ptr() as usize as CUdeviceptr,
            len: buf.len(),
            stream: &cs,
            _marker: PhantomData,
        };
        let out = f(&mut view);
        lent.close()?;
        Ok(out)
    }

    /// Borrows cudarc memory (a `&CudaSlice`, `&CudaView` or `&CudaViewMut`) as a handoff
    /// [`View`], to be read by handoff operations (sends, copies, kernels) that `f` queues on
    /// any handoff stream, without moving it. This `Stream` must wrap a cudarc stream
    /// ([`Stream::from_cudarc`]); nothing blocks the host:
    /// - before `f` runs, this stream waits, on the GPU, for cudarc's write event of the memory
    ///   (what any cudarc read of it waits for), and the view's uses on other streams wait for
    ///   that;
    /// - once `f` returns, or unwinds, this stream waits for every handoff use of the view, on
    ///   every stream, and cudarc's read event is recorded there after them, so cudarc's own
    ///   tracking orders its later writes, and the slice's free, after handoff's reads. A graph
    ///   that captured a use of the view can no longer be launched.
    ///
    /// cudarc keeps one read event per slice: a cudarc read on another stream recorded after
    /// this one replaces it, and a later cudarc write then waits for that read only (cudarc's
    /// rule for its own reads as well). Borrow with [`Stream::borrow_from_cudarc_mut`] to have
    /// handoff's reads recorded in the write event instead. If cudarc tracks no events for it
    /// (cudarc's `disable_event_tracking`, in the memory's context object or the wrapped
    /// stream's), the memory must belong to the stream this `Stream` wraps, which then orders
    /// everything, cudarc's free included. A report of an NCCL receive cut short does not
    /// follow the memory back to cudarc.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `Stream` not made by [`Stream::from_cudarc`], memory of
    /// another device or context, or memory whose context tracks no events and that belongs
    /// to another stream; [`Error::Capture`] while the stream is being captured; CUDA errors,
    /// and [`Error::Cudarc`] for an error cudarc stashed (after `f`, the host has then waited
    /// for handoff's uses instead).
    pub fn borrow_from_cudarc<T: Pod, M: CudarcMemory<T>, R>(
        &self,
        memory: &M,
        f: impl FnOnce(View<'_, T>) -> R,
    ) -> Result<R> {
        let (len, cs) = self.check_borrow::<T>(memory.stream(), memory.len())?;
        let held_off = self.hold_off_captures()?;
        let tracked = Tracked::new(self.device());
        // Waits for cudarc's write event here; what cudarc records at the end is its read.
        let (ptr, record) = memory.device_ptr(&cs);
        let back = GiveBack::start(self, &tracked, record, memory.stream().context(), held_off)?;
        // SAFETY: cudarc's pointer to `len` elements of `T` (any bit pattern is a valid `T`),
        // borrowed shared for as long as `memory` is, which outlives the view: `f` cannot keep
        // it. Its uses are tracked by `tracked`, which `back` hands back to cudarc.
        let view = unsafe { View::from_raw(ptr as usize as *const T, len, &tracked) };
        let out = f(view);
        back.finish()?;
        Ok(out)
    }

    /// Borrows cudarc memory (a `&mut CudaSlice` or `&mut CudaViewMut`) as a handoff
    /// [`ViewMut`], to be written and read by handoff operations (receives, copies, kernels)
    /// that `f` queues, as [`Stream::borrow_from_cudarc`] borrows it to be read: this stream
    /// first waits for cudarc's read and write events; afterwards it waits for every handoff
    /// use of the view, and cudarc's write event is recorded there, which every later cudarc
    /// use (and the free) waits for.
    ///
    /// # Errors
    /// As [`Stream::borrow_from_cudarc`].
    pub fn borrow_from_cudarc_mut<T: Pod, M: CudarcMemoryMut<T>, R>(
        &self,
        memory: &mut M,
        f: impl FnOnce(ViewMut<'_, T>) -> R,
    ) -> Result<R> {
        let (len, cs) = self.check_borrow::<T>(memory.stream(), memory.len())?;
        let ctx = memory.stream().context().clone();
        let held_off = self.hold_off_captures()?;
        let tracked = Tracked::new(self.device());
        // Waits for cudarc's read and write events here; what cudarc records at the end is its
        // write.
        let (ptr, record) = memory.device_ptr_mut(&cs);
        let back = GiveBack::start(self, &tracked, record, &ctx, held_off)?;
        // SAFETY: cudarc's pointer to `len` elements of `T` (any bit pattern is a valid `T`),
        // borrowed exclusively for as long as `memory` is, which outlives the view: `f` cannot
        // keep it. Its uses are tracked by `tracked`, which `back` hands back to cudarc.
        let view = unsafe { ViewMut::from_raw(ptr as usize as *mut T, len, &tracked) };
        let out = f(view);
        back.finish()?;
        Ok(out)
    }

    /// The checks of a borrow of `len` elements of `T` of cudarc memory of `owner`'s, and the
    /// cudarc stream this one wraps: the memory's context is this stream's device's primary
    /// one; its size fits; unless cudarc tracks it with events, it belongs to the stream this
    /// one wraps.
    fn check_borrow<T>(&self, owner: &Arc<CudaStream>, len: usize) -> Result<(usize, Arc<CudaStream>)> {
        let cs = self.cudarc_stream()?;
        check_context(owner.context(), self.device())?;
        crate::cuda::buffer::byte_len::<T>(len)?;
        // cudarc waits for the memory's events if the memory's context object manages
        // synchronisation, and records one at the end if the stream's does. Only with one
        // context object does that hold until cudarc's wait: the wrapped stream (never a
        // default one, see `check_handle`), alive while this borrow holds it, keeps that object
        // managing; another object (a second `CudaContext::new` of the same primary context)
        // could stop between this check and the wait, when its last other stream drops.
        let by_events =
            Arc::ptr_eq(owner.context(), cs.context()) && cs.context().is_managing_stream_synchronization();
        let same = std::ptr::eq(owner.cu_stream(), cs.cu_stream());
        if !by_events && !same {
            return Err(Error::InvalidArgument(
                "cudarc's events order this memory's uses here only when it belongs to the \
                 wrapped stream's own context object with event tracking on (it is another \
                 object's, or tracking is off), so only its own stream orders its uses: borrow \
                 it on a Stream made by Stream::from_cudarc from that stream (memory.stream())"
                    .into(),
            ));
        }
        Ok((len, cs))
    }
}

/// Hands borrowed cudarc memory back to cudarc, on every path out of the borrow: the stream
/// waits for every handoff use of it, then cudarc's event (`record`) is recorded there.
struct GiveBack<'a> {
    stream: &'a Stream,
    tracked: &'a Tracked,
    record: Option<SyncOnDrop<'a>>,
    ctx: &'a Arc<CudaContext>,
    _held_off: HeldOff<'a>,
}

impl<'a> GiveBack<'a> {
    /// Makes the handoff uses of the memory wait for cudarc's, which `stream` now waits for:
    /// a write with nothing to do, whose event later uses on other streams wait for.
    fn start(
        stream: &'a Stream,
        tracked: &'a Tracked,
        record: SyncOnDrop<'a>,
        ctx: &'a Arc<CudaContext>,
        held_off: HeldOff<'a>,
    ) -> Result<GiveBack<'a>> {
        let back = GiveBack {
            stream,
            tracked,
            record: Some(record),
            ctx,
            _held_off: held_off,
        };
        ctx.check_err()
            .map_err(|e| cudarc_error("DevicePtr::device_ptr", e))?;
        stream.enqueue(&[(tracked, Access::Write)], |_| Ok(()))?;
        Ok(back)
    }

    fn finish(mut self) -> Result<()> {
        self.give_back()
    }

    fn give_back(&mut self) -> Result<()> {
        let Some(record) = self.record.take() else {
            return Ok(());
        };
        // What a write here must wait for (the tracker's rule: every use on another stream),
        // then retired, under one lock, as a free is: every use recorded before is in
        // `pending`, and a graph that captured a use of the view is refused after.
        let pending: Vec<_> = {
            let mut uses = self.tracked.lock();
            let pending = uses.waits(self.stream.id(), Access::Write).cloned().collect();
            uses.retire();
            pending
        };
        let mut waited = Ok(());
        for e in &pending {
            // SAFETY: the stream is live, and captured by no one (captures are held off); the
            // event is kept alive by `pending`.
            waited = unsafe { cu::stream_wait_event(self.stream.as_raw(), e.raw) };
            if waited.is_err() {
                // cudarc's event cannot be ordered after handoff's uses on the GPU: the host
                // waits for them instead (failing only in CUDA's sticky error state, where no
                // further work runs).
                let _ = crate::engine::device::wait_all(&pending);
                break;
            }
        }
        // cudarc records its event on the stream, after the waits.
        drop(record);
        waited?;
        self.ctx
            .check_err()
            .map_err(|e| cudarc_error("recording cudarc's event after a borrow", e))
    }
}

impl Drop for GiveBack<'_> {
    fn drop(&mut self) {
        let _ = self.give_back();
    }
}

mod sealed {
    pub trait Sealed {}
}

/// cudarc memory that [`Stream::borrow_from_cudarc`] can borrow: cudarc's own `CudaSlice`,
/// `CudaView` and `CudaViewMut`, whose pointers and lengths handoff trusts. Sealed: any type
/// may implement cudarc's `DevicePtr`, with any pointer.
pub trait CudarcMemory<T>: DevicePtr<T> + sealed::Sealed {}

/// cudarc memory that [`Stream::borrow_from_cudarc_mut`] can borrow: `CudaSlice` and
/// `CudaViewMut`. Sealed, as [`CudarcMemory`].
pub trait CudarcMemoryMut<T>: DevicePtrMut<T> + sealed::Sealed {}

impl<T> sealed::Sealed for CudaSlice<T> {}
impl<T> sealed::Sealed for CudaView<'_, T> {}
impl<T> sealed::Sealed for CudaViewMut<'_, T> {}
impl<T> CudarcMemory<T> for CudaSlice<T> {}
impl<T> CudarcMemory<T> for CudaView<'_, T> {}
impl<T> CudarcMemory<T> for CudaViewMut<'_, T> {}
impl<T> CudarcMemoryMut<T> for CudaSlice<T> {}
impl<T> CudarcMemoryMut<T> for CudaViewMut<'_, T> {}

/// A handoff buffer (or view) lent to cudarc to be read, inside [`Stream::lend_to_cudarc`]:
/// cudarc's safe copies take it wherever they take a `CudaView` (it implements `DevicePtr`),
/// and [`CudarcView::kernel_arg`] passes it to a kernel.
///
/// Only on the cudarc stream the lend is across: handoff cannot order cudarc work on another
/// stream (nor know whether someone is capturing it into a graph), so `device_ptr` for any
/// other stream panics, before cudarc queues anything; so does a copy to another context
/// (`memcpy_dtod` or `clone_dtod` on a stream of another device), which cudarc queues on the
/// destination's stream.
pub struct CudarcView<'v, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'v Arc<CudaStream>,
    _marker: PhantomData<&'v [T]>,
}

/// A handoff buffer (or view) lent to cudarc to be written, inside
/// [`Stream::lend_to_cudarc_mut`]: as [`CudarcView`], taken also where cudarc writes
/// (`DevicePtrMut`: `memcpy_htod`, `memcpy_dtod`'s target, `memset_zeros`).
pub struct CudarcViewMut<'v, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'v Arc<CudaStream>,
    _marker: PhantomData<&'v mut [T]>,
}

/// Panics unless the work a view's pointer is taken for goes on `lent`, the stream it is lent
/// across (see [`CudarcView`]): `used` must be that stream, and the current context its own.
/// cudarc queues work on a stream other than the one it gives `device_ptr` in one place: a copy
/// from another context's memory (`memcpy_dtod` between contexts, a peer copy) takes the
/// source's pointer for its own stream but queues the copy on the destination's, with the
/// destination's context current; that context is how it is told apart.
fn check_lent_on(lent: &CudaStream, used: &CudaStream) {
    assert!(
        std::ptr::eq(lent.cu_stream(), used.cu_stream()),
        "a handoff buffer lent to cudarc was used on another cudarc stream than the one it is \
         lent across, where handoff cannot order the work: queue it on that stream"
    );
    let current = cudarc::driver::result::ctx::get_current();
    assert!(
        matches!(current, Ok(None)) || matches!(current, Ok(Some(c)) if c == lent.context().cu_ctx()),
        "a handoff buffer lent to cudarc was used with another CUDA context current (a copy \
         between contexts queues on the other context's stream), where handoff cannot order the \
         work: copy within the lend's context, on the stream it is lent across"
    );
}

impl<T> CudarcView<'_, T> {
    /// The device pointer, for a cudarc launch builder: `.arg(view.kernel_arg())`. The
    /// builder borrows the view, so the launch comes before the lend ends. cudarc's `launch`
    /// is `unsafe`; its caller promises, besides what cudarc asks, that the launch is on the
    /// stream the view is lent across and that the kernel only reads the view's `len()`
    /// elements.
    pub fn kernel_arg(&self) -> &CUdeviceptr {
        &self.ptr
    }
}

impl<T> CudarcViewMut<'_, T> {
    /// The device pointer, for a cudarc launch builder, as [`CudarcView::kernel_arg`]; the
    /// kernel may read and write the view's `len()` elements.
    pub fn kernel_arg(&self) -> &CUdeviceptr {
        &self.ptr
    }
}

impl<T> DeviceSlice<T> for CudarcView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DeviceSlice<T> for CudarcViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for CudarcView<'_, T> {
    /// The pointer, for work on `stream`, which must be the one the view is lent across (else
    /// this panics). Nothing to wait for (the lend did) or to record (its end does).
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        check_lent_on(self.stream, stream);
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtr<T> for CudarcViewMut<'_, T> {
    /// As [`CudarcView`]'s.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        check_lent_on(self.stream, stream);
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for CudarcViewMut<'_, T> {
    /// As [`CudarcView`]'s `device_ptr`, to write.
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        check_lent_on(self.stream, stream);
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> std::fmt::Debug for CudarcView<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudarcView").field("len", &self.len).finish()
    }
}

impl<T> std::fmt::Debug for CudarcViewMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudarcViewMut").field("len", &self.len).finish()
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Moves a cudarc slice into a handoff buffer, on `stream`, which must wrap the slice's own
    /// cudarc stream ([`Stream::from_cudarc`]): every later use waits, on the GPU, for the
    /// slice's pending uses (what cudarc's own `Drop` would wait for), and handoff frees the
    /// memory after its last use.
    ///
    /// The slice's stream must be wrapped because the move queues work on it (cudarc's waits
    /// for the slice's events, and the event that tracks them): through the wrapping `Stream`
    /// that work is ordered with handoff's graph captures by the stream's lock, and with
    /// cudarc's by the promise [`Stream::from_cudarc`] asks for.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `stream` does not wrap the slice's stream, and as
    /// [`Stream::from_cudarc`] for the slice's context; [`Error::Capture`] while a graph is
    /// being captured on the stream (the slice is then dropped by cudarc, after its uses); CUDA
    /// errors. If an error comes after the slice has been given up, its memory is leaked rather
    /// than freed while in use.
    pub fn from_cudarc(slice: CudaSlice<T>, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let device = stream.device().clone();
        check_context(slice.context(), &device)?;
        if !std::ptr::eq(
            slice.stream().cu_stream().cast::<()>(),
            stream.as_raw().cast::<()>(),
        ) {
            return Err(Error::InvalidArgument(
                "the slice's cudarc stream is not the one this handoff Stream wraps: move it on \
                 a Stream made with Stream::from_cudarc from the slice's own stream \
                 (slice.stream())"
                    .into(),
            ));
        }
        let len = slice.len();
        crate::cuda::buffer::byte_len::<T>(len)?;
        if len == 0 {
            drop(slice);
            return DeviceBuffer::zeros(0, stream);
        }
        let ctx = slice.context().clone();
        // Under the stream's order, outside any capture: cudarc queues the waits for the slice's
        // read and write events on its stream (the one `stream` wraps) and gives the memory up
        // without freeing it.
        let ptr = stream.outside_capture("moving a cudarc slice into handoff", || {
            stream.check_not_captured_elsewhere()?;
            Ok(slice.leak())
        })?;
        ctx.check_err().map_err(|e| cudarc_error("CudaSlice::leak", e))?;
        // SAFETY: the memory is a cuMemAllocAsync allocation of `len` elements (checked:
        // stream-ordered allocation) that cudarc gave up; the enqueue below makes its pending
        // uses, waited for on this stream, the buffer's first tracked use.
        let buf = unsafe { DeviceBuffer::from_raw_parts(ptr as usize as *mut T, len, &device) };
        // A write with nothing to do: its event, recorded after cudarc's waits, is what later
        // uses of the buffer wait for.
        let ordered = stream.enqueue(&[(buf.tracked(), Access::Write)], |_| Ok(()));
        if let Err(e) = ordered {
            // The buffer's tracking may not cover cudarc's pending work: leak the memory rather
            // than free it under that work.
            std::mem::forget(buf);
            return Err(e);
        }
        Ok(buf)
    }

    /// Moves the buffer into a cudarc slice on `stream`, once every pending handoff use of it
    /// has completed (the host waits for them), so whatever cudarc then queues, on any stream
    /// and in any capture, comes after them. cudarc frees the memory when the slice drops.
    ///
    /// The wait is on the host, not queued on `stream`: handoff queues nothing on a cudarc
    /// stream it does not wrap, since it cannot know whether another thread is capturing it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer of zero-sized elements and a length above zero
    /// (it has no memory for cudarc to own and free), and as [`Stream::from_cudarc`]; CUDA
    /// errors (the buffer is then dropped the handoff way).
    pub fn into_cudarc(self, stream: &Arc<CudaStream>) -> Result<CudaSlice<T>> {
        check_movable::<T>(self.len())?;
        check_context(stream.context(), self.device())?;
        check_handle(stream.cu_stream(), "the cudarc stream")?;
        if self.is_empty() {
            return stream.null().map_err(|e| cudarc_error("CudaStream::null", e));
        }
        self.device().set_current()?;
        // SAFETY: the events are alive (borrowed from the tracker).
        let (ptr, len) = self.into_raw_parts(|e| unsafe { cu::event_synchronize(e.raw) })?;
        // SAFETY: a stream-ordered allocation of `len` elements of `T` (any bit pattern is a
        // valid T, and `T` has a size: checked), given up by handoff once every use of it has
        // completed; the context allocates asynchronously (checked), so cudarc's free of it is
        // valid.
        let mut slice = unsafe { stream.upgrade_device_ptr::<T>(ptr as u64, len) };
        // Records cudarc's write event on the stream.
        drop(slice.device_ptr_mut(stream));
        stream
            .context()
            .check_err()
            .map_err(|e| cudarc_error("CudaSlice::device_ptr_mut", e))?;
        Ok(slice)
    }
}

/// Refuses to hand cudarc `len > 0` elements of a zero-sized type: such a buffer owns no
/// memory (its pointer is dangling), and cudarc would free that pointer when the slice drops
/// (`cuMemFreeAsync` of an address it never allocated, an error that poisons its context).
fn check_movable<T>(len: usize) -> Result<()> {
    if std::mem::size_of::<T>() == 0 && len > 0 {
        return Err(Error::InvalidArgument(format!(
            "a buffer of {len} zero-sized elements ({}) owns no device memory for cudarc to \
             free: keep it in handoff (or make the cudarc slice with the cudarc stream's \
             null())",
            std::any::type_name::<T>()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_sized_elements_are_not_handed_to_cudarc() {
        match check_movable::<()>(3) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("3 zero-sized elements"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(check_movable::<()>(0).is_ok());
        assert!(check_movable::<f32>(3).is_ok());
        assert!(check_movable::<[u8; 0]>(usize::MAX).is_err());
    }
}
