//! [`Graph`]: tracked work captured once (CUDA stream capture) and replayed with one launch.
//!
//! # How a graph stays safe
//! - **Capture.** While [`Graph::capture`] runs its closure, every tracked operation queued on
//!   the stream is recorded into the graph instead of running (see the engine's capture branch):
//!   it neither waits for nor records tracking events (nothing runs yet), and each buffer it
//!   touches is noted with the strongest access the capture made of it. What a graph cannot hold
//!   is refused with [`Error::Capture`], nothing queued: allocation, copies from or to host
//!   slices and pinned buffers (the host touches those outside stream order), waits for events
//!   recorded outside the capture, work spanning the capture's streams and others, NCCL on any
//!   communicator but the graph's own.
//! - **Several streams.** A stream that waits for an event recorded inside the capture joins
//!   it (CUDA's cross-stream capture; handoff marks the stream under its order lock and the
//!   event under its own, held across the record and the wait, so handoff's view is CUDA's).
//!   Uses inside the capture are tracked among the capture's streams by the same rule as eager
//!   ones, with events recorded into the capture (edges of the graph, no nodes), so the graph
//!   orders its own conflicting work. At the end every joined stream is joined back into the
//!   captured one (an event recorded there, waited for by the captured stream), then the
//!   graph's event is recorded: a replay is one operation on the captured stream, covering all
//!   of it. A joined stream's handle dropped during the capture is parked only after it (CUDA
//!   captures it until then).
//! - **Replays are tracked uses.** [`Graph::launch`] goes through the same engine as every
//!   operation: the stream waits for the earlier uses each buffer's access conflicts with, and
//!   one event after the replay is stored as a use of every buffer. Host reads, other streams
//!   and the next replay order themselves around replays exactly as around eager work.
//! - **The replay records its own event.** The capture ends with the graph's event recorded
//!   into it as an external event node (`cudaEventRecordWithFlags(…, cudaEventRecordExternal)`),
//!   after all its work, so every launch records that event again, with no host call: "each
//!   launch of the graph will record event to capture execution of the node's dependencies"
//!   (CUDA's `cudaGraphAddEventRecordNode`). The event therefore always stands for the latest
//!   replay launched, and that is what each holder means by it: a launch stores it as the
//!   latest use of every buffer of the graph, under their locks, and as its stream's latest
//!   work, so a tracker that still holds it has the latest replay as that buffer's latest use
//!   (a later use elsewhere would have replaced it). A wait on it is exact: `cudaStreamWaitEvent`
//!   uses "the most recently captured state at the time of the API call, and \[is\] not affected
//!   by later calls" (CUDA's `cudaEventRecord`), so a stream that waited for one replay is not
//!   made to wait for a later one. A host wait that took the event before a later launch may
//!   wait for that later replay too (more, never less; it is bounded as that replay is). What
//!   must tell replays apart (the in-flight bound, the watchdog's deadline) uses the host event
//!   an NCCL graph records after every fourth replay; the watchdog reads the graph's event as
//!   "the latest replay" only, and no list of what an NCCL operation waits behind holds it
//!   (see the engine).
//! - **Buffers: the graph refers, the buffer owns.** A graph holds each buffer's tracker, not its
//!   memory. Dropping a buffer frees the memory after every use queued so far (replays
//!   included) and retires the tracker; a later replay of a graph that uses it is refused
//!   ([`Error::InvalidArgument`]) before anything is queued. The check and the retirement happen
//!   under the tracker's lock, so a replay is either queued before the free (which waits for
//!   it) or refused. Memory is never kept alive behind the user's back, and never freed under a
//!   replay. Kernels' modules, which the graph's nodes name, are kept loaded by the graph.
//! - **NCCL: one communicator per graph.** [`Graph::capture_with`] takes a communicator by value
//!   and owns it until the graph is dropped; only its operations can be captured, and from then
//!   on it runs nothing but this graph's replays, on the stream it was captured on. Its
//!   operations are verified across ranks once, at capture, like any group (verification also
//!   compares whether each operation is captured: NCCL requires that of both sides or
//!   neither). Every rank's graph over that communicator therefore holds the same operations
//!   in the same order, so whatever
//!   the ranks replay, each NCCL operation can only meet its verified counterpart: replays of
//!   one graph cannot be matched against another graph's or eager work. A rank that replays
//!   more often than its peers waits for a counterpart that never comes; the communicator's
//!   watchdog aborts it after its timeout (the bounded abort, [`Error::CommunicatorUnusable`]
//!   on later waits), as for eager work; and a rank never gets more than
//!   [`MAX_REPLAYS_IN_FLIGHT`] replays ahead before waiting (bounded) for the oldest. NCCL's
//!   abort waits until every graph that captured the communicator is destroyed before it
//!   frees anything; a graph's communicator is therefore aborted on a thread of its own, which
//!   ends when the graph is dropped, so neither the watchdog nor a failing launch waits for the
//!   graph they are part of, and a replay racing the abort stops at once on the GPU with
//!   NCCL's resources still alive. Make the graph's communicator with
//!   [`Communicator::split`](crate::Communicator::split) (or a fresh
//!   [`Communicator::new`](crate::Communicator::new)).
//! - **Or one communicator for a family of graphs.** [`crate::GraphFamily`] owns one
//!   communicator for many graphs; as a replay could then meet another graph's operations,
//!   each replay is compared with every peer's before it is launched, with the family's
//!   communicator locked from the check to the launch (see there).
//! - **Threads.** While a capture is under way, only the thread running its closure can queue
//!   work on the stream; another thread's tracked work there is refused, not moved into the
//!   graph behind its back. The engine decides each refusal under the stream's order lock,
//!   which the capture holds to begin and to end, so no operation sees a capture that CUDA does
//!   not (a group also asks the same rule before it is verified, so that a refusal leaves its
//!   communicators usable).
//!
//! # NCCL's own conditions
//! NCCL connects peers lazily, on the first send or receive between them, and cannot do so
//! inside a capture ("operation not permitted when stream is capturing", then the communicator
//! is unusable): run one eager send/receive with each peer on the graph's communicator before
//! capturing, or set `NCCL_RUNTIME_CONNECT=0` to connect at creation. NCCL's documentation
//! warns that graphs of several communicators launched from one thread can deadlock CUDA
//! through its support for mixing captured and eager work (`NCCL_GRAPH_MIXING_SUPPORT=0` turns
//! that support off); handoff's tests launch two communicators' graphs from one thread, and
//! handoff cannot bound such a wait inside CUDA.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::engine::device::{Device, Origin, PooledEvent};
use crate::engine::stream::Stream;
use crate::engine::tracking::{Access, StreamId};
use crate::engine::{self, CaptureState, Captured, Keep, Replay, Tracked, TrackedUse, Work};
use crate::error::{Error, Result};
use crate::result::cudart as cu;
use crate::sys::cudart::cudaGraphExec_t;
use crate::trace;

/// Work captured on a stream once and replayed with one launch: the host cost of a replay is
/// one `cudaGraphLaunch` and handoff's tracking, whatever the number of operations inside.
///
/// ```no_run
/// use handoff::{Device, DeviceBuffer, Graph, Stream, kernels};
/// # fn main() -> handoff::Result<()> {
/// let dev = Device::new(0)?;
/// let s = Stream::new(&dev)?;
/// let mut x = DeviceBuffer::<f32>::zeros(4, &s)?;
/// let mut y = DeviceBuffer::<f32>::zeros(4, &s)?;
/// // Kernel A then kernel B, captured once...
/// let graph = Graph::capture(&s, |s| {
///     kernels::produce(&mut x, 1, s)?;
///     kernels::twice(&x, &mut y, s)
/// })?;
/// // ...replayed as often as wanted; each replay is a tracked use of x and y.
/// for _ in 0..100 {
///     graph.launch(&s)?;
/// }
/// assert_eq!(y.to_vec(&s)?, [2.0, 4.0, 6.0, 8.0]);
/// # Ok(()) }
/// ```
///
/// See the [module documentation](self) for what keeps replays safe. `Send`, not `Sync` (a
/// graph with NCCL operations owns its communicator, which is not `Sync`, and counts its
/// replays in plain cells):
///
/// ```
/// fn send<T: Send>() {}
/// send::<handoff::Graph>();
/// ```
///
/// ```compile_fail,E0277
/// fn share<T: Sync>() {}
/// share::<handoff::Graph>();
/// ```
pub struct Graph {
    /// The only holder of the executable graph: dropped first (fields drop in order), before
    /// the communicator, whose drop waits for an abort that waits for this graph to be gone.
    exec: Exec,
    device: Device,
    /// The stream it was captured on: the only one a graph with NCCL operations replays on.
    captured_on: StreamId,
    uses: Vec<(Tracked, Access)>,
    /// What the nodes refer to besides memory (kernels' modules).
    _keep: Vec<Keep>,
    /// The graph's communicator, its own or its family's, for graphs with NCCL operations.
    /// Dropped after `exec`.
    comm: Option<Box<dyn GraphComm>>,
    /// What its communicator verifies each replay against, in a family ([`ReplayComm::verify_replay`]).
    replay_id: u64,
    /// Recorded by every replay, on the GPU, as its last node (`cudaEventRecordExternal` at
    /// the end of the capture): the tracking event of the latest replay launched, which a
    /// launch stores as the latest use of the graph's buffers without recording anything.
    replayed: Arc<PooledEvent>,
    /// Replays launched so far (NCCL graphs), and how many of them are known complete.
    launches: Cell<u64>,
    completed: Cell<u64>,
    /// Host events recorded after every [`CHECKPOINT`]th replay (NCCL graphs), not yet seen
    /// complete, oldest first, each with the number of the replay it follows: fixed points of
    /// the stream, which the graph's own event (always the latest replay) is not.
    in_flight: RefCell<VecDeque<(u64, Arc<PooledEvent>)>>,
    /// For graphs with NCCL operations: what a replay's tracking event asks at a host read
    /// whether the replay was cut short (a replay's output depends on every other rank), made
    /// once for every replay.
    origin: Option<Arc<dyn Origin>>,
}

/// Replays of one NCCL graph queued and not yet complete, at most. A rank that runs ahead of
/// its peers waits (with the communicator's timeout, then aborts it) for its oldest replay
/// before queueing another: its failure shows within one timeout of the replay that found no
/// peer, and it does not fill the stream's queue until `cudaGraphLaunch` itself blocks.
pub const MAX_REPLAYS_IN_FLIGHT: usize = 8;

/// How many times the in-flight bound polls its oldest replay, yielding between polls, before
/// it sleeps between them (about a millisecond of polls).
const SPIN_POLLS: u32 = 1000;

/// An NCCL graph's launches record a host event after every this many replays (a fixed point
/// for the in-flight bound and the watchdog), and none after the others.
const CHECKPOINT: u64 = 4;

/// An instantiated graph, destroyed when the last holder lets go (CUDA frees one still running
/// once it completes).
struct Exec(cudaGraphExec_t);

// SAFETY: an executable graph handle may be launched and destroyed from any thread.
unsafe impl Send for Exec {}

impl Drop for Exec {
    fn drop(&mut self) {
        // SAFETY: instantiated by `Graph::capture_inner`, destroyed once, here; CUDA defers the
        // destruction of a graph still running until it completes.
        let _ = unsafe { cu::graph_exec_destroy(self.0) };
    }
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("device", &self.device.ordinal())
            .field("buffers", &self.uses.len())
            .field("nccl", &self.comm.is_some())
            .finish()
    }
}

/// Ends the capture and clears the stream's capture state on every path out of the closure,
/// panics included.
struct Capturing<'s> {
    stream: &'s Stream,
    ended: bool,
}

impl Capturing<'_> {
    /// Ends the capture, with `last` (if given) recorded as the graph's last node, so that
    /// every replay records it when all its work has completed: the captured graph (or CUDA's
    /// error) and what the capture noted.
    fn end(mut self, last: Option<&PooledEvent>) -> (Result<crate::sys::cudart::cudaGraph_t>, Captured) {
        self.ended = true;
        self.finish(last)
    }

    /// Joins every stream joined to the capture back into the one it began on (after all their
    /// work), records `last` there, ends the capture, then clears the capture state of every
    /// stream of it. The end is under the stream's order; the joined streams' states are
    /// cleared after it, each under its own order alone (no two stream orders are held at
    /// once, so no lock order is needed): until then another thread's work there is refused,
    /// and the capture thread is here, so no operation sees a capture that CUDA does not
    /// have, nor the other way round.
    fn finish(&self, last: Option<&PooledEvent>) -> (Result<crate::sys::cudart::cudaGraph_t>, Captured) {
        let mut held = self.stream.order().hold();
        let state = held.capture.clone().unwrap_or_default();
        let mut captured = state.lock();
        let mut joined = Ok(());
        let mut joins = Vec::with_capacity(captured.forked.len());
        for f in &captured.forked {
            let join = self.stream.device().take_event().and_then(|e| {
                // SAFETY: the fork's handle is live (its stream, or parked only after this),
                // of this device, and captured by this thread; the event is the pool's.
                unsafe { cu::event_record(e.raw, f.raw) }?;
                // SAFETY: as above; the capture's stream is live and captured here.
                unsafe { cu::stream_wait_event(self.stream.as_raw(), e.raw) }?;
                Ok(e)
            });
            match join {
                Ok(e) => joins.push(e),
                Err(e) => joined = joined.and(Err(e)),
            }
        }
        // After every captured operation (on this stream, or joined back into it), under the
        // order: nothing comes between it and the end.
        let recorded = joined.and_then(|()| {
            last.map_or(Ok(()), |e| {
                // SAFETY: the event is live and of the stream's device (taken from its pool);
                // this thread is capturing the live stream.
                unsafe { cu::event_record_external(e.raw, self.stream.as_raw()) }
            })
        });
        // SAFETY: this thread began capturing the live stream in `Graph::capture_inner`.
        let graph = unsafe { cu::stream_end_capture(self.stream.as_raw()) };
        let graph = match (recorded, graph) {
            (Ok(()), graph) => graph,
            (Err(e), graph) => {
                if let Ok(g) = graph {
                    // SAFETY: just captured, owned here, not instantiated.
                    let _ = unsafe { cu::graph_destroy(g) };
                }
                Err(e)
            }
        };
        let out = std::mem::take(&mut *captured);
        captured.ended = true;
        drop(captured);
        held.capture.take();
        drop(held);
        for f in &out.forked {
            let mut theirs = f.order.hold();
            if theirs
                .capture
                .as_ref()
                .is_some_and(|c| CaptureState::same(c, &state))
            {
                theirs.capture.take();
            }
            if f.dropped {
                self.stream.device().park_stream(f.raw);
            }
        }
        (graph, out)
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if !self.ended {
            // A panic in the closure: end the capture and throw the graph away.
            if let (Ok(g), _) = self.finish(None) {
                // SAFETY: just captured, owned here, not instantiated.
                let _ = unsafe { cu::graph_destroy(g) };
            }
        }
    }
}

impl Graph {
    /// Captures the tracked work `body` queues on `stream` into a graph, and instantiates it.
    /// Nothing runs during the capture; [`Graph::launch`] runs it.
    ///
    /// Inside `body`, queue work on `stream` (kernels, copies between device buffers, fills);
    /// other streams run eagerly as usual, unless they join the capture: a stream of the same
    /// device that waits ([`Stream::wait`]) for an [`crate::Event`] recorded on `stream` (or on
    /// a stream already joined) inside the capture is part of it from then on, as in CUDA's
    /// cross-stream capture. Its work is captured and ordered like eager work: after the point
    /// it waited for, and after the capture's conflicting uses of the same buffers on the
    /// capture's other streams (handoff records and waits for events inside the capture, which
    /// become edges of the graph). When `body` returns, every joined stream is joined back
    /// into `stream`, so a replay on `stream` runs all of it, and the joined streams run
    /// eagerly again. Refused with [`Error::Capture`] (and the capture thrown away if `body`
    /// passes the error on): allocation, copies from or to host memory, an operation spanning
    /// a stream of the capture and one outside it, waiting inside the capture for an event
    /// recorded outside it, a stream of another device joining, work of another thread on a
    /// stream of the capture, and NCCL (see [`Graph::capture_with`]).
    ///
    /// # Errors
    /// [`Error::Capture`] if the stream is already being captured (by handoff or anyone else),
    /// or while memory is lent to or borrowed from cudarc across it (feature `cudarc`); the
    /// first error `body` returns (the capture is then discarded); CUDA errors (capture,
    /// instantiation).
    pub fn capture(stream: &Stream, body: impl FnOnce(&Stream) -> Result<()>) -> Result<Graph> {
        Self::capture_inner(stream, None, |s, _| body(s))
    }

    pub(crate) fn capture_inner(
        stream: &Stream,
        comm: Option<Box<dyn GraphComm>>,
        body: impl FnOnce(&Stream, Option<&dyn ReplayComm>) -> Result<()>,
    ) -> Result<Graph> {
        let Some(comm) = comm else {
            return Self::capture_locked(stream, None, body);
        };
        // The whole capture with the communicator to itself (a family's graphs share one).
        let mut body = Some(body);
        let mut graph = None;
        comm.with(&mut |rc| {
            let body = body.take().expect("called once");
            graph = Some(Self::capture_locked(stream, Some(rc), body));
            Ok(())
        })?;
        let mut graph = graph.expect("called once")?;
        graph.origin = Some(comm.replay_origin());
        graph.comm = Some(comm);
        Ok(graph)
    }

    fn capture_locked(
        stream: &Stream,
        comm: Option<&dyn ReplayComm>,
        body: impl FnOnce(&Stream, Option<&dyn ReplayComm>) -> Result<()>,
    ) -> Result<Graph> {
        stream.device().set_current()?;
        let replayed = stream.device().take_replayed_event()?;
        {
            let mut state = stream.order().hold();
            if state.capture.is_some() {
                return Err(Error::Capture {
                    detail: "the stream is already being captured into a graph: end that \
                             capture first, or capture on another stream"
                        .into(),
                });
            }
            crate::engine::lend::check_not_lent(&state)?;
            stream.check_not_captured_elsewhere()?;
            if let Some(c) = comm {
                c.begin_capture(stream.id())?;
            }
            // SAFETY: the stream is live and not being captured: not by handoff (its capture
            // state, checked above under the stream's order, which every tracked operation on it
            // takes), not by anyone else (asked of CUDA above for a wrapped stream; for
            // handoff's own, `Stream::as_raw`'s contract). This is the capture through `Graph`
            // that the function's contract leaves to handoff: the capture state set below, under
            // the same lock, sends every tracked operation on the stream to the capture branch.
            unsafe { cu::stream_begin_capture(stream.as_raw()) }?;
            state.capture = Some(CaptureState::new(stream.device(), comm.as_ref().map(|c| c.key())));
        }
        trace::event!(
            debug,
            device = stream.device().ordinal(),
            stream = stream.id().0,
            nccl = comm.is_some(),
            "handoff: graph capture begins"
        );
        let capturing = Capturing { stream, ended: false };
        let ran = {
            let _span = trace::entered!(DEBUG, "graph_capture", stream = stream.id().0);
            let _here = engine::CapturingHere::enter();
            body(stream, comm)
        };
        let (graph, captured) = capturing.end(ran.is_ok().then_some(&*replayed));
        let replay_id = comm.map_or(0, |c| c.end_capture(ran.is_ok() && graph.is_ok()));
        trace::event!(
            debug,
            device = stream.device().ordinal(),
            stream = stream.id().0,
            streams = 1 + captured.forked.len(),
            buffers = captured.uses.uses().len(),
            ok = ran.is_ok() && graph.is_ok(),
            "handoff: graph capture ends"
        );
        let graph = match (ran, graph) {
            (Ok(()), Ok(g)) => g,
            (ran, graph) => {
                if let Ok(g) = graph {
                    // SAFETY: just captured, owned here, not instantiated.
                    let _ = unsafe { cu::graph_destroy(g) };
                }
                return Err(ran.err().or(graph.err()).expect("one of them failed"));
            }
        };
        // SAFETY: a live graph, captured above.
        let exec = unsafe { cu::graph_instantiate(graph) };
        // The executable graph is independent of the template: destroy it now.
        // SAFETY: live, owned here, not used again.
        let _ = unsafe { cu::graph_destroy(graph) };
        let exec = Exec(exec?);
        // In the engine's lock order (by key) once, so that a replay sorts nothing.
        let mut uses = captured.uses.uses().to_vec();
        uses.sort_by_key(|(t, _)| t.key());
        // A graph without NCCL operations does not need the communicator; keep it anyway: it
        // was given to the graph, and its verification order has moved on with the capture
        // (`capture_inner` sets it, and the origin of its replays).
        Ok(Graph {
            exec,
            device: stream.device().clone(),
            captured_on: stream.id(),
            uses,
            _keep: captured.keep,
            comm: None,
            replay_id,
            replayed,
            launches: Cell::new(0),
            completed: Cell::new(0),
            in_flight: RefCell::new(VecDeque::with_capacity(
                MAX_REPLAYS_IN_FLIGHT / CHECKPOINT as usize + 1,
            )),
            origin: None,
        })
    }

    /// The graph's communicator, if it has one.
    pub(crate) fn comm(&self) -> Option<&dyn GraphComm> {
        self.comm.as_deref()
    }

    /// Runs the captured work once on `stream` (of the graph's device), after the earlier
    /// uses of its buffers that it conflicts with; returns at once. Each replay is a tracked
    /// use of every buffer the capture used, with the access it had there.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `stream` is on another device, if the graph has NCCL
    /// operations and `stream` is not the one it was captured on, or if a buffer it uses has
    /// been dropped; [`Error::Capture`] while `stream` is being captured;
    /// [`Error::CommunicatorUnusable`] once the graph's communicator has been aborted; CUDA
    /// errors. A [`crate::GraphFamily`]'s graph also: [`Error::Mismatch`] when a peer's replay
    /// differs, [`Error::Timeout`] when a peer's does not come within the timeout (or another
    /// thread holds the family's communicator past it), [`Error::Capture`] inside a capture
    /// of its family.
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        // The one device check of a replay: the buffers' devices were checked as their work was
        // captured (the source of a peer copy is on another device than the stream), and the
        // graph's stream was on the graph's device.
        stream.check_device(&self.device, "the graph")?;
        let exec = self.exec.0;
        // Pushed in place: collecting builds the list elsewhere and copies it here.
        let mut uses: SmallVec<[TrackedUse<'_>; 8]> = SmallVec::new();
        for (t, a) in self.uses.iter() {
            uses.push(TrackedUse::on(stream, t, *a));
        }
        let Some(comm) = &self.comm else {
            let work = Work::Uncapturable {
                what: "launching a graph",
            };
            // SAFETY: the executable graph is live (held by `self`) and of the stream's device;
            // the engine made the stream wait for every conflicting use of the graph's buffers,
            // none of which is freed (retired trackers are refused).
            let launch = |s| unsafe { cu::graph_launch(exec, s) };
            if uses.is_empty() {
                // Still noted as the stream's latest work (see `Stream::enqueue_work`).
                return stream.enqueue_work(&[], work, launch);
            }
            let replay = Replay {
                event: &self.replayed,
                checkpoint: false,
            };
            return engine::enqueue_replay(&uses, work, replay, |_| launch(stream.as_raw()), |_, _, _| {});
        };
        if stream.id() != self.captured_on {
            return Err(Error::InvalidArgument(
                "a graph with NCCL operations replays only on the stream it was captured on \
                 (its communicator's operations must stay in one order)"
                    .into(),
            ));
        }
        // From the in-flight bound to the replay's bookkeeping with the communicator to itself:
        // in a family, replays reach the stream in the order they were verified.
        comm.with(&mut |rc| self.replay_nccl(stream, rc, &uses))
    }

    /// One replay of a graph with NCCL operations, its communicator held.
    fn replay_nccl(&self, stream: &Stream, comm: &dyn ReplayComm, uses: &[TrackedUse<'_>]) -> Result<()> {
        let exec = self.exec.0;
        self.bound_in_flight(comm)?;
        // What would be refused (a broken communicator, what the engine refuses), refused
        // before the peers' replays are compared with this one: after, the refusal would
        // break the communicator. A graph's own communicator compares nothing.
        if comm.verifies_replays() {
            comm.check_usable()?;
            engine::check_replay(uses)?;
        }
        // In a family, the replay is compared with every peer's before it is launched; from
        // then on it must reach the stream, or the communicator breaks (its peers' next
        // replays would be compared with the wrong ones).
        // Armed before: a panic part-way through verification may have published entries.
        let mut unposted = Unposted { comm: Some(comm) };
        match comm.verify_replay(self.replay_id) {
            Ok(true) => {}
            Ok(false) => unposted.comm = None,
            Err(e) => {
                // A failed verification has broken the communicator already, as it should.
                unposted.comm = None;
                return Err(e);
            }
        }
        let key = [comm.key()];
        let n = self.launches.get() + 1;
        // Counted whatever happens below: a replay counted but not launched only makes the
        // in-flight bound wait sooner.
        self.launches.set(n);
        let replay = Replay {
            event: &self.replayed,
            checkpoint: n.is_multiple_of(CHECKPOINT),
        };
        let mut due = false;
        let r = engine::enqueue_replay(
            uses,
            Work::Nccl {
                comms: &key,
                abort: comm.aborter(),
            },
            replay,
            |current| {
                comm.check_usable()?;
                // A graph of kernels is launched as CUDA work is, on the current device.
                current.set(stream.device())?;
                // Not under the communicator's state lock: a launch that blocks (a full queue)
                // must leave the watchdog free to abort the communicator, which stops the GPU
                // work it waits behind. A launch racing an abort is harmless: its NCCL kernels
                // see the abort and stop, and NCCL frees nothing while this graph lives.
                // SAFETY: as above; the communicator runs nothing but its graphs' replays, all
                // on this stream, each verified against its peers' (a family's) or the only
                // graph on it (its own).
                unsafe { cu::graph_launch(exec, stream.as_raw()) }
            },
            |_, event, before| {
                let origin = self.origin.as_ref().expect("made with the communicator");
                due |= comm.note_pending_from(event, before, origin);
                if !event.is_replayed() {
                    self.in_flight.borrow_mut().push_back((n, event.clone()));
                }
            },
        );
        unposted.done(&r);
        if due {
            comm.trim();
        }
        r
    }

    /// With [`MAX_REPLAYS_IN_FLIGHT`] replays launched and not known complete, finds out which
    /// have completed, and if none of them has, waits for the oldest checkpoint; below that,
    /// asks nothing. The replays run one after another on the one stream the graph replays on,
    /// so the latest complete means all are: the graph's own event, which always stands for the
    /// latest replay, is asked first, then the checkpoints, oldest first. Checkpoints come
    /// every [`CHECKPOINT`] replays, so with 8 not known complete the oldest of them is at most
    /// 7 replays back; once it has completed, at most 7 are in flight. The wait has no deadline
    /// of its own: the communicator's watchdog counts one for those replays, as for any NCCL
    /// work, and past it aborts the communicator, which ends them (and this wait, with the
    /// abort's error).
    fn bound_in_flight(&self, comm: &dyn ReplayComm) -> Result<()> {
        let launched = self.launches.get();
        if launched - self.completed.get() < MAX_REPLAYS_IN_FLIGHT as u64 {
            return Ok(());
        }
        let mut in_flight = self.in_flight.borrow_mut();
        // SAFETY: the event is kept alive by the Arc.
        if unsafe { cu::event_query(self.replayed.raw) }? {
            in_flight.clear();
            self.completed.set(launched);
            return Ok(());
        }
        while let Some((n, oldest)) = in_flight.front() {
            // SAFETY: the event is kept alive by the Arc.
            if !unsafe { cu::event_query(oldest.raw) }? {
                break;
            }
            self.completed.set(*n);
            in_flight.pop_front();
        }
        if launched - self.completed.get() < MAX_REPLAYS_IN_FLIGHT as u64 {
            return Ok(());
        }
        // No checkpoint (one that could not be recorded): the latest replay.
        let (n, oldest) = in_flight
            .pop_front()
            .unwrap_or_else(|| (launched, self.replayed.clone()));
        // Polled, not slept on at once: a sleep lasts at least the thread's timer slack (50 µs
        // by default on Linux), longer than the replays still queued take to run, so the GPU
        // would idle until the thread woke. A millisecond of yielding polls (each query asks
        // the communicator too: an abort, or the watchdog's end, stops the wait), then sleeps.
        let mut polls = 0u32;
        // SAFETY: as above.
        while !unsafe { cu::event_query(oldest.raw) }? {
            comm.check_usable()?;
            polls = polls.saturating_add(1);
            if polls < SPIN_POLLS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        self.completed.set(n);
        Ok(())
    }
}

/// Breaks a verified replay's communicator unless the replay reached the stream.
struct Unposted<'c> {
    /// `None` once posted, or when nothing was verified.
    comm: Option<&'c dyn ReplayComm>,
}

impl Unposted<'_> {
    fn done(mut self, r: &Result<()>) {
        if let (Some(c), Err(e)) = (self.comm.take(), r) {
            c.unposted(e);
        }
    }
}

impl Drop for Unposted<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.comm.take() {
            c.unposted(&Error::CommunicatorUnusable {
                reason: "a panic between verifying a graph's replay and launching it".into(),
            });
        }
    }
}

/// What a graph with NCCL operations holds of its communicator: its own
/// ([`Graph::capture_with`]) or its family's ([`crate::GraphFamily`]). Implemented by the NCCL
/// half (`nccl/graph.rs`, `nccl/family.rs`), so that the CUDA half names nothing of it.
pub(crate) trait GraphComm: Send + 'static {
    /// Runs `f` with the communicator to itself, for one capture or one replay: a family's
    /// graphs share one, so that replays reach the stream in the order they were verified.
    ///
    /// # Errors
    /// `f`'s.
    fn with(&self, f: &mut dyn FnMut(&dyn ReplayComm) -> Result<()>) -> Result<()>;
    /// What a replay's tracking event asks at a host read: whether the communicator's work,
    /// which received from every other rank, was cut short.
    fn replay_origin(&self) -> Arc<dyn Origin>;
    /// The communicator itself, for [`Graph::communicator`]: a graph's own, not a family's.
    fn communicator(&self) -> Option<&dyn std::any::Any>;
}

/// The communicator of a graph during a capture or a replay ([`GraphComm::with`]).
pub(crate) trait ReplayComm {
    /// The communicator's key (the engine's and the capture's name for it).
    fn key(&self) -> usize;
    /// A capture begins on `stream`: a family's must be on its stream, and its operations are
    /// noted from here on, for its replays to be verified.
    fn begin_capture(&self, stream: StreamId) -> Result<()>;
    /// The capture ended (`ok`: into a graph): what its replays are verified against.
    fn end_capture(&self, ok: bool) -> u64;
    /// Whether [`ReplayComm::verify_replay`] compares replays (a verified family's).
    fn verifies_replays(&self) -> bool;
    /// Compares the replay of the graph `id` ([`ReplayComm::end_capture`]) with every peer's
    /// next one, waiting on the host for them (bounded by the timeout): true if it was (a
    /// family's), false if nothing needs comparing (a graph's own communicator).
    fn verify_replay(&self, id: u64) -> Result<bool>;
    /// A verified replay did not reach the stream: breaks the communicator.
    fn unposted(&self, e: &Error);
    /// An error once the communicator is unusable (aborted, its watchdog gone).
    fn check_usable(&self) -> Result<()>;
    /// Queues `event`, recorded after a replay that ran `before` first, for the watchdog;
    /// returns whether the queue is due to be trimmed ([`ReplayComm::trim`]).
    fn note_pending_from(
        &self,
        event: &Arc<PooledEvent>,
        before: engine::Before,
        origin: &Arc<dyn Origin>,
    ) -> bool;
    /// Drops what has completed from the watchdog's queue: called with no engine lock held.
    fn trim(&self);
    /// How the engine aborts the communicator by key when it cannot track a replay.
    fn aborter(&self) -> fn(usize, &str);
    /// The communicator itself, for the capture's body.
    fn as_any(&self) -> &dyn std::any::Any;
}
