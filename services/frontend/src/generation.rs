//! Generations on `Worker.GenerateSession` sessions: one long-lived stream
//! from this frontend to each worker carries every generation it runs
//! there, so a request costs the worker hop a few small messages instead of
//! an HTTP/2 stream of its own (headers, trailers, a server task and codec
//! buffers at both ends). A generation reads like a `Generate` stream: the
//! worker's messages, the last one finishing it, or an error; dropping it
//! unfinished aborts the sequence on the worker.
//!
//! The session opens with its first generation (the request is already
//! queued when the call starts, so it pays no extra round trip). A session
//! that ends — the worker died, its connection broke, it drained — fails
//! every generation still on it with the status it ended in (a worker
//! failure: the request moves), and the next generation opens a new one.
//!
//! Each generation's messages wait in an unbounded channel until its
//! reader takes them: one slow HTTP client must not hold up the others on
//! the session. What waits is bounded by the request's `max_tokens`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use sluice_proto::worker::v1 as wpb;
use sluice_runtime::grpc::TracedChannel;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

type Item = Result<wpb::GenerateResponse, Box<tonic::Status>>;

/// Every worker's session, by endpoint.
#[derive(Debug, Default)]
pub(crate) struct GenerateSessions {
    sessions: Mutex<HashMap<String, Arc<Session>>>,
}

#[derive(Debug)]
struct Session {
    tx: mpsc::UnboundedSender<wpb::GenerateSessionRequest>,
    state: Mutex<SessionState>,
    next_id: AtomicU64,
}

#[derive(Debug, Default)]
struct SessionState {
    /// Generations not over yet, by id.
    live: HashMap<u64, mpsc::UnboundedSender<Item>>,
    /// The session ended; new generations need a new one.
    closed: bool,
}

/// One generation on a worker. Dropping it before its last message aborts
/// the sequence on the worker.
#[derive(Debug)]
pub(crate) struct WorkerStream {
    session: Arc<Session>,
    id: u64,
    messages: mpsc::UnboundedReceiver<Item>,
    /// A message taken early (see [`WorkerStream::first`]).
    peeked: Option<wpb::GenerateResponse>,
    /// Its last message (or error) has arrived: nothing to abort.
    ended: bool,
}

impl GenerateSessions {
    /// Starts `request` on the session to `endpoint` (opening the session
    /// on `channel` if there is none). The caller's span is its trace
    /// parent.
    pub(crate) fn start(
        &self,
        endpoint: &str,
        channel: TracedChannel,
        request: wpb::GenerateRequest,
    ) -> WorkerStream {
        let session = {
            let mut sessions = self.sessions.lock();
            match sessions.get(endpoint) {
                Some(s) if !s.state.lock().closed => Arc::clone(s),
                _ => {
                    // Sessions that ended stay only until the next one opens
                    // (workers come and go under new endpoints).
                    sessions.retain(|_, s| !s.state.lock().closed);
                    let (tx, rx) = mpsc::unbounded_channel();
                    let s = Arc::new(Session {
                        tx,
                        state: Mutex::new(SessionState::default()),
                        next_id: AtomicU64::new(1),
                    });
                    sessions.insert(endpoint.to_owned(), Arc::clone(&s));
                    // The generation below is queued before the call starts.
                    tokio::spawn(run(
                        Arc::clone(&s),
                        wpb::worker_client::WorkerClient::new(channel),
                        rx,
                    ));
                    s
                }
            }
        };
        let id = session.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, messages) = mpsc::unbounded_channel();
        let mut stream = WorkerStream {
            session: Arc::clone(&session),
            id,
            messages,
            peeked: None,
            ended: false,
        };
        {
            let mut state = session.state.lock();
            if state.closed {
                stream.ended = true;
                let _ = tx.send(Err(Box::new(session_closed())));
                return stream;
            }
            state.live.insert(id, tx);
        }
        let _ = session.tx.send(wpb::GenerateSessionRequest {
            id,
            request: Some(request),
            traceparent: sluice_runtime::telemetry::traceparent(),
        });
        stream
    }
}

fn session_closed() -> tonic::Status {
    tonic::Status::unavailable("the worker ended the generation session")
}

impl Session {
    /// Hands a message to its generation; a finishing one or an error is
    /// its last.
    fn dispatch(&self, answer: wpb::GenerateSessionResponse) {
        use wpb::generate_session_response::Msg;
        let (item, last) = match answer.msg {
            Some(Msg::Response(r)) => {
                let last = r.finish_reason != 0;
                (Ok(r), last)
            }
            Some(Msg::Error(e)) => (Err(Box::new(e.into_status())), true),
            None => return,
        };
        let mut state = self.state.lock();
        if let Some(tx) = state.live.get(&answer.id) {
            let _ = tx.send(item);
        }
        if last {
            state.live.remove(&answer.id);
        }
    }

    /// The session is over: every generation still on it fails with `status`.
    fn close(&self, status: &tonic::Status) {
        let live = {
            let mut state = self.state.lock();
            state.closed = true;
            std::mem::take(&mut state.live)
        };
        for tx in live.into_values() {
            let _ = tx.send(Err(Box::new(status.clone())));
        }
    }
}

/// Runs one session: opens the call with what is queued, then hands each
/// message to its generation until the stream ends.
async fn run(
    session: Arc<Session>,
    mut client: wpb::worker_client::WorkerClient<TracedChannel>,
    rx: mpsc::UnboundedReceiver<wpb::GenerateSessionRequest>,
) {
    let ended = match client
        .generate_session(UnboundedReceiverStream::new(rx))
        .await
    {
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
    tracing::debug!(code = ?ended.code(), message = ended.message(), "generation session ended");
    session.close(&ended_status(ended));
}

/// What the generations of a session that ended with `status` fail with. A
/// worker of an older release, without `GenerateSession`, is a worker that
/// cannot serve (another may): said so, rather than as an unknown method.
fn ended_status(status: tonic::Status) -> tonic::Status {
    if status.code() == tonic::Code::Unimplemented {
        return tonic::Status::unavailable(format!(
            "the worker does not serve Worker.GenerateSession (an older release?): {}",
            status.message()
        ));
    }
    status
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
        match self.messages.recv().await {
            Some(Ok(m)) => {
                if m.finish_reason != 0 {
                    self.ended = true;
                }
                Ok(Some(m))
            }
            Some(Err(status)) => {
                self.ended = true;
                Err(*status)
            }
            None => Ok(None),
        }
    }
}

impl Drop for WorkerStream {
    fn drop(&mut self) {
        self.session.state.lock().live.remove(&self.id);
        if !self.ended {
            let _ = self.session.tx.send(wpb::GenerateSessionRequest {
                id: self.id,
                request: None,
                traceparent: String::new(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic::Code;

    use super::*;

    #[test]
    fn a_worker_without_sessions_is_a_worker_that_cannot_serve() {
        let status = ended_status(tonic::Status::unimplemented("unknown method"));
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("Worker.GenerateSession"),
            "{status:?}"
        );
        let other = ended_status(tonic::Status::cancelled("reset"));
        assert_eq!(other.code(), Code::Cancelled);
    }

    #[tokio::test]
    async fn generations_on_a_session_that_cannot_open_fail_and_the_next_tries_again() {
        // Nothing listens on port 1.
        let endpoint = "127.0.0.1:1";
        let sessions = GenerateSessions::default();
        for _ in 0..2 {
            let channel = sluice_runtime::grpc::channel(endpoint).expect("channel");
            let mut stream = sessions.start(endpoint, channel, wpb::GenerateRequest::default());
            let answer = tokio::time::timeout(Duration::from_secs(10), stream.first())
                .await
                .expect("an answer in time");
            let status = answer.expect_err("nothing listens there");
            // The connection's own failure, a worker failure: the request
            // is placed again.
            assert_ne!(status.message(), session_closed().message(), "{status:?}");
            assert!(stream.ended, "a failed generation sends no abort");
        }
        assert_eq!(
            sessions.sessions.lock().len(),
            1,
            "ended sessions are dropped"
        );
    }
}
