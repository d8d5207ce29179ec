//! Admission: a lease from a queue replica (failing over to another when
//! one is unreachable), and the worker stream the grant names; a request
//! whose worker fails before its first token is placed again elsewhere.

use super::*;

impl Pipeline {
    /// The request's `n` choices, both APIs' one entry. One choice is
    /// [`Pipeline::start`]. For `n` > 1 the first is started and its first
    /// event awaited, by when its prompt's full blocks are cached on its
    /// worker; then the others, each with its own id (and seed + i), which
    /// the router places where that prefix is cached, so they compute only
    /// the prompt's last partial block. The first choice's first event
    /// comes back beside the generations, to be read before its next.
    pub(crate) async fn start_choices(
        self: &Arc<Self>,
        p: Prepared,
    ) -> Result<(Vec<Generation>, Option<Event>), FrontendError> {
        let n = p.params.n;
        if n <= 1 {
            return Ok((vec![self.start(p).await?], None));
        }
        let mut first = self.start(p.clone()).await?;
        let event = first.next().await.transpose()?;
        let others = (1..n).map(|i| {
            let mut q = p.clone();
            q.desc.request_id = format!("{}-{i}", p.desc.request_id);
            q.params.request_id.clone_from(&q.desc.request_id);
            q.params.sampling.seed = p.params.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
            self.start(q)
        });
        let mut generations = vec![first];
        generations.extend(futures::future::try_join_all(others).await?);
        Ok((generations, event))
    }

    /// Takes the admission lease and opens the worker stream. Errors before
    /// the first token surface here, so the HTTP layer can still pick a status.
    pub(crate) async fn start(self: &Arc<Self>, p: Prepared) -> Result<Generation, FrontendError> {
        let deadline = p.received + p.params.timeout.unwrap_or(self.request_timeout);
        let priority_label = p.desc.priority.to_string();
        let mut failed = Vec::new();
        let opened = self
            .open(&p, deadline, &mut failed, self.migration_limit)
            .await;
        if !failed.is_empty() {
            let outcome = if opened.is_ok() { "ok" } else { "failed" };
            self.metrics.migrations.with_label_values(&[outcome]).inc();
        }
        let opened = opened.inspect_err(|e| {
            if let Some(reason) = e.refusal_reason() {
                self.metrics
                    .refused(p.desc.priority, &p.desc.tenant, reason);
            }
        })?;
        let grant = &opened.grant;
        Span::current().record("worker_id", grant.worker_id.as_str());
        let detok =
            IncrementalDetokenizer::new(self.tokenizer.clone(), p.params.stop.clone(), true)
                .with_prompt(&p.prompt_ids);
        self.metrics.inflight.inc();
        Ok(Generation {
            pipeline: Arc::clone(self),
            serving: Serving {
                worker_id: grant.worker_id.clone(),
                dp_rank: grant.dp_rank,
                // Set from the worker's answer: the grant only offers a
                // prefill worker; the decode worker decides whether to use it.
                prefill_worker_id: String::new(),
                priority: p.desc.priority,
                tenant: p.desc.tenant.clone(),
                queue_wait_ms: grant.queue_wait_ms,
                routed_overlap_tokens: grant.overlap_tokens,
                fetched_tokens: 0,
                prefix_source_worker_id: grant
                    .prefix_source
                    .as_ref()
                    .map(|s| s.worker_id.clone())
                    .unwrap_or_default(),
                migrations: failed.len() as u32,
                ttft_target_ms: grant.ttft_target_ms,
                predicted_queue_wait_ms: grant.predicted_wait_ms,
                routed_ttft_ms: grant.routed_ttft_ms,
                routed_within_target: grant.routed_within_target,
                tpot_target_ms: grant.tpot_target_ms,
                tpot_ms: None,
                tpot_target_met: None,
                ttft_ms: 0.0,
                ttft_target_met: false,
            },
            lease: Some(opened.lease),
            stream: Some(opened.stream),
            detok,
            usage: common::Usage {
                prompt_tokens: p.prompt_ids.len() as u32,
                completion_tokens: 0,
                cached_tokens: 0,
            },
            want_logprobs: p.params.sampling.logprobs,
            priority_label,
            received: p.received,
            first_token: None,
            last_token: None,
            deadline,
            pending: VecDeque::new(),
            finished: false,
            failed: None,
            span: opened.span,
            generated: Vec::new(),
            lease_base: 0,
            reported: 0,
            failed_workers: failed,
            request: p,
        })
    }

    /// Admission, then `Generate` on the granted worker, never one of
    /// `failed`, both within `deadline`. A granted worker that is dead but
    /// still registered (refused connection, reset) joins `failed` and the
    /// request is placed again, at most `retries` times.
    pub(super) async fn open(
        &self,
        p: &Prepared,
        deadline: Instant,
        failed: &mut Vec<String>,
        retries: u32,
    ) -> Result<Opened, FrontendError> {
        let mut left = retries;
        loop {
            match self.open_once(p, deadline, failed).await {
                Ok(opened) => return Ok(opened),
                Err(Failure::Worker { worker_id, error })
                    if left > 0 && Instant::now() < deadline =>
                {
                    tracing::warn!(%worker_id, error = ?error, "granted worker failed the request; placing it again");
                    failed.push(worker_id);
                    left -= 1;
                }
                Err(failure) => return Err(failure.into_error()),
            }
        }
    }

    async fn open_once(
        &self,
        p: &Prepared,
        deadline: Instant,
        exclude: &[String],
    ) -> Result<Opened, Failure> {
        let admit = self.admit(p, exclude).instrument(tracing::info_span!(
            "queue.admit",
            priority = p.desc.priority,
            tenant = %p.desc.tenant,
        ));
        let (lease, grant) = tokio::time::timeout_at(deadline.into(), admit)
            .await
            .map_err(|_| FrontendError::Deadline)??;
        self.metrics
            .queue_wait
            .with_label_values(&[&p.desc.priority.to_string()])
            .observe(grant.queue_wait_ms / 1000.0);

        let span = tracing::info_span!(
            "worker.generate",
            worker_id = %grant.worker_id,
            prefill_worker_id = %grant.prefill_worker_id,
            ttft_target_ms = grant.ttft_target_ms,
            predicted_queue_wait_ms = grant.predicted_wait_ms,
            ttft_ms = tracing::field::Empty,
            ttft_target_met = tracing::field::Empty,
            tpot_target_ms = grant.tpot_target_ms,
            tpot_ms = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
            fetched_tokens = tracing::field::Empty,
            prefix_source = grant.prefix_source.as_ref().map(|s| s.worker_id.as_str()),
        );
        let channel = self.channels.get(&grant.worker_endpoint)?;
        let req = wpb::GenerateRequest {
            request_id: p.desc.request_id.clone(),
            model: self.model.clone(),
            prompt_token_ids: p.prompt_ids.clone(),
            sampling: Some(p.params.sampling.clone()),
            priority: p.desc.priority,
            dp_rank: grant.dp_rank,
            prefill_worker_id: grant.prefill_worker_id.clone(),
            prefill_worker_endpoint: grant.prefill_worker_endpoint.clone(),
            // The router counts this request's load until its lease ends.
            placed: true,
            prefix_source: grant.prefix_source.clone(),
            ttft_budget_ms: ttft_budget_ms(grant.ttft_target_ms, p.received, p.first_token_sent),
            tpot_target_ms: grant.tpot_target_ms,
        };
        let mut stream =
            span.in_scope(|| self.generations.start(&grant.worker_endpoint, channel, req));
        // The worker's first message (or its refusal) before the request
        // counts as started: a worker that cannot take it leaves the
        // request free to be placed again.
        let answer = tokio::time::timeout_at(deadline.into(), stream.first())
            .await
            .map_err(|_| FrontendError::Deadline)?;
        if let Err(s) = answer {
            lease.done(0);
            let failed = worker_failed(&s);
            let error = FrontendError::from_status("worker", s, &self.model);
            return Err(Failure::of_worker(&grant.worker_id, failed, error));
        }
        Ok(Opened {
            lease,
            grant,
            stream,
            span,
        })
    }

    /// An admission lease and its grant from one of the queues: a queue
    /// that fails (unreachable, reset, draining, its placement failed) is
    /// passed over for another, each tried once; nothing was sent to a
    /// worker yet, so trying again is safe.
    async fn admit(&self, p: &Prepared, exclude: &[String]) -> Result<Admitted, FrontendError> {
        if self.workers.count(&self.model) == 0 {
            return Err(FrontendError::NoWorkers {
                model: self.model.clone(),
            });
        }
        if self.routers.count("") == 0 {
            return Err(FrontendError::Unavailable {
                component: "router",
                message: "no router instance is registered".into(),
            });
        }
        let mut tried = Vec::new();
        let mut last = None;
        while let Some(queue) = self.queues.pick(&tried) {
            match self.admit_at(&queue, p, exclude).await {
                Ok(admitted) => {
                    self.queues.cleared(&queue.id);
                    return Ok(admitted);
                }
                Err(QueueFailure::Answer(e)) => return Err(e),
                Err(QueueFailure::Queue(e)) => {
                    tracing::warn!(queue = %queue.id, endpoint = %queue.endpoint, error = %e, "queue failed the admission; trying another");
                    self.queues.suspect(&queue.id);
                    self.metrics.failovers.with_label_values(&["queue"]).inc();
                    tried.push(queue.id);
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(FrontendError::Unavailable {
            component: "queue",
            message: "no queue instance is registered".into(),
        }))
    }

    /// Admission at `queue`.
    async fn admit_at(
        &self,
        queue: &sluice_runtime::Instance,
        p: &Prepared,
        exclude: &[String],
    ) -> Result<Admitted, QueueFailure> {
        let channel = self.channels.get(&queue.endpoint)?;
        let remaining = p
            .params
            .timeout
            .map(|t| t.saturating_sub(p.received.elapsed()));
        let mut description = p.desc.to_wire();
        description.exclude_worker_ids = exclude.to_vec();
        let open = qpb::AdmitOpen {
            description: Some(description),
            deadline_ms: remaining
                .map(|d| d.as_millis().min(u128::from(u32::MAX)) as u32)
                .unwrap_or(0),
        };
        let mut lease = self.leases.open(&queue.endpoint, channel, open);
        // The queue answers as soon as it has the request, before any hold
        // (`opened` when nothing else is ready at once): one that does not
        // within the timeout is hung or frozen (its connection may still be
        // open) and another one may admit the request. A queue that hangs
        // later, while it holds the request, is found by the channel's
        // keepalive.
        let mut event = tokio::time::timeout(self.queue_answer_timeout, lease.next())
            .await
            .map_err(|_| {
                QueueFailure::Queue(FrontendError::Unavailable {
                    component: "queue",
                    message: format!(
                        "the queue did not answer the admission within {} ms",
                        self.queue_answer_timeout.as_millis()
                    ),
                })
            })?;
        loop {
            match event {
                Some(LeaseEvent::Grant(g)) => return Ok((lease, *g)),
                Some(LeaseEvent::Held(h)) => {
                    tracing::debug!(position = h.position, pending = h.pending, reason = %h.reason, "held by the queue");
                }
                Some(LeaseEvent::Opened) => {}
                Some(LeaseEvent::Failed(s)) => return Err(queue_failure(*s, &self.model)),
                None => {
                    return Err(QueueFailure::Queue(FrontendError::Unavailable {
                        component: "queue",
                        message: "the queue closed the lease without a grant".into(),
                    }));
                }
            }
            event = lease.next().await;
        }
    }
}

/// What is left of the request's TTFT target of `target_ms` from when it
/// was `received`, for the worker to refuse it if its engine has not
/// started it by then (0 = no target; a target already passed leaves
/// 1 ms). A migrating request (`first_token_sent`) had its first token.
fn ttft_budget_ms(target_ms: u32, received: Instant, first_token_sent: bool) -> u32 {
    if target_ms == 0 || first_token_sent {
        return 0;
    }
    let left = u128::from(target_ms).saturating_sub(received.elapsed().as_millis());
    u32::try_from(left).unwrap_or(u32::MAX).max(1)
}

/// Whether a queue's error means the queue failed, so another one may
/// admit the request: the queue itself names the reason on every
/// answer (`sluice-reason`); an error without one came from the
/// transport (refused, reset, gone mid-stream).
fn queue_failure(s: tonic::Status, model: &str) -> QueueFailure {
    use tonic::Code;
    let reason = QueueReason::of_status(&s);
    let queue_failed = match reason {
        Some(reason) => reason.another_queue_may_admit(),
        None => worker_failed(&s),
    };
    let error = if reason == Some(QueueReason::NoRouter) {
        FrontendError::Unavailable {
            component: "router",
            message: s.message().to_string(),
        }
    } else if reason == Some(QueueReason::NoWorkers) || s.code() == Code::NotFound {
        FrontendError::NoWorkers {
            model: model.to_owned(),
        }
    } else {
        FrontendError::from_status("queue", s, model)
    };
    if queue_failed {
        QueueFailure::Queue(error)
    } else {
        QueueFailure::Answer(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn answered(code: Code, reason: QueueReason) -> tonic::Status {
        let mut s = tonic::Status::new(code, "said the queue");
        s.metadata_mut().insert(
            sluice_proto::REASON_HEADER,
            tonic::metadata::MetadataValue::from_static(reason.label()),
        );
        s
    }

    #[test]
    fn the_worker_gets_what_is_left_of_the_target_and_a_migration_none() {
        let ago = |ms| {
            Instant::now()
                .checked_sub(Duration::from_millis(ms))
                .expect("the clock is past that")
        };
        assert_eq!(ttft_budget_ms(0, ago(0), false), 0, "no target");
        let left = ttft_budget_ms(1_000, ago(100), false);
        assert!((400..=900).contains(&left), "{left}");
        assert_eq!(
            ttft_budget_ms(1_000, ago(2_000), false),
            1,
            "passed: refused at once"
        );
        assert_eq!(
            ttft_budget_ms(1_000, ago(100), true),
            0,
            "a migration had its first token: no target applies"
        );
    }

    /// Failover turns on the queue's own reason, never on a message: a
    /// queue that is going away or cannot place sends the request to
    /// another replica; an answer about the request holds at any replica;
    /// an error no queue named is the transport's.
    #[test]
    fn the_queues_reason_decides_failover() {
        let failover = |s| matches!(queue_failure(s, "m"), QueueFailure::Queue(_));
        assert!(failover(answered(Code::Unavailable, QueueReason::Draining)));
        assert!(failover(answered(
            Code::Unavailable,
            QueueReason::Placement
        )));
        assert!(failover(tonic::Status::unavailable("connection refused")));
        assert!(!failover(answered(
            Code::ResourceExhausted,
            QueueReason::QueueFull
        )));
        assert!(!failover(answered(
            Code::ResourceExhausted,
            QueueReason::TtftTargetUnmeetable
        )));
        assert!(!failover(tonic::Status::invalid_argument("bad")));

        match queue_failure(answered(Code::Unavailable, QueueReason::NoRouter), "m") {
            QueueFailure::Queue(FrontendError::Unavailable { component, .. }) => {
                assert_eq!(component, "router");
            }
            other => panic!("{other:?}"),
        }
        match queue_failure(answered(Code::NotFound, QueueReason::NoWorkers), "m") {
            QueueFailure::Answer(FrontendError::NoWorkers { model }) => assert_eq!(model, "m"),
            other => panic!("{other:?}"),
        }
    }
}
