//! The API workers call: an [`EngineHandle`] to an engine running its step
//! loop on a dedicated thread (scheduler + backend), which sleeps on its
//! command channel when there is nothing to do.
//!
//! - `generate` → a [`GenerateStream`] of per-step [`Output`]s; dropping the
//!   stream aborts the sequence and frees its blocks.
//! - KV events (`subscribe_kv_events`, `kv_snapshot`) and load (`load`) are
//!   read without a round trip to the engine thread.
//! - Disaggregation: the prefill side runs [`EngineHandle::prefill`] and reads
//!   the prompt's blocks from the returned [`HeldBlocks`]; the decode side
//!   reserves a [`RemoteSlot`], writes the received blocks, then
//!   [`EngineHandle::commit_remote`]s it into a normal stream. Every guard
//!   (stream, held blocks, slot) frees its blocks when dropped, wherever it is
//!   dropped, because the engine thread builds the guards itself.

mod core;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::task::{Context, Poll};

use tokio::sync::{mpsc, oneshot, watch};

use crate::backend::{Backend, KvArena, KvBlockLayout};
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::kv::{KvCache, KvEventLog, KvSnapshot, KvSubscription, SeqId, SnapshotRequired};
use crate::sampler::PositionLogprobs;
use crate::scheduler::{Finished, LoadStats, Preemption, Request, Scheduler};

/// What one engine step produced for one request. The last output of a
/// stream has `finished` set (its `token_ids` may be empty on abort/error).
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub token_ids: Vec<u32>,
    /// One entry per token when the request asked for logprobs.
    pub logprobs: Vec<PositionLogprobs>,
    pub finished: Option<Finished>,
    /// The request's preemptions and recomputed tokens so far (they grow
    /// only while it waits or recomputes, so a consumer can count them as
    /// they happen; the finishing output carries the totals).
    pub preemption: Preemption,
}

/// Commands from handles and guards to the engine thread.
enum Command {
    Generate {
        id: SeqId,
        req: Request,
        tx: mpsc::UnboundedSender<Output>,
    },
    Prefill {
        id: SeqId,
        req: Request,
        reply: oneshot::Sender<Result<PrefillOutput, EngineError>>,
    },
    Reserve {
        id: SeqId,
        req: Request,
        reply: oneshot::Sender<Result<RemoteSlot, EngineError>>,
    },
    Commit {
        id: SeqId,
        first_token: u32,
        logprobs: Option<PositionLogprobs>,
        tx: mpsc::UnboundedSender<Output>,
    },
    ReserveImport {
        id: SeqId,
        req: Request,
        blocks: usize,
        reply: oneshot::Sender<Result<RemoteSlot, EngineError>>,
    },
    CommitImport {
        id: SeqId,
        written: usize,
        reply: oneshot::Sender<Result<usize, EngineError>>,
    },
    HoldPrefix {
        id: SeqId,
        prompt: Vec<u32>,
        max_blocks: usize,
        reply: oneshot::Sender<HeldBlocks>,
    },
    WriteBlocks {
        id: SeqId,
        blocks: Vec<(u32, Vec<u8>)>,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    ReadBlocks {
        ids: Vec<u32>,
        reply: oneshot::Sender<Result<Vec<Vec<u8>>, EngineError>>,
    },
    /// Abort a sequence or release held/reserved blocks.
    Abort(SeqId),
    ClearPrefixCache,
    Shutdown,
}

/// Sends `Abort(id)` when dropped, unless disarmed.
#[derive(Debug)]
struct AbortOnDrop {
    id: SeqId,
    tx: Option<std_mpsc::Sender<Command>>,
}

impl AbortOnDrop {
    fn new(id: SeqId, tx: std_mpsc::Sender<Command>) -> Self {
        Self { id, tx: Some(tx) }
    }

    fn disarm(&mut self) {
        self.tx = None;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            // The engine may be gone already; then there is nothing to free.
            let _ = tx.send(Command::Abort(self.id));
        }
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Self::Generate { .. } => "Generate",
            Self::Prefill { .. } => "Prefill",
            Self::Reserve { .. } => "Reserve",
            Self::Commit { .. } => "Commit",
            Self::ReserveImport { .. } => "ReserveImport",
            Self::CommitImport { .. } => "CommitImport",
            Self::HoldPrefix { .. } => "HoldPrefix",
            Self::WriteBlocks { .. } => "WriteBlocks",
            Self::ReadBlocks { .. } => "ReadBlocks",
            Self::Abort(_) => "Abort",
            Self::ClearPrefixCache => "ClearPrefixCache",
            Self::Shutdown => "Shutdown",
        };
        f.write_str(name)
    }
}

/// The outputs of one request. Dropping it aborts the request.
#[derive(Debug)]
pub struct GenerateStream {
    id: SeqId,
    rx: mpsc::UnboundedReceiver<Output>,
    abort: AbortOnDrop,
}

impl GenerateStream {
    fn new(id: SeqId, rx: mpsc::UnboundedReceiver<Output>, tx: std_mpsc::Sender<Command>) -> Self {
        Self {
            id,
            rx,
            abort: AbortOnDrop::new(id, tx),
        }
    }

    /// The engine's id for this sequence.
    pub fn seq_id(&self) -> SeqId {
        self.id
    }

    /// The next output; `None` after the finishing one.
    pub async fn recv(&mut self) -> Option<Output> {
        let out = self.rx.recv().await;
        self.note(&out);
        out
    }

    /// Once the finishing output is out, the engine has freed the sequence:
    /// dropping the stream then sends no `Abort` (one engine wake-up less per
    /// request).
    fn note(&mut self, out: &Option<Output>) {
        if out.as_ref().is_some_and(|o| o.finished.is_some()) {
            self.abort.disarm();
        }
    }

    /// The next output merged with every output already waiting behind it,
    /// up to and including a finishing one. Never waits beyond the first:
    /// a consumer that keeps up gets one output per step as from
    /// [`GenerateStream::recv`], and one that fell behind the engine (a busy
    /// runtime, a fast engine) catches up in one message instead of one per
    /// step. Tokens and logprobs are concatenated in order; the preemption
    /// counts are the latest (they only grow).
    pub async fn recv_ready(&mut self) -> Option<Output> {
        let mut out = self.rx.recv().await?;
        while out.finished.is_none() {
            let Ok(next) = self.rx.try_recv() else {
                break;
            };
            out.token_ids.extend(next.token_ids);
            out.logprobs.extend(next.logprobs);
            out.finished = next.finished;
            out.preemption = next.preemption;
        }
        let out = Some(out);
        self.note(&out);
        out
    }

    /// [`GenerateStream::recv`] for synchronous callers (not inside a runtime).
    pub fn blocking_recv(&mut self) -> Option<Output> {
        let out = self.rx.blocking_recv();
        self.note(&out);
        out
    }

    /// Poll form of [`GenerateStream::recv`], for adapting to `Stream`.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Output>> {
        let poll = self.rx.poll_recv(cx);
        if let Poll::Ready(out) = &poll {
            self.note(out);
        }
        poll
    }

    /// Every token until the end, with the finish (`None` if the engine
    /// vanished without finishing the stream).
    pub async fn collect(mut self) -> (Vec<u32>, Option<Finished>) {
        let mut tokens = Vec::new();
        while let Some(out) = self.recv().await {
            tokens.extend(out.token_ids);
            if let Some(f) = out.finished {
                return (tokens, Some(f));
            }
        }
        (tokens, None)
    }
}

/// A finished prefill: the first token and the prompt's KV blocks, held
/// until this value (its [`HeldBlocks`]) is dropped.
#[derive(Debug)]
pub struct PrefillOutput {
    pub first_token: u32,
    pub logprobs: Option<PositionLogprobs>,
    /// Prompt tokens that came from this engine's prefix cache.
    pub cached_tokens: usize,
    pub blocks: HeldBlocks,
}

/// A prompt's KV blocks kept alive for reading (see
/// [`EngineHandle::read_blocks`]); released when dropped.
#[derive(Debug)]
pub struct HeldBlocks {
    block_ids: Vec<u32>,
    num_tokens: usize,
    _release: AbortOnDrop,
}

impl HeldBlocks {
    /// Physical blocks holding positions `0..num_tokens`, in order.
    pub fn block_ids(&self) -> &[u32] {
        &self.block_ids
    }

    /// Prompt tokens whose K/V the blocks hold.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}

/// Destination blocks of a remote prefill; released when dropped, unless
/// committed with [`EngineHandle::commit_remote`].
#[derive(Debug)]
pub struct RemoteSlot {
    id: SeqId,
    block_ids: Vec<u32>,
    skip_blocks: usize,
    cached_tokens: usize,
    release: AbortOnDrop,
}

impl RemoteSlot {
    /// The slot's id, for [`EngineHandle::write_blocks`].
    pub fn id(&self) -> SeqId {
        self.id
    }

    /// One block per full or partial prompt block, in order.
    pub fn block_ids(&self) -> &[u32] {
        &self.block_ids
    }

    /// Leading blocks already cached here: the sender skips them.
    pub fn skip_blocks(&self) -> usize {
        self.skip_blocks
    }

    /// Prompt tokens covered by the skipped blocks.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }
}

/// A cheap, cloneable handle to a running engine. The engine stops (aborting
/// whatever still runs) when the last handle is dropped or on `shutdown`.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    tx: std_mpsc::Sender<Command>,
    events: Arc<KvEventLog>,
    load: watch::Receiver<LoadStats>,
    next_id: AtomicU64,
    layout: KvBlockLayout,
    num_blocks: usize,
    kv_arena: Option<Arc<KvArena>>,
    max_len: usize,
    vocab_size: usize,
    grammars: Option<sluice_tokens::grammar::Grammars>,
    backend_name: &'static str,
    kv_transfer_model: Option<crate::backend::KvTransferModel>,
    thread: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

impl EngineHandle {
    /// Starts an engine over `backend` on its own thread.
    pub fn spawn(backend: Box<dyn Backend>, cfg: EngineConfig) -> Result<Self, EngineError> {
        cfg.validate()?;
        let layout = backend.kv_layout();
        if layout.block_size != cfg.block_size {
            return Err(EngineError::InvalidConfig(format!(
                "block_size {} differs from the backend's KV layout ({})",
                cfg.block_size, layout.block_size
            )));
        }
        let num_blocks = cfg.num_blocks.unwrap_or(backend.num_blocks());
        if num_blocks == 0 || num_blocks > backend.num_blocks() {
            return Err(EngineError::InvalidConfig(format!(
                "num_blocks {num_blocks} must be in 1..={} (the backend's KV memory)",
                backend.num_blocks()
            )));
        }
        let events = Arc::new(KvEventLog::new(cfg.event_ring_capacity));
        let mut kv = KvCache::new(
            num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            events.clone(),
        );
        if cfg.kv_tier_bytes > 0 && cfg.enable_prefix_caching {
            // A timing backend keeps no bytes: its budget counts the
            // modelled model's blocks.
            let tier = match backend.kv_transfer_model() {
                Some(m) => crate::kv::TierStore::new(cfg.kv_tier_bytes, m.block_bytes),
                None => crate::kv::TierStore::with_bytes(
                    cfg.kv_tier_bytes,
                    layout.block_bytes() as u64,
                )?,
            };
            kv = kv.with_tier(tier);
        }
        let sched = Scheduler::new(cfg.scheduler.clone(), kv, cfg.eos_token_ids.clone());
        let grammars = cfg.grammars.clone();
        let max_len = sched.max_len();
        let (load_tx, load_rx) = watch::channel(sched.load());
        let (tx, rx) = std_mpsc::channel();
        let backend_name = backend.name();
        let vocab_size = backend.vocab_size();
        let kv_arena = backend.kv_arena();
        let kv_transfer_model = backend.kv_transfer_model();
        let core = core::EngineCore::new(backend, sched, tx.clone(), load_tx, cfg.balance_group);
        let thread = std::thread::Builder::new()
            .name(format!("sluice-engine-{backend_name}"))
            .spawn(move || core.run(rx))
            .map_err(|e| EngineError::InvalidConfig(format!("cannot start engine thread: {e}")))?;
        Ok(Self {
            shared: Arc::new(Shared {
                tx,
                events,
                load: load_rx,
                next_id: AtomicU64::new(1),
                layout,
                num_blocks,
                kv_arena,
                max_len,
                vocab_size,
                grammars,
                backend_name,
                kv_transfer_model,
                thread: parking_lot::Mutex::new(Some(thread)),
            }),
        })
    }

    /// Queues `req` and returns its output stream.
    pub fn generate(&self, req: Request) -> Result<GenerateStream, EngineError> {
        self.check(&req)?;
        let id = self.next_id();
        let (tx, rx) = mpsc::unbounded_channel();
        self.send(Command::Generate { id, req, tx })?;
        Ok(GenerateStream::new(id, rx, self.shared.tx.clone()))
    }

    /// Computes `req`'s prompt and first token, keeping the prompt's blocks
    /// for [`EngineHandle::read_blocks`] until the returned blocks are dropped.
    /// Dropping the future before it resolves aborts the prefill.
    pub async fn prefill(&self, req: Request) -> Result<PrefillOutput, EngineError> {
        self.check(&req)?;
        let id = self.next_id();
        let (reply, rx) = oneshot::channel();
        self.send(Command::Prefill { id, req, reply })?;
        let mut abort = AbortOnDrop::new(id, self.shared.tx.clone());
        let out = rx.await.map_err(|_| EngineError::Shutdown)?;
        abort.disarm();
        out
    }

    /// Allocates local blocks for `req`'s prompt (reusing the locally cached
    /// prefix) for a remote prefill to write into.
    pub async fn reserve_remote(&self, req: Request) -> Result<RemoteSlot, EngineError> {
        self.check(&req)?;
        let id = self.next_id();
        let (reply, rx) = oneshot::channel();
        self.send(Command::Reserve { id, req, reply })?;
        rx.await.map_err(|_| EngineError::Shutdown)?
    }

    /// Allocates local blocks for the first `blocks` full blocks of `req`'s
    /// prompt (reusing the locally cached ones: `skip_blocks`) for a peer
    /// that holds them cached to write into; [`EngineHandle::commit_import`]
    /// makes them this engine's cached prefix.
    pub async fn reserve_import(
        &self,
        req: Request,
        blocks: usize,
    ) -> Result<RemoteSlot, EngineError> {
        self.check(&req)?;
        let id = self.next_id();
        let (reply, rx) = oneshot::channel();
        self.send(Command::ReserveImport {
            id,
            req,
            blocks,
            reply,
        })?;
        rx.await.map_err(|_| EngineError::Shutdown)?
    }

    /// The peer wrote the first `written` blocks of an import slot past its
    /// skipped ones: they enter the prefix cache and the KV events as if
    /// computed here (the rest is freed). Returns the prompt tokens the
    /// cache now holds of the prefix.
    pub async fn commit_import(
        &self,
        mut slot: RemoteSlot,
        written: usize,
    ) -> Result<usize, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::CommitImport {
            id: slot.id,
            written,
            reply,
        })?;
        slot.release.disarm();
        rx.await.map_err(|_| EngineError::Shutdown)?
    }

    /// Holds the cached prefix of `prompt` (its leading full blocks, at most
    /// `max_blocks`) for reading, e.g. by a peer that imports it, until the
    /// returned blocks are dropped; none when nothing of it is cached.
    pub async fn hold_prefix(
        &self,
        prompt: Vec<u32>,
        max_blocks: usize,
    ) -> Result<HeldBlocks, EngineError> {
        let id = self.next_id();
        let (reply, rx) = oneshot::channel();
        self.send(Command::HoldPrefix {
            id,
            prompt,
            max_blocks,
            reply,
        })?;
        rx.await.map_err(|_| EngineError::Shutdown)
    }

    /// What a KV transfer between workers costs in a timing backend's model
    /// (the mocker's); `None` for a backend whose bytes really move.
    pub fn kv_transfer_model(&self) -> Option<crate::backend::KvTransferModel> {
        self.shared.kv_transfer_model
    }

    /// Writes received KV blocks into a reserved slot. Every id must be one
    /// of the slot's blocks past `skip_blocks`; data is `block_bytes()` long.
    pub async fn write_blocks(
        &self,
        slot_id: SeqId,
        blocks: Vec<(u32, Vec<u8>)>,
    ) -> Result<(), EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::WriteBlocks {
            id: slot_id,
            blocks,
            reply,
        })?;
        rx.await.map_err(|_| EngineError::Shutdown)?
    }

    /// Copies blocks out of the backend's KV memory (`block_bytes()` each).
    pub async fn read_blocks(&self, ids: Vec<u32>) -> Result<Vec<Vec<u8>>, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ReadBlocks { ids, reply })?;
        rx.await.map_err(|_| EngineError::Shutdown)?
    }

    /// Turns a filled slot into a decoding sequence whose stream starts with
    /// `first_token` (the remote prefill's output).
    pub fn commit_remote(
        &self,
        mut slot: RemoteSlot,
        first_token: u32,
        logprobs: Option<PositionLogprobs>,
    ) -> Result<GenerateStream, EngineError> {
        if first_token as usize >= self.shared.vocab_size {
            // Dropping the slot releases it.
            return Err(EngineError::InvalidRequest(format!(
                "first token id {first_token} is outside the vocabulary ({})",
                self.shared.vocab_size
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.send(Command::Commit {
            id: slot.id,
            first_token,
            logprobs,
            tx,
        })?;
        slot.release.disarm();
        Ok(GenerateStream::new(slot.id, rx, self.shared.tx.clone()))
    }

    /// KV events after `from_seq` (backlog plus live), or `SnapshotRequired`.
    pub fn subscribe_kv_events(&self, from_seq: u64) -> Result<KvSubscription, SnapshotRequired> {
        self.shared.events.subscribe(from_seq)
    }

    /// Every cached block hash, with the event seq it is current at.
    pub fn kv_snapshot(&self) -> KvSnapshot {
        self.shared.events.snapshot()
    }

    /// Prompt tokens of `prompt` currently in the prefix cache (full blocks),
    /// as the event stream reports them; no round trip to the engine thread.
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        let bs = self.shared.layout.block_size;
        let hashes = sluice_tokens::sequence_block_hashes(prompt, bs);
        self.shared.events.cached_prefix_len(&hashes) * bs
    }

    /// Load, updated after every step.
    pub fn load(&self) -> watch::Receiver<LoadStats> {
        self.shared.load.clone()
    }

    /// Drops every cached prefix (publishes `Cleared`).
    pub fn clear_prefix_cache(&self) -> Result<(), EngineError> {
        self.send(Command::ClearPrefixCache)
    }

    /// Layout of one KV block of this engine's backend.
    pub fn kv_layout(&self) -> KvBlockLayout {
        self.shared.layout
    }

    /// The backend's KV memory, when transports may write reserved blocks
    /// into it directly (see [`KvArena`]).
    pub fn kv_arena(&self) -> Option<&Arc<KvArena>> {
        self.shared.kv_arena.as_ref()
    }

    /// KV blocks the engine manages.
    pub fn num_blocks(&self) -> usize {
        self.shared.num_blocks
    }

    /// Longest sequence (prompt + output) the engine holds.
    pub fn max_len(&self) -> usize {
        self.shared.max_len
    }

    /// Tokens in the model's vocabulary: every token id is below it.
    pub fn vocab_size(&self) -> usize {
        self.shared.vocab_size
    }

    /// Compiles structured-output grammars for this model, if it can.
    pub fn grammars(&self) -> Option<&sluice_tokens::grammar::Grammars> {
        self.shared.grammars.as_ref()
    }

    /// The backend's name ("cpu", "mocker", …).
    pub fn backend_name(&self) -> &'static str {
        self.shared.backend_name
    }

    /// Stops the engine: every unfinished stream ends with `Abort`. Waits for
    /// the engine thread (blocking; call from a blocking context).
    pub fn shutdown(&self) {
        let _ = self.shared.tx.send(Command::Shutdown);
        if let Some(t) = self.shared.thread.lock().take() {
            let _ = t.join();
        }
    }

    fn check(&self, req: &Request) -> Result<(), EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::InvalidRequest("prompt is empty".into()));
        }
        let vocab = self.shared.vocab_size;
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        if req.prompt.len() >= self.shared.max_len {
            return Err(EngineError::InvalidRequest(format!(
                "prompt has {} tokens; this engine holds at most {} per sequence including output",
                req.prompt.len(),
                self.shared.max_len
            )));
        }
        req.sampling.validate()
    }

    fn next_id(&self) -> SeqId {
        self.shared.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.shared.tx.send(cmd).map_err(|_| EngineError::Shutdown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::TokenLogprob;
    use crate::scheduler::{FinishReason, Usage};

    fn output(tokens: &[u32], preempted: usize, finished: bool) -> Output {
        Output {
            token_ids: tokens.to_vec(),
            logprobs: tokens
                .iter()
                .map(|&t| PositionLogprobs {
                    chosen: TokenLogprob {
                        token_id: t,
                        logprob: -(t as f32),
                    },
                    top: Vec::new(),
                })
                .collect(),
            finished: finished.then(|| Finished {
                reason: FinishReason::Length,
                usage: Usage::default(),
            }),
            preemption: Preemption {
                count: preempted,
                recomputed_tokens: 0,
            },
        }
    }

    #[tokio::test]
    async fn a_stream_dropped_after_its_finish_sends_no_abort_and_one_dropped_before_does() {
        let (commands, received) = std_mpsc::channel();
        for (finish, abort) in [(true, false), (false, true)] {
            let (tx, rx) = mpsc::unbounded_channel();
            let mut stream = GenerateStream::new(3, rx, commands.clone());
            tx.send(output(&[1], 0, finish)).expect("open");
            assert!(stream.recv().await.is_some());
            drop(stream);
            let sent = received.try_recv().ok();
            assert_eq!(
                matches!(sent, Some(Command::Abort(3))),
                abort,
                "finished: {finish}"
            );
        }
    }

    #[tokio::test]
    async fn recv_ready_merges_what_waits_up_to_the_finish_and_never_waits_for_more() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (commands, _keep) = std_mpsc::channel();
        let mut stream = GenerateStream::new(7, rx, commands);

        // One output waiting: as from recv.
        tx.send(output(&[1], 0, false)).expect("open");
        assert_eq!(stream.recv_ready().await, Some(output(&[1], 0, false)));

        // Three waiting, the last after a preemption: one output, in order,
        // with the latest counts.
        tx.send(output(&[2], 0, false)).expect("open");
        tx.send(output(&[], 1, false)).expect("open");
        tx.send(output(&[3, 4], 1, false)).expect("open");
        let merged = stream.recv_ready().await.expect("an output");
        assert_eq!(merged.token_ids, [2, 3, 4]);
        let logprob_ids: Vec<u32> = merged.logprobs.iter().map(|l| l.chosen.token_id).collect();
        assert_eq!(logprob_ids, [2, 3, 4]);
        assert_eq!(merged.preemption.count, 1);
        assert!(merged.finished.is_none());

        // Nothing is merged past the finishing output.
        tx.send(output(&[5], 1, true)).expect("open");
        tx.send(output(&[6], 1, false)).expect("open");
        let last = stream.recv_ready().await.expect("an output");
        assert_eq!(last.token_ids, [5]);
        assert!(last.finished.is_some());
        assert_eq!(stream.recv_ready().await, Some(output(&[6], 1, false)));

        // Nothing waiting after the first: it returns at once.
        tx.send(output(&[8], 1, false)).expect("open");
        let alone = tokio::time::timeout(std::time::Duration::from_secs(5), stream.recv_ready())
            .await
            .expect("does not wait for a second output");
        assert_eq!(alone, Some(output(&[8], 1, false)));
        drop(tx);
        assert_eq!(stream.recv_ready().await, None);
    }
}
