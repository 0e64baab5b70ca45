//! CPU tests of the unique-id bootstrap on loopback: the exchange between processes, with and
//! without a shared secret; its bounds against clients and servers that trickle, idle or send
//! garbage; each rank served once; authentication failures named on both sides; and property
//! tests feeding the server, the client and the launcher-variable parsing hostile input.
//! No GPU and no NCCL needed: the id served is made from bytes.

use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use handoff::nccl::bootstrap::{
    BootstrapOptions, IdServer, MAX_CONNECTIONS, PROTOCOL_VERSION, Secret, fetch_unique_id, serve_unique_id,
};
use handoff::{Error, Launch, UniqueId};
use libtest_mimic::{Arguments, Failed, Trial};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const ROLE: &str = "HANDOFF_BOOTSTRAP_CHILD";

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        std::process::exit(child(&role));
    }
    let args = Arguments::from_args();
    let trials = vec![
        Trial::test("exchange_between_three_processes", || exchange(false)),
        Trial::test("exchange_with_a_shared_secret_between_three_processes", || {
            exchange(true)
        }),
        Trial::test("rank_that_never_arrives_times_out", never_arrives),
        Trial::test("port_in_use_is_a_clear_error", port_in_use),
        Trial::test(
            "garbage_and_wrong_version_are_refused_and_serving_goes_on",
            garbage_and_wrong_version,
        ),
        Trial::test("answer_from_another_program_is_a_clear_error", another_program),
        Trial::test("spawn_local_starts_ranks_a_launcher_would", spawn_local_ranks),
        Trial::test(
            "trickling_client_is_cut_off_at_its_connection_deadline",
            trickler_cut_off,
        ),
        Trial::test(
            "trickling_client_cannot_hold_the_server_past_its_deadline",
            trickler_and_server_deadline,
        ),
        Trial::test(
            "idle_and_trickling_connections_do_not_delay_a_real_rank",
            idle_and_trickling,
        ),
        Trial::test(
            "each_rank_is_served_once_and_bad_hellos_lock_no_rank_out",
            served_once,
        ),
        Trial::test(
            "with_a_secret_rogue_hellos_never_see_the_id_nor_lock_ranks_out",
            rogues_with_secret,
        ),
        Trial::test(
            "missing_or_different_secrets_are_named_on_both_sides",
            secret_mismatch,
        ),
        Trial::test(
            "neither_the_secret_nor_the_id_crosses_the_wire",
            nothing_on_the_wire,
        ),
        Trial::test(
            "a_replayed_or_altered_exchange_is_refused_and_locks_no_rank_out",
            replayed_exchange,
        ),
        Trial::test(
            "a_server_without_the_secret_cannot_hand_a_rank_an_id",
            server_without_the_secret,
        ),
        Trial::test(
            "trickling_or_silent_server_cannot_hold_a_rank_past_its_timeout",
            trickling_server,
        ),
        Trial::test(
            "flood_beyond_the_connection_limit_is_turned_away_and_ranks_retry",
            flood,
        ),
        Trial::test(
            "property_server_fed_hostile_streams_over_tcp_keeps_serving",
            property_server_over_tcp,
        ),
        Trial::test(
            "property_client_fed_hostile_replies_over_tcp_returns_typed_errors",
            property_client_over_tcp,
        ),
        Trial::test(
            "property_launcher_variables_fed_arbitrary_strings",
            property_launcher_variables,
        ),
    ];
    libtest_mimic::run(&args, trials).exit()
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

/// A child process: `serve` serves HANDOFF_ID at HANDOFF_ADDR to a job of HANDOFF_WORLD ranks;
/// `fetch` fetches for HANDOFF_RANK and prints `id=HEX`; `launch` plays the rank its launcher
/// variables name. The secret, if any, comes from the environment. Errors go to stderr, exit 2.
fn child(role: &str) -> i32 {
    let addr = var("HANDOFF_ADDR");
    let timeout = Duration::from_millis(var("HANDOFF_TIMEOUT_MS").parse().unwrap_or(10_000));
    let options = || -> handoff::Result<BootstrapOptions> {
        let o = BootstrapOptions::new(timeout);
        Ok(match Secret::from_env()? {
            Some(s) => o.with_secret(s),
            None => o,
        })
    };
    let r = match role {
        "serve" => var("HANDOFF_ID").parse::<UniqueId>().and_then(|id| {
            let world = var("HANDOFF_WORLD").parse().unwrap_or(2);
            serve_unique_id(&addr, &id, world, &options()?)?.wait()
        }),
        "fetch" => {
            let rank = var("HANDOFF_RANK").parse().unwrap_or(1);
            options()
                .and_then(|o| fetch_unique_id(&addr, rank, &o))
                .map(|id| println!("id={id}"))
        }
        "launch" => Launch::from_env().and_then(|l| {
            let l = l.ok_or_else(|| Error::InvalidArgument("no launcher variables".into()))?;
            let options = l.bootstrap_options(timeout);
            let id = if l.rank == 0 {
                let id = test_id();
                serve_unique_id(&l.master, &id, l.world_size, &options)?.wait()?;
                id
            } else {
                fetch_unique_id(&l.master, l.rank, &options)?
            };
            println!(
                "{} {} {} {} {} secret={} id={id}",
                l.launcher,
                l.rank,
                l.world_size,
                l.local_rank,
                l.master,
                l.secret.is_some()
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

/// An address nobody holds, for a server a test starts later: a loopback address of its own
/// (all of 127.0.0.0/8 is this host's), drawn afresh for every server of every run, at one
/// port. Not a port of 127.0.0.1 found free by binding it for a moment: a test beside this one
/// that spawns a child process at that moment gives the child a copy of that listener, which
/// keeps listening until the child execs, and the server's bind then fails with "Address
/// already in use" (on the 16-core H200 machine, in a run of this binary now and then).
/// Nothing else binds these addresses, and clients connect from 127.0.0.1.
fn free_addr() -> Result<String, Failed> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let seed = std::process::id().wrapping_mul(2_654_435_761) ^ clock;
    loop {
        // Odd steps through the 2^24 addresses: a run repeats none of its own.
        let n = seed.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed).wrapping_mul(40_503)) & 0xff_ffff;
        // Not 127.0.0.x, where the rest of the machine's loopback traffic is, nor .0 or .255.
        if n >> 8 != 0 && !matches!(n & 0xff, 0 | 255) {
            let ip = std::net::Ipv4Addr::new(127, (n >> 16) as u8, (n >> 8) as u8, n as u8);
            return Ok(format!("{ip}:20000"));
        }
    }
}

fn test_id() -> UniqueId {
    let bytes: Vec<u8> = (0..UniqueId::BYTES).map(|i| (i * 7 + 3) as u8).collect();
    UniqueId::from_bytes(&bytes).unwrap()
}

const SECRET: &str = "test secret 0123456789abcdef";

fn secret() -> Secret {
    Secret::new(SECRET).unwrap()
}

fn opts(timeout_ms: u64) -> BootstrapOptions {
    BootstrapOptions::new(Duration::from_millis(timeout_ms))
}

fn spawn(role: &str, addr: &str, envs: &[(&str, String)]) -> Result<Child, Failed> {
    let mut c = Command::new(std::env::current_exe()?);
    c.env(ROLE, role)
        .env("HANDOFF_ADDR", addr)
        .env_remove("HANDOFF_SECRET")
        .env_remove("HANDOFF_SECRET_FILE")
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

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
    if ok { Ok(()) } else { Err(what().into()) }
}

/// The header a server of this version starts its answers with.
fn header() -> Vec<u8> {
    let mut h = b"HNDOFF\0".to_vec();
    h.push(PROTOCOL_VERSION);
    h
}

/// A hello as a client of this version sends it, with a made-up first Noise message (48
/// bytes) when it claims the secret.
fn hello(rank: u32, flags: u8) -> Vec<u8> {
    let mut h = header();
    h.push(flags);
    h.extend_from_slice(&rank.to_be_bytes());
    if flags & 1 != 0 {
        h.extend_from_slice(&[0x11; 48]);
    }
    h
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Connects once the server listens.
fn connect(addr: &str) -> Result<TcpStream, Failed> {
    let t = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(c) => return Ok(c),
            Err(e) if t.elapsed() > Duration::from_secs(5) => {
                return Err(format!("never listened: {e}").into());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Sends `bytes`, stops sending, and reads the whole answer.
fn exchange_raw(addr: &str, bytes: &[u8]) -> Result<Vec<u8>, Failed> {
    send_raw(connect(addr)?, bytes)
}

fn send_raw(mut c: TcpStream, bytes: &[u8]) -> Result<Vec<u8>, Failed> {
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(bytes)?;
    c.shutdown(Shutdown::Write)?;
    let mut reply = Vec::new();
    c.read_to_end(&mut reply)?;
    Ok(reply)
}

/// The refusal's status and text, from an answer that is one.
fn refusal(reply: &[u8]) -> Result<(u8, String), Failed> {
    check(reply.len() >= 11 && reply[..6] == *b"HNDOFF", || {
        format!("expected a refusal, got {reply:?}")
    })?;
    let len = u16::from_be_bytes([reply[9], reply[10]]) as usize;
    check(reply.len() == 11 + len, || {
        format!("refusal of the wrong length: {reply:?}")
    })?;
    Ok((reply[8], String::from_utf8_lossy(&reply[11..]).into()))
}

fn exchange(with_secret: bool) -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let secret: Vec<(&str, String)> = if with_secret {
        vec![("HANDOFF_SECRET", SECRET.into())]
    } else {
        vec![]
    };
    // The clients start first: they must retry until the server listens.
    let clients: Vec<Child> = (1..3)
        .map(|r| {
            spawn(
                "fetch",
                &addr,
                &[secret.clone(), vec![("HANDOFF_RANK", r.to_string())]].concat(),
            )
        })
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(300));
    let server = spawn(
        "serve",
        &addr,
        &[
            secret.clone(),
            vec![("HANDOFF_ID", id.to_string()), ("HANDOFF_WORLD", "3".into())],
        ]
        .concat(),
    )?;
    for c in clients {
        let (ok, out, err) = finish(c)?;
        check(ok && out.trim() == format!("id={id}"), || {
            format!("client: ok={ok} out={out:?} err={err:?}")
        })?;
    }
    let (ok, _, err) = finish(server)?;
    check(ok, || format!("server failed: {err}"))
}

fn never_arrives() -> Result<(), Failed> {
    let addr = free_addr()?;
    let t = Instant::now();
    let server = serve_unique_id(&addr, &test_id(), 2, &opts(500))?;
    let e = server.wait().unwrap_err();
    let took = t.elapsed();
    let msg = e.to_string();
    println!("server: {msg} (after {took:?})");
    check(
        matches!(e, Error::BootstrapTimeout { .. })
            && msg.contains("no rank fetched the unique id")
            && msg.contains("missing: rank 1")
            && msg.contains(&addr)
            && !msg.contains("sends and receives"),
        || format!("server: {e:?}"),
    )?;
    check(took < Duration::from_millis(1500), || {
        format!("a 500 ms server took {took:?}")
    })?;
    // A client whose server never comes: a timeout naming the address, in bounded time.
    let other = free_addr()?;
    let t = Instant::now();
    let e = fetch_unique_id(&other, 1, &opts(500)).unwrap_err();
    let took = t.elapsed();
    let msg = e.to_string();
    println!("client: {msg} (after {took:?})");
    check(
        matches!(e, Error::BootstrapTimeout { .. })
            && msg.contains("rank 0 never answered: nothing listened")
            && msg.contains(&other)
            && !msg.contains("sends and receives"),
        || format!("client: {e:?}"),
    )?;
    check(took < Duration::from_millis(1500), || {
        format!("a 500 ms client took {took:?}")
    })
}

fn port_in_use() -> Result<(), Failed> {
    let holder = TcpListener::bind("127.0.0.1:0")?;
    let addr = holder.local_addr()?.to_string();
    let e = serve_unique_id(&addr, &test_id(), 2, &opts(1000))
        .unwrap_err()
        .to_string();
    check(e.contains(&addr) && e.contains("MASTER_PORT"), || e.clone())
}

fn garbage_and_wrong_version() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let server = serve_unique_id(&addr, &id, 2, &opts(10_000))?;
    let (status, msg) = refusal(&exchange_raw(&addr, b"GET / HTTP/1.1\r\n\r\n")?)?;
    check(
        status == 1 && msg.contains("did not speak the handoff bootstrap protocol"),
        || format!("garbage got {msg:?}"),
    )?;
    // A client of version 1 sends 8 bytes and waits: it is told both versions at once.
    let (_, msg) = refusal(&exchange_raw(&addr, b"HNDOFF\0\x01")?)?;
    check(
        msg.contains("version 1 asked") && msg.contains(&format!("speaks version {PROTOCOL_VERSION}")),
        || format!("version 1 got {msg:?}"),
    )?;
    let mut wrong = hello(1, 0);
    wrong[7] = PROTOCOL_VERSION + 1;
    let (_, msg) = refusal(&exchange_raw(&addr, &wrong)?)?;
    check(msg.contains(&format!("version {}", PROTOCOL_VERSION + 1)), || {
        format!("wrong version got {msg:?}")
    })?;
    // The right client is still served, and the server then ends well.
    let got = fetch_unique_id(&addr, 1, &opts(5000))?;
    check(got == id, || "another id".into())?;
    server.wait()?;
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
    let e = fetch_unique_id(&addr, 1, &opts(5000)).unwrap_err().to_string();
    let _ = t.join();
    check(e.contains("another program"), || e.clone())
}

/// `spawn_local` starts the ranks with the variables a launcher sets, and a fresh secret, which
/// `Launch::from_env` then reads in each of them; they share an id through it.
fn spawn_local_ranks() -> Result<(), Failed> {
    let job = handoff::nccl::bootstrap::spawn_local(3, |_, cmd| {
        cmd.env(ROLE, "launch")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
    })?;
    let mut masters = Vec::new();
    for r in job.wait_timeout(Duration::from_secs(60))?.ranks {
        let (rank, ok, out, err) = (r.rank, r.success(), r.stdout, r.stderr);
        let f: Vec<&str> = out.split_whitespace().collect();
        let want = ["torchrun", &rank.to_string(), "3", &rank.to_string()];
        check(ok && f.len() == 7 && f[..4] == want, || {
            format!("rank {rank}: ok={ok} out={out:?} err={err:?}")
        })?;
        check(
            f[5] == "secret=true" && f[6] == format!("id={}", test_id()),
            || format!("rank {rank}: {out:?}"),
        )?;
        masters.push(f[4].to_string());
    }
    check(
        masters
            .iter()
            .all(|m| m == &masters[0] && m.starts_with("127.") && !m.starts_with("127.0.0.")),
        || format!("ranks disagree on the address: {masters:?}"),
    )
}

/// A valid hello claiming rank 1 with the secret: its Noise message (48 bytes) is then trickled.
const SLOW_HELLO: &[u8] = b"HNDOFF\0\x03\x01\0\0\0\x01";

/// A client that connects, sends `first`, then one byte every 100 ms (reading whatever comes
/// back) until the server has closed the connection or `limit` passes. Returns how long after
/// connecting the server closed it (`None`: it never did).
fn trickle(
    addr: &str,
    first: &'static [u8],
    limit: Duration,
) -> Result<JoinHandle<Option<Duration>>, Failed> {
    let mut c = connect(addr)?;
    Ok(std::thread::spawn(move || {
        let t = Instant::now();
        let _ = c.set_read_timeout(Some(Duration::from_millis(100)));
        if c.write_all(first).is_err() {
            return Some(t.elapsed());
        }
        let mut buf = [0u8; 512];
        let mut eof = false;
        while t.elapsed() < limit {
            // After the server's FIN (a refusal), keep writing until the server is gone: the
            // write then fails.
            if c.write_all(b"x").is_err() {
                return Some(t.elapsed());
            }
            match c.read(&mut buf) {
                Ok(0) if eof => std::thread::sleep(Duration::from_millis(100)),
                Ok(0) => eof = true,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return Some(t.elapsed()),
            }
        }
        None
    }))
}

fn trickler_cut_off() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let deadline = Duration::from_secs(1);
    let server = serve_unique_id(
        &addr,
        &id,
        2,
        &opts(20_000)
            .with_secret(secret())
            .with_connection_timeout(deadline),
    )?;
    // One trickles a valid hello and then its Noise message a byte at a time; one sends a
    // wrong hello and goes on trickling after the refusal.
    let slow_hello = trickle(&addr, SLOW_HELLO, Duration::from_secs(6))?;
    let garbage = trickle(&addr, b"GARBAGE!", Duration::from_secs(6))?;
    let (a, b) = (slow_hello.join().unwrap(), garbage.join().unwrap());
    println!("slow hello cut off after {a:?}, garbage after {b:?} (deadline {deadline:?})");
    let a = a.ok_or("the slow hello was never cut off")?;
    let b = b.ok_or("the garbage trickler was never cut off")?;
    check(
        a >= deadline - Duration::from_millis(100) && a < deadline + Duration::from_millis(600),
        || format!("slow hello cut off after {a:?}, deadline {deadline:?}"),
    )?;
    check(b < deadline + Duration::from_millis(600), || {
        format!("garbage cut off after {b:?}")
    })?;
    // The server serves on.
    check(
        fetch_unique_id(&addr, 1, &opts(5000).with_secret(secret()))? == id,
        || "another id".into(),
    )?;
    server.wait()?;
    Ok(())
}

fn trickler_and_server_deadline() -> Result<(), Failed> {
    // The case: a 2 s server, a client sending a wrong hello and then a byte every
    // 100 ms; and one trickling a right hello.
    let addr = free_addr()?;
    let timeout = Duration::from_secs(2);
    let t = Instant::now();
    let server = serve_unique_id(
        &addr,
        &test_id(),
        2,
        &BootstrapOptions::new(timeout).with_secret(secret()),
    )?;
    let garbage = trickle(&addr, b"GARBAGE!", Duration::from_secs(8))?;
    let slow_hello = trickle(&addr, SLOW_HELLO, Duration::from_secs(8))?;
    let e = server.wait().unwrap_err();
    let took = t.elapsed();
    let (a, b) = (garbage.join().unwrap(), slow_hello.join().unwrap());
    println!("server ended after {took:?} (timeout {timeout:?}); tricklers cut off after {a:?}, {b:?}: {e}");
    check(took < timeout + Duration::from_millis(500), || {
        format!("a {timeout:?} server took {took:?}")
    })?;
    let msg = e.to_string();
    check(
        matches!(e, Error::BootstrapTimeout { .. })
            && msg.contains("no rank fetched the unique id")
            && msg.contains("cut off unfinished at their deadline")
            && msg.contains("not the handoff bootstrap protocol"),
        || msg.clone(),
    )?;
    check(
        b.is_some_and(|b| b < timeout + Duration::from_millis(600)),
        || format!("the slow hello was cut off after {b:?}"),
    )
}

fn idle_and_trickling() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let server = serve_unique_id(&addr, &id, 2, &opts(20_000).with_secret(secret()))?;
    let idle: Vec<TcpStream> = (0..5).map(|_| connect(&addr)).collect::<Result<_, _>>()?;
    let trickler = trickle(&addr, SLOW_HELLO, Duration::from_secs(3))?;
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let got = fetch_unique_id(&addr, 1, &opts(10_000).with_secret(secret()))?;
    let took = t.elapsed();
    println!("the real rank got the id after {took:?} beside 5 idle connections and a trickler");
    check(got == id, || "another id".into())?;
    check(took < Duration::from_millis(500), || {
        format!("the real rank waited {took:?}")
    })?;
    // Once every rank is served the server ends, and closes the others.
    let t = Instant::now();
    server.wait()?;
    let cut = trickler.join().unwrap();
    check(
        t.elapsed() < Duration::from_millis(500) && cut.is_some_and(|c| c < Duration::from_secs(2)),
        || format!("server ended after {:?}, trickler cut after {cut:?}", t.elapsed()),
    )?;
    drop(idle);
    Ok(())
}

fn served_once() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let server = serve_unique_id(&addr, &id, 4, &opts(20_000))?;
    // world - 1 = 3 bad hellos, and more: none is served and none counts.
    for (bytes, says) in [
        (hello(0, 0), "rank 0 is not one that fetches"),
        (hello(4, 0), "rank 4 is not one"),
        (hello(u32::MAX, 0), "is not one"),
        (hello(1, 0x80), "unknown hello flags"),
        (b"HNDOFF\0\x01".to_vec(), "version 1 asked"),
        (hello(1, 0)[..10].to_vec(), ""),
    ] {
        let reply = exchange_raw(&addr, &bytes)?;
        if says.is_empty() {
            check(reply.is_empty(), || format!("a cut hello got {reply:?}"))?;
        } else {
            let (_, msg) = refusal(&reply)?;
            check(msg.contains(says), || format!("{bytes:?} got {msg:?}"))?;
        }
    }
    check(fetch_unique_id(&addr, 1, &opts(5000))? == id, || {
        "another id".into()
    })?;
    // Rank 1 again: refused, naming the rank; the others are still served.
    let e = fetch_unique_id(&addr, 1, &opts(5000)).unwrap_err().to_string();
    check(e.contains("rank 1 has already fetched the id"), || e.clone())?;
    let others: Vec<JoinHandle<handoff::Result<UniqueId>>> = [2, 3]
        .into_iter()
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || fetch_unique_id(&addr, r, &opts(5000)))
        })
        .collect();
    for o in others {
        check(o.join().unwrap()? == id, || "another id".into())?;
    }
    server.wait()?;
    Ok(())
}

/// A rogue that claims `rank` with the secret flag and a made-up first Noise message (or, with
/// `idle`, the clear hello alone, then nothing). Returns every byte it received, and the
/// connection (held open while idle).
fn rogue(addr: &str, rank: u32, idle: bool) -> Result<(Vec<u8>, TcpStream), Failed> {
    let mut c = connect(addr)?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    let h = hello(rank, 1);
    if idle {
        c.write_all(&h[..13])?;
        return Ok((Vec::new(), c));
    }
    c.write_all(&h)?;
    c.shutdown(Shutdown::Write)?;
    let mut got = Vec::new();
    c.read_to_end(&mut got)?;
    Ok((got, c))
}

fn rogues_with_secret() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let server = serve_unique_id(&addr, &id, 4, &opts(20_000).with_secret(secret()))?;
    let mut seen = Vec::new();
    // world - 1 rogues claim every rank with made-up handshakes, three more hold handshakes
    // open, and one claims a rank without the flag.
    for rank in 1..4 {
        let (got, _) = rogue(&addr, rank, false)?;
        let (status, msg) = refusal(&got)?;
        check(status == 4 && msg.contains("different secrets"), || {
            format!("rogue got {status} {msg:?}")
        })?;
        seen.extend(got);
    }
    let idle: Vec<(Vec<u8>, TcpStream)> = (1..4).map(|r| rogue(&addr, r, true)).collect::<Result<_, _>>()?;
    let (status, msg) = refusal(&exchange_raw(&addr, &hello(2, 0))?)?;
    check(status == 4 && msg.contains("holds none"), || {
        format!("flagless rogue got {msg:?}")
    })?;
    check(!contains(&seen, id.as_bytes()), || "a rogue saw the id".into())?;
    // The real ranks, meanwhile.
    let secret_opts = opts(5000).with_secret(secret());
    for r in 1..4 {
        check(fetch_unique_id(&addr, r, &secret_opts)? == id, || {
            format!("rank {r}: another id")
        })?;
    }
    server.wait()?;
    drop(idle);
    Ok(())
}

fn secret_mismatch() -> Result<(), Failed> {
    let other = Secret::new("a different secret, 0123456789").unwrap();
    let cases = [
        (
            Some(secret()),
            None,
            "this rank holds none",
            "refused without the shared secret",
        ),
        (
            None,
            Some(secret()),
            "rank 0 none",
            "holding a secret rank 0 lacks",
        ),
        (
            Some(secret()),
            Some(other),
            "different secrets",
            "authentication failed, a different secret",
        ),
    ];
    let runs: Vec<JoinHandle<Result<(), String>>> = cases
        .into_iter()
        .map(|(server_secret, client_secret, client_says, server_says)| {
            std::thread::spawn(move || {
                let addr = free_addr().map_err(|e| format!("{e:?}"))?;
                let with = |o: BootstrapOptions, s: Option<Secret>| match s {
                    Some(s) => o.with_secret(s),
                    None => o,
                };
                let server = serve_unique_id(&addr, &test_id(), 2, &with(opts(1500), server_secret))
                    .map_err(|e| e.to_string())?;
                let t = Instant::now();
                let e = fetch_unique_id(&addr, 1, &with(opts(5000), client_secret)).unwrap_err();
                let took = t.elapsed();
                let s = server.wait().unwrap_err();
                println!("client: {e} ({took:?})\nserver: {s}");
                let (ce, se) = (e.to_string(), s.to_string());
                if !(matches!(e, Error::BootstrapAuth { .. })
                    && ce.contains(client_says)
                    && ce.contains("HANDOFF_SECRET")
                    && took < Duration::from_millis(500))
                {
                    return Err(format!("client: {e:?} after {took:?}"));
                }
                if !(matches!(s, Error::BootstrapTimeout { .. }) && se.contains(server_says)) {
                    return Err(format!("server: {s:?}"));
                }
                Ok(())
            })
        })
        .collect();
    for r in runs {
        r.join().unwrap()?;
    }
    Ok(())
}

/// The bytes a relay saw: client to server, server to client.
type Seen = JoinHandle<(Vec<u8>, Vec<u8>)>;

/// Relays one connection between a client and `to`, keeping each direction's bytes.
fn proxy(to: String) -> Result<(String, Seen), Failed> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    Ok((
        addr,
        std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let server = connect(&to).unwrap();
            let pump = |mut from: TcpStream, mut to: TcpStream| {
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        seen.extend_from_slice(&buf[..n]);
                    }
                    let _ = to.shutdown(Shutdown::Write);
                    seen
                })
            };
            let up = pump(client.try_clone().unwrap(), server.try_clone().unwrap());
            let down = pump(server, client);
            (up.join().unwrap(), down.join().unwrap())
        }),
    ))
}

fn nothing_on_the_wire() -> Result<(), Failed> {
    let id = test_id();
    for with_secret in [true, false] {
        let addr = free_addr()?;
        let o = |t| {
            if with_secret {
                opts(t).with_secret(secret())
            } else {
                opts(t)
            }
        };
        let server = serve_unique_id(&addr, &id, 2, &o(10_000))?;
        let (via, relay) = proxy(addr.clone())?;
        check(fetch_unique_id(&via, 1, &o(5000))? == id, || "another id".into())?;
        server.wait()?;
        let (up, down) = relay.join().unwrap();
        let wire = [up, down].concat();
        // Without a secret the id crosses in the clear, which shows the check can see it.
        check(contains(&wire, id.as_bytes()) != with_secret, || {
            format!(
                "secret {with_secret}: the id on the wire: {}",
                contains(&wire, id.as_bytes())
            )
        })?;
        check(!contains(&wire, &SECRET.as_bytes()[..8]), || {
            "the secret crossed the wire".into()
        })?;
    }
    Ok(())
}

/// An honest exchange under the secret, captured by a relay, then its client bytes replayed
/// to a new server, whole and with a bit flipped in each part (the clear hello's rank, the
/// first Noise message, the confirmation): each is refused as an authentication failure, sees
/// nothing of the id, and the real rank is served after them.
fn replayed_exchange() -> Result<(), Failed> {
    let id = test_id();
    let o = |t| opts(t).with_secret(secret());
    let addr = free_addr()?;
    let server = serve_unique_id(&addr, &id, 2, &o(10_000))?;
    let (via, relay) = proxy(addr.clone())?;
    check(fetch_unique_id(&via, 1, &o(5000))? == id, || "another id".into())?;
    server.wait()?;
    let (up, _) = relay.join().unwrap();
    check(up.len() == 13 + 48 + 16, || {
        format!("the client sent {} bytes", up.len())
    })?;
    let addr = free_addr()?;
    let server = serve_unique_id(&addr, &id, 3, &o(10_000))?;
    let flipped = |at: usize, bit: u8| {
        let mut b = up.clone();
        b[at] ^= bit;
        b
    };
    let mut cases = 0;
    for (what, bytes) in [
        ("the whole exchange", up.clone()),
        ("the rank flipped", flipped(12, 3)),
        ("a bit of the first message", flipped(20, 1)),
        ("a bit of the confirmation", flipped(13 + 48 + 2, 1)),
    ] {
        let reply = exchange_raw(&addr, &bytes)?;
        check(!contains(&reply, id.as_bytes()), || format!("{what}: the id"))?;
        // A refusal after the server's handshake message, or at once.
        let refused = if reply.len() > 9 + 48 && reply[8] == 2 {
            [&reply[..8], &reply[9 + 48..]].concat()
        } else {
            reply.clone()
        };
        let (status, msg) = refusal(&refused)?;
        println!("replayed, {what}: {status} {msg}");
        check(status == 4 && msg.contains("different secrets"), || {
            format!("{what}: {status} {msg:?}")
        })?;
        cases += 1;
    }
    println!("bootstrap replayed exchanges: {cases} cases");
    for r in 1..3 {
        check(fetch_unique_id(&addr, r, &o(5000))? == id, || "another id".into())?;
    }
    server.wait()?;
    Ok(())
}

/// A server that answers every connection with `reply` (after reading the client's bytes).
fn fake_server(reply: Vec<u8>) -> Result<String, Failed> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    std::thread::spawn(move || {
        for c in listener.incoming() {
            let Ok(mut c) = c else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = c.read(&mut [0u8; 256]);
            let _ = c.write_all(&reply);
            let _ = c.read(&mut [0u8; 256]);
        }
    });
    Ok(addr)
}

fn server_without_the_secret() -> Result<(), Failed> {
    // A challenge with a made-up proof, then an "id"; and an id sent in the clear.
    let mut challenge = header();
    challenge.push(2);
    challenge.extend_from_slice(&[0x33; 48]);
    challenge.push(0);
    challenge.extend_from_slice(&[0x44; 144]);
    let mut plain = header();
    plain.push(0);
    plain.extend_from_slice(test_id().as_bytes());
    for (what, reply, says) in [
        (
            "made-up proof",
            challenge,
            "did not prove it holds this rank's secret",
        ),
        (
            "id in the clear",
            plain,
            "without proving it holds this rank's shared secret",
        ),
    ] {
        let addr = fake_server(reply)?;
        let r = fetch_unique_id(&addr, 1, &opts(2000).with_secret(secret()));
        println!("{what}: {r:?}");
        match r {
            Err(Error::BootstrapAuth { detail, .. }) if detail.contains(says) => {}
            other => return Err(format!("{what}: {other:?}").into()),
        }
    }
    Ok(())
}

fn trickling_server() -> Result<(), Failed> {
    // A server that answers a valid header and a refusal of 65535 bytes, one byte per 100 ms;
    // and one that accepts and says nothing.
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let slow = std::thread::spawn(move || {
        let _ = listener.set_nonblocking(true);
        let mut conns = Vec::new();
        while !stopped.load(Ordering::Relaxed) {
            if let Ok((c, _)) = listener.accept() {
                let _ = c.set_nonblocking(false);
                conns.push((c, 0usize));
            }
            let mut reply = header();
            reply.extend_from_slice(&[1, 0xff, 0xff]);
            for (c, sent) in &mut conns {
                let byte = reply.get(*sent).copied().unwrap_or(b'a');
                if (&*c).write_all(&[byte]).is_ok() {
                    *sent += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let silent = TcpListener::bind("127.0.0.1:0")?;
    let silent_addr = silent.local_addr()?.to_string();
    for (what, addr) in [("trickling", &addr), ("silent", &silent_addr)] {
        let t = Instant::now();
        let e = fetch_unique_id(addr, 1, &opts(1000)).unwrap_err();
        let took = t.elapsed();
        println!("{what} server: the rank gave up after {took:?} (timeout 1s): {e}");
        let msg = e.to_string();
        check(
            matches!(e, Error::BootstrapTimeout { .. }) && msg.contains("did not hand over the id in time"),
            || format!("{what}: {e:?}"),
        )?;
        check(took < Duration::from_millis(1400), || {
            format!("{what}: a 1 s fetch took {took:?}")
        })?;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = slow.join();
    Ok(())
}

fn flood() -> Result<(), Failed> {
    let addr = free_addr()?;
    let id = test_id();
    let server = serve_unique_id(
        &addr,
        &id,
        2,
        &opts(20_000).with_connection_timeout(Duration::from_millis(1500)),
    )?;
    // More idle connections than the server serves at once: the first MAX_CONNECTIONS wait,
    // the next are answered busy.
    let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS + 4)
        .map(|_| connect(&addr))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(200));
    let mut late = connect(&addr)?;
    late.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut reply = Vec::new();
    let _ = late.read_to_end(&mut reply);
    let (status, msg) = refusal(&reply)?;
    check(status == 3 && msg.contains("try again"), || {
        format!("late connection got {status} {msg:?}")
    })?;
    // A real rank retries until a slot frees (the idle ones are cut off at 1.5 s).
    let t = Instant::now();
    check(fetch_unique_id(&addr, 1, &opts(10_000))? == id, || {
        "another id".into()
    })?;
    println!(
        "behind {} idle connections the rank got the id after {:?}",
        idle.len(),
        t.elapsed()
    );
    check(t.elapsed() < Duration::from_secs(3), || {
        format!("took {:?}", t.elapsed())
    })?;
    server.wait()?;
    Ok(())
}

/// Client bytes built as a real client's, then damaged.
fn hostile_client_bytes() -> impl Strategy<Value = Vec<u8>> {
    let built = (
        prop_oneof![4 => Just(PROTOCOL_VERSION), 1 => any::<u8>()],
        prop_oneof![2 => Just(1u8), 1 => any::<u8>()],
        prop_oneof![4 => 0u32..5, 1 => any::<u32>()],
        proptest::collection::vec(any::<u8>(), 0..120),
        any::<proptest::sample::Index>(),
    )
        .prop_map(|(version, flags, rank, tail, cut)| {
            let mut b = hello(rank, flags);
            b[7] = version;
            b.extend_from_slice(&tail);
            b.truncate(cut.index(b.len()) + 1);
            b
        });
    prop_oneof![proptest::collection::vec(any::<u8>(), 0..200), built]
}

fn property_server_over_tcp() -> Result<(), Failed> {
    const CASES: u32 = 300;
    let addr = free_addr()?;
    let id = test_id();
    let deadline = Duration::from_secs(2);
    let server: IdServer = serve_unique_id(
        &addr,
        &id,
        3,
        &opts(25_000)
            .with_secret(secret())
            .with_connection_timeout(deadline),
    )?;
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        max_shrink_iters: 64,
        ..Config::default()
    });
    let ran = Cell::new(0);
    let r = runner.run(&hostile_client_bytes(), |bytes| {
        ran.set(ran.get() + 1);
        let t = Instant::now();
        // The server listens throughout: one connection, no retries.
        let reply = TcpStream::connect(&addr)
            .map_err(Failed::from)
            .and_then(|c| send_raw(c, &bytes))
            .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        // Closed (read to its end) within the connection's deadline, never with the id.
        prop_assert!(
            t.elapsed() < deadline + Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        prop_assert!(!contains(&reply, id.as_bytes()));
        if !reply.is_empty() {
            prop_assert_eq!(&reply[..8], &header()[..]);
            prop_assert!(matches!(reply[8], 1 | 2 | 4), "status {}", reply[8]);
        }
        Ok(())
    });
    println!("bootstrap server over TCP: {} cases", ran.get());
    r.map_err(|e| format!("{e}"))?;
    // The real ranks are served after all that.
    for r in 1..3 {
        check(
            fetch_unique_id(&addr, r, &opts(5000).with_secret(secret()))? == id,
            || "another id".into(),
        )?;
    }
    server.wait()?;
    Ok(())
}

fn property_client_over_tcp() -> Result<(), Failed> {
    const CASES: u32 = 40;
    let timeout = Duration::from_millis(200);
    let reply = Arc::new(Mutex::new(Vec::<u8>::new()));
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let answer = reply.clone();
    // Answers every connection with the current case's bytes, then closes it.
    std::thread::spawn(move || {
        for c in listener.incoming() {
            let Ok(mut c) = c else { continue };
            let bytes = answer.lock().unwrap().clone();
            let _ = c.write_all(&bytes);
            let _ = c.shutdown(Shutdown::Write);
            let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = c.read(&mut [0u8; 256]);
        }
    });
    let built = (
        0u8..6,
        proptest::collection::vec(any::<u8>(), 0..300),
        any::<proptest::sample::Index>(),
    )
        .prop_map(|(status, body, cut)| {
            let mut b = header();
            b.push(status);
            b.extend_from_slice(&body);
            b.truncate(cut.index(b.len() + 1));
            b
        });
    let strategy = prop_oneof![proptest::collection::vec(any::<u8>(), 0..300), built];
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        max_shrink_iters: 64,
        ..Config::default()
    });
    let ran = Cell::new(0);
    let r = runner.run(&(strategy, any::<bool>()), |(bytes, with_secret)| {
        ran.set(ran.get() + 1);
        let plain_id = bytes.len() >= 9 + UniqueId::BYTES && bytes[..8] == header()[..] && bytes[8] == 0;
        *reply.lock().unwrap() = bytes;
        let o = if with_secret {
            opts(200).with_secret(secret())
        } else {
            opts(200)
        };
        let t = Instant::now();
        let got = fetch_unique_id(&addr, 1, &o);
        prop_assert!(
            t.elapsed() < timeout + Duration::from_millis(800),
            "{:?}",
            t.elapsed()
        );
        match got {
            Ok(_) => prop_assert!(plain_id && !with_secret),
            Err(e) => {
                let typed = matches!(
                    e,
                    Error::Bootstrap { .. } | Error::BootstrapAuth { .. } | Error::BootstrapTimeout { .. }
                );
                prop_assert!(typed, "{e:?}");
            }
        }
        Ok(())
    });
    println!("bootstrap client over TCP: {} cases", ran.get());
    r.map_err(|e| format!("{e}"))?;
    Ok(())
}

fn property_launcher_variables() -> Result<(), Failed> {
    const CASES: u32 = 3000;
    const NAMES: [&str; 13] = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "HANDOFF_PORT",
        "HANDOFF_SECRET",
        "HANDOFF_SECRET_FILE",
    ];
    let text = |values: &'static [&'static str]| {
        prop_oneof![
            2 => Just(None),
            4 => proptest::sample::select(values).prop_map(|s| Some(s.to_string())),
            1 => any::<String>().prop_map(Some),
        ]
        .boxed()
    };
    let numbers: &'static [&'static str] = &[
        "0",
        "1",
        "2",
        "3",
        " 3 ",
        "0",
        "1",
        "-1",
        "+1",
        "1.0",
        "",
        "2147483647",
        "2147483648",
        "4294967296",
        "18446744073709551615",
        "18446744073709551616",
    ];
    let hosts: &'static [&'static str] = &["node0", "10.0.0.1", "::1", "[::1]", "", " ", "a:b:c", "\0"];
    let ports: &'static [&'static str] = &["29500", "0", "65535", "65536", "-1", " 1 ", "", "0x10"];
    let files: &'static [&'static str] = &[
        "/dev/zero",
        "/proc/self/status",
        "/nonexistent/token",
        "/",
        ".",
        "0123456789abcdef",
    ];
    // The secret variables are mostly unset, so that some cases get past them.
    let vars: Vec<BoxedStrategy<Option<String>>> = NAMES
        .iter()
        .map(|n| match *n {
            "MASTER_ADDR" => text(hosts),
            "MASTER_PORT" | "HANDOFF_PORT" => text(ports),
            "HANDOFF_SECRET" | "HANDOFF_SECRET_FILE" => {
                prop_oneof![12 => Just(None), 1 => text(files)].boxed()
            }
            _ => text(numbers),
        })
        .collect();
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        max_shrink_iters: 64,
        ..Config::default()
    });
    let (ran, ok) = (Cell::new(0), Cell::new(0));
    let r = runner.run(&vars, |values| {
        ran.set(ran.get() + 1);
        let lookup = |k: &str| NAMES.iter().position(|n| *n == k).and_then(|i| values[i].clone());
        match Launch::from_vars(lookup) {
            Ok(Some(l)) => {
                ok.set(ok.get() + 1);
                prop_assert!(l.rank < l.world_size && l.world_size <= i32::MAX as usize);
                prop_assert!(l.world_size == 1 || !l.master.is_empty());
                // An address given as an IP literal makes an address one can connect to.
                let ip = lookup("MASTER_ADDR").and_then(|a| a.trim().parse::<std::net::IpAddr>().ok());
                if ip.is_some() && lookup("MASTER_PORT").is_some() {
                    prop_assert!(l.master.parse::<std::net::SocketAddr>().is_ok(), "{}", l.master);
                }
            }
            Ok(None) => {}
            Err(Error::InvalidArgument(m)) => prop_assert!(!m.is_empty()),
            Err(e) => prop_assert!(false, "not a typed argument error: {e:?}"),
        }
        Ok(())
    });
    println!("launcher variables: {} cases, {} accepted", ran.get(), ok.get());
    r.map_err(|e| format!("{e}"))?;
    check(ok.get() > 0, || "no case was a valid launch".into())
}
