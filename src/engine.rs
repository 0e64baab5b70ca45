//! The one path by which tracked GPU work is queued: kernel launches, copies, fills, and NCCL
//! groups all go through [`enqueue`], so there is one recording rule and one fallback.
//!
//! 1. Every use's buffer must be on its stream's device.
//! 2. Each stream waits, on the GPU, for the earlier uses its new use conflicts with
//!    ([`crate::tracking`]); the host does not block.
//! 3. `submit` queues the work (a launch; or an NCCL group, which queues nothing before
//!    `ncclGroupEnd`, so the events below are recorded only after the work is really queued).
//! 4. On each stream used, one event is recorded after the work and stored as the latest use of
//!    every buffer used there, the two steps serialised per stream ([`RecordOrder`]) so that the
//!    newest event on a stream always wins. If recording fails, the host waits for the stream
//!    instead, so no queued use is left untracked.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::{Device, PooledEvent};
use crate::error::Result;
use crate::stream::Stream;
use crate::tracking::{Access, UseTracker};

/// The pending uses of one piece of device memory, and the device it lives on.
pub(crate) struct Tracked {
    pub(crate) device: Device,
    uses: Mutex<UseTracker<Arc<PooledEvent>>>,
}

impl Tracked {
    pub(crate) fn new(device: &Device) -> Tracked {
        Tracked {
            device: device.clone(),
            uses: Mutex::new(UseTracker::new()),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, UseTracker<Arc<PooledEvent>>> {
        // A panic while holding the lock cannot leave the tracker half-updated in a way that
        // loses a use (each method updates it in one step), so a poisoned lock is still usable.
        self.uses.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One use of a buffer by the operation being queued.
#[derive(Clone, Copy)]
pub(crate) struct TrackedUse<'a> {
    pub(crate) stream: &'a Stream,
    pub(crate) tracked: &'a Tracked,
    pub(crate) access: Access,
}

/// Switches the calling thread's current device only when it changes (each switch is a
/// runtime call).
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

/// Queues one operation that uses the given memory (steps 2 to 4 above; step 1 is
/// [`check_devices`], which callers run before anything else they check). `recorded` is called
/// with each stream used and the event recorded after the work there; `nccl` says the work is
/// an NCCL group (for [`Stream::synchronize`]'s report of an aborted one).
///
/// The uses are recorded even when `submit` fails: whatever part of the work reached a stream
/// stays tracked.
pub(crate) fn enqueue<R>(
    uses: &[TrackedUse<'_>],
    nccl: bool,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
    mut recorded: impl FnMut(&Stream, &Arc<PooledEvent>),
) -> Result<R> {
    let mut current = CurrentDevice::default();
    for u in uses {
        current.set(u.stream.device())?;
        u.stream.wait_for_conflicts(u.tracked, u.access)?;
    }
    let out = submit(&mut current);
    // Each distinct stream once, in first-use order (few uses: a linear scan is fine). In
    // reverse, so that with one device per stream the thread, left on the last operation's
    // device by the submission, switches devices once fewer.
    for (i, u) in uses.iter().enumerate().rev() {
        let first = uses.iter().position(|v| std::ptr::eq(v.stream, u.stream)) == Some(i);
        if !first {
            continue;
        }
        let s = u.stream;
        current.set(s.device())?;
        let stored = s.order().record_and_store(
            || s.record_event(),
            |event| {
                for v in uses.iter().filter(|v| std::ptr::eq(v.stream, s)) {
                    v.tracked.lock().record(s.id(), v.access, event.clone());
                }
                s.note_recorded(event, nccl);
            },
        );
        match stored {
            Ok(event) => recorded(s, &event),
            // The work is queued but untracked. Once it has completed it needs no tracking, and
            // the trackers' older entries stay correct.
            Err(_) => s.synchronize()?,
        }
    }
    out
}
