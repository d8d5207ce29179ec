//! The cuda backend's kernels, checked on a machine without a GPU: every
//! NVRTC source is compiled by the real NVRTC (the `nvidia-cuda-nvrtc`
//! wheel) to PTX for sm_80 and sm_90 and assembled by the real `ptxas` (the
//! `nvidia-cuda-nvcc` wheel), for several model geometries (the attention
//! kernel is specialised per head dimension and group). A kernel that does
//! not compile, is missing, or spills registers fails; a table of registers,
//! spills and shared memory per kernel is printed (`--nocapture`). The
//! cubin path the backend takes at start-up is compiled too.
//!
//! `make test` installs the wheels (`make deps`) and sets `SLUICE_NVRTC_LIB`
//! (the `libnvrtc.so.13` file) and `SLUICE_PTXAS`; without them the test
//! says so and checks nothing.

#![cfg(feature = "cuda")]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use sluice_engine::backend::cuda::libraries;
use sluice_engine::backend::cuda::nvrtc::{self, Output};
use sluice_engine::backend::cuda::plan::attention_shared_bytes;
use sluice_engine::backend::cuda::source::{KERNELS, KernelConfig, PROGRAM_NAME, SOURCE};

/// Architectures CI assembles for: A100-class and H100-class.
const ARCHS: [u32; 2] = [80, 90];
/// (head_dim, query heads per kv head): the built-in `tiny` and `small`
/// (~100M) models, Qwen2-0.5B, TinyLlama-1.1B, Llama-3-8B, Llama-3-70B,
/// the widest head the kernel takes, and the largest group.
const GEOMETRIES: [(usize, usize); 8] = [
    (32, 2),
    (64, 3),
    (64, 7),
    (64, 8),
    (128, 4),
    (128, 8),
    (256, 8),
    (128, 16),
];
/// Spilled bytes (stores + loads) a kernel may have: none.
const MAX_SPILL_BYTES: u64 = 0;

/// What `ptxas -v` says about one kernel.
#[derive(Debug, Default, Clone, PartialEq)]
struct Usage {
    registers: u64,
    stack: u64,
    spill_stores: u64,
    spill_loads: u64,
    shared: u64,
}

/// The number before `unit` in `line` (`"32 bytes spill stores"` → 32).
fn number_before(line: &str, unit: &str) -> Option<u64> {
    let at = line.find(unit)?;
    line[..at].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas -v` output into per-kernel usage.
fn parse_ptxas(text: &str) -> BTreeMap<String, Usage> {
    let mut out: BTreeMap<String, Usage> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_owned();
            out.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let Some(u) = current.as_ref().and_then(|n| out.get_mut(n)) else {
            continue;
        };
        if line.contains("spill stores") {
            u.stack = number_before(line, "bytes stack frame").unwrap_or(0);
            u.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            u.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used") && line.contains("registers") {
            u.registers = number_before(line, "registers").unwrap_or(0);
            u.shared = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

fn tools() -> Option<PathBuf> {
    let (Some(_), Some(ptxas)) = (
        std::env::var_os(libraries::NVRTC_LIB_VAR),
        std::env::var_os("SLUICE_PTXAS"),
    ) else {
        eprintln!(
            "cuda kernel check skipped: set {} and SLUICE_PTXAS (make test does, from the venv's nvidia wheels)",
            libraries::NVRTC_LIB_VAR
        );
        return None;
    };
    libraries::preload_nvrtc().expect("SLUICE_NVRTC_LIB loads");
    assert!(libraries::nvrtc_present(), "NVRTC is loaded");
    Some(PathBuf::from(ptxas))
}

#[test]
fn ptxas_output_is_parsed() {
    let text = "ptxas info    : Compiling entry function 'paged_attention' for 'sm_80'\n\
                ptxas info    : Function properties for paged_attention\n    \
                8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
                ptxas info    : Used 90 registers, used 1 barriers, 8800 bytes smem, 428 bytes cmem[0]\n";
    let u = &parse_ptxas(text)["paged_attention"];
    assert_eq!(
        *u,
        Usage {
            registers: 90,
            stack: 8,
            spill_stores: 4,
            spill_loads: 12,
            shared: 8800
        }
    );
}

#[test]
fn every_kernel_compiles_with_nvrtc_and_assembles_with_ptxas_without_spills() {
    let Some(ptxas) = tools() else {
        return;
    };
    let (major, minor) = nvrtc::version().expect("NVRTC version");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut failures = Vec::new();
    println!("NVRTC {major}.{minor}; ptxas {}", ptxas.display());
    println!(
        "{:<16} {:>8} {:>6} {:>5} {:>6} {:>8} {:>8} {:>6}",
        "kernel", "geometry", "arch", "regs", "stack", "spill_st", "spill_ld", "smem"
    );
    for (head_dim, group) in GEOMETRIES {
        let config = KernelConfig::new(head_dim, group).expect("a supported geometry");
        for arch in ARCHS {
            let (ptx, log) = nvrtc::compile(
                SOURCE,
                PROGRAM_NAME,
                &config.nvrtc_options(&format!("compute_{arch}")),
                Output::Ptx,
            )
            .unwrap_or_else(|e| {
                panic!("NVRTC (head_dim {head_dim}, group {group}, compute_{arch}): {e}")
            });
            assert!(
                !log.contains("warning"),
                "NVRTC warns for head_dim {head_dim}, group {group}: {log}"
            );
            let ptx_path = dir.path().join(format!("k_{head_dim}_{group}_{arch}.ptx"));
            std::fs::write(&ptx_path, &ptx).expect("write ptx");
            let run = Command::new(&ptxas)
                .arg("-v")
                .arg(format!("-arch=sm_{arch}"))
                .arg(&ptx_path)
                .arg("-o")
                .arg(ptx_path.with_extension("cubin"))
                .output()
                .expect("run ptxas");
            let text = String::from_utf8_lossy(&run.stderr).into_owned()
                + &String::from_utf8_lossy(&run.stdout);
            assert!(run.status.success(), "ptxas sm_{arch} failed:\n{text}");
            let usage = parse_ptxas(&text);
            for name in KERNELS {
                let Some(u) = usage.get(name) else {
                    failures.push(format!("{name} missing from the sm_{arch} PTX"));
                    continue;
                };
                println!(
                    "{:<16} {:>8} {:>6} {:>5} {:>6} {:>8} {:>8} {:>6}",
                    name,
                    format!("{head_dim}/{group}"),
                    format!("sm_{arch}"),
                    u.registers,
                    u.stack,
                    u.spill_stores,
                    u.spill_loads,
                    u.shared
                );
                if name == "paged_attention"
                    && u.shared != attention_shared_bytes(head_dim, group) as u64
                {
                    failures.push(format!(
                        "paged_attention ({head_dim}/{group}, sm_{arch}) uses {} bytes of shared memory; plan::attention_shared_bytes says {}",
                        u.shared,
                        attention_shared_bytes(head_dim, group)
                    ));
                }
                if u.spill_stores + u.spill_loads > MAX_SPILL_BYTES {
                    failures.push(format!(
                        "{name} (head_dim {head_dim}, group {group}, sm_{arch}) spills {} + {} bytes",
                        u.spill_stores, u.spill_loads
                    ));
                }
            }
            // The backend's own path: a cubin for the device's architecture.
            let (cubin, _) = nvrtc::compile(
                SOURCE,
                PROGRAM_NAME,
                &config.nvrtc_options(&format!("sm_{arch}")),
                Output::Cubin,
            )
            .expect("NVRTC cubin");
            assert_eq!(&cubin[..4], b"\x7fELF", "a cubin is an ELF image");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_kernel_that_does_not_compile_is_reported_with_the_log() {
    if tools().is_none() {
        return;
    }
    let broken =
        format!("{SOURCE}\nextern \"C\" __global__ void broken() {{ undefined_name = 1; }}\n");
    let config = KernelConfig::new(64, 1).expect("supported");
    let err = nvrtc::compile(
        &broken,
        PROGRAM_NAME,
        &config.nvrtc_options("compute_80"),
        Output::Ptx,
    )
    .expect_err("does not compile");
    let text = err.to_string();
    assert!(text.contains("undefined_name"), "{text}");
}
