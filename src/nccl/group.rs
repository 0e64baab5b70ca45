//! [`group`]: sends, receives and collectives collected by a closure, checked, verified, and
//! queued as one NCCL group through the crate's one tracked path.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::MutexGuard;
use std::time::Instant;

use smallvec::{SmallVec, smallvec};

use crate::cuda::view::{View, ViewMut};
use crate::engine::gate::Gate;
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::engine::{self, Tracked, TrackedUse};
use crate::error::{Error, Result};
use crate::nccl::communicator::{Communicator, usable};
use crate::nccl::fp8::{self, Use};
use crate::nccl::gatekeeper;
use crate::nccl::options;
use crate::nccl::state::{Cut, State};
use crate::nccl::types::NcclType;
use crate::nccl::verify::held::{self, Held, Verdict};
use crate::nccl::verify::local::{self, LocalRank};
use crate::nccl::verify::model::{self, Call};
use crate::nccl::verify::order;
use crate::nccl::verify::wire::{CollDesc, CollKind, Dir, NCCL_MEMORY, OpDesc, P2P, REGISTERED};
use crate::nccl::verify::{self, CollOps, Failure, Mailboxes, PairOps, Wait};
use crate::result::nccl as nc;
use crate::sys::nccl::{ncclDataType_t, ncclResult_t};

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

/// One collective, checked and waiting for [`Group`] to submit it.
pub(crate) struct CollOp<'a> {
    pub(crate) comm: &'a Communicator,
    pub(crate) stream: &'a Stream,
    pub(crate) desc: CollDesc,
    pub(crate) dtype: ncclDataType_t,
    /// The input, read; `None` in place (the output is then the input too).
    pub(crate) send: Option<(&'a Tracked, *const c_void)>,
    /// The output, written.
    pub(crate) recv: (&'a Tracked, *mut c_void),
    /// PreMulSum's scalar, this rank's, as bytes of the element type (at most 8).
    pub(crate) scalar: Option<[u8; 8]>,
}

impl CollOp<'_> {
    /// The call to NCCL.
    ///
    /// # Safety
    /// As the `result::nccl` function it calls: the op was checked when added (sizes, root, the
    /// buffers on the communicator's device and borrowed for the group), every rank posts the
    /// same collective in the same place in its order (verified, or promised by
    /// `CommOptions::unverified`), and tracking orders the buffers' other uses around it.
    /// `op` replaces the description's reduction (PreMulSum's operator, made for this call).
    unsafe fn issue(
        &self,
        comm: crate::sys::nccl::ncclComm_t,
        op: Option<crate::sys::nccl::ncclRedOp_t>,
    ) -> Result<ncclResult_t> {
        let recv = self.recv.1;
        let send = self.send.map_or(recv.cast_const(), |s| s.1);
        let (count, dtype, s) = (self.desc.count as usize, self.dtype, self.stream.as_raw());
        // PRE_MUL_SUM is handoff's wire code, never NCCL's: it needs the operator made for it.
        let op = match op {
            Some(op) => op,
            None if self.desc.redop == crate::nccl::verify::wire::PRE_MUL_SUM => {
                return Err(Error::InvalidArgument(
                    "internal: a PreMulSum collective without its operator (a bug in handoff)".into(),
                ));
            }
            None => crate::sys::nccl::ncclRedOp_t(self.desc.redop),
        };
        let root = self.desc.root as i32;
        // SAFETY: this function's contract.
        unsafe {
            match self.desc.kind {
                CollKind::AllReduce => nc::all_reduce(send, recv, count, dtype, op, comm, s),
                CollKind::Broadcast => nc::broadcast(send, recv, count, dtype, root, comm, s),
                CollKind::Reduce => nc::reduce(send, recv, count, dtype, op, root, comm, s),
                CollKind::AllGather => nc::all_gather(send, recv, count, dtype, comm, s),
                CollKind::ReduceScatter => nc::reduce_scatter(send, recv, count, dtype, op, comm, s),
                CollKind::AllToAll => nc::all_to_all(send, recv, count, dtype, comm, s),
                CollKind::Gather => nc::gather(send, recv, count, dtype, root, comm, s),
                CollKind::Scatter => nc::scatter(send, recv, count, dtype, root, comm, s),
                // Verification's alone: no collective is made with it.
                CollKind::Replay => Err(Error::InvalidArgument(
                    "internal: a graph replay's description posted as a collective (a bug in handoff)".into(),
                )),
            }
        }
    }

    fn call_name(&self) -> &'static str {
        match self.desc.kind {
            CollKind::AllReduce => "ncclAllReduce",
            CollKind::Broadcast => "ncclBroadcast",
            CollKind::Reduce => "ncclReduce",
            CollKind::AllGather => "ncclAllGather",
            CollKind::ReduceScatter => "ncclReduceScatter",
            CollKind::AllToAll => "ncclAlltoAll",
            CollKind::Gather => "ncclGather",
            CollKind::Scatter => "ncclScatter",
            CollKind::Replay => "cudaGraphLaunch",
        }
    }
}

impl Op<'_> {
    fn call(&self) -> Call {
        Call::P2p {
            peer: self.peer,
            dir: if self.access == Access::Read {
                Dir::Send
            } else {
                Dir::Recv
            },
            desc: OpDesc {
                count: self.count as u64,
                dtype: self.dtype.0,
                captured: self.comm.in_graph,
                nccl_memory: memory_flags(self.comm, self.tracked, self.peer),
                part: P2P,
            },
        }
    }
}

/// One send or receive NCCL will queue: `(communicator, peer, direction, description)`.
pub(crate) type Queued<'a> = local::Queued<&'a Communicator>;

impl LocalRank for &Communicator {
    fn rank(self) -> usize {
        Communicator::rank(self)
    }
    fn world(self) -> usize {
        self.world_size()
    }
    fn key(self) -> usize {
        Communicator::key(self)
    }
    fn drives_all(self) -> bool {
        self.clique.is_some()
    }
    fn is_rank(self, other: Self, peer: usize) -> bool {
        if peer == Communicator::rank(self) {
            return std::ptr::eq(self, other);
        }
        Communicator::rank(other) == peer
            && matches!((&self.clique, &other.clique), (Some(a), Some(b)) if std::sync::Arc::ptr_eq(a, b))
    }
}

impl Communicator {
    /// Whether this thread drives rank `peer` too: itself, or a rank of the same `init_all`.
    fn drives(&self, peer: usize) -> bool {
        peer == self.rank() || self.clique.is_some()
    }
}

/// What NCCL's registered send/receive path depends on for `tracked`'s memory moved by `comm`
/// with `peer` (see `wire::NCCL_MEMORY` and `wire::REGISTERED`): nothing with oneself, which
/// NCCL never registers (`!selfSend`).
pub(crate) fn memory_flags(comm: &Communicator, tracked: &Tracked, peer: usize) -> u8 {
    if peer == comm.rank() {
        return 0;
    }
    let captured = if comm.in_graph && tracked.nccl_memory {
        NCCL_MEMORY
    } else {
        0
    };
    let registered = if tracked.is_registered_with(comm.key()) {
        REGISTERED
    } else {
        0
    };
    captured | registered
}

/// One call of a group, in the order the closure made them: the order [`Group`] posts them in,
/// which is the order NCCL matches their per-peer parts in (see [`model`]).
#[derive(Clone, Copy)]
enum Posted {
    P2p(usize),
    Coll(usize),
}

/// Sends, receives and collectives queued together (`ncclGroupStart` … `ncclGroupEnd`), made
/// with [`group`]; the collectives are in [`crate::nccl`]'s collective methods
/// ([`Group::all_reduce`] and the others).
///
/// Each call checks its arguments at once; nothing reaches NCCL until the closure given to
/// [`group`] returns `Ok`, so a group is never left open and an error inside the closure
/// submits nothing. Operations may span several communicators (several GPUs of this process)
/// and streams.
pub struct Group<'a> {
    ops: SmallVec<[Op<'a>; 2]>,
    pub(crate) colls: SmallVec<[CollOp<'a>; 2]>,
    order: SmallVec<[Posted; 4]>,
    /// The group's communicators, each once in first-use order, with the stream of its first
    /// operation (where its tracking event is recorded): noted as operations are added.
    firsts: SmallVec<[(&'a Communicator, &'a Stream); 2]>,
    /// NCCL's group state is per thread.
    _not_send: PhantomData<*const ()>,
}

/// Runs `f` to collect sends, receives and collectives, then submits them as one NCCL group.
///
/// A send to oneself and its receive must be in one group; so must every send or receive
/// between ranks made together by [`Communicator::init_all`] and its counterpart.
///
/// ```no_run
/// # fn main() -> handoff::Result<()> {
/// use handoff::{group, Communicator, Device, DeviceBuffer, Stream};
/// let gpu = Device::new(0)?;
/// let comm = &Communicator::init_all(&[gpu.clone()])?[0];
/// let stream = Stream::new(&gpu)?;
/// let x = DeviceBuffer::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &stream)?;
/// let mut y = DeviceBuffer::<f32>::zeros(4, &stream)?;
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
/// `f`'s error (nothing submitted); [`Error::InvalidArgument`] for a send to oneself, or
/// between ranks of one `init_all`, without its counterpart in the group (nothing submitted,
/// the communicators stay usable); [`Error::Mismatch`], [`Error::Timeout`],
/// [`Error::PeerBroken`] from verification, NCCL errors: the communicators involved are then
/// aborted.
pub fn group<'a, R>(f: impl FnOnce(&mut Group<'a>) -> Result<R>) -> Result<R> {
    let mut g = Group {
        ops: SmallVec::new(),
        colls: SmallVec::new(),
        order: SmallVec::new(),
        firsts: SmallVec::new(),
        _not_send: PhantomData,
    };
    let out = f(&mut g)?;
    g.submit()?;
    Ok(out)
}

impl<'a> Group<'a> {
    /// Adds a send of `buf` (a buffer or a [`View`] of part of one); see
    /// [`Communicator::send`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]; [`Error::CommunicatorUnusable`].
    pub fn send<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: impl Into<View<'a, T>>,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        let v = buf.into();
        self.push::<T>(
            comm,
            v.tracked(),
            v.as_raw_ptr().cast_mut(),
            v.len(),
            peer,
            stream,
            Access::Read,
        )
    }

    /// Adds a receive into `buf` (a buffer or a [`ViewMut`] of part of one); see
    /// [`Communicator::recv`].
    ///
    /// # Errors
    /// As [`Group::send`].
    pub fn recv<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: impl Into<ViewMut<'a, T>>,
        peer: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        let mut v = buf.into();
        self.push::<T>(
            comm,
            v.tracked(),
            v.as_raw_mut_ptr(),
            v.len(),
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
        ptr: *mut T,
        count: usize,
        peer: usize,
        stream: &'a Stream,
        access: Access,
    ) -> Result<()> {
        usable(&comm.shared.lock())?;
        let what = if access == Access::Read { "send" } else { "receive" };
        if peer >= comm.world_size() {
            return Err(Error::InvalidArgument(format!(
                "{what} peer {peer} is out of range for a communicator of {} ranks",
                comm.world_size()
            )));
        }
        stream.check_device(comm.device(), "the communicator")?;
        stream.check_tracked(tracked, access)?;
        if count == 0 {
            // Defined as a no-op on both sides: NCCL is not called and nothing is tracked.
            return Ok(());
        }
        self.note(comm, stream);
        self.order.push(Posted::P2p(self.ops.len()));
        self.ops.push(Op {
            comm,
            stream,
            tracked,
            access,
            ptr: ptr.cast::<c_void>(),
            count,
            dtype: T::DATATYPE,
            peer,
        });
        Ok(())
    }

    /// Adds a checked collective.
    pub(crate) fn push_coll(&mut self, op: CollOp<'a>) {
        self.note(op.comm, op.stream);
        self.order.push(Posted::Coll(self.colls.len()));
        self.colls.push(op);
    }

    /// Every operation's communicator and stream, in call order.
    fn all(&self) -> impl Iterator<Item = (&'a Communicator, &'a Stream)> + '_ {
        self.order.iter().map(|p| match *p {
            Posted::P2p(i) => (self.ops[i].comm, self.ops[i].stream),
            Posted::Coll(i) => (self.colls[i].comm, self.colls[i].stream),
        })
    }

    /// Every send and receive NCCL will queue for this group, its collectives' per-peer parts
    /// included, in NCCL's order.
    fn queued(&self, queued: &mut SmallVec<[Queued<'a>; 8]>) {
        // Pushed one by one, into the caller's list: a short list, where collecting a flattened
        // iterator, or returning the list, costs more.
        for p in &self.order {
            let (comm, call) = match *p {
                Posted::P2p(i) => (self.ops[i].comm, self.ops[i].call()),
                Posted::Coll(i) => (self.colls[i].comm, Call::Coll(self.colls[i].desc)),
            };
            for (peer, dir, d) in model::expand(call, comm.rank(), comm.world_size()) {
                queued.push((comm, peer, dir, d));
            }
        }
    }

    /// Graph capture, checked before anything is verified or posted: a communicator given to
    /// [`crate::Graph::capture_with`] works only on the stream being captured (its operations
    /// then run at each replay, in the graph's order, and nowhere else), and no other
    /// communicator's operation is captured (the engine refuses it too); PreMulSum's operator
    /// does not outlive the group, so it is not captured.
    fn check_capture(&self) -> Result<()> {
        let mut captured_on: Option<&Stream> = None;
        for (c, s) in self.all() {
            match s.order().hold().capture.as_ref() {
                Some(capture) => {
                    capture.admit(
                        false,
                        engine::Work::Nccl {
                            comms: &[c.key()],
                            abort: Communicator::abort_by_key,
                        },
                    )?;
                    captured_on.get_or_insert(s);
                }
                None => c.check_not_in_graph()?,
            }
        }
        let Some(captured_on) = captured_on else {
            return Ok(());
        };
        if self.all().any(|(_, s)| !engine::same_capture(s, captured_on)) {
            return Err(engine::capture_error(engine::SPANNING));
        }
        if self.colls.iter().any(|o| o.scalar.is_some()) {
            return Err(engine::capture_error(
                "a PreMulSum collective cannot be captured (its operator is made and destroyed \
                 around each group): use Sum on pre-scaled input",
            ));
        }
        Ok(())
    }

    /// Element types the loaded NCCL or the GPU would refuse (fp8: see [`types`]), before
    /// anything is verified or posted: the communicators stay usable.
    fn check_types(&self) -> Result<()> {
        for o in &self.ops {
            fp8::check_use(o.comm, o.dtype, Use::Move)?;
        }
        for c in &self.colls {
            fp8::check_use(c.comm, c.dtype, Use::of(c.desc.kind, c.desc.count, c.desc.redop))?;
        }
        Ok(())
    }

    /// Notes an operation's communicator and stream in [`Group::firsts`] (few: a linear scan).
    fn note(&mut self, comm: &'a Communicator, stream: &'a Stream) {
        if !self.firsts.iter().any(|(c, _)| std::ptr::eq(*c, comm)) {
            self.firsts.push((comm, stream));
        }
    }

    /// The stream of `comm`'s first operation: where its tracking event is recorded.
    fn first_stream(&self, comm: &Communicator) -> &'a Stream {
        self.firsts
            .iter()
            .find(|(c, _)| std::ptr::eq(*c, comm))
            .expect("a communicator of the group")
            .1
    }

    /// The communicators of the group, each once, in first-use order.
    fn comms(&self) -> impl Iterator<Item = &'a Communicator> + '_ {
        self.firsts.iter().map(|(c, _)| *c)
    }

    /// Refuses a group in which NCCL may pick a collective's algorithm by how this rank laid out
    /// its registered memory ([`order::layout_dependent_merge`]), where NCCL's settings let it
    /// ([`options::algorithm_may_follow_layout`]): verification compares what each rank
    /// posts, not that layout, so two ranks could run equal, verified groups differently.
    fn check_layout_choice(&self) -> Result<()> {
        for c in self.comms() {
            let descs: SmallVec<[CollDesc; 4]> = self
                .colls
                .iter()
                .filter(|o| std::ptr::eq(o.comm, c))
                .map(|o| o.desc)
                .collect();
            let Some(d) = order::layout_dependent_merge(&descs) else {
                continue;
            };
            if options::algorithm_may_follow_layout(&c.options()) {
                return Err(Error::InvalidArgument(format!(
                    "this group holds {} beside another collective of its kind and type: NCCL \
                     may merge them and, under the efficiency CTA policy or a tuner \
                     plugin with NVLS on, choose the merge's algorithm by whether one \
                     registration covers it, which differs between ranks whose buffers are laid \
                     out differently and which verification cannot compare. Post each such \
                     collective in a group of its own, or set NCCL_NVLS_ENABLE=0",
                    d.describe()
                )));
            }
        }
        Ok(())
    }

    /// Operations whose counterpart must be in this group (sends to oneself, and anything
    /// between ranks of one `init_all`, which one thread drives), collectives' parts included,
    /// matched here, before anything is published or posted, whether or not the communicator
    /// verifies (see [`local`]); verification leaves them out.
    fn check_local(&self, queued: &[Queued<'a>]) -> Result<()> {
        let members: SmallVec<[&'a Communicator; 2]> = self.comms().collect();
        local::match_pairs(&members, queued).map_err(Error::InvalidArgument)?;
        if self.colls.iter().any(|o| o.comm.clique.is_some()) {
            let colls: SmallVec<[_; 4]> = self.colls.iter().map(|o| (o.comm, o.desc)).collect();
            local::match_collectives(&members, &colls).map_err(Error::InvalidArgument)?;
        }
        Ok(())
    }

    /// Verification of the group's operations ([`verify_ops`]), which may be held.
    fn verify(&self, comms: &[&'a Communicator], queued: &[Queued<'a>]) -> Result<Option<Hold<'a>>> {
        let colls: SmallVec<[(&'a Communicator, CollDesc); 4]> =
            self.colls.iter().map(|o| (o.comm, o.desc)).collect();
        verify_ops(comms, queued, &colls, true)
    }

    fn submit(&self) -> Result<()> {
        if self.ops.is_empty() && self.colls.is_empty() {
            return Ok(());
        }
        let mut comms: SmallVec<[&'a Communicator; 2]> = SmallVec::new();
        for c in self.comms() {
            comms.push(c);
        }
        self.check_types()?;
        self.check_capture()?;
        // What NCCL will queue, expanded once for the checks and verification.
        let mut queued = SmallVec::new();
        self.queued(&mut queued);
        self.check_local(&queued)?;
        self.check_layout_choice()?;
        let hold = self.verify(&comms, &queued)?;
        // Verified: each operation is now in the peers' order. From here until NCCL has the
        // group, any failure (or panic) must break every communicator of the group, or their
        // next operations would be matched, verified, against the wrong peer operations.
        let guard = BreakUnlessPosted {
            comms: &comms,
            posted: false,
        };
        // A family's capture: what each of its replays is verified against.
        for c in comms.iter().filter(|c| c.in_graph) {
            if let Some(f) = c.family.borrow_mut().as_mut() {
                let p2p = queued
                    .iter()
                    .filter(|(d, ..)| std::ptr::eq(*d, *c))
                    .map(|&(_, peer, dir, desc)| (peer, dir, desc));
                let colls = self
                    .colls
                    .iter()
                    .filter(|o| std::ptr::eq(o.comm, *c))
                    .map(|o| o.desc);
                f.note(c.rank(), p2p, colls);
            }
        }
        // One tracking event per communicator, on its first stream: see the engine.
        let use_of =
            |comm: &Communicator, stream: &'a Stream, tracked: &'a Tracked, access: Access| TrackedUse {
                stream,
                tracked,
                access,
                record: self.first_stream(comm),
            };
        let mut uses: SmallVec<[TrackedUse<'_>; 4]> = SmallVec::new();
        for o in &self.ops {
            uses.push(use_of(o.comm, o.stream, o.tracked, o.access));
        }
        for c in &self.colls {
            if let Some((t, _)) = c.send {
                uses.push(use_of(c.comm, c.stream, t, Access::Read));
            }
            uses.push(use_of(c.comm, c.stream, c.recv.0, Access::Write));
        }
        let mut keys: SmallVec<[usize; 2]> = SmallVec::new();
        for c in &comms {
            keys.push(c.key());
        }
        // The communicators whose queues are due to be trimmed, once the engine has let go.
        let mut due: SmallVec<[&'a Communicator; 2]> = SmallVec::new();
        let r = engine::enqueue(
            &uses,
            engine::Work::Nccl {
                comms: &keys,
                abort: Communicator::abort_by_key,
            },
            |_| self.post(&comms, hold.as_ref().map(|h| h.comm)),
            |stream, event, mut before| {
                // The communicators whose events are recorded on this stream, and the peers
                // each receives from; the list of what ran before goes to the last of them.
                let here = || {
                    self.firsts
                        .iter()
                        .filter(move |(_, s)| std::ptr::eq(*s, stream))
                        .map(|(c, _)| *c)
                };
                let mut left = here().count();
                for c in here() {
                    left -= 1;
                    let before = if left == 0 {
                        std::mem::take(&mut before)
                    } else {
                        before.clone()
                    };
                    let mut peers: SmallVec<[usize; 8]> = SmallVec::new();
                    for o in &self.ops {
                        if std::ptr::eq(o.comm, c) && o.access == Access::Write {
                            peers.push(o.peer);
                        }
                    }
                    // A collective's output depends on every other rank.
                    if self.colls.iter().any(|o| std::ptr::eq(o.comm, c)) {
                        for r in (0..c.world_size()).filter(|&r| r != c.rank()) {
                            peers.push(r);
                        }
                    }
                    if c.note_pending(event, before, &peers) {
                        due.push(c);
                    }
                }
            },
        );
        let r = guard.done(r.and_then(|ticket| match (hold, ticket) {
            (Some(h), Some(ticket)) => {
                h.queue(ticket);
                Ok(())
            }
            (None, _) => Ok(()),
            // Never: a held group's communicator has its gate. Its checks cannot be skipped.
            (Some(_), None) => Err(Error::CommunicatorUnusable {
                reason: "a held group was posted without its gate".into(),
            }),
        }));
        for c in due {
            c.trim();
        }
        r
    }
}

/// Verification (on communicators that have it) of `queued` sends and receives and the
/// collectives `coll_descs`: every operation published to its peer, and its counterpart seen
/// and compared, before anything reaches NCCL; or, with `may_hold`, where a peer has not posted
/// yet and the operations [`held::may_hold`], published and left to check later, behind a gate
/// (the returned [`Hold`]). A failure breaks every communicator of `comms`.
pub(crate) fn verify_ops<'a>(
    comms: &[&'a Communicator],
    queued: &[Queued<'a>],
    coll_descs: &[(&'a Communicator, CollDesc)],
    may_hold: bool,
) -> Result<Option<Hold<'a>>> {
    let mut locked: SmallVec<[(&'a Communicator, MutexGuard<'a, Mailboxes>); 2]> = SmallVec::new();
    let mut order: SmallVec<[&'a Communicator; 2]> = comms.iter().copied().collect();
    order.sort_by_key(|c| c.key());
    for c in order {
        if let Some(b) = &c.boxes {
            locked.push((c, b.lock().unwrap_or_else(|p| p.into_inner())));
        }
    }
    for (c, boxes) in &locked {
        if let Some(e) = c.shared.gating.failed.get() {
            // A held group failed after its call returned: this communicator verifies
            // nothing more (its counters stop at that group). Break it, if the gatekeeper
            // could not yet.
            c.break_held(e);
            return Err(e.clone());
        }
        if boxes.holding() {
            settle(c, boxes, Wait::Publish)?;
        }
    }
    let boxes_of = |c: &Communicator| {
        locked
            .iter()
            .find(|(d, _)| std::ptr::eq(*d, c))
            .map(|(_, b)| &**b)
    };
    let mut pairs: SmallVec<[PairOps<'_>; 2]> = SmallVec::new();
    for &(comm, peer, dir, desc) in queued {
        // Local operations are matched already, within the group (`check_local`).
        let Some(boxes) = boxes_of(comm).filter(|_| !comm.drives(peer)) else {
            continue;
        };
        let i = match pairs
            .iter()
            .position(|p| std::ptr::eq(p.boxes, boxes) && p.peer == peer)
        {
            Some(i) => i,
            None => {
                pairs.push(PairOps {
                    boxes,
                    peer,
                    sends: SmallVec::new(),
                    recvs: SmallVec::new(),
                    timeout: comm.timeout(),
                });
                pairs.len() - 1
            }
        };
        let side = if dir == Dir::Send {
            &mut pairs[i].sends
        } else {
            &mut pairs[i].recvs
        };
        side.push(desc);
    }
    let mut colls: SmallVec<[CollOps<'_>; 1]> = SmallVec::new();
    for &(comm, desc) in coll_descs {
        let Some(boxes) = boxes_of(comm).filter(|_| comm.clique.is_none()) else {
            continue;
        };
        match colls.iter_mut().find(|c| std::ptr::eq(c.boxes, boxes)) {
            Some(c) => c.ops.push(desc),
            None => colls.push(CollOps {
                boxes,
                ops: smallvec![desc],
                timeout: comm.timeout(),
            }),
        }
    }
    if pairs.is_empty() && colls.is_empty() {
        return Ok(None);
    }
    let posted = |pairs: &[PairOps<'_>], colls: &[CollOps<'_>]| {
        for (_, boxes) in &locked {
            boxes.note_posted(pairs, colls);
        }
    };
    let fail = |f: Failure| {
        let e = f.into_error(comms.iter().map(|c| c.timeout()).min().unwrap_or_default());
        // What this group published can no longer be matched in order: every communicator
        // of the group stops here, and tells its peers.
        for c in comms {
            c.break_with(&e);
        }
        e
    };
    if let [(comm, boxes)] = locked.as_slice()
        && may_hold
        && comms.len() == 1
        && held::may_hold(&pairs, &colls)
        && gatekeeper::running()
        && comm.shared.gating.gate.get_or_try_init(Gate::new).is_ok()
    {
        return match held::verify_or_hold(&pairs, &colls) {
            Ok(Verdict::Verified) => {
                posted(&pairs, &colls);
                Ok(None)
            }
            Ok(Verdict::Hold(progress)) => {
                posted(&pairs, &colls);
                Ok(Some(Hold {
                    comm,
                    held: Held::new(&pairs, &colls, progress),
                }))
            }
            Ok(Verdict::NoRoom(mut progress)) => {
                // What is held goes first, then this group, on the host.
                if boxes.holding() {
                    settle(comm, boxes, Wait::Block)?;
                }
                match verify::resume_with(&pairs, &colls, &mut progress, Wait::Block) {
                    Ok(_) => {
                        posted(&pairs, &colls);
                        Ok(None)
                    }
                    Err(f) => Err(fail(f)),
                }
            }
            Err(f) => Err(fail(f)),
        };
    }
    // Not held: what is held goes first (this host waits for it, with the timeout).
    for (c, boxes) in &locked {
        if boxes.holding() {
            settle(c, boxes, Wait::Block)?;
        }
    }
    match verify::verify(&pairs, &colls) {
        Ok(()) => {
            posted(&pairs, &colls);
            Ok(None)
        }
        Err(f) => Err(fail(f)),
    }
}

/// A group posted behind its communicator's gate, to be checked later ([`held`]).
pub(crate) struct Hold<'a> {
    comm: &'a Communicator,
    held: Held,
}

impl Hold<'_> {
    /// Queues the group behind gate ticket `ticket` and has the gatekeeper look.
    fn queue(self, ticket: u32) {
        let Some(b) = &self.comm.boxes else {
            return;
        };
        let boxes = b.lock().unwrap_or_else(|p| p.into_inner());
        boxes.hold(self.held, ticket);
        gatekeeper::note_deadline(&self.comm.shared.gating, &boxes);
        drop(boxes);
        gatekeeper::keep(b, &self.comm.shared);
    }
}

/// Checks `comm`'s held groups as far as `wait` says and opens the gates of those that passed;
/// on a failure, breaks the communicator (which opens the rest) and returns the error.
fn settle(comm: &Communicator, boxes: &Mailboxes, wait: Wait) -> Result<()> {
    let gating = &comm.shared.gating;
    if let Err(f) = boxes.check_held(wait, &mut |ticket| gating.open_to(ticket)) {
        let e = f.into_error(comm.timeout());
        let _ = gating.failed.set(e.clone());
        comm.break_held(&e);
        return Err(e);
    }
    gatekeeper::note_deadline(gating, boxes);
    Ok(())
}

/// Breaks the communicators of a verified group unless it reached NCCL.
struct BreakUnlessPosted<'g, 'a> {
    comms: &'g [&'a Communicator],
    posted: bool,
}

impl BreakUnlessPosted<'_, '_> {
    fn done(mut self, r: Result<()>) -> Result<()> {
        if let Err(e) = &r {
            for c in self.comms {
                c.break_with(e);
            }
        }
        self.posted = true;
        r
    }
}

impl Drop for BreakUnlessPosted<'_, '_> {
    fn drop(&mut self) {
        if !self.posted {
            let e = Error::CommunicatorUnusable {
                reason: "a panic between verifying a group and posting it".into(),
            };
            for c in self.comms {
                c.break_with(&e);
            }
        }
    }
}

impl<'a> Group<'a> {
    /// The NCCL group itself, with every communicator's lock held so that the watchdog cannot
    /// abort one in the middle. Nothing reaches a stream before `ncclGroupEnd`.
    fn post(&self, comms: &[&'a Communicator], gated: Option<&Communicator>) -> Result<Option<u32>> {
        let mut states: SmallVec<[std::sync::MutexGuard<'_, State>; 2]> =
            comms.iter().map(|c| c.shared.lock()).collect();
        let mut raws: SmallVec<[_; 2]> = SmallVec::new();
        for s in &states {
            raws.push(usable(s)?);
        }
        // A held group: every stream of it waits on the GPU for its gate, before NCCL's work.
        let mut ticket = None;
        if let Some(gate) = gated.and_then(|c| c.shared.gating.gate.get()) {
            let mut streams: SmallVec<[_; 2]> = SmallVec::new();
            for (_, stream) in self.all() {
                if !streams.contains(&stream.as_raw()) {
                    streams.push(stream.as_raw());
                }
            }
            // SAFETY: the streams are live (borrowed for the group). The gate opens in bounded
            // time on every path: the group is queued right after this returns, with its
            // deadline (`Hold::queue`), and the gatekeeper checks it with its timeout or opens
            // it once that has passed; a failure or panic before it is queued breaks the
            // communicator (`BreakUnlessPosted`), which opens every gate; a failure found while
            // this holds the lock is a break at the gatekeeper's next try, which opens it; and
            // the gate opens when dropped. (Between this and the queueing the deadline is not
            // yet published: microseconds, on this thread.)
            match unsafe { gate.shut(&streams) } {
                Ok(t) => ticket = Some(t),
                Err(e) => {
                    for (st, c) in states.iter_mut().zip(comms) {
                        st.break_with(e.to_string(), c.shared.ordinal, Cut::All);
                    }
                    return Err(e);
                }
            }
        }
        let raw_of = |c: &Communicator| raws[comms.iter().position(|d| std::ptr::eq(*d, c)).expect("listed")];
        // PreMulSum operators, made before the group (a failure to make one inside it would
        // not stop NCCL launching the rest of the group), destroyed once it has ended.
        let mut redops: SmallVec<[_; 2]> = SmallVec::new();
        for op in &self.colls {
            let Some(scalar) = &op.scalar else {
                redops.push(None);
                continue;
            };
            let comm = raw_of(op.comm);
            // SAFETY: the communicator is live (lock held); the scalar holds one element of the
            // op's type (written from a `T: NcclType` of that type).
            match unsafe { nc::red_op_create_pre_mul_sum(scalar.as_ptr().cast(), op.dtype, comm) } {
                Ok(r) => redops.push(Some(r)),
                Err(e) => {
                    for (made, op) in redops.iter().zip(&self.colls) {
                        if let Some(r) = made {
                            // SAFETY: made on this live, locked communicator; never given to
                            // NCCL.
                            let _ = unsafe { nc::red_op_destroy(*r, raw_of(op.comm)) };
                        }
                    }
                    for (st, c) in states.iter_mut().zip(comms) {
                        st.break_with(e.to_string(), c.shared.ordinal, Cut::All);
                    }
                    return Err(e);
                }
            }
        }
        // SAFETY: no raw group is open on this thread (`group_start` is unsafe and requires its
        // group closed before handoff's calls); closed below on every path.
        unsafe { nc::group_start() }?;
        let mut failed: Option<Error> = None;
        // In call order: the order verification modelled (see `model`).
        for posted in &self.order {
            let (rc, call) = match *posted {
                Posted::P2p(i) => {
                    let op = &self.ops[i];
                    let send = op.access == Access::Read;
                    let (ptr, count, dtype, peer) = (op.ptr, op.count, op.dtype, op.peer as i32);
                    let (comm, stream) = (raw_of(op.comm), op.stream.as_raw());
                    // SAFETY: `op` was checked when added: the pointer and count lie inside a
                    // buffer of the communicator's device, borrowed for the group's lifetime 'a;
                    // the peer is in range; the stream is live; the peer has posted the same
                    // count and type in the same place in its order (verified, or promised by
                    // `CommOptions::unverified`). Tracking made the stream wait for conflicting
                    // uses and records this one after the group.
                    let rc = unsafe {
                        if send {
                            nc::send(ptr, count, dtype, peer, comm, stream)
                        } else {
                            nc::recv(ptr, count, dtype, peer, comm, stream)
                        }
                    };
                    let call = if send { "ncclSend" } else { "ncclRecv" };
                    (rc, call)
                }
                Posted::Coll(i) => {
                    let op = &self.colls[i];
                    // SAFETY: `CollOp::issue`'s contract: checked when added, verified (or
                    // promised), tracked; the communicator is live (lock held); `redops[i]` was
                    // made on it for this type.
                    (unsafe { op.issue(raw_of(op.comm), redops[i]) }, op.call_name())
                }
            };
            let issued = rc.and_then(|rc| {
                if rc == ncclResult_t::ncclSuccess || rc == ncclResult_t::ncclInProgress {
                    Ok(())
                } else {
                    Err(nc::error(call, rc))
                }
            });
            if let Err(e) = issued {
                failed = Some(e);
                break;
            }
        }
        // Always close the group, even after an error.
        // SAFETY: closes the group opened above, on this thread.
        let in_progress = unsafe { nc::group_end() }.unwrap_or_else(|e| {
            failed.get_or_insert(e);
            false
        });
        // A non-blocking communicator may still be enqueueing: wait until it is ready (its
        // timeout counted from here, a few microseconds after the group began).
        if failed.is_none() && in_progress {
            let started = Instant::now();
            for (c, raw) in comms.iter().zip(&raws) {
                // SAFETY: the communicator is live (usable, lock held).
                if let Err(e) = unsafe { nc::wait_ready(*raw, "ncclGroupEnd", started, c.timeout()) } {
                    failed = Some(e);
                    break;
                }
            }
        }
        if failed.is_none() {
            let made = redops.iter().zip(&self.colls);
            for (op, comm) in made.filter_map(|(r, c)| Some(((*r)?, raw_of(c.comm)))) {
                // SAFETY: made on `comm` (live, locked) above; the group has ended and, when
                // non-blocking, been waited for, so every call given `op` has returned. A
                // failure leaks one operator handle and nothing else. After a failure the
                // communicators are aborted below, which frees their operators.
                let _ = unsafe { nc::red_op_destroy(op, comm) };
            }
        }
        match failed {
            Some(e) => {
                for (s, c) in states.iter_mut().zip(comms) {
                    s.break_with(e.to_string(), c.shared.ordinal, Cut::All);
                }
                Err(e)
            }
            None => Ok(ticket),
        }
    }
}
/// Single sends and receives: each a group of one.
impl Communicator {
    /// Sends `buf` (a buffer, or a [`View`] of part of one) to rank `peer`, on `stream`: after
    /// every earlier write of the buffer, and before any later write of it (on any stream) may
    /// start. Tracking is per buffer: the whole buffer counts as read.
    ///
    /// The peer posts a matching [`Communicator::recv`] of the same count and type, in the
    /// same order; verification (on by default) compares the two. If the peer has not posted
    /// yet, the send is queued at once behind a gate on the GPU and compared when it does
    /// (README, "Verified"); where it cannot be (a first send to the peer, registered memory,
    /// a peer on another host), this waits on the host, with the timeout, for the peer. A send
    /// to oneself needs its receive in the same [`group`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (peer out of range, another device, a send to oneself or to a
    /// rank of the same `init_all` outside a group with its counterpart) before anything else;
    /// [`Error::Mismatch`] when the peer's receive differs, [`Error::Timeout`] when it does not
    /// come, [`Error::PeerBroken`] when the peer's communicator broke, NCCL errors: after these
    /// the communicator is aborted. For a held send these come from the next call on the
    /// communicator (and from host reads of the work), not from this one.
    pub fn send<'b, T: NcclType>(
        &self,
        buf: impl Into<View<'b, T>>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let buf = buf.into();
        group(|g| g.send(self, buf, peer, stream))
    }

    /// Receives into `buf` (a buffer, or a [`ViewMut`] of part of one) from rank `peer`, on
    /// `stream`: after every earlier use of the buffer, and before any later use of it may
    /// start. Tracking is per buffer: the whole buffer counts as written.
    ///
    /// # Errors
    /// As [`Communicator::send`].
    pub fn recv<'b, T: NcclType>(
        &self,
        buf: impl Into<ViewMut<'b, T>>,
        peer: usize,
        stream: &Stream,
    ) -> Result<()> {
        let buf = buf.into();
        group(|g| g.recv(self, buf, peer, stream))
    }
}
