//! The cache of pinned host memory behind [`super::HostBuffer`]: a plain data structure, so its
//! bookkeeping is tested without a GPU.
//!
//! `cudaFreeHost` waits for the whole device to be idle, and holds up other threads' CUDA calls
//! meanwhile (CUDA lists page-locked allocation among the operations that synchronise
//! implicitly; PyTorch caches pinned memory for the same reason). So a dropped buffer's memory
//! is not freed: it comes here as a [`Block`], with the events of the copies that may still
//! use it, and a new buffer of the same size class takes it once they have all completed. Only
//! [`super::release_cached`] frees memory.

/// One allocation of pinned memory, idle on the host, with the events of the copies that may
/// still use it.
pub(crate) struct Block<E> {
    /// The address `cudaMallocHost` returned.
    pub(crate) addr: usize,
    /// Its size in bytes: a [`class`].
    pub(crate) bytes: usize,
    /// The events recorded after the copies that used it and had not completed when its
    /// buffer went away.
    pub(crate) pending: Vec<E>,
}

/// The blocks one device's buffers gave back.
pub(crate) struct Pool<E> {
    idle: Vec<Block<E>>,
}

impl<E> Default for Pool<E> {
    fn default() -> Self {
        Pool { idle: Vec::new() }
    }
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

    /// Every cached block, for freeing.
    pub(crate) fn drain(&mut self) -> Vec<Block<E>> {
        std::mem::take(&mut self.idle)
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
}
