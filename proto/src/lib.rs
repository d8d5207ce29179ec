//! Sluice's wire contracts, generated from `proto/sluice/**`. Services import
//! a package as `use sluice_proto::queue::v1 as pb;` so wire types stay
//! visibly apart from domain types. Beyond prost's code: the codec every
//! client and server uses, and the one mapping between a lease's error and
//! the gRPC status it stands for.

#![forbid(unsafe_code)]
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

/// The metadata key naming why the queue refused or failed a request
/// ([`queue::v1::QueueReason::label`]) on every status it answers with.
pub const REASON_HEADER: &str = "sluice-reason";

impl queue::v1::QueueReason {
    /// Every reason, `Unspecified` aside.
    pub const ALL: [Self; 16] = [
        Self::QueueFull,
        Self::TenantFull,
        Self::QuotaTokens,
        Self::QuotaRequests,
        Self::Shed,
        Self::TtftTargetUnmeetable,
        Self::TtftTargetMissed,
        Self::Displaced,
        Self::Deadline,
        Self::NoWorkers,
        Self::Placement,
        Self::Draining,
        Self::InvalidArgument,
        Self::InvalidFlag,
        Self::NoRouter,
        Self::Internal,
    ];

    /// The reason's label: the `sluice-reason` value, the metrics' `reason`
    /// label and the 429's `code`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::QueueFull => "queue_full",
            Self::TenantFull => "tenant_full",
            Self::QuotaTokens => "quota_tokens",
            Self::QuotaRequests => "quota_requests",
            Self::Shed => "shed",
            Self::TtftTargetUnmeetable => "ttft_target_unmeetable",
            Self::TtftTargetMissed => "ttft_target_missed",
            Self::Displaced => "displaced",
            Self::Deadline => "deadline",
            Self::NoWorkers => "no_workers",
            Self::Placement => "placement",
            Self::Draining => "draining",
            Self::InvalidArgument => "invalid_argument",
            Self::InvalidFlag => "invalid_flag",
            Self::NoRouter => "no_router",
            Self::Internal => "internal",
        }
    }

    /// The reason a label names (`None`: no queue's).
    pub fn from_label(label: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.label() == label)
    }

    /// The reason on a status, if a queue answered it.
    pub fn of_status(status: &tonic::Status) -> Option<Self> {
        status
            .metadata()
            .get(REASON_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(Self::from_label)
    }

    /// A refusal for this reason: `RESOURCE_EXHAUSTED` naming it
    /// (`sluice-reason`) with `retry-after` in seconds (at least 1), which
    /// the frontend answers as a 429 with `Retry-After`.
    pub fn refusal(self, message: impl Into<String>, retry_after_secs: u64) -> tonic::Status {
        let mut status = tonic::Status::resource_exhausted(message);
        let meta = status.metadata_mut();
        meta.insert(
            REASON_HEADER,
            tonic::metadata::MetadataValue::from_static(self.label()),
        );
        meta.insert(
            "retry-after",
            tonic::metadata::MetadataValue::from(retry_after_secs.max(1)),
        );
        status
    }

    /// Whether another queue replica may admit the request: this one is
    /// going away, or could not reach a router or get a placement from one.
    /// Every other answer is about the request, and holds at any replica.
    pub fn another_queue_may_admit(self) -> bool {
        match self {
            Self::Draining | Self::NoRouter | Self::Placement => true,
            Self::Unspecified
            | Self::QueueFull
            | Self::TenantFull
            | Self::QuotaTokens
            | Self::QuotaRequests
            | Self::Shed
            | Self::TtftTargetUnmeetable
            | Self::TtftTargetMissed
            | Self::Displaced
            | Self::Deadline
            | Self::NoWorkers
            | Self::InvalidArgument
            | Self::InvalidFlag
            | Self::Internal => false,
        }
    }
}

impl common::v1::FinishReason {
    /// The name the OpenAI API gives it (`None`: the request has not
    /// finished).
    pub fn openai_name(self) -> Option<&'static str> {
        match self {
            Self::Unspecified => None,
            Self::Stop => Some("stop"),
            Self::Length => Some("length"),
            Self::Abort => Some("abort"),
            Self::Error => Some("error"),
        }
    }
}

/// A request's error on a session (`Queue.Leases`, `Worker.GenerateSession`)
/// is the status its own call (`Admit`, `Generate`) would have ended with:
/// code, message and ASCII metadata (`sluice-reason`, `retry-after`,
/// `sluice-quota`). Both directions live here so the two ends of a session
/// cannot disagree on the mapping.
impl common::v1::RpcStatus {
    /// The error a session sends for `status`; binary metadata is dropped.
    pub fn from_status(status: &tonic::Status) -> Self {
        let metadata = status
            .metadata()
            .iter()
            .filter_map(|kv| match kv {
                tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                    Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned()))
                }
                tonic::metadata::KeyAndValueRef::Binary(..) => None,
            })
            .collect();
        Self {
            code: status.code() as i32,
            message: status.message().to_owned(),
            metadata,
        }
    }

    /// The status this error stands for; entries that are not valid
    /// metadata are dropped.
    pub fn into_status(self) -> tonic::Status {
        let mut status = tonic::Status::new(self.code.into(), self.message);
        for (k, v) in self.metadata {
            if let (Ok(key), Ok(value)) = (
                tonic::metadata::MetadataKey::from_bytes(k.as_bytes()),
                tonic::metadata::MetadataValue::try_from(v.as_str()),
            ) {
                status.metadata_mut().insert(key, value);
            }
        }
        status
    }
}

impl worker::v1::GenerateResponse {
    /// Whether this message ends its generation (`finish_reason` is set):
    /// the one rule for both ends of a `Worker.GenerateSession`.
    pub fn finishes(&self) -> bool {
        self.finish_reason != common::v1::FinishReason::Unspecified as i32
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

#[cfg(test)]
mod reason_tests {
    use super::queue::v1::QueueReason;

    #[test]
    fn every_reason_has_its_own_label_and_reads_back() {
        let mut labels: Vec<&str> = QueueReason::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), QueueReason::ALL.len());
        for r in QueueReason::ALL {
            assert_eq!(QueueReason::from_label(r.label()), Some(r));
            // The label is the wire name without its prefix, lower case.
            assert_eq!(
                r.as_str_name()
                    .trim_start_matches("QUEUE_REASON_")
                    .to_lowercase(),
                r.label()
            );
        }
        assert_eq!(QueueReason::from_label("nope"), None);
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::common::v1::RpcStatus;

    #[test]
    fn a_session_error_becomes_the_status_its_own_call_would_have_ended_with() {
        let status = RpcStatus {
            code: Code::ResourceExhausted as i32,
            message: "queue full".into(),
            metadata: [
                ("sluice-reason".to_owned(), "queue_full".to_owned()),
                ("retry-after".to_owned(), "3".to_owned()),
                ("not a header".to_owned(), "dropped".to_owned()),
            ]
            .into(),
        }
        .into_status();
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.message(), "queue full");
        let meta = |k| status.metadata().get(k).and_then(|v| v.to_str().ok());
        assert_eq!(meta("sluice-reason"), Some("queue_full"));
        assert_eq!(meta("retry-after"), Some("3"));
        assert_eq!(status.metadata().len(), 2);

        // And back: what the queue sends for that status.
        let again = RpcStatus::from_status(&status);
        assert_eq!(again.code, Code::ResourceExhausted as i32);
        assert_eq!(again.message, "queue full");
        assert_eq!(again.metadata.len(), 2);
        assert_eq!(
            again.metadata.get("retry-after").map(String::as_str),
            Some("3")
        );
    }
}
