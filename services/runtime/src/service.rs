//! The shape every service follows, and the one place its lifecycle lives.
//!
//! A service crate exposes:
//!
//! ```ignore
//! /// The service's own flags (no common ones; `sluice up` flattens several).
//! #[derive(Debug, Clone, clap::Args)]
//! pub struct Args { /* #[arg(long, env = "SLUICE_…")] … */ }
//! impl Args { pub fn validate(&self) -> Result<(), XError>; }
//! /// Serves until `ctx.shutdown` is cancelled.
//! pub async fn serve(listener: TcpListener, args: Args, ctx: ServiceContext) -> Result<(), XError>;
//! ```
//!
//! and inside `serve` hands its [`GrpcServer`] to [`ServiceContext::run`],
//! which registers the instance in discovery under a lease, serves, and on
//! shutdown deregisters first (so nobody new dials in), then drains in-flight
//! calls under `--drain-timeout`.
//!
//! Work a service runs beside its RPCs (discovery followers, dispatchers,
//! gauges, the tasks behind streaming responses) is spawned with
//! [`ServiceContext::spawn`]: [`ServiceContext::run`] cancels
//! [`ServiceContext::background`] once the server has drained and waits for
//! those tasks, so none outlives its service unnoticed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use crate::grpc::{GrpcServer, TracedChannel};
use crate::{CommonArgs, Discovery, Instance, RuntimeError, Security, Shutdown};

/// What every service's `serve` gets besides its own flags.
#[derive(Debug, Clone)]
pub struct ServiceContext {
    /// Namespace, advertise address, lease TTL, drain timeout.
    pub common: CommonArgs,
    /// Where to register and whom to find.
    pub discovery: Arc<dyn Discovery>,
    /// Cancelled when the process shuts down.
    pub shutdown: Shutdown,
    /// TLS, mesh token and connection limits, loaded from `common.security`;
    /// servers and clients of this service use it.
    pub security: Arc<Security>,
    /// The service's own tasks, waited for by [`Self::run`].
    tasks: TaskTracker,
    /// Cancelled by [`Self::run`] once the server has drained (a child of
    /// `shutdown`, so a task that watches it also stops on shutdown).
    background: Shutdown,
}

impl ServiceContext {
    /// A context with default common flags and no TLS or mesh token (tests).
    pub fn new(discovery: Arc<dyn Discovery>, shutdown: Shutdown) -> Self {
        Self::with_common(
            CommonArgs::default(),
            discovery,
            shutdown,
            Arc::new(Security::open()),
        )
    }

    /// A context for `common`'s flags, with `security` loaded from them
    /// (several services of one process share one, see `sluice up`).
    pub fn with_common(
        common: CommonArgs,
        discovery: Arc<dyn Discovery>,
        shutdown: Shutdown,
        security: Arc<Security>,
    ) -> Self {
        let background = shutdown.child_token();
        Self {
            common,
            discovery,
            shutdown,
            security,
            tasks: TaskTracker::new(),
            background,
        }
    }

    /// Runs `task` as one of this service's own tasks: [`Self::run`] waits
    /// for it after the server has drained. A task that loops watches
    /// [`Self::background`] (or ends with the stream it serves).
    pub fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn(task)
    }

    /// The tracker behind [`Self::spawn`], for parts that spawn later (a
    /// gRPC handler's stream, a session per peer).
    pub fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// Cancelled once the server has drained (or on shutdown): background
    /// work keeps going while in-flight calls finish, then stops.
    pub fn background(&self) -> &Shutdown {
        &self.background
    }

    /// A channel to a mesh endpoint with this service's TLS and token (see
    /// [`Security::channel`]).
    pub fn channel(&self, endpoint: &str) -> Result<TracedChannel, RuntimeError> {
        self.security.channel(endpoint)
    }

    /// The instance description for `component` bound at `listener`'s address.
    pub fn instance(
        &self,
        component: &str,
        listener: &TcpListener,
    ) -> Result<Instance, RuntimeError> {
        let bound = listener.local_addr()?;
        Ok(Instance::new(component, self.common.advertise_addr(bound)))
    }

    /// Registers `instance`, serves `server` on `listener` until shutdown,
    /// then deregisters, reports NOT_SERVING and drains under the deadline;
    /// last, cancels [`Self::background`] and waits for the service's tasks
    /// (under the same deadline again).
    pub async fn run(
        &self,
        server: GrpcServer,
        listener: TcpListener,
        instance: Instance,
    ) -> Result<(), RuntimeError> {
        let served = self.serve(server, listener, &instance).await;
        self.background.cancel();
        self.tasks.close();
        let drain = Duration::from_secs(self.common.drain_timeout);
        if tokio::time::timeout(drain, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(component = %instance.component, running = self.tasks.len(), ?drain, "service tasks still running after the drain deadline; leaving them");
        }
        served
    }

    async fn serve(
        &self,
        server: GrpcServer,
        listener: TcpListener,
        instance: &Instance,
    ) -> Result<(), RuntimeError> {
        let server = server.with_security(Arc::clone(&self.security));
        server.check_exposure(listener.local_addr()?)?;
        // Callable in-process before anyone can learn the endpoint.
        let local = crate::local::register(&instance.endpoint, server.router());
        let _metrics = crate::metrics::register_process(server.registries());
        let registration = self
            .discovery
            .register(instance.clone(), self.common.lease_ttl)
            .await?;
        tracing::info!(component = %instance.component, id = %instance.id, endpoint = %instance.endpoint, "serving");
        // The server's own shutdown signal fires after deregistration.
        let stop_serving = Shutdown::new();
        let serving = tokio::spawn(server.serve(listener, stop_serving.clone()));
        let mut serving = std::pin::pin!(serving);
        tokio::select! {
            res = &mut serving => {
                drop(local);
                registration.deregister().await;
                return res?;
            }
            _ = self.shutdown.cancelled() => {}
        }
        drop(local);
        registration.deregister().await;
        stop_serving.cancel();
        let drain = Duration::from_secs(self.common.drain_timeout);
        match tokio::time::timeout(drain, &mut serving).await {
            Ok(res) => res?,
            Err(_) => {
                tracing::warn!(component = %instance.component, ?drain, "drain deadline passed; cancelling in-flight calls");
                serving.abort();
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::discovery::MemoryDiscovery;

    #[tokio::test]
    async fn run_returns_after_the_services_tasks_saw_the_drain_end() {
        let shutdown = Shutdown::new();
        let ctx = ServiceContext::new(
            Arc::new(MemoryDiscovery::new("service-tests")),
            shutdown.clone(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let instance = ctx.instance("tasks", &listener).expect("instance");
        let finished = Arc::new(AtomicBool::new(false));
        let (started, mut running) = tokio::sync::watch::channel(false);
        {
            let (finished, background) = (Arc::clone(&finished), ctx.background().clone());
            ctx.spawn(async move {
                let _ = started.send(true);
                background.cancelled().await;
                // Work after the signal still counts: `run` waits for it.
                tokio::task::yield_now().await;
                finished.store(true, Ordering::SeqCst);
            });
        }
        let serving = tokio::spawn({
            let ctx = ctx.clone();
            async move {
                ctx.run(GrpcServer::new().expect("server"), listener, instance)
                    .await
            }
        });
        running.wait_for(|s| *s).await.expect("task started");
        assert!(!ctx.background().is_cancelled(), "serving: background runs");
        shutdown.cancel();
        serving.await.expect("join").expect("run");
        assert!(finished.load(Ordering::SeqCst), "run waited for the task");
        assert!(ctx.tasks().is_empty());
    }
}
