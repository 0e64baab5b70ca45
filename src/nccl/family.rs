//! [`GraphFamily`]: many graphs over one communicator, each replay verified across ranks
//! (the argument is on [`GraphFamily`]); what a replay publishes is `verify::replay`'s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::cuda::graph::{Graph, GraphComm, ReplayComm};
use crate::engine::device::Origin;
use crate::engine::stream::Stream;
use crate::error::{Error, Result};
use crate::nccl::communicator::Communicator;
use crate::nccl::group::{self, Queued};
use crate::nccl::verify::replay::Replays;
use crate::nccl::verify::wire::CollDesc;

/// A family of graphs over one communicator: every graph it captures shares the
/// communicator's NCCL resources, where [`Graph::capture_with`] gives each graph a
/// communicator of its own (nothing else runs there, so its replays need no check). A server
/// that captures one graph per batch-size bucket would otherwise hold one full NCCL
/// communicator per bucket. What a graph's own communicator never needed is checked at each
/// replay instead: that every rank replays graphs whose NCCL operations agree, in the same
/// order.
///
/// # How a replay is verified
/// While a family's graph is captured, the NCCL operations it posts are verified as any
/// capture's are, and noted: per peer and direction the sends' or receives' descriptions in
/// order, and the collectives in the order NCCL runs each group's, with the groups' ends. Each
/// list's SHA-256 digest stands for it. A replay publishes one verification entry per list (a
/// collective entry for the collectives, a send or receive entry per peer and direction) and
/// compares it with the peers' next ones before the launch, as eager operations are: equal
/// digests mean equal lists, so each pair's sends and receives, and the collectives,
/// concatenated over the replays, are the same on both sides, and NCCL, which matches a
/// communicator's operations in the order they reach it, meets only verified counterparts. The
/// replays reach the stream in that order: the family's communicator is locked from the check
/// to the launch, and every graph replays on the family's stream. A replay that differs from a
/// peer's is [`Error::Mismatch`] on both ranks, launched on neither; a peer that never replays
/// is [`Error::Timeout`]; either leaves the family's communicator unusable.
///
/// A replay that would be refused (a buffer of the graph dropped, the family's stream under
/// another capture, a buffer lent to cudarc elsewhere) is refused before it is compared, and
/// the communicator stays usable; if that changes between the check and the launch (another
/// thread drops a buffer, say), the refusal comes after the comparison and breaks the family's
/// communicator, since its peers' replays were compared with it. At most
/// [`crate::cuda::graph::MAX_REPLAYS_IN_FLIGHT`] replays of each graph are in flight, so a
/// family of `n` graphs may have `n` times as many; each is still checked against the peers'
/// hosts first. The family keeps what each of its graphs'
/// replays is compared with (about a hundred bytes a graph) until it is dropped.
///
/// The check waits on the host for the peers' hosts to reach the same replay (bounded by the
/// communicator's timeout, as any verification; a few microseconds when they are there), and
/// is never held behind a GPU gate as eager operations may be: a graph's NCCL work may use
/// NCCL's registered paths (it registers captured buffers), which an aborted kernel does not
/// stop at.
///
/// ```no_run
/// use handoff::{Communicator, Device, DeviceBuffer, GraphFamily, ReduceOp, Stream};
/// # fn main() -> handoff::Result<()> {
/// # let (id, rank, world) = (handoff::UniqueId::new()?, 0, 2);
/// let dev = Device::new(0)?;
/// let s = Stream::new(&dev)?;
/// let comm = Communicator::new(world, rank, &id, &dev)?;
/// comm.all_reduce_in_place(&mut DeviceBuffer::<f32>::zeros(1, &s)?, ReduceOp::Sum, &s)?; // connect first
/// let family = GraphFamily::new(comm, &s)?;
/// // One graph per batch size, all over the family's one communicator.
/// let mut buckets = Vec::new();
/// for n in [1usize, 2, 4, 8] {
///     let mut x = DeviceBuffer::<f32>::zeros(n * 1024, &s)?;
///     let graph = family.capture(&s, |s, comm| comm.all_reduce_in_place(&mut x, ReduceOp::Sum, s))?;
///     buckets.push((x, graph));
/// }
/// // Every rank replays the same buckets in the same order.
/// buckets[2].1.launch(&s)?;
/// buckets[0].1.launch(&s)?;
/// # Ok(()) }
/// ```
///
/// `Send` and `Sync`, like its graphs' sharing of it:
///
/// ```
/// fn both<T: Send + Sync>() {}
/// both::<handoff::GraphFamily>();
/// ```
pub struct GraphFamily {
    shared: Arc<Shared>,
}

/// The family's communicator, which its graphs and the family share.
struct Shared {
    comm: Mutex<Communicator>,
    /// The thread holding `comm` ([`this_thread`]), 0 for none: a capture's body that replays
    /// or synchronizes the family would otherwise wait for itself.
    holder: AtomicU64,
    /// The communicator's timeout when the family was made: the longest a lock waits.
    timeout: Duration,
    rank: usize,
    world: usize,
}

/// A number for this thread, never 0, never another live thread's.
fn this_thread() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static ME: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    ME.with(|m| *m)
}

/// The family's communicator, locked by this thread.
struct Held<'a> {
    guard: MutexGuard<'a, Communicator>,
    holder: &'a AtomicU64,
}

impl std::ops::Deref for Held<'_> {
    type Target = Communicator;
    fn deref(&self) -> &Communicator {
        &self.guard
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.holder.store(0, Ordering::Release);
    }
}

impl Shared {
    /// Locks the communicator, waiting at most its timeout for another thread's capture or
    /// replay (two threads each capturing one family while replaying the other's graphs would
    /// otherwise wait for each other forever).
    ///
    /// # Errors
    /// [`Error::Capture`] on the thread that holds it already (inside a capture of the family);
    /// [`Error::Timeout`] after the communicator's timeout.
    fn lock(&self) -> Result<Held<'_>> {
        let me = this_thread();
        if self.holder.load(Ordering::Acquire) == me {
            return Err(crate::engine::capture_error(
                "the graph family is capturing on this thread: replay or synchronize its graphs \
                 after the capture's body returns",
            ));
        }
        let started = Instant::now();
        let mut looks = 0u32;
        let guard = loop {
            match self.comm.try_lock() {
                Ok(g) => break g,
                // A panic while it was held broke the communicator if it had to (see the
                // graph's `Unposted`).
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock) => {}
            }
            if started.elapsed() >= self.timeout {
                return Err(Error::Timeout {
                    what: "the graph family's communicator, held by another thread's capture or \
                           replay"
                        .into(),
                    after: self.timeout,
                });
            }
            looks = looks.saturating_add(1);
            if looks < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        };
        self.holder.store(me, Ordering::Release);
        Ok(Held {
            guard,
            holder: &self.holder,
        })
    }
}

impl std::fmt::Debug for GraphFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphFamily")
            .field("rank", &self.shared.rank)
            .field("world", &self.shared.world)
            .finish_non_exhaustive()
    }
}

impl GraphFamily {
    /// Makes `comm` the communicator of a family of graphs captured and replayed on `stream`.
    /// The family owns it from now on: it runs nothing but the family's captures and replays
    /// (as a graph's own does, see [`Graph::capture_with`]), and is dropped with the family
    /// and its last graph. As there, send and receive with each peer once eagerly, and run a
    /// collective of each kind the graphs will hold, before making the family: NCCL cannot
    /// connect peers inside a capture.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a communicator made by
    /// [`Communicator::init_all`] (one thread drives all its ranks, whose replays cannot wait
    /// for each other); as [`Communicator::synchronize`] (its eager work completes first);
    /// [`Error::Capture`] if the thread that aborts a graph's communicator cannot be started.
    pub fn new(mut comm: Communicator, stream: &Stream) -> Result<GraphFamily> {
        if comm.clique.is_some() {
            return Err(Error::InvalidArgument(
                "a graph family's replays are verified against each peer's, which a rank made by \
                 Communicator::init_all (all ranks on one thread) cannot wait for: make each rank \
                 in a thread or process of its own, or give each graph its own communicator \
                 (Graph::capture_with)"
                    .into(),
            ));
        }
        comm.give_to_graph()?;
        *comm.family.borrow_mut() = Some(Replays::new(stream.id()));
        Ok(GraphFamily {
            shared: Arc::new(Shared {
                rank: comm.rank(),
                world: comm.world_size(),
                timeout: comm.timeout(),
                comm: Mutex::new(comm),
                holder: AtomicU64::new(0),
            }),
        })
    }

    /// As [`Graph::capture_with`], on the family's communicator, which `body` gets by
    /// reference; the capture must be on the family's stream. Every rank captures the same
    /// NCCL operations, and all its graphs before replaying any (a capture and a replay are
    /// compared with peers in the order they happen). The graph keeps the family's
    /// communicator alive.
    ///
    /// # Errors
    /// As [`Graph::capture_with`]; [`Error::Capture`] for a capture on another stream than the
    /// family's, or inside a capture of the family; [`Error::Timeout`] when another thread's
    /// capture or replay of the family holds its communicator past the timeout.
    pub fn capture(
        &self,
        stream: &Stream,
        body: impl FnOnce(&Stream, &Communicator) -> Result<()>,
    ) -> Result<Graph> {
        Graph::capture_inner(stream, Some(Box::new(Member(self.shared.clone()))), |s, c| {
            let c = c.and_then(|c| c.as_any().downcast_ref::<Communicator>());
            body(s, c.expect("a family passes its communicator"))
        })
    }

    /// Waits until every replay queued so far on the family's communicator has completed
    /// (bounded, as [`Communicator::synchronize`]).
    ///
    /// # Errors
    /// As [`Communicator::synchronize`]; [`Error::Capture`] inside a capture of the family;
    /// [`Error::Timeout`] as for [`GraphFamily::capture`].
    pub fn synchronize(&self) -> Result<()> {
        self.shared.lock()?.synchronize()
    }

    /// This rank in the family's communicator.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The number of ranks of the family's communicator.
    pub fn world_size(&self) -> usize {
        self.shared.world
    }
}

/// A graph's hold on its family's communicator.
struct Member(Arc<Shared>);

impl GraphComm for Member {
    fn with(&self, f: &mut dyn FnMut(&dyn ReplayComm) -> Result<()>) -> Result<()> {
        f(&*self.0.lock()?)
    }

    fn replay_origin(&self) -> Arc<dyn Origin> {
        let peers = (0..self.0.world).filter(|&r| r != self.0.rank).collect();
        // Read only by host reads, which ask the communicator's shared state, not its lock.
        self.0
            .comm
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .origin(peers)
    }

    fn communicator(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

/// Whether `comm`'s replays are compared with its peers': a family's, verified.
pub(crate) fn verifies_replays(comm: &Communicator) -> bool {
    // The twin build whose family mismatch tests must fail compares none
    // (scripts/stage-device.sh).
    comm.boxes.is_some() && comm.family.borrow().is_some() && !cfg!(handoff_bypass_replay_check)
}

/// Compares the replay of `comm`'s family graph `id` with every peer's next one (see
/// [`GraphFamily`]): false when there is nothing to compare (not a family's, an
/// unverified communicator, a graph without NCCL operations).
pub(crate) fn verify_replay(comm: &Communicator, id: u64) -> Result<bool> {
    if !verifies_replays(comm) {
        return Ok(false);
    }
    let family = comm.family.borrow();
    let replays = family.as_ref().expect("a family's (verifies_replays)");
    let desc = replays.graph(id).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "internal: graph {id} is not one of this family's {} (a bug in handoff)",
            replays.len()
        ))
    })?;
    if desc.pairs.is_empty() && desc.coll.is_none() {
        return Ok(false);
    }
    let queued: SmallVec<[Queued<'_>; 4]> = desc
        .pairs
        .iter()
        .map(|&(peer, dir, d)| (comm, peer, dir, d))
        .collect();
    let colls: SmallVec<[(&Communicator, CollDesc); 1]> = desc.coll.iter().map(|&d| (comm, d)).collect();
    group::verify_ops(&[comm], &queued, &colls, false)?;
    Ok(true)
}
