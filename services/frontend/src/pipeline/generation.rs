//! A running request's stream back: the worker's tokens detokenized (stop
//! strings, logprobs), usage and timing recorded, the lease told of
//! progress and ended, and the request migrated to another worker when its
//! worker fails mid-stream.

use super::*;

impl Generation {
    /// Tokens generated so far, across workers: `generated` is the one
    /// count (the usage reported takes it from there).
    fn completion_tokens(&self) -> u32 {
        u32::try_from(self.generated.len()).unwrap_or(u32::MAX)
    }

    /// The next event; `None` after `Done` or an error.
    pub(crate) async fn next(&mut self) -> Option<Result<Event, FrontendError>> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(Ok(e));
            }
            if self.finished {
                return self.failed.take().map(Err);
            }
            if let Err(failure) = self.read().await {
                if let Failure::Worker { error, .. } = &failure
                    && self.migrate(error).await
                {
                    continue;
                }
                let e = failure.into_error();
                self.finished = true;
                self.record_end(&e);
                // What the failing message carried goes out first.
                self.failed = Some(e);
            }
        }
    }

    /// Moves the request to another worker after its worker failed with
    /// `cause`: a new lease that excludes every failed worker, and a
    /// `Generate` of the prompt plus the tokens already streamed for the
    /// tokens still to come. The client's stream goes on. `false` when the
    /// limit is reached, the deadline has passed or no worker takes it.
    async fn migrate(&mut self, cause: &FrontendError) -> bool {
        // Its own handle (a migration is rare): `self` ends the lease below.
        let p = Arc::clone(&self.pipeline);
        let done = self.generated.len() as u32;
        let wanted = self.request.params.sampling.max_tokens;
        if self.failed_workers.len() as u32 >= p.migration_limit
            || Instant::now() >= self.deadline
            || (wanted > 0 && done >= wanted)
        {
            return false;
        }
        self.failed_workers.push(self.serving.worker_id.clone());
        let mut next = self.request.clone();
        next.first_token_sent = self.first_token.is_some();
        next.prompt_ids.extend_from_slice(&self.generated);
        if wanted > 0 {
            next.params.sampling.max_tokens = wanted - done;
        }
        next.desc = Prepared::describe(
            &next.desc.model,
            &next.params,
            &next.prompt_ids,
            next.desc.block_size as usize,
        );
        tracing::warn!(
            parent: &self.span,
            worker_id = %self.serving.worker_id,
            error = ?cause,
            streamed_tokens = done,
            "worker failed mid-stream; moving the request to another worker"
        );
        // The failed worker's stream is gone; its lease ends now.
        self.stream = None;
        self.end_lease();
        self.lease_base = self.completion_tokens();
        self.reported = 0;
        let retries = p
            .migration_limit
            .saturating_sub(self.failed_workers.len() as u32);
        let outcome = match p
            .open(&next, self.deadline, &mut self.failed_workers, retries)
            .await
        {
            Ok(opened) => {
                self.serving.migrations = self.failed_workers.len() as u32;
                self.serving.worker_id = opened.grant.worker_id.clone();
                self.serving.dp_rank = opened.grant.dp_rank;
                self.serving.queue_wait_ms += opened.grant.queue_wait_ms;
                self.lease = Some(opened.lease);
                self.stream = Some(opened.stream);
                self.span = opened.span;
                "ok"
            }
            Err(e) => {
                tracing::warn!(parent: &self.span, error = ?e, "no worker took the migrating request");
                "failed"
            }
        };
        p.metrics.migrations.with_label_values(&[outcome]).inc();
        outcome == "ok"
    }

    /// Reads one worker message into `pending`. A failure of the worker
    /// itself (transport error, reset, unfinished end) is `Failure::Worker`.
    async fn read(&mut self) -> Result<(), Failure> {
        let msg = self.next_message().await?;
        self.note_usage(&msg);
        self.note_timing(&msg);
        let (mut delta, stopped) = self.take_tokens(&msg)?;
        let reason = match stopped {
            Some(r) => Ok(Some(r)),
            None => finish_reason(&msg, &self.serving.worker_id),
        };
        match reason {
            Ok(Some(_)) if stopped.is_none() => {
                delta.text.push_str(&self.detok.flush()?.text);
            }
            Ok(None) => self.report_progress(),
            _ => {}
        }
        // Tokens that ride with a worker's failure (a worker sends what its
        // engine produced before the failing step in one message when its
        // reader fell behind) were produced and counted: the client gets
        // their text before the request moves on.
        if !delta.text.is_empty() || !delta.token_ids.is_empty() {
            self.pending.push_back(Event::Delta {
                text: delta.text,
                token_ids: delta.token_ids,
                logprobs: delta.logprobs,
            });
        }
        let reason = reason?;
        if let Some(r) = reason {
            self.finished = true;
            // The lease ends before the client hears of the end, so the
            // router has stopped counting this request by the time the
            // client's next one (a conversation's next turn) arrives.
            self.end_lease();
            self.record_tpot();
            self.pending.push_back(Event::Done {
                finish_reason: r,
                usage: common::Usage {
                    completion_tokens: self.completion_tokens(),
                    ..self.usage
                },
                serving: self.serving.clone(),
            });
            self.record_end_ok();
        }
        Ok(())
    }

    /// The worker's next message, before the deadline; a failed or cut
    /// stream is a worker failure (the request may move).
    async fn next_message(&mut self) -> Result<wpb::GenerateResponse, Failure> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(FrontendError::internal("worker stream already closed").into());
        };
        match tokio::time::timeout_at(self.deadline.into(), stream.message()).await {
            Err(_) => Err(FrontendError::Deadline.into()),
            Ok(Err(s)) => {
                let failed = worker_failed(&s);
                let error = FrontendError::from_status("worker", s, &self.pipeline.model);
                Err(Failure::of_worker(&self.serving.worker_id, failed, error))
            }
            Ok(Ok(None)) => {
                let error = FrontendError::Unavailable {
                    component: "worker",
                    message: "the worker ended the stream before finishing".into(),
                };
                Err(Failure::of_worker(&self.serving.worker_id, true, error))
            }
            Ok(Ok(Some(m))) => Ok(m),
        }
    }

    /// Usage and the prefill worker, as the worker reports them.
    fn note_usage(&mut self, msg: &wpb::GenerateResponse) {
        if let Some(u) = &msg.usage {
            if self.serving.migrations == 0 {
                self.usage.prompt_tokens = u.prompt_tokens.max(self.usage.prompt_tokens);
            }
            // After a move the worker's prompt holds the streamed tokens too.
            self.usage.cached_tokens = u.cached_tokens.min(self.usage.prompt_tokens);
        }
        if !msg.prefill_worker_id.is_empty() {
            self.serving.prefill_worker_id = msg.prefill_worker_id.clone();
        }
        if msg.fetched_tokens > 0 {
            self.serving.fetched_tokens = msg.fetched_tokens;
        }
    }

    /// TTFT at the first tokens, inter-token latency after; the lease's
    /// `started` at its first tokens, so the queue and the router stop
    /// counting the prompt as prefill work.
    fn note_timing(&mut self, msg: &wpb::GenerateResponse) {
        if msg.token_ids.is_empty() {
            return;
        }
        // The first tokens on this lease (a migrated request's new lease
        // hears it at its first tokens from the new worker); `take_tokens`
        // counts them after this.
        if self.on_lease() == 0
            && let Some(lease) = &self.lease
        {
            lease.started();
        }
        let now = Instant::now();
        let m = &self.pipeline.metrics;
        match self.last_token {
            None => {
                self.first_token = Some(now);
                let ttft = (now - self.received).as_secs_f64();
                m.ttft
                    .with_label_values(&[&self.priority_label])
                    .observe(ttft);
                m.tenant_ttft(&self.serving.tenant, self.usage.prompt_tokens, ttft);
                let serving = &mut self.serving;
                serving.ttft_ms = ttft * 1000.0;
                serving.ttft_target_met = serving.ttft_target_ms == 0
                    || serving.ttft_ms <= f64::from(serving.ttft_target_ms);
                m.slo(
                    serving.priority,
                    &serving.tenant,
                    if serving.ttft_target_met {
                        "met"
                    } else {
                        "missed"
                    },
                );
                self.span.record("ttft_ms", serving.ttft_ms);
                self.span.record("ttft_target_met", serving.ttft_target_met);
            }
            Some(prev) => {
                let per = (now - prev).as_secs_f64() / msg.token_ids.len() as f64;
                m.itl
                    .with_label_values(&[&self.priority_label])
                    .observe(per);
            }
        }
        self.last_token = Some(now);
    }

    /// Counts and detokenizes the message's tokens; `Some(Stop)` when a
    /// stop string ended the text (dropping the worker stream aborts it).
    fn take_tokens(
        &mut self,
        msg: &wpb::GenerateResponse,
    ) -> Result<(Delta, Option<common::FinishReason>), Failure> {
        let mut delta = Delta {
            text: String::new(),
            token_ids: Vec::with_capacity(msg.token_ids.len()),
            logprobs: Vec::new(),
        };
        for (i, &id) in msg.token_ids.iter().enumerate() {
            self.generated.push(id);
            delta.token_ids.push(id);
            if self.want_logprobs
                && let Some(lp) = msg.logprobs.get(i)
            {
                delta.logprobs.push(self.pipeline.logprob_entry(lp));
            }
            delta.text.push_str(&self.detok.push(id)?.text);
            if self.detok.is_stopped() {
                return Ok((delta, Some(common::FinishReason::Stop)));
            }
        }
        Ok((delta, None))
    }

    /// Output tokens produced on the current lease.
    fn on_lease(&self) -> u32 {
        self.completion_tokens().saturating_sub(self.lease_base)
    }

    /// Ends the admission lease (if still held), reporting the tokens
    /// produced under it.
    fn end_lease(&mut self) {
        let on_lease = self.on_lease();
        if let Some(lease) = self.lease.take() {
            lease.done(on_lease);
        }
    }

    /// Tells the queue the lease's output so far, at most once per
    /// [`PROGRESS_TOKENS`].
    fn report_progress(&mut self) {
        let on_lease = self.on_lease();
        if on_lease < self.reported + PROGRESS_TOKENS {
            return;
        }
        if let Some(lease) = &self.lease {
            lease.progress(on_lease);
            self.reported = on_lease;
        }
    }

    /// The mean time per output token after the first, and whether it met
    /// the request's TPOT target, into `serving` and the span.
    fn record_tpot(&mut self) {
        let tokens = self.completion_tokens();
        let (Some(first), Some(last)) = (self.first_token, self.last_token) else {
            return;
        };
        if tokens < 2 {
            return;
        }
        let tpot_ms = (last - first).as_secs_f64() * 1e3 / f64::from(tokens - 1);
        let serving = &mut self.serving;
        serving.tpot_ms = Some(tpot_ms);
        serving.tpot_target_met =
            (serving.tpot_target_ms > 0).then(|| tpot_ms <= f64::from(serving.tpot_target_ms));
        self.span.record("tpot_ms", tpot_ms);
    }

    fn record_end_ok(&self) {
        let m = &self.pipeline.metrics;
        m.tenant_tokens(&self.serving.tenant, self.completion_tokens());
        m.e2e
            .with_label_values(&[&self.priority_label])
            .observe(self.received.elapsed().as_secs_f64());
        self.span
            .record("completion_tokens", self.completion_tokens());
        self.span.record("cached_tokens", self.usage.cached_tokens);
        self.span
            .record("fetched_tokens", self.serving.fetched_tokens);
    }

    fn record_end(&self, e: &FrontendError) {
        tracing::warn!(parent: &self.span, error = ?e, "generation failed");
    }
}

impl Drop for Generation {
    /// Ends the lease with `done`. An unfinished worker stream (client
    /// gone, stop string, deadline) is dropped with it: that is the
    /// cancellation.
    fn drop(&mut self) {
        self.pipeline.metrics.inflight.dec();
        self.end_lease();
    }
}

impl Pipeline {
    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The one wire → client conversion of a position's logprobs.
    fn logprob_entry(&self, lp: &common::PositionLogprobs) -> TokenLogprob {
        let chosen = lp.chosen.unwrap_or_default();
        TokenLogprob {
            wire: lp.clone(),
            token: self.token_text(chosen.token_id),
            logprob: chosen.logprob,
            top: lp
                .top
                .iter()
                .map(|t| (self.token_text(t.token_id), t.logprob))
                .collect(),
        }
    }
}

/// Why the worker ended the request, if it did; a sequence the worker
/// failed (its batch went on) moves elsewhere like a worker failure.
fn finish_reason(
    msg: &wpb::GenerateResponse,
    worker_id: &str,
) -> Result<Option<common::FinishReason>, Failure> {
    use common::FinishReason;
    match FinishReason::try_from(msg.finish_reason).unwrap_or(FinishReason::Unspecified) {
        FinishReason::Unspecified => Ok(None),
        FinishReason::Error => {
            let error = FrontendError::Unavailable {
                component: "worker",
                message: "the worker failed the request mid-stream".into(),
            };
            Err(Failure::of_worker(worker_id, true, error))
        }
        reason @ (FinishReason::Stop | FinishReason::Length | FinishReason::Abort) => {
            Ok(Some(reason))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that ends a request with `ERROR` failed it mid-stream: a
    /// worker failure, so the request migrates; the other reasons end it.
    #[test]
    fn an_error_finish_is_a_worker_failure_the_rest_end_the_request() {
        use common::FinishReason;
        let msg = |r: FinishReason| wpb::GenerateResponse {
            finish_reason: r as i32,
            ..Default::default()
        };
        assert!(matches!(
            finish_reason(&msg(FinishReason::Error), "w1"),
            Err(Failure::Worker { worker_id, .. }) if worker_id == "w1"
        ));
        assert!(matches!(
            finish_reason(&msg(FinishReason::Unspecified), "w1"),
            Ok(None)
        ));
        for r in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Abort,
        ] {
            assert!(
                matches!(finish_reason(&msg(r), "w1"), Ok(Some(x)) if x == r),
                "{r:?}"
            );
        }
        let unknown = wpb::GenerateResponse {
            finish_reason: 99,
            ..Default::default()
        };
        assert!(matches!(finish_reason(&unknown, "w1"), Ok(None)));
    }
}
