//! The whole mesh in one process (`sluice_tests::mesh`: frontend, queue
//! replicas, router, workers on the built-in model or the mocker, real
//! etcd where discovery is the subject), one module per scenario. One test
//! binary: the scenarios share nothing but the process. Scenarios that read
//! their own spans back through an OTLP collector install the process's one
//! trace subscriber, so each is a test binary of its own beside this folder
//! (`admission_wait.rs`, `preemption.rs`, `trace_mesh.rs`,
//! `trace_propagation.rs`).

mod discovery;
mod edge;
mod fuzz;
mod kv_events;
mod kv_transfer;
mod overload;
mod replicas;
mod serving;
mod tenants;
