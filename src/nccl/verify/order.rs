//! The order NCCL runs one group's collectives in: verification publishes and compares a
//! group's collectives in it (see [`crate::nccl::verify::model`] for why).

use crate::nccl::verify::wire::{CollDesc, CollKind};

/// `ncclPrepareTasks`' list of a collective: (function, device reduction, type).
type List = (u8, u32, u32);

/// Where a collective goes: (not sorted by NCCL, its list's first appearance as (bin, call
/// index) counted down, its bin, its call index); see [`nccl_order`].
type Place = (u8, u32, usize, u32, usize);

/// Puts one group's collectives (of one communicator of `world` ranks, in call order) into the
/// order NCCL 2.28 runs them in (v2.28.3-1 to v2.28.9-1, which do not differ here):
/// - `collTaskAppend` (src/enqueue.cc) inserts each into `ncclTaskCollSorter`
///   (src/include/comm.h) by its traffic, `count × element size × ncclFuncTrafficPerByte`
///   (all_reduce 2, all_gather and reduce_scatter `world`, others 1), into one of 81 bins
///   (`u32fpEncode(min(traffic, 1 GiB) >> 10, 2)`: four per power of two above 1 KiB, all
///   below 1 KiB in one), bins largest first, each bin's newest first;
/// - `ncclPrepareTasks` walks that list into one LIFO per (function, device reduction, type),
///   lists in order of first appearance: per list, bins smallest first and call order within
///   a bin.
///
/// As a sort key: a collective's list ranks by its member with the largest (bin, call
/// index), latest first; within a list, (bin, call index) ascending. all_gather and broadcast
/// count in bytes of `ncclInt8`; Max and Min share `ncclDevMinMax`, a floating Avg shares
/// PreMulSum's `ncclDevPreMulSum`. (NCCL then moves each list's aggregates, runs within 4× of
/// each other's traffic, into CollNet and NVLS queues by their algorithm, chosen from the
/// aggregate alone, so the same way on every rank that has the same lists: left out, as equal
/// orders here give equal orders there.) all_to_all, gather and scatter are sends and receives
/// to NCCL ([`crate::nccl::verify::model::expand`]), and count 0 is not queued: they follow,
/// in call order.
pub(crate) fn nccl_order(ops: &mut [CollDesc], world: usize) {
    if ops.len() < 2 || !order_read_for_loaded_nccl() {
        return;
    }
    sort_as_nccl(ops, world);
}

/// Whether the loaded NCCL is one whose order [`nccl_order`] was read from (2.28.3 to 2.28.9).
/// Another may sort differently, and a wrong model of NCCL's order could let two groups that
/// NCCL runs in different orders compare equal: there a group's collectives stay in call order,
/// which is stricter (a group in another call order is refused), never looser.
fn order_read_for_loaded_nccl() -> bool {
    static READ: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READ.get_or_init(|| {
        cfg!(test)
            || matches!(crate::sys::loader::nccl_version_code(), Ok((Some(v), _)) if (22803..=22809).contains(&v))
    })
}

/// [`nccl_order`], whatever NCCL is loaded.
fn sort_as_nccl(ops: &mut [CollDesc], world: usize) {
    // (bin, call index, list) per collective; a collective NCCL does not sort has no list.
    let keyed: smallvec::SmallVec<[(u32, usize, Option<List>); 8]> = ops
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let sorted =
                c.count > 0 && !matches!(c.kind, CollKind::AllToAll | CollKind::Gather | CollKind::Scatter);
            (traffic_bin(c, world), i, sorted.then(|| sort_list(c)))
        })
        .collect();
    let mut order: smallvec::SmallVec<[(Place, CollDesc); 8]> = keyed
        .iter()
        .map(|&(bin, i, list)| {
            let key = match list {
                Some(l) => {
                    // The list's first appearance in the sorter's output: its member with the
                    // largest (bin, index); later first.
                    let (lb, li) = keyed
                        .iter()
                        .filter(|k| k.2 == Some(l))
                        .map(|&(b, j, _)| (b, j))
                        .max()
                        .expect("the collective itself");
                    (0, u32::MAX - lb, usize::MAX - li, bin, i)
                }
                None => (1, 0, 0, 0, i),
            };
            (key, ops[i])
        })
        .collect();
    order.sort_unstable_by_key(|&(k, _)| k);
    for (o, (_, c)) in ops.iter_mut().zip(order) {
        *o = c;
    }
}

/// A collective of one group whose algorithm NCCL may choose by how this rank laid out its
/// registered memory, if any: an all_gather or reduce_scatter with registered memory (bits 2
/// and 3 of [`CollDesc::nccl_memory`]) in a list (function, reduction, type) of two or more of
/// the group. `ncclPrepareTasks` merges a list's neighbours within 4x of each other's traffic
/// and, under the efficiency CTA policy or a tuner plugin, `getAlgoInfo` picks NVLS for a
/// merge only where one registration covers its whole range from the first task's buffer
/// (`ncclRegFind`, src/enqueue.cc at v2.28.3-1): two ranks whose registered buffers are laid
/// out differently then run equal, verified groups with different algorithms. Verification does
/// not compare layouts; [`crate::nccl::group`] refuses such a group where that choice is
/// possible.
pub(crate) fn layout_dependent_merge(ops: &[CollDesc]) -> Option<&CollDesc> {
    const REGISTERED_BITS: u8 = 0b1100;
    let merged =
        |c: &CollDesc| matches!(c.kind, CollKind::AllGather | CollKind::ReduceScatter) && c.count > 0;
    ops.iter().find(|c| {
        merged(c)
            && c.nccl_memory & REGISTERED_BITS != 0
            && ops
                .iter()
                .filter(|d| merged(d) && sort_list(d) == sort_list(c))
                .nth(1)
                .is_some()
    })
}

/// `ncclTaskCollSorterInsert`'s bin before its reversal: `u32fpEncode(min(traffic, 1 GiB) >>
/// 10, 2)` (src/include/bitops.h).
fn traffic_bin(c: &CollDesc, world: usize) -> u32 {
    let per_byte = match c.kind {
        CollKind::AllReduce => 2,
        CollKind::AllGather | CollKind::ReduceScatter => world as u64,
        _ => 1,
    };
    let traffic = c
        .count
        .saturating_mul(element_size(c.dtype))
        .saturating_mul(per_byte)
        .min(1 << 30);
    let x = (traffic >> 10) as u32;
    let log2 = 31 - (x | 1).leading_zeros();
    let (mantissa, exponent) = if log2 >= 2 {
        ((x >> (log2 - 2)) & 3, log2 - 1)
    } else {
        (x & 3, 0)
    };
    exponent << 2 | mantissa
}

/// `ncclTypeSize` of an `ncclDataType_t` code.
fn element_size(dtype: u32) -> u64 {
    match dtype {
        0 | 1 | 10 | 11 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        _ => 8,
    }
}

/// The (function, device reduction, type) list `ncclPrepareTasks` puts a collective in, as
/// one number (`hostToDevRedOp`, src/enqueue.cc).
fn sort_list(c: &CollDesc) -> List {
    use crate::nccl::verify::wire::{NONE, PRE_MUL_SUM};
    // all_gather and broadcast: ncclSum (their ncclInfo's) and ncclInt8 (`collTaskAppend`).
    let (op, dtype) = match c.kind {
        CollKind::AllGather | CollKind::Broadcast => (0, 0),
        _ => {
            let op = match c.redop {
                0 | NONE => 0,
                1 => 1,
                2 | 3 => 2,
                // Avg: ncclDevSumPostDiv for integers, ncclDevPreMulSum for floating types.
                4 if c.dtype <= 5 => 4,
                4 | PRE_MUL_SUM => 3,
                // (No other reduction reaches NCCL from handoff: apart, to be safe.)
                other => other,
            };
            (op, c.dtype)
        }
    };
    (c.kind as u8, op, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gather(count: u64, dtype: u32, registered: bool) -> CollDesc {
        CollDesc {
            kind: CollKind::AllGather,
            dtype,
            redop: crate::nccl::verify::wire::NONE,
            nccl_memory: if registered { 0b0100 } else { 0 },
            ..CollDesc::f32_sum(count)
        }
    }

    #[test]
    fn a_registered_all_gather_beside_another_of_its_list_is_layout_dependent() {
        let f32s = gather(16, 7, false).dtype;
        let (reg, plain) = (gather(16, f32s, true), gather(64, f32s, false));
        assert!(layout_dependent_merge(&[reg, plain]).is_some());
        assert!(layout_dependent_merge(&[plain, reg]).is_some());
        // Alone, unregistered, or beside an all_reduce: nothing for the layout to choose.
        assert!(layout_dependent_merge(&[reg]).is_none());
        assert!(layout_dependent_merge(&[plain, plain]).is_none());
        assert!(layout_dependent_merge(&[reg, CollDesc::f32_sum(16)]).is_none());
        // all_gathers are one list whatever the type (bytes of ncclInt8), and count 0 is not
        // queued.
        assert!(layout_dependent_merge(&[reg, gather(16, 0, false)]).is_some());
        assert!(layout_dependent_merge(&[reg, gather(0, f32s, false)]).is_none());
    }
}
