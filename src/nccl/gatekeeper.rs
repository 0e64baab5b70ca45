//! The gatekeeper: one thread per process that checks held groups ([`crate::nccl::verify::held`])
//! while their communicators' threads make no call, and opens their gates as they pass. A
//! communicator's own next group checks its held groups too; whichever looks first opens.
//!
//! Every gate opens in bounded time: the gatekeeper fails a held group whose counterpart has
//! not come within the communicator's timeout (`Error::Timeout`, naming both sides), as it
//! fails one that differs (`Error::Mismatch`), and breaks its communicator, which opens every
//! gate before NCCL's abort (that abort waits for the gated kernels). It takes a
//! communicator's locks only with `try_lock`: a thread holding them may be waiting, inside
//! CUDA, for the very gate (a launch that loads a module, a full launch queue), so once the
//! oldest held group's deadline has passed it opens the gates without them. An opened gate
//! never lets a kernel run against a different counterpart (`held`'s argument), so opening
//! early costs a failure's promptness, never safety.
//!
//! While nothing is held it sleeps; while something is, it looks every few tens of
//! microseconds (a peer usually posts within a millisecond).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError, Weak};
use std::time::Duration;

use crate::error::Error;
use crate::nccl::state::{Cut, Gating, Shared, epoch};
use crate::nccl::verify::{Failure, Mailboxes, Wait};
use crate::trace;

/// A communicator with held groups, or that had some.
struct Kept {
    boxes: Weak<Mutex<Mailboxes>>,
    shared: Weak<Shared>,
}

static KEPT: Mutex<Vec<Kept>> = Mutex::new(Vec::new());
static WAKE: Condvar = Condvar::new();
/// Counts [`keep`]'s calls (under [`KEPT`]'s lock): a round that began before one does not
/// go to sleep after it.
static HOLDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Whether the gatekeeper sleeps on [`WAKE`] (set and cleared under [`KEPT`]'s lock): only then
/// does [`keep`] wake it, a system call that a held group need not pay otherwise.
static SLEEPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How long the gatekeeper sleeps between looks while a group is held and nothing moved.
const LOOK: Duration = Duration::from_micros(20);

/// How long it sleeps while nothing is held (a new hold wakes it at once).
const IDLE: Duration = Duration::from_millis(100);

/// Starts the thread, once. False if it cannot be started: then nothing is held.
pub(crate) fn running() -> bool {
    static STARTED: OnceLock<bool> = OnceLock::new();
    *STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("handoff-gatekeeper".into())
            .spawn(run)
            .is_ok()
    })
}

/// Has the gatekeeper look after `boxes`' held groups (listed at the communicator's first).
pub(crate) fn keep(boxes: &Arc<Mutex<Mailboxes>>, shared: &Arc<Shared>) {
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    if !shared.gating.kept.swap(true, Ordering::Relaxed) {
        kept.push(Kept {
            boxes: Arc::downgrade(boxes),
            shared: Arc::downgrade(shared),
        });
    }
    HOLDS.fetch_add(1, Ordering::Relaxed);
    if SLEEPING.load(Ordering::Relaxed) {
        WAKE.notify_one();
    }
}

/// Publishes when `boxes`' oldest held group runs out of time (for a look without its lock).
pub(crate) fn note_deadline(gating: &Gating, boxes: &Mailboxes) {
    let at = boxes.held_deadline().map_or(0, |d| {
        u64::try_from(d.saturating_duration_since(epoch()).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    });
    gating.deadline.store(at, Ordering::Release);
}

fn now() -> u64 {
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

fn run() {
    // Failures found while the communicator's state was locked: broken at a later look.
    let mut unbroken: Vec<(Weak<Shared>, Error)> = Vec::new();
    loop {
        let round = HOLDS.load(Ordering::Relaxed);
        let kept: Vec<(Arc<Mutex<Mailboxes>>, Arc<Shared>)> = {
            let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
            kept.retain(|k| k.shared.strong_count() > 0);
            kept.iter()
                .filter_map(|k| Some((k.boxes.upgrade()?, k.shared.upgrade()?)))
                .collect()
        };
        unbroken.retain(|(s, e)| s.upgrade().is_some_and(|s| !try_break(&s, e)));
        let mut holding = !unbroken.is_empty();
        let mut moved = false;
        for (boxes, shared) in &kept {
            let looked = catch_unwind(AssertUnwindSafe(|| look(boxes, shared)));
            match looked {
                Ok(Look::Idle) => {}
                Ok(Look::Holding { moved: m }) => {
                    holding = true;
                    moved |= m;
                }
                Ok(Look::Failed(e)) => {
                    moved = true;
                    if !try_break(shared, &e) {
                        holding = true;
                        unbroken.push((Arc::downgrade(shared), e));
                    }
                }
                Err(_) => {
                    // A bug in a look: the communicator can no longer be looked after.
                    let e = Error::CommunicatorUnusable {
                        reason: "the gatekeeper's check of its held groups panicked".into(),
                    };
                    let _ = shared.gating.failed.set(e.clone());
                    shared.gating.open_all();
                    if !try_break(shared, &e) {
                        unbroken.push((Arc::downgrade(shared), e));
                    }
                }
            }
        }
        drop(kept);
        if !holding {
            let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
            if HOLDS.load(Ordering::Relaxed) == round {
                SLEEPING.store(true, Ordering::Relaxed);
                let (kept, _) = WAKE.wait_timeout(kept, IDLE).unwrap_or_else(|p| p.into_inner());
                SLEEPING.store(false, Ordering::Relaxed);
                drop(kept);
            }
        } else if moved {
            std::thread::yield_now();
        } else {
            std::thread::sleep(LOOK);
        }
    }
}

enum Look {
    Idle,
    Holding { moved: bool },
    Failed(Error),
}

/// One look at one communicator's held groups.
fn look(boxes: &Mutex<Mailboxes>, shared: &Shared) -> Look {
    let gating = &shared.gating;
    let guard = match boxes.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => {
            // Its thread is verifying (and checks held groups itself), or blocked with the
            // lock: past the deadline, open.
            let d = gating.deadline.load(Ordering::Acquire);
            if d != 0 && now() > d {
                gating.open_all();
            }
            return Look::Holding { moved: false };
        }
    };
    if !guard.holding() {
        return Look::Idle;
    }
    if gating.broken.load(Ordering::Acquire) {
        // Broken: its gates are open; nothing is left to check.
        guard.forget_held();
        gating.deadline.store(0, Ordering::Release);
        return Look::Idle;
    }
    let r = guard.check_held(Wait::Publish, &mut |t| gating.open_to(t));
    match r {
        Ok(opened) => {
            note_deadline(gating, &guard);
            Look::Holding { moved: opened }
        }
        Err(f) => {
            let after = match &f {
                Failure::Timeout { waited, .. } => *waited,
                _ => Duration::ZERO,
            };
            let e = f.into_error(after);
            // Sticky before anything else: the communicator's next call returns it, whether or
            // not the break below gets the lock now; its peers stop waiting for it.
            let _ = gating.failed.set(e.clone());
            guard.set_broken();
            gating.open_all();
            gating.deadline.store(0, Ordering::Release);
            Look::Failed(e)
        }
    }
}

/// Breaks `shared` for `e`, which its next group returns; false if its state is locked now.
fn try_break(shared: &Shared, e: &Error) -> bool {
    let Some(mut state) = shared.try_lock() else {
        return false;
    };
    trace::event!(
        warn,
        rank = shared.rank,
        device = shared.ordinal,
        reason = %e,
        "handoff: communicator aborted: a held group failed its check"
    );
    // Not here: the abort may wait for other work on the device, and other gates wait on
    // this thread.
    state.break_detached(e.to_string(), shared.ordinal, Cut::All);
    true
}
