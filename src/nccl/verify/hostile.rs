//! Hostile-input property tests: whatever a peer writes in its mailbox, whenever it writes it,
//! and whatever bytes arrive as its card, this rank gets a value, `None` or a typed refusal, in
//! bounded time: never a panic, a read outside the mapping or an endless loop. Each property
//! prints how many cases it ran.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::nccl::verify::mailbox::{MAX_CHECKED, RING, Region, STATUS_AT};
use crate::nccl::verify::wire::{
    CARD_WORDS, Card, CollDesc, CollEntry, Dir, OpDesc, P2P, PATH_BYTES, check_cards,
};
use crate::nccl::verify::{CollOps, Failure, Mailboxes, PairOps, verify};

/// Runs `test` over `cases` values of `strategy`, panicking with proptest's minimal failing
/// input; prints the number of cases run.
fn run<S: Strategy>(name: &str, cases: u32, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 256,
        ..Config::default()
    });
    let ran = Cell::new(0u32);
    let result = runner.run(&strategy, |v| {
        ran.set(ran.get() + 1);
        test(v)
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    eprintln!("hostile::{name}: {} cases passed", ran.get());
}

/// A word a hostile peer might write: anything, biased towards tags and counts the reader
/// looks for, and the ends of the range.
fn word() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        0..=3 * RING + 2,
        Just(0),
        Just(1),
        (u64::MAX - 2 * RING)..=u64::MAX,
    ]
}

/// An index a reader might ask for: small, near a ring's wrap, or anywhere up to `u64::MAX`.
fn index() -> impl Strategy<Value = u64> {
    prop_oneof![0..3 * RING, any::<u64>(), (u64::MAX - 2)..=u64::MAX]
}

/// A query of a peer's region, by its reader.
#[derive(Debug, Clone)]
enum Query {
    Read { peer: usize, send: bool, index: u64 },
    ReadColl { index: u64 },
    Checked { peer: usize, send: bool },
    CollChecked { peer: usize },
    Status,
    Busy { now: u64, fresh: u64 },
}

fn query(world: usize) -> impl Strategy<Value = Query> {
    prop_oneof![
        4 => (0..world, any::<bool>(), index()).prop_map(|(peer, send, index)| Query::Read { peer, send, index }),
        2 => index().prop_map(|index| Query::ReadColl { index }),
        1 => (0..world, any::<bool>()).prop_map(|(peer, send)| Query::Checked { peer, send }),
        1 => (0..world).prop_map(|peer| Query::CollChecked { peer }),
        1 => Just(Query::Status),
        1 => (any::<u64>(), any::<u64>()).prop_map(|(now, fresh)| Query::Busy { now, fresh }),
    ]
}

fn dir(send: bool) -> Dir {
    if send { Dir::Send } else { Dir::Recv }
}

/// A mailbox file's two mappings: the owner's (written here as a hostile peer would) and the
/// reader's (read-only, as another process maps it).
struct Mapped {
    owner: Region,
    reader: Region,
    path: PathBuf,
}

impl Mapped {
    fn new(world: usize, rank: usize, token: u64) -> Mapped {
        let (owner, path) = Region::create_file(&std::env::temp_dir(), world, rank, token).unwrap();
        let reader = Region::open_file(&path, world, rank, token).unwrap();
        assert_eq!(owner.words(), reader.words());
        Mapped { owner, reader, path }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What the reader must answer for `q` if its peer's region holds `model`; every word it
/// reads must lie inside the mapping.
fn expected(r: &Region, model: &[u64], q: &Query) -> Result<String, TestCaseError> {
    let at = |i: usize, n: usize| -> Result<&[u64], TestCaseError> {
        prop_assert!(
            i + n <= r.words(),
            "word {i}+{n} outside the {} mapped",
            r.words()
        );
        Ok(&model[i..i + n])
    };
    Ok(match *q {
        Query::Read { peer, send, index } => {
            let w = at(r.entry_at(peer, dir(send), index), 3)?;
            let hit = index.checked_add(1) == Some(w[0]);
            format!("{:?}", hit.then(|| OpDesc::decode([w[1], w[2]])))
        }
        Query::ReadColl { index } => {
            let w = at(r.coll_at(index), 4)?;
            let hit = index.checked_add(1) == Some(w[0]);
            format!("{:?}", hit.then(|| CollEntry::decode([w[1], w[2], w[3]])))
        }
        Query::Checked { peer, send } => {
            format!("{}", at(r.checked_at(peer, dir(send)), 1)?[0].min(MAX_CHECKED))
        }
        Query::CollChecked { peer } => format!("{}", at(r.coll_checked_at(peer), 1)?[0].min(MAX_CHECKED)),
        Query::Status => format!("{}", model[STATUS_AT[0]]),
        Query::Busy { now, fresh } => {
            let [_, beat, backlog] = STATUS_AT.map(|i| model[i]);
            format!("{}", backlog == 1 && now.saturating_sub(beat) <= fresh)
        }
    })
}

/// The reader's answer to `q`.
fn answer(r: &Region, q: &Query) -> String {
    match *q {
        Query::Read { peer, send, index } => format!("{:?}", r.read(peer, dir(send), index)),
        Query::ReadColl { index } => format!("{:?}", r.read_coll(index)),
        Query::Checked { peer, send } => format!("{}", r.checked(peer, dir(send))),
        Query::CollChecked { peer } => format!("{}", r.coll_checked(peer)),
        Query::Status => format!("{}", r.status()),
        Query::Busy { now, fresh } => format!("{}", r.busy_and_alive(now, fresh)),
    }
}

/// A fill of `n` words from `seed`, with [`word`]'s biases (drawn this way, not by proptest,
/// to keep thousands of words per case fast).
fn fill(seed: u64, n: usize) -> Vec<u64> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            let r = xorshift(&mut s);
            match r % 4 {
                0 => xorshift(&mut s),
                1 => (r >> 8) % (3 * RING + 3),
                2 => 0,
                _ => u64::MAX - (r >> 8) % (2 * RING),
            }
        })
        .collect()
}

/// The word `q` reads and the value that makes it find something, if it reads an entry.
fn aim(r: &Region, q: &Query) -> Option<(usize, u64)> {
    match *q {
        Query::Read { peer, send, index } => {
            Some((r.entry_at(peer, dir(send), index), index.wrapping_add(1)))
        }
        Query::ReadColl { index } => Some((r.coll_at(index), index.wrapping_add(1))),
        _ => None,
    }
}

#[test]
fn a_region_of_arbitrary_words_reads_as_what_it_holds() {
    let maps: Vec<Mapped> = (1..=3)
        .map(|w| Mapped::new(w, w - 1, 0x4_0000 + w as u64))
        .collect();
    let hits = Cell::new(0u32);
    let strategy = (0..maps.len()).prop_flat_map(|m| {
        (
            Just(m),
            any::<u64>(),
            // Each query, and whether the peer wrote the tag it looks for.
            proptest::collection::vec((query(m + 1), any::<bool>()), 1..48),
        )
    });
    run("arbitrary_region", 256, strategy, |(m, seed, queries)| {
        let Mapped { owner, reader, .. } = &maps[m];
        let mut model = fill(seed, owner.words());
        for (i, (at, tag)) in queries
            .iter()
            .filter(|q| q.1)
            .filter_map(|q| aim(owner, &q.0))
            .enumerate()
        {
            // Some aimed tags the reader should find, some one off.
            model[at] = if i % 3 == 2 { tag.wrapping_add(RING) } else { tag };
        }
        for (i, &w) in model.iter().enumerate() {
            owner.poke(i, w);
        }
        for (q, _) in &queries {
            let want = expected(reader, &model, q)?;
            let got = answer(reader, q);
            prop_assert_eq!(&got, &want, "{:?}", q);
            if got.starts_with("Some") {
                hits.set(hits.get() + 1);
            }
        }
        Ok(())
    });
    eprintln!("hostile::arbitrary_region: {} reads found an entry", hits.get());
    assert!(
        hits.get() > 0,
        "no query ever found an entry: the property tests only misses"
    );
}

/// What a peer does to its own region between its reader's queries.
#[derive(Debug, Clone)]
enum Act {
    /// Publishes an entry, as handoff does.
    Publish {
        peer: usize,
        send: bool,
        index: u64,
        count: u64,
        dtype: u32,
    },
    /// Rewrites an entry already published: the same tag over a new body, or a new tag.
    Rewrite {
        peer: usize,
        send: bool,
        index: u64,
        tag: u64,
        body: [u64; 2],
    },
    PublishColl {
        index: u64,
        words: [u64; 3],
    },
    /// Sets a checked counter: backwards, far ahead, anything.
    Checked {
        peer: usize,
        send: bool,
        n: u64,
    },
    CollChecked {
        peer: usize,
        n: u64,
    },
    Header {
        which: usize,
        value: u64,
    },
    Ask(Query),
}

fn act(world: usize) -> impl Strategy<Value = Act> {
    let small = 0..3 * RING;
    prop_oneof![
        3 => (0..world, any::<bool>(), small.clone(), word(), any::<u32>())
            .prop_map(|(peer, send, index, count, dtype)| Act::Publish { peer, send, index, count, dtype }),
        3 => (0..world, any::<bool>(), small.clone(), prop_oneof![Just(None), word().prop_map(Some)], [word(), word()])
            .prop_map(|(peer, send, index, tag, body)| Act::Rewrite {
                peer, send, index, tag: tag.unwrap_or(index + 1), body
            }),
        1 => (small, [word(), word(), word()]).prop_map(|(index, words)| Act::PublishColl { index, words }),
        2 => (0..world, any::<bool>(), word()).prop_map(|(peer, send, n)| Act::Checked { peer, send, n }),
        1 => (0..world, word()).prop_map(|(peer, n)| Act::CollChecked { peer, n }),
        1 => (0..3usize, word()).prop_map(|(which, value)| Act::Header { which, value }),
        6 => query(world).prop_map(Act::Ask),
    ]
}

#[test]
fn a_peer_that_rewrites_what_it_published_is_read_as_it_now_is() {
    let maps: Vec<Mapped> = (2..=3).map(|w| Mapped::new(w, 1, 0x5_0000 + w as u64)).collect();
    let strategy = (0..maps.len()).prop_flat_map(|m| (Just(m), proptest::collection::vec(act(m + 2), 1..64)));
    run("rewriting_peer", 256, strategy, |(m, acts)| {
        let Mapped { owner, reader, .. } = &maps[m];
        // The region starts zeroed, as the model; every act changes both.
        for i in 0..owner.words() {
            owner.poke(i, 0);
        }
        let mut model = vec![0u64; owner.words()];
        let put = |i: usize, v: u64, model: &mut Vec<u64>| {
            owner.poke(i, v);
            model[i] = v;
        };
        for a in &acts {
            match *a {
                Act::Publish {
                    peer,
                    send,
                    index,
                    count,
                    dtype,
                } => {
                    let op = OpDesc {
                        count,
                        dtype,
                        captured: false,
                        nccl_memory: 0,
                        part: P2P,
                    };
                    owner.publish(peer, dir(send), index, op);
                    let at = owner.entry_at(peer, dir(send), index);
                    let [c, d] = op.encode();
                    model[at..at + 3].copy_from_slice(&[index + 1, c, d]);
                }
                Act::Rewrite {
                    peer,
                    send,
                    index,
                    tag,
                    body,
                } => {
                    let at = owner.entry_at(peer, dir(send), index);
                    put(at + 1, body[0], &mut model);
                    put(at + 2, body[1], &mut model);
                    put(at, tag, &mut model);
                }
                Act::PublishColl { index, words } => {
                    let at = owner.coll_at(index);
                    for (k, w) in words.into_iter().enumerate() {
                        put(at + 1 + k, w, &mut model);
                    }
                    put(at, index + 1, &mut model);
                }
                Act::Checked { peer, send, n } => put(owner.checked_at(peer, dir(send)), n, &mut model),
                Act::CollChecked { peer, n } => put(owner.coll_checked_at(peer), n, &mut model),
                Act::Header { which, value } => put(STATUS_AT[which], value, &mut model),
                Act::Ask(ref q) => {
                    let want = expected(reader, &model, q)?;
                    prop_assert_eq!(answer(reader, q), want, "{:?}", q);
                }
            }
        }
        Ok(())
    });
}

/// A tiny deterministic generator for the concurrent scribbler (no shrinking needed there).
fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

#[test]
fn a_peer_rewriting_entries_while_they_are_read_yields_only_what_it_wrote() {
    // The peer keeps rewriting its first ring's entries (tags and bodies from a small set)
    // while this rank reads them: every entry read is one the peer wrote, or a mix of the words
    // of such entries (tag and body are separate words), never anything else, and no read
    // panics.
    let m = Mapped::new(2, 1, 0x6_0000);
    let counts = [3u64, 5, 7];
    let dtypes = [2u32, 7];
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reads = std::thread::scope(|s| {
        let owner = &m.owner;
        let halt = stop.clone();
        s.spawn(move || {
            let mut seed = 0x9e37_79b9_7f4a_7c15u64;
            while !halt.load(std::sync::atomic::Ordering::Relaxed) {
                let r = xorshift(&mut seed);
                let index = r % (2 * RING);
                let at = owner.entry_at(0, Dir::Recv, index);
                let op = OpDesc {
                    count: counts[(r >> 8) as usize % 3],
                    dtype: dtypes[(r >> 16) as usize % 2],
                    captured: (r >> 24) & 1 == 1,
                    nccl_memory: 0,
                    part: (r >> 25) as u8 % 10,
                };
                let [c, d] = op.encode();
                owner.poke(at + 1, c);
                owner.poke(at + 2, d);
                owner.poke(at, [index + 1, (r >> 32) % (3 * RING)][(r >> 40) as usize % 2]);
                owner.poke(owner.checked_at(0, Dir::Send), r);
            }
        });
        let deadline = Instant::now() + Duration::from_millis(300);
        let (mut reads, mut found) = (0u64, 0u64);
        while Instant::now() < deadline {
            for index in 0..2 * RING {
                if let Some(op) = m.reader.read(0, Dir::Recv, index) {
                    assert!(counts.contains(&op.count) && dtypes.contains(&op.dtype), "{op:?}");
                    found += 1;
                }
                assert!(m.reader.checked(0, Dir::Send) <= MAX_CHECKED);
                reads += 1;
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (reads, found)
    });
    eprintln!(
        "hostile::concurrent_rewrites: {} reads, {} found an entry",
        reads.0, reads.1
    );
    assert!(reads.1 > 0, "the reader never saw an entry: nothing was tested");
}

/// One rank's mailboxes in a world of two whose peer (rank 1) is hostile: its region is
/// plain memory the test writes.
fn hostile_pair() -> (Mailboxes, Arc<Region>) {
    let peer = Arc::new(Region::in_process(2, 1));
    let regions: Arc<[Arc<Region>]> = Arc::new([Arc::new(Region::in_process(2, 0)), peer.clone()]);
    (Mailboxes::new(0, regions), peer)
}

#[test]
fn verification_against_a_hostile_peer_ends_within_its_timeout() {
    // This rank verifies up to 1.5 * RING sends and receives, and a few collectives (more than a
    // ring holds, so it must wait on the peer's checked counters), against a peer that may have
    // published the counterparts and whose region then holds arbitrary words (counters
    // backwards, far ahead, tags anywhere). The outcome is Ok or a typed failure within the
    // timeout, never a panic or a longer wait.
    let timeout = Duration::from_millis(4);
    let write = (
        0usize..6,
        0..2 * RING,
        prop_oneof![Just(None), word().prop_map(Some)],
        word(),
    );
    let writes = prop_oneof![Just(Vec::new()), proptest::collection::vec(write, 1..64)];
    let strategy = (
        any::<bool>(),
        writes,
        proptest::collection::vec(1..4u64, 0..3 * RING as usize / 2),
        proptest::collection::vec(1..4u64, 0..3 * RING as usize / 2),
        0..4usize,
    );
    let outcomes = std::cell::RefCell::new(std::collections::BTreeMap::<&str, u32>::new());
    run(
        "hostile_peer_verify",
        64,
        strategy,
        |(honest, writes, sends, recvs, colls)| {
            let (boxes, peer) = hostile_pair();
            let coll = CollDesc::f32_sum(3);
            if honest {
                // The counterparts, as far as a ring holds them, and counters as if it checked
                // everything of this rank's: then the hostile writes below.
                for (i, &c) in sends.iter().take(RING as usize).enumerate() {
                    peer.publish(0, Dir::Recv, i as u64, OpDesc::f32_p2p(c));
                }
                for (i, &c) in recvs.iter().take(RING as usize).enumerate() {
                    peer.publish(0, Dir::Send, i as u64, OpDesc::f32_p2p(c));
                }
                // One group of them, as this rank posts it.
                for i in 0..colls {
                    let group_end = i + 1 == colls;
                    peer.publish_coll(
                        i as u64,
                        CollEntry {
                            desc: coll,
                            group_end,
                        },
                    );
                }
                for d in [Dir::Send, Dir::Recv] {
                    peer.poke(peer.checked_at(0, d), u64::MAX);
                }
                peer.poke(peer.coll_checked_at(0), u64::MAX);
            }
            for (kind, index, tag, w) in writes {
                // Entries this rank will read (the peer's receives from it, its sends to it, its
                // collectives), the peer's checked counters of this rank's entries, its status.
                let at = match kind {
                    0 => peer.entry_at(0, Dir::Recv, index),
                    1 => peer.entry_at(0, Dir::Send, index),
                    2 => peer.coll_at(index),
                    3 => peer.checked_at(0, if index % 2 == 0 { Dir::Send } else { Dir::Recv }),
                    4 => peer.coll_checked_at(0),
                    _ => STATUS_AT[0],
                };
                if kind < 3 {
                    peer.poke(at + 1, w);
                    peer.poke(at, tag.unwrap_or(index + 1));
                } else {
                    peer.poke(at, w);
                }
            }
            let pair = PairOps {
                boxes: &boxes,
                peer: 1,
                sends: sends.iter().map(|&c| OpDesc::f32_p2p(c)).collect(),
                recvs: recvs.iter().map(|&c| OpDesc::f32_p2p(c)).collect(),
                timeout,
            };
            let c = CollOps {
                boxes: &boxes,
                ops: smallvec::smallvec![coll; colls],
                timeout,
            };
            let t = Instant::now();
            let r = verify(std::slice::from_ref(&pair), std::slice::from_ref(&c));
            let took = t.elapsed();
            prop_assert!(took < timeout + Duration::from_secs(1), "took {took:?}: {r:?}");
            let kind = match r {
                Ok(()) => "ok",
                Err(Failure::Mismatch(_)) => "mismatch",
                Err(Failure::Timeout { .. }) => "timeout",
                Err(Failure::PeerBroken(_)) => "peer broken",
            };
            *outcomes.borrow_mut().entry(kind).or_default() += 1;
            Ok(())
        },
    );
    eprintln!("hostile::hostile_peer_verify: outcomes {:?}", outcomes.borrow());
}

/// A card as handoff writes it, as words.
fn card_words(path: &str) -> [u64; CARD_WORDS] {
    Card {
        verified: true,
        rank: 1,
        world: 2,
        token: 0xfeed,
        pid: 42,
        path: path.into(),
        ..Card::default()
    }
    .encode()
    .unwrap()
}

/// Bytes a peer might send as its card: arbitrary, a real card truncated, extended, with one
/// word changed, of another version, with a path length past the card or bytes that are not
/// UTF-8.
fn card_input() -> impl Strategy<Value = Vec<u64>> {
    let real = card_words("/dev/shm/handoff-42-000000000000feed-r1");
    prop_oneof![
        proptest::collection::vec(word(), 0..2 * CARD_WORDS),
        (0..CARD_WORDS).prop_map(move |n| real[..n].to_vec()),
        proptest::collection::vec(word(), 1..CARD_WORDS).prop_map(move |extra| [&real[..], &extra].concat()),
        (0..CARD_WORDS, word()).prop_map(move |(i, w)| {
            let mut v = real.to_vec();
            v[i] = w;
            v
        }),
        (word(), any::<u64>()).prop_map(move |(version, len)| {
            let mut v = real.to_vec();
            v[0] = real[0] ^ (version & 0xff);
            v[5] = len;
            v
        }),
        (
            0..=(CARD_WORDS as u64 - 8) * 8 + 16,
            proptest::collection::vec(any::<u64>(), CARD_WORDS - 8)
        )
            .prop_map(move |(len, path)| {
                let mut v = real.to_vec();
                v[5] = len;
                v[8..].copy_from_slice(&path);
                v
            }),
    ]
}

#[test]
fn a_card_of_arbitrary_words_decodes_or_is_refused() {
    let magic = card_words("")[0];
    let accepted = Cell::new(0u32);
    run("card_decode", 1024, card_input(), |w| {
        match Card::decode(&w) {
            Ok(card) => {
                accepted.set(accepted.get() + 1);
                prop_assert_eq!(w.len(), CARD_WORDS);
                prop_assert_eq!(w[0], magic);
                prop_assert!(w[1] <= 1);
                prop_assert_eq!(card.path.len() as u64, w[5]);
                prop_assert_eq!(card.verified, w[1] == 1);
                // What was accepted is what the fields say, and round-trips.
                prop_assert_eq!(Card::decode(&card.encode().unwrap()), Ok(card.clone()));
                // And the checks on a set of cards that includes it never panic.
                let _ = check_cards(0, &[card.clone(), card]);
            }
            Err(e) => prop_assert!(e.contains("card") || e.contains("path"), "{}", e),
        }
        Ok(())
    });
    eprintln!("hostile::card_decode: {} cards accepted", accepted.get());
}

#[test]
fn a_card_encodes_any_path_that_fits_and_refuses_a_longer_one() {
    let strategy = (
        any::<bool>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        "\\PC{0,80}",
    );
    run(
        "card_encode",
        256,
        strategy,
        |(verified, rank, world, token, pid, path)| {
            let card = Card {
                verified,
                rank,
                world,
                token,
                pid,
                path: path.repeat(3),
                ..Card::default()
            };
            match card.encode() {
                Ok(w) => prop_assert_eq!(Card::decode(&w), Ok(card)),
                Err(e) => {
                    prop_assert!(card.path.len() > PATH_BYTES);
                    prop_assert!(e.contains("TMPDIR"), "{}", e);
                }
            }
            Ok(())
        },
    );
}

#[test]
fn a_path_a_card_names_is_refused_at_once_whatever_it_is() {
    // Paths a hostile peer might name: anything, or files of this host that are not mailboxes.
    let named = [
        "",
        ".",
        "/",
        "/dev/null",
        "/dev/zero",
        "/dev/full",
        "/dev/stdin",
        "/dev/shm",
        "/proc/self/mem",
        "/proc/self/fd/0",
        "/proc/self/status",
        "/etc/passwd",
    ];
    let strategy = prop_oneof![
        proptest::sample::select(named.to_vec()).prop_map(String::from),
        "\\PC{0,40}",
        "/[a-z/.]{0,30}",
    ];
    let seen = std::cell::RefCell::new(std::collections::BTreeMap::<String, u32>::new());
    run("card_paths", 256, strategy, |path| {
        let t = Instant::now();
        let r = Region::open_file(Path::new(&path), 2, 1, 0x7_0000);
        prop_assert!(
            t.elapsed() < Duration::from_secs(1),
            "{:?} took {:?}",
            path,
            t.elapsed()
        );
        let e = match r {
            Ok(_) => return Err(TestCaseError::fail(format!("{path:?} was taken for a mailbox"))),
            Err(e) => e,
        };
        let kind = format!("{e:?}")
            .split([' ', '{'])
            .next()
            .unwrap_or("")
            .to_string();
        *seen.borrow_mut().entry(kind).or_default() += 1;
        prop_assert!(!e.to_string().is_empty());
        Ok(())
    });
    eprintln!("hostile::card_paths: refusals {:?}", seen.borrow());
}
