//! [`Stream`]'s public face (making one, waiting, events, raw work declared with [`RawUse`]) and
//! [`Event`]. The type itself, the per-stream state the engine keeps, is the engine's
//! (`src/engine/stream.rs`). Work queued here goes through the engine like the crate's own:
//! raw work declares the buffers it uses, and one handle is wrapped by at most one `Stream`.

use std::sync::{Arc, Mutex, MutexGuard};

use bytemuck::Pod;

use smallvec::SmallVec;

use crate::cuda::view::{View, ViewMut};
use crate::engine::device::Device;
use crate::engine::tracking::{Access, record_and_store};
use crate::engine::{self, CaptureState, Tracked, TrackedUse, Work};
use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::{cudaEvent_t, cudaStream_t};

pub use crate::engine::stream::Stream;
pub(crate) use crate::engine::stream::wrapped_handles;

impl Stream {
    /// A new stream on `device`.
    ///
    /// # Errors
    /// CUDA errors.
    pub fn new(device: &Device) -> Result<Stream> {
        Ok(Stream::over(device.take_stream()?, device, None))
    }

    /// A stream over someone else's handle, kept alive by `owner`, never parked.
    ///
    /// # Safety
    /// `raw` is a live stream of `device`'s primary context for as long as `owner` lives.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] while another live `Stream` wraps the same handle: each would
    /// keep its own order and capture state, and two threads could then interleave recording
    /// and storing tracking events on one queue, or one could queue tracked work into the
    /// other's graph capture. Share the first `Stream` instead.
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) unsafe fn from_owned_handle(
        raw: cudaStream_t,
        device: &Device,
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<Stream> {
        let mut wrapped = wrapped_handles();
        if wrapped.contains(&(raw as usize)) {
            return Err(Error::InvalidArgument(
                "this stream is already wrapped by a live handoff Stream: share that one (by \
                 reference or in an Arc) instead of wrapping the handle twice"
                    .into(),
            ));
        }
        wrapped.push(raw as usize);
        Ok(Stream::over(raw, device, Some(owner)))
    }

    /// Blocks the host until all work queued so far on this stream has completed.
    ///
    /// Never waits forever behind an NCCL operation: a communicator's watchdog aborts one that
    /// misses its deadline, and this then returns [`Error::CommunicatorUnusable`] naming it.
    ///
    /// # Errors
    /// CUDA errors, including a fault in earlier work; [`Error::CommunicatorUnusable`] when the
    /// last NCCL operation queued here was cut short by its communicator's abort.
    pub fn synchronize(&self) -> Result<()> {
        let nccl = self.last_nccl().clone();
        self.synchronize_raw()?;
        let r = crate::engine::device::check_poison(nccl.as_deref());
        if r.is_err() {
            // Reported once: later waits on the stream are about later work.
            let mut last = self.last_nccl();
            if last
                .as_ref()
                .is_some_and(|e| nccl.as_ref().is_some_and(|n| Arc::ptr_eq(e, n)))
            {
                *last = None;
            }
        }
        r
    }

    /// True when all work queued so far has completed; does not block.
    ///
    /// # Errors
    /// CUDA errors.
    pub fn is_idle(&self) -> Result<bool> {
        // SAFETY: the handle is live for as long as `self`.
        unsafe { cu::stream_query(self.raw) }
    }

    /// Records `event` here: it completes when the work queued so far has.
    ///
    /// Inside a [`crate::Graph`] capture on this stream (by this thread), the record is part of
    /// the graph: a stream that then waits for the event joins the capture (see
    /// [`Stream::wait`]), as CUDA's cross-stream capture does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the event belongs to another device; [`Error::Capture`]
    /// while another thread captures a graph here, or through cudarc on a stream wrapped from
    /// it; CUDA errors.
    pub fn record(&self, event: &Event) -> Result<()> {
        self.check_device(&event.device, "the event")?;
        let held = self.order.hold();
        // Held across the record, so that the mark says where CUDA's last record was made.
        let mut mark = event.mark();
        if let Some(capture) = held.capture.as_ref() {
            capture.admit(false, Work::Cuda { keep: None })?;
            // SAFETY: both handles are live and of the same device; the stream is captured by
            // this thread, so the record is a point of the capture.
            unsafe { cu::event_record(event.raw, self.raw) }?;
            *mark = Some(capture.clone());
            return Ok(());
        }
        // Recorded into someone else's capture, the event would be a node of their graph, and
        // a stream waiting for it would be drawn into the capture.
        self.check_not_captured_elsewhere()?;
        // SAFETY: both handles are live and of the same device.
        unsafe { cu::event_record(event.raw, self.raw) }?;
        *mark = None;
        Ok(())
    }

    /// Makes work queued here after this call wait, on the GPU, for `event`'s last record. The
    /// host does not block. The event may belong to another device.
    ///
    /// If the event was last recorded inside a [`crate::Graph`] capture (by the thread running
    /// it), this stream joins the capture: its later work is part of the graph, ordered after
    /// that point, and is joined back into the captured stream when the capture ends, so that
    /// each replay runs it. A stream of the capture that waits for an event recorded in it
    /// orders its later work after that point of the graph.
    ///
    /// # Errors
    /// [`Error::Capture`]: inside a capture, for an event recorded outside it; for an event
    /// recorded in a capture that has ended, or in another thread's; for a stream of another
    /// device than the capture's, or captured by cudarc, or one across which memory is lent to
    /// or borrowed from cudarc. CUDA errors.
    pub fn wait(&self, event: &Event) -> Result<()> {
        let mut held = self.order.hold();
        let mark = event.mark();
        let live = mark.as_ref().filter(|c| !c.lock().ended);
        match (held.capture.as_ref(), live) {
            (Some(mine), Some(theirs)) if CaptureState::same(mine, theirs) => {
                mine.admit(false, Work::Cuda { keep: None })?;
                // SAFETY: both handles are live; the event was recorded in this capture, so
                // the wait is an edge of the graph.
                unsafe { cu::stream_wait_event(self.raw, event.raw) }
            }
            (Some(_), _) => Err(engine::capture_error(
                "inside a graph's capture, a stream can wait only for an Event recorded in the \
                 same capture (the graph cannot wait for work outside it): record it inside, or \
                 wait before the capture",
            )),
            (None, Some(theirs)) => {
                theirs.admit(false, Work::Cuda { keep: None })?;
                engine::lend::check_not_lent(&held)?;
                let mut shared = theirs.lock();
                if !shared.device.as_ref().is_some_and(|d| d.same(&self.device)) {
                    return Err(engine::capture_error(
                        "a stream of another device cannot join this graph's capture: capture \
                         each device's work into a graph of its own",
                    ));
                }
                self.check_not_captured_elsewhere()?;
                // SAFETY: both handles are live; the event was recorded in a capture this
                // thread runs, so the stream joins it (CUDA's cross-stream capture), which the
                // state set below, under this stream's order, tells every tracked operation.
                unsafe { cu::stream_wait_event(self.raw, event.raw) }?;
                shared.forked.push(engine::Fork {
                    raw: self.raw,
                    order: self.order.clone(),
                    dropped: false,
                    _owner: self.owner.clone(),
                });
                drop(shared);
                held.capture = Some(theirs.clone());
                Ok(())
            }
            (None, None) if mark.is_some() => Err(engine::capture_error(
                "this Event was last recorded inside a graph's capture, which has ended: record \
                 it again outside a capture before waiting for it",
            )),
            (None, None) => {
                // SAFETY: both handles are live; cross-device waits are allowed.
                unsafe { cu::stream_wait_event(self.raw, event.raw) }
            }
        }
    }

    /// Runs `f` (which queues `what` on this stream, untracked) under the stream's order, unless
    /// handoff is capturing a graph here: [`Error::Capture`] then, as a graph cannot hold it.
    /// Held, so that no capture can begin in between.
    pub(crate) fn outside_capture<R>(&self, what: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let held = self.order.hold();
        if held.capture.is_some() {
            return Err(engine::not_capturable(what));
        }
        f()
    }

    /// Queues one operation on this stream that uses the given memory, through the crate's one
    /// tracked path (`src/engine`): waits for conflicting earlier uses, runs `op` (which
    /// queues the work on the raw stream), records the uses.
    pub(crate) fn enqueue<R>(
        &self,
        uses: &[(&Tracked, Access)],
        op: impl FnOnce(cudaStream_t) -> Result<R>,
    ) -> Result<R> {
        self.enqueue_work(uses, Work::Cuda { keep: None }, op)
    }

    /// [`Stream::enqueue`] of CUDA work of a kind (see [`Work`]): work that refers to `keep`
    /// (a kernel's module), which a graph that captures it keeps alive, or work that a graph
    /// cannot hold.
    pub(crate) fn enqueue_work<R>(
        &self,
        uses: &[(&Tracked, Access)],
        work: Work<'_>,
        op: impl FnOnce(cudaStream_t) -> Result<R>,
    ) -> Result<R> {
        // Pushed in place: collecting builds the list elsewhere and copies it here.
        let mut tracked: SmallVec<[TrackedUse<'_>; 8]> = SmallVec::new();
        for &(t, access) in uses {
            tracked.push(TrackedUse::on(self, t, access));
        }
        engine::check_devices(&tracked)?;
        if !tracked.is_empty() {
            return engine::enqueue(&tracked, work, |_| op(self.raw), |_, _, _| {});
        }
        // Work that touches no buffer: nothing to track, but later work on this stream starts
        // only after it, which a communicator's watchdog must know (its deadline for an
        // operation counts from the stream's previous work completing).
        self.device.set_current()?;
        let mut held = self.order.hold();
        if let Some(capture) = held.capture.as_mut() {
            // Captured: nothing runs now, so nothing to record.
            capture.admit(false, work)?;
            if let Work::Cuda { keep } = work {
                capture.lock().keep.extend(keep.cloned());
            }
            return op(self.raw);
        }
        self.check_not_captured_elsewhere()?;
        let out = op(self.raw)?;
        let recorded = record_and_store(
            &mut held,
            || self.record_event(),
            |held, e| self.note_recorded(held, e, false),
        );
        if recorded.is_err() {
            // Without the event, wait for the work instead, as the engine does.
            self.synchronize_raw()?;
        }
        Ok(out)
    }
}

/// A buffer's use by raw work, declared for [`Stream::raw_use`]: a read of a [`View`] or a write
/// of a [`ViewMut`] (or of a whole buffer), borrowed for as long as the declaration lives.
#[derive(Clone, Copy)]
pub struct RawUse<'a> {
    tracked: &'a Tracked,
    access: Access,
}

impl std::fmt::Debug for RawUse<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawUse").field("access", &self.access).finish()
    }
}

impl<'a> RawUse<'a> {
    /// The raw work reads `buf`.
    pub fn read<T: Pod>(buf: impl Into<View<'a, T>>) -> RawUse<'a> {
        RawUse {
            tracked: buf.into().tracked(),
            access: Access::Read,
        }
    }

    /// The raw work writes (and may read) `buf`.
    pub fn write<T: Pod>(buf: impl Into<ViewMut<'a, T>>) -> RawUse<'a> {
        RawUse {
            tracked: buf.into().tracked(),
            access: Access::Write,
        }
    }
}

impl Stream {
    /// Runs `work`, which queues raw CUDA work (cuBLAS, cudarc, a runtime call) on this stream's
    /// handle, as one tracked operation that uses `uses`: before it, the stream waits on the GPU
    /// for the conflicting earlier uses of those buffers on other streams; after it, the event
    /// that tracks them is recorded, so later tracked work, host reads and frees order after the
    /// raw work. Returns what `work` returns.
    ///
    /// ```no_run
    /// # fn main() -> handoff::Result<()> {
    /// use handoff::{Device, DeviceBuffer, RawUse, Stream};
    /// let stream = Stream::new(&Device::new(0)?)?;
    /// let x = DeviceBuffer::<f32>::zeros(256, &stream)?;
    /// let mut y = DeviceBuffer::<f32>::zeros(256, &stream)?;
    /// let (src, dst, bytes) = (x.as_raw_ptr(), y.as_raw_mut_ptr(), y.byte_len());
    /// // SAFETY: the copy reads x and writes y within their lengths, on this stream only.
    /// unsafe {
    ///     stream.raw_use(&[RawUse::read(&x), RawUse::write(&mut y)], |s| {
    ///         handoff::result::cudart::memcpy_async(dst.cast(), src.cast(), bytes,
    ///             handoff::sys::cudart::cudaMemcpyKind::cudaMemcpyDeviceToDevice, s)
    ///     })??;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Safety
    /// - `work` queues work only on the stream it is given (or joins any other stream it uses
    ///   back into it, with events, before returning), and returns once it is queued;
    /// - that work reads only the buffers declared in `uses`, and writes only those declared
    ///   written, within their views' elements;
    /// - `work` calls nothing of handoff's on this stream or these buffers (their locks are held
    ///   while it runs: such a call waits forever);
    /// - `work` does not panic once it has queued work (an unwinding `work` skips the recording,
    ///   and the work would go untracked);
    /// - inside a [`crate::Graph`] capture on this stream, the work becomes part of the graph
    ///   and runs at every replay: whatever it refers to besides the declared buffers (modules,
    ///   host memory, handles) outlives the graph.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer on another device; CUDA errors from the waits or
    /// the recording.
    pub unsafe fn raw_use<R>(&self, uses: &[RawUse<'_>], work: impl FnOnce(cudaStream_t) -> R) -> Result<R> {
        let uses: Vec<(&Tracked, Access)> = uses.iter().map(|u| (u.tracked, u.access)).collect();
        self.enqueue(&uses, |s| Ok(work(s)))
    }
}

/// A CUDA event: a point in a stream that other streams can wait for and the host can
/// query, and, between two of them, a GPU-side timer.
pub struct Event {
    raw: cudaEvent_t,
    /// Owns `raw`: shared with the async waits on the event (`cuda::completion`), so that the
    /// handle outlives every query of it, whenever the `Event` itself is dropped.
    pub(crate) owned: Arc<OwnedEvent>,
    device: Device,
    timing: bool,
    /// The graph capture its last record was made in, if it was; held across every record
    /// and wait through handoff, so that it says where CUDA's last record is (a wait for an
    /// event recorded in a capture joins the capture).
    captured: Mutex<Option<CaptureState>>,
}

// SAFETY: CUDA events may be used from any host thread.
unsafe impl Send for Event {}
// SAFETY: every method takes `&self` and makes only thread-safe runtime calls.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device.ordinal())
            .field("timing", &self.timing)
            .finish()
    }
}

/// An [`Event`]'s handle, destroyed when its last holder (the event, or an async wait on it)
/// lets go.
pub(crate) struct OwnedEvent(pub(crate) cudaEvent_t);

// SAFETY: CUDA events may be used from any host thread.
unsafe impl Send for OwnedEvent {}
// SAFETY: the only operations on a shared handle are thread-safe runtime calls.
unsafe impl Sync for OwnedEvent {}

impl Drop for OwnedEvent {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once; a pending event is released by the runtime once
        // it completes.
        let _ = unsafe { cu::event_destroy(self.0) };
    }
}

impl Event {
    /// An event that can time ([`Event::elapsed_ms`]).
    ///
    /// # Errors
    /// CUDA errors.
    pub fn new(device: &Device) -> Result<Event> {
        Self::create(device, true)
    }

    /// An event for ordering only, cheaper to record and wait for.
    ///
    /// # Errors
    /// CUDA errors.
    pub fn without_timing(device: &Device) -> Result<Event> {
        Self::create(device, false)
    }

    fn create(device: &Device, timing: bool) -> Result<Event> {
        device.set_current()?;
        let raw = cu::event_create(timing)?;
        Ok(Event {
            raw,
            owned: Arc::new(OwnedEvent(raw)),
            device: device.clone(),
            timing,
            captured: Mutex::new(None),
        })
    }

    fn mark(&self) -> MutexGuard<'_, Option<CaptureState>> {
        self.captured.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks the host until the work before the last record has completed.
    ///
    /// # Errors
    /// CUDA errors.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live handle.
        unsafe { cu::event_synchronize(self.raw) }
    }

    /// True when the work before the last record has completed (or it was never recorded).
    ///
    /// # Errors
    /// CUDA errors.
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: live handle.
        unsafe { cu::event_query(self.raw) }
    }

    /// Milliseconds of GPU time from `self` to `end`; both must have completed.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if either was made without timing; CUDA errors (e.g. one not
    /// yet complete).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(Error::InvalidArgument(
                "elapsed_ms needs two events made with Event::new".into(),
            ));
        }
        // SAFETY: live handles created with timing.
        unsafe { cu::event_elapsed_ms(self.raw, end.raw) }
    }

    /// The raw handle.
    pub fn as_raw(&self) -> cudaEvent_t {
        self.raw
    }
}
