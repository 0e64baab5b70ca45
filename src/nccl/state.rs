//! A communicator's state as its users and its watchdog share it ([`Shared`]): the live handle,
//! why it broke, the queue of operations not known complete, behind the one lock every NCCL call
//! on the communicator holds.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::engine::Before;
use crate::engine::device::{Origin, PooledEvent};
use crate::engine::gate::Gate;
use crate::error::Error;
use crate::nccl::verify::mailbox::{BROKEN, Region};
use crate::result::nccl as nc;
use crate::sys::nccl::{ncclComm_t, ncclResult_t};
use crate::trace;

/// The peers an operation received from, and its tracking event's origin.
pub(crate) type PeersOrigin = (Vec<usize>, Arc<dyn Origin>);

/// What the communicator shares with the watchdog, behind one lock that every NCCL call on the
/// communicator holds, so that the watchdog's abort never runs concurrently with one.
pub(crate) struct Shared {
    /// The communicator's key (`Communicator::key`), from [`fresh_id`]: never reused, unlike
    /// this state's address, which a later communicator's state may take once this one is freed.
    pub(crate) id: usize,
    pub(crate) state: Mutex<State>,
    pub(crate) rank: usize,
    pub(crate) ordinal: i32,
    /// Window registrations attempted on this rank, each exchanged with every rank
    /// ([`crate::nccl::register`]): the next one's number.
    pub(crate) windows: AtomicU64,
    /// Set when the watchdog's look at this communicator panicked: it can no longer be watched,
    /// and the watchdog aborts it (with this reason) at its next chance.
    pub(crate) unwatchable: std::sync::OnceLock<String>,
    /// Its gate, and whether it is broken, read without the lock (see [`Gating`]).
    pub(crate) gating: Arc<Gating>,
}

/// The communicator's gate ([`crate::nccl::verify::held`]), made at its first held group, and
/// what the gatekeeper reads without taking a lock that an enqueuing thread may hold.
#[derive(Default)]
pub(crate) struct Gating {
    pub(crate) gate: once_cell::sync::OnceCell<Gate>,
    /// When the oldest held group's timeout ends, in nanoseconds after [`epoch`]; 0 if none.
    pub(crate) deadline: AtomicU64,
    /// Set when the communicator breaks: its held groups need no checking any more.
    pub(crate) broken: std::sync::atomic::AtomicBool,
    /// Whether the gatekeeper lists this communicator (from its first held group on).
    pub(crate) kept: std::sync::atomic::AtomicBool,
    /// The error a held group failed with after its call returned: every later call on the
    /// communicator returns it, as that call would have. Set before anything else happens to
    /// the communicator (its break may have to wait for its lock), so that no later group is
    /// verified against counters that the failed group left behind.
    pub(crate) failed: std::sync::OnceLock<Error>,
}

impl Gating {
    /// Opens every gate: the communicator broke, or its oldest held group ran out of time.
    pub(crate) fn open_all(&self) {
        if let Some(g) = self.gate.get() {
            g.open_all();
        }
    }

    /// Opens up to `ticket`.
    pub(crate) fn open_to(&self, ticket: u32) {
        if let Some(g) = self.gate.get() {
            g.open_to(ticket);
        }
    }
}

/// The instant deadlines in [`Gating`] count from.
pub(crate) fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(crate) struct State {
    /// Null once aborted or destroyed.
    pub(crate) raw: ncclComm_t,
    pub(crate) rank: usize,
    /// Why the communicator is unusable, once it is.
    pub(crate) broken: Option<String>,
    /// Work queued and not yet seen complete, oldest first (in `seq` order): an event after each
    /// group on each stream, and when it was queued. NCCL runs a communicator's operations in
    /// order (see the watchdog), so an entry seen complete means every older one is.
    pub(crate) pending: VecDeque<Pending>,
    /// The `seq` of the next entry of `pending`.
    pub(crate) next_seq: u64,
    pub(crate) timeout: Duration,
    /// Every rank's mailbox (verified communicators): this rank's is marked broken with the
    /// communicator so that no peer waits for it, and carries the watchdog's heartbeat.
    pub(crate) regions: Option<Arc<[Arc<Region>]>>,
    /// For a communicator owned by a graph: the thread that will abort it (see
    /// [`State::break_with`]).
    pub(crate) graph_aborter: Option<GraphAborter>,
    /// Shared with [`Shared::gating`]: a break opens the gates before it aborts.
    pub(crate) gating: Arc<Gating>,
    /// The thread of a [`State::break_detached`]'s abort: the communicator's drop waits for it,
    /// so that no NCCL call is left running behind its owner (at process exit, say).
    pub(crate) aborting: Option<std::thread::JoinHandle<()>>,
}

/// A thread, started when a communicator is given to a graph, that aborts it when handed its
/// handle, and otherwise ends when the communicator is dropped. Started up front so that a
/// thread that cannot be made is an error at capture, never an abort that does not happen.
pub(crate) struct GraphAborter {
    pub(crate) handle: Option<std::sync::mpsc::Sender<Raw>>,
    pub(crate) thread: std::thread::JoinHandle<()>,
}

pub(crate) struct Pending {
    /// Numbers the communicator's entries in the order they were queued, never reused: what the
    /// watchdog names an entry by while it queries with the lock released.
    pub(crate) seq: u64,
    /// Recorded after the group on one of its streams.
    pub(crate) event: Arc<PooledEvent>,
    /// What the stream ran before the group: it cannot start before these complete.
    pub(crate) after: Before,
    /// When the watchdog first saw `after` complete: the group's deadline counts from here.
    pub(crate) started: Option<Instant>,
}

/// Which queued work an abort cuts short.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Work not complete yet (a missed deadline, an explicit abort).
    Incomplete,
    /// All work not yet seen complete: after an NCCL error, kernels may have ended early.
    All,
}

// SAFETY: the NCCL handle is used only under the mutex; NCCL lets any thread use a communicator
// as long as one at a time does.
unsafe impl Send for State {}

impl State {
    /// The state of a live communicator `raw` of rank `rank`, with nothing queued.
    pub(crate) fn new(raw: ncclComm_t, rank: usize, timeout: Duration) -> State {
        State {
            raw,
            broken: None,
            pending: VecDeque::new(),
            next_seq: 0,
            timeout,
            regions: None,
            graph_aborter: None,
            rank,
            gating: Arc::default(),
            aborting: None,
        }
    }

    /// Notes work queued after everything pending: `event` recorded after it, `after` what
    /// its stream ran before. Returns the entry's `seq`.
    pub(crate) fn push_pending(&mut self, event: Arc<PooledEvent>, after: Before) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.pending.push_back(Pending {
            seq,
            event,
            after,
            started: None,
        });
        seq
    }

    /// Marks the communicator unusable and aborts it (`ncclCommAbort`), as NCCL requires after
    /// an error; tells the peers through the mailbox. The caller holds the lock, so no other
    /// NCCL call on the communicator runs meanwhile.
    pub(crate) fn break_with(&mut self, reason: String, ordinal: i32, cut: Cut) {
        if let Some(raw) = self.break_unaborted(reason, cut) {
            abort(raw, ordinal);
        }
    }

    /// [`State::break_with`], with `ncclCommAbort` on a thread of its own: for a caller that
    /// must not wait for it (an async executor's thread). NCCL's abort can take as long as
    /// other work on the device (it frees device memory, which waits for the device); the
    /// communicator is unusable, its peers told and its gates open before this returns.
    pub(crate) fn break_detached(&mut self, reason: String, ordinal: i32, cut: Cut) {
        let Some(raw) = self.break_unaborted(reason, cut) else {
            return;
        };
        let (to, from) = std::sync::mpsc::channel::<Raw>();
        let spawned = std::thread::Builder::new()
            .name("handoff-abort".into())
            .spawn(move || {
                if let Ok(raw) = from.recv() {
                    abort(raw, ordinal);
                }
            });
        match spawned {
            Ok(thread) => {
                // The thread lives until it has the handle.
                let _ = to.send(raw);
                self.aborting = Some(thread);
            }
            // No thread: abort here after all.
            Err(_) => abort(raw, ordinal),
        }
    }

    /// Everything [`State::break_with`] does but the abort itself: the handle to abort, unless
    /// there is none or the graph's aborter took it.
    fn break_unaborted(&mut self, reason: String, cut: Cut) -> Option<Raw> {
        // Work still queued is cut short: host reads that wait for it report why.
        for p in self.pending.drain(..) {
            // SAFETY: the event is kept alive by the Arc.
            if cut == Cut::All || unsafe { crate::result::cudart::event_query(p.event.raw) } != Ok(true) {
                p.event.poison(&reason);
            }
        }
        if self.broken.is_none() {
            // Every path that breaks a communicator passes here; the callers' own events say
            // what they saw.
            trace::event!(
                info,
                rank = self.rank,
                reason = %reason,
                cut_all = cut == Cut::All,
                "handoff: communicator broken"
            );
        }
        self.broken.get_or_insert(reason);
        if let Some(mine) = self.mine() {
            mine.set_broken();
        }
        // NCCL's abort waits for the device, so for any held group's gate: open them all. A
        // held group never runs against a different counterpart (`verify::held`).
        self.gating.broken.store(true, Ordering::Release);
        self.gating.open_all();
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        if raw.is_null() {
            return None;
        }
        let mut raw = Raw(raw);
        // NCCL's abort first tells the GPU work to stop, then waits until every graph that
        // captured the communicator is destroyed before it frees anything (its
        // `commDestroySync`). A graph's own communicator is aborted by its aborter thread, as
        // the graph is alive (the caller may be inside its launch, or the watchdog holding
        // this lock); that abort ends once the graph is dropped. Replays launched meanwhile
        // stop at once, and NCCL's resources outlive them.
        if let Some(to) = self.graph_aborter.as_ref().and_then(|g| g.handle.as_ref()) {
            match to.send(raw) {
                Ok(()) => return None,
                // The aborter is gone (it never ends before its handle is dropped, below):
                // abort here after all.
                Err(back) => raw = back.0,
            }
        }
        Some(raw)
    }
}

/// `ncclCommAbort`, on `ordinal`'s device.
pub(crate) fn abort(raw: Raw, ordinal: i32) {
    // Best effort: NCCL sets the communicator's device itself, and the abort must happen
    // whatever (it also ends a split still writing a child's handle).
    let _ = crate::result::cudart::set_device(ordinal);
    // SAFETY: `raw` was live and is not used again (the state's handle is now null).
    let _ = unsafe { nc::comm_abort(raw.0) };
}

/// A communicator handle handed to the thread that aborts it.
pub(crate) struct Raw(crate::sys::nccl::ncclComm_t);

// SAFETY: NCCL lets any thread use a communicator as long as one at a time does; the handle is
// taken out of the state (left null) before it is handed over, so no other thread uses it.
unsafe impl Send for Raw {}

impl State {
    /// This rank's mailbox, if verified.
    pub(crate) fn mine(&self) -> Option<&Region> {
        Some(&self.regions.as_ref()?[self.rank])
    }
}

/// An id no communicator of this process has had: a forgotten [`crate::Registration`] keeps its
/// communicator's id on the buffer past the communicator's end, and a reused one would make the
/// buffer count as registered with a communicator that never registered it.
pub(crate) fn fresh_id() -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    // Only where `usize` is narrower than 64 bits, and after 2^32 communicators: stop rather
    // than repeat one.
    usize::try_from(id).expect("communicator ids are exhausted")
}

impl Shared {
    /// The state of a new communicator of rank `rank` on device `ordinal`, with a fresh id.
    pub(crate) fn new(state: State, rank: usize, ordinal: i32) -> Shared {
        let gating = state.gating.clone();
        Shared {
            gating,
            id: fresh_id(),
            state: Mutex::new(state),
            rank,
            ordinal,
            windows: AtomicU64::new(0),
            unwatchable: std::sync::OnceLock::new(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state if its lock is free (a poisoned lock is still usable: every update of the
    /// state is one step): for the threads that must never wait for an NCCL call.
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(s) => Some(s),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Marks the communicator unusable and aborts it (see [`State::break_with`]).
    pub(crate) fn break_with(&self, reason: String, cut: Cut) {
        self.lock().break_with(reason, self.ordinal, cut);
    }
}

/// Where a group's tracking event on one stream came from: this communicator, receiving from
/// `peers`. Asked at a host read whether that work may have been cut short.
pub(crate) struct OpOrigin {
    pub(crate) shared: std::sync::Weak<Shared>,
    pub(crate) peers: Vec<usize>,
}

impl Origin for OpOrigin {
    /// An NCCL error that the watchdog has not yet acted on may have ended the communicator's
    /// kernels early, and a peer that broke (aborted, failed) before sending may have let a
    /// receive complete without its data (on the H200 a receive whose sender aborted completes
    /// at once, its buffer untouched). Either way: abort now, and say so. A
    /// communicator broken before has already marked the work it cut short.
    fn failure(&self) -> Option<String> {
        let shared = self.shared.upgrade()?;
        let mut state = shared.lock();
        if state.broken.is_some() || state.raw.is_null() {
            return None;
        }
        // SAFETY: `raw` is live (not broken, lock held).
        let rc = unsafe { nc::comm_state(state.raw) };
        let reason = match rc {
            Ok(rc) if rc == ncclResult_t::ncclSuccess || rc == ncclResult_t::ncclInProgress => {
                let regions = state.regions.as_ref()?;
                let peer = self
                    .peers
                    .iter()
                    .find(|&&p| p != shared.rank && regions[p].status() == BROKEN)?;
                format!(
                    "rank {peer}, which a receive of rank {} was waiting for, broke its communicator \
                     (an error, a timeout or an abort there): the received data may be incomplete",
                    shared.rank
                )
            }
            Ok(rc) => format!(
                "rank {} hit an NCCL error: {}",
                shared.rank,
                nc::error("ncclCommGetAsyncError", rc)
            ),
            Err(e) => format!("rank {} hit an NCCL error: {e}", shared.rank),
        };
        state.break_with(reason.clone(), shared.ordinal, Cut::All);
        Some(reason)
    }
}
