//! Interop with [cudarc](https://docs.rs/cudarc) 0.19 (feature `cudarc`): a handoff [`Stream`]
//! over a cudarc stream, and buffers moved between cudarc's `CudaSlice` and [`DeviceBuffer`]
//! after their pending uses. To launch through cudarc's own launch builder on handoff buffers,
//! queue it inside [`Stream::raw_use`] on a stream made by [`Stream::from_cudarc`] from the
//! cudarc stream the builder launches on, passing the buffers' raw pointers as `u64` values.
//!
//! cudarc drives CUDA through the driver API and handoff through the runtime; under a device's
//! *primary* context the two share handles (a `CUstream` is a `cudaStream_t`, a `CUdeviceptr`
//! a device pointer). Only primary contexts with stream-ordered allocation are accepted.
//!
//! What crosses the boundary and what does not: cudarc tracks a slice with one read and one
//! write event, and only while its context manages synchronisation (more than one stream);
//! handoff orders a moved buffer after exactly what cudarc's own `Drop` would wait for, and
//! hands a buffer to cudarc with its write event recorded after every handoff use. A report of
//! an NCCL receive cut short (see [`Stream::synchronize`]) does not follow a buffer into cudarc.

use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};

use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::result as cu;
use crate::stream::Stream;
use crate::sys::cudart::cudaStream_t;
use crate::tracking::Access;

/// The special handles: the legacy default stream (`0`, and `cudaStreamLegacy`, `1`), which
/// names the *current* device's, and the per-thread default stream (`2`), a different stream on
/// every thread. handoff calls some runtime functions on a stream without making its device
/// current first, and orders work per stream: neither fits.
fn check_handle(raw: cudarc::driver::sys::CUstream, what: &str) -> Result<()> {
    if (raw as usize) <= 2 {
        return Err(Error::InvalidArgument(format!(
            "{what} is a default stream of cudarc's (legacy or per-thread), which names a \
             different stream by device or thread; use one made by new_stream()"
        )));
    }
    Ok(())
}

fn cudarc_error(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::Cudarc {
        call,
        code: e.0 as i32,
        message: e.to_string(),
    }
}

/// The context must be `device`'s primary one, with stream-ordered allocation, and error-free.
fn check_context(ctx: &Arc<CudaContext>, device: &Device) -> Result<()> {
    ctx.check_err().map_err(|e| cudarc_error("cudarc's context", e))?;
    let problem = if !ctx.is_primary() {
        Some("is not a primary context: handoff shares handles only under the primary context".to_string())
    } else if ctx.ordinal() != device.ordinal() {
        Some(format!(
            "is on device {}, not {}",
            ctx.ordinal(),
            device.ordinal()
        ))
    } else if !ctx.has_async_alloc() {
        Some("has no stream-ordered allocation (cuMemAllocAsync), which handoff frees with".into())
    } else {
        None
    };
    match problem {
        Some(p) => Err(Error::InvalidArgument(format!("the cudarc context {p}"))),
        None => Ok(()),
    }
}

impl Stream {
    /// A handoff stream over `stream`'s handle: the same queue, kept alive as long as the
    /// returned `Stream`. Work queued on either is in one order.
    ///
    /// Capture through [`crate::Graph`], not cudarc's `begin_capture`, while handoff queues work
    /// on the stream: handoff refuses tracked work on a stream captured outside it by a check
    /// made before queueing, which a capture begun at the same moment on another thread can
    /// slip past (its events would then be graph nodes, and order nothing).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a context that is not `device`'s primary one, for
    /// cudarc's per-thread default stream (a different stream on each thread), or for a stream
    /// another live handoff `Stream` already wraps; [`Error::Cudarc`] for an error cudarc had
    /// stashed.
    pub fn from_cudarc(stream: &Arc<CudaStream>, device: &Device) -> Result<Stream> {
        check_context(stream.context(), device)?;
        let raw = stream.cu_stream();
        check_handle(raw, "the cudarc stream")?;
        // SAFETY: a cudarc stream of the device's primary context is a runtime stream of the
        // device; the Arc kept in the Stream keeps it alive.
        unsafe { Stream::from_owned_handle(raw.cast(), device, stream.clone()) }
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Moves a cudarc slice into a handoff buffer, on `stream`: every later use waits, on the
    /// GPU, for the slice's pending uses (what cudarc's own `Drop` would wait for), and handoff
    /// frees the memory after its last use.
    ///
    /// # Errors
    /// As [`Stream::from_cudarc`] for the slice's context; CUDA errors. If an error comes after
    /// the slice has been given up, its memory is leaked rather than freed while in use.
    pub fn from_cudarc(slice: CudaSlice<T>, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let device = stream.device().clone();
        check_context(slice.context(), &device)?;
        check_handle(slice.stream().cu_stream(), "the slice's stream")?;
        let len = slice.len();
        crate::buffer::byte_len::<T>(len)?;
        if len == 0 {
            drop(slice);
            return DeviceBuffer::zeros(stream, 0);
        }
        let theirs = slice.stream().clone();
        let theirs_raw: cudaStream_t = theirs.cu_stream().cast();
        // The event recorded below must be a real one, not a node of someone's graph capture.
        // SAFETY: a live stream of the device's primary context.
        if unsafe { cu::stream_is_capturing(theirs_raw) }? {
            return Err(Error::Capture {
                detail: "the slice's cudarc stream is being captured into a CUDA graph: move \
                         the slice after the capture ends"
                    .into(),
            });
        }
        let ctx = theirs.context().clone();
        // Queues the slice's stream's waits for its read and write events, and gives the
        // memory up without freeing it.
        let ptr = slice.leak();
        ctx.check_err().map_err(|e| cudarc_error("CudaSlice::leak", e))?;
        device.set_current()?;
        // An event after everything the slice's stream holds, its waits included.
        let after = device.take_event()?;
        // SAFETY: both handles are live and of this device (primary context).
        unsafe { cu::event_record(after.raw, theirs_raw) }?;
        // SAFETY: the memory is a cuMemAllocAsync allocation of `len` elements (checked:
        // stream-ordered allocation) that cudarc gave up; the enqueue below makes its pending
        // uses, through `after`, the buffer's first tracked use.
        let buf = unsafe { DeviceBuffer::from_raw_parts(ptr as usize as *mut T, len, &device) };
        let ordered = stream.enqueue(&[(buf.tracked(), Access::Write)], |s| {
            // SAFETY: both handles are live; cross-stream waits are allowed.
            unsafe { cu::stream_wait_event(s, after.raw) }
        });
        if let Err(e) = ordered {
            // The buffer's tracking may not cover cudarc's pending work: leak the memory rather
            // than free it under that work.
            std::mem::forget(buf);
            return Err(e);
        }
        Ok(buf)
    }

    /// Moves the buffer into a cudarc slice on `stream`: the stream waits, on the GPU, for every
    /// pending handoff use, and cudarc's write event is recorded after those waits, so cudarc's
    /// uses on its other streams wait too. cudarc frees the memory when the slice drops.
    ///
    /// # Errors
    /// As [`Stream::from_cudarc`]; CUDA errors (the buffer is then dropped the handoff way).
    pub fn into_cudarc(self, stream: &Arc<CudaStream>) -> Result<CudaSlice<T>> {
        check_context(stream.context(), self.device())?;
        check_handle(stream.cu_stream(), "the cudarc stream")?;
        if self.is_empty() {
            return stream.null().map_err(|e| cudarc_error("CudaStream::null", e));
        }
        self.device().set_current()?;
        let raw: cudaStream_t = stream.cu_stream().cast();
        // SAFETY: the stream is live and of this device; the events are alive.
        let (ptr, len) = self.into_raw_parts(|e| unsafe { cu::stream_wait_event(raw, e.raw) })?;
        // SAFETY: a stream-ordered allocation of `len` elements of `T` (any bit pattern is a
        // valid T), given up by handoff after the waits above; the context allocates
        // asynchronously (checked), so cudarc's free of it is valid.
        let mut slice = unsafe { stream.upgrade_device_ptr::<T>(ptr as u64, len) };
        // Records cudarc's write event on the stream, after the waits.
        drop(slice.device_ptr_mut(stream));
        stream
            .context()
            .check_err()
            .map_err(|e| cudarc_error("CudaSlice::device_ptr_mut", e))?;
        Ok(slice)
    }
}
