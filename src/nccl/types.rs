//! [`NcclType`]: the element types NCCL moves, and their codes.

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
    }
}
