//! The state of a graph capture under way ([`CaptureState`]), which every stream of the capture
//! holds in its record order, and the one rule of what may enter it ([`CaptureState::admit`]).

use std::sync::{Arc, Mutex, MutexGuard};

use crate::engine::device::{Device, PooledEvent};
use crate::engine::tracked::Tracked;
use crate::engine::tracking::{CapturedUses, RecordOrder, UseTracker};
use crate::engine::{StreamState, Work};
use crate::error::{Error, Result};

/// A graph capture under way on a stream (see [`crate::Graph`]): held in the stream's
/// [`tracking::RecordOrder`], so the engine sees it under the lock it already takes;
/// the same capture's state is held by every stream of the capture (the one it began on, and
/// those joined to it by waiting for an [`crate::Event`] recorded in it), all sharing one
/// [`Captured`]. While it is there, operations on the stream are recorded into the graph, not
/// run: the engine neither waits for earlier uses outside the capture (the graph's replays
/// will) nor records tracking events (nothing ran); it notes each use for the replays to
/// track, and orders it after the conflicting earlier uses of the capture on its other streams
/// (edges of the graph).
#[derive(Default, Clone)]
pub(crate) struct CaptureState {
    /// What every stream of the capture shares; taken after stream orders, trackers and an
    /// event's mark, and with nothing inside it but the device's event pool.
    pub(crate) shared: Arc<Mutex<Captured>>,
    /// The communicator given to the capture (its key, an id never reused), the only one whose
    /// operations it takes.
    pub(crate) comm: Option<usize>,
    /// The thread running the capture's closure, the only one whose work it takes: another
    /// thread's work on the stream is refused, not silently moved into the graph (that thread
    /// checked for a capture before it began, and would believe its work had run). `None` only
    /// in a state no capture made (the default), which admits nothing.
    pub(crate) thread: Option<std::thread::ThreadId>,
}

/// What the streams of one capture share.
#[derive(Default)]
pub(crate) struct Captured {
    pub(crate) uses: CapturedUses<Tracked>,
    /// What the graph's nodes refer to besides memory (the modules of captured kernels).
    pub(crate) keep: Vec<Keep>,
    /// Each buffer's uses inside the capture, each tracked by an event recorded into the
    /// capture after it on its stream (which adds no node; a wait for it from another stream of
    /// the capture is an edge): the same rule as eager tracking, inside the graph.
    within: Vec<(Tracked, UseTracker<Arc<PooledEvent>>)>,
    /// The streams joined to the capture, each joined back into the stream it began on before
    /// it ends (CUDA requires it: `cudaErrorStreamCaptureUnjoined`).
    pub(crate) forked: Vec<Fork>,
    /// The device of the stream the capture began on: streams of another cannot join.
    pub(crate) device: Option<Device>,
    /// Set once the capture has ended.
    pub(crate) ended: bool,
}

/// A stream joined to a capture.
pub(crate) struct Fork {
    pub(crate) raw: crate::sys::cudart::cudaStream_t,
    /// Its order, whose capture state is cleared when the capture ends.
    pub(crate) order: Arc<RecordOrder<StreamState>>,
    /// Whether its `Stream` was dropped during the capture: its handle is then parked only
    /// once the capture has ended (until then CUDA still captures it, and a new `Stream` over
    /// it would queue untracked work into the graph).
    pub(crate) dropped: bool,
    /// For a stream wrapped from someone else (cudarc's): what keeps its handle alive until
    /// the capture has joined it back and ended, even if its `Stream` is dropped before.
    pub(crate) _owner: Option<Keep>,
}

// SAFETY: the raw handles are CUDA streams, usable from any thread; the list is behind the
// capture's mutex.
unsafe impl Send for Captured {}

impl Captured {
    pub(crate) fn within(&mut self, t: &Tracked) -> &mut UseTracker<Arc<PooledEvent>> {
        let i = match self.within.iter().position(|(u, _)| Tracked::same(u, t)) {
            Some(i) => i,
            None => {
                self.within.push((t.clone(), UseTracker::new()));
                self.within.len() - 1
            }
        };
        &mut self.within[i].1
    }
}

impl CaptureState {
    /// A capture beginning on a stream of `device`, by the calling thread, taking NCCL
    /// operations of the communicator `comm` (its key) only.
    pub(crate) fn new(device: &Device, comm: Option<usize>) -> CaptureState {
        let captured = Captured {
            device: Some(device.clone()),
            ..Captured::default()
        };
        CaptureState {
            shared: Arc::new(Mutex::new(captured)),
            comm,
            thread: Some(std::thread::current().id()),
        }
    }

    /// The shared state, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Captured> {
        // Each update is one step: a poisoned lock is still usable.
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `a` and `b` are one capture's.
    pub(crate) fn same(a: &CaptureState, b: &CaptureState) -> bool {
        Arc::ptr_eq(&a.shared, &b.shared)
    }
}

impl CaptureState {
    /// Whether `work` (using pinned host memory if `host`), queued by the calling thread, may
    /// enter this capture: the one rule, applied by the engine under the stream's lock, and by
    /// a group before it is verified (so that a refusal leaves its communicators usable).
    ///
    /// # Errors
    /// [`Error::Capture`], saying what to do instead.
    pub(crate) fn admit(&self, host: bool, work: Work<'_>) -> Result<()> {
        if self.thread != Some(std::thread::current().id()) {
            return Err(capture_error(
                "the stream is being captured into a graph by another thread: queue this work \
                 on another stream, or after the capture",
            ));
        }
        if host {
            return Err(capture_error(
                "a pinned host buffer cannot be used in a graph (the host reads and writes it \
                 outside stream order): copy to or from it outside the capture, after a replay",
            ));
        }
        match work {
            Work::Uncapturable { what } => Err(not_capturable(what)),
            Work::Lend { .. } => Err(not_capturable("lending memory to cudarc")),
            Work::Nccl { comms, .. } if comms.iter().any(|c| self.comm != Some(*c)) => {
                Err(capture_error(NOT_THE_GRAPHS))
            }
            Work::Nccl { .. } | Work::Cuda { .. } => Ok(()),
        }
    }
}

thread_local! {
    /// How many capture bodies ([`crate::Graph::capture`]) the calling thread is running.
    static CAPTURING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Marks the calling thread as running a capture's body while it lives. CUDA captures in its
/// thread-local mode, in which it refuses a capturing thread's host waits for as long as the
/// capture lasts: a blocking host copy there, on any stream, is refused at once instead
/// ([`capturing_here`]).
pub(crate) struct CapturingHere(());

impl CapturingHere {
    pub(crate) fn enter() -> CapturingHere {
        CAPTURING.with(|c| c.set(c.get() + 1));
        CapturingHere(())
    }
}

impl Drop for CapturingHere {
    fn drop(&mut self) {
        CAPTURING.with(|c| c.set(c.get() - 1));
    }
}

/// Whether the calling thread is running a capture's body.
pub(crate) fn capturing_here() -> bool {
    CAPTURING.with(|c| c.get() > 0)
}

/// Why an NCCL operation of another communicator is refused in a capture.
pub(crate) const NOT_THE_GRAPHS: &str = "an NCCL operation in a graph must use the communicator \
    given to Graph::capture_with (make one for the graph, e.g. with Communicator::split, and \
    send and receive with each peer on it once before capturing)";

/// Why an operation spanning streams is refused in a capture.
pub(crate) const SPANNING: &str = "an operation captured into a graph may use only streams of \
    the capture (the stream being captured, and streams joined to it by waiting for an Event \
    recorded in it): queue the other streams' work outside the capture, or join them first";

/// [`Error::Capture`] with `detail`.
pub(crate) fn capture_error(detail: &str) -> Error {
    Error::Capture {
        detail: detail.into(),
    }
}

/// The refusal of `what`, which a graph cannot hold.
pub(crate) fn not_capturable(what: &str) -> Error {
    capture_error(&format!(
        "{what} cannot be captured into a graph: do it outside the capture"
    ))
}

/// Something a captured graph's nodes refer to, kept alive as long as the graph.
pub(crate) type Keep = Arc<dyn std::any::Any + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    fn capture(comm: Option<usize>) -> CaptureState {
        CaptureState {
            comm,
            thread: Some(std::thread::current().id()),
            ..CaptureState::default()
        }
    }

    fn no_abort(_: usize, _: &str) {}

    fn refused(r: Result<()>) -> String {
        match r {
            Err(Error::Capture { detail }) => detail,
            other => panic!("admitted, or another error: {other:?}"),
        }
    }

    #[test]
    fn a_capture_admits_its_threads_cuda_work_and_its_communicators_nccl() {
        let c = capture(Some(7));
        assert!(c.admit(false, Work::Cuda { keep: None }).is_ok());
        assert!(
            c.admit(
                false,
                Work::Nccl {
                    comms: &[7],
                    abort: no_abort
                }
            )
            .is_ok()
        );
    }

    #[test]
    fn a_capture_refuses_what_a_graph_cannot_hold() {
        let c = capture(Some(7));
        let d = refused(c.admit(
            false,
            Work::Nccl {
                comms: &[8],
                abort: no_abort,
            },
        ));
        assert!(d.contains("Graph::capture_with"), "{d}");
        assert!(
            refused(c.admit(
                false,
                Work::Nccl {
                    comms: &[7, 8],
                    abort: no_abort
                }
            ))
            .contains("capture_with")
        );
        let d = refused(c.admit(true, Work::Cuda { keep: None }));
        assert!(d.contains("pinned host buffer"), "{d}");
        let d = refused(c.admit(
            false,
            Work::Uncapturable {
                what: "allocating a buffer",
            },
        ));
        assert!(d.starts_with("allocating a buffer cannot be captured"), "{d}");
        // Without a communicator, no NCCL at all.
        assert!(
            refused(capture(None).admit(
                false,
                Work::Nccl {
                    comms: &[7],
                    abort: no_abort
                }
            ))
            .contains("capture_with")
        );
        // A state no capture made admits nothing.
        let d = refused(CaptureState::default().admit(false, Work::Cuda { keep: None }));
        assert!(d.contains("another thread"), "{d}");
    }

    #[test]
    fn a_capture_refuses_another_threads_work() {
        let c = capture(Some(7));
        std::thread::scope(|t| {
            t.spawn(|| {
                let d = refused(c.admit(false, Work::Cuda { keep: None }));
                assert!(d.contains("another thread"), "{d}");
            });
        });
    }
}
