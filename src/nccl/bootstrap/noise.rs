//! The one authenticated transport of the crate's own sockets: the bootstrap's id exchange
//! (under a secret) and the verification channel both run `Noise_NNpsk0_25519_ChaChaPoly_SHA256`
//! (the Noise Protocol Framework, rev. 34, through the `snow` crate) keyed by the job's secret.
//! Nothing here is a protocol of handoff's own: this module only fixes the pattern, how the
//! 32-byte pre-shared key is derived from the secret, and the nonce rule below.
//!
//! `NNpsk0`: the initiator sends `psk, e` (its ephemeral key, and an empty payload sealed under
//! a key from the PSK: only a holder of the PSK can write it), the responder `e, ee` (sealed
//! under the PSK and the fresh Diffie-Hellman, so only a holder of the PSK that saw this
//! initiator's ephemeral key can write it). Each side's [prologue](Handshake::initiator), the
//! clear header both already exchanged (protocol version, ranks, flags), is bound into the
//! handshake hash: a flipped bit of it fails the handshake. Then:
//! - nonce 0 of each direction is its [confirmation](Session::confirmation): the initiator's
//!   proves to the responder that it is live in this handshake (a replayed first message
//!   cannot make it), the responder's that it finished;
//! - record `i` of a direction travels under nonce `i + 1`, so a record replayed, reordered or
//!   dropped fails to open; each direction has its own key, so a reflected one fails too.
//!
//! Forward secrecy and encryption come with it: the id and the channel's frames are sealed
//! (ChaCha20-Poly1305) under keys from fresh ephemeral keys as well as the secret.

use sha2::{Digest, Sha256};
use snow::{HandshakeState, StatelessTransportState};

/// The Noise protocol name: pattern, DH, cipher, hash.
pub(crate) const PROTOCOL: &str = "Noise_NNpsk0_25519_ChaChaPoly_SHA256";
/// Bytes of each handshake message (an ephemeral key and the tag of an empty payload).
pub(crate) const MESSAGE: usize = 32 + TAG;
/// Bytes of an AEAD tag: what sealing adds to a plaintext.
pub(crate) const TAG: usize = 16;

/// The 32-byte pre-shared key of one use (`context`): SHA-256 over a label, `context`, whether
/// there is a secret, the secret and each of `bound` (values both sides hold, such as the
/// verification channel's tokens), each length-prefixed so that no two inputs collide.
pub(crate) fn psk(context: &str, secret: Option<&[u8]>, bound: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    let mut part = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(b"handoff noise psk 1");
    part(context.as_bytes());
    part(&[u8::from(secret.is_some())]);
    part(secret.unwrap_or_default());
    for b in bound {
        part(b);
    }
    h.finalize().into()
}

/// One side of one handshake.
pub(crate) struct Handshake(HandshakeState);

impl Handshake {
    fn build(prologue: &[u8], psk: &[u8; 32], initiator: bool) -> Result<Handshake, String> {
        let params = PROTOCOL.parse().map_err(|e| format!("Noise parameters: {e}"))?;
        let b = snow::Builder::new(params)
            .prologue(prologue)
            .and_then(|b| b.psk(0, psk))
            .map_err(|e| format!("Noise handshake: {e}"))?;
        let state = if initiator {
            b.build_initiator()
        } else {
            b.build_responder()
        };
        state.map(Handshake).map_err(|e| format!("Noise handshake: {e}"))
    }

    /// The side that writes the first message, binding `prologue` (both sides' must be equal).
    ///
    /// # Errors
    /// The handshake cannot be set up (no randomness for its ephemeral key).
    pub(crate) fn initiator(prologue: &[u8], psk: &[u8; 32]) -> Result<Handshake, String> {
        Self::build(prologue, psk, true)
    }

    /// The side that reads the first message.
    ///
    /// # Errors
    /// As [`Handshake::initiator`].
    pub(crate) fn responder(prologue: &[u8], psk: &[u8; 32]) -> Result<Handshake, String> {
        Self::build(prologue, psk, false)
    }

    /// This side's next message.
    ///
    /// # Errors
    /// Out of turn, or no randomness for the ephemeral key.
    pub(crate) fn write(&mut self) -> Result<[u8; MESSAGE], String> {
        let mut m = [0u8; MESSAGE];
        match self.0.write_message(&[], &mut m) {
            Ok(MESSAGE) => Ok(m),
            Ok(n) => Err(format!("Noise handshake message of {n} bytes")),
            Err(e) => Err(format!("Noise handshake: {e}")),
        }
    }

    /// Reads the peer's next message: false when it does not authenticate (another PSK or
    /// prologue, or damaged). The handshake is then unusable.
    pub(crate) fn read(&mut self, message: &[u8; MESSAGE]) -> bool {
        self.0.read_message(message, &mut []) == Ok(0)
    }

    /// The session, once both messages have passed.
    ///
    /// # Errors
    /// The handshake has not finished.
    pub(crate) fn finish(self) -> Result<Session, String> {
        self.0
            .into_stateless_transport_mode()
            .map(Session)
            .map_err(|e| format!("Noise handshake: {e}"))
    }
}

/// The keys of a finished handshake: one per direction, nonces chosen by the caller (see the
/// module: 0 confirms, record `i` is `i + 1`). Shared by a connection's sending and receiving
/// halves.
pub(crate) struct Session(StatelessTransportState);

impl Session {
    /// This side's confirmation (nonce 0, empty payload).
    pub(crate) fn confirmation(&self) -> [u8; TAG] {
        let mut c = [0u8; TAG];
        // Cannot fail: an empty payload into TAG bytes, nonce 0.
        let _ = self.0.write_message(0, &[], &mut c);
        c
    }

    /// Whether `c` is the peer's confirmation.
    pub(crate) fn confirms(&self, c: &[u8; TAG]) -> bool {
        self.0.read_message(0, c, &mut []) == Ok(0)
    }

    /// Seals `plain` as this side's record `record` into `out` (`plain.len() + TAG` bytes).
    /// False when `out` is too short or `plain` too long for one Noise message.
    pub(crate) fn seal(&self, record: u64, plain: &[u8], out: &mut [u8]) -> bool {
        let Some(nonce) = record.checked_add(1) else {
            return false;
        };
        out.len() == plain.len() + TAG && self.0.write_message(nonce, plain, out).is_ok()
    }

    /// Opens the peer's record `record` from `sealed` into `out` (`sealed.len() - TAG` bytes):
    /// false when it is not that record of the peer's, under this session's key, unaltered.
    pub(crate) fn open(&self, record: u64, sealed: &[u8], out: &mut [u8]) -> bool {
        let Some(nonce) = record.checked_add(1) else {
            return false;
        };
        sealed.len() == out.len() + TAG && self.0.read_message(nonce, sealed, out) == Ok(out.len())
    }
}

/// Both ends of a session made in memory, for tests: `(initiator, responder)`.
#[cfg(test)]
pub(crate) fn pair_for_test(psk: &[u8; 32]) -> (Session, Session) {
    let mut i = Handshake::initiator(b"test", psk).unwrap();
    let mut r = Handshake::responder(b"test", psk).unwrap();
    assert!(r.read(&i.write().unwrap()));
    assert!(i.read(&r.write().unwrap()));
    (i.finish().unwrap(), r.finish().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_needs_the_same_psk_and_prologue_and_refuses_replays_and_reflections() {
        let k = psk("test", Some(b"0123456789abcdef"), &[b"token"]);
        assert_ne!(k, psk("test", Some(b"0123456789abcdeF"), &[b"token"]));
        assert_ne!(k, psk("test", None, &[b"token"]));
        assert_ne!(k, psk("other", Some(b"0123456789abcdef"), &[b"token"]));
        assert_ne!(psk("t", None, &[b"ab", b"c"]), psk("t", None, &[b"a", b"bc"]));
        let (i, r) = pair_for_test(&k);
        assert!(r.confirms(&i.confirmation()) && i.confirms(&r.confirmation()));
        // A side's own confirmation is not the peer's (a reflection).
        assert!(!i.confirms(&i.confirmation()));
        let mut sealed = [0u8; 4 + TAG];
        assert!(i.seal(0, b"abcd", &mut sealed));
        assert!(!sealed.windows(4).any(|w| w == b"abcd"));
        let mut out = [0u8; 4];
        assert!(r.open(0, &sealed, &mut out) && out == *b"abcd");
        // Another record number (a replay, a reorder), a reflection, a flipped bit.
        assert!(!r.open(1, &sealed, &mut out));
        assert!(!i.open(0, &sealed, &mut out));
        sealed[3] ^= 1;
        assert!(!r.open(0, &sealed, &mut out));
        // Another PSK, another prologue: the first message does not authenticate.
        let mut a = Handshake::initiator(b"p", &k).unwrap();
        let first = a.write().unwrap();
        assert!(!Handshake::responder(b"p", &[0; 32]).unwrap().read(&first));
        assert!(!Handshake::responder(b"q", &k).unwrap().read(&first));
        let mut b = Handshake::responder(b"p", &k).unwrap();
        assert!(b.read(&first));
        let mut second = b.write().unwrap();
        second[40] ^= 1;
        assert!(!a.read(&second));
    }
}

#[cfg(test)]
mod cost {
    #[test]
    #[ignore = "a timing, for release builds"]
    fn seal_and_open_cost() {
        let (i, r) = super::pair_for_test(&[7; 32]);
        let plain = [5u8; 40];
        let mut sealed = [0u8; 56];
        let mut out = [0u8; 40];
        let n = 200_000u64;
        let t = std::time::Instant::now();
        for k in 0..n {
            assert!(i.seal(k, &plain, &mut sealed));
        }
        let s = t.elapsed() / n as u32;
        let t = std::time::Instant::now();
        for _ in 0..n {
            let _ = r.open(0, &sealed, &mut out);
        }
        println!("seal {s:?} open {:?}", t.elapsed() / n as u32);
    }
}
