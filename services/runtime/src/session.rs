//! Many calls on one long-lived stream per peer: the mesh's one
//! multiplexed-session client. The frontend's admission leases
//! (`Queue.Leases`) and generations (`Worker.GenerateSession`) and the
//! queue's placements (`Router.Place`) all ride on it. Each call is a
//! [`Member`] of its peer's [`Session`], named by an id in every message,
//! so a call costs a few small messages instead of an HTTP/2 stream of its
//! own (headers, trailers, a server task and codec buffers at both ends).
//! What differs between the kinds lives in their [`Protocol`].
//!
//! A session's opening messages are queued before its call starts, so the
//! first member pays no extra round trip. A session ends when the peer ends
//! its stream (it restarted, its connection broke, it shut down), when the
//! caller closes it (a peer that hung), when the service stops, or when the
//! peer falls [`BACKLOG`] messages behind: every member still waiting on it
//! then fails with the status it ended in, and the caller opens a new one.
//! A member dropped before its end tells the peer, where the protocol has a
//! message for that.
//!
//! Backpressure is one rule for every kind: what waits to be sent is
//! bounded, and a peer that stops reading is cut off rather than let grow
//! this process's memory. Each member's events wait in an unbounded channel
//! until it takes them: one slow member must not hold up the others. What
//! waits there is bounded by the call (a lease's few answers, a
//! generation's `max_tokens`, a route's one answer).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::Shutdown;
use crate::grpc::TracedChannel;

/// Messages a session may have waiting to be sent. A peer that falls this
/// far behind has its session ended (its members fail over).
pub const BACKLOG: usize = 65_536;

/// What one kind of session carries.
pub trait Protocol: 'static {
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
        outbound: ReceiverStream<Self::Out>,
    ) -> BoxFuture<'static, Result<tonic::Streaming<Self::In>, tonic::Status>>;
    /// A message's member, its event, and whether it is the last the peer
    /// sends that member (`None`: a message for no member).
    fn event(msg: Self::In) -> Option<(u64, Self::Event, bool)>;
    /// The event that fails a member when its session ends.
    fn failure(status: tonic::Status) -> Self::Event;
    /// Whether a member that heard `event` is over at the peer (nothing to
    /// cancel when it drops).
    fn ends(event: &Self::Event) -> bool;
    /// The message that drops member `id` at the peer, if the peer takes
    /// one.
    fn cancel(id: u64) -> Option<Self::Out>;
}

/// Where a session is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The call is starting: messages queue, nothing has answered.
    Opening,
    /// The peer accepted the call.
    Open,
    /// Over: new members fail at once.
    Closed,
}

/// One peer's session.
pub struct Session<P: Protocol> {
    /// The outbound stream's sender; `None` once closed.
    tx: Mutex<Option<mpsc::Sender<P::Out>>>,
    /// Members the peer may still send to, by id.
    live: Mutex<HashMap<u64, mpsc::UnboundedSender<P::Event>>>,
    next_id: AtomicU64,
    phase: watch::Sender<Phase>,
    /// Cancelled by [`Session::close`]: the session's task stops reading.
    ended: CancellationToken,
}

impl<P: Protocol> std::fmt::Debug for Session<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("method", &P::METHOD)
            .field("phase", &*self.phase.borrow())
            .field("live", &self.live.lock().len())
            .finish()
    }
}

/// The opening messages did not fit in [`BACKLOG`].
#[derive(Debug, thiserror::Error)]
#[error("{0} opening messages do not fit in a session's backlog of {BACKLOG}")]
pub struct TooManyOpening(pub usize);

impl<P: Protocol> Session<P> {
    /// Opens a session on `channel` whose stream starts with `opening`. Its
    /// task runs on `tasks` until the peer ends the stream, the session is
    /// closed, or `stop` is cancelled.
    pub fn open(
        channel: TracedChannel,
        opening: Vec<P::Out>,
        tasks: &TaskTracker,
        stop: Shutdown,
    ) -> Result<Arc<Self>, TooManyOpening> {
        if opening.len() > BACKLOG {
            return Err(TooManyOpening(opening.len()));
        }
        Ok(Self::start(channel, opening, tasks, stop))
    }

    /// [`Self::open`] with `opening` known to fit.
    fn start(
        channel: TracedChannel,
        opening: Vec<P::Out>,
        tasks: &TaskTracker,
        stop: Shutdown,
    ) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(BACKLOG);
        for msg in opening {
            // Fits: the channel is new and as large as the check above.
            let _ = tx.try_send(msg);
        }
        let session = Arc::new(Self {
            tx: Mutex::new(Some(tx)),
            live: Mutex::default(),
            next_id: AtomicU64::new(1),
            phase: watch::Sender::new(Phase::Opening),
            ended: CancellationToken::new(),
        });
        tasks.spawn(run(Arc::clone(&session), channel, rx, stop));
        session
    }

    /// A new member whose first message is `first(id)`. On a closed session
    /// it fails at once.
    pub fn join(self: &Arc<Self>, first: impl FnOnce(u64) -> P::Out) -> Member<P> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, events) = mpsc::unbounded_channel();
        let mut member = Member {
            session: Arc::clone(self),
            id,
            events,
            ended: false,
        };
        {
            let mut live = self.live.lock();
            if self.phase() == Phase::Closed {
                member.ended = true;
                let _ = tx.send(P::failure(closed::<P>()));
                return member;
            }
            live.insert(id, tx);
        }
        self.send(first(id));
        member
    }

    /// Sends `msg` on the session; `false` when it is over. A peer
    /// [`BACKLOG`] messages behind ends the session.
    pub fn send(&self, msg: P::Out) -> bool {
        let full = {
            let tx = self.tx.lock();
            match tx.as_ref().map(|tx| tx.try_send(msg)) {
                None | Some(Err(mpsc::error::TrySendError::Closed(_))) => return false,
                Some(Ok(())) => return true,
                Some(Err(mpsc::error::TrySendError::Full(_))) => true,
            }
        };
        if full {
            tracing::warn!(
                method = P::METHOD,
                backlog = BACKLOG,
                "the {} fell too far behind; ending its session",
                P::PEER
            );
            self.close(&tonic::Status::unavailable(format!(
                "the {} fell {BACKLOG} messages behind on the {} session",
                P::PEER,
                P::MEMBER
            )));
        }
        false
    }

    /// Ends the session: the stream to the peer ends, the task stops
    /// reading, and every member still live fails with `status`.
    pub fn close(&self, status: &tonic::Status) {
        let live = {
            let mut live = self.live.lock();
            self.phase.send_replace(Phase::Closed);
            std::mem::take(&mut *live)
        };
        self.tx.lock().take();
        self.ended.cancel();
        for tx in live.into_values() {
            let _ = tx.send(P::failure(status.clone()));
        }
    }

    /// Where the session is now.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Waits until the peer accepted the call (`true`) or the session is
    /// over (`false`).
    pub async fn opened(&self) -> bool {
        let mut phase = self.phase.subscribe();
        matches!(
            phase.wait_for(|p| *p != Phase::Opening).await.as_deref(),
            Ok(Phase::Open)
        )
    }

    /// Waits until the session is over.
    pub async fn closed(&self) {
        let mut phase = self.phase.subscribe();
        let _ = phase.wait_for(|p| *p == Phase::Closed).await;
    }

    /// Hands a message to its member.
    fn dispatch(&self, msg: P::In) {
        let Some((id, event, last)) = P::event(msg) else {
            return;
        };
        let mut live = self.live.lock();
        if let Some(tx) = live.get(&id) {
            let _ = tx.send(event);
        }
        if last {
            live.remove(&id);
        }
    }
}

/// The status of a session the peer ended.
pub fn closed<P: Protocol>() -> tonic::Status {
    tonic::Status::unavailable(format!("the {} ended the {} session", P::PEER, P::MEMBER))
}

/// What the members of a session that ended with `status` fail with. A
/// peer of an older release, without the session's method, is a peer that
/// cannot serve (another may): said so, rather than as an unknown method.
pub fn ended_status<P: Protocol>(status: tonic::Status) -> tonic::Status {
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

/// Runs one session: opens the call with what is queued, then hands each
/// message to its member until the stream ends, the session is closed, or
/// `stop` is cancelled.
async fn run<P: Protocol>(
    session: Arc<Session<P>>,
    channel: TracedChannel,
    rx: mpsc::Receiver<P::Out>,
    stop: Shutdown,
) {
    let stopped = || tonic::Status::unavailable("shutting down");
    let call = tokio::select! {
        () = stop.cancelled() => Err(stopped()),
        () = session.ended.cancelled() => return,
        call = P::call(channel, ReceiverStream::new(rx)) => call,
    };
    let ended = match call {
        Ok(mut messages) => {
            session.phase.send_if_modified(|p| {
                let opening = *p == Phase::Opening;
                if opening {
                    *p = Phase::Open;
                }
                opening
            });
            loop {
                tokio::select! {
                    () = stop.cancelled() => break stopped(),
                    () = session.ended.cancelled() => return,
                    msg = messages.message() => match msg {
                        Ok(Some(msg)) => session.dispatch(msg),
                        Ok(None) => break closed::<P>(),
                        Err(status) => break status,
                    },
                }
            }
        }
        Err(status) => status,
    };
    tracing::debug!(method = P::METHOD, code = ?ended.code(), message = ended.message(), "session ended");
    session.close(&ended_status::<P>(ended));
}

/// One call on a session. Dropped before its end, it is cancelled at the
/// peer.
pub struct Member<P: Protocol> {
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

impl<P: Protocol> Member<P> {
    /// The peer's next event; `None` once there is no more.
    pub async fn next(&mut self) -> Option<P::Event> {
        let event = self.events.recv().await;
        if event.as_ref().is_some_and(P::ends) {
            self.ended = true;
        }
        event
    }

    /// Sends `msg` (it names this member) to the peer.
    pub fn send(&self, msg: impl FnOnce(u64) -> P::Out) {
        self.session.send(msg(self.id));
    }

    /// The member is over at the peer: nothing to cancel when it drops.
    pub fn end(&mut self) {
        self.ended = true;
    }

    /// Whether the member is over at the peer.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// This member's id on its session.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl<P: Protocol> Drop for Member<P> {
    fn drop(&mut self) {
        self.session.live.lock().remove(&self.id);
        if !self.ended
            && let Some(cancel) = P::cancel(self.id)
        {
            self.session.send(cancel);
        }
    }
}

/// Every peer's session of one protocol, by endpoint, each opened by its
/// first member.
pub struct Sessions<P: Protocol> {
    sessions: Mutex<HashMap<String, Arc<Session<P>>>>,
    /// Where each session's task runs (the service's own tasks).
    tasks: TaskTracker,
    /// Ends every session (the service's background token: cancelled once
    /// the service has drained, when no member is left).
    stop: Shutdown,
}

impl<P: Protocol> std::fmt::Debug for Sessions<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("method", &P::METHOD)
            .field("sessions", &self.sessions.lock().len())
            .finish()
    }
}

impl<P: Protocol> Sessions<P> {
    /// No sessions yet; each opens as a task on `tasks` and ends with `stop`.
    pub fn new(tasks: TaskTracker, stop: Shutdown) -> Self {
        Self {
            sessions: Mutex::default(),
            tasks,
            stop,
        }
    }

    /// A new member of the session to `endpoint` (opened on `channel` if
    /// there is none open), whose first message is `first(id)`.
    pub fn join(
        &self,
        endpoint: &str,
        channel: TracedChannel,
        first: impl FnOnce(u64) -> P::Out,
    ) -> Member<P> {
        let session = {
            let mut sessions = self.sessions.lock();
            match sessions.get(endpoint) {
                Some(s) if s.phase() != Phase::Closed => Arc::clone(s),
                _ => {
                    // Sessions that ended stay only until the next one opens
                    // (peers come and go under new endpoints).
                    sessions.retain(|_, s| s.phase() != Phase::Closed);
                    let s = Session::start(channel, Vec::new(), &self.tasks, self.stop.clone());
                    sessions.insert(endpoint.to_owned(), Arc::clone(&s));
                    s
                }
            }
        };
        session.join(first)
    }

    /// Sessions known now, open or not yet pruned.
    pub fn count(&self) -> usize {
        self.sessions.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::FutureExt;

    use super::*;

    /// A peer that takes the call and never reads or answers (a hung one).
    struct Hung;

    impl Protocol for Hung {
        type Out = u64;
        type In = ();
        type Event = Result<(), tonic::Status>;
        const PEER: &'static str = "peer";
        const METHOD: &'static str = "Peer.Hang";
        const MEMBER: &'static str = "call";

        fn call(
            _channel: TracedChannel,
            outbound: ReceiverStream<u64>,
        ) -> BoxFuture<'static, Result<tonic::Streaming<()>, tonic::Status>> {
            async move {
                let _unread = outbound;
                futures::future::pending().await
            }
            .boxed()
        }
        fn event(_: ()) -> Option<(u64, Self::Event, bool)> {
            None
        }
        fn failure(status: tonic::Status) -> Self::Event {
            Err(status)
        }
        fn ends(event: &Self::Event) -> bool {
            event.is_err()
        }
        fn cancel(id: u64) -> Option<u64> {
            Some(id)
        }
    }

    fn session() -> Arc<Session<Hung>> {
        let channel = crate::grpc::channel("127.0.0.1:1").expect("channel");
        Session::open(channel, vec![0], &TaskTracker::new(), Shutdown::new()).expect("open")
    }

    async fn next_in_time(member: &mut Member<Hung>) -> Option<Result<(), tonic::Status>> {
        tokio::time::timeout(Duration::from_secs(10), member.next())
            .await
            .expect("an event in time")
    }

    #[tokio::test]
    async fn a_peer_that_falls_the_backlog_behind_ends_the_session_and_fails_its_members() {
        let session = session();
        let mut member = session.join(|id| id);
        // The opening message and the member's first fill two places.
        for i in 2..BACKLOG {
            assert!(session.send(i as u64), "message {i} fits");
        }
        assert_eq!(session.phase(), Phase::Opening);
        assert!(!session.send(0), "one past the backlog is refused");
        assert_eq!(session.phase(), Phase::Closed);
        let failed = next_in_time(&mut member).await.expect("an event");
        let status = failed.expect_err("the member fails");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("behind"), "{status:?}");
        assert!(member.ended(), "a failed member sends no cancel");
        assert!(!session.opened().await, "it never opened");
    }

    #[tokio::test]
    async fn a_member_of_a_closed_session_fails_at_once_and_later_sends_go_nowhere() {
        let session = session();
        let mut before = session.join(|id| id);
        session.close(&tonic::Status::unavailable("the peer hung"));
        session.closed().await;
        let status = next_in_time(&mut before)
            .await
            .expect("event")
            .expect_err("fails");
        assert_eq!(status.message(), "the peer hung");
        let mut after = session.join(|id| id);
        assert!(after.ended());
        let status = next_in_time(&mut after)
            .await
            .expect("event")
            .expect_err("fails");
        assert_eq!(status.message(), closed::<Hung>().message());
        assert!(!session.send(7));
    }

    #[tokio::test]
    async fn sessions_open_one_per_endpoint_and_replace_a_closed_one() {
        let (tasks, stop) = (TaskTracker::new(), Shutdown::new());
        let sessions = Sessions::<Hung>::new(tasks.clone(), stop.clone());
        let channel = || crate::grpc::channel("127.0.0.1:1").expect("channel");
        let a = sessions.join("a", channel(), |id| id);
        let b = sessions.join("a", channel(), |id| id);
        assert!(
            Arc::ptr_eq(&a.session, &b.session),
            "one session per endpoint"
        );
        assert_ne!(a.id(), b.id());
        a.session.close(&tonic::Status::unavailable("gone"));
        let c = sessions.join("a", channel(), |id| id);
        assert!(
            !Arc::ptr_eq(&a.session, &c.session),
            "a closed one is replaced"
        );
        assert_eq!(sessions.count(), 1, "the closed one is pruned");
        // The service's stop ends the rest, and their tasks with them.
        stop.cancel();
        c.session.closed().await;
        tasks.close();
        tokio::time::timeout(Duration::from_secs(10), tasks.wait())
            .await
            .expect("every session's task ends");
    }
}
