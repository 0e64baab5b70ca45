//! The feature `tracing`'s events, on a CPU, against the stub libraries of tests/stubs (built
//! here with the system's C compiler): a subscriber of this test's own, installed for the whole
//! process, collects every event into a list. Two ranks, each a thread of this process with a
//! communicator of its own (`Communicator::new`, verified), are made: the stub NCCL's
//! all-gather really gathers here (`nccl_stub_set_gather`), so their creation settles
//! verification through mailbox files as two processes would. Each creation is an event. Then
//! rank 0 sends 4 elements and rank 1 receives 3: verification refuses it on both ranks, and
//! the mismatch is an event with its detail. A graph capture is two events, its beginning and
//! its end.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use handoff::{Communicator, Device, DeviceBuffer, Error, Graph, Stream, UniqueId, kernels};
use libtest_mimic::{Arguments, Failed, Trial};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

mod stubs;

/// One event: its level, target and fields (the message under `message`), as text.
#[derive(Debug, Clone)]
struct Seen {
    level: tracing::Level,
    target: String,
    fields: BTreeMap<String, String>,
}

impl Seen {
    fn message(&self) -> &str {
        self.fields.get("message").map_or("", String::as_str)
    }
}

static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());

/// Collects every event into [`SEEN`]; spans get ids and nothing else.
struct Collect {
    next_span: AtomicU64,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl Subscriber for Collect {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let seen = Seen {
            level: *event.metadata().level(),
            target: event.metadata().target().to_string(),
            fields,
        };
        SEEN.lock().unwrap_or_else(|p| p.into_inner()).push(seen);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// How many events have been seen so far: a mark for [`since`].
fn mark() -> usize {
    SEEN.lock().unwrap_or_else(|p| p.into_inner()).len()
}

/// The events seen after `mark` whose message is `what`.
fn since(mark: usize, what: &str) -> Vec<Seen> {
    let all = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    all[mark..]
        .iter()
        .filter(|s| s.message() == what)
        .cloned()
        .collect()
}

/// The events seen so far whose message contains `what`.
fn seen(what: &str) -> Vec<Seen> {
    let all = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    all.iter()
        .filter(|s| s.message().contains(what))
        .cloned()
        .collect()
}

/// Two ranks on two threads: creation, then a send of 4 against a receive of 3.
fn creation_and_mismatch() -> Result<(), Failed> {
    let id = UniqueId::new()?;
    let ranks: Vec<_> = (0..2usize)
        .map(|rank| {
            let id = id.clone();
            std::thread::spawn(move || -> Result<Error, String> {
                let e = |e: Error| format!("rank {rank}: {e}");
                let device = Device::new(rank).map_err(e)?;
                let comm = Communicator::new(2, rank, &id, &device).map_err(e)?;
                let stream = Stream::new(&device).map_err(e)?;
                let got = if rank == 0 {
                    let x = DeviceBuffer::from_slice(&[1.0f32; 4], &stream).map_err(e)?;
                    comm.send(&x, 1, &stream)
                } else {
                    let mut y = DeviceBuffer::<f32>::zeros(3, &stream).map_err(e)?;
                    comm.recv(&mut y, 0, &stream)
                };
                got.err()
                    .ok_or(format!("rank {rank}: the mismatched transfer passed"))
            })
        })
        .collect();
    for (rank, t) in ranks.into_iter().enumerate() {
        let e = t.join().map_err(|_| format!("rank {rank} panicked"))??;
        if !matches!(e, Error::Mismatch { .. }) {
            return Err(format!("rank {rank}: {e:?}, want Error::Mismatch").into());
        }
    }

    let created = seen("communicator created");
    println!("creation events: {created:#?}");
    for rank in 0..2 {
        let mine: Vec<_> = created
            .iter()
            .filter(|s| s.fields.get("rank").map(String::as_str) == Some(&rank.to_string()))
            .collect();
        let [one] = mine.as_slice() else {
            return Err(format!("rank {rank}: {} creation events, want one", mine.len()).into());
        };
        let field = |k: &str| one.fields.get(k).map_or("", String::as_str);
        if one.level != tracing::Level::INFO
            || !one.target.starts_with("handoff")
            || field("world") != "2"
            || field("device") != rank.to_string()
            || field("verified") != "true"
            || field("blocking") != "true"
            || field("elapsed").is_empty()
            || field("nccl_init").is_empty()
        {
            return Err(format!("rank {rank}: creation event {one:?}").into());
        }
    }
    let mismatches = seen("verification mismatch");
    println!("mismatch events: {mismatches:#?}");
    // Each rank compares what both posted: both see it.
    if mismatches.len() != 2 {
        return Err(format!("{} mismatch events, want 2", mismatches.len()).into());
    }
    for m in &mismatches {
        let detail = m.fields.get("detail").map_or("", String::as_str);
        if m.level != tracing::Level::WARN || !(detail.contains('4') && detail.contains('3')) {
            return Err(format!("mismatch event {m:?}").into());
        }
    }
    // The mismatch aborts both communicators: each abort is an event naming the error.
    let aborted = seen("aborted on an error");
    if aborted.len() < 2 {
        return Err(format!("{} abort events, want 2 or more: {aborted:#?}", aborted.len()).into());
    }
    Ok(())
}

/// Splits and aborts: a split (its child's rank and world), a rank left out of a split, and
/// `split_all` are events; every break of a communicator is one event with its reason, and
/// every `ncclCommAbort` one more, whichever path aborts (here the program's abort and a
/// left-out rank's unwanted child).
fn splits_and_aborts() -> Result<(), Failed> {
    let field = |s: &Seen, k: &str| s.fields.get(k).cloned().unwrap_or_default();
    let device = Device::new(0)?;
    let at = mark();
    let one = Communicator::new(1, 0, &UniqueId::new()?, &device)?;
    let child = one.split(Some(3), 0)?.ok_or("the split made no communicator")?;
    let split = since(at, "handoff: communicator split");
    match split.as_slice() {
        [e] if field(e, "rank") == "0"
            && field(e, "child_rank") == "0"
            && field(e, "child_world") == "1"
            && field(e, "color") == "3"
            && !field(e, "elapsed").is_empty() => {}
        _ => return Err(format!("split events: {split:?}").into()),
    }
    let at = mark();
    if one.split(None, 0)?.is_some() {
        return Err("a rank left out got a communicator".into());
    }
    let left = since(at, "handoff: communicator split: this rank left out");
    let aborts = since(at, "handoff: ncclCommAbort returned");
    if left.len() != 1 || aborts.len() != 1 || field(&aborts[0], "ok") != "true" {
        return Err(format!("left out: {left:?}; its child's abort: {aborts:?}").into());
    }
    let at = mark();
    child.abort()?;
    let broken = since(at, "handoff: communicator broken");
    let aborts = since(at, "handoff: ncclCommAbort returned");
    match (broken.as_slice(), aborts.as_slice()) {
        ([b], [a])
            if field(b, "reason") == "aborted by the program"
                && field(b, "rank") == "0"
                && field(b, "cut_all") == "false"
                && !field(a, "elapsed").is_empty() => {}
        _ => return Err(format!("abort events: {broken:?} {aborts:?}").into()),
    }
    // A second abort breaks nothing more.
    let at = mark();
    child.abort()?;
    if !since(at, "handoff: communicator broken").is_empty() {
        return Err("a broken communicator's second abort was a second break".into());
    }
    let two = [Device::new(0)?, Device::new(1)?];
    let comms = Communicator::init_all(&two)?;
    let at = mark();
    let kids = Communicator::split_all(&comms, &[(Some(0), 0), (Some(0), 1)])?;
    let together = since(at, "handoff: communicators split together");
    match together.as_slice() {
        [e] if field(e, "ranks") == "2" && field(e, "made") == "2" && kids.iter().all(Option::is_some) => {}
        _ => return Err(format!("split_all events: {together:?}").into()),
    }
    Ok(())
}

/// A graph capture's beginning and end are events, the end with its streams and buffers.
fn graph_capture() -> Result<(), Failed> {
    let device = Device::new(0)?;
    let stream = Stream::new(&device)?;
    let mut x = DeviceBuffer::<f32>::zeros(4, &stream)?;
    let _graph = Graph::capture(&stream, |s| kernels::produce(&mut x, 0, s))?;
    let begun = seen("graph capture begins");
    let ended = seen("graph capture ends");
    println!("capture events: {begun:#?} {ended:#?}");
    let field = |s: &Seen, k: &str| s.fields.get(k).cloned().unwrap_or_default();
    match (begun.as_slice(), ended.as_slice()) {
        ([b], [e])
            if field(b, "nccl") == "false"
                && field(e, "streams") == "1"
                && field(e, "buffers") == "1"
                && field(e, "ok") == "true" =>
        {
            Ok(())
        }
        _ => Err(format!("capture events: {begun:?} {ended:?}").into()),
    }
}

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time, in order: each counts the events of what it did.
    args.test_threads = Some(1);
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    let Some((dir, _, _)) = (unsafe { stubs::install_gathering_pair("tracing_stub") }) else {
        return;
    };
    tracing::subscriber::set_global_default(Collect {
        next_span: AtomicU64::new(1),
    })
    .expect("the first subscriber");
    let trials = vec![
        Trial::test(
            "creation_and_a_mismatch_are_events_with_their_fields",
            creation_and_mismatch,
        ),
        Trial::test("a_graph_capture_is_two_events", graph_capture),
        // Last: it makes communicators, whose events the first trial counts.
        Trial::test("splits_and_aborts_are_events", splits_and_aborts),
    ];
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(&dir);
    conclusion.exit()
}
