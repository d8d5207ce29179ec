//! The queue's error enum and the one place it becomes a `tonic::Status`.
//!
//! Errors are classified where they happen (the admission checks, the
//! dispatcher, the placer) and rendered here: full or shed → `RESOURCE_EXHAUSTED`,
//! deadline → `DEADLINE_EXCEEDED`, no worker / placement failure / draining →
//! `UNAVAILABLE`, malformed open → `INVALID_ARGUMENT`.

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use sluice_proto::REASON_HEADER;
use sluice_proto::queue::v1::QueueReason;

/// Why a request was not admitted or not granted.
///
/// `Clone` because a failure travels to the request's ticket through a watch
/// channel; sources are kept behind an `Arc` for that reason.
#[derive(Debug, Clone, thiserror::Error)]
pub enum QueueError {
    /// Every pending slot of the queue is taken.
    #[error("queue full: {pending} requests pending, limit {limit} (--max-pending); retry after {} s", retry_after.as_secs())]
    QueueFull {
        /// Requests pending when this one arrived.
        pending: usize,
        /// The global limit.
        limit: usize,
        /// When the backlog will have drained enough, at the rate it drains.
        retry_after: Duration,
    },
    /// The tenant has as many requests pending as it may.
    #[error(
        "tenant {tenant:?} has {pending} requests pending, limit {limit} (--max-pending-per-tenant); retry after {} s", retry_after.as_secs()
    )]
    TenantFull {
        /// The tenant ("" is the default tenant).
        tenant: String,
        /// The tenant's pending requests.
        pending: usize,
        /// The per-tenant limit.
        limit: usize,
        /// When the backlog will have drained enough, at the rate it drains.
        retry_after: Duration,
    },
    /// The tenant is over one of its quotas (`--tenant-limits`).
    #[error("tenant {tenant:?} is over {quota}; retry after {} s", retry_after.as_secs())]
    QuotaExceeded {
        /// The tenant.
        tenant: String,
        /// The limit it is over.
        quota: Quota,
        /// When this replica's share allows a request again.
        retry_after: Duration,
    },
    /// The wait predicted for the request (from the work ahead of it in
    /// release order and the workers' drain rate) exceeds its TTFT target.
    #[error(
        "predicted queue wait {} ms exceeds the request's TTFT target of {} ms (nvext.agent_hints.ttft_target_ms, or the queue's --ttft-target-secs / --ttft-targets for its priority); retry after {} s",
        predicted.as_millis(), target.as_millis(), retry_after.as_secs()
    )]
    TargetUnmeetable {
        /// The predicted wait.
        predicted: Duration,
        /// The request's TTFT target.
        target: Duration,
        /// When the backlog ahead will have drained enough.
        retry_after: Duration,
    },
    /// The request was still held when its TTFT target passed: it leaves
    /// before any token instead of being served late.
    #[error(
        "held {} ms, past the request's TTFT target of {} ms; retry after {} s",
        waited.as_millis(), target.as_millis(), retry_after.as_secs()
    )]
    TargetMissed {
        /// How long it was held.
        waited: Duration,
        /// The request's TTFT target.
        target: Duration,
        /// When the backlog ahead will have drained enough.
        retry_after: Duration,
    },
    /// A low-priority request found only the share reserved for protected
    /// priorities left.
    #[error(
        "queue full for priority {priority}: {pending} requests pending, and the last {reserved} of {limit} slots are reserved for priority above {protect}; retry after {} s", retry_after.as_secs()
    )]
    Shed {
        /// When the backlog will have drained enough, at the rate it drains.
        retry_after: Duration,
        /// The request's priority.
        priority: i32,
        /// Requests pending when this one arrived.
        pending: usize,
        /// Slots reserved for priorities above `protect`.
        reserved: usize,
        /// The global limit.
        limit: usize,
        /// `--shed-protect-priority`.
        protect: i32,
    },
    /// A held request gave its place in a full queue to a request of
    /// higher priority.
    #[error(
        "displaced from the full queue by a priority {by} request (this one has priority {priority}); retry after {} s", retry_after.as_secs()
    )]
    Displaced {
        /// This request's priority.
        priority: i32,
        /// The priority of the request that took its place.
        by: i32,
        /// When the backlog will have drained enough, at the rate it drains.
        retry_after: Duration,
    },
    /// The request's deadline passed while it was held.
    #[error("deadline passed after {} ms in the queue", waited.as_millis())]
    DeadlineExceeded {
        /// How long it waited.
        waited: Duration,
    },
    /// No worker serves the model.
    #[error("no worker available for model {model:?}")]
    NoWorkers {
        /// The requested model.
        model: String,
    },
    /// The placement service (the router) failed.
    #[error("placement failed")]
    Placement {
        /// What the router client reported.
        #[source]
        source: Arc<dyn StdError + Send + Sync + 'static>,
    },
    /// The queue is shutting down and admits nothing more.
    #[error("queue is shutting down")]
    Draining,
    /// A flag's value cannot work.
    #[error("{flag}: {reason}")]
    InvalidFlag {
        /// The flag, with its dashes.
        flag: &'static str,
        /// Why, and what would be accepted.
        reason: String,
    },
    /// No router instance is known (none registered, or none reachable).
    #[error("no router available for placement")]
    NoRouter,
    /// Server, discovery or telemetry plumbing failed.
    #[error("service runtime")]
    Runtime(#[source] Arc<sluice_runtime::RuntimeError>),
    /// Metrics could not be registered.
    #[error("metrics registration")]
    Metrics(#[source] Arc<prometheus::Error>),
    /// The client's open message is malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The offending field, as named on the wire.
        field: &'static str,
        /// What to fix.
        reason: String,
    },
}

/// Which of a tenant's quotas refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quota {
    /// Tokens per minute.
    Tokens {
        /// The tenant's limit.
        per_minute: u64,
        /// This replica's share of it.
        share: u64,
        /// Queue replicas sharing it.
        replicas: u32,
    },
    /// Requests pending or running at once.
    Requests {
        /// The tenant's limit.
        limit: u32,
        /// This replica's share of it.
        share: u32,
        /// Queue replicas sharing it.
        replicas: u32,
    },
}

impl Quota {
    /// The wire name (`sluice-quota` metadata) and OpenAI error type.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Tokens { .. } => "tokens",
            Self::Requests { .. } => "requests",
        }
    }
}

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (share, replicas) = match self {
            Self::Tokens {
                per_minute,
                share,
                replicas,
            } => {
                write!(f, "its limit of {per_minute} tokens per minute")?;
                (*share, *replicas)
            }
            Self::Requests {
                limit,
                share,
                replicas,
            } => {
                write!(f, "its limit of {limit} concurrent requests")?;
                (u64::from(*share), *replicas)
            }
        };
        if replicas > 1 {
            write!(
                f,
                " (this queue replica enforces its share {share} of {replicas} replicas)"
            )?;
        }
        Ok(())
    }
}

impl QueueError {
    /// Why, as the wire names it (`sluice-reason`, the metrics' label).
    pub fn reason(&self) -> QueueReason {
        match self {
            Self::QueueFull { .. } => QueueReason::QueueFull,
            Self::TenantFull { .. } => QueueReason::TenantFull,
            Self::QuotaExceeded {
                quota: Quota::Tokens { .. },
                ..
            } => QueueReason::QuotaTokens,
            Self::QuotaExceeded {
                quota: Quota::Requests { .. },
                ..
            } => QueueReason::QuotaRequests,
            Self::Shed { .. } => QueueReason::Shed,
            Self::TargetUnmeetable { .. } => QueueReason::TtftTargetUnmeetable,
            Self::TargetMissed { .. } => QueueReason::TtftTargetMissed,
            Self::Displaced { .. } => QueueReason::Displaced,
            Self::DeadlineExceeded { .. } => QueueReason::Deadline,
            Self::NoWorkers { .. } => QueueReason::NoWorkers,
            Self::Placement { .. } => QueueReason::Placement,
            Self::Draining => QueueReason::Draining,
            Self::InvalidArgument { .. } => QueueReason::InvalidArgument,
            Self::InvalidFlag { .. } => QueueReason::InvalidFlag,
            Self::NoRouter => QueueReason::NoRouter,
            Self::Runtime(_) | Self::Metrics(_) => QueueReason::Internal,
        }
    }

    /// A placement failure wrapping any error.
    pub fn placement(source: impl StdError + Send + Sync + 'static) -> Self {
        Self::Placement {
            source: Arc::new(source),
        }
    }
}

impl From<QueueError> for tonic::Status {
    fn from(err: QueueError) -> Self {
        // The reason on every answer, so a caller can tell the queue's
        // answers from a transport failure (and fail over to another queue
        // only for the latter, or for the reasons that allow it).
        let reason = err.reason();
        let mut status = status_of(err);
        status.metadata_mut().insert(
            REASON_HEADER,
            tonic::metadata::MetadataValue::from_static(reason.label()),
        );
        status
    }
}

fn status_of(err: QueueError) -> tonic::Status {
    use tonic::Status;
    match &err {
        QueueError::QueueFull { retry_after, .. }
        | QueueError::TenantFull { retry_after, .. }
        | QueueError::Shed { retry_after, .. }
        | QueueError::TargetUnmeetable { retry_after, .. }
        | QueueError::TargetMissed { retry_after, .. }
        | QueueError::Displaced { retry_after, .. } => {
            err.reason().refusal(err.to_string(), retry_after.as_secs())
        }
        QueueError::QuotaExceeded {
            quota, retry_after, ..
        } => {
            let mut status = Status::resource_exhausted(err.to_string());
            let secs = retry_after.as_secs().max(1);
            let meta = status.metadata_mut();
            meta.insert("retry-after", tonic::metadata::MetadataValue::from(secs));
            meta.insert(
                "sluice-quota",
                tonic::metadata::MetadataValue::from_static(quota.kind()),
            );
            status
        }
        QueueError::DeadlineExceeded { .. } => Status::deadline_exceeded(err.to_string()),
        QueueError::NoWorkers { .. } | QueueError::NoRouter | QueueError::Draining => {
            Status::unavailable(err.to_string())
        }
        QueueError::Placement { source } => {
            tracing::warn!(error = %source, "placement failed");
            Status::unavailable(format!("placement failed: {source}"))
        }
        QueueError::InvalidArgument { .. } => Status::invalid_argument(err.to_string()),
        QueueError::InvalidFlag { .. } | QueueError::Runtime(_) | QueueError::Metrics(_) => {
            tracing::error!(error = %err, cause = ?std::error::Error::source(&err), "internal error");
            Status::internal("internal error in the queue")
        }
    }
}

impl From<sluice_runtime::RuntimeError> for QueueError {
    fn from(err: sluice_runtime::RuntimeError) -> Self {
        Self::Runtime(Arc::new(err))
    }
}

impl From<prometheus::Error> for QueueError {
    fn from(err: prometheus::Error) -> Self {
        Self::Metrics(Arc::new(err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn full_and_shed_map_to_resource_exhausted() {
        let full = QueueError::QueueFull {
            pending: 4,
            limit: 4,
            retry_after: Duration::from_secs(3),
        };
        let shed = QueueError::Shed {
            retry_after: Duration::from_secs(3),
            priority: 0,
            pending: 3,
            reserved: 1,
            limit: 4,
            protect: 0,
        };
        let tenant = QueueError::TenantFull {
            tenant: "a".into(),
            pending: 1,
            limit: 1,
            retry_after: Duration::from_secs(3),
        };
        let displaced = QueueError::Displaced {
            priority: 0,
            by: 3,
            retry_after: Duration::from_secs(3),
        };
        let unmeetable = QueueError::TargetUnmeetable {
            predicted: Duration::from_secs(9),
            target: Duration::from_secs(6),
            retry_after: Duration::from_secs(3),
        };
        let missed = QueueError::TargetMissed {
            waited: Duration::from_secs(6),
            target: Duration::from_secs(6),
            retry_after: Duration::from_secs(3),
        };
        for err in [full, shed, tenant, displaced, unmeetable, missed] {
            let status = tonic::Status::from(err);
            assert_eq!(status.code(), Code::ResourceExhausted);
            let retry = status
                .metadata()
                .get("retry-after")
                .and_then(|v| v.to_str().ok());
            assert_eq!(retry, Some("3"), "{status:?}");
        }
    }

    #[test]
    fn a_quota_refusal_carries_retry_after_and_the_quota_in_metadata() {
        let err = QueueError::QuotaExceeded {
            tenant: "acme".into(),
            quota: Quota::Tokens {
                per_minute: 1200,
                share: 600,
                replicas: 2,
            },
            retry_after: Duration::from_secs(7),
        };
        assert_eq!(err.reason(), QueueReason::QuotaTokens);
        let status = tonic::Status::from(err);
        assert_eq!(status.code(), Code::ResourceExhausted);
        let meta = |k| status.metadata().get(k).and_then(|v| v.to_str().ok());
        assert_eq!(meta("retry-after"), Some("7"));
        assert_eq!(meta("sluice-quota"), Some("tokens"));
        assert!(
            status
                .message()
                .contains("\"acme\" is over its limit of 1200 tokens per minute (this queue replica enforces its share 600 of 2 replicas); retry after 7 s"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn deadline_invalid_and_unavailable_codes() {
        let status = tonic::Status::from(QueueError::DeadlineExceeded {
            waited: Duration::from_millis(5),
        });
        assert_eq!(status.code(), Code::DeadlineExceeded);
        let status = tonic::Status::from(QueueError::InvalidArgument {
            field: "open.description.request_id",
            reason: "must not be empty".into(),
        });
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("open.description.request_id"));
        let status = tonic::Status::from(QueueError::NoWorkers { model: "m".into() });
        assert_eq!(status.code(), Code::Unavailable);
        let status = tonic::Status::from(QueueError::Draining);
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            status
                .metadata()
                .get(REASON_HEADER)
                .and_then(|v| v.to_str().ok()),
            Some("draining")
        );
    }
}
