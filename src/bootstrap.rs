//! Starting separate processes as ranks of one communicator: reading the launcher's variables
//! and sharing the [`UniqueId`] over TCP.
//!
//! Rank 0 makes the id and serves it at `MASTER_ADDR:MASTER_PORT`; every other rank connects
//! (retrying until its timeout, so start order does not matter) and fetches it. NCCL then
//! carries all traffic itself, so the same code spans machines.
//!
//! # Launchers
//! [`Launch::from_env`] reads, in this order: torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`;
//! Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; Open MPI's `OMPI_COMM_WORLD_RANK`,
//! `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`. The address always comes from
//! `MASTER_ADDR` and `MASTER_PORT` (torchrun sets them; under Slurm or mpirun, export them), the
//! port from `HANDOFF_PORT` instead where it is set: torchrun's own store already listens on
//! `MASTER_PORT` on rank 0's host.
//!
//! # Wire format (version 1)
//! The client sends 8 bytes: `HNDOFF`, 0, version. The server answers 8 bytes (`HNDOFF`, 0, its
//! version), one status byte, then either the 128 id bytes (status 0) or a big-endian u16 length
//! and a UTF-8 message (status 1: refused). A connection that sends anything else gets the
//! refusal and is closed; the server keeps serving the others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::nccl::{CommOptions, Communicator, UniqueId};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u8 = 1;
const MAGIC: &[u8; 6] = b"HNDOFF";

fn header(version: u8) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..6].copy_from_slice(MAGIC);
    h[7] = version;
    h
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
    /// # Errors
    /// [`Error::InvalidArgument`] naming the variable that is malformed or missing.
    pub fn from_env() -> Result<Option<Launch>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Launch::from_env`], reading variables through `var` (for tests, or a launcher of
    /// your own).
    ///
    /// # Errors
    /// As [`Launch::from_env`].
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let Some(&(launcher, rank_var, size_var, local_var)) = LAUNCHERS
            .iter()
            .find(|(_, r, s, _)| var(r).is_some() && var(s).is_some())
        else {
            return Ok(None);
        };
        let num = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        Error::InvalidArgument(format!("{name}={v:?} ({launcher}) is not a whole number"))
                    })
                })
                .transpose()
        };
        let rank = num(rank_var)?.expect("checked above");
        let world_size = num(size_var)?.expect("checked above");
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "{rank_var}={rank} and {size_var}={world_size} ({launcher}): the rank must be below the size"
            )));
        }
        let local_rank = num(local_var)?.unwrap_or(rank);
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
                format!("{}:{port}", a.trim())
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
            rank,
            world_size,
            local_rank,
            master,
            launcher,
        }))
    }

    /// Shares a unique id among the launch's ranks: rank 0 makes it and serves it in the
    /// background until every other rank has fetched it or `timeout` passes; the others fetch
    /// it. With one rank, nothing is served.
    ///
    /// # Errors
    /// [`Error::Bootstrap`] (port in use, unreachable address, a peer speaking another
    /// protocol), [`Error::Timeout`], NCCL errors from making the id.
    pub fn unique_id(&self, timeout: Duration) -> Result<(UniqueId, Option<IdServer>)> {
        if self.rank == 0 {
            let id = UniqueId::new()?;
            let server = if self.world_size > 1 {
                Some(serve_unique_id(&self.master, &id, self.world_size - 1, timeout)?)
            } else {
                None
            };
            Ok((id, server))
        } else {
            Ok((fetch_unique_id(&self.master, timeout)?, None))
        }
    }

    /// This process's communicator: the GPU `local_rank` (of those visible), the id shared
    /// through [`Launch::unique_id`] (within `options.timeout`), made with `options`.
    ///
    /// # Errors
    /// As [`Launch::unique_id`] and [`Communicator::with_options`]; [`Error::NoDevice`] when
    /// `local_rank` is not a visible GPU.
    pub fn communicator(&self, options: CommOptions) -> Result<Communicator> {
        let device = Device::new(self.local_rank)?;
        let (id, server) = self.unique_id(options.timeout())?;
        let comm = Communicator::with_options(&device, self.world_size, self.rank, &id, options)?;
        if let Some(server) = server {
            // Every rank has joined the communicator, so every rank has fetched the id.
            server.wait()?;
        }
        Ok(comm)
    }
}

/// Starts `world` copies of the running executable on this machine, one rank each, as a launcher
/// would: rank `r` gets `RANK=r`, `WORLD_SIZE`, `LOCAL_RANK=r`, `MASTER_ADDR=127.0.0.1` and a
/// free `MASTER_PORT`, and inherits the rest of the environment (`NCCL_*` included).
/// `configure` may change each rank's command (arguments, variables, redirections) before it
/// starts. Returns the children in rank order; the caller waits for them.
///
/// # Errors
/// [`Error::Bootstrap`] when no port is free or a process cannot be started.
pub fn spawn_local(
    world: usize,
    mut configure: impl FnMut(usize, &mut std::process::Command),
) -> Result<Vec<std::process::Child>> {
    let fail = |detail: String| Error::Bootstrap {
        addr: "127.0.0.1".into(),
        detail,
    };
    // The port is free now; another program could take it before rank 0 listens, in which case
    // rank 0 reports the port in use.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| fail(format!("no free local port: {e}")))?
        .port();
    let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find this executable: {e}")))?;
    (0..world)
        .map(|rank| {
            let mut cmd = std::process::Command::new(&exe);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string());
            configure(rank, &mut cmd);
            cmd.spawn()
                .map_err(|e| fail(format!("cannot start rank {rank}: {e}")))
        })
        .collect()
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

/// Rank 0's server of the unique id, running on a background thread.
#[derive(Debug)]
pub struct IdServer {
    addr: String,
    thread: JoinHandle<Result<()>>,
}

impl IdServer {
    /// The address served.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Waits for the server to finish: `Ok` once every rank was served.
    ///
    /// # Errors
    /// [`Error::Timeout`] when some rank never came.
    pub fn wait(self) -> Result<()> {
        self.thread.join().unwrap_or_else(|_| {
            Err(Error::Bootstrap {
                addr: self.addr.clone(),
                detail: "the server thread panicked".into(),
            })
        })
    }
}

/// Listens at `addr` now (so a port in use fails here) and serves `id` to `clients`
/// connections on a background thread, until all are served or `timeout` passes.
///
/// # Errors
/// [`Error::Bootstrap`] when the address cannot be listened on.
pub fn serve_unique_id(addr: &str, id: &UniqueId, clients: usize, timeout: Duration) -> Result<IdServer> {
    let sock = resolve(addr)?;
    let listener = TcpListener::bind(sock).map_err(|e| Error::Bootstrap {
        addr: addr.to_string(),
        detail: format!(
            "cannot listen: {e}{}",
            if e.kind() == std::io::ErrorKind::AddrInUse {
                "; another job or an earlier run holds the port: set MASTER_PORT to a free one"
            } else {
                ""
            }
        ),
    })?;
    listener.set_nonblocking(true).map_err(|e| Error::Bootstrap {
        addr: addr.to_string(),
        detail: e.to_string(),
    })?;
    let (addr_owned, id) = (addr.to_string(), id.clone());
    let thread = std::thread::Builder::new()
        .name("handoff-bootstrap".into())
        .spawn(move || serve_loop(listener, &addr_owned, &id, clients, timeout))
        .map_err(|e| Error::Bootstrap {
            addr: addr.to_string(),
            detail: format!("cannot start a thread: {e}"),
        })?;
    Ok(IdServer {
        addr: addr.to_string(),
        thread,
    })
}

fn serve_loop(
    listener: TcpListener,
    addr: &str,
    id: &UniqueId,
    clients: usize,
    timeout: Duration,
) -> Result<()> {
    let started = Instant::now();
    let mut served = 0;
    while served < clients {
        if started.elapsed() >= timeout {
            return Err(Error::Timeout {
                what: format!(
                    "serving the unique id at {addr}: {served} of {clients} other rank(s) fetched it"
                ),
                after: timeout,
            });
        }
        match listener.accept() {
            Ok((conn, _)) => {
                if serve_one(conn, id) {
                    served += 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    Ok(())
}

/// Serves one connection; true if it was a client of this protocol and got the id.
fn serve_one(mut conn: TcpStream, id: &UniqueId) -> bool {
    // A silent or slow connection must not hold up the others for long.
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(2)));
    let mut hello = [0u8; 8];
    let refusal = match conn.read_exact(&mut hello) {
        Err(e) => format!("no handoff hello received ({e})"),
        Ok(()) if &hello[..6] != MAGIC || hello[6] != 0 => "this port serves a handoff unique id; \
             the connection did not speak the handoff bootstrap protocol"
            .to_string(),
        Ok(()) if hello[7] != PROTOCOL_VERSION => format!(
            "protocol version {} asked, this server speaks version {PROTOCOL_VERSION}: use the same \
             handoff version on every rank",
            hello[7]
        ),
        Ok(()) => {
            let mut reply = Vec::with_capacity(9 + UniqueId::BYTES);
            reply.extend_from_slice(&header(PROTOCOL_VERSION));
            reply.push(0);
            reply.extend_from_slice(id.as_bytes());
            return conn.write_all(&reply).and_then(|()| conn.flush()).is_ok();
        }
    };
    let msg = refusal.as_bytes();
    let len = msg.len().min(u16::MAX as usize);
    let mut reply = Vec::with_capacity(11 + len);
    reply.extend_from_slice(&header(PROTOCOL_VERSION));
    reply.push(1);
    reply.extend_from_slice(&(len as u16).to_be_bytes());
    reply.extend_from_slice(&msg[..len]);
    let _ = conn.write_all(&reply);
    // Closing with unread input would reset the connection and lose the refusal: stop
    // writing, then drain what the peer sent, briefly.
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 512];
    while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
    false
}

/// Fetches the unique id from rank 0's server at `addr`, retrying while nobody listens there
/// yet, until `timeout`.
///
/// # Errors
/// [`Error::Timeout`] naming the address when no server answered in time; [`Error::Bootstrap`]
/// when something answered but not with an id (another program, another version).
pub fn fetch_unique_id(addr: &str, timeout: Duration) -> Result<UniqueId> {
    let started = Instant::now();
    let sock = resolve(addr)?;
    let bootstrap = |detail: String| Error::Bootstrap {
        addr: addr.to_string(),
        detail,
    };
    let mut last = String::from("nothing tried");
    loop {
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: format!("fetching the unique id from rank 0 at {addr} (last attempt: {last})"),
                after: timeout,
            });
        }
        match TcpStream::connect_timeout(&sock, left.min(Duration::from_secs(1))) {
            Ok(mut conn) => {
                let _ = conn.set_read_timeout(Some(left.max(Duration::from_millis(1))));
                conn.write_all(&header(PROTOCOL_VERSION))
                    .map_err(|e| bootstrap(format!("sending the hello: {e}")))?;
                let mut head = [0u8; 9];
                conn.read_exact(&mut head).map_err(|e| {
                    bootstrap(format!(
                        "no handoff answer (is something else listening there?): {e}"
                    ))
                })?;
                if &head[..6] != MAGIC || head[6] != 0 {
                    return Err(bootstrap(
                        "the answer is not the handoff bootstrap protocol: another program holds the port"
                            .into(),
                    ));
                }
                if head[7] != PROTOCOL_VERSION {
                    return Err(bootstrap(format!(
                        "rank 0 speaks protocol version {}, this rank {PROTOCOL_VERSION}: use the same \
                         handoff version on every rank",
                        head[7]
                    )));
                }
                if head[8] != 0 {
                    let mut len = [0u8; 2];
                    let mut msg = Vec::new();
                    if conn.read_exact(&mut len).is_ok() {
                        msg.resize(u16::from_be_bytes(len) as usize, 0);
                        let _ = conn.read_exact(&mut msg);
                    }
                    return Err(bootstrap(format!("refused: {}", String::from_utf8_lossy(&msg))));
                }
                let mut id = [0u8; UniqueId::BYTES];
                conn.read_exact(&mut id)
                    .map_err(|e| bootstrap(format!("the id was cut short: {e}")))?;
                return UniqueId::from_bytes(&id);
            }
            Err(e) => {
                last = e.to_string();
                std::thread::sleep(Duration::from_millis(50).min(left));
            }
        }
    }
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
                launcher: "torchrun"
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
    }
}
