//! The verification channel: what a shared mapping of a peer's mailbox gives a rank on one
//! host, over TCP to a rank on another.
//!
//! For each remote peer a rank keeps a mirror, an in-process [`Region`] that only a receiver
//! thread writes, from the frames the peer sends; and it forwards, as one frame, every write to
//! its own region that the peer reads (an entry it publishes, a checked counter, a collective,
//! its status, its heartbeat). The receiver applies each frame with the mailbox's own stores
//! (the entry's words, then its tag with release), so [`super::verify`] reads mirrors exactly
//! as it reads mapped files.
//!
//! A frame is five little-endian words (kind and four arguments) and the first 16 bytes of an
//! HMAC-SHA256, under the connection's key for that direction (see [`super::auth`]), of its
//! sequence number and words: a frame that is forged, replayed, reordered, cut or unknown ends
//! the connection, and the peer's mirror reads as broken ([`super::mailbox::BROKEN`]), as does
//! one the peer closed. A frame only ever writes the mirror's block for this rank, its
//! collective ring and its header, at indices the mailbox reduces into the region.
//!
//! The writing thread sends its frame itself, without blocking (`MSG_DONTWAIT`): a socket
//! buffer holds thousands of frames and the peer's receiver drains it. Should it be full (the
//! peer stopped reading), an entry or counter waits for room up to the communicator's timeout,
//! without holding the connection's lock, and then the peer counts as broken; the watchdog's
//! heartbeat and a broken note never wait (they are queued, up to a bound, behind what the
//! socket has not taken).

use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hmac::Mac;

use super::auth::{HmacSha256, Keys};
use super::mailbox::Region;
use super::wire::Dir;

const FRAME_WORDS: usize = 5;
const TAG_BYTES: usize = 16;
const FRAME_BYTES: usize = FRAME_WORDS * 8 + TAG_BYTES;
/// How much a connection queues for a peer that does not read, beyond what its socket took.
const QUEUE_LIMIT: usize = 64 * 1024;

const K_PUBLISH: u64 = 1;
const K_CHECKED: u64 = 2;
const K_COLL: u64 = 3;
const K_COLL_CHECKED: u64 = 4;
const K_BROKEN: u64 = 5;
const K_HEARTBEAT: u64 = 6;

/// A write to the owner's region that a peer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Note {
    /// Entry `index` with the peer in `dir`: [`super::wire::OpDesc::encode`]'s words.
    Publish { dir: Dir, index: u64, words: [u64; 2] },
    /// The owner checked `n` of the peer's operations in `dir`.
    Checked { dir: Dir, n: u64 },
    /// Collective `index`: [`super::wire::CollDesc::encode`]'s words.
    Coll { index: u64, words: [u64; 3] },
    /// The owner checked `n` of the peer's collectives.
    CollChecked { n: u64 },
    /// The owner's communicator broke.
    Broken,
    /// The owner's watchdog is alive; whether its oldest operation is held up by its own work.
    Heartbeat { backlog: bool },
}

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

/// Wall-clock milliseconds, as the watchdog's heartbeats count them.
pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn tag(key: &HmacSha256, seq: u64, words: &[u8]) -> [u8; 32] {
    let mut m = key.clone();
    m.update(&seq.to_le_bytes());
    m.update(words);
    m.finalize().into_bytes().into()
}

// Linux's send(2) flags (libc is not a dependency).
/// Return at once instead of waiting for room in the socket buffer.
const MSG_DONTWAIT: i32 = 0x40;
/// A closed connection is an error (EPIPE), not a SIGPIPE.
const MSG_NOSIGNAL: i32 = 0x4000;

unsafe extern "C" {
    /// POSIX `send`.
    fn send(fd: i32, buf: *const u8, len: usize, flags: i32) -> isize;
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

/// The sending half of one connection.
struct Out {
    stream: TcpStream,
    key: HmacSha256,
    seq: u64,
    /// Frames, or the end of one, that the socket has not taken yet.
    queued: Vec<u8>,
    /// The connection failed: nothing more is sent.
    dead: bool,
}

impl Out {
    /// Queues `note`'s frame (if `always`, or the queue is short) and sends what the socket
    /// takes. False once the connection has failed.
    fn push(&mut self, note: Note, always: bool) -> bool {
        if self.dead {
            return false;
        }
        if always || self.queued.len() < QUEUE_LIMIT {
            let mut frame = [0u8; FRAME_BYTES];
            for (i, w) in note.encode().into_iter().enumerate() {
                frame[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
            }
            let t = tag(&self.key, self.seq, &frame[..FRAME_WORDS * 8]);
            frame[FRAME_WORDS * 8..].copy_from_slice(&t[..TAG_BYTES]);
            self.seq += 1;
            self.queued.extend_from_slice(&frame);
        }
        self.flush()
    }

    fn flush(&mut self) -> bool {
        while !self.dead && !self.queued.is_empty() {
            match send_now(&self.stream, &self.queued) {
                Ok(0) => break,
                Ok(n) => {
                    self.queued.drain(..n);
                }
                Err(_) => self.dead = true,
            }
        }
        !self.dead
    }
}

struct Peer {
    out: Mutex<Out>,
    /// The peer's region as this rank sees it.
    mirror: Arc<Region>,
    /// Tells the receiver to end.
    stop: Arc<AtomicBool>,
    receiver: Option<JoinHandle<()>>,
}

/// How often a receiver with nothing to read looks whether its channel is being dropped.
const STOP_POLL: Duration = Duration::from_millis(20);
/// How long a dropped channel waits for a peer to confirm it read every frame.
const LINGER: Duration = Duration::from_secs(1);

/// One rank's connections to its remote peers, owned by its own region.
pub(crate) struct Channel {
    /// By rank: `None` for this rank and peers that share a mailbox file with it.
    peers: Vec<Option<Peer>>,
    /// How long an entry waits for room in a full socket.
    timeout: Duration,
}

/// The mirrors of the peers' regions, by rank.
pub(crate) type Mirrors = Vec<(usize, Arc<Region>)>;

/// An authenticated connection to peer `rank`, ready to carry frames.
pub(crate) struct Connection {
    pub(crate) rank: usize,
    pub(crate) stream: TcpStream,
    pub(crate) keys: Keys,
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
            c.stream.set_read_timeout(Some(STOP_POLL)).map_err(fail)?;
            let reading = c.stream.try_clone().map_err(fail)?;
            let stop = Arc::new(AtomicBool::new(false));
            let receiver = {
                let (mirror, stop) = (mirror.clone(), stop.clone());
                let key = c.keys.recv;
                std::thread::Builder::new()
                    .name(format!("handoff-verify-r{me}-from-r{}", c.rank))
                    .spawn(move || receive(reading, key, &mirror, me, &stop))
                    .map_err(fail)?
            };
            mirrors.push((c.rank, mirror.clone()));
            peers[c.rank] = Some(Peer {
                out: Mutex::new(Out {
                    stream: c.stream,
                    key: c.keys.send,
                    seq: 0,
                    queued: Vec::new(),
                    dead: false,
                }),
                mirror,
                stop,
                receiver: Some(receiver),
            });
        }
        Ok((Channel { peers, timeout }, mirrors))
    }

    /// Sends `note` to `peer`, if remote. An entry or counter waits (bounded by the timeout)
    /// for room in a full socket; a heartbeat or a broken note never waits.
    pub(crate) fn tell(&self, peer: usize, note: Note) {
        let Some(Some(p)) = self.peers.get(peer) else {
            return;
        };
        let must = !matches!(note, Note::Heartbeat { .. } | Note::Broken);
        let lock = || p.out.lock().unwrap_or_else(|e| e.into_inner());
        if !lock().push(note, must) {
            p.mirror.set_broken();
            return;
        }
        if !must {
            return;
        }
        // Full: wait for room without holding the lock, so that the watchdog's notes queue.
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            {
                let mut out = lock();
                if !out.flush() {
                    break;
                }
                if out.queued.is_empty() {
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

    /// Sends `note` to every remote peer.
    pub(crate) fn tell_all(&self, note: Note) {
        for r in 0..self.peers.len() {
            self.tell(r, note);
        }
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
            let mut out = p.out.lock().unwrap_or_else(|e| e.into_inner());
            out.flush();
            let _ = out.stream.shutdown(Shutdown::Write);
        }
        for p in self.peers.iter_mut().flatten() {
            if let Some(t) = p.receiver.take() {
                let _ = t.join();
            }
        }
    }
}

/// The receiver of one connection: applies each frame to `mirror` until the connection ends
/// or carries a frame no honest handoff sends; then the mirror reads as broken.
fn receive(mut stream: TcpStream, key: HmacSha256, mirror: &Region, me: usize, stop: &AtomicBool) {
    let mut seq = 0u64;
    let mut frame = [0u8; FRAME_BYTES];
    let mut have = 0;
    let mut stopping: Option<Instant> = None;
    loop {
        if stop.load(Ordering::Relaxed) && stopping.get_or_insert_with(Instant::now).elapsed() >= LINGER {
            break;
        }
        match stream.read(&mut frame[have..]) {
            Ok(0) => {
                // Every frame of the peer's is read: its side may close now.
                let _ = stream.shutdown(Shutdown::Write);
                break;
            }
            Ok(n) => have += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        if have < FRAME_BYTES || stopping.is_some() {
            // Once dropping, frames are only read to the peer's end.
            have %= FRAME_BYTES;
            continue;
        }
        have = 0;
        let (words, their_tag) = frame.split_at(FRAME_WORDS * 8);
        // Compared in constant time: a forged tag learns nothing of the right one.
        let mut m = key.clone();
        m.update(&seq.to_le_bytes());
        m.update(words);
        if m.verify_truncated_left(their_tag).is_err() {
            break;
        }
        seq += 1;
        let w: [u64; FRAME_WORDS] =
            std::array::from_fn(|i| u64::from_le_bytes(words[i * 8..i * 8 + 8].try_into().expect("8 bytes")));
        let Some(note) = Note::decode(w) else {
            break;
        };
        note.apply(mirror, me);
    }
    mirror.set_broken();
}

#[cfg(test)]
pub(super) fn frame_for_test(key: &HmacSha256, seq: u64, words: [u64; FRAME_WORDS]) -> Vec<u8> {
    let mut frame = vec![0u8; FRAME_BYTES];
    for (i, w) in words.into_iter().enumerate() {
        frame[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    let t = tag(key, seq, &frame[..FRAME_WORDS * 8]);
    frame[FRAME_WORDS * 8..].copy_from_slice(&t[..TAG_BYTES]);
    frame
}
