//! A worker's discovery entry, typed. The wire form is one protobuf
//! message, `sluice.worker.v1.WorkerInfo`: the worker encodes it once when
//! it registers, the discovery layer decodes and checks it once when it
//! reads the entry, and every reader (router, frontend, tests) uses this
//! type. Nothing parses worker facts out of strings.

use std::sync::Arc;

use prost::Message;
use sluice_proto::kv::v1::Transport;
use sluice_proto::worker::v1 as pb;

/// One data-parallel rank of one worker: what the router places on and the
/// queue counts load and starting prefills by. The mesh's one name for it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRank {
    /// The worker's instance id (its discovery id).
    pub worker_id: Arc<str>,
    /// Data-parallel rank inside that worker.
    pub dp_rank: u32,
}

impl WorkerRank {
    /// Rank `dp_rank` of worker `worker_id`.
    pub fn new(worker_id: impl Into<Arc<str>>, dp_rank: u32) -> Self {
        Self {
            worker_id: worker_id.into(),
            dp_rank,
        }
    }
}

impl std::fmt::Display for WorkerRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// What a worker does in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerRole {
    /// Serves `Generate`; prefills locally or on a prefill worker.
    Decode,
    /// Serves `Prefill`: computes prompts and writes their KV blocks.
    Prefill,
    /// Prefill and decode in one worker.
    Aggregated,
}

impl WorkerRole {
    /// From the wire enum's value; `None` for UNSPECIFIED or unknown values
    /// (each boundary says what that means there).
    pub fn from_pb(value: i32) -> Option<Self> {
        match pb::WorkerRole::try_from(value).ok()? {
            pb::WorkerRole::Decode => Some(Self::Decode),
            pb::WorkerRole::Prefill => Some(Self::Prefill),
            pb::WorkerRole::Aggregated => Some(Self::Aggregated),
            pb::WorkerRole::Unspecified => None,
        }
    }

    /// The wire enum.
    pub fn to_pb(self) -> pb::WorkerRole {
        match self {
            Self::Decode => pb::WorkerRole::Decode,
            Self::Prefill => pb::WorkerRole::Prefill,
            Self::Aggregated => pb::WorkerRole::Aggregated,
        }
    }

    /// The lower-case name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Decode => "decode",
            Self::Prefill => "prefill",
            Self::Aggregated => "aggregated",
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The compute backend that runs a worker's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineBackend {
    Cpu,
    Cuda,
    /// Dynamo's timing model in place of compute.
    Mocker,
}

impl EngineBackend {
    /// From the wire enum's value; `None` for UNSPECIFIED or unknown values.
    pub fn from_pb(value: i32) -> Option<Self> {
        match pb::EngineBackend::try_from(value).ok()? {
            pb::EngineBackend::Cpu => Some(Self::Cpu),
            pb::EngineBackend::Cuda => Some(Self::Cuda),
            pb::EngineBackend::Mocker => Some(Self::Mocker),
            pb::EngineBackend::Unspecified => None,
        }
    }

    /// The wire enum.
    pub fn to_pb(self) -> pb::EngineBackend {
        match self {
            Self::Cpu => pb::EngineBackend::Cpu,
            Self::Cuda => pb::EngineBackend::Cuda,
            Self::Mocker => pb::EngineBackend::Mocker,
        }
    }
}

/// What a worker publishes about itself in discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub role: WorkerRole,
    /// Tokens per KV block; never 0.
    pub block_size: u32,
    /// Data-parallel ranks, numbered from 0; at least 1.
    pub dp_size: u32,
    /// `None`: the worker did not say (or named a backend this build does
    /// not know); informational only.
    pub engine: Option<EngineBackend>,
    /// KV blocks of one rank.
    pub total_blocks: u64,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    /// The longest request (prompt and output) it holds; `None`: not said.
    pub max_model_len: Option<u32>,
    /// The KV transports it offers (decode) or accepts (prefill), preferred
    /// first; never UNSPECIFIED.
    pub kv_transports: Vec<Transport>,
    /// Bytes a KV transfer moves per block; `None`: not said.
    pub kv_block_bytes: Option<u64>,
}

/// Why a worker's discovery entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerInfoError {
    #[error("not a WorkerInfo message")]
    Decode(#[from] prost::DecodeError),
    #[error("role is unspecified or unknown ({0})")]
    Role(i32),
    #[error("block_size is 0")]
    BlockSize,
}

impl WorkerInfo {
    /// A worker of `role` with KV blocks of `block_size` tokens, one rank,
    /// and nothing else said.
    pub fn new(role: WorkerRole, block_size: u32) -> Self {
        Self {
            role,
            block_size,
            dp_size: 1,
            engine: None,
            total_blocks: 0,
            max_num_seqs: 0,
            max_num_batched_tokens: 0,
            max_model_len: None,
            kv_transports: Vec::new(),
            kv_block_bytes: None,
        }
    }

    /// The wire message.
    pub fn to_pb(&self) -> pb::WorkerInfo {
        pb::WorkerInfo {
            role: self.role.to_pb() as i32,
            block_size: self.block_size,
            dp_size: self.dp_size,
            engine: self
                .engine
                .map_or(pb::EngineBackend::Unspecified, |e| e.to_pb()) as i32,
            total_blocks: self.total_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len.unwrap_or(0),
            kv_transports: self.kv_transports.iter().map(|t| *t as i32).collect(),
            kv_block_bytes: self.kv_block_bytes.unwrap_or(0),
        }
    }

    /// Checks the wire message: the role must be known and the block size
    /// positive; `dp_size` 0 means 1, `max_model_len` 0 means not said, and
    /// unknown engines and transports are dropped.
    pub fn from_pb(m: &pb::WorkerInfo) -> Result<Self, WorkerInfoError> {
        let role = WorkerRole::from_pb(m.role).ok_or(WorkerInfoError::Role(m.role))?;
        if m.block_size == 0 {
            return Err(WorkerInfoError::BlockSize);
        }
        Ok(Self {
            role,
            block_size: m.block_size,
            dp_size: m.dp_size.max(1),
            engine: EngineBackend::from_pb(m.engine),
            total_blocks: m.total_blocks,
            max_num_seqs: m.max_num_seqs,
            max_num_batched_tokens: m.max_num_batched_tokens,
            max_model_len: (m.max_model_len > 0).then_some(m.max_model_len),
            kv_transports: m
                .kv_transports
                .iter()
                .filter_map(|&t| Transport::try_from(t).ok())
                .filter(|&t| t != Transport::Unspecified)
                .collect(),
            kv_block_bytes: (m.kv_block_bytes > 0).then_some(m.kv_block_bytes),
        })
    }

    /// The encoded wire message.
    pub fn encode(&self) -> Vec<u8> {
        self.to_pb().encode_to_vec()
    }

    /// Decodes and checks an encoded wire message.
    pub fn decode(bytes: &[u8]) -> Result<Self, WorkerInfoError> {
        let m = pb::WorkerInfo::decode(bytes)?;
        Self::from_pb(&m)
    }
}

/// The discovery entry's JSON envelope carries the encoded message as one
/// base64 string (`"worker": "CAEQEB…"`).
pub(super) mod base64_pb {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::WorkerInfo;

    pub(crate) fn serialize<S: Serializer>(
        info: &Option<WorkerInfo>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match info {
            Some(i) => s.serialize_some(&STANDARD.encode(i.encode())),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<WorkerInfo>, D::Error> {
        let Some(text) = Option::<String>::deserialize(d)? else {
            return Ok(None);
        };
        let bytes = STANDARD
            .decode(text.as_bytes())
            .map_err(|e| serde::de::Error::custom(format!("worker: not base64: {e}")))?;
        WorkerInfo::decode(&bytes)
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("worker: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_info_round_trips_and_refuses_what_it_cannot_use() {
        let info = WorkerInfo {
            role: WorkerRole::Prefill,
            block_size: 16,
            dp_size: 2,
            engine: Some(EngineBackend::Mocker),
            total_blocks: 512,
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            max_model_len: Some(4096),
            kv_transports: vec![Transport::Shm, Transport::Grpc],
            kv_block_bytes: Some(2 << 20),
        };
        assert_eq!(WorkerInfo::decode(&info.encode()), Ok(info.clone()));

        let mut m = info.to_pb();
        m.role = pb::WorkerRole::Unspecified as i32;
        assert_eq!(WorkerInfo::from_pb(&m), Err(WorkerInfoError::Role(0)));
        m.role = 99;
        assert_eq!(WorkerInfo::from_pb(&m), Err(WorkerInfoError::Role(99)));

        let mut m = info.to_pb();
        m.block_size = 0;
        assert_eq!(WorkerInfo::from_pb(&m), Err(WorkerInfoError::BlockSize));

        // Defaults at the boundary: dp 0 is one rank, max_model_len 0 and an
        // unknown engine are "not said", unknown transports are dropped.
        let mut m = info.to_pb();
        m.dp_size = 0;
        m.max_model_len = 0;
        m.engine = 42;
        m.kv_transports = vec![0, Transport::Tcp as i32, 77];
        let got = WorkerInfo::from_pb(&m).expect("valid");
        assert_eq!(got.dp_size, 1);
        assert_eq!(got.max_model_len, None);
        assert_eq!(got.engine, None);
        assert_eq!(got.kv_transports, vec![Transport::Tcp]);

        assert!(matches!(
            WorkerInfo::decode(b"\xff\xff"),
            Err(WorkerInfoError::Decode(_))
        ));
    }
}
