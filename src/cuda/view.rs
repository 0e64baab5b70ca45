//! Views: part of a [`DeviceBuffer`], read ([`View`]) or written ([`ViewMut`]), usable by every
//! tracked operation (kernel launches, copies, fills, sends, receives).
//!
//! Tracking is per buffer, not per range: a use of a view is a use of its whole buffer. So a
//! write to one half waits for earlier reads of the other half too. That is sound whatever the
//! ranges, and costs nothing on the host beyond the buffer's own tracking; on the GPU it can
//! order operations on disjoint halves that could have overlapped. (Two halves from
//! [`ViewMut::split_at_mut`] may be written from two threads at once: the engine queues one
//! buffer's operations one at a time, and each write waits for the other's.)
//!
//! Like `&[T]` and `&mut [T]`, a view borrows its buffer: a `ViewMut` excludes every other use
//! of the buffer by safe code while it lives, except through the other half of a split.
//!
//! Every operation that takes a device buffer takes `impl Into<View>` (read) or
//! `impl Into<ViewMut>` (written): a `&DeviceBuffer` / `&mut DeviceBuffer` (either is read), a
//! view, or a reference to one (a `ViewMut` given by value is read as `&mut [T]` is). So halves from [`DeviceBuffer::split_at_mut`] and slices go wherever a
//! buffer goes (a registration borrows a whole buffer, as NCCL registers whole allocations):
//!
//! ```no_run
//! # fn main() -> handoff::Result<()> {
//! use std::time::Duration;
//! use handoff::{Communicator, Device, DeviceBuffer, HostBuffer, ReduceOp, Stream};
//! use handoff::{group, kernels};
//! let dev = Device::new(0)?;
//! let s = Stream::new(&dev)?;
//! let comm = Communicator::init_all(std::slice::from_ref(&dev))?.remove(0);
//! let other = DeviceBuffer::<f32>::from_slice(&[1.0; 4], &s)?;
//! let mut other2 = DeviceBuffer::<f32>::from_slice(&[1.0; 4], &s)?;
//! let mut host = HostBuffer::<f32>::zeros(4, &dev)?;
//! let mut buf = DeviceBuffer::<f32>::zeros(8, &s)?;
//! let (mut lo, mut hi) = buf.split_at_mut(4)?;
//! kernels::produce(&mut lo, 0, &s)?; // &mut ViewMut
//! kernels::twice(&lo, &mut hi, &s)?; // one half read, the other written
//! kernels::delayed_copy(&hi, &mut lo, Duration::ZERO, &s)?;
//! kernels::twice(other.slice(..)?, hi.slice_mut(..)?, &s)?; // View, ViewMut by value
//! kernels::twice(&other.view(), hi.reborrow(), &s)?; // &View
//! kernels::produce(lo.reborrow(), 1, &s)?;
//! lo.copy_from(&other, &s)?;
//! lo.copy_from(&hi, &s)?;
//! hi.fill(1.0, &s)?;
//! lo.copy_from_slice(&[0.0; 4], &s)?;
//! host.copy_from_device(&hi, &s)?;
//! host.copy_from_device(hi.reborrow(), &s)?; // a ViewMut read
//! lo.copy_from_host(&host, &s)?;
//! group(|g| {
//!     g.send(&comm, &lo, 0, &s)?;
//!     g.recv(&comm, &mut hi, 0, &s)
//! })?;
//! comm.all_reduce(&lo, &mut hi, ReduceOp::Sum, &s)?;
//! comm.all_reduce_in_place(&mut lo, ReduceOp::Sum, &s)?;
//! comm.broadcast(&mut hi, 0, &s)?;
//! let back: Vec<f32> = lo.to_vec(&s)?;
//! # drop(back);
//! let mut y2 = DeviceBuffer::<f32>::zeros(4, &s)?;
//! kernels::twice(&mut other2, &mut y2, &s)?; // a buffer borrowed exclusively, read
//! # Ok(())
//! # }
//! ```

use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use bytemuck::Pod;

use crate::cuda::buffer::DeviceBuffer;
use crate::engine::device::{Device, PooledEvent};
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::engine::{self, Tracked, TrackedUse};
use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::cudaMemcpyKind;

/// Part of a [`DeviceBuffer`], to be read. `Copy`, like `&[T]`.
pub struct View<'a, T: Pod> {
    ptr: *const T,
    len: usize,
    tracked: &'a Tracked,
    _marker: PhantomData<&'a [T]>,
}

/// Part of a [`DeviceBuffer`], to be written (and read), like `&mut [T]`.
pub struct ViewMut<'a, T: Pod> {
    ptr: *mut T,
    len: usize,
    tracked: &'a Tracked,
    _marker: PhantomData<&'a mut [T]>,
}

impl<T: Pod> Clone for View<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Pod> Copy for View<'_, T> {}

// SAFETY: a `View` only lets tracked reads of device memory happen, like `&[T]`; its tracker is
// behind a mutex.
unsafe impl<T: Pod + Sync> Send for View<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Pod + Sync> Sync for View<'_, T> {}
// SAFETY: a `ViewMut` is an exclusive borrow of its range, like `&mut [T]`; uses are tracked
// behind the buffer's mutex.
unsafe impl<T: Pod + Send> Send for ViewMut<'_, T> {}
// SAFETY: `&ViewMut` only allows reads.
unsafe impl<T: Pod + Sync> Sync for ViewMut<'_, T> {}

impl<T: Pod> std::fmt::Debug for View<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View")
            .field("len", &self.len)
            .field("device", &self.tracked.device.ordinal())
            .finish()
    }
}

impl<T: Pod> std::fmt::Debug for ViewMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ViewMut")
            .field("len", &self.len)
            .field("device", &self.tracked.device.ordinal())
            .finish()
    }
}

/// `range` as start..end within `len`, or an error naming both.
pub(crate) fn bounds(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e)),
        _ => Err(Error::InvalidArgument(format!(
            "range {:?}..{:?} is outside a view of {len} elements",
            range.start_bound(),
            range.end_bound()
        ))),
    }
}

impl<'a, T: Pod> View<'a, T> {
    /// # Safety
    /// `ptr` is `len` elements of the memory `tracked` tracks, readable for `'a`.
    pub(crate) unsafe fn from_raw(ptr: *const T, len: usize, tracked: &'a Tracked) -> Self {
        View {
            ptr,
            len,
            tracked,
            _marker: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a view of no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device the memory lives on.
    pub fn device(&self) -> &'a Device {
        &self.tracked.device
    }

    /// The raw device pointer, for calling CUDA or NCCL directly; see [`Stream::raw_use`] for
    /// doing so with tracking.
    pub fn as_raw_ptr(&self) -> *const T {
        self.ptr
    }

    pub(crate) fn tracked(&self) -> &'a Tracked {
        self.tracked
    }

    /// The elements `range` of this view.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<View<'a, T>> {
        let (s, e) = bounds(range, self.len)?;
        // SAFETY: s..e lies within this view's elements (device addresses: `wrapping_add`, as
        // they are not in a Rust allocation).
        Ok(unsafe { View::from_raw(self.ptr.wrapping_add(s), e - s, self.tracked) })
    }

    /// Copies the view to a new host vector, on `stream`, after the last write to its buffer.
    /// Blocks until the copy has completed (waiting for its own event, as
    /// [`ViewMut::copy_from_slice`] does); never forever behind an NCCL receive (see
    /// [`Stream::synchronize`]). On an error the vector's memory is leaked, never freed while
    /// the copy may write it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `stream` is on another device; [`Error::Capture`] while a
    /// graph is being captured on `stream` (nothing is copied); CUDA errors, including a
    /// fault in a kernel that wrote the buffer; [`Error::CommunicatorUnusable`] when the last
    /// write was an NCCL receive cut short by its communicator's abort.
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        let mut out: Vec<T> = Vec::with_capacity(self.len);
        let bytes = self.byte_len();
        let src = self.ptr.cast::<c_void>();
        let dst = out.as_mut_ptr().cast::<c_void>();
        let written_by = self.tracked.lock().last_write().cloned();
        // A graph would write the vector at every replay, long after it is returned.
        let copied = host_copy(
            stream,
            self.tracked,
            Access::Read,
            "copying to a host vector",
            |s| {
                if bytes == 0 {
                    return Ok(());
                }
                // SAFETY: `dst` has capacity for `bytes` bytes and stays allocated until the copy
                // can no longer write it (`host_copy` returns only then; on an error, `out` is
                // leaked); the stream waits for the last write.
                unsafe { cu::memcpy_async(dst, src, bytes, cudaMemcpyKind::cudaMemcpyDeviceToHost, s) }
            },
        );
        if let Err(e) = copied {
            // Perhaps partly written: never read as `T`s. Leaked rather than freed, so that
            // even a copy whose end could not be told (see `host_copy`) writes no freed memory.
            std::mem::forget(out);
            return Err(e);
        }
        // The copy has completed; its source may have been a receive that an abort cut short.
        crate::engine::device::check_poison(written_by.as_deref())?;
        // SAFETY: the copy above wrote all `len` elements, and any bit pattern is a valid `T`.
        unsafe { out.set_len(self.len) };
        Ok(out)
    }
}

impl<'a, T: Pod> ViewMut<'a, T> {
    /// # Safety
    /// `ptr` is `len` elements of the memory `tracked` tracks, writable for `'a` by this view
    /// alone among safe code.
    pub(crate) unsafe fn from_raw(ptr: *mut T, len: usize, tracked: &'a Tracked) -> Self {
        ViewMut {
            ptr,
            len,
            tracked,
            _marker: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a view of no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device the memory lives on.
    pub fn device(&self) -> &'a Device {
        &self.tracked.device
    }

    /// The raw device pointer, writable; see [`View::as_raw_ptr`].
    pub fn as_raw_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    pub(crate) fn tracked(&self) -> &'a Tracked {
        self.tracked
    }

    /// This view, to be read.
    pub fn as_view(&self) -> View<'_, T> {
        // SAFETY: the same elements, borrowed shared for as long as `self` is.
        unsafe { View::from_raw(self.ptr, self.len, self.tracked) }
    }

    /// A shorter-lived writable view of the same elements.
    pub fn reborrow(&mut self) -> ViewMut<'_, T> {
        // SAFETY: the same elements, borrowed exclusively for as long as `self` is.
        unsafe { ViewMut::from_raw(self.ptr, self.len, self.tracked) }
    }

    /// The elements `range`, to be read.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<View<'_, T>> {
        self.as_view().slice(range)
    }

    /// The elements `range`, to be written.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the view.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<ViewMut<'_, T>> {
        self.reborrow().into_slice_mut(range)
    }

    /// The elements `range`, to be written, for as long as this view would have lived.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the view.
    pub fn into_slice_mut(self, range: impl RangeBounds<usize>) -> Result<ViewMut<'a, T>> {
        let (s, e) = bounds(range, self.len)?;
        // SAFETY: s..e lies within this view's elements, which `self`, consumed, gives up.
        Ok(unsafe { ViewMut::from_raw(self.ptr.wrapping_add(s), e - s, self.tracked) })
    }

    /// Two writable views, of the elements before `mid` and from `mid` on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `mid` is beyond the view.
    pub fn split_at_mut(&mut self, mid: usize) -> Result<(ViewMut<'_, T>, ViewMut<'_, T>)> {
        if mid > self.len {
            return Err(Error::InvalidArgument(format!(
                "split at {mid} is beyond a view of {} elements",
                self.len
            )));
        }
        // SAFETY: 0..mid and mid..len are disjoint and within this view, borrowed exclusively.
        Ok(unsafe {
            (
                ViewMut::from_raw(self.ptr, mid, self.tracked),
                ViewMut::from_raw(self.ptr.wrapping_add(mid), self.len - mid, self.tracked),
            )
        })
    }

    /// Copies the view to a new host vector; see [`View::to_vec`].
    ///
    /// # Errors
    /// As [`View::to_vec`].
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        self.as_view().to_vec(stream)
    }

    /// Sets every byte to zero, on `stream`, after every earlier use of the buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `stream` is on another device; CUDA errors.
    pub fn memset_zero(&mut self, stream: &Stream) -> Result<()> {
        let (ptr, bytes) = (self.ptr.cast::<c_void>(), self.byte_len());
        stream.enqueue(&[(self.tracked, Access::Write)], |s| {
            if bytes == 0 {
                return Ok(());
            }
            // SAFETY: `ptr` is `bytes` bytes of this view; the stream now waits for every
            // earlier use of the buffer.
            unsafe { cu::memset_async(ptr, 0, bytes, s) }
        })
    }

    /// Copies `data` into the view, on `stream`, after every earlier use; blocks until the copy
    /// has completed, so `data` may be reused as soon as this returns, even when it is pinned
    /// (a [`crate::HostBuffer`]'s contents). The host waits for the copy's own event, so a graph
    /// capture another thread begins on `stream` meanwhile changes nothing.
    ///
    /// Never returns while the copy may still read `data`: should CUDA fail, for about a minute,
    /// to say either that the copy is done or that the device has stopped (one of its sticky
    /// errors), the process is aborted instead.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the lengths differ or `stream` is on another device;
    /// [`Error::Capture`] while a graph is being captured on `stream` (nothing is copied); CUDA
    /// errors.
    pub fn copy_from_slice(&mut self, data: &[T], stream: &Stream) -> Result<()> {
        check_len(self.len, data.len(), "the host slice")?;
        let (dst, bytes) = (self.ptr.cast::<c_void>(), self.byte_len());
        // A graph would read `data` at every replay, long after this borrow ends.
        host_copy(
            stream,
            self.tracked,
            Access::Write,
            "copying from a host slice",
            |s| {
                if bytes == 0 {
                    return Ok(());
                }
                // SAFETY: `dst` holds `bytes` bytes; `data` is borrowed for the whole call, and
                // `host_copy` returns only once the copy can no longer read it.
                unsafe {
                    cu::memcpy_async(
                        dst,
                        data.as_ptr().cast(),
                        bytes,
                        cudaMemcpyKind::cudaMemcpyHostToDevice,
                        s,
                    )
                }
            },
        )
    }

    /// Copies `src` into this view on `stream` (of this view's device), after the last write to
    /// `src` and every earlier use of this view's buffer; returns at once. `src` may live on
    /// another device: then it is a peer copy (`cudaMemcpyPeerAsync`, over NVLink where there
    /// is one).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the lengths differ or `stream` is not on this view's
    /// device; CUDA errors.
    pub fn copy_from<'s>(&mut self, src: impl Into<View<'s, T>>, stream: &Stream) -> Result<()> {
        let src = src.into();
        check_len(self.len, src.len, "the source")?;
        stream.check_tracked(self.tracked, Access::Write)?;
        let how = CopyPath::DeviceToDevice {
            dst: self.device().ordinal() as i32,
            src: src.device().ordinal() as i32,
        };
        // SAFETY: both views hold `len` elements (checked) of their buffers, which stay borrowed
        // for the call; the source may be on another device (a peer copy).
        unsafe {
            tracked_copy(
                stream,
                (src.tracked, src.ptr.cast()),
                (self.tracked, self.ptr.cast()),
                self.byte_len(),
                how,
            )
        }
    }
}

/// What a tracked copy moves, between what.
#[derive(Clone, Copy)]
pub(crate) enum CopyPath {
    /// Device memory of device `src` to device memory of device `dst` (a peer copy when they
    /// differ).
    DeviceToDevice { dst: i32, src: i32 },
    /// Pinned host memory to device memory.
    HostToDevice,
    /// Device memory to pinned host memory.
    DeviceToHost,
}

/// Queues a copy of `bytes` from `src` to `dst` on `stream` as one tracked operation: a read of
/// `src`'s memory and a write of `dst`'s, both used on `stream` (a stream may wait for another
/// device's events and record events that other devices' streams then wait for, so the source
/// of a peer copy may be on another device). Returns at once.
///
/// # Safety
/// `src` and `dst` point to `bytes` bytes of the memory their trackers track, of the kind `how`
/// says, borrowed by the caller for the call; `dst` is on `stream`'s device (checked by the
/// caller, with the lengths).
pub(crate) unsafe fn tracked_copy(
    stream: &Stream,
    src: (&Tracked, *const c_void),
    dst: (&Tracked, *mut c_void),
    bytes: usize,
    how: CopyPath,
) -> Result<()> {
    let uses = [
        TrackedUse::on(stream, src.0, Access::Read),
        TrackedUse::on(stream, dst.0, Access::Write),
    ];
    let (from, to) = (src.1, dst.1);
    engine::enqueue(
        &uses,
        engine::Work::Cuda { keep: None },
        |_| {
            if bytes == 0 {
                return Ok(());
            }
            let kind = match how {
                CopyPath::DeviceToDevice { dst, src } if dst != src => {
                    // SAFETY: the caller vouches for both pointers; the stream waits for the
                    // source's last write and every use of the destination, and the events
                    // recorded after the copy keep both from being reused or freed early.
                    return unsafe { cu::memcpy_peer_async(to, dst, from, src, bytes, stream.as_raw()) };
                }
                CopyPath::DeviceToDevice { .. } => cudaMemcpyKind::cudaMemcpyDeviceToDevice,
                CopyPath::HostToDevice => cudaMemcpyKind::cudaMemcpyHostToDevice,
                CopyPath::DeviceToHost => cudaMemcpyKind::cudaMemcpyDeviceToHost,
            };
            // SAFETY: as above; pinned host memory is reached by the copy engine directly.
            unsafe { cu::memcpy_async(to, from, bytes, kind, stream.as_raw()) }
        },
        |_, _, _| {},
    )
}

/// Queues `copy`, a copy between device memory `tracked` tracks (used as `access`) and host
/// memory that the caller lends only for this call (a slice, perhaps pinned, or a vector's
/// spare capacity), as one tracked operation on `stream`, refused in a graph capture as `what`;
/// then blocks until the copy can no longer touch that host memory.
///
/// The wait is on the event the engine recorded after this copy, under the stream's order: a
/// graph capture that another thread begins on the stream afterwards changes nothing about it
/// (a stream synchronize would then fail at once, with the copy still queued). If the engine
/// could record no event, it has already waited for the stream under that order; if that wait
/// failed too, the stream itself is polled. See [`wait_for_copy`] for when the wait ends.
fn host_copy(
    stream: &Stream,
    tracked: &Tracked,
    access: Access,
    what: &str,
    copy: impl FnOnce(crate::sys::cudart::cudaStream_t) -> Result<()>,
) -> Result<()> {
    if engine::capturing_here() {
        return Err(engine::capture_error(&format!(
            "{what} blocks the host, which CUDA refuses on a thread that is capturing a graph, \
             whatever the stream, for as long as the capture lasts: do it before or after the \
             capture"
        )));
    }
    let uses = [TrackedUse::on(stream, tracked, access)];
    engine::check_devices(&uses)?;
    let mut after: Option<Arc<PooledEvent>> = None;
    let mut submitted = false;
    let queued = engine::enqueue(
        &uses,
        engine::Work::Uncapturable { what },
        |_| {
            submitted = true;
            copy(stream.as_raw())
        },
        |_, event, _| after = Some(event.clone()),
    );
    let waited = match (&after, submitted) {
        (Some(e), _) => wait_for_copy(
            // SAFETY: the event is kept alive by the Arc.
            || unsafe { cu::event_synchronize(e.raw) },
            // SAFETY: as above.
            || unsafe { cu::event_query(e.raw) },
            pause,
        ),
        (None, true) => wait_for_copy(|| stream.synchronize_raw(), || stream.is_idle(), pause),
        // Refused before anything was queued.
        (None, false) => Waited::Done,
    };
    match waited {
        Waited::Done => queued,
        Waited::Stopped(e) => queued.and(Err(e)),
        Waited::Unknown(e) => {
            // Returning could let the caller reuse or free memory that the copy engine may
            // still read or write: a data race, or a use after free. Nothing safe is left.
            eprintln!(
                "handoff: cannot tell whether a copy between the GPU and host memory lent to \
                 {what} has finished ({e}); aborting rather than returning while it may still \
                 use that memory"
            );
            std::process::abort()
        }
    }
}

/// How a wait for a copy ended.
#[derive(Debug, PartialEq)]
enum Waited {
    /// The copy has completed (or was never queued).
    Done,
    /// CUDA reported one of its sticky errors: no work of the context runs any more, this
    /// copy included.
    Stopped(Error),
    /// CUDA kept failing to answer, without a sticky error: whether the copy still runs is
    /// unknown.
    Unknown(Error),
}

/// How many answers in a row that are errors, but not sticky ones, [`wait_for_copy`] takes
/// before it gives up: with [`pause`]'s back-off, about a minute.
const PATIENCE: u32 = 6_000;

/// Waits with `sync` (blocking) for a copy, then, if that fails without a sticky error,
/// polls `query` (true once complete), calling `pause` with the number of polls so far between
/// polls, until the copy is known complete or stopped (a sticky error). Pending answers wait on
/// for as long as the GPU takes, as any stream synchronize does; errors that are not sticky
/// (a capture elsewhere forbidding the call, say) are retried [`PATIENCE`] times in a row.
fn wait_for_copy(
    sync: impl FnOnce() -> Result<()>,
    mut query: impl FnMut() -> Result<bool>,
    mut pause: impl FnMut(u32),
) -> Waited {
    match sync() {
        Ok(()) => return Waited::Done,
        Err(e) if stops_all_work(&e) => return Waited::Stopped(e),
        Err(_) => {}
    }
    let (mut polls, mut failures) = (0u32, 0u32);
    loop {
        pause(polls);
        polls = polls.saturating_add(1);
        match query() {
            Ok(true) => return Waited::Done,
            Ok(false) => failures = 0,
            Err(e) if stops_all_work(&e) => return Waited::Stopped(e),
            Err(e) => {
                failures += 1;
                if failures >= PATIENCE {
                    return Waited::Unknown(e);
                }
            }
        }
    }
}

/// Sleeps between polls for [`pause_micros`].
fn pause(polls: u32) {
    std::thread::sleep(std::time::Duration::from_micros(pause_micros(polls)));
}

/// The pause before poll `polls + 1`: 50 µs, doubling up to 10 ms.
fn pause_micros(polls: u32) -> u64 {
    (50u64 << polls.min(8)).min(10_000)
}

/// CUDA's sticky errors: each leaves "the process in an inconsistent state and any further
/// CUDA work will return the same error" (driver_types.h, CUDA 13.0): cudaErrorContained
/// (226), IllegalAddress (700), LaunchTimeout (702), Assert (710), HardwareStackError (714),
/// IllegalInstruction (715), MisalignedAddress (716), InvalidAddressSpace (717), InvalidPc
/// (718), LaunchFailure (719), TensorMemoryLeak (721), MpsClientTerminated (810),
/// ExternalDevice (911). The context's queues are stopped: no copy queued there runs on.
const STICKY: [i32; 13] = [226, 700, 702, 710, 714, 715, 716, 717, 718, 719, 721, 810, 911];

/// Whether `e` is one of [`STICKY`].
fn stops_all_work(e: &Error) -> bool {
    matches!(e, Error::Cuda { code, .. } if STICKY.contains(code))
}

pub(crate) fn check_len(len: usize, other: usize, what: &str) -> Result<()> {
    if other == len {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what} has {other} elements but the destination has {len}"
        )))
    }
}

impl<'a, T: Pod> From<&'a DeviceBuffer<T>> for View<'a, T> {
    fn from(b: &'a DeviceBuffer<T>) -> Self {
        b.view()
    }
}

impl<'a, T: Pod> From<&'a mut DeviceBuffer<T>> for ViewMut<'a, T> {
    fn from(b: &'a mut DeviceBuffer<T>) -> Self {
        b.view_mut()
    }
}

impl<'a, T: Pod> From<&'a View<'_, T>> for View<'a, T> {
    fn from(v: &'a View<'_, T>) -> Self {
        *v
    }
}

impl<'a, T: Pod> From<&'a ViewMut<'_, T>> for View<'a, T> {
    fn from(v: &'a ViewMut<'_, T>) -> Self {
        v.as_view()
    }
}

/// A writable view given up to be read, as `&mut [T]` coerces to `&[T]`.
impl<'a, T: Pod> From<ViewMut<'a, T>> for View<'a, T> {
    fn from(v: ViewMut<'a, T>) -> Self {
        // SAFETY: the same elements, borrowed exclusively for 'a by `v`, which is consumed:
        // shared for 'a now.
        unsafe { View::from_raw(v.ptr, v.len, v.tracked) }
    }
}

/// A buffer borrowed exclusively, read.
impl<'a, T: Pod> From<&'a mut DeviceBuffer<T>> for View<'a, T> {
    fn from(b: &'a mut DeviceBuffer<T>) -> Self {
        (&*b).into()
    }
}

impl<'a, T: Pod> From<&'a mut ViewMut<'_, T>> for ViewMut<'a, T> {
    fn from(v: &'a mut ViewMut<'_, T>) -> Self {
        v.reborrow()
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// The whole buffer, to be read.
    pub fn view(&self) -> View<'_, T> {
        // SAFETY: the buffer's own elements, borrowed shared.
        unsafe { View::from_raw(self.as_raw_ptr(), self.len(), self.tracked()) }
    }

    /// The whole buffer, to be written.
    pub fn view_mut(&mut self) -> ViewMut<'_, T> {
        let (ptr, len) = (self.as_raw_mut_ptr(), self.len());
        // SAFETY: the buffer's own elements, borrowed exclusively.
        unsafe { ViewMut::from_raw(ptr, len, self.tracked()) }
    }

    /// The elements `range`, to be read.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<View<'_, T>> {
        self.view().slice(range)
    }

    /// The elements `range`, to be written.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a range outside the buffer.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<ViewMut<'_, T>> {
        self.view_mut().into_slice_mut(range)
    }

    /// Two writable views, of the elements before `mid` and from `mid` on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `mid` is beyond the buffer.
    pub fn split_at_mut(&mut self, mid: usize) -> Result<(ViewMut<'_, T>, ViewMut<'_, T>)> {
        let len = self.len();
        if mid > len {
            return Err(Error::InvalidArgument(format!(
                "split at {mid} is beyond a buffer of {len} elements"
            )));
        }
        let (ptr, tracked) = (self.as_raw_mut_ptr(), self.tracked());
        // SAFETY: 0..mid and mid..len are disjoint and within the buffer, borrowed exclusively.
        Ok(unsafe {
            (
                ViewMut::from_raw(ptr, mid, tracked),
                ViewMut::from_raw(ptr.wrapping_add(mid), len - mid, tracked),
            )
        })
    }

    /// Copies `src` (of the same length, on this or another device) into the buffer; see
    /// [`ViewMut::copy_from`].
    ///
    /// # Errors
    /// As [`ViewMut::copy_from`].
    pub fn copy_from<'s>(&mut self, src: impl Into<View<'s, T>>, stream: &Stream) -> Result<()> {
        self.view_mut().copy_from(src, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(code: i32) -> Error {
        Error::Cuda {
            call: "cudaEventSynchronize",
            code,
            name: String::new(),
            message: String::new(),
        }
    }

    /// cudaErrorStreamCaptureUnsupported: what a stream synchronize returns at once when a
    /// capture began on the stream after the copy was queued. Not sticky.
    const CAPTURE_UNSUPPORTED: i32 = 900;

    /// Runs `wait_for_copy` with a sync answer and a list of query answers (the last repeated),
    /// counting the polls.
    fn wait_with(sync: Result<()>, answers: Vec<Result<bool>>) -> (Waited, usize) {
        let mut next = 0usize;
        let mut polls = 0usize;
        let waited = wait_for_copy(
            || sync,
            || {
                let a = answers[next.min(answers.len() - 1)].clone();
                next += 1;
                a
            },
            |_| polls += 1,
        );
        (waited, polls)
    }

    #[test]
    fn a_wait_that_succeeds_asks_nothing_more() {
        assert_eq!(wait_with(Ok(()), vec![Ok(false)]), (Waited::Done, 0));
    }

    #[test]
    fn a_failed_wait_never_ends_while_the_copy_is_pending() {
        // A stream synchronize that fails at once (a capture begun meanwhile) must not end the
        // wait while the copy is still queued: the copy is polled until it has completed.
        let answers = vec![Ok(false), Ok(false), Ok(false), Ok(true)];
        assert_eq!(
            wait_with(Err(cuda(CAPTURE_UNSUPPORTED)), answers),
            (Waited::Done, 4)
        );
        // Errors that are not sticky are retried too, and a pending answer starts the count of
        // failures again.
        let mut answers = vec![Err(cuda(CAPTURE_UNSUPPORTED)); PATIENCE as usize - 1];
        answers.push(Ok(false));
        answers.extend(vec![Err(cuda(CAPTURE_UNSUPPORTED)); PATIENCE as usize - 1]);
        answers.push(Ok(true));
        let (waited, polls) = wait_with(Err(cuda(CAPTURE_UNSUPPORTED)), answers);
        assert_eq!((waited, polls), (Waited::Done, 2 * PATIENCE as usize));
    }

    #[test]
    fn a_sticky_error_ends_the_wait_with_that_error() {
        // Sticky at the first wait: no poll.
        assert_eq!(
            wait_with(Err(cuda(700)), vec![Ok(false)]),
            (Waited::Stopped(cuda(700)), 0)
        );
        // Sticky while polling.
        let answers = vec![Ok(false), Err(cuda(CAPTURE_UNSUPPORTED)), Err(cuda(719))];
        assert_eq!(
            wait_with(Err(cuda(CAPTURE_UNSUPPORTED)), answers),
            (Waited::Stopped(cuda(719)), 3)
        );
        for code in STICKY {
            assert!(stops_all_work(&cuda(code)), "{code}");
        }
        for code in [1, 2, 4, 400, 600, 900, 901, 904] {
            assert!(!stops_all_work(&cuda(code)), "{code} is not sticky");
        }
        assert!(!stops_all_work(&Error::InvalidArgument("x".into())));
    }

    #[test]
    fn endless_errors_that_are_not_sticky_give_up_after_about_a_minute() {
        let (waited, polls) = wait_with(
            Err(cuda(CAPTURE_UNSUPPORTED)),
            vec![Err(cuda(CAPTURE_UNSUPPORTED))],
        );
        assert_eq!(waited, Waited::Unknown(cuda(CAPTURE_UNSUPPORTED)));
        assert_eq!(polls, PATIENCE as usize);
        let slept: u64 = (0..PATIENCE).map(pause_micros).sum();
        assert!(
            (50_000_000..=70_000_000).contains(&slept),
            "{slept} µs of pauses before giving up"
        );
        assert_eq!(pause_micros(0), 50);
        assert_eq!(pause_micros(u32::MAX), 10_000);
    }

    #[test]
    fn bounds_accept_every_range_form_inside_and_refuse_outside() {
        assert_eq!(bounds(.., 8).unwrap(), (0, 8));
        assert_eq!(bounds(2..5, 8).unwrap(), (2, 5));
        assert_eq!(bounds(2..=5, 8).unwrap(), (2, 6));
        assert_eq!(bounds(..3, 8).unwrap(), (0, 3));
        assert_eq!(bounds(6.., 8).unwrap(), (6, 8));
        assert_eq!(bounds(8..8, 8).unwrap(), (8, 8));
        for bad in [
            bounds(4..9, 8),
            bounds(9.., 8),
            bounds(0..=8, 8),
            bounds(0..=usize::MAX, 8),
        ] {
            assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{bad:?}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = bounds(5..3, 8);
        assert!(reversed.is_err());
        let e = bounds(4..9, 8).unwrap_err().to_string();
        assert!(e.contains("8 elements"), "{e}");
    }
}
