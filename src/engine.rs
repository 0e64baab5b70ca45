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

use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::{Device, PooledEvent};
use crate::error::Result;
use crate::stream::Stream;
use crate::tracking::{Access, Held, UseTracker, record_and_store};

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

/// What an NCCL group's streams ran before it: the group can start on the GPU only once these
/// have completed (the stream's previous tracked work, and the uses it was made to wait for).
/// The communicator's watchdog counts its deadline from there.
pub(crate) type Before = Vec<Arc<PooledEvent>>;

/// Queues one operation that uses the given memory (steps 2 to 5 above; step 1 is
/// [`check_devices`], which callers run before anything else they check). `recorded` is called
/// with each record stream, the event recorded after the work there, and (for `nccl` work,
/// which [`Stream::synchronize`] also reports on) what its uses' streams ran before it.
///
/// The uses are recorded even when `submit` fails: whatever part of the work reached a stream
/// stays tracked.
pub(crate) fn enqueue<R>(
    uses: &[TrackedUse<'_>],
    nccl: bool,
    submit: impl FnOnce(&mut CurrentDevice) -> Result<R>,
    mut recorded: impl FnMut(&Stream, &Arc<PooledEvent>, &Before),
) -> Result<R> {
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
    let mut held: Vec<Option<Held<'_>>> = (0..streams.len()).map(|_| None).collect();
    for i in by_id {
        held[i] = Some(streams[i].order().hold());
    }
    // Each distinct tracker once, locked in address order.
    let mut trackers: Vec<&Tracked> = Vec::with_capacity(uses.len());
    for u in uses {
        if !trackers.iter().any(|t| std::ptr::eq(*t, u.tracked)) {
            trackers.push(u.tracked);
        }
    }
    trackers.sort_by_key(|t| *t as *const Tracked as usize);
    let mut locked: Vec<MutexGuard<'_, UseTracker<Arc<PooledEvent>>>> =
        trackers.iter().map(|t| t.lock()).collect();
    let slot = |t: &Tracked| trackers.iter().position(|u| std::ptr::eq(*u, t)).expect("listed");
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
    let mut current = CurrentDevice::default();
    for u in uses {
        current.set(u.stream.device())?;
        let sink = before.get_mut(index(u.record));
        u.stream
            .wait_for_conflicts(&locked[slot(u.tracked)], u.access, sink)?;
    }
    let out = submit(&mut current);
    // In reverse, so that with one device per stream the thread, left on the last operation's
    // device by the submission, switches devices once fewer.
    let mut failed = None;
    for (i, s) in streams.iter().enumerate().rev() {
        if !uses.iter().any(|u| std::ptr::eq(u.record, *s)) {
            continue;
        }
        let mine = || uses.iter().filter(|u| std::ptr::eq(u.record, *s));
        let stored = current.set(s.device()).and_then(|()| {
            record_and_store(
                held[i].as_ref().expect("held above"),
                || s.record_event(),
                |event| {
                    for v in mine() {
                        locked[slot(v.tracked)].record(v.stream.id(), v.access, event.clone());
                        v.stream.note_recorded(event, nccl);
                    }
                },
            )
        });
        match stored {
            Ok(event) => recorded(s, &event, before.get(i).unwrap_or(&Vec::new())),
            Err(e) => {
                // The work is queued but untracked. Once it has completed it needs no tracking,
                // and the trackers' older entries stay correct. If even waiting fails, the
                // device is in CUDA's sticky error state, where no further work runs.
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
