//! [`NcclType`]: the element types NCCL moves, their codes, and what the loaded NCCL and the
//! GPU need for each.
//!
//! # fp8 (feature `float8`)
//! [`float8::F8E4M3`] and [`float8::F8E5M2`] are `ncclFloat8e4m3` (10) and `ncclFloat8e5m2`
//! (11). What NCCL 2.28.3's source accepts for them, checked here before anything is queued
//! (`nccl/fp8.rs`), so that NCCL's invalid-argument (which would abort the communicator) is
//! never reached:
//! - the types exist from NCCL 2.24.3 on (older versions refuse any code past `ncclBfloat16`):
//!   an older NCCL is [`Error::Unsupported`] naming the version;
//! - sending and receiving them works on any GPU, and so do the collectives that only move
//!   them (broadcast, all-gather, all-to-all, gather, scatter) from NCCL 2.28.3 on; older NCCLs
//!   refuse those below sm_90 like reductions;
//! - reducing them (all-reduce, reduce, reduce-scatter) needs compute capability 9.0 (sm_90)
//!   or newer: `taskAppend` refuses them when the communicator's oldest GPU is older (its
//!   `minCompCap`), and its reduction kernels are only built for sm_90+. Checked on this rank's
//!   GPU, [`Error::InvalidArgument`] if older; in a communicator that mixes older and newer GPUs
//!   the newer ranks cannot see this and NCCL refuses the collective there;
//! - on a one-rank communicator, NCCL runs reductions as a copy, except `Avg` and PreMulSum
//!   whose scaling kernel (`ncclLaunchOneRank`) has no fp8 case in a host build: those are
//!   [`Error::InvalidArgument`] too. With more ranks they run in NCCL's fp8 kernels, which
//!   accumulate in the type itself (NCCL sends fp8 reductions over deep trees to other
//!   algorithms to limit the rounding).

use bytemuck::Pod;

use crate::sys::nccl::ncclDataType_t;

mod sealed {
    pub trait Sealed {}
}

/// Element types NCCL can move, with their `ncclDataType_t`.
///
/// Sealed: the type's size must be the NCCL type's size, or NCCL would read or write past the
/// buffer, so only the crate implements it.
pub trait NcclType: Pod + sealed::Sealed {
    /// The NCCL data type.
    const DATATYPE: ncclDataType_t;
    /// Its name, for messages.
    const NAME: &'static str;
}

macro_rules! nccl_types {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl NcclType for $t {
            const DATATYPE: ncclDataType_t = ncclDataType_t::$d;
            const NAME: &'static str = stringify!($t);
        }
    )*};
}

nccl_types! {
    i8 => ncclInt8,
    u8 => ncclUint8,
    i32 => ncclInt32,
    u32 => ncclUint32,
    i64 => ncclInt64,
    u64 => ncclUint64,
    half::f16 => ncclFloat16,
    f32 => ncclFloat32,
    f64 => ncclFloat64,
    half::bf16 => ncclBfloat16,
}

#[cfg(feature = "float8")]
nccl_types! {
    float8::F8E4M3 => ncclFloat8e4m3,
    float8::F8E5M2 => ncclFloat8e5m2,
}

/// The size in bytes of one element of an NCCL data type.
#[cfg(test)]
fn datatype_size(d: ncclDataType_t) -> usize {
    match d.0 {
        0 | 1 | 10 | 11 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        _ => 8,
    }
}

/// The Rust name of an NCCL data type code, for messages.
pub(crate) fn datatype_name(code: u32) -> &'static str {
    match code {
        0 => "i8",
        1 => "u8",
        2 => "i32",
        3 => "u32",
        4 => "i64",
        5 => "u64",
        6 => "f16",
        7 => "f32",
        8 => "f64",
        9 => "bf16",
        10 => "f8e4m3",
        11 => "f8e5m2",
        _ => "an unknown NCCL type",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datatypes_match_rust_sizes() {
        fn check<T: NcclType>() {
            assert_eq!(
                datatype_size(T::DATATYPE),
                std::mem::size_of::<T>(),
                "{}",
                T::NAME
            );
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<half::f16>();
        check::<f32>();
        check::<f64>();
        check::<half::bf16>();
        #[cfg(feature = "float8")]
        {
            check::<float8::F8E4M3>();
            check::<float8::F8E5M2>();
        }
    }
}
