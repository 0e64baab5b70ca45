//! The channel and its handshake between two ranks of this process over loopback TCP: what
//! verification sees through mirrors, and what it does with a peer that lies, stops reading,
//! or is not a rank. (Two processes on two network namespaces: `tests/hosts.rs`.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::nccl::verify::auth::{self, Keys, Pair};
use crate::nccl::verify::channel::{Channel, Connection, MAX_FRAMES, now_ms, open_for_test, record_for_test};
use crate::nccl::verify::mailbox::{BROKEN, Region};
use crate::nccl::verify::wire::{CollDesc, CollKind, Dir, NONE, OpDesc, P2P};
use crate::nccl::verify::{CollOps, Failure, Mailboxes, PairOps, verify};

const T0: u128 = 0x1111_2222_3333_4444_5555_6666_7777_8888;
const T1: u128 = 0x9999_aaaa_bbbb_cccc_dddd_eeee_ffff_0000;

fn pair() -> Pair {
    Pair {
        server: 0,
        client: 1,
        world: 2,
        server_token: T0,
        client_token: T1,
    }
}

fn deadline(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

/// Rank 0 serves on loopback with `server_secret`; `client` runs against its address.
fn handshake<C: Send + 'static>(
    server_secret: Option<&'static [u8]>,
    client: impl FnOnce(SocketAddr) -> C + Send + 'static,
) -> (Result<(usize, TcpStream, Keys), String>, C) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let c = std::thread::spawn(move || client(addr));
    let (s, _) = l.accept().unwrap();
    let token_of = |c: usize| (c == 1).then_some(T1);
    let served = auth::serve(s, 0, 2, T0, &token_of, server_secret, deadline(2_000));
    (served, c.join().unwrap())
}

/// Two ranks joined by the channel: each one's own region forwards to the other's mirror.
fn two(secret: Option<&'static [u8]>, timeout: Duration) -> [Mailboxes; 2] {
    let (served, connected) = handshake(secret, move |addr| {
        auth::connect(addr, pair(), secret, deadline(2_000))
    });
    let (_, s_stream, s_keys) = served.unwrap();
    let (c_stream, c_keys) = connected.unwrap();
    let side = |me: usize, stream: TcpStream, keys: Keys| {
        let peer = 1 - me;
        let (channel, mirrors) = Channel::start(
            me,
            2,
            vec![Connection {
                rank: peer,
                stream,
                keys,
            }],
            timeout,
        )
        .unwrap();
        let own = Region::in_process(2, me);
        own.install_channel(channel);
        let mut regions: Vec<Arc<Region>> = vec![Arc::new(own), mirrors[0].1.clone()];
        if me == 1 {
            regions.swap(0, 1);
        }
        Mailboxes::new(me, regions.into())
    };
    [side(0, s_stream, s_keys), side(1, c_stream, c_keys)]
}

/// `n` ranks of this process, every pair joined by the channel (no mailbox files).
pub(super) fn world(n: usize, timeout: Duration) -> Vec<Mailboxes> {
    let token = |r: usize| T0 ^ ((r as u128 + 1) * 0x0101_0101);
    let mut connections: Vec<Vec<Connection>> = (0..n).map(|_| Vec::new()).collect();
    for server in 0..n {
        for client in server + 1..n {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let pair = Pair {
                server,
                client,
                world: n,
                server_token: token(server),
                client_token: token(client),
            };
            // A loaded machine (the model's tests make many worlds at once) may take seconds.
            let c = std::thread::spawn(move || auth::connect(addr, pair, None, deadline(20_000)).unwrap());
            let (s, _) = l.accept().unwrap();
            let token_of = |c: usize| (c == client).then_some(token(client));
            let (_, stream, keys) =
                auth::serve(s, server, n, token(server), &token_of, None, deadline(20_000)).unwrap();
            connections[server].push(Connection {
                rank: client,
                stream,
                keys,
            });
            let (stream, keys) = c.join().unwrap();
            connections[client].push(Connection {
                rank: server,
                stream,
                keys,
            });
        }
    }
    connections
        .into_iter()
        .enumerate()
        .map(|(me, c)| {
            let (channel, mirrors) = Channel::start(me, n, c, timeout).unwrap();
            let own = Arc::new(Region::in_process(n, me));
            own.install_channel(channel);
            let mut regions: Vec<Option<Arc<Region>>> = (0..n).map(|_| None).collect();
            regions[me] = Some(own);
            for (r, m) in mirrors {
                regions[r] = Some(m);
            }
            let regions: Vec<Arc<Region>> = regions.into_iter().map(Option::unwrap).collect();
            Mailboxes::new(me, regions.into())
        })
        .collect()
}

fn ops<'a>(boxes: &'a Mailboxes, sends: &[u64], recvs: &[u64], timeout: Duration) -> PairOps<'a> {
    with(boxes, 1 - boxes.rank, sends, recvs, timeout)
}

fn with<'a>(
    boxes: &'a Mailboxes,
    peer: usize,
    sends: &[u64],
    recvs: &[u64],
    timeout: Duration,
) -> PairOps<'a> {
    let op = |&count: &u64| OpDesc {
        count,
        dtype: 7,
        captured: false,
        nccl_memory: 0,
        part: P2P,
    };
    PairOps {
        boxes,
        peer,
        sends: sends.iter().map(op).collect(),
        recvs: recvs.iter().map(op).collect(),
        timeout,
    }
}

const SECOND: Duration = Duration::from_secs(1);

#[test]
fn operations_and_collectives_are_checked_through_mirrors_and_a_mismatch_fails_both() {
    for secret in [None, Some(&b"job secret"[..])] {
        let [a, b] = two(secret, 5 * SECOND);
        // Far more than a ring holds, grouped differently on each side.
        let counts: Vec<u64> = (1..=300).collect();
        let sent = counts.clone();
        let ta = std::thread::spawn(move || {
            let r = verify(&[ops(&a, &sent, &[7], 5 * SECOND)], &[]);
            (r, a)
        });
        let tb = std::thread::spawn(move || {
            let mut r = verify(&[ops(&b, &[7], &[], 5 * SECOND)], &[]);
            for c in &counts {
                r = r.and_then(|()| verify(&[ops(&b, &[], &[*c], 5 * SECOND)], &[]));
            }
            (r, b)
        });
        let (ra, a) = ta.join().unwrap();
        let (rb, b) = tb.join().unwrap();
        ra.unwrap();
        rb.unwrap();
        // Collectives, past the ring too.
        let coll = |n: u64| CollDesc {
            kind: CollKind::AllGather,
            count: n,
            dtype: 7,
            redop: NONE,
            root: NONE,
            captured: false,
            nccl_memory: 0,
        };
        let colls: Vec<CollDesc> = (1..=100).map(coll).collect();
        let c2 = colls.clone();
        let c = |boxes: &Mailboxes, v: &[CollDesc]| {
            verify(
                &[],
                &[CollOps {
                    boxes,
                    ops: v.into(),
                    timeout: 5 * SECOND,
                }],
            )
        };
        let ta = std::thread::spawn(move || (c(&a, &colls), a));
        let tb = std::thread::spawn(move || (c(&b, &c2), b));
        let (ra, a) = ta.join().unwrap();
        let (rb, b) = tb.join().unwrap();
        ra.unwrap();
        rb.unwrap();
        // Issue 9's mismatch: both ranks refuse it, naming both counts. (Each first sees
        // that the other checked its 300 operations: a rank whose ring is still full finds
        // the mismatch before it can publish, and its peer then sees it broken instead.)
        let until = deadline(2_000);
        while a.regions[1].checked(0, Dir::Send) < 300 || b.regions[0].checked(1, Dir::Recv) < 300 {
            assert!(Instant::now() < until, "the checked counters did not arrive");
            std::thread::yield_now();
        }
        let ta = std::thread::spawn(move || verify(&[ops(&a, &[4_194_304], &[], 5 * SECOND)], &[]));
        let tb = std::thread::spawn(move || verify(&[ops(&b, &[], &[3_145_728], 5 * SECOND)], &[]));
        for r in [ta.join().unwrap(), tb.join().unwrap()] {
            assert!(
                matches!(&r, Err(Failure::Mismatch(m)) if m.contains("4194304") && m.contains("3145728")),
                "{secret:?}: {r:?}"
            );
        }
    }
}

#[test]
fn four_ranks_agree_on_collectives_and_a_ring_of_sends_and_all_refuse_a_difference() {
    let coll = CollDesc::f32_sum;
    let n = 4;
    let run = |ranks: Vec<Mailboxes>, last: Vec<u64>| {
        let threads: Vec<_> = ranks
            .into_iter()
            .zip(last)
            .map(|(b, last)| {
                std::thread::spawn(move || {
                    let me = b.rank;
                    let c = |count: u64| CollOps {
                        boxes: &b,
                        ops: [coll(count)].into_iter().collect(),
                        timeout: 5 * SECOND,
                    };
                    // Past the ring, one collective per group, with a send round the ring
                    // between them.
                    let mut r = Ok(());
                    for i in 1..=100u64 {
                        r = r.and_then(|()| verify(&[], &[c(i)]));
                        let to = |peer: usize, sends: &[u64], recvs: &[u64]| {
                            with(&b, peer, sends, recvs, 5 * SECOND)
                        };
                        r = r.and_then(|()| {
                            verify(
                                &[to((me + 1) % n, &[i], &[]), to((me + n - 1) % n, &[], &[i])],
                                &[],
                            )
                        });
                    }
                    (r.and_then(|()| verify(&[], &[c(last)])), b)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>()
    };
    let done = run(world(n, 5 * SECOND), vec![7; n]);
    let mut ranks = Vec::new();
    for (r, (res, b)) in done.into_iter().enumerate() {
        assert_eq!(res, Ok(()), "rank {r}");
        ranks.push(b);
    }
    // Rank 3's next all_reduce differs: every rank refuses it.
    for (r, (res, _)) in run(ranks, {
        let mut v = vec![9; n];
        v[n - 1] = 10;
        v
    })
    .into_iter()
    .enumerate()
    {
        assert!(
            matches!(&res, Err(Failure::Mismatch(m)) if m.contains("10") && m.contains('9')),
            "rank {r}: {res:?}"
        );
    }
}

#[test]
fn heartbeats_and_broken_notes_cross_and_a_closed_peer_reads_as_broken() {
    let [a, b] = two(None, 5 * SECOND);
    let now = now_ms();
    b.regions[1].set_heartbeat(now, true);
    let until = deadline(2_000);
    while !a.regions[1].busy_and_alive(now_ms(), 1_000) {
        assert!(Instant::now() < until, "the heartbeat did not arrive");
        std::thread::yield_now();
    }
    b.regions[1].set_broken();
    let r = verify(&[ops(&a, &[4], &[], 5 * SECOND)], &[]);
    assert_eq!(r, Err(Failure::PeerBroken(1)));
    // Dropping a rank's own region ends its receiver and closes the connection: the other's
    // mirror reads as broken at once.
    let [c, d] = two(None, 5 * SECOND);
    let t = Instant::now();
    drop(d);
    assert!(t.elapsed() < SECOND, "dropping waited {:?}", t.elapsed());
    let r = verify(&[ops(&c, &[4], &[], 5 * SECOND)], &[]);
    assert_eq!(r, Err(Failure::PeerBroken(1)));
    assert!(t.elapsed() < 2 * SECOND);
}

/// A client that passed the handshake as rank 1, then writes raw what `bytes` makes of its
/// session and rank 0's. Returns rank 0's side, and the client's connection and session.
fn raw_peer(bytes: impl FnOnce(&Keys, &Keys) -> Vec<u8>) -> (Mailboxes, TcpStream, Keys) {
    let (served, connected) = handshake(None, move |addr| {
        auth::connect(addr, pair(), None, deadline(2_000)).unwrap()
    });
    let (_, stream, keys) = served.unwrap();
    let (mut peer, peer_keys) = connected;
    peer.write_all(&bytes(&peer_keys, &keys)).unwrap();
    let (channel, mirrors) = Channel::start(
        0,
        2,
        vec![Connection {
            rank: 1,
            stream,
            keys,
        }],
        5 * SECOND,
    )
    .unwrap();
    let own = Region::in_process(2, 0);
    own.install_channel(channel);
    (
        Mailboxes::new(0, vec![Arc::new(own), mirrors[0].1.clone()].into()),
        peer,
        peer_keys,
    )
}

#[test]
fn forged_replayed_or_unknown_frames_end_the_connection() {
    let publish = |index: u64, count: u64| {
        let [w0, w1] = OpDesc {
            count,
            dtype: 7,
            captured: false,
            nccl_memory: 0,
            part: P2P,
        }
        .encode();
        [1, 1, index, w0, w1]
    };
    type Bytes = Box<dyn FnOnce(&Keys, &Keys) -> Vec<u8> + Send>;
    let cases: Vec<(&str, Bytes)> = vec![
        (
            "honest",
            Box::new(move |k: &Keys, _: &Keys| record_for_test(k, 0, &[publish(0, 4)])),
        ),
        (
            "a flipped bit",
            Box::new(move |k: &Keys, _: &Keys| {
                let mut f = record_for_test(k, 0, &[publish(0, 4)]);
                f[24] ^= 1;
                f
            }),
        ),
        (
            "a replayed frame",
            Box::new(move |k: &Keys, _: &Keys| {
                let f = record_for_test(k, 0, &[publish(0, 4)]);
                [f.clone(), f].concat()
            }),
        ),
        (
            "a record of rank 0's reflected",
            Box::new(move |_: &Keys, rank0: &Keys| record_for_test(rank0, 0, &[publish(0, 4)])),
        ),
        (
            "an unknown kind",
            Box::new(move |k: &Keys, _: &Keys| record_for_test(k, 0, &[[99, 0, 0, 0, 0]])),
        ),
        (
            "a bad direction",
            Box::new(move |k: &Keys, _: &Keys| record_for_test(k, 0, &[[1, 2, 0, 4, 7]])),
        ),
        (
            "entry u64::MAX",
            Box::new(move |k: &Keys, _: &Keys| record_for_test(k, 0, &[publish(u64::MAX, 4)])),
        ),
        (
            "a record of no frames",
            Box::new(move |k: &Keys, _: &Keys| record_for_test(k, 0, &[])),
        ),
        (
            "more frames than a record holds",
            Box::new(move |k: &Keys, _: &Keys| {
                let frames: Vec<[u64; 5]> = (0..=MAX_FRAMES as u64).map(|i| publish(i, 4)).collect();
                record_for_test(k, 0, &frames)
            }),
        ),
        (
            "half a frame",
            Box::new(move |k: &Keys, _: &Keys| record_for_test(k, 0, &[publish(0, 4)])[..30].to_vec()),
        ),
    ];
    for (what, bytes) in cases {
        let (a, peer, _) = raw_peer(bytes);
        let wanted = if what == "a replayed frame" { 2 } else { 1 };
        // The honest frame publishes a receive of 4 (the replay: then a second one, refused).
        let r = verify(
            &[ops(&a, &vec![4; wanted], &[], 300 * Duration::from_millis(1))],
            &[],
        );
        drop(peer);
        match what {
            "honest" => assert_eq!(r, Ok(()), "{what}"),
            "a replayed frame" | "half a frame" => {
                // Dropping the peer closed the connection: broken either way, never accepted.
                assert!(
                    matches!(r, Err(Failure::PeerBroken(1) | Failure::Timeout { .. })),
                    "{what}: {r:?}"
                )
            }
            _ => assert_eq!(r, Err(Failure::PeerBroken(1)), "{what}"),
        }
    }
}

/// The frame that publishes entry `index` of a 4-element f32 send (a rank's first kind of
/// frame), as a peer would write it.
fn publish(index: u64) -> [u64; 5] {
    let [w0, w1] = OpDesc {
        count: 4,
        dtype: 7,
        ..OpDesc::default()
    }
    .encode();
    [1, 1, index, w0, w1]
}

#[test]
fn a_record_is_applied_whole_or_not_at_all() {
    let (a, peer, _) = raw_peer(move |k, _| record_for_test(k, 0, &[publish(0), publish(1)]));
    assert_eq!(verify(&[ops(&a, &[4, 4], &[], 2 * SECOND)], &[]), Ok(()));
    drop(peer);
    // An honest entry and a frame no handoff writes, in one record: the entry is not applied.
    let (a, peer, _) = raw_peer(move |k, _| record_for_test(k, 0, &[publish(0), [99, 0, 0, 0, 0]]));
    assert_eq!(
        verify(&[ops(&a, &[4], &[], 2 * SECOND)], &[]),
        Err(Failure::PeerBroken(1))
    );
    assert_eq!(a.regions[1].read(0, Dir::Recv, 0), None);
    drop(peer);
}

#[test]
fn checked_counters_a_verification_leaves_reach_the_peer_without_another() {
    // Rank 1 posts a whole ring of receives, then rank 0 the sends: rank 1 leaves with its
    // last checked counters held back. Rank 1 then verifies nothing more, yet rank 0's next
    // ring of sends, whose last needs the slot the last counter frees, must be published.
    let [a, b] = two(None, 5 * SECOND);
    let n = crate::nccl::verify::mailbox::RING;
    let ring: Vec<u64> = (1..=n).collect();
    let sent = ring.clone();
    let tb = std::thread::spawn(move || (verify(&[ops(&b, &[], &ring, 5 * SECOND)], &[]), b));
    std::thread::sleep(Duration::from_millis(100));
    verify(&[ops(&a, &sent, &[], 5 * SECOND)], &[]).unwrap();
    let (rb, b) = tb.join().unwrap();
    rb.unwrap();
    let again = sent.clone();
    let ta = std::thread::spawn(move || verify(&[ops(&a, &again, &[], 5 * SECOND)], &[]));
    let t = Instant::now();
    while b.regions[0].read(1, Dir::Send, 2 * n - 1).is_none() {
        assert!(
            t.elapsed() < 2 * SECOND,
            "rank 0's send past the ring was not published: rank 1's counters never left"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!(
        "channel: a send past a full ring was published after {:?}",
        t.elapsed()
    );
    verify(&[ops(&b, &[], &sent, 5 * SECOND)], &[]).unwrap();
    ta.join().unwrap().unwrap();
}

#[test]
fn a_replayed_frame_is_refused_while_the_connection_stays_open() {
    let (a, peer, _) = raw_peer(move |k, _| {
        [
            record_for_test(k, 0, &[publish(0)]),
            record_for_test(k, 0, &[publish(1)]),
        ]
        .concat()
    });
    let r = verify(&[ops(&a, &[4, 4], &[], 2 * SECOND)], &[]);
    assert_eq!(
        r,
        Err(Failure::PeerBroken(1)),
        "the second frame reused sequence number 0"
    );
    assert_eq!(a.regions[1].status(), BROKEN);
    drop(peer);
}

#[test]
fn a_peer_that_stops_reading_bounds_the_writer_by_the_timeout() {
    // The peer's side is a raw connection that never reads: its socket buffers fill.
    let (served, connected) = handshake(None, |addr| {
        auth::connect(addr, pair(), None, deadline(2_000)).unwrap()
    });
    let (_, stream, keys) = served.unwrap();
    let timeout = Duration::from_millis(300);
    let (channel, mirrors) = Channel::start(
        0,
        2,
        vec![Connection {
            rank: 1,
            stream,
            keys,
        }],
        timeout,
    )
    .unwrap();
    let own = Region::in_process(2, 0);
    own.install_channel(channel);
    let mirror = mirrors[0].1.clone();
    let mut longest = Duration::ZERO;
    let started = Instant::now();
    let mut n = 0u64;
    while mirror.status() != BROKEN {
        assert!(
            started.elapsed() < 60 * SECOND,
            "the socket never filled ({n} frames)"
        );
        let t = Instant::now();
        own.set_checked(1, Dir::Send, n);
        longest = longest.max(t.elapsed());
        // The watchdog's heartbeat never waits, full socket or not: a wait would be the
        // socket's timeout; half of it leaves room for a loaded machine's scheduling (50 ms
        // once failed on a 2-core machine running the suite in parallel).
        let t = Instant::now();
        own.set_heartbeat(n, false);
        assert!(t.elapsed() < timeout / 2, "a heartbeat waited {:?}", t.elapsed());
        n += 1;
    }
    assert!(
        longest >= timeout && longest < timeout + SECOND,
        "the full socket's wait was {longest:?} (timeout {timeout:?}, {n} frames)"
    );
    eprintln!("channel: a peer that stopped reading took {n} frames, then one waited {longest:?}");
    drop(connected);
}

#[test]
fn the_handshake_refuses_who_cannot_prove_it_is_a_rank() {
    // Wrong channel token (a process that saw the address but not the card).
    let wrong = Pair {
        client_token: T1 ^ 1,
        ..pair()
    };
    let (s, c) = handshake(None, move |addr| {
        auth::connect(addr, wrong, None, deadline(2_000)).map(drop)
    });
    assert!(s.is_err(), "the server accepted a wrong token");
    assert!(
        c.unwrap_err().contains("could not prove"),
        "the client took the server's proof"
    );
    // A rank that is not expected.
    let stranger = Pair { client: 5, ..pair() };
    let (s, c) = handshake(None, move |addr| {
        auth::connect(addr, stranger, None, deadline(2_000)).map(drop)
    });
    assert!(s.err().unwrap().contains("not a peer this rank expects"));
    assert!(c.unwrap_err().contains("refused"));
    // Different secrets, and a secret on one side only.
    let (s, c) = handshake(Some(b"one"), |addr| {
        auth::connect(addr, pair(), Some(b"two"), deadline(2_000)).map(drop)
    });
    assert!(s.is_err());
    assert!(c.unwrap_err().contains("could not prove"));
    let (s, c) = handshake(Some(b"one"), |addr| {
        auth::connect(addr, pair(), None, deadline(2_000)).map(drop)
    });
    assert!(s.err().unwrap().contains("differ on having a shared secret"));
    assert!(c.unwrap_err().contains("has a shared secret"));
    // Garbage, and a right hello with a guessed proof.
    let (s, _) = handshake(None, |addr| {
        let mut t = TcpStream::connect(addr).unwrap();
        t.write_all(&[0xab; 200]).unwrap();
    });
    assert!(s.err().unwrap().contains("not a handoff hello"));
    let (s, _) = handshake(None, |addr| {
        let mut t = TcpStream::connect(addr).unwrap();
        let mut hello = 0x4844_4f46_4656_4332u64.to_le_bytes().to_vec();
        for w in [1u32, 0, 2, 0] {
            hello.extend_from_slice(&w.to_le_bytes());
        }
        hello.extend_from_slice(&[0; 48]);
        t.write_all(&hello).unwrap();
        let mut reply = [0u8; 64];
        t.read_exact(&mut reply).unwrap();
        let mut rest = Vec::new();
        let _ = t.read_to_end(&mut rest);
        rest
    });
    assert!(s.err().unwrap().contains("could not prove"));
}

#[test]
fn a_trickling_client_is_cut_off_at_the_deadline() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let trickle = std::thread::spawn(move || {
        let mut t = TcpStream::connect(addr).unwrap();
        for _ in 0..40 {
            if t.write_all(&[0x48]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let (s, _) = l.accept().unwrap();
    let t = Instant::now();
    let token_of = |_: usize| Some(T1);
    let r = auth::serve(s, 0, 2, T0, &token_of, None, deadline(500));
    let took = t.elapsed();
    assert!(r.is_err());
    assert!(took < Duration::from_millis(800), "held for {took:?}");
    trickle.join().unwrap();
}

/// The records `s` carries (the frames of each, opened with `keys`, the session of the side
/// they are sent to) until `enough` says so of those read, or `within` passes.
fn records_until(
    s: &mut TcpStream,
    keys: &Keys,
    enough: impl Fn(&[Vec<[u64; 5]>]) -> bool,
    within: Duration,
) -> Vec<Vec<[u64; 5]>> {
    s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
    let (mut buf, mut records, mut seq) = (Vec::new(), Vec::new(), 0);
    let until = Instant::now() + within;
    while !enough(&records) && Instant::now() < until {
        let mut b = [0u8; 4096];
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&b[..n]),
            Err(_) => continue,
        }
        records.extend(open_for_test(keys, &mut seq, &mut buf));
    }
    records
}

/// The values of the checked counters of the peer's receives among `records`.
fn recvs_checked(records: &[Vec<[u64; 5]>]) -> Vec<u64> {
    records
        .iter()
        .flatten()
        .filter(|f| f[..2] == [2, 1])
        .map(|f| f[2])
        .collect()
}

#[test]
fn a_stream_of_verifications_sends_one_record_each_and_a_counter_each_half_ring() {
    let n = crate::nccl::verify::mailbox::RING;
    let (a, mut peer, keys) = raw_peer(move |k, _| {
        (0..n)
            .flat_map(|i| record_for_test(k, i, &[publish(i)]))
            .collect()
    });
    for _ in 0..n {
        verify(&[ops(&a, &[4], &[], 2 * SECOND)], &[]).unwrap();
    }
    let records = records_until(
        &mut peer,
        &keys,
        |r| recvs_checked(r).last() == Some(&n),
        2 * SECOND,
    );
    let publishes = records.iter().flatten().filter(|f| f[0] == 1).count() as u64;
    assert_eq!(publishes, n, "{records:?}");
    assert!(
        records.len() as u64 <= n + 2,
        "about one record a verification: {records:?}"
    );
    // Half a ring and a whole one (each with the entry of the verification that made it due);
    // the receiver thread may send one between verifications.
    let counters = recvs_checked(&records);
    assert!(counters.len() <= 4, "{counters:?}");
    assert_eq!(
        counters.last(),
        Some(&n),
        "the last counter is due and sent: {records:?}"
    );
    eprintln!(
        "channel: {n} verified sends took {} records, counters {counters:?}",
        records.len()
    );
}

#[test]
fn a_counter_held_back_reaches_the_peer_from_the_receiver_thread() {
    let (a, mut peer, keys) = raw_peer(move |k, _| record_for_test(k, 0, &[publish(0)]));
    verify(&[ops(&a, &[4], &[], 2 * SECOND)], &[]).unwrap();
    let t = Instant::now();
    let records = records_until(&mut peer, &keys, |r| recvs_checked(r) == [1], 2 * SECOND);
    assert_eq!(recvs_checked(&records), [1], "{records:?}");
    eprintln!("channel: a held counter reached the peer {:?} after", t.elapsed());
}

#[test]
fn a_verification_that_waits_sends_the_counters_it_holds() {
    let (a, mut peer, keys) = raw_peer(move |k, _| record_for_test(k, 0, &[publish(0)]));
    // The send is checked at once (its counter held back), the receive never matched: the
    // verification waits, its link corked throughout (the receiver thread sends nothing),
    // until its timeout.
    let waiting = std::thread::spawn(move || verify(&[ops(&a, &[4], &[4], 2 * SECOND)], &[]));
    let records = records_until(&mut peer, &keys, |r| !recvs_checked(r).is_empty(), SECOND);
    assert!(
        !waiting.is_finished(),
        "the verification ended before its timeout"
    );
    assert_eq!(recvs_checked(&records), [1], "{records:?}");
    assert!(matches!(waiting.join().unwrap(), Err(Failure::Timeout { .. })));
}
