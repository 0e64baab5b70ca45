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
//! Captures: cudarc lets any thread begin a graph capture on any of its streams from safe code,
//! and handoff cannot see one begin. So handoff queues work only on cudarc streams it wraps,
//! and wrapping one ([`Stream::from_cudarc`]) is `unsafe`: its caller promises that no capture
//! begins there outside [`crate::Graph`] while the wrapper lives. Moving a slice into handoff
//! needs such a wrapper of the slice's stream; moving a buffer out waits for its uses on the
//! host and queues nothing of handoff's on cudarc's stream.
//!
//! What crosses the boundary and what does not: cudarc tracks a slice with one read and one
//! write event, and only while its context manages synchronisation (more than one stream);
//! handoff orders a moved buffer after exactly what cudarc's own `Drop` would wait for, and
//! hands a buffer to cudarc once every handoff use has completed, with cudarc's write event
//! recorded on the slice's stream. A report of
//! an NCCL receive cut short (see [`Stream::synchronize`]) does not follow a buffer into cudarc.

use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};

use crate::cuda::buffer::DeviceBuffer;
use crate::engine::device::Device;
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::error::{Error, Result};
use crate::result::cudart as cu;

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
    /// # Safety
    /// While the returned `Stream` lives, no capture into a CUDA graph begins on `stream` except
    /// through [`crate::Graph`] on the returned `Stream`: not cudarc's safe
    /// `CudaStream::begin_capture`, nor a raw `cuStreamBeginCapture` or
    /// `cudaStreamBeginCapture`, on any thread. handoff refuses tracked work on a stream
    /// captured outside it, but it can only ask before it queues (cudarc takes no lock of
    /// handoff's): a capture begun between that question and the work would take the work, and
    /// the events that track it, into someone else's graph. That graph would replay the work
    /// untracked, perhaps after its buffers are freed, and later waits on those events would
    /// order nothing. Captures through [`crate::Graph`] are ordered with handoff's work by the
    /// stream's lock, and need no promise.
    ///
    /// Without `unsafe`, a call does not compile:
    /// ```compile_fail,E0133
    /// fn wrap(s: &std::sync::Arc<cudarc::driver::CudaStream>, d: &handoff::Device) {
    ///     let _ = handoff::Stream::from_cudarc(s, d);
    /// }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a context that is not `device`'s primary one, for
    /// cudarc's per-thread default stream (a different stream on each thread), or for a stream
    /// another live handoff `Stream` already wraps; [`Error::Cudarc`] for an error cudarc had
    /// stashed.
    pub unsafe fn from_cudarc(stream: &Arc<CudaStream>, device: &Device) -> Result<Stream> {
        check_context(stream.context(), device)?;
        let raw = stream.cu_stream();
        check_handle(raw, "the cudarc stream")?;
        // SAFETY: a cudarc stream of the device's primary context is a runtime stream of the
        // device; the Arc kept in the Stream keeps it alive.
        unsafe { Stream::from_owned_handle(raw.cast(), device, stream.clone()) }
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Moves a cudarc slice into a handoff buffer, on `stream`, which must wrap the slice's own
    /// cudarc stream ([`Stream::from_cudarc`]): every later use waits, on the GPU, for the
    /// slice's pending uses (what cudarc's own `Drop` would wait for), and handoff frees the
    /// memory after its last use.
    ///
    /// The slice's stream must be wrapped because the move queues work on it (cudarc's waits
    /// for the slice's events, and the event that tracks them): through the wrapping `Stream`
    /// that work is ordered with handoff's graph captures by the stream's lock, and with
    /// cudarc's by the promise [`Stream::from_cudarc`] asks for.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `stream` does not wrap the slice's stream, and as
    /// [`Stream::from_cudarc`] for the slice's context; [`Error::Capture`] while a graph is
    /// being captured on the stream (the slice is then dropped by cudarc, after its uses); CUDA
    /// errors. If an error comes after the slice has been given up, its memory is leaked rather
    /// than freed while in use.
    pub fn from_cudarc(slice: CudaSlice<T>, stream: &Stream) -> Result<DeviceBuffer<T>> {
        let device = stream.device().clone();
        check_context(slice.context(), &device)?;
        if !std::ptr::eq(
            slice.stream().cu_stream().cast::<()>(),
            stream.as_raw().cast::<()>(),
        ) {
            return Err(Error::InvalidArgument(
                "the slice's cudarc stream is not the one this handoff Stream wraps: move it on \
                 a Stream made with Stream::from_cudarc from the slice's own stream \
                 (slice.stream())"
                    .into(),
            ));
        }
        let len = slice.len();
        crate::cuda::buffer::byte_len::<T>(len)?;
        if len == 0 {
            drop(slice);
            return DeviceBuffer::zeros(0, stream);
        }
        let ctx = slice.context().clone();
        // Under the stream's order, outside any capture: cudarc queues the waits for the slice's
        // read and write events on its stream (the one `stream` wraps) and gives the memory up
        // without freeing it.
        let ptr = stream.outside_capture("moving a cudarc slice into handoff", || {
            stream.check_not_captured_elsewhere()?;
            Ok(slice.leak())
        })?;
        ctx.check_err().map_err(|e| cudarc_error("CudaSlice::leak", e))?;
        // SAFETY: the memory is a cuMemAllocAsync allocation of `len` elements (checked:
        // stream-ordered allocation) that cudarc gave up; the enqueue below makes its pending
        // uses, waited for on this stream, the buffer's first tracked use.
        let buf = unsafe { DeviceBuffer::from_raw_parts(ptr as usize as *mut T, len, &device) };
        // A write with nothing to do: its event, recorded after cudarc's waits, is what later
        // uses of the buffer wait for.
        let ordered = stream.enqueue(&[(buf.tracked(), Access::Write)], |_| Ok(()));
        if let Err(e) = ordered {
            // The buffer's tracking may not cover cudarc's pending work: leak the memory rather
            // than free it under that work.
            std::mem::forget(buf);
            return Err(e);
        }
        Ok(buf)
    }

    /// Moves the buffer into a cudarc slice on `stream`, once every pending handoff use of it
    /// has completed (the host waits for them), so whatever cudarc then queues, on any stream
    /// and in any capture, comes after them. cudarc frees the memory when the slice drops.
    ///
    /// The wait is on the host, not queued on `stream`: handoff queues nothing on a cudarc
    /// stream it does not wrap, since it cannot know whether another thread is capturing it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer of zero-sized elements and a length above zero
    /// (it has no memory for cudarc to own and free), and as [`Stream::from_cudarc`]; CUDA
    /// errors (the buffer is then dropped the handoff way).
    pub fn into_cudarc(self, stream: &Arc<CudaStream>) -> Result<CudaSlice<T>> {
        check_movable::<T>(self.len())?;
        check_context(stream.context(), self.device())?;
        check_handle(stream.cu_stream(), "the cudarc stream")?;
        if self.is_empty() {
            return stream.null().map_err(|e| cudarc_error("CudaStream::null", e));
        }
        self.device().set_current()?;
        // SAFETY: the events are alive (borrowed from the tracker).
        let (ptr, len) = self.into_raw_parts(|e| unsafe { cu::event_synchronize(e.raw) })?;
        // SAFETY: a stream-ordered allocation of `len` elements of `T` (any bit pattern is a
        // valid T, and `T` has a size: checked), given up by handoff once every use of it has
        // completed; the context allocates asynchronously (checked), so cudarc's free of it is
        // valid.
        let mut slice = unsafe { stream.upgrade_device_ptr::<T>(ptr as u64, len) };
        // Records cudarc's write event on the stream.
        drop(slice.device_ptr_mut(stream));
        stream
            .context()
            .check_err()
            .map_err(|e| cudarc_error("CudaSlice::device_ptr_mut", e))?;
        Ok(slice)
    }
}

/// Refuses to hand cudarc `len > 0` elements of a zero-sized type: such a buffer owns no
/// memory (its pointer is dangling), and cudarc would free that pointer when the slice drops
/// (`cuMemFreeAsync` of an address it never allocated, an error that poisons its context).
fn check_movable<T>(len: usize) -> Result<()> {
    if std::mem::size_of::<T>() == 0 && len > 0 {
        return Err(Error::InvalidArgument(format!(
            "a buffer of {len} zero-sized elements ({}) owns no device memory for cudarc to \
             free: keep it in handoff (or make the cudarc slice with the cudarc stream's \
             null())",
            std::any::type_name::<T>()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_sized_elements_are_not_handed_to_cudarc() {
        match check_movable::<()>(3) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("3 zero-sized elements"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(check_movable::<()>(0).is_ok());
        assert!(check_movable::<f32>(3).is_ok());
        assert!(check_movable::<[u8; 0]>(usize::MAX).is_err());
    }
}
