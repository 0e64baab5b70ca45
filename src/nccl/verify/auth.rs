//! The verification channel's handshake: two ranks prove to each other that they hold the job's
//! shared secret (when one is set) and both channel tokens of their cards (which travel only
//! through NCCL's all-gather, never on this connection), by a Noise handshake keyed by them
//! (see [`crate::nccl::bootstrap::noise`]), whose session then seals every later record (see
//! [`crate::nccl::verify::channel`]).
//!
//! Client `c` (the higher rank) to server `s`, version 2:
//! 1. `c → s` hello: magic, ranks `c` and `s`, world, whether `c` has a secret (the Noise
//!    prologue), then the first Noise message;
//! 2. `s → c` reply: magic, status, then the second Noise message (zeros unless the status is
//!    0);
//! 3. `c → s` the client's confirmation; 4. `s → c` the server's.
//!
//! The pre-shared key is derived from the secret (or its absence) and both tokens; the
//! prologue binds the ranks, the world and the flags. A server reads the magic first: a client
//! of version 1 is answered in version 1's layout with a refusal, and the server's error names
//! both versions. Every read and write has the caller's overall deadline; the server's, also
//! [`HANDSHAKE_WAIT`] from the connection (an honest client answers at once), so that
//! connections that say nothing hold a listener's handshake slots only that long.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use crate::nccl::bootstrap::noise::{self, Handshake, MESSAGE, Session, TAG};

const HELLO_MAGIC: u64 = 0x4844_4f46_4656_4332; // "HDOFFVC2"
const REPLY_MAGIC: u64 = 0x4844_4f46_4656_5332; // "HDOFFVS2"
/// Version 1's magic numbers, to tell a rank of that version what this one speaks.
const HELLO_MAGIC_V1: u64 = 0x4844_4f46_4656_4331; // "HDOFFVC1"
const REPLY_MAGIC_V1: u64 = 0x4844_4f46_4656_5331; // "HDOFFVS1"
/// The clear part of the hello: magic, four words. The Noise prologue.
const HELLO_CLEAR: usize = 8 + 16;
const HELLO_BYTES: usize = HELLO_CLEAR + MESSAGE;
const REPLY_BYTES: usize = 8 + 8 + MESSAGE;
/// A version 1 client's hello and the reply it waits for.
const HELLO_BYTES_V1: usize = 8 + 16 + 32;
const REPLY_BYTES_V1: usize = 8 + 8 + 32 + 32;

/// How long a server gives a client for the whole handshake (within the overall deadline).
pub(crate) const HANDSHAKE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

const OK: u32 = 0;
const NOT_EXPECTED: u32 = 1;
const SECRET_DIFFERS: u32 = 2;
/// The client's first message did not authenticate: another secret or tokens.
const NOT_PROVEN: u32 = 3;
/// The client speaks another version (sent in version 1's layout).
const OTHER_VERSION: u32 = 4;

/// The job's shared secret, as the bootstrap reads it ([`crate::nccl::bootstrap::Secret::from_env`]:
/// `HANDOFF_SECRET`, or the owner-only file `HANDOFF_SECRET_FILE` names), so that one setting
/// keys both.
///
/// # Errors
/// As `Secret::from_env`: both variables set, an unreadable or too open file, a secret too
/// short.
pub(crate) fn job_secret() -> Result<Option<Vec<u8>>, String> {
    crate::nccl::bootstrap::Secret::from_env()
        .map(|s| s.map(|s| s.bytes().to_vec()))
        .map_err(|e| e.to_string())
}

/// `N` bytes from the kernel's random source.
///
/// # Errors
/// `/dev/urandom` cannot be read.
pub(crate) fn random<const N: usize>() -> Result<[u8; N], String> {
    let mut b = [0u8; N];
    crate::nccl::bootstrap::secret::random(&mut b).map_err(|e| format!("reading /dev/urandom: {e}"))?;
    Ok(b)
}

/// What both ends of one connection know from the cards.
#[derive(Clone, Copy)]
pub(crate) struct Pair {
    pub(crate) server: usize,
    pub(crate) client: usize,
    pub(crate) world: usize,
    pub(crate) server_token: u128,
    pub(crate) client_token: u128,
}

/// The session of an authenticated connection, shared by its sending and receiving halves.
pub(crate) type Keys = Arc<Session>;

/// The clear hello: magic, client, server, world, flags (little-endian words).
fn clear_hello(c: usize, s: usize, world: usize, flags: u32) -> [u8; HELLO_CLEAR] {
    let mut h = [0u8; HELLO_CLEAR];
    h[..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    for (i, w) in [c as u32, s as u32, world as u32, flags].into_iter().enumerate() {
        h[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
    }
    h
}

fn prologue(clear: &[u8]) -> Vec<u8> {
    [b"handoff verification channel 2\0".as_slice(), clear].concat()
}

/// The pre-shared key of a connection: the secret, if any, and both tokens.
fn psk(pair: Pair, secret: Option<&[u8]>) -> [u8; 32] {
    noise::psk(
        "verification channel",
        secret,
        &[&pair.server_token.to_le_bytes(), &pair.client_token.to_le_bytes()],
    )
}

fn remaining(deadline: Instant) -> std::io::Result<std::time::Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the deadline passed",
        ))
    } else {
        Ok(left)
    }
}

/// Fills `buf` by `deadline`, however the peer trickles its bytes.
pub(crate) fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        s.set_read_timeout(Some(remaining(deadline)?))?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the deadline passed",
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    s.set_write_timeout(Some(remaining(deadline)?))?;
    s.write_all(buf)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Connects rank `pair.client` to rank `pair.server` at `addr` and authenticates both.
///
/// # Errors
/// What failed or was refused, and what to check.
pub(crate) fn connect(
    addr: SocketAddr,
    pair: Pair,
    secret: Option<&[u8]>,
    deadline: Instant,
) -> Result<(TcpStream, Keys), String> {
    let (c, s) = (pair.client, pair.server);
    let io = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| format!("rank {c}'s verification channel to rank {s} at {addr}: {what}: {e}")
    };
    let mut stream = TcpStream::connect_timeout(&addr, remaining(deadline).map_err(io("connecting"))?)
        .map_err(io("connecting"))?;
    stream.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
    let flags = u32::from(secret.is_some());
    let clear = clear_hello(c, s, pair.world, flags);
    let mut handshake = Handshake::initiator(&prologue(&clear), &psk(pair, secret))?;
    let hello = [clear.as_slice(), &handshake.write()?].concat();
    write_by(&mut stream, &hello, deadline).map_err(io("sending the hello"))?;
    let mut reply = [0u8; REPLY_BYTES];
    read_by(&mut stream, &mut reply, deadline).map_err(io(
        "reading the reply (the listener closed or did not answer: is it rank {s} of this communicator, \
         with the same handoff version?)",
    ))?;
    if u64_at(&reply, 0) != REPLY_MAGIC {
        return Err(format!(
            "rank {c}'s verification channel to rank {s} at {addr}: the listener is not a handoff rank \
             of this version (verification channel 2)"
        ));
    }
    match u32_at(&reply, 8) {
        OK => {}
        SECRET_DIFFERS => {
            return Err(format!(
                "rank {s} {} a shared secret and rank {c} {}: set the same HANDOFF_SECRET (or \
                 HANDOFF_SECRET_FILE) for every rank, or for none",
                if flags == 1 { "has no" } else { "has" },
                if flags == 1 { "has one" } else { "has none" }
            ));
        }
        NOT_PROVEN => return Err(not_proven(addr, pair, secret)),
        code => {
            return Err(format!(
                "rank {s} at {addr} refused rank {c}'s verification channel (code {code}): it does \
                 not expect rank {c} there; do all ranks run the same handoff in one communicator?"
            ));
        }
    }
    let second: &[u8; MESSAGE] = reply[16..].try_into().expect("a Noise message");
    if !handshake.read(second) {
        return Err(not_proven(addr, pair, secret));
    }
    let session = handshake.finish()?;
    write_by(&mut stream, &session.confirmation(), deadline).map_err(io("sending the confirmation"))?;
    let mut confirmation = [0u8; TAG];
    read_by(&mut stream, &mut confirmation, deadline).map_err(io(
        "reading the confirmation (rank {s} refused this rank's: do the ranks have the same HANDOFF_SECRET?)",
    ))?;
    if !session.confirms(&confirmation) {
        return Err(format!("rank {s} at {addr} did not confirm rank {c}'s handshake"));
    }
    Ok((stream, Arc::new(session)))
}

fn not_proven(addr: SocketAddr, pair: Pair, secret: Option<&[u8]>) -> String {
    let s = pair.server;
    format!(
        "rank {s} at {addr} and this rank could not prove to each other that they hold this job's {}: \
         refused (a process that is not rank {s}, or ranks with different HANDOFF_SECRET)",
        if secret.is_some() {
            "shared secret and channel tokens"
        } else {
            "channel tokens"
        }
    )
}

/// Serves one connection to rank `me`'s listener: the client must be a rank `c` for which
/// `token_of(c)` is its channel token, and prove it, within [`HANDSHAKE_WAIT`] and by
/// `deadline`. Returns `c`.
///
/// # Errors
/// Why the connection was refused.
pub(crate) fn serve(
    mut stream: TcpStream,
    me: usize,
    world: usize,
    my_token: u128,
    token_of: &dyn Fn(usize) -> Option<u128>,
    secret: Option<&[u8]>,
    deadline: Instant,
) -> Result<(usize, TcpStream, Keys), String> {
    let fail = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| format!("{what}: {e}")
    };
    let deadline = deadline.min(Instant::now() + HANDSHAKE_WAIT);
    stream.set_nodelay(true).map_err(fail("setting TCP_NODELAY"))?;
    let mut hello = [0u8; HELLO_BYTES];
    read_by(&mut stream, &mut hello[..8], deadline).map_err(fail("reading a hello"))?;
    match u64_at(&hello, 0) {
        HELLO_MAGIC => {}
        HELLO_MAGIC_V1 => {
            // Version 1's client reads this as a refusal naming its code; then it is closed.
            let _ = read_by(&mut stream, &mut [0u8; HELLO_BYTES_V1 - 8], deadline);
            let mut reply = [0u8; REPLY_BYTES_V1];
            reply[..8].copy_from_slice(&REPLY_MAGIC_V1.to_le_bytes());
            reply[8..16].copy_from_slice(&u64::from(OTHER_VERSION).to_le_bytes());
            let _ = write_by(&mut stream, &reply, deadline);
            return Err(
                "a hello of verification channel version 1, this rank speaks version 2: run the same handoff \
                 version on every rank"
                    .into(),
            );
        }
        _ => return Err("not a handoff hello".into()),
    }
    read_by(&mut stream, &mut hello[8..], deadline).map_err(fail("reading a hello"))?;
    let (c, s, w, flags) = (
        u32_at(&hello, 8) as usize,
        u32_at(&hello, 12) as usize,
        u32_at(&hello, 16) as usize,
        u32_at(&hello, 20),
    );
    let token = (s == me && w == world).then(|| token_of(c)).flatten();
    let mut handshake = None;
    let status = match token {
        None => NOT_EXPECTED,
        Some(_) if flags != u32::from(secret.is_some()) => SECRET_DIFFERS,
        Some(client_token) => {
            let pair = Pair {
                server: me,
                client: c,
                world,
                server_token: my_token,
                client_token,
            };
            let mut h = Handshake::responder(&prologue(&hello[..HELLO_CLEAR]), &psk(pair, secret))?;
            let first: &[u8; MESSAGE] = hello[HELLO_CLEAR..].try_into().expect("a Noise message");
            if h.read(first) {
                handshake = Some(h);
                OK
            } else {
                NOT_PROVEN
            }
        }
    };
    let mut reply = [0u8; REPLY_BYTES];
    reply[..8].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
    reply[8..16].copy_from_slice(&u64::from(status).to_le_bytes());
    if let Some(h) = handshake.as_mut() {
        reply[16..].copy_from_slice(&h.write()?);
    }
    write_by(&mut stream, &reply, deadline).map_err(fail("sending the reply"))?;
    let session = match (handshake, status) {
        (Some(h), OK) => h.finish()?,
        (_, SECRET_DIFFERS) => {
            return Err(format!("rank {c} and this rank differ on having a shared secret"));
        }
        (_, NOT_PROVEN) => {
            return Err(format!(
                "a client claiming to be rank {c} could not prove it holds the job's secret and channel tokens"
            ));
        }
        _ => {
            return Err(format!(
                "a hello as rank {c} of {w} to rank {s}: not a peer this rank expects"
            ));
        }
    };
    // The first message may be a replay: only the confirmation shows the client saw this
    // server's ephemeral key.
    let mut confirmation = [0u8; TAG];
    read_by(&mut stream, &mut confirmation, deadline).map_err(fail("reading the client's confirmation"))?;
    if !session.confirms(&confirmation) {
        return Err(format!(
            "a client claiming to be rank {c} could not prove it holds the job's secret and channel tokens \
             (its confirmation does not authenticate: a replayed hello?)"
        ));
    }
    write_by(&mut stream, &session.confirmation(), deadline).map_err(fail("sending the confirmation"))?;
    Ok((c, stream, Arc::new(session)))
}
