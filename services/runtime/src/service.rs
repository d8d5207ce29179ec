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

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::grpc::GrpcServer;
use crate::{CommonArgs, Discovery, Instance, RuntimeError, Shutdown};

/// What every service's `serve` gets besides its own flags.
#[derive(Debug, Clone)]
pub struct ServiceContext {
    /// Namespace, advertise address, lease TTL, drain timeout.
    pub common: CommonArgs,
    /// Where to register and whom to find.
    pub discovery: Arc<dyn Discovery>,
    /// Cancelled when the process shuts down.
    pub shutdown: Shutdown,
}

impl ServiceContext {
    /// A context with default common flags (tests, `sluice up`).
    pub fn new(discovery: Arc<dyn Discovery>, shutdown: Shutdown) -> Self {
        Self {
            common: CommonArgs::default(),
            discovery,
            shutdown,
        }
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
    /// then deregisters, reports NOT_SERVING and drains under the deadline.
    pub async fn run(
        &self,
        server: GrpcServer,
        listener: TcpListener,
        instance: Instance,
    ) -> Result<(), RuntimeError> {
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
