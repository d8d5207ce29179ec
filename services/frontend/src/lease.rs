//! Admission leases on `Queue.Leases` sessions (see [`crate::session`]):
//! one long-lived stream from this frontend to each queue carries every
//! lease it holds there. A lease behaves as on `Queue.Admit`: `open`, held
//! updates, then a grant or an error; `started`, `progress` and `done`
//! after the grant; dropping it without `done` cancels it. A session that
//! ends fails every lease still waiting for an answer (another queue
//! admits it).

use futures::FutureExt;
use sluice_proto::queue::v1 as qpb;
use sluice_runtime::Shutdown;
use sluice_runtime::grpc::TracedChannel;
use tokio_util::task::TaskTracker;

use sluice_runtime::session::{Member, Protocol, Sessions};

/// What a lease hears from its queue before and at the grant. Boxed, so a
/// lease's channel costs a few hundred bytes rather than a block of 32
/// whole grants.
#[derive(Debug)]
pub(crate) enum LeaseEvent {
    /// The queue has the request (no other answer was ready at once).
    Opened,
    Held(Box<qpb::Held>),
    Grant(Box<qpb::Grant>),
    /// The lease is over: the queue's error (with its metadata), or the
    /// session's end.
    Failed(Box<tonic::Status>),
}

/// `Queue.Leases`.
#[derive(Debug)]
pub(crate) struct Leases;

impl Protocol for Leases {
    type Out = qpb::LeaseRequest;
    type In = qpb::LeaseResponse;
    type Event = LeaseEvent;
    const PEER: &'static str = "queue";
    const METHOD: &'static str = "Queue.Leases";
    const MEMBER: &'static str = "lease";

    fn call(
        channel: TracedChannel,
        outbound: tokio_stream::wrappers::ReceiverStream<Self::Out>,
    ) -> futures::future::BoxFuture<'static, Result<tonic::Streaming<Self::In>, tonic::Status>>
    {
        async move {
            let mut client = qpb::queue_client::QueueClient::new(channel);
            Ok(client.leases(outbound).await?.into_inner())
        }
        .boxed()
    }

    /// A grant or an error is the queue's last answer to a lease.
    fn event(answer: qpb::LeaseResponse) -> Option<(u64, LeaseEvent, bool)> {
        use qpb::lease_response::Msg;
        let event = match answer.msg? {
            Msg::Opened(_) => LeaseEvent::Opened,
            Msg::Held(h) => LeaseEvent::Held(Box::new(h)),
            Msg::Grant(g) => LeaseEvent::Grant(Box::new(g)),
            Msg::Error(e) => LeaseEvent::Failed(Box::new(e.into_status())),
        };
        let last = matches!(event, LeaseEvent::Grant(_) | LeaseEvent::Failed(_));
        Some((answer.lease_id, event, last))
    }

    fn failure(status: tonic::Status) -> LeaseEvent {
        LeaseEvent::Failed(Box::new(status))
    }

    /// A granted lease lives on until `done` (or its drop cancels it).
    fn ends(event: &LeaseEvent) -> bool {
        matches!(event, LeaseEvent::Failed(_))
    }

    fn cancel(id: u64) -> Option<qpb::LeaseRequest> {
        Some(lease_message(id, None))
    }
}

fn lease_message(id: u64, msg: Option<qpb::admit_request::Msg>) -> qpb::LeaseRequest {
    qpb::LeaseRequest {
        lease_id: id,
        request: msg.map(|msg| qpb::AdmitRequest { msg: Some(msg) }),
        traceparent: String::new(),
    }
}

/// Every queue's lease session, by endpoint.
#[derive(Debug)]
pub(crate) struct LeaseSessions(Sessions<Leases>);

/// One admission lease. Dropping it without [`QueueLease::done`] cancels it
/// (releases the slot, or takes a held request out of the queue).
#[derive(Debug)]
pub(crate) struct QueueLease(Member<Leases>);

impl LeaseSessions {
    /// No sessions yet; each runs on `tasks` until `stop`.
    pub(crate) fn new(tasks: TaskTracker, stop: Shutdown) -> Self {
        Self(Sessions::new(tasks, stop))
    }

    /// Opens a lease for `open` on the session to `endpoint` (opening the
    /// session on `channel` if there is none). Its events say what the
    /// queue made of it; the caller's span is its trace parent.
    pub(crate) fn open(
        &self,
        endpoint: &str,
        channel: TracedChannel,
        open: qpb::AdmitOpen,
    ) -> QueueLease {
        QueueLease(self.0.join(endpoint, channel, |id| qpb::LeaseRequest {
            traceparent: sluice_runtime::telemetry::traceparent(),
            ..lease_message(id, Some(qpb::admit_request::Msg::Open(open)))
        }))
    }
}

impl QueueLease {
    /// The queue's next answer before the grant; `None` once there is no
    /// more (after the grant, or the lease failed).
    pub(crate) async fn next(&mut self) -> Option<LeaseEvent> {
        self.0.next().await
    }

    /// After the grant: the request produced its first token.
    pub(crate) fn started(&self) {
        self.0.send(|id| {
            lease_message(
                id,
                Some(qpb::admit_request::Msg::Started(qpb::AdmitStarted {})),
            )
        });
    }

    /// After the grant: output tokens produced on this lease so far.
    pub(crate) fn progress(&self, completion_tokens: u32) {
        self.0.send(|id| {
            lease_message(
                id,
                Some(qpb::admit_request::Msg::Progress(qpb::AdmitProgress {
                    completion_tokens,
                })),
            )
        });
    }

    /// The request finished with `completion_tokens` output tokens on this
    /// lease: the queue releases it.
    pub(crate) fn done(mut self, completion_tokens: u32) {
        self.0.send(|id| {
            lease_message(
                id,
                Some(qpb::admit_request::Msg::Done(qpb::AdmitDone {
                    completion_tokens,
                })),
            )
        });
        self.0.end();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic::Code;

    use super::*;
    use sluice_runtime::session::{closed, ended_status};

    #[test]
    fn a_queue_without_leases_is_a_queue_that_cannot_admit() {
        let status = ended_status::<Leases>(tonic::Status::unimplemented("unknown method Leases"));
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().contains("Queue.Leases"), "{status:?}");
        let other = ended_status::<Leases>(tonic::Status::cancelled("reset"));
        assert_eq!(other.code(), Code::Cancelled);
    }

    #[tokio::test]
    async fn leases_on_a_session_that_cannot_open_fail_and_the_next_lease_tries_again() {
        // Nothing listens on port 1.
        let endpoint = "127.0.0.1:1";
        let sessions = LeaseSessions::new(TaskTracker::new(), Shutdown::new());
        for _ in 0..2 {
            let channel = sluice_runtime::grpc::channel(endpoint).expect("channel");
            let mut lease = sessions.open(endpoint, channel, qpb::AdmitOpen::default());
            let event = tokio::time::timeout(Duration::from_secs(10), lease.next())
                .await
                .expect("an answer in time");
            let Some(LeaseEvent::Failed(status)) = event else {
                panic!("expected a failure, got {event:?}");
            };
            // A transport failure, not a queue's answer: no sluice-reason,
            // so the frontend tries another queue.
            assert!(status.metadata().get(sluice_proto::REASON_HEADER).is_none());
            // Each lease met the connection's own failure: the second one
            // opened a new session rather than finding the dead one.
            assert_ne!(status.message(), closed::<Leases>().message(), "{status:?}");
            assert!(lease.0.ended(), "a failed lease sends no cancel");
        }
        assert_eq!(sessions.0.count(), 1, "ended sessions are dropped");
    }
}
