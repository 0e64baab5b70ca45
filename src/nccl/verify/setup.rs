//! Setting up verification when a communicator is made: every rank tells every other, through
//! an all-gather of [`Card`]s, whether it verifies, where its mailbox file is, which kernel and
//! mount namespace it runs in and where its channel listens; then each pair of ranks shares
//! mailbox files if both can map the other's (same boot, same mount namespace, and the file
//! there carrying the token of the card), and otherwise connects through the verification
//! channel ([`super::channel`]). A communicator may mix both. Any failure is an error on every
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
//!   connection then proves (see [`super::auth`]); without it, a connection proves only the
//!   random channel tokens of the two cards.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use super::auth::{self, Pair};
use super::channel::{Channel, Connection};
use super::mailbox::{Region, mailbox_dir};
use super::wire::{CARD_WORDS, Card, HostId, check_cards};
use crate::error::{Error, Result};

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

/// How many handshakes a listener serves at once (each on its own thread, bounded by the
/// deadline); connections beyond are closed at once.
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

fn prepare(world: usize, rank: usize, token: u64) -> std::result::Result<Mine, String> {
    let forced = forced()?;
    let secret = auth::job_secret()?;
    let channel_token = u128::from_le_bytes(auth::random::<16>()?);
    let (listener, no_listener) = match listen_addr().and_then(|a| {
        TcpListener::bind(a).map_err(|e| format!("binding the verification channel to {a}: {e}"))
    }) {
        Ok(l) => (Some(l), String::new()),
        Err(e) => (None, e),
    };
    let (region, path) =
        Region::create_file(&mailbox_dir(), world, rank, token).map_err(|e| e.to_string())?;
    Ok(Mine {
        region,
        path,
        listener,
        no_listener,
        token: channel_token,
        secret,
        forced,
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
    gather: &mut Gather<'_>,
) -> Result<Option<Settled>> {
    let mut problem = String::new();
    let mut mine = None;
    if verified {
        match prepare(world, rank, token) {
            Ok(m) => mine = Some(m),
            Err(e) => problem = e,
        }
    }
    let removed = |m: &Option<Mine>| {
        if let Some(m) = m {
            let _ = std::fs::remove_file(&m.path);
        }
    };
    let card = Card {
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
        tuning: super::wire::tuning_digest(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned())),
    };
    let words = card.encode().map_err(setup_error)?;
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
    let mut flags = vec![0u64; 1 + bitmap_words];
    flags[0] = u64::from(problem.is_empty());
    for (r, m) in mapped.iter().enumerate() {
        if m.is_some() {
            flags[1 + r / 64] |= 1 << (r % 64);
        }
    }
    let all = gather(&flags);
    removed(&mine);
    let all = all?;
    let has = |of: usize, r: usize| all[of * flags.len() + 1 + r / 64] >> (r % 64) & 1 == 1;
    if !problem.is_empty() {
        return Err(setup_error(problem));
    }
    if let Some(bad) = (0..world).find(|&r| all[r * flags.len()] != 1) {
        return Err(setup_error(format!(
            "rank {bad} could not set up verification (its error says why)"
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
    let ok = gather(&[u64::from(problem.is_empty())])?;
    if !problem.is_empty() {
        return Err(setup_error(problem));
    }
    if let Some(bad) = ok.iter().position(|&w| w != 1) {
        return Err(setup_error(format!(
            "rank {bad} could not connect its verification channel (its error says why)"
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
        match listener.accept() {
            Ok((stream, _)) if Arc::strong_count(&live) <= MAX_HANDSHAKES => {
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
            Ok(_) => refused += 1,
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
