//! A stream as the engine sees it: [`Stream`]'s handle, identity, device, record order (with the
//! capture under way, if any) and newest tracking events. Its public constructors and operations
//! are in [`crate::cuda::stream`].

use std::sync::{Arc, Mutex, MutexGuard};

use crate::engine::device::{Device, PooledEvent};
use crate::engine::tracking::{Access, RecordOrder, StreamId, UseTracker};
use crate::engine::{self, StreamState, Tracked};
use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::cudaStream_t;

/// A CUDA stream: a queue of GPU work that runs in order.
///
/// Created non-blocking (`cudaStreamNonBlocking`), so it never synchronises implicitly with the
/// legacy default stream. A call that queues work returns before the work runs; a
/// [`DeviceBuffer`](crate::DeviceBuffer) keeps track of which streams still use it and makes
/// later conflicting work wait on the GPU, so queueing in any order on any streams is safe.
///
/// Dropping a stream does not wait: work already queued still runs, and the handle is kept by
/// the device for a later [`Stream::new`].
pub struct Stream {
    pub(crate) raw: cudaStream_t,
    pub(crate) id: StreamId,
    pub(crate) device: Device,
    /// Serialises recording tracking events here with storing them (see [`RecordOrder`]), and
    /// holds the graph capture under way here, if any, and the newest tracking event.
    pub(crate) order: Arc<RecordOrder<StreamState>>,
    /// The newest tracking event recorded here after NCCL work, which [`Stream::synchronize`]
    /// reports on: apart from the order, so that a synchronize never waits behind another
    /// thread's enqueue (a blocking `ncclGroupEnd` can take long).
    pub(crate) last_nccl: Mutex<Option<Arc<PooledEvent>>>,
    /// For a stream that belongs to someone else (cudarc's): what keeps its handle alive. Such
    /// a handle is never parked for reuse.
    pub(crate) owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

/// The handles of other owners' streams that a live `Stream` wraps (see
/// [`Stream::from_owned_handle`]): few, so a list. Handles as keys are safe: each is removed
/// when its `Stream` drops, and its owner, which the `Stream` holds, keeps it from being reused.
pub(crate) fn wrapped_handles() -> MutexGuard<'static, Vec<usize>> {
    static WRAPPED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    WRAPPED.lock().unwrap_or_else(|p| p.into_inner())
}

// SAFETY: CUDA streams may be used from any host thread; the runtime serialises access.
unsafe impl Send for Stream {}
// SAFETY: every method takes `&self` and makes only thread-safe runtime calls.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.id.0)
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Joined to a capture under way: CUDA captures the handle until the capture ends, so it
        // is parked (or let go of) only then (see `Graph`'s end of capture).
        if let Some(capture) = self.order.hold().capture.as_ref() {
            let mut shared = capture.lock();
            if let Some(fork) = shared
                .forked
                .iter_mut()
                .find(|f| Arc::ptr_eq(&f.order, &self.order))
            {
                fork.dropped = self.owner.is_none();
                if self.owner.is_some() {
                    wrapped_handles().retain(|&h| h != self.raw as usize);
                }
                return;
            }
        }
        // Trackers refer to this stream's work by event and by a StreamId that is never
        // reused, never by handle, so handing the handle to a later Stream is safe.
        if self.owner.is_none() {
            self.device.park_stream(self.raw);
        } else {
            wrapped_handles().retain(|&h| h != self.raw as usize);
        }
    }
}

impl Stream {
    /// A stream with a null handle, for CPU tests that never queue work on it.
    #[cfg(test)]
    pub(crate) fn for_tests(device: &Device) -> Stream {
        Stream::over(std::ptr::null_mut(), device, None)
    }

    /// A `Stream` over `raw`, a stream of `device`, with a fresh id and nothing recorded yet;
    /// `owner` keeps someone else's handle alive (such a handle is never parked).
    pub(crate) fn over(raw: cudaStream_t, device: &Device, owner: Option<engine::Keep>) -> Stream {
        Stream {
            raw,
            id: StreamId::fresh(),
            device: device.clone(),
            order: Arc::default(),
            last_nccl: Mutex::default(),
            owner,
        }
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The raw handle, for calling CUDA or NCCL directly. Work queued through it is not
    /// tracked: the caller takes on the ordering that the safe API otherwise provides.
    ///
    /// The handle of a stream made by [`Stream::new`] must not be captured into a CUDA graph
    /// except through [`crate::Graph`] (no `cudaStreamBeginCapture` on it, nor a capture that
    /// reaches it through an event wait): handoff does not ask CUDA whether its own streams
    /// are being captured, and tracked work queued there during such a capture would become
    /// part of that graph, untracked. (A stream wrapped from cudarc, whose safe API can begin a
    /// capture, is asked before every tracked operation.)
    pub fn as_raw(&self) -> cudaStream_t {
        self.raw
    }

    /// Remembers `event` as the newest tracking event recorded here (`nccl`: after NCCL work),
    /// in `held`, this stream's order state, held since the event was recorded.
    pub(crate) fn note_recorded(&self, held: &mut StreamState, event: &Arc<PooledEvent>, nccl: bool) {
        held.last = Some(event.clone());
        if nccl {
            *self.last_nccl() = Some(event.clone());
        }
    }

    /// The field of that name, locked.
    pub(crate) fn last_nccl(&self) -> MutexGuard<'_, Option<Arc<PooledEvent>>> {
        self.last_nccl.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn check_device(&self, other: &Device, what: &str) -> Result<()> {
        if self.device.same(other) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{what} is on device {} but the stream is on device {}",
                other.ordinal(),
                self.device.ordinal()
            )))
        }
    }

    pub(crate) fn id(&self) -> StreamId {
        self.id
    }

    pub(crate) fn order(&self) -> &RecordOrder<StreamState> {
        &self.order
    }

    /// [`Error::Capture`] when someone other than handoff is capturing this stream into a CUDA
    /// graph: tracking's events recorded there would be part of that graph, never complete as
    /// events, and later waits on them would order nothing. Asked of CUDA only for streams
    /// wrapped from someone else (cudarc's, whose safe API can begin a capture): handoff's own
    /// are captured only through [`crate::Graph`], as [`Stream::as_raw`] requires, which the
    /// stream's capture state shows.
    pub(crate) fn check_not_captured_elsewhere(&self) -> Result<()> {
        if self.owner.is_none() {
            return Ok(());
        }
        // SAFETY: the handle is live for as long as `self`.
        if unsafe { cu::stream_is_capturing(self.raw) }? {
            return Err(Error::Capture {
                detail: format!(
                    "stream {} is being captured into a CUDA graph outside handoff: tracked work \
                     cannot be queued on it (capture with handoff::Graph, or end the capture)",
                    self.id.0
                ),
            });
        }
        Ok(())
    }

    pub(crate) fn check_tracked(&self, t: &Tracked, access: Access) -> Result<()> {
        let what = if access == Access::Read {
            "an input buffer"
        } else {
            "an output buffer"
        };
        self.check_device(&t.device, what)
    }

    /// Makes this stream wait, on the GPU, for the uses in `tracker` (locked by the caller) that
    /// an `access` here conflicts with, adding them to `waited` if given. The stream's device
    /// must be current.
    pub(crate) fn wait_for_conflicts(
        &self,
        tracker: &UseTracker<Arc<PooledEvent>>,
        access: Access,
        mut waited: Option<&mut engine::Before>,
    ) -> Result<()> {
        for e in tracker.waits(self.id, access) {
            // SAFETY: the stream is live; the event is kept alive by the tracker.
            unsafe { cu::stream_wait_event(self.raw, e.raw)? };
            if let Some(w) = waited.as_deref_mut() {
                w.push(e.clone());
            }
        }
        Ok(())
    }

    /// Blocks until the stream's work has completed, without reporting an NCCL abort.
    pub(crate) fn synchronize_raw(&self) -> Result<()> {
        // SAFETY: the handle is live for as long as `self`.
        unsafe { cu::stream_synchronize(self.raw) }
    }

    /// A pooled event recorded here now.
    pub(crate) fn record_event(&self) -> Result<Arc<PooledEvent>> {
        self.record_pooled(self.device.take_event()?)
    }

    /// Records `event`, a pooled event of this stream's device referred to by no tracker yet,
    /// here now.
    pub(crate) fn record_pooled(&self, event: Arc<PooledEvent>) -> Result<Arc<PooledEvent>> {
        // SAFETY: both handles are live and of the same device.
        unsafe { cu::event_record(event.raw, self.raw)? };
        Ok(event)
    }
}
