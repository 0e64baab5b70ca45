//! fp8 element types (feature `float8`) on a CPU, against the stub libraries of tests/stubs: the
//! stub NCCL records the data type of each call and reports the version it is told to, and the
//! stub runtime's GPU answers compute capability 1.1 (every attribute is 1). So a send, a
//! receive and an all-gather of fp8 reach NCCL with codes 10 and 11, while an fp8 reduction is
//! refused before NCCL is called (NCCL refuses fp8 reductions below sm_90 with
//! invalid-argument) and the communicator stays usable; and an NCCL reporting a version older
//! than 2.24.3 makes every fp8 operation `Error::Unsupported`, in a child process (the crate
//! reads the version once per process).
//!
//! The values themselves are checked on a GPU (tests/fp8.rs): the stub NCCL moves no data.

use std::path::{Path, PathBuf};

use float8::{F8E4M3, F8E5M2};
use handoff::{Communicator, Device, DeviceBuffer, Error, ReduceOp, Stream, group};
use libtest_mimic::{Arguments, Failed, Trial};

mod stubs;

/// Set in the child that runs against an NCCL reporting an old version.
const CHILD: &str = "HANDOFF_FP8_STUB_CHILD";

struct Stubs {
    nccl: libloading::Library,
}

impl Stubs {
    fn count(&self, name: &str) -> i64 {
        let name = std::ffi::CString::new(name).expect("name");
        // SAFETY: `long nccl_stub_count(const char *name, int all)`.
        unsafe {
            let count: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i64> =
                self.nccl.get(b"nccl_stub_count\0").expect("count");
            count(name.as_ptr(), 1)
        }
    }

    /// The data type of the last NCCL call that took one.
    fn last_type(&self) -> i32 {
        // SAFETY: `int nccl_stub_last_type(void)`.
        unsafe {
            let f: libloading::Symbol<unsafe extern "C" fn() -> i32> =
                self.nccl.get(b"nccl_stub_last_type\0").expect("last type");
            f()
        }
    }

    fn set_version(&self, v: i32) {
        // SAFETY: `void nccl_stub_set_version(int)`.
        unsafe {
            let f: libloading::Symbol<unsafe extern "C" fn(i32)> =
                self.nccl.get(b"nccl_stub_set_version\0").expect("set version");
            f(v)
        }
    }
}

fn one_rank() -> Result<(Stream, Communicator), Failed> {
    let dev = Device::new(0)?;
    let stream = Stream::new(&dev)?;
    let comm = Communicator::init_all(std::slice::from_ref(&dev))?
        .pop()
        .ok_or("no communicator")?;
    Ok((stream, comm))
}

fn f8e4(v: &[f32]) -> Vec<F8E4M3> {
    v.iter().map(|&x| F8E4M3::from_f32(x)).collect()
}

/// Sends, receives and all-gathers of both fp8 types reach NCCL with NCCL's codes.
fn moves_reach_nccl(s: &Stubs) -> Result<(), Failed> {
    let (stream, comm) = one_rank()?;
    let a = DeviceBuffer::from_slice(&f8e4(&[1.0, 2.0, 3.0, 4.0]), &stream)?;
    let mut b = DeviceBuffer::<F8E4M3>::zeros(4, &stream)?;
    let sends = s.count("ncclSend");
    group(|g| {
        g.send(&comm, &a, 0, &stream)?;
        g.recv(&comm, &mut b, 0, &stream)
    })?;
    if s.count("ncclSend") != sends + 1 || s.last_type() != 10 {
        return Err(format!(
            "an F8E4M3 self send/recv: {} sends, last type {}, want 1 and 10 (ncclFloat8e4m3)",
            s.count("ncclSend") - sends,
            s.last_type()
        )
        .into());
    }
    let x = DeviceBuffer::from_slice(&[F8E5M2::from_f32(0.5); 8], &stream)?;
    let mut y = DeviceBuffer::<F8E5M2>::zeros(8, &stream)?;
    let gathers = s.count("ncclAllGather");
    comm.all_gather(&x, &mut y, &stream)?;
    if s.count("ncclAllGather") != gathers + 1 || s.last_type() != 11 {
        return Err(format!(
            "an F8E5M2 all-gather: {} calls, last type {}, want 1 and 11 (ncclFloat8e5m2)",
            s.count("ncclAllGather") - gathers,
            s.last_type()
        )
        .into());
    }
    Ok(())
}

/// On a GPU older than sm_90 an fp8 reduction is refused before any NCCL call, and the
/// communicator goes on working.
fn reductions_need_sm_90(s: &Stubs) -> Result<(), Failed> {
    let (stream, comm) = one_rank()?;
    let mut buf = DeviceBuffer::from_slice(&f8e4(&[1.0; 16]), &stream)?;
    let names = ["ncclAllReduce", "ncclReduceScatter", "ncclGroupStart"];
    let before: Vec<i64> = names.iter().map(|n| s.count(n)).collect();
    match comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &stream) {
        Err(Error::InvalidArgument(m)) if m.contains("sm_90") && m.contains("1.1") => {
            println!("refused: {m}")
        }
        other => return Err(format!("an fp8 all-reduce on a 1.1 GPU gave {other:?}").into()),
    }
    let mut out = DeviceBuffer::<F8E4M3>::zeros(16, &stream)?;
    match comm.reduce_scatter(&buf, &mut out, ReduceOp::Max, &stream) {
        Err(Error::InvalidArgument(m)) if m.contains("sm_90") => {}
        other => return Err(format!("an fp8 reduce-scatter on a 1.1 GPU gave {other:?}").into()),
    }
    let after: Vec<i64> = names.iter().map(|n| s.count(n)).collect();
    if after != before {
        return Err(
            format!("refused reductions reached NCCL: {names:?} went {before:?} -> {after:?}").into(),
        );
    }
    // Refused before verification: the communicator is still usable.
    let mut f = DeviceBuffer::from_slice(&[1.0f32; 16], &stream)?;
    comm.all_reduce_in_place(&mut f, ReduceOp::Sum, &stream)?;
    if s.count("ncclAllReduce") != before[0] + 1 {
        return Err("an f32 all-reduce after the refusal did not reach NCCL".into());
    }
    Ok(())
}

/// In the child: the stub NCCL loaded (as 2.28.3), then made to report 2.23.4 before the first
/// fp8 operation: every fp8 operation is Error::Unsupported naming 2.24.3, nothing reaches NCCL,
/// and other types still work.
fn child_old_nccl(s: &Stubs) -> Result<(), String> {
    let (stream, comm) = one_rank().map_err(|e| format!("{e:?}"))?;
    s.set_version(22304);
    let a = DeviceBuffer::from_slice(&[F8E5M2::from_f32(1.0); 4], &stream).map_err(|e| e.to_string())?;
    let mut b = DeviceBuffer::<F8E5M2>::zeros(4, &stream).map_err(|e| e.to_string())?;
    let calls = s.count("ncclGroupStart");
    let check = |what: &str, r: handoff::Result<()>| match r {
        Err(Error::Unsupported { needs, loaded, .. })
            if needs.contains("2.24.3") && loaded.contains("22304") =>
        {
            Ok(())
        }
        other => Err(format!(
            "{what} on NCCL 2.23.4: {other:?}, want Error::Unsupported"
        )),
    };
    check(
        "a send/recv",
        group(|g| {
            g.send(&comm, &a, 0, &stream)?;
            g.recv(&comm, &mut b, 0, &stream)
        }),
    )?;
    check("an all-gather", comm.all_gather(&a, &mut b, &stream))?;
    if s.count("ncclGroupStart") != calls {
        return Err("a refused fp8 operation reached NCCL".into());
    }
    let mut f = DeviceBuffer::from_slice(&[1.0f32; 4], &stream).map_err(|e| e.to_string())?;
    comm.all_reduce_in_place(&mut f, ReduceOp::Sum, &stream)
        .map_err(|e| format!("other types should work: {e}"))
}

fn old_nccl(cudart: &Path, nccl: &Path) -> Result<(), Failed> {
    stubs::run_child(CHILD, cudart, nccl).map_err(Failed::from)
}

fn open(nccl: &Path) -> &'static Stubs {
    // SAFETY: the stub just built: plain C with no initialisers.
    let nccl = unsafe { libloading::Library::new(nccl) }.expect("stub NCCL");
    Box::leak(Box::new(Stubs { nccl }))
}

fn main() {
    stubs::child_main(CHILD, || {
        let nccl = PathBuf::from(std::env::var_os("HANDOFF_NCCL_PATH").expect("set by the parent"));
        child_old_nccl(open(&nccl))
    });
    let mut args = Arguments::from_args();
    // SAFETY: no other thread exists yet, and nothing has read the environment.
    let Some((dir, cudart, nccl)) = (unsafe { stubs::install_pair("fp8_stub", "nccl.c") }) else {
        return;
    };
    let stubs = open(&nccl);
    let trial = |name: &str, f: fn(&Stubs) -> Result<(), Failed>| Trial::test(name, move || f(stubs));
    let trials = vec![
        trial(
            "fp8_sends_receives_and_all_gathers_reach_nccl_with_its_codes",
            moves_reach_nccl,
        ),
        trial(
            "an_fp8_reduction_below_sm_90_is_refused_before_nccl",
            reductions_need_sm_90,
        ),
        Trial::test("an_nccl_older_than_2_24_3_makes_fp8_unsupported", move || {
            old_nccl(&cudart, &nccl)
        }),
    ];
    // One at a time: the stub's last type is the whole process's.
    args.test_threads = Some(1);
    let conclusion = libtest_mimic::run(&args, trials);
    let _ = std::fs::remove_dir_all(&dir);
    conclusion.exit()
}
