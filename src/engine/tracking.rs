//! Use tracking: the rules that keep a buffer from being reused too early, as a plain data
//! structure with no CUDA in it, so that CPU tests exercise every rule.
//!
//! # The model
//! Every stream operation that touches a buffer is a *use*: a read (a kernel's input, the
//! source of a copy, a send) or a write (a kernel's output, the target of a copy, a receive).
//! After queueing an operation, the caller records an event on its stream and hands it to
//! [`UseTracker::record`]. Before queueing the next operation on a buffer, the caller asks
//! [`UseTracker::waits`] which earlier uses it conflicts with and makes its stream wait for
//! their events on the GPU (`cudaStreamWaitEvent`); the host does not block.
//!
//! | new use | must wait for |
//! |---|---|
//! | read  | the last write (read after write) |
//! | write | the last write (write after write) and **every** read since it (write after read) |
//!
//! Uses on the same stream are ordered by the stream itself, so they are never waited for.
//! Every read since the last write is kept, one per stream (a later read on a stream
//! supersedes an earlier one there): cudarc keeps one read event per buffer, so a write after
//! reads on two streams waits for only one of them.
//!
//! A recorded write supersedes everything before it: it waited, on the GPU, for every earlier
//! use, so its event completes only after theirs. That keeps the state small: one write and at
//! most one read per stream.
//!
//! Freeing follows the same rule as a write: [`UseTracker::take_all`] hands back every pending
//! event, and the buffer's memory is released in stream order after all of them.
//!
//! # Lends
//! Memory can be *lent* on a stream to work the engine does not queue itself (cudarc's, through
//! a borrowed view): between [`UseTracker::lend`] and [`UseTracker::end_lend`] that work is
//! queued on the stream at times the engine does not see, so it has no event yet for others to
//! wait for. A use on another stream that conflicts with an open lend (either is a write) is
//! therefore refused ([`UseTracker::lent_conflict`]) rather than ordered; uses on the lending
//! stream are ordered by the stream. The lend ends with an event recorded on its stream after
//! that work, stored as an ordinary use.

/// Identifies a stream for the whole life of the process. Never reused, unlike a
/// `cudaStream_t`, whose address a later stream can get once the first is destroyed: a reused
/// id would make a use on a dead stream look stream-ordered with a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl StreamId {
    /// A fresh id, distinct from every other this process has made.
    pub fn fresh() -> StreamId {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StreamId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// What an operation does to a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The operation reads the buffer.
    Read,
    /// The operation writes (part of) the buffer.
    Write,
}

/// One recorded use: the stream it ran on and the event recorded after it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Use<E> {
    /// The stream the operation was queued on.
    pub stream: StreamId,
    /// An event recorded on that stream after the operation.
    pub event: E,
}

/// The pending uses of one buffer. `E` is the event type: a CUDA event handle in the crate, a
/// plain value in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UseTracker<E> {
    write: Option<Use<E>>,
    /// Reads since `write`, at most one per stream.
    reads: Vec<Use<E>>,
    /// Set by [`UseTracker::retire`]: the memory is being freed, and no use may be added.
    retired: bool,
    /// Open lends (see the module's "Lends"): an id, the stream, and the access lent.
    lent: Vec<(u64, StreamId, Access)>,
}

impl<E> Default for UseTracker<E> {
    fn default() -> Self {
        UseTracker {
            write: None,
            reads: Vec::new(),
            retired: false,
            lent: Vec::new(),
        }
    }
}

/// True when the crate was built to demonstrate what goes wrong without tracking
/// (`RUSTFLAGS="--cfg handoff_bypass_tracking"`, used by `scripts/stage-device.sh` only).
pub const BYPASSED: bool = cfg!(handoff_bypass_tracking);

impl<E> UseTracker<E> {
    /// A buffer with no pending use.
    pub fn new() -> Self {
        Self::default()
    }

    /// The events that an `access` on `stream` must wait for before it starts.
    pub fn waits(&self, stream: StreamId, access: Access) -> impl Iterator<Item = &E> {
        let reads: &[Use<E>] = match access {
            Access::Read => &[],
            Access::Write => &self.reads,
        };
        self.write
            .iter()
            .chain(reads)
            .filter(move |u| !BYPASSED && u.stream != stream)
            .map(|u| &u.event)
    }

    /// Records that an `access` was queued on `stream`, after waiting for [`Self::waits`], and
    /// that `event` was recorded on `stream` after it.
    pub fn record(&mut self, stream: StreamId, access: Access, event: E) {
        let new = Use { stream, event };
        match access {
            Access::Read => match self.reads.iter_mut().find(|u| u.stream == stream) {
                Some(slot) => *slot = new,
                None => self.reads.push(new),
            },
            Access::Write => {
                self.reads.clear();
                self.write = Some(new);
            }
        }
    }

    /// Every pending use's event, leaving the tracker empty: what a free, or a host access
    /// that blocks, must wait for.
    pub fn take_all(&mut self) -> Vec<E> {
        let all: Vec<E> = self
            .write
            .take()
            .into_iter()
            .chain(self.reads.drain(..))
            .map(|u| u.event)
            .collect();
        if BYPASSED { Vec::new() } else { all }
    }

    /// [`UseTracker::take_all`] for a free: afterwards [`UseTracker::is_retired`] is true, and
    /// whoever still refers to the tracker (a captured graph) must not queue a use of the memory.
    /// Checked under the same lock as the free takes the events, so a use is either recorded
    /// before (and the free waits for it) or refused.
    pub fn retire(&mut self) -> Vec<E> {
        self.retired = true;
        self.take_all()
    }

    /// Whether an `access` on `stream` must be refused: it conflicts with an open lend on
    /// another stream (either is a write), whose work has no event yet to wait for. Uses on the
    /// lending stream are ordered by it.
    pub fn lent_conflict(&self, stream: StreamId, access: Access) -> bool {
        !BYPASSED
            && self
                .lent
                .iter()
                .any(|&(_, s, a)| s != stream && (a == Access::Write || access == Access::Write))
    }

    /// Opens lend `id`: from now until [`UseTracker::end_lend`], work the engine does not see
    /// may `access` the memory on `stream`. The caller has refused the lend if
    /// [`UseTracker::lent_conflict`] said so, and made `stream` wait for [`UseTracker::waits`].
    pub fn lend(&mut self, id: u64, stream: StreamId, access: Access) {
        self.lent.push((id, stream, access));
    }

    /// Ends lend `id`, once an event recorded on its stream after the lent work has been
    /// stored with [`UseTracker::record`] (or that work has completed). False if it was not open.
    pub fn end_lend(&mut self, id: u64) -> bool {
        match self.lent.iter().position(|&(i, _, _)| i == id) {
            Some(at) => {
                self.lent.swap_remove(at);
                true
            }
            None => false,
        }
    }

    /// True once the memory has been (or is being) freed: see [`UseTracker::retire`].
    pub fn is_retired(&self) -> bool {
        self.retired
    }

    /// The last write's event, if it is pending.
    pub fn last_write(&self) -> Option<&E> {
        self.write.as_ref().map(|u| &u.event)
    }

    /// Every pending use, write first.
    pub fn uses(&self) -> impl Iterator<Item = &Use<E>> {
        self.write.iter().chain(&self.reads)
    }

    /// True when no use is pending.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.write.is_none() && self.reads.is_empty()
    }
}

/// Serialises, per stream, "record an event after the work just queued" with "store that event
/// in the trackers", so that of two uses on one stream the one recorded later is always stored
/// later: a tracker's read slot for a stream then always holds that stream's newest event, which
/// completes only after every earlier use there.
///
/// Without it, two threads sharing a stream can interleave as: T1 records E1, T2 records E2 and
/// stores it, T1 stores E1 over it. The slot then holds E1, which does not cover T2's use, and a
/// later write on another stream waits for E1 alone (issue 9, hole 5). The engine holds it for
/// its whole enqueue, so a stream's tracked operations are queued one at a time.
#[derive(Debug, Default)]
pub(crate) struct RecordOrder<S = ()> {
    lock: std::sync::Mutex<S>,
}

/// Proof that the caller holds a stream's [`RecordOrder`], and the state it guards (a stream's
/// graph capture, if one is under way).
pub(crate) type Held<'a, S = ()> = std::sync::MutexGuard<'a, S>;

impl<S> RecordOrder<S> {
    /// Holds the stream's order until the guard is dropped.
    pub(crate) fn hold(&self) -> Held<'_, S> {
        // A panic inside cannot leave anything half-done that the next caller relies on.
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The buffers a graph uses, each once with the strongest access the capture made of it (a
/// buffer read then written, or written then read, is a write): every replay is one use of each,
/// tracked like any other operation. `same` says whether two entries are one buffer.
#[derive(Debug, Clone)]
pub struct CapturedUses<T> {
    uses: Vec<(T, Access)>,
}

impl<T> Default for CapturedUses<T> {
    fn default() -> Self {
        CapturedUses { uses: Vec::new() }
    }
}

impl<T> CapturedUses<T> {
    /// Notes that the capture used `t` with `access`.
    pub fn note(&mut self, t: T, access: Access, same: impl Fn(&T, &T) -> bool) {
        match self.uses.iter_mut().find(|(u, _)| same(u, &t)) {
            Some((_, a)) => {
                if access == Access::Write {
                    *a = Access::Write;
                }
            }
            None => self.uses.push((t, access)),
        }
    }

    /// Each buffer once, with its access.
    pub fn uses(&self) -> &[(T, Access)] {
        &self.uses
    }
}

/// Runs `record`, then `store` with what it returned, while the caller holds the orders of the
/// streams it records on and stores for (`held`, which `store` may update): no other recording
/// on those streams comes in between.
pub(crate) fn record_and_store<E, X, H: ?Sized>(
    held: &mut H,
    record: impl FnOnce() -> Result<E, X>,
    store: impl FnOnce(&mut H, &E),
) -> Result<E, X> {
    let event = record()?;
    store(held, &event);
    Ok(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S1: StreamId = StreamId(1);
    const S2: StreamId = StreamId(2);
    const S3: StreamId = StreamId(3);

    fn waits(t: &UseTracker<&'static str>, s: StreamId, a: Access) -> Vec<&'static str> {
        let mut v: Vec<_> = t.waits(s, a).copied().collect();
        v.sort();
        v
    }

    #[test]
    fn retiring_takes_every_use_and_marks_the_tracker() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        t.record(S2, Access::Read, "r2");
        assert!(!t.is_retired());
        let mut all = t.retire();
        all.sort();
        if !BYPASSED {
            assert_eq!(all, ["r2", "w1"]);
        }
        assert!(t.is_retired() && t.is_empty());
    }

    #[test]
    fn captured_uses_keep_each_buffer_once_with_its_strongest_access() {
        let mut c = CapturedUses::default();
        let same = |a: &&str, b: &&str| a == b;
        c.note("x", Access::Read, same);
        c.note("y", Access::Write, same);
        c.note("x", Access::Read, same);
        assert_eq!(c.uses(), [("x", Access::Read), ("y", Access::Write)]);
        c.note("x", Access::Write, same);
        c.note("y", Access::Read, same);
        assert_eq!(c.uses(), [("x", Access::Write), ("y", Access::Write)]);
    }

    #[test]
    fn fresh_buffer_waits_for_nothing() {
        let t = UseTracker::<&str>::new();
        assert!(waits(&t, S1, Access::Read).is_empty());
        assert!(waits(&t, S1, Access::Write).is_empty());
        assert!(t.is_empty());
    }

    #[test]
    fn read_after_write_on_another_stream_waits_for_the_write() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        assert_eq!(waits(&t, S2, Access::Read), ["w1"]);
    }

    #[test]
    fn same_stream_never_waits() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        t.record(S1, Access::Read, "r1");
        assert!(waits(&t, S1, Access::Read).is_empty());
        assert!(waits(&t, S1, Access::Write).is_empty());
    }

    #[test]
    fn write_after_write_on_another_stream_waits() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        assert_eq!(waits(&t, S2, Access::Write), ["w1"]);
    }

    #[test]
    fn write_after_reads_on_two_streams_waits_for_both() {
        // The case cudarc gets wrong: it keeps only the latest read.
        let mut t = UseTracker::new();
        t.record(S1, Access::Read, "r1");
        t.record(S2, Access::Read, "r2");
        assert_eq!(waits(&t, S3, Access::Write), ["r1", "r2"]);
        // A writer on S1 is ordered after r1 by its stream, so it waits for r2 only.
        assert_eq!(waits(&t, S1, Access::Write), ["r2"]);
    }

    #[test]
    fn reads_do_not_wait_for_reads() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Read, "r1");
        assert!(waits(&t, S2, Access::Read).is_empty());
    }

    #[test]
    fn later_read_on_a_stream_supersedes_the_earlier_one() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Read, "r1a");
        t.record(S2, Access::Read, "r2");
        t.record(S1, Access::Read, "r1b");
        assert_eq!(waits(&t, S3, Access::Write), ["r1b", "r2"]);
        assert_eq!(t.uses().count(), 2);
    }

    #[test]
    fn write_supersedes_earlier_uses() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        t.record(S2, Access::Read, "r2");
        t.record(S3, Access::Read, "r3");
        // The caller made S1 wait for r2 and r3 before this write.
        t.record(S1, Access::Write, "w1b");
        assert_eq!(waits(&t, S2, Access::Write), ["w1b"]);
        assert_eq!(waits(&t, S3, Access::Read), ["w1b"]);
        assert_eq!(t.uses().count(), 1);
    }

    #[test]
    fn read_after_write_then_reads_keeps_waiting_for_the_write() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        t.record(S2, Access::Read, "r2");
        assert_eq!(waits(&t, S3, Access::Read), ["w1"]);
        assert_eq!(waits(&t, S3, Access::Write), ["r2", "w1"]);
    }

    #[test]
    fn free_waits_for_every_pending_use_on_every_stream() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        t.record(S2, Access::Read, "r2");
        t.record(S3, Access::Read, "r3");
        let mut all = t.take_all();
        all.sort();
        assert_eq!(all, ["r2", "r3", "w1"]);
        assert!(t.is_empty());
    }

    #[test]
    fn newest_event_on_a_shared_stream_wins_whatever_the_interleaving() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::{Arc, Barrier, Mutex};
        use std::time::Duration;
        for _ in 0..10 {
            let order: Arc<RecordOrder> = Arc::new(RecordOrder::default());
            let tracker = Arc::new(Mutex::new(UseTracker::<u32>::new()));
            // The stream: events are numbered in the order they are recorded.
            let clock = Arc::new(AtomicU32::new(0));
            let t1_recorded = Arc::new(Barrier::new(2));
            let t1 = {
                let (order, tracker, clock, sync) =
                    (order.clone(), tracker.clone(), clock.clone(), t1_recorded.clone());
                std::thread::spawn(move || {
                    record_and_store(
                        &mut [order.hold()],
                        || {
                            let e = clock.fetch_add(1, Ordering::SeqCst) + 1;
                            sync.wait();
                            // Held up between recording and storing.
                            std::thread::sleep(Duration::from_millis(20));
                            Ok::<u32, ()>(e)
                        },
                        |_, &e| tracker.lock().unwrap().record(S1, Access::Read, e),
                    )
                })
            };
            t1_recorded.wait();
            record_and_store(
                &mut [order.hold()],
                || Ok::<u32, ()>(clock.fetch_add(1, Ordering::SeqCst) + 1),
                |_, &e| tracker.lock().unwrap().record(S1, Access::Read, e),
            )
            .unwrap();
            t1.join().unwrap().unwrap();
            let kept: Vec<u32> = tracker.lock().unwrap().uses().map(|u| u.event).collect();
            assert_eq!(kept, [2], "the read slot must hold the newest event (2)");
        }
    }

    #[test]
    fn a_write_lend_refuses_every_use_elsewhere_until_it_ends() {
        let mut t = UseTracker::new();
        t.record(S1, Access::Write, "w1");
        // Opening a write lend on S2 waits, as a write there would, for w1.
        assert_eq!(waits(&t, S2, Access::Write), ["w1"]);
        t.lend(7, S2, Access::Write);
        // The lent work has no event yet: every use on another stream is refused; the lending
        // stream orders its own.
        assert!(t.lent_conflict(S1, Access::Read) && t.lent_conflict(S3, Access::Write));
        assert!(!t.lent_conflict(S2, Access::Read) && !t.lent_conflict(S2, Access::Write));
        t.record(S2, Access::Write, "end");
        assert!(t.end_lend(7));
        assert!(!t.end_lend(7), "a lend ends once");
        assert!(!t.lent_conflict(S1, Access::Read));
        assert_eq!(waits(&t, S1, Access::Read), ["end"]);
    }

    #[test]
    fn a_read_lend_refuses_only_writes_elsewhere() {
        let mut t = UseTracker::<&str>::new();
        t.lend(1, S1, Access::Read);
        assert!(!t.lent_conflict(S2, Access::Read));
        assert!(t.lent_conflict(S2, Access::Write));
        // Two read lends on two streams: a write is refused until both have ended.
        t.lend(2, S2, Access::Read);
        assert!(t.end_lend(1));
        assert!(t.lent_conflict(S3, Access::Write) && t.lent_conflict(S1, Access::Write));
        assert!(
            !t.lent_conflict(S2, Access::Write),
            "S2 orders its own write after its lend"
        );
        assert!(t.end_lend(2));
        assert!(!t.lent_conflict(S3, Access::Write));
    }

    /// The model check below with lends: every sequence of up to five steps on two streams
    /// (four on three), each a use, the opening of a lend, lent work (on the newest open lend's
    /// stream, waiting for nothing, as cudarc's does), or the closing of the oldest open lend (an
    /// event after it, stored as that stream's use). Refused steps are left out; no two
    /// conflicting accesses may overlap.
    #[test]
    fn no_sequence_with_lends_lets_conflicting_accesses_overlap() {
        let mut checked = 0;
        for (streams, longest) in [(&[S1, S2][..], 5u32), (&[S1, S2, S3][..], 4)] {
            let mut steps = Vec::new();
            for &s in streams {
                for a in [Access::Read, Access::Write] {
                    steps.push(Step::Use(s, a));
                    steps.push(Step::Open(s, a));
                }
            }
            steps.extend([Step::Work, Step::Close]);
            for len in 1..=longest {
                for code in 0..steps.len().pow(len) {
                    let mut seq = Vec::new();
                    let mut c = code;
                    for _ in 0..len {
                        seq.push(steps[c % steps.len()]);
                        c /= steps.len();
                    }
                    check_lends(&seq);
                    checked += 1;
                }
            }
        }
        assert!(checked > 140_000);
    }

    #[derive(Debug, Clone, Copy)]
    enum Step {
        Use(StreamId, Access),
        Open(StreamId, Access),
        Work,
        Close,
    }

    fn check_lends(seq: &[Step]) {
        use std::collections::BTreeSet;
        let mut t = UseTracker::<usize>::new();
        // Per op: its stream, the access it makes of the memory (none for a lend's open and
        // close, which only wait and record), and every op it is ordered after.
        let mut ops: Vec<(StreamId, Option<Access>, BTreeSet<usize>)> = Vec::new();
        let mut open: Vec<(usize, StreamId, Access)> = Vec::new();
        let push = |ops: &mut Vec<(StreamId, Option<Access>, BTreeSet<usize>)>,
                    t: &UseTracker<usize>,
                    s: StreamId,
                    access: Option<Access>,
                    wait: Option<Access>| {
            let mut deps = BTreeSet::new();
            for (j, (sj, _, bj)) in ops.iter().enumerate() {
                if *sj == s {
                    deps.insert(j);
                    deps.extend(bj.iter().copied());
                }
            }
            for &e in wait.iter().flat_map(|&a| t.waits(s, a)) {
                deps.insert(e);
                deps.extend(ops[e].2.iter().copied());
            }
            ops.push((s, access, deps));
            ops.len() - 1
        };
        let mut steps: Vec<Step> = seq.to_vec();
        // Every lend still open at the end is closed before the free.
        steps.extend(std::iter::repeat_n(Step::Close, 5));
        for step in steps {
            match step {
                Step::Use(s, a) | Step::Open(s, a) if t.lent_conflict(s, a) => {}
                Step::Use(s, a) => {
                    let i = push(&mut ops, &t, s, Some(a), Some(a));
                    t.record(s, a, i);
                }
                Step::Open(s, a) => {
                    let i = push(&mut ops, &t, s, None, Some(a));
                    t.record(s, a, i);
                    t.lend(i as u64, s, a);
                    open.push((i, s, a));
                }
                Step::Work => {
                    if let Some(&(_, s, a)) = open.last() {
                        push(&mut ops, &t, s, Some(a), None);
                    }
                }
                Step::Close => {
                    if !open.is_empty() {
                        let (id, s, a) = open.remove(0);
                        let i = push(&mut ops, &t, s, None, Some(a));
                        t.record(s, a, i);
                        assert!(t.end_lend(id as u64));
                    }
                }
            }
        }
        for i in 0..ops.len() {
            for j in 0..i {
                if let (Some(ai), Some(aj)) = (ops[i].1, ops[j].1)
                    && (ai == Access::Write || aj == Access::Write)
                {
                    assert!(ops[i].2.contains(&j), "{seq:?}: op {i} may overlap op {j}");
                }
            }
        }
        let freed: BTreeSet<usize> = t
            .take_all()
            .into_iter()
            .flat_map(|e| ops[e].2.iter().copied().chain([e]).collect::<Vec<_>>())
            .collect();
        for (i, op) in ops.iter().enumerate() {
            assert!(
                op.1.is_none() || freed.contains(&i),
                "{seq:?}: free may overlap op {i}"
            );
        }
    }

    #[test]
    fn stream_ids_are_never_reused() {
        let a = StreamId::fresh();
        let b = StreamId::fresh();
        assert_ne!(a, b);
    }

    /// A model check over every sequence of up to five uses on three streams: simulate GPU
    /// completion order as "each op may start only after what it waited for and its stream
    /// predecessor", and check that no conflicting pair of uses can run out of order.
    #[test]
    fn no_sequence_lets_conflicting_uses_overlap() {
        let streams = [S1, S2, S3];
        let ops: Vec<(StreamId, Access)> = streams
            .iter()
            .flat_map(|&s| [(s, Access::Read), (s, Access::Write)])
            .collect();
        let mut checked = 0;
        for len in 1..=5u32 {
            for code in 0..ops.len().pow(len) {
                let mut seq = Vec::new();
                let mut c = code;
                for _ in 0..len {
                    seq.push(ops[c % ops.len()]);
                    c /= ops.len();
                }
                check_sequence(&seq);
                checked += 1;
            }
        }
        assert!(checked > 9000);
    }

    /// `happens_before[i]` holds every op index that op i is ordered after, through stream
    /// order and event waits, transitively.
    fn check_sequence(seq: &[(StreamId, Access)]) {
        let mut t = UseTracker::<usize>::new();
        let mut before: Vec<std::collections::BTreeSet<usize>> = Vec::new();
        for (i, &(s, a)) in seq.iter().enumerate() {
            let mut deps = std::collections::BTreeSet::new();
            for j in 0..i {
                if seq[j].0 == s {
                    deps.insert(j);
                    deps.extend(before[j].iter().copied());
                }
            }
            for &e in t.waits(s, a) {
                deps.insert(e);
                deps.extend(before[e].iter().copied());
            }
            before.push(deps);
            t.record(s, a, i);
        }
        for i in 0..seq.len() {
            for j in 0..i {
                let conflict = seq[i].1 == Access::Write || seq[j].1 == Access::Write;
                if conflict {
                    assert!(before[i].contains(&j), "{seq:?}: op {i} may overlap op {j}");
                }
            }
        }
        // Freeing after the sequence must come after every op.
        let freed: std::collections::BTreeSet<usize> = t
            .take_all()
            .into_iter()
            .flat_map(|e| before[e].iter().copied().chain([e]).collect::<Vec<_>>())
            .collect();
        assert_eq!(freed.len(), seq.len(), "{seq:?}: free may overlap a use");
    }
}
