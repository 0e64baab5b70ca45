//! Verification alone, without NCCL or a GPU: one rank's mailboxes set up by the same code as a
//! communicator's (`setup::settle`), over an all-gather the caller provides, and
//! checked by the same `verify`. For the two-host rehearsal (`tests/hosts.rs`) and the
//! channel's benchmark; not an API.

use std::sync::Arc;
use std::time::Duration;

use crate::nccl::verify::mailbox::Region;
use crate::nccl::verify::wire::{CollDesc, OpDesc, P2P};
use crate::nccl::verify::{CollOps, Mailboxes, PairOps, setup, verify};

/// `ncclFloat32`.
const F32: u32 = 7;

/// An all-gather: every rank's words, in rank order, or why not.
pub type Gather<'a> = dyn FnMut(&[u64]) -> Result<Vec<u64>, String> + 'a;

/// Where a rank's channel listens, as its setup chooses it from the variables.
///
/// # Errors
/// A variable names no usable address.
pub fn listen_addr() -> Result<std::net::SocketAddr, String> {
    setup::listen_addr()
}

/// One rank's verification, set up.
pub struct Rank {
    boxes: Mailboxes,
    regions: Arc<[Arc<Region>]>,
    remote: Vec<usize>,
    refused: usize,
    timeout: Duration,
}

impl Rank {
    /// Sets up rank `rank` of `world` as a verified communicator does, with `gather` as its
    /// all-gather (every rank's words, in rank order) and `timeout` for every wait.
    ///
    /// # Errors
    /// What setup reports (a communicator's [`crate::Error::Setup`]), as text.
    pub fn settle(
        rank: usize,
        world: usize,
        timeout: Duration,
        gather: &mut Gather<'_>,
    ) -> Result<Rank, String> {
        let mut g = |w: &[u64]| gather(w).map_err(|detail| crate::Error::Setup { detail });
        let token = u64::from_le_bytes(crate::nccl::verify::auth::random::<8>()?);
        let s = setup::settle(rank, world, true, token, timeout, None, &mut g)
            .map_err(|e| e.to_string())?
            .expect("verified");
        Ok(Rank {
            boxes: Mailboxes::new(rank, s.regions.clone()),
            regions: s.regions,
            remote: s.remote,
            refused: s.refused,
            timeout,
        })
    }

    /// The peers reached through the channel (the others share mailbox files).
    pub fn remote(&self) -> &[usize] {
        &self.remote
    }

    /// Connections this rank's listener refused during setup.
    pub fn refused(&self) -> usize {
        self.refused
    }

    /// Verifies one group of sends to and receives from `peer` of `f32` counts, in order.
    ///
    /// # Errors
    /// The failure, as verification reports it (`Mismatch(..)`, `PeerBroken(..)`,
    /// `Timeout { .. }`).
    pub fn exchange(&self, peer: usize, sends: &[u64], recvs: &[u64]) -> Result<(), String> {
        let op = |&count: &u64| OpDesc {
            count,
            dtype: F32,
            captured: false,
            nccl_memory: 0,
            part: P2P,
        };
        let pair = PairOps {
            boxes: &self.boxes,
            peer,
            sends: sends.iter().map(op).collect(),
            recvs: recvs.iter().map(op).collect(),
            timeout: self.timeout,
        };
        verify(&[pair], &[]).map_err(|f| format!("{f:?}"))
    }

    /// Verifies one group of all_reduce sums of `f32` counts, in order.
    ///
    /// # Errors
    /// As [`Rank::exchange`].
    pub fn all_reduce(&self, counts: &[u64]) -> Result<(), String> {
        let c = CollOps {
            boxes: &self.boxes,
            ops: counts.iter().map(|&count| CollDesc::f32_sum(count)).collect(),
            timeout: self.timeout,
        };
        verify(&[], &[c]).map_err(|f| format!("{f:?}"))
    }

    /// Marks this rank broken, as a communicator that fails does.
    pub fn set_broken(&self) {
        self.regions[self.boxes.rank].set_broken();
    }

    /// Sends the watchdog's heartbeat, busy or not.
    pub fn heartbeat(&self, now_ms: u64, backlog: bool) {
        self.regions[self.boxes.rank].set_heartbeat(now_ms, backlog);
    }

    /// Whether `peer` looks alive and busy (as the watchdog asks), `fresh_ms` being how old
    /// its heartbeat may be.
    pub fn peer_busy(&self, peer: usize, now_ms: u64, fresh_ms: u64) -> bool {
        self.regions[peer].busy_and_alive(now_ms, fresh_ms)
    }
}
