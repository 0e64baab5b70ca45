//! The article's kernels (CUDA C in `kernels/article.cu`, compiled to PTX by `build.rs`), loaded
//! once per process and launched through typed functions that take part in use tracking.
//!
//! - [`produce`] is kernel A: writes `x[i] = ((i + round) mod 2^24) + 1`, so round 0 of a
//!   four-element buffer is `[1, 2, 3, 4]` and every round differs.
//! - [`twice`] is kernel B: `y = 2x`.
//! - [`busy`] is work C: independent of any buffer, of a chosen duration, to overlap with
//!   transfers.
//! - [`delayed_copy`] reads a buffer after a delay: a long read, for showing hazards.
//!
//! They are launched through the same [`Module`] and launch builder as users' own kernels.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytemuck::Pod;
use once_cell::sync::OnceCell;

use crate::cuda::buffer::DeviceBuffer;
use crate::cuda::module::{Function, LaunchConfig, Module};
use crate::cuda::view::{View, ViewMut, check_len};
use crate::engine::stream::Stream;
use crate::error::{Error, Result};
use crate::sys::ptx;

/// The crate's kernels, launched through the same [`Module`] API as users' own.
struct Builtins {
    produce: Function,
    twice: Function,
    busy: Function,
    delayed_copy: Function,
    fill: Function,
    /// Bit `d` set once every kernel is loaded on device `d` (ordinals below 64), so that a
    /// launch then asks nothing more. Set only after the loads, read with `Acquire`.
    loaded: AtomicU64,
}

static BUILTINS: OnceCell<Result<Builtins>> = OnceCell::new();

/// The crate's kernels, every one of them loaded on `stream`'s device before the first launch of
/// any there (as one step: a lazy load can wait for work already running on the device, so none
/// should happen between two launches whose ordering a caller relies on).
fn builtins(stream: &Stream) -> Result<&'static Builtins> {
    let b = all_builtins()?;
    let bit = 1u64.checked_shl(stream.device().ordinal() as u32).unwrap_or(0);
    if b.loaded.load(Ordering::Acquire) & bit != 0 {
        return Ok(b);
    }
    for f in [&b.produce, &b.twice, &b.busy, &b.delayed_copy, &b.fill] {
        f.load_on(stream.device())?;
    }
    b.loaded.fetch_or(bit, Ordering::Release);
    Ok(b)
}

fn all_builtins() -> Result<&'static Builtins> {
    BUILTINS
        .get_or_init(|| {
            let m = Module::from_image(ptx::ARTICLE)?;
            Ok(Builtins {
                produce: m.function("handoff_produce")?,
                twice: m.function("handoff_twice")?,
                busy: m.function("handoff_busy")?,
                delayed_copy: m.function("handoff_delayed_copy")?,
                fill: m.function("handoff_fill")?,
                loaded: AtomicU64::new(0),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

const BLOCK: u32 = 256;
/// The kernels use grid-stride loops; this many blocks keep every multiprocessor of current
/// GPUs busy without launching one block per 256 elements of a huge buffer.
const MAX_GRID: u64 = 65_535;

fn grid_for(n: usize) -> u32 {
    (n as u64).div_ceil(u64::from(BLOCK)).clamp(1, MAX_GRID) as u32
}

fn config(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid: (blocks, 1, 1),
        block: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The longest wait [`busy`] and [`delayed_copy`] accept: a stream held for longer is a hang in
/// all but name.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

fn nanos(d: Duration) -> Result<u64> {
    if d > MAX_WAIT {
        return Err(Error::InvalidArgument(format!(
            "a GPU-side wait of {d:?} is longer than the {MAX_WAIT:?} allowed"
        )));
    }
    Ok(d.as_nanos() as u64)
}

/// Kernel A: writes `x[i] = ((i + round) mod 2^24) + 1` on `stream`, after every earlier use of
/// `x`'s buffer. `x` is a buffer or a [`ViewMut`] of part of one; `i` counts from the view's
/// start.
///
/// # Errors
/// [`Error::InvalidArgument`] if `x` is on another device than
/// `stream`; CUDA errors (loading the PTX, launching).
pub fn produce<'x>(x: impl Into<ViewMut<'x, f32>>, round: u32, stream: &Stream) -> Result<()> {
    let x = x.into();
    let k = &builtins(stream)?.produce;
    let n = x.len();
    // SAFETY: handoff_produce(float* x, u64 n, u32 round) writes x[0..n] only, and ends.
    unsafe {
        stream
            .launch_builder(k)
            .arg(x)
            .arg(n as u64)
            .arg(round)
            .launch(config(grid_for(n), BLOCK))
    }
}

/// The value kernel A writes at index `i` in round `round`, for checking on the host.
pub fn produced_value(i: usize, round: u32) -> f32 {
    (((i as u64 + u64::from(round)) & 0xFF_FFFF) + 1) as f32
}

/// Kernel B: `y = 2x` on `stream`, after the last write to `x`'s buffer and every earlier use of
/// `y`'s. Each is a buffer or a view of part of one ([`View`], [`ViewMut`]); they may be the
/// two halves of one buffer from [`ViewMut::split_at_mut`].
///
/// # Errors
/// [`Error::InvalidArgument`] if the lengths differ or a buffer
/// is on another device; CUDA errors.
pub fn twice<'x, 'y>(
    x: impl Into<View<'x, f32>>,
    y: impl Into<ViewMut<'y, f32>>,
    stream: &Stream,
) -> Result<()> {
    let (x, y) = (x.into(), y.into());
    check_len(y.len(), x.len(), "x")?;
    let k = &builtins(stream)?.twice;
    let n = x.len();
    // SAFETY: handoff_twice(const float* x, float* y, u64 n) reads x[0..n], writes y[0..n].
    unsafe {
        stream
            .launch_builder(k)
            .arg(x)
            .arg(y)
            .arg(n as u64)
            .launch(config(grid_for(n), BLOCK))
    }
}

/// Work C: keeps one GPU thread busy for `duration` on `stream`, touching no memory.
///
/// # Errors
/// [`Error::InvalidArgument`] for a duration over [`MAX_WAIT`];
/// CUDA errors.
pub fn busy(duration: Duration, stream: &Stream) -> Result<()> {
    let ns = nanos(duration)?;
    let k = &builtins(stream)?.busy;
    // SAFETY: handoff_busy(u64 ns) touches no memory and ends after `ns` (at most MAX_WAIT).
    unsafe { stream.launch_builder(k).arg(ns).launch(config(1, 1)) }
}

/// Blocks for [`delayed_copy`]: few, so that its long wait holds only a few multiprocessors.
/// A kernel with blocks on every multiprocessor can keep kernels that need another
/// shared-memory configuration (NCCL's, for one) from starting until it ends (so on the H200),
/// and that delay would hide the missing ordering the hazard tests look for.
const DELAYED_COPY_BLOCKS: u32 = 16;

/// A long read: waits `delay` on the GPU, then copies `src` into `dst`, on `stream`. Each is a
/// buffer or a view of part of one, as for [`twice`].
///
/// # Errors
/// As [`twice`], and as [`busy`] for the delay.
pub fn delayed_copy<'s, 'd>(
    src: impl Into<View<'s, f32>>,
    dst: impl Into<ViewMut<'d, f32>>,
    delay: Duration,
    stream: &Stream,
) -> Result<()> {
    let (src, dst) = (src.into(), dst.into());
    check_len(dst.len(), src.len(), "src")?;
    let ns = nanos(delay)?;
    let k = &builtins(stream)?.delayed_copy;
    let n = src.len();
    // SAFETY: handoff_delayed_copy(const float* src, float* dst, u64 n, u64 ns) reads src[0..n],
    // writes dst[0..n], and ends after at most MAX_WAIT plus the copy.
    unsafe {
        stream
            .launch_builder(k)
            .arg(src)
            .arg(dst)
            .arg(n as u64)
            .arg(ns)
            .launch(config(grid_for(n).min(DELAYED_COPY_BLOCKS), BLOCK))
    }
}

/// Sets every element of `dst` to `value` (see [`ViewMut::fill`]).
pub(crate) fn fill<T: Pod>(dst: ViewMut<'_, T>, value: T, stream: &Stream) -> Result<()> {
    let size = std::mem::size_of::<T>();
    if size > 16 {
        return Err(Error::InvalidArgument(format!(
            "fill takes elements of at most 16 bytes; {} has {size}",
            std::any::type_name::<T>()
        )));
    }
    stream.check_tracked(dst.tracked(), crate::engine::tracking::Access::Write)?;
    if size == 0 || dst.is_empty() {
        // Nothing to write (a zero-sized type has no bytes, whatever the length): no kernel,
        // which for a zero-sized type of a huge length would loop all but forever.
        return Ok(());
    }
    let mut pattern = [0u8; 16];
    pattern[..size].copy_from_slice(bytemuck::bytes_of(&value));
    let lo = u64::from_le_bytes(pattern[..8].try_into().expect("8 bytes"));
    let hi = u64::from_le_bytes(pattern[8..].try_into().expect("8 bytes"));
    let typed = u32::from(matches!(size, 1 | 2 | 4 | 8) && std::mem::align_of::<T>() == size);
    let k = &builtins(stream)?.fill;
    let n = dst.len();
    // SAFETY: handoff_fill(u8* dst, u64 n, u32 size, u32 typed, u64 lo, u64 hi) writes the
    // n × size bytes of dst, with stores of `size` bytes only where `typed` says the elements
    // are aligned to their size; it ends.
    unsafe {
        stream
            .launch_builder(k)
            .arg(dst)
            .arg(n as u64)
            .arg(size as u32)
            .arg(typed)
            .arg(lo)
            .arg(hi)
            .launch(config(grid_for(n), BLOCK))
    }
}

/// [`ViewMut::fill`] and [`DeviceBuffer::fill`]: here, beside the kernel they launch.
impl<T: Pod> ViewMut<'_, T> {
    /// Sets every element to `value`, on `stream`, after every earlier use of the buffer;
    /// returns at once. Elements of up to 16 bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an element over 16 bytes, or `stream` on another device;
    /// CUDA errors.
    pub fn fill(&mut self, value: T, stream: &Stream) -> Result<()> {
        fill(self.reborrow(), value, stream)
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Sets every element to `value`; see [`ViewMut::fill`].
    ///
    /// # Errors
    /// As [`ViewMut::fill`].
    pub fn fill(&mut self, value: T, stream: &Stream) -> Result<()> {
        self.view_mut().fill(value, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_zero_is_the_articles_x() {
        let x: Vec<f32> = (0..4).map(|i| produced_value(i, 0)).collect();
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
        assert_ne!(produced_value(0, 1), produced_value(0, 0));
    }

    #[test]
    fn produced_values_stay_exact_in_f32() {
        assert_eq!(produced_value((1 << 24) - 1, 0), 16_777_216.0);
        assert_eq!(produced_value(1 << 24, 0), 1.0);
    }

    /// A fill of a zero-sized type over a huge length launches nothing (no GPU here: a launch
    /// would fail).
    #[test]
    fn filling_nothing_launches_nothing() {
        let device = crate::engine::device::Device::for_tests();
        let stream = Stream::for_tests(&device);
        let tracked = crate::engine::Tracked::new(&device);
        let mut unit = ();
        // SAFETY: never dereferenced; zero-sized elements.
        let huge = unsafe { ViewMut::from_raw(&mut unit as *mut (), usize::MAX, &tracked) };
        fill(huge, (), &stream).unwrap();
        let mut x = 0f32;
        // SAFETY: never dereferenced; no elements.
        let empty = unsafe { ViewMut::from_raw(&mut x as *mut f32, 0, &tracked) };
        fill(empty, 1.0, &stream).unwrap();
    }

    #[test]
    fn gpu_waits_are_bounded_at_ten_minutes() {
        assert_eq!(nanos(Duration::from_millis(3)).unwrap(), 3_000_000);
        assert!(nanos(MAX_WAIT).is_ok());
        assert!(nanos(Duration::MAX).is_err());
    }

    #[test]
    fn grid_is_at_least_one_block_and_capped() {
        assert_eq!(grid_for(0), 1);
        assert_eq!(grid_for(256), 1);
        assert_eq!(grid_for(257), 2);
        assert_eq!(grid_for(usize::MAX), MAX_GRID as u32);
    }

    #[test]
    fn ptx_is_embedded_and_nul_terminated() {
        assert_eq!(ptx::ARTICLE.last(), Some(&0));
        let text = std::str::from_utf8(&ptx::ARTICLE[..ptx::ARTICLE.len() - 1]).unwrap();
        for k in [
            "handoff_produce",
            "handoff_twice",
            "handoff_busy",
            "handoff_delayed_copy",
            "handoff_fill",
        ] {
            assert!(text.contains(&format!(".entry {k}")), "{k} missing from the PTX");
        }
        assert!(
            text.contains(".target sm_75"),
            "PTX must target compute_75 for the driver to JIT it anywhere"
        );
    }
}
