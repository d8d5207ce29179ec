//! The floor of one gRPC crossing between two processes on this host.
//!
//! A bidirectional stream ping-pong over loopback TCP (`TCP_NODELAY`), with
//! tonic's client and server and Sluice's codec, as the mesh's long-lived
//! sessions (`Queue.Leases`, `Router.Place`, `Worker.GenerateSession`) use
//! them: the client sends a message of about the size of a lease or a
//! placement, the server echoes it straight back (no task, no channel, no
//! tracing: nothing but gRPC), the client waits for the echo, and so on.
//! Both processes' CPU time over the round trips, halved, is what one
//! one-way crossing costs at the least: no mesh message can cost less.
//! Each runtime flavour is run for both ends: `current` (one thread, the
//! runtime's own), `1` and `2` (tokio's multi-thread runtime with that many
//! workers; a service with one thread per core runs the latter here).
//!
//! ```text
//! cargo run --release -p sluice-tests --example grpc_floor -- [ROUND_TRIPS] [REPEATS] [FLAVOURS]
//! ```
//!
//! `tests/bench/results/frontend.md` uses it to bound what the separate-
//! process mesh can cost per request against `sluice up`.

use std::convert::Infallible;
use std::io::BufRead;
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::task::{Context, Poll};
use std::time::Instant;

use anyhow::Context as _;
use sluice_proto::Codec;
use sluice_proto::common::v1::RpcStatus;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

type Message = RpcStatus;
type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

const PATH: &str = "/sluice.bench.Echo/Echo";
const FLAVOURS: [&str; 3] = ["current", "1", "2"];

fn runtime(flavour: &str) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = match flavour {
        "current" => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(
                n.parse()
                    .context("a flavour is `current` or a thread count")?,
            );
            b
        }
    };
    Ok(builder.enable_all().build()?)
}

/// CPU seconds (user + system) of a process so far, from `/proc` (whose
/// clock ticks are `USER_HZ`, 100 on Linux).
fn cpu_seconds(pid: &str) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_name = stat.rsplit_once(')').context("malformed stat")?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / 100.0)
}

#[derive(Clone)]
struct Echo;

impl tonic::server::NamedService for Echo {
    const NAME: &'static str = "sluice.bench.Echo";
}

impl tower::Service<http::Request<tonic::body::Body>> for Echo {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(Codec::<Message, Message>::default());
            Ok(grpc.streaming(EchoStream, req).await)
        })
    }
}

struct EchoStream;

impl tonic::server::StreamingService<Message> for EchoStream {
    type Response = Message;
    type ResponseStream = Pin<Box<dyn Stream<Item = Result<Message, Status>> + Send>>;
    type Future = BoxFuture<Result<Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: Request<Streaming<Message>>) -> Self::Future {
        Box::pin(async move {
            let echo: Self::ResponseStream = Box::pin(request.into_inner());
            Ok(Response::new(echo))
        })
    }
}

async fn serve() -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("{}", listener.local_addr()?.port());
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(Echo)
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await?;
    Ok(())
}

/// Round trips on one stream; returns (wall µs per round trip, this
/// process's CPU seconds over them).
async fn ping_pong(port: u16, round_trips: u32) -> anyhow::Result<(f64, f64)> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await?;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let mut echoes = grpc
        .streaming(
            Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            http::uri::PathAndQuery::from_static(PATH),
            Codec::<Message, Message>::default(),
        )
        .await?
        .into_inner();
    let message = Message {
        code: 0,
        message: "x".repeat(150),
        ..Default::default()
    };
    let one = async |echoes: &mut Streaming<Message>| -> anyhow::Result<()> {
        tx.send(message.clone()).await?;
        echoes.next().await.context("the echo stream ended")??;
        Ok(())
    };
    for _ in 0..1_000 {
        one(&mut echoes).await?;
    }
    let (cpu, start) = (cpu_seconds("self")?, Instant::now());
    for _ in 0..round_trips {
        one(&mut echoes).await?;
    }
    let wall = start.elapsed().as_secs_f64() * 1e6 / f64::from(round_trips);
    Ok((wall, cpu_seconds("self")? - cpu))
}

fn measure(flavour: &str, round_trips: u32) -> anyhow::Result<String> {
    let mut server = Command::new(std::env::current_exe()?)
        .args(["serve", flavour])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().context("no stdout")?).read_line(&mut line)?;
    let port: u16 = line.trim().parse().context("the server's port")?;
    let pid = server.id().to_string();
    let result = (|| {
        let before = cpu_seconds(&pid)?;
        // The client's work runs on a runtime worker, as a service's does.
        let rt = runtime(flavour)?;
        let (wall, client) =
            rt.block_on(async move { tokio::spawn(ping_pong(port, round_trips)).await? })?;
        let server_cpu = cpu_seconds(&pid)? - before;
        let per = |s: f64| s * 1e6 / f64::from(round_trips);
        Ok(format!(
            "| {flavour} | {round_trips} | {wall:.1} | {:.1} | {:.1} | {:.1} |",
            per(client),
            per(server_cpu),
            (per(client) + per(server_cpu)) / 2.0
        ))
    })();
    let _ = server.kill();
    let _ = server.wait();
    result
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        return runtime(args.get(1).map_or("current", String::as_str))?.block_on(serve());
    }
    let round_trips: u32 = args.first().map_or(Ok(30_000), |a| a.parse())?;
    let repeats: u32 = args.get(1).map_or(Ok(3), |a| a.parse())?;
    let flavours: Vec<&str> = args
        .get(2)
        .map_or(FLAVOURS.to_vec(), |a| a.split(',').collect());
    println!(
        "| runtime (both ends) | round trips | wall µs per round trip | client CPU µs per round trip | server CPU µs per round trip | CPU µs per one-way crossing |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for _ in 0..repeats {
        for flavour in &flavours {
            println!("{}", measure(flavour, round_trips)?);
        }
    }
    Ok(())
}
