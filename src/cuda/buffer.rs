//! [`DeviceBuffer`]: typed device memory whose every use is tracked, freed only once its last
//! use has completed on the GPU, and leaked rather than freed while a forgotten registration
//! may still let NCCL use it.

use std::sync::Arc;

use crate::engine::device::PooledEvent;
use std::marker::PhantomData;

use bytemuck::Pod;

use crate::engine::Tracked;
use crate::engine::device::Device;
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::error::{Error, Result};
use crate::result::cudart as cu;

/// `len` elements of `T` in one device's memory.
///
/// Every stream operation on the buffer (kernel launch, copy, send, receive) is tracked: it first
/// makes its stream wait, on the GPU, for the earlier uses it conflicts with on other streams,
/// then records itself (see the crate's "Soundness" section). So no sequence of safe calls lets the GPU read
/// the buffer while it is being overwritten, or write it while another operation still reads it.
///
/// Memory comes from the device's stream-ordered pool (`cudaMallocAsync`). Dropping the buffer
/// does not block: the free is queued on the device's internal stream after every pending use
/// (`cudaFreeAsync`), so the memory cannot be handed out again while the GPU still uses it.
///
/// Memory from `ncclMemAlloc` ([`DeviceBuffer::zeros_nccl`]), which NCCL's registered paths
/// and symmetric windows want, is tracked the same way. `ncclMemFree` is not stream-ordered, so
/// a dropped buffer of it hands its memory, with the events of its pending uses, to a thread of
/// handoff's that frees it once they have all completed: dropping does not block either.
///
/// Host copies ([`DeviceBuffer::to_vec`], [`DeviceBuffer::copy_from_slice`]) block until the copy
/// has completed, and a copy to the host waits for the last write first.
pub struct DeviceBuffer<T: Pod> {
    ptr: *mut T,
    len: usize,
    tracked: Tracked,
    device: Device,
    alloc: Alloc,
    pub(crate) registrations: Registrations,
    _marker: PhantomData<T>,
}

/// Where a buffer's memory came from, which decides how it is freed.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Alloc {
    /// The device's stream-ordered pool (`cudaMallocAsync`), freed with `cudaFreeAsync`.
    Pool,
    /// Another allocator's, which frees it once every use has completed: `ncclMemAlloc`'s
    /// (the NCCL half's, `nccl/memory.rs`).
    Other(&'static Allocator),
}

/// An allocator other than the device's pool, as a buffer needs it.
pub(crate) struct Allocator {
    /// For messages.
    pub(crate) name: &'static str,
    /// Whether its memory is NCCL's (`ncclMemAlloc`), which verification compares.
    pub(crate) nccl_memory: bool,
    /// `bytes` (more than 0) on the device, usable by every stream once it returns.
    pub(crate) alloc: fn(&Device, usize) -> Result<*mut std::ffi::c_void>,
    /// Frees `ptr` (from `alloc`, never freed before) now, after waiting for every event in
    /// `pending`, which holds every use of it not known complete.
    pub(crate) free_now: unsafe fn(*mut std::ffi::c_void, &[Arc<PooledEvent>]) -> Result<()>,
    /// As `free_now`, without blocking: once every event in `pending` has completed.
    pub(crate) free_after: unsafe fn(*mut std::ffi::c_void, Vec<Arc<PooledEvent>>),
}

impl std::fmt::Debug for Allocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// The NCCL registrations of a buffer's memory ([`crate::nccl::register`]): kept by the
/// registrations through their exclusive borrow of the buffer. Anything but zero when the buffer
/// is dropped means a registration was forgotten (`mem::forget`): NCCL may still use the memory,
/// so it is leaked, never freed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Registrations {
    /// `ncclCommRegister`s and windows alive.
    pub(crate) count: usize,
    /// Whether one of them is a window (a second would be undefined in NCCL).
    pub(crate) window: bool,
}

// SAFETY: the buffer owns its device memory; the tracker is behind a mutex, and CUDA calls on
// the memory may come from any thread.
unsafe impl<T: Pod + Send> Send for DeviceBuffer<T> {}
// SAFETY: `&DeviceBuffer` only allows tracked reads, whose bookkeeping is behind the mutex.
unsafe impl<T: Pod + Sync> Sync for DeviceBuffer<T> {}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("device", &self.device.ordinal())
            .field("nccl_alloc", &self.is_nccl_alloc())
            .finish()
    }
}

/// The size in bytes of `len` elements of `T`, or an error if it overflows.
pub(crate) fn byte_len<T>(len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{len} elements of {} ({} bytes each) overflow the address space",
                std::any::type_name::<T>(),
                std::mem::size_of::<T>()
            ))
        })
}

impl<T: Pod> DeviceBuffer<T> {
    /// Allocates `len` elements of `alloc`'s kind on `stream`'s device without initialising
    /// them: the contents are whatever the memory held (any bit pattern is a valid `T`, as
    /// `T: Pod`).
    pub(crate) fn alloc(stream: &Stream, len: usize, alloc: Alloc) -> Result<Self> {
        let bytes = byte_len::<T>(len)?;
        let device = stream.device().clone();
        // Length 0 until the memory exists, so that an early return frees nothing.
        let mut buf = DeviceBuffer {
            ptr: std::ptr::NonNull::<T>::dangling().as_ptr(),
            len: 0,
            tracked: match alloc {
                Alloc::Other(a) if a.nccl_memory => Tracked::new_nccl(&device),
                Alloc::Pool | Alloc::Other(_) => Tracked::new(&device),
            },
            device,
            alloc,
            registrations: Registrations::default(),
            _marker: PhantomData,
        };
        if bytes > 0 {
            // The allocation is recorded as a write on `stream`: pool memory is stream-ordered
            // and exists for other streams only once they have waited for it, which tracking
            // then makes them do; ncclMemAlloc's is usable by every stream once it returns, and
            // goes the same way. Neither can be captured (cudaMallocAsync would make memory
            // that exists only while the graph runs): refused in a capture.
            let work = crate::engine::Work::Uncapturable {
                what: "allocating a buffer",
            };
            let ptr = stream.enqueue_work(&[(&buf.tracked, Access::Write)], work, |s| match alloc {
                // SAFETY: the stream is live and its device is current (enqueue set it).
                Alloc::Pool => unsafe { cu::malloc_async(bytes, s) },
                Alloc::Other(a) => (a.alloc)(stream.device(), bytes),
            })?;
            buf.ptr = ptr.cast::<T>();
        }
        buf.len = len;
        Ok(buf)
    }

    /// Whether the memory came from `ncclMemAlloc` ([`DeviceBuffer::zeros_nccl`]).
    pub fn is_nccl_alloc(&self) -> bool {
        matches!(self.alloc, Alloc::Other(a) if a.nccl_memory)
    }

    /// A buffer of `len` zeroed elements, allocated and zeroed in order on `stream`. Returns
    /// before the GPU has done either; later uses on any stream wait for them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the size overflows; CUDA errors (out of memory).
    pub fn zeros(len: usize, stream: &Stream) -> Result<Self> {
        let mut buf = Self::alloc(stream, len, Alloc::Pool)?;
        buf.memset_zero(stream)?;
        Ok(buf)
    }

    /// A buffer holding a copy of `data`. Blocks until the copy has completed, so `data` may be
    /// reused as soon as this returns; see [`ViewMut::copy_from_slice`](crate::ViewMut::copy_from_slice).
    ///
    /// # Errors
    /// As [`DeviceBuffer::zeros`] and [`ViewMut::copy_from_slice`](crate::ViewMut::copy_from_slice).
    pub fn from_slice(data: &[T], stream: &Stream) -> Result<Self> {
        let mut buf = Self::alloc(stream, data.len(), Alloc::Pool)?;
        buf.copy_from_slice(data, stream)?;
        Ok(buf)
    }

    /// Sets every byte to zero, on `stream`, after every earlier use of the buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `stream` is on another device; CUDA errors.
    pub fn memset_zero(&mut self, stream: &Stream) -> Result<()> {
        self.view_mut().memset_zero(stream)
    }

    /// Copies `data` into the buffer, on `stream`, after every earlier use; blocks until the
    /// copy has completed, so `data` may be reused as soon as this returns. See
    /// [`ViewMut::copy_from_slice`](crate::ViewMut::copy_from_slice).
    ///
    /// # Errors
    /// As [`ViewMut::copy_from_slice`](crate::ViewMut::copy_from_slice).
    pub fn copy_from_slice(&mut self, data: &[T], stream: &Stream) -> Result<()> {
        self.view_mut().copy_from_slice(data, stream)
    }

    /// Copies the buffer to a new host vector, on `stream`, after the last write to it; see
    /// [`View::to_vec`](crate::View::to_vec).
    ///
    /// # Errors
    /// As [`View::to_vec`](crate::View::to_vec).
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        self.view().to_vec(stream)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a buffer of no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device the memory lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The raw device pointer, for calling CUDA or NCCL directly. Work queued through it is
    /// not tracked; see [`Stream::as_raw`].
    pub fn as_raw_ptr(&self) -> *const T {
        self.ptr
    }

    /// The raw device pointer, writable. As [`DeviceBuffer::as_raw_ptr`].
    pub fn as_raw_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// Blocks the host until every pending use of the buffer, on every stream, has completed.
    ///
    /// # Errors
    /// CUDA errors.
    pub fn synchronize(&self) -> Result<()> {
        let events: Vec<_> = self.tracked.lock().uses().map(|u| u.event.clone()).collect();
        crate::engine::device::wait_all(&events)
    }

    pub(crate) fn tracked(&self) -> &Tracked {
        &self.tracked
    }

    /// A buffer over memory that came from elsewhere (cudarc), tracked from now on, freed by
    /// handoff (`cudaFreeAsync`) after its last use.
    ///
    /// # Safety
    /// `ptr` is a stream-ordered allocation (`cudaMallocAsync`/`cuMemAllocAsync` from the device
    /// pool) of at least `len` elements on `device`, owned by nobody else from now on; the
    /// caller then makes every earlier use of it a tracked use (a write) before anything else.
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) unsafe fn from_raw_parts(ptr: *mut T, len: usize, device: &Device) -> Self {
        DeviceBuffer {
            ptr,
            len,
            tracked: Tracked::new(device),
            device: device.clone(),
            alloc: Alloc::Pool,
            registrations: Registrations::default(),
            _marker: PhantomData,
        }
    }

    /// Gives the memory up without freeing it, after `wait` has been called with every pending
    /// use's event (to order the new owner after them); on an error from `wait`, the buffer is
    /// dropped the handoff way (freed after its uses). Only pool memory can be given up (the new
    /// owner frees it with `cuMemFreeAsync`): memory from `ncclMemAlloc` is refused, and so
    /// dropped the handoff way.
    #[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
    pub(crate) fn into_raw_parts(
        mut self,
        mut wait: impl FnMut(&crate::engine::device::PooledEvent) -> Result<()>,
    ) -> Result<(*mut T, usize)> {
        if !matches!(self.alloc, Alloc::Pool) {
            return Err(Error::InvalidArgument(
                "memory from ncclMemAlloc (DeviceBuffer::zeros_nccl) cannot be given to cudarc, \
                 which would free it with cuMemFreeAsync; copy it into a DeviceBuffer::zeros first"
                    .into(),
            ));
        }
        {
            // One lock for the waits and the retirement: a graph's replay is either recorded
            // before (and waited for here) or refused after.
            let mut tracker = self.tracked.lock();
            // Bypassed tracking (a test build) leaves out the waits, as everywhere else.
            tracker
                .uses()
                .filter(|_| !crate::engine::tracking::BYPASSED)
                .try_for_each(|u| wait(&u.event))?;
            // Given away: a graph that captured a use of the buffer can no longer queue one.
            tracker.retire();
        }
        let parts = (self.ptr, self.len);
        // Given up: `Drop` frees nothing (length 0), but still drops the tracker and device.
        self.len = 0;
        Ok(parts)
    }

    /// Frees the memory in stream order after every pending use, reporting errors that `Drop`
    /// has to swallow. Memory from `ncclMemAlloc` is freed here and now, after the host has
    /// waited for every pending use.
    ///
    /// # Errors
    /// CUDA errors; NCCL's from `ncclMemFree`; [`Error::InvalidArgument`] for memory that a
    /// forgotten (`mem::forget`) registration or window may still let NCCL use. The memory is
    /// then leaked rather than freed while it may be in use.
    pub fn free(mut self) -> Result<()> {
        let r = self.release(true);
        // Released (or deliberately leaked): `Drop` must not free again, but still drops the
        // tracker and the device handle.
        self.len = 0;
        r
    }

    /// Frees the memory after every pending use; for `ncclMemAlloc` memory, on the host after
    /// waiting for them if `wait`, else through the reaper without blocking.
    fn release(&mut self, wait: bool) -> Result<()> {
        // Retired: a graph that captured a use of the buffer can no longer queue one.
        let pending = self.tracked.lock().retire();
        if self.byte_len() == 0 {
            return Ok(());
        }
        if self.registrations != Registrations::default() {
            return Err(Error::InvalidArgument(format!(
                "a buffer of {} bytes was dropped while NCCL may still use it (a registration \
                 or window of it was forgotten with mem::forget): its memory is leaked",
                self.byte_len()
            )));
        }
        if let Alloc::Other(a) = self.alloc {
            let ptr = self.ptr.cast();
            return if wait {
                // SAFETY: from the allocator, freed once (the caller then leaves the buffer
                // empty); unregistered (checked above); retired, and every pending use is in
                // `pending`.
                unsafe { (a.free_now)(ptr, &pending) }
            } else {
                // SAFETY: as above.
                unsafe { (a.free_after)(ptr, pending) };
                Ok(())
            };
        }
        let inner = &self.device.inner;
        cu::ensure_device(inner.ordinal)?;
        for e in &pending {
            // SAFETY: the lifecycle stream lives as long as the device; the event is alive.
            // On error we return before the free: the memory leaks instead of being reused.
            unsafe { cu::stream_wait_event(inner.lifecycle, e.raw) }?;
        }
        // SAFETY: the pointer came from cudaMallocAsync; the lifecycle stream now waits for
        // every pending use, including the allocation itself (recorded as a write).
        unsafe { cu::free_async(self.ptr.cast(), inner.lifecycle) }
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // Errors leak the memory (see `release`); `free` reports them.
        let _ = self.release(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_len_rejects_overflow() {
        assert_eq!(byte_len::<f32>(4).unwrap(), 16);
        assert_eq!(byte_len::<u8>(0).unwrap(), 0);
        assert!(matches!(
            byte_len::<f64>(usize::MAX / 4),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            byte_len::<u8>(usize::MAX),
            Err(Error::InvalidArgument(_))
        ));
    }
}
