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
//!    ([`crate::engine::tracking`]); the host does not block.
//! 4. `submit` queues the work (a launch; or an NCCL group, which queues nothing before
//!    `ncclGroupEnd`, so the events below are recorded only after the work is really queued).
//! 5. One event is recorded after the work on each *record stream* and stored as the latest use
//!    of every buffer used with it, each under the stream it was used on. A use's record stream
//!    is its own stream, except in an NCCL group: there one event per communicator, on its first
//!    stream, covers all its operations, since NCCL makes every stream of a group wait for the
//!    group ("as if the NCCL group operation was posted on every stream", NCCL's CUDA stream
//!    semantics) and the stream orders held here keep any other use of those streams wholly
//!    before or after. If recording fails, the host waits for the stream instead, so no queued
//!    use is left untracked; every record stream is handled even after an error. A graph
//!    replay records nothing: its graph's event, which the replay records itself on the GPU,
//!    is stored instead ([`enqueue_replay`]).
//!
//! On a stream handoff is capturing into a graph ([`crate::Graph`]), steps 3 and 5 give way to
//! the capture branch: [`CaptureState::admit`] decides whether the work may enter, and its
//! buffers are noted for the graph's replays instead of waited for and recorded; among the
//! capture's streams (every stream of the operation must be one), the same rule as step 3
//! orders it after the capture's conflicting uses, through events recorded into the capture.
//! On a stream someone else captures, nothing is queued ([`Error::Capture`]).

pub(crate) mod capture;
pub(crate) mod device;
pub(crate) mod gate;
pub(crate) mod lend;
pub(crate) mod stream;
pub(crate) mod tracked;
pub(crate) mod tracking;

use std::sync::{Arc, MutexGuard};

use smallvec::SmallVec;

pub(crate) use crate::engine::capture::{
    CaptureState, Captured, CapturingHere, Fork, Keep, SPANNING, capture_error, capturing_here,
    not_capturable,
};
use crate::engine::device::{Device, PooledEvent};
use crate::engine::stream::Stream;
pub(crate) use crate::engine::tracked::Tracked;
use crate::engine::tracking::{Access, Held, UseTracker, record_and_store};
use crate::error::{Error, Result};
use crate::result::cudart as cu;

/// Whether two streams are being captured into one graph (for a group's check).
pub(crate) fn same_capture(a: &Stream, b: &Stream) -> bool {
    if std::ptr::eq(a, b) {
        return true;
    }
    let Some(x) = a.order().hold().capture.clone() else {
        return false;
    };
    b.order()
        .hold()
        .capture
        .as_ref()
        .is_some_and(|y| CaptureState::same(&x, y))
}

/// What a stream's order lock guards: the capture under way there, if any, and the newest
/// tracking event recorded there (under the lock that orders their recording, so that queueing
/// CUDA work takes no other lock of the stream; see [`Stream::note_recorded`]).
#[derive(Default)]
pub(crate) struct StreamState {
    pub(crate) capture: Option<CaptureState>,
    pub(crate) last: Option<Arc<PooledEvent>>,
    /// How many lends of memory to work the engine does not see are open across this stream
    /// ([`lend::HeldOff`]): no capture may begin or join here meanwhile.
    pub(crate) lent: usize,
}

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
pub(crate) type Before = SmallVec<[Arc<PooledEvent>; 2]>;

/// What kind of work an [`enqueue`] queues.
#[derive(Clone, Copy)]
pub(crate) enum Work<'k> {
    /// CUDA work; `keep` is what it refers to besides memory (a kernel's module), which a graph
    /// that captures it must keep alive.
    Cuda { keep: Option<&'k Keep> },
    /// NCCL work on the communicators with these keys ([`crate::Communicator`]'s `key`).
    /// `abort` aborts one of them by key: what the engine does when it cannot track their work
    /// (the NCCL half's, so that the engine needs nothing of it).
    Nccl {
        comms: &'k [usize],
        abort: fn(usize, &str),
    },
    /// CUDA work that a graph cannot hold (an allocation, a copy from or to a host slice):
    /// refused in a capture, checked under the stream's order so that a capture begun by
    /// another thread cannot slip in between.
    Uncapturable { what: &'k str },
    /// No work: the opening (`open`) or the end of lend `id` of the operation's memory to work
    /// the engine does not see, queued on the operation's stream in between (see
    /// [`crate::engine::tracking`]'s "Lends", and [`lend`]). Refused in a capture.
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    Lend { id: u64, open: bool },
}

/// Queues one operation that uses the given memory (steps 2 to 5 above; step 1 is
/// [`check_devices`], which callers run before anything else they check). `recorded` is called
/// with each record stream, the event recorded after the work there, and (for NCCL work,
/// which [`Stream::synchronize`] also reports on) what its uses' streams ran before it, handed
/// over.
///
/// The uses are recorded even when `submit` fails: whatever part of the work reached a stream
/// stays tracked.
///
/// On a stream that handoff is capturing into a graph (every stream of the operation must then
/// be in that capture), the work is captured instead: see [`CaptureState`]; `recorded` is not called.
/// On a stream that someone else is capturing, nothing is queued: [`Error::Capture`]. A use of
/// memory that has been freed (reachable only through a graph that outlived a buffer) is
/// refused.
pub(crate) fn enqueue<R>(
    uses: &[TrackedUse<'_>],
    work: Work<'_>,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
    recorded: impl FnMut(&Stream, &Arc<PooledEvent>, Before),
) -> Result<R> {
    enqueue_with(uses, work, None, submit, recorded)
}

/// How a graph replay is tracked (see [`crate::Graph`]): by the graph's own event, which the
/// replay records on the GPU (an event record node at the end of the capture), so that the
/// launch records nothing from the host.
#[derive(Clone, Copy)]
pub(crate) struct Replay<'e> {
    /// The graph's event (`PooledEvent::is_replayed`): stored as the latest use of every
    /// buffer of the replay, and as its stream's latest work.
    pub(crate) event: &'e Arc<PooledEvent>,
    /// Whether to record a host event after the replay as well (an NCCL graph's every few
    /// launches): a fixed point of the stream, for the watchdog and the in-flight bound, which
    /// must tell replays apart. It is what `recorded` gets; otherwise `recorded` gets `event`.
    pub(crate) checkpoint: bool,
}

/// A replay's refusal of a buffer dropped since its capture.
fn dropped_under_graph() -> Error {
    Error::InvalidArgument(
        "a buffer this graph uses has been dropped: the graph cannot run again (capture a new \
         one, or keep its buffers while it is used)"
            .into(),
    )
}

/// What [`enqueue_replay`] would refuse of a replay on one stream as things stand: a dropped
/// buffer, a use that conflicts with a lend to cudarc, the stream being captured. Asked before
/// a replay is verified across ranks (a graph family's), whose refusal after verification
/// would break its communicator; the state may still change before the replay, which
/// `enqueue_replay` then refuses.
///
/// # Errors
/// As [`enqueue_replay`]'s refusals.
pub(crate) fn check_replay(uses: &[TrackedUse<'_>]) -> Result<()> {
    for u in uses {
        let t = u.tracked.lock();
        if t.is_retired() {
            return Err(dropped_under_graph());
        }
        if t.lent_conflict(u.stream.id(), u.access) {
            return Err(lend::refused(u.access));
        }
    }
    if let Some(u) = uses.first()
        && u.stream.order().hold().capture.is_some()
    {
        return Err(not_capturable("launching a graph"));
    }
    Ok(())
}

/// [`enqueue`] of a graph replay on one stream, tracked as `replay` says. Refused in a
/// capture.
pub(crate) fn enqueue_replay<R>(
    uses: &[TrackedUse<'_>],
    work: Work<'_>,
    replay: Replay<'_>,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
    recorded: impl FnMut(&Stream, &Arc<PooledEvent>, Before),
) -> Result<R> {
    enqueue_with(uses, work, Some(replay), submit, recorded)
}

/// One distinct stream of the operation being queued, with its order held and what the engine
/// keeps for it until the end.
struct OnStream<'s> {
    stream: &'s Stream,
    held: Held<'s, StreamState>,
    /// Whether some use's event is recorded here (a record stream).
    records: bool,
    /// The event to record here after the work, taken before it is submitted.
    event: Option<Arc<PooledEvent>>,
    /// For NCCL work recorded here: what its uses' streams ran (and are made to wait for)
    /// before it.
    before: Before,
}

/// One distinct buffer of the operation, its tracker locked.
struct OnTracker<'t> {
    tracked: &'t Tracked,
    uses: MutexGuard<'t, UseTracker<Arc<PooledEvent>>>,
}

/// The entry of `s` among the operation's streams (few: a linear scan).
fn on<'a, 's>(streams: &'a mut [OnStream<'s>], s: &Stream) -> &'a mut OnStream<'s> {
    streams
        .iter_mut()
        .find(|o| std::ptr::eq(o.stream, s))
        .expect("listed")
}

/// The locked tracker of `t` among the operation's buffers.
fn tracker<'a, 't>(trackers: &'a mut [OnTracker<'t>], t: &Tracked) -> &'a mut UseTracker<Arc<PooledEvent>> {
    &mut trackers
        .iter_mut()
        .find(|o| Tracked::same(o.tracked, t))
        .expect("listed")
        .uses
}

/// Each distinct item of `items` once (few: linear scans with `same`), sorted by `key`; the sort
/// is skipped when they come sorted.
fn distinct_sorted<'a, T, K: Ord>(
    items: impl Iterator<Item = &'a T>,
    same: impl Fn(&T, &T) -> bool,
    key: impl Fn(&T) -> K,
) -> SmallVec<[&'a T; 8]> {
    let mut out: SmallVec<[&'a T; 8]> = SmallVec::new();
    for i in items {
        if !out.iter().any(|o| same(o, i)) {
            out.push(i);
        }
    }
    if !out.is_sorted_by_key(|t| key(t)) {
        out.as_mut_slice().sort_unstable_by_key(|t| key(t));
    }
    out
}

fn enqueue_with<R>(
    uses: &[TrackedUse<'_>],
    work: Work<'_>,
    replay: Option<Replay<'_>>,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
    mut recorded: impl FnMut(&Stream, &Arc<PooledEvent>, Before),
) -> Result<R> {
    let nccl = matches!(work, Work::Nccl { .. });
    // Each distinct stream once, in stream-id order, the order their locks are taken in, so
    // that threads queueing on overlapping streams cannot deadlock (few uses: linear scans).
    // Record streams are among them.
    let ids = distinct_sorted(
        uses.iter().map(|u| u.stream),
        |a, b| std::ptr::eq(a, b),
        Stream::id,
    );
    let mut streams: SmallVec<[OnStream<'_>; 4]> = SmallVec::new();
    for &stream in &ids {
        streams.push(OnStream {
            stream,
            held: stream.order().hold(),
            records: uses.iter().any(|u| std::ptr::eq(u.record, stream)),
            event: None,
            before: Before::new(),
        });
    }
    let mut captures = streams.iter().filter_map(|o| o.held.capture.as_ref());
    let capturing = match captures.next() {
        None => false,
        Some(first) => {
            if streams.iter().any(|o| {
                o.held
                    .capture
                    .as_ref()
                    .is_none_or(|c| !CaptureState::same(c, first))
            }) {
                return Err(capture_error(SPANNING));
            }
            true
        }
    };
    if !capturing {
        for o in &streams {
            o.stream.check_not_captured_elsewhere()?;
        }
    }
    // Each distinct tracker once, locked in key order (a graph's are sorted already).
    let keys = distinct_sorted(uses.iter().map(|u| u.tracked), Tracked::same, Tracked::key);
    let mut trackers: SmallVec<[OnTracker<'_>; 8]> = SmallVec::new();
    for &tracked in &keys {
        trackers.push(OnTracker {
            tracked,
            uses: tracked.lock(),
        });
    }
    if trackers.iter().any(|t| t.uses.is_retired()) {
        return Err(dropped_under_graph());
    }
    if capturing {
        if replay.is_some() {
            return Err(not_capturable("launching a graph"));
        }
        let state = streams
            .first()
            .and_then(|o| o.held.capture.as_ref())
            .expect("capturing");
        return capture(uses, work, &ids, state, submit);
    }
    // Per record stream, what its uses' streams ran before: each stream's newest tracked work,
    // once.
    if nccl {
        for u in uses {
            let Some(last) = on(&mut streams, u.stream).held.last.clone() else {
                continue;
            };
            let b = &mut on(&mut streams, u.record).before;
            if !b.iter().any(|e| Arc::ptr_eq(e, &last)) {
                b.push(last);
            }
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
        let t = tracker(&mut trackers, u.tracked);
        if t.lent_conflict(u.stream.id(), u.access) {
            return Err(lend::refused(u.access));
        }
        let sink = nccl.then(|| &mut on(&mut streams, u.record).before);
        u.stream.wait_for_conflicts(t, u.access, sink)?;
    }
    if nccl {
        exact_before(uses, &mut streams, replay.map(|r| r.event))?;
    }
    // The events to record after the work, taken before it is submitted: an event that cannot
    // be made fails the operation before anything is queued.
    let host_record = replay.is_none_or(|r| r.checkpoint);
    for o in streams.iter_mut().filter(|o| o.records && host_record) {
        o.event = Some(o.stream.device().take_event()?);
    }
    let mut current = CurrentDevice::default();
    if let (false, Some(o)) = (nccl, streams.first()) {
        current.set(o.stream.device())?;
    }
    let out = submit(&mut current);
    let mut failed = None;
    for i in 0..streams.len() {
        let s = streams[i].stream;
        if !streams[i].records {
            continue;
        }
        let mine = || uses.iter().filter(|u| std::ptr::eq(u.record, s));
        if let Some(r) = replay {
            // Recorded by the replay itself, on the GPU: stored now, under the locks, with no
            // call. Each launch stores it again, so wherever it is stored it means the latest
            // replay (see `PooledEvent::replayed`).
            for v in mine() {
                tracker(&mut trackers, v.tracked).record(v.stream.id(), v.access, r.event.clone());
            }
            let o = &mut streams[i];
            s.note_recorded(&mut o.held, r.event, nccl);
            // The checkpoint, if one is due; without it (or if it cannot be recorded) the
            // watchdog watches the replay through the graph's event, which is exact enough
            // for it (see the watchdog's deadline over replays).
            let watched = match o.event.take() {
                Some(event) => match s.record_pooled(event) {
                    Ok(event) => event,
                    Err(e) => {
                        failed.get_or_insert(e);
                        r.event.clone()
                    }
                },
                None => r.event.clone(),
            };
            recorded(s, &watched, std::mem::take(&mut o.before));
            continue;
        }
        let Some(event) = streams[i].event.take() else {
            continue;
        };
        let stored = record_and_store(
            &mut streams,
            || s.record_pooled(event),
            |streams, event| {
                for v in mine() {
                    let t = tracker(&mut trackers, v.tracked);
                    t.record(v.stream.id(), v.access, event.clone());
                    match work {
                        Work::Lend { id, open: true } => t.lend(id, v.stream.id(), v.access),
                        Work::Lend { id, open: false } => {
                            t.end_lend(id);
                        }
                        _ => {}
                    }
                }
                // Once per stream the event follows work of.
                for o in streams.iter_mut() {
                    if mine().any(|v| std::ptr::eq(v.stream, o.stream)) {
                        o.stream.note_recorded(&mut o.held, event, nccl);
                    }
                }
            },
        );
        match stored {
            Ok(event) => recorded(s, &event, std::mem::take(&mut streams[i].before)),
            Err(e) => {
                // The work is queued but untracked. Once it has completed it needs no tracking,
                // and the trackers' older entries stay correct, so the host waits for it here,
                // with the locks held. NCCL work could wait for a peer forever, and the
                // watchdog never saw it: its communicators are aborted first, which ends their
                // kernels, so the wait is bounded. If even waiting fails, the device is in
                // CUDA's sticky error state, where no further work runs.
                if let Work::Nccl { comms, abort } = work {
                    let reason = format!(
                        "the event tracking an NCCL operation could not be recorded after it ({e}): \
                         the operation cannot be watched, so its communicator was aborted"
                    );
                    for &key in comms {
                        abort(key, &reason);
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

/// Makes every [`Before`] list hold only fixed points of streams, as the watchdog's deadline
/// needs (an operation's deadline counts from when its list has completed). A graph's event
/// (`PooledEvent::is_replayed`) is not one: it stands for that graph's latest replay, and a
/// replay launched later, perhaps behind this very operation, would hold the list back until
/// after the operation itself: its deadline would never start. So:
/// - `own`, the replayed graph's own event, is dropped: it is there as its stream's previous
///   work, an earlier replay of the same graph, whose entry is in the same communicator's queue
///   and older, and an entry's deadline starts only once it is the oldest, after that one was
///   seen complete;
/// - where another graph's event is in the list, the list is replaced by one event recorded now
///   (after the waits, before the work) on each stream whose uses it covers: those complete
///   exactly when everything the operation waits behind there has.
fn exact_before(
    uses: &[TrackedUse<'_>],
    streams: &mut [OnStream<'_>],
    own: Option<&Arc<PooledEvent>>,
) -> Result<()> {
    let is_own = |e: &Arc<PooledEvent>| own.is_some_and(|o| Arc::ptr_eq(o, e));
    for i in 0..streams.len() {
        let r = streams[i].stream;
        let b = &streams[i].before;
        if b.iter().any(|e| e.is_replayed() && !is_own(e)) {
            let mut marks = Before::default();
            for o in streams.iter() {
                if uses
                    .iter()
                    .any(|u| std::ptr::eq(u.record, r) && std::ptr::eq(u.stream, o.stream))
                {
                    marks.push(o.stream.record_event()?);
                }
            }
            streams[i].before = marks;
        } else if b.iter().any(is_own) {
            streams[i].before = b.iter().filter(|e| !is_own(e)).cloned().collect();
        }
    }
    Ok(())
}

/// The capture branch of [`enqueue`]: checks that the work may go into the graph, notes its uses
/// (before submitting, so that a partly captured operation is tracked too), orders it after the
/// conflicting uses of the capture on its other streams, submits it, and records one event into
/// the capture after it on each of its streams, for later uses there to wait for.
fn capture<R>(
    uses: &[TrackedUse<'_>],
    work: Work<'_>,
    streams: &[&Stream],
    state: &CaptureState,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
) -> Result<R> {
    state.admit(uses.iter().any(|u| u.tracked.host), work)?;
    let mut shared = state.lock();
    if let Work::Cuda { keep } = work {
        shared.keep.extend(keep.cloned());
    }
    for u in uses {
        shared.uses.note(u.tracked.clone(), u.access, Tracked::same);
    }
    for u in uses {
        for e in shared.within(u.tracked).waits(u.stream.id(), u.access) {
            // SAFETY: the stream is live; the event was recorded into this capture on another
            // of its streams, and is kept alive by the capture's tracker: the wait is an edge of
            // the graph.
            unsafe { cu::stream_wait_event(u.stream.as_raw(), e.raw)? };
        }
    }
    // Not held across the submission (an NCCL group takes its communicators' locks).
    drop(shared);
    let mut current = CurrentDevice::default();
    if !matches!(work, Work::Nccl { .. })
        && let Some(u) = uses.first()
    {
        current.set(u.stream.device())?;
    }
    let out = submit(&mut current);
    let mut shared = state.lock();
    for s in streams {
        let event = s.device().take_event()?;
        // SAFETY: both handles are live and of the same device; recorded into the capture
        // (the stream is captured), where it marks this point of the stream.
        unsafe { cu::event_record(event.raw, s.as_raw())? };
        for u in uses.iter().filter(|u| std::ptr::eq(u.stream, *s)) {
            shared.within(u.tracked).record(s.id(), u.access, event.clone());
        }
    }
    out
}
