//! A prompt that waited for slots about to free, through the whole mesh: a
//! mocker worker with five slots runs four short requests; a fifth arrives
//! while they decode their last tokens, finds one slot free and waits for
//! theirs to share their prefill step (the admission wait, on with
//! `--scheduling-policy priority`). Its `worker.generate` span says how many
//! steps it waited, and the others' say nothing. One OTLP test per binary
//! (the subscriber is global).

use std::time::Duration;

use serde_json::{Value, json};
use sluice_tests::http::{open, post_json};
use sluice_tests::mesh::{Mesh, MeshOptions};
use sluice_tests::otlp::{attr, traced};
use tokio::io::AsyncBufReadExt;

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sluice-tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
           "nvext": {"agent_hints": {"priority": 3}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_held_for_slots_about_to_free_says_so_on_its_span() -> anyhow::Result<()> {
    let (collector, telemetry) = traced("sluice-test").await?;

    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    // Decode steps of some 60 ms: the four finish some 240 ms after their
    // first token, a wide window for the fifth to arrive in.
    opts.worker.speedup_ratio = 0.1;
    opts.worker.max_num_seqs = 5;
    opts.worker.scheduling_policy = "priority".into();
    // The engine must see the fifth while the four run.
    opts.queue.no_default_holding = true;
    let mesh = Mesh::start(opts).await?;

    // Four requests of 5 tokens: once each has its first, every one ends
    // within the wait (4 steps), so the one slot left is "about to be
    // joined" by four more.
    // Opened together: a response's head comes with its first token.
    let opens = (0..4).map(|i| {
        let mut body = completion(&format!("running request {i} "), 5);
        body["stream"] = json!(true);
        let http = mesh.http.clone();
        tokio::spawn(async move {
            open(
                &http,
                "POST",
                "/v1/completions",
                Some(body.to_string()),
                &[],
            )
            .await
        })
    });
    let mut streams = Vec::new();
    for opened in futures::future::join_all(opens).await {
        let (status, _, reader) = opened??;
        assert_eq!(status, 200);
        streams.push(reader);
    }
    for reader in &mut streams {
        let mut line = String::new();
        while !line.starts_with("data: ") {
            line.clear();
            let read = tokio::time::timeout(Duration::from_secs(10), reader.read_line(&mut line))
                .await??;
            anyhow::ensure!(read > 0, "a running request ended before its first token");
        }
    }
    let (status, body) = post_json(&mesh.http, "/v1/completions", &completion("late ", 2)).await?;
    assert_eq!(status, 200, "{body}");
    for mut reader in streams {
        let mut rest = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut reader, &mut rest).await?;
        assert!(rest.contains("[DONE]"), "{rest}");
    }
    mesh.stop().await?;
    telemetry.flush().await;

    let spans = collector.worker_generate_spans(5).await?;
    let (late, running): (Vec<_>, Vec<_>) = spans
        .iter()
        .partition(|s| attr(s, "completion_tokens").as_deref() == Some("2"));
    let ids =
        |v: &[&_]| -> Vec<Option<String>> { v.iter().map(|s| attr(s, "request_id")).collect() };
    assert_eq!(
        (late.len(), running.len()),
        (1, 4),
        "{:?} / {:?}",
        ids(&late),
        ids(&running)
    );
    // (completion tokens, start ms, end ms) of each, for a failure to show.
    let t0 = spans
        .iter()
        .map(|s| s.start_time_unix_nano)
        .min()
        .unwrap_or(0);
    let times: Vec<_> = spans
        .iter()
        .map(|s| {
            (
                attr(s, "completion_tokens"),
                (s.start_time_unix_nano - t0) / 1_000_000,
                (s.end_time_unix_nano - t0) / 1_000_000,
            )
        })
        .collect();
    let held: u64 = attr(late[0], "admission_held_steps")
        .unwrap_or_else(|| panic!("the late prompt's span has no admission_held_steps: {times:?}"))
        .parse()?;
    assert!((1..=4).contains(&held), "held {held} steps");
    for s in running {
        assert_eq!(attr(s, "admission_held_steps"), None, "{s:?}");
    }
    Ok(())
}
