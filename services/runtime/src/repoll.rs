//! Tasks that wake themselves are polled again at once instead of through
//! the scheduler.
//!
//! hyper's HTTP/2 body pipe calls h2's `reserve_capacity` before each
//! message it sends, and h2 answers by waking the stream's send task: the
//! pipe itself, while it runs. tokio's multi-thread scheduler requeues a
//! task woken during its own poll as a yield, and a yield unparks an idle
//! worker to come and steal it; at low load that worker finds nothing and
//! parks again. So every message sent on a gRPC stream cost a futex wake,
//! a context switch and a second thread's scheduler loop: a bare gRPC
//! crossing cost ~57 µs of CPU with two runtime workers against ~38 µs
//! with one (`tests/examples/grpc_floor.rs`).
//!
//! [`Executor`] spawns hyper's tasks (connections, body pipes) as
//! [`Repoll`]: a wake that arrives while the task is being polled is kept,
//! and the task is polled again before its poll returns, up to
//! [`REPOLLS`] times and while the task has cooperative budget left; then it
//! yields as before, so a task that keeps waking itself, or that woke itself
//! to yield, still gives the others their turn. A wake between polls goes to
//! the scheduler as usual.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures::task::AtomicWaker;

/// Polls again in one poll at most, before yielding to the scheduler.
pub const REPOLLS: usize = 8;

const IDLE: u8 = 0;
const POLLING: u8 = 1;
/// Woken while polling: poll again.
const WOKEN: u8 = 2;

struct Shared {
    state: AtomicU8,
    /// The scheduler's waker for this task, as of its latest poll.
    outer: AtomicWaker,
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        match self
            .state
            .compare_exchange(POLLING, WOKEN, Ordering::AcqRel, Ordering::Acquire)
        {
            // Kept: the poll in progress polls again.
            Ok(_) | Err(WOKEN) => {}
            Err(_) => self.outer.wake(),
        }
    }
}

/// A future whose wakes during its own poll make it poll again at once.
pub struct Repoll<F> {
    inner: Pin<Box<F>>,
    shared: Arc<Shared>,
    waker: Waker,
}

impl<F: Future> Repoll<F> {
    pub fn new(inner: F) -> Self {
        let shared = Arc::new(Shared {
            state: AtomicU8::new(IDLE),
            outer: AtomicWaker::new(),
        });
        Self {
            inner: Box::pin(inner),
            waker: Waker::from(Arc::clone(&shared)),
            shared,
        }
    }
}

impl<F: Future> Future for Repoll<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.shared.outer.register(cx.waker());
        for _ in 0..REPOLLS {
            this.shared.state.store(POLLING, Ordering::Release);
            let mut inner_cx = Context::from_waker(&this.waker);
            if let Poll::Ready(out) = this.inner.as_mut().poll(&mut inner_cx) {
                this.shared.state.store(IDLE, Ordering::Release);
                return Poll::Ready(out);
            }
            if this
                .shared
                .state
                .compare_exchange(POLLING, IDLE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Poll::Pending;
            }
            // Out of its cooperative budget, the task woke itself to yield
            // (tokio's resources answer `Pending` until it does): let it.
            if !tokio::task::coop::has_budget_remaining() {
                break;
            }
        }
        // Still waking itself: let the others run first.
        this.shared.state.store(IDLE, Ordering::Release);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// hyper's executor for Sluice's gRPC servers and clients: `tokio::spawn`
/// of a [`Repoll`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Executor;

impl<F> hyper::rt::Executor<F> for Executor
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(Repoll::new(fut));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;

    /// Pending `wakes` times, waking itself each time, then ready.
    struct SelfWaking {
        wakes: usize,
        polls: Arc<AtomicUsize>,
    }

    impl Future for SelfWaking {
        type Output = ();

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            if self.wakes == 0 {
                return Poll::Ready(());
            }
            self.wakes -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    /// Counts the wakes of the outer waker.
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_wake_during_its_own_poll_polls_again_without_the_scheduler() {
        let polls = Arc::new(AtomicUsize::new(0));
        let mut fut = Box::pin(Repoll::new(SelfWaking {
            wakes: 3,
            polls: Arc::clone(&polls),
        }));
        let outer = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&outer));
        assert!(
            fut.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_ready()
        );
        assert_eq!(polls.load(Ordering::Relaxed), 4);
        assert_eq!(
            outer.0.load(Ordering::Relaxed),
            0,
            "the scheduler was not woken"
        );
    }

    #[test]
    fn a_task_that_keeps_waking_itself_yields_after_the_limit() {
        let polls = Arc::new(AtomicUsize::new(0));
        let mut fut = Box::pin(Repoll::new(SelfWaking {
            wakes: REPOLLS + 1,
            polls: Arc::clone(&polls),
        }));
        let outer = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&outer));
        let mut cx = Context::from_waker(&waker);
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), REPOLLS);
        assert_eq!(outer.0.load(Ordering::Relaxed), 1, "it yielded once");
        assert!(fut.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn a_wake_between_polls_reaches_the_scheduler() {
        let (tx, rx) = std::sync::mpsc::channel::<Waker>();
        let mut fut = Box::pin(Repoll::new(futures::future::poll_fn(move |cx| {
            // Hands its waker out once, pending until it is woken.
            if tx.send(cx.waker().clone()).is_ok() {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })));
        let outer = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&outer));
        assert!(
            fut.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        let inner = rx.recv().expect("the waker");
        assert_eq!(outer.0.load(Ordering::Relaxed), 0);
        inner.wake_by_ref();
        assert_eq!(outer.0.load(Ordering::Relaxed), 1);
        inner.wake();
        assert_eq!(
            outer.0.load(Ordering::Relaxed),
            1,
            "one registration, one wake"
        );
    }

    #[tokio::test]
    async fn a_task_out_of_budget_yields_instead_of_polling_again() {
        let polls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&polls);
        // Spends its budget on a channel that always has a message, then
        // finds the next receive pending (tokio wakes it to yield).
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        for _ in 0..10_000 {
            tx.send(()).expect("open");
        }
        let mut fut = Box::pin(Repoll::new(futures::future::poll_fn(move |cx| {
            counted.fetch_add(1, Ordering::Relaxed);
            loop {
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(())) => continue,
                    Poll::Ready(None) => return Poll::Ready(()),
                    Poll::Pending => return Poll::Pending,
                }
            }
        })));
        let outer = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&outer));
        // The test's own task polls it, inside that task's budget.
        let first = fut.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(first.is_pending());
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "no second poll without budget"
        );
        // tokio defers the wake that makes a task out of budget yield; it
        // reaches the scheduler once this task yields.
        tokio::task::yield_now().await;
        assert_eq!(outer.0.load(Ordering::Relaxed), 1, "it yielded");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wakes_from_other_threads_are_never_lost() {
        // A ping-pong between two Repoll tasks over channels, many times:
        // a lost wake would hang it.
        let (to_b, mut b_rx) = tokio::sync::mpsc::channel::<u32>(1);
        let (to_a, mut a_rx) = tokio::sync::mpsc::channel::<u32>(1);
        let b = tokio::spawn(Repoll::new(async move {
            while let Some(n) = b_rx.recv().await {
                if to_a.send(n + 1).await.is_err() {
                    break;
                }
            }
        }));
        let a = tokio::spawn(Repoll::new(async move {
            let mut n = 0;
            for _ in 0..20_000 {
                to_b.send(n).await.expect("b lives");
                n = a_rx.recv().await.expect("b answers");
            }
            n
        }));
        let n = tokio::time::timeout(Duration::from_secs(60), a)
            .await
            .expect("no lost wake")
            .expect("a");
        assert_eq!(n, 20_000);
        b.await.expect("b");
    }
}
