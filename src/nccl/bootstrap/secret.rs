//! The job's shared secret and the MACs the id exchange computes with it. The secret never
//! crosses the wire and is never printed, and comparing it or a MAC takes the same time
//! whichever byte differs.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};
use crate::nccl::UniqueId;

/// The variable holding the secret itself.
pub const SECRET_VAR: &str = "HANDOFF_SECRET";
/// The variable naming a file that holds the secret.
pub const SECRET_FILE_VAR: &str = "HANDOFF_SECRET_FILE";

/// A secret every rank of a job holds, proving to rank 0's id server that a client is one of
/// the job's ranks, and to a rank that the server is rank 0. It never crosses the wire: each
/// side sends an HMAC-SHA256 over the other's fresh nonce (see [`bootstrap`](super)).
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

    fn mac(&self, label: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        m.update(label);
        m
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

/// Bytes of a nonce, a MAC.
pub(super) const NONCE: usize = 32;
pub(super) const MAC: usize = 32;
/// The id as sent under a secret: encrypted, then its MAC.
pub(super) const SEALED: usize = UniqueId::BYTES + MAC;

// Each MAC's input starts with its own label, so no MAC one side sends can stand for another.
const SERVER_PROOF: &[u8] = b"handoff bootstrap 2: server proof\0";
const CLIENT_PROOF: &[u8] = b"handoff bootstrap 2: client proof\0";
const ID_KEY: &[u8] = b"handoff bootstrap 2: id keystream\0";
const ID_MAC: &[u8] = b"handoff bootstrap 2: id mac\0";

/// What one exchange's MACs cover: the secret, the rank the client claims, and both nonces.
pub(super) struct Transcript<'a> {
    pub secret: &'a Secret,
    pub rank: u32,
    pub client_nonce: [u8; NONCE],
    pub server_nonce: [u8; NONCE],
}

impl Transcript<'_> {
    fn mac(&self, label: &[u8]) -> Hmac<Sha256> {
        let mut m = self.secret.mac(label);
        m.update(&self.rank.to_be_bytes());
        m.update(&self.client_nonce);
        m.update(&self.server_nonce);
        m
    }

    /// What the server sends to show it holds the secret.
    pub fn server_proof(&self) -> [u8; MAC] {
        self.mac(SERVER_PROOF).finalize().into_bytes().into()
    }

    /// What the client sends to show it holds the secret.
    pub fn client_proof(&self) -> [u8; MAC] {
        self.mac(CLIENT_PROOF).finalize().into_bytes().into()
    }

    /// Whether `proof` is the server's (compared in constant time).
    pub fn is_server_proof(&self, proof: &[u8]) -> bool {
        self.mac(SERVER_PROOF).verify_slice(proof).is_ok()
    }

    /// Whether `proof` is the client's (compared in constant time).
    pub fn is_client_proof(&self, proof: &[u8]) -> bool {
        self.mac(CLIENT_PROOF).verify_slice(proof).is_ok()
    }

    /// HMAC in counter mode: the keystream that hides the id from anyone watching the wire.
    fn keystream(&self) -> [u8; UniqueId::BYTES] {
        let mut ks = [0u8; UniqueId::BYTES];
        for (i, block) in ks.chunks_mut(MAC).enumerate() {
            let mut m = self.mac(ID_KEY);
            m.update(&[i as u8]);
            block.copy_from_slice(&m.finalize().into_bytes()[..block.len()]);
        }
        ks
    }

    /// The id encrypted, then MACed (encrypt-then-MAC).
    pub fn seal(&self, id: &[u8; UniqueId::BYTES]) -> [u8; SEALED] {
        let mut out = [0u8; SEALED];
        for ((o, k), b) in out.iter_mut().zip(self.keystream()).zip(id) {
            *o = k ^ b;
        }
        let mut m = self.mac(ID_MAC);
        m.update(&out[..UniqueId::BYTES]);
        out[UniqueId::BYTES..].copy_from_slice(&m.finalize().into_bytes());
        out
    }

    /// The id from `sealed`, or `None` when its MAC is not this transcript's.
    pub fn open(&self, sealed: &[u8; SEALED]) -> Option<[u8; UniqueId::BYTES]> {
        let (cipher, tag) = sealed.split_at(UniqueId::BYTES);
        let mut m = self.mac(ID_MAC);
        m.update(cipher);
        m.verify_slice(tag).ok()?;
        let mut id = [0u8; UniqueId::BYTES];
        for ((o, k), c) in id.iter_mut().zip(self.keystream()).zip(cipher) {
            *o = k ^ c;
        }
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn transcript(secret: &Secret) -> Transcript<'_> {
        Transcript {
            secret,
            rank: 3,
            client_nonce: [1; NONCE],
            server_nonce: [2; NONCE],
        }
    }

    #[test]
    fn proofs_and_sealed_id_need_the_same_secret_rank_and_nonces() {
        let (a, b) = (Secret::new([7u8; 32]).unwrap(), Secret::new([8u8; 32]).unwrap());
        let t = transcript(&a);
        let id = [0x5a; UniqueId::BYTES];
        let sealed = t.seal(&id);
        assert_eq!(t.open(&sealed), Some(id));
        assert!(!sealed.windows(16).any(|w| id.windows(16).any(|v| v == w)));
        assert!(t.is_client_proof(&t.client_proof()) && t.is_server_proof(&t.server_proof()));
        // One side's proof never passes as the other's.
        assert!(!t.is_client_proof(&t.server_proof()) && !t.is_server_proof(&t.client_proof()));
        let others = [
            transcript(&b),
            Transcript {
                rank: 4,
                ..transcript(&a)
            },
            Transcript {
                client_nonce: [9; NONCE],
                ..transcript(&a)
            },
            Transcript {
                server_nonce: [9; NONCE],
                ..transcript(&a)
            },
        ];
        for o in &others {
            assert!(!o.is_client_proof(&t.client_proof()) && !o.is_server_proof(&t.server_proof()));
            assert_eq!(o.open(&sealed), None);
        }
        let mut flipped = sealed;
        flipped[5] ^= 1;
        assert_eq!(t.open(&flipped), None);
    }

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
