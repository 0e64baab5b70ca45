//! Setting up verification when a communicator is made: every rank tells every other, through
//! an all-gather of [`Card`]s, whether it verifies, where its mailbox file is, which kernel and
//! mount namespace it runs in and where its channel listens; then each pair of ranks shares
//! mailbox files if both can map the other's (same boot, same mount namespace, and the file
//! there carrying the token of the card), and otherwise connects through the verification
//! channel ([`crate::nccl::verify::channel`]). A communicator may mix both. Any failure is an error on every
//! rank, so no rank verifies alone.
//!
//! # Variables
//! - `HANDOFF_VERIFY_ADDR`: the address (`IP` or `IP:port`) this rank's channel listens on.
//!   Else the local address of a UDP socket connected towards `MASTER_ADDR` when that is set
//!   (the interface that reaches the job's master); else that of the default route; else
//!   127.0.0.1. The listener is open only while the communicator is being made.
//! - `HANDOFF_VERIFY_CHANNEL=tcp`: every pair uses the channel, even on one host (tests and
//!   benchmarks); `auto` (the default) shares mailbox files where it can.
//! - `HANDOFF_SECRET` or `HANDOFF_SECRET_FILE`: the job's shared secret, which every channel
//!   connection then proves (see [`crate::nccl::verify::auth`]); without it, a connection proves only the
//!   random channel tokens of the two cards.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::nccl::verify::auth::{self, Pair};
use crate::nccl::verify::channel::{Channel, Connection};
use crate::nccl::verify::mailbox::{Region, mailbox_dir};
use crate::nccl::verify::wire::{CARD_WORDS, Card, HostId, check_cards};

/// What verification's setup made.
pub(crate) struct Settled {
    /// Every rank's region, by rank: this rank's own, mapped files, and mirrors of the peers
    /// reached through the channel.
    pub(crate) regions: Arc<[Arc<Region>]>,
    /// The peers reached through the channel.
    pub(crate) remote: Vec<usize>,
    /// Connections this rank's listener refused.
    pub(crate) refused: usize,
}

/// How many handshakes a listener serves at once (each on its own thread, bounded by
/// [`auth::HANDSHAKE_WAIT`]); connections beyond wait in the listener's backlog until one
/// ends.
const MAX_HANDSHAKES: usize = 32;

/// This rank's kernel and mount namespace, zero where unknown.
pub(crate) fn host_id() -> HostId {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .and_then(|s| u128::from_str_radix(&s.trim().replace('-', ""), 16).ok())
        .unwrap_or(0);
    let mounts = std::fs::metadata("/proc/self/ns/mnt").map_or(0, |m| m.ino());
    HostId { boot, mounts }
}

/// Whether `HANDOFF_VERIFY_CHANNEL` forces every pair onto the channel.
fn forced() -> std::result::Result<bool, String> {
    match std::env::var("HANDOFF_VERIFY_CHANNEL").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("" | "auto") => Ok(false),
        Ok("tcp") => Ok(true),
        Ok(v) => Err(format!("HANDOFF_VERIFY_CHANNEL={v}: expected tcp or auto")),
        Err(e) => Err(format!("HANDOFF_VERIFY_CHANNEL: {e}")),
    }
}

/// Where this rank's channel listens (see the module's "Variables").
pub(crate) fn listen_addr() -> std::result::Result<SocketAddr, String> {
    if let Ok(v) = std::env::var("HANDOFF_VERIFY_ADDR") {
        return v
            .parse::<SocketAddr>()
            .or_else(|_| v.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 0)))
            .map_err(|_| format!("HANDOFF_VERIFY_ADDR={v}: expected an IP address, or IP:port"));
    }
    let towards = |to: SocketAddr| -> std::io::Result<IpAddr> {
        let any: SocketAddr = if to.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let u = UdpSocket::bind(any)?;
        // A UDP connect sends nothing: it only picks the route, and so the local address.
        u.connect(to)?;
        Ok(u.local_addr()?.ip())
    };
    if let Ok(master) = std::env::var("MASTER_ADDR") {
        let to = (master.as_str(), 1)
            .to_socket_addrs()
            .map_err(|e| format!("MASTER_ADDR={master}: {e}"))?
            .next()
            .ok_or_else(|| format!("MASTER_ADDR={master} names no address"))?;
        let ip = towards(to).map_err(|e| format!("no route towards MASTER_ADDR={master}: {e}"))?;
        return Ok(SocketAddr::new(ip, 0));
    }
    // An address of TEST-NET-1, never reached: only the default route's interface is asked.
    match towards((Ipv4Addr::new(192, 0, 2, 1), 9).into()) {
        Ok(ip) if !ip.is_unspecified() => Ok(SocketAddr::new(ip, 0)),
        _ => Ok((Ipv4Addr::LOCALHOST, 0).into()),
    }
}

/// What a rank's setup takes from its environment (see the module's "Variables").
pub(crate) struct Env {
    /// Where its mailbox file goes.
    pub(crate) dir: PathBuf,
    /// Every pair uses the channel.
    pub(crate) forced: bool,
    /// Where its channel listens, or why it cannot.
    pub(crate) addr: std::result::Result<SocketAddr, String>,
    pub(crate) secret: Option<Vec<u8>>,
}

impl Env {
    /// # Errors
    /// A variable is malformed, or the secret cannot be read.
    fn read() -> std::result::Result<Env, String> {
        Ok(Env {
            dir: mailbox_dir(),
            forced: forced()?,
            addr: listen_addr(),
            secret: auth::job_secret()?,
        })
    }
}

/// This rank's part before the first exchange.
struct Mine {
    region: Region,
    path: PathBuf,
    listener: Option<TcpListener>,
    /// Why there is no listener.
    no_listener: String,
    token: u128,
    secret: Option<Vec<u8>>,
    forced: bool,
}

fn prepare(
    world: usize,
    rank: usize,
    token: u64,
    env: std::result::Result<Env, String>,
) -> std::result::Result<Mine, String> {
    let env = env?;
    let channel_token = u128::from_le_bytes(auth::random::<16>()?);
    let (listener, no_listener) = match env.addr.and_then(|a| {
        TcpListener::bind(a).map_err(|e| format!("binding the verification channel to {a}: {e}"))
    }) {
        Ok(l) => (Some(l), String::new()),
        Err(e) => (None, e),
    };
    let (region, path) = Region::create_file(&env.dir, world, rank, token).map_err(|e| e.to_string())?;
    Ok(Mine {
        region,
        path,
        listener,
        no_listener,
        token: channel_token,
        secret: env.secret,
        forced: env.forced,
    })
}

/// Every rank's part of one all-gather: `words` from every rank, in rank order.
pub(crate) type Gather<'a> = dyn FnMut(&[u64]) -> Result<Vec<u64>> + 'a;

fn setup_error(detail: impl Into<String>) -> Error {
    Error::Setup {
        detail: detail.into(),
    }
}

/// Sets up verification for rank `rank` of `world` (`verified` is this rank's setting; every
/// rank must have the same), with `gather` as the all-gather: `None` when no rank verifies.
/// `token` is the mailbox's random token; `timeout` bounds every wait of the setup, and then
/// a full socket's.
///
/// # Errors
/// [`Error::Setup`] on every rank when the ranks disagree or any rank fails (each failing rank
/// says why); errors of `gather`.
pub(crate) fn settle(
    rank: usize,
    world: usize,
    verified: bool,
    token: u64,
    timeout: Duration,
    cta_policy: Option<i32>,
    gather: &mut Gather<'_>,
) -> Result<Option<Settled>> {
    settle_in(
        rank,
        world,
        verified,
        token,
        timeout,
        cta_policy,
        gather,
        Env::read,
    )
}

/// [`settle`], with `env` for what it would read from the environment.
#[allow(clippy::too_many_arguments)]
pub(crate) fn settle_in(
    rank: usize,
    world: usize,
    verified: bool,
    token: u64,
    timeout: Duration,
    cta_policy: Option<i32>,
    gather: &mut Gather<'_>,
    env: impl FnOnce() -> std::result::Result<Env, String>,
) -> Result<Option<Settled>> {
    let mut problem = String::new();
    let mut mine = None;
    if verified {
        match prepare(world, rank, token, env()) {
            Ok(m) => mine = Some(m),
            Err(e) => problem = e,
        }
    }
    let removed = |m: &Option<Mine>| {
        if let Some(m) = m {
            let _ = std::fs::remove_file(&m.path);
        }
    };
    let card = |mine: &Option<Mine>| Card {
        verified,
        rank: rank as u32,
        world: world as u32,
        token,
        pid: std::process::id(),
        path: mine
            .as_ref()
            .map(|m| m.path.display().to_string())
            .unwrap_or_default(),
        host: host_id(),
        addr: mine
            .as_ref()
            .and_then(|m| m.listener.as_ref())
            .and_then(|l| l.local_addr().ok()),
        channel_token: mine.as_ref().map_or(0, |m| m.token),
        tuning: crate::nccl::verify::wire::tuning_digest(|k| match k {
            crate::nccl::verify::wire::CTA_POLICY_OPTION => cta_policy.map(|c| c.to_string()),
            _ => std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()),
        }),
    };
    let words = match card(&mine).encode() {
        Ok(w) => w,
        Err(e) => {
            // Every rank takes part in every exchange, so that each fails saying why, not
            // waiting for this one: this rank's card goes without its part, and the problem
            // with the next round's flags.
            removed(&mine);
            mine = None;
            problem = format!(
                "the mailbox path is too long for a communicator's card: set TMPDIR to a shorter \
                 folder ({e})"
            );
            card(&mine).encode().map_err(setup_error)?
        }
    };
    let card = card(&mine);
    let gathered = gather(&words).inspect_err(|_| removed(&mine))?;
    let cards: Vec<Card> = gathered
        .chunks(CARD_WORDS)
        .map(Card::decode)
        .collect::<std::result::Result<Vec<Card>, _>>()
        .and_then(|cards| {
            if cards.len() != world {
                return Err(format!("{} cards from a communicator of {world}", cards.len()));
            }
            check_cards(rank, &cards).map(|()| cards)
        })
        .map_err(|detail| {
            removed(&mine);
            setup_error(detail)
        })?;
    if !verified {
        // check_cards saw every rank unverified.
        return Ok(None);
    }

    // Second round: which peers' files each rank mapped. A pair shares files only if both did.
    let mut mapped: Vec<Option<Region>> = (0..world).map(|_| None).collect();
    if let Some(m) = &mine {
        for (r, c) in cards.iter().enumerate() {
            if r != rank && !m.forced && card.host.maybe_same(c.host) {
                mapped[r] = Region::open_file(std::path::Path::new(&c.path), world, r, c.token).ok();
            }
        }
    }
    let bitmap_words = world.div_ceil(64);
    let mut flags = verdict(&problem).to_vec();
    flags.resize(VERDICT_WORDS + bitmap_words, 0);
    for (r, m) in mapped.iter().enumerate() {
        if m.is_some() {
            flags[VERDICT_WORDS + r / 64] |= 1 << (r % 64);
        }
    }
    let all = gather(&flags);
    removed(&mine);
    let all = all?;
    let has = |of: usize, r: usize| all[of * flags.len() + VERDICT_WORDS + r / 64] >> (r % 64) & 1 == 1;
    if !problem.is_empty() {
        return Err(setup_error(problem));
    }
    if let Some((bad, why)) = first_problem(&all, flags.len()) {
        return Err(setup_error(format!(
            "rank {bad} could not set up verification: {why}"
        )));
    }
    let m = mine.expect("a verified rank without a problem has its part");
    let remote: Vec<usize> = (0..world)
        .filter(|&r| r != rank && !(has(rank, r) && has(r, rank)))
        .collect();

    // Third round, after connecting: did every rank connect to every remote peer?
    let deadline = Instant::now() + timeout;
    let (connections, refused) = match connect_all(rank, world, &m, &cards, &remote, deadline) {
        Ok(c) => c,
        Err(e) => {
            problem = e;
            (Vec::new(), 0)
        }
    };
    let started = if problem.is_empty() {
        Channel::start(rank, world, connections, timeout)
            .inspect_err(|e| problem = e.clone())
            .ok()
    } else {
        None
    };
    let ok = gather(&verdict(&problem))?;
    if !problem.is_empty() {
        return Err(setup_error(problem));
    }
    if let Some((bad, why)) = first_problem(&ok, VERDICT_WORDS) {
        return Err(setup_error(format!(
            "rank {bad} could not connect its verification channel: {why}"
        )));
    }
    let (channel, mirrors) = started.expect("started without a problem");
    let mut regions: Vec<Option<Arc<Region>>> = mapped
        .into_iter()
        .enumerate()
        .map(|(r, m)| m.filter(|_| !remote.contains(&r)).map(Arc::new))
        .collect();
    for (r, mirror) in mirrors {
        regions[r] = Some(mirror);
    }
    m.region.install_channel(channel);
    regions[rank] = Some(Arc::new(m.region));
    let regions = regions
        .into_iter()
        .map(|r| r.expect("every rank's region is mapped or mirrored"))
        .collect();
    Ok(Some(Settled {
        regions,
        remote,
        refused,
    }))
}

/// Words of a rank's verdict in an exchange: whether it succeeded, and the start of why not.
const VERDICT_WORDS: usize = 1 + 24;

/// `problem` (empty: none) as a rank tells the others.
fn verdict(problem: &str) -> [u64; VERDICT_WORDS] {
    let mut w = [0u64; VERDICT_WORDS];
    w[0] = u64::from(problem.is_empty());
    let text = problem.as_bytes();
    for (i, chunk) in text.chunks(8).take(VERDICT_WORDS - 1).enumerate() {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        w[1 + i] = u64::from_le_bytes(b);
    }
    w
}

/// The first rank whose verdict, at the start of each `stride` words of `all`, is a problem,
/// and what it said (printable characters only: the text is a peer's).
fn first_problem(all: &[u64], stride: usize) -> Option<(usize, String)> {
    let (bad, v) = all.chunks(stride).enumerate().find(|(_, v)| v[0] != 1)?;
    let text: String = v[1..v.len().min(VERDICT_WORDS)]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .take_while(|&b| b != 0)
        .map(|b| if (0x20..0x7f).contains(&b) { b as char } else { '?' })
        .collect();
    let why = if text.is_empty() {
        "its error says why".into()
    } else if text.len() == (VERDICT_WORDS - 1) * 8 {
        format!("{text}… (its error says the rest)")
    } else {
        text
    };
    Some((bad, why))
}

/// Connects to every remote peer of lower rank, then serves every one of higher rank, each
/// authenticated, by `deadline`. Lower ranks connect first, so the order cannot deadlock: rank
/// 0 serves at once, and each rank serves once its own connections are made. Returns the
/// connections and how many this rank's listener refused.
fn connect_all(
    rank: usize,
    world: usize,
    m: &Mine,
    cards: &[Card],
    remote: &[usize],
    deadline: Instant,
) -> std::result::Result<(Vec<Connection>, usize), String> {
    let secret = m.secret.as_deref();
    let mut connections = Vec::new();
    for &r in remote.iter().filter(|&&r| r < rank) {
        let addr = cards[r].addr.ok_or_else(|| {
            format!(
                "rank {r} has no verification channel (its error says why) and rank {rank} is not on its host"
            )
        })?;
        let pair = Pair {
            server: r,
            client: rank,
            world,
            server_token: cards[r].channel_token,
            client_token: m.token,
        };
        let (stream, keys) = auth::connect(addr, pair, secret, deadline)?;
        connections.push(Connection {
            rank: r,
            stream,
            keys,
        });
    }
    let expected: Vec<usize> = remote.iter().copied().filter(|&r| r > rank).collect();
    if expected.is_empty() {
        return Ok((connections, 0));
    }
    let listener = m.listener.as_ref().ok_or_else(|| {
        format!(
            "rank {rank} must serve ranks {expected:?} through its verification channel, but has \
             none: {}",
            m.no_listener
        )
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("rank {rank}'s verification listener: {e}"))?;
    let tokens: Arc<Vec<Option<u128>>> = Arc::new(
        (0..world)
            .map(|r| expected.contains(&r).then_some(cards[r].channel_token))
            .collect(),
    );
    let (tx, rx) = mpsc::channel();
    let live = Arc::new(());
    let mut refused = 0usize;
    let mut last_refusal = String::new();
    let mut served: Vec<usize> = Vec::new();
    while served.len() < expected.len() {
        if Instant::now() >= deadline {
            return Err(format!(
                "rank {rank}'s verification channel: ranks {:?} did not connect within the \
                 communicator's timeout{}",
                expected
                    .iter()
                    .filter(|r| !served.contains(r))
                    .collect::<Vec<_>>(),
                if refused > 0 {
                    format!("; {refused} connection(s) refused, the last: {last_refusal}")
                } else {
                    String::new()
                }
            ));
        }
        // With every handshake slot taken, a connection waits in the backlog, unaccepted.
        let accepted = if Arc::strong_count(&live) <= MAX_HANDSHAKES {
            listener.accept().map(Some)
        } else {
            Ok(None)
        };
        match accepted {
            Ok(None) => {}
            Ok(Some((stream, _))) => {
                let (tx, tokens, live, secret) = (tx.clone(), tokens.clone(), live.clone(), m.secret.clone());
                let my_token = m.token;
                let _ = std::thread::Builder::new()
                    .name(format!("handoff-verify-r{rank}-handshake"))
                    .spawn(move || {
                        let _live = live;
                        let token_of = |c: usize| tokens.get(c).copied().flatten();
                        let r = auth::serve(
                            stream,
                            rank,
                            world,
                            my_token,
                            &token_of,
                            secret.as_deref(),
                            deadline,
                        );
                        let _ = tx.send(r);
                    });
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("rank {rank}'s verification listener: {e}")),
        }
        match rx.recv_timeout(Duration::from_millis(1)) {
            Ok(Ok((c, stream, keys))) if !served.contains(&c) => {
                served.push(c);
                connections.push(Connection {
                    rank: c,
                    stream,
                    keys,
                });
            }
            Ok(Ok((c, ..))) => {
                refused += 1;
                last_refusal = format!("a second connection as rank {c}");
            }
            Ok(Err(e)) => {
                refused += 1;
                last_refusal = e;
            }
            Err(_) => {}
        }
    }
    Ok((connections, refused))
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;
    use std::path::Path;
    use std::sync::{Condvar, Mutex};

    use super::*;
    use crate::nccl::verify::wire::PATH_BYTES;

    /// An all-gather between ranks on threads, each round given up after `limit`.
    struct Exchange {
        world: usize,
        rounds: Mutex<Vec<Vec<Option<Vec<u64>>>>>,
        arrived: Condvar,
        limit: Duration,
    }

    impl Exchange {
        fn new(world: usize, limit: Duration) -> Arc<Exchange> {
            Arc::new(Exchange {
                world,
                rounds: Mutex::new(Vec::new()),
                arrived: Condvar::new(),
                limit,
            })
        }

        fn gather(&self, rank: usize, round: usize, words: &[u64]) -> Result<Vec<u64>> {
            let mut rounds = self.rounds.lock().unwrap();
            while rounds.len() <= round {
                rounds.push(vec![None; self.world]);
            }
            rounds[round][rank] = Some(words.to_vec());
            self.arrived.notify_all();
            let until = Instant::now() + self.limit;
            while rounds[round].iter().any(Option::is_none) {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(setup_error(format!(
                        "the test's all-gather round {round} timed out"
                    )));
                }
                rounds = self.arrived.wait_timeout(rounds, left).unwrap().0;
            }
            Ok(rounds[round].iter().flat_map(|w| w.clone().unwrap()).collect())
        }
    }

    fn env(dir: &Path, forced: bool) -> Env {
        Env {
            dir: dir.to_path_buf(),
            forced,
            addr: Ok((Ipv4Addr::LOCALHOST, 0).into()),
            secret: None,
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("handoff-setup-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Rank `rank` of two, settled with `dir` for its mailbox; `first_round` runs when the
    /// cards are all in, before the rank goes on.
    fn rank(
        x: &Arc<Exchange>,
        rank: usize,
        dir: PathBuf,
        forced: bool,
        timeout: Duration,
        first_round: impl FnOnce(&[u64]) + Send + 'static,
    ) -> std::thread::JoinHandle<Result<Option<Settled>>> {
        let x = x.clone();
        std::thread::spawn(move || {
            let mut round = 0;
            let mut first_round = Some(first_round);
            let mut gather = |w: &[u64]| {
                let all = x.gather(rank, round, w);
                if let (Ok(all), Some(f)) = (&all, first_round.take()) {
                    f(all);
                }
                round += 1;
                all
            };
            settle_in(rank, 2, true, 7 + rank as u64, timeout, None, &mut gather, || {
                Ok(env(&dir, forced))
            })
        })
    }

    fn files(dir: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    }

    #[test]
    fn a_card_that_cannot_be_encoded_fails_every_rank_saying_why_and_leaves_no_file() {
        let short = scratch("short");
        // A folder whose mailbox path is longer than a card holds.
        let long = scratch(&"x".repeat(PATH_BYTES));
        let x = Exchange::new(2, Duration::from_secs(3));
        let r0 = rank(&x, 0, short.clone(), false, Duration::from_secs(5), |_| {});
        let r1 = rank(&x, 1, long.clone(), false, Duration::from_secs(5), |_| {});
        let (e0, e1) = (r0.join().unwrap().err(), r1.join().unwrap().err());
        let said = |e: &Option<Error>| match e {
            Some(Error::Setup { detail }) => detail.clone(),
            other => panic!("not a setup error: {other:?}"),
        };
        let (e0, e1) = (said(&e0), said(&e1));
        assert!(e1.contains("too long") && e1.contains("TMPDIR"), "rank 1: {e1}");
        assert!(
            e0.contains("rank 1 could not set up verification") && e0.contains("TMPDIR"),
            "rank 0: {e0}"
        );
        assert_eq!(
            files(&long),
            Vec::<PathBuf>::new(),
            "rank 1's mailbox file was left"
        );
        assert_eq!(
            files(&short),
            Vec::<PathBuf>::new(),
            "rank 0's mailbox file was left"
        );
        let _ = std::fs::remove_dir_all(short);
        let _ = std::fs::remove_dir_all(long);
    }

    #[test]
    fn silent_connections_do_not_keep_a_rank_out() {
        let dir = scratch("silent");
        let timeout = Duration::from_secs(8);
        let x = Exchange::new(2, timeout + Duration::from_secs(2));
        let silent: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let r0 = rank(&x, 0, dir.clone(), true, timeout, |_| {});
        let held = silent.clone();
        // Before rank 1 connects, 40 connections to rank 0's listener that never say a word:
        // more than its handshake slots.
        let r1 = rank(&x, 1, dir.clone(), true, timeout, move |all| {
            let card = Card::decode(&all[..CARD_WORDS]).unwrap();
            let addr = card.addr.expect("rank 0 listens");
            let mut held = held.lock().unwrap();
            for _ in 0..40 {
                held.push(TcpStream::connect(addr).unwrap());
            }
        });
        let t = Instant::now();
        let (s0, s1) = (r0.join().unwrap(), r1.join().unwrap());
        let took = t.elapsed();
        let s0 = s0.unwrap().expect("verified");
        let s1 = s1.unwrap().expect("verified");
        assert_eq!((s0.remote, s1.remote), (vec![1], vec![0]));
        assert!(
            took < timeout,
            "setup took {took:?}: the silent connections held rank 0's listener"
        );
        eprintln!(
            "setup: 40 silent connections delayed rank 1 by {took:?}; rank 0 refused {}",
            s0.refused
        );
        drop(silent);
        let _ = std::fs::remove_dir_all(dir);
    }
}
