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
//!
//! # Who can reach a mailbox
//! A file is created 0600 (whatever the umask) under a name with a random token, and removed
//! once every rank has mapped its peers'; until then, only processes of the same user and root
//! can open it. A peer's file is opened only if `lstat` and then `fstat` say it is a regular
//! file of this process's user, writable by nobody else, of exactly the expected size, and
//! only without following a link or blocking. Whatever a peer then writes in its region is read
//! as a value or nothing, never out of bounds ([`MAX_CHECKED`] bounds its counters). What stays
//! trusted: the peers run handoff honestly (they can publish one operation and post another),
//! and no process of this user truncates a mapped file (the next access would fault, SIGBUS).

use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::nccl::verify::transport::{Transport, wait_in_memory};
use crate::nccl::verify::wire::{CollEntry, Dir, OpDesc};

/// Entries per ring: how far a rank may publish ahead of its peer's checks, and so how many
/// gated operations it may queue before its peer's host has posted theirs.
pub(crate) const RING: u64 = 256;
const ENTRY_WORDS: usize = 3;
const MAGIC: u64 = 0x4844_4f46_464d_4232; // "HDOFFMB2"
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
/// A collective's entry: tag, then [`CollEntry::encode`]'s three words.
const COLL_WORDS: usize = 4;

/// The most a checked counter reads as: no rank checks that many entries, and a peer that
/// writes more still leaves `RING + checked` (the slots its owner may fill) in range.
pub(crate) const MAX_CHECKED: u64 = u64::MAX - RING;

/// A rank's status word: nothing wrong.
pub(crate) const LIVE: u64 = 0;
/// A rank's status word: its communicator broke (an error, a timeout, an abort).
pub(crate) const BROKEN: u64 = 1;

/// The mode of a mailbox file: its owner reads and writes it, nobody else opens it.
const OWNER_ONLY: u32 = 0o600;

use crate::sys::posix::{ELOOP, O_NOCTTY, O_NOFOLLOW, O_NONBLOCK, geteuid};

/// A write to the owner's region that a peer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Note {
    /// Entry `index` with the peer in `dir`: [`crate::nccl::verify::wire::OpDesc::encode`]'s words.
    Publish { dir: Dir, index: u64, words: [u64; 2] },
    /// The owner checked `n` of the peer's operations in `dir`.
    Checked { dir: Dir, n: u64 },
    /// Collective `index`: [`crate::nccl::verify::wire::CollEntry::encode`]'s words.
    Coll { index: u64, words: [u64; 3] },
    /// The owner checked `n` of the peer's collectives.
    CollChecked { n: u64 },
    /// The owner's communicator broke.
    Broken,
    /// The owner's watchdog is alive; whether its oldest operation is held up by its own work.
    Heartbeat { backlog: bool },
}

/// Milliseconds of the wall clock: what heartbeats are stamped with.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where a region forwards its owner's writes for peers on other hosts: the verification
/// channel ([`crate::nccl::verify::channel`]), which mirrors the region there.
pub(crate) trait Relay: Send + Sync + 'static {
    /// Forwards a write that `peer` reads.
    fn tell(&self, peer: usize, note: Note);
    /// Forwards a write that every remote peer reads.
    fn tell_all(&self, note: Note);
    /// The relay itself (the channel, for verification's batching).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Why a mailbox file could not be made or was refused. Each says what was wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum MailboxError {
    /// The mailbox of a world this large does not fit in memory.
    #[error("a world of {world} ranks is too large for a mailbox")]
    TooLarge {
        /// The world size.
        world: usize,
    },
    /// A system call on a mailbox file failed.
    #[error(
        "{what} {}: {error}; check that the folder ({}) is writable and not full",
        .path.display(),
        .path.parent().unwrap_or(Path::new("/")).display()
    )]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's error.
        error: String,
    },
    /// The file named in a peer's card cannot be opened.
    #[error(
        "opening {}: {error} (a peer whose file cannot be opened is verified through the \
         channel instead)",
        .path.display()
    )]
    Open {
        /// The file.
        path: PathBuf,
        /// The system's error.
        error: String,
    },
    /// The path names a symbolic link, which is not followed.
    #[error(
        "{} is a symbolic link, not a mailbox file (each rank creates its own and names it in its \
         card): refused unfollowed. Do all ranks run this handoff, and does anyone else write in {}?",
        .path.display(),
        .path.parent().unwrap_or(Path::new("/")).display()
    )]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// The path names something other than a regular file.
    #[error(
        "{} is {kind}, not a regular file: a peer's card must name the mailbox file its rank \
         created. Do all ranks run this handoff?",
        .path.display()
    )]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is: "a FIFO", "a directory", ...
        kind: &'static str,
    },
    /// The file belongs to another user.
    #[error(
        "{} belongs to user {owner}, not to this process's user {me}: another user's file could \
         be rewritten under this rank, so verifying ranks must run as one user. Run every rank of \
         the host as the same user",
        .path.display()
    )]
    OtherOwner {
        /// The file.
        path: PathBuf,
        /// Its owner's uid.
        owner: u32,
        /// This process's effective uid.
        me: u32,
    },
    /// Users other than its owner may write the file.
    #[error(
        "{} can be written by users other than its owner (mode {mode:o}): handoff creates \
         mailboxes 0600, so this one could carry forged entries. Do all ranks run this handoff?",
        .path.display()
    )]
    Writable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The file is not the size of the mailbox expected, so mapping it could fault.
    #[error(
        "{} has {size} bytes, not the {expected} of the mailbox expected: it was cut short, or it \
         is not a mailbox of a communicator this size. Do all ranks run the same handoff with the \
         same world size?",
        .path.display()
    )]
    WrongSize {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The size of the mailbox expected.
        expected: u64,
    },
    /// The file is a mailbox, but not the one the card announced.
    #[error(
        "{} is not rank {rank}'s mailbox of this communicator (its header differs): a stale file, \
         or one from another host or job. Do all ranks run on this host?",
        .path.display()
    )]
    NotTheMailbox {
        /// The file.
        path: PathBuf,
        /// The rank whose mailbox it should be.
        rank: usize,
    },
}

/// A mapping of `map_len` bytes at `at` holds the `len` words of a mailbox.
fn check_mapping(path: &Path, at: *const u8, map_len: usize, len: usize) -> Result<(), MailboxError> {
    if map_len < len * 8 {
        return Err(MailboxError::WrongSize {
            path: path.to_path_buf(),
            size: map_len as u64,
            expected: (len * 8) as u64,
        });
    }
    if at.align_offset(8) != 0 {
        return Err(MailboxError::Io {
            what: "mapping",
            path: path.to_path_buf(),
            error: "the mapping is not aligned to 8 bytes".into(),
        });
    }
    Ok(())
}

/// What `lstat` and `fstat` must say of a peer's mailbox before it is opened and mapped: a
/// regular file (not a link, nor a FIFO, whose open could block, nor a device), of this process's user `euid` (so nobody else can
/// change its size), writable by nobody else, of exactly `expected` bytes (a shorter file faults
/// on access to the missing pages).
fn check_peer_file(path: &Path, meta: &Metadata, euid: u32, expected: u64) -> Result<(), MailboxError> {
    let path = path.to_path_buf();
    let t = meta.file_type();
    if t.is_symlink() {
        return Err(MailboxError::Symlink { path });
    }
    if !t.is_file() {
        let kind = if t.is_dir() {
            "a directory"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a file"
        };
        return Err(MailboxError::NotRegular { path, kind });
    }
    if meta.uid() != euid {
        return Err(MailboxError::OtherOwner {
            path,
            owner: meta.uid(),
            me: euid,
        });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(MailboxError::Writable {
            path,
            mode: meta.mode() & 0o7777,
        });
    }
    if meta.len() != expected {
        return Err(MailboxError::WrongSize {
            path,
            size: meta.len(),
            expected,
        });
    }
    Ok(())
}

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
    /// The owner's: its connections to the peers on other hosts, which each write a peer reads
    /// is forwarded to (see [`crate::nccl::verify::channel`]).
    channel: std::sync::OnceLock<Box<dyn Relay>>,
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
            channel: std::sync::OnceLock::new(),
            _memory: memory,
        }
    }

    /// From now on, each write of the owner's that a peer on `channel` reads is also sent to
    /// it. Set once, before the region is shared.
    pub(crate) fn install_channel(&self, channel: impl Relay) {
        assert!(self.writable(), "a peer's mailbox is never written");
        assert!(
            self.channel.set(Box::new(channel)).is_ok(),
            "a region's channel is installed once"
        );
    }

    /// Where the owner's writes are forwarded, if anywhere.
    pub(crate) fn relay(&self) -> Option<&dyn Relay> {
        self.channel.get().map(|r| &**r)
    }

    fn tell(&self, peer: usize, note: Note) {
        if let Some(c) = self.channel.get() {
            c.tell(peer, note);
        }
    }

    fn tell_all(&self, note: Note) {
        if let Some(c) = self.channel.get() {
            c.tell_all(note);
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

    /// A new mailbox file in `dir`, for peers in other processes of this host to map: mode 0600
    /// whatever the umask, so no other user can open it.
    ///
    /// # Errors
    /// The file cannot be created, sized, restricted to its owner or mapped.
    pub(crate) fn create_file(
        dir: &Path,
        world: usize,
        rank: usize,
        token: u64,
    ) -> Result<(Region, PathBuf), MailboxError> {
        let len = words_for(world).ok_or(MailboxError::TooLarge { world })?;
        let path = dir.join(format!("handoff-{}-{token:016x}-r{rank}", std::process::id()));
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |e: std::io::Error| MailboxError::Io {
                what,
                path,
                error: e.to_string(),
            }
        };
        // `create_new` is O_CREAT | O_EXCL: it follows no link and opens no file that was there.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(OWNER_ONLY)
            .open(&path)
            .map_err(io("creating", &path))?;
        let r = Self::restrict(&file, &path)
            .and_then(|()| file.set_len((len * 8) as u64).map_err(io("sizing", &path)))
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

    /// Makes the new file's mode exactly [`OWNER_ONLY`] (a umask can only narrow the mode it was
    /// created with, and one that took the owner's read away would lock the peers out) and
    /// checks it with `fstat`.
    fn restrict(file: &std::fs::File, path: &Path) -> Result<(), MailboxError> {
        let fail = |error: String| MailboxError::Io {
            what: "restricting to its owner",
            path: path.to_path_buf(),
            error,
        };
        file.set_permissions(std::fs::Permissions::from_mode(OWNER_ONLY))
            .map_err(|e| fail(e.to_string()))?;
        let mode = file.metadata().map_err(|e| fail(e.to_string()))?.mode() & 0o7777;
        if mode != OWNER_ONLY {
            return Err(fail(format!("its mode is {mode:o} after setting {OWNER_ONLY:o}")));
        }
        Ok(())
    }

    /// Maps a peer's mailbox file, named in its card, and checks that it is the one the card
    /// announced. Whatever the path names, this returns at once: it opens without following a
    /// link and without blocking (a FIFO), and maps only a regular file of this process's user,
    /// writable by nobody else, of exactly the size of rank `rank`'s mailbox in a world of
    /// `world` (a shorter one would fault on access).
    ///
    /// # Errors
    /// The file cannot be opened or mapped (for example, the peer is on another host), it is
    /// not a file a rank of this user created ([`MailboxError`] says what it is instead), or it
    /// is not that rank's mailbox.
    pub(crate) fn open_file(
        path: &Path,
        world: usize,
        rank: usize,
        token: u64,
    ) -> Result<Region, MailboxError> {
        let len = words_for(world).ok_or(MailboxError::TooLarge { world })?;
        let (euid, expected) = (geteuid(), (len * 8) as u64);
        let open_error = |e: std::io::Error| MailboxError::Open {
            path: path.to_path_buf(),
            error: e.to_string(),
        };
        // Looked at before it is opened, since opening a device can act (a tape rewinds, a
        // watchdog arms): anything but a mailbox-like file is refused unopened. The `fstat` of
        // what was opened is the check that counts (the name may change in between).
        check_peer_file(
            path,
            &std::fs::symlink_metadata(path).map_err(open_error)?,
            euid,
            expected,
        )?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(O_NOFOLLOW | O_NONBLOCK | O_NOCTTY)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(ELOOP) => MailboxError::Symlink {
                    path: path.to_path_buf(),
                },
                _ => open_error(e),
            })?;
        let meta = file.metadata().map_err(|e| MailboxError::Io {
            what: "reading the status of",
            path: path.to_path_buf(),
            error: e.to_string(),
        })?;
        check_peer_file(path, &meta, euid, expected)?;
        // SAFETY: a regular file of this user, writable by no other, of the size checked just
        // now: no one but a process of this user can truncate it while mapped (the crate's
        // documented trust limit), and every access goes through atomics. Mapped read-only, as
        // this process never writes a peer's mailbox.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| MailboxError::Io {
            what: "mapping",
            path: path.to_path_buf(),
            error: e.to_string(),
        })?;
        check_mapping(path, map.as_ptr(), map.len(), len)?;
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
            Err(MailboxError::NotTheMailbox {
                path: path.to_path_buf(),
                rank,
            })
        }
    }

    fn map(file: &std::fs::File, path: &Path, len: usize, world: usize) -> Result<Region, MailboxError> {
        // SAFETY: the file is this rank's mailbox, of exactly `len` words; every access to it
        // goes through atomics, so peers reading it concurrently is not a data race. Nobody
        // handoff runs truncates it while mapped: its owner sized it once and only removes its
        // name, and no other user can open it (mode 0600); another process of the same user
        // could (the crate's documented trust limit).
        let mut map = unsafe { memmap2::MmapMut::map_mut(file) }.map_err(|e| MailboxError::Io {
            what: "mapping",
            path: path.to_path_buf(),
            error: e.to_string(),
        })?;
        check_mapping(path, map.as_ptr(), map.len(), len)?;
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

    fn coll_checked_word(&self, peer: usize) -> usize {
        self.block(peer) + 2 * RING_WORDS + 2
    }

    fn coll_slot(&self, index: u64) -> usize {
        HEADER_WORDS + self.world * PEER_WORDS + (index % RING) as usize * COLL_WORDS
    }

    /// Publishes this rank's collective number `index`. The caller has made sure every peer
    /// checked entry `index - RING` ([`Region::coll_checked`]).
    pub(crate) fn publish_coll(&self, index: u64, entry: CollEntry) {
        self.publish_coll_words(index, entry.encode());
    }

    /// [`Region::publish_coll`] of encoded words, as a peer's channel delivers them.
    pub(super) fn publish_coll_words(&self, index: u64, words: [u64; 3]) {
        assert!(self.writable(), "a peer's mailbox is never written");
        let at = self.coll_slot(index);
        for (i, w) in words.into_iter().enumerate() {
            self.word(at + 1 + i).store(w, Ordering::Relaxed);
        }
        // Wrapping: entry u64::MAX (only a hostile peer's) is then never read.
        self.word(at).store(index.wrapping_add(1), Ordering::Release);
        self.tell_all(Note::Coll { index, words });
    }

    /// The owner's collective number `index`, once published: `Some(None)` for words no
    /// handoff wrote.
    pub(crate) fn read_coll(&self, index: u64) -> Option<Option<CollEntry>> {
        let at = self.coll_slot(index);
        if Some(self.word(at).load(Ordering::Acquire)) != index.checked_add(1) {
            return None;
        }
        let w = [1, 2, 3].map(|i| self.word(at + i).load(Ordering::Relaxed));
        Some(CollEntry::decode(w))
    }

    /// How many of `peer`'s collectives the owner has checked, at most [`MAX_CHECKED`].
    pub(crate) fn coll_checked(&self, peer: usize) -> u64 {
        self.word(self.coll_checked_word(peer))
            .load(Ordering::Acquire)
            .min(MAX_CHECKED)
    }

    /// Records that the owner has checked `n` of `peer`'s collectives.
    pub(crate) fn set_coll_checked(&self, peer: usize, n: u64) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(self.coll_checked_word(peer))
            .store(n, Ordering::Release);
        self.tell(peer, Note::CollChecked { n });
    }

    /// Publishes this rank's operation number `index` with `peer`. The caller has made sure the
    /// peer checked entry `index - RING` ([`Region::checked`]).
    pub(crate) fn publish(&self, peer: usize, dir: Dir, index: u64, op: OpDesc) {
        self.publish_words(peer, dir, index, op.encode());
    }

    /// [`Region::publish`] of encoded words, as a peer's channel delivers them.
    pub(super) fn publish_words(&self, peer: usize, dir: Dir, index: u64, words: [u64; 2]) {
        assert!(self.writable(), "a peer's mailbox is never written");
        let at = self.slot(peer, dir, index);
        self.word(at + 1).store(words[0], Ordering::Relaxed);
        self.word(at + 2).store(words[1], Ordering::Relaxed);
        // Wrapping: entry u64::MAX (only a hostile peer's) is then never read.
        self.word(at).store(index.wrapping_add(1), Ordering::Release);
        self.tell(peer, Note::Publish { dir, index, words });
    }

    /// The owner's operation number `index` with `peer`, once published.
    pub(crate) fn read(&self, peer: usize, dir: Dir, index: u64) -> Option<OpDesc> {
        let at = self.slot(peer, dir, index);
        if Some(self.word(at).load(Ordering::Acquire)) != index.checked_add(1) {
            return None;
        }
        let op = OpDesc::decode([
            self.word(at + 1).load(Ordering::Relaxed),
            self.word(at + 2).load(Ordering::Relaxed),
        ]);
        Some(op)
    }

    /// How many of `peer`'s operations in direction `dir` (its sends to the owner, or its
    /// receives from the owner) the owner has checked, at most [`MAX_CHECKED`].
    pub(crate) fn checked(&self, peer: usize, dir: Dir) -> u64 {
        self.word(self.checked_word(peer, dir))
            .load(Ordering::Acquire)
            .min(MAX_CHECKED)
    }

    /// Records that the owner has checked `n` of `peer`'s operations in direction `dir`.
    pub(crate) fn set_checked(&self, peer: usize, dir: Dir, n: u64) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(self.checked_word(peer, dir))
            .store(n, Ordering::Release);
        self.tell(peer, Note::Checked { dir, n });
    }

    /// The owner's status ([`LIVE`] or [`BROKEN`]).
    pub(crate) fn status(&self) -> u64 {
        self.word(H_STATUS).load(Ordering::Acquire)
    }

    /// Tells every peer that the owner's communicator broke, so that none waits for it.
    pub(crate) fn set_broken(&self) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(H_STATUS).store(BROKEN, Ordering::Release);
        self.tell_all(Note::Broken);
    }

    /// The owner's watchdog says it is alive (`now_ms`, wall-clock milliseconds) and whether
    /// its oldest queued operation is still held up by earlier GPU work of its own (`backlog`).
    pub(crate) fn set_heartbeat(&self, now_ms: u64, backlog: bool) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(H_BACKLOG).store(u64::from(backlog), Ordering::Relaxed);
        self.word(H_HEARTBEAT).store(now_ms, Ordering::Release);
        self.tell_all(Note::Heartbeat { backlog });
    }

    /// Whether the owner was alive at most `fresh_ms` before `now_ms` and held up by its own
    /// earlier GPU work then: its operations have not started, but it is not dead.
    pub(crate) fn busy_and_alive(&self, now_ms: u64, fresh_ms: u64) -> bool {
        let beat = self.word(H_HEARTBEAT).load(Ordering::Acquire);
        self.word(H_BACKLOG).load(Ordering::Relaxed) == 1 && now_ms.saturating_sub(beat) <= fresh_ms
    }
}

/// Where the reader looks, for tests that write a peer's region as a hostile owner would.
#[cfg(test)]
impl Region {
    /// Words in the region (its whole mapping).
    pub(super) fn words(&self) -> usize {
        self.len
    }

    /// Stores `v` in word `i`, whatever it means.
    pub(super) fn poke(&self, i: usize, v: u64) {
        assert!(self.writable(), "a peer's mailbox is never written");
        self.word(i).store(v, Ordering::Release);
    }

    /// The tag word of entry `index` with `peer` in `dir` ([`ENTRY_WORDS`] words).
    pub(super) fn entry_at(&self, peer: usize, dir: Dir, index: u64) -> usize {
        self.slot(peer, dir, index)
    }

    /// The tag word of collective `index` ([`COLL_WORDS`] words).
    pub(super) fn coll_at(&self, index: u64) -> usize {
        self.coll_slot(index)
    }

    /// The word counting `peer`'s operations in `dir` the owner checked.
    pub(super) fn checked_at(&self, peer: usize, dir: Dir) -> usize {
        self.checked_word(peer, dir)
    }

    /// The word counting `peer`'s collectives the owner checked.
    pub(super) fn coll_checked_at(&self, peer: usize) -> usize {
        self.coll_checked_word(peer)
    }
}

/// The mailbox as a transport: every peer's region mapped (or in this process), read and
/// written in place. Nothing to pump or flush; holding works (see [`Transport::holds`]).
#[derive(Clone, Copy)]
pub(crate) struct SharedMemory<'a> {
    /// This rank.
    pub(crate) rank: usize,
    /// Every rank's region, this rank's own at `rank`.
    pub(crate) regions: &'a [Arc<Region>],
}

impl SharedMemory<'_> {
    fn mine(&self) -> &Region {
        &self.regions[self.rank]
    }
}

impl Transport for SharedMemory<'_> {
    #[inline]
    fn publish(&self, peer: usize, dir: Dir, index: u64, op: OpDesc) {
        self.mine().publish(peer, dir, index, op);
    }

    #[inline]
    fn read(&self, peer: usize, dir: Dir, index: u64) -> Option<OpDesc> {
        self.regions[peer].read(self.rank, dir, index)
    }

    #[inline]
    fn checked(&self, peer: usize, dir: Dir) -> u64 {
        self.regions[peer].checked(self.rank, dir)
    }

    #[inline]
    fn mark_checked(&self, peer: usize, dir: Dir, n: u64) {
        self.mine().set_checked(peer, dir, n);
    }

    #[inline]
    fn publish_coll(&self, index: u64, entry: CollEntry) {
        self.mine().publish_coll(index, entry);
    }

    #[inline]
    fn read_coll(&self, peer: usize, index: u64) -> Option<Option<CollEntry>> {
        self.regions[peer].read_coll(index)
    }

    #[inline]
    fn coll_checked(&self, peer: usize) -> u64 {
        self.regions[peer].coll_checked(self.rank)
    }

    #[inline]
    fn mark_coll_checked(&self, peer: usize, n: u64) {
        self.mine().set_coll_checked(peer, n);
    }

    #[inline]
    fn broken(&self, peer: usize) -> bool {
        self.regions[peer].status() == BROKEN
    }

    #[inline]
    fn pump(&mut self) -> bool {
        false
    }

    #[inline]
    fn flush(&mut self) {}

    #[inline]
    fn wait(&mut self, looks: u32, timeout: Duration) {
        wait_in_memory(looks, timeout);
    }

    #[inline]
    fn holds(&self) -> bool {
        true
    }
}

/// Header words, for tests: status, heartbeat, backlog.
#[cfg(test)]
pub(super) const STATUS_AT: [usize; 3] = [H_STATUS, H_HEARTBEAT, H_BACKLOG];

/// The folder for mailbox files: `/dev/shm` where it exists (memory, not disk), else the
/// temporary folder.
pub(crate) fn mailbox_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() { shm } else { std::env::temp_dir() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_wrap_without_stale_reads() {
        let r = Region::in_process(3, 1);
        assert_eq!(r.read(2, Dir::Send, 0), None);
        r.publish(2, Dir::Send, 0, OpDesc::f32_p2p(10));
        assert_eq!(r.read(2, Dir::Send, 0), Some(OpDesc::f32_p2p(10)));
        // Another peer's and the other direction's rings are separate.
        assert_eq!(r.read(0, Dir::Send, 0), None);
        assert_eq!(r.read(2, Dir::Recv, 0), None);
        // Entry RING lands in entry 0's slot: a reader asking for 0 no longer sees it, and a
        // reader asking for RING does not see entry 0.
        assert_eq!(r.read(2, Dir::Send, RING), None);
        r.publish(2, Dir::Send, RING, OpDesc::f32_p2p(11));
        assert_eq!(r.read(2, Dir::Send, 0), None);
        assert_eq!(r.read(2, Dir::Send, RING), Some(OpDesc::f32_p2p(11)));
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
        use crate::nccl::verify::wire::{CollDesc, CollKind, NONE};
        let r = Region::in_process(3, 0);
        let d = CollDesc {
            kind: CollKind::AllGather,
            count: 7,
            dtype: 7,
            redop: NONE,
            root: NONE,
            captured: false,
            nccl_memory: 0,
        };
        let e = |desc, group_end| CollEntry { desc, group_end };
        assert_eq!(r.read_coll(0), None);
        r.publish_coll(0, e(d, false));
        assert_eq!(r.read_coll(0), Some(Some(e(d, false))));
        r.publish_coll(RING, e(CollDesc { count: 8, ..d }, true));
        assert_eq!(r.read_coll(0), None);
        assert_eq!(r.read_coll(RING), Some(Some(e(CollDesc { count: 8, ..d }, true))));
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
        mine.publish(0, Dir::Recv, 0, OpDesc::f32_p2p(3));
        assert_eq!(theirs.read(0, Dir::Recv, 0), Some(OpDesc::f32_p2p(3)));
        mine.set_broken(); // the same memory
        assert_eq!(theirs.status(), BROKEN);
        let e = Region::open_file(&path, 2, 1, 0xdef).err().unwrap();
        assert!(matches!(e, MailboxError::NotTheMailbox { rank: 1, .. }), "{e}");
        assert!(Region::open_file(&path, 3, 1, 0xabc).is_err());
        std::fs::remove_file(&path).unwrap();
        assert!(Region::open_file(&path, 2, 1, 0xabc).is_err());
    }

    unsafe extern "C" {
        /// POSIX `umask`: sets the file-mode creation mask, returns the previous one; never
        /// fails and takes no pointers (`mode_t` is 32 bits on Linux).
        safe fn umask(mask: u32) -> u32;
        /// POSIX `mkfifo`.
        fn mkfifo(path: *const std::ffi::c_char, mode: u32) -> i32;
    }

    /// A path in the temporary folder no other test uses.
    fn scratch(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("handoff-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    /// `f`'s result, or `None` if it has not returned within 2 s (it is left running).
    fn within_2s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(std::time::Duration::from_secs(2)).ok()
    }

    fn set_mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_mailbox_file_is_its_owners_alone_whatever_the_umask() {
        // The umask is the process's: set in a child running only this test, so that no other
        // test creates files under it.
        const CHILD: &str = "HANDOFF_TEST_UMASK_CHILD";
        if std::env::var_os(CHILD).is_some() {
            for (mask, token) in [(0o000, 0x5a0), (0o002, 0x5a1), (0o277, 0x5a2)] {
                umask(mask);
                let (_mine, path) = Region::create_file(&std::env::temp_dir(), 2, 0, token).unwrap();
                let mode = std::fs::metadata(&path).unwrap().mode() & 0o7777;
                std::fs::remove_file(&path).unwrap();
                assert_eq!(mode, 0o600, "created under umask {mask:03o}: mode {mode:o}");
                println!("umask {mask:03o}: mode {mode:o}");
            }
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "nccl::verify::mailbox::tests::a_mailbox_file_is_its_owners_alone_whatever_the_umask",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert_eq!(text.matches(": mode 600").count(), 3, "{text}");
    }

    #[test]
    fn a_fifo_is_refused_at_once_not_waited_on() {
        let path = scratch("fifo");
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(
            unsafe { mkfifo(c.as_ptr(), 0o600) },
            0,
            "mkfifo {}",
            path.display()
        );
        let p = path.clone();
        let r = within_2s(move || Region::open_file(&p, 2, 1, 1).err());
        if r.is_none() {
            // Release the open that waits for a writer, so the thread ends.
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(O_NONBLOCK)
                .open(&path);
        }
        std::fs::remove_file(&path).unwrap();
        let e = r.expect("opening a FIFO did not return within 2 s");
        assert!(
            matches!(&e, Some(MailboxError::NotRegular { kind: "a FIFO", .. })),
            "{e:?}"
        );
        assert!(e.unwrap().to_string().contains("is a FIFO, not a regular file"));
    }

    #[test]
    fn a_fifo_is_not_even_opened() {
        // A writer waits in open(2) until the FIFO has a reader: opening it as one, however
        // briefly, would let the writer through.
        let path = scratch("fifo-writer");
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(
            unsafe { mkfifo(c.as_ptr(), 0o600) },
            0,
            "mkfifo {}",
            path.display()
        );
        let writer = std::thread::spawn({
            let path = path.clone();
            move || std::fs::OpenOptions::new().write(true).open(path).map(drop)
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        let r = within_2s({
            let path = path.clone();
            move || Region::open_file(&path, 2, 1, 1).err()
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        let let_through = writer.is_finished();
        // Release the writer.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(O_NONBLOCK)
            .open(&path)
            .unwrap();
        writer.join().unwrap().unwrap();
        drop(reader);
        std::fs::remove_file(&path).unwrap();
        assert!(
            matches!(r, Some(Some(MailboxError::NotRegular { kind: "a FIFO", .. }))),
            "{r:?}"
        );
        assert!(!let_through, "the FIFO was opened: its writer went through");
    }

    #[test]
    fn a_symlink_even_to_a_real_mailbox_is_refused() {
        let (_mine, target) = Region::create_file(&std::env::temp_dir(), 2, 1, 0x5b0).unwrap();
        let link = scratch("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let r = Region::open_file(&link, 2, 1, 0x5b0).err();
        std::fs::remove_file(&link).unwrap();
        std::fs::remove_file(&target).unwrap();
        assert!(
            matches!(&r, Some(MailboxError::Symlink { path }) if *path == link),
            "{r:?}"
        );
    }

    #[test]
    fn a_directory_and_a_device_are_refused() {
        let dir = std::env::temp_dir();
        for (path, kind) in [
            (dir.as_path(), "a directory"),
            (Path::new("/dev/null"), "a character device"),
        ] {
            let r = within_2s({
                let path = path.to_path_buf();
                move || Region::open_file(&path, 2, 1, 1).err()
            })
            .expect("returns at once");
            assert!(
                matches!(&r, Some(MailboxError::NotRegular { kind: k, .. }) if *k == kind),
                "{}: {r:?}",
                path.display()
            );
        }
    }

    #[test]
    fn another_users_file_is_refused() {
        let (_mine, path) = Region::create_file(&std::env::temp_dir(), 2, 1, 0x5c0).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let len = meta.len();
        // The rule, for a user this process is not.
        let other = geteuid().wrapping_add(1);
        let r = check_peer_file(&path, &meta, other, len);
        assert!(
            matches!(r, Err(MailboxError::OtherOwner { owner, me, .. }) if owner == meta.uid() && me == other),
            "{r:?}"
        );
        assert_eq!(check_peer_file(&path, &meta, geteuid(), len), Ok(()));
        // And a real file of another user, where this process may give one away (root).
        let given = geteuid() == 0 && std::os::unix::fs::chown(&path, Some(65534), Some(65534)).is_ok();
        let r = given.then(|| Region::open_file(&path, 2, 1, 0x5c0).err());
        std::fs::remove_file(&path).unwrap();
        match r {
            Some(r) => assert!(
                matches!(
                    r,
                    Some(MailboxError::OtherOwner {
                        owner: 65534,
                        me: 0,
                        ..
                    })
                ),
                "{r:?}"
            ),
            None => eprintln!("not root: another user's file checked by the rule only"),
        }
    }

    #[test]
    fn a_file_others_may_write_is_refused() {
        let (_mine, path) = Region::create_file(&std::env::temp_dir(), 2, 1, 0x5d0).unwrap();
        let mut seen = Vec::new();
        for mode in [0o620, 0o602, 0o666] {
            set_mode(&path, mode);
            seen.push(Region::open_file(&path, 2, 1, 0x5d0).err());
        }
        set_mode(&path, 0o600);
        let ok = Region::open_file(&path, 2, 1, 0x5d0).is_ok();
        std::fs::remove_file(&path).unwrap();
        for (r, mode) in seen.iter().zip([0o620, 0o602, 0o666]) {
            assert!(
                matches!(r, Some(MailboxError::Writable { mode: m, .. }) if *m == mode),
                "{mode:o}: {r:?}"
            );
        }
        assert!(ok, "the same file at 0600 is the mailbox");
    }

    #[test]
    fn a_file_of_the_wrong_size_is_refused_before_it_is_mapped() {
        let (_mine, path) = Region::create_file(&std::env::temp_dir(), 2, 1, 0x5e0).unwrap();
        let expected = std::fs::metadata(&path).unwrap().len();
        let mut seen = Vec::new();
        // Mapped, each short one would fault (SIGBUS) on the words past its end.
        for size in [0, 100, 4096, expected - 8, expected + 8] {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(size)
                .unwrap();
            seen.push((size, Region::open_file(&path, 2, 1, 0x5e0).err()));
        }
        std::fs::remove_file(&path).unwrap();
        for (size, r) in seen {
            assert!(
                matches!(r, Some(MailboxError::WrongSize { size: s, expected: e, .. }) if s == size && e == expected),
                "{size}: {r:?}"
            );
        }
    }
}
