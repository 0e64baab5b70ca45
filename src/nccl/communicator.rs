//! [`Communicator`]: one rank of an NCCL communicator, its creation (with the exchange that
//! settles verification), its bounded waits, and its end.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cuda::buffer::DeviceBuffer;
use crate::engine::device::{Device, Origin, PooledEvent};
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::engine::{self, Before, TrackedUse};
use crate::error::{Error, Result};
use crate::nccl::id::UniqueId;
use crate::nccl::options::CommOptions;
use crate::nccl::state::{Cut, GraphAborter, OpOrigin, PeersOrigin, Raw, Shared, State, abort};
use crate::nccl::types::NcclType;
use crate::nccl::verify::Mailboxes;
use crate::nccl::verify::mailbox::Region;
use crate::nccl::verify::setup::settle;
use crate::nccl::watchdog;
use crate::result::nccl as nc;
use crate::sys::nccl::{ncclComm_t, ncclResult_t};
use crate::trace;

/// One rank of an NCCL communicator, bound to one GPU.
///
/// # Verification
/// By default ([`CommOptions::default`]) every send and receive is verified before it reaches
/// NCCL: this rank and its peer each see the other's operation and compare element count and
/// type, in the order issued, so a disagreement is [`Error::Mismatch`] on both ranks and
/// nothing is transferred (see the crate's "Soundness" section). All ranks are created with
/// the same setting, checked at creation.
///
/// # Bounded
/// Every wait has a deadline ([`CommOptions::with_timeout`]): for a peer's counterpart, for
/// [`Communicator::synchronize`], [`Communicator::wait_stream`], finalizing. A watchdog thread
/// also watches the work this communicator queued: when an operation has not completed within
/// the timeout of being queued (a peer died after posting, or never runs its side), or NCCL
/// reports an error, it aborts the communicator (`ncclCommAbort`), which ends its kernels, so
/// that every host wait on a stream stuck behind it returns. The timeout therefore has to be
/// longer than the GPU work queued ahead of an operation on its stream. After an abort every
/// call returns [`Error::CommunicatorUnusable`].
///
/// Dropping it waits (up to the timeout) for the operations it queued, then finalizes and
/// destroys it, or aborts it: dropping never hangs on a peer.
/// [`Communicator::finalize`] does the same and reports errors.
///
/// # Threads
/// `Send` but not `Sync`: NCCL calls on one communicator must not run concurrently. Ranks made
/// together by [`Communicator::init_all`] are driven by one thread, and their operations with
/// each other go in one [`group`](crate::group); for one thread per GPU, make each rank with
/// [`Communicator::new`] on its own thread.
pub struct Communicator {
    pub(crate) shared: Arc<Shared>,
    device: Device,
    rank: usize,
    world: usize,
    options: CommOptions,
    /// The mailboxes of verification; `None` when unverified. Behind a lock that the
    /// gatekeeper ([`crate::nccl::gatekeeper`]) also takes, to check held groups.
    pub(crate) boxes: Option<Arc<Mutex<Mailboxes>>>,
    /// Identifies the ranks made together by one `init_all`.
    pub(crate) clique: Option<Arc<()>>,
    /// Given to a graph ([`crate::Graph::capture_with`]), which owns it from then on.
    pub(crate) in_graph: bool,
    /// For a [`crate::GraphFamily`]'s communicator: its graphs' operations, which each replay
    /// is verified against.
    pub(crate) family: std::cell::RefCell<Option<crate::nccl::verify::replay::Replays>>,
    /// The origin of the last operation's tracking event, and the peers it received from: a
    /// next operation with the same peers shares it (see [`Communicator::note_pending`]).
    last_origin: std::cell::RefCell<Option<PeersOrigin>>,
    /// NCCL calls on one communicator must not run concurrently: not `Sync`.
    _not_sync: PhantomData<Cell<()>>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device.ordinal())
            .field("options", &self.options)
            .field("broken", &self.broken_reason())
            .finish()
    }
}

impl Communicator {
    pub(super) fn wrap(
        raw: ncclComm_t,
        device: &Device,
        world: usize,
        rank: usize,
        options: CommOptions,
    ) -> Communicator {
        let state = State::new(raw, rank, options.timeout());
        let shared = Arc::new(Shared::new(state, rank, device.ordinal() as i32));
        Communicator {
            shared,
            device: device.clone(),
            rank,
            world,
            options,
            boxes: None,
            clique: None,
            in_graph: false,
            family: std::cell::RefCell::new(None),
            last_origin: std::cell::RefCell::new(None),
            _not_sync: PhantomData,
        }
    }

    /// Rank `rank` of a communicator of `world` ranks, on `device`, with default
    /// [`CommOptions`] (verified). Every rank calls this with the same `id`; it returns once all
    /// have joined and agreed on verification.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `world == 0` or `rank >= world`; NCCL errors (e.g. two
    /// ranks on one GPU); [`Error::Setup`] when the ranks disagree on verification, cannot
    /// reach each other's mailboxes, or set NCCL's tuning variables differently (those from
    /// which each rank alone decides how a transfer is cut into steps: `NCCL_PROTO`,
    /// `NCCL_P2P_*_CHUNKSIZE`, `NCCL_LOCAL_REGISTER` and the others the message lists, and
    /// [`CommOptions::with_cta_policy`]).
    pub fn new(world: usize, rank: usize, id: &UniqueId, device: &Device) -> Result<Communicator> {
        Self::with_options(world, rank, id, CommOptions::default(), device)
    }

    /// As [`Communicator::new`], with `options`. A non-blocking communicator fails with
    /// [`Error::Timeout`] when the other ranks do not join within the timeout; a blocking one
    /// waits for them as long as NCCL does.
    ///
    /// # Errors
    /// As [`Communicator::new`], and [`Error::Timeout`].
    pub fn with_options(
        world: usize,
        rank: usize,
        id: &UniqueId,
        options: CommOptions,
        device: &Device,
    ) -> Result<Communicator> {
        check_world_rank(world, rank)?;
        device.set_current()?;
        crate::nccl::options::note_nccl_environment();
        let started = Instant::now();
        let mut config = options.config();
        // SAFETY: the config comes from `config_initializer` with only `blocking` changed; no
        // raw group is open on this thread (`group_start` is unsafe, and requires its group be
        // closed before handoff's calls).
        let (raw, pending) =
            unsafe { nc::comm_init_rank(world as i32, &id.raw(), rank as i32, &mut config) }?;
        let mut comm = Communicator::wrap(raw, device, world, rank, options);
        comm.fail_on(watchdog::watch(&comm.shared))?;
        if pending {
            // SAFETY: `raw` is the communicator just created.
            let r = unsafe { nc::wait_ready(raw, "ncclCommInitRankConfig", started, options.timeout()) };
            comm.fail_on(r)?;
        }
        // How long NCCL took, apart from settling verification (read only for the event).
        #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
        let nccl_init = started.elapsed();
        let r = comm.settle_verification();
        comm.fail_on(r)?;
        trace::event!(
            info,
            rank,
            world,
            device = device.ordinal(),
            verified = comm.boxes.is_some(),
            blocking = options.blocking(),
            nccl_init = ?nccl_init,
            elapsed = ?started.elapsed(),
            "handoff: communicator created"
        );
        Ok(comm)
    }

    /// One communicator over all of `devices`, all in this process: rank `i` on `devices[i]`
    /// (what NCCL's `ncclCommInitAll` does), with default [`CommOptions`].
    ///
    /// The ranks are meant to be driven together by one thread: every send or receive between
    /// two of them goes in one [`group`](crate::group) with its counterpart (anything else is
    /// [`Error::InvalidArgument`] at once, where NCCL would wait forever for the other half).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no devices, or a device listed twice (NCCL refuses two
    /// ranks on one GPU); NCCL errors.
    pub fn init_all(devices: &[Device]) -> Result<Vec<Communicator>> {
        Self::init_all_with(CommOptions::default(), devices)
    }

    /// As [`Communicator::init_all`], with `options`.
    ///
    /// # Errors
    /// As [`Communicator::init_all`], and [`Error::Timeout`].
    pub fn init_all_with(options: CommOptions, devices: &[Device]) -> Result<Vec<Communicator>> {
        let world = devices.len();
        check_world_rank(world, 0)?;
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].iter().any(|e| e.same(d)) {
                return Err(Error::InvalidArgument(format!(
                    "device {} is listed twice: NCCL allows one rank per GPU in a process. To run \
                     several ranks on one GPU, make each rank a process of its own with \
                     HANDOFF_SHARE_GPUS=1 (nccl::bootstrap::spawn_local_with and \
                     GpuSharing::Always start them)",
                    d.ordinal()
                )));
            }
        }
        // Every device usable before the group: a rank that fails to join it would leave the
        // ranks queued before it waiting for it at `ncclGroupEnd`.
        for d in devices {
            d.set_current()?;
        }
        crate::nccl::options::note_nccl_environment();
        let id = UniqueId::new()?.raw();
        let started = Instant::now();
        let mut comms = Vec::with_capacity(world);
        // SAFETY: no raw group is open on this thread (see `with_options`); closed below.
        unsafe { nc::group_start() }?;
        let mut first_err = None;
        for (rank, device) in devices.iter().enumerate() {
            let mut config = options.config();
            // SAFETY: as in `with_options`; inside this group, ready after `group_end`.
            let made = device
                .set_current()
                .and_then(|()| unsafe { nc::comm_init_rank(world as i32, &id, rank as i32, &mut config) });
            match made {
                Ok((raw, _)) => {
                    let c = Communicator::wrap(raw, device, world, rank, options);
                    let watched = watchdog::watch(&c.shared);
                    comms.push(c);
                    if let Err(e) = watched {
                        first_err = Some(e);
                        break;
                    }
                }
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        // SAFETY: closes the group opened above, on this thread.
        if let Err(e) = unsafe { nc::group_end() } {
            first_err.get_or_insert(e);
        }
        for c in &comms {
            if first_err.is_some() {
                break;
            }
            let raw = c.shared.lock().raw;
            // SAFETY: each communicator was just created.
            if let Err(e) = unsafe { nc::wait_ready(raw, "ncclCommInitAll", started, options.timeout()) } {
                first_err = Some(e);
            }
        }
        if let Some(e) = first_err {
            for c in &comms {
                c.break_with(&e);
            }
            return Err(e);
        }
        form_clique(comms.iter_mut().collect());
        trace::with_tracing! {
            let elapsed = started.elapsed();
            for c in &comms {
                trace::event!(
                    info,
                    rank = c.rank,
                    world,
                    device = c.device.ordinal(),
                    verified = options.verified(),
                    blocking = options.blocking(),
                    nccl_init = ?elapsed,
                    elapsed = ?elapsed,
                    "handoff: communicator created (init_all)"
                );
            }
        }
        Ok(comms)
    }

    pub(super) fn attach(&mut self, regions: Arc<[Arc<Region>]>) {
        self.shared.lock().regions = Some(regions.clone());
        self.boxes = Some(Arc::new(Mutex::new(Mailboxes::new(self.rank, regions))));
    }

    /// Breaks the communicator on an error during creation.
    pub(super) fn fail_on<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.break_with(e);
        }
        r
    }

    /// Every rank tells every other, through NCCL, whether it verifies, where its mailbox is
    /// and where its verification channel listens; every pair of ranks then shares mailbox
    /// files where it can (one host) and connects through the channel otherwise (see
    /// `verify::setup`). Any disagreement or failure is an error on every rank, so no rank
    /// verifies alone (issue 9, hole 2: a verifying rank's checks would be read by an
    /// unverified one as payload).
    pub(super) fn settle_verification(&mut self) -> Result<()> {
        let (world, rank, verified) = (self.world, self.rank, self.options.verified());
        if world == 1 {
            if verified {
                self.attach(Arc::new([Arc::new(Region::in_process(1, 0))]));
            }
            return Ok(());
        }
        let timeout = self.options.timeout();
        let settled = settle(
            rank,
            world,
            verified,
            random_token(),
            timeout,
            self.options.cta_policy().map(|p| p.code()),
            &mut |w: &[u64]| self.all_gather_words(w),
        )?;
        if let Some(s) = settled {
            self.attach(s.regions);
        }
        Ok(())
    }

    /// `words` from every rank, in rank order, through `ncclAllGather` on an internal stream,
    /// waited for with the communicator's timeout.
    pub(crate) fn all_gather_words(&self, words: &[u64]) -> Result<Vec<u64>> {
        let stream = Stream::new(&self.device)?;
        let send = DeviceBuffer::from_slice(words, &stream)?;
        let mut all = DeviceBuffer::<u64>::zeros(words.len() * self.world, &stream)?;
        let (src, dst) = (send.as_raw_ptr().cast(), all.as_raw_mut_ptr().cast());
        let uses = [
            TrackedUse::on(&stream, send.tracked(), Access::Read),
            TrackedUse::on(&stream, all.tracked(), Access::Write),
        ];
        engine::check_devices(&uses)?;
        let mut due = false;
        let queued = engine::enqueue(
            &uses,
            engine::Work::Nccl {
                comms: &[self.key()],
                abort: Communicator::abort_by_key,
            },
            |_| {
                let mut state = self.shared.lock();
                let raw = usable(&state)?;
                // SAFETY: `src` holds `words.len()` u64 and `dst` world times that, on the
                // communicator's device, tracked as a read and a write; every rank gathers the
                // same count (the card's and the flag's fixed sizes); no raw group is open.
                let rc =
                    unsafe { nc::all_gather(src, dst, words.len(), u64::DATATYPE, raw, stream.as_raw()) }?;
                let r = if rc == ncclResult_t::ncclInProgress {
                    // SAFETY: `raw` is live.
                    unsafe { nc::wait_ready(raw, "ncclAllGather", Instant::now(), self.options.timeout()) }
                } else {
                    nc::check("ncclAllGather", rc)
                };
                if let Err(e) = &r {
                    state.break_with(e.to_string(), self.shared.ordinal, Cut::All);
                }
                r
            },
            |_, event, before| due |= self.note_pending(event, before, &[]),
        );
        if due {
            self.trim();
        }
        queued?;
        self.wait_stream(&stream)?;
        all.to_vec(&stream)
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

    /// The options the communicator was made with (the timeout as last set).
    pub fn options(&self) -> CommOptions {
        self.options
    }

    /// The deadline of every host-side wait on this communicator, and the watchdog's.
    pub fn timeout(&self) -> Duration {
        self.options.timeout()
    }

    /// Changes the deadline of later waits, of the watchdog, and of the finalize on drop.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.options = self.options.with_timeout(timeout);
        self.shared.lock().timeout = timeout;
    }

    /// The raw handle, for calling NCCL directly (null once aborted or finalized). Operations
    /// queued through it are neither tracked nor verified, and the watchdog may abort (and so
    /// free) the communicator at any time after an error or a missed deadline: using the handle
    /// is `unsafe` and on the caller.
    pub fn as_raw(&self) -> ncclComm_t {
        self.shared.lock().raw
    }

    /// Why the communicator is unusable, if it is.
    pub fn broken_reason(&self) -> Option<String> {
        self.shared.lock().broken.clone()
    }

    /// Blocks the host until every operation this communicator queued has completed on the GPU,
    /// watching NCCL's asynchronous error (`ncclCommGetAsyncError`) while it waits. On an error,
    /// or past the timeout, the communicator is aborted and the error returned.
    ///
    /// # Errors
    /// [`Error::Timeout`], NCCL's asynchronous error, CUDA errors; [`Error::CommunicatorUnusable`].
    pub fn synchronize(&self) -> Result<()> {
        let events: Vec<Arc<PooledEvent>> = {
            let state = self.shared.lock();
            usable(&state)?;
            state.pending.iter().map(|p| p.event.clone()).collect()
        };
        self.wait_for(&events, "queued sends and receives")
    }

    /// Blocks the host until all work queued so far on `stream` has completed, watching this
    /// communicator's asynchronous error while it waits; on an error, or past the timeout,
    /// aborts the communicator and returns the error. Use it instead of
    /// [`Stream::synchronize`] where a peer's failure must be reported as this communicator's.
    ///
    /// # Errors
    /// [`Error::Timeout`], NCCL's asynchronous error, CUDA errors; [`Error::CommunicatorUnusable`].
    pub fn wait_stream(&self, stream: &Stream) -> Result<()> {
        usable(&self.shared.lock())?;
        // The event must not be a node of a graph being captured: recorded under the stream's
        // order, outside any capture.
        let recorded = stream.outside_capture("waiting for a stream", || {
            stream.check_not_captured_elsewhere()?;
            stream.record_event()
        });
        if let Err(refused @ Error::Capture { .. }) = recorded {
            // Nothing queued: the communicator is fine.
            return Err(refused);
        }
        self.bounded(|| self.wait_events(&[recorded?], "the work queued on a stream"))
    }

    /// Waits, with the communicator's timeout, for `events` (recorded after its work); on an
    /// error, or past the timeout, aborts the communicator and returns the error.
    pub(crate) fn wait_for(&self, events: &[Arc<PooledEvent>], what: &str) -> Result<()> {
        self.bounded(|| self.wait_events(events, what))
    }

    /// Runs a wait; on its error, breaks the communicator.
    fn bounded(&self, wait: impl FnOnce() -> Result<()>) -> Result<()> {
        let r = wait();
        if let Err(e) = &r {
            self.break_with(e);
        }
        r
    }

    fn wait_events(&self, events: &[Arc<PooledEvent>], what: &str) -> Result<()> {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let mut idle = true;
            for e in events {
                // SAFETY: the event is kept alive by the Arc.
                idle &= unsafe { crate::result::cudart::event_query(e.raw) }?;
            }
            if idle {
                // A held group that failed completes too (its gate opens when it fails): the
                // failure is set before that.
                return match self.shared.gating.failed.get() {
                    Some(e) => Err(e.clone()),
                    None => Ok(()),
                };
            }
            {
                let state = self.shared.lock();
                let raw = usable(&state)?;
                // SAFETY: `raw` is live: not broken, and the lock is held.
                let rc = unsafe { nc::comm_state(raw) }?;
                if rc != ncclResult_t::ncclSuccess && rc != ncclResult_t::ncclInProgress {
                    return Err(nc::error("ncclCommGetAsyncError", rc));
                }
            }
            if started.elapsed() >= self.timeout() {
                return Err(Error::Timeout {
                    what: format!("rank {}'s wait for {what}", self.rank),
                    after: self.timeout(),
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
    /// later call returns [`Error::CommunicatorUnusable`]; peers waiting to verify against this
    /// rank fail at once. Buffers it used stay tracked, so they are still freed only after the
    /// aborted operations have left the GPU.
    ///
    /// # Errors
    /// None today; kept for NCCL's error from the abort.
    pub fn abort(&self) -> Result<()> {
        trace::event!(
            info,
            rank = self.rank,
            device = self.shared.ordinal,
            "handoff: communicator aborted by the program"
        );
        self.shared
            .break_with("aborted by the program".into(), Cut::Incomplete);
        Ok(())
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
        // Finalizing while operations are still queued would wait for them inside NCCL, with no
        // deadline for a blocking communicator: wait here first, with one.
        self.synchronize()?;
        self.device.set_current()?;
        let mut state = self.shared.lock();
        let raw = usable(&state)?;
        if raw.is_null() {
            return Ok(());
        }
        let started = Instant::now();
        // SAFETY: `raw` is live (non-null, not broken, lock held) and owned by self.
        let pending = unsafe { nc::comm_finalize(raw) }?;
        if pending {
            // SAFETY: as above.
            unsafe { nc::wait_ready(raw, "ncclCommFinalize", started, self.timeout()) }?;
        }
        state.raw = std::ptr::null_mut();
        state.broken = Some("finalized".into());
        // SAFETY: finalized; not used again (raw is now null).
        unsafe { nc::comm_destroy(raw) }
    }

    /// [`Error::CommunicatorUnusable`] once the communicator has been aborted.
    pub(crate) fn check_usable(&self) -> Result<()> {
        usable(&self.shared.lock()).map(drop)
    }

    /// Hands the communicator to a graph ([`crate::Graph::capture_with`]): from now on it works
    /// only inside that graph's capture, and an abort does not wait for the graph to go (it
    /// runs on a thread started here).
    ///
    /// Its eager work completes first (bounded, as [`Communicator::synchronize`]): NCCL orders
    /// eager work before a graph's launches only with its graph mixing support on
    /// (`NCCL_GRAPH_MIXING_SUPPORT`), and a warm-up transfer still running beside a first
    /// replay would share its connections.
    ///
    /// # Errors
    /// As [`Communicator::synchronize`]; [`Error::Capture`] if the thread cannot be started.
    pub(crate) fn give_to_graph(&mut self) -> Result<()> {
        self.synchronize()?;
        let (to, from) = std::sync::mpsc::channel::<Raw>();
        let ordinal = self.shared.ordinal;
        let thread = std::thread::Builder::new()
            .name("handoff-graph-abort".into())
            .spawn(move || {
                if let Ok(raw) = from.recv() {
                    abort(raw, ordinal);
                }
            })
            .map_err(|e| Error::Capture {
                detail: format!("could not start the thread that would abort the graph's communicator ({e})"),
            })?;
        self.shared.lock().graph_aborter = Some(GraphAborter {
            handle: Some(to),
            thread,
        });
        self.in_graph = true;
        Ok(())
    }

    /// [`Error::Capture`] for a communicator given to a graph, outside that graph's capture:
    /// it runs nothing but the graph's replays, so that every NCCL operation on it meets its
    /// verified counterpart (eager operations, splits included, are refused).
    pub(crate) fn check_not_in_graph(&self) -> Result<()> {
        if self.in_graph {
            return Err(crate::engine::capture_error(
                "this communicator belongs to a graph: it works only inside that graph's capture \
                 (use another communicator, e.g. split from the parent, for eager work)",
            ));
        }
        Ok(())
    }

    /// Identifies the communicator to registrations, the engine, graph capture and local
    /// verification: its state's id (`state::fresh_id`), never reused.
    pub(crate) fn key(&self) -> usize {
        self.shared.id
    }

    /// Aborts the communicator whose [`Communicator::key`] is `key`, if it is still alive, for
    /// `reason` (for the engine, which knows an operation's communicators by key only).
    pub(crate) fn abort_by_key(key: usize, reason: &str) {
        if let Some(shared) = watchdog::watched(key) {
            shared.break_with(reason.to_string(), Cut::All);
        }
    }

    /// Marks the communicator unusable because a held group failed with `e` (see
    /// [`crate::nccl::verify::held`]) and aborts it: every queued operation counts as cut short,
    /// since the gates open first.
    pub(crate) fn break_held(&self, e: &Error) {
        trace::event!(
            warn,
            rank = self.rank,
            device = self.shared.ordinal,
            reason = %e,
            "handoff: communicator aborted: a held group failed its check"
        );
        self.shared.break_with(e.to_string(), Cut::All);
    }

    /// Marks the communicator unusable because of `e` and aborts it.
    pub(crate) fn break_with(&self, e: &Error) {
        trace::event!(
            warn,
            rank = self.rank,
            device = self.shared.ordinal,
            timeout = matches!(e, Error::Timeout { .. }),
            reason = %e,
            "handoff: communicator aborted on an error"
        );
        self.shared.break_with(e.to_string(), Cut::Incomplete);
    }

    /// Remembers `event`, recorded after this communicator's latest work on some stream, which
    /// ran `before` first and received from `peers`, for [`Communicator::synchronize`], the
    /// watchdog and host reads.
    ///
    /// Returns whether the queue is due to be trimmed ([`Communicator::trim`], once the
    /// operation is queued and the engine's locks let go of).
    pub(crate) fn note_pending(&self, event: &Arc<PooledEvent>, before: Before, peers: &[usize]) -> bool {
        // The same peers as the last time (an application's steady state): the same origin.
        let mut last = self.last_origin.borrow_mut();
        let origin = match last.as_ref() {
            // Lengths first: mostly no peer or one, where a memory comparison costs more.
            Some((p, o)) if p.len() == peers.len() && p.iter().zip(peers).all(|(a, b)| a == b) => o.clone(),
            _ => {
                let o = self.origin(peers.to_vec());
                *last = Some((peers.to_vec(), o.clone()));
                o
            }
        };
        drop(last);
        self.note_pending_from(event, before, &origin)
    }

    /// What a tracking event after work of this communicator receiving from `peers` asks, at a
    /// host read, whether that work was cut short: made once and shared by every such event
    /// (a graph's replays).
    pub(crate) fn origin(&self, peers: Vec<usize>) -> Arc<dyn Origin> {
        Arc::new(OpOrigin {
            shared: Arc::downgrade(&self.shared),
            peers,
        })
    }

    /// [`Communicator::note_pending`] with the event's origin made already.
    pub(crate) fn note_pending_from(
        &self,
        event: &Arc<PooledEvent>,
        before: Before,
        origin: &Arc<dyn Origin>,
    ) -> bool {
        event.set_origin(origin);
        let mut state = self.shared.lock();
        if let Some(reason) = &state.broken {
            // Broken between posting and now: the work may have been cut short.
            event.poison(reason);
            return false;
        }
        let seq = state.push_pending(event.clone(), before);
        watchdog::trim_due(seq, state.pending.len())
    }

    /// Drops what has completed from the queue (see `watchdog::trim`): called with no lock
    /// held, after an operation whose [`Communicator::note_pending`] said it was due.
    pub(crate) fn trim(&self) {
        watchdog::trim(&self.shared);
    }
}

/// Makes `members`, every rank of one communicator, all in this process and made with one
/// setting, the ranks one thread drives together (see [`Communicator::init_all`]); verified,
/// their mailboxes are plain memory, indexed by rank.
pub(super) fn form_clique(members: Vec<&mut Communicator>) {
    let world = members.len();
    let clique = Arc::new(());
    let regions: Arc<[Arc<Region>]> = (0..world)
        .map(|r| Arc::new(Region::in_process(world, r)))
        .collect();
    for c in members {
        c.clique = Some(clique.clone());
        if c.options.verified() {
            c.attach(regions.clone());
        }
    }
}

/// The live handle, or why there is none.
pub(crate) fn usable(state: &State) -> Result<ncclComm_t> {
    if let Some(reason) = watchdog::dead() {
        // Without the watchdog, nothing would bound a wait behind this communicator's work.
        return Err(Error::CommunicatorUnusable {
            reason: reason.to_string(),
        });
    }
    if let Some(e) = state.gating.failed.get() {
        // A held group failed after its call returned: every later call says why, as that
        // call would have.
        return Err(e.clone());
    }
    match &state.broken {
        Some(reason) => Err(Error::CommunicatorUnusable {
            reason: reason.clone(),
        }),
        None => Ok(state.raw),
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let live = {
            let state = self.shared.lock();
            state.broken.is_none() && !state.raw.is_null()
        };
        if live && self.finalize_raw().is_err() {
            self.break_with(&Error::CommunicatorUnusable {
                reason: "dropped while its work did not complete".into(),
            });
        }
        // A graph's communicator: its aborter ends once it has aborted it (which ends once the
        // graph, dropped before its communicator, is gone) or, never handed the handle, once
        // the channel closes. Wait for it, so that no NCCL call on the communicator is left
        // running behind its owner (at process exit, say).
        let aborter = self.shared.lock().graph_aborter.take();
        if let Some(mut a) = aborter {
            drop(a.handle.take());
            let _ = a.thread.join();
        }
        // Likewise an abort that a failure handed to a thread of its own.
        let aborting = self.shared.lock().aborting.take();
        if let Some(t) = aborting {
            let _ = t.join();
        }
    }
}

pub(crate) fn check_world_rank(world: usize, rank: usize) -> Result<()> {
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

/// A value no other communicator of this host is likely to pick: the mailbox token.
fn random_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn world_and_rank_are_checked() {
        assert!(check_world_rank(1, 0).is_ok());
        assert!(matches!(check_world_rank(0, 0), Err(Error::InvalidArgument(_))));
        let e = check_world_rank(2, 2).unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("2 ranks"), "{e}");
    }

    #[test]
    fn tokens_differ() {
        assert_ne!(random_token(), random_token());
    }
}
