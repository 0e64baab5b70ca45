//! The one path by which tracked GPU work is queued: kernel launches, copies, fills, and NCCL
//! groups all go through [`enqueue`], so there is one recording rule and one fallback.
//!
//! 1. Every use's buffer must be on its stream's device ([`check_devices`]).
//! 2. The streams' [`RecordOrder`]s are held, in stream-id order, then the buffers' trackers, in
//!    address order, for the whole enqueue: a stream's tracked operations, and a buffer's, are
//!    queued one at a time, whatever the threads. (Two writers of one buffer can exist at once,
//!    through the two halves of `split_at_mut`; each waits for the other's earlier writes, and
//!    neither's record is lost.)
//! 3. Each stream waits, on the GPU, for the earlier uses its new use conflicts with
//!    ([`crate::tracking`]); the host does not block.
//! 4. `submit` queues the work (a launch; or an NCCL group, which queues nothing before
//!    `ncclGroupEnd`, so the events below are recorded only after the work is really queued).
//! 5. One event is recorded after the work on each *record stream* and stored as the latest use
//!    of every buffer used with it, each under the stream it was used on. A use's record stream
//!    is its own stream, except in an NCCL group: there one event per communicator, on its first
//!    stream, covers all its operations, since NCCL makes every stream of a group wait for the
//!    group ("as if the NCCL group operation was posted on every stream", NCCL's CUDA stream
//!    semantics) and the stream orders held here keep any other use of those streams wholly
//!    before or after. If recording fails, the host waits for the stream instead, so no queued
//!    use is left untracked; every record stream is handled even after an error.
//!
//! On a stream handoff is capturing into a graph ([`crate::Graph`]), steps 3 and 5 give way to
//! the capture branch: [`CaptureState::admit`] decides whether the work may enter, and its
//! buffers are noted for the graph's replays instead of waited for and recorded. On a stream
//! someone else captures, nothing is queued ([`Error::Capture`]).

use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::{Device, PooledEvent};
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::tracking::{Access, CapturedUses, Held, UseTracker, record_and_store};

/// The pending uses of one piece of memory, and the device it lives on; shared (cheaply cloned)
/// between the buffer and any graph that captured a use of it.
#[derive(Clone)]
pub(crate) struct Tracked(Arc<TrackedInner>);

pub(crate) struct TrackedInner {
    pub(crate) device: Device,
    /// Pinned host memory (a [`crate::HostBuffer`]), which the host reads and writes outside
    /// stream order: never captured into a graph.
    host: bool,
    uses: Mutex<UseTracker<Arc<PooledEvent>>>,
}

impl std::ops::Deref for Tracked {
    type Target = TrackedInner;
    fn deref(&self) -> &TrackedInner {
        &self.0
    }
}

impl Tracked {
    pub(crate) fn new(device: &Device) -> Tracked {
        Self::with(device, false)
    }

    /// The tracker of pinned host memory.
    pub(crate) fn new_host(device: &Device) -> Tracked {
        Self::with(device, true)
    }

    fn with(device: &Device, host: bool) -> Tracked {
        Tracked(Arc::new(TrackedInner {
            device: device.clone(),
            host,
            uses: Mutex::new(UseTracker::new()),
        }))
    }

    /// One key per piece of memory, whichever clone of the tracker it is reached through: the
    /// engine's lock order and identity.
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// Whether two trackers are one piece of memory's.
    pub(crate) fn same(a: &Tracked, b: &Tracked) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl TrackedInner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, UseTracker<Arc<PooledEvent>>> {
        // A panic while holding the lock cannot leave the tracker half-updated in a way that
        // loses a use (each method updates it in one step), so a poisoned lock is still usable.
        self.uses.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A graph capture under way on a stream (see [`crate::Graph`]): held in the stream's
/// [`crate::tracking::RecordOrder`], so the engine sees it under the lock it already takes.
/// While it is there, operations on the stream are recorded into the graph, not run: the engine
/// neither waits for earlier uses (the graph's replays will) nor records events (nothing ran);
/// it notes each use for the replays to track.
#[derive(Default)]
pub(crate) struct CaptureState {
    pub(crate) uses: CapturedUses<Tracked>,
    /// What the graph's nodes refer to besides memory (the modules of captured kernels).
    pub(crate) keep: Vec<Keep>,
    /// The communicator given to the capture (its key), the only one whose operations it takes.
    pub(crate) comm: Option<usize>,
    /// The thread running the capture's closure, the only one whose work it takes: another
    /// thread's work on the stream is refused, not silently moved into the graph (that thread
    /// checked for a capture before it began, and would believe its work had run). `None` only
    /// in a state no capture made (the default), which admits nothing.
    pub(crate) thread: Option<std::thread::ThreadId>,
}

impl CaptureState {
    /// Whether `work` (using pinned host memory if `host`), queued by the calling thread, may
    /// enter this capture: the one rule, applied by the engine under the stream's lock, and by
    /// a group before it is verified (so that a refusal leaves its communicators usable).
    ///
    /// # Errors
    /// [`Error::Capture`], saying what to do instead.
    pub(crate) fn admit(&self, host: bool, work: Work<'_>) -> Result<()> {
        if self.thread != Some(std::thread::current().id()) {
            return Err(capture_error(
                "the stream is being captured into a graph by another thread: queue this work \
                 on another stream, or after the capture",
            ));
        }
        if host {
            return Err(capture_error(
                "a pinned host buffer cannot be used in a graph (the host reads and writes it \
                 outside stream order): copy to or from it outside the capture, after a replay",
            ));
        }
        match work {
            Work::Uncapturable { what } => Err(not_capturable(what)),
            Work::Nccl { comms } if comms.iter().any(|c| self.comm != Some(*c)) => {
                Err(capture_error(NOT_THE_GRAPHS))
            }
            Work::Nccl { .. } | Work::Cuda { .. } => Ok(()),
        }
    }
}

/// Why an NCCL operation of another communicator is refused in a capture.
pub(crate) const NOT_THE_GRAPHS: &str = "an NCCL operation in a graph must use the communicator \
    given to Graph::capture_with (make one for the graph, e.g. with Communicator::split, and \
    send and receive with each peer on it once before capturing)";

/// Why an operation spanning streams is refused in a capture.
pub(crate) const SPANNING: &str = "an operation captured into a graph may use only the stream \
    being captured: queue the other streams' work outside the capture";

/// [`Error::Capture`] with `detail`.
pub(crate) fn capture_error(detail: &str) -> Error {
    Error::Capture {
        detail: detail.into(),
    }
}

/// The refusal of `what`, which a graph cannot hold.
pub(crate) fn not_capturable(what: &str) -> Error {
    capture_error(&format!(
        "{what} cannot be captured into a graph: do it outside the capture"
    ))
}

/// Something a captured graph's nodes refer to, kept alive as long as the graph.
pub(crate) type Keep = Arc<dyn std::any::Any + Send + Sync>;

/// What a stream's order lock guards.
pub(crate) type StreamState = Option<CaptureState>;

/// One use of a buffer by the operation being queued.
#[derive(Clone, Copy)]
pub(crate) struct TrackedUse<'a> {
    pub(crate) stream: &'a Stream,
    pub(crate) tracked: &'a Tracked,
    pub(crate) access: Access,
    /// Where the event that tracks this use is recorded (see step 5): `stream`, or in an NCCL
    /// group the first stream of the use's communicator.
    pub(crate) record: &'a Stream,
}

impl<'a> TrackedUse<'a> {
    /// A use recorded on its own stream.
    pub(crate) fn on(stream: &'a Stream, tracked: &'a Tracked, access: Access) -> Self {
        TrackedUse {
            stream,
            tracked,
            access,
            record: stream,
        }
    }
}

/// Switches the calling thread's current device only when it changes (each switch is a
/// runtime call): made current by the engine before CUDA work is submitted, never for NCCL
/// work.
#[derive(Default)]
pub(crate) struct CurrentDevice(Option<usize>);

impl CurrentDevice {
    pub(crate) fn set(&mut self, d: &Device) -> Result<()> {
        if self.0 != Some(d.ordinal()) {
            d.set_current()?;
            self.0 = Some(d.ordinal());
        }
        Ok(())
    }
}

/// Checks that every use's buffer is on its stream's device (step 1).
pub(crate) fn check_devices(uses: &[TrackedUse<'_>]) -> Result<()> {
    for u in uses {
        u.stream.check_tracked(u.tracked, u.access)?;
    }
    Ok(())
}

/// What an NCCL group's streams ran before it: the group can start on the GPU only once these
/// have completed (the stream's previous tracked work, and the uses it was made to wait for).
/// The communicator's watchdog counts its deadline from there.
pub(crate) type Before = Vec<Arc<PooledEvent>>;

/// What kind of work an [`enqueue`] queues.
#[derive(Clone, Copy)]
pub(crate) enum Work<'k> {
    /// CUDA work; `keep` is what it refers to besides memory (a kernel's module), which a graph
    /// that captures it must keep alive.
    Cuda { keep: Option<&'k Keep> },
    /// NCCL work on the communicators with these keys ([`crate::Communicator`]'s `key`).
    Nccl { comms: &'k [usize] },
    /// CUDA work that a graph cannot hold (an allocation, a copy from or to a host slice):
    /// refused in a capture, checked under the stream's order so that a capture begun by
    /// another thread cannot slip in between.
    Uncapturable { what: &'k str },
}

/// Queues one operation that uses the given memory (steps 2 to 5 above; step 1 is
/// [`check_devices`], which callers run before anything else they check). `recorded` is called
/// with each record stream, the event recorded after the work there, and (for NCCL work,
/// which [`Stream::synchronize`] also reports on) what its uses' streams ran before it.
///
/// The uses are recorded even when `submit` fails: whatever part of the work reached a stream
/// stays tracked.
///
/// On a stream that handoff is capturing into a graph (every stream of the operation must then
/// be that one), the work is captured instead: see [`CaptureState`]; `recorded` is not called.
/// On a stream that someone else is capturing, nothing is queued: [`Error::Capture`]. A use of
/// memory that has been freed (reachable only through a graph that outlived a buffer) is
/// refused.
pub(crate) fn enqueue<R>(
    uses: &[TrackedUse<'_>],
    work: Work<'_>,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
    mut recorded: impl FnMut(&Stream, &Arc<PooledEvent>, &Before),
) -> Result<R> {
    let nccl = matches!(work, Work::Nccl { .. });
    // Each distinct stream once, in first-use order (few uses: a linear scan is fine). Record
    // streams are among them.
    let mut streams: Vec<&Stream> = Vec::with_capacity(2);
    for u in uses {
        if !streams.iter().any(|s| std::ptr::eq(*s, u.stream)) {
            streams.push(u.stream);
        }
    }
    let index = |s: &Stream| streams.iter().position(|t| std::ptr::eq(*t, s)).expect("listed");
    // Held in stream-id order, so that threads queueing on overlapping streams cannot deadlock.
    let mut by_id: Vec<usize> = (0..streams.len()).collect();
    by_id.sort_by_key(|&i| streams[i].id());
    let mut held: Vec<Option<Held<'_, StreamState>>> = (0..streams.len()).map(|_| None).collect();
    for i in by_id {
        held[i] = Some(streams[i].order().hold());
    }
    let capturing = held.iter().any(|h| h.as_ref().is_some_and(|h| h.is_some()));
    if capturing && streams.len() > 1 {
        return Err(capture_error(SPANNING));
    }
    if !capturing {
        for s in &streams {
            s.check_not_captured_elsewhere()?;
        }
    }
    // Each distinct tracker once, locked in key order.
    let mut trackers: Vec<&Tracked> = Vec::with_capacity(uses.len());
    for u in uses {
        if !trackers.iter().any(|t| Tracked::same(t, u.tracked)) {
            trackers.push(u.tracked);
        }
    }
    trackers.sort_by_key(|t| t.key());
    let mut locked: Vec<MutexGuard<'_, UseTracker<Arc<PooledEvent>>>> =
        trackers.iter().map(|t| t.lock()).collect();
    let slot = |t: &Tracked| trackers.iter().position(|u| Tracked::same(u, t)).expect("listed");
    if locked.iter().any(|t| t.is_retired()) {
        return Err(Error::InvalidArgument(
            "a buffer this graph uses has been dropped: the graph cannot run again (capture a \
             new one, or keep its buffers while it is used)"
                .into(),
        ));
    }
    if capturing {
        let state = held[0].as_mut().and_then(|h| h.as_mut()).expect("capturing");
        return capture(uses, work, state, submit);
    }
    // Per record stream, what its uses' streams ran (and are made to wait for) before.
    let mut before: Vec<Before> = if nccl {
        vec![Vec::new(); streams.len()]
    } else {
        Vec::new()
    };
    if nccl {
        for u in uses {
            before[index(u.record)].extend(u.stream.last_recorded());
        }
    }
    // Waits and event records take their device from the stream, whatever the current device
    // (CUDA's "Stream and Event Behavior"); NCCL makes its communicator's device current
    // itself, and restores the caller's (`ncclEnqueueCheck`, enqueue.cc 2618-2631 of NCCL
    // 2.28.3; `ncclGroupEndInternal` and `groupLaunch`, group.cc 598 and 742-744). CUDA work
    // (a kernel launch, a copy) runs on the current device's: its stream's device (CUDA work
    // is queued on one stream) is made current just before it is submitted. A new tracking
    // event is made on its device by the pool.
    for u in uses {
        let sink = before.get_mut(index(u.record));
        u.stream
            .wait_for_conflicts(&locked[slot(u.tracked)], u.access, sink)?;
    }
    // The events to record after the work, taken before it is submitted: an event that cannot
    // be made fails the operation before anything is queued.
    let is_record = |s: &Stream| uses.iter().any(|u| std::ptr::eq(u.record, s));
    let mut events: Vec<Option<Arc<PooledEvent>>> = Vec::with_capacity(streams.len());
    for s in &streams {
        events.push(if is_record(s) {
            Some(s.device().take_event()?)
        } else {
            None
        });
    }
    let mut current = CurrentDevice::default();
    if let (false, Some(s)) = (nccl, streams.first()) {
        current.set(s.device())?;
    }
    let out = submit(&mut current);
    let mut failed = None;
    for (i, s) in streams.iter().enumerate() {
        let Some(event) = events[i].take() else {
            continue;
        };
        let mine = || uses.iter().filter(|u| std::ptr::eq(u.record, *s));
        let stored = record_and_store(
            held[i].as_ref().expect("held above"),
            || s.record_pooled(event),
            |event| {
                for v in mine() {
                    locked[slot(v.tracked)].record(v.stream.id(), v.access, event.clone());
                    v.stream.note_recorded(event, nccl);
                }
            },
        );
        match stored {
            Ok(event) => recorded(s, &event, before.get(i).unwrap_or(&Vec::new())),
            Err(e) => {
                // The work is queued but untracked. Once it has completed it needs no tracking,
                // and the trackers' older entries stay correct, so the host waits for it here,
                // with the locks held. NCCL work could wait for a peer forever, and the
                // watchdog never saw it: its communicators are aborted first, which ends their
                // kernels, so the wait is bounded. If even waiting fails, the device is in
                // CUDA's sticky error state, where no further work runs.
                if let Work::Nccl { comms } = work {
                    let reason = format!(
                        "the event tracking an NCCL operation could not be recorded after it ({e}): \
                         the operation cannot be watched, so its communicator was aborted"
                    );
                    for &key in comms {
                        crate::nccl::Communicator::abort_by_key(key, &reason);
                    }
                }
                for v in mine() {
                    let _ = v.stream.synchronize_raw();
                }
                failed.get_or_insert(e);
            }
        }
    }
    match (out, failed) {
        (Ok(r), None) => Ok(r),
        (Err(e), _) | (Ok(_), Some(e)) => Err(e),
    }
}

/// The capture branch of [`enqueue`]: checks that the work may go into the graph, notes its uses
/// (before submitting, so that a partly captured operation is tracked too), and submits it.
fn capture<R>(
    uses: &[TrackedUse<'_>],
    work: Work<'_>,
    state: &mut CaptureState,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
) -> Result<R> {
    state.admit(uses.iter().any(|u| u.tracked.host), work)?;
    if let Work::Cuda { keep } = work {
        state.keep.extend(keep.cloned());
    }
    for u in uses {
        state.uses.note(u.tracked.clone(), u.access, Tracked::same);
    }
    let mut current = CurrentDevice::default();
    if !matches!(work, Work::Nccl { .. })
        && let Some(u) = uses.first()
    {
        current.set(u.stream.device())?;
    }
    submit(&mut current)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture(comm: Option<usize>) -> CaptureState {
        CaptureState {
            comm,
            thread: Some(std::thread::current().id()),
            ..CaptureState::default()
        }
    }

    fn refused(r: Result<()>) -> String {
        match r {
            Err(Error::Capture { detail }) => detail,
            other => panic!("admitted, or another error: {other:?}"),
        }
    }

    #[test]
    fn a_capture_admits_its_threads_cuda_work_and_its_communicators_nccl() {
        let c = capture(Some(7));
        assert!(c.admit(false, Work::Cuda { keep: None }).is_ok());
        assert!(c.admit(false, Work::Nccl { comms: &[7] }).is_ok());
    }

    #[test]
    fn a_capture_refuses_what_a_graph_cannot_hold() {
        let c = capture(Some(7));
        let d = refused(c.admit(false, Work::Nccl { comms: &[8] }));
        assert!(d.contains("Graph::capture_with"), "{d}");
        assert!(refused(c.admit(false, Work::Nccl { comms: &[7, 8] })).contains("capture_with"));
        let d = refused(c.admit(true, Work::Cuda { keep: None }));
        assert!(d.contains("pinned host buffer"), "{d}");
        let d = refused(c.admit(
            false,
            Work::Uncapturable {
                what: "allocating a buffer",
            },
        ));
        assert!(d.starts_with("allocating a buffer cannot be captured"), "{d}");
        // Without a communicator, no NCCL at all.
        assert!(refused(capture(None).admit(false, Work::Nccl { comms: &[7] })).contains("capture_with"));
        // A state no capture made admits nothing.
        let d = refused(CaptureState::default().admit(false, Work::Cuda { keep: None }));
        assert!(d.contains("another thread"), "{d}");
    }

    #[test]
    fn a_capture_refuses_another_threads_work() {
        let c = capture(Some(7));
        std::thread::scope(|t| {
            t.spawn(|| {
                let d = refused(c.admit(false, Work::Cuda { keep: None }));
                assert!(d.contains("another thread"), "{d}");
            });
        });
    }
}
