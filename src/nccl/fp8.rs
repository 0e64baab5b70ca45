//! What NCCL accepts of its fp8 types, checked before anything reaches it: the version that has
//! them (2.24.3), the GPUs that reduce them (sm_90 and newer; before 2.28.3 also for the
//! collectives that only move them, `taskAppend` in `src/enqueue.cc`), the one-rank reductions
//! 2.28 has no kernel for. Empty collectives are dropped by NCCL before its type check, so only
//! the version is asked of them.

use crate::error::{Error, Result};
use crate::nccl::communicator::Communicator;
use crate::nccl::types::datatype_name;
use crate::nccl::verify::wire::{CollKind, PRE_MUL_SUM};
use crate::sys::loader;
use crate::sys::nccl::{ncclDataType_t, ncclRedOp_t};

/// Whether `d` is one of NCCL's fp8 types.
fn is_fp8(d: ncclDataType_t) -> bool {
    d == ncclDataType_t::ncclFloat8e4m3 || d == ncclDataType_t::ncclFloat8e5m2
}

/// How an operation uses its elements, which decides what NCCL needs for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// Moved without arithmetic by a send or a receive.
    Move,
    /// Moved without arithmetic by a collective (broadcast, all-gather, all-to-all, gather,
    /// scatter): refused below sm_90 by NCCL before 2.28.3.
    CollMove,
    /// An empty collective, which NCCL drops before looking at its reduction.
    Empty,
    /// Reduced with sum, product, minimum or maximum.
    Reduce,
    /// Reduced with `Avg` or PreMulSum: scaled by a factor, then summed.
    Scale,
}

impl Use {
    /// The use of a collective of `kind` over `count` elements with the wire code `redop` of
    /// its reduction.
    pub(crate) fn of(kind: CollKind, count: u64, redop: u32) -> Use {
        if count == 0 {
            return Use::Empty;
        }
        match kind {
            CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter => {
                if redop == ncclRedOp_t::ncclAvg.0 || redop == PRE_MUL_SUM {
                    Use::Scale
                } else {
                    Use::Reduce
                }
            }
            _ => Use::CollMove,
        }
    }
}

/// The first NCCL whose moving collectives take fp8 on any GPU (`taskAppend`, 2.28.3).
const FP8_COLL_MOVE_ANY_GPU: i32 = 22803;

/// Why NCCL would refuse an element type for a use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The loaded NCCL predates the type.
    OldNccl,
    /// Reductions of the type need a newer GPU than this compute capability.
    OldGpu(i32, i32),
    /// This NCCL's collectives take the type only on a newer GPU than this compute capability.
    OldGpuForCollectives(i32, i32),
    /// A one-rank communicator has no scaling kernel for the type.
    OneRankScale,
}

/// What NCCL (2.28.3's rules, see the module) would refuse for `dtype` used as `how`, given the
/// loaded NCCL's version code, this GPU's compute capability (asked only for reductions) and the
/// communicator's size. `None`: NCCL accepts it.
pub(crate) fn refusal(
    dtype: ncclDataType_t,
    how: Use,
    version: Option<i32>,
    compute: impl FnOnce() -> (i32, i32),
    world: usize,
) -> Option<Refusal> {
    if !is_fp8(dtype) {
        return None;
    }
    if version.is_none_or(|v| v < loader::FP8_MIN_VERSION) {
        return Some(Refusal::OldNccl);
    }
    let new_nccl = version.is_some_and(|v| v >= FP8_COLL_MOVE_ANY_GPU);
    if how == Use::Move || how == Use::Empty || (how == Use::CollMove && new_nccl) {
        return None;
    }
    let (major, minor) = compute();
    if major < 9 {
        return Some(match how {
            Use::CollMove => Refusal::OldGpuForCollectives(major, minor),
            _ => Refusal::OldGpu(major, minor),
        });
    }
    (how == Use::Scale && world == 1).then_some(Refusal::OneRankScale)
}

/// Refuses, before anything is queued, an operation of `comm` using `dtype` as `how` that the
/// loaded NCCL or this GPU would refuse (see the module). Free for the types every NCCL has.
///
/// # Errors
/// [`Error::Unsupported`] for an NCCL older than the type; [`Error::InvalidArgument`] for a
/// reduction NCCL cannot run here; CUDA errors asking the GPU's compute capability.
pub(crate) fn check_use(comm: &Communicator, dtype: ncclDataType_t, how: Use) -> Result<()> {
    if !is_fp8(dtype) {
        return Ok(());
    }
    let (version, path) = loader::nccl_version_code()?;
    let mut asked: Result<()> = Ok(());
    let compute = || match comm.device().compute_capability() {
        Ok(c) => c,
        Err(e) => {
            asked = Err(e);
            // Refused below with the CUDA error, not with this made-up capability.
            (0, 0)
        }
    };
    let r = refusal(dtype, how, version, compute, comm.world_size());
    asked?;
    let name = datatype_name(dtype.0);
    match r {
        None => Ok(()),
        Some(Refusal::OldNccl) => Err(Error::Unsupported {
            feature: "fp8 element types",
            needs: loader::FP8_NEEDS,
            loaded: match version {
                Some(v) => format!("{}, version code {v}", path.display()),
                None => path.display().to_string(),
            },
            detail: format!("it has no {name}"),
        }),
        Some(Refusal::OldGpu(major, minor)) => Err(Error::InvalidArgument(format!(
            "a reduction of {name} needs a GPU of compute capability 9.0 (sm_90) or newer, and \
             device {} is {major}.{minor}: NCCL has no fp8 reduction kernels for it. Move fp8 \
             data with sends, receives, broadcast or all-gather, or reduce in f16 or bf16",
            comm.device().ordinal()
        ))),
        Some(Refusal::OldGpuForCollectives(major, minor)) => Err(Error::InvalidArgument(format!(
            "a collective of {name} needs, with this NCCL (older than 2.28.3), a GPU of compute \
             capability 9.0 (sm_90) or newer, and device {} is {major}.{minor}: move fp8 data \
             with sends and receives, or load NCCL 2.28.3 or newer",
            comm.device().ordinal()
        ))),
        Some(Refusal::OneRankScale) => Err(Error::InvalidArgument(format!(
            "Avg and PreMulSum of {name} on a one-rank communicator: NCCL (2.28) has no fp8 \
             kernel for scaling on one rank. Use Sum (on one rank, a copy) and scale the result"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_needs_nccl_2_24_sm_90_for_reductions_and_no_one_rank_scaling() {
        let (e4, e5, f32_) = (
            ncclDataType_t::ncclFloat8e4m3,
            ncclDataType_t::ncclFloat8e5m2,
            ncclDataType_t::ncclFloat32,
        );
        let h200 = || (9, 0);
        let a100 = || (8, 0);
        let never = || -> (i32, i32) { panic!("the compute capability is asked only for reductions") };
        // Other types: nothing asked, whatever the version.
        assert_eq!(refusal(f32_, Use::Scale, Some(21800), never, 1), None);
        // Older than 2.24.3: refused for every use, empty collectives too (NCCL checks the type
        // code before the count).
        for how in [Use::Move, Use::CollMove, Use::Empty, Use::Reduce, Use::Scale] {
            assert_eq!(refusal(e4, how, Some(22304), h200, 2), Some(Refusal::OldNccl));
            assert_eq!(refusal(e5, how, None, h200, 2), Some(Refusal::OldNccl));
        }
        // Sent and received: any GPU, from 2.24.3; empty collectives likewise (NCCL drops them).
        assert_eq!(refusal(e4, Use::Move, Some(22403), never, 1), None);
        assert_eq!(refusal(e5, Use::Move, Some(22803), never, 8), None);
        assert_eq!(refusal(e4, Use::Empty, Some(22403), never, 2), None);
        // Moved by a collective: any GPU from 2.28.3, sm_90 before.
        assert_eq!(refusal(e4, Use::CollMove, Some(22803), never, 2), None);
        assert_eq!(refusal(e4, Use::CollMove, Some(22703), h200, 2), None);
        assert_eq!(
            refusal(e5, Use::CollMove, Some(22703), a100, 2),
            Some(Refusal::OldGpuForCollectives(8, 0))
        );
        // Reduced: sm_90 or newer.
        assert_eq!(refusal(e4, Use::Reduce, Some(22803), h200, 1), None);
        assert_eq!(
            refusal(e4, Use::Reduce, Some(22803), a100, 2),
            Some(Refusal::OldGpu(8, 0))
        );
        assert_eq!(
            refusal(e5, Use::Scale, Some(22803), || (8, 9), 2),
            Some(Refusal::OldGpu(8, 9))
        );
        assert_eq!(refusal(e5, Use::Reduce, Some(22803), || (10, 0), 2), None);
        // Scaled: not on one rank.
        assert_eq!(
            refusal(e4, Use::Scale, Some(22803), h200, 1),
            Some(Refusal::OneRankScale)
        );
        assert_eq!(refusal(e4, Use::Scale, Some(22803), h200, 2), None);
    }

    #[test]
    fn a_collective_uses_its_type_by_kind_and_reduction() {
        let sum = ncclRedOp_t::ncclSum.0;
        assert_eq!(Use::of(CollKind::AllReduce, 4, sum), Use::Reduce);
        assert_eq!(
            Use::of(CollKind::ReduceScatter, 4, ncclRedOp_t::ncclMax.0),
            Use::Reduce
        );
        assert_eq!(Use::of(CollKind::Reduce, 4, ncclRedOp_t::ncclAvg.0), Use::Scale);
        assert_eq!(Use::of(CollKind::AllReduce, 4, PRE_MUL_SUM), Use::Scale);
        assert_eq!(Use::of(CollKind::AllReduce, 0, PRE_MUL_SUM), Use::Empty);
        for kind in [
            CollKind::Broadcast,
            CollKind::AllGather,
            CollKind::AllToAll,
            CollKind::Gather,
            CollKind::Scatter,
        ] {
            assert_eq!(Use::of(kind, 4, crate::nccl::verify::wire::NONE), Use::CollMove);
            assert_eq!(Use::of(kind, 0, crate::nccl::verify::wire::NONE), Use::Empty);
        }
    }
}
