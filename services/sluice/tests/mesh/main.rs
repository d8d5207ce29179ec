//! The whole mesh in one process (`sluice_tests::mesh`: frontend, queue
//! replicas, router, workers on the built-in model or the mocker, real
//! etcd where discovery is the subject), one module per scenario. One test
//! binary: the scenarios share nothing but the process. Beside this folder,
//! binaries of their own: the scenarios that read their spans back through
//! an OTLP collector (they install the process's one trace subscriber:
//! `admission_wait.rs`, `preemption.rs`, `trace_mesh.rs`,
//! `trace_propagation.rs`), and `discovery.rs`, whose leases and grace
//! periods are timed against etcd processes it pauses and restarts: with
//! the fuzz scenarios beside it in one process, one `make test` run did not
//! see a lost member's deletion within its test's 10 s wait (root cause
//! not found; never seen in a binary of its own); and `fuzz.rs`, whose
//! generated load runs for a minute and more at full CPU, so that the
//! timed scenarios here (idle and header timeouts, bursts) never run beside
//! it.

mod edge;
mod kv_events;
mod kv_transfer;
mod overload;
mod prefix_fetch;
mod replicas;
mod serving;
mod tenants;
