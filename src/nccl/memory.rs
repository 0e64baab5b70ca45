//! Memory from `ncclMemAlloc`, and its free once its last use has completed.
//!
//! `ncclMemFree` is not stream-ordered: it unmaps the memory at once, so it may run only after
//! every queued use has completed on the GPU. A dropped buffer does not wait for that: its
//! memory and the events of its pending uses go to a [`Graveyard`], which one thread of the
//! process (started at the first such drop) polls with `cudaEventQuery`, never waiting on the
//! GPU while holding anything, and frees each allocation once all its events have completed.
//! An allocation whose event cannot be queried (the device is in CUDA's sticky error state) is
//! leaked, never freed while it may be in use.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use once_cell::sync::OnceCell;

use bytemuck::Pod;

use crate::cuda::buffer::{Alloc, Allocator, DeviceBuffer};
use crate::engine::device::{Device, PooledEvent};
use crate::engine::stream::Stream;
use crate::error::Result;
use crate::result::cudart as cu;
use crate::result::nccl as nc;

/// Allocations waiting for their uses to complete, each with the events still pending.
pub(crate) struct Graveyard<E> {
    graves: Vec<(usize, Vec<E>)>,
}

impl<E> Default for Graveyard<E> {
    fn default() -> Self {
        Graveyard { graves: Vec::new() }
    }
}

/// What one [`Graveyard::dig`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Dug {
    /// Allocations whose uses have all completed: free them now.
    pub(crate) free: Vec<usize>,
    /// Allocations given up on (an event could not be queried): leak them.
    pub(crate) leaked: usize,
}

impl<E> Graveyard<E> {
    /// Adds an allocation (its address) and the events of its pending uses.
    pub(crate) fn bury(&mut self, ptr: usize, pending: Vec<E>) {
        self.graves.push((ptr, pending));
    }

    /// Allocations still waiting.
    pub(crate) fn len(&self) -> usize {
        self.graves.len()
    }

    /// Asks `done` about each pending event (forgetting those that completed), and takes out
    /// every allocation with none left, or whose event `done` could not answer for.
    pub(crate) fn dig(&mut self, mut done: impl FnMut(&E) -> Result<bool>) -> Dug {
        let mut dug = Dug::default();
        self.graves.retain_mut(|(ptr, events)| {
            let mut failed = false;
            events.retain(|e| match done(e) {
                Ok(complete) => !complete,
                Err(_) => {
                    failed = true;
                    true
                }
            });
            if failed {
                dug.leaked += 1;
                false
            } else if events.is_empty() {
                dug.free.push(*ptr);
                false
            } else {
                true
            }
        });
        dug
    }
}

/// The process's graveyard of `ncclMemAlloc` memory and the thread that empties it.
struct Reaper {
    graves: Mutex<Graveyard<Arc<PooledEvent>>>,
    wake: Condvar,
}

static REAPER: OnceCell<Option<&'static Reaper>> = OnceCell::new();

/// The reaper, its thread started at the first call; `None` if the thread cannot be started.
fn reaper() -> Option<&'static Reaper> {
    *REAPER.get_or_init(|| {
        let reaper: &'static Reaper = Box::leak(Box::new(Reaper {
            graves: Mutex::new(Graveyard::default()),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("handoff-nccl-free".into())
            .spawn(move || reaper.run())
            .ok()
            .map(|_| reaper)
    })
}

impl Reaper {
    fn lock(&self) -> std::sync::MutexGuard<'_, Graveyard<Arc<PooledEvent>>> {
        self.graves.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self) {
        loop {
            let dug = {
                let mut graves = self.lock();
                while graves.len() == 0 {
                    graves = self.wake.wait(graves).unwrap_or_else(|p| p.into_inner());
                }
                // SAFETY: each event is kept alive by its Arc.
                graves.dig(|e| unsafe { cu::event_query(e.raw) })
            };
            for ptr in dug.free {
                // SAFETY: the memory came from ncclMemAlloc and was buried once, by its owner,
                // unregistered; every use recorded on it has completed, and its tracker was
                // retired, so nothing can queue another.
                let _ = unsafe { nc::mem_free(ptr as *mut std::ffi::c_void) };
            }
            if self.lock().len() > 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

/// `ncclMemAlloc`'s memory, as a buffer frees it ([`DeviceBuffer::zeros_nccl`]).
pub(crate) static NCCL_MEM: Allocator = Allocator {
    name: "ncclMemAlloc",
    nccl_memory: true,
    alloc,
    free_now,
    free_after,
};

impl<T: Pod> DeviceBuffer<T> {
    /// As [`DeviceBuffer::zeros`], with memory from `ncclMemAlloc`: CUDA virtual memory
    /// (`cuMemCreate`) that NCCL can map into its peers' address spaces, which its registered
    /// paths ([`Communicator::register`](crate::Communicator::register)) and symmetric windows
    /// ([`Communicator::register_window`](crate::Communicator::register_window)) need. Tracked
    /// like any buffer; dropped, it is freed (`ncclMemFree`) once its last use has completed,
    /// without blocking. NCCL rounds the size up to the allocation granularity (2 MiB on an
    /// H200): prefer few large buffers.
    ///
    /// # Errors
    /// As [`DeviceBuffer::zeros`]; [`Error::Unsupported`](crate::Error::Unsupported) when the loaded NCCL lacks
    /// `ncclMemAlloc`; NCCL errors.
    pub fn zeros_nccl(len: usize, stream: &Stream) -> Result<Self> {
        let mut buf = Self::alloc(stream, len, Alloc::Other(&NCCL_MEM))?;
        buf.memset_zero(stream)?;
        Ok(buf)
    }

    /// As [`DeviceBuffer::from_slice`], with memory from `ncclMemAlloc` (see
    /// [`DeviceBuffer::zeros_nccl`]).
    ///
    /// # Errors
    /// As [`DeviceBuffer::zeros_nccl`] and [`DeviceBuffer::from_slice`].
    pub fn from_slice_nccl(data: &[T], stream: &Stream) -> Result<Self> {
        let mut buf = Self::alloc(stream, data.len(), Alloc::Other(&NCCL_MEM))?;
        buf.copy_from_slice(data, stream)?;
        Ok(buf)
    }
}

/// `bytes` (> 0) from `ncclMemAlloc` on `device`.
pub(crate) fn alloc(device: &Device, bytes: usize) -> Result<*mut std::ffi::c_void> {
    device.set_current()?;
    nc::mem_alloc(bytes)
}

/// Frees `ptr` (from [`alloc`]) with `ncclMemFree` once every event in `pending` has completed,
/// without blocking; or, if the reaper thread cannot be started, after waiting for them here.
///
/// # Safety
/// `ptr` came from [`alloc`] and is freed once; `pending` holds an event after every use of it
/// that may still be queued, and nothing can queue another (its tracker is retired); no
/// communicator has it registered.
pub(crate) unsafe fn free_after(ptr: *mut std::ffi::c_void, pending: Vec<Arc<PooledEvent>>) {
    match reaper() {
        Some(r) => {
            r.lock().bury(ptr as usize, pending);
            r.wake.notify_one();
        }
        None => {
            // On an error the memory leaks instead.
            if crate::engine::device::wait_all(&pending).is_err() {
                return;
            }
            // SAFETY: the caller's guarantees, and every pending use has completed.
            let _ = unsafe { nc::mem_free(ptr) };
        }
    }
}

/// Frees `ptr` now, after waiting on the host for `pending`, reporting errors.
///
/// # Errors
/// CUDA errors from the waits (the memory is then leaked), NCCL's from the free.
///
/// # Safety
/// As [`free_after`].
pub(crate) unsafe fn free_now(ptr: *mut std::ffi::c_void, pending: &[Arc<PooledEvent>]) -> Result<()> {
    crate::engine::device::wait_all(pending)?;
    // SAFETY: the caller's guarantees, and every pending use has completed.
    unsafe { nc::mem_free(ptr) }
}

/// How many `ncclMemAlloc` allocations dropped buffers left waiting for their uses to complete.
pub fn pending_frees() -> usize {
    match REAPER.get() {
        Some(Some(r)) => r.lock().len(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn an_allocation_is_freed_only_once_all_its_events_completed() {
        let mut g = Graveyard::default();
        // Events are (id, complete?).
        g.bury(0x1000, vec![1, 2]);
        g.bury(0x2000, vec![3]);
        g.bury(0x3000, vec![]);
        let mut complete = vec![1];
        let dug = g.dig(|e| Ok(complete.contains(e)));
        // No events: freed at once; one of two complete: still waiting.
        assert_eq!(
            dug,
            Dug {
                free: vec![0x3000],
                leaked: 0
            }
        );
        assert_eq!(g.len(), 2);
        complete.push(3);
        // Event 1 was forgotten once complete: never asked again.
        let dug = g.dig(|e| {
            assert_ne!(*e, 1, "a completed event is asked again");
            Ok(complete.contains(e))
        });
        assert_eq!(dug.free, vec![0x2000]);
        complete.push(2);
        assert_eq!(g.dig(|e| Ok(complete.contains(e))).free, vec![0x1000]);
        assert_eq!(g.len(), 0);
    }

    #[test]
    fn an_event_that_cannot_be_queried_leaks_its_allocation() {
        let mut g = Graveyard::default();
        g.bury(0x1000, vec![1]);
        g.bury(0x2000, vec![2]);
        let dug = g.dig(|e| {
            if *e == 1 {
                Err(Error::InvalidArgument("sticky".into()))
            } else {
                Ok(false)
            }
        });
        assert_eq!(
            dug,
            Dug {
                free: vec![],
                leaked: 1
            }
        );
        // The other one still waits.
        assert_eq!(g.len(), 1);
    }
}
