//! [`UniqueId`]: what the ranks of one communicator share to find each other. Its bytes are
//! opaque and only copied; an id read from text is refused unless it is exactly
//! [`UniqueId::BYTES`] bytes of hex.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::result::nccl as nc;
use crate::sys::nccl::ncclUniqueId;

/// The identifier that every rank of one communicator must share, made by one of them.
///
/// 128 opaque bytes: NCCL encodes in them the address of a bootstrap socket that
/// [`UniqueId::new`] opens in the calling process, which must therefore stay alive until all
/// ranks have joined. Move it between processes as bytes ([`UniqueId::as_bytes`]) or as text
/// (`Display` / `FromStr`, 256 hex digits), or let [`crate::nccl::bootstrap`] do it.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UniqueId::BYTES],
}

impl UniqueId {
    /// Size of a unique id in bytes (`NCCL_UNIQUE_ID_BYTES`).
    pub const BYTES: usize = crate::sys::nccl::NCCL_UNIQUE_ID_BYTES as usize;

    /// A new id (`ncclGetUniqueId`).
    ///
    /// # Errors
    /// NCCL cannot be loaded, or cannot open its bootstrap socket.
    pub fn new() -> Result<UniqueId> {
        let raw = nc::get_unique_id()?;
        Ok(UniqueId {
            bytes: raw.internal.map(|c| c as u8),
        })
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; UniqueId::BYTES] {
        &self.bytes
    }

    /// An id from bytes that [`UniqueId::as_bytes`] produced.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `bytes` has exactly [`UniqueId::BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; UniqueId::BYTES] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "a unique id has {} bytes, not {}",
                UniqueId::BYTES,
                bytes.len()
            ))
        })?;
        Ok(UniqueId { bytes })
    }

    pub(crate) fn raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: self.bytes.map(|b| b as std::ffi::c_char),
        }
    }
}

impl fmt::Display for UniqueId {
    /// 256 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.to_string();
        write!(f, "UniqueId({}…)", &text[..16])
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    /// Parses the 256 hex digits that `Display` writes.
    fn from_str(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 2 * UniqueId::BYTES || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(Error::InvalidArgument(format!(
                "a unique id is written as {} hex digits; got {} characters{}",
                2 * UniqueId::BYTES,
                s.len(),
                if s.bytes().all(|c| c.is_ascii_hexdigit()) {
                    ""
                } else {
                    " with non-hex ones"
                }
            )));
        }
        let mut bytes = [0u8; UniqueId::BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("checked hex digits");
        }
        Ok(UniqueId { bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips_through_bytes_and_text() {
        let mut bytes = [0u8; UniqueId::BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 37 % 256) as u8;
        }
        let id = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.as_bytes(), &bytes);
        let text = id.to_string();
        assert_eq!(text.len(), 256);
        assert_eq!(text.parse::<UniqueId>().unwrap(), id);
        // The raw NCCL form carries the same bytes.
        assert_eq!(id.raw().internal.map(|c| c as u8), bytes);
    }

    #[test]
    fn bad_unique_ids_are_typed_errors() {
        assert!(matches!(
            UniqueId::from_bytes(&[0; 127]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            UniqueId::from_bytes(&[0; 129]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            "abc".parse::<UniqueId>(),
            Err(Error::InvalidArgument(_))
        ));
        let not_hex = "zz".repeat(128);
        let e = not_hex.parse::<UniqueId>().unwrap_err().to_string();
        assert!(e.contains("non-hex"), "{e}");
    }
}
