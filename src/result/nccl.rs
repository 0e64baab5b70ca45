//! The checked layer over NCCL: one function per call, status codes to [`Error`]s carrying
//! `ncclGetLastError`'s text.
//!
//! A non-blocking communicator (`ncclConfig_t::blocking = 0`) may answer `ncclInProgress`; the
//! caller then polls [`wait_ready`] until it is ready, with a deadline. Functions whose misuse
//! could break what the safe API guarantees (raw handles, pointers, an open group) are `unsafe`
//! and say what they require.
//!
//! # Errors
//! Said once for every function here: [`Error::LibraryNotFound`] or
//! [`Error::LibraryIncompatible`] when NCCL cannot be loaded, and [`Error::Nccl`] (the call's
//! name, code and `ncclGetLastError`'s text) when the call fails; the functions of registered
//! memory and windows also [`Error::Unsupported`] when the loaded NCCL lacks them. A function
//! that can fail otherwise says so.
//!
//! NVIDIA's reference: <https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api.html>.

use std::ffi::CStr;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sys::cudart::cudaStream_t;
use crate::sys::loader;
use crate::sys::nccl::register::NcclRegisterLib;
use crate::sys::nccl::{
    NcclLib, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclScalarResidence_t,
    ncclUniqueId, ncclWindow_t,
};
use crate::trace;

/// The loaded NCCL.
#[inline]
pub fn lib() -> Result<&'static NcclLib> {
    loader::nccl()
}

fn c_text(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: NCCL returns NUL-terminated strings that live at least until the next NCCL call
    // on this thread; we copy at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The error for a failed NCCL call, with `ncclGetLastError`'s text. That call takes a
/// communicator which NCCL documents as unused; we pass null.
pub fn error(call: &'static str, rc: ncclResult_t) -> Error {
    let (name, last_error) = match lib() {
        // SAFETY: both accept any code, and null for the (unused) communicator.
        Ok(l) => unsafe {
            (
                c_text(l.ncclGetErrorString(rc)),
                c_text(l.ncclGetLastError(std::ptr::null_mut())),
            )
        },
        Err(_) => (format!("ncclResult {}", rc.0), String::new()),
    };
    Error::Nccl {
        call,
        code: rc.0 as i32,
        name,
        last_error,
    }
}

/// Ok for `ncclSuccess`, the error otherwise (`ncclInProgress` included: callers that accept it
/// test for it first).
pub fn check(call: &'static str, rc: ncclResult_t) -> Result<()> {
    if rc == ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(error(call, rc))
    }
}

/// `NCCL_CONFIG_INITIALIZER` from nccl.h 2.28.3, written out (bindgen does not translate
/// initializer macros). Naming every field makes a header with other fields fail to compile
/// here rather than pass NCCL a struct it misreads.
pub fn config_initializer() -> ncclConfig_t {
    const UNDEF_INT: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: crate::sys::nccl::NCCL_VERSION_CODE,
        blocking: UNDEF_INT,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
    }
}

/// `ncclGetUniqueId`. Also starts NCCL's bootstrap root in this process.
pub fn get_unique_id() -> Result<ncclUniqueId> {
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: writes the id through a valid pointer.
    check("ncclGetUniqueId", unsafe { lib()?.ncclGetUniqueId(&mut id) })?;
    Ok(id)
}

/// `ncclCommInitRankConfig` on the current device. With a non-blocking config it may return
/// before the communicator is ready: then `Ok((comm, true))`, and [`wait_ready`] must follow.
///
/// # Safety
/// `config` is a valid configuration (start from [`config_initializer`]): its `size`, `magic`
/// and `version` describe this struct, and its `netName` and `commName` pointers are null or
/// point to NUL-terminated strings that outlive the call. Called inside a raw group
/// ([`group_start`]), the communicator is ready only after [`group_end`].
///
/// Not a safe call (issue 9, hole 4: the config carries raw pointers and a size):
/// ```compile_fail
/// let mut config = handoff::result::nccl::config_initializer();
/// let id = handoff::result::nccl::get_unique_id().unwrap();
/// let _ = handoff::result::nccl::comm_init_rank(1, &id, 0, &mut config);
/// ```
pub unsafe fn comm_init_rank(
    world: i32,
    id: &ncclUniqueId,
    rank: i32,
    config: &mut ncclConfig_t,
) -> Result<(ncclComm_t, bool)> {
    let mut comm = std::ptr::null_mut();
    // SAFETY: writes the handle; the id is passed by value; the caller vouches for the config,
    // which NCCL reads during the call.
    let rc = unsafe { lib()?.ncclCommInitRankConfig(&mut comm, world, *id, rank, config) };
    if rc == ncclResult_t::ncclInProgress {
        return Ok((comm, true));
    }
    match check("ncclCommInitRankConfig", rc) {
        Ok(()) => Ok((comm, false)),
        Err(e) => {
            if !comm.is_null() {
                // SAFETY: a half-made communicator is released the way NCCL says to.
                let _ = unsafe { comm_abort(comm) };
            }
            Err(e)
        }
    }
}

/// `ncclCommGetAsyncError`: the communicator's state (`ncclSuccess`, `ncclInProgress` or an
/// error code).
///
/// # Safety
/// `comm` is a live communicator.
pub unsafe fn comm_state(comm: ncclComm_t) -> Result<ncclResult_t> {
    let mut state = ncclResult_t::ncclSuccess;
    // SAFETY: the caller vouches for the handle; writes one code.
    check("ncclCommGetAsyncError", unsafe {
        lib()?.ncclCommGetAsyncError(comm, &mut state)
    })?;
    Ok(state)
}

/// Polls the communicator until it is no longer `ncclInProgress`. `what` names the operation
/// for the errors.
///
/// # Errors
/// The communicator's asynchronous error, or [`Error::Timeout`] past `deadline`. Either way
/// NCCL says the communicator must then be aborted; the caller does that.
///
/// # Safety
/// `comm` is a live communicator.
pub unsafe fn wait_ready(
    comm: ncclComm_t,
    what: &'static str,
    started: Instant,
    timeout: Duration,
) -> Result<()> {
    let mut spins = 0u32;
    loop {
        // SAFETY: the caller vouches for the handle.
        let state = unsafe { comm_state(comm) }?;
        if state == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        if state != ncclResult_t::ncclInProgress {
            return Err(error(what, state));
        }
        if started.elapsed() >= timeout {
            return Err(Error::Timeout {
                what: what.to_string(),
                after: timeout,
            });
        }
        // Enqueueing usually finishes within microseconds; connection set-up and init take
        // milliseconds to seconds. Spin briefly, then sleep.
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// `ncclCommFinalize`: flushes the communicator's operations. Non-blocking: `Ok(true)` means
/// in progress.
///
/// # Safety
/// `comm` is a live communicator.
pub unsafe fn comm_finalize(comm: ncclComm_t) -> Result<bool> {
    // SAFETY: the caller vouches for the handle.
    let rc = unsafe { lib()?.ncclCommFinalize(comm) };
    if rc == ncclResult_t::ncclInProgress {
        return Ok(true);
    }
    check("ncclCommFinalize", rc).map(|()| false)
}

/// `ncclCommDestroy`, after a finalize that completed.
///
/// # Safety
/// `comm` is a live, finalized communicator, not used afterwards.
pub unsafe fn comm_destroy(comm: ncclComm_t) -> Result<()> {
    // SAFETY: the caller vouches for the handle.
    check("ncclCommDestroy", unsafe { lib()?.ncclCommDestroy(comm) })
}

/// `ncclCommAbort`: stops the communicator's operations and frees it without waiting for peers.
///
/// # Safety
/// `comm` is a live communicator, not used afterwards.
pub unsafe fn comm_abort(comm: ncclComm_t) -> Result<()> {
    // Every abort passes here (a break's, a watchdog's, a graph's aborter thread's, a split's
    // unwanted child's): one span and one event for all. An abort can take as long as other
    // work on the device, or until a graph that captured the communicator is gone.
    let _span = trace::entered!(DEBUG, "nccl_comm_abort");
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    let started = Instant::now();
    // SAFETY: the caller vouches for the handle.
    let r = check("ncclCommAbort", unsafe { lib()?.ncclCommAbort(comm) });
    trace::event!(
        info,
        elapsed = ?started.elapsed(),
        ok = r.is_ok(),
        "handoff: ncclCommAbort returned"
    );
    r
}

/// `ncclCommSplit`: makes this rank's communicator of `color` (`NCCL_SPLIT_NOCOLOR`, -1, for
/// none), ranked by `key`, and writes its handle to `*newcomm` (null for no color). NCCL writes
/// `*newcomm` when the split's job runs: inside a group at the outermost `ncclGroupEnd`, and for
/// a non-blocking communicator on a thread of NCCL's after this returns, even when it returned
/// success (NCCL 2.28): poll the parent with [`wait_ready`] before reading `*newcomm`. The
/// `bool` is `true` when NCCL answered `ncclInProgress`. On 2.28 a rank passing no color whose
/// split then fails crashes inside NCCL, which is why handoff's safe split never passes it.
///
/// # Safety
/// `comm` is a live communicator, not used concurrently by another thread; `newcomm` stays
/// valid and is not read until the split has finished (the group ended, the parent polled
/// ready) or the parent has been aborted; `config` comes from [`config_initializer`]; every
/// rank of `comm` calls this, in one group where ranks share a thread; no other raw group is
/// open on this thread (see [`group_start`]).
pub unsafe fn comm_split(
    comm: ncclComm_t,
    color: i32,
    key: i32,
    newcomm: *mut ncclComm_t,
    config: &mut ncclConfig_t,
) -> Result<bool> {
    // SAFETY: the caller vouches for the parent, `newcomm` and the config, which NCCL reads
    // during the call.
    let rc = unsafe { lib()?.ncclCommSplit(comm, color, key, newcomm, config) };
    if rc == ncclResult_t::ncclInProgress {
        return Ok(true);
    }
    check("ncclCommSplit", rc).map(|()| false)
}

/// `ncclCommCount` and `ncclCommUserRank`: the communicator's size and this rank in it.
///
/// # Errors
/// Also [`Error::Setup`] when NCCL reports a rank that is not below the size.
///
/// # Safety
/// `comm` is a live communicator that has finished initializing.
pub unsafe fn comm_world_rank(comm: ncclComm_t) -> Result<(usize, usize)> {
    let (mut world, mut rank) = (0, 0);
    // SAFETY: the caller vouches for the handle; both write one int.
    unsafe {
        check("ncclCommCount", lib()?.ncclCommCount(comm, &mut world))?;
        check("ncclCommUserRank", lib()?.ncclCommUserRank(comm, &mut rank))?;
    }
    match (usize::try_from(world), usize::try_from(rank)) {
        (Ok(w), Ok(r)) if r < w => Ok((w, r)),
        _ => Err(Error::Setup {
            detail: format!("NCCL reports rank {rank} of {world} ranks for a communicator"),
        }),
    }
}

/// `ncclGroupStart`: operations issued on this thread until the matching [`group_end`] are
/// queued by it, not before.
///
/// # Safety
/// The group is ended on this thread by [`group_end`] before any of handoff's own calls that
/// reach NCCL ([`Communicator`](crate::Communicator)'s operations, [`crate::group`], creating a
/// communicator): inside an open raw group, handoff's `ncclGroupEnd` only closes a nested group
/// and queues nothing, so the events it records to track its buffers would complete before the
/// work they stand for, and a buffer could be read, rewritten or freed under a transfer.
///
/// ```no_run
/// # fn main() -> handoff::Result<()> {
/// use handoff::result::nccl::{group_end, group_start};
/// // SAFETY: the group is closed on this thread before any of handoff's calls.
/// unsafe {
///     group_start()?;
///     group_end()?;
/// }
/// # Ok(())
/// # }
/// ```
///
/// Outside `unsafe` neither compiles (issue 9, hole 3: a safe raw group let tracking record its
/// events before the transfers were queued):
/// ```compile_fail
/// handoff::result::nccl::group_start().unwrap();
/// ```
/// ```compile_fail
/// handoff::result::nccl::group_end().unwrap();
/// ```
pub unsafe fn group_start() -> Result<()> {
    // SAFETY: no arguments; groups are per thread.
    check("ncclGroupStart", unsafe { lib()?.ncclGroupStart() })
}

/// `ncclGroupEnd`: `Ok(true)` when the group is still being enqueued (`ncclInProgress`).
///
/// # Safety
/// Ends a group this thread opened with [`group_start`]; ending one that handoff opened would
/// queue its work before it records the events that track it.
pub unsafe fn group_end() -> Result<bool> {
    // SAFETY: no arguments; ends this thread's group.
    let rc = unsafe { lib()?.ncclGroupEnd() };
    if rc == ncclResult_t::ncclInProgress {
        return Ok(true);
    }
    check("ncclGroupEnd", rc).map(|()| false)
}

/// `ncclSend`. In a group, NCCL queues nothing before `ncclGroupEnd`.
///
/// # Safety
/// `buf` is device memory of `comm`'s device holding `count` elements of `dtype`, not written
/// until the send completes on `stream`; `peer` is a rank of `comm`.
pub unsafe fn send(
    buf: *const std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    peer: i32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclSend(buf, count, dtype, peer, comm, stream) })
}

/// `ncclRecv`.
///
/// # Safety
/// As [`send`], for a buffer neither read nor written by anything else until the receive
/// completes.
pub unsafe fn recv(
    buf: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    peer: i32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclRecv(buf, count, dtype, peer, comm, stream) })
}

/// `ncclAllGather`: each rank's `count` elements of `send`, in rank order, into every rank's
/// `recv`.
///
/// # Safety
/// `send` holds `count` elements and `recv` `count × world` elements of `dtype`, both device
/// memory of `comm`'s device, neither written by anything else (nor `recv` read) until the
/// operation completes on `stream`; every rank calls it with the same `count` and `dtype`.
pub unsafe fn all_gather(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclAllGather(send, recv, count, dtype, comm, stream) })
}

/// `ncclAllReduce`: the element-wise reduction `op` of every rank's `send` into every rank's
/// `recv` (`send == recv`: in place).
///
/// # Safety
/// `send` and `recv` hold `count` elements of `dtype` on `comm`'s device (they may be the same
/// buffer), neither written by anything else (nor `recv` read) until the operation completes on
/// `stream`; every rank calls it with the same `count`, `dtype` and `op`, in the same order
/// among its collectives.
pub unsafe fn all_reduce(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    op: crate::sys::nccl::ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclAllReduce(send, recv, count, dtype, op, comm, stream) })
}

/// `ncclBroadcast`: `root`'s `send` into every rank's `recv`.
///
/// # Safety
/// As [`all_reduce`]; `send` is read on `root` only (any pointer elsewhere); `root` is a rank
/// of `comm`, the same on every rank.
pub unsafe fn broadcast(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    root: i32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclBroadcast(send, recv, count, dtype, root, comm, stream) })
}

/// `ncclReduce`: the reduction `op` of every rank's `send` into `root`'s `recv`.
///
/// # Safety
/// As [`broadcast`]; `recv` is written on `root` only.
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    op: crate::sys::nccl::ncclRedOp_t,
    root: i32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclReduce(send, recv, count, dtype, op, root, comm, stream) })
}

/// `ncclReduceScatter`: the reduction `op` of every rank's `send` (`recv_count × world`
/// elements), block `r` of it into rank `r`'s `recv`.
///
/// # Safety
/// As [`all_reduce`], with `send` holding `recv_count × world` elements and `recv`
/// `recv_count`.
pub unsafe fn reduce_scatter(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    recv_count: usize,
    dtype: ncclDataType_t,
    op: crate::sys::nccl::ncclRedOp_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclReduceScatter(send, recv, recv_count, dtype, op, comm, stream) })
}

/// `ncclAlltoAll`: block `j` (`count` elements) of every rank's `send` into block `i` of rank
/// `j`'s `recv`, `i` being the sender.
///
/// # Safety
/// As [`all_reduce`], with `send` and `recv` each holding `count × world` elements.
pub unsafe fn all_to_all(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclAlltoAll(send, recv, count, dtype, comm, stream) })
}

/// `ncclGather`: every rank's `send` (`count` elements) into block `i` of `root`'s `recv`.
///
/// # Safety
/// As [`broadcast`], with `recv` holding `count × world` elements on `root` (unused elsewhere).
pub unsafe fn gather(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    root: i32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclGather(send, recv, count, dtype, root, comm, stream) })
}

/// `ncclScatter`: block `i` of `root`'s `send` (`count × world` elements there, unused
/// elsewhere) into rank `i`'s `recv` (`count` elements).
///
/// # Safety
/// As [`broadcast`].
pub unsafe fn scatter(
    send: *const std::ffi::c_void,
    recv: *mut std::ffi::c_void,
    count: usize,
    dtype: ncclDataType_t,
    root: i32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> Result<ncclResult_t> {
    // SAFETY: the caller vouches for every argument.
    Ok(unsafe { lib()?.ncclScatter(send, recv, count, dtype, root, comm, stream) })
}

/// `ncclRedOpCreatePreMulSum` with a host scalar (`ncclScalarHostImmediate`: read before it
/// returns): a reduction that multiplies each rank's input by its `scalar`, then sums.
///
/// # Safety
/// `comm` is a live communicator, not used concurrently by another thread; `scalar` points to
/// one element of `datatype`.
pub unsafe fn red_op_create_pre_mul_sum(
    scalar: *const std::ffi::c_void,
    datatype: ncclDataType_t,
    comm: ncclComm_t,
) -> Result<ncclRedOp_t> {
    let mut op = ncclRedOp_t(0);
    // SAFETY: writes the handle; NCCL reads the scalar during the call (host, immediate) and
    // does not write it; the caller vouches for the rest.
    let rc = unsafe {
        lib()?.ncclRedOpCreatePreMulSum(
            &mut op,
            scalar.cast_mut(),
            datatype,
            ncclScalarResidence_t::ncclScalarHostImmediate,
            comm,
        )
    };
    check("ncclRedOpCreatePreMulSum", rc).map(|()| op)
}

/// `ncclRedOpDestroy`.
///
/// # Safety
/// `op` was made by [`red_op_create_pre_mul_sum`] on `comm`, which is live and not used
/// concurrently; every NCCL call given `op` has returned (inside a group: the group has ended).
pub unsafe fn red_op_destroy(op: ncclRedOp_t, comm: ncclComm_t) -> Result<()> {
    // SAFETY: the caller vouches for both.
    check("ncclRedOpDestroy", unsafe { lib()?.ncclRedOpDestroy(op, comm) })
}

/// NCCL's functions of registered memory and windows; [`Error::Unsupported`] when the loaded
/// NCCL lacks them (see [`loader::nccl_register`]).
#[inline]
pub fn register_lib() -> Result<&'static NcclRegisterLib> {
    loader::nccl_register()
}

/// `ncclMemAlloc`: `bytes` (> 0) of device memory on the current device, from CUDA's virtual
/// memory management (`cuMemCreate`, mapped for every peer GPU that can reach it) where NCCL's
/// cuMem support is on, else from `cudaMalloc` (`NCCL_CUMEM_ENABLE=0`, a driver without it).
/// Not stream-ordered: usable by every stream at once. Leaking it is safe.
///
/// # Errors
/// Also [`Error::InvalidArgument`] when NCCL answers success with a null pointer.
pub fn mem_alloc(bytes: usize) -> Result<*mut std::ffi::c_void> {
    let mut ptr = std::ptr::null_mut();
    // SAFETY: writes one pointer through a valid pointer.
    check("ncclMemAlloc", unsafe {
        register_lib()?.ncclMemAlloc(&mut ptr, bytes)
    })?;
    if ptr.is_null() {
        return Err(Error::InvalidArgument(format!(
            "ncclMemAlloc returned no memory for {bytes} bytes"
        )));
    }
    Ok(ptr)
}

/// `ncclMemFree`. Not stream-ordered: the memory is unmapped at once.
///
/// # Safety
/// `ptr` came from [`mem_alloc`], is not freed again, no queued or running GPU work uses it,
/// and no communicator has it registered ([`comm_register`], [`comm_window_register`]).
pub unsafe fn mem_free(ptr: *mut std::ffi::c_void) -> Result<()> {
    // SAFETY: the caller vouches for the pointer.
    check("ncclMemFree", unsafe { register_lib()?.ncclMemFree(ptr) })
}

/// `ncclCommRegister`: tells `comm` that `bytes` at `ptr` may be used by its operations without
/// staging copies. Local to this rank in NCCL 2.28 (it fills the communicator's registration
/// cache; peers exchange handles later, inside the collectives that use the memory). The
/// handle is null when NCCL registers nothing (`NCCL_LOCAL_REGISTER=0`).
///
/// # Safety
/// `comm` is a live communicator not used concurrently by another thread; the memory is device
/// memory of its device and stays allocated until [`comm_deregister`] (or the communicator's
/// destruction) has returned.
pub unsafe fn comm_register(
    comm: ncclComm_t,
    ptr: *mut std::ffi::c_void,
    bytes: usize,
) -> Result<*mut std::ffi::c_void> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: the caller vouches for the communicator and the memory; writes the handle.
    check("ncclCommRegister", unsafe {
        register_lib()?.ncclCommRegister(comm, ptr, bytes, &mut handle)
    })?;
    Ok(handle)
}

/// `ncclCommDeregister`.
///
/// # Safety
/// `handle` came from [`comm_register`] on `comm`, which is live and not used concurrently, and
/// is not deregistered again; no queued or running operation uses the memory.
pub unsafe fn comm_deregister(comm: ncclComm_t, handle: *mut std::ffi::c_void) -> Result<()> {
    // SAFETY: the caller vouches for both.
    check("ncclCommDeregister", unsafe {
        register_lib()?.ncclCommDeregister(comm, handle)
    })
}

/// `ncclCommWindowRegister` with `flags` (`NCCL_WIN_COLL_SYMMETRIC`): makes `bytes` at `ptr` a
/// window, mapped into every local peer's address space. Collective in NCCL 2.28: it runs as a
/// group task that exchanges handles and ends in a barrier of every rank, so every rank calls
/// it, in the same order, with the same size. `Ok((window, true))` when a non-blocking
/// communicator answered `ncclInProgress`: poll it with [`wait_ready`] before reading the
/// window (NCCL writes it when the task runs).
///
/// # Safety
/// `comm` is a live communicator not used concurrently, and no raw group is open on this thread
/// ([`group_start`]); every rank calls this with the same `bytes` as the same-numbered window
/// registration of `comm`; the memory is one [`mem_alloc`] allocation (CUDA VMM memory) at an
/// offset within it that is a multiple of `NCCL_WIN_REQUIRED_ALIGNMENT` (4096), holds `bytes`, and
/// stays allocated until [`comm_window_deregister`] has returned; it is not already a window of
/// `comm`. A rank that breaks the collective rules leaves the others waiting in NCCL's barrier,
/// with no deadline.
pub unsafe fn comm_window_register(
    comm: ncclComm_t,
    ptr: *mut std::ffi::c_void,
    bytes: usize,
    flags: i32,
) -> Result<(ncclWindow_t, bool)> {
    let mut win: ncclWindow_t = std::ptr::null_mut();
    // SAFETY: the caller vouches for the communicator, the memory and the collective rules;
    // NCCL writes the window through a pointer that lives until it is read (after the group,
    // or after `wait_ready` for a non-blocking communicator: the caller's part).
    let rc = unsafe { register_lib()?.ncclCommWindowRegister(comm, ptr, bytes, &mut win, flags) };
    if rc == ncclResult_t::ncclInProgress {
        return Ok((win, true));
    }
    check("ncclCommWindowRegister", rc).map(|()| (win, false))
}

/// `ncclCommWindowDeregister`: local to this rank in NCCL 2.28 (it unmaps the peers' memory from
/// this rank's window and drops its registration; it waits on an internal stream of NCCL's).
///
/// # Safety
/// `win` came from [`comm_window_register`] on `comm`, which is live and not used concurrently,
/// and is not deregistered again; no queued or running operation uses the window.
pub unsafe fn comm_window_deregister(comm: ncclComm_t, win: ncclWindow_t) -> Result<()> {
    // SAFETY: the caller vouches for both.
    check("ncclCommWindowDeregister", unsafe {
        register_lib()?.ncclCommWindowDeregister(comm, win)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_initializer_matches_the_header() {
        let c = config_initializer();
        assert_eq!(c.size, std::mem::size_of::<ncclConfig_t>());
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.version, 22803);
        assert_eq!(c.blocking, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn success_is_ok_without_loading_nccl() {
        assert!(check("ncclSend", ncclResult_t::ncclSuccess).is_ok());
    }
}
