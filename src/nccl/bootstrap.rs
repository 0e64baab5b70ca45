//! Starting separate processes as ranks of one communicator: reading the launcher's variables
//! and sharing the [`UniqueId`] over TCP.
//!
//! Rank 0 makes the id and serves it at `MASTER_ADDR:MASTER_PORT`; every other rank connects
//! (retrying until its timeout, so start order does not matter), says which rank it is, and
//! fetches it. NCCL then carries all traffic itself, so the same code spans machines.
//!
//! # Launchers
//! [`Launch::from_env`] reads, in this order: torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`;
//! Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; Open MPI's `OMPI_COMM_WORLD_RANK`,
//! `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`. The address always comes from
//! `MASTER_ADDR` and `MASTER_PORT` (torchrun sets them; under Slurm or mpirun, export them), the
//! port from `HANDOFF_PORT` instead where it is set: torchrun's own store already listens on
//! `MASTER_PORT` on rank 0's host. The job's shared secret, if any, comes from
//! `HANDOFF_SECRET` (the secret as text) or `HANDOFF_SECRET_FILE` (a file holding it, mode
//! 0600); see [`Secret`].
//!
//! # Bounds
//! The server has one deadline for the whole exchange (the timeout given to
//! [`Launch::unique_id`], [`serve_unique_id`]) and each connection its own
//! ([`BootstrapOptions::connection_timeout`], 5 s by default, within the server's): hello,
//! authentication and id together, however slowly a client sends its bytes. Connections are
//! served concurrently (up to [`MAX_CONNECTIONS`] at once), so an idle, slow or garbled
//! connection delays no other. Each rank `1..world` is served once: a rank already served, or
//! out of range, is refused. [`fetch_unique_id`] keeps to its own timeout the same way, however
//! a server paces its bytes.
//!
//! # Authentication
//! With a secret on every rank, the exchange runs the Noise protocol
//! `Noise_NNpsk0_25519_ChaChaPoly_SHA256` (the `snow` crate; see `noise.rs`), its pre-shared key
//! derived from the secret and its prologue the clear hello (version, flags, rank): the
//! client's first message proves it holds the secret, the server's answer proves the server
//! does, the client's confirmation that it is live in this handshake (not a replay), and only
//! then is the rank claimed and the id sent, encrypted and authenticated under keys from fresh
//! ephemeral keys and the secret (forward secrecy). The secret never crosses the wire, and nor
//! does the id in the clear. A secret on one side only, or two different ones, is
//! [`Error::BootstrapAuth`] on the rank (naming what to set) and counted in rank 0's
//! [`Error::BootstrapTimeout`].
//!
//! What someone who can connect to the port can still do:
//! - Without a secret: fetch the id (all NCCL needs to join the job as a rank), and so take a
//!   rank's place (the real rank is then refused: "rank r has already fetched the id"); hold
//!   connections open to deny service until the server's deadline.
//! - With a secret: deny service until the deadline, by keeping [`MAX_CONNECTIONS`]
//!   connections open (each cut off at its own deadline, then opened again); nothing else.
//!   They learn nothing about the secret or the id, and a rank's place cannot be taken.
//! - Either way, handoff does not authenticate NCCL's own sockets: anyone who learns the id
//!   otherwise, or who can reach NCCL's ports, is NCCL's concern.
//!
//! # Wire format (version 3)
//! The client sends 13 bytes: `HNDOFF`, 0, version, flags (bit 0: it holds a secret) and its
//! rank (u32, big-endian), then, with the flag, the first Noise message (48 bytes). The server
//! answers `HNDOFF`, 0, its version, and a status byte: 0 and the 128 id bytes (no secret); 2
//! and the second Noise message (under a secret; the client then sends its 16-byte
//! confirmation, and the server a status byte again: 0 and the sealed id, 144 bytes, or a
//! refusal); or a refusal (1; 3 "busy, try again"; 4 authentication), a big-endian u16 length
//! and a UTF-8 message. A connection that sends anything else gets the refusal and is closed;
//! the server keeps serving the others. Versions 1 and 2 have the same header and refusal, so a
//! rank of either version is told the other's version.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::engine::device::Device;
use crate::error::{Error, Result};
use crate::nccl::{CommOptions, Communicator, UniqueId};

mod client;
mod local;
pub(crate) mod noise;
pub(crate) mod secret;
mod server;
mod wire;

pub use client::fetch_unique_id;
pub use local::{GpuSharing, JobExit, LocalJob, RankExit, SHARE_GPUS_VAR, spawn_local, spawn_local_with};
pub use secret::{SECRET_FILE_VAR, SECRET_VAR, Secret};
pub use server::{IdServer, MAX_CONNECTIONS, serve_unique_id};
pub use wire::PROTOCOL_VERSION;

/// The deadline and the secret of one id exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapOptions {
    timeout: Duration,
    connection_timeout: Duration,
    secret: Option<Secret>,
}

impl BootstrapOptions {
    /// Each connection's deadline unless set otherwise.
    pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

    /// No secret; the whole exchange within `timeout`, each connection within
    /// [`BootstrapOptions::DEFAULT_CONNECTION_TIMEOUT`] of it.
    pub fn new(timeout: Duration) -> BootstrapOptions {
        BootstrapOptions {
            timeout,
            connection_timeout: Self::DEFAULT_CONNECTION_TIMEOUT,
            secret: None,
        }
    }

    /// The id goes only to clients proving they hold `secret` (server), and is taken only from a
    /// server proving it (client).
    pub fn with_secret(mut self, secret: Secret) -> BootstrapOptions {
        self.secret = Some(secret);
        self
    }

    /// How long one connection may take on the server, from its accept to the id sent (within
    /// the server's own timeout); after that it is closed.
    pub fn with_connection_timeout(mut self, timeout: Duration) -> BootstrapOptions {
        self.connection_timeout = timeout;
        self
    }

    /// The whole exchange's deadline: the server's, or a client's to fetch the id.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// One connection's deadline on the server.
    pub fn connection_timeout(&self) -> Duration {
        self.connection_timeout
    }

    /// The shared secret, if any.
    pub fn secret(&self) -> Option<&Secret> {
        self.secret.as_ref()
    }
}

/// `timeout` from now, or far in the future when that is past what an `Instant` holds.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(u32::MAX.into())))
        .unwrap_or(now)
}

/// Where this process sits in a multi-process job, as its launcher described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes (ranks).
    pub world_size: usize,
    /// This process's index on its machine: which GPU it takes.
    pub local_rank: usize,
    /// `MASTER_ADDR:MASTER_PORT`, where rank 0 serves the unique id.
    pub master: String,
    /// Which launcher's variables were read: `torchrun`, `slurm` or `openmpi`.
    pub launcher: &'static str,
    /// The job's shared secret (`HANDOFF_SECRET` or `HANDOFF_SECRET_FILE`), proving the ranks
    /// to each other in the id exchange; `None`: anyone who reaches `master` can fetch the id.
    pub secret: Option<Secret>,
    /// `HANDOFF_SHARE_GPUS=1`: the ranks of this machine share its GPUs, each process with an
    /// NCCL host id of its own (see [`spawn_local_with`]); rank `r` takes GPU
    /// `local_rank % count`.
    pub share_gpus: bool,
}

const LAUNCHERS: &[(&str, &str, &str, &str)] = &[
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
];

impl Launch {
    /// Reads the launcher variables of this process; `Ok(None)` when none are set.
    ///
    /// With `HANDOFF_SHARE_GPUS=1` (ranks sharing GPUs, e.g.
    /// `HANDOFF_SHARE_GPUS=1 torchrun --nproc_per_node=4 ...` on one GPU), it also gives this
    /// process the NCCL variables that mode needs (an `NCCL_HOSTID` of its own; NCCL's socket
    /// transport over loopback unless `NCCL_NET` and `NCCL_SOCKET_IFNAME` are set), which NCCL
    /// reads once, at its first call: call it first thing in `main`, before other threads or
    /// NCCL start. Rank 0 says once on stderr that this is a development mode.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the variable that is malformed or missing, a secret
    /// that cannot be used (see [`Secret::from_env`]), or, with `HANDOFF_SHARE_GPUS=1`, NCCL
    /// variables it cannot set safely any more (NCCL already open, or other threads running):
    /// the message names what to export instead.
    pub fn from_env() -> Result<Option<Launch>> {
        // A value that is not UTF-8 is read (with replacement characters) and then rejected,
        // never taken for an unset variable.
        let launch = Self::from_vars(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()))?;
        if let Some(l) = launch.as_ref().filter(|l| l.share_gpus) {
            local::apply(l.rank)?;
        }
        Ok(launch)
    }

    /// As [`Launch::from_env`], reading variables through `var` (for tests, or a launcher of
    /// your own). Each variable is read once.
    ///
    /// # Errors
    /// As [`Launch::from_env`].
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let Some((launcher, (rank_var, rank), (size_var, size), local)) =
            LAUNCHERS
                .iter()
                .find_map(|&(launcher, r, s, l)| match (var(r), var(s)) {
                    (Some(rank), Some(size)) => Some((launcher, (r, rank), (s, size), (l, var(l)))),
                    _ => None,
                })
        else {
            return Ok(None);
        };
        let num = |name: &str, v: &str| -> Result<usize> {
            v.trim().parse::<usize>().map_err(|_| {
                Error::InvalidArgument(format!("{name}={v:?} ({launcher}) is not a whole number"))
            })
        };
        let rank_n = num(rank_var, &rank)?;
        let world_size = num(size_var, &size)?;
        if world_size == 0 || rank_n >= world_size {
            return Err(Error::InvalidArgument(format!(
                "{rank_var}={rank_n} and {size_var}={world_size} ({launcher}): the rank must be below the size"
            )));
        }
        if world_size > server::MAX_WORLD {
            return Err(Error::InvalidArgument(format!(
                "{size_var}={world_size} ({launcher}): NCCL takes at most {} ranks",
                server::MAX_WORLD
            )));
        }
        let local_rank = match &local.1 {
            Some(v) => num(local.0, v)?,
            None => rank_n,
        };
        // torchrun's own store listens on MASTER_PORT on rank 0's host: HANDOFF_PORT names
        // another port for the id.
        let port = var("HANDOFF_PORT")
            .map(|p| ("HANDOFF_PORT", p))
            .or_else(|| var("MASTER_PORT").map(|p| ("MASTER_PORT", p)));
        let master = match (var("MASTER_ADDR"), port) {
            (Some(a), Some((name, p))) => {
                let port: u16 = p
                    .trim()
                    .parse()
                    .map_err(|_| Error::InvalidArgument(format!("{name}={p:?} is not a port number")))?;
                let host = a.trim();
                if host.is_empty() {
                    return Err(Error::InvalidArgument(
                        "MASTER_ADDR is empty: set it to rank 0's host".into(),
                    ));
                }
                // An IPv6 address takes brackets before the port.
                if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                }
            }
            _ if world_size == 1 => String::new(),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "{launcher} set {rank_var} and {size_var} but MASTER_ADDR and MASTER_PORT are \
                     not both set: export them (rank 0's host and a free port) so the ranks can \
                     share the NCCL unique id"
                )));
            }
        };
        Ok(Some(Launch {
            rank: rank_n,
            world_size,
            local_rank,
            master,
            launcher,
            secret: Secret::from_vars(&var)?,
            share_gpus: local::parse_share(var(SHARE_GPUS_VAR).as_deref())?,
        }))
    }

    /// The options of this launch's id exchange: `timeout`, and its secret.
    pub fn bootstrap_options(&self, timeout: Duration) -> BootstrapOptions {
        let options = BootstrapOptions::new(timeout);
        match &self.secret {
            Some(s) => options.with_secret(s.clone()),
            None => options,
        }
    }

    /// Shares a unique id among the launch's ranks: rank 0 makes it and serves it in the
    /// background until every other rank has fetched it or `timeout` passes; the others fetch
    /// it within `timeout`. With one rank, nothing is served. Rank 0 keeps the returned server
    /// until its communicator is made (dropping it stops serving), then waits for it.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] (port in use, unreachable address, a peer speaking another
    /// protocol, a refusal), [`Error::BootstrapAuth`] (the secret is missing on one side or
    /// differs), [`Error::BootstrapTimeout`] (rank 0 never answered), NCCL errors from making
    /// the id.
    pub fn unique_id(&self, timeout: Duration) -> Result<(UniqueId, Option<IdServer>)> {
        let options = self.bootstrap_options(timeout);
        if self.rank == 0 {
            let id = UniqueId::new()?;
            let server = if self.world_size > 1 {
                Some(serve_unique_id(&self.master, &id, self.world_size, &options)?)
            } else {
                None
            };
            Ok((id, server))
        } else {
            Ok((fetch_unique_id(&self.master, self.rank, &options)?, None))
        }
    }

    /// The GPU this rank takes: `local_rank` of those visible, or with
    /// [`share_gpus`](Launch::share_gpus), `local_rank` modulo their count.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when that GPU is not visible (or none is); CUDA errors.
    pub fn device(&self) -> Result<Device> {
        local::rank_device(self.local_rank, self.share_gpus)
    }

    /// This process's communicator on [`Launch::device`]: see [`Launch::communicator_on`].
    ///
    /// # Errors
    /// As [`Launch::device`] and [`Launch::communicator_on`].
    pub fn communicator(&self, options: CommOptions) -> Result<Communicator> {
        self.communicator_on(&self.device()?, options)
    }

    /// This process's communicator on `device`, a GPU the program picked: the id shared through
    /// [`Launch::unique_id`] (within `options.timeout`), made with `options`. Two ranks on one
    /// GPU need [`share_gpus`](Launch::share_gpus) (NCCL refuses them otherwise).
    ///
    /// # Errors
    /// As [`Launch::unique_id`] and [`Communicator::with_options`].
    pub fn communicator_on(&self, device: &Device, options: CommOptions) -> Result<Communicator> {
        let (id, server) = self.unique_id(options.timeout())?;
        let comm = Communicator::with_options(self.world_size, self.rank, &id, options, device)?;
        if let Some(server) = server {
            // Every rank has joined the communicator, so every rank has fetched the id.
            server.wait()?;
        }
        Ok(comm)
    }
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Bootstrap {
            addr: addr.to_string(),
            detail: format!("cannot resolve: {e}"),
        })?
        .next()
        .ok_or_else(|| Error::Bootstrap {
            addr: addr.to_string(),
            detail: "resolves to no address".into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn no_launcher_is_none() {
        assert_eq!(Launch::from_vars(vars(&[("MASTER_PORT", "1")])).unwrap(), None);
    }

    #[test]
    fn torchrun_variables() {
        let l = Launch::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            l,
            Launch {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                master: "10.0.0.1:29500".into(),
                launcher: "torchrun",
                secret: None,
                share_gpus: false,
            }
        );
    }

    #[test]
    fn handoff_port_wins_over_master_port() {
        let torchrun = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ];
        let l = Launch::from_vars(vars(
            &[torchrun.as_slice(), &[("HANDOFF_PORT", "29501")]].concat(),
        ))
        .unwrap()
        .unwrap();
        assert_eq!(l.master, "node0:29501");
        let e = Launch::from_vars(vars(&[torchrun.as_slice(), &[("HANDOFF_PORT", "x")]].concat()));
        assert!(matches!(e, Err(Error::InvalidArgument(m)) if m.contains("HANDOFF_PORT")));
    }

    #[test]
    fn sharing_gpus_is_read_with_the_launchers_variables() {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        let l = Launch::from_vars(vars(&base)).unwrap().unwrap();
        assert!(!l.share_gpus);
        let l = Launch::from_vars(vars(&[base.as_slice(), &[("HANDOFF_SHARE_GPUS", "1")]].concat()))
            .unwrap()
            .unwrap();
        assert!(l.share_gpus);
        let e = Launch::from_vars(vars(&[base.as_slice(), &[("HANDOFF_SHARE_GPUS", "x")]].concat()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("HANDOFF_SHARE_GPUS"), "{e}");
    }

    #[test]
    fn slurm_and_openmpi_variables() {
        let l = Launch::from_vars(vars(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.launcher),
            (1, 2, 0, "slurm")
        );
        let l = Launch::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.launcher),
            (0, 1, 0, "openmpi")
        );
    }

    #[test]
    fn each_variable_is_read_once_and_a_fickle_lookup_cannot_panic() {
        use std::cell::RefCell;
        let reads = RefCell::new(HashMap::<String, usize>::new());
        // Answers a variable only the first time it is asked for it.
        let fickle = |k: &str| {
            let mut r = reads.borrow_mut();
            let n = r.entry(k.to_string()).or_default();
            *n += 1;
            let first = *n == 1;
            let v = match k {
                "RANK" => "1",
                "WORLD_SIZE" => "2",
                "MASTER_ADDR" => "::1",
                "MASTER_PORT" => "29500",
                _ => return None,
            };
            first.then(|| v.to_string())
        };
        let l = Launch::from_vars(fickle).unwrap().unwrap();
        assert_eq!((l.rank, l.world_size, l.master.as_str()), (1, 2, "[::1]:29500"));
        assert!(l.master.parse::<SocketAddr>().is_ok());
        assert!(reads.borrow().values().all(|&n| n == 1), "{:?}", reads.borrow());
    }

    #[test]
    fn bad_launcher_variables_are_named() {
        let e = Launch::from_vars(vars(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = Launch::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("below the size"), "{e}");
        let e = Launch::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "0")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("below the size"), "{e}");
        let e = Launch::from_vars(vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = Launch::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
        let e = Launch::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "4294967296")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 2147483647 ranks"), "{e}");
        let e = Launch::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", " "),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_ADDR is empty"), "{e}");
    }
}
