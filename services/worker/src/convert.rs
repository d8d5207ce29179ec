//! Wire ⇄ engine conversions for the worker API. Bad input is
//! `InvalidArgument` naming the field.

use sluice_engine as engine;
use sluice_proto::common::v1 as common;
use sluice_proto::worker::v1 as pb;
use sluice_runtime::limits;
use sluice_tokens::grammar::{Constraint, GrammarSpec};

use crate::error::WorkerError;

/// Sampling parameters from the wire, validated by the engine later.
pub fn sampling(s: Option<common::SamplingParams>) -> engine::SamplingParams {
    let s = s.unwrap_or_default();
    engine::SamplingParams {
        max_tokens: (s.max_tokens > 0).then_some(s.max_tokens as usize),
        min_tokens: s.min_tokens as usize,
        temperature: s.temperature.unwrap_or(1.0),
        top_k: s.top_k as usize,
        top_p: s.top_p.unwrap_or(1.0),
        seed: s.seed,
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        stop_token_ids: s.stop_token_ids,
        ignore_eos: s.ignore_eos,
        logprobs: s.logprobs || s.top_logprobs > 0,
        top_logprobs: s.top_logprobs as usize,
    }
}

/// Checks a prompt and its sampling parameters for `engine` with the rules
/// every boundary applies ([`sluice_runtime::limits`]): token ids in the
/// vocabulary, a prompt that fits the model with room for output, the
/// sampling limits, bounded ids. `Generate` and `Prefill` both call it
/// before anything reaches the engine.
pub fn check_input(
    engine: &engine::EngineHandle,
    request_id: &str,
    prompt: &[u32],
    sampling: Option<&common::SamplingParams>,
) -> Result<(), WorkerError> {
    limits::check_id("request_id", request_id)?;
    limits::check_prompt_len("prompt_token_ids", prompt.len(), engine.max_len())?;
    limits::check_token_ids("prompt_token_ids", prompt, engine.vocab_size())?;
    if let Some(s) = sampling {
        limits::check_sampling(s)?;
        limits::check_token_ids(
            "sampling.stop_token_ids",
            &s.stop_token_ids,
            engine.vocab_size(),
        )?;
    }
    Ok(())
}

/// An engine request from a worker `Generate` call for `engine`, checked.
pub(crate) fn request(
    r: &pb::GenerateRequest,
    engine: &engine::EngineHandle,
) -> Result<engine::Request, WorkerError> {
    check_input(
        engine,
        &r.request_id,
        &r.prompt_token_ids,
        r.sampling.as_ref(),
    )?;
    limits::check_id("prefill_worker_id", &r.prefill_worker_id)?;
    limits::check_id("prefill_worker_endpoint", &r.prefill_worker_endpoint)?;
    limits::check_priority("priority", r.priority, "priority", 0)?;
    Ok(engine::Request {
        request_id: r.request_id.clone(),
        prompt: r.prompt_token_ids.clone(),
        sampling: sampling(r.sampling.clone()),
        priority: r.priority,
        constraint: constraint(r.sampling.as_ref(), engine)?,
        first_token_by: first_token_by(r.ttft_budget_ms),
        tpot_target: tpot_target(r.tpot_target_ms),
    })
}

/// A TPOT target from the wire (0 = none).
pub(crate) fn tpot_target(ms: u32) -> Option<std::time::Duration> {
    (ms > 0).then(|| std::time::Duration::from_millis(u64::from(ms)))
}

/// The deadline a TTFT budget from the wire sets from now (0 = none).
pub fn first_token_by(budget_ms: u32) -> Option<std::time::Instant> {
    (budget_ms > 0)
        .then(|| std::time::Instant::now() + std::time::Duration::from_millis(budget_ms.into()))
}

/// What is left of a deadline, as a TTFT budget for the wire (0 = none; a
/// deadline already passed leaves 1 ms, refused at once).
pub fn ttft_budget_ms(first_token_by: Option<std::time::Instant>) -> u32 {
    first_token_by.map_or(0, |by| {
        let left = by.saturating_duration_since(std::time::Instant::now());
        u32::try_from(left.as_millis()).unwrap_or(u32::MAX).max(1)
    })
}

const STRUCTURED: &str = "sampling.structured_output";

/// The grammar a request's output must match, from the wire.
pub(crate) fn grammar_spec(
    s: &common::StructuredOutput,
) -> Result<Option<GrammarSpec>, WorkerError> {
    use common::structured_output::Kind;
    let bad = |message: String| WorkerError::InvalidArgument {
        field: STRUCTURED,
        message,
    };
    Ok(match &s.kind {
        None | Some(Kind::JsonObject(false)) => None,
        Some(Kind::JsonObject(true)) => Some(GrammarSpec::JsonObject),
        Some(Kind::JsonSchema(text)) => Some(GrammarSpec::JsonSchema(
            serde_json::from_str(text)
                .map_err(|e| bad(format!("json_schema is not valid JSON: {e}")))?,
        )),
        Some(Kind::Regex(rx)) => Some(GrammarSpec::Regex(rx.clone())),
        Some(Kind::Lark(lark)) => Some(GrammarSpec::Lark(lark.clone())),
    })
}

/// A compiled constraint for a request that asks for structured output.
fn constraint(
    s: Option<&common::SamplingParams>,
    engine: &engine::EngineHandle,
) -> Result<Option<Constraint>, WorkerError> {
    let Some(spec) = s
        .and_then(|s| s.structured_output.as_ref())
        .map(grammar_spec)
        .transpose()?
        .flatten()
    else {
        return Ok(None);
    };
    // The mocker picks its tokens without sampling: no mask applies (and
    // one computed at its real cost every step would dwarf its sped-up
    // steps).
    if engine.backend_name() == "mocker" {
        return Ok(None);
    }
    let grammars = engine.grammars().ok_or(WorkerError::InvalidArgument {
        field: STRUCTURED,
        message: "this model's tokenizer cannot constrain decoding (neither byte-level BPE nor byte fallback)".into(),
    })?;
    grammars
        .constrain(&spec)
        .map(Some)
        .map_err(|e| WorkerError::InvalidArgument {
            field: STRUCTURED,
            message: e.to_string(),
        })
}

/// One generated position's logprobs on the wire: the only engine → wire
/// logprob conversion (`Generate`'s tokens, `Prefill`'s first token).
pub fn logprobs_to_wire(l: &engine::PositionLogprobs) -> common::PositionLogprobs {
    let token = |t: &engine::TokenLogprob| common::TokenLogprob {
        token_id: t.token_id,
        logprob: t.logprob,
    };
    common::PositionLogprobs {
        chosen: Some(token(&l.chosen)),
        top: l.top.iter().map(token).collect(),
    }
}

/// A position's logprobs from the wire (a prefill worker's first token),
/// the inverse of [`logprobs_to_wire`]; `None` without a chosen token.
pub fn logprobs_from_wire(l: &common::PositionLogprobs) -> Option<engine::PositionLogprobs> {
    let token = |t: &common::TokenLogprob| engine::TokenLogprob {
        token_id: t.token_id,
        logprob: t.logprob,
    };
    Some(engine::PositionLogprobs {
        chosen: token(l.chosen.as_ref()?),
        top: l.top.iter().map(token).collect(),
    })
}

pub(crate) fn finish_reason(r: engine::FinishReason) -> common::FinishReason {
    match r {
        engine::FinishReason::Stop => common::FinishReason::Stop,
        engine::FinishReason::Length => common::FinishReason::Length,
        engine::FinishReason::Abort => common::FinishReason::Abort,
        engine::FinishReason::Error => common::FinishReason::Error,
        // Never sent as a finish: the stream's error status says it (a
        // refusal before any token), see `Reply::message`.
        engine::FinishReason::TtftTargetMissed => common::FinishReason::Abort,
    }
}

pub(crate) fn usage(u: engine::Usage) -> common::Usage {
    common::Usage {
        prompt_tokens: u.prompt_tokens as u32,
        completion_tokens: u.completion_tokens as u32,
        cached_tokens: u.cached_tokens as u32,
    }
}

pub(crate) fn kv_event(r: &engine::KvEventRecord) -> pb::KvEvent {
    let kind = match &r.event {
        engine::KvEvent::Stored {
            parent_hash,
            block_hashes,
        } => pb::kv_event::Kind::Stored(pb::BlocksStored {
            parent_hash: *parent_hash,
            block_hashes: block_hashes.clone(),
        }),
        engine::KvEvent::Removed { block_hashes } => {
            pb::kv_event::Kind::Removed(pb::BlocksRemoved {
                block_hashes: block_hashes.clone(),
            })
        }
        engine::KvEvent::Moved { block_hashes, tier } => {
            pb::kv_event::Kind::Moved(pb::BlocksMoved {
                block_hashes: block_hashes.clone(),
                tier: *tier,
            })
        }
        engine::KvEvent::Cleared => pb::kv_event::Kind::Cleared(pb::AllBlocksCleared {}),
    };
    pb::KvEvent {
        seq: r.seq,
        kind: Some(kind),
    }
}

pub(crate) fn load(rank: u32, l: &engine::LoadStats, prefill_queue: u32) -> pb::LoadReport {
    pb::LoadReport {
        dp_rank: rank,
        running: l.running as u32,
        waiting: l.waiting as u32,
        kv_usage: l.kv_usage,
        active_blocks: l.active_blocks as u64,
        total_blocks: l.total_blocks as u64,
        pending_prefill_tokens: l.pending_prefill_tokens as u64,
        max_num_seqs: l.max_num_seqs as u32,
        max_num_batched_tokens: l.max_num_batched_tokens as u32,
        priority_scheduling: l.priority_scheduling,
        long_prefill_token_threshold: l.long_prefill_token_threshold as u32,
        step_time_us: l.step_time_us,
        prefill_ns_per_token: l.prefill_ns_per_token,
        prefill_step_us: l.prefill_step_us,
        prefill_first_steps: l.prefill_first_steps as u32,
        stalled_in_a_row: l.stalled_in_a_row as u32,
        prefilling: l.prefilling as u32,
        decode_base_us: l.decode_base_us,
        decode_ns_per_seq: l.decode_ns_per_seq,
        prefill_queue,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A budget becomes a deadline and back, as a remote prefill passes it
    /// on: none stays none, a passed deadline is refused at once.
    #[test]
    fn a_ttft_budget_and_its_deadline_convert_both_ways() {
        assert_eq!(tpot_target(0), None, "no target");
        assert_eq!(tpot_target(50), Some(std::time::Duration::from_millis(50)));
        assert_eq!(first_token_by(0), None);
        assert_eq!(ttft_budget_ms(None), 0);
        let left = ttft_budget_ms(first_token_by(60_000));
        assert!((59_000..=60_000).contains(&left), "{left}");
        let passed = std::time::Instant::now()
            .checked_sub(std::time::Duration::from_secs(1))
            .expect("the clock is past that");
        assert_eq!(ttft_budget_ms(Some(passed)), 1);
    }

    #[test]
    fn the_load_report_carries_the_scheduling_policy() {
        let priority = engine::LoadStats {
            priority_scheduling: true,
            ..Default::default()
        };
        assert!(load(0, &priority, 0).priority_scheduling);
        assert!(!load(0, &engine::LoadStats::default(), 0).priority_scheduling);
    }

    #[test]
    fn the_load_report_carries_the_long_prefill_threshold() {
        let stats = engine::LoadStats {
            long_prefill_token_threshold: 256,
            ..Default::default()
        };
        assert_eq!(load(0, &stats, 0).long_prefill_token_threshold, 256);
    }

    #[test]
    fn logprobs_go_to_the_wire_and_back_unchanged() {
        let token = |token_id, logprob| engine::TokenLogprob { token_id, logprob };
        let position = engine::PositionLogprobs {
            chosen: token(7, -0.5),
            top: vec![token(7, -0.5), token(3, -1.25)],
        };
        let wire = logprobs_to_wire(&position);
        assert_eq!(wire.chosen.map(|c| c.token_id), Some(7));
        assert_eq!(wire.top.len(), 2);
        assert_eq!(logprobs_from_wire(&wire), Some(position));
        let no_choice = common::PositionLogprobs {
            chosen: None,
            top: wire.top,
        };
        assert_eq!(logprobs_from_wire(&no_choice), None);
    }
}
