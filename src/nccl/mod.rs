//! The NCCL side: [`UniqueId`], [`CommOptions`], [`Communicator`] with point-to-point
//! [`Communicator::send`] and [`Communicator::recv`], collectives, [`group`]s of them,
//! [`Communicator::split`], and the verification and watchdog that keep them safe.
//!
//! # How a transfer stays safe
//! A send is a *read* of its buffer and a receive a *write*, in the same use tracking as every
//! other stream operation, queued by the crate's one engine. So the article's rules hold by
//! construction, whatever streams are used: the next kernel A cannot overwrite a send buffer
//! before the send has completed on the GPU, and the next receive cannot overwrite `x` before
//! kernel B has read it.
//!
//! NCCL queues nothing on a stream before `ncclGroupEnd` (and, for a non-blocking communicator,
//! before its state leaves `ncclInProgress`). handoff therefore makes the streams wait for
//! earlier conflicting uses *before* the group, and records the events that track the transfers
//! only *after* the group has been enqueued: recording them inside the group, as cudarc does
//! (its issue 575), would let them complete before the transfers even start. The raw
//! `ncclGroupStart` that could leave such a group open is `unsafe` for that reason.
//!
//! Before the group, each operation is verified with its peer (see [`Communicator`]): NCCL
//! leaves a send and receive that disagree undefined.
//!
//! # Threads
//! NCCL calls on one communicator are not thread-safe. [`Communicator`] is therefore `Send` (it
//! may move to another thread) but not `Sync`, and a [`Group`], which holds communicators, is
//! neither: NCCL's group state belongs to the thread that opened it.

pub mod bootstrap;
mod collective;
mod communicator;
pub(crate) mod family;
mod fp8;
mod gatekeeper;
mod graph;
mod group;
mod id;
pub(crate) mod memory;
mod options;
mod register;
mod split;
mod state;
mod types;
mod verify;
mod wait_async;
mod watchdog;

pub use collective::ReduceOp;
pub use communicator::Communicator;
pub use family::GraphFamily;
pub use group::{Group, group};
pub use id::UniqueId;
pub use memory::pending_frees as pending_nccl_frees;
pub use options::{CommOptions, CtaPolicy};
pub use register::{Registration, Window};
pub use types::NcclType;
#[doc(hidden)]
pub use verify::rehearsal;
pub use wait_async::CommCompletion;
