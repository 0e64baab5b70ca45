//! CPU tests of the unique-id bootstrap, with real processes on loopback: the normal exchange,
//! a rank that never arrives, a port in use, and garbage or a wrong version sent to the port.
//! No GPU and no NCCL needed: the id served is made from bytes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use handoff::UniqueId;
use handoff::bootstrap::{PROTOCOL_VERSION, fetch_unique_id, serve_unique_id};
use libtest_mimic::{Arguments, Failed, Trial};

const ROLE: &str = "HANDOFF_BOOTSTRAP_CHILD";

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(child(&role));
    }
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("exchange_between_three_processes", exchange),
        Trial::test("rank_that_never_arrives_times_out", never_arrives),
        Trial::test("port_in_use_is_a_clear_error", port_in_use),
        Trial::test(
            "garbage_and_wrong_version_are_refused_and_serving_goes_on",
            garbage_and_wrong_version,
        ),
        Trial::test("answer_from_another_program_is_a_clear_error", another_program),
        Trial::test("spawn_local_starts_ranks_a_launcher_would", spawn_local_ranks),
    ];
    libtest_mimic::run(&args, trials).exit()
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

/// A child process: `serve` serves HANDOFF_ID at HANDOFF_ADDR to HANDOFF_CLIENTS clients;
/// `fetch` fetches from HANDOFF_ADDR and prints `id=HEX`. Errors go to stderr, exit 2.
fn child(role: &str) -> i32 {
    let addr = var("HANDOFF_ADDR");
    let timeout = Duration::from_millis(var("HANDOFF_TIMEOUT_MS").parse().unwrap_or(10_000));
    let r = match role {
        "serve" => var("HANDOFF_ID").parse::<UniqueId>().and_then(|id| {
            let clients = var("HANDOFF_CLIENTS").parse().unwrap_or(1);
            serve_unique_id(&addr, &id, clients, timeout)?.wait()
        }),
        "fetch" => fetch_unique_id(&addr, timeout).map(|id| println!("id={id}")),
        "launch" => handoff::Launch::from_env().and_then(|l| {
            let l = l.ok_or_else(|| handoff::Error::InvalidArgument("no launcher variables".into()))?;
            println!(
                "{} {} {} {} {}",
                l.launcher, l.rank, l.world_size, l.local_rank, l.master
            );
            Ok(())
        }),
        _ => return 3,
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

fn free_addr() -> Result<String, Failed> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    Ok(format!("127.0.0.1:{port}"))
}

fn test_id() -> UniqueId {
    let bytes: Vec<u8> = (0..UniqueId::BYTES).map(|i| (i * 7 + 3) as u8).collect();
    UniqueId::from_bytes(&bytes).unwrap()
}

fn spawn(role: &str, addr: &str, envs: &[(&str, String)]) -> Result<Child, Failed> {
    let mut c = Command::new(std::env::current_exe()?);
    c.env(ROLE, role)
        .env("HANDOFF_ADDR", addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        c.env(k, v);
    }
    Ok(c.spawn()?)
}

fn finish(c: Child) -> Result<(bool, String, String), Failed> {
    let Output {
        status,
        stdout,
        stderr,
    } = c.wait_with_output()?;
    Ok((
        status.success(),
        String::from_utf8_lossy(&stdout).into(),
        String::from_utf8_lossy(&stderr).into(),
    ))
}

fn exchange() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    // The clients start first: they must retry until the server listens.
    let clients: Vec<Child> = (0..2)
        .map(|_| spawn("fetch", &addr, &[]))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(300));
    let server = spawn(
        "serve",
        &addr,
        &[("HANDOFF_ID", id.to_string()), ("HANDOFF_CLIENTS", "2".into())],
    )?;
    for c in clients {
        let (ok, out, err) = finish(c)?;
        if !ok || out.trim() != format!("id={id}") {
            return Err(format!("client: ok={ok} out={out:?} err={err:?}").into());
        }
    }
    let (ok, _, err) = finish(server)?;
    if !ok {
        return Err(format!("server failed: {err}").into());
    }
    Ok(())
}

fn never_arrives() -> Result<(), Failed> {
    let addr = free_addr()?;
    // A server whose one client never comes.
    let t = Instant::now();
    let server = spawn(
        "serve",
        &addr,
        &[
            ("HANDOFF_ID", test_id().to_string()),
            ("HANDOFF_CLIENTS", "1".into()),
            ("HANDOFF_TIMEOUT_MS", "500".into()),
        ],
    )?;
    let (ok, _, err) = finish(server)?;
    if ok || !err.contains("0 of 1") || !err.contains(&addr) {
        return Err(format!("server: ok={ok} err={err:?}").into());
    }
    // A client whose server never comes: a timeout naming the address, in bounded time.
    let other = free_addr()?;
    let client = spawn("fetch", &other, &[("HANDOFF_TIMEOUT_MS", "500".into())])?;
    let (ok, _, err) = finish(client)?;
    if ok || !err.contains(&other) || !err.contains("did not complete within 500ms") {
        return Err(format!("client: ok={ok} err={err:?}").into());
    }
    if t.elapsed() > Duration::from_secs(10) {
        return Err(format!("timeouts of 500 ms took {:?}", t.elapsed()).into());
    }
    Ok(())
}

fn port_in_use() -> Result<(), Failed> {
    let holder = TcpListener::bind("127.0.0.1:0")?;
    let addr = holder.local_addr()?.to_string();
    let server = spawn("serve", &addr, &[("HANDOFF_ID", test_id().to_string())])?;
    let (ok, _, err) = finish(server)?;
    if ok || !err.contains(&addr) || !err.contains("MASTER_PORT") {
        return Err(format!("ok={ok} err={err:?}").into());
    }
    Ok(())
}

fn refusal(addr: &str, hello: &[u8]) -> Result<String, Failed> {
    let mut c = TcpStream::connect(addr)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(hello)?;
    let mut reply = Vec::new();
    c.read_to_end(&mut reply)?;
    if reply.len() < 11 || &reply[..6] != b"HNDOFF" || reply[8] != 1 {
        return Err(format!("expected a refusal, got {reply:?}").into());
    }
    Ok(String::from_utf8_lossy(&reply[11..]).into())
}

fn garbage_and_wrong_version() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let server = spawn(
        "serve",
        &addr,
        &[("HANDOFF_ID", id.to_string()), ("HANDOFF_CLIENTS", "1".into())],
    )?;
    // Wait for it to listen.
    let t = Instant::now();
    while TcpStream::connect(&addr).is_err() {
        if t.elapsed() > Duration::from_secs(5) {
            return Err("server never listened".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let msg = refusal(&addr, b"GET / HTTP/1.1\r\n\r\n")?;
    if !msg.contains("did not speak the handoff bootstrap protocol") {
        return Err(format!("garbage got {msg:?}").into());
    }
    let mut wrong = *b"HNDOFF\0\0";
    wrong[7] = PROTOCOL_VERSION + 1;
    let msg = refusal(&addr, &wrong)?;
    if !msg.contains(&format!("version {}", PROTOCOL_VERSION + 1)) {
        return Err(format!("wrong version got {msg:?}").into());
    }
    // The right client is still served, and the server then ends well.
    let (ok, out, err) = finish(spawn("fetch", &addr, &[])?)?;
    if !ok || out.trim() != format!("id={id}") {
        return Err(format!("client after garbage: ok={ok} out={out:?} err={err:?}").into());
    }
    let (ok, _, err) = finish(server)?;
    if !ok {
        return Err(format!("server: {err}").into());
    }
    Ok(())
}

fn another_program() -> Result<(), Failed> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let t = std::thread::spawn(move || {
        if let Ok((mut c, _)) = listener.accept() {
            let _ = c.write_all(b"SSH-2.0-OpenSSH_9.2\r\n");
        }
    });
    let (ok, _, err) = finish(spawn("fetch", &addr, &[])?)?;
    let _ = t.join();
    if ok || !err.contains("another program") {
        return Err(format!("ok={ok} err={err:?}").into());
    }
    Ok(())
}

/// `spawn_local` starts the ranks with the variables a launcher sets, which `Launch::from_env`
/// then reads in each of them.
fn spawn_local_ranks() -> Result<(), Failed> {
    let kids = handoff::bootstrap::spawn_local(3, |_, cmd| {
        cmd.env(ROLE, "launch").stdout(Stdio::piped());
    })?;
    let mut masters = Vec::new();
    for (rank, k) in kids.into_iter().enumerate() {
        let (ok, out, err) = finish(k)?;
        let f: Vec<&str> = out.split_whitespace().collect();
        if !ok || f.len() != 5 || f[..4] != ["torchrun", &rank.to_string(), "3", &rank.to_string()] {
            return Err(format!("rank {rank}: ok={ok} out={out:?} err={err:?}").into());
        }
        masters.push(f[4].to_string());
    }
    if !masters
        .iter()
        .all(|m| m == &masters[0] && m.starts_with("127.0.0.1:"))
    {
        return Err(format!("ranks disagree on the address: {masters:?}").into());
    }
    Ok(())
}
