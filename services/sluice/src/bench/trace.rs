//! Mooncake-style JSONL traces: parsing, and turning a row's `hash_ids` into
//! prompt token ids so that equal ids mean equal prefixes.
//!
//! A row is one JSON object per line: `timestamp` (ms from the start of the
//! trace, integer or float), `input_length` and `output_length` (tokens),
//! `hash_ids` (one id per `--trace-block-size` prompt tokens, 512 in the
//! Mooncake release; equal ids are a reusable prefix), and optionally
//! `priority` or `extra.nvext.agent_hints.priority`. Other fields are
//! ignored. Blank lines are skipped; any other bad row is an error naming
//! its line number.
//!
//! Expansion: with `--trace-scale S`, one hash id becomes a block of
//! `block_size / S` token ids that depend only on the id (never on the row),
//! and the prompt is `ceil(input_length / S)` tokens long: the first blocks
//! come from the hash ids, a tail past them gets ids unique to the row. So
//! two rows that share their first k hash ids share exactly their first
//! k blocks of tokens, at any scale.

use std::path::Path;

use serde::Deserialize;

use super::BenchError;

/// One parsed trace row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TraceRow {
    /// 1-based line number in the file.
    pub line: usize,
    /// Arrival, ms from the start of the trace.
    pub timestamp_ms: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
    pub priority: Option<i32>,
}

#[derive(Debug, Deserialize)]
struct RawRow {
    timestamp: Option<f64>,
    input_length: Option<u64>,
    output_length: Option<u64>,
    #[serde(default)]
    hash_ids: Vec<u64>,
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    extra: Option<RawExtra>,
}

#[derive(Debug, Deserialize)]
struct RawExtra {
    #[serde(default)]
    nvext: Option<RawNvext>,
}

#[derive(Debug, Deserialize)]
struct RawNvext {
    #[serde(default)]
    agent_hints: Option<RawHints>,
}

#[derive(Debug, Deserialize)]
struct RawHints {
    #[serde(default)]
    priority: Option<i32>,
}

/// Reads and parses a trace file.
pub(crate) fn read_trace(path: &Path, block_size: u64) -> Result<Vec<TraceRow>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::ReadTrace {
        path: path.to_path_buf(),
        source,
    })?;
    parse_trace(&text, block_size)
}

/// Parses trace text; `block_size` is the number of tokens one hash id stands for.
pub(crate) fn parse_trace(text: &str, block_size: u64) -> Result<Vec<TraceRow>, BenchError> {
    let mut rows = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        rows.push(parse_row(raw, line, block_size)?);
    }
    if rows.is_empty() {
        return Err(BenchError::EmptyTrace);
    }
    Ok(rows)
}

fn parse_row(raw: &str, line: usize, block_size: u64) -> Result<TraceRow, BenchError> {
    let bad = |reason: String| BenchError::TraceRow { line, reason };
    let row: RawRow =
        serde_json::from_str(raw).map_err(|e| bad(format!("not a valid trace row: {e}")))?;
    let timestamp_ms = row
        .timestamp
        .ok_or_else(|| bad("missing `timestamp` (ms from the start)".into()))?;
    if !timestamp_ms.is_finite() || timestamp_ms < 0.0 {
        return Err(bad(format!(
            "`timestamp` must be a non-negative number of ms, got {timestamp_ms}"
        )));
    }
    let input_length = row
        .input_length
        .ok_or_else(|| bad("missing `input_length`".into()))?;
    if input_length == 0 {
        return Err(bad("`input_length` must be at least 1".into()));
    }
    let output_length = row
        .output_length
        .ok_or_else(|| bad("missing `output_length`".into()))?;
    if output_length == 0 {
        return Err(bad("`output_length` must be at least 1".into()));
    }
    let max_blocks = input_length.div_ceil(block_size);
    if row.hash_ids.len() as u64 > max_blocks {
        return Err(bad(format!(
            "{} hash_ids but input_length {input_length} fills only {max_blocks} block(s) of \
             {block_size} tokens (is --trace-block-size right?)",
            row.hash_ids.len()
        )));
    }
    let nested = row
        .extra
        .and_then(|e| e.nvext)
        .and_then(|n| n.agent_hints)
        .and_then(|h| h.priority);
    let priority = match (row.priority, nested) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(format!(
                "`priority` {a} and `extra.nvext.agent_hints.priority` {b} disagree"
            )));
        }
        (a, b) => a.or(b),
    };
    Ok(TraceRow {
        line,
        timestamp_ms,
        input_length,
        output_length,
        hash_ids: row.hash_ids,
        priority,
    })
}

/// SplitMix64: a fast, well-mixed 64-bit permutation (for token ids only).
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A token id in `1..vocab` (0 is left out: it is often a special token).
pub(crate) fn token_id(stream: u64, position: u64, vocab: u32) -> u32 {
    let span = u64::from(vocab.max(2) - 1);
    (1 + mix64(mix64(stream) ^ position) % span) as u32
}

/// Distinguishes the streams of hash-id blocks from per-request tails.
const HASH_STREAM: u64 = 0x5a5a_0000_0000_0000;
const TAIL_STREAM: u64 = 0xa5a5_0000_0000_0000;

/// How a prompt's token ids are made; materialized just before sending so a
/// long trace never holds all its prompts in memory.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PromptSpec {
    /// Prompt length in tokens.
    pub len: usize,
    /// Prefix blocks: one id per `block_tokens` tokens.
    pub hash_ids: Vec<u64>,
    pub block_tokens: usize,
    /// Seed of the tokens past the hash-id blocks (unique per request).
    pub tail_seed: u64,
}

impl PromptSpec {
    /// The token ids, all in `1..vocab`.
    pub(crate) fn tokens(&self, vocab: u32) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        'blocks: for &id in &self.hash_ids {
            for k in 0..self.block_tokens {
                if out.len() == self.len {
                    break 'blocks;
                }
                out.push(token_id(HASH_STREAM ^ mix64(id), k as u64, vocab));
            }
        }
        let mut k = 0u64;
        while out.len() < self.len {
            out.push(token_id(TAIL_STREAM ^ mix64(self.tail_seed), k, vocab));
            k += 1;
        }
        out
    }
}

/// The prompt of a row at `scale` (block of `block_size / scale` tokens,
/// `ceil(input_length / scale)` tokens), capped at `max_isl` tokens.
pub(crate) fn row_prompt(
    row: &TraceRow,
    block_size: u64,
    scale: u64,
    max_isl: Option<u64>,
) -> PromptSpec {
    let scale = scale.max(1);
    let mut len = row.input_length.div_ceil(scale);
    if let Some(cap) = max_isl {
        len = len.min(cap.max(1));
    }
    PromptSpec {
        len: len as usize,
        hash_ids: row.hash_ids.clone(),
        block_tokens: (block_size / scale).max(1) as usize,
        tail_seed: row.line as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
{"timestamp": 5.5, "input_length": 600, "output_length": 3, "hash_ids": [0, 2], "priority": 2}

{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [7], "extra": {"nvext": {"agent_hints": {"priority": -1}}}, "session_id": "x"}
"#;

    fn err_of(text: &str) -> String {
        parse_trace(text, 512).expect_err("bad trace").to_string()
    }

    #[test]
    fn parses_rows_priorities_and_skips_blank_lines() {
        let rows = parse_trace(GOOD, 512).expect("parses");
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].hash_ids, vec![0, 1]);
        assert_eq!(rows[0].priority, None);
        assert_eq!(rows[1].timestamp_ms, 5.5);
        assert_eq!(rows[1].priority, Some(2));
        assert_eq!(rows[2].line, 4);
        assert_eq!(rows[2].priority, Some(-1));
    }

    #[test]
    fn bad_json_names_the_line() {
        let text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}\n{oops\n";
        let e = err_of(text);
        assert!(e.contains("line 2"), "{e}");
        assert!(e.contains("not a valid trace row"), "{e}");
    }

    #[test]
    fn missing_and_invalid_fields_name_the_line_and_field() {
        let e = err_of("\n\n{\"timestamp\": 0, \"output_length\": 1}\n");
        assert!(e.contains("line 3") && e.contains("input_length"), "{e}");
        let e = err_of("{\"input_length\": 3, \"output_length\": 1}");
        assert!(e.contains("line 1") && e.contains("timestamp"), "{e}");
        let e = err_of("{\"timestamp\": -4, \"input_length\": 3, \"output_length\": 1}");
        assert!(e.contains("non-negative"), "{e}");
        let e = err_of("{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 0}");
        assert!(e.contains("output_length"), "{e}");
        let e = err_of("{\"timestamp\": 0, \"input_length\": \"3\", \"output_length\": 1}");
        assert!(e.contains("line 1"), "{e}");
    }

    #[test]
    fn too_many_hash_ids_for_the_length_is_an_error() {
        let e = err_of(
            "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [1,2,3]}",
        );
        assert!(e.contains("line 1") && e.contains("3 hash_ids"), "{e}");
    }

    #[test]
    fn disagreeing_priorities_are_an_error() {
        let e = err_of(
            r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "priority": 1, "extra": {"nvext": {"agent_hints": {"priority": 2}}}}"#,
        );
        assert!(e.contains("disagree"), "{e}");
    }

    #[test]
    fn empty_trace_is_an_error() {
        assert!(matches!(
            parse_trace("\n \n", 512),
            Err(BenchError::EmptyTrace)
        ));
    }

    #[test]
    fn equal_hash_ids_give_equal_prefixes_and_different_ones_differ() {
        let rows = parse_trace(GOOD, 512).expect("parses");
        for scale in [1, 8, 512] {
            let a = row_prompt(&rows[0], 512, scale, None).tokens(1000);
            let b = row_prompt(&rows[1], 512, scale, None).tokens(1000);
            let block = (512 / scale) as usize;
            assert_eq!(a.len(), 1000usize.div_ceil(scale as usize));
            assert_eq!(b.len(), 600usize.div_ceil(scale as usize));
            assert_eq!(a[..block], b[..block], "scale {scale}");
            let end = (2 * block).min(a.len()).min(b.len());
            assert_ne!(a[block..end], b[block..end], "scale {scale}");
            assert!(a.iter().all(|&t| (1..1000).contains(&t)));
        }
    }

    #[test]
    fn prompts_are_deterministic_and_capped() {
        let rows = parse_trace(GOOD, 512).expect("parses");
        let p = row_prompt(&rows[0], 512, 1, Some(100));
        assert_eq!(p.len, 100);
        assert_eq!(p.tokens(50), p.tokens(50));
        // Tails past the hash-id blocks are unique per row.
        let mut r = rows[2].clone();
        r.hash_ids.clear();
        let mut s = r.clone();
        s.line += 1;
        assert_ne!(
            row_prompt(&r, 512, 1, None).tokens(1000),
            row_prompt(&s, 512, 1, None).tokens(1000)
        );
    }
}
