//! The thin checked layer over the generated bindings: one function per runtime call the crate
//! makes, each turning the raw status into a [`crate::Result`]. Functions that take raw handles
//! are `unsafe`: the caller vouches for them.

pub mod cudart;
pub mod nccl;
