//! The tonic `Queue` service: convert → call the queue → map the error.
//!
//! `Admit` is the request's lease. The ticket moves into the response stream
//! and drops with it: the client sending `done`, closing its side, or the
//! connection dropping ends the stream and so releases the slot (or cancels
//! a request still held) and ends the placement at the router. `started`
//! after the grant tells the router the request's prefill is done;
//! `progress` and `done` carry the output tokens the queue charges to the
//! request's tenant.

use std::pin::Pin;

use futures::Stream;
use sluice_proto::queue::v1 as pb;
use sluice_proto::queue::v1::admit_request::Msg as InMsg;
use tokio::time::Instant;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::convert;
use crate::error::QueueError;
use crate::queue::{Queue, Ticket, TicketEvent};

/// The gRPC face of a [`Queue`].
#[derive(Debug, Clone)]
pub(crate) struct QueueService {
    queue: Queue,
}

impl QueueService {
    pub(crate) fn new(queue: Queue) -> Self {
        Self { queue }
    }
}

type AdmitStream = Pin<Box<dyn Stream<Item = Result<pb::AdmitResponse, Status>> + Send>>;

/// One lease's stream state; dropping it drops the ticket (and closes the
/// `queue.lease` span, whose length is the lease's).
struct Lease {
    ticket: Ticket,
    span: tracing::Span,
    inbound: Streaming<pb::AdmitRequest>,
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
                    Ok(Some(pb::AdmitRequest {
                        msg: Some(InMsg::Open(_)),
                    })) => {
                        self.finished = true;
                        return Some(Err(QueueError::InvalidArgument {
                            field: "open",
                            reason: "sent twice on one lease".into(),
                        }
                        .into()));
                    }
                    Ok(Some(pb::AdmitRequest {
                        msg: Some(InMsg::Started(_)),
                    })) => self.ticket.started(),
                    Ok(Some(pb::AdmitRequest {
                        msg: Some(InMsg::Progress(p)),
                    })) => self.ticket.progress(p.completion_tokens),
                    Ok(Some(pb::AdmitRequest {
                        msg: Some(InMsg::Done(done)),
                    })) => {
                        self.ticket.progress(done.completion_tokens);
                        return None;
                    }
                    Ok(Some(pb::AdmitRequest { msg: None })) => continue,
                    Ok(None) | Err(_) => return None,
                }
            }
        }
        tokio::select! {
            event = self.ticket.next() => match event {
                Ok(TicketEvent::Held(status)) => Some(Ok(convert::held_response(&status))),
                Ok(TicketEvent::Granted(grant)) => {
                    self.granted = true;
                    self.span.record("worker_id", grant.placement.worker.worker_id.as_str());
                    self.span.record("queue_wait_ms", grant.waited.as_secs_f64() * 1000.0);
                    if grant.express {
                        self.span.record("express", true);
                    }
                    Some(Ok(convert::grant_response(&grant)))
                }
                Err(err) => {
                    self.finished = true;
                    self.span.record("error", tracing::field::display(&err));
                    Some(Err(err.into()))
                }
            },
            // Anything from the client before the grant ends the request:
            // `done` or a close cancels it while held.
            message = self.inbound.message() => match message {
                Ok(Some(pb::AdmitRequest { msg: Some(InMsg::Open(_)) })) => {
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

#[tonic::async_trait]
impl pb::queue_server::Queue for QueueService {
    type AdmitStream = AdmitStream;

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
        let mut entry = convert::entry_from_open(open, Instant::now())?;
        let span = tracing::info_span!(
            "queue.lease",
            request_id = %entry.desc.request_id,
            priority = entry.desc.priority,
            strict_tier = entry.desc.strict_priority,
            tenant = %entry.desc.tenant,
            prompt_tokens = entry.desc.prompt_tokens,
            worker_id = tracing::field::Empty,
            queue_wait_ms = tracing::field::Empty,
            express = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        entry.span = span.clone();
        let ticket = span
            .in_scope(|| self.queue.admit(entry))
            .inspect_err(|err| {
                span.record("error", tracing::field::display(err));
            })?;
        let lease = Lease {
            ticket,
            span,
            inbound,
            granted: false,
            finished: false,
        };
        let stream = futures::stream::unfold(lease, |mut lease| async move {
            let span = lease.span.clone();
            let item = lease.next().instrument(span).await?;
            Some((item, lease))
        });
        Ok(Response::new(Box::pin(stream)))
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
