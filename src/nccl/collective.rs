//! NCCL's collectives — [`Group::all_reduce`], [`Group::broadcast`], [`Group::reduce`],
//! [`Group::all_gather`], [`Group::reduce_scatter`] and their [`Communicator`] forms — through
//! the same tracked, verified path as sends and receives: inputs are reads, outputs writes, an
//! in-place buffer a write. Every rank posts the same collectives in the same order (operation,
//! count, type, root, reduction): verification checks it before NCCL is called, and each
//! collective's size rule is checked locally first.

use crate::error::{Error, Result};
use crate::nccl::communicator::{Communicator, usable};
use crate::nccl::group::{CollOp, Group, group};
use crate::nccl::types::NcclType;
use crate::nccl::verify::wire::{CollDesc, CollKind, NONE};
use crate::stream::Stream;
use crate::tracking::Access;
use crate::view::{View, ViewMut};

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
pub(crate) fn count_for(kind: CollKind, world: usize, send: Option<usize>, recv: usize) -> Result<usize> {
    let bad = |rule: String| Err(Error::InvalidArgument(format!("{}: {rule}", kind_name(kind))));
    match (kind, send) {
        (CollKind::AllGather, Some(s)) => {
            if Some(recv) != s.checked_mul(world) {
                return bad(format!(
                    "the output has {recv} elements but must hold every rank's input: {world} × {s}"
                ));
            }
            Ok(s)
        }
        (CollKind::ReduceScatter, Some(s)) => {
            if Some(s) != recv.checked_mul(world) {
                return bad(format!(
                    "the input has {s} elements but must hold one output per rank: {world} × {recv}"
                ));
            }
            Ok(recv)
        }
        (_, Some(s)) if s != recv => bad(format!("the input has {s} elements but the output {recv}")),
        _ => Ok(recv),
    }
}

fn kind_name(kind: CollKind) -> &'static str {
    match kind {
        CollKind::AllReduce => "all_reduce",
        CollKind::Broadcast => "broadcast",
        CollKind::Reduce => "reduce",
        CollKind::AllGather => "all_gather",
        CollKind::ReduceScatter => "reduce_scatter",
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
        let count = count_for(kind, comm.world_size(), send.map(|s| s.len()), recv.len())?;
        if let Some(r) = root
            && r >= comm.world_size()
        {
            return Err(Error::InvalidArgument(format!(
                "{}: root {r} is out of range for a communicator of {} ranks",
                kind_name(kind),
                comm.world_size()
            )));
        }
        stream.check_device(comm.device(), "the communicator")?;
        if let Some(s) = &send {
            stream.check_tracked(s.tracked(), Access::Read)?;
        }
        stream.check_tracked(recv.tracked(), Access::Write)?;
        self.colls.push(CollOp {
            comm,
            stream,
            desc: CollDesc {
                kind,
                count: count as u64,
                dtype: T::DATATYPE.0,
                redop: op.map_or(NONE, ReduceOp::code),
                root: root.map_or(NONE, |r| r as u32),
            },
            dtype: T::DATATYPE,
            send: send.map(|s| (s.tracked(), s.as_raw_ptr().cast())),
            recv: (recv.tracked(), recv.as_raw_mut_ptr().cast()),
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_rules_are_checked_before_nccl() {
        assert_eq!(count_for(CollKind::AllReduce, 2, Some(7), 7).unwrap(), 7);
        assert_eq!(count_for(CollKind::AllReduce, 2, None, 7).unwrap(), 7);
        assert_eq!(count_for(CollKind::AllGather, 3, Some(5), 15).unwrap(), 5);
        assert_eq!(count_for(CollKind::ReduceScatter, 3, Some(15), 5).unwrap(), 5);
        assert_eq!(count_for(CollKind::Broadcast, 4, None, 9).unwrap(), 9);
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
        ] {
            let e = count_for(kind, 3, send, recv).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains(want)),
                "{kind:?}: {e}"
            );
        }
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
