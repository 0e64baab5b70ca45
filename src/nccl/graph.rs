//! Graphs with NCCL operations: [`Graph::capture_with`] hands a [`Communicator`] to the graph,
//! which drives it through [`GraphComm`], the CUDA half's view of a graph's communicator. The
//! graph owns the communicator from then on: it runs nothing but the graph's replays.

use std::sync::Arc;

use crate::cuda::graph::{Graph, GraphComm, ReplayComm};
use crate::engine::Before;
use crate::engine::device::{Origin, PooledEvent};
use crate::engine::stream::Stream;
use crate::engine::tracking::StreamId;
use crate::error::{Error, Result};
use crate::nccl::communicator::Communicator;
use crate::nccl::family;

impl GraphComm for Communicator {
    fn with(&self, f: &mut dyn FnMut(&dyn ReplayComm) -> Result<()>) -> Result<()> {
        f(self)
    }

    fn replay_origin(&self) -> Arc<dyn Origin> {
        self.origin((0..self.world_size()).filter(|&r| r != self.rank()).collect())
    }

    fn communicator(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl ReplayComm for Communicator {
    fn key(&self) -> usize {
        Communicator::key(self)
    }

    fn begin_capture(&self, stream: StreamId) -> Result<()> {
        match self.family.borrow_mut().as_mut() {
            Some(f) => f.begin_capture(stream),
            None => Ok(()),
        }
    }

    fn end_capture(&self, ok: bool) -> u64 {
        let world = self.world_size();
        self.family
            .borrow_mut()
            .as_mut()
            .map_or(0, |f| f.end_capture(ok, world))
    }

    fn verifies_replays(&self) -> bool {
        family::verifies_replays(self)
    }

    fn verify_replay(&self, id: u64) -> Result<bool> {
        family::verify_replay(self, id)
    }

    fn unposted(&self, e: &Error) {
        self.break_with(e);
    }

    fn check_usable(&self) -> Result<()> {
        Communicator::check_usable(self)
    }

    fn note_pending_from(&self, event: &Arc<PooledEvent>, before: Before, origin: &Arc<dyn Origin>) -> bool {
        Communicator::note_pending_from(self, event, before, origin)
    }

    fn trim(&self) {
        Communicator::trim(self);
    }

    fn aborter(&self) -> fn(usize, &str) {
        Communicator::abort_by_key
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Graph {
    /// As [`Graph::capture`], with NCCL operations on `comm`, which the graph owns from now on
    /// (it is dropped with the graph, or at once if the capture fails). `body` gets it back by
    /// reference to queue sends, receives, collectives and groups on `stream` (or on streams
    /// joined to the capture); they are verified across ranks during the capture, as eager ones
    /// are, and replayed without being checked again.
    /// Every rank must capture the same NCCL operations on this communicator, and replay the
    /// graph as often as the others: a rank left waiting is aborted by the watchdog after the
    /// communicator's timeout. A graph with NCCL operations replays only on `stream`. Send and
    /// receive with each peer once, eagerly, before capturing (see the [module
    /// documentation](crate::cuda::graph): NCCL cannot connect peers inside a capture).
    ///
    /// # Errors
    /// As [`Graph::capture`]; [`Error::Capture`] for an NCCL operation of another communicator,
    /// or of this one on another stream, or a PreMulSum collective; verification's errors.
    pub fn capture_with(
        mut comm: Communicator,
        stream: &Stream,
        body: impl FnOnce(&Stream, &Communicator) -> Result<()>,
    ) -> Result<Graph> {
        comm.give_to_graph()?;
        Self::capture_inner(stream, Some(Box::new(comm)), |s, c| {
            let c = c.and_then(|c| c.as_any().downcast_ref::<Communicator>());
            body(s, c.expect("capture_with passes its communicator"))
        })
    }

    /// The graph's communicator, for graphs made with [`Graph::capture_with`]: to wait for its
    /// replays ([`Communicator::synchronize`]) or read its rank.
    pub fn communicator(&self) -> Option<&Communicator> {
        self.comm()?.communicator()?.downcast_ref()
    }
}
