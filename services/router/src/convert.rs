//! Wire ⇄ domain conversions: `pb` types on one side, the index's and the
//! pool's types on the other. Bad input becomes `RouterError::InvalidArgument`.

use std::collections::BTreeMap;

use sluice_proto::router::v1 as pb;
use sluice_proto::worker::v1 as wpb;
use sluice_runtime::RequestDescription;

use crate::error::RouterError;
use crate::indexer::{KvEvent, KvEventKind};
use crate::load::LoadReport;
use crate::pool::{
    Candidate, Commit, Decision, HeldByModel, MemberLoad, PlacementRecord, PlacementState,
    PoolKind, RouteInput,
};
use sluice_runtime::discovery::WorkerRank;

/// The pool a request asks for; unspecified means the decode pool.
pub(crate) fn pool_kind(pool: i32) -> Result<PoolKind, RouterError> {
    match pb::Pool::try_from(pool) {
        Ok(pb::Pool::Unspecified | pb::Pool::Decode) => Ok(PoolKind::Decode),
        Ok(pb::Pool::Prefill) => Ok(PoolKind::Prefill),
        Err(_) => Err(RouterError::InvalidArgument(format!(
            "pool {pool} is not a known pool (1 = decode, 2 = prefill)"
        ))),
    }
}

/// Checks a request's description ([`RequestDescription::from_wire`], and
/// a block size to count blocks by) and takes it as a [`RouteInput`]
/// committed as `commit` says (the caller decides from `req.commit` and
/// where the call came from).
pub(crate) fn route_input(
    req: pb::RouteRequest,
    commit: Commit,
) -> Result<RouteInput, RouterError> {
    let desc = RequestDescription::from_wire(req.description)
        .map_err(|e| RouterError::InvalidArgument(format!("description.{e}")))?;
    if desc.block_size == 0 {
        return Err(RouterError::InvalidArgument(
            "description.block_size must be positive (the workers' KV block size in tokens)".into(),
        ));
    }
    Ok(RouteInput { desc, commit })
}

fn pool_of(kind: PoolKind) -> pb::Pool {
    match kind {
        PoolKind::Decode => pb::Pool::Decode,
        PoolKind::Prefill => pb::Pool::Prefill,
    }
}

/// A placement on the wire.
pub(crate) fn placement(kind: PoolKind, p: &PlacementRecord, endpoint: &str) -> pb::Placement {
    pb::Placement {
        placement_id: p.id,
        pool: pool_of(kind) as i32,
        target: Some(target(&p.target, endpoint)),
        prefill_tokens: p.prefill_tokens,
        block_hashes: p.block_hashes.to_vec(),
        blocks: u32::try_from(p.blocks).unwrap_or(u32::MAX),
        started: p.started,
        priority: p.priority,
        tpot_target_ms: p.tpot_target_ms,
    }
}

/// Counts by priority on the wire, highest first.
pub(crate) fn priority_counts(by_priority: &BTreeMap<i32, u32>) -> Vec<pb::PriorityCount> {
    by_priority
        .iter()
        .rev()
        .filter(|(_, n)| **n > 0)
        .map(|(&priority, &count)| pb::PriorityCount { priority, count })
        .collect()
}

/// Held requests by model on the wire.
pub(crate) fn held_models(held: &HeldByModel) -> Vec<pb::HeldModel> {
    held.iter()
        .map(|(model, by_priority)| pb::HeldModel {
            model: model.clone(),
            by_priority: priority_counts(by_priority),
        })
        .filter(|m| !m.by_priority.is_empty())
        .collect()
}

/// A client's report of what it holds: model → priority → requests. A model
/// named twice or a priority named twice in one model is refused.
pub(crate) fn held_report(r: &pb::HeldReport) -> Result<HeldByModel, RouterError> {
    const MAX_MODELS: usize = 1024;
    const MAX_PRIORITIES: usize = 4096;
    if r.models.len() > MAX_MODELS {
        return Err(RouterError::InvalidArgument(format!(
            "held: {} models, at most {MAX_MODELS}",
            r.models.len()
        )));
    }
    let mut out = HeldByModel::new();
    for m in &r.models {
        if m.by_priority.len() > MAX_PRIORITIES {
            return Err(RouterError::InvalidArgument(format!(
                "held: model {:?} names {} priorities, at most {MAX_PRIORITIES}",
                m.model,
                m.by_priority.len()
            )));
        }
        if out.contains_key(&m.model) {
            return Err(RouterError::InvalidArgument(format!(
                "held: model {:?} named twice",
                m.model
            )));
        }
        let by_priority = out.entry(m.model.clone()).or_default();
        for c in &m.by_priority {
            if by_priority.insert(c.priority, c.count).is_some() {
                return Err(RouterError::InvalidArgument(format!(
                    "held: model {:?} names priority {} twice",
                    m.model, c.priority
                )));
            }
        }
    }
    out.retain(|_, by_priority| {
        by_priority.retain(|_, n| *n > 0);
        !by_priority.is_empty()
    });
    Ok(out)
}

/// A placement a client sends (a replica's or one it still holds).
pub(crate) fn placement_record(
    p: &pb::Placement,
) -> Result<(PoolKind, PlacementRecord), RouterError> {
    let kind = pool_kind(p.pool)?;
    let t = p
        .target
        .as_ref()
        .ok_or_else(|| RouterError::InvalidArgument("placement: target is required".into()))?;
    if u64::try_from(p.block_hashes.len()).unwrap_or(u64::MAX) > u64::from(p.blocks) {
        return Err(RouterError::InvalidArgument(format!(
            "placement {}: {} block hashes but only {} blocks",
            p.placement_id,
            p.block_hashes.len(),
            p.blocks
        )));
    }
    Ok((
        kind,
        PlacementRecord {
            id: p.placement_id,
            target: WorkerRank::new(t.worker_id.as_str(), t.dp_rank),
            prefill_tokens: p.prefill_tokens,
            block_hashes: p.block_hashes.as_slice().into(),
            blocks: u64::from(p.blocks),
            started: p.started,
            priority: p.priority,
            tpot_target_ms: p.tpot_target_ms,
        },
    ))
}

/// A placement update's state.
pub(crate) fn placement_state(state: i32) -> Result<PlacementState, RouterError> {
    match pb::PlacementState::try_from(state) {
        Ok(pb::PlacementState::Started) => Ok(PlacementState::Started),
        Ok(pb::PlacementState::Released) => Ok(PlacementState::Released),
        _ => Err(RouterError::InvalidArgument(format!(
            "placement state {state} is not one of STARTED (1), RELEASED (2)"
        ))),
    }
}

fn target(t: &WorkerRank, endpoint: &str) -> pb::Target {
    pb::Target {
        worker_id: t.worker_id.to_string(),
        dp_rank: t.dp_rank,
        endpoint: endpoint.to_owned(),
    }
}

fn candidate(c: &Candidate) -> pb::Candidate {
    pb::Candidate {
        target: Some(target(&c.target, &c.endpoint)),
        overlap_blocks: c.terms.overlap_blocks,
        prefill_cost: c.terms.prefill_cost,
        decode_cost: c.terms.decode_cost,
        total_cost: c.terms.total_cost,
        active_requests: c.terms.active_requests,
        over_bound: c.terms.over_bound,
        queued_prefill_tokens: c.terms.queued_prefill_tokens,
        predicted_ttft_ms: c.terms.predicted_ttft.map(|s| s * 1e3),
        predicted_tpot_ms: c.terms.predicted_tpot.map(|s| s * 1e3),
        over_tpot: c.terms.over_tpot,
        fetch_blocks: c.terms.fetch_blocks,
        fetch_ms: c.terms.fetch_seconds.map(|s| s * 1e3),
        restore_ms: c.terms.restore_seconds * 1e3,
    }
}

/// The reply for a decision in `kind`'s pool.
pub(crate) fn route_response(kind: PoolKind, d: &Decision) -> pb::RouteResponse {
    let chosen = d.target();
    pb::RouteResponse {
        target: Some(target(&chosen.target, &chosen.endpoint)),
        overlap_blocks: chosen.terms.overlap_blocks,
        mode: d.mode.to_pb() as i32,
        candidates: d.candidates.iter().map(candidate).collect(),
        placement: d
            .placement
            .as_ref()
            .map(|p| placement(kind, p, &chosen.endpoint)),
        predicted_within_target: d.within_target,
        prefix_source: d.prefix_source.as_ref().map(|(holder, blocks)| {
            sluice_proto::common::v1::PrefixSource {
                worker_id: holder.worker_id.to_string(),
                dp_rank: holder.dp_rank,
                blocks: *blocks,
            }
        }),
    }
}

/// One member's line in a `LoadView`.
pub(crate) fn worker_load(
    m: &MemberLoad,
    others_by_priority: Option<&BTreeMap<i32, u32>>,
) -> pb::WorkerLoad {
    pb::WorkerLoad {
        target: Some(target(&m.info.target, &m.info.endpoint)),
        model: m.info.model.clone(),
        role: m.info.role.to_pb() as i32,
        active_prefill_tokens: m.load.active_prefill_tokens,
        active_decode_blocks: m.load.active_decode_blocks,
        running: m.load.report.running,
        waiting: m.load.report.waiting,
        max_num_batched_tokens: m.load.report.max_num_batched_tokens,
        max_num_seqs: m.load.report.max_num_seqs,
        total_blocks: m.load.report.total_blocks,
        placements: m.load.placements,
        unplaced_requests: m.load.report.unplaced_requests,
        priority_scheduling: m.load.report.priority_scheduling,
        step_time_us: m.load.report.step_time_us,
        others_by_priority: others_by_priority.map(priority_counts).unwrap_or_default(),
    }
}

/// A worker's KV event; `None` for an event with no kind (a newer worker's
/// kind this router does not know), which the caller treats as a gap.
pub(crate) fn kv_event(ev: wpb::KvEvent) -> Option<KvEvent> {
    let kind = match ev.kind? {
        wpb::kv_event::Kind::Stored(s) => KvEventKind::Stored {
            parent: s.parent_hash,
            hashes: s.block_hashes,
        },
        wpb::kv_event::Kind::Removed(r) => KvEventKind::Removed {
            hashes: r.block_hashes,
        },
        wpb::kv_event::Kind::Moved(m) => KvEventKind::Moved {
            hashes: m.block_hashes,
            tier: m.tier,
        },
        wpb::kv_event::Kind::Cleared(_) => KvEventKind::Cleared,
    };
    Some(KvEvent { seq: ev.seq, kind })
}

/// A worker's load report.
pub(crate) fn load_report(r: &wpb::LoadReport) -> LoadReport {
    LoadReport {
        running: r.running,
        waiting: r.waiting,
        active_blocks: r.active_blocks,
        total_blocks: r.total_blocks,
        pending_prefill_tokens: r.pending_prefill_tokens,
        max_num_seqs: r.max_num_seqs,
        max_num_batched_tokens: r.max_num_batched_tokens,
        unplaced_requests: r.unplaced_requests,
        unplaced_prefill_tokens: r.unplaced_prefill_tokens,
        unplaced_blocks: r.unplaced_blocks,
        priority_scheduling: r.priority_scheduling,
        long_prefill_token_threshold: r.long_prefill_token_threshold,
        step_time_us: r.step_time_us,
        prefill_ns_per_token: r.prefill_ns_per_token,
        prefill_step_us: r.prefill_step_us,
        prefill_first_steps: r.prefill_first_steps,
        stalled_in_a_row: r.stalled_in_a_row,
        prefilling: r.prefilling,
        decode_base_us: r.decode_base_us,
        decode_ns_per_seq: r.decode_ns_per_seq,
        kv_fetch_bytes_per_sec: r.kv_fetch_bytes_per_sec,
        kv_tier_bytes_per_sec: r.kv_tier_bytes_per_sec,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_report_converts_and_names_what_it_repeats() {
        let count = |priority, count| pb::PriorityCount { priority, count };
        let model = |name: &str, by_priority| pb::HeldModel {
            model: name.into(),
            by_priority,
        };
        let report = pb::HeldReport {
            models: vec![
                model("m", vec![count(3, 1), count(0, 2), count(1, 0)]),
                model("n", vec![count(0, 0)]),
            ],
        };
        let held = held_report(&report).expect("valid");
        assert_eq!(held.len(), 1, "empty counts and models dropped: {held:?}");
        assert_eq!(held["m"], BTreeMap::from([(0, 2), (3, 1)]));
        assert_eq!(
            held_models(&held),
            vec![model("m", vec![count(3, 1), count(0, 2)])],
            "highest first"
        );
        let twice = pb::HeldReport {
            models: vec![model("m", vec![]), model("m", vec![])],
        };
        assert!(held_report(&twice).is_err());
        let twice = pb::HeldReport {
            models: vec![model("m", vec![count(1, 1), count(1, 2)])],
        };
        let err = held_report(&twice).expect_err("a priority twice");
        assert!(err.to_string().contains("priority 1 twice"), "{err}");
    }

    #[test]
    fn zero_block_size_and_too_many_hashes_are_invalid() {
        let req = |block_size, block_hashes| pb::RouteRequest {
            description: Some(sluice_proto::common::v1::RequestDescription {
                prompt_tokens: 32,
                block_size,
                block_hashes,
                ..Default::default()
            }),
            ..Default::default()
        };
        for bad in [req(0, Vec::new()), req(16, vec![1, 2, 3])] {
            assert!(matches!(
                route_input(bad, Commit::DryRun),
                Err(RouterError::InvalidArgument(_))
            ));
        }
        let input = route_input(req(16, vec![1, 2]), Commit::DryRun).expect("valid");
        assert_eq!(&*input.desc.block_hashes, &[1, 2]);
        assert!(matches!(
            route_input(pb::RouteRequest::default(), Commit::DryRun),
            Err(RouterError::InvalidArgument(_))
        ));
    }

    #[test]
    fn unspecified_pool_is_decode_and_unknown_is_invalid() {
        assert_eq!(pool_kind(0).expect("ok"), PoolKind::Decode);
        assert_eq!(pool_kind(2).expect("ok"), PoolKind::Prefill);
        assert!(pool_kind(9).is_err());
    }
}
