//! What verification asks of whatever carries its entries between ranks: the shared-memory
//! mailbox ([`crate::nccl::verify::mailbox::SharedMemory`]) between the ranks of one host, the
//! TCP channel ([`crate::nccl::verify::channel::Channelled`]) to ranks on others. The rule
//! ([`crate::nccl::verify::rule`]) only reads and writes entries through it; the caller of the
//! rule moves them ([`Transport::pump`], [`Transport::flush`], [`Transport::wait`]) and reads
//! the clock.
//!
//! Entries are those of the mailbox layout ([`crate::nccl::verify::mailbox`]): per peer and
//! direction, entry `i` is this rank's `i`-th operation with that peer; a peer's checked mark
//! says how many of this rank's entries it has compared, and so which slots of a ring this rank
//! may reuse.

use std::time::Duration;

use crate::nccl::verify::wire::{CollEntry, Dir, OpDesc};

/// One rank's link to the peers of one verification.
///
/// The entry operations are memory accesses: a transport never blocks, reads a socket or
/// reads a clock in them, so the rule that calls them stays deterministic given what the
/// peers have written. Everything that waits or touches a socket is in the movement
/// operations, which only the rule's driver calls.
pub(crate) trait Transport {
    /// Publishes this rank's operation number `index` with `peer` in `dir`. The caller has
    /// made sure the peer checked entry `index - RING` ([`Transport::checked`]).
    fn publish(&self, peer: usize, dir: Dir, index: u64, op: OpDesc);
    /// `peer`'s operation number `index` with this rank in `dir` (its sends to this rank, or
    /// its receives from it), once published.
    fn read(&self, peer: usize, dir: Dir, index: u64) -> Option<OpDesc>;
    /// How many of this rank's operations with `peer` in `dir` the peer has checked.
    fn checked(&self, peer: usize, dir: Dir) -> u64;
    /// Tells `peer` that this rank has checked `n` of its operations in `dir`.
    fn mark_checked(&self, peer: usize, dir: Dir, n: u64);
    /// Publishes this rank's collective number `index`, for every peer. The caller has made
    /// sure every peer checked entry `index - RING`.
    fn publish_coll(&self, index: u64, entry: CollEntry);
    /// `peer`'s collective number `index`, once published: `Some(None)` for words no handoff
    /// wrote.
    fn read_coll(&self, peer: usize, index: u64) -> Option<Option<CollEntry>>;
    /// How many of this rank's collectives `peer` has checked.
    fn coll_checked(&self, peer: usize) -> u64;
    /// Tells `peer` that this rank has checked `n` of its collectives.
    fn mark_coll_checked(&self, peer: usize, n: u64);
    /// Whether `peer`'s communicator broke (it will post nothing more).
    fn broken(&self, peer: usize) -> bool;

    /// Takes in what the peers sent since the last look. False only if nothing arrived: a
    /// [`Transport::wait`] then misses nothing.
    fn pump(&mut self) -> bool;
    /// Sends what this rank wrote since the last flush.
    fn flush(&mut self);
    /// Waits for the peers after `looks` looks found nothing new: at most about `timeout`,
    /// less if a peer sends something.
    fn wait(&mut self, looks: u32, timeout: Duration);
    /// Whether a group may be posted before its peers' entries are here ([`crate::nccl::verify::held`]):
    /// only where this rank's entries and the peers' are read and written in one memory, so
    /// that two ranks that publish and then read cannot both miss the other's entry.
    fn holds(&self) -> bool;
}

/// How a transport whose peers write in this process's memory waits: a peer on another core
/// usually posts within microseconds, so it spins, then gives the core back, then sleeps.
pub(crate) fn wait_in_memory(looks: u32, timeout: Duration) {
    if looks < 2_000 {
        std::hint::spin_loop();
    } else if looks < 2_100 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(timeout.min(Duration::from_micros(50)));
    }
}
