//! This process's TCP connections as the kernel counts them: every socket among
//! `/proc/self/fd`, asked for `TCP_INFO` (Linux 4.19 or newer for every field read here). What
//! the verification channel sends is counted from outside the crate, on the wire: the channel
//! exposes no counter, and a count kept by the code it measures could agree with that code's
//! mistakes.

/// Sums over this process's TCP connections (listening sockets left out).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tcp {
    /// Connections established now.
    pub established: u64,
    /// Segments that carried data, sent and received, the kernel's retransmissions included: on
    /// a connection with `TCP_NODELAY`, one per send call of a few hundred bytes (a record of
    /// the channel, or a flush of several).
    pub data_segs_out: u64,
    pub data_segs_in: u64,
    /// Of `data_segs_out`, the kernel's retransmissions: over loopback, tail-loss probes that
    /// fire before the peer's delayed acknowledgement (a few milliseconds against 40).
    pub retrans_segs: u64,
    /// Every segment, acknowledgements and the TCP handshake's included.
    pub segs_out: u64,
    pub segs_in: u64,
    /// Payload bytes sent (retransmissions included), of them retransmitted, and received (each
    /// byte once).
    pub bytes_sent: u64,
    pub bytes_retrans: u64,
    pub bytes_received: u64,
}

impl Tcp {
    /// What changed from `before` to `self` (connections: those established now).
    pub fn since(self, before: Tcp) -> Tcp {
        Tcp {
            established: self.established,
            data_segs_out: self.data_segs_out - before.data_segs_out,
            data_segs_in: self.data_segs_in - before.data_segs_in,
            segs_out: self.segs_out - before.segs_out,
            segs_in: self.segs_in - before.segs_in,
            retrans_segs: self.retrans_segs - before.retrans_segs,
            bytes_sent: self.bytes_sent - before.bytes_sent,
            bytes_retrans: self.bytes_retrans - before.bytes_retrans,
            bytes_received: self.bytes_received - before.bytes_received,
        }
    }

    /// Data segments sent once: what the sender's calls made, without the kernel's repeats.
    pub fn sent_once(&self) -> u64 {
        self.data_segs_out - self.retrans_segs
    }

    /// Payload bytes sent once.
    pub fn bytes_once(&self) -> u64 {
        self.bytes_sent - self.bytes_retrans
    }
}

const IPPROTO_TCP: i32 = 6;
const TCP_INFO: i32 = 11;
const TCP_LISTEN: u8 = 10;
const TCP_ESTABLISHED: u8 = 1;
/// `struct tcp_info` up to and including `tcpi_bytes_retrans` (linux/tcp.h).
const INFO_BYTES: usize = 216;

unsafe extern "C" {
    /// POSIX `getsockopt`.
    fn getsockopt(fd: i32, level: i32, name: i32, value: *mut u8, len: *mut u32) -> i32;
}

fn u32_at(b: &[u8], at: usize) -> u64 {
    u64::from(u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes")))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The sum over this process's TCP sockets, each counted once however many descriptors it has
/// (the channel reads and writes a connection through two).
///
/// # Panics
/// `/proc/self/fd` cannot be read, or the kernel's `tcp_info` is older than the fields read.
pub fn tcp() -> Tcp {
    let mut seen = std::collections::HashSet::new();
    let mut sum = Tcp::default();
    for entry in std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd") {
        let Ok(entry) = entry else { continue };
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // A descriptor closed since the listing is no longer a socket, or another one.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        let Some(inode) = target.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) else {
            continue;
        };
        if !seen.insert(inode.to_owned()) {
            continue;
        }
        let mut b = [0u8; 256];
        let mut len = b.len() as u32;
        // SAFETY: `b` is valid for writes of `len` bytes and `len` for a write of its own; a
        // descriptor that is not a TCP socket (or no longer open) fails the call, which is
        // skipped.
        if unsafe { getsockopt(fd, IPPROTO_TCP, TCP_INFO, b.as_mut_ptr(), &mut len) } != 0 {
            continue;
        }
        assert!(
            len as usize >= INFO_BYTES,
            "tcp_info of {len} bytes: a kernel older than 4.19 lacks tcpi_bytes_retrans"
        );
        if b[0] == TCP_LISTEN {
            continue;
        }
        sum.established += u64::from(b[0] == TCP_ESTABLISHED);
        sum.retrans_segs += u32_at(&b, 100);
        sum.bytes_received += u64_at(&b, 128);
        sum.segs_out += u32_at(&b, 136);
        sum.segs_in += u32_at(&b, 140);
        sum.data_segs_in += u32_at(&b, 152);
        sum.data_segs_out += u32_at(&b, 156);
        sum.bytes_sent += u64_at(&b, 200);
        sum.bytes_retrans += u64_at(&b, 208);
    }
    sum
}
