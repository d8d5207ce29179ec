//! Many requests on one long-lived stream per peer: the frontend's
//! admission leases on `Queue.Leases` (`crate::lease`) and its generations
//! on `Worker.GenerateSession` (`crate::worker_session`). Each request is a
//! [`Member`] of its peer's session, named by an id in every message, so a
//! request costs a hop a few small messages instead of an HTTP/2 stream of
//! its own (headers, trailers, a server task and codec buffers at both
//! ends). What differs between the two lives in their [`Protocol`].
//!
//! A session opens with its first member (that member's first message is
//! already queued when the call starts, so it pays no extra round trip). A
//! session that ends — the peer restarted, its connection broke, it shut
//! down — fails every member still waiting on it with the status it ended
//! in, and the next member opens a new one. A member dropped before its
//! end tells the peer (its id without a request).
//!
//! Each member's events wait in an unbounded channel until it takes them:
//! one slow member must not hold up the others on the session. What waits
//! is bounded by the request (a lease's few answers, a generation's
//! `max_tokens`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use sluice_runtime::Shutdown;
use sluice_runtime::grpc::TracedChannel;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::task::TaskTracker;

/// What one kind of session carries.
pub(crate) trait Protocol: 'static {
    /// A message to the peer.
    type Out: Send + 'static;
    /// A message from the peer.
    type In: Send + 'static;
    /// What a member hears.
    type Event: Send + 'static;
    /// The peer, in messages ("queue").
    const PEER: &'static str;
    /// The session's method, in messages ("Queue.Leases").
    const METHOD: &'static str;
    /// What a member is, in messages ("lease").
    const MEMBER: &'static str;

    /// Opens the session's call on `channel` with `outbound`.
    fn call(
        channel: TracedChannel,
        outbound: UnboundedReceiverStream<Self::Out>,
    ) -> BoxFuture<'static, Result<tonic::Streaming<Self::In>, tonic::Status>>;
    /// A message's member, its event, and whether it is the last the peer
    /// sends that member.
    fn event(msg: Self::In) -> Option<(u64, Self::Event, bool)>;
    /// The event that fails a member.
    fn failure(status: tonic::Status) -> Self::Event;
    /// Whether a member that heard `event` is over at the peer (nothing to
    /// cancel when it drops).
    fn ends(event: &Self::Event) -> bool;
    /// The message that drops member `id` at the peer.
    fn cancel(id: u64) -> Self::Out;
}

/// Every peer's session of one protocol, by endpoint.
pub(crate) struct Sessions<P: Protocol> {
    sessions: Mutex<HashMap<String, Arc<Session<P>>>>,
    /// Where each session's task runs (the service's own tasks).
    tasks: TaskTracker,
    /// Ends every session (the service's background token: cancelled once
    /// the frontend has drained, when no member is left).
    stop: Shutdown,
}

impl<P: Protocol> Sessions<P> {
    /// No sessions yet; each opens as a task on `tasks` and ends with `stop`.
    pub(crate) fn new(tasks: TaskTracker, stop: Shutdown) -> Self {
        Self {
            sessions: Mutex::default(),
            tasks,
            stop,
        }
    }
}

impl<P: Protocol> std::fmt::Debug for Sessions<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("method", &P::METHOD)
            .field("sessions", &self.sessions.lock().len())
            .finish()
    }
}

struct Session<P: Protocol> {
    tx: mpsc::UnboundedSender<P::Out>,
    state: Mutex<State<P>>,
    next_id: AtomicU64,
}

struct State<P: Protocol> {
    /// Members the peer may still send to, by id.
    live: HashMap<u64, mpsc::UnboundedSender<P::Event>>,
    /// The session ended; new members need a new one.
    closed: bool,
}

/// One request on a session. Dropped before its end, it is cancelled at
/// the peer.
pub(crate) struct Member<P: Protocol> {
    session: Arc<Session<P>>,
    id: u64,
    events: mpsc::UnboundedReceiver<P::Event>,
    /// Over at the peer: nothing to cancel.
    ended: bool,
}

impl<P: Protocol> std::fmt::Debug for Member<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(P::MEMBER)
            .field("id", &self.id)
            .field("ended", &self.ended)
            .finish()
    }
}

impl<P: Protocol> Sessions<P> {
    /// A new member of the session to `endpoint` (opened on `channel` if
    /// there is none), whose first message is `first(id)`.
    pub(crate) fn join(
        &self,
        endpoint: &str,
        channel: TracedChannel,
        first: impl FnOnce(u64) -> P::Out,
    ) -> Member<P> {
        let session = {
            let mut sessions = self.sessions.lock();
            match sessions.get(endpoint) {
                Some(s) if !s.state.lock().closed => Arc::clone(s),
                _ => {
                    // Sessions that ended stay only until the next one opens
                    // (peers come and go under new endpoints).
                    sessions.retain(|_, s| !s.state.lock().closed);
                    let (tx, rx) = mpsc::unbounded_channel();
                    let s = Arc::new(Session {
                        tx,
                        state: Mutex::new(State {
                            live: HashMap::new(),
                            closed: false,
                        }),
                        next_id: AtomicU64::new(1),
                    });
                    sessions.insert(endpoint.to_owned(), Arc::clone(&s));
                    // The member below is queued before the call starts.
                    self.tasks
                        .spawn(run(Arc::clone(&s), channel, rx, self.stop.clone()));
                    s
                }
            }
        };
        let id = session.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, events) = mpsc::unbounded_channel();
        let mut member = Member {
            session: Arc::clone(&session),
            id,
            events,
            ended: false,
        };
        {
            let mut state = session.state.lock();
            if state.closed {
                member.ended = true;
                let _ = tx.send(P::failure(closed::<P>()));
                return member;
            }
            state.live.insert(id, tx);
        }
        let _ = session.tx.send(first(id));
        member
    }

    #[cfg(test)]
    pub(crate) fn count(&self) -> usize {
        self.sessions.lock().len()
    }
}

/// The status of a session the peer ended.
pub(crate) fn closed<P: Protocol>() -> tonic::Status {
    tonic::Status::unavailable(format!("the {} ended the {} session", P::PEER, P::MEMBER))
}

impl<P: Protocol> Session<P> {
    /// Hands a message to its member.
    fn dispatch(&self, msg: P::In) {
        let Some((id, event, last)) = P::event(msg) else {
            return;
        };
        let mut state = self.state.lock();
        if let Some(tx) = state.live.get(&id) {
            let _ = tx.send(event);
        }
        if last {
            state.live.remove(&id);
        }
    }

    /// The session is over: every member still live fails with `status`.
    fn close(&self, status: &tonic::Status) {
        let live = {
            let mut state = self.state.lock();
            state.closed = true;
            std::mem::take(&mut state.live)
        };
        for tx in live.into_values() {
            let _ = tx.send(P::failure(status.clone()));
        }
    }
}

/// Runs one session: opens the call with what is queued, then hands each
/// message to its member until the stream ends or `stop` is cancelled.
async fn run<P: Protocol>(
    session: Arc<Session<P>>,
    channel: TracedChannel,
    rx: mpsc::UnboundedReceiver<P::Out>,
    stop: Shutdown,
) {
    let stopped = || tonic::Status::unavailable("the frontend is shutting down");
    let ended = tokio::select! {
        () = stop.cancelled() => Err(stopped()),
        call = P::call(channel, UnboundedReceiverStream::new(rx)) => call,
    };
    let ended = match ended {
        Ok(mut messages) => loop {
            tokio::select! {
                () = stop.cancelled() => break stopped(),
                msg = messages.message() => match msg {
                    Ok(Some(msg)) => session.dispatch(msg),
                    Ok(None) => break closed::<P>(),
                    Err(status) => break status,
                },
            }
        },
        Err(status) => status,
    };
    tracing::debug!(method = P::METHOD, code = ?ended.code(), message = ended.message(), "session ended");
    session.close(&ended_status::<P>(ended));
}

/// What the members of a session that ended with `status` fail with. A
/// peer of an older release, without the session's method, is a peer that
/// cannot serve (another may): said so, rather than as an unknown method.
pub(crate) fn ended_status<P: Protocol>(status: tonic::Status) -> tonic::Status {
    if status.code() == tonic::Code::Unimplemented {
        return tonic::Status::unavailable(format!(
            "the {} does not serve {} (an older release?): {}",
            P::PEER,
            P::METHOD,
            status.message()
        ));
    }
    status
}

impl<P: Protocol> Member<P> {
    /// The peer's next event; `None` once there is no more.
    pub(crate) async fn next(&mut self) -> Option<P::Event> {
        let event = self.events.recv().await;
        if event.as_ref().is_some_and(P::ends) {
            self.ended = true;
        }
        event
    }

    /// Sends `msg` (it names this member) to the peer.
    pub(crate) fn send(&self, msg: impl FnOnce(u64) -> P::Out) {
        let _ = self.session.tx.send(msg(self.id));
    }

    /// The member is over at the peer: nothing to cancel when it drops.
    pub(crate) fn end(&mut self) {
        self.ended = true;
    }

    #[cfg(test)]
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }
}

impl<P: Protocol> Drop for Member<P> {
    fn drop(&mut self) {
        self.session.state.lock().live.remove(&self.id);
        if !self.ended {
            let _ = self.session.tx.send(P::cancel(self.id));
        }
    }
}
