//! [`Communicator::wait_stream_async`]: the async form of [`Communicator::wait_stream`], woken
//! by the thread of `cuda::completion` (see there why a polling thread) and bounded, and
//! aborting, as the blocking form is.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::cuda::completion::{Outcome, Query, Waiting, started};
use crate::engine::stream::Stream;
use crate::error::{Error, Result};
use crate::nccl::communicator::{Communicator, usable};
use crate::nccl::state::{Cut, Shared};
use crate::result::nccl as nc;
use crate::sys::nccl::ncclResult_t;
use crate::trace;

/// How often a pending wait looks at the communicator's asynchronous error, as the blocking
/// form does at each turn of its loop. The watchdog, which looks every 20 ms, aborts the
/// communicator on such an error anyway (and the aborted work then completes, waking the
/// future): this only reports the error as this wait's, sooner.
const RECHECK: Duration = Duration::from_millis(5);

impl Communicator {
    /// A future that resolves once all work queued so far on `stream` has completed: the async
    /// form of [`Communicator::wait_stream`], which no executor thread blocks on. The point is
    /// taken now (an event recorded on `stream`), and the deadline is this communicator's
    /// timeout from now, as for the blocking form. While pending it looks at the
    /// communicator's asynchronous error every few milliseconds (only when the communicator's
    /// lock is free: another thread's NCCL call never holds up the executor). On an error, or
    /// past the deadline, it aborts the communicator and returns the error, as the blocking
    /// form does; the abort (`ncclCommAbort`, which can take as long as other work on the
    /// device) runs on a thread of its own, so the future resolves at the deadline.
    ///
    /// Dropping the future at any time is safe: it holds one event, and the buffers of the
    /// work stay tracked by their own; a dropped future aborts nothing (the watchdog still
    /// bounds the work).
    ///
    /// # Errors
    /// The future's: [`Error::Timeout`], NCCL's asynchronous error, CUDA errors (the
    /// communicator is then aborted); [`Error::CommunicatorUnusable`]; [`Error::Capture`] while
    /// a graph is being captured on `stream` (the communicator is fine); [`Error::Setup`] if the
    /// thread that wakes futures cannot be started.
    pub fn wait_stream_async(&self, stream: &Stream) -> CommCompletion {
        let started = Instant::now();
        let timeout = self.timeout();
        let mut out = CommCompletion {
            shared: Arc::downgrade(&self.shared),
            rank: self.rank(),
            timeout,
            wait: Err(None),
        };
        if let Err(e) = usable(&self.shared.lock()) {
            out.wait = Err(Some(e));
            return out;
        }
        // As the blocking form: the event must not be a node of a graph being captured.
        let recorded = stream.outside_capture("waiting for a stream", || {
            stream.check_not_captured_elsewhere()?;
            stream.record_event()
        });
        out.wait = match recorded {
            Ok(e) => Ok(Waiting::new([e as Arc<dyn Query>], Some(started + timeout))),
            // Nothing queued: the communicator is fine.
            Err(refused @ Error::Capture { .. }) => Err(Some(refused)),
            Err(e) => {
                out.fail(&e);
                Err(Some(e))
            }
        };
        out
    }
}

/// A future that resolves once the work queued on a stream before
/// [`Communicator::wait_stream_async`] has completed, bounded by the communicator's timeout.
#[must_use = "a future does nothing unless awaited or polled"]
pub struct CommCompletion {
    /// Not kept alive by the wait: once the communicator is gone, only the deadline bounds it.
    shared: Weak<Shared>,
    rank: usize,
    timeout: Duration,
    /// The wait, or why none could be set up (returned at the first poll).
    wait: std::result::Result<Waiting, Option<Error>>,
}

impl std::fmt::Debug for CommCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommCompletion")
            .field("rank", &self.rank)
            .field("timeout", &self.timeout)
            .field("wait", &self.wait)
            .finish()
    }
}

impl CommCompletion {
    /// Aborts the communicator for `e`, as the blocking form's `bounded` does.
    fn fail(&self, e: &Error) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        trace::event!(
            warn,
            rank = self.rank,
            device = shared.ordinal,
            timeout = matches!(e, Error::Timeout { .. }),
            reason = %e,
            "handoff: communicator aborted on an error"
        );
        // Not on the executor's thread: NCCL's abort may wait for other work on the device.
        shared
            .lock()
            .break_detached(e.to_string(), shared.ordinal, Cut::Incomplete);
    }

    /// The communicator's asynchronous error, or why it is unusable, if its lock is free.
    fn comm_error(shared: &Weak<Shared>) -> Option<Error> {
        let shared = shared.upgrade()?;
        let state = shared.try_lock()?;
        let raw = match usable(&state) {
            Ok(raw) => raw,
            Err(e) => return Some(e),
        };
        // SAFETY: `raw` is live: not broken, and the lock is held.
        match unsafe { nc::comm_state(raw) } {
            Ok(rc) if rc == ncclResult_t::ncclSuccess || rc == ncclResult_t::ncclInProgress => None,
            Ok(rc) => Some(nc::error("ncclCommGetAsyncError", rc)),
            Err(e) => Some(e),
        }
    }
}

impl Future for CommCompletion {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        let wait = match started(&mut this.wait, "CommCompletion") {
            Ok(w) => w,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let failed = match wait.poll(cx, Some(RECHECK)) {
            Poll::Ready(Ok(Outcome::Complete)) => return Poll::Ready(Ok(())),
            Poll::Ready(Ok(Outcome::Expired)) => Error::Timeout {
                what: format!("rank {}'s wait for the work queued on a stream", this.rank),
                after: this.timeout,
            },
            Poll::Ready(Err(e)) => e,
            Poll::Pending => match Self::comm_error(&this.shared) {
                None => return Poll::Pending,
                Some(e) => {
                    wait.cancel();
                    e
                }
            },
        };
        this.fail(&failed);
        Poll::Ready(Err(failed))
    }
}
