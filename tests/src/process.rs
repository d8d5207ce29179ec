//! Child processes of the `sluice` binary for process-level tests.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Child, Command};

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
