//! NCCL's collectives — [`Group::all_reduce`], [`Group::broadcast`], [`Group::reduce`],
//! [`Group::all_gather`], [`Group::reduce_scatter`] and their [`Communicator`] forms — through
//! the same tracked, verified path as sends and receives: inputs are reads, outputs writes, an
//! in-place buffer a write. Every rank posts the same collectives in the same order (operation,
//! count, type, root, reduction): verification checks it before NCCL is called, and each
//! collective's size rule is checked locally first.

use crate::cuda::view::{View, ViewMut};
use crate::engine::stream::Stream;
use crate::engine::tracking::Access;
use crate::error::{Error, Result};
use crate::nccl::communicator::{Communicator, usable};
use crate::nccl::group::{CollOp, Group, group};
use crate::nccl::types::NcclType;
use crate::nccl::verify::wire::{CollDesc, CollKind, NONE, PRE_MUL_SUM};

/// How a reduction combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Average (the sum divided by the number of ranks).
    Avg,
}

impl ReduceOp {
    fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Avg => 4,
        }
    }
}

/// The size rule of each collective, checked before anything else; `Ok(count)` is NCCL's count.
/// `root_is_me`: this rank is the collective's root (gather, scatter).
pub(crate) fn count_for(
    kind: CollKind,
    world: usize,
    send: Option<usize>,
    recv: usize,
    root_is_me: bool,
) -> Result<usize> {
    let bad = |rule: String| Err(Error::InvalidArgument(format!("{}: {rule}", kind.name())));
    let times = |n: usize| n.checked_mul(world);
    match (kind, send) {
        (CollKind::AllGather, Some(s)) => {
            if Some(recv) != times(s) {
                return bad(format!(
                    "the output has {recv} elements but must hold every rank's input: {world} × {s}"
                ));
            }
            Ok(s)
        }
        (CollKind::ReduceScatter, Some(s)) => {
            if Some(s) != times(recv) {
                return bad(format!(
                    "the input has {s} elements but must hold one output per rank: {world} × {recv}"
                ));
            }
            Ok(recv)
        }
        (CollKind::AllToAll, Some(s)) => {
            if s != recv || s % world != 0 {
                return bad(format!(
                    "the input ({s}) and the output ({recv}) must have the same length, a multiple of \
                     the {world} ranks"
                ));
            }
            Ok(s / world)
        }
        // The root's output holds every rank's input; elsewhere the output is unused, and may be
        // empty.
        (CollKind::Gather, Some(s)) => {
            if Some(recv) != times(s) && (root_is_me || recv != 0) {
                return bad(format!(
                    "the output has {recv} elements but must hold every rank's input: {world} × {s}{}",
                    if root_is_me {
                        ""
                    } else {
                        " (or none, off the root)"
                    }
                ));
            }
            Ok(s)
        }
        (CollKind::Scatter, Some(s)) => {
            if Some(s) != times(recv) && (root_is_me || s != 0) {
                return bad(format!(
                    "the input has {s} elements but must hold one output per rank: {world} × {recv}{}",
                    if root_is_me {
                        ""
                    } else {
                        " (or none, off the root)"
                    }
                ));
            }
            Ok(recv)
        }
        (_, Some(s)) if s != recv => bad(format!("the input has {s} elements but the output {recv}")),
        _ => Ok(recv),
    }
}

impl<'a> Group<'a> {
    #[allow(clippy::too_many_arguments)]
    fn collective<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        kind: CollKind,
        send: Option<View<'a, T>>,
        mut recv: ViewMut<'a, T>,
        op: Option<ReduceOp>,
        root: Option<usize>,
        stream: &'a Stream,
    ) -> Result<()> {
        usable(&comm.shared.lock())?;
        if let Some(r) = root
            && r >= comm.world_size()
        {
            return Err(Error::InvalidArgument(format!(
                "{}: root {r} is out of range for a communicator of {} ranks",
                kind.name(),
                comm.world_size()
            )));
        }
        let root_is_me = root == Some(comm.rank());
        let count = count_for(
            kind,
            comm.world_size(),
            send.map(|s| s.len()),
            recv.len(),
            root_is_me,
        )?;
        stream.check_device(comm.device(), "the communicator")?;
        if let Some(s) = &send {
            stream.check_tracked(s.tracked(), Access::Read)?;
        }
        stream.check_tracked(recv.tracked(), Access::Write)?;
        // In place, the input is the output's memory. Flags as a send's or receive's with a peer
        // (`memory_flags`): bits 0 and 2 of the input, 1 and 3 of the output; a one-rank
        // collective has no peer (NCCL copies locally), so none.
        let input = send.as_ref().map_or(recv.tracked(), |s| s.tracked());
        let peer = (comm.rank() + 1) % comm.world_size();
        let flags = |t| crate::nccl::group::memory_flags(comm, t, peer);
        let (i, o) = (flags(input), flags(recv.tracked()));
        let nccl_memory = (i & 1) | ((o & 1) << 1) | (((i >> 1) & 1) << 2) | (((o >> 1) & 1) << 3);
        self.push_coll(CollOp {
            comm,
            stream,
            desc: CollDesc {
                kind,
                count: count as u64,
                dtype: T::DATATYPE.0,
                redop: op.map_or(NONE, ReduceOp::code),
                root: root.map_or(NONE, |r| r as u32),
                captured: comm.in_graph,
                nccl_memory,
            },
            dtype: T::DATATYPE,
            send: send.map(|s| (s.tracked(), s.as_raw_ptr().cast())),
            recv: (recv.tracked(), recv.as_raw_mut_ptr().cast()),
            scalar: None,
        });
        Ok(())
    }

    /// The collective just added, turned into a PreMulSum with this rank's `scalar`.
    fn pre_mul_sum<T: NcclType>(&mut self, scalar: T) {
        let bytes = bytemuck::bytes_of(&scalar);
        let mut held = [0u8; 8];
        // Every NCCL type is at most 8 bytes.
        held[..bytes.len()].copy_from_slice(bytes);
        let op = self.colls.last_mut().expect("just added");
        op.desc.redop = PRE_MUL_SUM;
        op.scalar = Some(held);
    }

    /// Adds an all-reduce whose reduction is NCCL's PreMulSum: every rank's `recv` gets the sum
    /// over the ranks of `scalar × send`, each rank with its own `scalar` (the ranks agree on
    /// the reduction, not the scalars).
    ///
    /// # Errors
    /// As [`Group::all_reduce`], and NCCL's error making the operator.
    pub fn all_reduce_pre_mul_sum<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        scalar: T,
        stream: &'a Stream,
    ) -> Result<()> {
        self.all_reduce(comm, send, recv, ReduceOp::Sum, stream)?;
        self.pre_mul_sum(scalar);
        Ok(())
    }

    /// Adds a reduce-scatter whose reduction is PreMulSum (see
    /// [`Group::all_reduce_pre_mul_sum`]).
    ///
    /// # Errors
    /// As [`Group::reduce_scatter`], and NCCL's error making the operator.
    pub fn reduce_scatter_pre_mul_sum<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        scalar: T,
        stream: &'a Stream,
    ) -> Result<()> {
        self.reduce_scatter(comm, send, recv, ReduceOp::Sum, stream)?;
        self.pre_mul_sum(scalar);
        Ok(())
    }

    /// Adds an all-reduce: every rank's `recv` gets the element-wise `op` of every rank's
    /// `send` (same length on every rank).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for lengths that differ or another device;
    /// [`Error::CommunicatorUnusable`].
    pub fn all_reduce<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::AllReduce,
            Some(send.into()),
            recv.into(),
            Some(op),
            None,
            stream,
        )
    }

    /// Adds an all-reduce in place: `buf` is the input and then the result.
    ///
    /// # Errors
    /// As [`Group::all_reduce`].
    pub fn all_reduce_in_place<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: impl Into<ViewMut<'a, T>>,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::AllReduce,
            None,
            buf.into(),
            Some(op),
            None,
            stream,
        )
    }

    /// Adds a broadcast in place: `root`'s `buf` is copied into every other rank's `buf`.
    ///
    /// # Errors
    /// As [`Group::all_reduce`], and for a root out of range.
    pub fn broadcast<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        buf: impl Into<ViewMut<'a, T>>,
        root: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::Broadcast,
            None,
            buf.into(),
            None,
            Some(root),
            stream,
        )
    }

    /// Adds a reduce: `root`'s `recv` gets the element-wise `op` of every rank's `send`. Every
    /// rank passes a `recv` of the same length (tracked as written; NCCL writes only the
    /// root's).
    ///
    /// # Errors
    /// As [`Group::broadcast`].
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        op: ReduceOp,
        root: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::Reduce,
            Some(send.into()),
            recv.into(),
            Some(op),
            Some(root),
            stream,
        )
    }

    /// Adds an all-gather: every rank's `recv` (world × the input's length) gets every rank's
    /// `send`, in rank order.
    ///
    /// # Errors
    /// As [`Group::all_reduce`], and for an output that is not world × the input.
    pub fn all_gather<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::AllGather,
            Some(send.into()),
            recv.into(),
            None,
            None,
            stream,
        )
    }

    /// Adds a reduce-scatter: the element-wise `op` of every rank's `send` (world × the output's
    /// length), block `r` of it into rank `r`'s `recv`.
    ///
    /// # Errors
    /// As [`Group::all_reduce`], and for an input that is not world × the output.
    pub fn reduce_scatter<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        op: ReduceOp,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::ReduceScatter,
            Some(send.into()),
            recv.into(),
            Some(op),
            None,
            stream,
        )
    }
}

impl<'a> Group<'a> {
    /// Adds an all-to-all: block `j` of every rank's `send` (`world` equal blocks) goes to
    /// block `i` of rank `j`'s `recv`, `i` being the sender.
    ///
    /// # Errors
    /// As [`Group::all_reduce`], and for lengths that are not one multiple of the world.
    pub fn all_to_all<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::AllToAll,
            Some(send.into()),
            recv.into(),
            None,
            None,
            stream,
        )
    }

    /// Adds a gather: every rank's `send` into block `i` (the sender's rank) of `root`'s `recv`
    /// (world × the input's length). Other ranks' `recv` is unused and may be empty.
    ///
    /// # Errors
    /// As [`Group::broadcast`], and for a root's output that is not world × the input.
    pub fn gather<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        root: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::Gather,
            Some(send.into()),
            recv.into(),
            None,
            Some(root),
            stream,
        )
    }

    /// Adds a scatter: block `i` of `root`'s `send` (world × the output's length) into rank
    /// `i`'s `recv`. Other ranks' `send` is unused and may be empty.
    ///
    /// # Errors
    /// As [`Group::broadcast`], and for a root's input that is not world × the output.
    pub fn scatter<T: NcclType>(
        &mut self,
        comm: &'a Communicator,
        send: impl Into<View<'a, T>>,
        recv: impl Into<ViewMut<'a, T>>,
        root: usize,
        stream: &'a Stream,
    ) -> Result<()> {
        self.collective(
            comm,
            CollKind::Scatter,
            Some(send.into()),
            recv.into(),
            None,
            Some(root),
            stream,
        )
    }
}

impl Communicator {
    /// An all-to-all; see [`Group::all_to_all`].
    ///
    /// # Errors
    /// As [`Group::all_to_all`]; as [`Communicator::send`] for verification and NCCL.
    pub fn all_to_all<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.all_to_all(self, send, recv, stream))
    }

    /// A gather; see [`Group::gather`].
    ///
    /// # Errors
    /// As [`Group::gather`]; as [`Communicator::send`] for verification and NCCL.
    pub fn gather<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.gather(self, send, recv, root, stream))
    }

    /// A scatter; see [`Group::scatter`].
    ///
    /// # Errors
    /// As [`Group::scatter`]; as [`Communicator::send`] for verification and NCCL.
    pub fn scatter<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.scatter(self, send, recv, root, stream))
    }
}

impl Communicator {
    /// An all-reduce on its own; see [`Group::all_reduce`]. Ranks of one `init_all` post their
    /// collectives together in a [`group`].
    ///
    /// # Errors
    /// As [`Group::all_reduce`]; as [`Communicator::send`] for verification and NCCL.
    pub fn all_reduce<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.all_reduce(self, send, recv, op, stream))
    }

    /// An all-reduce in place; see [`Group::all_reduce_in_place`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub fn all_reduce_in_place<'b, T: NcclType>(
        &self,
        buf: impl Into<ViewMut<'b, T>>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let buf = buf.into();
        group(|g| g.all_reduce_in_place(self, buf, op, stream))
    }

    /// A broadcast in place; see [`Group::broadcast`].
    ///
    /// # Errors
    /// As [`Group::broadcast`]; as [`Communicator::send`] for verification and NCCL.
    pub fn broadcast<'b, T: NcclType>(
        &self,
        buf: impl Into<ViewMut<'b, T>>,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let buf = buf.into();
        group(|g| g.broadcast(self, buf, root, stream))
    }

    /// A reduce; see [`Group::reduce`].
    ///
    /// # Errors
    /// As [`Group::reduce`]; as [`Communicator::send`] for verification and NCCL.
    pub fn reduce<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        op: ReduceOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.reduce(self, send, recv, op, root, stream))
    }

    /// An all-gather; see [`Group::all_gather`].
    ///
    /// # Errors
    /// As [`Group::all_gather`]; as [`Communicator::send`] for verification and NCCL.
    pub fn all_gather<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.all_gather(self, send, recv, stream))
    }

    /// An all-reduce with PreMulSum; see [`Group::all_reduce_pre_mul_sum`].
    ///
    /// # Errors
    /// As [`Group::all_reduce_pre_mul_sum`]; as [`Communicator::send`] for verification and NCCL.
    pub fn all_reduce_pre_mul_sum<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        scalar: T,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.all_reduce_pre_mul_sum(self, send, recv, scalar, stream))
    }

    /// A reduce-scatter with PreMulSum; see [`Group::reduce_scatter_pre_mul_sum`].
    ///
    /// # Errors
    /// As [`Group::reduce_scatter_pre_mul_sum`]; as [`Communicator::send`] for verification and
    /// NCCL.
    pub fn reduce_scatter_pre_mul_sum<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        scalar: T,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.reduce_scatter_pre_mul_sum(self, send, recv, scalar, stream))
    }

    /// A reduce-scatter; see [`Group::reduce_scatter`].
    ///
    /// # Errors
    /// As [`Group::reduce_scatter`]; as [`Communicator::send`] for verification and NCCL.
    pub fn reduce_scatter<'b, T: NcclType>(
        &self,
        send: impl Into<View<'b, T>>,
        recv: impl Into<ViewMut<'b, T>>,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let (send, recv) = (send.into(), recv.into());
        group(|g| g.reduce_scatter(self, send, recv, op, stream))
    }
}

impl Communicator {
    /// A barrier of every rank, queued on `stream`: a one-element all-reduce (sum of a `u8`)
    /// of a buffer made for it, verified like any collective (every rank posts its barrier at
    /// the same place in its order of collectives). Returns once it is queued, not done.
    ///
    /// What it orders, on the GPU: the all-reduce on a rank starts after the work queued
    /// before it on that rank's `stream`, and cannot complete before every rank's all-reduce
    /// has started (its result is every rank's contribution). So the work each rank queued on
    /// its barrier stream before its barrier completes before the work any rank queues on its
    /// barrier stream after its barrier starts. Nothing more: work on other streams is ordered
    /// only as far as those streams are joined to the barrier stream ([`Stream::record`] an
    /// event on one, [`Stream::wait`] for it on the other), and no host is held;
    /// [`Communicator::barrier_wait`] holds this rank's.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`]; [`Error::Capture`] while `stream` is being captured
    /// into a graph (the buffer cannot be allocated in a capture); CUDA errors allocating it.
    pub fn barrier(&self, stream: &Stream) -> Result<()> {
        // Allocated and freed in stream order: the free waits for the all-reduce (tracking).
        let mut token = crate::cuda::buffer::DeviceBuffer::<u8>::zeros(1, stream)?;
        self.all_reduce_in_place(&mut token, ReduceOp::Sum, stream)
    }

    /// [`Communicator::barrier`], then blocks the host until the work queued on `stream` so
    /// far has completed, as [`Communicator::wait_stream`] (bounded by the timeout). When it
    /// returns, every rank has completed the work it queued on its barrier stream before its
    /// barrier, and this rank's barrier is done; other ranks' hosts may not have returned yet.
    ///
    /// # Errors
    /// As [`Communicator::barrier`] and [`Communicator::wait_stream`].
    pub fn barrier_wait(&self, stream: &Stream) -> Result<()> {
        self.barrier(stream)?;
        self.wait_stream(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_rules_are_checked_before_nccl() {
        assert_eq!(count_for(CollKind::AllReduce, 2, Some(7), 7, false).unwrap(), 7);
        assert_eq!(count_for(CollKind::AllReduce, 2, None, 7, false).unwrap(), 7);
        assert_eq!(count_for(CollKind::AllGather, 3, Some(5), 15, false).unwrap(), 5);
        assert_eq!(
            count_for(CollKind::ReduceScatter, 3, Some(15), 5, false).unwrap(),
            5
        );
        assert_eq!(count_for(CollKind::Broadcast, 4, None, 9, true).unwrap(), 9);
        for (kind, send, recv, want) in [
            (
                CollKind::AllReduce,
                Some(7),
                6,
                "input has 7 elements but the output 6",
            ),
            (
                CollKind::Reduce,
                Some(1),
                2,
                "input has 1 elements but the output 2",
            ),
            (CollKind::AllGather, Some(5), 14, "3 × 5"),
            (CollKind::ReduceScatter, Some(14), 5, "3 × 5"),
            (CollKind::AllGather, Some(usize::MAX), 3, "3 ×"),
            (CollKind::AllToAll, Some(9), 6, "same length"),
            (CollKind::AllToAll, Some(8), 8, "multiple of the 3 ranks"),
            (CollKind::Gather, Some(4), 0, "3 × 4"),
            (CollKind::Scatter, Some(0), 4, "3 × 4"),
        ] {
            let e = count_for(kind, 3, send, recv, true).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains(want)),
                "{kind:?}: {e}"
            );
        }
    }

    #[test]
    fn gather_and_scatter_need_the_whole_buffer_only_on_the_root() {
        assert_eq!(count_for(CollKind::AllToAll, 3, Some(9), 9, false).unwrap(), 3);
        assert_eq!(count_for(CollKind::Gather, 3, Some(4), 12, true).unwrap(), 4);
        assert_eq!(count_for(CollKind::Gather, 3, Some(4), 0, false).unwrap(), 4);
        assert_eq!(count_for(CollKind::Scatter, 3, Some(12), 4, true).unwrap(), 4);
        assert_eq!(count_for(CollKind::Scatter, 3, Some(0), 4, false).unwrap(), 4);
        let e = count_for(CollKind::Gather, 3, Some(4), 5, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("or none, off the root"), "{e}");
    }

    #[test]
    fn reduction_codes_are_ncclredop() {
        use crate::sys::nccl::ncclRedOp_t as R;
        for (op, code) in [
            (ReduceOp::Sum, R::ncclSum),
            (ReduceOp::Prod, R::ncclProd),
            (ReduceOp::Max, R::ncclMax),
            (ReduceOp::Min, R::ncclMin),
            (ReduceOp::Avg, R::ncclAvg),
        ] {
            assert_eq!(op.code(), code.0);
        }
    }
}
