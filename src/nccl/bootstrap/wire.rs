//! The id exchange's wire format, and each side's half of one exchange over any byte stream
//! that keeps a deadline ([`Wire`]); the TCP loops around them are in `server` and `client`.
//!
//! Version 3 (every integer big-endian):
//! - client: hello = `HNDOFF`, 0, version (3), flags (bit 0: "I hold a secret"; the others 0),
//!   the rank it claims (u32); with the secret flag, then the first Noise message (48 bytes, see
//!   [`noise`](super::noise)), whose prologue is these 13 bytes.
//! - server: `HNDOFF`, 0, its version, then a status byte and what it carries:
//!   - 0, without a secret: the 128 id bytes.
//!   - 2, with one: the second Noise message (48 bytes). The client answers its confirmation
//!     (16 bytes), and the server then sends a status byte again: 0 and the id sealed as its
//!     record 0 (144 bytes), or a refusal.
//!   - 1 (refused), 3 (busy: try again), 4 (refused: authentication): a u16 length and that
//!     many bytes of UTF-8 saying why.
//!
//! The server reads the first 8 bytes before the rest, so a client of another version gets the
//! refusal naming both versions (versions 1 and 2 have this refusal's layout too).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use crate::error::Error;
use crate::nccl::UniqueId;
use crate::nccl::bootstrap::noise::{self, Handshake, MESSAGE, Session, TAG};
use crate::nccl::bootstrap::secret::Secret;

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u8 = 3;
pub(super) const MAGIC: &[u8; 6] = b"HNDOFF";
/// Hello flag: the client holds a secret.
pub(super) const FLAG_SECRET: u8 = 1;
/// Bytes of the hello after its 8-byte header: flags, rank (then, under a secret, the first
/// Noise message).
pub(super) const HELLO_REST: usize = 1 + 4;
/// Bytes of the clear hello, the Noise prologue.
const HELLO: usize = 8 + HELLO_REST;
/// The id as sent under a secret: sealed.
const SEALED: usize = UniqueId::BYTES + TAG;

pub(super) const ID: u8 = 0;
pub(super) const REFUSED: u8 = 1;
pub(super) const HANDSHAKE: u8 = 2;
pub(super) const BUSY: u8 = 3;
pub(super) const AUTH_REFUSED: u8 = 4;

pub(super) fn header() -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..6].copy_from_slice(MAGIC);
    h[7] = PROTOCOL_VERSION;
    h
}

/// The client's clear hello.
pub(super) fn hello(rank: u32, holds_secret: bool) -> [u8; HELLO] {
    let mut h = [0u8; HELLO];
    h[..8].copy_from_slice(&header());
    h[8] = if holds_secret { FLAG_SECRET } else { 0 };
    h[9..].copy_from_slice(&rank.to_be_bytes());
    h
}

/// The Noise prologue of an exchange: a label and the clear hello, so that the handshake fails
/// if any of it (version, flags, rank) was altered on the way.
fn prologue(hello: &[u8; HELLO]) -> Vec<u8> {
    [b"handoff bootstrap 3\0".as_slice(), hello].concat()
}

/// The pre-shared key of the id exchange under `secret`.
fn psk(secret: &Secret) -> [u8; 32] {
    noise::psk("bootstrap", Some(secret.bytes()), &[])
}

/// A status byte and a message, with the header in front when it is the server's first word.
pub(super) fn message(first: bool, status: u8, text: &str) -> Vec<u8> {
    let text = &text.as_bytes()[..text.len().min(u16::MAX as usize)];
    let mut m = if first { header().to_vec() } else { Vec::new() };
    m.push(status);
    m.extend_from_slice(&(text.len() as u16).to_be_bytes());
    m.extend_from_slice(text);
    m
}

/// A byte stream with a deadline: each call fails with `TimedOut` once the deadline passes, with
/// `UnexpectedEof` when the peer closes first.
pub(super) trait Wire {
    /// Fills `buf`.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<()>;
    /// Sends all of `buf`.
    fn send(&mut self, buf: &[u8]) -> io::Result<()>;
}

/// A TCP connection whose every read and write ends by one deadline, however the peer paces
/// its bytes.
pub(super) struct Timed<'a> {
    pub conn: &'a TcpStream,
    pub deadline: Instant,
}

impl Timed<'_> {
    fn left(&self) -> io::Result<std::time::Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::ErrorKind::TimedOut.into())
        } else {
            Ok(left)
        }
    }
}

fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

impl Wire for Timed<'_> {
    fn recv(&mut self, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            self.conn.set_read_timeout(Some(self.left()?))?;
            match (&mut &*self.conn).read(buf) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => buf = &mut buf[n..],
                // The loop asks for the time left again, and ends at the deadline.
                Err(e) if retry(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn send(&mut self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            self.conn.set_write_timeout(Some(self.left()?))?;
            match (&mut &*self.conn).write(buf) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if retry(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// What the server knows: the id, the job's size and its secret.
pub(super) struct ServerSide<'a> {
    pub id: &'a UniqueId,
    pub world: u32,
    pub secret: Option<&'a Secret>,
}

/// The ranks served so far, shared by the server's connections. Under a secret, whether a rank
/// was served is told to a client only once it has authenticated.
pub(super) trait Ranks {
    /// Marks `rank` served; false when it already was.
    fn claim(&self, rank: u32) -> bool;
    /// Undoes a claim whose id could not be sent.
    fn release(&self, rank: u32);
}

/// Why the server refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    NotProtocol,
    Version(u8),
    Flags(u8),
    RankOutOfRange(u32),
    AlreadyServed(u32),
    /// The client holds no secret, the server does.
    ClientLacksSecret,
    /// The client holds a secret, the server none.
    ServerLacksSecret,
    /// The client's first Noise message or its confirmation does not authenticate under the
    /// server's secret (another secret, a replay, damage).
    WrongProof,
    NoRandomness,
}

/// How one connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The id was sent to a client claiming this rank.
    Served(u32),
    /// A refusal was sent.
    Refused(Refusal),
    /// The peer closed or broke the connection, or the deadline passed (`TimedOut`).
    Dropped(io::ErrorKind),
}

impl Refusal {
    fn text(self, world: u32) -> String {
        match self {
            Refusal::NotProtocol => "this port serves a handoff unique id; the connection did not speak the \
                                     handoff bootstrap protocol"
                .into(),
            Refusal::Version(v) => format!(
                "protocol version {v} asked, this server speaks version {PROTOCOL_VERSION}: use the same \
                 handoff version on every rank"
            ),
            Refusal::Flags(f) => {
                format!("unknown hello flags {f:#04x}: use the same handoff version on every rank")
            }
            Refusal::RankOutOfRange(r) => format!(
                "rank {r} is not one that fetches the id: this job's ranks 1 to {} do (check RANK and \
                 WORLD_SIZE)",
                world.saturating_sub(1)
            ),
            Refusal::AlreadyServed(r) => format!(
                "rank {r} has already fetched the id: two processes claim rank {r} (check RANK), or something \
                 else took its place"
            ),
            Refusal::ClientLacksSecret => format!(
                "rank 0 requires the job's shared secret and this client holds none: set {} or {} on every rank",
                crate::nccl::bootstrap::SECRET_VAR,
                crate::nccl::bootstrap::SECRET_FILE_VAR
            ),
            Refusal::ServerLacksSecret => format!(
                "this client holds a shared secret and rank 0 none: set the same {} or {} on rank 0 too",
                crate::nccl::bootstrap::SECRET_VAR,
                crate::nccl::bootstrap::SECRET_FILE_VAR
            ),
            Refusal::WrongProof => {
                "the client's handshake does not authenticate under rank 0's secret: the ranks hold \
                 different secrets (or it replayed another's)"
                    .into()
            }
            Refusal::NoRandomness => {
                "rank 0 cannot make a Noise handshake (no randomness for its key)".into()
            }
        }
    }

    fn status(self) -> u8 {
        match self {
            Refusal::ClientLacksSecret | Refusal::ServerLacksSecret | Refusal::WrongProof => AUTH_REFUSED,
            _ => REFUSED,
        }
    }
}

fn refuse(w: &mut impl Wire, first: bool, why: Refusal, world: u32) -> Outcome {
    // Best effort: a peer that does not read loses the reason, nothing else.
    let _ = w.send(&message(first, why.status(), &why.text(world)));
    Outcome::Refused(why)
}

/// The server's half of one exchange. Nothing about the id is sent before the hello is checked,
/// and under a secret before the client's first Noise message and its confirmation are.
pub(super) fn serve(w: &mut impl Wire, side: &ServerSide<'_>, ranks: &impl Ranks) -> Outcome {
    let world = side.world;
    let mut hello = [0u8; HELLO];
    if let Err(e) = w.recv(&mut hello[..8]) {
        return Outcome::Dropped(e.kind());
    }
    if &hello[..6] != MAGIC || hello[6] != 0 {
        return refuse(w, true, Refusal::NotProtocol, world);
    }
    if hello[7] != PROTOCOL_VERSION {
        return refuse(w, true, Refusal::Version(hello[7]), world);
    }
    if let Err(e) = w.recv(&mut hello[8..]) {
        return Outcome::Dropped(e.kind());
    }
    let flags = hello[8];
    let rank = u32::from_be_bytes([hello[9], hello[10], hello[11], hello[12]]);
    if flags & !FLAG_SECRET != 0 {
        return refuse(w, true, Refusal::Flags(flags), world);
    }
    if rank == 0 || rank >= world {
        return refuse(w, true, Refusal::RankOutOfRange(rank), world);
    }
    let secret = match (side.secret, flags & FLAG_SECRET != 0) {
        (None, true) => return refuse(w, true, Refusal::ServerLacksSecret, world),
        (Some(_), false) => return refuse(w, true, Refusal::ClientLacksSecret, world),
        (None, false) => {
            if !ranks.claim(rank) {
                return refuse(w, true, Refusal::AlreadyServed(rank), world);
            }
            let mut reply = header().to_vec();
            reply.push(ID);
            reply.extend_from_slice(side.id.as_bytes());
            return match w.send(&reply) {
                Ok(()) => Outcome::Served(rank),
                Err(e) => {
                    ranks.release(rank);
                    Outcome::Dropped(e.kind())
                }
            };
        }
        (Some(s), true) => s,
    };
    let mut first = [0u8; MESSAGE];
    if let Err(e) = w.recv(&mut first) {
        return Outcome::Dropped(e.kind());
    }
    let Ok(mut handshake) = Handshake::responder(&prologue(&hello), &psk(secret)) else {
        return refuse(w, true, Refusal::NoRandomness, world);
    };
    if !handshake.read(&first) {
        return refuse(w, true, Refusal::WrongProof, world);
    }
    let Ok(second) = handshake.write() else {
        return refuse(w, true, Refusal::NoRandomness, world);
    };
    let Ok(session) = handshake.finish() else {
        return refuse(w, true, Refusal::NoRandomness, world);
    };
    let mut reply = header().to_vec();
    reply.push(HANDSHAKE);
    reply.extend_from_slice(&second);
    if let Err(e) = w.send(&reply) {
        return Outcome::Dropped(e.kind());
    }
    // The first message may be a replay: only the confirmation shows the client saw this
    // server's ephemeral key, so only then is a rank claimed.
    let mut confirmation = [0u8; TAG];
    if let Err(e) = w.recv(&mut confirmation) {
        return Outcome::Dropped(e.kind());
    }
    if !session.confirms(&confirmation) {
        return refuse(w, false, Refusal::WrongProof, world);
    }
    if !ranks.claim(rank) {
        return refuse(w, false, Refusal::AlreadyServed(rank), world);
    }
    let mut reply = [0u8; 1 + SEALED];
    reply[0] = ID;
    if !session.seal(0, side.id.as_bytes(), &mut reply[1..]) {
        ranks.release(rank);
        return refuse(w, false, Refusal::NoRandomness, world);
    }
    match w.send(&reply) {
        Ok(()) => Outcome::Served(rank),
        Err(e) => {
            ranks.release(rank);
            Outcome::Dropped(e.kind())
        }
    }
}

/// How one attempt to fetch the id failed.
#[derive(Debug)]
pub(super) enum Attempt {
    /// Worth another connection while the deadline allows: the server was busy, or the
    /// connection broke or closed early. Says what happened.
    Retry(String),
    /// Final: a refusal, another protocol or version, an authentication failure.
    Failed(Error),
}

/// At most this much of a peer's message is kept, with control characters replaced, so a
/// hostile server cannot flood or garble the error text.
fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .take(400)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// A refusal's reason: a u16 length and that many bytes. Cut short by the deadline, the
/// attempt ran out of time; cut short otherwise, the refusal stands without its reason.
fn read_text(w: &mut impl Wire) -> Result<String, Attempt> {
    let cut = |e: io::Error| {
        if e.kind() == io::ErrorKind::TimedOut {
            Err(io_retry("reading rank 0's answer", &e))
        } else {
            Ok("(the reason was cut short)".into())
        }
    };
    let mut len = [0u8; 2];
    if let Err(e) = w.recv(&mut len) {
        return cut(e);
    }
    let mut text = vec![0u8; u16::from_be_bytes(len) as usize];
    match w.recv(&mut text) {
        Ok(()) => Ok(printable(&text)),
        Err(e) => cut(e),
    }
}

fn io_retry(what: &str, e: &io::Error) -> Attempt {
    Attempt::Retry(match e.kind() {
        io::ErrorKind::TimedOut => format!("{what}: no answer before the deadline"),
        io::ErrorKind::UnexpectedEof => format!("{what}: rank 0's server closed the connection"),
        _ => format!("{what}: {e}"),
    })
}

/// The client's half of one exchange: the id, under a secret trusted only from a server that
/// completed the Noise handshake with this rank's secret.
pub(super) fn fetch(
    w: &mut impl Wire,
    addr: &str,
    rank: u32,
    secret: Option<&Secret>,
) -> Result<UniqueId, Attempt> {
    let fail = |detail: String| {
        Attempt::Failed(Error::Bootstrap {
            addr: addr.to_string(),
            detail,
        })
    };
    let auth = |detail: String| {
        Attempt::Failed(Error::BootstrapAuth {
            addr: addr.to_string(),
            detail,
        })
    };
    let (set, file) = (
        crate::nccl::bootstrap::SECRET_VAR,
        crate::nccl::bootstrap::SECRET_FILE_VAR,
    );
    let hello = hello(rank, secret.is_some());
    let mut handshake = match secret {
        Some(s) => {
            let mut h = Handshake::initiator(&prologue(&hello), &psk(s))
                .map_err(|e| fail(format!("cannot start the handshake: {e}")))?;
            let first = h
                .write()
                .map_err(|e| fail(format!("cannot start the handshake: {e}")))?;
            w.send(&[hello.as_slice(), &first].concat())
                .map_err(|e| io_retry("sending the hello", &e))?;
            Some(h)
        }
        None => {
            w.send(&hello).map_err(|e| io_retry("sending the hello", &e))?;
            None
        }
    };
    let mut head = [0u8; 9];
    w.recv(&mut head)
        .map_err(|e| io_retry("waiting for rank 0's answer", &e))?;
    if &head[..6] != MAGIC || head[6] != 0 {
        return Err(fail(
            "the answer is not the handoff bootstrap protocol: another program holds the port".into(),
        ));
    }
    if head[7] != PROTOCOL_VERSION {
        return Err(fail(format!(
            "rank 0 speaks protocol version {}, this rank {PROTOCOL_VERSION}: use the same handoff version \
             on every rank",
            head[7]
        )));
    }
    let mut status = head[8];
    let mut session: Option<Session> = None;
    loop {
        match (status, secret, &session) {
            (BUSY, ..) => {
                let why = read_text(w)?;
                return Err(Attempt::Retry(format!("rank 0's server was busy: {why}")));
            }
            (REFUSED, ..) => {
                let why = read_text(w)?;
                return Err(fail(format!("refused: {why}")));
            }
            (AUTH_REFUSED, None, _) | (HANDSHAKE, None, _) => {
                read_text(w)?;
                return Err(auth(format!(
                    "rank 0 requires the job's shared secret and this rank holds none: set {set} or {file} \
                     on this rank, the same as on rank 0"
                )));
            }
            (AUTH_REFUSED, Some(_), None) => {
                let why = read_text(w)?;
                let detail = if why.contains("rank 0 none") {
                    format!(
                        "this rank holds a shared secret and rank 0 none: set the same {set} or {file} on rank \
                         0, or on no rank"
                    )
                } else {
                    format!(
                        "rank 0 rejected this rank's handshake: the ranks hold different secrets; set the same \
                         {set} or {file} on every rank"
                    )
                };
                return Err(auth(detail));
            }
            (AUTH_REFUSED, Some(_), Some(_)) => {
                read_text(w)?;
                return Err(auth(format!(
                    "rank 0 rejected this rank's confirmation: the ranks hold different secrets; set the same \
                     {set} or {file} on every rank"
                )));
            }
            (ID, None, _) => {
                let mut id = [0u8; UniqueId::BYTES];
                w.recv(&mut id).map_err(|e| io_retry("reading the id", &e))?;
                return UniqueId::from_bytes(&id).map_err(Attempt::Failed);
            }
            (ID, Some(_), None) => {
                return Err(auth(format!(
                    "the server sent an id without proving it holds this rank's shared secret, so it is not \
                     trusted: set the same {set} or {file} on rank 0 (is rank 0 an older handoff, or is \
                     something else answering at this port?)"
                )));
            }
            (ID, Some(_), Some(s)) => {
                let mut sealed = [0u8; SEALED];
                w.recv(&mut sealed).map_err(|e| io_retry("reading the id", &e))?;
                let mut id = [0u8; UniqueId::BYTES];
                if !s.open(0, &sealed, &mut id) {
                    return Err(auth(
                        "the id failed its authentication check: it was altered on the way, or the server is \
                         not rank 0"
                            .into(),
                    ));
                }
                return UniqueId::from_bytes(&id).map_err(Attempt::Failed);
            }
            (HANDSHAKE, Some(_), None) => {
                let mut second = [0u8; MESSAGE];
                w.recv(&mut second)
                    .map_err(|e| io_retry("reading rank 0's handshake", &e))?;
                let Some(mut h) = handshake.take() else {
                    return Err(fail(
                        "rank 0 sent a second handshake: not the handoff bootstrap protocol".into(),
                    ));
                };
                if !h.read(&second) {
                    return Err(auth(format!(
                        "rank 0 did not prove it holds this rank's secret: the ranks hold different secrets \
                         (set the same {set} or {file} on every rank), or something other than rank 0 \
                         answers at this port"
                    )));
                }
                let s = h.finish().map_err(fail)?;
                w.send(&s.confirmation())
                    .map_err(|e| io_retry("sending this rank's confirmation", &e))?;
                session = Some(s);
                let mut next = [0u8; 1];
                w.recv(&mut next)
                    .map_err(|e| io_retry("waiting for the id", &e))?;
                status = next[0];
            }
            (HANDSHAKE, Some(_), Some(_)) => {
                return Err(fail(
                    "rank 0 sent a second handshake: not the handoff bootstrap protocol".into(),
                ));
            }
            (other, ..) => {
                return Err(fail(format!(
                    "rank 0 answered with unknown status {other}: use the same handoff version on every rank"
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    use std::cell::{Cell, RefCell};
    use std::collections::BTreeSet;

    /// A scripted peer: reads come from `input` (then end of stream), writes are kept.
    struct Mem {
        input: Vec<u8>,
        at: usize,
        out: Vec<u8>,
    }

    impl Mem {
        fn new(input: Vec<u8>) -> Mem {
            Mem {
                input,
                at: 0,
                out: Vec::new(),
            }
        }
    }

    impl Wire for Mem {
        fn recv(&mut self, buf: &mut [u8]) -> io::Result<()> {
            let end = self.at + buf.len();
            if end > self.input.len() {
                self.at = self.input.len();
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            buf.copy_from_slice(&self.input[self.at..end]);
            self.at = end;
            Ok(())
        }
        fn send(&mut self, buf: &[u8]) -> io::Result<()> {
            self.out.extend_from_slice(buf);
            Ok(())
        }
    }

    #[derive(Default)]
    struct Set(RefCell<BTreeSet<u32>>);

    impl Ranks for Set {
        fn claim(&self, rank: u32) -> bool {
            self.0.borrow_mut().insert(rank)
        }
        fn release(&self, rank: u32) {
            self.0.borrow_mut().remove(&rank);
        }
    }

    fn id() -> UniqueId {
        UniqueId::from_bytes(&[0xa5; UniqueId::BYTES]).unwrap()
    }

    fn secret() -> Secret {
        Secret::new(*b"0123456789abcdef0123456789abcdef").unwrap()
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    fn runner(cases: u32) -> TestRunner {
        TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        })
    }

    /// Client bytes built as a real client's, then damaged: wrong magic or version, other
    /// flags and ranks, random proofs, cut anywhere or with junk after.
    fn adversarial_client() -> impl Strategy<Value = Vec<u8>> {
        (
            prop_oneof![9 => Just(*MAGIC), 1 => any::<[u8; 6]>()],
            prop_oneof![9 => Just(0u8), 1 => any::<u8>()],
            prop_oneof![8 => Just(PROTOCOL_VERSION), 1 => Just(1u8), 1 => any::<u8>()],
            prop_oneof![4 => Just(0u8), 4 => Just(FLAG_SECRET), 1 => any::<u8>()],
            prop_oneof![4 => 0u32..6, 1 => any::<u32>()],
            any::<[u8; MESSAGE]>(),
            proptest::collection::vec(any::<u8>(), 0..80),
            any::<proptest::sample::Index>(),
        )
            .prop_map(|(magic, zero, version, flags, rank, first, tail, cut)| {
                let mut b = magic.to_vec();
                b.push(zero);
                b.push(version);
                b.push(flags);
                b.extend_from_slice(&rank.to_be_bytes());
                b.extend_from_slice(&first);
                b.extend_from_slice(&tail);
                let cut = cut.index(b.len() + 1);
                b.truncate(cut.max(1));
                b
            })
    }

    fn any_client() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..120),
            adversarial_client()
        ]
    }

    /// What the server must do with `input` when it holds no secret: serve exactly a
    /// well-formed hello claiming an unserved rank in range without the secret flag.
    fn plain_hello_rank(input: &[u8], world: u32, served: &BTreeSet<u32>) -> Option<u32> {
        if input.len() < HELLO || input[..8] != header() || input[8] != 0 {
            return None;
        }
        let rank = u32::from_be_bytes(input[9..13].try_into().unwrap());
        (rank != 0 && rank < world && !served.contains(&rank)).then_some(rank)
    }

    #[test]
    fn server_fed_hostile_bytes_refuses_or_closes_and_never_leaks_the_id() {
        const CASES: u32 = 3000;
        let id = id();
        let secret = secret();
        let ran = Cell::new(0u32);
        for with_secret in [false, true] {
            let seen = RefCell::new(std::collections::BTreeMap::<String, u32>::new());
            let ranks = Set::default();
            let side = ServerSide {
                id: &id,
                world: 4,
                secret: with_secret.then_some(&secret),
            };
            runner(CASES)
                .run(&any_client(), |input| {
                    ran.set(ran.get() + 1);
                    let before = ranks.0.borrow().clone();
                    let expect = plain_hello_rank(&input, 4, &before);
                    let mut w = Mem::new(input);
                    let outcome = serve(&mut w, &side, &ranks);
                    let kind = format!("{outcome:?}");
                    let kind = kind.split('(').take(2).collect::<Vec<_>>().join("(");
                    *seen.borrow_mut().entry(kind).or_default() += 1;
                    if with_secret {
                        // Random bytes never hold the client's proof.
                        prop_assert!(!matches!(outcome, Outcome::Served(_)), "{outcome:?}");
                        prop_assert!(!contains(&w.out, id.as_bytes()));
                        prop_assert_eq!(&*ranks.0.borrow(), &before);
                    } else {
                        match expect {
                            Some(r) => {
                                prop_assert_eq!(outcome, Outcome::Served(r));
                                prop_assert_eq!(&w.out[9..], id.as_bytes());
                            }
                            None => prop_assert!(!matches!(outcome, Outcome::Served(_)), "{outcome:?}"),
                        }
                    }
                    // Whatever the server sent parses as its side of the protocol.
                    if !w.out.is_empty() {
                        prop_assert_eq!(&w.out[..8], &header());
                    }
                    if let Outcome::Refused(_) = outcome {
                        // A refusal ends what was sent: status, length, that many bytes.
                        let start = if w.out[8] == HANDSHAKE { 9 + MESSAGE } else { 8 };
                        prop_assert!(matches!(w.out[start], REFUSED | AUTH_REFUSED));
                        let len = u16::from_be_bytes([w.out[start + 1], w.out[start + 2]]) as usize;
                        prop_assert_eq!(w.out.len(), start + 3 + len);
                    }
                    Ok(())
                })
                .unwrap();
            // The cases reached every refusal the inputs can cause, and past the challenge.
            let seen = seen.into_inner();
            println!("bootstrap server property, secret {with_secret}: {seen:?}");
            let mut expected = vec![
                "Refused(NotProtocol",
                "Refused(Version",
                "Refused(Flags",
                "Refused(RankOutOfRange",
            ];
            expected.extend(if with_secret {
                [
                    "Refused(ClientLacksSecret",
                    "Refused(WrongProof",
                    "Dropped(UnexpectedEof",
                ]
            } else {
                ["Refused(ServerLacksSecret", "Served(", "Refused(AlreadyServed"]
            });
            for e in expected {
                assert!(
                    seen.keys().any(|k| k.starts_with(e)),
                    "no case gave {e}: {seen:?}"
                );
            }
        }
        println!("bootstrap server property: {} cases", ran.get());
        assert_eq!(ran.get(), 2 * CASES);
    }

    /// Server bytes built as a real server's, then damaged.
    fn adversarial_server() -> impl Strategy<Value = Vec<u8>> {
        (
            prop_oneof![9 => Just(header()), 1 => any::<[u8; 8]>()],
            prop_oneof![9 => 0u8..6, 1 => any::<u8>()],
            proptest::collection::vec(any::<u8>(), 0..300),
            prop_oneof![Just(None), (0u8..6).prop_map(Some)],
            proptest::collection::vec(any::<u8>(), 0..200),
            any::<proptest::sample::Index>(),
        )
            .prop_map(|(head, status, body, second, more, cut)| {
                let mut b = head.to_vec();
                b.push(status);
                b.extend_from_slice(&body);
                if let Some(s) = second {
                    b.truncate(9 + MESSAGE);
                    b.push(s);
                    b.extend_from_slice(&more);
                }
                let cut = cut.index(b.len() + 1);
                b.truncate(cut);
                b
            })
    }

    #[test]
    fn client_fed_hostile_replies_returns_a_typed_error_and_never_trusts_an_unproven_id() {
        const CASES: u32 = 3000;
        let secret = secret();
        let ran = Cell::new(0u32);
        for with_secret in [false, true] {
            let seen = RefCell::new(std::collections::BTreeMap::<String, u32>::new());
            let strategy = prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..400),
                adversarial_server()
            ];
            runner(CASES)
                .run(&strategy, |reply| {
                    ran.set(ran.get() + 1);
                    let plain_id =
                        reply.len() >= 9 + UniqueId::BYTES && reply[..8] == header() && reply[8] == ID;
                    let mut w = Mem::new(reply);
                    let r = fetch(&mut w, "a:1", 2, with_secret.then_some(&secret));
                    let kind = match &r {
                        Ok(_) => "id".to_string(),
                        Err(Attempt::Retry(why)) => format!("retry: {}", why.split(':').next().unwrap_or("")),
                        Err(Attempt::Failed(e)) => {
                            let text: String =
                                e.to_string().chars().filter(|c| !c.is_ascii_digit()).collect();
                            let words: Vec<&str> = text.split_whitespace().skip(3).take(7).collect();
                            words.join(" ")
                        }
                    };
                    *seen.borrow_mut().entry(kind).or_default() += 1;
                    match r {
                        Ok(_) => prop_assert!(!with_secret && plain_id),
                        Err(Attempt::Retry(why)) => prop_assert!(!why.is_empty()),
                        Err(Attempt::Failed(e)) => {
                            let typed = matches!(
                                e,
                                Error::Bootstrap { .. }
                                    | Error::BootstrapAuth { .. }
                                    | Error::InvalidArgument(_)
                            );
                            prop_assert!(typed, "{e:?}");
                        }
                    }
                    // The hello went out (with the first Noise message under a secret), and nothing
                    // after it: made-up bytes never pass as rank 0's handshake.
                    let hello = HELLO + if with_secret { MESSAGE } else { 0 };
                    prop_assert_eq!(w.out.len(), hello);
                    Ok(())
                })
                .unwrap();
            let seen = seen.into_inner();
            println!(
                "bootstrap client property, secret {with_secret}: {} kinds of outcome",
                seen.len()
            );
            for (k, n) in &seen {
                println!("  {n:5} {k}");
            }
            let mut expected = vec![
                "retry: rank 0's server was busy",
                "retry: waiting for",
                "failed: refused",
            ];
            if with_secret {
                expected.extend([
                    "authentication failed: rank did not prove",
                    "retry: reading rank 0's handshake",
                ]);
            } else {
                expected.push("id");
            }
            for e in expected {
                assert!(
                    seen.keys().any(|k| k.starts_with(e)),
                    "no case gave {e}: {seen:?}"
                );
            }
        }
        println!("bootstrap client property: {} cases", ran.get());
        assert_eq!(ran.get(), 2 * CASES);
    }

    /// One end of an in-memory duplex: what it sends the other end receives; a receive with
    /// nothing for two seconds, or after the other end is gone, is the end of the stream.
    struct Pipe {
        rx: std::sync::mpsc::Receiver<Vec<u8>>,
        tx: std::sync::mpsc::Sender<Vec<u8>>,
        buf: Vec<u8>,
        sent: Vec<u8>,
    }

    fn pipes() -> (Pipe, Pipe) {
        let (a_tx, b_rx) = std::sync::mpsc::channel();
        let (b_tx, a_rx) = std::sync::mpsc::channel();
        let end = |rx, tx| Pipe {
            rx,
            tx,
            buf: Vec::new(),
            sent: Vec::new(),
        };
        (end(a_rx, a_tx), end(b_rx, b_tx))
    }

    impl Wire for Pipe {
        fn recv(&mut self, buf: &mut [u8]) -> io::Result<()> {
            while self.buf.len() < buf.len() {
                match self.rx.recv_timeout(std::time::Duration::from_secs(2)) {
                    Ok(b) => self.buf.extend_from_slice(&b),
                    Err(_) => return Err(io::ErrorKind::UnexpectedEof.into()),
                }
            }
            buf.copy_from_slice(&self.buf[..buf.len()]);
            self.buf.drain(..buf.len());
            Ok(())
        }
        fn send(&mut self, buf: &[u8]) -> io::Result<()> {
            self.sent.extend_from_slice(buf);
            let _ = self.tx.send(buf.to_vec());
            Ok(())
        }
    }

    /// One exchange between the two halves over a [`Pipe`]: the server's outcome and bytes, the
    /// client's result and bytes.
    fn exchange(
        server_secret: Option<Secret>,
        client_secret: Option<Secret>,
    ) -> (Outcome, Vec<u8>, Result<UniqueId, Attempt>, Vec<u8>) {
        let (mut s, mut c) = pipes();
        let server = std::thread::spawn(move || {
            let id = id();
            let side = ServerSide {
                id: &id,
                world: 3,
                secret: server_secret.as_ref(),
            };
            let outcome = serve(&mut s, &side, &Set::default());
            (outcome, std::mem::take(&mut s.sent))
        });
        let r = fetch(&mut c, "a:1", 1, client_secret.as_ref());
        drop(c.tx);
        let (outcome, server_bytes) = server.join().unwrap();
        (outcome, server_bytes, r, c.sent)
    }

    /// Both halves against each other: the id arrives with and without a secret, and
    /// mismatched secrets fail on both sides with the side that lacks one named.
    #[test]
    fn both_halves_agree_and_mismatched_secrets_fail_on_both_sides() {
        let id = id();
        let (a, b) = (secret(), Secret::new([1u8; 20]).unwrap());
        let cases = [
            (None, None),
            (Some(a.clone()), Some(a.clone())),
            (Some(a.clone()), None),
            (None, Some(a.clone())),
            (Some(a.clone()), Some(b)),
        ];
        for (server_secret, client_secret) in cases {
            let (outcome, server_bytes, r, client_bytes) =
                exchange(server_secret.clone(), client_secret.clone());
            match (&server_secret, &client_secret) {
                (None, None) => {
                    assert_eq!(outcome, Outcome::Served(1));
                    assert_eq!(r.unwrap(), id);
                }
                (Some(x), Some(y)) if x == y => {
                    assert_eq!(outcome, Outcome::Served(1));
                    assert_eq!(r.unwrap(), id);
                    assert!(
                        !contains(&server_bytes, id.as_bytes()),
                        "the id crosses the wire encrypted"
                    );
                    assert!(
                        !contains(&server_bytes, b"0123456789abcdef")
                            && !contains(&client_bytes, b"0123456789abcdef")
                    );
                }
                (s, c_s) => {
                    let expect = match (s, c_s) {
                        (Some(_), None) => Refusal::ClientLacksSecret,
                        (None, Some(_)) => Refusal::ServerLacksSecret,
                        _ => Refusal::WrongProof,
                    };
                    assert_eq!(outcome, Outcome::Refused(expect));
                    let Err(Attempt::Failed(Error::BootstrapAuth { detail, .. })) = r else {
                        panic!("{r:?}");
                    };
                    let says = match expect {
                        Refusal::ClientLacksSecret => "this rank holds none",
                        Refusal::ServerLacksSecret => "rank 0 none",
                        _ => "different secrets",
                    };
                    assert!(
                        detail.contains(says) && detail.contains("HANDOFF_SECRET"),
                        "{detail}"
                    );
                    assert!(!contains(&server_bytes, id.as_bytes()));
                }
            }
        }
    }

    /// What a server under `secret` does with `client_bytes`: its outcome, its bytes, whether
    /// it claimed a rank.
    fn replayed(client_bytes: Vec<u8>) -> (Outcome, Vec<u8>, bool) {
        let (id, secret) = (id(), secret());
        let side = ServerSide {
            id: &id,
            world: 3,
            secret: Some(&secret),
        };
        let ranks = Set::default();
        let mut w = Mem::new(client_bytes);
        let outcome = serve(&mut w, &side, &ranks);
        let claimed = !ranks.0.borrow().is_empty();
        (outcome, w.out, claimed)
    }

    /// The hostile clients of a captured honest exchange: its whole replay, its first message
    /// reflected as the server's or the server's reflected as the client's, a flipped flag or
    /// rank in the clear hello, a flipped bit of the first message or of the confirmation. Each
    /// is refused, sees nothing of the id, and claims no rank.
    #[test]
    fn replayed_reflected_or_flipped_exchanges_are_refused() {
        let (outcome, server_bytes, r, client_bytes) = exchange(Some(secret()), Some(secret()));
        assert_eq!(outcome, Outcome::Served(1));
        assert_eq!(r.unwrap(), id());
        assert_eq!(client_bytes.len(), HELLO + MESSAGE + TAG);
        let first = &client_bytes[..HELLO + MESSAGE];
        let second = &server_bytes[9..9 + MESSAGE];
        let flip = |at: usize, bit: u8| {
            let mut b = client_bytes.clone();
            b[at] ^= bit;
            b
        };
        let cases: Vec<(&str, Vec<u8>, Refusal)> = vec![
            (
                "the whole exchange replayed",
                client_bytes.clone(),
                Refusal::WrongProof,
            ),
            (
                "the first message replayed, then its own confirmation reflected",
                [first, &server_bytes[server_bytes.len() - TAG..]].concat(),
                Refusal::WrongProof,
            ),
            (
                "the server's message reflected as the client's",
                [&client_bytes[..HELLO], second, &[0; TAG]].concat(),
                Refusal::WrongProof,
            ),
            (
                "the secret flag flipped",
                flip(8, FLAG_SECRET),
                Refusal::ClientLacksSecret,
            ),
            ("the rank flipped (1 to 2)", flip(12, 3), Refusal::WrongProof),
            (
                "a bit of the first message flipped",
                flip(HELLO + 40, 1),
                Refusal::WrongProof,
            ),
            (
                "a bit of the confirmation flipped",
                flip(HELLO + MESSAGE + 3, 1),
                Refusal::WrongProof,
            ),
        ];
        for (what, bytes, expect) in cases {
            let (outcome, out, claimed) = replayed(bytes);
            println!("bootstrap hostile client, {what}: {outcome:?}");
            assert_eq!(outcome, Outcome::Refused(expect), "{what}");
            assert!(!claimed, "{what}: a rank was claimed");
            assert!(!contains(&out, id().as_bytes()), "{what}");
            // Nothing the server sent opens as the id under the honest client's session.
            assert!(
                !out.ends_with(&server_bytes[server_bytes.len() - SEALED..]),
                "{what}"
            );
        }
    }
}
