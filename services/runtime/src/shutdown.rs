//! Graceful shutdown: one [`Shutdown`] token per process, cancelled on
//! SIGTERM or Ctrl-C; every `serve` takes a child of it.
//!
//! Phases, in each service: health `NOT_SERVING` and deregistration → stop
//! accepting and drain under a deadline → cancel background tasks → flush
//! telemetry.

pub use tokio_util::sync::CancellationToken as Shutdown;

/// A token cancelled on the first SIGTERM or Ctrl-C.
pub fn on_signal() -> Shutdown {
    let token = Shutdown::new();
    let t = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received; draining");
        t.cancel();
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
