//! Generations on `Worker.GenerateSession` sessions (see
//! [`crate::session`]): one long-lived stream from this frontend to each
//! worker carries every generation it runs there. A generation reads like a
//! `Generate` stream: the worker's messages, the last one finishing it, or
//! an error; dropping it unfinished aborts the sequence on the worker. A
//! session that ends (the worker died, its connection broke, it drained)
//! fails every generation still on it: a worker failure, so the request
//! moves.

use futures::FutureExt;
use sluice_proto::worker::v1 as wpb;
use sluice_runtime::Shutdown;
use sluice_runtime::grpc::TracedChannel;
use tokio_util::task::TaskTracker;

use sluice_runtime::session::{Member, Protocol, Sessions};

/// A worker's message to a generation, or the error that ends it (boxed:
/// the channel's slots stay small).
type Event = Result<wpb::GenerateResponse, Box<tonic::Status>>;

/// `Worker.GenerateSession`.
#[derive(Debug)]
pub(crate) struct Generations;

impl Protocol for Generations {
    type Out = wpb::GenerateSessionRequest;
    type In = wpb::GenerateSessionResponse;
    type Event = Event;
    const PEER: &'static str = "worker";
    const METHOD: &'static str = "Worker.GenerateSession";
    const MEMBER: &'static str = "generation";

    fn call(
        channel: TracedChannel,
        outbound: tokio_stream::wrappers::ReceiverStream<Self::Out>,
    ) -> futures::future::BoxFuture<'static, Result<tonic::Streaming<Self::In>, tonic::Status>>
    {
        async move {
            let mut client = wpb::worker_client::WorkerClient::new(channel);
            Ok(client.generate_session(outbound).await?.into_inner())
        }
        .boxed()
    }

    fn event(answer: wpb::GenerateSessionResponse) -> Option<(u64, Event, bool)> {
        use wpb::generate_session_response::Msg;
        let event = match answer.msg? {
            Msg::Response(r) => Ok(r),
            Msg::Error(e) => Err(Box::new(e.into_status())),
        };
        let last = Self::ends(&event);
        Some((answer.id, event, last))
    }

    fn failure(status: tonic::Status) -> Event {
        Err(Box::new(status))
    }

    /// The message that finishes the sequence, or an error, is its last.
    fn ends(event: &Event) -> bool {
        event.as_ref().is_ok_and(|r| r.finishes()) || event.is_err()
    }

    fn cancel(id: u64) -> Option<wpb::GenerateSessionRequest> {
        Some(wpb::GenerateSessionRequest {
            id,
            request: None,
            traceparent: String::new(),
        })
    }
}

/// Every worker's generation session, by endpoint.
#[derive(Debug)]
pub(crate) struct GenerateSessions(Sessions<Generations>);

/// One generation on a worker. Dropping it before its last message aborts
/// the sequence on the worker.
#[derive(Debug)]
pub(crate) struct WorkerStream {
    member: Member<Generations>,
    /// A message taken early (see [`WorkerStream::first`]).
    peeked: Option<wpb::GenerateResponse>,
}

impl GenerateSessions {
    /// No sessions yet; each runs on `tasks` until `stop`.
    pub(crate) fn new(tasks: TaskTracker, stop: Shutdown) -> Self {
        Self(Sessions::new(tasks, stop))
    }

    /// Starts `request` on the session to `endpoint` (opening the session
    /// on `channel` if there is none). The caller's span is its trace
    /// parent.
    pub(crate) fn start(
        &self,
        endpoint: &str,
        channel: TracedChannel,
        request: wpb::GenerateRequest,
    ) -> WorkerStream {
        let member = self
            .0
            .join(endpoint, channel, |id| wpb::GenerateSessionRequest {
                id,
                request: Some(request),
                traceparent: sluice_runtime::telemetry::traceparent(),
            });
        WorkerStream {
            member,
            peeked: None,
        }
    }
}

impl WorkerStream {
    /// Waits for the worker's first message and keeps it for
    /// [`Self::message`]: a request the worker refuses, or cannot take,
    /// fails here.
    pub(crate) async fn first(&mut self) -> Result<(), tonic::Status> {
        if self.peeked.is_none()
            && let Some(m) = self.message().await?
        {
            self.peeked = Some(m);
        }
        Ok(())
    }

    /// The worker's next message; `None` after the last one.
    pub(crate) async fn message(&mut self) -> Result<Option<wpb::GenerateResponse>, tonic::Status> {
        if let Some(m) = self.peeked.take() {
            return Ok(Some(m));
        }
        match self.member.next().await {
            Some(Ok(m)) => Ok(Some(m)),
            Some(Err(status)) => Err(*status),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic::Code;

    use super::*;
    use sluice_runtime::session::{closed, ended_status};

    #[test]
    fn a_worker_without_sessions_is_a_worker_that_cannot_serve() {
        let status = ended_status::<Generations>(tonic::Status::unimplemented("unknown method"));
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("Worker.GenerateSession"),
            "{status:?}"
        );
        let other = ended_status::<Generations>(tonic::Status::cancelled("reset"));
        assert_eq!(other.code(), Code::Cancelled);
    }

    #[tokio::test]
    async fn generations_on_a_session_that_cannot_open_fail_and_the_next_tries_again() {
        // Nothing listens on port 1.
        let endpoint = "127.0.0.1:1";
        let sessions = GenerateSessions::new(TaskTracker::new(), Shutdown::new());
        for _ in 0..2 {
            let channel = sluice_runtime::grpc::channel(endpoint).expect("channel");
            let mut stream = sessions.start(endpoint, channel, wpb::GenerateRequest::default());
            let answer = tokio::time::timeout(Duration::from_secs(10), stream.first())
                .await
                .expect("an answer in time");
            let status = answer.expect_err("nothing listens there");
            // The connection's own failure, a worker failure: the request
            // is placed again.
            assert_ne!(
                status.message(),
                closed::<Generations>().message(),
                "{status:?}"
            );
            assert!(stream.member.ended(), "a failed generation sends no abort");
        }
        assert_eq!(sessions.0.count(), 1, "ended sessions are dropped");
    }
}
