//! A real etcd-server for tests: started on free loopback ports with a
//! temporary data dir, restartable on the same ports and data, killed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A running `etcd` child process.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

impl EtcdServer {
    /// Starts etcd and waits until it answers. Fails with a clear message
    /// when the `etcd` binary is missing (`make deps` installs etcd-server).
    ///
    /// etcd cannot report a port it picked itself, so its ports are picked
    /// here; another process may take one before etcd binds it. etcd then
    /// exits at once, and it starts again on new ports (a few times).
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_on(crate::free_port).await
    }

    /// [`Self::start`] on ports `pick` gives.
    async fn start_on(mut pick: impl FnMut() -> anyhow::Result<u16>) -> anyhow::Result<Self> {
        const ATTEMPTS: usize = 5;
        let mut s = Self {
            child: None,
            dir: tempfile::tempdir()?,
            client_port: 0,
            peer_port: 0,
        };
        let mut attempt = 1;
        loop {
            s.client_port = pick()?;
            s.peer_port = pick()?;
            match s.spawn().await {
                Ok(()) => return Ok(s),
                Err(e) if attempt < ATTEMPTS && s.exited() => {
                    eprintln!(
                        "etcd on ports {}/{}: {e:#}; new ports",
                        s.client_port, s.peer_port
                    );
                    s.kill();
                    s.dir = tempfile::tempdir()?;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the child has exited (a port it could not bind, above all).
    fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| c.try_wait().ok().flatten().is_some())
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(etcd_binary())
            .arg("--name")
            .arg("test")
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("test={peer}"))
            .arg("--log-level")
            .arg("error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting etcd (is etcd-server installed? run `make deps`)")?;
        self.child = Some(child);
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = format!("127.0.0.1:{}", self.client_port);
        loop {
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c.try_wait()?
            {
                bail!("etcd exited early: {status}");
            }
            if let Ok(Ok(mut s)) = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(&addr),
            )
            .await
            {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let req =
                    format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
                if s.write_all(req.as_bytes()).await.is_ok() {
                    let mut buf = Vec::new();
                    let _ =
                        tokio::time::timeout(Duration::from_secs(1), s.read_to_end(&mut buf)).await;
                    if String::from_utf8_lossy(&buf).contains("\"health\":\"true\"") {
                        return Ok(());
                    }
                }
            }
            if Instant::now() > deadline {
                bail!("etcd did not become healthy within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills etcd (SIGKILL), keeping its data dir.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops etcd with SIGSTOP: it holds its connections and answers
    /// nothing until [`Self::resume`]; leases expire meanwhile.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal("-STOP")
    }

    /// Lets a paused etcd go on (SIGCONT).
    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let Some(c) = self.child.as_ref() else {
            bail!("etcd is not running");
        };
        let status = Command::new("kill")
            .arg(sig)
            .arg(c.id().to_string())
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill {sig} {} failed: {status}", c.id());
        }
        Ok(())
    }

    /// Starts etcd again on the same ports with the same data.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn etcd_binary() -> String {
    std::env::var("SLUICE_TEST_ETCD").unwrap_or_else(|_| "etcd".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port taken between the pick and etcd's bind (here: held by this
    /// test) makes etcd exit at once; it starts again on new ports.
    #[tokio::test]
    async fn a_taken_port_is_picked_again() -> anyhow::Result<()> {
        let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = taken.local_addr()?.port();
        let mut picks = 0;
        let etcd = EtcdServer::start_on(|| {
            picks += 1;
            if picks == 1 {
                Ok(port)
            } else {
                crate::free_port()
            }
        })
        .await?;
        assert_ne!(etcd.client_port, port);
        assert_eq!(picks, 4, "two ports a start, two starts");
        Ok(())
    }
}
