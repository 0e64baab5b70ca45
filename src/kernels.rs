//! The article's kernels (CUDA C in `kernels/article.cu`, compiled to PTX by `build.rs`), loaded
//! once per process and launched through typed functions that take part in use tracking.
//!
//! - [`produce`] is kernel A: writes `x[i] = ((i + round) mod 2^24) + 1`, so round 0 of a
//!   four-element buffer is `[1, 2, 3, 4]` and every round differs.
//! - [`twice`] is kernel B: `y = 2x`.
//! - [`busy`] is work C: independent of any buffer, of a chosen duration, to overlap with
//!   transfers.
//! - [`delayed_copy`] reads a buffer after a delay: a long read, for showing hazards.

use std::ffi::{CStr, c_void};
use std::time::Duration;

use once_cell::sync::OnceCell;

use crate::buffer::DeviceBuffer;
use crate::error::Result;
use crate::result as cu;
use crate::stream::Stream;
use crate::sys::cudart::cudaKernel_t;
use crate::sys::ptx;
use crate::tracking::Access;

struct Loaded {
    produce: cudaKernel_t,
    twice: cudaKernel_t,
    busy: cudaKernel_t,
    delayed_copy: cudaKernel_t,
}

// SAFETY: kernel handles of a context-independent library are valid on every thread and
// device; they are never unloaded (the library lives for the whole process).
unsafe impl Send for Loaded {}
// SAFETY: as above; the handles are only read.
unsafe impl Sync for Loaded {}

static KERNELS: OnceCell<Result<Loaded>> = OnceCell::new();

/// The kernels, loaded into `stream`'s device before the first launch there, so that CUDA's
/// lazy loading (which can wait for work already running on the device) happens once, up front,
/// and never between two operations whose ordering a test or a user relies on.
fn kernels(stream: &Stream) -> Result<&'static Loaded> {
    let k = library()?;
    stream.device().inner.kernels_loaded.get_or_try_init(|| {
        stream.device().set_current()?;
        for kernel in [k.produce, k.twice, k.busy, k.delayed_copy] {
            // SAFETY: handles of a library that is never unloaded.
            unsafe { cu::kernel_load_on_current_device(kernel) }?;
        }
        Ok::<(), crate::Error>(())
    })?;
    Ok(k)
}

fn library() -> Result<&'static Loaded> {
    KERNELS
        .get_or_init(|| {
            let lib = cu::library_load_ptx(ptx::ARTICLE)?;
            let get = |name: &CStr| {
                // SAFETY: `lib` was just loaded and is never unloaded.
                unsafe { cu::library_get_kernel(lib, name) }
            };
            Ok(Loaded {
                produce: get(c"handoff_produce")?,
                twice: get(c"handoff_twice")?,
                busy: get(c"handoff_busy")?,
                delayed_copy: get(c"handoff_delayed_copy")?,
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

/// The longest wait [`busy`] and [`delayed_copy`] accept: a stream held for longer is a hang in
/// all but name.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

fn nanos(d: Duration) -> Result<u64> {
    if d > MAX_WAIT {
        return Err(crate::Error::InvalidArgument(format!(
            "a GPU-side wait of {d:?} is longer than the {MAX_WAIT:?} allowed"
        )));
    }
    Ok(d.as_nanos() as u64)
}

fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// Kernel A: writes `x[i] = ((i + round) mod 2^24) + 1` on `stream`, after every earlier use of
/// `x`.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if `x` is on another device than `stream`; CUDA errors (loading
/// the PTX, launching).
pub fn produce(stream: &Stream, x: &mut DeviceBuffer<f32>, round: u32) -> Result<()> {
    let k = kernels(stream)?.produce;
    let (mut p, mut n, mut r) = (x.as_raw_mut_ptr(), x.len() as u64, round);
    stream.enqueue(&[(x.tracked(), Access::Write)], |s| {
        // SAFETY: the arguments match `handoff_produce(float*, u64, u32)`; `p` holds `n` floats.
        unsafe {
            cu::launch_kernel(
                k,
                grid_for(n as usize),
                BLOCK,
                &mut [arg(&mut p), arg(&mut n), arg(&mut r)],
                s,
            )
        }
    })
}

/// The value kernel A writes at index `i` in round `round`, for checking on the host.
pub fn produced_value(i: usize, round: u32) -> f32 {
    (((i as u64 + u64::from(round)) & 0xFF_FFFF) + 1) as f32
}

/// Kernel B: `y = 2x` on `stream`, after the last write to `x` and every earlier use of `y`.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ or a buffer is on another device; CUDA
/// errors.
pub fn twice(stream: &Stream, x: &DeviceBuffer<f32>, y: &mut DeviceBuffer<f32>) -> Result<()> {
    y.check_len(x.len(), "x")?;
    let k = kernels(stream)?.twice;
    let (mut px, mut py, mut n) = (x.as_raw_ptr(), y.as_raw_mut_ptr(), x.len() as u64);
    stream.enqueue(
        &[(x.tracked(), Access::Read), (y.tracked(), Access::Write)],
        |s| {
            // SAFETY: the arguments match `handoff_twice(const float*, float*, u64)`; both hold `n`.
            unsafe {
                cu::launch_kernel(
                    k,
                    grid_for(n as usize),
                    BLOCK,
                    &mut [arg(&mut px), arg(&mut py), arg(&mut n)],
                    s,
                )
            }
        },
    )
}

/// Work C: keeps one GPU thread busy for `duration` on `stream`, touching no memory.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a duration over [`MAX_WAIT`];
/// CUDA errors.
pub fn busy(stream: &Stream, duration: Duration) -> Result<()> {
    let k = kernels(stream)?.busy;
    let mut ns = nanos(duration)?;
    stream.enqueue(&[], |s| {
        // SAFETY: the argument matches `handoff_busy(u64)`.
        unsafe { cu::launch_kernel(k, 1, 1, &mut [arg(&mut ns)], s) }
    })
}

/// Blocks for [`delayed_copy`]: few, so that its long wait holds only a few multiprocessors.
/// A kernel with blocks on every multiprocessor can keep kernels that need another
/// shared-memory configuration (NCCL's, for one) from starting until it ends: seen on the H200,
/// where that delay hid the missing ordering the hazard tests look for.
const DELAYED_COPY_BLOCKS: u32 = 16;

/// A long read: waits `delay` on the GPU, then copies `src` into `dst`, on `stream`.
///
/// # Errors
/// As [`twice`].
pub fn delayed_copy(
    stream: &Stream,
    src: &DeviceBuffer<f32>,
    dst: &mut DeviceBuffer<f32>,
    delay: Duration,
) -> Result<()> {
    dst.check_len(src.len(), "src")?;
    let k = kernels(stream)?.delayed_copy;
    let (mut ps, mut pd, mut n, mut ns) = (
        src.as_raw_ptr(),
        dst.as_raw_mut_ptr(),
        src.len() as u64,
        nanos(delay)?,
    );
    stream.enqueue(
        &[(src.tracked(), Access::Read), (dst.tracked(), Access::Write)],
        |s| {
            // SAFETY: the arguments match `handoff_delayed_copy(const float*, float*, u64, u64)`.
            unsafe {
                cu::launch_kernel(
                    k,
                    grid_for(n as usize).min(DELAYED_COPY_BLOCKS),
                    BLOCK,
                    &mut [arg(&mut ps), arg(&mut pd), arg(&mut n), arg(&mut ns)],
                    s,
                )
            }
        },
    )
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

    #[test]
    fn gpu_waits_are_bounded() {
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
        ] {
            assert!(text.contains(&format!(".entry {k}")), "{k} missing from the PTX");
        }
        assert!(
            text.contains(".target sm_75"),
            "PTX must target compute_75 for the driver to JIT it anywhere"
        );
    }
}
