//! Build script: generates the FFI bindings to the CUDA runtime and NCCL with bindgen, and
//! compiles every `kernels/*.cu` to PTX with nvcc.
//!
//! Nothing is linked: the bindings use bindgen's dynamic loading, so the crate builds on a
//! machine without libcudart or libnccl and opens them at run time (see `src/sys/loader.rs`).
//!
//! Where the CUDA 13 headers, `nccl.h` and libclang are found, the bindings are generated here;
//! where nvcc is found, the PTX is. Where they are not (docs.rs, a machine without CUDA, a
//! crate that depends on handoff), the build uses the copies in `src/sys/generated/`, which this
//! same code wrote from the pinned CUDA 13.0 and NCCL 2.28.3 headers and nvcc 13.0
//! (`scripts/setup.sh`), and says so in one `cargo:warning`. `DOCS_RS` (set on docs.rs) always
//! selects the committed copies.
//!
//! Two variables keep the committed copies equal to what this script generates:
//! - `HANDOFF_WRITE_GENERATED=1 cargo build` rewrites them (after changing the function lists
//!   below, a kernel, or a pinned version; run `bash scripts/setup.sh` first);
//! - `HANDOFF_CHECK_GENERATED=1` (set by `.ci/run`) fails the build if generating here is not
//!   possible or gives anything other than the committed files.
//!
//! Path variables (`CUDA_HOME`, `HANDOFF_TOOLS_DIR`, ...) given as relative paths are resolved
//! against the folder cargo was started from (the shell's `PWD`), not against this crate's
//! folder, where cargo runs build scripts.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every variable this script reads; each gets `cargo:rerun-if-env-changed`. (`PWD` too, but
/// only when a relative path is resolved against it.)
const ENV_VARS: &[&str] = &[
    "CUDA_HOME",
    "CUDA_PATH",
    "NCCL_HOME",
    "NCCL_INCLUDE_DIR",
    "NVCC",
    "HANDOFF_TOOLS_DIR",
    "HANDOFF_PTX_ARCH",
    "LIBCLANG_PATH",
    "DOCS_RS",
    "HANDOFF_CHECK_GENERATED",
    "HANDOFF_WRITE_GENERATED",
];

/// Where the committed bindings and PTX live, relative to the crate root.
const GENERATED: &str = "src/sys/generated";

/// The lowest CUDA the bindings may be generated from: libcudart.so.13 has CUDA 13's ABI
/// (`cudaDeviceProp` changed in 13.0), so older headers would describe other structures.
const MIN_CUDART_VERSION: u32 = 13000;

/// The CUDA runtime functions the crate calls. Narrow on purpose: every one is in CUDA 13.0's
/// libcudart, and the loader requires all of them to be present.
const CUDART_FUNCTIONS: &[&str] = &[
    "cudaGetErrorName",
    "cudaGetErrorString",
    "cudaGetLastError",
    "cudaRuntimeGetVersion",
    "cudaDriverGetVersion",
    "cudaGetDeviceCount",
    "cudaGetDevice",
    "cudaSetDevice",
    "cudaDeviceGetAttribute",
    "cudaGetDeviceProperties",
    "cudaDeviceSynchronize",
    "cudaDeviceGetDefaultMemPool",
    "cudaMemPoolSetAttribute",
    "cudaStreamCreateWithFlags",
    "cudaStreamDestroy",
    "cudaStreamSynchronize",
    "cudaStreamQuery",
    "cudaStreamWaitEvent",
    "cudaEventCreateWithFlags",
    "cudaEventDestroy",
    "cudaEventRecord",
    "cudaEventRecordWithFlags",
    "cudaEventQuery",
    "cudaEventSynchronize",
    "cudaEventElapsedTime",
    "cudaMallocAsync",
    "cudaFreeAsync",
    "cudaMallocHost",
    "cudaFreeHost",
    "cudaHostAlloc",
    "cudaHostGetDevicePointer",
    "cudaGetDriverEntryPointByVersion",
    "cudaMemcpyAsync",
    "cudaMemcpyPeerAsync",
    "cudaMemsetAsync",
    "cudaLibraryLoadData",
    "cudaLibraryUnload",
    "cudaLibraryGetKernel",
    "cudaLaunchKernel",
    "cudaFuncGetAttributes",
    "cudaStreamBeginCapture",
    "cudaStreamEndCapture",
    "cudaStreamIsCapturing",
    "cudaGraphInstantiateWithFlags",
    "cudaGraphLaunch",
    "cudaGraphDestroy",
    "cudaGraphExecDestroy",
];

/// The NCCL functions the crate calls; all exist in NCCL 2.28.3, the oldest NCCL supported.
/// A newer header than the installed library plus `dynamic_link_require_all` over the whole
/// `nccl.*` API fails to load (`undefined symbol: ncclCommRevoke` on 2.28.3), hence a list.
const NCCL_FUNCTIONS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommInitRank",
    "ncclCommInitRankConfig",
    "ncclCommInitAll",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommSplit",
    "ncclCommGetAsyncError",
    "ncclCommCount",
    "ncclCommCuDevice",
    "ncclCommUserRank",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllGather",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduce",
    "ncclReduceScatter",
    "ncclAlltoAll",
    "ncclGather",
    "ncclScatter",
    "ncclRedOpCreatePreMulSum",
    "ncclRedOpDestroy",
];

/// The NCCL functions of registered memory and symmetric windows (`src/nccl/register.rs`). They
/// get a library struct of their own (`nccl::register::NcclRegisterLib`, opened from the same
/// file as `NcclLib`), so that an NCCL without them still loads and only these features fail,
/// with a typed error naming the version they need, instead of `NcclLib` refusing the library.
const NCCL_REGISTER_FUNCTIONS: &[&str] = &[
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclCommRegister",
    "ncclCommDeregister",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
];

/// What to do with the committed copies, besides using them where generating is not possible.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Generate where possible, else use the committed copies.
    Normal,
    /// `DOCS_RS`: use the committed copies, generate nothing.
    Committed,
    /// `HANDOFF_CHECK_GENERATED`: generate (or fail), and fail unless equal to the committed.
    Check,
    /// `HANDOFF_WRITE_GENERATED`: generate (or fail), and overwrite the committed copies.
    Write,
}

fn main() {
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed={GENERATED}");

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let committed = manifest.join(GENERATED);
    let mode = mode();

    let tools = env_path("HANDOFF_TOOLS_DIR").unwrap_or_else(|| manifest.join(".tools/cuda"));
    // The run-time loader also looks for the wheels' libraries in this folder.
    println!("cargo:rustc-env=HANDOFF_BUILD_TOOLS_DIR={}", tools.display());
    // clang-sys reads LIBCLANG_PATH itself, relative to this script's folder: make it absolute.
    if let Some(p) = env_path("LIBCLANG_PATH") {
        // SAFETY: the build script is single-threaded here; nothing reads the environment
        // concurrently.
        unsafe { env::set_var("LIBCLANG_PATH", p) };
    }

    // Why each part comes from the committed copies, for the one warning.
    let mut fallbacks = Vec::new();

    // --- bindings ---------------------------------------------------------------------------
    let generated = if mode == Mode::Committed {
        Err(vec!["DOCS_RS is set".to_string()])
    } else {
        generate_bindings(&tools)
    };
    match generated {
        Ok(files) => {
            for (name, text) in &files {
                settle(mode, &committed.join(name), text.as_bytes());
                write_file(&out.join(name), text.as_bytes());
            }
        }
        Err(problems) => {
            if matches!(mode, Mode::Check | Mode::Write) {
                fail("the bindings cannot be generated here", &problems);
            }
            for name in ["cudart.rs", "nccl.rs"] {
                write_file(&out.join(name), &read_committed(&committed.join(name)));
            }
            fallbacks.push(format!("bindings ({})", problems.join("; ")));
        }
    }

    // --- PTX --------------------------------------------------------------------------------
    let kernels = kernel_sources(&manifest.join("kernels"));
    let nvcc = if mode == Mode::Committed {
        Err("DOCS_RS is set".to_string())
    } else {
        find_nvcc(&tools)
    };
    let mut index = String::new();
    for (stem, src) in &kernels {
        println!("cargo:rerun-if-changed={}", src.display());
        let file = format!("{stem}.ptx");
        let ptx = match &nvcc {
            Ok(nvcc) => {
                let ptx = compile_kernel(nvcc, src, &manifest, &out.join(&file));
                settle(mode, &committed.join(&file), &ptx);
                ptx
            }
            Err(problem) => {
                if matches!(mode, Mode::Check | Mode::Write) {
                    fail("the PTX cannot be generated here", std::slice::from_ref(problem));
                }
                read_committed(&committed.join(&file))
            }
        };
        // PTX is loaded as a NUL-terminated string (cudaLibraryLoadData reads PTX that way).
        let mut text = ptx;
        text.push(0);
        let embedded = out.join(&file);
        write_file(&embedded, &text);
        let _ = writeln!(
            index,
            "/// PTX of `kernels/{stem}.cu`, NUL-terminated.\npub const {}: &[u8] = include_bytes!({:?});",
            stem.to_uppercase(),
            embedded.display().to_string()
        );
    }
    // A committed PTX whose kernel is gone would ship unused: check and write mode remove it.
    if matches!(mode, Mode::Check | Mode::Write) {
        let orphans: Vec<PathBuf> = std::fs::read_dir(&committed)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
            .filter(|p| {
                !kernels
                    .iter()
                    .any(|(stem, _)| p.file_stem() == Some(stem.as_ref()))
            })
            .collect();
        for orphan in orphans {
            if mode == Mode::Check {
                fail(
                    &format!("{} has no kernels/*.cu", orphan.display()),
                    &["delete it, or run `HANDOFF_WRITE_GENERATED=1 cargo build`".into()],
                );
            }
            std::fs::remove_file(&orphan).unwrap_or_else(|e| panic!("removing {}: {e}", orphan.display()));
            println!("cargo:warning=handoff: removed {}", orphan.display());
        }
    }
    if let Err(problem) = &nvcc {
        let arch = match env::var("HANDOFF_PTX_ARCH") {
            Ok(a) if a != "compute_75" => format!("; it is for compute_75, HANDOFF_PTX_ARCH={a} is ignored"),
            _ => String::new(),
        };
        fallbacks.push(format!("PTX ({problem}{arch})"));
    }
    write_file(&out.join("ptx.rs"), index.as_bytes());

    if !fallbacks.is_empty() {
        println!(
            "cargo:warning=handoff: using the {} committed in {GENERATED} (generated from CUDA 13.0 \
             and NCCL 2.28.3), because: {}. This is expected on docs.rs and without a CUDA \
             toolkit; set CUDA_HOME (or HANDOFF_TOOLS_DIR) to generate them here",
            fallbacks
                .iter()
                .map(|f| f.split(' ').next().unwrap())
                .collect::<Vec<_>>()
                .join(" and "),
            fallbacks.join("; ")
        );
    }
}

fn mode() -> Mode {
    let set = |var| env::var_os(var).is_some_and(|v| !v.is_empty() && v != "0");
    match (
        set("DOCS_RS"),
        set("HANDOFF_CHECK_GENERATED"),
        set("HANDOFF_WRITE_GENERATED"),
    ) {
        (_, true, true) => fail(
            "HANDOFF_CHECK_GENERATED and HANDOFF_WRITE_GENERATED are both set",
            &["set one of them".into()],
        ),
        (true, false, false) => Mode::Committed,
        (true, _, _) => fail(
            "DOCS_RS is set together with HANDOFF_CHECK_GENERATED or HANDOFF_WRITE_GENERATED",
            &["DOCS_RS selects the committed files; unset it to generate them".into()],
        ),
        (false, true, false) => Mode::Check,
        (false, false, true) => Mode::Write,
        (false, false, false) => Mode::Normal,
    }
}

/// Stops the build with one message listing what went wrong and what to do.
fn fail(what: &str, problems: &[String]) -> ! {
    let mut msg = format!("\n\nhandoff: {what}:\n");
    for p in problems {
        let _ = writeln!(msg, "  - {p}");
    }
    msg.push_str(
        "\nOn a Debian/Ubuntu machine without a CUDA toolkit, `bash scripts/setup.sh` (in the \
         handoff repository) installs libclang-dev and NVIDIA's CUDA 13.0 wheels into \
         .tools/cuda. With a CUDA toolkit installed elsewhere, set CUDA_HOME (and NCCL_HOME or \
         NCCL_INCLUDE_DIR for nccl.h, NVCC for nvcc).\n",
    );
    panic!("{msg}");
}

/// A path variable, unset when empty. A relative path is resolved against the folder cargo was
/// started from: `PWD`, which the shell sets and cargo passes on (cargo runs build scripts in
/// the crate's own folder, so the process's working directory would be the wrong base).
fn env_path(var: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env::var_os(var).filter(|v| !v.is_empty())?);
    if p.is_absolute() {
        return Some(p);
    }
    println!("cargo:rerun-if-env-changed=PWD");
    match env::var_os("PWD").map(PathBuf::from).filter(|d| d.is_absolute()) {
        Some(dir) => Some(dir.join(p)),
        // No PWD (cargo started by a program, not a shell): the best left is our own folder.
        None => Some(p),
    }
}

/// The committed file's bytes, or a build failure saying how to recreate it.
fn read_committed(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| {
        fail(
            &format!("{} cannot be read ({e})", path.display()),
            &[
                "it is generated by `HANDOFF_WRITE_GENERATED=1 cargo build` in the handoff \
               repository (after `bash scripts/setup.sh`)"
                    .into(),
            ],
        )
    })
}

fn write_file(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// In check mode, fails unless `generated` equals the committed file; in write mode, writes it.
fn settle(mode: Mode, committed: &Path, generated: &[u8]) {
    match mode {
        Mode::Write => {
            let old = std::fs::read(committed).ok();
            if old.as_deref() != Some(generated) {
                write_file(committed, generated);
                println!("cargo:warning=handoff: wrote {}", committed.display());
            }
        }
        Mode::Check => {
            let old = std::fs::read(committed).unwrap_or_default();
            if old != generated {
                fail(
                    &format!("{} is not what this build generates", committed.display()),
                    &[
                        first_difference(&old, generated),
                        "regenerate the committed files with `bash scripts/setup.sh && \
                         HANDOFF_WRITE_GENERATED=1 cargo build` and commit them"
                            .into(),
                    ],
                );
            }
        }
        Mode::Normal | Mode::Committed => {}
    }
}

fn first_difference(old: &[u8], new: &[u8]) -> String {
    let old = String::from_utf8_lossy(old);
    let new = String::from_utf8_lossy(new);
    let (mut a, mut b) = (old.lines(), new.lines());
    for n in 1.. {
        match (a.next(), b.next()) {
            (Some(x), Some(y)) if x == y => continue,
            (None, None) => break,
            (x, y) => {
                return format!(
                    "first difference at line {n}: committed {:?}, generated {:?}",
                    x.unwrap_or("<end of file>"),
                    y.unwrap_or("<end of file>")
                );
            }
        }
    }
    "the files differ only in line endings".into()
}

/// Roots of CUDA installations, in the order they are tried.
fn cuda_roots(tools: &Path) -> Vec<(String, PathBuf)> {
    let mut roots = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(p) = env_path(var) {
            roots.push((format!("${var}"), p));
        }
    }
    roots.push(("default".into(), PathBuf::from("/usr/local/cuda")));
    roots.push((
        "the wheels in HANDOFF_TOOLS_DIR".into(),
        tools.join("nvidia/cu13"),
    ));
    roots
}

/// The first candidate `probe` accepts; otherwise every candidate with why it was passed over.
fn search(
    what: &str,
    candidates: impl IntoIterator<Item = (String, PathBuf)>,
    probe: impl Fn(&Path) -> Result<(), String>,
) -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    for (label, dir) in candidates {
        match probe(&dir) {
            Ok(()) => return Ok(dir),
            Err(why) => tried.push(format!("{} ({label}{why})", dir.display())),
        }
    }
    Err(format!("{what} not found; searched: {}", tried.join(", ")))
}

/// `#define NAME value` from a header, as a number.
fn header_define(header: &str, name: &str) -> Option<u32> {
    header.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        (words.next()? == "#define" && words.next()? == name)
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

fn find_cuda_include(tools: &Path) -> Result<PathBuf, String> {
    let cands = cuda_roots(tools)
        .into_iter()
        .map(|(l, r)| (l, r.join("include")))
        .chain([("system".to_string(), PathBuf::from("/usr/include"))]);
    search("CUDA 13's cuda_runtime_api.h", cands, |d| {
        let text = std::fs::read_to_string(d.join("cuda_runtime_api.h")).map_err(|_| String::new())?;
        match header_define(&text, "CUDART_VERSION") {
            Some(v) if v >= MIN_CUDART_VERSION => Ok(()),
            v => Err(format!(": CUDART_VERSION {v:?}, CUDA 13 needed")),
        }
    })
}

fn find_nccl_include(tools: &Path, cuda_include: Option<&Path>) -> Result<PathBuf, String> {
    let mut cands = Vec::new();
    if let Some(p) = env_path("NCCL_INCLUDE_DIR") {
        cands.push(("$NCCL_INCLUDE_DIR".to_string(), p));
    }
    if let Some(p) = env_path("NCCL_HOME") {
        cands.push(("$NCCL_HOME".to_string(), p.join("include")));
    }
    if let Some(c) = cuda_include {
        cands.push(("the CUDA include folder".to_string(), c.to_path_buf()));
    }
    cands.push(("system".to_string(), PathBuf::from("/usr/include")));
    cands.push((
        "the wheels in HANDOFF_TOOLS_DIR".to_string(),
        tools.join("nvidia/nccl/include"),
    ));
    search("nccl.h", cands, |d| is_file(&d.join("nccl.h")))
}

fn find_nvcc(tools: &Path) -> Result<PathBuf, String> {
    let mut cands = Vec::new();
    match env::var_os("NVCC").filter(|v| !v.is_empty()) {
        // A bare name is a command, looked up on PATH.
        Some(name) if !name.to_string_lossy().contains('/') => {
            let found = env::var_os("PATH").and_then(|path| {
                env::split_paths(&path)
                    .map(|d| d.join(&name))
                    .find(|p| p.is_file())
            });
            cands.push(("$NVCC, on PATH".to_string(), found.unwrap_or_else(|| name.into())));
        }
        Some(_) => cands.push(("$NVCC".to_string(), env_path("NVCC").unwrap())),
        None => {}
    }
    for (label, root) in cuda_roots(tools) {
        cands.push((label, root.join("bin/nvcc")));
    }
    // PATH counts as one place in the message, however many folders it holds.
    let on_path = env::var_os("PATH").and_then(|path| {
        env::split_paths(&path)
            .map(|d| d.join("nvcc"))
            .find(|p| p.is_file())
    });
    cands.push((
        "PATH".to_string(),
        on_path.unwrap_or_else(|| PathBuf::from("nvcc")),
    ));
    search("nvcc", cands, is_file)
}

/// A probe for [`search`]: the file exists (no reason otherwise: the search names the path).
fn is_file(p: &Path) -> Result<(), String> {
    if p.is_file() { Ok(()) } else { Err(String::new()) }
}

/// The bindings as `(file name, text)`, or why they cannot be generated here: a header or
/// libclang is missing. Anything else that goes wrong (a header bindgen cannot parse) stops the
/// build, rather than hiding a broken toolkit behind the committed copies.
fn generate_bindings(tools: &Path) -> Result<Vec<(&'static str, String)>, Vec<String>> {
    let mut problems = Vec::new();
    let cuda_include = find_cuda_include(tools).map_err(|e| problems.push(e)).ok();
    let nccl_include = find_nccl_include(tools, cuda_include.as_deref())
        .map_err(|e| problems.push(e))
        .ok();
    if let Err(e) = libclang() {
        problems.push(e);
    }
    let (Some(cuda_include), Some(nccl_include)) = (cuda_include, nccl_include) else {
        return Err(problems);
    };
    if !problems.is_empty() {
        return Err(problems);
    }

    let mut includes = vec![cuda_include.clone()];
    // nccl.h includes cuda_fp16.h, which needs CCCL's <nv/target>; the CCCL wheel puts it here.
    if cuda_include.join("cccl/nv/target").exists() {
        includes.push(cuda_include.join("cccl"));
    }
    if nccl_include != cuda_include {
        includes.push(nccl_include.clone());
    }
    let version = |file: &Path, name| {
        std::fs::read_to_string(file)
            .ok()
            .and_then(|t| header_define(&t, name))
            .map_or_else(|| "unknown".to_string(), |v| v.to_string())
    };
    let cudart = generate_cudart(&includes);
    let cudart_from = format!(
        "cuda_runtime_api.h (CUDART_VERSION {})",
        version(&cuda_include.join("cuda_runtime_api.h"), "CUDART_VERSION")
    );
    let nccl = generate_nccl(&includes);
    let nccl_from = format!(
        "nccl.h (NCCL_VERSION_CODE {})",
        version(&nccl_include.join("nccl.h"), "NCCL_VERSION_CODE")
    );
    Ok(vec![
        ("cudart.rs", with_header(&cudart_from, &cudart)),
        ("nccl.rs", with_header(&nccl_from, &nccl)),
    ])
}

fn with_header(from: &str, body: &str) -> String {
    format!(
        "// Generated by handoff's build.rs from {from}; do not edit.\n\
         // Regenerate: `bash scripts/setup.sh && HANDOFF_WRITE_GENERATED=1 cargo build`.\n{body}"
    )
}

/// Whether bindgen can load libclang. bindgen panics when it cannot, so ask it once, quietly.
fn libclang() -> Result<(), String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let loaded = std::panic::catch_unwind(bindgen::clang_version);
    std::panic::set_hook(hook);
    loaded.map(|_| ()).map_err(|_| {
        "libclang not found (bindgen needs it: apt-get install libclang-dev, or set \
         LIBCLANG_PATH to the folder holding libclang.so)"
            .to_string()
    })
}

fn builder(includes: &[PathBuf], header: &str) -> bindgen::Builder {
    let mut b = bindgen::Builder::default()
        .header_contents("handoff_wrapper.h", header)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(false)
        .generate_comments(false)
        // prettyplease comes with bindgen (Cargo.lock pins it), so the text, which is compared
        // with the committed copy, does not depend on the installed rustfmt.
        .formatter(bindgen::Formatter::Prettyplease)
        .rust_edition(bindgen::RustEdition::Edition2024)
        .dynamic_link_require_all(true);
    for inc in includes {
        b = b.clang_arg(format!("-I{}", inc.display()));
    }
    b
}

fn generated_text(bindings: Result<bindgen::Bindings, bindgen::BindgenError>, what: &str) -> String {
    match bindings {
        Ok(b) => b.to_string(),
        Err(e) => fail(
            &format!("bindgen could not generate the {what} bindings"),
            &[e.to_string()],
        ),
    }
}

fn generate_cudart(includes: &[PathBuf]) -> String {
    let mut b = builder(includes, "#include <cuda_runtime_api.h>\n")
        .dynamic_library_name("CudartLib")
        .allowlist_type("cudaError_t|cudaError")
        .allowlist_type("cudaStream_t|cudaEvent_t|cudaMemPool_t|cudaLibrary_t|cudaKernel_t")
        .allowlist_type("cudaGraph_t|cudaGraphExec_t|cudaStreamCaptureMode|cudaStreamCaptureStatus")
        .allowlist_type("cudaDeviceProp|cudaDeviceAttr|cudaMemcpyKind|cudaMemPoolAttr")
        .allowlist_type("cudaJitOption|cudaLibraryOption|cudaFuncAttributes|dim3")
        .allowlist_var("cudaStream.*|cudaEvent.*");
    for f in CUDART_FUNCTIONS {
        b = b.allowlist_function(f);
    }
    generated_text(b.generate(), "CUDA runtime")
}

fn generate_nccl(includes: &[PathBuf]) -> String {
    // The CUDA stream type comes from the cudart bindings, so the two modules share it.
    let mut b = builder(includes, "#include <nccl.h>\n")
        .dynamic_library_name("NcclLib")
        .allowlist_type("nccl.*")
        .allowlist_var("NCCL_.*")
        .blocklist_type("cudaStream_t|CUstream_st")
        .raw_line("use super::cudart::cudaStream_t;");
    for f in NCCL_FUNCTIONS {
        b = b.allowlist_function(f);
    }
    let main = generated_text(b.generate(), "NCCL");
    // Only the functions: their types are the ones generated above, reached through `super`.
    let mut r = builder(includes, "#include <nccl.h>\n")
        .dynamic_library_name("NcclRegisterLib")
        .allowlist_recursively(false);
    for f in NCCL_REGISTER_FUNCTIONS {
        r = r.allowlist_function(f);
    }
    let register = generated_text(r.generate(), "NCCL registration");
    format!(
        "{main}\n/// The functions of registered memory and windows, loaded apart (see `build.rs`).\n\
         pub mod register {{\n    use super::*;\n{register}}}\n"
    )
}

/// Every `kernels/*.cu`, as (file stem, path), sorted.
fn kernel_sources(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut sources: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .map(|p| (p.file_stem().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    sources.sort();
    sources
}

/// Compiles one kernel file to PTX for a virtual architecture low enough that the driver
/// JIT-compiles it for any GPU CUDA 13 supports (compute_75 is CUDA 13's lowest). Returns the
/// PTX with its source paths made relative (see [`relative_file_paths`]).
fn compile_kernel(nvcc: &Path, src: &Path, manifest: &Path, ptx: &Path) -> Vec<u8> {
    let arch = env::var("HANDOFF_PTX_ARCH").unwrap_or_else(|_| "compute_75".into());
    let output = Command::new(nvcc)
        .args(["-ptx", "-lineinfo", &format!("-arch={arch}"), "-o"])
        .arg(ptx)
        .arg(src)
        .output()
        .unwrap_or_else(|e| fail("nvcc cannot be run", &[format!("{}: {e}", nvcc.display())]));
    if !output.status.success() {
        fail(
            &format!("nvcc failed on {}", src.display()),
            &[format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )],
        );
    }
    let text = std::fs::read_to_string(ptx).expect("nvcc wrote the PTX");
    relative_file_paths(&text, manifest).into_bytes()
}

/// `-lineinfo` writes each source's absolute path into the PTX (`.file 1 "/home/.../x.cu"`),
/// which would make the PTX depend on where the repository is checked out. Rewrites the paths
/// of files in this crate relative to its root, and others (CUDA headers) to their file name.
fn relative_file_paths(ptx: &str, manifest: &Path) -> String {
    let roots: Vec<String> = [Some(manifest.to_path_buf()), manifest.canonicalize().ok()]
        .into_iter()
        .flatten()
        .map(|p| format!("{}/", p.display()))
        .collect();
    let mut out = String::with_capacity(ptx.len());
    for line in ptx.split_inclusive('\n') {
        let trimmed = line.trim_start();
        if trimmed.starts_with(".file")
            && let (Some(open), Some(close)) = (line.find('"'), line.rfind('"'))
            && open < close
        {
            let path = &line[open + 1..close];
            let short = roots
                .iter()
                .find_map(|r| path.strip_prefix(r.as_str()))
                .unwrap_or_else(|| path.rsplit('/').next().unwrap_or(path));
            out.push_str(&line[..=open]);
            out.push_str(short);
            out.push_str(&line[close..]);
        } else {
            out.push_str(line);
        }
    }
    out
}
