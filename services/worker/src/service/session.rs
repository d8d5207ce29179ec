//! `Worker.GenerateSession`: many generations on one long-lived stream from
//! a caller (the frontend keeps one per worker). Each generation is what a
//! `Generate` call would be — the same admission, the same wire messages
//! — tagged with the caller's id for it, so a request costs the worker hop
//! a few small messages instead of an HTTP/2 stream of its own (headers,
//! trailers, a server task and codec buffers at both ends).
//!
//! One task drives a session's generations. A generation ends with its last
//! response or an error; the caller aborts one by sending its id without a
//! request, and the session's end (the caller dropped it, the connection
//! broke) aborts all of them, as a reset stream aborts its sequence. Once
//! the worker drains, new generations are refused with `UNAVAILABLE` (the
//! frontend places them on another worker) and the session ends when those
//! already running are over.

use std::collections::HashMap;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use sluice_proto::common::v1::RpcStatus;
use sluice_proto::worker::v1 as pb;
use sluice_runtime::metrics::Open;
use tokio::sync::{mpsc, oneshot};
use tonic::{Status, Streaming};

use super::WorkerService;

type Out = mpsc::Sender<Result<pb::GenerateSessionResponse, Status>>;

/// Serves one session until the caller ends it or stops reading its
/// answers, or, once the worker drains, until its generations are over.
pub(crate) async fn run(
    svc: WorkerService,
    mut inbound: Streaming<pb::GenerateSessionRequest>,
    out: Out,
) {
    let _open = Open::new(&svc.core.metrics.generate_sessions);
    let mut session = Session::default();
    let mut draining = svc.draining.is_cancelled();
    loop {
        tokio::select! {
            // The drain first: a message that arrives once the worker drains
            // is refused, whichever was ready first.
            biased;
            () = svc.draining.cancelled(), if !draining => draining = true,
            Some((id, generation)) = session.running.next(), if !session.running.is_empty() => {
                session.ended(id, generation);
            }
            msg = inbound.message() => match msg {
                Ok(Some(m)) => session.on_message(&svc, m, &out, draining),
                Ok(None) | Err(_) => break,
            },
            // Nobody reads the answers any more (a caller in this process
            // dropped them without ending its requests, which a socket
            // would have reset).
            () = out.closed() => break,
        }
        if draining && session.running.is_empty() {
            break;
        }
    }
}

/// One session's generations.
#[derive(Default)]
struct Session {
    /// Generation id → (its number on this session, the sender whose drop
    /// aborts it). The number tells a generation from an earlier one the
    /// caller started under the same id.
    live: HashMap<u64, (u64, oneshot::Sender<()>)>,
    /// Each generation's driver (and each refusal's answer); yields
    /// `(id, number)` when it is over.
    running: FuturesUnordered<BoxFuture<'static, (u64, u64)>>,
    started: u64,
}

impl Session {
    /// Applies one message from the caller.
    fn on_message(
        &mut self,
        svc: &WorkerService,
        m: pb::GenerateSessionRequest,
        out: &Out,
        draining: bool,
    ) {
        let id = m.id;
        let Some(req) = m.request else {
            // Dropped by the caller: dropping its sender aborts it.
            self.live.remove(&id);
            return;
        };
        let refusal = if self.live.contains_key(&id) {
            Some(Status::invalid_argument(format!(
                "id: generation {id} is already running on this session; \
                 choose an id no live generation uses"
            )))
        } else if draining {
            Some(Status::unavailable(
                "the worker is shutting down and takes no new generations",
            ))
        } else {
            None
        };
        if let Some(status) = refusal {
            // A refusal takes no number, so it never ends a live generation.
            let out = out.clone();
            self.running.push(Box::pin(async move {
                let _ = out.send(Ok(error(id, &status))).await;
                (id, 0)
            }));
            return;
        }
        self.started += 1;
        let number = self.started;
        let (abort, aborted) = oneshot::channel();
        self.live.insert(id, (number, abort));
        let work = generate(svc.clone(), id, req, m.traceparent, out.clone());
        self.running.push(Box::pin(async move {
            tokio::select! {
                _ = aborted => {}
                () = work => {}
            }
            (id, number)
        }));
    }

    /// Generation `id` numbered `number` is over: forget it, unless the id
    /// now names a newer one.
    fn ended(&mut self, id: u64, number: u64) {
        if self.live.get(&id).is_some_and(|(n, _)| *n == number) {
            self.live.remove(&id);
        }
    }
}

/// Runs one generation, sending its messages tagged with `id`; its last
/// message is the one that finishes it, or an error.
async fn generate(
    svc: WorkerService,
    id: u64,
    req: pb::GenerateRequest,
    traceparent: String,
    out: Out,
) {
    let mut stream = match svc.start(req, Some(&traceparent)).await {
        Ok(stream) => stream,
        Err(status) => {
            let _ = out.send(Ok(error(id, &status))).await;
            return;
        }
    };
    while let Some(item) = stream.next().await {
        let (msg, last) = match item {
            Ok(r) => {
                let last = r.finishes();
                let msg = pb::GenerateSessionResponse {
                    id,
                    msg: Some(pb::generate_session_response::Msg::Response(r)),
                };
                (msg, last)
            }
            Err(status) => (error(id, &status), true),
        };
        if out.send(Ok(msg)).await.is_err() || last {
            return;
        }
    }
    // The engine's stream ended without a finish: said, so the caller does
    // not wait on it (a `Generate` stream would just end).
    let status = Status::unavailable("the worker ended the generation before finishing");
    let _ = out.send(Ok(error(id, &status))).await;
}

/// A generation's error as a session message.
fn error(id: u64, status: &Status) -> pb::GenerateSessionResponse {
    pb::GenerateSessionResponse {
        id,
        msg: Some(pb::generate_session_response::Msg::Error(
            RpcStatus::from_status(status),
        )),
    }
}
