//! `cargo bench --bench verify_scale -- [--worlds 2,4,8,16,32,64] [--ops N] [--warmup N]
//! [--csv PATH] [--svg PATH] [--no-netns]`
//!
//! What verification between hosts costs each rank as the world grows (issue 30, "Planned for
//! a thousand ranks"), CPU only: for each world size, that many rank processes, each running
//! verification alone (`handoff::nccl::rehearsal`, no GPU, no NCCL) with every pair on the TCP
//! channel (`HANDOFF_VERIFY_CHANNEL=tcp`), as ranks on as many hosts would be. Per world:
//! - **creation**: the connections each rank has, the handshakes (TCP connections opened in
//!   the namespace, each one authenticated channel connection), the time `Rank::settle` took
//!   (and of it, the time not spent in the file all-gather that stands in for NCCL's), what the
//!   handshakes sent, and each rank's resident memory and threads afterwards;
//! - **idle**: each rank's CPU time over a second in which nothing is verified (its receiver
//!   threads, one per peer, wake to look at their sockets);
//! - **p2p**: `--ops` steps of a ring (fewer above 4 ranks: see `Opts::ops_for`), each rank
//!   verifying a send to the next rank and a receive from the previous one (even ranks send
//!   first, odd ranks receive first);
//! - **collectives**: as many all-reduces, one verified collective each.
//!
//! Each phase starts and ends with every rank at a barrier (files, with the parent), the
//! channel left 100 ms to go quiet between; then each rank reads the kernel's counters of its
//! own TCP connections (`harness/sockets.rs`): data segments and bytes, sent and received, the
//! kernel's retransmissions apart. The channel exposes no count of its own; it sends what it
//! flushes in one call, a record unless its socket was full (then what queued goes together),
//! so with `TCP_NODELAY` a data segment sent once is a record: the bytes say so, 58 for a
//! record of one frame.
//! Unless `--no-netns` (or where it cannot: not root, no `unshare` or `ip`), the whole run is in
//! a fresh network namespace whose loopback carries nothing else, and the parent reads the
//! namespace's own totals at each barrier too (`/proc/net/snmp`, the loopback's packets).
//!
//! Prints a table (the median rank's figures per rank per operation, with the lowest and
//! highest rank's where they differ), writes it as CSV and plots it. Every rank is a process
//! with a receiver thread per peer: at 64 ranks, 4,032 threads on however many cores there
//! are; the counts do not depend on them, the times do.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

mod harness;
#[path = "verify_scale/plot.rs"]
mod plot;
#[path = "verify_scale/rank.rs"]
mod rank;

use rank::{DIR, OPS, ROLE, Report, WARMUP, WORLD, rank_main, release};

/// Set in the copy of the benchmark that runs in its own network namespace.
const IN_NETNS: &str = "HANDOFF_SCALE_NETNS";

struct Opts {
    worlds: Vec<usize>,
    ops: usize,
    warmup: usize,
    csv: PathBuf,
    svg: PathBuf,
    netns: bool,
}

impl Opts {
    /// Timed operations per phase in a world of `n`: `ops` up to 4 ranks, then fewer as `4 / n`
    /// (a collective's records grow as `n^2` over the world), at least 20.
    fn ops_for(&self, n: usize) -> usize {
        (self.ops * 4 / n.max(4)).clamp(20.min(self.ops), self.ops)
    }
}

fn opts() -> Result<Opts, String> {
    let mut o = Opts {
        worlds: vec![2, 4, 8, 16, 32, 64],
        ops: 300,
        warmup: 30,
        csv: PathBuf::from("verify-scale.csv"),
        svg: PathBuf::from("verify-scale.svg"),
        netns: true,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|e| format!("{v}: {e}"));
        match a.as_str() {
            "--worlds" => {
                o.worlds = value()?
                    .split(',')
                    .map(|w| number(w.to_string()))
                    .collect::<Result<_, _>>()?;
            }
            "--ops" => o.ops = number(value()?)?,
            "--warmup" => o.warmup = number(value()?)?,
            "--csv" => o.csv = value()?.into(),
            "--svg" => o.svg = value()?.into(),
            "--no-netns" => o.netns = false,
            "--bench" => {}
            other => return Err(format!("unknown option {other}")),
        }
    }
    if o.ops == 0 || o.worlds.iter().any(|&w| w < 2) {
        return Err("--ops must be positive and every world at least 2".into());
    }
    Ok(o)
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        if let Err(e) = rank_main(role.parse().expect("a rank")) {
            eprintln!("rank {role}: {e}");
            std::process::exit(1);
        }
        return;
    }
    let o = match opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("verify_scale: {e}");
            std::process::exit(2);
        }
    };
    let netns = if std::env::var_os(IN_NETNS).is_some() {
        true
    } else if o.netns {
        match in_fresh_netns() {
            Ok(code) => std::process::exit(code),
            Err(why) => {
                println!("not in a network namespace of its own ({why}): namespace totals not read");
                false
            }
        }
    } else {
        false
    };
    if let Err(e) = run(&o, netns) {
        eprintln!("verify_scale: {e}");
        std::process::exit(1);
    }
}

/// Runs this benchmark again in a fresh network namespace with its loopback up, and returns
/// its exit code; or why it cannot (not root, no `unshare` or `ip`), having tried one.
fn in_fresh_netns() -> Result<i32, String> {
    let probe = Command::new("unshare")
        .args(["--net", "--", "ip", "link", "set", "lo", "up"])
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("unshare: {e}"))?;
    if !probe.status.success() {
        return Err(format!(
            "unshare --net -- ip link set lo up: {}: {}",
            probe.status,
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let status = Command::new("unshare")
        .args([
            "--net",
            "--",
            "sh",
            "-c",
            "ip link set lo up && exec \"$0\" \"$@\"",
        ])
        .arg(&exe)
        .args(std::env::args().skip(1))
        .env(IN_NETNS, "1")
        .status()
        .map_err(|e| format!("unshare: {e}"))?;
    status.code().ok_or_else(|| format!("unshare: {status}"))
}

// --- The parent -----------------------------------------------------------------------------

/// The namespace's own totals: TCP's (`/proc/net/snmp`) and the loopback's.
#[derive(Clone, Copy, Default)]
struct Netns {
    active_opens: u64,
    out_segs: u64,
    retrans_segs: u64,
    lo_packets: u64,
    lo_bytes: u64,
}

fn netns_totals() -> Netns {
    let snmp = std::fs::read_to_string("/proc/net/snmp").unwrap_or_default();
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap_or(""), tcp.next().unwrap_or(""));
    let field: BTreeMap<&str, u64> = names
        .split_whitespace()
        .zip(values.split_whitespace())
        .filter_map(|(n, v)| Some((n, v.parse().ok()?)))
        .collect();
    // The namespace's own devices (/sys/class/net shows the namespace sysfs was mounted in):
    // after "lo:", received bytes and packets and six more, then sent bytes and packets.
    let dev = std::fs::read_to_string("/proc/net/dev").unwrap_or_default();
    let lo: Vec<u64> = dev
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("lo:"))
        .map(|f| f.split_whitespace().filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_default();
    let lo = |i: usize| lo.get(i).copied().unwrap_or(0);
    Netns {
        active_opens: field.get("ActiveOpens").copied().unwrap_or(0),
        out_segs: field.get("OutSegs").copied().unwrap_or(0),
        retrans_segs: field.get("RetransSegs").copied().unwrap_or(0),
        lo_packets: lo(9),
        lo_bytes: lo(8),
    }
}

impl Netns {
    fn since(self, b: Netns) -> Netns {
        Netns {
            active_opens: self.active_opens - b.active_opens,
            out_segs: self.out_segs - b.out_segs,
            retrans_segs: self.retrans_segs - b.retrans_segs,
            lo_packets: self.lo_packets - b.lo_packets,
            lo_bytes: self.lo_bytes - b.lo_bytes,
        }
    }
}

/// One world's figures.
struct Row {
    world: usize,
    reports: Vec<Report>,
    /// The namespace's totals over setup, the p2p phase and the collective phase.
    netns: Option<[Netns; 3]>,
    ops: usize,
}

fn world_run(world: usize, o: &Opts, netns: bool) -> Result<Row, String> {
    let dir = std::env::temp_dir().join(format!("handoff-verify-scale-{}-{world}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children: Vec<Child> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .env(ROLE, r.to_string())
                .env(DIR, &dir)
                .env(WORLD, world.to_string())
                .env(OPS, o.ops_for(world).to_string())
                .env(WARMUP, o.warmup.to_string())
                .env("HANDOFF_VERIFY_CHANNEL", "tcp")
                .env("HANDOFF_VERIFY_ADDR", "127.0.0.1")
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("starting rank {r}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let mut marks = Vec::new();
    let phases = [
        "begin",
        "settled",
        "idle",
        "p2p-warm",
        "p2p-start",
        "p2p-done",
        "p2p-counted",
        "coll-warm",
        "coll-start",
        "coll-done",
        "coll-counted",
        "end",
    ];
    let mut failed = None;
    for p in phases {
        match release(&dir, world, p, &mut children, netns_totals) {
            Ok(n) => marks.push((p, n)),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    if failed.is_some() {
        for c in &mut children {
            let _ = c.kill();
        }
    }
    let mut reports = Vec::new();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            failed.get_or_insert(format!("rank {r} failed: {}", out.status));
            continue;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().last().unwrap_or("");
        reports.push(Report::parse(line).ok_or_else(|| format!("rank {r} reported {line:?}"))?);
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(e) = failed {
        return Err(format!("world {world}: {e}"));
    }
    let at = |p: &str| {
        marks
            .iter()
            .find(|(q, _)| *q == p)
            .map(|&(_, n)| n)
            .expect("every phase")
    };
    Ok(Row {
        world,
        reports,
        netns: netns.then(|| {
            [
                at("settled").since(at("begin")),
                at("p2p-counted").since(at("p2p-start")),
                at("coll-counted").since(at("coll-start")),
            ]
        }),
        ops: o.ops_for(world),
    })
}

/// The lowest, median and highest of the ranks' `f`.
fn spread(reports: &[Report], f: impl Fn(&Report) -> f64) -> [f64; 3] {
    let mut v: Vec<f64> = reports.iter().map(f).collect();
    v.sort_by(f64::total_cmp);
    [v[0], v[v.len() / 2], v[v.len() - 1]]
}

/// `lo/median/hi`, or one number where they agree.
fn show(s: [f64; 3], digits: usize) -> String {
    if s[0] == s[2] {
        format!("{:.*}", digits, s[1])
    } else {
        format!("{:.*}/{:.*}/{:.*}", digits, s[0], digits, s[1], digits, s[2])
    }
}

/// The CSV's columns: (name, value of a row). Per-rank figures are the median rank's.
type Column = (&'static str, fn(&Row) -> f64);

fn columns() -> Vec<Column> {
    fn med(r: &Row, f: impl Fn(&Report) -> f64) -> f64 {
        spread(&r.reports, f)[1]
    }
    fn per_op(r: &Row, f: impl Fn(&Report) -> u64) -> f64 {
        med(r, |x| f(x) as f64 / r.ops as f64)
    }
    fn ns(r: &Row, phase: usize, f: impl Fn(&Netns) -> u64) -> f64 {
        r.netns.map_or(f64::NAN, |n| f(&n[phase]) as f64)
    }
    vec![
        ("world", |r| r.world as f64),
        ("connections_per_rank", |r| med(r, |x| x.setup.established as f64)),
        ("handshakes_in_netns", |r| ns(r, 0, |n| n.active_opens)),
        ("setup_ms", |r| med(r, |x| x.settle_us / 1e3)),
        ("setup_ms_outside_gather", |r| {
            med(r, |x| (x.settle_us - x.gather_us) / 1e3)
        }),
        ("setup_segments_out_per_rank", |r| {
            med(r, |x| x.setup.records_out as f64)
        }),
        ("setup_bytes_out_per_rank", |r| {
            med(r, |x| x.setup.bytes_out as f64)
        }),
        ("rss_mib_per_rank", |r| med(r, |x| x.rss_kib as f64 / 1024.0)),
        ("threads_per_rank", |r| med(r, |x| x.threads as f64)),
        ("idle_cpu_ms_per_s_per_rank", |r| med(r, |x| x.idle_cpu_ms_per_s)),
        ("p2p_records_out_per_rank_per_step", |r| {
            per_op(r, |x| x.p2p.records_out)
        }),
        ("p2p_segments_in_per_rank_per_step", |r| {
            per_op(r, |x| x.p2p.segs_in)
        }),
        ("p2p_bytes_out_per_rank_per_step", |r| {
            per_op(r, |x| x.p2p.bytes_out)
        }),
        ("p2p_bytes_in_per_rank_per_step", |r| {
            per_op(r, |x| x.p2p.bytes_in)
        }),
        ("p2p_retransmits_per_rank_per_step", |r| {
            per_op(r, |x| x.p2p.retrans)
        }),
        ("p2p_us_per_step", |r| med(r, |x| x.p2p_us)),
        ("p2p_us_per_step_slowest_rank", |r| {
            spread(&r.reports, |x| x.p2p_us)[2]
        }),
        ("p2p_cpu_us_per_rank_per_step", |r| med(r, |x| x.p2p_cpu_us)),
        ("coll_records_out_per_rank_per_op", |r| {
            per_op(r, |x| x.coll.records_out)
        }),
        ("coll_segments_in_per_rank_per_op", |r| {
            per_op(r, |x| x.coll.segs_in)
        }),
        ("coll_bytes_out_per_rank_per_op", |r| {
            per_op(r, |x| x.coll.bytes_out)
        }),
        ("coll_bytes_in_per_rank_per_op", |r| {
            per_op(r, |x| x.coll.bytes_in)
        }),
        ("coll_retransmits_per_rank_per_op", |r| {
            per_op(r, |x| x.coll.retrans)
        }),
        ("coll_us_per_op", |r| med(r, |x| x.coll_us)),
        ("coll_us_per_op_slowest_rank", |r| {
            spread(&r.reports, |x| x.coll_us)[2]
        }),
        ("coll_cpu_us_per_rank_per_op", |r| med(r, |x| x.coll_cpu_us)),
        ("netns_lo_packets_per_rank_per_coll", |r| {
            ns(r, 2, |n| n.lo_packets) / (r.world * r.ops) as f64
        }),
        ("netns_tcp_out_segs_per_rank_per_coll", |r| {
            ns(r, 2, |n| n.out_segs) / (r.world * r.ops) as f64
        }),
        ("netns_lo_bytes_per_rank_per_coll", |r| {
            ns(r, 2, |n| n.lo_bytes) / (r.world * r.ops) as f64
        }),
    ]
}

fn print_row(r: &Row) {
    let per = |f: fn(&Report) -> u64| spread(&r.reports, |x| f(x) as f64 / r.ops as f64);
    let setup = |f: fn(&Report) -> f64| spread(&r.reports, f);
    println!(
        "{:>5} {:>5} | {:>5} {:>9} {:>15} {:>9} {:>7} {:>9} | {:>15} {:>17} {:>20} | {:>19} {:>19} {:>22} | {}",
        r.world,
        r.ops,
        show(setup(|x| x.setup.established as f64), 0),
        r.netns.map_or("-".into(), |n| n[0].active_opens.to_string()),
        show(setup(|x| (x.settle_us - x.gather_us) / 1e3), 1),
        show(setup(|x| x.rss_kib as f64 / 1024.0), 0),
        show(setup(|x| x.threads as f64), 0),
        format!("{:.1}", setup(|x| x.idle_cpu_ms_per_s)[1]),
        show(per(|x| x.p2p.records_out), 2),
        show(per(|x| x.p2p.bytes_out), 0),
        format!(
            "{:.1} ({:.1})",
            spread(&r.reports, |x| x.p2p_us)[1],
            spread(&r.reports, |x| x.p2p_cpu_us)[1]
        ),
        show(per(|x| x.coll.records_out), 2),
        show(per(|x| x.coll.bytes_out), 0),
        format!(
            "{:.1} ({:.1})",
            spread(&r.reports, |x| x.coll_us)[1],
            spread(&r.reports, |x| x.coll_cpu_us)[1]
        ),
        r.netns.map_or("-".into(), |n| {
            format!(
                "{:.2} pkts, {:.3} retrans",
                n[2].lo_packets as f64 / (r.world * r.ops) as f64,
                n[2].retrans_segs as f64 / (r.world * r.ops) as f64
            )
        }),
    );
}

fn run(o: &Opts, netns: bool) -> Result<(), String> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    println!(
        "verification over the TCP channel, every pair remote: {} timed operations per phase after {} \
         warm-up; {} cores ({cpu}){}",
        o.ops,
        o.warmup,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if netns {
            "; in a network namespace of its own"
        } else {
            ""
        }
    );
    println!(
        "per rank, lo/median/hi over the ranks where they differ: connections, handshakes (the \
         namespace's), setup time outside the all-gather, memory, threads, idle CPU ms per s; \
         per operation: records sent (data segments sent once), bytes sent, µs of wall time (and of \
         the process's CPU time), median rank"
    );
    println!(
        "{:>5} {:>5} | {:>5} {:>9} {:>15} {:>9} {:>7} {:>9} | {:>15} {:>17} {:>20} | {:>19} {:>19} {:>22} | namespace per rank per collective",
        "world",
        "ops",
        "conns",
        "handshks",
        "setup ms (own)",
        "RSS MiB",
        "threads",
        "idle CPU",
        "p2p records",
        "p2p bytes",
        "p2p µs (CPU)",
        "coll records",
        "coll bytes",
        "coll µs (CPU)",
    );
    let mut rows = Vec::new();
    for &w in &o.worlds {
        let row = world_run(w, o, netns)?;
        print_row(&row);
        rows.push(row);
    }
    let cols = columns();
    let mut csv = cols.iter().map(|c| c.0).collect::<Vec<_>>().join(",");
    csv.push('\n');
    for r in &rows {
        let line: Vec<String> = cols.iter().map(|c| format!("{:.3}", (c.1)(r))).collect();
        csv.push_str(&line.join(","));
        csv.push('\n');
    }
    std::fs::write(&o.csv, csv).map_err(|e| format!("{}: {e}", o.csv.display()))?;
    plot::plot(&o.svg, &rows).map_err(|e| format!("{}: {e}", o.svg.display()))?;
    println!("wrote {} and {}", o.csv.display(), o.svg.display());
    Ok(())
}
