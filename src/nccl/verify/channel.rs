//! The verification channel: what a shared mapping of a peer's mailbox gives a rank on one
//! host, over TCP to a rank on another.
//!
//! For each remote peer a rank keeps a mirror, an in-process [`Region`] that only the frames
//! the peer sends write; and it forwards, as a frame, every write to its own region that the
//! peer reads (an entry it publishes, a checked counter, a collective, its status, its
//! heartbeat). Frames are applied with the mailbox's own stores (the entry's words, then its
//! tag with release), so [`crate::nccl::verify::verify`] reads mirrors exactly as it reads mapped files.
//!
//! A frame is five little-endian words (kind and four arguments). Frames travel in records:
//! a u16 (little-endian) counting the bytes that follow, then the frames (1 to [`MAX_FRAMES`])
//! sealed with ChaCha20-Poly1305 as that direction's next record of the connection's Noise
//! session (see [`crate::nccl::verify::auth`] and [`crate::nccl::bootstrap::noise`]): encrypted,
//! and bound to its sequence number by the nonce. A record that is forged, replayed, reordered,
//! reflected, cut, of a bad length or with a frame no handoff writes ends the connection, and the peer's
//! mirror reads as broken ([`crate::nccl::verify::mailbox::BROKEN`]), as does one the peer closed. A frame
//! only ever writes the mirror's block for this rank, its collective ring and its header, at
//! indices the mailbox reduces into the region.
//!
//! Who reads: a thread waiting in [`crate::nccl::verify::verify`] for a remote peer reads that peer's
//! socket itself ([`Channel::pump`], then [`Channel::wait`] once it has spun a while), so a
//! frame reaches the mirror without a thread waking; the connection's receiver thread reads
//! whenever no verification has read it for [`IDLE`] (the watchdog's heartbeats, a peer's
//! broken note), and keeps out of the way otherwise. A lock per connection keeps the two in
//! order.
//!
//! Who writes: the writing thread seals and sends its frames itself, without blocking
//! (`MSG_DONTWAIT`): a socket buffer holds thousands of frames and the peer reads them. While
//! a verification runs, the frames of its peers are corked ([`Channel::cork`]): what it
//! publishes and checks goes out as one record, one system call, before it waits and when it
//! returns. A checked counter is held back, its later value replacing its earlier one, until
//! it lags half a ring behind (see `Out::due`), a verification waits on the socket, or the
//! receiver thread sends it (within twice [`IDLE`]): the peer needs counters only to reuse the
//! slots of a full ring, and the common record is then one entry's frame.
//! Should the socket be full (the peer stopped reading), an entry or counter waits for room up
//! to the communicator's timeout, without holding the connection's lock, and then the peer
//! counts as broken; the watchdog's heartbeat and a broken note never wait (they are queued,
//! up to a bound, behind what the socket has not taken).

use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::nccl::bootstrap::noise::TAG;
use crate::nccl::verify::auth::Keys;
use smallvec::SmallVec;

use crate::nccl::verify::mailbox::{Note, RING, Region, Relay, SharedMemory};
use crate::nccl::verify::transport::{Transport, wait_in_memory};
use crate::nccl::verify::wire::{CollEntry, Dir, OpDesc};

const FRAME_WORDS: usize = 5;
const FRAME_BYTES: usize = FRAME_WORDS * 8;
/// The most frames one record carries.
pub(super) const MAX_FRAMES: usize = 64;
/// A record's length prefix.
const LEN_BYTES: usize = 2;
/// The most bytes of frames one record carries.
const FRAMES_MAX: usize = MAX_FRAMES * FRAME_BYTES;
/// How much a connection queues for a peer that does not read, beyond what its socket took.
const QUEUE_LIMIT: usize = 64 * 1024;
/// How much one read takes at most.
const READ_BYTES: usize = 16 * 1024;

const K_PUBLISH: u64 = 1;
const K_CHECKED: u64 = 2;
const K_COLL: u64 = 3;
const K_COLL_CHECKED: u64 = 4;
const K_BROKEN: u64 = 5;
const K_HEARTBEAT: u64 = 6;

fn dir_code(d: Dir) -> u64 {
    match d {
        Dir::Send => 0,
        Dir::Recv => 1,
    }
}

fn code_dir(c: u64) -> Option<Dir> {
    match c {
        0 => Some(Dir::Send),
        1 => Some(Dir::Recv),
        _ => None,
    }
}

impl Note {
    fn encode(self) -> [u64; FRAME_WORDS] {
        match self {
            Note::Publish { dir, index, words } => [K_PUBLISH, dir_code(dir), index, words[0], words[1]],
            Note::Checked { dir, n } => [K_CHECKED, dir_code(dir), n, 0, 0],
            Note::Coll { index, words } => [K_COLL, index, words[0], words[1], words[2]],
            Note::CollChecked { n } => [K_COLL_CHECKED, n, 0, 0, 0],
            Note::Broken => [K_BROKEN, 0, 0, 0, 0],
            Note::Heartbeat { backlog } => [K_HEARTBEAT, u64::from(backlog), 0, 0, 0],
        }
    }

    /// `None` for words no handoff writes.
    fn decode(w: [u64; FRAME_WORDS]) -> Option<Note> {
        let zero = |from: usize| w[from..].iter().all(|&x| x == 0);
        Some(match w[0] {
            // No rank issues 2^64 - 1 operations: its tag would wrap.
            K_PUBLISH | K_COLL
                if w[0] == K_PUBLISH && w[2] == u64::MAX || w[0] == K_COLL && w[1] == u64::MAX =>
            {
                return None;
            }
            K_PUBLISH => Note::Publish {
                dir: code_dir(w[1])?,
                index: w[2],
                words: [w[3], w[4]],
            },
            K_CHECKED if zero(3) => Note::Checked {
                dir: code_dir(w[1])?,
                n: w[2],
            },
            K_COLL => Note::Coll {
                index: w[1],
                words: [w[2], w[3], w[4]],
            },
            K_COLL_CHECKED if zero(2) => Note::CollChecked { n: w[1] },
            K_BROKEN if zero(1) => Note::Broken,
            K_HEARTBEAT if w[1] <= 1 && zero(2) => Note::Heartbeat { backlog: w[1] == 1 },
            _ => return None,
        })
    }

    /// Applies what peer `owner` wrote to `mirror`, its region as rank `me` sees it.
    fn apply(self, mirror: &Region, me: usize) {
        match self {
            Note::Publish { dir, index, words } => mirror.publish_words(me, dir, index, words),
            Note::Checked { dir, n } => mirror.set_checked(me, dir, n),
            Note::Coll { index, words } => mirror.publish_coll_words(index, words),
            Note::CollChecked { n } => mirror.set_coll_checked(me, n),
            Note::Broken => mirror.set_broken(),
            // The receiver's clock: hosts' clocks need not agree.
            Note::Heartbeat { backlog } => mirror.set_heartbeat(now_ms(), backlog),
        }
    }
}

pub(super) use crate::nccl::verify::mailbox::now_ms;

/// The most records one direction of a connection carries (far below the nonces Noise allows).
const MAX_RECORDS: u64 = 1 << 56;

fn word_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

// Linux's flags and poll(2)'s entry (libc is not a dependency).
/// Return at once instead of waiting for room in the socket buffer, or for data.
const MSG_DONTWAIT: i32 = 0x40;
/// A closed connection is an error (EPIPE), not a SIGPIPE.
const MSG_NOSIGNAL: i32 = 0x4000;
/// Data to read (or the end of the stream).
const POLLIN: i16 = 0x1;

#[repr(C)]
struct PollFd {
    fd: i32,
    events: i16,
    revents: i16,
}

unsafe extern "C" {
    /// POSIX `send`.
    fn send(fd: i32, buf: *const u8, len: usize, flags: i32) -> isize;
    /// POSIX `recv`.
    fn recv(fd: i32, buf: *mut u8, len: usize, flags: i32) -> isize;
    /// POSIX `poll`.
    fn poll(fds: *mut PollFd, nfds: std::ffi::c_ulong, timeout: i32) -> i32;
}

/// Sends what of `buf` the socket takes now. `Ok(0)` when it takes nothing.
fn send_now(s: &TcpStream, buf: &[u8]) -> std::io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes for the call; `s` owns the descriptor.
        let n = unsafe {
            send(
                s.as_raw_fd(),
                buf.as_ptr(),
                buf.len(),
                MSG_DONTWAIT | MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

/// Reads what the socket holds now, into `buf` (not empty): `Ok(None)` when it holds nothing,
/// `Ok(Some(0))` at the end of the stream.
fn recv_now(s: &TcpStream, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
    loop {
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the call; `s` owns the
        // descriptor.
        let n = unsafe { recv(s.as_raw_fd(), buf.as_mut_ptr(), buf.len(), MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Waits up to `ms` milliseconds (0: not at all) until one of `fds` has data or has ended.
fn poll_fds(fds: &mut [PollFd], ms: i32) {
    // SAFETY: `fds` is valid for reads and writes of `fds.len()` entries for the call. A
    // failure (EINTR) is an early return, which every caller treats as a spurious wake.
    unsafe { poll(fds.as_mut_ptr(), fds.len() as std::ffi::c_ulong, ms) };
}

fn millis(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// The sending half of one connection.
struct Out {
    stream: TcpStream,
    key: Keys,
    /// The next record's sequence number.
    seq: u64,
    /// The next record's frames so far, in the clear.
    open: Vec<u8>,
    frames: usize,
    /// Sealed records, or the end of one, that the socket has not taken yet.
    queued: Vec<u8>,
    /// What is open or queued holds an entry or counter (which waits for room).
    must: bool,
    /// The checked counters (sends, receives, collectives) not sent yet: a later value replaces
    /// an earlier one, as it would the word in a shared mailbox. See [`Out::due`].
    held: [Option<u64>; 3],
    /// The counters' values last sealed into a record.
    sent: [u64; 3],
    /// A verification holds the frames back until it flushes them.
    corked: bool,
    /// The connection failed: nothing more is sent.
    dead: bool,
}

impl Out {
    fn new(stream: TcpStream, key: Keys) -> Out {
        Out {
            stream,
            key,
            seq: 0,
            open: Vec::with_capacity(FRAMES_MAX),
            frames: 0,
            queued: Vec::new(),
            must: false,
            held: [None; 3],
            sent: [0; 3],
            corked: false,
            dead: false,
        }
    }

    /// Adds `note`'s frame to the next record: always if `must`, else while the queue is short.
    /// A checked counter is held instead (see [`Out::due`]).
    fn push(&mut self, note: Note, must: bool) {
        if self.dead || !must && self.queued.len() + self.open.len() >= QUEUE_LIMIT {
            return;
        }
        match note {
            Note::Checked { dir, n } => self.held[dir_code(dir) as usize] = Some(n),
            Note::CollChecked { n } => self.held[2] = Some(n),
            _ => {
                for w in note.encode() {
                    self.open.extend_from_slice(&w.to_le_bytes());
                }
                self.frames += 1;
                self.must |= must;
                // Room for the held counters.
                if self.frames + self.held.len() == MAX_FRAMES {
                    self.seal(true);
                }
            }
        }
    }

    /// Whether a held counter must go with the next record: it moved half a ring since it was
    /// last sent. The peer needs a counter only to reuse a slot of a full ring (it publishes
    /// entry `i` once this rank has checked `i - RING`), so one that lags by less than half a
    /// ring may wait for a record it is due in, a verification that waits
    /// ([`Channel::wait`]), or the receiver thread (within twice [`IDLE`]); sending each
    /// value would add a frame, and a block of the tag, to every record. It never holds up
    /// an entry this rank waits for: waiting for entry `c` means it has checked `c`, so the
    /// peer knows of more than `c - RING / 2` and may publish up to past `c + RING / 2`. (A
    /// verification flushes at every look, so what becomes due while it waits goes at once.)
    fn due(&self) -> bool {
        self.held
            .iter()
            .zip(self.sent)
            .any(|(h, s)| h.is_some_and(|h| h.wrapping_sub(s) >= RING / 2))
    }

    /// Closes the open record with the held counters (all of them, or only if [`Out::due`]):
    /// its length, its frames sealed, into the queue.
    fn seal(&mut self, counters: bool) {
        let counters = counters || self.due();
        if self.frames == 0 && !(counters && self.held.iter().any(Option::is_some)) {
            return;
        }
        if counters {
            for c in 0..self.held.len() {
                let Some(n) = self.held[c].take() else {
                    continue;
                };
                let note = match c {
                    0 => Note::Checked { dir: Dir::Send, n },
                    1 => Note::Checked { dir: Dir::Recv, n },
                    _ => Note::CollChecked { n },
                };
                for w in note.encode() {
                    self.open.extend_from_slice(&w.to_le_bytes());
                }
                self.frames += 1;
                self.sent[c] = n;
                self.must = true;
            }
        }
        if self.seq >= MAX_RECORDS {
            self.dead = true;
        }
        let sealed = self.open.len() + TAG;
        let at = self.queued.len() + LEN_BYTES;
        self.queued.extend_from_slice(&(sealed as u16).to_le_bytes());
        self.queued.resize(at + sealed, 0);
        if !self.key.seal(self.seq, &self.open, &mut self.queued[at..]) {
            self.dead = true;
        }
        self.seq += 1;
        self.open.clear();
        self.frames = 0;
    }

    /// Seals the open record (with every held counter if `counters`, else those due) and sends
    /// what the socket takes. False once the connection has failed.
    fn flush(&mut self, counters: bool) -> bool {
        self.seal(counters);
        while !self.dead && !self.queued.is_empty() {
            match send_now(&self.stream, &self.queued) {
                Ok(0) => break,
                Ok(n) => {
                    self.queued.drain(..n);
                }
                Err(_) => self.dead = true,
            }
        }
        if self.queued.is_empty() {
            self.must = false;
        }
        !self.dead
    }

    /// An entry or counter is still waiting for room in the socket.
    fn stuck(&self) -> bool {
        self.must && !self.queued.is_empty()
    }
}

/// The receiving half of one connection.
struct In {
    stream: TcpStream,
    key: Keys,
    /// The next record's sequence number.
    seq: u64,
    buf: Box<[u8]>,
    have: usize,
    /// A record's frames, opened.
    plain: Box<[u8; FRAMES_MAX]>,
    /// The connection ended: closed, failed, or it carried what no honest handoff sends.
    ended: bool,
}

impl In {
    /// See [`Channel::mark`].
    fn mark(&self) -> u64 {
        self.seq << 1 | u64::from(self.ended)
    }

    /// Reads what the socket holds and applies each whole record to `mirror`, this peer's
    /// region as rank `me` sees it; with `discard` (the channel is being dropped), reads to the
    /// peer's end without applying. False once the connection has ended: the mirror then
    /// reads as broken.
    fn drain(&mut self, mirror: &Region, me: usize, discard: bool) -> bool {
        while !self.ended {
            // At most a record's less than whole is kept: the buffer always has room.
            let room = &mut self.buf[self.have..];
            let wanted = room.len();
            match recv_now(&self.stream, room) {
                Ok(None) => break,
                Ok(Some(0)) => {
                    // Every frame of the peer's is read: its side may close now.
                    let _ = self.stream.shutdown(Shutdown::Write);
                    self.ended = true;
                }
                Ok(Some(n)) => {
                    self.have += n;
                    if discard {
                        self.have = 0;
                    } else if !self.apply(mirror, me) {
                        self.ended = true;
                    } else if n < wanted {
                        // The socket is empty for now: spare the call that would say so.
                        break;
                    }
                }
                Err(_) => self.ended = true,
            }
        }
        if self.ended {
            mirror.set_broken();
        }
        !self.ended
    }

    /// Applies the whole records at the front of the buffer and keeps the rest. False at a
    /// record no honest handoff sends (then nothing of it is applied).
    fn apply(&mut self, mirror: &Region, me: usize) -> bool {
        let mut at = 0;
        loop {
            let rest = &self.buf[at..self.have];
            if rest.len() < LEN_BYTES {
                break;
            }
            let sealed = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
            // Checked before anything waits for it: a length no honest handoff sends.
            let Some(body) = sealed.checked_sub(TAG) else {
                return false;
            };
            if body == 0 || body > FRAMES_MAX || body % FRAME_BYTES != 0 {
                return false;
            }
            if rest.len() < LEN_BYTES + sealed {
                break;
            }
            if self.seq >= MAX_RECORDS {
                return false;
            }
            let plain = &mut self.plain[..body];
            if !self
                .key
                .open(self.seq, &rest[LEN_BYTES..LEN_BYTES + sealed], plain)
            {
                return false;
            }
            self.seq += 1;
            let mut notes = [Note::Broken; MAX_FRAMES];
            for (i, f) in plain.chunks_exact(FRAME_BYTES).enumerate() {
                let Some(n) = Note::decode(std::array::from_fn(|w| word_at(f, w * 8))) else {
                    return false;
                };
                notes[i] = n;
            }
            for n in &notes[..body / FRAME_BYTES] {
                n.apply(mirror, me);
            }
            at += LEN_BYTES + sealed;
        }
        self.buf.copy_within(at..self.have, 0);
        self.have -= at;
        true
    }
}

struct Peer {
    out: Arc<Mutex<Out>>,
    inn: Arc<Mutex<In>>,
    /// The socket's descriptor, to wait on (`inn`'s stream owns it).
    fd: i32,
    /// Counts verifications' reads: while it moves, the receiver thread keeps away.
    reading: Arc<AtomicU64>,
    /// The peer's region as this rank sees it.
    mirror: Arc<Region>,
    /// Tells the receiver to end.
    stop: Arc<AtomicBool>,
    receiver: Option<JoinHandle<()>>,
}

impl Peer {
    fn out(&self) -> MutexGuard<'_, Out> {
        self.out.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_in(&self) -> MutexGuard<'_, In> {
        self.inn.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How often a receiver with nothing to read looks whether its channel is being dropped.
const STOP_POLL: Duration = Duration::from_millis(20);
/// How long after a verification last read a connection its receiver thread reads it again.
const IDLE: Duration = Duration::from_millis(20);
/// How long a dropped channel waits for a peer to confirm it read every frame.
const LINGER: Duration = Duration::from_secs(1);

/// One rank's connections to its remote peers, owned by its own region.
pub(crate) struct Channel {
    me: usize,
    /// By rank: `None` for this rank and peers that share a mailbox file with it.
    peers: Vec<Option<Peer>>,
    /// How long an entry waits for room in a full socket.
    timeout: Duration,
}

/// Peers, and their sockets to poll.
type Polled = (smallvec::SmallVec<[usize; 8]>, smallvec::SmallVec<[PollFd; 8]>);

/// The mirrors of the peers' regions, by rank.
pub(crate) type Mirrors = Vec<(usize, Arc<Region>)>;

/// An authenticated connection to peer `rank`, ready to carry frames.
pub(crate) struct Connection {
    pub(crate) rank: usize,
    pub(crate) stream: TcpStream,
    pub(crate) keys: Keys,
}

impl Relay for Channel {
    fn tell(&self, peer: usize, note: Note) {
        Channel::tell(self, peer, note);
    }

    fn tell_all(&self, note: Note) {
        Channel::tell_all(self, note);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The owner's connections to its remote peers, installed in its region, if it has any.
pub(crate) fn of(region: &Region) -> Option<&Channel> {
    region.relay()?.as_any().downcast_ref()
}

impl Channel {
    /// Starts a receiver for each connection, filling a new mirror of that peer's region, and
    /// returns the channel with the mirrors (by rank). `me` is this rank.
    ///
    /// # Errors
    /// A thread or a socket could not be made.
    pub(crate) fn start(
        me: usize,
        world: usize,
        connections: Vec<Connection>,
        timeout: Duration,
    ) -> Result<(Channel, Mirrors), String> {
        let mut peers: Vec<Option<Peer>> = (0..world).map(|_| None).collect();
        let mut mirrors = Vec::new();
        for c in connections {
            let mirror = Arc::new(Region::in_process(world, c.rank));
            let fail =
                |e: std::io::Error| format!("rank {me}'s verification channel to rank {}: {e}", c.rank);
            let reading = c.stream.try_clone().map_err(fail)?;
            let fd = reading.as_raw_fd();
            let inn = Arc::new(Mutex::new(In {
                stream: reading,
                key: c.keys.clone(),
                seq: 0,
                buf: vec![0; READ_BYTES].into_boxed_slice(),
                have: 0,
                plain: Box::new([0; FRAMES_MAX]),
                ended: false,
            }));
            let stop = Arc::new(AtomicBool::new(false));
            let verifying = Arc::new(AtomicU64::new(0));
            let out = Arc::new(Mutex::new(Out::new(c.stream, c.keys)));
            let receiver = {
                let (out, inn, verifying, mirror, stop) = (
                    out.clone(),
                    inn.clone(),
                    verifying.clone(),
                    mirror.clone(),
                    stop.clone(),
                );
                std::thread::Builder::new()
                    .name(format!("handoff-verify-r{me}-from-r{}", c.rank))
                    .spawn(move || {
                        let link = Link {
                            out: &out,
                            inn: &inn,
                            fd,
                            reading: &verifying,
                            mirror: &mirror,
                        };
                        receive(&link, me, &stop)
                    })
                    .map_err(fail)?
            };
            mirrors.push((c.rank, mirror.clone()));
            peers[c.rank] = Some(Peer {
                out,
                inn,
                fd,
                reading: verifying,
                mirror,
                stop,
                receiver: Some(receiver),
            });
        }
        Ok((Channel { me, peers, timeout }, mirrors))
    }

    fn peer(&self, peer: usize) -> Option<&Peer> {
        self.peers.get(peer).and_then(Option::as_ref)
    }

    /// Whether `peer` is reached through this channel.
    pub(crate) fn reaches(&self, peer: usize) -> bool {
        self.peer(peer).is_some()
    }

    /// Sends `note` to `peer`, if remote (or holds it while `peer` is corked). An entry or
    /// counter waits (bounded by the timeout) for room in a full socket; a heartbeat or a
    /// broken note never waits.
    pub(crate) fn tell(&self, peer: usize, note: Note) {
        let Some(p) = self.peer(peer) else {
            return;
        };
        let must = !matches!(note, Note::Heartbeat { .. } | Note::Broken);
        let mut out = p.out();
        out.push(note, must);
        if out.corked && !out.dead {
            return;
        }
        let ok = out.flush(true);
        let stuck = must && out.stuck();
        drop(out);
        self.settle(p, ok, stuck);
    }

    /// Sends `note` to every remote peer.
    pub(crate) fn tell_all(&self, note: Note) {
        for r in 0..self.peers.len() {
            self.tell(r, note);
        }
    }

    /// From now on, until [`Channel::uncork`], what is told to `peer` is held back and sent
    /// at [`Channel::flush`]: a verification's notes go out together.
    pub(crate) fn cork(&self, peer: usize) {
        if let Some(p) = self.peer(peer) {
            p.out().corked = true;
        }
    }

    /// Sends what is held back for `peer` (of the checked counters, those due: see
    /// [`Out::due`]), an entry or counter waiting (bounded by the timeout) for room in a full
    /// socket.
    pub(crate) fn flush(&self, peer: usize) {
        self.flush_with(peer, false);
    }

    /// [`Channel::flush`], with every held counter if `counters`.
    fn flush_with(&self, peer: usize, counters: bool) {
        let Some(p) = self.peer(peer) else {
            return;
        };
        let mut out = p.out();
        let held = if counters {
            out.held.iter().any(Option::is_some)
        } else {
            out.due()
        };
        if out.frames == 0 && out.queued.is_empty() && !held {
            return;
        }
        let ok = out.flush(counters);
        let stuck = out.stuck();
        drop(out);
        self.settle(p, ok, stuck);
    }

    /// Ends [`Channel::cork`] and flushes, except checked counters that are not due: the peer
    /// needs those only to reuse the slots of a full ring, so they go with a later record, or
    /// from the receiver thread, sparing a system call on a verification's way out.
    pub(crate) fn uncork(&self, peer: usize) {
        if let Some(p) = self.peer(peer) {
            p.out().corked = false;
            self.flush(peer);
        }
    }

    /// How far `peer`'s mirror has come: it moves with every record applied, by whichever
    /// thread, and when the connection ends. Compared with an earlier value by
    /// [`Channel::pump`].
    pub(crate) fn mark(&self, peer: usize) -> u64 {
        self.peer(peer).map_or(0, |p| p.lock_in().mark())
    }

    /// Reads what `peer` sent into its mirror; for the next [`IDLE`], the receiver thread
    /// leaves the connection to the verifications. True if the mirror moved since `seen` (a
    /// [`Channel::mark`], updated): if false, nothing arrived since, and a wait on the socket
    /// misses nothing.
    pub(crate) fn pump(&self, peer: usize, seen: &mut u64) -> bool {
        self.pump_if(peer, seen, true)
    }

    fn pump_if(&self, peer: usize, seen: &mut u64, read: bool) -> bool {
        let Some(p) = self.peer(peer) else {
            return false;
        };
        p.reading.fetch_add(1, Ordering::Relaxed);
        // Waits at most for the receiver thread to apply what it read (it never waits with
        // the lock held), so that the mark covers it.
        let mut inn = p.lock_in();
        if read {
            inn.drain(&p.mirror, self.me, false);
        }
        let was = std::mem::replace(seen, inn.mark());
        was != *seen
    }

    /// [`Channel::pump`] of each of `peers`, with `seen` theirs, reading only the sockets that
    /// have something: one system call to ask them all, then one for each that has.
    pub(crate) fn pump_ready(&self, peers: impl Iterator<Item = usize>, seen: &mut [u64]) -> bool {
        let (peers, mut fds) = self.fds(peers);
        poll_fds(&mut fds, 0);
        let mut any = false;
        for ((r, f), seen) in peers.into_iter().zip(&fds).zip(seen) {
            any |= self.pump_if(r, seen, f.revents != 0);
        }
        any
    }

    /// Waits up to `timeout` (at least a millisecond) until one of `peers` sent something,
    /// having sent them every counter held back: a verification that waits this long has no
    /// system call to spare, and its peers get every slot it freed.
    pub(crate) fn wait(&self, peers: impl Iterator<Item = usize>, timeout: Duration) {
        let (peers, mut fds) = self.fds(peers);
        for p in peers {
            self.flush_with(p, true);
        }
        if !fds.is_empty() {
            poll_fds(&mut fds, millis(timeout));
        }
    }

    /// The remote ones of `peers`, and their sockets to poll.
    fn fds(&self, peers: impl Iterator<Item = usize>) -> Polled {
        peers
            .filter_map(|r| self.peer(r).map(|p| (r, p)))
            .map(|(r, p)| {
                (
                    r,
                    PollFd {
                        fd: p.fd,
                        events: POLLIN,
                        revents: 0,
                    },
                )
            })
            .unzip()
    }

    /// After a send to `p`: a failed connection makes the peer broken; an entry or counter
    /// the full socket did not take waits for room.
    fn settle(&self, p: &Peer, ok: bool, stuck: bool) {
        if !ok {
            p.mirror.set_broken();
        } else if stuck {
            self.wait_for_room(p);
        }
    }

    /// Waits for room in `p`'s full socket without holding the lock, so that the watchdog's
    /// notes queue; bounded by the timeout.
    fn wait_for_room(&self, p: &Peer) {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            {
                let mut out = p.out();
                if !out.flush(false) {
                    break;
                }
                if !out.stuck() {
                    return;
                }
                if started.elapsed() >= self.timeout {
                    out.dead = true;
                    break;
                }
            }
            spins += 1;
            if spins < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        // The peer has not read for a whole timeout, or its connection failed: a wait for it
        // ends as for a broken peer.
        p.mirror.set_broken();
    }
}

impl Drop for Channel {
    /// Sends what the sockets take of the frames queued, then closes the sending side; each
    /// receiver ends when its peer closes its own in answer, having read every frame (or after
    /// [`LINGER`]). Closing the whole connection at once could reset it (a socket closed with
    /// data unread sends a reset), and the peer lose frames it had not read yet.
    fn drop(&mut self) {
        for p in self.peers.iter().flatten() {
            p.stop.store(true, Ordering::Relaxed);
            let mut out = p.out();
            out.flush(true);
            let _ = out.stream.shutdown(Shutdown::Write);
        }
        for p in self.peers.iter_mut().flatten() {
            if let Some(t) = p.receiver.take() {
                let _ = t.join();
            }
        }
    }
}

/// What a receiver thread uses of its connection.
struct Link<'a> {
    out: &'a Mutex<Out>,
    inn: &'a Mutex<In>,
    fd: i32,
    reading: &'a AtomicU64,
    mirror: &'a Region,
}

/// The receiver thread of one connection: reads it whenever no verification has for
/// [`IDLE`], until the connection ends or carries a record no honest handoff sends (then the
/// mirror reads as broken); and sends the checked counters a verification left.
fn receive(link: &Link<'_>, me: usize, stop: &AtomicBool) {
    let Link {
        out,
        inn,
        fd,
        reading,
        mirror,
    } = *link;
    let mut seen = reading.load(Ordering::Relaxed);
    let mut stopping: Option<Instant> = None;
    loop {
        if stop.load(Ordering::Relaxed) {
            if stopping.get_or_insert_with(Instant::now).elapsed() >= LINGER {
                break;
            }
        } else {
            {
                let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                let held = out.held.iter().any(Option::is_some);
                if !out.corked && (out.frames > 0 || !out.queued.is_empty() || held) && !out.flush(true) {
                    mirror.set_broken();
                }
            }
            let now = reading.load(Ordering::Relaxed);
            if now != seen {
                // A verification reads this connection: a wake of this thread for each of its
                // frames would only slow it.
                seen = now;
                std::thread::sleep(IDLE);
                continue;
            }
        }
        poll_fds(
            &mut [PollFd {
                fd,
                events: POLLIN,
                revents: 0,
            }],
            millis(STOP_POLL),
        );
        // Once dropping, frames are only read to the peer's end.
        let mut i = inn.lock().unwrap_or_else(|e| e.into_inner());
        if !i.drain(mirror, me, stopping.is_some()) {
            break;
        }
    }
    mirror.set_broken();
}

/// The channel as a transport: for the peers it reaches, their mirrors read and its own
/// region's writes forwarded (see the module's documentation), so its entries are the
/// mailbox's ([`SharedMemory`]); what it adds is how they move. While it lives, what this rank
/// tells these peers is corked, and goes out at [`Transport::flush`] and when it is dropped (on
/// every path: a mismatch reaches the peer too); [`Transport::pump`] reads their sockets.
pub(crate) struct Channelled<'a> {
    memory: SharedMemory<'a>,
    channel: &'a Channel,
    /// The peers of the verification that the channel reaches.
    remote: SmallVec<[usize; 4]>,
    /// Each remote peer's [`Channel::mark`] when this verification last looked.
    seen: SmallVec<[u64; 4]>,
    /// Every peer the verification may wait on is remote: their sockets say when to look.
    all_remote: bool,
}

impl<'a> Channelled<'a> {
    /// The transport to `peers` (each once), of which those `channel` reaches are remote.
    pub(crate) fn new(memory: SharedMemory<'a>, channel: &'a Channel, peers: &[usize]) -> Channelled<'a> {
        let remote: SmallVec<[usize; 4]> = peers.iter().copied().filter(|&p| channel.reaches(p)).collect();
        for &r in &remote {
            channel.cork(r);
        }
        let seen = remote.iter().map(|&r| channel.mark(r)).collect();
        Channelled {
            memory,
            channel,
            all_remote: remote.len() == peers.len(),
            remote,
            seen,
        }
    }
}

impl Drop for Channelled<'_> {
    fn drop(&mut self) {
        for &r in &self.remote {
            self.channel.uncork(r);
        }
    }
}

/// How many times a verification waiting only for remote peers looks before it sleeps on
/// their sockets: each look reads them (a system call), so this is some 100 µs, more than a
/// frame takes over a loopback or a LAN; spinning longer starves ranks that share the cores.
const REMOTE_SPINS: u32 = 200;

impl Transport for Channelled<'_> {
    fn publish(&self, peer: usize, dir: Dir, index: u64, op: OpDesc) {
        self.memory.publish(peer, dir, index, op);
    }

    fn read(&self, peer: usize, dir: Dir, index: u64) -> Option<OpDesc> {
        self.memory.read(peer, dir, index)
    }

    fn checked(&self, peer: usize, dir: Dir) -> u64 {
        self.memory.checked(peer, dir)
    }

    fn mark_checked(&self, peer: usize, dir: Dir, n: u64) {
        self.memory.mark_checked(peer, dir, n);
    }

    fn publish_coll(&self, index: u64, entry: CollEntry) {
        self.memory.publish_coll(index, entry);
    }

    fn read_coll(&self, peer: usize, index: u64) -> Option<Option<CollEntry>> {
        self.memory.read_coll(peer, index)
    }

    fn coll_checked(&self, peer: usize) -> u64 {
        self.memory.coll_checked(peer)
    }

    fn mark_coll_checked(&self, peer: usize, n: u64) {
        self.memory.mark_coll_checked(peer, n);
    }

    fn broken(&self, peer: usize) -> bool {
        self.memory.broken(peer)
    }

    fn pump(&mut self) -> bool {
        if self.remote.len() > 2 {
            // Many peers (a collective's): ask which sockets have something first.
            return self
                .channel
                .pump_ready(self.remote.iter().copied(), &mut self.seen);
        }
        let mut any = false;
        for (&r, seen) in self.remote.iter().zip(&mut self.seen) {
            any |= self.channel.pump(r, seen);
        }
        any
    }

    fn flush(&mut self) {
        for &r in &self.remote {
            self.channel.flush(r);
        }
    }

    fn wait(&mut self, looks: u32, timeout: Duration) {
        if !self.all_remote || self.remote.is_empty() {
            // A peer in shared memory may write at any moment: no socket says when.
            wait_in_memory(looks, timeout);
        } else if looks < REMOTE_SPINS {
            std::hint::spin_loop();
        } else {
            self.channel.wait(self.remote.iter().copied(), timeout);
        }
    }

    fn holds(&self) -> bool {
        // A mirror is not read at the same time as the peer writes its region: two ranks could
        // both miss each other's entry.
        self.remote.is_empty()
    }
}

/// One record of `frames` sealed by `key` as its sequence number `seq`, as a peer sends it.
#[cfg(test)]
pub(super) fn record_for_test(
    key: &crate::nccl::bootstrap::noise::Session,
    seq: u64,
    frames: &[[u64; FRAME_WORDS]],
) -> Vec<u8> {
    let plain: Vec<u8> = frames.iter().flatten().flat_map(|w| w.to_le_bytes()).collect();
    let mut r = vec![0u8; LEN_BYTES + plain.len() + TAG];
    r[..LEN_BYTES].copy_from_slice(&((plain.len() + TAG) as u16).to_le_bytes());
    assert!(key.seal(seq, &plain, &mut r[LEN_BYTES..]));
    r
}

/// The frames of the records at the front of `buf` that `key` opens as the peer's records
/// `*seq` onwards (taken from `buf`); stops at the first that does not open.
#[cfg(test)]
pub(super) fn open_for_test(
    key: &crate::nccl::bootstrap::noise::Session,
    seq: &mut u64,
    buf: &mut Vec<u8>,
) -> Vec<Vec<[u64; FRAME_WORDS]>> {
    let mut records = Vec::new();
    while buf.len() >= LEN_BYTES {
        let sealed = usize::from(u16::from_le_bytes([buf[0], buf[1]]));
        if buf.len() < LEN_BYTES + sealed || sealed < TAG {
            break;
        }
        let mut plain = vec![0u8; sealed - TAG];
        if !key.open(*seq, &buf[LEN_BYTES..LEN_BYTES + sealed], &mut plain) {
            break;
        }
        *seq += 1;
        records.push(
            plain
                .chunks_exact(FRAME_BYTES)
                .map(|f| std::array::from_fn(|w| word_at(f, w * 8)))
                .collect(),
        );
        buf.drain(..LEN_BYTES + sealed);
    }
    records
}
