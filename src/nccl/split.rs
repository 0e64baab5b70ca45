//! Splitting a communicator into sub-communicators (`ncclCommSplit`): [`Communicator::split`]
//! for ranks on their own threads or processes, [`Communicator::split_all`] for the ranks one
//! thread made together with [`Communicator::init_all`]. Each parent stays locked until its
//! split has finished (no watchdog aborts it mid-split), and NCCL's "no color" is never passed.

use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::nccl::communicator::{Communicator, form_clique, usable};
use crate::nccl::options::CommOptions;
use crate::nccl::options::{FIRST_SPLIT_SHARE, SPLIT_SHARE};
use crate::nccl::state::Cut;
use crate::nccl::watchdog;
use crate::result::nccl as nc;
use crate::sys::nccl::ncclComm_t;
use crate::trace;

/// Colors from here up are handoff's: a rank left out splits into a color of its own,
/// `LEFT_OUT + rank`, and its one-rank child is aborted at once. NCCL's own "no color"
/// (`NCCL_SPLIT_NOCOLOR`) is never passed: on 2.28, a rank without a color whose split fails
/// (a peer died, a timeout) makes NCCL write through a null communicator and crash.
const LEFT_OUT: u32 = 1 << 30;

/// NCCL's color for `color` on parent rank `rank`.
fn nccl_color(color: Option<u32>, rank: usize) -> Result<i32> {
    let c = match color {
        Some(c) if c < LEFT_OUT => c,
        Some(c) => {
            return Err(Error::InvalidArgument(format!(
                "split color {c} is too large: colors go up to {} (those above are handoff's, for \
                 ranks left out)",
                LEFT_OUT - 1
            )));
        }
        None => u32::try_from(rank)
            .ok()
            .and_then(|r| LEFT_OUT.checked_add(r))
            .filter(|&c| c <= i32::MAX as u32)
            .ok_or_else(|| Error::InvalidArgument(format!("rank {rank} is too large to split")))?,
    };
    Ok(c as i32)
}

/// Which ranks of `splits` land together: for each, the index of the first rank with its color
/// (`None` for a rank left out). Ranks of one group form one child communicator.
pub(crate) fn color_groups(splits: &[(Option<u32>, i32)]) -> Vec<Option<usize>> {
    splits
        .iter()
        .map(|(c, _)| c.map(|c| splits.iter().position(|(d, _)| *d == Some(c)).expect("itself")))
        .collect()
}

impl Communicator {
    /// Splits this communicator (`ncclCommSplit`): the ranks that pass the same `color` form a
    /// new communicator, ranked by `key` (ties by their rank here); a rank that passes `None`
    /// is left out and gets `Ok(None)`. Every rank of this communicator calls it, each on its
    /// own thread or process; for ranks made together by [`Communicator::init_all`], use
    /// [`Communicator::split_all`].
    ///
    /// The new communicator has this one's options and current timeout (verified when this
    /// one is, checked again among its own ranks) and its own tracking, verification and
    /// watchdog; it does not depend on this one, which may be dropped first. Like creating a
    /// communicator, a blocking split waits as long as NCCL does for the other ranks to call
    /// it; a non-blocking one ([`CommOptions::with_blocking`]) fails with [`Error::Timeout`]
    /// after the timeout.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a color of 2^30 or more (those are handoff's), or for a
    /// rank made by [`Communicator::init_all`] (splitting it alone would wait for the other
    /// ranks forever); [`Error::Capture`] for a communicator a graph owns;
    /// [`Error::CommunicatorUnusable`] once this communicator is broken; NCCL errors;
    /// [`Error::Timeout`]; [`Error::Setup`] when the new communicator's ranks cannot set up
    /// verification (as for [`Communicator::new`]); [`Error::InvalidArgument`] when
    /// `NCCL_COMM_SPLIT_SHARE_RESOURCES` is set (a child would share its parent's abort). When
    /// NCCL's split fails or times out, this communicator is aborted too: the split may have
    /// been half done (NCCL 2.28 then keeps some of the half-made child's memory: its abort
    /// frees only communicators that finished initializing).
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>> {
        self.check_not_in_graph()?;
        if self.clique.is_some() {
            return Err(Error::InvalidArgument(format!(
                "rank {} was made by Communicator::init_all with the other ranks of this \
                 process: split them together with Communicator::split_all",
                self.rank()
            )));
        }
        let left_out = color.is_none();
        let color = nccl_color(color, self.rank())?;
        refuse_shared_resources()?;
        let started = Instant::now();
        let options = self.child_options();
        let mut config = options.config();
        // NCCL writes the child's handle here when the split's job runs, possibly after
        // `comm_split` returns: it lives until the split has finished or the parent is aborted.
        let mut child: ncclComm_t = std::ptr::null_mut();
        {
            let mut state = self.shared.lock();
            let parent = usable(&state)?;
            // SAFETY: `parent` is live and used under its lock (no concurrent NCCL call or
            // abort); `child` outlives the split (read only after it finished, below, or after
            // the parent's abort, which ends it); the config comes from `config_initializer`
            // with only `blocking` changed; every rank calls `split` (its contract), this one
            // outside any group: no raw group is open on this thread (`group_start` is unsafe
            // and requires that).
            let done =
                unsafe { nc::comm_split(parent, color, key, &mut child, &mut config) }.and_then(|_| {
                    // Non-blocking, NCCL 2.28 answers success while the split's job still runs:
                    // the parent, in progress until the job has stored the child, is polled always.
                    // SAFETY: `parent` is live and locked.
                    unsafe { nc::wait_ready(parent, "ncclCommSplit", started, options.timeout()) }
                });
            if let Err(e) = done {
                // The split may still be running: aborting the parent ends it (NCCL joins the
                // job) before `child` is read; a split half done leaves the parent unusable.
                state.break_with(e.to_string(), self.shared.ordinal, Cut::Incomplete);
                abort_child(child);
                return Err(e);
            }
        }
        if left_out {
            // A left-out rank's own one-rank communicator is not wanted.
            abort_child(child);
            trace::event!(
                info,
                rank = self.rank(),
                "handoff: communicator split: this rank left out"
            );
            return Ok(None);
        }
        if child.is_null() {
            return Err(Error::Setup {
                detail: "ncclCommSplit made no communicator for this rank's color".into(),
            });
        }
        let mut comm = self.adopt(child, options, started)?;
        let r = comm.settle_verification();
        comm.fail_on(r)?;
        trace::event!(
            info,
            rank = self.rank(),
            color,
            key,
            child_rank = comm.rank(),
            child_world = comm.world_size(),
            elapsed = ?started.elapsed(),
            "handoff: communicator split"
        );
        Ok(Some(comm))
    }

    /// [`Communicator::split`] for the ranks one thread made together with
    /// [`Communicator::init_all`]: `comms` are all of them (in any order) and `splits[i]` is
    /// the color and key of `comms[i]`. Returns, for each, its new communicator or `None`. The
    /// new communicators of one color are made together, as by `init_all`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `comms` are all the ranks of one `init_all` and
    /// `splits` has one entry for each; otherwise as [`Communicator::split`]. After a failed
    /// split NCCL may have half done, the parents are aborted.
    pub fn split_all(
        comms: &[Communicator],
        splits: &[(Option<u32>, i32)],
    ) -> Result<Vec<Option<Communicator>>> {
        for c in comms {
            c.check_not_in_graph()?;
        }
        let whole = comms
            .first()
            .and_then(|c| c.clique.as_ref())
            .is_some_and(|clique| {
                comms.len() == comms[0].world_size()
                    && comms
                        .iter()
                        .all(|c| c.clique.as_ref().is_some_and(|k| Arc::ptr_eq(k, clique)))
                    && (0..comms.len()).all(|r| comms.iter().filter(|c| c.rank() == r).count() == 1)
            });
        if !whole || splits.len() != comms.len() {
            return Err(Error::InvalidArgument(format!(
                "split_all takes every rank made by one Communicator::init_all and one (color, key) \
                 for each ({} communicators and {} splits given)",
                comms.len(),
                splits.len()
            )));
        }
        let colors = comms
            .iter()
            .zip(splits)
            .map(|(c, (color, _))| nccl_color(*color, c.rank()))
            .collect::<Result<Vec<i32>>>()?;
        refuse_shared_resources()?;
        let started = Instant::now();
        let options: Vec<CommOptions> = comms.iter().map(Communicator::child_options).collect();
        let timeout = options.iter().map(CommOptions::timeout).max().expect("not empty");
        // Every parent stays locked until the split has finished: no watchdog aborts one
        // mid-split. Checked usable before the group, so that a split is queued for every rank
        // or for none (a rank missing from the group would leave the others waiting for it).
        let mut states: Vec<_> = comms.iter().map(|c| c.shared.lock()).collect();
        let parents = states
            .iter()
            .map(|s| usable(s))
            .collect::<Result<Vec<ncclComm_t>>>()?;
        // NCCL writes each child's handle here at the group's end (or later, non-blocking):
        // not resized or read until every split has finished or its parent is aborted.
        // The configs are alike but for timeouts (one clique, made with one setting): NCCL 2.28
        // fails a group mixing blocking and non-blocking children after linking the child's
        // abort flag to the parent, which the parent's abort would then write once freed.
        debug_assert!(options.iter().all(|o| o.blocking() == options[0].blocking()));
        let mut children: Vec<ncclComm_t> = vec![std::ptr::null_mut(); comms.len()];
        let slots = children.as_mut_ptr();
        let mut first_err = None;
        // SAFETY: no raw group is open on this thread (`group_start` is unsafe and requires
        // that); closed below.
        unsafe { nc::group_start() }?;
        for (i, (parent, (color, (_, key)))) in parents.iter().zip(colors.iter().zip(splits)).enumerate() {
            let mut config = options[i].config();
            // SAFETY: `parent` is live and locked; `slots.add(i)` is `children[i]`, which
            // outlives the split (see above); the config comes from `config_initializer`; every
            // rank of the parent is split in this group.
            match unsafe { nc::comm_split(*parent, *color, *key, slots.add(i), &mut config) } {
                Ok(_) => {}
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        // SAFETY: closes the group opened above, on this thread.
        if let Err(e) = unsafe { nc::group_end() } {
            first_err.get_or_insert(e);
        }
        if first_err.is_none() {
            for parent in &parents {
                // SAFETY: each parent is live and locked; NCCL marks it in progress until its
                // split's job has stored the child (immediately ready when blocking).
                if let Err(e) = unsafe { nc::wait_ready(*parent, "ncclCommSplit", started, timeout) } {
                    first_err = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = first_err {
            // Aborting the parents ends any split still running before the handles are read.
            for (state, c) in states.iter_mut().zip(comms) {
                state.break_with(e.to_string(), c.shared.ordinal, Cut::Incomplete);
            }
            drop(states);
            children.into_iter().for_each(abort_child);
            return Err(e);
        }
        drop(states);
        // Adopt every child (aborting the rest on an error), then give each color its mailboxes.
        let mut out: Vec<Option<Communicator>> = Vec::with_capacity(comms.len());
        let mut rest = children.into_iter().zip(options);
        for ((c, (color, _)), (child, opts)) in comms.iter().zip(splits).zip(rest.by_ref()) {
            if color.is_none() || child.is_null() {
                abort_child(child);
                out.push(None);
                continue;
            }
            match c.adopt(child, opts, started) {
                Ok(comm) => out.push(Some(comm)),
                Err(e) => {
                    rest.for_each(|(child, _)| abort_child(child));
                    return Err(e);
                }
            }
        }
        let groups = color_groups(splits);
        for (i, g) in groups.iter().enumerate() {
            if *g != Some(i) {
                continue;
            }
            let world = groups.iter().filter(|&&h| h == Some(i)).count();
            let mut members = Vec::with_capacity(world);
            for (j, comm) in out.iter_mut().enumerate().filter(|(j, _)| groups[*j] == Some(i)) {
                let Some(comm) = comm.as_mut() else {
                    return Err(Error::Setup {
                        detail: format!("NCCL made no communicator for color {:?}", splits[j].0),
                    });
                };
                if comm.world_size() != world {
                    return Err(Error::Setup {
                        detail: format!(
                            "NCCL made a communicator of {} ranks for color {:?}, which {world} \
                             ranks chose",
                            comm.world_size(),
                            splits[j].0
                        ),
                    });
                }
                members.push(comm);
            }
            form_clique(members);
        }
        trace::event!(
            info,
            ranks = comms.len(),
            made = out.iter().flatten().count(),
            elapsed = ?started.elapsed(),
            "handoff: communicators split together"
        );
        Ok(out)
    }

    /// A child's options: this communicator's, with its current timeout.
    fn child_options(&self) -> CommOptions {
        self.options().with_timeout(self.timeout())
    }

    /// Wraps a child `ncclCommSplit` made, on this communicator's device, once it is ready,
    /// and watches it; aborts it on an error.
    fn adopt(&self, child: ncclComm_t, options: CommOptions, started: Instant) -> Result<Communicator> {
        // SAFETY: `child` is live: its split finished and wrote it.
        let ready = unsafe { nc::wait_ready(child, "ncclCommSplit", started, options.timeout()) }
            // SAFETY: `child` is live and, polled ready, has finished initializing.
            .and_then(|()| unsafe { nc::comm_world_rank(child) });
        let (world, rank) = match ready {
            Ok(wr) => wr,
            Err(e) => {
                abort_child(child);
                return Err(e);
            }
        };
        let comm = Communicator::wrap(child, self.device(), world, rank, options);
        comm.fail_on(watchdog::watch(&comm.shared))?;
        Ok(comm)
    }
}

/// With `NCCL_COMM_SPLIT_SHARE_RESOURCES` set, NCCL lets a child share its parent's resources,
/// abort flag included, whatever the config says: the watchdog's abort of one would then cut
/// the other's kernels short unreported.
/// NCCL reads the variable once per process, at its first communicator, and keeps that value:
/// checked as it was then and as it is now.
fn refuse_shared_resources() -> Result<()> {
    shared_resources_refused(FIRST_SPLIT_SHARE.get().cloned().flatten())?;
    shared_resources_refused(std::env::var(SPLIT_SHARE).ok())
}

fn shared_resources_refused(value: Option<String>) -> Result<()> {
    match value {
        Some(v) if v.trim() != "0" => Err(Error::InvalidArgument(format!(
            "NCCL_COMM_SPLIT_SHARE_RESOURCES={v} makes split communicators share their parent's \
             resources and abort flag, which handoff's per-communicator watchdog cannot allow: \
             unset it"
        ))),
        _ => Ok(()),
    }
}

/// Aborts a child not yet wrapped (nothing for a null one).
fn abort_child(child: ncclComm_t) {
    if !child.is_null() {
        // SAFETY: `child` is a live communicator nobody else holds; not used afterwards.
        let _ = unsafe { nc::comm_abort(child) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colors_map_to_nccl() {
        // A rank left out gets a color of its own, never NCCL's NOCOLOR.
        assert_eq!(nccl_color(None, 3).unwrap(), (LEFT_OUT + 3) as i32);
        assert_ne!(nccl_color(None, 0).unwrap(), nccl_color(None, 1).unwrap());
        assert_eq!(nccl_color(Some(7), 3).unwrap(), 7);
        for c in [LEFT_OUT, u32::MAX] {
            assert!(matches!(nccl_color(Some(c), 0), Err(Error::InvalidArgument(_))));
        }
        assert!(nccl_color(None, usize::MAX).is_err());
    }

    #[test]
    fn shared_resources_are_refused() {
        assert!(shared_resources_refused(None).is_ok());
        assert!(shared_resources_refused(Some("0".into())).is_ok());
        assert!(matches!(
            shared_resources_refused(Some("1".into())),
            Err(Error::InvalidArgument(m)) if m.contains("unset it")
        ));
    }

    #[test]
    fn ranks_of_one_color_group_together() {
        let splits = [(Some(3), 0), (None, 0), (Some(1), 0), (Some(3), -1)];
        assert_eq!(color_groups(&splits), [Some(0), None, Some(2), Some(0)]);
    }
}
