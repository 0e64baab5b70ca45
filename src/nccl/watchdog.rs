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
//! It takes a communicator's lock only with `try_lock`, and breaks a communicator only while
//! holding it: NCCL calls on one communicator never run concurrently, and a communicator in use
//! is looked at again at the next round. (A graph's communicator is then aborted by its own
//! aborter thread, since NCCL's abort waits for the graph to be destroyed: see
//! `State::break_with`.)

use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};
use crate::nccl::communicator::{Cut, Shared, State};
use crate::result::nccl as nc;
use crate::sys::nccl::ncclResult_t;

/// How often the watchdog looks. Timeouts are seconds; this bounds how late after one the abort
/// comes.
const PERIOD: Duration = Duration::from_millis(20);

/// A peer's heartbeat older than this counts as a dead peer's.
const FRESH: Duration = Duration::from_millis(1000);

/// How many timeouts an operation may wait, in all, for peers that are alive but busy.
pub(crate) const PATIENCE: u32 = 10;

/// `HANDOFF_WATCHDOG_LOG=1` prints each look at a communicator with queued work to stderr.
static LOG: once_cell::sync::Lazy<bool> =
    once_cell::sync::Lazy::new(|| std::env::var_os("HANDOFF_WATCHDOG_LOG").is_some_and(|v| v == "1"));

static WATCHED: OnceCell<std::result::Result<Mutex<Vec<Weak<Shared>>>, String>> = OnceCell::new();

/// Starts watching a communicator (and, the first time, the watchdog thread).
///
/// # Errors
/// [`Error::Setup`] if the thread could not be started: without it, stream waits behind a
/// stuck operation would have no bound, so no communicator is made.
pub(crate) fn watch(shared: &Arc<Shared>) -> Result<()> {
    let list = WATCHED.get_or_init(|| {
        std::thread::Builder::new()
            .name("handoff-watchdog".into())
            .spawn(run)
            .map(|_| Mutex::new(Vec::new()))
            .map_err(|e| format!("could not start the communicator watchdog thread: {e}"))
    });
    match list {
        Ok(list) => {
            list.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Arc::downgrade(shared));
            Ok(())
        }
        Err(detail) => Err(Error::Setup {
            detail: detail.clone(),
        }),
    }
}

fn run() {
    loop {
        std::thread::sleep(PERIOD);
        let live: Vec<Arc<Shared>> = match WATCHED.get() {
            Some(Ok(list)) => {
                let mut list = list.lock().unwrap_or_else(|p| p.into_inner());
                list.retain(|w| w.strong_count() > 0);
                list.iter().filter_map(Weak::upgrade).collect()
            }
            _ => continue,
        };
        for shared in live {
            check(&shared);
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn complete(e: &crate::device::PooledEvent) -> bool {
    // SAFETY: the event is kept alive by its Arc. An error (the device's sticky error state)
    // counts as not complete: the deadline then decides.
    (unsafe { crate::result::event_query(e.raw) }) == Ok(true)
}

/// One look at one communicator.
fn check(shared: &Shared) {
    let mut state = match shared.state.try_lock() {
        Ok(s) => s,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return,
    };
    if state.broken.is_some() || state.raw.is_null() {
        return;
    }
    // NCCL's error first: kernels it ended early have completed events, which must not be
    // taken for work that completed.
    // SAFETY: `raw` is live (not broken, lock held).
    let rc = unsafe { nc::comm_state(state.raw) };
    let failed = match rc {
        Ok(rc) if rc == ncclResult_t::ncclSuccess || rc == ncclResult_t::ncclInProgress => None,
        Ok(rc) => Some(nc::error("ncclCommGetAsyncError", rc).to_string()),
        Err(e) => Some(e.to_string()),
    };
    if let Some(e) = failed {
        let reason = format!("the watchdog found an NCCL error on rank {}: {e}", shared.rank);
        state.break_with(reason, shared.ordinal, Cut::All);
        return;
    }
    while state.pending.front().is_some_and(|p| complete(&p.event)) {
        state.pending.pop_front();
    }
    let now = Instant::now();
    let mut held_up = false;
    if let Some(front) = state.pending.front_mut()
        && front.started.is_none()
    {
        if front.after.iter().all(|e| complete(e)) {
            front.started = Some(now);
        } else {
            held_up = true;
        }
    }
    let wall = now_ms();
    if let Some(mine) = state.mine() {
        mine.set_heartbeat(wall, held_up);
    }
    let started = state.pending.front().and_then(|p| p.started);
    if *LOG && !state.pending.is_empty() {
        eprintln!(
            "handoff watchdog: rank {} on device {}: {} pending, oldest held up by its stream: \
             {held_up}, waiting for {:?}, a peer busy: {}",
            shared.rank,
            shared.ordinal,
            state.pending.len(),
            started.map(|t| now.duration_since(t)),
            peer_busy(&state, wall, Duration::ZERO)
        );
    }
    let Some(started) = started else {
        return;
    };
    let waited = now.duration_since(started);
    if waited <= state.timeout || peer_busy(&state, wall, waited) {
        return;
    }
    let reason = format!(
        "rank {}'s oldest queued operation did not complete within {:?} of becoming able to start \
         (the watchdog aborted the communicator: a peer may have died, or never run its side)",
        shared.rank, state.timeout
    );
    state.break_with(reason, shared.ordinal, Cut::Incomplete);
}

/// Whether some peer is alive and held up by its own GPU work, and the operation has waited
/// less than [`PATIENCE`] timeouts.
fn peer_busy(state: &State, wall: u64, waited: Duration) -> bool {
    let Some(regions) = &state.regions else {
        return false;
    };
    waited < state.timeout * PATIENCE
        && regions
            .iter()
            .enumerate()
            .any(|(r, region)| r != state.rank && region.busy_and_alive(wall, FRESH.as_millis() as u64))
}
