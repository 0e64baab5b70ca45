//! The watchdog: one thread per process that watches every communicator's queued work and
//! aborts a communicator whose oldest unfinished operation has been queued longer than its
//! timeout, or on which NCCL reports an error (PyTorch's model). `ncclCommAbort` ends the
//! communicator's kernels, so every host wait on a stream stuck behind one of its operations
//! (`Stream::synchronize`, `DeviceBuffer::to_vec`, `Device::synchronize`, …) returns instead of
//! waiting forever for a peer that will never come.
//!
//! It takes a communicator's lock only with `try_lock`, and aborts only while holding it: NCCL
//! calls on one communicator never run concurrently, and a communicator in use is looked at
//! again at the next round.

use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::time::Duration;

use once_cell::sync::OnceCell;

use crate::nccl::communicator::Shared;
use crate::result::nccl as nc;
use crate::sys::nccl::ncclResult_t;

/// How often the watchdog looks. Timeouts are seconds; this bounds how late after one the abort
/// comes.
const PERIOD: Duration = Duration::from_millis(20);

static WATCHED: OnceCell<Mutex<Vec<Weak<Shared>>>> = OnceCell::new();

/// Starts watching a communicator (and, the first time, the watchdog thread).
pub(crate) fn watch(shared: &Arc<Shared>) {
    let list = WATCHED.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("handoff-watchdog".into())
            .spawn(run);
        if let Err(e) = spawned {
            // Without a thread, waits keep their own deadlines; only stream waits lose theirs.
            eprintln!("handoff: could not start the communicator watchdog: {e}");
        }
        Mutex::new(Vec::new())
    });
    list.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Arc::downgrade(shared));
}

fn run() {
    loop {
        std::thread::sleep(PERIOD);
        let live: Vec<Arc<Shared>> = {
            let Some(list) = WATCHED.get() else { continue };
            let mut list = list.lock().unwrap_or_else(|p| p.into_inner());
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for shared in live {
            check(&shared);
        }
    }
}

/// One look at one communicator.
fn check(shared: &Shared) {
    let mut state = match shared.state.try_lock() {
        Ok(s) => s,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return,
    };
    if state.broken.is_some() || state.raw.is_null() {
        state.pending.clear();
        return;
    }
    while let Some(front) = state.pending.front() {
        // SAFETY: the event is kept alive by the Arc. An error (the device's sticky error
        // state) counts as not complete: the deadline then decides.
        if unsafe { crate::result::event_query(front.event.raw) } == Ok(true) {
            state.pending.pop_front();
        } else {
            break;
        }
    }
    let Some(front) = state.pending.front_mut() else {
        return;
    };
    if front.started.is_none() {
        // SAFETY: as above.
        let ready = front
            .after
            .as_ref()
            .is_none_or(|a| unsafe { crate::result::event_query(a.raw) } == Ok(true));
        if ready {
            // Not before it was queued; and at the latest now, when the watchdog sees it can run.
            front.started = Some(if front.after.is_none() {
                front.queued
            } else {
                std::time::Instant::now()
            });
        }
    }
    let late = front.started.is_some_and(|t| t.elapsed() > state.timeout);
    // SAFETY: `raw` is live (not broken, lock held).
    let rc = unsafe { nc::comm_state(state.raw) };
    let reason = match rc {
        Ok(rc) if rc != ncclResult_t::ncclSuccess && rc != ncclResult_t::ncclInProgress => Some(format!(
            "the watchdog found NCCL's asynchronous error on rank {}: {}",
            shared.rank,
            nc::error("ncclCommGetAsyncError", rc)
        )),
        Err(e) => Some(format!(
            "the watchdog could not read rank {}'s state: {e}",
            shared.rank
        )),
        _ if late => Some(format!(
            "rank {}'s oldest queued operation did not complete within {:?} of the work before it \
             on its stream (the watchdog aborted the communicator: a peer may have died, or never \
             run its side)",
            shared.rank, state.timeout
        )),
        _ => None,
    };
    if let Some(reason) = reason {
        state.break_with(reason, shared.ordinal);
    }
}
