//! Child processes of the `sluice` binary for process-level tests.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

/// What a `sluice` service prints once bound, before its address.
const LISTENING: &str = "listening on ";

/// The first line of `log` that reads as an error (`ERROR`, `error:`,
/// `panicked`), or its last line: what to show when a child failed. The
/// whole log stays where it is.
pub fn first_error(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = text
        .lines()
        .find(|l| l.contains("ERROR") || l.contains("error:") || l.contains("panicked"))
        .or_else(|| text.lines().last())
        .unwrap_or("(empty log)");
    format!("{}: {line}", log.display())
}

/// A child process, killed and reaped when dropped. Its standard output
/// and error go to one log file.
#[derive(Debug)]
pub struct Proc {
    /// The process itself (to signal it, or read its id).
    pub child: Child,
}

impl Proc {
    /// Starts `bin` with `args`, logging to `log` with `RUST_LOG=info`
    /// unless the test's environment sets it.
    pub fn spawn<I, S>(bin: impl AsRef<OsStr>, args: I, log: &Path) -> anyhow::Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = std::fs::File::create(log)?;
        let child = Command::new(bin)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?;
        Ok(Self { child })
    }

    /// Starts `bin` like [`Proc::spawn`] with `args` (which bind
    /// `--listen 127.0.0.1:0`) and waits for the address it reports once
    /// bound: no port is chosen here and handed over, so none can be taken
    /// by another bind in between. A child that exits first, or reports
    /// nothing within a minute, fails with the first error line of its log.
    pub async fn spawn_listening<I, S>(
        bin: impl AsRef<OsStr>,
        args: I,
        log: &Path,
    ) -> anyhow::Result<(Self, String)>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut proc = Self::spawn(bin, args, log)?;
        let what = format!("the address {} reports", log.display());
        let addr = crate::wait::until(&what, Duration::from_secs(60), || {
            let found = std::fs::read_to_string(log).map(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix(LISTENING).map(str::to_owned))
            });
            let exited = proc.child.try_wait();
            async move {
                if let Some(addr) = found? {
                    return Ok(Some(addr));
                }
                if let Some(status) = exited? {
                    anyhow::bail!("exited ({status}) before listening: {}", first_error(log));
                }
                Ok(None)
            }
        })
        .await
        .map_err(|e| e.context(first_error(log)))?;
        Ok((proc, addr))
    }

    /// The value of `field` on the first line of `log` that says `message`
    /// (a structured log line in the text format: `… message field=value`),
    /// waiting up to a minute for it: what a child bound besides its
    /// `--listen` address (a port 0 it was given) is read back this way.
    pub async fn logged(log: &Path, message: &str, field: &str) -> anyhow::Result<String> {
        let what = format!("`{message}` in {}", log.display());
        let key = format!("{field}=");
        crate::wait::until(&what, Duration::from_secs(60), || {
            let found = std::fs::read_to_string(log).map(|text| {
                text.lines().filter(|l| l.contains(message)).find_map(|l| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix(key.as_str()).map(str::to_owned))
                })
            });
            async move { Ok(found?) }
        })
        .await
    }

    /// `kill -9`, and waits for the process to end.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        let _ = self.child.wait();
        Ok(())
    }

    /// Freezes the process (SIGSTOP): its sockets stay open and the kernel
    /// still accepts connections, but it answers nothing until
    /// [`Self::resume`] (a hung process, not a dead one).
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal("-STOP")
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let id = self.child.id().to_string();
        let status = Command::new("kill").arg(sig).arg(&id).status()?;
        anyhow::ensure!(status.success(), "kill {sig} {id} failed: {status}");
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The discovery flags every service of a process-level test mesh takes:
/// its etcd, a namespace of its own, a short lease and drain, and
/// `--discovery-grace` when given.
pub fn mesh_args(etcd: &str, namespace: &str, lease_ttl: u64, grace: Option<u64>) -> Vec<String> {
    let mut args: Vec<String> = [
        "--etcd",
        etcd,
        "--namespace",
        namespace,
        "--lease-ttl",
        &lease_ttl.to_string(),
        "--drain-timeout",
        "2",
    ]
    .map(str::to_owned)
    .into();
    if let Some(g) = grace {
        args.extend(["--discovery-grace".to_owned(), g.to_string()]);
    }
    args
}

/// Writes the built-in model into `dir/sluice-tiny` with `bin model init`;
/// returns its path.
pub fn write_model(bin: impl AsRef<OsStr>, dir: &Path) -> anyhow::Result<String> {
    let model = dir.join("sluice-tiny");
    let status = Command::new(bin)
        .args(["model", "init", "--out"])
        .arg(&model)
        .status()?;
    anyhow::ensure!(status.success(), "sluice model init failed: {status}");
    Ok(model.to_string_lossy().into_owned())
}
