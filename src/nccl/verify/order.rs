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
