//! The cache of pinned host memory behind [`super::HostBuffer`]: a plain data structure, so its
//! bookkeeping is tested without a GPU.
//!
//! `cudaFreeHost` waits for the whole device to be idle, and holds up other threads' CUDA calls
//! meanwhile (CUDA lists page-locked allocation among the operations that synchronise
//! implicitly; PyTorch caches pinned memory for the same reason). So a dropped buffer's memory
//! is not freed: it comes here as a [`Block`], with the events of the copies that may still
//! use it, and a new buffer of the same size class takes it once they have all completed. Only
//! [`super::release_cached`] frees memory.
//!
//! `cudaMallocHost` is costly too, and may wait behind other threads' GPU work: a size class up
//! to [`SLAB_MAX_CLASS`] is allocated a [`slab`] at a time, several blocks of it in one call, the
//! others cached idle at once, so that most new buffers never call it. A slab is freed only
//! whole, once every one of its blocks is back and idle.

/// One allocation of pinned memory, idle on the host, with the events of the copies that may
/// still use it.
pub(crate) struct Block<E> {
    /// Its address: what `cudaMallocHost` returned, or a part of a slab.
    pub(crate) addr: usize,
    /// The address `cudaMallocHost` returned for the allocation it is part of (its own, for a
    /// block allocated alone).
    pub(crate) slab: usize,
    /// Its size in bytes: a [`class`].
    pub(crate) bytes: usize,
    /// The events recorded after the copies that used it and had not completed when its
    /// buffer went away.
    pub(crate) pending: Vec<E>,
}

/// The blocks one device's buffers gave back.
pub(crate) struct Pool<E> {
    idle: Vec<Block<E>>,
    /// Each slab's address, size, and how many blocks it was cut into.
    slabs: Vec<(usize, usize, usize)>,
}

impl<E> Default for Pool<E> {
    fn default() -> Self {
        Pool {
            idle: Vec::new(),
            slabs: Vec::new(),
        }
    }
}

/// The largest size class allocated in slabs.
pub(crate) const SLAB_MAX_CLASS: usize = 4 << 20;

/// The size of the slab a block of size class `class` is allocated in, if it is: eight
/// blocks, at least 1 MiB, at most 32 MiB.
pub(crate) fn slab(class: usize) -> Option<usize> {
    (class <= SLAB_MAX_CLASS).then(|| class.saturating_mul(8).clamp(1 << 20, 32 << 20))
}

/// The size a request for `bytes` is rounded up to, so that buffers of similar sizes reuse one
/// another's blocks: the next power of two, at least 512 bytes (at most twice the request).
pub(crate) fn class(bytes: usize) -> usize {
    bytes.max(512).checked_next_power_of_two().unwrap_or(bytes)
}

impl<E> Pool<E> {
    /// A block of `bytes` (a [`class`]) whose copies have all completed, if one is cached:
    /// `done` says whether the work before an event has completed (without blocking); completed
    /// events are dropped as they are found. A block with a copy still pending is never
    /// returned.
    pub(crate) fn take(&mut self, bytes: usize, mut done: impl FnMut(&E) -> bool) -> Option<Block<E>> {
        let i = self.idle.iter_mut().position(|b| {
            if b.bytes != bytes {
                return false;
            }
            b.pending.retain(|e| !done(e));
            b.pending.is_empty()
        })?;
        Some(self.idle.swap_remove(i))
    }

    /// Caches `block`, which no buffer uses any more (its copies may still be pending).
    pub(crate) fn give(&mut self, block: Block<E>) {
        self.idle.push(block);
    }

    /// The slab `addr` is part of: its own address for a block allocated alone.
    pub(crate) fn slab_of(&self, addr: usize) -> usize {
        self.slabs
            .iter()
            .find(|&&(base, bytes, _)| (base..base + bytes).contains(&addr))
            .map_or(addr, |&(base, _, _)| base)
    }

    /// Cuts the slab `cudaMallocHost` returned at `addr`, of `bytes`, into blocks of `class`
    /// (which divides it): the first is returned, for a new buffer, the others cached idle.
    pub(crate) fn cut(&mut self, addr: usize, bytes: usize, class: usize) -> Block<E> {
        let parts = bytes / class;
        self.slabs.push((addr, bytes, parts));
        for i in 1..parts {
            self.give(Block {
                addr: addr + i * class,
                slab: addr,
                bytes: class,
                pending: Vec::new(),
            });
        }
        Block {
            addr,
            slab: addr,
            bytes: class,
            pending: Vec::new(),
        }
    }

    /// What can be freed: every cached block allocated alone, and every slab all of whose
    /// blocks are cached (as one block of the slab's size, with all their pending events).
    /// Blocks of a slab still partly in use stay cached.
    pub(crate) fn drain(&mut self) -> Vec<Block<E>> {
        let mut out = Vec::new();
        let (whole, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.slabs)
            .into_iter()
            .partition(|&(addr, _, parts)| self.idle.iter().filter(|b| b.slab == addr).count() == parts);
        self.slabs = rest;
        for (addr, bytes, _) in whole {
            let mut pending = Vec::new();
            self.idle.retain_mut(|b| {
                if b.slab != addr {
                    return true;
                }
                pending.append(&mut b.pending);
                false
            });
            out.push(Block {
                addr,
                slab: addr,
                bytes,
                pending,
            });
        }
        let slabs = &self.slabs;
        let (alone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.idle)
            .into_iter()
            .partition(|b| !slabs.iter().any(|&(addr, _, _)| addr == b.slab));
        self.idle = kept;
        out.extend(alone);
        out
    }

    /// The bytes cached.
    pub(crate) fn bytes(&self) -> usize {
        self.idle.iter().map(|b| b.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn block(addr: usize, bytes: usize, pending: &[u32]) -> Block<u32> {
        Block {
            addr,
            slab: addr,
            bytes,
            pending: pending.to_vec(),
        }
    }

    #[test]
    fn sizes_round_up_to_a_class_at_most_twice_the_request() {
        assert_eq!(class(1), 512);
        assert_eq!(class(512), 512);
        assert_eq!(class(513), 1024);
        assert_eq!(class(4 << 20), 4 << 20);
        assert_eq!(class((4 << 20) + 1), 8 << 20);
        for bytes in [1usize, 777, 1 << 20, (1 << 30) + 3, isize::MAX as usize] {
            let c = class(bytes);
            assert!(c >= bytes && (bytes < 512 || c / 2 < bytes), "{bytes} -> {c}");
        }
    }

    #[test]
    fn a_block_is_handed_out_again_only_once_its_copies_have_completed() {
        let mut pool = Pool::default();
        pool.give(block(0x1000, 4096, &[1, 2]));
        // Event 2 still pending: not handed out, and the completed one is forgotten.
        let pending = Cell::new(2);
        assert!(pool.take(4096, |e| *e != pending.get()).is_none());
        assert_eq!(pool.idle[0].pending, [2]);
        assert_eq!(pool.bytes(), 4096);
        // Another size class never matches.
        assert!(pool.take(8192, |_| true).is_none());
        pending.set(0);
        let b = pool.take(4096, |e| *e != pending.get()).expect("idle now");
        assert_eq!((b.addr, b.bytes, b.pending.len()), (0x1000, 4096, 0));
        assert_eq!(pool.bytes(), 0);
        assert!(pool.take(4096, |_| true).is_none(), "handed out twice");
    }

    #[test]
    fn an_idle_block_is_found_behind_busy_ones_and_every_block_is_drained() {
        let mut pool = Pool::default();
        pool.give(block(0x1000, 4096, &[7]));
        pool.give(block(0x2000, 4096, &[]));
        pool.give(block(0x3000, 8192, &[]));
        let b = pool.take(4096, |e| *e != 7).expect("the idle one");
        assert_eq!(b.addr, 0x2000);
        assert_eq!(pool.bytes(), 4096 + 8192);
        pool.give(b);
        let mut all: Vec<usize> = pool.drain().iter().map(|b| b.addr).collect();
        all.sort();
        assert_eq!(all, [0x1000, 0x2000, 0x3000]);
        assert_eq!(pool.bytes(), 0);
    }

    #[test]
    fn a_slab_is_cut_into_idle_blocks_and_freed_only_whole() {
        assert_eq!(slab(512), Some(1 << 20));
        assert_eq!(slab(4 << 20), Some(32 << 20));
        assert_eq!(slab(8 << 20), None);
        let mut pool = Pool::default();
        let first = pool.cut(0x10_0000, 4096, 1024);
        assert_eq!((first.addr, first.bytes), (0x10_0000, 1024));
        assert_eq!(pool.bytes(), 3 * 1024, "the other three cached idle");
        // Three new buffers of the class take them without a new allocation.
        let taken: Vec<_> = (0..3).map(|_| pool.take(1024, |_| true).expect("cut")).collect();
        assert!(pool.take(1024, |_| true).is_none());
        let mut addrs: Vec<usize> = taken.iter().map(|b| b.addr).collect();
        addrs.sort();
        assert_eq!(addrs, [0x10_0400, 0x10_0800, 0x10_0c00]);
        // Given back, one with a copy pending: the slab is not whole while `first` is out.
        let mut taken = taken.into_iter();
        let mut with_copy = taken.next().expect("one");
        with_copy.pending.push(7);
        pool.give(with_copy);
        pool.give(block(0x9000, 8192, &[]));
        let freed = pool.drain();
        assert_eq!(freed.len(), 1, "only the block allocated alone");
        assert_eq!(freed[0].addr, 0x9000);
        for b in taken.chain([first]) {
            pool.give(b);
        }
        // Whole now: freed as the slab, with the pending copy's event to wait for first.
        let freed = pool.drain();
        assert_eq!(freed.len(), 1);
        assert_eq!(
            (freed[0].addr, freed[0].bytes, freed[0].pending.as_slice()),
            (0x10_0000, 4096, &[7][..])
        );
        assert_eq!(pool.bytes(), 0);
    }
}
