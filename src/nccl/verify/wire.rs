//! What ranks tell each other to verify their operations: one [`OpDesc`] per send or receive,
//! and at creation one [`Card`] per rank. Plain data, so the CPU tests cover every encoding and
//! comparison.

use crate::nccl::types::datatype_name;

/// One send or receive as its peer must see it: NCCL matches the sends and receives between two
/// ranks in the order they were issued, and each pair must agree on element count and type
/// (see [`crate::nccl::verify::model`] for what counts as a send or a receive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct OpDesc {
    /// Elements.
    pub(crate) count: u64,
    /// `ncclDataType_t` code.
    pub(crate) dtype: u32,
    /// Captured into a graph: NCCL requires an operation to be captured on every rank of the
    /// transfer or on none.
    pub(crate) captured: bool,
    /// What NCCL's registered path depends on: [`NCCL_MEMORY`] when captured and in memory from
    /// `ncclMemAlloc`, [`REGISTERED`] when the memory is registered with the communicator.
    pub(crate) nccl_memory: u8,
    /// The [`CollKind`] code of the collective this is a per-peer part of, or [`P2P`] for a
    /// send or receive the user posted: a part paired with another kind of operation would
    /// deliver into the wrong buffer even when the sizes agree. Raw, so that a peer's unknown
    /// code compares unequal instead of failing to decode.
    pub(crate) part: u8,
}

/// [`OpDesc::part`] of a user's own send or receive.
pub(crate) const P2P: u8 = 0;

#[cfg(test)]
impl OpDesc {
    /// The tests' usual operation: a user's send or receive of `count` f32 in plain memory.
    pub(crate) fn f32_p2p(count: u64) -> OpDesc {
        OpDesc {
            part: P2P,
            count,
            dtype: 7,
            captured: false,
            nccl_memory: 0,
        }
    }
}

/// Why memory's kind is compared for captured operations: NCCL 2.28.3 registers a captured
/// transfer's buffer itself (`ncclRegisterP2pIpcBuffer`: `comm->planner.persistent &&
/// ncclParamGraphRegister()`, src/register/sendrecv_reg.cc), which succeeds for `ncclMemAlloc`
/// memory (CUDA virtual memory) and not for the stream-ordered pool's, and then moves the
/// transfer in other steps on the registered side ("We require users registering buffers on
/// both sides", src/enqueue.cc): a captured send from one kind into a receive of the other
/// would make the connection's step counts drift. The bit of a send or receive
/// ([`OpDesc::nccl_memory`]); of a collective's input (bit 0) and output (bit 1)
/// ([`CollDesc::nccl_memory`]).
pub(crate) const NCCL_MEMORY: u8 = 1;

/// Memory registered with the communicator (`ncclCommRegister`): NCCL's send/receive path then
/// takes the registered route on that side, which needs the peer's side registered too ("We
/// require users registering buffers on both sides", `addP2pToPlan` in src/enqueue.cc, not
/// checked by NCCL), so it is compared. The bit of a send or receive ([`OpDesc::nccl_memory`]);
/// of a collective's input (bit 2) and output (bit 3) ([`CollDesc::nccl_memory`]).
pub(crate) const REGISTERED: u8 = 2;

impl OpDesc {
    /// The two words of a ring entry after its tag.
    pub(crate) fn encode(self) -> [u64; 2] {
        [
            self.count,
            u64::from(self.dtype)
                | u64::from(self.captured) << 32
                | u64::from(self.nccl_memory & 3) << 33
                | u64::from(self.part) << 40,
        ]
    }

    pub(crate) fn decode(w: [u64; 2]) -> OpDesc {
        OpDesc {
            count: w[0],
            dtype: w[1] as u32,
            captured: (w[1] >> 32) & 1 == 1,
            nccl_memory: ((w[1] >> 33) & 3) as u8,
            part: (w[1] >> 40) as u8,
        }
    }

    pub(crate) fn describe(self) -> String {
        if self.part == CollKind::Replay as u8 {
            return format!(
                "the replay of a graph whose operations with this peer have digest {:016x}{:08x}",
                self.count, self.dtype
            );
        }
        let part = match self.part {
            P2P => String::new(),
            code => match CollKind::from_code(u64::from(code)) {
                Some(k) => format!(" (part of a {})", k.name()),
                None => format!(" (part of an operation of unknown code {code})"),
            },
        };
        format!(
            "{} elements of {}{part}{}{}",
            self.count,
            datatype_name(self.dtype),
            captured_note(self.captured),
            memory_note(self.nccl_memory, NCCL_MEMORY, REGISTERED, "")
        )
    }
}

/// What a description adds, after `what`, for memory whose flags `bits` have `nccl`
/// (`ncclMemAlloc` memory in a capture) or `registered` set.
fn memory_note(bits: u8, nccl: u8, registered: u8, what: &str) -> String {
    let sep = if what.is_empty() { ", " } else { " " };
    let mut s = String::new();
    if bits & nccl != 0 {
        s += &format!("{what}{sep}in ncclMemAlloc memory");
    }
    if bits & registered != 0 {
        s += &format!("{what}{sep}registered with the communicator");
    }
    s
}

/// What a description adds for an operation captured into a graph.
fn captured_note(captured: bool) -> &'static str {
    if captured { ", captured into a graph" } else { "" }
}

/// Which side of a transfer an operation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// A send to the peer.
    Send,
    /// A receive from the peer.
    Recv,
}

impl Dir {
    /// The direction the peer's side of an operation in this direction has.
    pub(crate) fn counterpart(self) -> Dir {
        match self {
            Dir::Send => Dir::Recv,
            Dir::Recv => Dir::Send,
        }
    }
}

/// Compares this rank's operation number `index` (0-based, in the order issued) with the peer's
/// counterpart; `Err` names both sides. Both ranks compare the same two entries, so both reach
/// the same verdict.
pub(crate) fn compare(
    me: usize,
    peer: usize,
    dir: Dir,
    index: u64,
    mine: OpDesc,
    theirs: OpDesc,
) -> Result<(), String> {
    if mine == theirs {
        return Ok(());
    }
    let n = index + 1;
    Err(match dir {
        Dir::Send => format!(
            "rank {me}'s send #{n} to rank {peer} is {}, but rank {peer}'s receive #{n} from rank \
             {me} is {}",
            mine.describe(),
            theirs.describe()
        ),
        Dir::Recv => format!(
            "rank {me}'s receive #{n} from rank {peer} is {}, but rank {peer}'s send #{n} to rank \
             {me} is {}",
            mine.describe(),
            theirs.describe()
        ),
    })
}

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CollKind {
    AllReduce = 1,
    Broadcast = 2,
    Reduce = 3,
    AllGather = 4,
    ReduceScatter = 5,
    AllToAll = 6,
    Gather = 7,
    Scatter = 8,
    /// Not NCCL's: the replay of a graph of a [`crate::GraphFamily`], standing for every NCCL
    /// operation captured in it (a digest of them, see [`crate::nccl::family`]); as an
    /// [`OpDesc::part`], the digest of the graph's operations with one peer in one direction.
    Replay = 9,
}

impl CollKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllGather => "all_gather",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::AllToAll => "all_to_all",
            CollKind::Gather => "gather",
            CollKind::Scatter => "scatter",
            CollKind::Replay => "graph replay",
        }
    }

    fn from_code(c: u64) -> Option<CollKind> {
        Some(match c {
            1 => CollKind::AllReduce,
            2 => CollKind::Broadcast,
            3 => CollKind::Reduce,
            4 => CollKind::AllGather,
            5 => CollKind::ReduceScatter,
            6 => CollKind::AllToAll,
            7 => CollKind::Gather,
            8 => CollKind::Scatter,
            9 => CollKind::Replay,
            _ => return None,
        })
    }
}

/// "No reduction" / "no root", in a [`CollDesc`].
pub(crate) const NONE: u32 = u32::MAX;

/// PreMulSum, in a [`CollDesc`] (NCCL's own codes for it are made per call; ranks' scalars
/// may differ, so only the kind is compared).
pub(crate) const PRE_MUL_SUM: u32 = 5;

/// One collective as every rank of the communicator must post it, in the same order: NCCL
/// leaves a disagreement on operation, count, type, root or reduction undefined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CollDesc {
    pub(crate) kind: CollKind,
    /// NCCL's count: all_reduce, broadcast and reduce its elements; all_gather each rank's part;
    /// reduce_scatter each rank's result.
    pub(crate) count: u64,
    pub(crate) dtype: u32,
    /// `ncclRedOp_t` code of a built-in reduction, [`PRE_MUL_SUM`], or [`NONE`].
    pub(crate) redop: u32,
    /// The root rank, or [`NONE`].
    pub(crate) root: u32,
    /// Captured into a graph: NCCL requires a collective to be captured on every rank or none.
    pub(crate) captured: bool,
    /// When captured, whether its input (bit 0) and output (bit 1) are `ncclMemAlloc` memory
    /// (see [`NCCL_MEMORY`]); whether they are registered with the communicator (bits 2 and 3,
    /// see [`REGISTERED`]).
    pub(crate) nccl_memory: u8,
}

impl CollDesc {
    /// An all_reduce sum of `count` `f32` elements, not captured, in plain memory: what the
    /// rehearsal and the verification tests post.
    pub(crate) fn f32_sum(count: u64) -> CollDesc {
        use crate::sys::nccl::{ncclDataType_t, ncclRedOp_t};
        CollDesc {
            kind: CollKind::AllReduce,
            count,
            dtype: ncclDataType_t::ncclFloat32.0,
            redop: ncclRedOp_t::ncclSum.0,
            root: NONE,
            captured: false,
            nccl_memory: 0,
        }
    }

    /// The three words of a ring entry after its tag.
    pub(crate) fn encode(self) -> [u64; 3] {
        [
            self.count,
            (self.kind as u64)
                | u64::from(self.captured) << 7
                | (u64::from(self.dtype) << 8)
                | (u64::from(self.redop) << 32),
            u64::from(self.root) | u64::from(self.nccl_memory & 0xf) << 32,
        ]
    }

    /// `None` for words no handoff wrote.
    pub(crate) fn decode(w: [u64; 3]) -> Option<CollDesc> {
        Some(CollDesc {
            kind: CollKind::from_code(w[1] & 0x7f)?,
            captured: (w[1] >> 7) & 1 == 1,
            nccl_memory: ((w[2] >> 32) & 0xf) as u8,
            count: w[0],
            dtype: ((w[1] >> 8) & 0xff_ffff) as u32,
            redop: (w[1] >> 32) as u32,
            root: w[2] as u32,
        })
    }

    pub(crate) fn describe(self) -> String {
        if self.kind == CollKind::Replay {
            return format!(
                "the replay of a graph whose collectives' digest is {:016x}{:08x}{:08x}",
                self.count, self.redop, self.root
            );
        }
        let mut s = format!(
            "{} of {} elements of {}",
            self.kind.name(),
            self.count,
            datatype_name(self.dtype)
        );
        if self.redop != NONE {
            s += &format!(", reduction {}", redop_name(self.redop));
        }
        if self.root != NONE {
            s += &format!(", root {}", self.root);
        }
        s += &memory_note(self.nccl_memory, 1, 4, ", input");
        s += &memory_note(self.nccl_memory, 2, 8, ", output");
        s + captured_note(self.captured)
    }
}

/// The name of an `ncclRedOp_t` code.
pub(crate) fn redop_name(code: u32) -> &'static str {
    match code {
        0 => "sum",
        1 => "prod",
        2 => "max",
        3 => "min",
        4 => "avg",
        PRE_MUL_SUM => "pre-multiplied sum",
        _ => "a custom reduction",
    }
}

/// The bit of a collective entry's third word that marks the last collective of its group.
const GROUP_END: u64 = 1 << 63;

/// A collective as a rank publishes it: what it is, and whether it ends its group's
/// collectives. A rank publishes each group's collectives in NCCL's order
/// ([`crate::nccl::verify::order::nccl_order`]), the last one marked, so equal entries mean
/// equal groups run in equal orders (see [`crate::nccl::verify::model`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CollEntry {
    pub(crate) desc: CollDesc,
    pub(crate) group_end: bool,
}

impl CollEntry {
    /// The three words of a ring entry after its tag, in the shared mailbox and on the channel
    /// alike: [`CollDesc::encode`]'s, with [`GROUP_END`] in the third (bits it leaves zero).
    pub(crate) fn encode(self) -> [u64; 3] {
        let mut w = self.desc.encode();
        if self.group_end {
            w[2] |= GROUP_END;
        }
        w
    }

    /// `None` for words no handoff wrote.
    pub(crate) fn decode(w: [u64; 3]) -> Option<CollEntry> {
        Some(CollEntry {
            desc: CollDesc::decode(w)?,
            group_end: w[2] & GROUP_END != 0,
        })
    }
}

/// Compares this rank's collective number `index` (in the order its groups run in NCCL) with
/// a peer's.
pub(crate) fn compare_coll(
    me: usize,
    peer: usize,
    index: u64,
    mine: CollEntry,
    theirs: Option<CollEntry>,
) -> Result<(), String> {
    if Some(mine) == theirs {
        return Ok(());
    }
    let n = index + 1;
    let grouping = match theirs {
        Some(t) if t.group_end != mine.group_end => {
            let (ends, not) = if mine.group_end { (me, peer) } else { (peer, me) };
            format!(
                " (rank {ends}'s ends a group of collectives, rank {not}'s does not: every rank \
                 must put the same collectives in each group, since NCCL runs a group's \
                 collectives in an order of its own, by size and kind)"
            )
        }
        _ => String::new(),
    };
    Err(format!(
        "rank {me}'s collective #{n} is {}, but rank {peer}'s collective #{n} is {}{grouping}",
        mine.desc.describe(),
        theirs.map_or_else(
            || "not one this handoff version writes".to_string(),
            |t| t.desc.describe()
        )
    ))
}

// Cards name the rank's host and its verification channel (see
// [`crate::nccl::verify::channel`]), and collective entries carry their group's end
// ([`CollEntry`]) since "HDOFFCD8": ranks of another version must not be paired with these.
const CARD_MAGIC: u64 = 0x4844_4f46_4643_4438; // "HDOFFCD8"
/// Words in an encoded card.
pub(crate) const CARD_WORDS: usize = 40;
const PATH_AT: usize = 8;
const PATH_WORDS: usize = 24;
/// The longest mailbox path a card holds.
#[cfg(test)]
pub(crate) const PATH_BYTES: usize = PATH_WORDS * 8;
const HOST_AT: usize = PATH_AT + PATH_WORDS;

/// Which kernel and mount namespace a rank runs in: two ranks may share a mailbox file only if
/// these are equal (and the file proves it, see [`crate::nccl::verify::setup`]). Zero where unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct HostId {
    /// `/proc/sys/kernel/random/boot_id`: one per boot of one kernel.
    pub(crate) boot: u128,
    /// The inode of `/proc/self/ns/mnt`: one per mount namespace of that kernel.
    pub(crate) mounts: u64,
}

impl HostId {
    /// Both known and equal: the two ranks may be on one host (the file probe decides).
    pub(crate) fn maybe_same(self, other: HostId) -> bool {
        self.boot != 0 && self.mounts != 0 && self == other
    }
}

/// What each rank tells every other when a communicator is created: whether it verifies, and
/// where its mailbox is (see [`crate::nccl::verify::mailbox`]) and its verification channel listens (see
/// [`crate::nccl::verify::channel`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Card {
    pub(crate) verified: bool,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    /// A random value also written in the mailbox, so that a peer that opens a file of the same
    /// name on another host (or a stale one) notices.
    pub(crate) token: u64,
    pub(crate) pid: u32,
    /// The mailbox file, empty when the rank has none (unverified).
    pub(crate) path: String,
    /// The rank's kernel and mount namespace.
    pub(crate) host: HostId,
    /// Where its channel listens, `None` when it has none (unverified).
    pub(crate) addr: Option<std::net::SocketAddr>,
    /// A random value a peer must prove it knows to connect to the channel (it travels only
    /// through NCCL's all-gather of the cards, never on the channel's connection).
    pub(crate) channel_token: u128,
    /// A digest of the rank's [`TUNING`] variables ([`tuning_digest`]).
    pub(crate) tuning: u64,
}

/// The `NCCL_*` variables from which each rank alone decides how a send or receive is cut into
/// steps, chunks and channels, whether its memory is registered, and which path a collective
/// takes (NCCL 2.28.3: `src/enqueue.cc`'s p2p planning, `src/init.cc`'s chunk sizes,
/// `src/graph/paths.cc`'s channels per peer, the tuner's protocol and algorithm choice, the
/// register and window switches). Two ranks that differ here cut one transfer differently, and
/// NCCL, which assumes they agree, delivers wrong data or hangs; so every rank must set the
/// same values (or leave them unset alike). Others, such as the network interface, may
/// rightly differ between hosts.
pub(crate) const TUNING: &[&str] = &[
    "NCCL_ALGO",
    "NCCL_BUFFSIZE",
    "NCCL_CHUNK_SIZE",
    "NCCL_CTA_POLICY",
    "NCCL_CUMEM_ENABLE",
    "NCCL_GRAPH_REGISTER",
    "NCCL_LL128_BUFFSIZE",
    "NCCL_LL_BUFFSIZE",
    "NCCL_LOCAL_REGISTER",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MAX_P2P_NCHANNELS",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MIN_P2P_NCHANNELS",
    "NCCL_NCHANNELS_PER_NET_PEER",
    "NCCL_NCHANNELS_PER_PEER",
    "NCCL_P2P_DIRECT_DISABLE",
    "NCCL_P2P_LL_THRESHOLD",
    "NCCL_P2P_NET_CHUNKSIZE",
    "NCCL_P2P_NVL_CHUNKSIZE",
    "NCCL_P2P_PCI_CHUNKSIZE",
    "NCCL_P2P_READ_ENABLE",
    "NCCL_P2P_USE_CUDA_MEMCPY",
    "NCCL_PROTO",
    "NCCL_WIN_ENABLE",
    CTA_POLICY_OPTION,
];

/// In [`TUNING`], the communicator's own CTA policy ([`crate::CommOptions::with_cta_policy`]),
/// which NCCL's environment variable overrides and which decides CTAs as the variable does.
pub(crate) const CTA_POLICY_OPTION: &str = "CommOptions::with_cta_policy";

/// A digest of the [`TUNING`] variables as `var` reads them (the process environment, where
/// NCCL has also put what its configuration files set): FNV-1a over each name and value, an
/// unset variable hashed apart from an empty one.
pub(crate) fn tuning_digest(var: impl Fn(&str) -> Option<String>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for name in TUNING {
        eat(name.as_bytes());
        match var(name) {
            Some(v) => {
                eat(b"=");
                eat(v.as_bytes());
            }
            None => eat(b"-"),
        }
        eat(b"\0");
    }
    h
}

fn split128(v: u128) -> [u64; 2] {
    [v as u64, (v >> 64) as u64]
}

fn join128(w: &[u64]) -> u128 {
    u128::from(w[0]) | (u128::from(w[1]) << 64)
}

impl Card {
    /// The card as words, for an all-gather.
    ///
    /// # Errors
    /// The path is too long to fit.
    pub(crate) fn encode(&self) -> Result<[u64; CARD_WORDS], String> {
        let bytes = self.path.as_bytes();
        if bytes.len() > PATH_WORDS * 8 {
            return Err(format!(
                "the mailbox path {} is longer than {} bytes; set TMPDIR to a shorter folder",
                self.path,
                PATH_WORDS * 8
            ));
        }
        let mut w = [0u64; CARD_WORDS];
        w[0] = CARD_MAGIC;
        w[1] = u64::from(self.verified);
        w[2] = u64::from(self.rank) | (u64::from(self.world) << 32);
        w[3] = self.token;
        w[4] = u64::from(self.pid);
        w[5] = bytes.len() as u64;
        w[6] = self.tuning;
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            w[PATH_AT + i] = u64::from_le_bytes(b);
        }
        let h = HOST_AT;
        w[h..h + 2].copy_from_slice(&split128(self.host.boot));
        w[h + 2] = self.host.mounts;
        w[h + 3..h + 5].copy_from_slice(&split128(self.channel_token));
        match self.addr {
            None => {}
            Some(std::net::SocketAddr::V4(a)) => {
                w[h + 5] = 4 | u64::from(a.port()) << 8;
                w[h + 6] = u64::from(a.ip().to_bits());
            }
            Some(std::net::SocketAddr::V6(a)) => {
                w[h + 5] = 6 | u64::from(a.port()) << 8;
                w[h + 6..h + 8].copy_from_slice(&split128(a.ip().to_bits()));
            }
        }
        Ok(w)
    }

    /// Reads what [`Card::encode`] wrote.
    ///
    /// # Errors
    /// Not a card of this handoff version.
    pub(crate) fn decode(w: &[u64]) -> Result<Card, String> {
        let refused = || {
            format!(
                "a peer's communicator card is not one this handoff version writes ({:x?}); do \
                 all ranks run the same handoff?",
                &w[..w.len().min(2)]
            )
        };
        if w.len() != CARD_WORDS || w[0] != CARD_MAGIC || w[1] > 1 || w[5] as usize > PATH_WORDS * 8 {
            return Err(refused());
        }
        let h = HOST_AT;
        let addr = match (w[h + 5] & 0xff, w[h + 5] >> 24, w[h + 5] >> 8 & 0xffff) {
            (0, 0, 0) if w[h + 6] == 0 && w[h + 7] == 0 => None,
            (4, 0, port) if w[h + 6] >> 32 == 0 && w[h + 7] == 0 => Some(std::net::SocketAddr::from((
                std::net::Ipv4Addr::from_bits(w[h + 6] as u32),
                port as u16,
            ))),
            (6, 0, port) => Some(std::net::SocketAddr::from((
                std::net::Ipv6Addr::from_bits(join128(&w[h + 6..h + 8])),
                port as u16,
            ))),
            _ => return Err(refused()),
        };
        let mut bytes: Vec<u8> = w[PATH_AT..PATH_AT + PATH_WORDS]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        bytes.truncate(w[5] as usize);
        Ok(Card {
            verified: w[1] == 1,
            rank: w[2] as u32,
            world: (w[2] >> 32) as u32,
            token: w[3],
            pid: w[4] as u32,
            path: String::from_utf8(bytes).map_err(|e| format!("a peer's mailbox path: {e}"))?,
            host: HostId {
                boot: join128(&w[h..h + 2]),
                mounts: w[h + 2],
            },
            addr,
            channel_token: join128(&w[h + 3..h + 5]),
            tuning: w[6],
        })
    }
}

/// Checks that every rank's card agrees with this rank's on what must be the same everywhere.
///
/// # Errors
/// Which ranks disagree, and on what.
pub(crate) fn check_cards(me: usize, cards: &[Card]) -> Result<(), String> {
    let world = cards.len();
    for (r, c) in cards.iter().enumerate() {
        if c.rank as usize != r || c.world as usize != world {
            return Err(format!(
                "rank {r}'s card says rank {} of {}, in a communicator of {world}",
                c.rank, c.world
            ));
        }
    }
    if let Some(r) = (0..world).find(|&r| cards[r].tuning != cards[me].tuning) {
        return Err(format!(
            "rank {r}'s NCCL tuning variables differ from rank {me}'s: every rank must set the same \
             values of {} (or leave them unset alike), or NCCL cuts a transfer differently on the \
             two sides and delivers wrong data or hangs",
            TUNING.join(", ")
        ));
    }
    let verified: Vec<usize> = (0..world).filter(|&r| cards[r].verified).collect();
    if !verified.is_empty() && verified.len() != world {
        let unverified: Vec<usize> = (0..world).filter(|&r| !cards[r].verified).collect();
        return Err(format!(
            "ranks {verified:?} verify their operations but ranks {unverified:?} do not (this is \
             rank {me}); every rank must be created with the same setting, or a verifying rank's \
             checks would never be answered"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: u32 = 7;
    const I32: u32 = 2;

    fn op(count: u64, dtype: u32) -> OpDesc {
        OpDesc {
            count,
            dtype,
            captured: false,
            nccl_memory: 0,
            part: P2P,
        }
    }

    #[test]
    fn ops_round_trip() {
        let o = op(4_194_304, F32);
        assert_eq!(OpDesc::decode(o.encode()), o);
        let c = OpDesc { captured: true, ..o };
        assert_eq!(OpDesc::decode(c.encode()), c);
        let g = OpDesc {
            part: CollKind::Gather as u8,
            ..c
        };
        assert_eq!(OpDesc::decode(g.encode()), g);
    }

    #[test]
    fn captured_transfers_between_kinds_of_memory_are_a_mismatch() {
        let pool = OpDesc {
            captured: true,
            ..op(4, F32)
        };
        let vmm = OpDesc {
            nccl_memory: NCCL_MEMORY,
            ..pool
        };
        assert_eq!(OpDesc::decode(vmm.encode()), vmm);
        let e = compare(0, 1, Dir::Send, 0, vmm, pool).unwrap_err();
        assert!(e.contains("in ncclMemAlloc memory, but"), "{e}");
        let registered = OpDesc {
            nccl_memory: NCCL_MEMORY | REGISTERED,
            ..pool
        };
        assert_eq!(OpDesc::decode(registered.encode()), registered);
        let e = compare(0, 1, Dir::Recv, 0, pool, registered).unwrap_err();
        assert!(
            e.ends_with("in ncclMemAlloc memory, registered with the communicator"),
            "{e}"
        );
        let c = CollDesc {
            kind: CollKind::Gather,
            count: 4,
            dtype: F32,
            redop: NONE,
            root: 1,
            captured: true,
            nccl_memory: 3,
        };
        assert_eq!(CollDesc::decode(c.encode()), Some(c));
        assert!(
            c.describe()
                .contains("input in ncclMemAlloc memory, output in ncclMemAlloc memory")
        );
    }

    #[test]
    fn a_send_paired_with_a_collectives_part_is_a_mismatch_even_of_one_size() {
        let part = OpDesc {
            part: CollKind::Gather as u8,
            ..op(4, F32)
        };
        let e = compare(1, 0, Dir::Send, 0, op(4, F32), part).unwrap_err();
        assert!(
            e.contains("is 4 elements of f32, but") && e.ends_with("is 4 elements of f32 (part of a gather)"),
            "{e}"
        );
        let odd = OpDesc { part: 200, ..part };
        assert!(
            compare(1, 0, Dir::Send, 0, part, odd)
                .unwrap_err()
                .contains("unknown code 200")
        );
    }

    #[test]
    fn an_op_captured_on_one_rank_only_is_a_mismatch() {
        let c = OpDesc {
            captured: true,
            nccl_memory: 0,
            ..op(4, F32)
        };
        let e = compare(0, 1, Dir::Send, 0, c, op(4, F32)).unwrap_err();
        assert!(
            e.contains("is 4 elements of f32, captured into a graph, but")
                && e.ends_with("is 4 elements of f32"),
            "{e}"
        );
    }

    #[test]
    fn matching_ops_pass_on_both_sides() {
        assert_eq!(compare(0, 1, Dir::Send, 0, op(4, F32), op(4, F32)), Ok(()));
        assert_eq!(compare(1, 0, Dir::Recv, 0, op(4, F32), op(4, F32)), Ok(()));
    }

    #[test]
    fn count_mismatch_names_both_sides_on_both_ranks() {
        // Issue 9's case: a send of n matched with a receive of 3n/4.
        let at_sender = compare(0, 1, Dir::Send, 2, op(4_194_304, F32), op(3_145_728, F32)).unwrap_err();
        assert!(
            at_sender.contains("rank 0's send #3 to rank 1 is 4194304 elements of f32")
                && at_sender.contains("rank 1's receive #3 from rank 0 is 3145728 elements of f32"),
            "{at_sender}"
        );
        let at_receiver = compare(1, 0, Dir::Recv, 2, op(3_145_728, F32), op(4_194_304, F32)).unwrap_err();
        assert!(
            at_receiver.contains("rank 1's receive #3 from rank 0 is 3145728 elements of f32"),
            "{at_receiver}"
        );
    }

    #[test]
    fn type_mismatch_is_caught() {
        let e = compare(0, 1, Dir::Send, 0, op(4, F32), op(4, I32)).unwrap_err();
        assert!(e.contains("f32") && e.contains("i32"), "{e}");
    }

    #[test]
    fn collectives_round_trip_and_every_field_counts() {
        let d = CollDesc {
            kind: CollKind::Reduce,
            count: 1001,
            dtype: F32,
            redop: 2,
            root: 1,
            captured: false,
            nccl_memory: 0,
        };
        assert_eq!(CollDesc::decode(d.encode()), Some(d));
        assert_eq!(CollDesc::decode([0, 0, 0]), None);
        let e = |desc| CollEntry {
            desc,
            group_end: true,
        };
        assert_eq!(compare_coll(0, 1, 0, e(d), Some(e(d))), Ok(()));
        let others = [
            CollDesc {
                kind: CollKind::AllReduce,
                root: NONE,
                captured: false,
                nccl_memory: 0,
                ..d
            },
            CollDesc { count: 1000, ..d },
            CollDesc { dtype: I32, ..d },
            CollDesc { redop: 0, ..d },
            CollDesc { root: 0, ..d },
            CollDesc { captured: true, ..d },
        ];
        for o in others {
            let e = compare_coll(0, 1, 4, e(d), Some(e(o))).unwrap_err();
            assert!(
                e.contains("rank 0's collective #5 is reduce of 1001 elements of f32, reduction max, root 1"),
                "{e}"
            );
            assert!(e.contains("rank 1's collective #5 is"), "{e}");
        }
        assert!(
            compare_coll(0, 1, 0, e(d), None)
                .unwrap_err()
                .contains("not one this handoff")
        );
        // PreMulSum against a plain sum is a mismatch, named.
        let pre = CollDesc {
            redop: PRE_MUL_SUM,
            ..d
        };
        let e = compare_coll(0, 1, 0, e(pre), Some(e(CollDesc { redop: 0, ..d }))).unwrap_err();
        assert!(
            e.contains("reduction pre-multiplied sum") && e.contains("reduction sum"),
            "{e}"
        );
    }

    #[test]
    fn a_group_end_travels_with_its_entry_and_counts() {
        let d = CollDesc::f32_sum(16);
        for group_end in [false, true] {
            let e = CollEntry { desc: d, group_end };
            assert_eq!(CollEntry::decode(e.encode()), Some(e));
        }
        let end = CollEntry {
            desc: d,
            group_end: true,
        };
        let more = CollEntry {
            desc: d,
            group_end: false,
        };
        let e = compare_coll(0, 1, 0, end, Some(more)).unwrap_err();
        assert!(
            e.contains("rank 0's ends a group of collectives, rank 1's does not"),
            "{e}"
        );
        let e = compare_coll(1, 0, 0, more, Some(end)).unwrap_err();
        assert!(
            e.contains("rank 0's ends a group of collectives, rank 1's does not"),
            "{e}"
        );
    }

    #[test]
    fn cards_round_trip_and_reject_garbage() {
        let c = Card {
            verified: true,
            rank: 3,
            world: 8,
            token: 0xdead_beef_1234,
            pid: 4242,
            path: "/dev/shm/handoff-4242-abc-r3".into(),
            host: HostId {
                boot: 0x1234_5678_9abc_def0_1122_3344_5566_7788,
                mounts: 4026531832,
            },
            addr: Some("10.77.0.1:47001".parse().unwrap()),
            channel_token: u128::MAX - 5,
            tuning: 0x5eed_0001,
        };
        assert_eq!(Card::decode(&c.encode().unwrap()).unwrap(), c);
        let e = Card::decode(&[1; CARD_WORDS]).unwrap_err();
        assert!(e.contains("same handoff"), "{e}");
        let long = Card {
            path: "x".repeat(400),
            ..c
        };
        assert!(long.encode().is_err());
        for addr in [None, Some("[fe80::1]:9".parse().unwrap())] {
            let c = Card { addr, ..c.clone() };
            assert_eq!(Card::decode(&c.encode().unwrap()).unwrap(), c);
        }
        // An address family or port word no handoff writes.
        let mut w = c.encode().unwrap();
        w[HOST_AT + 5] |= 1 << 40;
        assert!(Card::decode(&w).is_err());
    }

    fn card(rank: u32, world: u32, verified: bool) -> Card {
        Card {
            verified,
            rank,
            world,
            token: 1,
            pid: 1,
            ..Card::default()
        }
    }

    #[test]
    fn ranks_must_agree_on_nccls_tuning_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let none = tuning_digest(env(&[]));
        let chunk = tuning_digest(env(&[("NCCL_P2P_NVL_CHUNKSIZE", "131072")]));
        let empty = tuning_digest(env(&[("NCCL_P2P_NVL_CHUNKSIZE", "")]));
        let other = tuning_digest(env(&[("NCCL_SOCKET_IFNAME", "eth1")]));
        assert_ne!(none, chunk);
        assert_ne!(none, empty, "an empty value is not an unset one");
        assert_eq!(none, other, "the network interface may differ between hosts");
        let cta = tuning_digest(env(&[(CTA_POLICY_OPTION, "2")]));
        assert_ne!(
            none, cta,
            "the communicator's CTA policy counts as the variable does"
        );
        let with = |tuning| Card {
            tuning,
            ..card(0, 2, true)
        };
        let agree = [
            with(chunk),
            Card {
                rank: 1,
                ..with(chunk)
            },
        ];
        assert_eq!(check_cards(0, &agree), Ok(()));
        let differ = [
            with(none),
            Card {
                rank: 1,
                ..with(chunk)
            },
        ];
        for me in 0..2 {
            let e = check_cards(me, &differ).unwrap_err();
            assert!(
                e.contains("tuning variables differ") && e.contains("NCCL_P2P_NVL_CHUNKSIZE"),
                "{e}"
            );
        }
    }

    #[test]
    fn ranks_must_agree_on_verification() {
        // Hole 2 of issue 9: a checked and an unchecked rank would misread each other's traffic.
        let agree = [card(0, 2, true), card(1, 2, true)];
        assert_eq!(check_cards(0, &agree), Ok(()));
        let off = [card(0, 2, false), card(1, 2, false)];
        assert_eq!(check_cards(1, &off), Ok(()));
        let mixed = [card(0, 2, true), card(1, 2, false)];
        let e = check_cards(0, &mixed).unwrap_err();
        assert!(
            e.contains("ranks [0] verify") && e.contains("ranks [1] do not"),
            "{e}"
        );
        let wrong_rank = [card(0, 2, true), card(0, 2, true)];
        assert!(check_cards(0, &wrong_rank).is_err());
    }
}
