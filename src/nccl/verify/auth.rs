//! The verification channel's handshake: two ranks prove to each other, with fresh nonces both
//! ways, that they hold the job's shared secret (when one is set) and both channel tokens of
//! their cards (which travel only through NCCL's all-gather, never on this connection), and
//! derive the keys that authenticate every later frame (see [`crate::nccl::verify::channel`]).
//!
//! Client `c` (the higher rank) to server `s`:
//! 1. `c → s` hello: magic, ranks `c` and `s`, world, whether `c` has a secret, nonce `n_c`;
//! 2. `s → c` reply: magic, status, nonce `n_s`, `HMAC(K, "server" ‖ transcript)`;
//! 3. `c → s` `HMAC(K, "client" ‖ transcript)`;
//! 4. `s → c` an acknowledgement.
//!
//! `K = HMAC(secret or a fixed label, T_s ‖ T_c)`, the transcript is both tokens, the ranks,
//! the world, the flags and both nonces: neither proof can be replayed (fresh nonces),
//! reflected (distinct labels) or made without `K`. Frame keys are `HMAC(K, "c2s"/"s2c" ‖
//! transcript)`. Every read and write has the caller's overall deadline; the server's, also
//! [`HANDSHAKE_WAIT`] from the connection (an honest client answers at once), so that
//! connections that say nothing hold a listener's handshake slots only that long.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub(crate) type HmacSha256 = Hmac<Sha256>;

const HELLO_MAGIC: u64 = 0x4844_4f46_4656_4331; // "HDOFFVC1"
const REPLY_MAGIC: u64 = 0x4844_4f46_4656_5331; // "HDOFFVS1"
const ACK: u64 = 0x4844_4f46_464f_4b31; // "HDOFFOK1"
const HELLO_BYTES: usize = 8 + 16 + 32;
const REPLY_BYTES: usize = 8 + 8 + 32 + 32;
const NO_SECRET: &[u8] = b"handoff verification channel: no shared secret";

/// How long a server gives a client for the whole handshake (within the overall deadline).
pub(crate) const HANDSHAKE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

const OK: u32 = 0;
const NOT_EXPECTED: u32 = 1;
const SECRET_DIFFERS: u32 = 2;

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

/// The keys of an authenticated connection: one per direction.
pub(crate) struct Keys {
    pub(crate) send: HmacSha256,
    pub(crate) recv: HmacSha256,
}

fn mac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m
}

struct Transcript {
    key: [u8; 32],
    bytes: Vec<u8>,
}

impl Transcript {
    fn new(pair: Pair, secret: Option<&[u8]>, flags: u32, n_c: &[u8; 32], n_s: &[u8; 32]) -> Transcript {
        let (st, ct) = (pair.server_token.to_le_bytes(), pair.client_token.to_le_bytes());
        let key = mac(secret.unwrap_or(NO_SECRET), &[&st, &ct])
            .finalize()
            .into_bytes()
            .into();
        let mut bytes = Vec::with_capacity(120);
        for w in [pair.server as u32, pair.client as u32, pair.world as u32, flags] {
            bytes.extend_from_slice(&w.to_le_bytes());
        }
        bytes.extend_from_slice(&st);
        bytes.extend_from_slice(&ct);
        bytes.extend_from_slice(n_c);
        bytes.extend_from_slice(n_s);
        Transcript { key, bytes }
    }

    fn proof(&self, label: &[u8]) -> HmacSha256 {
        mac(&self.key, &[label, &self.bytes])
    }

    fn keys(&self, server: bool) -> Keys {
        let key = |label: &[u8]| {
            let k: [u8; 32] = self.proof(label).finalize().into_bytes().into();
            mac(&k, &[])
        };
        let (c2s, s2c) = (key(b"c2s"), key(b"s2c"));
        if server {
            Keys { send: s2c, recv: c2s }
        } else {
            Keys { send: c2s, recv: s2c }
        }
    }
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
    let n_c = random::<32>()?;
    let flags = u32::from(secret.is_some());
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
    for w in [c as u32, s as u32, pair.world as u32, flags] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    hello.extend_from_slice(&n_c);
    write_by(&mut stream, &hello, deadline).map_err(io("sending the hello"))?;
    let mut reply = [0u8; REPLY_BYTES];
    read_by(&mut stream, &mut reply, deadline).map_err(io(
        "reading the reply (the listener closed or did not answer: is it rank {s} of this communicator?)",
    ))?;
    if u64_at(&reply, 0) != REPLY_MAGIC {
        return Err(format!(
            "rank {c}'s verification channel to rank {s} at {addr}: the listener is not a handoff rank"
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
        code => {
            return Err(format!(
                "rank {s} at {addr} refused rank {c}'s verification channel (code {code}): it does \
                 not expect rank {c} there; do all ranks run the same handoff in one communicator?"
            ));
        }
    }
    let n_s: [u8; 32] = reply[16..48].try_into().expect("32 bytes");
    let t = Transcript::new(pair, secret, flags, &n_c, &n_s);
    if t.proof(b"server").verify_slice(&reply[48..80]).is_err() {
        return Err(format!(
            "rank {s} at {addr} could not prove it holds this job's {}: refused (a process that \
             is not rank {s}, or ranks with different HANDOFF_SECRET)",
            if secret.is_some() {
                "shared secret and channel tokens"
            } else {
                "channel tokens"
            }
        ));
    }
    let proof = t.proof(b"client").finalize().into_bytes();
    write_by(&mut stream, &proof, deadline).map_err(io("sending the proof"))?;
    let mut ack = [0u8; 8];
    read_by(&mut stream, &mut ack, deadline).map_err(io(
        "reading the acknowledgement (rank {s} refused this rank's proof: do the ranks have the same HANDOFF_SECRET?)",
    ))?;
    if u64_at(&ack, 0) != ACK {
        return Err(format!("rank {s} at {addr} did not acknowledge rank {c}'s proof"));
    }
    Ok((stream, t.keys(false)))
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
    read_by(&mut stream, &mut hello, deadline).map_err(fail("reading a hello"))?;
    if u64_at(&hello, 0) != HELLO_MAGIC {
        return Err("not a handoff hello".into());
    }
    let (c, s, w, flags) = (
        u32_at(&hello, 8) as usize,
        u32_at(&hello, 12) as usize,
        u32_at(&hello, 16) as usize,
        u32_at(&hello, 20),
    );
    let n_c: [u8; 32] = hello[24..56].try_into().expect("32 bytes");
    let token = (s == me && w == world).then(|| token_of(c)).flatten();
    let status = match token {
        None => NOT_EXPECTED,
        Some(_) if flags != u32::from(secret.is_some()) => SECRET_DIFFERS,
        Some(_) => OK,
    };
    let n_s = random::<32>()?;
    let mut reply = Vec::with_capacity(REPLY_BYTES);
    reply.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
    reply.extend_from_slice(&u64::from(status).to_le_bytes());
    reply.extend_from_slice(&n_s);
    let t = token.map(|client_token| {
        let pair = Pair {
            server: me,
            client: c,
            world,
            server_token: my_token,
            client_token,
        };
        Transcript::new(pair, secret, flags, &n_c, &n_s)
    });
    match (&t, status) {
        (Some(t), OK) => reply.extend_from_slice(&t.proof(b"server").finalize().into_bytes()),
        _ => reply.extend_from_slice(&[0; 32]),
    }
    write_by(&mut stream, &reply, deadline).map_err(fail("sending the reply"))?;
    let t = match (t, status) {
        (Some(t), OK) => t,
        (_, SECRET_DIFFERS) => {
            return Err(format!("rank {c} and this rank differ on having a shared secret"));
        }
        _ => {
            return Err(format!(
                "a hello as rank {c} of {w} to rank {s}: not a peer this rank expects"
            ));
        }
    };
    let mut proof = [0u8; 32];
    read_by(&mut stream, &mut proof, deadline).map_err(fail("reading the client's proof"))?;
    if t.proof(b"client").verify_slice(&proof).is_err() {
        return Err(format!(
            "a client claiming to be rank {c} could not prove it holds the job's secret and channel tokens"
        ));
    }
    write_by(&mut stream, &ACK.to_le_bytes(), deadline).map_err(fail("sending the acknowledgement"))?;
    Ok((c, stream, t.keys(true)))
}
