//! fp8 element types (feature `float8`) on GPUs: every byte pattern of both types through a
//! self send/receive, one-rank all-reduces (NCCL copies) and an all-gather, compared bit for
//! bit; the one-rank Avg that handoff refuses, with NCCL's own answer to it called raw (the
//! refusal's premise: NCCL 2.28 has no one-rank fp8 scaling kernel); and, on two GPUs, fp8
//! sums and averages with values checked.

mod common;

use common::Gpus;
use float8::{F8E4M3, F8E5M2};
use handoff::{CommOptions, DeviceBuffer, Error, NcclType, ReduceOp, Stream, group};
use libtest_mimic::Failed;

/// Elements per buffer: every byte pattern, then some, not a power of two.
const N: usize = 3001;

/// The element types, as the bit patterns of each.
trait Fp8: NcclType {
    fn from_bits(b: u8) -> Self;
    fn bits(self) -> u8;
}

macro_rules! fp8 {
    ($t:ty) => {
        impl Fp8 for $t {
            fn from_bits(b: u8) -> Self {
                <$t>::from_bits(b)
            }
            fn bits(self) -> u8 {
                self.to_bits()
            }
        }
    };
}
fp8!(F8E4M3);
fp8!(F8E5M2);

fn patterns<T: Fp8>() -> Vec<T> {
    (0..N).map(|i| T::from_bits((i * 7 % 256) as u8)).collect()
}

fn bits<T: Fp8>(v: &[T]) -> Vec<u8> {
    v.iter().map(|x| x.bits()).collect()
}

fn main() {
    let g = Gpus::detect();
    common::run(vec![
        g.trial("fp8_self_send_recv_moves_every_byte_pattern", 1, || {
            self_send_recv::<F8E4M3>()?;
            self_send_recv::<F8E5M2>()
        }),
        g.trial(
            "fp8_one_rank_all_reduce_and_all_gather_copy_bit_for_bit",
            1,
            || {
                one_rank_collectives::<F8E4M3>()?;
                one_rank_collectives::<F8E5M2>()
            },
        ),
        g.trial(
            "fp8_one_rank_avg_is_refused_as_nccl_itself_refuses_it",
            1,
            one_rank_avg,
        ),
        g.ranks_trial("fp8_two_rank_sum_and_avg_values", two_ranks),
    ]);
}

fn self_send_recv<T: Fp8>() -> Result<(), Failed> {
    let (dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(&dev)?;
    let want = patterns::<T>();
    let a = DeviceBuffer::from_slice(&want, &s)?;
    let mut b = DeviceBuffer::<T>::zeros(N, &s)?;
    group(|g| {
        g.send(&comm, &a, 0, &s)?;
        g.recv(&comm, &mut b, 0, &s)
    })?;
    let got = b.to_vec(&s)?;
    if bits(&got) != bits(&want) {
        return Err(format!("{}: a self send/recv changed the bytes", T::NAME).into());
    }
    Ok(())
}

fn one_rank_collectives<T: Fp8>() -> Result<(), Failed> {
    let (dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(&dev)?;
    let want = patterns::<T>();
    let a = DeviceBuffer::from_slice(&want, &s)?;
    for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min] {
        let mut out = DeviceBuffer::<T>::zeros(N, &s)?;
        comm.all_reduce(&a, &mut out, op, &s)?;
        if bits(&out.to_vec(&s)?) != bits(&want) {
            return Err(format!("{}: a one-rank all-reduce ({op:?}) is not a copy", T::NAME).into());
        }
    }
    let mut inplace = DeviceBuffer::from_slice(&want, &s)?;
    comm.all_reduce_in_place(&mut inplace, ReduceOp::Sum, &s)?;
    let mut gathered = DeviceBuffer::<T>::zeros(N, &s)?;
    comm.all_gather(&a, &mut gathered, &s)?;
    if bits(&inplace.to_vec(&s)?) != bits(&want) || bits(&gathered.to_vec(&s)?) != bits(&want) {
        return Err(format!(
            "{}: an in-place all-reduce or an all-gather changed the bytes",
            T::NAME
        )
        .into());
    }
    Ok(())
}

fn one_rank_avg() -> Result<(), Failed> {
    let (dev, comm) = common::one_rank(CommOptions::default())?;
    let s = Stream::new(&dev)?;
    let a = DeviceBuffer::from_slice(&[F8E4M3::from_f32(2.0); 64], &s)?;
    let mut out = DeviceBuffer::<F8E4M3>::zeros(64, &s)?;
    match comm.all_reduce(&a, &mut out, ReduceOp::Avg, &s) {
        Err(Error::InvalidArgument(m)) if m.contains("one-rank") => println!("refused: {m}"),
        other => return Err(format!("a one-rank fp8 Avg gave {other:?}, want the refusal").into()),
    }
    // NCCL's answer, raw, on another one-rank communicator (an error there is not handoff's).
    let (_dev, raw) = common::one_rank(CommOptions::default())?;
    s.synchronize()?;
    // SAFETY: both buffers hold 64 elements of one byte on this device, neither used by
    // anything else until the stream is synchronized below; the communicator is live and used
    // by this thread only; one rank.
    let rc = unsafe {
        handoff::result::nccl::all_reduce(
            a.as_raw_ptr().cast(),
            out.as_raw_mut_ptr().cast(),
            64,
            handoff::sys::nccl::ncclDataType_t::ncclFloat8e4m3,
            handoff::sys::nccl::ncclRedOp_t::ncclAvg,
            raw.as_raw(),
            s.as_raw(),
        )
    }?;
    s.synchronize()?;
    println!("NCCL's own one-rank fp8 Avg: ncclResult {}", rc.0);
    if rc != handoff::sys::nccl::ncclResult_t::ncclInvalidArgument {
        return Err(format!(
            "NCCL answered {} to a one-rank fp8 Avg, not ncclInvalidArgument: the refusal in \
             src/nccl/types.rs is no longer needed on this NCCL",
            rc.0
        )
        .into());
    }
    Ok(())
}

fn two_ranks() -> Result<(), Failed> {
    let results = common::two_ranks([CommOptions::default(); 2], |made| {
        let comm = made.map_err(|e| e.to_string())?;
        let rank = comm.rank();
        let e = |e: Error| format!("rank {rank}: {e}");
        let s = Stream::new(comm.device()).map_err(e)?;
        // Small integers, exact in both types: rank 0 has i % 8, rank 1 has 2 (or 4 for Avg).
        let mine: Vec<F8E4M3> = (0..N)
            .map(|i| F8E4M3::from_f32(if rank == 0 { (i % 8) as f32 } else { 2.0 }))
            .collect();
        let a = DeviceBuffer::from_slice(&mine, &s).map_err(e)?;
        let mut sum = DeviceBuffer::<F8E4M3>::zeros(N, &s).map_err(e)?;
        comm.all_reduce(&a, &mut sum, ReduceOp::Sum, &s).map_err(e)?;
        let halves: Vec<F8E5M2> = (0..N)
            .map(|_| F8E5M2::from_f32(2.0 * (rank + 1) as f32))
            .collect();
        let h = DeviceBuffer::from_slice(&halves, &s).map_err(e)?;
        let mut avg = DeviceBuffer::<F8E5M2>::zeros(N, &s).map_err(e)?;
        comm.all_reduce(&h, &mut avg, ReduceOp::Avg, &s).map_err(e)?;
        let mut gathered = DeviceBuffer::<F8E4M3>::zeros(2 * N, &s).map_err(e)?;
        comm.all_gather(&a, &mut gathered, &s).map_err(e)?;
        // As f32 (exact for these values): the results travel from the rank processes as JSON.
        let f32s = |v: Vec<F8E4M3>| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        Ok((
            f32s(sum.to_vec(&s).map_err(e)?),
            avg.to_vec(&s)
                .map_err(e)?
                .iter()
                .map(|x| x.to_f32())
                .collect::<Vec<f32>>(),
            f32s(gathered.to_vec(&s).map_err(e)?),
        ))
    })?;
    for (rank, (sum, avg, gathered)) in common::both_ok(results)?.into_iter().enumerate() {
        for (i, x) in sum.iter().enumerate() {
            if *x != (i % 8) as f32 + 2.0 {
                return Err(format!("rank {rank}: sum[{i}] = {x}, want {}", (i % 8) + 2).into());
            }
        }
        if let Some((i, x)) = avg.iter().enumerate().find(|(_, x)| **x != 3.0) {
            return Err(format!("rank {rank}: avg[{i}] = {x}, want 3 (the mean of 2 and 4)").into());
        }
        let want: Vec<f32> = (0..N)
            .map(|i| (i % 8) as f32)
            .chain((0..N).map(|_| 2.0))
            .collect();
        if gathered != want {
            return Err(format!("rank {rank}: the all-gather is not rank 0's then rank 1's").into());
        }
    }
    Ok(())
}
