//! A GPU as the engine sees it: [`Device`]'s identity and the state every stream and buffer of it
//! shares (the pool of tracking events, parked streams, the stream on which buffers are freed).
//! Its public constructors and queries are in [`crate::cuda::device`].

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::{cudaEvent_t, cudaStream_t};

/// One CUDA device, as seen by this process (after `CUDA_VISIBLE_DEVICES`).
///
/// Cheap to clone; streams, events and buffers keep their device's state alive. Every call of
/// the safe API that runs on the current device (creating a stream or an event, a kernel
/// launch, a copy, an allocation, a graph launch) makes its device current on the calling
/// thread first (`cudaSetDevice`, only when another is current), so one thread may drive
/// several devices; NCCL operations leave the current device as NCCL does (it restores it).
/// Code that mixes in raw runtime calls must set its own.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.inner.ordinal)
            .finish()
    }
}

pub(crate) struct DeviceInner {
    pub(crate) ordinal: i32,
    /// Where buffers are freed: in stream order after every pending use (see `DeviceBuffer`'s
    /// `Drop`), so dropping a buffer never blocks the host.
    pub(crate) lifecycle: cudaStream_t,
    /// Every tracking event made here, oldest taken first: one that nothing but the pool holds
    /// (its `Arc`'s count is 1) is taken again, `Arc` and all, so that the hot path neither
    /// creates an event nor allocates.
    events: Mutex<VecDeque<Arc<PooledEvent>>>,
    /// Streams whose `Stream` was dropped, reused by `Stream::new`. Dropping a `Stream` parks
    /// its handle here instead of calling `cudaStreamDestroy`, which blocks until the stream's
    /// queued work has finished (CUDA 13.0, driver 580), whatever its documentation says.
    streams: Mutex<Vec<cudaStream_t>>,
    /// The compute capability (major, minor), asked once (what NCCL's fp8 rules depend on).
    compute: OnceCell<(i32, i32)>,
}

// SAFETY: the raw handles are CUDA objects that the runtime lets any host thread use; the event
// list is behind a mutex.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; no method hands out `&mut` to shared state without the mutex.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // Nothing of this device is alive any more (everything holds an Arc to it). Frees queued
        // on the lifecycle stream still run; pending events are released by the runtime once
        // they complete.
        if cu::set_device(self.ordinal).is_err() {
            return;
        }
        // Each event is destroyed by its last holder: here, or later (a communicator's queue
        // on the watchdog's thread may still hold one for a moment).
        drop(std::mem::take(
            self.events.get_mut().unwrap_or_else(|p| p.into_inner()),
        ));
        let streams = std::mem::take(self.streams.get_mut().unwrap_or_else(|p| p.into_inner()));
        for s in streams.into_iter().chain([self.lifecycle]) {
            // SAFETY: parked and lifecycle streams are owned here and nothing else can reach
            // them now. This may wait for work still queued on them (see `streams`).
            let _ = unsafe { cu::stream_destroy(s) };
        }
    }
}

/// A tracking event: taken from its device's pool, which keeps it and takes it again once
/// nothing else holds it (every tracker that referred to it has let go). Shared (`Arc`)
/// because one operation's event is recorded in the tracker of every buffer it touches.
pub(crate) struct PooledEvent {
    pub(crate) raw: cudaEvent_t,
    /// A made-up handle of the CPU tests, never given to CUDA.
    #[cfg(test)]
    fake: bool,
    /// Set when the work this event follows was cut short: an NCCL operation whose
    /// communicator was aborted before it completed. Host reads that waited for it report it.
    poison: OnceCell<String>,
    /// The communicator whose work this event follows, asked at a host read whether that work
    /// may have been cut short since (an NCCL error its watchdog has not yet seen).
    origin: Mutex<Option<Arc<dyn Origin>>>,
    /// Recorded by a graph's replays on the GPU (an event record node, see [`crate::Graph`]),
    /// not by the host: it stands for the latest replay launched so far, which changes at each
    /// launch. Every holder that keeps it past a launch must mean "the latest replay" (the
    /// trackers and a stream's last work do: each launch stores it again); a list that must
    /// mean one fixed point of a stream (what an NCCL operation waits behind, for the
    /// watchdog's deadline) never holds it (see `engine::enqueue`).
    replayed: bool,
}

/// Where a tracking event's work came from, when something can cut that work short.
pub(crate) trait Origin: Send + Sync {
    /// Why work of this origin may have been cut short, found now; `None` if nothing is wrong.
    fn failure(&self) -> Option<String>;
}

/// Blocks the host until the work before every event in `events` has completed.
///
/// # Errors
/// CUDA errors (the first one).
pub(crate) fn wait_all<'e>(events: impl IntoIterator<Item = &'e Arc<PooledEvent>>) -> Result<()> {
    for e in events {
        // SAFETY: the event is kept alive by the Arc.
        unsafe { crate::result::cudart::event_synchronize(e.raw) }?;
    }
    Ok(())
}

/// Ok unless the work before `event` was an NCCL operation cut short by an abort.
pub(crate) fn check_poison(event: Option<&PooledEvent>) -> Result<()> {
    match event.and_then(|e| e.poisoned()) {
        Some(reason) => Err(Error::CommunicatorUnusable {
            reason: format!("an NCCL operation this wait depends on did not complete: {reason}"),
        }),
        None => Ok(()),
    }
}

impl PooledEvent {
    /// Marks the work before this event as cut short, for `reason`.
    pub(crate) fn poison(&self, reason: &str) {
        let _ = self.poison.set(reason.to_string());
    }

    /// Says which communicator's work this event follows.
    pub(crate) fn set_origin(&self, origin: &Arc<dyn Origin>) {
        // A lock, not a `OnceLock`: set at every operation, where a once-cell's state machine
        // costs several times an uncontended lock.
        let mut o = self.origin.lock().unwrap_or_else(|p| p.into_inner());
        if o.is_none() {
            *o = Some(origin.clone());
        }
    }

    /// Whether a graph's replays record this event (see `replayed`), not the host.
    pub(crate) fn is_replayed(&self) -> bool {
        self.replayed
    }

    /// Why the work before this event was cut short, if it was. Called once the event has
    /// completed.
    pub(crate) fn poisoned(&self) -> Option<String> {
        if let Some(p) = self.poison.get() {
            return Some(p.clone());
        }
        let origin = self.origin.lock().unwrap_or_else(|p| p.into_inner()).clone();
        origin?.failure().or_else(|| self.poison.get().cloned())
    }
}

// SAFETY: CUDA event handles may be used from any thread.
unsafe impl Send for PooledEvent {}
// SAFETY: the only operations on a shared PooledEvent are thread-safe CUDA calls.
unsafe impl Sync for PooledEvent {}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        #[cfg(test)]
        if self.fake {
            return;
        }
        // Only once its pool is gone (its device): nothing refers to it any more. A pending
        // event is released by the runtime once it completes.
        // SAFETY: the handle was made by the pool and is destroyed once, here.
        let _ = unsafe { cu::event_destroy(self.raw) };
    }
}

/// How many of the pool's events [`Device::take_event`] looks at for one that nothing holds
/// before it makes a new one.
const REUSE_TRIES: usize = 4;

impl Device {
    /// Opens device `ordinal` (below the device count) and makes it current on this thread.
    pub(crate) fn open(ordinal: i32) -> Result<Device> {
        cu::set_device(ordinal)?;
        // Keep freed memory in the pool: handing it back to the OS at every synchronisation
        // would make the next allocation map it again.
        cu::set_default_pool_release_threshold(ordinal, u64::MAX)?;
        let lifecycle = cu::stream_create_non_blocking()?;
        Ok(Device {
            inner: Arc::new(DeviceInner {
                ordinal,
                lifecycle,
                events: Mutex::new(VecDeque::new()),
                streams: Mutex::new(Vec::new()),
                compute: OnceCell::new(),
            }),
        })
    }

    /// A device of ordinal 0 with no CUDA state, for CPU tests of the plain structures.
    #[cfg(test)]
    pub(crate) fn for_tests() -> Device {
        Device {
            inner: Arc::new(DeviceInner {
                ordinal: 0,
                lifecycle: std::ptr::null_mut(),
                events: Mutex::new(VecDeque::new()),
                streams: Mutex::new(Vec::new()),
                compute: OnceCell::new(),
            }),
        }
    }

    /// The device's ordinal, as given to [`Device::new`].
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal as usize
    }

    /// Makes this device current on the calling thread (`cudaSetDevice`).
    ///
    /// # Errors
    /// CUDA errors.
    pub fn set_current(&self) -> Result<()> {
        cu::ensure_device(self.inner.ordinal)
    }

    pub(crate) fn same(&self, other: &Device) -> bool {
        self.inner.ordinal == other.inner.ordinal
    }

    /// The compute capability (major, minor), asked of CUDA once per device.
    ///
    /// # Errors
    /// CUDA errors.
    pub(crate) fn compute_capability(&self) -> Result<(i32, i32)> {
        use crate::sys::cudart::cudaDeviceAttr as A;
        self.inner
            .compute
            .get_or_try_init(|| {
                let ordinal = self.inner.ordinal;
                Ok((
                    cu::device_attribute(A::cudaDevAttrComputeCapabilityMajor, ordinal)?,
                    cu::device_attribute(A::cudaDevAttrComputeCapabilityMinor, ordinal)?,
                ))
            })
            .copied()
    }

    /// A non-blocking stream, parked or new.
    pub(crate) fn take_stream(&self) -> Result<cudaStream_t> {
        let parked = self.inner.streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match parked {
            Some(s) => Ok(s),
            None => {
                self.set_current()?;
                cu::stream_create_non_blocking()
            }
        }
    }

    /// Parks a stream for reuse. Work still queued on it keeps running; a later user of the
    /// handle gets a fresh [`crate::engine::tracking::StreamId`], so tracking treats it as another
    /// stream and waits for that work through events where it must.
    pub(crate) fn park_stream(&self, s: cudaStream_t) {
        self.inner
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(s);
    }

    /// A tracking event over a made-up handle, for CPU tests that never give it to CUDA. The
    /// device must outlive the test without being dropped (its drop destroys pooled events).
    #[cfg(test)]
    pub(crate) fn fake_event(&self, raw: usize) -> Arc<PooledEvent> {
        self.fake_event_for(raw, false)
    }

    /// [`Device::fake_event`] of a graph's replays (`PooledEvent::is_replayed`).
    #[cfg(test)]
    pub(crate) fn fake_replayed_event(&self, raw: usize) -> Arc<PooledEvent> {
        self.fake_event_for(raw, true)
    }

    #[cfg(test)]
    fn fake_event_for(&self, raw: usize, replayed: bool) -> Arc<PooledEvent> {
        Arc::new(PooledEvent {
            raw: raw as cudaEvent_t,
            fake: true,
            poison: OnceCell::new(),
            origin: Mutex::new(None),
            replayed,
        })
    }

    /// A tracking event, from the pool or new.
    pub(crate) fn take_event(&self) -> Result<Arc<PooledEvent>> {
        self.take_event_for(false)
    }

    /// An event for a graph's replays to record (see `PooledEvent::replayed`), from the pool
    /// or new. Never handed out again: once the graph and every tracker have let go of it, the
    /// pool destroys it (see [`take_idle`]).
    pub(crate) fn take_replayed_event(&self) -> Result<Arc<PooledEvent>> {
        self.take_event_for(true)
    }

    fn take_event_for(&self, replayed: bool) -> Result<Arc<PooledEvent>> {
        let mut pool = self.inner.events.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = take_idle(&mut pool, replayed) {
            return Ok(e);
        }
        // Events belong to the device current at creation: make sure it is this one.
        self.set_current()?;
        let e = Arc::new(PooledEvent {
            raw: cu::event_create(false)?,
            #[cfg(test)]
            fake: false,
            poison: OnceCell::new(),
            origin: Mutex::new(None),
            replayed,
        });
        pool.push_back(e.clone());
        Ok(e)
    }
}

/// An event of `pool` that nothing else holds, made ready for a new use (`replayed`: a graph's,
/// see `PooledEvent::replayed`), if one of the first [`REUSE_TRIES`] is. The oldest taken are
/// looked at first: events are let go of roughly in the order they were taken (a newer use
/// supersedes an older one); one still held goes to the back.
fn take_idle(pool: &mut VecDeque<Arc<PooledEvent>>, replayed: bool) -> Option<Arc<PooledEvent>> {
    for _ in 0..pool.len().min(REUSE_TRIES) {
        let mut e = pool.pop_front()?;
        // Unique: no tracker, queue or list refers to it, and none can start to (only the pool
        // could hand out a clone, and the caller holds it locked).
        if let Some(idle) = Arc::get_mut(&mut e) {
            if idle.replayed {
                // A graph's: its executable is destroyed (the graph holds the event until
                // then), but a replay may still be running, and would record it. Destroyed
                // instead of reused: CUDA releases an event whose record has not completed once
                // it has (`cudaEventDestroy`).
                drop(e);
                continue;
            }
            // Re-recording it is safe even if its last record is still pending:
            // cudaStreamWaitEvent captured the state of each record at the time it was called,
            // and a host wait that read it has returned (nothing else holds it).
            idle.poison = OnceCell::new();
            *idle.origin.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
            idle.replayed = replayed;
            pool.push_back(e.clone());
            return Some(e);
        }
        pool.push_back(e);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_hands_out_again_only_what_nothing_holds() {
        let d = Device::for_tests();
        let mut pool: VecDeque<Arc<PooledEvent>> = (1..=3).map(|i| d.fake_event(i)).collect();
        // Held by a tracker (here: by the test) and marked by an earlier use.
        let held: Vec<_> = pool.iter().take(2).cloned().collect();
        held[0].poison("cut short");
        let e = take_idle(&mut pool, true).expect("the third is idle");
        assert_eq!(e.raw as usize, 3);
        assert!(e.is_replayed() && e.poisoned().is_none());
        // A graph's event, let go of: destroyed, not handed out again.
        drop(e);
        assert!(take_idle(&mut pool, false).is_none());
        assert_eq!(pool.len(), 2, "the graph's event left the pool");
        // Now every one is held: none is handed out (a new one would be made).
        assert!(take_idle(&mut pool, false).is_none());
        assert_eq!(pool.len(), 2, "the pool keeps them all");
        drop(held);
        let e = take_idle(&mut pool, false).expect("let go of");
        assert_eq!(e.raw as usize, 1, "the oldest first");
        assert!(e.poisoned().is_none(), "a new use starts unmarked");
    }
}
