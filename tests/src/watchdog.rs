//! A last resort for a test stuck where no timer fires (a blocked runtime,
//! a deadlock): [`watchdog`] ends the whole test process after a limit far
//! past any bound the test keeps itself, saying what was still running,
//! so a CI run fails with a place instead of being stopped at its own limit
//! with nothing said.

use std::sync::mpsc;
use std::time::Duration;

/// Stops its watchdog when dropped.
#[derive(Debug)]
pub struct Watchdog(mpsc::Sender<()>);

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// Ends the process (exit status 101, as a failed test) if the returned
/// guard is still alive after `after`, first writing `what()` straight to
/// stderr (the test harness captures what `eprintln!` prints, and would
/// never show it).
pub fn watchdog(after: Duration, what: impl FnOnce() -> String + Send + 'static) -> Watchdog {
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(after) {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "watchdog: still running after {after:?}: {}",
                what()
            );
            std::process::exit(101);
        }
    });
    Watchdog(tx)
}
