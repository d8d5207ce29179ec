//! Wire ⇄ domain: the `Admit` open message to an [`Entry`] (validated, with
//! `InvalidArgument` naming the field), held statuses and grants to
//! responses, the router's `LoadView` to the queue's, and `Stats`.

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_proto::queue::v1 as pb;
use sluice_proto::router::v1 as router_pb;
use sluice_runtime::RequestDescription;
use sluice_runtime::discovery::WorkerRank;
use tokio::time::Instant;

use crate::config::Args;
use crate::error::QueueError;
use crate::queue::{
    Entry, Grant, HeldByModel, HeldStatus, LoadView, QueueStats, Target, WorkerLoad, WorkerRole,
};

fn invalid(field: &'static str, reason: impl Into<String>) -> QueueError {
    QueueError::InvalidArgument {
        field,
        reason: reason.into(),
    }
}

/// The wire path of a description's field inside `AdmitOpen`, for errors.
fn open_field(field: &'static str) -> &'static str {
    match field {
        "request_id" => "open.description.request_id",
        "model" => "open.description.model",
        "priority" => "open.description.priority",
        "strict_priority" => "open.description.strict_priority",
        "tenant" => "open.description.tenant",
        "exclude_worker_ids" => "open.description.exclude_worker_ids",
        "block_size" => "open.description.block_size",
        "block_hashes" => "open.description.block_hashes",
        other => other,
    }
}

/// Validates an open message received at `now` and makes it an entry: the
/// description's rules ([`RequestDescription::from_wire`]) and the queue's
/// own (a request id to name the lease by). The cached-prefix estimate
/// starts at 0; under `wspt` the queue reads it from the router while the
/// request is held.
pub(crate) fn entry_from_open(open: pb::AdmitOpen, now: Instant) -> Result<Entry, QueueError> {
    let mut desc = RequestDescription::from_wire(open.description)
        .map_err(|e| invalid(open_field(e.field), e.message))?;
    if desc.request_id.is_empty() {
        return Err(invalid(open_field("request_id"), "must not be empty"));
    }
    // "" is the default tenant: one name for it in quotas and classes.
    if desc.tenant.is_empty() {
        crate::tenants::DEFAULT_TENANT.clone_into(&mut desc.tenant);
    }
    let deadline =
        (open.deadline_ms > 0).then(|| now + Duration::from_millis(u64::from(open.deadline_ms)));
    Ok(Entry {
        desc,
        overlap_tokens: 0,
        arrival: now,
        deadline,
        span: tracing::Span::none(),
    })
}

pub(crate) fn held_response(status: &HeldStatus) -> pb::AdmitResponse {
    pb::AdmitResponse {
        msg: Some(pb::admit_response::Msg::Held(pb::Held {
            position: status.position,
            pending: status.pending,
            reason: status.reason.as_str().to_owned(),
        })),
    }
}

pub(crate) fn grant_response(grant: &Grant) -> pb::AdmitResponse {
    let placement = &grant.placement;
    let (prefill_worker_id, prefill_worker_endpoint) = placement
        .prefill
        .as_ref()
        .map(|t| (t.rank.worker_id.to_string(), t.endpoint.clone()))
        .unwrap_or_default();
    pb::AdmitResponse {
        msg: Some(pb::admit_response::Msg::Grant(pb::Grant {
            worker_id: placement.worker.rank.worker_id.to_string(),
            worker_endpoint: placement.worker.endpoint.clone(),
            dp_rank: placement.worker.rank.dp_rank,
            prefill_worker_id,
            prefill_worker_endpoint,
            overlap_tokens: placement.overlap_tokens,
            queue_wait_ms: grant.waited.as_secs_f64() * 1000.0,
            ttft_target_ms: u32::try_from(grant.ttft_target.as_millis()).unwrap_or(u32::MAX),
            predicted_wait_ms: grant.predicted_wait.map(|d| d.as_secs_f64() * 1000.0),
            routed_ttft_ms: placement.routed_ttft.map(|d| d.as_secs_f64() * 1000.0),
            routed_within_target: placement.routed_within_target,
            tpot_target_ms: grant.tpot_target_ms,
            prefix_source: placement.prefix_source.as_ref().map(|(holder, blocks)| {
                sluice_proto::common::v1::PrefixSource {
                    worker_id: holder.worker_id.to_string(),
                    dp_rank: holder.dp_rank,
                    blocks: *blocks,
                }
            }),
        })),
    }
}

impl From<router_pb::Target> for Target {
    fn from(t: router_pb::Target) -> Self {
        Self {
            rank: WorkerRank::new(t.worker_id, t.dp_rank),
            endpoint: t.endpoint,
        }
    }
}

/// Counts by priority from the wire (a priority named twice adds up).
fn priority_counts(counts: &[router_pb::PriorityCount]) -> BTreeMap<i32, u32> {
    let mut out = BTreeMap::new();
    for c in counts {
        let n: &mut u32 = out.entry(c.priority).or_default();
        *n = n.saturating_add(c.count);
    }
    out
}

/// What this queue holds, on the wire.
pub(crate) fn held_report(held: &HeldByModel) -> router_pb::HeldReport {
    router_pb::HeldReport {
        models: held
            .iter()
            .map(|(model, by_priority)| router_pb::HeldModel {
                model: model.clone(),
                by_priority: by_priority
                    .iter()
                    .rev()
                    .map(|(&priority, &count)| router_pb::PriorityCount { priority, count })
                    .collect(),
            })
            .collect(),
    }
}

impl From<router_pb::LoadView> for LoadView {
    fn from(view: router_pb::LoadView) -> Self {
        let workers = view
            .workers
            .into_iter()
            .map(|w| {
                // UNSPECIFIED (or a role this build does not know) counts as
                // aggregated: the worker takes any request.
                let role = WorkerRole::from_pb(w.role).unwrap_or_else(|| {
                    tracing::debug!(
                        role = w.role,
                        "unspecified or unknown worker role; counting it as aggregated"
                    );
                    WorkerRole::Aggregated
                });
                WorkerLoad {
                    target: w.target.map(Target::from).unwrap_or_else(|| Target {
                        rank: WorkerRank::new("", 0),
                        endpoint: String::new(),
                    }),
                    model: w.model,
                    role,
                    active_prefill_tokens: w.active_prefill_tokens,
                    max_num_batched_tokens: w.max_num_batched_tokens,
                    max_num_seqs: w.max_num_seqs,
                    unplaced_requests: w.unplaced_requests,
                    priority_scheduling: w.priority_scheduling,
                    step_time_us: w.step_time_us,
                    others_by_priority: priority_counts(&w.others_by_priority),
                }
            })
            .collect();
        let held_elsewhere = view
            .held
            .iter()
            .map(|m| (m.model.clone(), priority_counts(&m.by_priority)))
            .collect();
        Self {
            workers,
            held_elsewhere,
        }
    }
}

pub(crate) fn stats_response(args: &Args, stats: QueueStats) -> pb::StatsResponse {
    let saturate = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    pb::StatsResponse {
        policy: args.queue_policy.to_pb() as i32,
        threshold: args.queue_threshold.unwrap_or(-1.0),
        max_pending: saturate(args.max_pending),
        max_pending_per_tenant: saturate(args.max_pending_per_tenant),
        shed_protect_priority: args.shed_protect_priority,
        pending: saturate(stats.pending),
        active: saturate(stats.active),
        tiers: stats
            .tiers
            .into_iter()
            .map(|t| pb::TierStats {
                strict_priority: t.strict_tier,
                priority: t.priority,
                pending: saturate(t.pending),
                pending_tokens: t.pending_tokens,
                oldest_wait_ms: t.oldest_wait.as_secs_f64() * 1000.0,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::common::v1 as common;
    use sluice_proto::worker::v1 as worker_pb;

    fn description() -> common::RequestDescription {
        common::RequestDescription {
            request_id: "r1".into(),
            model: "m".into(),
            priority: -2,
            strict_priority: 1,
            tenant: "t".into(),
            prompt_tokens: 40,
            block_hashes: vec![1, 2],
            block_size: 16,
            expected_output_tokens: 0,
            ttft_target_ms: 1500,
            tpot_target_ms: 40,
            exclude_worker_ids: vec!["w9".into()],
            tenant_weight: 2,
        }
    }

    fn open_with(description: common::RequestDescription) -> pb::AdmitOpen {
        pb::AdmitOpen {
            description: Some(description),
            deadline_ms: 1500,
        }
    }

    fn open() -> pb::AdmitOpen {
        open_with(description())
    }

    fn field_of(err: QueueError) -> &'static str {
        match err {
            QueueError::InvalidArgument { field, .. } => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn open_becomes_an_entry_with_deadline_from_receipt() {
        let now = Instant::now();
        let entry = entry_from_open(open(), now).expect("valid");
        assert_eq!(entry.desc.priority, -2);
        assert_eq!(entry.desc.strict_priority, 1);
        assert_eq!(entry.deadline, Some(now + Duration::from_millis(1500)));
        assert_eq!(&*entry.desc.block_hashes, &[1, 2]);
        assert_eq!(&*entry.desc.exclude_worker_ids, ["w9".to_string()]);
        assert_eq!(
            (entry.desc.tenant.as_str(), entry.desc.tenant_weight),
            ("t", 2)
        );
        let anonymous = entry_from_open(
            open_with(common::RequestDescription {
                tenant: String::new(),
                ..description()
            }),
            now,
        )
        .expect("valid");
        assert_eq!(anonymous.desc.tenant, "default");
        let no_deadline = entry_from_open(
            pb::AdmitOpen {
                deadline_ms: 0,
                ..open()
            },
            now,
        )
        .expect("valid");
        assert_eq!(no_deadline.deadline, None);
    }

    #[tokio::test(start_paused = true)]
    async fn malformed_open_names_the_field() {
        let now = Instant::now();
        let cases = [
            (
                common::RequestDescription {
                    request_id: String::new(),
                    ..description()
                },
                "open.description.request_id",
            ),
            (
                common::RequestDescription {
                    prompt_tokens: 20,
                    ..description()
                },
                "open.description.block_hashes",
            ),
            (
                common::RequestDescription {
                    block_size: 0,
                    ..description()
                },
                "open.description.block_size",
            ),
            (
                common::RequestDescription {
                    block_hashes: vec![1, 2, 3],
                    ..description()
                },
                "open.description.block_hashes",
            ),
            (
                common::RequestDescription {
                    priority: 5000,
                    ..description()
                },
                "open.description.priority",
            ),
        ];
        for (bad, field) in cases {
            let err = entry_from_open(open_with(bad), now).expect_err(field);
            assert_eq!(field_of(err), field);
        }
        let missing = pb::AdmitOpen {
            description: None,
            deadline_ms: 0,
        };
        let err = entry_from_open(missing, now).expect_err("no description");
        assert_eq!(field_of(err), "open.description.request_id");
    }

    #[test]
    fn load_view_roles_and_targets_convert() {
        let view = LoadView::from(router_pb::LoadView {
            workers: vec![router_pb::WorkerLoad {
                target: Some(router_pb::Target {
                    worker_id: "p0".into(),
                    dp_rank: 1,
                    endpoint: "10.0.0.1:5".into(),
                }),
                model: "m".into(),
                role: worker_pb::WorkerRole::Prefill as i32,
                active_prefill_tokens: 7,
                max_num_batched_tokens: 2048,
                others_by_priority: vec![
                    router_pb::PriorityCount {
                        priority: 3,
                        count: 1,
                    },
                    router_pb::PriorityCount {
                        priority: 3,
                        count: 2,
                    },
                ],
                ..Default::default()
            }],
            held: vec![router_pb::HeldModel {
                model: "m".into(),
                by_priority: vec![router_pb::PriorityCount {
                    priority: -1,
                    count: 4,
                }],
            }],
        });
        assert_eq!(view.workers[0].others_by_priority, BTreeMap::from([(3, 3)]));
        assert_eq!(view.held_elsewhere["m"], BTreeMap::from([(-1, 4)]));
        let w = &view.workers[0];
        assert_eq!(w.role, WorkerRole::Prefill);
        let unspecified = LoadView::from(router_pb::LoadView {
            workers: vec![router_pb::WorkerLoad::default()],
            held: Vec::new(),
        });
        assert_eq!(unspecified.workers[0].role, WorkerRole::Aggregated);
        assert_eq!(w.target.rank.dp_rank, 1);
        assert_eq!(w.active_prefill_tokens, 7);
    }
}
