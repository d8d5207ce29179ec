//! Sluice's wire contracts, generated from `proto/sluice/**`. Services import
//! a package as `use sluice_proto::queue::v1 as pb;` so wire types stay
//! visibly apart from domain types. Nothing here has behaviour beyond prost's.

#![allow(unreachable_pub, clippy::all)] // generated code

/// Shared messages: sampling parameters, usage, priority hints.
pub mod common {
    pub mod v1 {
        tonic::include_proto!("sluice.common.v1");
    }
}

/// The frontend's gRPC `Inference` API.
pub mod inference {
    pub mod v1 {
        tonic::include_proto!("sluice.inference.v1");
    }
}

/// The priority admission queue.
pub mod queue {
    pub mod v1 {
        tonic::include_proto!("sluice.queue.v1");
    }
}

/// The KV-aware router.
pub mod router {
    pub mod v1 {
        tonic::include_proto!("sluice.router.v1");
    }
}

/// Decode, prefill and aggregated workers.
pub mod worker {
    pub mod v1 {
        tonic::include_proto!("sluice.worker.v1");
    }
}

/// KV transfer descriptors and the gRPC fallback transport.
pub mod kv {
    pub mod v1 {
        tonic::include_proto!("sluice.kv.v1");
    }
}

/// Encoded `FileDescriptorSet` of every Sluice package, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("sluice_descriptor");
