//! Harness for Sluice's end-to-end tests: real processes on loopback.
//!
//! - [`etcd::EtcdServer`]: a real `etcd` on free loopback ports with a temp
//!   data dir, killed when dropped.
//! - [`mesh::Mesh`]: every service in one process on loopback.
//! - [`otlp::Collector`]: an in-process OTLP trace collector.
//! - [`http`]: a raw HTTP/1.1 client that can drop a stream mid-way.
//! - [`process::Proc`]: a child process, killed when dropped.
//! - [`wait`]: poll a condition with a deadline instead of sleeping.
//! - [`watchdog`]: end a test process stuck where no timer fires; every
//!   [`mesh::Mesh`] has one.

#![forbid(unsafe_code)]

pub mod etcd;
pub mod http;
pub mod mesh;
pub mod otlp;
pub mod process;
pub mod wait;
pub mod watchdog;

use std::net::TcpListener;

/// A free loopback port, bound and released: another bind may take it
/// before the child does, so only for etcd, which cannot report a port it
/// picked (its harness starts it again on new ports when one was taken).
/// Sluice's own processes bind port 0 and report what they got.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
