//! The threads a CPU backend's forward pass splits its products over.
//!
//! A decode step opens a parallel section per product and per attention
//! pass: about 150 a step for a 30-layer model, each a fraction of a
//! millisecond. Rayon puts an idle worker to sleep within microseconds and
//! wakes it through a futex, so at batch 1 those wake-ups were a large part
//! of the step and two threads ran only 1.5× faster than one. llama.cpp
//! keeps its threads spinning between the operations of a graph; this is
//! that shape: the threads are started once, a section is published by
//! bumping an epoch the idle workers watch, and everyone, the caller
//! included, takes task indices off one atomic counter until none are left.
//! A worker that sees no section for [`SPIN`] parks, so an idle engine burns
//! no CPU.
//!
//! Why not a crate: rayon has no spin setting, and the spin-then-park pools
//! on crates.io abort the process on a panic in a section (`micropool`) or
//! are parts of other engines. A panic in a task here is caught on the
//! thread that ran it and raised again on the caller once every task has
//! finished, as rayon does.

use std::any::Any;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker watches for the next section before parking:
/// longer than the serial work between two sections of a step, shorter
/// than the gap between steps of an idle engine.
const SPIN: Duration = Duration::from_micros(200);

/// One parallel section: `f(0..n)`, living on the caller's stack.
struct Section<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Section<'_> {
    /// Runs tasks until none are left to claim.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n {
                return;
            }
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(payload);
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

struct Shared {
    /// Bumped for every section published.
    epoch: AtomicU64,
    /// The section being run (a `Section<'_>` on the caller's stack), or
    /// null between sections.
    section: AtomicPtr<Section<'static>>,
    /// Workers that may be reading `section`.
    busy: AtomicUsize,
    stop: AtomicBool,
}

/// A fixed team of threads; see the module documentation.
pub(crate) struct Team {
    shared: Arc<Shared>,
    workers: Vec<(Thread, JoinHandle<()>)>,
    /// The rayon pool big products (gemm's prefill) run on: see [`on_pool`].
    pool: Arc<rayon::ThreadPool>,
}

thread_local! {
    /// The team of the forward pass running on this thread, if any.
    static CURRENT: Cell<*const Team> = const { Cell::new(ptr::null()) };
}

/// Sets [`CURRENT`] until dropped, then puts back the team it replaced
/// (held in `.0`).
struct Current(*const Team);

impl Current {
    fn set(team: *const Team) -> Current {
        Current(CURRENT.with(|c| c.replace(team)))
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

impl Team {
    /// A team of `threads` (the caller counts as one), whose big products
    /// run on `pool`.
    pub(crate) fn new(
        threads: usize,
        name: &str,
        pool: Arc<rayon::ThreadPool>,
    ) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            section: AtomicPtr::new(ptr::null_mut()),
            busy: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        for i in 1..threads.max(1) {
            let shared = Arc::clone(&shared);
            let handle = thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || worker(&shared))?;
            workers.push((handle.thread().clone(), handle));
        }
        Ok(Team {
            shared,
            workers,
            pool,
        })
    }

    /// Threads that run a section, the caller included.
    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f` with this team as the one [`for_each`] and [`threads`]
    /// use on this thread.
    pub(crate) fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        let _restore = Current::set(self);
        f()
    }

    /// `f(i)` for every `i` in `0..n`, spread over the team; returns when
    /// all are done. A task's panic is raised here after that.
    pub(crate) fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        if n == 1 || self.workers.is_empty() {
            (0..n).for_each(f);
            return;
        }
        let section = Section {
            f,
            n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
        };
        let erased = (&section as *const Section<'_>).cast::<Section<'static>>();
        self.shared.section.store(erased.cast_mut(), SeqCst);
        self.shared.epoch.fetch_add(1, SeqCst);
        for (thread, _) in &self.workers {
            thread.unpark();
        }
        section.work();
        while section.done.load(SeqCst) < n {
            std::hint::spin_loop();
        }
        // No worker may read the section once this returns: unpublish it,
        // then wait out any worker that loaded the pointer before that.
        self.shared.section.store(ptr::null_mut(), SeqCst);
        while self.shared.busy.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        let panic = section
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("threads", &self.threads())
            .finish()
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        for (thread, handle) in self.workers.drain(..) {
            thread.unpark();
            let _ = handle.join();
        }
    }
}

fn worker(shared: &Shared) {
    let mut seen = shared.epoch.load(SeqCst);
    loop {
        let idle = Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.stop.load(SeqCst) {
                return;
            }
            let epoch = shared.epoch.load(SeqCst);
            if epoch != seen {
                seen = epoch;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
            } else if idle.elapsed() < SPIN {
                // Every few microseconds, let a thread that has work run
                // (the engine's own, the services beside it on a small
                // host): the next section waits at most that long.
                thread::yield_now();
            } else {
                // A section published after the check above also unparks.
                thread::park();
            }
        }
        shared.busy.fetch_add(1, SeqCst);
        let section = shared.section.load(SeqCst);
        if !section.is_null() {
            // SAFETY: `Team::run` keeps the section alive until it has seen
            // `busy` at zero after unpublishing it; this worker counted
            // itself busy before loading the pointer, so either it loaded
            // null or `run` waits for it.
            unsafe { (*section).work() };
        }
        shared.busy.fetch_sub(1, SeqCst);
    }
}

/// Threads of the team the current forward pass runs on (1 outside one).
pub(crate) fn threads() -> usize {
    CURRENT.with(|c| {
        let team = c.get();
        // SAFETY: `install` sets the pointer for the duration of a borrow
        // of the team and restores the previous one after.
        if team.is_null() {
            1
        } else {
            unsafe { (*team).threads() }
        }
    })
}

/// Runs `f` on the current team's rayon pool (gemm parallelises through
/// rayon), or where it is called outside a team.
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let team = CURRENT.with(Cell::get);
    if team.is_null() {
        f()
    } else {
        // SAFETY: as in `threads`.
        unsafe { (*team).pool.install(f) }
    }
}

/// `f(i)` for `i` in `0..n` on the current team, or serially outside one
/// (and inside a task: sections do not nest).
pub(crate) fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let current = Current::set(ptr::null());
    if current.0.is_null() {
        (0..n).for_each(f);
    } else {
        // SAFETY: as in `threads`.
        unsafe { (*current.0).run(n, f) }
    }
}

/// `f(i, &mut items[i])` for every item, on the current team.
pub(crate) fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    struct Items<T>(*mut T);
    // SAFETY: only used to hand each task its own item (see below).
    unsafe impl<T: Send> Sync for Items<T> {}
    let base = Items(items.as_mut_ptr());
    let base = &base;
    for_each(items.len(), &|i| {
        // SAFETY: a section runs each index exactly once, so no two tasks
        // hold the same item, and `items` is borrowed until all are done.
        let item = unsafe { &mut *base.0.add(i) };
        f(i, item);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> Arc<rayon::ThreadPool> {
        Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(2)
                .build()
                .expect("pool"),
        )
    }

    #[test]
    fn every_task_runs_once_across_many_sections() {
        let team = Team::new(3, "test-team", pool()).expect("team");
        let hits: Vec<AtomicUsize> = (0..97).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..500 {
            team.run(hits.len(), &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
        }
        assert!(hits.iter().all(|h| h.load(SeqCst) == 500));
    }

    #[test]
    fn sections_after_the_workers_parked_still_run() {
        let team = Team::new(2, "test-team", pool()).expect("team");
        let sum = AtomicUsize::new(0);
        for round in 0..3 {
            // Longer than the spin window: the worker parks in between.
            std::thread::sleep(SPIN * 5);
            team.run(64, &|i| {
                sum.fetch_add(i, SeqCst);
            });
            assert_eq!(sum.load(SeqCst), (round + 1) * 64 * 63 / 2);
        }
    }

    #[test]
    fn a_panicking_task_is_raised_on_the_caller_after_the_others() {
        let team = Team::new(2, "test-team", pool()).expect("team");
        let done = AtomicUsize::new(0);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            team.run(32, &|i| {
                if i == 5 {
                    panic!("task five");
                }
                done.fetch_add(1, SeqCst);
            })
        }));
        let payload = caught.expect_err("the panic reaches the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"task five"));
        assert_eq!(done.load(SeqCst), 31);
        // The team still works.
        let again = AtomicUsize::new(0);
        team.run(8, &|_| {
            again.fetch_add(1, SeqCst);
        });
        assert_eq!(again.load(SeqCst), 8);
    }

    #[test]
    fn items_are_handed_out_once_each_and_sections_do_not_nest() {
        let team = Team::new(2, "test-team", pool()).expect("team");
        let mut items = vec![0usize; 50];
        team.install(|| {
            for_each_mut(&mut items, |i, item| {
                // A nested section runs serially on this task's thread.
                let inner = AtomicUsize::new(0);
                for_each(4, &|_| {
                    inner.fetch_add(1, SeqCst);
                });
                *item = i + inner.load(SeqCst);
            });
        });
        assert!(items.iter().enumerate().all(|(i, v)| *v == i + 4));
    }

    #[test]
    fn install_scopes_the_current_team() {
        assert_eq!(threads(), 1);
        let team = Team::new(2, "test-team", pool()).expect("team");
        team.install(|| {
            assert_eq!(threads(), 2);
            assert_eq!(on_pool(rayon::current_num_threads), 2);
        });
        assert_eq!(threads(), 1);
    }
}
