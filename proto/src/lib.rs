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

/// The codec every generated client and server uses: prost's, with smaller
/// starting buffers.
///
/// tonic starts each call's encoder and decoder with an 8 KiB buffer, so a
/// request through the mesh (an admission lease and a worker stream, each
/// encoded and decoded at both ends) allocated some 64 KiB it barely
/// touched: Sluice's messages are tens to hundreds of bytes. With 256
/// requests in flight that is 16 MiB of short-lived buffers, one page or
/// more each, and allocation showed up as the part of the CPU per request
/// that grew with concurrency. Buffers start at [`CODEC_BUFFER_BYTES`] and
/// grow as a message needs (a decoder reserves a message's whole length
/// once its header is read; an encoder grows like any `BytesMut`), and a
/// stream still yields its encoded bytes every 32 KiB, tonic's default.
#[derive(Debug, Clone, Copy)]
pub struct Codec<T, U>(std::marker::PhantomData<(T, U)>);

/// Starting size of a call's encode and decode buffers (see [`Codec`]).
pub const CODEC_BUFFER_BYTES: usize = 1024;

const CODEC_YIELD_BYTES: usize = 32 * 1024;

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <tonic_prost::ProstCodec<T, U> as tonic::codec::Codec>::Encoder;
    type Decoder = <tonic_prost::ProstCodec<T, U> as tonic::codec::Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstCodec::<T, U>::raw_encoder(tonic::codec::BufferSettings::new(
            CODEC_BUFFER_BYTES,
            CODEC_YIELD_BYTES,
        ))
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstCodec::<T, U>::raw_decoder(tonic::codec::BufferSettings::new(
            CODEC_BUFFER_BYTES,
            CODEC_YIELD_BYTES,
        ))
    }
}
