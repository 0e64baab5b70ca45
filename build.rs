//! Build script: generates the FFI bindings to the CUDA runtime and NCCL with bindgen, and
//! compiles every `kernels/*.cu` to PTX with nvcc.
//!
//! Nothing is linked: the bindings use bindgen's dynamic loading, so the crate builds on a
//! machine without libcudart or libnccl and opens them at run time (see `src/sys/loader.rs`).
//! Only the headers and nvcc are needed here. `scripts/setup.sh` installs both (NVIDIA's PyPI
//! wheels, CUDA 13.0) where no CUDA toolkit is installed.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every variable this script reads; each gets `cargo:rerun-if-env-changed`.
const ENV_VARS: &[&str] = &[
    "CUDA_HOME",
    "CUDA_PATH",
    "NCCL_HOME",
    "NCCL_INCLUDE_DIR",
    "NVCC",
    "HANDOFF_TOOLS_DIR",
    "HANDOFF_PTX_ARCH",
    "LIBCLANG_PATH",
];

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
    "cudaEventQuery",
    "cudaEventSynchronize",
    "cudaEventElapsedTime",
    "cudaMallocAsync",
    "cudaFreeAsync",
    "cudaMallocHost",
    "cudaFreeHost",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaLibraryLoadData",
    "cudaLibraryUnload",
    "cudaLibraryGetKernel",
    "cudaLaunchKernel",
    "cudaFuncGetAttributes",
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
    "ncclCommGetAsyncError",
    "ncclCommCount",
    "ncclCommCuDevice",
    "ncclCommUserRank",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllGather",
];

fn main() {
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let tools = env::var_os("HANDOFF_TOOLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join(".tools/cuda"));

    let mut problems = Vec::new();
    let cuda_include = find_cuda_include(&tools).map_err(|e| problems.push(e)).ok();
    let nccl_include = find_nccl_include(&tools, cuda_include.as_deref())
        .map_err(|e| problems.push(e))
        .ok();
    let nvcc = find_nvcc(&tools).map_err(|e| problems.push(e)).ok();
    if !problems.is_empty() {
        fail(&problems);
    }
    let (cuda_include, nccl_include, nvcc) = (cuda_include.unwrap(), nccl_include.unwrap(), nvcc.unwrap());

    let mut includes = vec![cuda_include.clone()];
    // nccl.h includes cuda_fp16.h, which needs CCCL's <nv/target>; the CCCL wheel puts it here.
    if cuda_include.join("cccl/nv/target").exists() {
        includes.push(cuda_include.join("cccl"));
    }
    if nccl_include != cuda_include {
        includes.push(nccl_include);
    }

    generate_cudart(&includes, &out.join("cudart.rs"));
    generate_nccl(&includes, &out.join("nccl.rs"));
    compile_kernels(&nvcc, &manifest.join("kernels"), &out);
}

/// Stops the build with one message listing what was searched and how to install what is missing.
fn fail(problems: &[String]) -> ! {
    let mut msg = String::from("\n\nhandoff cannot be built:\n");
    for p in problems {
        let _ = writeln!(msg, "  - {p}");
    }
    msg.push_str(
        "\nOn a Debian/Ubuntu machine without a CUDA toolkit, `scripts/setup.sh` (in the handoff \
         repository) installs libclang-dev and NVIDIA's CUDA 13.0 wheels into .tools/cuda:\n    \
         bash scripts/setup.sh\nor, by hand:\n    \
         apt-get install libclang-dev\n    \
         python3 -m pip install --target .tools/cuda nvidia-cuda-runtime==13.0.96 \
         nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
         nvidia-cuda-cccl==13.0.85 nvidia-nccl-cu13==2.28.3\n\
         and point HANDOFF_TOOLS_DIR at that folder when handoff is a dependency of another crate.\n\
         With a CUDA toolkit installed elsewhere, set CUDA_HOME (and NCCL_HOME or NCCL_INCLUDE_DIR \
         for nccl.h, NVCC for nvcc).\n",
    );
    panic!("{msg}");
}

fn env_path(var: &str) -> Option<PathBuf> {
    env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from)
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
        "NVIDIA's wheels (HANDOFF_TOOLS_DIR)".into(),
        tools.join("nvidia/cu13"),
    ));
    roots
}

fn search<'a>(
    what: &str,
    candidates: impl IntoIterator<Item = (String, PathBuf)>,
    probe: impl Fn(&Path) -> bool + 'a,
) -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    for (label, dir) in candidates {
        if probe(&dir) {
            return Ok(dir);
        }
        tried.push(format!("{} ({label})", dir.display()));
    }
    Err(format!("{what} not found; searched: {}", tried.join(", ")))
}

fn find_cuda_include(tools: &Path) -> Result<PathBuf, String> {
    let cands = cuda_roots(tools)
        .into_iter()
        .map(|(l, r)| (l, r.join("include")))
        .chain([("system".to_string(), PathBuf::from("/usr/include"))]);
    search("cuda_runtime_api.h", cands, |d| {
        d.join("cuda_runtime_api.h").is_file()
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
        "NVIDIA's wheels (HANDOFF_TOOLS_DIR)".to_string(),
        tools.join("nvidia/nccl/include"),
    ));
    search("nccl.h", cands, |d| d.join("nccl.h").is_file())
}

fn find_nvcc(tools: &Path) -> Result<PathBuf, String> {
    let mut cands = Vec::new();
    if let Some(p) = env_path("NVCC") {
        cands.push(("$NVCC".to_string(), p));
    }
    for (label, root) in cuda_roots(tools) {
        cands.push((label, root.join("bin/nvcc")));
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            cands.push(("PATH".to_string(), dir.join("nvcc")));
        }
    }
    search("nvcc", cands, |p| p.is_file())
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
        .rust_edition(bindgen::RustEdition::Edition2024)
        .dynamic_link_require_all(true);
    for inc in includes {
        b = b.clang_arg(format!("-I{}", inc.display()));
    }
    b
}

fn write(bindings: Result<bindgen::Bindings, bindgen::BindgenError>, what: &str, path: &Path) {
    match bindings {
        Ok(b) => b
            .write_to_file(path)
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display())),
        Err(e) => fail(&[format!(
            "bindgen could not generate the {what} bindings: {e}. If libclang is missing, \
             install libclang-dev (apt-get install libclang-dev) or set LIBCLANG_PATH to the \
             folder holding libclang.so"
        )]),
    }
}

fn generate_cudart(includes: &[PathBuf], out: &Path) {
    let mut b = builder(includes, "#include <cuda_runtime_api.h>\n")
        .dynamic_library_name("CudartLib")
        .allowlist_type("cudaError_t|cudaError")
        .allowlist_type("cudaStream_t|cudaEvent_t|cudaMemPool_t|cudaLibrary_t|cudaKernel_t")
        .allowlist_type("cudaDeviceProp|cudaDeviceAttr|cudaMemcpyKind|cudaMemPoolAttr")
        .allowlist_type("cudaJitOption|cudaLibraryOption|cudaFuncAttributes|dim3")
        .allowlist_var("cudaStream.*|cudaEvent.*");
    for f in CUDART_FUNCTIONS {
        b = b.allowlist_function(f);
    }
    write(b.generate(), "CUDA runtime", out);
}

fn generate_nccl(includes: &[PathBuf], out: &Path) {
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
    write(b.generate(), "NCCL", out);
}

/// Compiles each `kernels/*.cu` to PTX for a virtual architecture low enough that the driver
/// JIT-compiles it for any GPU CUDA 13 supports (compute_75 is CUDA 13's lowest).
fn compile_kernels(nvcc: &Path, dir: &Path, out: &Path) {
    let arch = env::var("HANDOFF_PTX_ARCH").unwrap_or_else(|_| "compute_75".into());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut index = String::new();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let stem = src.file_stem().unwrap().to_string_lossy().into_owned();
        let ptx = out.join(format!("{stem}.ptx"));
        let output = Command::new(nvcc)
            .args(["-ptx", "-lineinfo", &format!("-arch={arch}"), "-o"])
            .arg(&ptx)
            .arg(src)
            .output()
            .unwrap_or_else(|e| fail(&[format!("running {}: {e}", nvcc.display())]));
        if !output.status.success() {
            fail(&[format!(
                "nvcc failed on {}:\n{}{}",
                src.display(),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )]);
        }
        // PTX is loaded as a NUL-terminated string (cudaLibraryLoadData reads PTX that way).
        let mut text = std::fs::read(&ptx).expect("nvcc wrote the PTX");
        text.push(0);
        std::fs::write(&ptx, text).expect("rewriting the PTX");
        let _ = writeln!(
            index,
            "/// PTX of `kernels/{stem}.cu`, NUL-terminated.\npub const {}: &[u8] = include_bytes!({:?});",
            stem.to_uppercase(),
            ptx.display().to_string()
        );
    }
    std::fs::write(out.join("ptx.rs"), index).expect("writing ptx.rs");
}
