//! Ranks started on this machine ([`spawn_local`]), and ranks that share a GPU.
//!
//! NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
//! detected"): it compares the ranks' bus ids and host hashes. A process computes its host hash
//! once, at its first NCCL call, from `NCCL_HOSTID` where set (else the hostname and boot id).
//! A rank process with a host id of its own is therefore, to NCCL, a host of its own: NCCL
//! connects it to the others through its network transport (here the socket transport over
//! loopback), never peer-to-peer or shared memory, and lets it share a GPU. That is correct but
//! not fast (no NVLink, every byte through the kernel's sockets): a development mode, for
//! running multi-rank code and its tests on fewer GPUs than ranks, not for measuring.
//!
//! Threads of one process share its host id, so ranks that share a GPU must be processes.
//! handoff's own verification is unchanged: it finds ranks of one machine by the boot id, not
//! by NCCL's host id, and checks them through shared memory as before.

use std::sync::Once;

use super::secret::{SECRET_FILE_VAR, SECRET_VAR, Secret};
use crate::engine::device::Device;
use crate::error::{Error, Result};

/// The variable that turns GPU sharing on for a rank process: `1` (or `true`, `yes`, `on`) on,
/// `0` (or `false`, `no`, `off`, empty) off.
pub const SHARE_GPUS_VAR: &str = "HANDOFF_SHARE_GPUS";

/// Where [`spawn_local_with`] puts its ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GpuSharing {
    /// One GPU per rank: rank `r` on GPU `r`, NCCL's fast paths between them. The ranks still
    /// share GPUs if this process has `HANDOFF_SHARE_GPUS=1` set.
    #[default]
    Never,
    /// Ranks round-robin over the visible GPUs (rank `r` on GPU `r % count`), each process with
    /// its own NCCL host id over NCCL's socket transport: correct, not fast.
    Always,
    /// [`GpuSharing::Always`] when there are more ranks than visible GPUs, else
    /// [`GpuSharing::Never`]: what a test or an example that must run anywhere wants.
    WhenFewerGpus,
}

/// Whether `value` of [`SHARE_GPUS_VAR`] turns sharing on.
///
/// # Errors
/// [`Error::InvalidArgument`] for a value that is neither on nor off.
pub(crate) fn parse_share(value: Option<&str>) -> Result<bool> {
    let Some(v) = value else { return Ok(false) };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::InvalidArgument(format!(
            "{SHARE_GPUS_VAR}={v:?} is neither 1 nor 0"
        ))),
    }
}

/// NCCL's variables for rank `rank`'s process when ranks share GPUs, given the environment
/// `var`: a host id of its own, and NCCL's socket transport over loopback unless the
/// environment picks a network and an interface already. The one rule for both ways a rank
/// gets them: [`spawn_local_with`] sets them on the process it starts, [`apply`] in a process a
/// launcher started.
pub(crate) fn rank_env(rank: usize, var: impl Fn(&str) -> Option<String>) -> [(&'static str, String); 3] {
    // Unique among the ranks of any communicator this process joins; the same NCCL_HOSTID on
    // every rank (a launcher passes one environment to all) is exactly what must not stay.
    let host = ("NCCL_HOSTID", format!("handoff-shared-gpu-rank-{rank}"));
    let keep = |name: &'static str, default: &str| (name, var(name).unwrap_or_else(|| default.to_string()));
    [host, keep("NCCL_NET", "Socket"), keep("NCCL_SOCKET_IFNAME", "lo")]
}

/// The threads of this process, from `/proc/self/status`; `None` where it cannot be read.
fn threads() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
}

/// Gives this process, rank `rank` of a launcher's job that shares GPUs, the variables of
/// [`rank_env`] before NCCL starts, and says once (on rank 0) what the mode is.
///
/// # Errors
/// [`Error::InvalidArgument`] when a variable is missing or different and cannot be set
/// safely: NCCL has already been opened in this process (it read them), or the process runs
/// other threads (one of them could be reading the environment). It names what to export.
pub(crate) fn apply(rank: usize) -> Result<()> {
    let wanted = rank_env(rank, |k| std::env::var(k).ok());
    let differ: Vec<&(&str, String)> = wanted
        .iter()
        .filter(|(k, v)| std::env::var(k).ok().as_deref() != Some(v.as_str()))
        .collect();
    if !differ.is_empty() {
        let exports = differ
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let refuse = |why: String| {
            Error::InvalidArgument(format!(
                "{SHARE_GPUS_VAR}=1 needs {exports} in rank {rank}'s environment before NCCL \
                 starts, and handoff cannot set them now: {why}. Call Launch::from_env() first \
                 thing in main, or export them for this rank"
            ))
        };
        if crate::sys::loader::nccl_opened() {
            return Err(refuse(
                "NCCL is already open in this process and has read them".into(),
            ));
        }
        match threads() {
            Some(1) => {}
            Some(n) => return Err(refuse(format!("this process runs {n} threads"))),
            None => return Err(refuse("/proc/self/status gives no thread count".into())),
        }
        for (k, v) in differ {
            // SAFETY: the environment is written while this process has one thread, the one
            // running here, so no other thread can be reading or writing it (the data race
            // that makes `set_var` unsafe); only this thread could start another, and it does
            // not until the loop ends.
            unsafe { std::env::set_var(k, v) };
        }
    }
    if rank == 0 {
        static SAID: Once = Once::new();
        SAID.call_once(|| {
            eprintln!(
                "handoff: {SHARE_GPUS_VAR}=1: ranks share GPUs, each process its own NCCL host \
                 id, through NCCL's socket transport ({}): a development mode, correct but not \
                 fast (no NVLink or shared memory); its figures are not performance figures",
                std::env::var("NCCL_SOCKET_IFNAME").unwrap_or_default()
            )
        });
    }
    Ok(())
}

/// The GPU a rank of local index `local_rank` takes: the one of that index, or when ranks share
/// GPUs, `local_rank` modulo the visible GPUs.
///
/// # Errors
/// [`Error::NoDevice`] when that GPU is not visible, or none is; CUDA errors.
pub(crate) fn rank_device(local_rank: usize, share: bool) -> Result<Device> {
    if !share {
        return Device::new(local_rank);
    }
    match Device::count()? {
        0 => Err(Error::NoDevice {
            reason: "the CUDA runtime reports 0 devices".into(),
        }),
        n => Device::new(local_rank % n),
    }
}

/// Where rank 0 of a local launch serves the unique id: a loopback address drawn at random
/// (all of 127.0.0.0/8 is this host's; not 127.0.0.x, where the rest of the host's loopback
/// traffic is) and a port of 20000-29999: nothing else binds that address. Never
/// a port found free by binding it for a moment: a process that another thread spawns at that
/// moment inherits the listener until it execs, and rank 0's bind then fails (seen on the
/// 16-core H200 machine with many launches at once).
fn local_master() -> std::io::Result<std::net::SocketAddrV4> {
    let mut b = [0u8; 5];
    loop {
        super::secret::random(&mut b)?;
        if (b[0], b[1]) != (0, 0) && !matches!(b[2], 0 | 255) {
            let ip = std::net::Ipv4Addr::new(127, b[0], b[1], b[2]);
            let port = 20_000 + u16::from_le_bytes([b[3], b[4]]) % 10_000;
            return Ok(std::net::SocketAddrV4::new(ip, port));
        }
    }
}

/// Starts `world` copies of the running executable on this machine, one rank each, one GPU
/// each: [`spawn_local_with`] and [`GpuSharing::Never`].
///
/// # Errors
/// As [`spawn_local_with`].
pub fn spawn_local(
    world: usize,
    configure: impl FnMut(usize, &mut std::process::Command),
) -> Result<Vec<std::process::Child>> {
    spawn_local_with(world, GpuSharing::Never, configure)
}

/// Starts `world` copies of the running executable on this machine, one rank each, as a
/// launcher would: rank `r` gets `RANK=r`, `WORLD_SIZE`, `LOCAL_RANK=r`, and a `MASTER_ADDR`
/// and `MASTER_PORT` of this launch's own (a loopback address drawn for it, 127.a.b.c, and a
/// port of 20000-29999), and inherits the rest of the environment
/// (`NCCL_*` included). Unless this process has `HANDOFF_SECRET` or `HANDOFF_SECRET_FILE` set,
/// the ranks get a fresh random `HANDOFF_SECRET`, so that no other local process can fetch
/// their id. `configure` may change each rank's command (arguments, variables, redirections)
/// before it starts. Returns the children in rank order; the caller waits for them.
///
/// Where `sharing` says so (or this process has `HANDOFF_SHARE_GPUS=1`), the ranks share the
/// visible GPUs round-robin: each gets `HANDOFF_SHARE_GPUS=1`, an `NCCL_HOSTID` of its own,
/// and NCCL's socket transport over loopback unless `NCCL_NET` and `NCCL_SOCKET_IFNAME` are set;
/// [`Launch::communicator`](super::Launch::communicator) then puts rank `r` on GPU
/// `r % count`. See the [module](super) docs for what that costs.
///
/// # Errors
/// [`Error::Bootstrap`] when no address or secret can be drawn from /dev/urandom, or a process
/// cannot be started; [`Error::InvalidArgument`] for a malformed `HANDOFF_SHARE_GPUS`;
/// with [`GpuSharing::WhenFewerGpus`], the errors of [`Device::count`].
pub fn spawn_local_with(
    world: usize,
    sharing: GpuSharing,
    mut configure: impl FnMut(usize, &mut std::process::Command),
) -> Result<Vec<std::process::Child>> {
    let fail = |detail: String| Error::Bootstrap {
        addr: "127.0.0.1".into(),
        detail,
    };
    let inherited = std::env::var_os(SHARE_GPUS_VAR).map(|v| v.to_string_lossy().into_owned());
    let share = parse_share(inherited.as_deref())?
        || match sharing {
            GpuSharing::Never => false,
            GpuSharing::Always => true,
            GpuSharing::WhenFewerGpus => world > Device::count()?,
        };
    let master = local_master().map_err(|e| fail(format!("cannot draw an address: {e}")))?;
    let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find this executable: {e}")))?;
    let secret = match (std::env::var_os(SECRET_VAR), std::env::var_os(SECRET_FILE_VAR)) {
        (None, None) => Some(Secret::random_hex().map_err(|e| fail(format!("cannot draw a secret: {e}")))?),
        _ => None,
    };
    (0..world)
        .map(|rank| {
            let mut cmd = std::process::Command::new(&exe);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", master.ip().to_string())
                .env("MASTER_PORT", master.port().to_string());
            if let Some(s) = &secret {
                cmd.env(SECRET_VAR, s);
            }
            if share {
                cmd.env(SHARE_GPUS_VAR, "1");
                // Set here, before the child runs, so that it never has to write its own
                // environment.
                for (k, v) in rank_env(rank, |k| std::env::var(k).ok()) {
                    cmd.env(k, v);
                }
            }
            configure(rank, &mut cmd);
            cmd.spawn()
                .map_err(|e| fail(format!("cannot start rank {rank}: {e}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    /// The variables [`spawn_local_with`] gives rank `rank`'s process, for tests: what
    /// `configure` sees already set on the command.
    fn command_env(cmd: &std::process::Command) -> Vec<(OsString, Option<OsString>)> {
        cmd.get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned())))
            .collect()
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn each_rank_gets_a_host_id_of_its_own_and_loopback_sockets_unless_chosen() {
        let env = vars(&[("NCCL_HOSTID", "the-launchers-one")]);
        let ids: Vec<String> = (0..8).map(|r| rank_env(r, &env)[0].1.clone()).collect();
        let distinct: std::collections::BTreeSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), 8, "{ids:?}");
        assert!(ids.iter().all(|i| i != "the-launchers-one"), "{ids:?}");
        assert_eq!(
            rank_env(3, vars(&[]))[1..],
            [("NCCL_NET", "Socket".into()), ("NCCL_SOCKET_IFNAME", "lo".into())]
        );
        // A network and an interface the user chose are kept.
        let chosen = vars(&[("NCCL_NET", "IB"), ("NCCL_SOCKET_IFNAME", "eth0")]);
        assert_eq!(
            rank_env(0, chosen)[1..],
            [("NCCL_NET", "IB".into()), ("NCCL_SOCKET_IFNAME", "eth0".into())]
        );
        // The same rank, the same id: a process that already has its variables keeps them.
        assert_eq!(rank_env(5, vars(&[])), rank_env(5, vars(&[])));
    }

    #[test]
    fn the_switch_is_on_off_or_named_as_malformed() {
        for on in ["1", "true", "YES", " on "] {
            assert!(parse_share(Some(on)).unwrap(), "{on}");
        }
        for off in ["0", "", "false", "No", "off"] {
            assert!(!parse_share(Some(off)).unwrap(), "{off}");
        }
        assert!(!parse_share(None).unwrap());
        let e = parse_share(Some("2")).unwrap_err().to_string();
        assert!(e.contains("HANDOFF_SHARE_GPUS=\"2\""), "{e}");
    }

    #[test]
    fn shared_ranks_are_started_with_their_variables_set() {
        // Each rank is this test binary listing its tests (and exiting); `configure` sees each
        // command as it starts.
        let mut seen = Vec::new();
        let kids = spawn_local_with(3, GpuSharing::Always, |rank, cmd| {
            cmd.arg("--list").stdout(std::process::Stdio::null());
            seen.push((rank, command_env(cmd)));
        })
        .unwrap();
        for mut k in kids {
            assert!(k.wait().unwrap().success());
        }
        let get = |env: &[(OsString, Option<OsString>)], k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .and_then(|(_, v)| v.clone())
                .map(|v| v.to_string_lossy().into_owned())
        };
        assert_eq!(seen.len(), 3);
        let mut ids = std::collections::BTreeSet::new();
        for (rank, env) in &seen {
            assert_eq!(get(env, SHARE_GPUS_VAR).as_deref(), Some("1"));
            for (k, v) in rank_env(*rank, |k| std::env::var(k).ok()) {
                assert_eq!(get(env, k), Some(v), "rank {rank}: {k}");
            }
            assert_eq!(get(env, "LOCAL_RANK"), Some(rank.to_string()));
            ids.insert(get(env, "NCCL_HOSTID"));
        }
        assert_eq!(ids.len(), 3, "{ids:?}");
    }
}
