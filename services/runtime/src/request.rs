//! One request's description as it travels through admission and placement
//! (`common.v1.RequestDescription` on the wire): who sent it, what it asks
//! for, what its prompt looks like. The frontend builds it once from the
//! parsed, tokenized and hashed request; the queue takes it from
//! `AdmitOpen` with [`RequestDescription::from_wire`] (the one check, with
//! the [`crate::limits`] rules) and hands it on in every `RouteRequest`;
//! the router takes it the same way. The queue's `Entry`, the router's
//! `RouteInput` and the frontend's `Prepared` embed this type rather than
//! copy its fields.
//!
//! Hashes and exclusions are shared (`Arc`), so the copies a held request
//! makes (orders, placement calls to several routers) cost no allocation.

use std::sync::Arc;

use sluice_proto::common::v1 as common;

use crate::limits::{self, Invalid};

/// A request as admission and placement see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestDescription {
    /// The caller's request id (logs, traces, the router's span).
    pub request_id: String,
    /// The model; "" = any worker.
    pub model: String,
    /// Higher = more important; default 0.
    pub priority: i32,
    /// Strict tier; every request of a higher tier is released first.
    pub strict_priority: u32,
    /// Tenant for per-tenant limits, `wfq` classes and `fair` shares; "" =
    /// default.
    pub tenant: String,
    /// The tenant's fair-share weight sent with the request (the API key
    /// file's); 0 = none.
    pub tenant_weight: u32,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Expected output tokens (0 = unknown).
    pub expected_output_tokens: u32,
    /// The client's TTFT target in milliseconds; 0 = the queue's default
    /// for the priority.
    pub ttft_target_ms: u32,
    /// The client's TPOT target in milliseconds; 0 = the queue's default
    /// for the priority (none unless configured).
    pub tpot_target_ms: u32,
    /// Chained sequence block hashes of the prompt's full blocks.
    pub block_hashes: Arc<[u64]>,
    /// Block size the hashes were computed with, in tokens.
    pub block_size: u32,
    /// Decode workers not to place on (a migrating request's failed ones).
    pub exclude_worker_ids: Arc<[String]>,
}

impl RequestDescription {
    /// Takes a description received on the wire, checked with
    /// [`RequestDescription::check`]. A missing one is the empty
    /// description (which the caller's own rules may refuse, e.g. for its
    /// empty id).
    pub fn from_wire(d: Option<common::RequestDescription>) -> Result<Self, Invalid> {
        let d = d.unwrap_or_default();
        let desc = Self {
            request_id: d.request_id,
            model: d.model,
            priority: d.priority,
            strict_priority: d.strict_priority,
            tenant: d.tenant,
            tenant_weight: d.tenant_weight,
            prompt_tokens: d.prompt_tokens,
            expected_output_tokens: d.expected_output_tokens,
            ttft_target_ms: d.ttft_target_ms,
            tpot_target_ms: d.tpot_target_ms,
            block_hashes: Arc::from(d.block_hashes),
            block_size: d.block_size,
            exclude_worker_ids: Arc::from(d.exclude_worker_ids),
        };
        desc.check()?;
        Ok(desc)
    }

    /// The rules every receiver applies, each naming the field as the
    /// description names it (`block_size`, `exclude_worker_ids`, …): ids,
    /// model and tenant bounded ([`limits::check_id`]), priority and tier
    /// in range ([`limits::check_priority`]), exclusions bounded
    /// ([`limits::check_excluded`]), and hashes only of full blocks of the
    /// prompt (so `block_size` is set when any are sent).
    pub fn check(&self) -> Result<(), Invalid> {
        limits::check_id("request_id", &self.request_id)?;
        limits::check_id("model", &self.model)?;
        limits::check_priority(
            "priority",
            self.priority,
            "strict_priority",
            self.strict_priority,
        )?;
        limits::check_id("tenant", &self.tenant)?;
        limits::check_excluded("exclude_worker_ids", &self.exclude_worker_ids)?;
        if !self.block_hashes.is_empty() {
            if self.block_size == 0 {
                return Err(Invalid {
                    field: "block_size",
                    message: "must be set (> 0) when block_hashes are sent".into(),
                });
            }
            let covered = self.block_hashes.len() as u64 * u64::from(self.block_size);
            if covered > u64::from(self.prompt_tokens) {
                return Err(Invalid {
                    field: "block_hashes",
                    message: format!(
                        "{} full blocks of {} tokens exceed prompt_tokens {}",
                        self.block_hashes.len(),
                        self.block_size,
                        self.prompt_tokens
                    ),
                });
            }
        }
        Ok(())
    }

    /// The description on the wire.
    pub fn to_wire(&self) -> common::RequestDescription {
        common::RequestDescription {
            request_id: self.request_id.clone(),
            model: self.model.clone(),
            priority: self.priority,
            strict_priority: self.strict_priority,
            tenant: self.tenant.clone(),
            tenant_weight: self.tenant_weight,
            prompt_tokens: self.prompt_tokens,
            expected_output_tokens: self.expected_output_tokens,
            ttft_target_ms: self.ttft_target_ms,
            tpot_target_ms: self.tpot_target_ms,
            block_hashes: self.block_hashes.to_vec(),
            block_size: self.block_size,
            exclude_worker_ids: self.exclude_worker_ids.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire() -> common::RequestDescription {
        common::RequestDescription {
            request_id: "r1".into(),
            model: "m".into(),
            priority: -2,
            strict_priority: 1,
            tenant: "t".into(),
            tenant_weight: 2,
            prompt_tokens: 40,
            expected_output_tokens: 7,
            ttft_target_ms: 1500,
            tpot_target_ms: 40,
            block_hashes: vec![1, 2],
            block_size: 16,
            exclude_worker_ids: vec!["w9".into()],
        }
    }

    #[test]
    fn a_description_goes_through_the_wire_unchanged() {
        let desc = RequestDescription::from_wire(Some(wire())).expect("valid");
        assert_eq!(&*desc.block_hashes, &[1, 2]);
        assert_eq!(&*desc.exclude_worker_ids, ["w9".to_string()]);
        assert_eq!(desc.to_wire(), wire());
        assert_eq!(
            RequestDescription::from_wire(None).expect("empty is valid"),
            RequestDescription::default()
        );
    }

    #[test]
    fn each_rule_names_its_field() {
        let cases = [
            (
                common::RequestDescription {
                    prompt_tokens: 20,
                    ..wire()
                },
                "block_hashes",
            ),
            (
                common::RequestDescription {
                    block_size: 0,
                    ..wire()
                },
                "block_size",
            ),
            (
                common::RequestDescription {
                    priority: i32::MAX,
                    ..wire()
                },
                "priority",
            ),
            (
                common::RequestDescription {
                    strict_priority: u32::MAX,
                    ..wire()
                },
                "strict_priority",
            ),
            (
                common::RequestDescription {
                    tenant: "t".repeat(limits::MAX_ID_BYTES + 1),
                    ..wire()
                },
                "tenant",
            ),
            (
                common::RequestDescription {
                    exclude_worker_ids: vec!["w".into(); limits::MAX_EXCLUDED_WORKERS + 1],
                    ..wire()
                },
                "exclude_worker_ids",
            ),
        ];
        for (bad, field) in cases {
            let err = RequestDescription::from_wire(Some(bad)).expect_err(field);
            assert_eq!(err.field, field);
        }
        // No hashes: no block size needed.
        let bare = common::RequestDescription {
            block_hashes: Vec::new(),
            block_size: 0,
            ..wire()
        };
        assert!(RequestDescription::from_wire(Some(bare)).is_ok());
    }
}
