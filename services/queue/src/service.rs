//! The tonic `Queue` service: convert → call the queue → map the error.
//!
//! A lease lives on its own `Admit` stream or, many of them, on one
//! `Leases` session (what the frontend uses: no HTTP/2 stream, headers or
//! trailers per request). The ticket moves into the lease and drops with
//! it: the client sending `done`, closing (or, on a session, dropping) the
//! lease, or the stream or session ending releases the slot (or cancels a
//! request still held) and ends the placement at the router. `started`
//! after the grant tells the router the request's prefill is done;
//! `progress` and `done` carry the output tokens the queue charges to the
//! request's tenant.

use std::collections::HashMap;
use std::pin::Pin;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use sluice_proto::queue::v1 as pb;
use sluice_proto::queue::v1::admit_request::Msg as InMsg;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::convert;
use crate::error::QueueError;
use crate::queue::{Queue, Ticket, TicketEvent};

/// A session lease with no answer this long is sent `opened`, so a client
/// that times out silent queues can tell a held request from a hung queue.
const OPENED_AFTER: Duration = Duration::from_millis(20);

/// The gRPC face of a [`Queue`].
#[derive(Debug, Clone)]
pub(crate) struct QueueService {
    queue: Queue,
    /// Sessions end once this fires and their leases are over.
    shutdown: CancellationToken,
    /// Where each `Leases` session runs (the service context's tasks).
    tasks: TaskTracker,
}

impl QueueService {
    pub(crate) fn new(queue: Queue, shutdown: CancellationToken, tasks: TaskTracker) -> Self {
        Self {
            queue,
            shutdown,
            tasks,
        }
    }
}

type AdmitStream = Pin<Box<dyn Stream<Item = Result<pb::AdmitResponse, Status>> + Send>>;
type LeasesStream = UnboundedReceiverStream<Result<pb::LeaseResponse, Status>>;

/// A lease's messages from its client: its own `Admit` stream, or its
/// share of a `Leases` session.
enum Inbound {
    Stream(Box<Streaming<pb::AdmitRequest>>),
    Session(mpsc::UnboundedReceiver<Input>),
}

/// What a client says on an open lease (small, so a session lease's
/// channel costs a few hundred bytes, not a block of whole requests).
#[derive(Debug, Clone, Copy)]
enum Input {
    /// `open` again: refused.
    Open,
    Started,
    Progress(u32),
    Done(u32),
    /// A message without a body: ignored.
    Empty,
}

impl From<InMsg> for Input {
    fn from(msg: InMsg) -> Self {
        match msg {
            InMsg::Open(_) => Input::Open,
            InMsg::Started(_) => Input::Started,
            InMsg::Progress(p) => Input::Progress(p.completion_tokens),
            InMsg::Done(d) => Input::Done(d.completion_tokens),
        }
    }
}

impl Inbound {
    /// The next message; `None` once the client is done with the lease
    /// (closed or dropped it, or its connection failed).
    async fn message(&mut self) -> Option<Input> {
        match self {
            Inbound::Stream(s) => {
                let msg = s.message().await.ok().flatten()?;
                Some(msg.msg.map_or(Input::Empty, Input::from))
            }
            Inbound::Session(rx) => rx.recv().await,
        }
    }
}

/// One lease's stream state; dropping it drops the ticket (and closes the
/// `queue.lease` span, whose length is the lease's).
struct Lease {
    ticket: Ticket,
    span: tracing::Span,
    inbound: Inbound,
    granted: bool,
    finished: bool,
}

impl Lease {
    /// The next response, or None when the stream (and the lease) ends.
    async fn next(&mut self) -> Option<Result<pb::AdmitResponse, Status>> {
        if self.finished {
            return None;
        }
        if self.granted {
            // Hold the lease until the client is done or gone.
            loop {
                match self.inbound.message().await {
                    Some(Input::Open) => {
                        self.finished = true;
                        return Some(Err(QueueError::InvalidArgument {
                            field: "open",
                            reason: "sent twice on one lease".into(),
                        }
                        .into()));
                    }
                    Some(Input::Started) => self.ticket.started(),
                    Some(Input::Progress(tokens)) => self.ticket.progress(tokens),
                    Some(Input::Done(tokens)) => {
                        self.ticket.progress(tokens);
                        return None;
                    }
                    Some(Input::Empty) => continue,
                    None => return None,
                }
            }
        }
        tokio::select! {
            event = self.ticket.next() => match event {
                Ok(TicketEvent::Held(status)) => Some(Ok(convert::held_response(&status))),
                Ok(TicketEvent::Granted(grant)) => {
                    self.granted = true;
                    self.span.record("worker_id", &*grant.placement.worker.rank.worker_id);
                    self.span.record("queue_wait_ms", grant.waited.as_secs_f64() * 1000.0);
                    if grant.express {
                        self.span.record("express", true);
                    }
                    self.span.record("outcome", "granted");
                    Some(Ok(convert::grant_response(&grant)))
                }
                Err(err) => {
                    self.finished = true;
                    self.span.record("outcome", err.reason().label());
                    self.span.record("error", tracing::field::display(&err));
                    Some(Err(err.into()))
                }
            },
            // Anything from the client before the grant ends the request:
            // `done` or a close cancels it while held.
            message = self.inbound.message() => match message {
                Some(Input::Open) => {
                    self.finished = true;
                    Some(Err(QueueError::InvalidArgument {
                        field: "open",
                        reason: "sent twice on one lease".into(),
                    }
                    .into()))
                }
                _ => None,
            },
        }
    }
}

impl QueueService {
    /// Enters the request `open` describes into the queue as a lease fed by
    /// `inbound`. Its `queue.lease` span is a child of the current span (an
    /// `Admit` call's), or of `traceparent` on a session.
    fn open_lease(
        &self,
        open: pb::AdmitOpen,
        inbound: Inbound,
        traceparent: Option<&str>,
    ) -> Result<Lease, Status> {
        let mut entry = convert::entry_from_open(open, Instant::now())?;
        let parent = match traceparent {
            Some(_) => None,
            None => tracing::Span::current().id(),
        };
        let span = tracing::info_span!(
            parent: parent,
            "queue.lease",
            request_id = %entry.desc.request_id,
            priority = entry.desc.priority,
            strict_tier = entry.desc.strict_priority,
            tenant = %entry.desc.tenant,
            prompt_tokens = entry.desc.prompt_tokens,
            worker_id = tracing::field::Empty,
            queue_wait_ms = tracing::field::Empty,
            express = tracing::field::Empty,
            ttft_target_ms = tracing::field::Empty,
            predicted_wait_ms = tracing::field::Empty,
            outcome = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        if let Some(tp) = traceparent {
            sluice_runtime::telemetry::set_parent_from_traceparent(tp, &span);
        }
        entry.span = span.clone();
        let ticket = span
            .in_scope(|| self.queue.admit(entry))
            .inspect_err(|err| {
                span.record("error", tracing::field::display(err));
            })?;
        Ok(Lease {
            ticket,
            span,
            inbound,
            granted: false,
            finished: false,
        })
    }
}

type Answers = mpsc::UnboundedSender<Result<pb::LeaseResponse, Status>>;

/// One `Leases` session's leases, all driven by the session's task.
#[derive(Default)]
struct Session {
    /// Lease id → (generation, its inbound). The generation tells a lease
    /// from an earlier one the client opened under the same id.
    leases: HashMap<u64, (u64, mpsc::UnboundedSender<Input>)>,
    /// Each lease's driver; yields `(id, generation)` when the lease is over.
    running: FuturesUnordered<BoxFuture<'static, (u64, u64)>>,
    generation: u64,
}

impl Session {
    /// Applies one message from the client.
    fn on_message(&mut self, svc: &QueueService, m: pb::LeaseRequest, out: &Answers) {
        let id = m.lease_id;
        let Some(req) = m.request else {
            // Dropped by the client: closing its inbound ends it.
            self.leases.remove(&id);
            return;
        };
        match req.msg {
            Some(InMsg::Open(open)) => self.open(svc, id, open, &m.traceparent, out),
            Some(msg) => {
                let input = Input::from(msg);
                if let Some((_, tx)) = self.leases.get(&id) {
                    let _ = tx.send(input);
                }
                if matches!(input, Input::Done(_)) {
                    self.leases.remove(&id);
                }
            }
            None => {}
        }
    }

    /// Opens lease `id`, or answers why not.
    fn open(
        &mut self,
        svc: &QueueService,
        id: u64,
        open: pb::AdmitOpen,
        traceparent: &str,
        out: &Answers,
    ) {
        if self.leases.contains_key(&id) {
            let err = QueueError::InvalidArgument {
                field: "lease_id",
                reason: format!("lease {id} is already open on this session"),
            };
            let _ = out.send(Ok(lease_error(id, &err.into())));
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        match svc.open_lease(open, Inbound::Session(rx), Some(traceparent)) {
            Ok(lease) => {
                self.generation += 1;
                self.leases.insert(id, (self.generation, tx));
                self.running
                    .push(Box::pin(run_lease(id, self.generation, lease, out.clone())));
            }
            Err(status) => {
                let _ = out.send(Ok(lease_error(id, &status)));
            }
        }
    }

    /// Lease `id` of `generation` is over: forget it, unless the id now
    /// names a newer lease.
    fn ended(&mut self, id: u64, generation: u64) {
        if self.leases.get(&id).is_some_and(|(g, _)| *g == generation) {
            self.leases.remove(&id);
        }
    }
}

/// Serves one `Leases` session until the client ends it, or until shutdown
/// once its leases are over. Every lease runs on this task; ending it drops
/// them all.
async fn run_session(svc: QueueService, mut inbound: Streaming<pb::LeaseRequest>, out: Answers) {
    let _open = svc.queue.metrics().lease_session();
    let mut session = Session::default();
    let mut draining = false;
    loop {
        tokio::select! {
            () = svc.shutdown.cancelled(), if !draining => draining = true,
            Some((id, g)) = session.running.next(), if !session.running.is_empty() => {
                session.ended(id, g);
            }
            msg = inbound.message() => match msg {
                Ok(Some(m)) => session.on_message(&svc, m, &out),
                Ok(None) | Err(_) => break,
            },
            // Nobody reads the answers any more (a caller in this process
            // dropped them without ending its requests).
            () = out.closed() => break,
        }
        if draining && session.running.is_empty() {
            break;
        }
    }
}

/// Drives one session lease, sending its answers tagged with `id`;
/// returns `(id, generation)` once it is over.
async fn run_lease(id: u64, generation: u64, mut lease: Lease, out: Answers) -> (u64, u64) {
    let span = lease.span.clone();
    let mut answered = false;
    loop {
        let next = lease.next().instrument(span.clone());
        let item = if answered {
            next.await
        } else {
            tokio::pin!(next);
            tokio::select! {
                biased;
                item = &mut next => item,
                () = tokio::time::sleep(OPENED_AFTER) => {
                    let opened = pb::LeaseResponse {
                        lease_id: id,
                        msg: Some(pb::lease_response::Msg::Opened(pb::LeaseOpened {})),
                    };
                    let _ = out.send(Ok(opened));
                    next.await
                }
            }
        };
        answered = true;
        let Some(item) = item else { break };
        let msg = match item {
            Ok(pb::AdmitResponse { msg: Some(m) }) => pb::LeaseResponse {
                lease_id: id,
                msg: Some(match m {
                    pb::admit_response::Msg::Held(h) => pb::lease_response::Msg::Held(h),
                    pb::admit_response::Msg::Grant(g) => pb::lease_response::Msg::Grant(g),
                }),
            },
            Ok(pb::AdmitResponse { msg: None }) => continue,
            Err(status) => lease_error(id, &status),
        };
        if out.send(Ok(msg)).is_err() {
            break;
        }
    }
    (id, generation)
}

/// A lease's error as a session message.
fn lease_error(id: u64, status: &Status) -> pb::LeaseResponse {
    pb::LeaseResponse {
        lease_id: id,
        msg: Some(pb::lease_response::Msg::Error(
            sluice_proto::common::v1::RpcStatus::from_status(status),
        )),
    }
}

#[tonic::async_trait]
impl pb::queue_server::Queue for QueueService {
    type AdmitStream = AdmitStream;
    type LeasesStream = LeasesStream;

    async fn admit(
        &self,
        request: Request<Streaming<pb::AdmitRequest>>,
    ) -> Result<Response<Self::AdmitStream>, Status> {
        let mut inbound = request.into_inner();
        let open = match inbound.message().await? {
            Some(pb::AdmitRequest {
                msg: Some(InMsg::Open(open)),
            }) => open,
            Some(_) => {
                return Err(QueueError::InvalidArgument {
                    field: "open",
                    reason: "the first message on a lease must be `open`".into(),
                }
                .into());
            }
            None => {
                return Err(QueueError::InvalidArgument {
                    field: "open",
                    reason: "stream closed before `open`".into(),
                }
                .into());
            }
        };
        let lease = self.open_lease(open, Inbound::Stream(Box::new(inbound)), None)?;
        let stream = futures::stream::unfold(lease, |mut lease| async move {
            let span = lease.span.clone();
            let item = lease.next().instrument(span).await?;
            Some((item, lease))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn leases(
        &self,
        request: Request<Streaming<pb::LeaseRequest>>,
    ) -> Result<Response<Self::LeasesStream>, Status> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.tasks
            .spawn(run_session(self.clone(), request.into_inner(), tx));
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn stats(
        &self,
        _request: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(convert::stats_response(
            self.queue.config(),
            self.queue.stats(),
        )))
    }
}
