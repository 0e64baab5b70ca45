//! Graphs with NCCL operations: [`Graph::capture_with`] hands a [`Communicator`] to the graph,
//! which drives it through [`GraphComm`], the CUDA half's view of a graph's communicator. The
//! graph owns the communicator from then on: it runs nothing but the graph's replays.

use std::sync::Arc;

use crate::cuda::graph::{Graph, GraphComm};
use crate::engine::Before;
use crate::engine::device::{Origin, PooledEvent};
use crate::engine::stream::Stream;
use crate::error::Result;
use crate::nccl::communicator::Communicator;

impl GraphComm for Communicator {
    fn key(&self) -> usize {
        Communicator::key(self)
    }

    fn give_to_graph(&mut self) -> Result<()> {
        Communicator::give_to_graph(self)
    }

    fn check_usable(&self) -> Result<()> {
        Communicator::check_usable(self)
    }

    fn replay_origin(&self) -> Arc<dyn Origin> {
        self.origin((0..self.world_size()).filter(|&r| r != self.rank()).collect())
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
    /// As [`Graph::capture`]; [`Error::Capture`](crate::Error::Capture) for an NCCL operation of another communicator,
    /// or of this one on another stream, or a PreMulSum collective; verification's errors.
    pub fn capture_with(
        comm: Communicator,
        stream: &Stream,
        body: impl FnOnce(&Stream, &Communicator) -> Result<()>,
    ) -> Result<Graph> {
        Self::capture_inner(stream, Some(Box::new(comm)), |s, c| {
            let c = c.and_then(|c| c.as_any().downcast_ref::<Communicator>());
            body(s, c.expect("capture_with passes its communicator"))
        })
    }

    /// The graph's communicator, for graphs made with [`Graph::capture_with`]: to wait for its
    /// replays ([`Communicator::synchronize`]) or read its rank.
    pub fn communicator(&self) -> Option<&Communicator> {
        self.comm()?.as_any().downcast_ref()
    }
}
