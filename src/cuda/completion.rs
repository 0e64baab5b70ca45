//! Async completion: futures for an [`Event`]'s last record ([`Event::completed`]), a stream's
//! work so far ([`Stream::completion`]) and, elsewhere, a host buffer's data
//! ([`crate::HostBuffer::read_async`]) and a communicator's queued work
//! ([`crate::Communicator::wait_stream_async`]). They are plain [`std::future::Future`]s, woken
//! through their [`Waker`]: no executor is assumed, and none blocks the thread that polls it.
//!
//! # How they are woken
//! One thread per process, started at the first future that has to wait (so a program that
//! never awaits one pays nothing, and a future whose work is already done when first polled
//! never starts it), polls every pending future's event with `cudaEventQuery` and wakes the
//! futures whose events have completed, or whose deadline has come. Between rounds it sleeps,
//! from 10 µs after a round that woke something, doubling to 200 µs while nothing
//! completes; with nothing pending it parks, costing nothing, until a future registers.
//!
//! Why a polling thread and not `cudaLaunchHostFunc` (a callback queued on an internal stream
//! after `cudaStreamWaitEvent` on the event):
//! - **Bounded.** Every wait here has a deadline, and work that never completes (a peer that
//!   never comes) never runs a callback: a timer is needed anyway, and the polling thread is
//!   one, with no second mechanism.
//! - **Dropping.** A dropped future must leave nothing behind. A callback's argument has to
//!   live until CUDA runs it, which for work that never completes is never: each dropped
//!   pending future would leak its registration (or need a reference count the callback
//!   drops, on CUDA's callback thread). Here a drop removes its entry under a lock, and the
//!   thread never touches it again.
//! - **No CUDA call in a callback, and no stream of ours in the way.** A host function may
//!   call no CUDA function, blocks its stream while it runs, and every device would need an
//!   internal stream whose queue the callbacks serialise on (one slow waker delays every later
//!   one). A query is one cheap runtime call on a thread of ours.
//! - **Cost.** A callback costs two runtime calls per future (the wait and the launch), made on
//!   the polling thread of the executor; a registration here is a map insert under a lock, and
//!   the thread's queries are off the executor's threads. The price is latency: a completion
//!   is seen up to 200 µs late while nothing else completes, and the thread wakes about every
//!   200 µs while futures are pending.
//!
//! The thread holds every pending future's event (an `Arc`), so a query never reaches a
//! destroyed handle, and queries outside its lock, so a registration or a drop never waits
//! behind a round of queries. A future that is dropped while its event is pending frees
//! nothing on the GPU: the buffers its work uses stay tracked by their own events, not by the
//! future.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::cuda::stream::{Event, OwnedEvent};
use crate::engine::device::{PooledEvent, check_poison};
use crate::engine::stream::Stream;
use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::cudaEvent_t;

/// The thread's sleep after a round that woke a future.
const FIRST: Duration = Duration::from_micros(10);
/// The longest sleep between rounds while futures are pending: how late a completion may be
/// seen.
const LAST: Duration = Duration::from_micros(200);

/// An event a future waits for, kept alive by whoever holds it.
pub(crate) trait Query: Send + Sync {
    /// The handle, live for as long as `self`.
    fn handle(&self) -> cudaEvent_t;
}

impl Query for PooledEvent {
    fn handle(&self) -> cudaEvent_t {
        self.raw
    }
}

impl Query for OwnedEvent {
    fn handle(&self) -> cudaEvent_t {
        self.0
    }
}

/// Whether the work before `e` has completed; an error (a fault in that work) is returned.
fn query(e: &dyn Query) -> Result<bool> {
    // SAFETY: the handle is live for as long as `e`, which the caller holds.
    unsafe { cu::event_query(e.handle()) }
}

/// A pending future's registration: its event, when to wake it regardless, its waker.
struct Entry {
    event: Arc<dyn Query>,
    wake_at: Option<Instant>,
    waker: Waker,
}

struct Entries {
    next: u64,
    map: BTreeMap<u64, Entry>,
    /// The thread waits on [`WAKE`] for a first entry.
    parked: bool,
}

static ENTRIES: Mutex<Entries> = Mutex::new(Entries {
    next: 0,
    map: BTreeMap::new(),
    parked: false,
});
static WAKE: Condvar = Condvar::new();
/// Whether the thread was started, or why it could not be.
static STARTED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
/// Why the thread ended, once it has (it never ends otherwise).
static DEAD: OnceLock<String> = OnceLock::new();

fn entries() -> MutexGuard<'static, Entries> {
    ENTRIES.lock().unwrap_or_else(|p| p.into_inner())
}

/// The thread, started the first time; [`Error::Setup`] if it cannot be, or has ended.
fn poller() -> Result<()> {
    let started = STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("handoff-completion".into())
            .spawn(|| {
                let how = match std::panic::catch_unwind(run) {
                    Ok(never) => match never {},
                    Err(_) => "panicked",
                };
                let _ = DEAD.set(format!(
                    "the thread that wakes handoff's futures {how} (a bug in handoff: please \
                     report it); async waits can no longer be woken"
                ));
                // Every future still registered is woken, to see the error.
                let gone = std::mem::take(&mut entries().map);
                for e in gone.into_values() {
                    e.waker.wake();
                }
            })
            .map(drop)
            .map_err(|e| format!("could not start the thread that wakes handoff's futures: {e}"))
    });
    let detail = match (started, DEAD.get()) {
        (Err(e), _) => e.clone(),
        (Ok(()), Some(dead)) => dead.clone(),
        (Ok(()), None) => return Ok(()),
    };
    Err(Error::Setup { detail })
}

fn run() -> std::convert::Infallible {
    // Reused every round: a round allocates nothing once they have grown.
    let mut batch: Vec<(u64, Arc<dyn Query>, Option<Instant>)> = Vec::new();
    let mut due: Vec<u64> = Vec::new();
    let mut woken: Vec<Entry> = Vec::new();
    let mut sleep = FIRST;
    loop {
        {
            let mut g = entries();
            while g.map.is_empty() {
                g.parked = true;
                g = WAKE.wait(g).unwrap_or_else(|p| p.into_inner());
                sleep = FIRST;
            }
            g.parked = false;
            batch.extend(g.map.iter().map(|(&id, e)| (id, e.event.clone(), e.wake_at)));
        }
        // Outside the lock: a registration or a drop never waits for the queries, and the
        // copies keep every handle alive until they are done.
        let now = Instant::now();
        for (id, event, at) in batch.drain(..) {
            // An error wakes the future too: it reads the error from its own query.
            if at.is_some_and(|t| t <= now) || !matches!(query(&*event), Ok(false)) {
                due.push(id);
            }
        }
        let next_at = {
            let mut g = entries();
            // A future dropped or completed meanwhile is no longer there: nothing to wake.
            woken.extend(due.drain(..).filter_map(|id| g.map.remove(&id)));
            g.map.values().filter_map(|e| e.wake_at).min()
        };
        // Woken outside the lock: a waker may run anything, a future's drop included.
        sleep = if woken.is_empty() {
            (sleep * 2).min(LAST)
        } else {
            FIRST
        };
        for e in woken.drain(..) {
            e.waker.wake();
        }
        let nap = next_at.map_or(sleep, |t| sleep.min(t.saturating_duration_since(Instant::now())));
        std::thread::sleep(nap);
    }
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Every event has completed.
    Complete,
    /// The deadline passed first.
    Expired,
}

/// The shared core of the futures: events to wait for, in order, a deadline, and this wait's
/// registration with the thread while it is pending.
pub(crate) struct Waiting {
    events: SmallVec<[Arc<dyn Query>; 2]>,
    /// How many of `events`, from the first, have been seen complete.
    done: usize,
    deadline: Option<Instant>,
    /// This wait's entry, while it has one.
    slot: Option<u64>,
}

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiting")
            .field("events", &self.events.len())
            .field("done", &self.done)
            .field("deadline", &self.deadline)
            .field("registered", &self.slot.is_some())
            .finish()
    }
}

impl Waiting {
    /// A wait for every one of `events`, until `deadline` if any.
    pub(crate) fn new(events: impl IntoIterator<Item = Arc<dyn Query>>, deadline: Option<Instant>) -> Self {
        Waiting {
            events: events.into_iter().collect(),
            done: 0,
            deadline,
            slot: None,
        }
    }

    /// Sets the deadline (the earlier one wins).
    pub(crate) fn bound(&mut self, deadline: Instant) {
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline)));
    }

    /// Queries the events not yet seen complete, without blocking: ready when all have
    /// completed or the deadline has passed (completion first: work done at the deadline
    /// counts as done), or with the first CUDA error. Otherwise registers `cx`'s waker, to be
    /// woken when the first pending event completes, at the deadline, and after `recheck` if
    /// given (for a caller that must look at something else from time to time).
    ///
    /// # Errors
    /// CUDA errors from the queries (a fault in the work waited for); [`Error::Setup`] if the
    /// waking thread cannot be started.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>, recheck: Option<Duration>) -> Poll<Result<Outcome>> {
        while let Some(e) = self.events.get(self.done) {
            match query(&**e) {
                Ok(true) => self.done += 1,
                Ok(false) => break,
                Err(err) => {
                    self.cancel();
                    return Poll::Ready(Err(err));
                }
            }
        }
        let now = Instant::now();
        let Some(pending) = self.events.get(self.done).cloned() else {
            self.cancel();
            return Poll::Ready(Ok(Outcome::Complete));
        };
        if self.deadline.is_some_and(|d| d <= now) {
            self.cancel();
            return Poll::Ready(Ok(Outcome::Expired));
        }
        if let Err(e) = poller() {
            self.cancel();
            return Poll::Ready(Err(e));
        }
        let wake_at = match (self.deadline, recheck) {
            (d, None) => d,
            (None, Some(r)) => Some(now + r),
            (Some(d), Some(r)) => Some(d.min(now + r)),
        };
        let mut old = None;
        {
            let mut g = entries();
            // The thread removes an entry when it wakes it: registered again then.
            match self.slot.and_then(|id| g.map.get_mut(&id)) {
                Some(entry) => {
                    if !entry.waker.will_wake(cx.waker()) {
                        old = Some(std::mem::replace(&mut entry.waker, cx.waker().clone()));
                    }
                    if !Arc::ptr_eq(&entry.event, &pending) {
                        entry.event = pending;
                    }
                    entry.wake_at = wake_at;
                }
                None => {
                    let id = g.next;
                    g.next += 1;
                    g.map.insert(
                        id,
                        Entry {
                            event: pending,
                            wake_at,
                            waker: cx.waker().clone(),
                        },
                    );
                    self.slot = Some(id);
                    if g.parked {
                        g.parked = false;
                        WAKE.notify_one();
                    }
                }
            }
        }
        // Dropped outside the lock: a waker's drop may run anything.
        drop(old);
        Poll::Pending
    }

    /// Removes this wait's entry, if it has one: the thread will not wake it.
    pub(crate) fn cancel(&mut self) {
        if let Some(id) = self.slot.take() {
            let entry = entries().map.remove(&id);
            drop(entry);
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// The number of futures registered with the waking thread now (for tests of drops).
#[doc(hidden)]
pub fn registered() -> usize {
    entries().map.len()
}

/// [`Error::Timeout`] of an async wait for `what`, bounded by `after`.
fn expired(what: &str, after: Duration) -> Error {
    Error::Timeout {
        what: format!("the async wait for {what}"),
        after,
    }
}

/// A future that resolves once the work before an [`Event`]'s last record has completed
/// ([`Event::completed`]).
#[derive(Debug)]
#[must_use = "a future does nothing unless awaited or polled"]
pub struct EventCompletion {
    wait: Waiting,
    /// The bound set by [`EventCompletion::with_timeout`].
    timeout: Option<Duration>,
}

impl Event {
    /// A future that resolves once the work before this event's last record has completed
    /// (or at once if it was never recorded): the async form of [`Event::synchronize`], which
    /// no executor thread blocks on. It follows the last record at each poll, as
    /// [`Event::is_complete`] does, and holds the event's handle, so the `Event` itself may be
    /// dropped first.
    ///
    /// Unbounded, like [`Event::synchronize`] (NCCL work it follows is bounded by its
    /// communicator's watchdog); [`EventCompletion::with_timeout`] bounds it.
    ///
    /// # Errors
    /// The future's: CUDA errors (a fault in the work before the record); [`Error::Timeout`]
    /// past a timeout set; [`Error::Setup`] if the thread that wakes futures cannot be started.
    pub fn completed(&self) -> EventCompletion {
        EventCompletion {
            wait: Waiting::new([self.owned.clone() as Arc<dyn Query>], None),
            timeout: None,
        }
    }
}

impl EventCompletion {
    /// Ends the wait with [`Error::Timeout`] if the work has not completed within `timeout` of
    /// now.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.wait.bound(Instant::now() + timeout);
        self.timeout = Some(timeout);
        self
    }
}

impl Future for EventCompletion {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        match this.wait.poll(cx, None) {
            Poll::Ready(Ok(Outcome::Complete)) => Poll::Ready(Ok(())),
            Poll::Ready(Ok(Outcome::Expired)) => {
                Poll::Ready(Err(expired("an event", this.timeout.unwrap_or_default())))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A future that resolves once the work queued on a [`Stream`] before [`Stream::completion`]
/// has completed.
#[must_use = "a future does nothing unless awaited or polled"]
pub struct StreamCompletion {
    /// The wait, or why none could be set up (returned at the first poll).
    wait: std::result::Result<Waiting, Option<Error>>,
    /// The newest NCCL work's event on the stream then, whose abort the wait reports.
    nccl: Option<Arc<PooledEvent>>,
    timeout: Option<Duration>,
}

impl std::fmt::Debug for StreamCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamCompletion")
            .field("wait", &self.wait)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Stream {
    /// A future that resolves once all work queued so far on this stream has completed: the
    /// async form of [`Stream::synchronize`], which no executor thread blocks on. The point is
    /// taken now (an event recorded here), not at the first poll.
    ///
    /// Like [`Stream::synchronize`], it never waits forever behind an NCCL operation (its
    /// communicator's watchdog aborts one that misses its deadline, and the future then ends
    /// with [`Error::CommunicatorUnusable`]); [`StreamCompletion::with_timeout`] bounds it
    /// further. Dropping it at any time is safe: buffers the work uses stay tracked.
    ///
    /// # Errors
    /// The future's: [`Error::Capture`] while a graph is being captured on the stream; CUDA
    /// errors, including a fault in earlier work; [`Error::CommunicatorUnusable`] when the last
    /// NCCL operation queued here was cut short by its communicator's abort; [`Error::Timeout`]
    /// past a timeout set; [`Error::Setup`] if the thread that wakes futures cannot be started.
    pub fn completion(&self) -> StreamCompletion {
        let nccl = self.last_nccl().clone();
        // Recorded under the stream's order, outside any capture: an event recorded into a
        // graph would never complete as one.
        let recorded = self.outside_capture("waiting for a stream", || {
            self.check_not_captured_elsewhere()?;
            self.record_event()
        });
        StreamCompletion {
            wait: recorded
                .map(|e| Waiting::new([e as Arc<dyn Query>], None))
                .map_err(Some),
            nccl,
            timeout: None,
        }
    }
}

/// The wait of a future that queued its record when made, or what the future ends with: the
/// record's error, once, then (polled again after it ended) an error saying so.
pub(crate) fn started<'w>(
    wait: &'w mut std::result::Result<Waiting, Option<Error>>,
    future: &str,
) -> Result<&'w mut Waiting> {
    match wait {
        Ok(w) => Ok(w),
        Err(e) => Err(e
            .take()
            .unwrap_or_else(|| Error::InvalidArgument(format!("a {future} polled again after it ended")))),
    }
}

impl StreamCompletion {
    /// Ends the wait with [`Error::Timeout`] if the work has not completed within `timeout` of
    /// now.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        if let Ok(w) = &mut self.wait {
            w.bound(Instant::now() + timeout);
        }
        self.timeout = Some(timeout);
        self
    }
}

impl Future for StreamCompletion {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        let wait = match started(&mut this.wait, "StreamCompletion") {
            Ok(w) => w,
            Err(e) => return Poll::Ready(Err(e)),
        };
        match wait.poll(cx, None) {
            Poll::Ready(Ok(Outcome::Complete)) => Poll::Ready(check_poison(this.nccl.as_deref())),
            Poll::Ready(Ok(Outcome::Expired)) => {
                Poll::Ready(Err(expired("a stream's work", this.timeout.unwrap_or_default())))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}
