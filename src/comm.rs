//! NCCL communicators: [`UniqueId`], [`Communicator`], point-to-point [`Communicator::send`] and
//! [`Communicator::recv`], and [`group`]s of them.
//!
//! # How a transfer stays safe
//! A send is a *read* of its buffer and a receive a *write*, in the same use tracking as every
//! other stream operation (see [`crate::tracking`]). So the article's rules hold by
//! construction, whatever streams are used: the next kernel A cannot overwrite a send buffer
//! before the send has completed on the GPU, and the next receive cannot overwrite `x` before
//! kernel B has read it.
//!
//! NCCL queues nothing on a stream before `ncclGroupEnd` (and, for a non-blocking communicator,
//! before its state leaves `ncclInProgress`). handoff therefore makes the streams wait for
//! earlier conflicting uses *before* the group, and records the events that track the transfers
//! only *after* the group has been enqueued: recording them inside the group, as cudarc did
//! (its issue 575), would let them complete before the transfers even start.
//!
//! # Threads
//! NCCL calls on one communicator are not thread-safe. [`Communicator`] is therefore `Send` (it
//! may move to another thread) but not `Sync` (two threads cannot call it at once), and a
//! [`Group`], which holds communicators, is neither: NCCL's group state belongs to the thread
//! that opened it.
//!
//! # Failures
//! Host-side waits have a deadline ([`CommOptions::timeout`]): [`Communicator::synchronize`],
//! [`Communicator::finalize`] and the finalize on drop always; creation and enqueueing too for a
//! non-blocking communicator ([`CommOptions::blocking`]). An NCCL error or a missed deadline
//! aborts the communicator (`ncclCommAbort`), as NCCL requires; every later call on it returns
//! [`Error::CommunicatorUnusable`].

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytemuck::Pod;

use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::device::PooledEvent;
use crate::error::{Error, Result};
use crate::result::nccl as nc;
use crate::stream::{Stream, Tracked};
use crate::sys::nccl::{ncclComm_t, ncclDataType_t, ncclResult_t, ncclUniqueId};
use crate::tracking::{Access, StreamId};

/// The identifier that every rank of one communicator must share, made by one of them.
///
/// 128 opaque bytes: NCCL encodes in them the address of a bootstrap socket that
/// [`UniqueId::new`] opens in the calling process, which must therefore stay alive until all
/// ranks have joined. Move it between processes as bytes ([`UniqueId::as_bytes`]) or as text
/// (`Display` / `FromStr`, 256 hex digits), or let [`crate::bootstrap`] do it.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UniqueId::BYTES],
}

impl UniqueId {
    /// Size of a unique id in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const BYTES: usize = crate::sys::nccl::NCCL_UNIQUE_ID_BYTES as usize;

    /// A new id (`ncclGetUniqueId`).
    ///
    /// # Errors
    /// NCCL cannot be loaded, or cannot open its bootstrap socket.
    pub fn new() -> Result<UniqueId> {
        let raw = nc::get_unique_id()?;
        Ok(UniqueId {
            bytes: raw.internal.map(|c| c as u8),
        })
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; UniqueId::BYTES] {
        &self.bytes
    }

    /// An id from bytes that [`UniqueId::as_bytes`] produced.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `bytes` has exactly [`UniqueId::BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; UniqueId::BYTES] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "a unique id has {} bytes, not {}",
                UniqueId::BYTES,
                bytes.len()
            ))
        })?;
        Ok(UniqueId { bytes })
    }

    pub(crate) fn raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: self.bytes.map(|b| b as std::ffi::c_char),
        }
    }
}

impl fmt::Display for UniqueId {
    /// 256 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.to_string();
        write!(f, "UniqueId({}…)", &text[..16])
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    /// Parses the 256 hex digits that `Display` writes.
    fn from_str(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 2 * UniqueId::BYTES || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(Error::InvalidArgument(format!(
                "a unique id is written as {} hex digits; got {} characters{}",
                2 * UniqueId::BYTES,
                s.len(),
                if s.bytes().all(|c| c.is_ascii_hexdigit()) {
                    ""
                } else {
                    " with non-hex ones"
                }
            )));
        }
        let mut bytes = [0u8; UniqueId::BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("checked hex digits");
        }
        Ok(UniqueId { bytes })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Element types NCCL can move, with their `ncclDataType_t`.
///
/// Sealed: the type's size must be the NCCL type's size, or NCCL would read or write past the
/// buffer, so only the crate implements it.
pub trait NcclType: Pod + sealed::Sealed {
    /// The NCCL data type.
    const DATATYPE: ncclDataType_t;
    /// Its name, for messages.
    const NAME: &'static str;
}

macro_rules! nccl_types {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl NcclType for $t {
            const DATATYPE: ncclDataType_t = ncclDataType_t::$d;
            const NAME: &'static str = stringify!($t);
        }
    )*};
}

nccl_types! {
    i8 => ncclInt8,
    u8 => ncclUint8,
    i32 => ncclInt32,
    u32 => ncclUint32,
    i64 => ncclInt64,
    u64 => ncclUint64,
    half::f16 => ncclFloat16,
    f32 => ncclFloat32,
    f64 => ncclFloat64,
    half::bf16 => ncclBfloat16,
}

/// The size in bytes of one element of an NCCL data type (for checks and messages).
pub fn datatype_size(d: ncclDataType_t) -> usize {
    match d.0 {
        0 | 1 | 10 | 11 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        _ => 8,
    }
}

/// The Rust name of an NCCL data type code, for messages.
pub fn datatype_name(code: u32) -> &'static str {
    match code {
        0 => "i8",
        1 => "u8",
        2 => "i32",
        3 => "u32",
        4 => "i64",
        5 => "u64",
        6 => "f16",
        7 => "f32",
        8 => "f64",
        9 => "bf16",
        10 => "f8e4m3",
        11 => "f8e5m2",
        _ => "an unknown NCCL type",
    }
}

/// How a communicator is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommOptions {
    /// Deadline of every host-side wait on the communicator: its creation (non-blocking only),
    /// enqueueing (non-blocking only), [`Communicator::synchronize`], [`Communicator::finalize`]
    /// and the finalize on drop. Past it the communicator is aborted. Default: 120 s.
    pub timeout: Duration,
    /// NCCL's `blocking` setting. Blocking (the default, and NCCL's) is fast: a send or receive
    /// returns after a few microseconds. Non-blocking makes creation and enqueueing time out
    /// instead of hanging on a rank that never comes, but on NCCL 2.28 every group then goes
    /// through NCCL's background thread, which costs tens of microseconds per call (see
    /// BENCHMARKS.md).
    pub blocking: bool,
    /// Checked mode: before each group, every pair of ranks with sends or receives between them
    /// swaps what it will post (counts, types, order), and a disagreement becomes
    /// [`Error::Mismatch`] on both ranks, with nothing transferred, instead of a hang or silent
    /// corruption. Costs one small NCCL exchange and a host wait per group. All ranks must use
    /// the same setting (a rank without it never answers the exchange, which then times out).
    /// Default: on in debug builds, off in release builds.
    pub checked: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(120),
            blocking: true,
            checked: cfg!(debug_assertions),
        }
    }
}

impl CommOptions {
    /// Non-blocking, with `timeout` for every host-side wait.
    pub fn nonblocking(timeout: Duration) -> Self {
        CommOptions {
            timeout,
            blocking: false,
            ..CommOptions::default()
        }
    }

    fn config(&self) -> crate::sys::nccl::ncclConfig_t {
        let mut config = nc::config_initializer();
        config.blocking = i32::from(self.blocking);
        config
    }
}

/// One rank of an NCCL communicator, bound to one GPU.
///
/// Dropping it waits (up to [`CommOptions::timeout`]) for the operations it queued to finish,
/// then finalizes and destroys it; if they do not finish in time, or NCCL reports an error, or
/// the communicator was already broken, it is aborted instead: dropping never hangs on a peer.
/// [`Communicator::finalize`] does the same and reports errors.
pub struct Communicator {
    /// Null once aborted or destroyed.
    raw: Cell<ncclComm_t>,
    device: Device,
    rank: usize,
    world: usize,
    options: CommOptions,
    /// Why the communicator is unusable, once it is.
    broken: RefCell<Option<String>>,
    /// The event after this communicator's last operation on each stream it used.
    last: RefCell<Vec<(StreamId, Arc<PooledEvent>)>>,
}

// SAFETY: an NCCL communicator is not tied to the thread that made it; each call makes the
// communicator's device current on the calling thread. It is not Sync (the RefCells see to
// that): NCCL calls on one communicator must not run concurrently.
unsafe impl Send for Communicator {}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device.ordinal())
            .field("options", &self.options)
            .field("broken", &*self.broken.borrow())
            .finish()
    }
}

impl Communicator {
    fn wrap(
        raw: ncclComm_t,
        device: &Device,
        world: usize,
        rank: usize,
        options: CommOptions,
    ) -> Communicator {
        Communicator {
            raw: Cell::new(raw),
            device: device.clone(),
            rank,
            world,
            options,
            broken: RefCell::new(None),
            last: RefCell::new(Vec::new()),
        }
    }

    /// Rank `rank` of a communicator of `world` ranks, on `device`, with default
    /// [`CommOptions`]. Every rank calls this with the same `id`; it returns once all have
    /// joined.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `world == 0` or `rank >= world`; NCCL errors (e.g. two
    /// ranks on one GPU).
    pub fn new(device: &Device, world: usize, rank: usize, id: &UniqueId) -> Result<Communicator> {
        Self::with_options(device, world, rank, id, CommOptions::default())
    }

    /// As [`Communicator::new`], with `options`. A non-blocking communicator fails with
    /// [`Error::Timeout`] when the other ranks do not join within the timeout; a blocking one
    /// waits for them as long as NCCL does.
    ///
    /// # Errors
    /// As [`Communicator::new`], and [`Error::Timeout`].
    pub fn with_options(
        device: &Device,
        world: usize,
        rank: usize,
        id: &UniqueId,
        options: CommOptions,
    ) -> Result<Communicator> {
        check_world_rank(world, rank)?;
        device.set_current()?;
        let started = Instant::now();
        let (raw, pending) = nc::comm_init_rank(world as i32, &id.raw(), rank as i32, &mut options.config())?;
        let comm = Communicator::wrap(raw, device, world, rank, options);
        if pending {
            // SAFETY: `raw` is the communicator just created.
            if let Err(e) = unsafe { nc::wait_ready(raw, "ncclCommInitRankConfig", started, options.timeout) }
            {
                comm.break_with(&e);
                return Err(e);
            }
        }
        Ok(comm)
    }

    /// One communicator over all of `devices`, all in this process: rank `i` on `devices[i]`
    /// (what NCCL's `ncclCommInitAll` does), with default [`CommOptions`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no devices, or a device listed twice (NCCL refuses two
    /// ranks on one GPU); NCCL errors.
    pub fn init_all(devices: &[Device]) -> Result<Vec<Communicator>> {
        Self::init_all_with(devices, CommOptions::default())
    }

    /// As [`Communicator::init_all`], with `options`.
    ///
    /// # Errors
    /// As [`Communicator::init_all`], and [`Error::Timeout`].
    pub fn init_all_with(devices: &[Device], options: CommOptions) -> Result<Vec<Communicator>> {
        let world = devices.len();
        check_world_rank(world, 0)?;
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].iter().any(|e| e.same(d)) {
                return Err(Error::InvalidArgument(format!(
                    "device {} is listed twice: NCCL allows one rank per GPU",
                    d.ordinal()
                )));
            }
        }
        let id = UniqueId::new()?.raw();
        let started = Instant::now();
        let mut comms = Vec::with_capacity(world);
        nc::group_start()?;
        let mut first_err = None;
        for (rank, device) in devices.iter().enumerate() {
            match device
                .set_current()
                .and_then(|()| nc::comm_init_rank(world as i32, &id, rank as i32, &mut options.config()))
            {
                Ok((raw, _)) => comms.push(Communicator::wrap(raw, device, world, rank, options)),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        if let Err(e) = nc::group_end() {
            first_err.get_or_insert(e);
        }
        for c in &comms {
            if first_err.is_some() {
                break;
            }
            // SAFETY: each communicator was just created.
            if let Err(e) =
                unsafe { nc::wait_ready(c.raw.get(), "ncclCommInitAll", started, options.timeout) }
            {
                first_err = Some(e);
            }
        }
        match first_err {
            Some(e) => {
                for c in &comms {
                    c.break_with(&e);
                }
                Err(e)
            }
            None => Ok(comms),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The GPU this rank runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The options the communicator was made with.
    pub fn options(&self) -> CommOptions {
        self.options
    }

    /// The deadline of every host-side wait on this communicator.
    pub fn timeout(&self) -> Duration {
        self.options.timeout
    }

    /// Changes the deadline of later host-side waits (and of the finalize on drop).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.options.timeout = timeout;
    }

    /// The raw handle, for calling NCCL directly (null once aborted or finalized). Operations
    /// queued through it are not tracked: the caller takes on the ordering that the safe API
    /// otherwise provides, and must not call it from two threads at once.
    pub fn as_raw(&self) -> ncclComm_t {
        self.raw.get()
    }

    /// Why the communicator is unusable, if it is.
    pub fn broken_reason(&self) -> Option<String> {
        self.broken.borrow().clone()
    }

    /// Sends all of `buf` to rank `peer`, on `stream`: after every earlier write of `buf`, and
    /// before any later write of it (on any stream) may start.
    ///
    /// The peer must post a matching [`Communicator::recv`] of the same count and type. A send
    /// to oneself needs its receive in the same [`group`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (peer out of range, another device, a send to oneself outside
    /// a group) before NCCL is called; NCCL errors and [`Error::Timeout`], after which the
    /// communicator is aborted.
    pub fn send<T: NcclType>(&self, buf: &DeviceBuffer<T>, peer: usize, stream: &Stream) -> Result<()> {
        group(|g| g.send(self, buf, peer, stream))
    }

    /// Sends the elements `range` of `buf`. As [`Communicator::send`]; the whole buffer counts
    /// as read for tracking.
    ///
    /// # Errors
    /// As [`Communicator::send`], and [`Error::InvalidArgument`] for a range outside `buf`.
    pub fn send_range<T: NcclType>(
        &self,
        buf: &DeviceBuffer<T>,
        range: Range<usize>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        group(|g| g.send_range(self, buf, range, peer, stream))
    }

    /// Receives into all of `buf` from rank `peer`, on `stream`: after every earlier use of
    /// `buf`, and before any later use of it may start.
    ///
    /// # Errors
    /// As [`Communicator::send`].
    pub fn recv<T: NcclType>(&self, buf: &mut DeviceBuffer<T>, peer: usize, stream: &Stream) -> Result<()> {
        group(|g| g.recv(self, buf, peer, stream))
    }

    /// Receives into the elements `range` of `buf`. As [`Communicator::recv`]; the whole buffer
    /// counts as written for tracking.
    ///
    /// # Errors
    /// As [`Communicator::send_range`].
    pub fn recv_range<T: NcclType>(
        &self,
        buf: &mut DeviceBuffer<T>,
        range: Range<usize>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        group(|g| g.recv_range(self, buf, range, peer, stream))
    }

    /// Blocks the host until every operation this communicator queued has completed on the GPU,
    /// watching NCCL's asynchronous error (`ncclCommGetAsyncError`) while it waits. On an error,
    /// or past [`CommOptions::timeout`], the communicator is aborted and the error returned;
    /// later calls then fail with [`Error::CommunicatorUnusable`].
    ///
    /// # Errors
    /// [`Error::Timeout`], NCCL's asynchronous error, CUDA errors; [`Error::CommunicatorUnusable`].
    pub fn synchronize(&self) -> Result<()> {
        let raw = self.usable()?;
        let r = self.wait_idle(raw);
        if let Err(e) = &r {
            self.break_with(e);
        }
        r
    }

    fn wait_idle(&self, raw: ncclComm_t) -> Result<()> {
        let events: Vec<Arc<PooledEvent>> = self.last.borrow().iter().map(|(_, e)| e.clone()).collect();
        self.wait_events(raw, &events, "queued sends and receives")?;
        self.last.borrow_mut().clear();
        Ok(())
    }

    /// Blocks the host until all work queued so far on `stream` has completed, watching this
    /// communicator's asynchronous error while it waits; on an error, or past
    /// [`CommOptions::timeout`], aborts the communicator and returns the error. Use it instead
    /// of [`Stream::synchronize`] where a peer's failure must not hang this rank.
    ///
    /// # Errors
    /// [`Error::Timeout`], NCCL's asynchronous error, CUDA errors; [`Error::CommunicatorUnusable`].
    pub fn wait_stream(&self, stream: &Stream) -> Result<()> {
        let raw = self.usable()?;
        let r = stream.device().take_event().and_then(|e| {
            // SAFETY: both handles are live and of the same device.
            unsafe { crate::result::event_record(e.raw, stream.as_raw()) }?;
            self.wait_events(raw, &[e], "the work queued on a stream")
        });
        if let Err(e) = &r {
            self.break_with(e);
        }
        r
    }

    fn wait_events(&self, raw: ncclComm_t, events: &[Arc<PooledEvent>], what: &str) -> Result<()> {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let mut idle = true;
            for e in events {
                // SAFETY: the event is kept alive by the Arc.
                idle &= unsafe { crate::result::event_query(e.raw) }?;
            }
            if idle {
                return Ok(());
            }
            // SAFETY: `raw` is live (checked by the caller).
            let state = unsafe { nc::comm_state(raw) }?;
            if state != ncclResult_t::ncclSuccess && state != ncclResult_t::ncclInProgress {
                return Err(nc::error("ncclCommGetAsyncError", state));
            }
            if started.elapsed() >= self.options.timeout {
                return Err(Error::Timeout {
                    what: format!("rank {}'s wait for {what}", self.rank),
                    after: self.options.timeout,
                });
            }
            spins += 1;
            if spins < 100 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Aborts the communicator now (`ncclCommAbort`): its queued operations stop, and every
    /// later call returns [`Error::CommunicatorUnusable`]. Buffers it used stay tracked, so they
    /// are still freed only after the aborted operations have left the GPU.
    ///
    /// # Errors
    /// NCCL's error from the abort.
    pub fn abort(&self) -> Result<()> {
        self.broken
            .borrow_mut()
            .get_or_insert_with(|| "aborted by the program".into());
        self.abort_raw()
    }

    /// Waits for the communicator's operations (as [`Communicator::synchronize`]), then
    /// finalizes and destroys it; aborts it if they do not finish in time or fail. `Drop` does
    /// the same but cannot report.
    ///
    /// # Errors
    /// As [`Communicator::synchronize`]; NCCL's errors from finalizing.
    pub fn finalize(self) -> Result<()> {
        let r = self.finalize_raw();
        if let Err(e) = &r {
            self.break_with(e);
        }
        r
    }

    fn finalize_raw(&self) -> Result<()> {
        let raw = self.usable()?;
        if raw.is_null() {
            return Ok(());
        }
        self.device.set_current()?;
        // Finalizing while operations are still queued would wait for them inside NCCL, with no
        // deadline for a blocking communicator: wait here first, with one.
        self.wait_idle(raw)?;
        let started = Instant::now();
        // SAFETY: `raw` is live (non-null) and owned by self.
        let pending = unsafe { nc::comm_finalize(raw) }?;
        if pending {
            // SAFETY: as above.
            unsafe { nc::wait_ready(raw, "ncclCommFinalize", started, self.options.timeout) }?;
        }
        self.raw.set(std::ptr::null_mut());
        // SAFETY: finalized; not used again (raw is now null).
        unsafe { nc::comm_destroy(raw) }
    }

    fn abort_raw(&self) -> Result<()> {
        let raw = self.raw.replace(std::ptr::null_mut());
        if raw.is_null() {
            return Ok(());
        }
        self.device.set_current()?;
        // SAFETY: `raw` was live and is not used again.
        unsafe { nc::comm_abort(raw) }
    }

    /// Marks the communicator unusable because of `e` and aborts it, as NCCL requires after an
    /// error.
    fn break_with(&self, e: &Error) {
        self.broken.borrow_mut().get_or_insert_with(|| e.to_string());
        let _ = self.abort_raw();
    }

    fn usable(&self) -> Result<ncclComm_t> {
        if let Some(reason) = self.broken_reason() {
            return Err(Error::CommunicatorUnusable { reason });
        }
        Ok(self.raw.get())
    }

    /// Remembers `event` as the point after this communicator's latest operation on `stream`.
    fn note_last(&self, stream: StreamId, event: Arc<PooledEvent>) {
        let mut last = self.last.borrow_mut();
        match last.iter_mut().find(|(s, _)| *s == stream) {
            Some(slot) => slot.1 = event,
            None => last.push((stream, event)),
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.raw.get().is_null() {
            return;
        }
        if self.broken_reason().is_some() || self.finalize_raw().is_err() {
            let _ = self.abort_raw();
        }
    }
}

fn check_world_rank(world: usize, rank: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidArgument(
            "a communicator needs at least one rank (world size 0)".into(),
        ));
    }
    if world > i32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "world size {world} is larger than NCCL allows"
        )));
    }
    if rank >= world {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} is out of range for a communicator of {world} ranks"
        )));
    }
    Ok(())
}

/// One send or receive, checked and waiting for [`Group`] to submit it.
struct Op<'a> {
    comm: &'a Communicator,
    stream: &'a Stream,
    tracked: &'a Tracked,
    access: Access,
    ptr: *mut c_void,
    count: usize,
    dtype: ncclDataType_t,
    peer: usize,
}

/// Sends and receives queued together (`ncclGroupStart` … `ncclGroupEnd`), made with [`group`].
///
/// Each call checks its arguments at once; nothing reaches NCCL until the closure given to
/// [`group`] returns `Ok`, so a group is never left open and an error inside the closure
/// submits nothing. Operations may span several communicators (several GPUs of this process)
/// and streams.
pub struct Group<'a> {
    ops: Vec<Op<'a>>,
    /// NCCL's group state is per thread.
    _not_send: PhantomData<*const ()>,
}

/// Runs `f` to collect sends and receives, then submits them as one NCCL group.
///
/// A send to oneself and its receive must be in one group; so must operations on several
/// communicators of this process that depend on each other.
///
/// ```no_run
/// # fn main() -> handoff::Result<()> {
/// use handoff::{group, Communicator, Device, DeviceBuffer, Stream};
/// let gpu = Device::new(0)?;
/// let comm = &Communicator::init_all(&[gpu.clone()])?[0];
/// let stream = Stream::new(&gpu)?;
/// let x = DeviceBuffer::from_slice(&stream, &[1.0f32, 2.0, 3.0, 4.0])?;
/// let mut y = DeviceBuffer::<f32>::zeros(&stream, 4)?;
/// group(|g| {
///     g.send(comm, &x, 0, &stream)?; // to itself: rank 0 of 1
///     g.recv(comm, &mut y, 0, &stream)
/// })?;
/// assert_eq!(y.to_vec(&stream)?, [1.0, 2.0, 3.0, 4.0]);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// `f`'s error (nothing submitted); [`Error::InvalidArgument`] for a send to oneself without a
/// matching receive; NCCL errors and [`Error::Timeout`] (the communicators involved are then
/// aborted).
pub fn group<'a, R>(f: impl FnOnce(&mut Group<'a>) -> Result<R>) -> Result<R> {
    let mut g = Group {
        ops: Vec::new(),
        _not_send: PhantomData,
    };
    let out = f(&mut g)?;
    g.submit()?;
    Ok(out)
}

impl<'a> Group<'a> {
    /// Adds a send of all of `buf`; see [`Communicator::send`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]; [`Error::CommunicatorUnusable`].
    pub fn send<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a DeviceBuffer<T>,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        self.send_range(comm, buf, 0..buf.len(), peer, stream)
    }

    /// Adds a send of the elements `range` of `buf`.
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn send_range<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a DeviceBuffer<T>,
        range: Range<usize>,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        let ptr = buf.as_raw_ptr().cast_mut();
        self.push::<T>(
            comm,
            buf.tracked(),
            buf.len(),
            ptr,
            range,
            peer,
            stream,
            Access::Read,
        )
    }

    /// Adds a receive into all of `buf`; see [`Communicator::recv`].
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn recv<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut DeviceBuffer<T>,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        let len = buf.len();
        self.recv_range(comm, buf, 0..len, peer, stream)
    }

    /// Adds a receive into the elements `range` of `buf`.
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn recv_range<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut DeviceBuffer<T>,
        range: Range<usize>,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        let ptr = buf.as_raw_mut_ptr();
        let buf: &'a DeviceBuffer<T> = buf;
        self.push::<T>(
            comm,
            buf.tracked(),
            buf.len(),
            ptr,
            range,
            peer,
            stream,
            Access::Write,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn push<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        tracked: &'a Tracked,
        len: usize,
        base: *mut T,
        range: Range<usize>,
        peer: usize,
        stream: &'a Stream,
        access: Access,
    ) -> Result<()> {
        comm.usable()?;
        let what = if access == Access::Read { "send" } else { "receive" };
        if peer >= comm.world {
            return Err(Error::InvalidArgument(format!(
                "{what} peer {peer} is out of range for a communicator of {} ranks",
                comm.world
            )));
        }
        if range.start > range.end || range.end > len {
            return Err(Error::InvalidArgument(format!(
                "{what} range {range:?} is outside a buffer of {len} elements"
            )));
        }
        stream.check_device(&comm.device, "the communicator")?;
        stream.check_tracked(tracked, access)?;
        if range.is_empty() {
            // Defined as a no-op on both sides: NCCL is not called and nothing is tracked.
            return Ok(());
        }
        // SAFETY: `range.start < len`, so the offset stays inside the allocation.
        let ptr = unsafe { base.add(range.start) }.cast::<c_void>();
        self.ops.push(Op {
            comm,
            stream,
            tracked,
            access,
            ptr,
            count: range.len(),
            dtype: T::DATATYPE,
            peer,
        });
        Ok(())
    }

    /// Each send to oneself needs a receive from oneself of the same count and type in the
    /// same group, or NCCL waits forever. NCCL matches the sends and receives between two ranks
    /// in the order they were issued, so the two sequences must be equal, in order. No
    /// allocation unless they differ.
    fn check_self_transfers(&self) -> Result<()> {
        let is_self = |o: &&Op<'_>| o.peer == o.comm.rank;
        for (i, first) in self.ops.iter().enumerate().filter(|(_, o)| is_self(o)) {
            if self.ops[..i]
                .iter()
                .any(|o| is_self(&o) && std::ptr::eq(o.comm, first.comm))
            {
                continue; // this communicator was checked at its first self operation
            }
            let side = |access: Access| {
                self.ops
                    .iter()
                    .filter(move |o| is_self(o) && std::ptr::eq(o.comm, first.comm) && o.access == access)
                    .map(|o| (o.count, o.dtype.0))
            };
            if !side(Access::Read).eq(side(Access::Write)) {
                return Err(Error::InvalidArgument(format!(
                    "sends to oneself {:?} and receives from oneself {:?}, as (count, NCCL type) \
                     in the order issued, must match one to one in the same group, or NCCL \
                     waits forever",
                    side(Access::Read).collect::<Vec<_>>(),
                    side(Access::Write).collect::<Vec<_>>()
                )));
            }
        }
        Ok(())
    }

    /// Checked mode (see [`crate::checked`]): swaps a header with every peer this group talks
    /// to, on communicators that have it on, and fails on both ranks if they disagree.
    fn exchange_checks(&self) -> Result<()> {
        use crate::checked::{Header, WORDS, compare};
        // (communicator, peer, stream, header), in first-use order.
        let mut pairs: Vec<(&Communicator, usize, &Stream, Header)> = Vec::new();
        for o in self
            .ops
            .iter()
            // Not with oneself: `check_self_transfers` has compared those completely, locally. (An
            // exchange with oneself worked on the H200, but its host wait also serialized every
            // group, which hid from the tracking tests the very overlaps they look for.)
            .filter(|o| o.comm.options.checked && o.peer != o.comm.rank)
        {
            let i = match pairs
                .iter()
                .position(|p| std::ptr::eq(p.0, o.comm) && p.1 == o.peer)
            {
                Some(i) => i,
                None => {
                    pairs.push((o.comm, o.peer, o.stream, Header::default()));
                    pairs.len() - 1
                }
            };
            let side = if o.access == Access::Read {
                &mut pairs[i].3.sends
            } else {
                &mut pairs[i].3.recvs
            };
            side.push(o.count as u64, o.dtype.0);
        }
        if pairs.is_empty() {
            return Ok(());
        }
        let mut bufs = Vec::with_capacity(pairs.len());
        for (_, _, stream, header) in &pairs {
            let out = DeviceBuffer::from_slice(stream, &header.encode())?;
            let inbox = DeviceBuffer::<u64>::zeros(stream, WORDS)?;
            bufs.push((out, inbox));
        }
        // The exchange is a group of its own, enqueued by the same steps as any other, so it is
        // tracked, waits for a non-blocking communicator to be ready before its events are
        // recorded, and aborts the communicators on failure.
        let mut exchange = Group {
            ops: Vec::with_capacity(2 * pairs.len()),
            _not_send: PhantomData,
        };
        for ((comm, peer, stream, _), (out, inbox)) in pairs.iter().zip(bufs.iter_mut()) {
            let header_op = |tracked, access, ptr| Op {
                comm,
                stream,
                tracked,
                access,
                ptr,
                count: WORDS,
                dtype: u64::DATATYPE,
                peer: *peer,
            };
            exchange.ops.push(header_op(
                out.tracked(),
                Access::Read,
                out.as_raw_ptr().cast_mut().cast(),
            ));
            let ptr = inbox.as_raw_mut_ptr().cast();
            exchange.ops.push(header_op(inbox.tracked(), Access::Write, ptr));
        }
        exchange.enqueue()?;
        let mut mismatches = Vec::new();
        for ((comm, peer, stream, mine), (_, inbox)) in pairs.iter().zip(&bufs) {
            // Bounded: a peer that never answers (dead, or without checked mode) is a timeout.
            comm.wait_stream(stream)?;
            let theirs =
                Header::decode(&inbox.to_vec(stream)?).map_err(|detail| Error::Mismatch { detail })?;
            if let Err(detail) = compare(comm.rank, *peer, mine, &theirs) {
                mismatches.push(detail);
            }
        }
        if mismatches.is_empty() {
            Ok(())
        } else {
            Err(Error::Mismatch {
                detail: mismatches.join("; "),
            })
        }
    }

    fn submit(self) -> Result<()> {
        if self.ops.is_empty() {
            return Ok(());
        }
        self.check_self_transfers()?;
        self.exchange_checks()?;
        self.enqueue()
    }

    /// Queues the operations, checked already: waits for conflicting uses, the NCCL group,
    /// readiness of non-blocking communicators, then the tracking events.
    fn enqueue(&self) -> Result<()> {
        // Distinct communicators, in first-use order (few: a linear scan is fine).
        let mut comms: Vec<&Communicator> = Vec::new();
        for op in &self.ops {
            op.comm.usable()?;
            if !comms.iter().any(|c| std::ptr::eq(*c, op.comm)) {
                comms.push(op.comm);
            }
        }
        // The device current on this thread; the runtime calls below act on it. Switched only
        // when an operation is on another device (each switch is a runtime call).
        let mut current: Option<usize> = None;
        let mut make_current = |d: &Device| -> Result<()> {
            if current != Some(d.ordinal()) {
                d.set_current()?;
                current = Some(d.ordinal());
            }
            Ok(())
        };
        // 1. Before the group: each stream waits for the conflicting earlier uses.
        for op in &self.ops {
            make_current(op.stream.device())?;
            op.stream.wait_for_conflicts(op.tracked, op.access)?;
        }
        // 2. The group. Nothing reaches a stream before ncclGroupEnd.
        let started = Instant::now();
        nc::group_start()?;
        let mut failed: Option<Error> = None;
        for op in &self.ops {
            let comm = op.comm.raw.get();
            // NCCL switches to each communicator's device itself.
            let issued = (|| {
                // SAFETY: `op` was checked when added: the pointer and count lie inside a
                // buffer of the communicator's device, borrowed for the group's lifetime 'a;
                // the peer is in range; the stream is live. Tracking makes the stream wait
                // for conflicting uses (step 1) and records this use (step 4).
                let rc = unsafe {
                    if op.access == Access::Read {
                        nc::send(
                            op.ptr,
                            op.count,
                            op.dtype,
                            op.peer as i32,
                            comm,
                            op.stream.as_raw(),
                        )
                    } else {
                        nc::recv(
                            op.ptr,
                            op.count,
                            op.dtype,
                            op.peer as i32,
                            comm,
                            op.stream.as_raw(),
                        )
                    }
                }?;
                if rc == ncclResult_t::ncclSuccess || rc == ncclResult_t::ncclInProgress {
                    Ok(())
                } else {
                    Err(nc::error(
                        if op.access == Access::Read {
                            "ncclSend"
                        } else {
                            "ncclRecv"
                        },
                        rc,
                    ))
                }
            })();
            if let Err(e) = issued {
                failed = Some(e);
                break;
            }
        }
        // Always close the group, even after an error.
        let in_progress = nc::group_end().unwrap_or_else(|e| {
            failed.get_or_insert(e);
            false
        });
        // 3. A non-blocking communicator may still be enqueueing: wait until it is ready.
        if failed.is_none() && in_progress {
            for c in &comms {
                // SAFETY: the communicator is live (checked above).
                if let Err(e) = unsafe { nc::wait_ready(c.raw.get(), "ncclGroupEnd", started, c.timeout()) } {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = &failed {
            for c in &comms {
                c.break_with(e);
            }
        }
        // 4. Only now record the events that track the transfers, even after an error: whatever
        // did reach a stream stays tracked. One event per communicator, on the first stream it
        // used: NCCL makes every stream of a group wait for the group's kernel ("it will behave
        // as if the NCCL group operation was posted on every stream", NCCL's CUDA stream
        // semantics), so that event completes only after all of the communicator's operations,
        // whichever stream each was on; and later work on each op's own stream is ordered
        // after it by that stream. Each use is recorded under its own stream. In reverse: the
        // thread is still on the last operation's device (NCCL restores it), so with one
        // communicator per device this switches devices once fewer.
        for c in comms.iter().rev() {
            let mine = || self.ops.iter().filter(|o| std::ptr::eq(o.comm, *c));
            let first = mine()
                .next()
                .expect("every listed communicator has an operation")
                .stream;
            make_current(first.device())?;
            match first.record_event() {
                Ok(event) => {
                    for o in mine() {
                        o.tracked.lock().record(o.stream.id(), o.access, event.clone());
                    }
                    c.note_last(first.id(), event);
                }
                Err(_) => {
                    // Untracked but queued: wait for it on the host instead.
                    for o in mine() {
                        o.stream.synchronize()?;
                    }
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips_through_bytes_and_text() {
        let mut bytes = [0u8; UniqueId::BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 37 % 256) as u8;
        }
        let id = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.as_bytes(), &bytes);
        let text = id.to_string();
        assert_eq!(text.len(), 256);
        assert_eq!(text.parse::<UniqueId>().unwrap(), id);
        // The raw NCCL form carries the same bytes.
        assert_eq!(id.raw().internal.map(|c| c as u8), bytes);
    }

    #[test]
    fn bad_unique_ids_are_typed_errors() {
        assert!(matches!(
            UniqueId::from_bytes(&[0; 127]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            UniqueId::from_bytes(&[0; 129]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            "abc".parse::<UniqueId>(),
            Err(Error::InvalidArgument(_))
        ));
        let not_hex = "zz".repeat(128);
        let e = not_hex.parse::<UniqueId>().unwrap_err().to_string();
        assert!(e.contains("non-hex"), "{e}");
    }

    #[test]
    fn world_and_rank_are_checked() {
        assert!(check_world_rank(1, 0).is_ok());
        assert!(matches!(check_world_rank(0, 0), Err(Error::InvalidArgument(_))));
        let e = check_world_rank(2, 2).unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("2 ranks"), "{e}");
    }

    #[test]
    fn datatypes_match_rust_sizes() {
        fn check<T: NcclType>() {
            assert_eq!(
                datatype_size(T::DATATYPE),
                std::mem::size_of::<T>(),
                "{}",
                T::NAME
            );
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<half::f16>();
        check::<f32>();
        check::<f64>();
        check::<half::bf16>();
    }
}
