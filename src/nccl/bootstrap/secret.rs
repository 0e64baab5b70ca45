//! The job's shared secret. It never crosses the wire (it keys the Noise handshakes of
//! [`noise`](super::noise)) and is never printed, and comparing it takes the same time whichever
//! byte differs.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{Error, Result};

/// The variable holding the secret itself.
pub const SECRET_VAR: &str = "HANDOFF_SECRET";
/// The variable naming a file that holds the secret.
pub const SECRET_FILE_VAR: &str = "HANDOFF_SECRET_FILE";

/// A secret every rank of a job holds, proving to rank 0's id server that a client is one of
/// the job's ranks, and to a rank that the server is rank 0. It never crosses the wire: it is the
/// pre-shared key of a Noise handshake (see [`bootstrap`](super)).
///
/// Its bytes are never printed (`Debug` shows `Secret(..)`); equality takes the same time
/// whichever byte differs.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// The fewest bytes a secret may have.
    pub const MIN_LEN: usize = 16;
    /// The most bytes a secret (or its file) may have.
    pub const MAX_LEN: usize = 4096;

    /// A secret of these bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it is shorter than [`Secret::MIN_LEN`] or longer than
    /// [`Secret::MAX_LEN`] bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret> {
        Self::named(bytes.into(), "the secret")
    }

    fn named(bytes: Vec<u8>, what: &str) -> Result<Secret> {
        if bytes.len() < Self::MIN_LEN || bytes.len() > Self::MAX_LEN {
            return Err(Error::InvalidArgument(format!(
                "{what} is {} bytes; a shared secret has {} to {} (make one with `openssl rand \
                 -hex 32`)",
                bytes.len(),
                Self::MIN_LEN,
                Self::MAX_LEN
            )));
        }
        Ok(Secret(bytes))
    }

    /// Reads the secret from `path`: a regular file that only its owner may read or write
    /// (mode 0600 or 0400), of at most [`Secret::MAX_LEN`] bytes; trailing whitespace (a final
    /// newline) is not part of the secret.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the file when it cannot be read, is not a regular file,
    /// is open to its group or others, or holds too few or too many bytes.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Secret> {
        let path = path.as_ref();
        let bad = |why: String| Error::InvalidArgument(format!("{SECRET_FILE_VAR}={path:?}: {why}"));
        // Checked before opening, so that a FIFO or a device is normally never opened, and again
        // on the open file, which is what is read; opened without blocking, so that one swapped
        // in between cannot hold the open (links are followed: secrets are often mounted so).
        let check = |meta: std::fs::Metadata| -> Result<()> {
            if !meta.is_file() {
                return Err(bad("not a regular file".into()));
            }
            if meta.mode() & 0o077 != 0 {
                return Err(bad(format!(
                    "its mode is {:04o}, open to its group or others: `chmod 600` it",
                    meta.mode() & 0o7777
                )));
            }
            if meta.len() > Self::MAX_LEN as u64 {
                return Err(bad(format!("{} bytes, more than {}", meta.len(), Self::MAX_LEN)));
            }
            Ok(())
        };
        check(std::fs::metadata(path).map_err(|e| bad(format!("cannot read it: {e}")))?)?;
        let file = {
            use crate::sys::posix::{O_NOCTTY, O_NONBLOCK};
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(O_NONBLOCK | O_NOCTTY)
                .open(path)
                .map_err(|e| bad(format!("cannot open it: {e}")))?
        };
        check(file.metadata().map_err(|e| bad(format!("cannot read it: {e}")))?)?;
        let mut bytes = Vec::new();
        file.take(Self::MAX_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| bad(format!("cannot read it: {e}")))?;
        while bytes.last().is_some_and(u8::is_ascii_whitespace) {
            bytes.pop();
        }
        Self::named(bytes, &format!("{SECRET_FILE_VAR}={path:?}"))
    }

    /// The secret this process's environment gives: `HANDOFF_SECRET` (the secret itself, as
    /// text) or `HANDOFF_SECRET_FILE` (a file holding it, see [`Secret::from_file`]);
    /// `Ok(None)` when neither is set.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when both are set, or the one set is not a usable secret (an
    /// empty or short value is an error, never "no secret").
    pub fn from_env() -> Result<Option<Secret>> {
        Self::from_vars(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()))
    }

    /// As [`Secret::from_env`], reading variables through `var`.
    ///
    /// # Errors
    /// As [`Secret::from_env`].
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Secret>> {
        match (var(SECRET_VAR), var(SECRET_FILE_VAR)) {
            (None, None) => Ok(None),
            (Some(_), Some(_)) => Err(Error::InvalidArgument(format!(
                "both {SECRET_VAR} and {SECRET_FILE_VAR} are set: set one"
            ))),
            (Some(s), None) => Self::named(s.into_bytes(), SECRET_VAR).map(Some),
            (None, Some(path)) => Self::from_file(path).map(Some),
        }
    }

    /// The secret's bytes, for the other protocols keyed by it (the verification channel).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// A fresh random secret of 32 bytes, written as 64 hex digits (so it can travel in
    /// `HANDOFF_SECRET`).
    pub(crate) fn random_hex() -> std::io::Result<String> {
        let mut b = [0u8; 32];
        random(&mut b)?;
        Ok(b.iter().map(|x| format!("{x:02x}")).collect())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.0.len() == other.0.len()
            && self.0.iter().zip(&other.0).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl Eq for Secret {}

/// Fills `buf` from the kernel's random source.
pub(crate) fn random(buf: &mut [u8]) -> std::io::Result<()> {
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn secrets_from_variables_and_files() {
        let vars = |pairs: Vec<(&'static str, String)>| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
        };
        assert_eq!(Secret::from_vars(vars(vec![])).unwrap(), None);
        let s = Secret::from_vars(vars(vec![(SECRET_VAR, "x".repeat(16))])).unwrap();
        assert_eq!(s, Some(Secret::new("x".repeat(16)).unwrap()));
        assert_eq!(format!("{s:?}"), "Some(Secret(..))");
        for short in ["", "short"] {
            let e = Secret::from_vars(vars(vec![(SECRET_VAR, short.into())])).unwrap_err();
            assert!(e.to_string().contains("HANDOFF_SECRET is"), "{e}");
        }
        let dir = std::env::temp_dir().join(format!("handoff-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let path = file.to_string_lossy().into_owned();
        let e = Secret::from_vars(vars(vec![(SECRET_FILE_VAR, path.clone())])).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = Secret::from_vars(vars(vec![(SECRET_FILE_VAR, path.clone())])).unwrap();
        assert_eq!(s, Some(Secret::new("0123456789abcdef0123").unwrap()));
        let e = Secret::from_vars(vars(vec![
            (SECRET_FILE_VAR, path.clone()),
            (SECRET_VAR, "y".repeat(16)),
        ]));
        assert!(e.unwrap_err().to_string().contains("set one"));
        let e = Secret::from_file(&dir).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = Secret::from_file(dir.join("absent")).unwrap_err();
        assert!(e.to_string().contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
