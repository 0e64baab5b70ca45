//! [`Tracked`]: the pending uses of one piece of memory (a device buffer, pinned host memory),
//! shared between its owner and any graph that captured a use of it, and what else verification
//! asks of it (whether NCCL allocated or registered it).

use std::sync::{Arc, Mutex, MutexGuard};

use crate::engine::device::{Device, PooledEvent};
use crate::engine::tracking::UseTracker;

/// The pending uses of one piece of memory, and the device it lives on; shared (cheaply cloned)
/// between the buffer and any graph that captured a use of it.
#[derive(Clone)]
pub(crate) struct Tracked(Arc<TrackedInner>);

pub(crate) struct TrackedInner {
    pub(crate) device: Device,
    /// Pinned host memory (a [`crate::HostBuffer`]), which the host reads and writes outside
    /// stream order: never captured into a graph.
    pub(crate) host: bool,
    /// Memory from `ncclMemAlloc`, which NCCL registers by itself for a graph's transfers (see
    /// `verify::wire::NCCL_MEMORY`).
    pub(crate) nccl_memory: bool,
    /// The communicators (their keys) this memory is registered with (`ncclCommRegister`),
    /// which NCCL's send/receive path uses on one side only if the peer's memory is too (see
    /// `verify::wire::REGISTERED`); how many, so that unregistered memory asks no lock. A
    /// forgotten registration's key stays here after its communicator is gone, harmless since
    /// keys are never reused.
    registered_with: Mutex<Vec<usize>>,
    registrations: std::sync::atomic::AtomicUsize,
    uses: Mutex<UseTracker<Arc<PooledEvent>>>,
}

impl std::ops::Deref for Tracked {
    type Target = TrackedInner;
    fn deref(&self) -> &TrackedInner {
        &self.0
    }
}

impl Tracked {
    pub(crate) fn new(device: &Device) -> Tracked {
        Self::with(device, false, false)
    }

    /// The tracker of pinned host memory.
    pub(crate) fn new_host(device: &Device) -> Tracked {
        Self::with(device, true, false)
    }

    /// The tracker of memory from `ncclMemAlloc`.
    pub(crate) fn new_nccl(device: &Device) -> Tracked {
        Self::with(device, false, true)
    }

    fn with(device: &Device, host: bool, nccl_memory: bool) -> Tracked {
        Tracked(Arc::new(TrackedInner {
            device: device.clone(),
            host,
            nccl_memory,
            registered_with: Mutex::new(Vec::new()),
            registrations: std::sync::atomic::AtomicUsize::new(0),
            uses: Mutex::new(UseTracker::new()),
        }))
    }

    /// One key per piece of memory, whichever clone of the tracker it is reached through: the
    /// engine's lock order and identity. An address is safe here: it is only compared among
    /// trackers held (cloned) by whoever compares them, which pins the allocation.
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// Whether two trackers are one piece of memory's.
    pub(crate) fn same(a: &Tracked, b: &Tracked) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl TrackedInner {
    /// Notes that the memory is now registered with the communicator of key `comm`.
    pub(crate) fn note_registered(&self, comm: usize) {
        self.registered_with
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(comm);
        self.registrations
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// Notes that one registration with the communicator of key `comm` has ended.
    pub(crate) fn note_deregistered(&self, comm: usize) {
        let mut with = self.registered_with.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = with.iter().position(|&c| c == comm) {
            with.swap_remove(i);
            self.registrations
                .fetch_sub(1, std::sync::atomic::Ordering::Release);
        }
    }

    /// Whether the memory is registered with the communicator of key `comm`.
    pub(crate) fn is_registered_with(&self, comm: usize) -> bool {
        self.registrations.load(std::sync::atomic::Ordering::Acquire) > 0
            && self
                .registered_with
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&comm)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, UseTracker<Arc<PooledEvent>>> {
        // A panic while holding the lock cannot leave the tracker half-updated in a way that
        // loses a use (each method updates it in one step), so a poisoned lock is still usable.
        self.uses.lock().unwrap_or_else(|p| p.into_inner())
    }
}
