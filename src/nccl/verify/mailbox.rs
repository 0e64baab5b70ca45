//! Mailboxes: where each rank publishes the sends and receives it is about to post, for its
//! peers to check before anything reaches NCCL. One region per rank, written only by its owner
//! and read by its peers: shared memory (a file under `/dev/shm`, mapped by every process of the
//! communicator on the host) between processes, plain memory between the ranks of one process.
//!
//! # Layout (64-bit words)
//! A header (magic, token, rank, world, status), then one block per peer `p`:
//! - a ring of this rank's sends to `p` and a ring of its receives from `p`, [`RING`] entries
//!   each; entry `i` (0-based, in the order issued) lives in slot `i % RING` as
//!   `[i + 1, count, type]`, the tag written last (release) so a reader that sees tag `i + 1`
//!   (acquire) sees the whole entry;
//! - how many of `p`'s sends to this rank, and of `p`'s receives from it, this rank has checked.
//!   A rank overwrites a slot only once its peer has checked the entry in it, so a reader never
//!   sees a torn or overwritten entry.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::wire::{CollDesc, Dir, OpDesc};

/// Entries per ring: how far a rank may publish ahead of its peer's checks.
pub(crate) const RING: u64 = 64;
const ENTRY_WORDS: usize = 3;
const MAGIC: u64 = 0x4844_4f46_464d_4231; // "HDOFFMB1"
const HEADER_WORDS: usize = 8;
const H_MAGIC: usize = 0;
const H_TOKEN: usize = 1;
const H_RANK: usize = 2;
const H_WORLD: usize = 3;
const H_STATUS: usize = 4;
const H_HEARTBEAT: usize = 5;
const H_BACKLOG: usize = 6;
const RING_WORDS: usize = RING as usize * ENTRY_WORDS;
/// Two rings and three counters, rounded up to whole 64-byte lines.
const PEER_WORDS: usize = (2 * RING_WORDS + 3).div_ceil(8) * 8;
/// A collective's entry: tag, then [`CollDesc::encode`]'s three words.
const COLL_WORDS: usize = 4;

/// A rank's status word: nothing wrong.
pub(crate) const LIVE: u64 = 0;
/// A rank's status word: its communicator broke (an error, a timeout, an abort).
pub(crate) const BROKEN: u64 = 1;

enum Memory {
    /// From `Box::into_raw`, freed in `Drop`: the region's pointer is derived from it, and a
    /// `Box` moved with the region would claim unique access to the memory that pointer reads.
    Heap(*mut [AtomicU64]),
    Mapped(#[allow(dead_code)] memmap2::MmapMut),
    /// A peer's: this process only reads it.
    MappedReadOnly(#[allow(dead_code)] memmap2::Mmap),
}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Memory::Heap(p) = *self {
            // SAFETY: `p` came from `Box::into_raw` and is freed once, here.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

/// One rank's mailbox.
pub(crate) struct Region {
    words: *const AtomicU64,
    len: usize,
    world: usize,
    _memory: Memory,
}

impl Region {
    fn writable(&self) -> bool {
        !matches!(self._memory, Memory::MappedReadOnly(_))
    }
}

// SAFETY: the region is only accessed through atomics, from any thread; `words` points into
// `_memory`, which lives as long as the region and never moves (a raw heap slice, or a
// mapping).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

fn words_for(world: usize) -> Option<usize> {
    world
        .checked_mul(PEER_WORDS)?
        .checked_add(HEADER_WORDS + RING as usize * COLL_WORDS)
}

impl Region {
    fn new(memory: Memory, words: *const AtomicU64, len: usize, world: usize) -> Region {
        Region {
            words,
            len,
            world,
            _memory: memory,
        }
    }

    fn init(&self, rank: usize, token: u64) {
        self.word(H_TOKEN).store(token, Ordering::Relaxed);
        self.word(H_RANK).store(rank as u64, Ordering::Relaxed);
        self.word(H_WORLD).store(self.world as u64, Ordering::Relaxed);
        self.word(H_STATUS).store(LIVE, Ordering::Relaxed);
        self.word(H_MAGIC).store(MAGIC, Ordering::Release);
    }

    /// A mailbox in this process's memory, for ranks that all live in it.
    pub(crate) fn in_process(world: usize, rank: usize) -> Region {
        let len = words_for(world).expect("world sizes come from an i32");
        let memory: Box<[AtomicU64]> = (0..len).map(|_| AtomicU64::new(0)).collect();
        let raw = Box::into_raw(memory);
        let r = Region::new(
            Memory::Heap(raw),
            raw.cast::<AtomicU64>().cast_const(),
            len,
            world,
        );
        r.init(rank, 0);
        r
    }

    /// A new mailbox file in `dir`, for peers in other processes of this host to map.
    ///
    /// # Errors
    /// The file cannot be created, sized or mapped.
    pub(crate) fn create_file(
        dir: &Path,
        world: usize,
        rank: usize,
        token: u64,
    ) -> Result<(Region, PathBuf), String> {
        let len = words_for(world).ok_or("the world is too large for a mailbox")?;
        let path = dir.join(format!("handoff-{}-{token:016x}-r{rank}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| format!("creating {}: {e}", path.display()))?;
        let r = file
            .set_len((len * 8) as u64)
            .map_err(|e| format!("sizing {}: {e}", path.display()))
            .and_then(|()| Self::map(&file, &path, len, world));
        match r {
            Ok(region) => {
                region.init(rank, token);
                Ok((region, path))
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Maps a peer's mailbox file and checks that it is the one its card announced.
    ///
    /// # Errors
    /// The file cannot be opened or mapped (for example, the peer is on another host), or it is
    /// not that rank's mailbox.
    pub(crate) fn open_file(path: &Path, world: usize, rank: usize, token: u64) -> Result<Region, String> {
        let len = words_for(world).ok_or("the world is too large for a mailbox")?;
        let file = std::fs::File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
        let size = file.metadata().map_err(|e| e.to_string())?.len();
        if size != (len * 8) as u64 {
            return Err(format!("{} has {size} bytes, not {}", path.display(), len * 8));
        }
        // SAFETY: as in `map`; mapped read-only, as this process never writes a peer's mailbox.
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|e| format!("mapping {}: {e}", path.display()))?;
        if map.len() < len * 8 || map.as_ptr().align_offset(8) != 0 {
            return Err(format!("{} mapped short or misaligned", path.display()));
        }
        // Atomic loads of aligned 64-bit words are allowed on read-only memory (std's atomic
        // module, "Atomic accesses to read-only memory"); this region is never stored to.
        let words = map.as_ptr().cast::<AtomicU64>();
        let region = Region::new(Memory::MappedReadOnly(map), words, len, world);
        let ok = region.word(H_MAGIC).load(Ordering::Acquire) == MAGIC
            && region.word(H_TOKEN).load(Ordering::Relaxed) == token
            && region.word(H_RANK).load(Ordering::Relaxed) == rank as u64
            && region.word(H_WORLD).load(Ordering::Relaxed) == world as u64;
        if ok {
            Ok(region)
        } else {
            Err(format!("{} is not rank {rank}'s mailbox", path.display()))
        }
    }

    fn map(file: &std::fs::File, path: &Path, len: usize, world: usize) -> Result<Region, String> {
        // SAFETY: the file is this rank's mailbox, of exactly `len` words; every access to it
        // goes through atomics, so peers reading it concurrently is not a data race. Nobody
        // handoff runs truncates it while mapped: its owner sized it once and only removes its
        // name (another process of the same user could: the crate's documented trust limit).
        let mut map = unsafe { memmap2::MmapMut::map_mut(file) }
            .map_err(|e| format!("mapping {}: {e}", path.display()))?;
        if map.len() < len * 8 || map.as_ptr().align_offset(8) != 0 {
            return Err(format!("{} mapped short or misaligned", path.display()));
        }
        let words = map.as_mut_ptr().cast::<AtomicU64>().cast_const();
        Ok(Region::new(Memory::Mapped(map), words, len, world))
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.len, "mailbox word {i} out of {}", self.len);
        // SAFETY: in bounds (checked); the memory is valid, aligned and lives as long as self.
        unsafe { &*self.words.add(i) }
    }

    fn block(&self, peer: usize) -> usize {
        assert!(peer < self.world, "peer {peer} of {}", self.world);
        HEADER_WORDS + peer * PEER_WORDS
    }

    fn slot(&self, peer: usize, dir: Dir, index: u64) -> usize {
        let ring = match dir {
            Dir::Send => 0,
            Dir::Recv => RING_WORDS,
        };
        self.block(peer) + ring + (index % RING) as usize * ENTRY_WORDS
    }

    fn checked_word(&self, peer: usize, dir: Dir) -> usize {
        self.block(peer) + 2 * RING_WORDS + if dir == Dir::Send { 0 } else { 1 }
    }

    fn coll_slot(&self, index: u64) -> usize {
        HEADER_WORDS + self.world * PEER_WORDS + (index % RING) as usize * COLL_WORDS
    }

    /// Publishes this rank's collective number `index`. The caller has made sure every peer
    /// checked entry `index - RING` ([`Region::coll_checked`]).
    pub(crate) fn publish_coll(&self, index: u64, op: CollDesc) {
        assert!(self.writable(), "a peer's mailbox is never written");
        let at = self.coll_slot(index);
        for (i, w) in op.encode().into_iter().enumerate() {
            self.word(at + 1 + i).store(w, Ordering::Relaxed);
        }
        self.word(at).store(index + 1, Ordering::Release);
    }

    /// The owner's collective number `index`, once published: `Some(None)` for words no
    /// handoff wrote.
    pub(crate) fn read_coll(&self, index: u64) -> Option<Option<CollDesc>> {
        let at = self.coll_slot(index);
        if self.word(at).load(Ordering::Acquire) != index + 1 {
            return None;
        }
        let w = [1, 2, 3].map(|i| self.word(at + i).load(Ordering::Relaxed));
        Some(CollDesc::decode(w))
    }

    /// How many of `peer`'s collectives the owner has checked.
    pub(crate) fn coll_checked(&self, peer: usize) -> u64 {
        self.word(self.block(peer) + 2 * RING_WORDS + 2)
            .load(Ordering::Acquire)
    }

    /// Records that the owner has checked `n` of `peer`'s collectives.
    pub(crate) fn set_coll_checked(&self, peer: usize, n: u64) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(self.block(peer) + 2 * RING_WORDS + 2)
            .store(n, Ordering::Release);
    }

    /// Publishes this rank's operation number `index` with `peer`. The caller has made sure the
    /// peer checked entry `index - RING` ([`Region::checked`]).
    pub(crate) fn publish(&self, peer: usize, dir: Dir, index: u64, op: OpDesc) {
        assert!(self.writable(), "a peer's mailbox is never written");
        let at = self.slot(peer, dir, index);
        let [count, dtype] = op.encode();
        self.word(at + 1).store(count, Ordering::Relaxed);
        self.word(at + 2).store(dtype, Ordering::Relaxed);
        self.word(at).store(index + 1, Ordering::Release);
    }

    /// The owner's operation number `index` with `peer`, once published.
    pub(crate) fn read(&self, peer: usize, dir: Dir, index: u64) -> Option<OpDesc> {
        let at = self.slot(peer, dir, index);
        if self.word(at).load(Ordering::Acquire) != index + 1 {
            return None;
        }
        let op = OpDesc::decode([
            self.word(at + 1).load(Ordering::Relaxed),
            self.word(at + 2).load(Ordering::Relaxed),
        ]);
        Some(op)
    }

    /// How many of `peer`'s operations in direction `dir` (its sends to the owner, or its
    /// receives from the owner) the owner has checked.
    pub(crate) fn checked(&self, peer: usize, dir: Dir) -> u64 {
        self.word(self.checked_word(peer, dir)).load(Ordering::Acquire)
    }

    /// Records that the owner has checked `n` of `peer`'s operations in direction `dir`.
    pub(crate) fn set_checked(&self, peer: usize, dir: Dir, n: u64) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(self.checked_word(peer, dir))
            .store(n, Ordering::Release);
    }

    /// The owner's status ([`LIVE`] or [`BROKEN`]).
    pub(crate) fn status(&self) -> u64 {
        self.word(H_STATUS).load(Ordering::Acquire)
    }

    /// Tells every peer that the owner's communicator broke, so that none waits for it.
    pub(crate) fn set_broken(&self) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(H_STATUS).store(BROKEN, Ordering::Release);
    }

    /// The owner's watchdog says it is alive (`now_ms`, wall-clock milliseconds) and whether
    /// its oldest queued operation is still held up by earlier GPU work of its own (`backlog`).
    pub(crate) fn set_heartbeat(&self, now_ms: u64, backlog: bool) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(H_BACKLOG).store(u64::from(backlog), Ordering::Relaxed);
        self.word(H_HEARTBEAT).store(now_ms, Ordering::Release);
    }

    /// Whether the owner was alive at most `fresh_ms` before `now_ms` and held up by its own
    /// earlier GPU work then: its operations have not started, but it is not dead.
    pub(crate) fn busy_and_alive(&self, now_ms: u64, fresh_ms: u64) -> bool {
        let beat = self.word(H_HEARTBEAT).load(Ordering::Acquire);
        self.word(H_BACKLOG).load(Ordering::Relaxed) == 1 && now_ms.saturating_sub(beat) <= fresh_ms
    }
}

/// The folder for mailbox files: `/dev/shm` where it exists (memory, not disk), else the
/// temporary folder.
pub(crate) fn mailbox_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() { shm } else { std::env::temp_dir() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(count: u64) -> OpDesc {
        OpDesc {
            part: super::super::wire::P2P,
            count,
            dtype: 7,
            captured: false,
        }
    }

    #[test]
    fn entries_round_trip_and_wrap_without_stale_reads() {
        let r = Region::in_process(3, 1);
        assert_eq!(r.read(2, Dir::Send, 0), None);
        r.publish(2, Dir::Send, 0, op(10));
        assert_eq!(r.read(2, Dir::Send, 0), Some(op(10)));
        // Another peer's and the other direction's rings are separate.
        assert_eq!(r.read(0, Dir::Send, 0), None);
        assert_eq!(r.read(2, Dir::Recv, 0), None);
        // Entry RING lands in entry 0's slot: a reader asking for 0 no longer sees it, and a
        // reader asking for RING does not see entry 0.
        assert_eq!(r.read(2, Dir::Send, RING), None);
        r.publish(2, Dir::Send, RING, op(11));
        assert_eq!(r.read(2, Dir::Send, 0), None);
        assert_eq!(r.read(2, Dir::Send, RING), Some(op(11)));
    }

    #[test]
    fn a_heartbeat_says_busy_only_while_fresh() {
        let r = Region::in_process(2, 1);
        assert!(!r.busy_and_alive(1_000, 500), "no heartbeat yet");
        r.set_heartbeat(1_000, true);
        assert!(r.busy_and_alive(1_400, 500));
        assert!(!r.busy_and_alive(1_600, 500), "stale: the owner may be dead");
        r.set_heartbeat(1_600, false);
        assert!(!r.busy_and_alive(1_600, 500), "alive but not held up");
    }

    #[test]
    fn collective_entries_round_trip_and_wrap() {
        use super::super::wire::{CollKind, NONE};
        let r = Region::in_process(3, 0);
        let d = CollDesc {
            kind: CollKind::AllGather,
            count: 7,
            dtype: 7,
            redop: NONE,
            root: NONE,
            captured: false,
        };
        assert_eq!(r.read_coll(0), None);
        r.publish_coll(0, d);
        assert_eq!(r.read_coll(0), Some(Some(d)));
        r.publish_coll(RING, CollDesc { count: 8, ..d });
        assert_eq!(r.read_coll(0), None);
        assert_eq!(r.read_coll(RING), Some(Some(CollDesc { count: 8, ..d })));
        // The collective ring does not overlap the peers' blocks.
        assert_eq!(r.read(2, Dir::Recv, 0), None);
        r.set_coll_checked(2, 5);
        assert_eq!(
            (r.coll_checked(2), r.coll_checked(1), r.checked(2, Dir::Recv)),
            (5, 0, 0)
        );
    }

    #[test]
    fn checked_counters_and_status() {
        let r = Region::in_process(2, 0);
        assert_eq!(r.checked(1, Dir::Recv), 0);
        r.set_checked(1, Dir::Recv, 5);
        r.set_checked(1, Dir::Send, 7);
        assert_eq!((r.checked(1, Dir::Recv), r.checked(1, Dir::Send)), (5, 7));
        assert_eq!(r.status(), LIVE);
        r.set_broken();
        assert_eq!(r.status(), BROKEN);
    }

    #[test]
    #[should_panic(expected = "a peer's mailbox is never written")]
    fn a_peer_mailbox_is_read_only() {
        let dir = std::env::temp_dir();
        let (_mine, path) = Region::create_file(&dir, 2, 0, 0x123).unwrap();
        let theirs = Region::open_file(&path, 2, 0, 0x123).unwrap();
        std::fs::remove_file(&path).unwrap();
        theirs.set_broken();
    }

    #[test]
    #[should_panic(expected = "peer 2 of 2")]
    fn a_peer_out_of_range_is_refused() {
        Region::in_process(2, 0).read(2, Dir::Send, 0);
    }

    #[test]
    fn a_file_mailbox_is_shared_and_checked_by_token() {
        let dir = std::env::temp_dir();
        let (mine, path) = Region::create_file(&dir, 2, 1, 0xabc).unwrap();
        let theirs = Region::open_file(&path, 2, 1, 0xabc).unwrap();
        mine.publish(0, Dir::Recv, 0, op(3));
        assert_eq!(theirs.read(0, Dir::Recv, 0), Some(op(3)));
        mine.set_broken(); // the same memory
        assert_eq!(theirs.status(), BROKEN);
        let e = Region::open_file(&path, 2, 1, 0xdef).err().unwrap();
        assert!(e.contains("not rank 1's mailbox"), "{e}");
        assert!(Region::open_file(&path, 3, 1, 0xabc).is_err());
        std::fs::remove_file(&path).unwrap();
        assert!(Region::open_file(&path, 2, 1, 0xabc).is_err());
    }
}
