//! Checked mode: what two ranks tell each other before a group, so that a send and a receive
//! that disagree on count or type become an error on both ranks instead of a hang or silent
//! corruption. Plain data here, so the CPU tests cover the encoding and every comparison.
//!
//! Before the payload, each pair of ranks with operations between them swaps one [`Header`]
//! (64 bytes, through NCCL itself): how many sends and receives each posts to the other, the
//! first of each (count and NCCL type), and a hash of each whole sequence in the order posted
//! (NCCL matches the sends and receives between two ranks in that order). Each rank compares
//! its sends with the peer's receives and its receives with the peer's sends; both ranks see the
//! same two headers, so both reach the same verdict, and on a mismatch neither posts the payload.

use crate::comm::datatype_name;

const MAGIC: u64 = 0x4844_4f46_4643_4b31; // "HDOFFCK1"

/// One direction of the operations between two ranks, as posted in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Side {
    /// How many operations.
    pub ops: u64,
    /// The first one: element count and NCCL type code.
    pub first: Option<(u64, u32)>,
    /// FNV-1a over every (count, type) in order.
    pub hash: u64,
}

impl Side {
    /// Appends one operation.
    pub fn push(&mut self, count: u64, dtype: u32) {
        if self.ops == 0 {
            self.first = Some((count, dtype));
            self.hash = 0xcbf2_9ce4_8422_2325;
        }
        self.ops += 1;
        for b in count.to_le_bytes().into_iter().chain(dtype.to_le_bytes()) {
            self.hash ^= u64::from(b);
            self.hash = self.hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// What one rank will do with one peer in a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// This rank's sends to the peer.
    pub sends: Side,
    /// This rank's receives from the peer.
    pub recvs: Side,
}

/// Words in an encoded header.
pub const WORDS: usize = 8;

impl Header {
    /// The header as eight u64 words, for sending.
    pub fn encode(&self) -> [u64; WORDS] {
        let first = |s: &Side| s.first.map_or((u64::MAX, u64::MAX), |(c, d)| (c, u64::from(d)));
        let (sc, sd) = first(&self.sends);
        let (rc, rd) = first(&self.recvs);
        [
            MAGIC,
            self.sends.ops | (self.recvs.ops << 32),
            sc,
            sd,
            rc,
            rd,
            self.sends.hash,
            self.recvs.hash,
        ]
    }

    /// Reads what [`Header::encode`] wrote.
    ///
    /// # Errors
    /// A description of what is wrong (not a header of this version).
    pub fn decode(w: &[u64]) -> Result<Header, String> {
        if w.len() != WORDS || w[0] != MAGIC {
            return Err(format!(
                "the peer's checked-mode header is not one this handoff version writes ({:x?}); \
                 do all ranks run the same handoff with checked mode on?",
                &w[..w.len().min(2)]
            ));
        }
        let first = |c: u64, d: u64| (c != u64::MAX).then_some((c, d as u32));
        Ok(Header {
            sends: Side {
                ops: w[1] & 0xffff_ffff,
                first: first(w[2], w[3]),
                hash: w[6],
            },
            recvs: Side {
                ops: w[1] >> 32,
                first: first(w[4], w[5]),
                hash: w[7],
            },
        })
    }
}

fn describe(s: &Side) -> String {
    match (s.ops, s.first) {
        (0, _) | (_, None) => "nothing".into(),
        (1, Some((c, d))) => format!("{c} elements of {}", datatype_name(d)),
        (n, Some((c, d))) => format!(
            "{n} operations, the first of {c} elements of {}",
            datatype_name(d)
        ),
    }
}

/// Compares this rank's header with the peer's. `Err` names both sides' values.
pub fn compare(me: usize, peer: usize, mine: &Header, theirs: &Header) -> Result<(), String> {
    let mut problems = Vec::new();
    if mine.sends != theirs.recvs {
        problems.push(format!(
            "rank {me} sends {} to rank {peer}, which receives {} from rank {me}",
            describe(&mine.sends),
            describe(&theirs.recvs)
        ));
    }
    if mine.recvs != theirs.sends {
        problems.push(format!(
            "rank {me} receives {} from rank {peer}, which sends {} to rank {me}",
            describe(&mine.recvs),
            describe(&theirs.sends)
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(ops: &[(u64, u32)]) -> Side {
        let mut s = Side::default();
        for &(c, d) in ops {
            s.push(c, d);
        }
        s
    }

    #[test]
    fn headers_round_trip() {
        let h = Header {
            sends: side(&[(4, 7), (9, 2)]),
            recvs: side(&[]),
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let e = Header::decode(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap_err();
        assert!(e.contains("checked mode"), "{e}");
    }

    #[test]
    fn matching_pair_passes() {
        let a = Header {
            sends: side(&[(4, 7)]),
            recvs: side(&[(2, 8)]),
        };
        let b = Header {
            sends: side(&[(2, 8)]),
            recvs: side(&[(4, 7)]),
        };
        assert_eq!(compare(0, 1, &a, &b), Ok(()));
        assert_eq!(compare(1, 0, &b, &a), Ok(()));
    }

    #[test]
    fn count_mismatch_names_both_values_on_both_ranks() {
        let sender = Header {
            sends: side(&[(4, 7)]),
            recvs: side(&[]),
        };
        let receiver = Header {
            sends: side(&[]),
            recvs: side(&[(3, 7)]),
        };
        let at_sender = compare(0, 1, &sender, &receiver).unwrap_err();
        assert!(
            at_sender.contains("rank 0 sends 4 elements of f32 to rank 1"),
            "{at_sender}"
        );
        assert!(at_sender.contains("receives 3 elements of f32"), "{at_sender}");
        let at_receiver = compare(1, 0, &receiver, &sender).unwrap_err();
        assert!(
            at_receiver.contains("rank 1 receives 3 elements of f32 from rank 0"),
            "{at_receiver}"
        );
        assert!(at_receiver.contains("sends 4 elements of f32"), "{at_receiver}");
    }

    #[test]
    fn type_mismatch_is_caught() {
        let sender = Header {
            sends: side(&[(4, 7)]),
            recvs: side(&[]),
        };
        let receiver = Header {
            sends: side(&[]),
            recvs: side(&[(4, 2)]),
        };
        let e = compare(0, 1, &sender, &receiver).unwrap_err();
        assert!(e.contains("f32") && e.contains("i32"), "{e}");
    }

    #[test]
    fn order_matters() {
        let sender = Header {
            sends: side(&[(4, 7), (8, 7)]),
            recvs: side(&[]),
        };
        let receiver = Header {
            sends: side(&[]),
            recvs: side(&[(8, 7), (4, 7)]),
        };
        assert!(compare(0, 1, &sender, &receiver).is_err());
    }

    #[test]
    fn a_missing_receive_is_caught() {
        let sender = Header {
            sends: side(&[(4, 7)]),
            recvs: side(&[]),
        };
        let idle = Header::default();
        let e = compare(0, 1, &sender, &idle).unwrap_err();
        assert!(e.contains("receives nothing"), "{e}");
    }
}
