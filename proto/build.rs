//! Generates the Rust types and tonic stubs for every `.proto` under `sluice/`,
//! plus one file-descriptor set for gRPC reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "sluice/common/v1/common.proto",
        "sluice/inference/v1/inference.proto",
        "sluice/queue/v1/queue.proto",
        "sluice/router/v1/router.proto",
        "sluice/worker/v1/worker.proto",
        "sluice/kv/v1/kv.proto",
    ];
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        // Prost's codec with smaller starting buffers (see `Codec` in lib.rs).
        .codec_path("crate::Codec")
        .file_descriptor_set_path(out.join("sluice_descriptor.bin"))
        .compile_protos(&protos, &["."])?;
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}
