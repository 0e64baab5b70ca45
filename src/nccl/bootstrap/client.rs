//! A rank fetching the id: connects (retrying while nobody listens yet) and runs the exchange,
//! all within one deadline.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::nccl::UniqueId;
use crate::nccl::bootstrap::wire::{self, Attempt, Timed};
use crate::nccl::bootstrap::{BootstrapOptions, deadline_after, resolve};

/// Fetches the unique id for `rank` from rank 0's server at `addr`, retrying while nobody
/// listens there yet or the server is busy, all within `options.timeout()`: however a server
/// paces its bytes, this returns by then. Under `options.secret()` the id is trusted only from
/// a server that proved it holds the same secret.
///
/// # Errors
/// - [`Error::BootstrapTimeout`] when rank 0 did not hand over the id in time, saying whether
///   anything listened at `addr` and what the last attempt saw.
/// - [`Error::BootstrapAuth`] when this rank holds a secret and rank 0 none, or the reverse,
///   or the two differ (naming the variables to set).
/// - [`Error::Bootstrap`] when the server refused (a rank already served or out of range) or
///   something else answered (another program, another handoff version).
/// - [`Error::InvalidArgument`] when `rank` is 0 (rank 0 serves the id) or above `u32::MAX`.
pub fn fetch_unique_id(addr: &str, rank: usize, options: &BootstrapOptions) -> Result<UniqueId> {
    let rank = u32::try_from(rank).ok().filter(|&r| r != 0).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "rank {rank} cannot fetch the unique id: rank 0 serves it"
        ))
    })?;
    let deadline = deadline_after(options.timeout());
    let sock = resolve(addr)?;
    let secret = options.secret();
    let mut last: Option<String> = None;
    let mut refused_connection = String::from("nothing tried");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let detail = match last {
                None => format!(
                    "rank 0 never answered: nothing listened at {addr} (last: {refused_connection}); check that \
                     rank 0 runs and that MASTER_ADDR and MASTER_PORT are the same on every rank"
                ),
                Some(why) => format!(
                    "rank 0's server did not hand over the id in time (last attempt: {why}); someone else may be \
                     holding its connections, or raise the timeout"
                ),
            };
            return Err(Error::BootstrapTimeout {
                addr: addr.to_string(),
                detail,
                after: options.timeout(),
            });
        }
        match TcpStream::connect_timeout(&sock, left.min(Duration::from_secs(1))) {
            Ok(conn) => {
                let _ = conn.set_nodelay(true);
                match wire::fetch(
                    &mut Timed {
                        conn: &conn,
                        deadline,
                    },
                    addr,
                    rank,
                    secret,
                ) {
                    Ok(id) => return Ok(id),
                    Err(Attempt::Failed(e)) => return Err(e),
                    Err(Attempt::Retry(why)) => last = Some(why),
                }
            }
            Err(e) => refused_connection = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50).min(deadline.saturating_duration_since(Instant::now())));
    }
}
