//! The thin checked layer: one function per CUDA runtime call the crate makes, each turning the
//! raw status code into a [`Result`]. No tracking and no ownership here; the safe API builds on
//! these. Functions that take raw handles are `unsafe`: the caller vouches for the handles.
//!
//! # Errors
//! Said once for every function here: [`Error::LibraryNotFound`] or
//! [`Error::LibraryIncompatible`] when the runtime cannot be loaded, and [`Error::Cuda`] (the
//! call's name, code and CUDA's text) when the call fails; a function that can fail otherwise
//! says so.
//!
//! NVIDIA's reference for each call: <https://docs.nvidia.com/cuda/cuda-runtime-api/>.

use std::ffi::{CStr, c_void};
use std::mem::MaybeUninit;

use crate::error::{Error, Result};
use crate::sys::cudart::{
    self as rt, CudartLib, cudaDeviceAttr, cudaError_t, cudaEvent_t, cudaKernel_t, cudaLibrary_t,
    cudaMemPoolAttr, cudaMemcpyKind, cudaStream_t, dim3,
};
use crate::sys::loader;

/// The loaded runtime.
#[inline]
pub fn lib() -> Result<&'static CudartLib> {
    loader::cudart()
}

fn c_text(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: cudaGetErrorName/String return pointers to static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Turns a runtime status into a result, naming the call.
pub fn check(call: &'static str, code: cudaError_t) -> Result<()> {
    if code == cudaError_t::cudaSuccess {
        return Ok(());
    }
    let (name, message) = match lib() {
        // SAFETY: both functions accept any code and return static strings.
        Ok(l) => unsafe {
            (
                c_text(l.cudaGetErrorName(code)),
                c_text(l.cudaGetErrorString(code)),
            )
        },
        Err(_) => (format!("cudaError {}", code.0), String::new()),
    };
    Err(Error::Cuda {
        call,
        code: code.0 as i32,
        name,
        message,
    })
}

/// `cudaGetDeviceCount`.
pub fn device_count() -> Result<i32> {
    let mut n = 0;
    // SAFETY: writes one int through a valid pointer.
    check("cudaGetDeviceCount", unsafe { lib()?.cudaGetDeviceCount(&mut n) })?;
    Ok(n)
}

/// `cudaGetDevice`: the calling thread's current device.
pub fn get_device() -> Result<i32> {
    let mut d = 0;
    // SAFETY: writes one int through a valid pointer.
    check("cudaGetDevice", unsafe { lib()?.cudaGetDevice(&mut d) })?;
    Ok(d)
}

/// `cudaSetDevice`.
pub fn set_device(ordinal: i32) -> Result<()> {
    // SAFETY: takes a plain integer; a bad ordinal is an error code.
    check("cudaSetDevice", unsafe { lib()?.cudaSetDevice(ordinal) })
}

/// Makes `ordinal` the calling thread's current device if it is not already.
pub fn ensure_device(ordinal: i32) -> Result<()> {
    if get_device()? != ordinal {
        set_device(ordinal)?;
    }
    Ok(())
}

/// `cudaDeviceGetAttribute`.
pub fn device_attribute(attr: cudaDeviceAttr, ordinal: i32) -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer.
    check("cudaDeviceGetAttribute", unsafe {
        lib()?.cudaDeviceGetAttribute(&mut v, attr, ordinal)
    })?;
    Ok(v)
}

/// The device's name, from `cudaGetDeviceProperties`.
pub fn device_name(ordinal: i32) -> Result<String> {
    let mut prop = MaybeUninit::<rt::cudaDeviceProp>::zeroed();
    // SAFETY: the runtime fills the struct, whose layout bindgen took from the same header.
    check("cudaGetDeviceProperties", unsafe {
        lib()?.cudaGetDeviceProperties(prop.as_mut_ptr(), ordinal)
    })?;
    // SAFETY: zeroed then filled by the runtime; every field is plain data.
    let prop = unsafe { prop.assume_init() };
    // SAFETY: the name is a NUL-terminated char array inside the struct (zeroed first).
    Ok(unsafe { CStr::from_ptr(prop.name.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `cudaDeviceSynchronize` on the current device.
pub fn device_synchronize() -> Result<()> {
    // SAFETY: no arguments.
    check("cudaDeviceSynchronize", unsafe { lib()?.cudaDeviceSynchronize() })
}

/// Sets the release threshold of `ordinal`'s default memory pool, so that memory freed with
/// `cudaFreeAsync` stays reserved for reuse instead of going back to the OS at every sync.
pub fn set_default_pool_release_threshold(ordinal: i32, bytes: u64) -> Result<()> {
    let l = lib()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: writes the pool handle through a valid pointer.
    check("cudaDeviceGetDefaultMemPool", unsafe {
        l.cudaDeviceGetDefaultMemPool(&mut pool, ordinal)
    })?;
    let mut value = bytes;
    // SAFETY: the release threshold attribute takes a pointer to a u64 (cuuint64_t).
    check("cudaMemPoolSetAttribute", unsafe {
        l.cudaMemPoolSetAttribute(
            pool,
            cudaMemPoolAttr::cudaMemPoolAttrReleaseThreshold,
            (&mut value as *mut u64).cast(),
        )
    })
}

/// `cudaStreamCreateWithFlags(cudaStreamNonBlocking)` on the current device: a stream that does
/// not synchronise with the legacy default stream.
pub fn stream_create_non_blocking() -> Result<cudaStream_t> {
    let mut s = std::ptr::null_mut();
    // SAFETY: writes the handle through a valid pointer.
    check("cudaStreamCreateWithFlags", unsafe {
        lib()?.cudaStreamCreateWithFlags(&mut s, rt::cudaStreamNonBlocking)
    })?;
    Ok(s)
}

/// `cudaStreamDestroy`. Returns at once; work already queued still runs.
///
/// # Safety
/// `s` is a live stream handle that is not used afterwards.
pub unsafe fn stream_destroy(s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("cudaStreamDestroy", unsafe { lib()?.cudaStreamDestroy(s) })
}

/// `cudaStreamSynchronize`.
///
/// # Safety
/// `s` is a live stream handle.
pub unsafe fn stream_synchronize(s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("cudaStreamSynchronize", unsafe {
        lib()?.cudaStreamSynchronize(s)
    })
}

/// `cudaStreamQuery`: `true` when all work queued on `s` has completed.
///
/// # Safety
/// `s` is a live stream handle.
pub unsafe fn stream_query(s: cudaStream_t) -> Result<bool> {
    // SAFETY: the caller vouches for the handle.
    let rc = unsafe { lib()?.cudaStreamQuery(s) };
    if rc == cudaError_t::cudaErrorNotReady {
        return Ok(false);
    }
    check("cudaStreamQuery", rc).map(|()| true)
}

/// `cudaStreamWaitEvent`: work queued on `s` after this waits, on the GPU, for `e`'s last record.
///
/// # Safety
/// `s` and `e` are live handles of the same process.
pub unsafe fn stream_wait_event(s: cudaStream_t, e: cudaEvent_t) -> Result<()> {
    // SAFETY: the caller vouches for the handles.
    check("cudaStreamWaitEvent", unsafe {
        lib()?.cudaStreamWaitEvent(s, e, 0)
    })
}

/// `cudaStreamBeginCapture` in thread-local mode: work queued on `s` by this thread is recorded
/// into a graph instead of running, until [`stream_end_capture`].
///
/// # Safety
/// `s` is a live, non-default stream handle not being captured, and not the handle of a
/// [`crate::Stream`] made by `Stream::new` (capture those with [`crate::Graph`]: handoff does
/// not ask CUDA whether its own streams are captured, see [`crate::Stream::as_raw`]). For a
/// stream wrapped from cudarc: until the capture ends, no handoff-tracked work is queued on `s`
/// from another thread: handoff refuses tracked work on such a stream captured outside it
/// ([`crate::Error::Capture`]) by a check made before queueing, which a capture begun
/// concurrently can slip past.
pub unsafe fn stream_begin_capture(s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("cudaStreamBeginCapture", unsafe {
        lib()?.cudaStreamBeginCapture(s, rt::cudaStreamCaptureMode::cudaStreamCaptureModeThreadLocal)
    })
}

/// `cudaStreamEndCapture`: the graph captured on `s` (which the caller then owns and destroys
/// with [`graph_destroy`]).
///
/// # Safety
/// `s` is a live stream handle that this thread is capturing.
pub unsafe fn stream_end_capture(s: cudaStream_t) -> Result<rt::cudaGraph_t> {
    let mut g = std::ptr::null_mut();
    // SAFETY: the caller vouches for the handle; writes through a valid pointer.
    check("cudaStreamEndCapture", unsafe {
        lib()?.cudaStreamEndCapture(s, &mut g)
    })?;
    Ok(g)
}

/// `cudaStreamIsCapturing`: `true` while `s` is being captured into a graph (by anyone).
///
/// # Safety
/// `s` is a live stream handle.
pub unsafe fn stream_is_capturing(s: cudaStream_t) -> Result<bool> {
    let mut status = rt::cudaStreamCaptureStatus::cudaStreamCaptureStatusNone;
    // SAFETY: the caller vouches for the handle; writes through a valid pointer.
    check("cudaStreamIsCapturing", unsafe {
        lib()?.cudaStreamIsCapturing(s, &mut status)
    })?;
    Ok(status != rt::cudaStreamCaptureStatus::cudaStreamCaptureStatusNone)
}

/// `cudaGraphInstantiateWithFlags` with no flags.
///
/// # Safety
/// `g` is a live graph handle.
pub unsafe fn graph_instantiate(g: rt::cudaGraph_t) -> Result<rt::cudaGraphExec_t> {
    let mut exec = std::ptr::null_mut();
    // SAFETY: the caller vouches for the handle; writes through a valid pointer.
    check("cudaGraphInstantiateWithFlags", unsafe {
        lib()?.cudaGraphInstantiateWithFlags(&mut exec, g, 0)
    })?;
    Ok(exec)
}

/// `cudaGraphLaunch`.
///
/// # Safety
/// `exec` and `s` are live handles of the same device; the memory the graph uses is allocated
/// and ordered after its other uses.
pub unsafe fn graph_launch(exec: rt::cudaGraphExec_t, s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the handles.
    check("cudaGraphLaunch", unsafe { lib()?.cudaGraphLaunch(exec, s) })
}

/// `cudaGraphExecDestroy`.
///
/// # Safety
/// `exec` is a live executable graph, not used again.
pub unsafe fn graph_exec_destroy(exec: rt::cudaGraphExec_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("cudaGraphExecDestroy", unsafe {
        lib()?.cudaGraphExecDestroy(exec)
    })
}

/// `cudaGraphDestroy`.
///
/// # Safety
/// `g` is a live graph, not used again.
pub unsafe fn graph_destroy(g: rt::cudaGraph_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("cudaGraphDestroy", unsafe { lib()?.cudaGraphDestroy(g) })
}

/// `cudaEventCreateWithFlags` on the current device.
pub fn event_create(timing: bool) -> Result<cudaEvent_t> {
    let flags = if timing {
        rt::cudaEventDefault
    } else {
        rt::cudaEventDisableTiming
    };
    let mut e = std::ptr::null_mut();
    // SAFETY: writes the handle through a valid pointer.
    check("cudaEventCreateWithFlags", unsafe {
        lib()?.cudaEventCreateWithFlags(&mut e, flags)
    })?;
    Ok(e)
}

/// `cudaEventDestroy`. Returns at once; an event still pending is released once it completes.
///
/// # Safety
/// `e` is a live event handle that is not used afterwards.
pub unsafe fn event_destroy(e: cudaEvent_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("cudaEventDestroy", unsafe { lib()?.cudaEventDestroy(e) })
}

/// `cudaEventRecord`.
///
/// # Safety
/// `e` and `s` are live handles of the same device.
pub unsafe fn event_record(e: cudaEvent_t, s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the handles.
    check("cudaEventRecord", unsafe { lib()?.cudaEventRecord(e, s) })
}

/// `cudaEventRecordWithFlags(e, s, cudaEventRecordExternal)`: inside a capture on `s`, an event
/// record node of the graph, so that every launch of the graph records `e` again.
///
/// # Safety
/// `e` and `s` are live handles of the same device, and `s` is being captured.
pub unsafe fn event_record_external(e: cudaEvent_t, s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the handles.
    check("cudaEventRecordWithFlags", unsafe {
        lib()?.cudaEventRecordWithFlags(e, s, crate::sys::cudart::cudaEventRecordExternal)
    })
}

/// `cudaEventQuery`: `true` when the work captured by the last record has completed.
///
/// # Safety
/// `e` is a live event handle.
pub unsafe fn event_query(e: cudaEvent_t) -> Result<bool> {
    // SAFETY: the caller vouches for the handle.
    let rc = unsafe { lib()?.cudaEventQuery(e) };
    if rc == cudaError_t::cudaErrorNotReady {
        return Ok(false);
    }
    check("cudaEventQuery", rc).map(|()| true)
}

/// `cudaEventSynchronize`: blocks the host until the event's work has completed.
///
/// # Safety
/// `e` is a live event handle.
pub unsafe fn event_synchronize(e: cudaEvent_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("cudaEventSynchronize", unsafe { lib()?.cudaEventSynchronize(e) })
}

/// `cudaEventElapsedTime` in milliseconds.
///
/// # Safety
/// Both are live events created with timing enabled.
pub unsafe fn event_elapsed_ms(start: cudaEvent_t, end: cudaEvent_t) -> Result<f32> {
    let mut ms = 0.0f32;
    // SAFETY: the caller vouches for the handles; writes one float.
    check("cudaEventElapsedTime", unsafe {
        lib()?.cudaEventElapsedTime(&mut ms, start, end)
    })?;
    Ok(ms)
}

/// `cudaMallocAsync`: stream-ordered allocation from the current device's default pool. The
/// memory may be used only by work ordered after this point of `s`.
///
/// # Safety
/// `s` is a live stream of the current device.
pub unsafe fn malloc_async(bytes: usize, s: cudaStream_t) -> Result<*mut c_void> {
    let mut p = std::ptr::null_mut();
    // SAFETY: the caller vouches for the stream; writes the pointer.
    check("cudaMallocAsync", unsafe {
        lib()?.cudaMallocAsync(&mut p, bytes, s)
    })?;
    Ok(p)
}

/// `cudaFreeAsync`: the memory returns to its pool when `s` reaches this point.
///
/// # Safety
/// `p` came from [`malloc_async`] and no work not ordered before this point of `s` uses it.
pub unsafe fn free_async(p: *mut c_void, s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the pointer and the ordering.
    check("cudaFreeAsync", unsafe { lib()?.cudaFreeAsync(p, s) })
}

/// `cudaMemcpyAsync`.
///
/// # Safety
/// `dst` and `src` are valid for `bytes` bytes of the memory kinds `kind` names, for as long as
/// the copy runs, and nothing else writes them meanwhile.
pub unsafe fn memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    kind: cudaMemcpyKind,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: the caller vouches for the pointers and the stream.
    check("cudaMemcpyAsync", unsafe {
        lib()?.cudaMemcpyAsync(dst, src, bytes, kind, s)
    })
}

/// `cudaMemsetAsync`.
///
/// # Safety
/// `p` is device memory valid for `bytes` bytes, ordered on `s`.
pub unsafe fn memset_async(p: *mut c_void, value: u8, bytes: usize, s: cudaStream_t) -> Result<()> {
    // SAFETY: the caller vouches for the pointer and the stream.
    check("cudaMemsetAsync", unsafe {
        lib()?.cudaMemsetAsync(p, i32::from(value), bytes, s)
    })
}

/// `cudaMallocHost`: page-locked host memory.
pub fn malloc_host(bytes: usize) -> Result<*mut c_void> {
    let mut p = std::ptr::null_mut();
    // SAFETY: writes the pointer.
    check("cudaMallocHost", unsafe { lib()?.cudaMallocHost(&mut p, bytes) })?;
    Ok(p)
}

/// `cudaFreeHost`.
///
/// # Safety
/// `p` came from [`malloc_host`] and no copy still uses it.
pub unsafe fn free_host(p: *mut c_void) -> Result<()> {
    // SAFETY: the caller vouches for the pointer.
    check("cudaFreeHost", unsafe { lib()?.cudaFreeHost(p) })
}

/// `cudaHostAlloc` with `cudaHostAllocPortable | cudaHostAllocMapped`: page-locked host memory
/// that every device can address, at [`host_device_pointer`].
pub fn host_alloc_mapped(bytes: usize) -> Result<*mut c_void> {
    const PORTABLE_MAPPED: u32 = 0x01 | 0x02;
    let mut p = std::ptr::null_mut();
    // SAFETY: writes the pointer.
    check("cudaHostAlloc", unsafe {
        lib()?.cudaHostAlloc(&mut p, bytes, PORTABLE_MAPPED)
    })?;
    Ok(p)
}

/// `cudaHostGetDevicePointer`: where devices address mapped host memory.
///
/// # Safety
/// `p` lies in memory from [`host_alloc_mapped`] that is still allocated.
pub unsafe fn host_device_pointer(p: *mut c_void) -> Result<u64> {
    let mut d = std::ptr::null_mut();
    // SAFETY: the caller vouches for the pointer; writes `d`.
    check("cudaHostGetDevicePointer", unsafe {
        lib()?.cudaHostGetDevicePointer(&mut d, p, 0)
    })?;
    Ok(d as u64)
}

/// The driver's `cuStreamWaitValue32` (CUDA 12's `_v2`, the one `cuda.h` names so): `CUresult
/// (CUstream, CUdeviceptr, cuuint32_t, unsigned int)`.
type StreamWaitValue32 = unsafe extern "C" fn(cudaStream_t, u64, u32, u32) -> i32;

/// `cuStreamWaitValue32`, resolved once through `cudaGetDriverEntryPointByVersion` (the runtime
/// already loaded the driver; no second library is opened).
fn stream_wait_value32_fn() -> Result<StreamWaitValue32> {
    static RESOLVED: once_cell::sync::OnceCell<usize> = once_cell::sync::OnceCell::new();
    let addr = *RESOLVED.get_or_try_init(|| {
        let mut f = std::ptr::null_mut();
        let mut status = rt::cudaDriverEntryPointQueryResult(u32::MAX);
        // SAFETY: a NUL-terminated name; writes `f` and `status`. 12000: the ABI of the `_v2`
        // entry point, CUDA 12's default; flags 0: cudaEnableDefault.
        check("cudaGetDriverEntryPointByVersion", unsafe {
            lib()?.cudaGetDriverEntryPointByVersion(
                c"cuStreamWaitValue32".as_ptr(),
                &mut f,
                12000,
                0,
                &mut status,
            )
        })?;
        if status != rt::cudaDriverEntryPointQueryResult::cudaDriverEntryPointSuccess || f.is_null() {
            return Err(Error::Cuda {
                call: "cudaGetDriverEntryPointByVersion",
                code: status.0 as i32,
                name: "cuStreamWaitValue32 not found".into(),
                message: "the driver does not offer cuStreamWaitValue32 for CUDA 12's ABI; \
                          install a driver for CUDA 12 or newer"
                    .into(),
            });
        }
        Ok(f as usize)
    })?;
    // SAFETY: the driver's entry point for `cuStreamWaitValue32` at CUDA 12's ABI, whose C
    // declaration `StreamWaitValue32` spells.
    Ok(unsafe { std::mem::transmute::<usize, StreamWaitValue32>(addr) })
}

/// `cuStreamWaitValue32(s, addr, value, CU_STREAM_WAIT_VALUE_GEQ)`: work queued on `s` after
/// this waits until `(int32_t)(*addr - value) >= 0` (wrapping), which the host makes true by
/// writing the word.
///
/// # Safety
/// `s` is a live stream; `addr` is the device address of a 4-byte-aligned word of mapped host
/// memory ([`host_device_pointer`]) that stays allocated until the wait has completed on the
/// GPU, and that the host makes true within a bounded time (or `s` never runs again).
pub unsafe fn stream_wait_value32_geq(s: cudaStream_t, addr: u64, value: u32) -> Result<()> {
    const GEQ: u32 = 0;
    let f = stream_wait_value32_fn()?;
    // SAFETY: the caller vouches for the stream and the address.
    let rc = unsafe { f(s, addr, value, GEQ) };
    if rc == 0 {
        return Ok(());
    }
    Err(Error::Cuda {
        call: "cuStreamWaitValue32",
        code: rc,
        name: format!("CUresult {rc}"),
        message: "the driver refused the stream wait".into(),
    })
}

/// `cudaLibraryGetKernel`.
///
/// # Safety
/// `library` is a live library handle.
pub unsafe fn library_get_kernel(library: cudaLibrary_t, name: &CStr) -> Result<cudaKernel_t> {
    let mut k = std::ptr::null_mut();
    // SAFETY: the caller vouches for the library; `name` is NUL-terminated.
    check("cudaLibraryGetKernel", unsafe {
        lib()?.cudaLibraryGetKernel(&mut k, library, name.as_ptr())
    })?;
    Ok(k)
}

/// `cudaLaunchKernel` with a `cudaKernel_t`, which the runtime accepts in place of a function
/// symbol.
///
/// # Safety
/// `args` points to one pointer per kernel parameter, each to a value of the parameter's type;
/// every device pointer among them is valid for what the kernel does, ordered on `s`.
pub unsafe fn launch_kernel(
    kernel: cudaKernel_t,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_mem_bytes: u32,
    args: &mut [*mut c_void],
    s: cudaStream_t,
) -> Result<()> {
    let grid = dim3 {
        x: grid.0,
        y: grid.1,
        z: grid.2,
    };
    let block = dim3 {
        x: block.0,
        y: block.1,
        z: block.2,
    };
    // SAFETY: the caller vouches for the arguments and the stream.
    check("cudaLaunchKernel", unsafe {
        lib()?.cudaLaunchKernel(
            kernel.cast_const().cast(),
            grid,
            block,
            args.as_mut_ptr(),
            shared_mem_bytes as usize,
            s,
        )
    })
}

/// `cudaFuncGetAttributes` for a `cudaKernel_t` on the current device (which also loads it
/// there, if CUDA loads modules lazily).
///
/// # Safety
/// `kernel` is a live kernel handle.
pub unsafe fn kernel_attributes(kernel: cudaKernel_t) -> Result<rt::cudaFuncAttributes> {
    let mut attrs = MaybeUninit::<rt::cudaFuncAttributes>::zeroed();
    // SAFETY: the runtime accepts a cudaKernel_t where it takes a function symbol; it fills the
    // attribute struct, whose layout bindgen took from the same header.
    check("cudaFuncGetAttributes", unsafe {
        lib()?.cudaFuncGetAttributes(attrs.as_mut_ptr(), kernel.cast_const().cast())
    })?;
    // SAFETY: zeroed, then filled by the runtime; every field is plain data.
    Ok(unsafe { attrs.assume_init() })
}

/// `cudaLibraryLoadData` for a PTX (NUL-terminated), cubin or fatbin image, with no options.
///
/// # Safety
/// A PTX image ends with a NUL byte (the runtime reads PTX as a C string); a binary image is a
/// whole cubin or fatbin (the runtime reads the sizes it declares).
pub unsafe fn library_load_image(image: &[u8]) -> Result<cudaLibrary_t> {
    let mut library = std::ptr::null_mut();
    // SAFETY: the caller vouches for the image, which outlives the call (the runtime copies it);
    // no JIT or library options are passed (null arrays with count 0).
    check("cudaLibraryLoadData", unsafe {
        lib()?.cudaLibraryLoadData(
            &mut library,
            image.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    })?;
    Ok(library)
}

/// `cudaMemcpyPeerAsync`: `bytes` from `src` on device `src_device` to `dst` on `dst_device`,
/// ordered on `s`.
///
/// # Safety
/// Both pointers are device memory valid for `bytes` bytes on their devices, ordered on `s`.
pub unsafe fn memcpy_peer_async(
    dst: *mut c_void,
    dst_device: i32,
    src: *const c_void,
    src_device: i32,
    bytes: usize,
    s: cudaStream_t,
) -> Result<()> {
    // SAFETY: the caller vouches for the pointers and the stream.
    check("cudaMemcpyPeerAsync", unsafe {
        lib()?.cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, s)
    })
}

/// `cudaDriverGetVersion`: the CUDA version the installed driver supports (e.g. `13000` for
/// 13.0), or `0` when no driver is installed (`libcuda.so.1` cannot be loaded).
///
/// # Errors
/// The runtime cannot be loaded, or the call fails.
pub fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer; needs no driver.
    check("cudaDriverGetVersion", unsafe {
        lib()?.cudaDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

/// `cudaRuntimeGetVersion`: the version of the loaded CUDA runtime (e.g. `13000` for 13.0).
///
/// # Errors
/// The runtime cannot be loaded, or the call fails.
pub fn runtime_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int through a valid pointer; needs no driver.
    check("cudaRuntimeGetVersion", unsafe {
        lib()?.cudaRuntimeGetVersion(&mut v)
    })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_ok_without_loading_anything() {
        assert_eq!(check("cudaSetDevice", cudaError_t::cudaSuccess), Ok(()));
    }

    #[test]
    fn failure_names_the_call_and_code() {
        let e = check("cudaMallocAsync", cudaError_t::cudaErrorMemoryAllocation).unwrap_err();
        match e {
            Error::Cuda { call, code, .. } => {
                assert_eq!(call, "cudaMallocAsync");
                assert_eq!(code, 2);
            }
            other => panic!("{other:?}"),
        }
    }
}
