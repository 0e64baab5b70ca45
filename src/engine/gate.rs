//! Gates: work queued on a stream behind a gate starts only once the host opens it, without
//! the host waiting at the time it queues. A gate is one 32-bit word of mapped, page-locked
//! host memory; shutting it queues `cuStreamWaitValue32(word >= ticket)` on each stream, and
//! opening it is a store to the word, no CUDA call (so it can be made from any thread, also
//! while CUDA's own locks are held elsewhere).
//!
//! Tickets count up per word, and a word only ever moves forward (the wait compares with
//! wrapping, as `(int32_t)(*word - ticket) >= 0`), so a word handed from one owner to the next
//! keeps its count: a wait queued by an earlier owner is already open. Words are never freed
//! (a GPU wait may still read one after its owner is gone): they come from pages of [`WORDS`]
//! words that live as long as the process, and are reused.
//!
//! What a shut gate couples, measured (../shared/anchors/README.md, "A GPU-side gate"): other
//! streams run on, but with lazy module loading (CUDA's default) the first launch of a kernel
//! not yet loaded, on any stream, waits for it, and `cudaFree`-like calls that synchronize the
//! device wait for it. The owner must therefore open every gate within a bounded time.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::Result;
use crate::result::cudart as cu;
use crate::sys::cudart::cudaStream_t;

/// Words per page: one 4 KiB page.
const WORDS: usize = 1024;

/// A word: where the host writes, where devices read, and the last ticket issued on it.
struct Word {
    host: &'static AtomicU32,
    device: u64,
    issued: u32,
}

/// Free words, with their counts.
static FREE: Mutex<Vec<Word>> = Mutex::new(Vec::new());

/// One gate: a word its owner shuts streams behind and opens.
pub(crate) struct Gate {
    host: &'static AtomicU32,
    device: u64,
    /// The last ticket issued.
    issued: AtomicU32,
}

impl Gate {
    /// A gate, open.
    ///
    /// # Errors
    /// Page-locked memory cannot be had, or its device address asked ([`crate::Error::Cuda`]).
    pub(crate) fn new() -> Result<Gate> {
        let mut free = FREE.lock().unwrap_or_else(|p| p.into_inner());
        if free.is_empty() {
            let page = cu::host_alloc_mapped(WORDS * 4)?;
            // SAFETY: `page` is mapped host memory just allocated, never freed.
            let device = match unsafe { cu::host_device_pointer(page) } {
                Ok(d) => d,
                Err(e) => {
                    // SAFETY: allocated above, used by nothing.
                    let _ = unsafe { cu::free_host(page) };
                    return Err(e);
                }
            };
            let words = page.cast::<AtomicU32>();
            for i in 0..WORDS {
                // SAFETY: the page holds WORDS aligned, zeroable u32s (page-aligned memory),
                // lives for the process (never freed) and is written only through these
                // atomics.
                let host: &'static AtomicU32 = unsafe {
                    let w = words.add(i);
                    w.write(AtomicU32::new(0));
                    &*w
                };
                free.push(Word {
                    host,
                    device: device + 4 * i as u64,
                    issued: 0,
                });
            }
        }
        let w = free.pop().expect("a page was added");
        Ok(Gate {
            host: w.host,
            device: w.device,
            issued: AtomicU32::new(w.issued),
        })
    }

    /// Shuts the gate on every stream of `streams` (in one ticket): work queued there after this
    /// starts once [`Gate::open_to`] reaches the returned ticket. Tickets rise by one per call.
    ///
    /// # Errors
    /// The driver refused a wait. The gate is then open to this ticket (streams that did take
    /// the wait run on).
    ///
    /// # Safety
    /// Each stream is live. The caller opens the gate to this ticket within a bounded time on
    /// every path, including its own failure and drop (dropping the gate opens it).
    pub(crate) unsafe fn shut(&self, streams: &[cudaStream_t]) -> Result<u32> {
        let ticket = self.issued.load(Ordering::Relaxed).wrapping_add(1);
        self.issued.store(ticket, Ordering::Relaxed);
        for &s in streams {
            // SAFETY: `s` is live (the caller's promise); the word is mapped host memory that is
            // never freed; the caller opens it in bounded time.
            if let Err(e) = unsafe { cu::stream_wait_value32_geq(s, self.device, ticket) } {
                self.open_to(ticket);
                return Err(e);
            }
        }
        Ok(ticket)
    }

    /// Opens the gate up to `ticket`: work behind it and every earlier ticket may start. Never
    /// moves the word back.
    pub(crate) fn open_to(&self, ticket: u32) {
        let mut cur = self.host.load(Ordering::Relaxed);
        while (ticket.wrapping_sub(cur) as i32) > 0 {
            match self
                .host
                .compare_exchange_weak(cur, ticket, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// Opens every ticket issued.
    pub(crate) fn open_all(&self) {
        self.open_to(self.issued.load(Ordering::Relaxed));
    }

    /// Whether every ticket issued is open.
    #[cfg(test)]
    pub(crate) fn is_open(&self) -> bool {
        let issued = self.issued.load(Ordering::Relaxed);
        (self.host.load(Ordering::Acquire).wrapping_sub(issued) as i32) >= 0
    }
}

impl Drop for Gate {
    /// Opens everything and gives the word back, with its count.
    fn drop(&mut self) {
        self.open_all();
        let issued = *self.issued.get_mut();
        FREE.lock().unwrap_or_else(|p| p.into_inner()).push(Word {
            host: self.host,
            device: self.device,
            issued,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_moves_forward_only_and_wraps() {
        static W: AtomicU32 = AtomicU32::new(u32::MAX - 1);
        let g = Gate {
            host: &W,
            device: 0,
            issued: AtomicU32::new(u32::MAX - 1),
        };
        assert!(g.is_open());
        g.issued.store(1, Ordering::Relaxed); // three tickets later, past the wrap
        assert!(!g.is_open());
        g.open_to(u32::MAX);
        assert_eq!(W.load(Ordering::Relaxed), u32::MAX);
        g.open_to(0);
        assert!(!g.is_open());
        g.open_to(u32::MAX - 5); // behind: ignored
        assert_eq!(W.load(Ordering::Relaxed), 0);
        g.open_all();
        assert!(g.is_open());
        assert_eq!(W.load(Ordering::Relaxed), 1);
        // Not given back to the pool: the word is not page-locked memory.
        std::mem::forget(g);
    }
}
