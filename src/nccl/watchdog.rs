//! The watchdog: one thread per process that watches every communicator's queued work and
//! aborts a communicator on which NCCL reports an error, or whose oldest unfinished operation
//! has not completed within the timeout of becoming able to start (PyTorch's model).
//! `ncclCommAbort` ends the communicator's kernels, so every host wait on a stream stuck behind
//! one of its operations (`Stream::synchronize`, `DeviceBuffer::to_vec`, `Device::synchronize`,
//! …) returns instead of waiting forever for a peer that will never come.
//!
//! An operation becomes able to start when what its stream ran before it has completed. A
//! receive also needs its sender's side, which may be held up by the sender's own earlier GPU
//! work: each rank's watchdog publishes, in its mailbox, a heartbeat and whether its oldest
//! operation is still held up that way, and a rank whose deadline passed waits on while a peer
//! is demonstrably alive and busy, up to [`PATIENCE`] times the timeout.
//!
//! # Off the enqueueing thread's path
//! It never queries an event while holding a communicator's lock, which every NCCL call on the
//! communicator (every group) takes: a look copies what it needs out (`Arc` clones of a few
//! events, named by their entry's `seq`), queries with the lock released, and takes the lock
//! again to apply what it found, by `seq`, so that entries queued meanwhile (newer `seq`s) are
//! untouched, and an abort meanwhile (which empties the queue) leaves nothing to apply. It takes
//! the lock only with `try_lock`, and breaks a communicator only while holding it: NCCL calls on
//! one communicator never run concurrently, and a communicator in use is looked at again at the
//! next round. (A graph's communicator is then aborted by its own aborter thread, since NCCL's
//! abort waits for the graph to be destroyed: see `State::break_with`.)
//!
//! # The enqueuer's share
//! Every [`TRIM_EVERY`] operations on a communicator, the thread that queued the last one runs
//! the first half of a look itself ([`trim`]: NCCL's error, then what has completed leaves the
//! queue), under the same rules (no query with the lock held). So the queue, and the tracking
//! events it holds from going back to the device's pool, stay about as long as the work the GPU
//! has not yet done, not as long as a whole period's operations.
//!
//! # Newest first
//! NCCL runs one communicator's operations one after another: every group's kernel launch
//! stream first waits for the communicator's `deviceStream` ("userStream[0] waits on
//! deviceStream", `ncclLaunchPrepare` in NCCL 2.28.3's `src/enqueue.cc`, lines 1485-1486), and
//! after the launch the `deviceStream` advances to an event recorded behind the kernel on that
//! stream ("deviceStream waits on userStream[0]", `ncclLaunchFinish`, lines 1698-1708), and
//! every other stream of the group waits for that event too (:1711-1713). A graph's
//! communicator runs only its graph's replays, on one stream. Each entry's event is recorded
//! right after its group on one of the group's streams, under that stream's order. So when
//! the newest entry's event has completed, every older entry's operation has too, and one
//! query drains the whole queue: about one query per look instead of one per operation. While
//! the newest is incomplete, a few entries spread over the queue are queried, oldest first, and
//! everything up to the newest one seen complete is dropped.
//!
//! # Graph replays
//! A graph's replays record the graph's own event on the GPU (`PooledEvent::is_replayed`):
//! it stands for the latest replay launched, not for one. An entry with it is complete, as
//! the newest, when the event is (the latest replay launched before the query has completed,
//! and with it every entry copied before); as an older entry's it says nothing, so it is not
//! asked. An NCCL graph records a host event (a fixed point) after every fourth replay: an
//! entry with one drains the replays before it as any entry does. The oldest entry's deadline
//! therefore covers the entries up to the first fixed point (or all of them), which run one
//! after another: it is that many timeouts from the oldest's start, as long as a healthy run of
//! them may take, and bounded. No entry's `after` holds a graph's event (the engine's
//! `exact_before`), so every deadline starts.
//!
//! # Its own failure
//! A panic in a look at one communicator is caught: that communicator can no longer be watched,
//! so it is aborted (its operations then fail with the panic's reason), and the others are
//! watched on. Should the thread itself end, [`dead`] says why from then on, and every
//! communicator's next call, and [`watch`], fail with it: no operation is queued without a
//! bound.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::nccl::verify::mailbox::now_ms;

use once_cell::sync::OnceCell;

use crate::engine::device::PooledEvent;
use crate::error::{Error, Result};
use crate::nccl::state::{Cut, Pending, Shared, State};
use crate::result::nccl as nc;
use crate::sys::nccl::{ncclComm_t, ncclResult_t};
use crate::trace;

/// How often the watchdog looks. Timeouts are seconds; this bounds how late after one the abort
/// comes.
const PERIOD: Duration = Duration::from_millis(20);

/// A peer's heartbeat older than this counts as a dead peer's.
const FRESH: Duration = Duration::from_millis(1000);

/// How many timeouts an operation may wait, in all, for peers that are alive but busy.
pub(crate) const PATIENCE: u32 = 10;

/// `HANDOFF_WATCHDOG_LOG=1` prints each look at a communicator with queued work to stderr
/// (kept beside the feature `tracing`, whose `TRACE` event is the same look).
static LOG: once_cell::sync::Lazy<bool> =
    once_cell::sync::Lazy::new(|| std::env::var_os("HANDOFF_WATCHDOG_LOG").is_some_and(|v| v == "1"));

/// A watched communicator: its key (`Communicator::key`), which a `Weak` cannot give once its
/// communicator is gone, and its state.
type Watched = (usize, Weak<Shared>);

static WATCHED: OnceCell<std::result::Result<Mutex<Vec<Watched>>, String>> = OnceCell::new();

/// Why the watchdog thread ended, once it has: it never ends otherwise.
static DEAD: OnceLock<String> = OnceLock::new();

/// Why the watchdog thread is gone, if it is (see the module documentation).
pub(crate) fn dead() -> Option<&'static str> {
    DEAD.get().map(String::as_str)
}

/// Starts watching a communicator (and, the first time, the watchdog thread).
///
/// # Errors
/// [`Error::Setup`] if the thread could not be started, or has ended: without it, stream waits
/// behind a stuck operation would have no bound, so no communicator is made.
pub(crate) fn watch(shared: &Arc<Shared>) -> Result<()> {
    let list = WATCHED.get_or_init(|| {
        std::thread::Builder::new()
            .name("handoff-watchdog".into())
            .spawn(|| guarded(&DEAD, run))
            .map(|_| Mutex::new(Vec::new()))
            .map_err(|e| format!("could not start the communicator watchdog thread: {e}"))
    });
    if let Some(reason) = dead() {
        return Err(Error::Setup {
            detail: reason.to_string(),
        });
    }
    match list {
        Ok(list) => {
            list.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((shared.id, Arc::downgrade(shared)));
            Ok(())
        }
        Err(detail) => Err(Error::Setup {
            detail: detail.clone(),
        }),
    }
}

/// The watched communicator whose key (`Communicator::key`) is `key`, if it is alive.
pub(crate) fn watched(key: usize) -> Option<Arc<Shared>> {
    let Some(Ok(list)) = WATCHED.get() else {
        return None;
    };
    let list = list.lock().unwrap_or_else(|p| p.into_inner());
    list.iter()
        .find(|(id, _)| *id == key)
        .and_then(|(_, w)| w.upgrade())
}

/// Runs `body` (the watchdog's loop, which never returns) and records in `dead` why it ended.
fn guarded(dead: &OnceLock<String>, body: impl FnOnce()) {
    let how = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(()) => "returned".to_string(),
        Err(p) => format!("panicked ({})", panic_text(&*p)),
    };
    let _ = dead.set(format!(
        "the communicator watchdog thread {how}: no NCCL operation can be bounded any more, so \
         none is queued (a bug in handoff: please report it)"
    ));
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message")
}

fn run() {
    loop {
        std::thread::sleep(PERIOD);
        let live: Vec<Arc<Shared>> = match WATCHED.get() {
            Some(Ok(list)) => {
                let mut list = list.lock().unwrap_or_else(|p| p.into_inner());
                list.retain(|(_, w)| w.strong_count() > 0);
                list.iter().filter_map(|(_, w)| w.upgrade()).collect()
            }
            _ => continue,
        };
        round(&live, |shared| check(shared, &Cuda));
    }
}

/// One look at each communicator; a look that panics makes its communicator unwatchable
/// (aborted, now or at a later round if it is busy), and the others are still looked at.
fn round(live: &[Arc<Shared>], look: impl Fn(&Shared)) {
    for shared in live {
        if shared.unwatchable.get().is_some() {
            abort_unwatchable(shared);
            continue;
        }
        contained(shared, || look(shared));
    }
}

/// Runs `look` (all or part of a look at `shared`); if it panics, the communicator can no
/// longer be watched: it is marked so, and aborted (now if its lock is free, else at the
/// watchdog's next round).
fn contained(shared: &Shared, look: impl FnOnce()) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(look)) {
        let _ = shared.unwatchable.set(format!(
            "the watchdog's look at rank {}'s communicator panicked ({}): it can no longer \
             be watched, so it is aborted (a bug in handoff: please report it)",
            shared.rank,
            panic_text(&*p)
        ));
        trace::event!(
            error,
            rank = shared.rank,
            device = shared.ordinal,
            panicked = true,
            reason = shared.unwatchable.get().map(String::as_str),
            "handoff: the watchdog aborts a communicator"
        );
        // Aborted now if the lock is free (a panic under it leaves it poisoned, not held).
        abort_unwatchable(shared);
    }
}

/// Aborts a communicator whose look panicked, if its lock is free (else at a later round).
fn abort_unwatchable(shared: &Shared) {
    let Some(reason) = shared.unwatchable.get() else {
        return;
    };
    if let Some(mut state) = shared.try_lock()
        && state.broken.is_none()
    {
        state.break_with(reason.clone(), shared.ordinal, Cut::All);
    }
}

/// What a look asks of CUDA and NCCL; the tests stand in for them.
pub(crate) trait Gpu {
    /// Whether the work before `e` has completed. An error (the device's sticky error state)
    /// counts as not complete: the deadline then decides.
    fn complete(&self, e: &PooledEvent) -> bool;
    /// NCCL's asynchronous error on `raw` (live, its communicator's lock held), if any.
    fn comm_error(&self, raw: ncclComm_t) -> Option<String>;
}

/// The real ones.
struct Cuda;

impl Gpu for Cuda {
    fn complete(&self, e: &PooledEvent) -> bool {
        // SAFETY: the event is kept alive by the caller's Arc.
        (unsafe { crate::result::cudart::event_query(e.raw) }) == Ok(true)
    }

    fn comm_error(&self, raw: ncclComm_t) -> Option<String> {
        // SAFETY: the caller's contract: `raw` is live and its lock held.
        match unsafe { nc::comm_state(raw) } {
            Ok(rc) if rc == ncclResult_t::ncclSuccess || rc == ncclResult_t::ncclInProgress => None,
            Ok(rc) => Some(nc::error("ncclCommGetAsyncError", rc).to_string()),
            Err(e) => Some(e.to_string()),
        }
    }
}

/// The state, if its lock is free and the communicator still live.
fn live_state(shared: &Shared) -> Option<MutexGuard<'_, State>> {
    shared.try_lock().filter(live)
}

/// Whether the communicator is live: neither broken nor destroyed.
fn live(state: &MutexGuard<'_, State>) -> bool {
    state.broken.is_none() && !state.raw.is_null()
}

/// How many entries of the queue a look copies out to query, at most: the newest, then some
/// spread evenly from the oldest.
const PROBES: usize = 8;

/// Entries copied out of the queue to query unlocked, newest first then oldest first.
type Probes = [Option<(u64, Arc<PooledEvent>)>; PROBES];

fn probes(pending: &VecDeque<Pending>) -> Probes {
    let mut out: Probes = Default::default();
    let Some(last) = pending.len().checked_sub(1) else {
        return out;
    };
    let mut taken = 0;
    for i in std::iter::once(last).chain((0..PROBES - 1).map(|k| last * k / (PROBES - 1))) {
        if taken > 0 && out[..taken].iter().flatten().any(|(s, _)| *s == pending[i].seq) {
            continue;
        }
        // A graph's event stands for its latest replay (see `PooledEvent::is_replayed`): as
        // the newest entry's, complete means every entry copied here is; as an older one's,
        // incomplete says nothing about that entry. Only the newest is asked.
        if taken > 0 && pending[i].event.is_replayed() {
            continue;
        }
        out[taken] = Some((pending[i].seq, pending[i].event.clone()));
        taken += 1;
    }
    out
}

/// The newest `seq` among `probes` whose event has completed: the newest first (one query when
/// the queue is done), then from the oldest until one is not.
fn newest_complete(probes: &Probes, gpu: &impl Gpu) -> Option<u64> {
    let (newest, newest_event) = probes[0].as_ref()?;
    if gpu.complete(newest_event) {
        return Some(*newest);
    }
    let mut done = None;
    for (seq, e) in probes[1..].iter().flatten() {
        if !gpu.complete(e) {
            break;
        }
        done = Some(*seq);
    }
    done
}

/// How often the enqueueing thread trims its communicator's queue itself ([`trim`]): every
/// this many operations.
const TRIM_EVERY: u64 = 64;

/// Whether the enqueueing thread, having just queued operation `seq` (`queued` entries now),
/// is due to [`trim`] the queue: every [`TRIM_EVERY`] operations.
pub(crate) fn trim_due(seq: u64, queued: usize) -> bool {
    (seq + 1).is_multiple_of(TRIM_EVERY) && queued > 0
}

/// Drops what has completed from the queue of `shared`: called by the enqueueing thread when
/// [`trim_due`] says so, once the operation is queued and every lock let go of (a panic here
/// is contained as in the watchdog's own look: the communicator is aborted, never left
/// unwatched).
///
/// Without it every operation's tracking event stays queued until the watchdog's next look, up
/// to [`PERIOD`] later: thousands of events at a few microseconds an operation, which the
/// device's event pool must then hold too, and whose every reuse finds cold memory. With it the
/// queue stays about as long as the work the GPU has not yet done (and at most this long when
/// the GPU keeps up), for NCCL's error state and a few event queries per [`TRIM_EVERY`]
/// operations. It is the first half of the watchdog's look ([`drain`]): deadlines stay the
/// watchdog's.
pub(crate) fn trim(shared: &Shared) {
    trim_with(shared, &Cuda);
}

fn trim_with(shared: &Shared, gpu: &impl Gpu) {
    // Waits for the lock (the watchdog never holds it across a query): a trim skipped because
    // the watchdog happened to be looking would leave the queue as long as before.
    contained(shared, || {
        drain(shared, gpu, |s| Some(s.lock()).filter(live));
    });
}

/// The first half of a look (see the module documentation): NCCL's error, then what has
/// completed is dropped (NCCL's error asked again first). Returns the state, locked, unless
/// the communicator broke (or is busy). No event is queried with the lock held. `lock` takes
/// the state if the communicator is live (the watchdog's only if it is free).
fn drain<'s>(
    shared: &'s Shared,
    gpu: &impl Gpu,
    lock: impl Fn(&'s Shared) -> Option<MutexGuard<'s, State>>,
) -> Option<MutexGuard<'s, State>> {
    // Breaks the communicator on NCCL's error: kernels it ended early have completed events,
    // which must not be taken for work that completed.
    let broke = |state: &mut MutexGuard<'s, State>| match gpu.comm_error(state.raw) {
        Some(e) => {
            let reason = format!("the watchdog found an NCCL error on rank {}: {e}", shared.rank);
            trace::event!(
                error,
                rank = shared.rank,
                device = shared.ordinal,
                reason = %reason,
                "handoff: the watchdog aborts a communicator"
            );
            state.break_with(reason, shared.ordinal, Cut::All);
            true
        }
        None => false,
    };
    let mut state = lock(shared)?;
    if broke(&mut state) {
        return None;
    }
    let probes = probes(&state.pending);
    if probes[0].is_some() {
        drop(state);
        let done = newest_complete(&probes, gpu);
        state = lock(shared)?;
        // Asked again before anything is dropped: an error that came while the events were
        // queried would otherwise let cut-short work leave the queue as complete, unpoisoned.
        if broke(&mut state) {
            return None;
        }
        if let Some(done) = done {
            // By `seq`: entries queued since the copy are newer and stay.
            while state.pending.front().is_some_and(|p| p.seq <= done) {
                state.pending.pop_front();
            }
        }
    }
    Some(state)
}

/// One look at one communicator (see the module documentation): [`drain`], then the oldest
/// operation's deadline. No event is queried with the lock held.
fn check(shared: &Shared, gpu: &impl Gpu) {
    let Some(mut state) = drain(shared, gpu, live_state) else {
        return;
    };
    // The oldest operation's deadline counts from when what its stream ran before it completed.
    let mut held_up = false;
    if let Some(front) = state.pending.front()
        && front.started.is_none()
    {
        let (seq, after) = (front.seq, front.after.clone());
        drop(state);
        let ready = after.iter().all(|e| gpu.complete(e));
        let seen = Instant::now();
        drop(after);
        let Some(again) = live_state(shared) else {
            return;
        };
        state = again;
        if let Some(front) = state.pending.front_mut()
            && front.seq == seq
        {
            if ready {
                front.started.get_or_insert(seen);
                front.after = Default::default();
            } else {
                held_up = true;
            }
        }
    }
    let now = Instant::now();
    let wall = now_ms();
    if let Some(mine) = state.mine() {
        mine.set_heartbeat(wall, held_up);
    }
    let started = state.pending.front().and_then(|p| p.started);
    trace::with_tracing! {
        if !state.pending.is_empty() {
            trace::event!(
                trace,
                rank = shared.rank,
                device = shared.ordinal,
                pending = state.pending.len(),
                held_up,
                waiting = ?started.map(|t| now.saturating_duration_since(t)),
                "handoff: watchdog look"
            );
        }
    }
    if *LOG && !state.pending.is_empty() {
        eprintln!(
            "handoff watchdog: rank {} on device {}: {} pending, oldest held up by its stream: \
             {held_up}, waiting for {:?}, a peer busy: {}",
            shared.rank,
            shared.ordinal,
            state.pending.len(),
            started.map(|t| now.saturating_duration_since(t)),
            peer_busy(&state, wall, Duration::ZERO, state.timeout)
        );
    }
    let Some(started) = started else {
        return;
    };
    let waited = now.saturating_duration_since(started);
    let timeout = state.timeout.saturating_mul(span(&state.pending));
    if waited <= timeout || peer_busy(&state, wall, waited, timeout) {
        return;
    }
    let reason = format!(
        "rank {}'s oldest queued operation did not complete within {:?} of becoming able to start \
         (the watchdog aborted the communicator: a peer may have died, or never run its side)",
        shared.rank, timeout
    );
    trace::event!(
        error,
        rank = shared.rank,
        device = shared.ordinal,
        timeout = ?timeout,
        reason = %reason,
        "handoff: the watchdog aborts a communicator"
    );
    state.break_with(reason, shared.ordinal, Cut::Incomplete);
}

/// How many operations the oldest entry's deadline covers: one, unless its event is a graph's
/// (`PooledEvent::is_replayed`, the latest replay), whose completion the watchdog sees only
/// through a later entry's fixed point, or the newest's: then every entry up to the first with
/// a fixed point (an NCCL graph records one every fourth replay), or all of them. Those run one
/// after another, each within its timeout of starting if nothing is wrong, so together within
/// that many timeouts of the first one starting: the deadline over them is that long, never
/// shorter than a healthy run of them, and still bounded.
fn span(pending: &VecDeque<Pending>) -> u32 {
    let n = pending
        .iter()
        .position(|p| !p.event.is_replayed())
        .map_or(pending.len(), |i| i + 1);
    u32::try_from(n.max(1)).unwrap_or(u32::MAX)
}

/// Whether some peer is alive and held up by its own GPU work, and the operation has waited
/// less than [`PATIENCE`] times `timeout` (all of it, for a timeout too long to multiply).
fn peer_busy(state: &State, wall: u64, waited: Duration, timeout: Duration) -> bool {
    let Some(regions) = &state.regions else {
        return false;
    };
    waited < timeout.saturating_mul(PATIENCE)
        && regions
            .iter()
            .enumerate()
            .any(|(r, region)| r != state.rank && region.busy_and_alive(wall, FRESH.as_millis() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::device::Device;
    use crate::nccl::verify::mailbox::Region;
    use std::cell::{Cell, RefCell};

    /// A device never dropped: its drop would hand the fake events to CUDA.
    fn device() -> &'static Device {
        Box::leak(Box::new(Device::for_tests()))
    }

    /// A communicator's shared state over a made-up handle (`live`) or none, which no test lets
    /// reach NCCL (no error, no missed deadline).
    fn shared(live: bool) -> Shared {
        let raw = if live {
            std::ptr::NonNull::dangling().as_ptr()
        } else {
            std::ptr::null_mut()
        };
        Shared::new(State::new(raw, 0, Duration::from_secs(3600)), 0, 0)
    }

    /// A live communicator's state whose abort hands its (made-up) handle to an aborter that
    /// drops it, never to NCCL: for tests that break it.
    fn live_aborted_by_hand() -> Shared {
        let s = shared(true);
        let (to, from) = std::sync::mpsc::channel();
        s.lock().graph_aborter = Some(crate::nccl::state::GraphAborter {
            handle: Some(to),
            thread: std::thread::spawn(move || drop(from.recv())),
        });
        s
    }

    /// What another thread does while the watchdog queries.
    type During<'a> = Box<dyn FnOnce(&Shared) + 'a>;

    /// Events are numbered by their handle; those up to `done` have completed. Every query
    /// checks that the communicator's lock is free, and may run `during` (another thread's
    /// enqueue or abort) as if it came while the lock was released.
    struct Fake<'a> {
        shared: &'a Shared,
        done: Cell<usize>,
        queries: Cell<usize>,
        during: RefCell<Option<During<'a>>>,
        /// Whether NCCL reports an error once an event has been queried.
        fails_once_queried: Cell<bool>,
    }

    impl<'a> Fake<'a> {
        fn new(shared: &'a Shared, done: usize) -> Self {
            Fake {
                shared,
                done: Cell::new(done),
                queries: Cell::new(0),
                during: RefCell::new(None),
                fails_once_queried: Cell::new(false),
            }
        }
    }

    impl Gpu for Fake<'_> {
        fn complete(&self, e: &PooledEvent) -> bool {
            assert!(
                self.shared.state.try_lock().is_ok(),
                "an event was queried with the communicator's lock held"
            );
            self.queries.set(self.queries.get() + 1);
            if let Some(f) = self.during.borrow_mut().take() {
                f(self.shared);
            }
            (e.raw as usize) <= self.done.get()
        }

        fn comm_error(&self, _: ncclComm_t) -> Option<String> {
            (self.fails_once_queried.get() && self.queries.get() > 0).then(|| "a remote error".into())
        }
    }

    /// Queues operations whose events are numbered `events`, each after nothing.
    fn queue(shared: &Shared, events: impl IntoIterator<Item = usize>) {
        let mut state = shared.lock();
        for e in events {
            state.push_pending(device().fake_event(e), Default::default());
        }
    }

    fn seqs(shared: &Shared) -> Vec<u64> {
        shared.lock().pending.iter().map(|p| p.seq).collect()
    }

    #[test]
    fn one_query_of_the_newest_drains_a_completed_queue() {
        let s = shared(true);
        queue(&s, 1..=100);
        let gpu = Fake::new(&s, 100);
        check(&s, &gpu);
        assert!(seqs(&s).is_empty());
        assert_eq!(
            gpu.queries.get(),
            1,
            "the newest alone says the whole queue is done"
        );
    }

    /// The enqueueing thread's trim: one look's drain every `TRIM_EVERY` operations, none in
    /// between.
    #[test]
    fn the_enqueuers_trim_keeps_a_completed_queue_short_without_the_watchdog() {
        let s = shared(true);
        let gpu = Fake::new(&s, usize::MAX);
        // Queues the operation whose event is numbered `e` and trims if due, as
        // `Communicator::note_pending_from` and its caller do; returns the queue's length
        // before the trim.
        let enqueue = |e: usize| {
            let (seq, queued) = {
                let mut state = s.lock();
                let seq = state.push_pending(device().fake_event(e), Default::default());
                (seq, state.pending.len())
            };
            if trim_due(seq, queued) {
                trim_with(&s, &gpu);
            }
            queued
        };
        let mut longest = 0;
        for e in 1..=10 * TRIM_EVERY as usize {
            longest = longest.max(enqueue(e));
        }
        assert!(seqs(&s).is_empty(), "the last trim left {:?}", seqs(&s));
        assert_eq!(
            longest as u64, TRIM_EVERY,
            "the queue never grew past one trim's worth"
        );
        assert_eq!(gpu.queries.get(), 10, "one query (the newest, complete) per trim");
        // An empty queue is not trimmed, and would not be asked about.
        assert!(!trim_due(TRIM_EVERY - 1, 0));
        trim_with(&s, &gpu);
        assert_eq!(gpu.queries.get(), 10);
        // A queue still running is trimmed of what completed, and no more.
        gpu.done.set(10 * TRIM_EVERY as usize + TRIM_EVERY as usize / 2);
        for e in 10 * TRIM_EVERY as usize + 1..=11 * TRIM_EVERY as usize {
            enqueue(e);
        }
        let left = seqs(&s);
        assert!(!left.is_empty() && left.len() < TRIM_EVERY as usize, "{left:?}");
        assert_eq!(left.last(), Some(&(11 * TRIM_EVERY - 1)));
    }

    /// An NCCL error that comes while the events are queried: nothing leaves the queue as
    /// complete (NCCL may have completed those events by ending their kernels early), and the
    /// queued work is marked cut short.
    #[test]
    fn an_error_while_the_events_are_queried_drops_nothing_as_complete() {
        let s = live_aborted_by_hand();
        let events: Vec<_> = (1..=3).map(|e| device().fake_event(e)).collect();
        {
            let mut state = s.lock();
            for e in &events {
                state.push_pending(e.clone(), Default::default());
            }
        }
        let gpu = Fake::new(&s, 3);
        gpu.fails_once_queried.set(true);
        trim_with(&s, &gpu);
        let reason = s.lock().broken.clone().expect("broken by the error");
        assert!(reason.contains("a remote error"), "{reason}");
        for e in &events {
            assert!(
                e.poisoned().is_some(),
                "work queued when the error came is cut short"
            );
        }
    }

    /// A panic in the enqueueing thread's trim is contained as one in the watchdog's look: the
    /// communicator is aborted with why, not left queued with nothing watching it.
    #[test]
    fn a_panicking_trim_aborts_its_communicator() {
        let s = live_aborted_by_hand();
        queue(&s, 1..=3);
        let gpu = Fake::new(&s, 3);
        *gpu.during.borrow_mut() = Some(Box::new(|_| panic!("a bug in a trim")));
        trim_with(&s, &gpu);
        let reason = s.lock().broken.clone().expect("aborted");
        assert!(reason.contains("panicked (a bug in a trim)"), "{reason}");
        assert!(s.unwatchable.get().is_some());
    }

    #[test]
    fn an_incomplete_newest_drops_what_the_probes_saw_complete() {
        let s = shared(true);
        queue(&s, 1..=15);
        // Events 1..=8 complete: the probes (oldest first, every other entry here) see up to
        // event 7 complete; event 9's probe is not, and stops the search.
        let gpu = Fake::new(&s, 8);
        check(&s, &gpu);
        let left = seqs(&s);
        assert_eq!(
            left.first(),
            Some(&7),
            "entries up to the newest probe seen complete go"
        );
        assert_eq!(left.last(), Some(&14));
        // The oldest left (event 8) then starts its deadline: it ran after nothing.
        assert!(s.lock().pending.front().is_some_and(|p| p.started.is_some()));
        assert!(gpu.queries.get() <= PROBES, "{} queries", gpu.queries.get());
        // Everything done: one query drains the rest.
        gpu.done.set(15);
        gpu.queries.set(0);
        check(&s, &gpu);
        assert!(seqs(&s).is_empty());
        assert_eq!(gpu.queries.get(), 1);
    }

    #[test]
    fn work_queued_while_the_watchdog_queries_stays_queued() {
        let s = shared(true);
        queue(&s, 1..=3);
        let gpu = Fake::new(&s, 3);
        // Another thread enqueues (event 9, not complete) while the newest is queried.
        *gpu.during.borrow_mut() = Some(Box::new(|s: &Shared| queue(s, [9])));
        check(&s, &gpu);
        assert_eq!(
            seqs(&s),
            [3],
            "the entry queued meanwhile is newer than what was seen"
        );
    }

    #[test]
    fn an_abort_while_the_watchdog_queries_leaves_nothing_to_apply() {
        let s = shared(true);
        queue(&s, 1..=3);
        let gpu = Fake::new(&s, 3);
        // As `State::break_with` leaves the state (the abort itself is NCCL's).
        *gpu.during.borrow_mut() = Some(Box::new(|s: &Shared| {
            let mut state = s.lock();
            state.pending.clear();
            state.broken = Some("aborted meanwhile".into());
            state.raw = std::ptr::null_mut();
        }));
        check(&s, &gpu);
        assert!(seqs(&s).is_empty());
        assert_eq!(gpu.queries.get(), 1, "nothing is looked at after the abort");
    }

    #[test]
    fn the_deadline_starts_once_what_the_stream_ran_before_has_completed() {
        let s = shared(true);
        let d = device();
        s.lock()
            .push_pending(d.fake_event(10), [d.fake_event(5)].into_iter().collect());
        let gpu = Fake::new(&s, 4);
        check(&s, &gpu);
        let started = |s: &Shared| s.lock().pending.front().and_then(|p| p.started);
        assert!(started(&s).is_none(), "held up by event 5");
        gpu.done.set(5);
        check(&s, &gpu);
        assert!(started(&s).is_some());
        assert_eq!(s.lock().pending[0].after.iter().count(), 0, "no longer needed");
    }

    #[test]
    fn a_timeout_too_long_to_multiply_does_not_panic() {
        let s = shared(true);
        let mut state = s.lock();
        state.timeout = Duration::MAX;
        state.regions = Some((0..2).map(|r| Arc::new(Region::in_process(2, r))).collect());
        state.regions.as_ref().expect("set")[1].set_heartbeat(now_ms(), true);
        assert!(peer_busy(&state, now_ms(), Duration::ZERO, state.timeout));
        assert!(peer_busy(
            &state,
            now_ms(),
            Duration::from_secs(u64::MAX / 2),
            state.timeout.saturating_mul(span(&state.pending))
        ));
    }

    /// An NCCL graph's replays: each entry's event the graph's own (the latest replay, here
    /// never complete: 100), and a fixed point after every fourth (numbered 4, 8, ...).
    fn queue_replays(shared: &Shared, replays: u64) {
        let d = device();
        let graphs = d.fake_replayed_event(100);
        let mut state = shared.lock();
        for n in 1..=replays {
            let e = if n.is_multiple_of(4) {
                d.fake_event(n as usize)
            } else {
                graphs.clone()
            };
            state.push_pending(e, Default::default());
        }
    }

    #[test]
    fn a_graphs_event_is_asked_only_as_the_newest_and_fixed_points_drain_the_replays_before() {
        let s = shared(true);
        queue_replays(&s, 10);
        // Replays up to 8 complete; the latest (10) is not.
        let gpu = Fake::new(&s, 9);
        check(&s, &gpu);
        // Asked as an older entry's, the graph's event (incomplete: the latest replay runs)
        // would stop the search at the first replay and drain nothing.
        assert_eq!(
            seqs(&s),
            [8, 9],
            "replays up to the fixed point after the 8th are done"
        );
        // The two left are watched through the graph's event: done once it is.
        gpu.done.set(100);
        check(&s, &gpu);
        assert!(seqs(&s).is_empty());
    }

    #[test]
    fn the_deadline_over_replays_spans_them_up_to_the_next_fixed_point() {
        let s = shared(true);
        assert_eq!(span(&s.lock().pending), 1, "an empty queue");
        queue_replays(&s, 6);
        // Replays 1 to 4 (the 4th's a fixed point) before the oldest is seen complete.
        assert_eq!(span(&s.lock().pending), 4);
        s.lock().pending.drain(..4);
        // Replays 5 and 6, the tail, watched through the graph's event alone.
        assert_eq!(span(&s.lock().pending), 2);
        let plain = shared(true);
        queue(&plain, 1..=3);
        assert_eq!(span(&plain.lock().pending), 1, "eager work: one operation each");
    }

    #[test]
    fn a_panicking_look_aborts_its_communicator_and_the_others_are_still_watched() {
        let (a, b) = (Arc::new(shared(false)), Arc::new(shared(false)));
        queue(&a, [1]);
        let looked = RefCell::new(Vec::new());
        round(&[a.clone(), b.clone()], |s| {
            looked.borrow_mut().push(s as *const Shared);
            if std::ptr::eq(s, &*a) {
                let _held = s.lock();
                panic!("a bug in a look");
            }
        });
        assert_eq!(looked.borrow().len(), 2, "the second communicator was looked at");
        let reason = a
            .lock()
            .broken
            .clone()
            .expect("the unwatchable communicator is aborted");
        assert!(reason.contains("panicked (a bug in a look)"), "{reason}");
        assert!(a.lock().pending.is_empty());
        assert!(b.lock().broken.is_none());
        // From then on it is not looked at again.
        round(std::slice::from_ref(&a), |_| panic!("looked at again"));
    }

    #[test]
    fn the_thread_ending_is_recorded() {
        let dead = OnceLock::new();
        guarded(&dead, || panic!("boom"));
        let reason = dead.get().expect("recorded");
        assert!(reason.contains("panicked (boom)"), "{reason}");
        let dead = OnceLock::new();
        guarded(&dead, || {});
        assert!(dead.get().expect("recorded").contains("returned"));
    }
}
