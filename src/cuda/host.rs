//! [`HostBuffer`]: page-locked ("pinned") host memory with asynchronous, tracked copies to and from
//! device buffers.
//!
//! A copy between the GPU and pageable memory ([`View::to_vec`], [`ViewMut::copy_from_slice`])
//! must block the host until it is done, since the memory may be paged out or freed as soon as
//! the call returns. Pinned memory stays put, so a copy to or from it can be queued on a stream
//! and return at once: [`HostBuffer::copy_from_device`] and [`ViewMut::copy_from_host`]. The
//! GPU's DMA engines also reach it directly, which is what makes such copies fast.
//!
//! # The rules
//! A host buffer is tracked exactly like a [`DeviceBuffer`], by the same engine: a copy into it
//! is a *write* of it, a copy out of it a *read* of it, and each copy first makes its stream wait,
//! on the GPU, for the earlier copies it conflicts with. The host is the other party, and the
//! host's access goes through the buffer too, waiting where it must:
//!
//! | host access | may conflict with | how it is excluded |
//! |---|---|---|
//! | [`HostBuffer::read`] (`&self`) | a copy into the buffer queued earlier | `read` waits for the buffer's last write (`cudaEventSynchronize`) |
//! | the [`HostRef`] it returns | a copy into the buffer queued meanwhile | impossible: a copy into it takes `&mut HostBuffer` |
//! | [`HostBuffer::write`] (`&mut self`) | any copy into or out of it queued earlier | `write` waits for every pending use |
//! | the [`HostMut`] it returns | any copy queued meanwhile | impossible: every copy borrows the buffer |
//! | drop | any copy queued earlier | the memory goes to its device's cache with those copies' events, without blocking; no buffer takes it before they complete, and [`release_cached`] waits for them before freeing it |
//! | [`HostBuffer::free`] | any copy queued earlier | waits for every pending use, then caches the memory |
//!
//! Copies out of the buffer (`&HostBuffer`) may run while the host reads it: both only read.
//! A copy into or out of it borrows the buffer only for the call; tracking, not the borrow,
//! keeps the memory from being written or freed until the GPU is done with it.
//!
//! A buffer is bound to one [`Device`]: its copies go on that device's streams (a stream of
//! another device is [`Error::InvalidArgument`]).
//!
//! # Cost, and the cache
//! Pinned memory cannot be paged out: it is taken from the memory the operating system can use
//! for everything else. Allocating it (`cudaMallocHost`) is slow (it maps and locks every page),
//! and freeing it (`cudaFreeHost`) waits for the whole device to be idle, holding up other
//! threads' CUDA calls meanwhile: one thread's drop would stall another's copies behind
//! unrelated kernels. So handoff caches it, as PyTorch does: dropping a buffer hands its memory,
//! rounded up to a power of two (at least 512 bytes), to a per-device cache, and a new buffer of
//! that size class on the device reuses it once every copy that used it has completed (asked
//! without blocking; until then a new allocation is made). A size class up to 4 MiB is
//! allocated eight blocks (at least 1 MiB, at most 32 MiB) at a time, the others cached idle,
//! so that most new buffers make no `cudaMallocHost` call (one can wait behind other threads'
//! GPU work); such a slab is freed only whole. Only [`release_cached`] gives cached
//! memory back to the system (it blocks, and synchronises the device); [`cached_bytes`] says how
//! much is held. Allocate large buffers once and reuse them; call [`release_cached`] when a
//! phase that used much pinned memory is over and the device is idle.

use std::future::Future;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll};

use bytemuck::Pod;

use crate::cuda::buffer::{DeviceBuffer, byte_len};
use crate::cuda::completion::{Outcome, Query, Waiting};
use crate::cuda::view::{CopyPath, View, ViewMut, check_len, tracked_copy};
use crate::engine::device::check_poison;
use crate::engine::device::{Device, PooledEvent, wait_all};
use crate::engine::stream::Stream;
use crate::engine::tracking::{Access, StreamId};
use crate::engine::{self, Tracked, TrackedUse};
use crate::error::{Error, Result};
use crate::result::cudart as cu;

mod pool;
use pool::{Block, Pool};

/// `len` elements of `T` in page-locked host memory, bound to one device; see the
/// [module docs](self) for the rules.
///
/// ```no_run
/// # fn main() -> handoff::Result<()> {
/// use handoff::{Device, DeviceBuffer, HostBuffer, Stream, kernels};
/// let dev = Device::new(0)?;
/// let stream = Stream::new(&dev)?;
/// let mut y = DeviceBuffer::<f32>::zeros(4, &stream)?;
/// kernels::produce(&mut y, 0, &stream)?;
/// let mut host = HostBuffer::<f32>::zeros(4, &dev)?;
/// host.copy_from_device(&y, &stream)?; // returns at once
/// // ... other host work ...
/// assert_eq!(&*host.read()?, [1.0, 2.0, 3.0, 4.0]); // waits for the copy
/// # Ok(())
/// # }
/// ```
pub struct HostBuffer<T: Pod> {
    ptr: *mut T,
    len: usize,
    /// The bytes of the cached block `ptr` points to (a size class); 0 when the buffer owns no
    /// memory (no elements, elements of no size, or given back already).
    capacity: usize,
    tracked: Tracked,
    /// The last write of the device memory that the latest copy into this buffer read: a
    /// receive there that an NCCL abort cut short makes the data read here partial, which
    /// [`HostBuffer::read`] reports (as [`View::to_vec`] does). Set only under `&mut self`.
    filled_from: Option<Arc<PooledEvent>>,
    _marker: PhantomData<T>,
}

// SAFETY: the buffer owns its host memory, which any thread may use; its tracker is behind a
// mutex, and CUDA calls on the memory may come from any thread. As `Vec<T>`: Send if `T` is.
unsafe impl<T: Pod + Send> Send for HostBuffer<T> {}
// SAFETY: `&HostBuffer` allows only reads of the memory (host reads after waiting for the last
// write, and tracked copies out of it), whose bookkeeping is behind the mutex.
unsafe impl<T: Pod + Sync> Sync for HostBuffer<T> {}

impl<T: Pod> std::fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("device", &self.tracked.device.ordinal())
            .finish()
    }
}

/// The host, as a party of the tracking rules: no stream, so none of a buffer's uses is ordered
/// before a host access by stream order, and every conflicting one is waited for. An id that no
/// stream has.
fn host() -> StreamId {
    static HOST: OnceLock<StreamId> = OnceLock::new();
    *HOST.get_or_init(StreamId::fresh)
}

impl<T: Pod> HostBuffer<T> {
    /// Allocates `len` elements of pinned memory without initialising them: a cached block of
    /// the size class whose copies have all completed, or a new one.
    fn alloc(device: &Device, len: usize) -> Result<Self> {
        let bytes = byte_len::<T>(len)?;
        // Length 0 and no block until the memory exists, so that an early return gives back
        // nothing.
        let mut buf = HostBuffer {
            ptr: std::ptr::NonNull::<T>::dangling().as_ptr(),
            len: 0,
            capacity: 0,
            tracked: Tracked::new_host(device),
            filled_from: None,
            _marker: PhantomData,
        };
        if bytes > 0 {
            let class = pool::class(bytes);
            // SAFETY: the events are alive (the pool owns them); a query does not block.
            let cached = pool_of(device, |p| {
                p.take(class, |e| unsafe { cu::event_query(e.raw) }.unwrap_or(false))
            });
            let ptr = match cached {
                Some(block) => block.addr as *mut T,
                None => {
                    // The allocation belongs to the context of the current device (and, with
                    // unified addressing, every device can use it).
                    device.set_current()?;
                    match pool::slab(class) {
                        // Several blocks in one call, the others cached idle (no copy ever
                        // used them).
                        Some(slab) => {
                            let addr = cu::malloc_host(slab)? as usize;
                            pool_of(device, |p| p.cut(addr, slab, class)).addr as *mut T
                        }
                        None => cu::malloc_host(class)?.cast::<T>(),
                    }
                }
            };
            if !ptr.is_aligned() {
                // Idle and unused: cached for a type it suits (cudaMallocHost aligns to pages,
                // so this is not expected).
                give_back(device, ptr as usize, class, Vec::new());
                return Err(Error::InvalidArgument(format!(
                    "cudaMallocHost returned memory not aligned for {} ({} bytes)",
                    std::any::type_name::<T>(),
                    std::mem::align_of::<T>()
                )));
            }
            buf.ptr = ptr;
            buf.capacity = class;
        }
        buf.len = len;
        Ok(buf)
    }

    /// `len` zeroed elements of pinned host memory, for copies on `device`'s streams. A length
    /// of zero allocates nothing.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the size overflows; CUDA errors (out of pinned memory).
    pub fn zeros(len: usize, device: &Device) -> Result<Self> {
        let buf = Self::alloc(device, len)?;
        // SAFETY: `ptr` holds `len` elements, owned by `buf` and used by nothing else yet; all
        // zero bytes are a valid `T` (`T: Pod`).
        unsafe { std::ptr::write_bytes(buf.ptr, 0, buf.len) };
        Ok(buf)
    }

    /// Pinned host memory holding a copy of `data`, for copies on `device`'s streams.
    ///
    /// # Errors
    /// As [`HostBuffer::zeros`].
    pub fn from_slice(data: &[T], device: &Device) -> Result<Self> {
        let buf = Self::alloc(device, data.len())?;
        // SAFETY: `ptr` holds `data.len()` elements, owned by `buf` and used by nothing else
        // yet; `data` is other memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr, data.len()) };
        Ok(buf)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a buffer of no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device on whose streams the buffer is copied.
    pub fn device(&self) -> &Device {
        &self.tracked.device
    }

    /// The raw host pointer, for calling CUDA directly. Neither access through it nor work
    /// queued with it is tracked: the caller takes on the waits that [`HostBuffer::read`] and
    /// [`HostBuffer::write`] otherwise make.
    pub fn as_raw_ptr(&self) -> *const T {
        self.ptr
    }

    /// The raw host pointer, writable. As [`HostBuffer::as_raw_ptr`].
    pub fn as_raw_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// The contents, to be read on the host, once every copy into the buffer queued so far has
    /// completed (the host blocks until then). Copies out of the buffer may still be running,
    /// and others may be queued while the guard lives: they only read.
    ///
    /// # Errors
    /// CUDA errors, including a fault in a copy into the buffer; [`Error::CommunicatorUnusable`]
    /// when the device memory last copied in was last written by an NCCL receive that its
    /// communicator's abort cut short (the data is partial): reported at every read until
    /// another copy replaces the contents.
    pub fn read(&self) -> Result<HostRef<'_, T>> {
        // A host read conflicts only with writes, i.e. copies into the buffer. Such a copy needs
        // `&mut self`, so none is being queued now nor can be while the guard borrows `self`:
        // waiting for the last write queued so far is enough. Earlier writes are covered by it
        // (each recorded write waited on the GPU for every earlier use). Asked of the tracker, so
        // that a build with tracking bypassed shows the hazard.
        let (waits, last) = {
            let t = self.tracked.lock();
            let waits: Vec<_> = t.waits(host(), Access::Read).cloned().collect();
            (waits, t.last_write().cloned())
        };
        wait_all(&waits)?;
        check_poison(last.as_deref())?;
        check_poison(self.filled_from.as_deref())?;
        // SAFETY: `len` elements of `T` owned by `self`, valid for any bit pattern; no write is
        // pending (waited above) and none can be queued or made through safe code while the
        // guard borrows `self` shared.
        let slice = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        Ok(HostRef { slice })
    }

    /// The contents, to be written (and read) on the host, once every copy into or out of the
    /// buffer queued so far has completed (the host blocks until then).
    ///
    /// # Errors
    /// As [`HostBuffer::read`]; after a cut-short copy in, the error stays until another copy
    /// replaces the contents (or the buffer is dropped).
    pub fn write(&mut self) -> Result<HostMut<'_, T>> {
        // A host write conflicts with every use: a copy in (writing) or out (reading). All need
        // a borrow of `self`, so none is being queued now, nor can be while the guard borrows
        // `self` exclusively: waiting for the uses pending now is enough.
        let (waits, last) = {
            let t = self.tracked.lock();
            let waits: Vec<_> = t.waits(host(), Access::Write).cloned().collect();
            (waits, t.last_write().cloned())
        };
        wait_all(&waits)?;
        check_poison(last.as_deref())?;
        check_poison(self.filled_from.as_deref())?;
        // Every use waited for has completed and no other can have been recorded since (`&mut
        // self`): forget them, so that their events go back to the pool. The host now writes the
        // contents: what the last copy in read no longer matters.
        drop(self.tracked.lock().take_all());
        self.filled_from = None;
        // SAFETY: `len` elements of `T` owned by `self`, valid for any bit pattern; no copy
        // uses them (waited above) and none can be queued while the guard borrows `self`
        // exclusively.
        let slice = unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) };
        Ok(HostMut { slice })
    }

    /// Copies `src` (a device buffer or a [`View`] of part of one, of the same length) into this
    /// buffer on `stream` (of `src`'s device, which must be this buffer's), after the last write
    /// to `src`'s buffer and every earlier use of this one; returns at once, without waiting for
    /// the copy. [`HostBuffer::read`] waits for it; this buffer cannot be written or freed before
    /// it is done.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the lengths differ, or the stream, `src` and this buffer
    /// are not all of one device; CUDA errors.
    pub fn copy_from_device<'s>(&mut self, src: impl Into<View<'s, T>>, stream: &Stream) -> Result<()> {
        let src = src.into();
        let uses = [
            TrackedUse::on(stream, src.tracked(), Access::Read),
            TrackedUse::on(stream, &self.tracked, Access::Write),
        ];
        engine::check_devices(&uses)?;
        check_len(self.len, src.len(), "the device view")?;
        // The write the copy will read after, whose report of cut-short data a host read gives
        // (through another view of the same buffer, a write may still be queued before the copy:
        // then that one; see the crate's known limits). Set before the copy is queued, so that
        // whatever part of it reaches the stream is covered.
        let before = std::mem::replace(&mut self.filled_from, src.tracked().lock().last_write().cloned());
        // SAFETY: `src` holds `len` elements of device memory and this buffer as many of pinned
        // host memory (checked), both borrowed for the call, all on `stream`'s device
        // (checked); the copy's tracking keeps the device buffer from being rewritten or freed,
        // and this buffer from being read, written or freed on the host, before it is done.
        let copied = unsafe {
            tracked_copy(
                stream,
                (src.tracked(), src.as_raw_ptr().cast()),
                (&self.tracked, self.ptr.cast()),
                src.byte_len(),
                CopyPath::DeviceToHost,
            )
        };
        if copied.is_err() {
            // Perhaps nothing was copied: what the buffer held, and its report, stay.
            self.filled_from = before;
        }
        copied
    }

    /// Gives the memory back to its device's cache once every copy that uses it has completed
    /// (the host blocks until then), reporting those copies' errors, which a drop leaves
    /// unreported (it does not wait).
    ///
    /// # Errors
    /// CUDA errors. The memory is then leaked rather than reused while it may be in use.
    pub fn free(mut self) -> Result<()> {
        let pending = self.tracked.lock().retire();
        let waited = wait_all(&pending);
        if waited.is_ok() && self.capacity > 0 {
            give_back(self.device(), self.ptr as usize, self.capacity, Vec::new());
        }
        // Given back (or deliberately leaked): `Drop` must not give it again.
        self.capacity = 0;
        waited
    }
}

impl<T: Pod> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        // Retired under the tracker's lock, so no use is recorded after the events are taken.
        let pending = self.tracked.lock().retire();
        if self.capacity > 0 {
            give_back(self.device(), self.ptr as usize, self.capacity, pending);
        }
    }
}

/// Each device's cache of pinned memory, by ordinal: every [`Device`] of one ordinal shares the
/// primary context the memory was pinned in. Never freed but by [`release_cached`].
fn pool_of<R>(device: &Device, f: impl FnOnce(&mut Pool<Arc<PooledEvent>>) -> R) -> R {
    type Pools = Vec<(usize, Pool<Arc<PooledEvent>>)>;
    static POOLS: Mutex<Pools> = Mutex::new(Vec::new());
    // Each method leaves the pool whole, so a poisoned lock is still usable.
    let mut pools: MutexGuard<'_, Pools> = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    let ordinal = device.ordinal();
    let i = match pools.iter().position(|(o, _)| *o == ordinal) {
        Some(i) => i,
        None => {
            pools.push((ordinal, Pool::default()));
            pools.len() - 1
        }
    };
    f(&mut pools[i].1)
}

/// Caches the block at `addr` of `bytes`, used by no buffer any more, with the events of the
/// copies that may still use it.
fn give_back(device: &Device, addr: usize, bytes: usize, pending: Vec<Arc<PooledEvent>>) {
    pool_of(device, |p| {
        let slab = p.slab_of(addr);
        p.give(Block {
            addr,
            slab,
            bytes,
            pending,
        })
    });
}

/// The bytes of pinned memory that dropped [`HostBuffer`]s of `device`'s ordinal left in its
/// cache, for new buffers to reuse.
pub fn cached_bytes(device: &Device) -> usize {
    pool_of(device, |p| p.bytes())
}

/// Frees the pinned memory cached for `device`'s ordinal (see the [module docs](self)), once
/// the copies that may still use each block have completed; returns the bytes freed. Blocks:
/// `cudaFreeHost` waits for the whole device to be idle. Buffers still alive are untouched.
///
/// # Errors
/// CUDA errors (the first one; a block whose copies could not be waited for, or whose free
/// failed, is leaked rather than freed while it may be in use).
pub fn release_cached(device: &Device) -> Result<usize> {
    device.set_current()?;
    let blocks = pool_of(device, Pool::drain);
    let (mut freed, mut first_error) = (0, None);
    for b in blocks {
        // SAFETY: the block came from malloc_host and no buffer uses it; every copy that used
        // it has completed (waited for first).
        let r = wait_all(&b.pending).and_then(|()| unsafe { cu::free_host(b.addr as *mut std::ffi::c_void) });
        match r {
            Ok(()) => freed += b.bytes,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    first_error.map_or(Ok(freed), Err)
}

impl<T: Pod> HostBuffer<T> {
    /// A future of the contents, to be read on the host once every copy into the buffer queued
    /// so far has completed: the async form of [`HostBuffer::read`], which no executor thread
    /// blocks on. It borrows the buffer as `read` does, so no copy into it can be queued
    /// meanwhile; dropping it at any time is safe (the copies stay tracked by the buffer).
    ///
    /// Unbounded, like [`HostBuffer::read`] (a copy behind NCCL work is bounded by its
    /// communicator's watchdog); [`HostRead::with_timeout`] bounds it.
    ///
    /// # Errors
    /// The future's: as [`HostBuffer::read`]; [`Error::Timeout`] past a timeout set;
    /// [`Error::Setup`] if the thread that wakes futures cannot be started.
    pub fn read_async(&self) -> HostRead<'_, T> {
        // As `read`: the last write queued so far covers every earlier one, and none can be
        // queued while the future borrows `self`.
        let (waits, last) = {
            let t = self.tracked.lock();
            let waits: Vec<_> = t.waits(host(), Access::Read).cloned().collect();
            (waits, t.last_write().cloned())
        };
        HostRead {
            buf: self,
            wait: Waiting::new(waits.into_iter().map(|e| e as Arc<dyn Query>), None),
            last,
            timeout: None,
        }
    }
}

/// A future of a [`HostBuffer`]'s contents ([`HostBuffer::read_async`]), resolving to the
/// [`HostRef`] that [`HostBuffer::read`] returns.
#[must_use = "a future does nothing unless awaited or polled"]
pub struct HostRead<'a, T: Pod> {
    buf: &'a HostBuffer<T>,
    wait: Waiting,
    /// The last write when the future was made, whose abort the read reports.
    last: Option<Arc<PooledEvent>>,
    timeout: Option<std::time::Duration>,
}

impl<T: Pod> std::fmt::Debug for HostRead<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRead")
            .field("buffer", self.buf)
            .field("wait", &self.wait)
            .finish()
    }
}

impl<'a, T: Pod> HostRead<'a, T> {
    /// Ends the wait with [`Error::Timeout`] if the copies have not completed within `timeout`
    /// of now.
    pub fn with_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.wait.bound(std::time::Instant::now() + timeout);
        self.timeout = Some(timeout);
        self
    }
}

impl<'a, T: Pod> Future for HostRead<'a, T> {
    type Output = Result<HostRef<'a, T>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match this.wait.poll(cx, None) {
            Poll::Ready(Ok(Outcome::Complete)) => {
                let buf = this.buf;
                let checked = check_poison(this.last.as_deref())
                    .and_then(|()| check_poison(buf.filled_from.as_deref()));
                Poll::Ready(checked.map(|()| {
                    // SAFETY: as in `read`: `len` elements of `T` owned by the buffer, valid for
                    // any bit pattern; every copy into it queued before the future was made has
                    // completed, and none can have been queued since (it is borrowed shared for
                    // `'a`).
                    let slice = unsafe { std::slice::from_raw_parts(buf.ptr, buf.len) };
                    HostRef { slice }
                }))
            }
            Poll::Ready(Ok(Outcome::Expired)) => Poll::Ready(Err(Error::Timeout {
                what: "the async read of a host buffer".into(),
                after: this.timeout.unwrap_or_default(),
            })),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A [`HostBuffer`]'s contents, read on the host: from [`HostBuffer::read`], which waited for
/// every copy into it. Derefs to `&[T]`.
pub struct HostRef<'a, T: Pod> {
    slice: &'a [T],
}

impl<T: Pod> Deref for HostRef<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for HostRef<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.slice.fmt(f)
    }
}

/// A [`HostBuffer`]'s contents, written on the host: from [`HostBuffer::write`], which waited
/// for every copy into or out of it. Derefs to `&mut [T]`.
pub struct HostMut<'a, T: Pod> {
    slice: &'a mut [T],
}

impl<T: Pod> Deref for HostMut<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T: Pod> DerefMut for HostMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.slice
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for HostMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.slice.fmt(f)
    }
}

impl<T: Pod> ViewMut<'_, T> {
    /// Copies `src`, pinned host memory of the same length, into the view on `stream` (of the
    /// view's device, which must be `src`'s), after every earlier use of the view's buffer and
    /// the last copy into `src`; returns at once, without waiting for the copy. `src` is
    /// borrowed only for the call: it cannot be written on the host, or freed, before the copy
    /// is done ([`HostBuffer::write`] and its drop wait for it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the lengths differ, or the stream, the view or `src` are
    /// not all of one device; CUDA errors.
    pub fn copy_from_host(&mut self, src: &HostBuffer<T>, stream: &Stream) -> Result<()> {
        let uses = [
            TrackedUse::on(stream, &src.tracked, Access::Read),
            TrackedUse::on(stream, self.tracked(), Access::Write),
        ];
        engine::check_devices(&uses)?;
        check_len(self.len(), src.len, "the host buffer")?;
        // SAFETY: `src` holds `len` elements of pinned host memory and the view as many of
        // device memory (checked), both borrowed for the call, all on `stream`'s device
        // (checked); the copy's tracking keeps `src` from being written or freed on the host,
        // and the device buffer from being used, before it is done.
        unsafe {
            tracked_copy(
                stream,
                (&src.tracked, src.ptr.cast_const().cast()),
                (self.tracked(), self.as_raw_mut_ptr().cast()),
                self.byte_len(),
                CopyPath::HostToDevice,
            )
        }
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Copies `src`, pinned host memory of the same length, into the buffer; returns at once.
    /// See [`ViewMut::copy_from_host`].
    ///
    /// # Errors
    /// As [`ViewMut::copy_from_host`].
    pub fn copy_from_host(&mut self, src: &HostBuffer<T>, stream: &Stream) -> Result<()> {
        self.view_mut().copy_from_host(src, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_length_buffers_need_no_cuda() {
        let dev = Device::for_tests();
        let mut a = HostBuffer::<f32>::zeros(0, &dev).unwrap();
        assert!(a.is_empty());
        assert_eq!((a.len(), a.byte_len()), (0, 0));
        assert!(a.read().unwrap().is_empty());
        assert!(a.write().unwrap().is_empty());
        a.free().unwrap();
        let b = HostBuffer::<u8>::from_slice(&[], &dev).unwrap();
        assert_eq!(b.device().ordinal(), 0);
        assert!(format!("{b:?}").contains("len: 0"));
        drop(b);
        // Elements of no size need no memory, whatever their number.
        let mut c = HostBuffer::<()>::zeros(5, &dev).unwrap();
        assert_eq!((c.len(), c.byte_len()), (5, 0));
        assert_eq!(c.read().unwrap().len(), 5);
        assert_eq!(c.write().unwrap().len(), 5);
    }

    #[test]
    fn sizes_that_overflow_are_refused_before_cuda() {
        let dev = Device::for_tests();
        assert!(matches!(
            HostBuffer::<f64>::zeros(usize::MAX / 4, &dev),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn copies_of_other_lengths_are_refused_before_cuda() {
        let dev = Device::for_tests();
        let stream = Stream::for_tests(&dev);
        // A device buffer's bookkeeping over memory that is never touched: the copies are
        // refused before anything is queued.
        let tracked = Tracked::new(&dev);
        let ptr = std::ptr::NonNull::<f32>::dangling().as_ptr();
        let mut host = HostBuffer::<f32>::zeros(0, &dev).unwrap();
        // SAFETY: never dereferenced: every call below fails on the lengths first.
        let (view, mut view_mut) = unsafe {
            (
                View::from_raw(ptr, 3, &tracked),
                ViewMut::from_raw(ptr, 3, &tracked),
            )
        };
        for r in [
            host.copy_from_device(view, &stream),
            host.copy_from_device(&view_mut, &stream),
            view_mut.copy_from_host(&host, &stream),
        ] {
            match r {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.contains("3 elements") || m.contains("has 0"), "{m}")
                }
                other => panic!("a copy of another length gave {other:?}"),
            }
        }
        // Nothing was recorded on either side.
        assert!(tracked.lock().is_empty());
        assert!(host.tracked.lock().is_empty());
    }

    #[test]
    fn the_host_is_no_stream() {
        // The host's id is stable and no stream gets it, so no use is ever taken as ordered
        // before a host access by a stream.
        assert_eq!(host(), host());
        assert_ne!(StreamId::fresh(), host());
        let mut t = crate::engine::tracking::UseTracker::new();
        let s = StreamId::fresh();
        t.record(s, Access::Read, "r");
        assert!(t.waits(host(), Access::Read).next().is_none());
        t.record(s, Access::Write, "w");
        t.record(StreamId::fresh(), Access::Read, "r2");
        if !crate::engine::tracking::BYPASSED {
            assert_eq!(t.waits(host(), Access::Read).collect::<Vec<_>>(), [&"w"]);
            assert_eq!(t.waits(host(), Access::Write).count(), 2);
        }
    }
}
