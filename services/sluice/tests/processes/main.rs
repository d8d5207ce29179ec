//! The mesh as a user runs it: `sluice` child processes (`sluice up`, or
//! each service on its own) that bind port 0 and report their address, a
//! real etcd-server on loopback, and clients over HTTP and gRPC; one module
//! per scenario.

mod failover;
mod routing;
mod trust;
mod up;
mod worker_killed;
