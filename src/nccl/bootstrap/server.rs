//! Rank 0's id server: one acceptor thread, one thread per connection (at most
//! [`MAX_CONNECTIONS`] at once), every connection ended by its own deadline and all of them by
//! the server's.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::nccl::UniqueId;
use crate::nccl::bootstrap::wire::{self, Outcome, Ranks, Refusal, ServerSide, Timed};
use crate::nccl::bootstrap::{BootstrapOptions, Secret, deadline_after, resolve};

/// Connections served at once; one more is answered "busy" and closed, and its client retries.
pub const MAX_CONNECTIONS: usize = 64;
/// After a refusal, how long the server reads what the client still sends, so that closing does
/// not reset the connection and lose the refusal (within the connection's deadline).
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 64 * 1024;
/// The acceptor's poll interval (std has no readiness wait): the latency a new connection sees.
const POLL: Duration = Duration::from_millis(5);
/// The most ranks a job has (NCCL's rank count is an `int`).
pub(super) const MAX_WORLD: usize = i32::MAX as usize;

/// Rank 0's server of the unique id, running on a background thread until every other rank has
/// fetched the id or its deadline passes. Dropping it stops it: keep it until the communicator
/// is made, then [`IdServer::wait`] for it.
#[derive(Debug)]
#[must_use = "dropping the server stops it before the other ranks fetch the id: keep it until \
              the communicator is made, then wait for it"]
pub struct IdServer {
    addr: String,
    thread: Option<JoinHandle<Result<()>>>,
    stop: Arc<AtomicBool>,
}

impl IdServer {
    /// The address served.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Waits for the server to finish (by its deadline at the latest): `Ok` once every rank was
    /// served.
    ///
    /// # Errors
    /// [`Error::BootstrapTimeout`] when some rank never fetched the id, saying which and what
    /// the server saw instead (connections refused, and why: no secret, a wrong one, another
    /// protocol; connections cut off at their deadline).
    pub fn wait(mut self) -> Result<()> {
        let thread = self.thread.take().expect("only wait takes the thread");
        thread.join().unwrap_or_else(|_| {
            Err(Error::Bootstrap {
                addr: self.addr.clone(),
                detail: "the server thread panicked".into(),
            })
        })
    }
}

impl Drop for IdServer {
    fn drop(&mut self) {
        // Not waited for: the thread stops within one poll and closes its connections.
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Listens at `addr` now (so a port in use fails here) and serves `id` on a background thread
/// to ranks `1..world_size`, each once, until all are served or `options.timeout()` passes. Each
/// connection must finish its exchange within `options.connection_timeout()`; connections are
/// served concurrently, so none delays another. Under `options.secret()`, a client gets the id
/// only after a Noise handshake keyed by the secret (see [`bootstrap`](super)).
///
/// # Errors
/// [`Error::Bootstrap`] when the address cannot be listened on, or (under a secret) no Noise
/// handshake can be made; [`Error::InvalidArgument`] when `world_size` is 0 or more
/// than `i32::MAX`.
pub fn serve_unique_id(
    addr: &str,
    id: &UniqueId,
    world_size: usize,
    options: &BootstrapOptions,
) -> Result<IdServer> {
    if world_size == 0 || world_size > MAX_WORLD {
        return Err(Error::InvalidArgument(format!(
            "a job of {world_size} ranks: between 1 and {MAX_WORLD}"
        )));
    }
    let fail = |detail: String| Error::Bootstrap {
        addr: addr.to_string(),
        detail,
    };
    if options.secret().is_some() {
        // Each handshake draws an ephemeral key: without randomness, fail here rather than on
        // every connection.
        crate::nccl::bootstrap::noise::Handshake::initiator(b"", &[0; 32])
            .and_then(|mut h| h.write())
            .map_err(|e| fail(format!("cannot make a handshake under the secret: {e}")))?;
    }
    let deadline = deadline_after(options.timeout());
    let listener = TcpListener::bind(resolve(addr)?).map_err(|e| {
        fail(format!(
            "cannot listen: {e}{}",
            if e.kind() == io::ErrorKind::AddrInUse {
                "; another job or an earlier run holds the port: set MASTER_PORT to a free one"
            } else {
                ""
            }
        ))
    })?;
    listener.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let shared = Arc::new(Shared {
        addr: addr.to_string(),
        id: id.clone(),
        world: world_size as u32,
        secret: options.secret().cloned(),
        connection_timeout: options.connection_timeout(),
        state: Mutex::default(),
    });
    let (timeout, stop_flag) = (options.timeout(), stop.clone());
    let thread = std::thread::Builder::new()
        .name("handoff-bootstrap".into())
        .spawn(move || accept_loop(&listener, &shared, deadline, timeout, &stop_flag))
        .map_err(|e| fail(format!("cannot start a thread: {e}")))?;
    Ok(IdServer {
        addr: addr.to_string(),
        thread: Some(thread),
        stop,
    })
}

struct Shared {
    addr: String,
    id: UniqueId,
    world: u32,
    secret: Option<Secret>,
    connection_timeout: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    served: BTreeSet<u32>,
    /// Every open connection, so that the server's end closes them all.
    live: HashMap<u64, TcpStream>,
    next: u64,
    finished: bool,
    seen: Seen,
}

/// What the server saw besides ranks served, for the message when it times out.
#[derive(Default)]
struct Seen {
    not_protocol: usize,
    bad_version_or_flags: usize,
    bad_rank: usize,
    already_served: usize,
    client_lacks_secret: usize,
    server_lacks_secret: usize,
    wrong_proof: usize,
    no_randomness: usize,
    cut_off: usize,
    closed: usize,
    busy: usize,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere cannot leave the counts half-updated in a way that matters here.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn done(&self) -> bool {
        self.state().served.len() + 1 >= self.world as usize
    }

    /// Ends the connections still open: no thread outlives the server by more than a read.
    /// Each is counted as cut off, and its own outcome no more.
    fn finish(&self) {
        let mut state = self.state();
        state.finished = true;
        state.seen.cut_off += state.live.len();
        for conn in state.live.values() {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }

    /// Counts how a connection ended (unless the server has) and forgets it.
    fn forget(&self, key: u64, outcome: Outcome) {
        let mut state = self.state();
        state.live.remove(&key);
        if state.finished {
            return;
        }
        let seen = &mut state.seen;
        let n = match outcome {
            Outcome::Served(_) => return,
            Outcome::Refused(Refusal::NotProtocol) => &mut seen.not_protocol,
            Outcome::Refused(Refusal::Version(_) | Refusal::Flags(_)) => &mut seen.bad_version_or_flags,
            Outcome::Refused(Refusal::RankOutOfRange(_)) => &mut seen.bad_rank,
            Outcome::Refused(Refusal::AlreadyServed(_)) => &mut seen.already_served,
            Outcome::Refused(Refusal::ClientLacksSecret) => &mut seen.client_lacks_secret,
            Outcome::Refused(Refusal::ServerLacksSecret) => &mut seen.server_lacks_secret,
            Outcome::Refused(Refusal::WrongProof) => &mut seen.wrong_proof,
            Outcome::Refused(Refusal::NoRandomness) => &mut seen.no_randomness,
            Outcome::Dropped(io::ErrorKind::TimedOut) => &mut seen.cut_off,
            Outcome::Dropped(_) => &mut seen.closed,
        };
        *n += 1;
    }

    fn timed_out(&self, after: Duration) -> Error {
        let state = self.state();
        let expected = self.world as usize - 1;
        let fetched = state.served.len();
        let mut detail = if fetched == 0 {
            "no rank fetched the unique id".to_string()
        } else {
            format!("{fetched} of {expected} ranks fetched the unique id")
        };
        let missing: Vec<String> = (1..self.world)
            .filter(|r| !state.served.contains(r))
            .take(8)
            .map(|r| r.to_string())
            .collect();
        let more = if expected - fetched > missing.len() {
            ", ..."
        } else {
            ""
        };
        detail += &format!(" (missing: rank {}{more})", missing.join(", "));
        let s = &state.seen;
        let (var, file) = (
            crate::nccl::bootstrap::SECRET_VAR,
            crate::nccl::bootstrap::SECRET_FILE_VAR,
        );
        let notes = [
            (
                s.client_lacks_secret,
                format!("refused without the shared secret (set {var} or {file} on every rank)"),
            ),
            (
                s.server_lacks_secret,
                format!("holding a secret rank 0 lacks (set the same {var} or {file} on rank 0)"),
            ),
            (
                s.wrong_proof,
                "refused: authentication failed, a different secret".into(),
            ),
            (
                s.not_protocol,
                "refused: not the handoff bootstrap protocol".into(),
            ),
            (
                s.bad_version_or_flags,
                "refused: another handoff protocol version".into(),
            ),
            (s.bad_rank, "refused: a rank out of range".into()),
            (s.already_served, "refused: a rank already served".into()),
            (s.no_randomness, "refused: /dev/urandom could not be read".into()),
            (
                s.cut_off,
                format!(
                    "cut off unfinished at their deadline ({:?} each, or the server's)",
                    self.connection_timeout
                ),
            ),
            (s.closed, "closed by the client before the exchange ended".into()),
            (
                s.busy,
                format!("turned away busy (more than {MAX_CONNECTIONS} at once)"),
            ),
        ];
        let notes: Vec<String> = notes
            .into_iter()
            .filter(|(n, _)| *n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        if notes.is_empty() {
            detail += "; no other connection came";
        } else {
            detail += &format!("; connections: {}", notes.join("; "));
        }
        detail += &format!(
            ". Check that every rank runs and reaches {} (MASTER_ADDR and MASTER_PORT the same on every rank), \
             or raise the timeout",
            self.addr
        );
        Error::BootstrapTimeout {
            addr: self.addr.clone(),
            detail,
            after,
        }
    }
}

impl Ranks for Shared {
    fn claim(&self, rank: u32) -> bool {
        self.state().served.insert(rank)
    }
    fn release(&self, rank: u32) {
        self.state().served.remove(&rank);
    }
}

fn accept_loop(
    listener: &TcpListener,
    shared: &Arc<Shared>,
    deadline: Instant,
    timeout: Duration,
    stop: &AtomicBool,
) -> Result<()> {
    loop {
        if shared.done() || stop.load(Ordering::Relaxed) {
            shared.finish();
            break Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            shared.finish();
            break Err(shared.timed_out(timeout));
        }
        match listener.accept() {
            Ok((conn, _)) => admit(conn, shared, deadline),
            // Nothing waiting, or the process is out of descriptors for now.
            Err(_) => std::thread::sleep(POLL.min(left)),
        }
    }
}

fn admit(conn: TcpStream, shared: &Arc<Shared>, server_deadline: Instant) {
    let busy = |conn: TcpStream| {
        let _ = conn.set_nonblocking(true);
        let _ = (&conn).write(&wire::message(
            true,
            wire::BUSY,
            &format!("more than {MAX_CONNECTIONS} connections at once; try again"),
        ));
        shared.state().seen.busy += 1;
    };
    if conn.set_nonblocking(false).is_err() {
        return;
    }
    let _ = conn.set_nodelay(true);
    let key = {
        let mut state = shared.state();
        if state.live.len() >= MAX_CONNECTIONS {
            drop(state);
            return busy(conn);
        }
        let Ok(clone) = conn.try_clone() else {
            drop(state);
            return busy(conn);
        };
        let key = state.next;
        state.next += 1;
        state.live.insert(key, clone);
        key
    };
    let deadline = deadline_after(shared.connection_timeout).min(server_deadline);
    let worker = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("handoff-bootstrap-conn".into())
        .stack_size(256 * 1024)
        .spawn(move || {
            let outcome = serve_connection(&conn, &worker, deadline);
            worker.forget(key, outcome);
        });
    if spawned.is_err()
        && let Some(conn) = shared.state().live.remove(&key)
    {
        busy(conn);
    }
}

fn serve_connection(conn: &TcpStream, shared: &Shared, deadline: Instant) -> Outcome {
    let side = ServerSide {
        id: &shared.id,
        world: shared.world,
        secret: shared.secret.as_ref(),
    };
    let outcome = wire::serve(&mut Timed { conn, deadline }, &side, shared);
    if let Outcome::Refused(_) = outcome {
        // Stop writing, then read what the peer still sends (briefly, boundedly), so that the
        // close does not reset the connection before the refusal is read.
        let _ = conn.shutdown(Shutdown::Write);
        let until = deadline.min(Instant::now() + LINGER);
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < LINGER_BYTES {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
                break;
            }
            match (&mut &*conn).read(&mut sink) {
                Ok(0) => break,
                Ok(n) => drained += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }
    let _ = conn.shutdown(Shutdown::Both);
    outcome
}
