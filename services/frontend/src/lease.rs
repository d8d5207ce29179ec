//! Admission leases on `Queue.Leases` sessions: one long-lived stream from
//! this frontend to each queue carries every lease it holds there, so a
//! request costs the queue hop a few small messages instead of an HTTP/2
//! stream of its own (headers, trailers, a server task and codec buffers
//! at both ends). A lease behaves as on `Queue.Admit`: `open`, held
//! updates, then a grant or an error; `started`, `progress` and `done`
//! after the grant; dropping it without `done` cancels it.
//!
//! The session opens with its first lease (the `open` is already queued
//! when the call starts, so the first lease pays no extra round trip). A
//! session that ends — the queue restarted, its connection broke, it shut
//! down — fails every lease still waiting for an answer with the status it
//! ended in, and the next lease opens a new one.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use sluice_proto::queue::v1 as qpb;
use sluice_runtime::grpc::TracedChannel;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

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

/// Every queue's session, by endpoint.
#[derive(Debug, Default)]
pub(crate) struct LeaseSessions {
    sessions: Mutex<HashMap<String, Arc<Session>>>,
}

#[derive(Debug)]
struct Session {
    tx: mpsc::UnboundedSender<qpb::LeaseRequest>,
    state: Mutex<SessionState>,
    next_id: AtomicU64,
}

#[derive(Debug, Default)]
struct SessionState {
    /// Leases waiting for their grant (or error), by id.
    waiting: HashMap<u64, mpsc::UnboundedSender<LeaseEvent>>,
    /// The session ended; new leases need a new one.
    closed: bool,
}

/// One admission lease. Dropping it without [`QueueLease::done`] cancels it
/// (releases the slot, or takes a held request out of the queue).
#[derive(Debug)]
pub(crate) struct QueueLease {
    session: Arc<Session>,
    id: u64,
    events: mpsc::UnboundedReceiver<LeaseEvent>,
    /// The queue has no more to do with it: `done` sent, or it failed.
    ended: bool,
}

impl LeaseSessions {
    /// Opens a lease for `open` on the session to `endpoint` (opening the
    /// session on `channel` if there is none). Its events say what the
    /// queue made of it; the caller's span is its trace parent.
    pub(crate) fn open(
        &self,
        endpoint: &str,
        channel: TracedChannel,
        open: qpb::AdmitOpen,
    ) -> QueueLease {
        let session = {
            let mut sessions = self.sessions.lock();
            match sessions.get(endpoint) {
                Some(s) if !s.state.lock().closed => Arc::clone(s),
                _ => {
                    // Sessions that ended stay only until the next one opens
                    // (queues come and go under new endpoints).
                    sessions.retain(|_, s| !s.state.lock().closed);
                    let (tx, rx) = mpsc::unbounded_channel();
                    let s = Arc::new(Session {
                        tx,
                        state: Mutex::new(SessionState::default()),
                        next_id: AtomicU64::new(1),
                    });
                    sessions.insert(endpoint.to_owned(), Arc::clone(&s));
                    // The lease below is queued before the call starts.
                    tokio::spawn(run(
                        Arc::clone(&s),
                        qpb::queue_client::QueueClient::new(channel),
                        rx,
                    ));
                    s
                }
            }
        };
        let id = session.next_id.fetch_add(1, Ordering::Relaxed);
        let (events_tx, events) = mpsc::unbounded_channel();
        let mut lease = QueueLease {
            session: Arc::clone(&session),
            id,
            events,
            ended: false,
        };
        {
            let mut state = session.state.lock();
            if state.closed {
                lease.ended = true;
                let _ = events_tx.send(LeaseEvent::Failed(Box::new(session_closed())));
                return lease;
            }
            state.waiting.insert(id, events_tx);
        }
        let _ = session.tx.send(qpb::LeaseRequest {
            lease_id: id,
            request: Some(qpb::AdmitRequest {
                msg: Some(qpb::admit_request::Msg::Open(open)),
            }),
            traceparent: sluice_runtime::telemetry::traceparent(),
        });
        lease
    }
}

fn session_closed() -> tonic::Status {
    tonic::Status::unavailable("the queue ended the lease session")
}

impl Session {
    /// Hands an answer to its lease; a grant or an error is its last.
    fn dispatch(&self, answer: qpb::LeaseResponse) {
        use qpb::lease_response::Msg;
        let event = match answer.msg {
            Some(Msg::Opened(_)) => LeaseEvent::Opened,
            Some(Msg::Held(h)) => LeaseEvent::Held(Box::new(h)),
            Some(Msg::Grant(g)) => LeaseEvent::Grant(Box::new(g)),
            Some(Msg::Error(e)) => LeaseEvent::Failed(Box::new(e.into_status())),
            None => return,
        };
        let last = matches!(event, LeaseEvent::Grant(_) | LeaseEvent::Failed(_));
        let mut state = self.state.lock();
        if let Some(tx) = state.waiting.get(&answer.lease_id) {
            let _ = tx.send(event);
        }
        if last {
            state.waiting.remove(&answer.lease_id);
        }
    }

    /// The session is over: every lease still waiting fails with `status`.
    fn close(&self, status: &tonic::Status) {
        let waiting = {
            let mut state = self.state.lock();
            state.closed = true;
            std::mem::take(&mut state.waiting)
        };
        for tx in waiting.into_values() {
            let _ = tx.send(LeaseEvent::Failed(Box::new(status.clone())));
        }
    }

    fn send(&self, id: u64, request: Option<qpb::admit_request::Msg>) {
        let _ = self.tx.send(qpb::LeaseRequest {
            lease_id: id,
            request: request.map(|msg| qpb::AdmitRequest { msg: Some(msg) }),
            traceparent: String::new(),
        });
    }
}

/// Runs one session: opens the call with what is queued, then hands each
/// answer to its lease until the stream ends.
async fn run(
    session: Arc<Session>,
    mut client: qpb::queue_client::QueueClient<TracedChannel>,
    rx: mpsc::UnboundedReceiver<qpb::LeaseRequest>,
) {
    let ended = match client.leases(UnboundedReceiverStream::new(rx)).await {
        Ok(response) => {
            let mut answers = response.into_inner();
            loop {
                match answers.message().await {
                    Ok(Some(answer)) => session.dispatch(answer),
                    Ok(None) => break session_closed(),
                    Err(status) => break status,
                }
            }
        }
        Err(status) => status,
    };
    tracing::debug!(code = ?ended.code(), message = ended.message(), "lease session ended");
    session.close(&ended_status(ended));
}

/// What the leases of a session that ended with `status` fail with. A
/// queue of an older release, without `Leases`, is a queue that cannot
/// admit (another may): said so, rather than as an unknown method.
fn ended_status(status: tonic::Status) -> tonic::Status {
    if status.code() == tonic::Code::Unimplemented {
        return tonic::Status::unavailable(format!(
            "the queue does not serve Queue.Leases (an older release?): {}",
            status.message()
        ));
    }
    status
}

impl QueueLease {
    /// The queue's next answer before the grant; `None` once there is no
    /// more (after the grant, or the lease failed).
    pub(crate) async fn next(&mut self) -> Option<LeaseEvent> {
        let event = self.events.recv().await;
        if matches!(event, Some(LeaseEvent::Failed(_))) {
            self.ended = true;
        }
        event
    }

    /// After the grant: the request produced its first token.
    pub(crate) fn started(&self) {
        self.session.send(
            self.id,
            Some(qpb::admit_request::Msg::Started(qpb::AdmitStarted {})),
        );
    }

    /// After the grant: output tokens produced on this lease so far.
    pub(crate) fn progress(&self, completion_tokens: u32) {
        self.session.send(
            self.id,
            Some(qpb::admit_request::Msg::Progress(qpb::AdmitProgress {
                completion_tokens,
            })),
        );
    }

    /// The request finished with `completion_tokens` output tokens on this
    /// lease: the queue releases it.
    pub(crate) fn done(mut self, completion_tokens: u32) {
        self.session.send(
            self.id,
            Some(qpb::admit_request::Msg::Done(qpb::AdmitDone {
                completion_tokens,
            })),
        );
        self.ended = true;
    }
}

impl Drop for QueueLease {
    fn drop(&mut self) {
        self.session.state.lock().waiting.remove(&self.id);
        if !self.ended {
            self.session.send(self.id, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic::Code;

    use super::*;

    #[test]
    fn a_queue_without_leases_is_a_queue_that_cannot_admit() {
        let status = ended_status(tonic::Status::unimplemented("unknown method Leases"));
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().contains("Queue.Leases"), "{status:?}");
        let other = ended_status(tonic::Status::cancelled("reset"));
        assert_eq!(other.code(), Code::Cancelled);
    }

    #[tokio::test]
    async fn leases_on_a_session_that_cannot_open_fail_and_the_next_lease_tries_again() {
        // Nothing listens on port 1.
        let endpoint = "127.0.0.1:1";
        let sessions = LeaseSessions::default();
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
            assert!(status.metadata().get("sluice-reason").is_none());
            // Each lease met the connection's own failure: the second one
            // opened a new session rather than finding the dead one.
            assert_ne!(status.message(), session_closed().message(), "{status:?}");
            assert!(lease.ended, "a failed lease sends no cancel");
        }
        assert_eq!(
            sessions.sessions.lock().len(),
            1,
            "ended sessions are dropped"
        );
    }
}
