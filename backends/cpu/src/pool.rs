//! The worker pool the kernels split their work over.
//!
//! Decode runs hundreds of small ops per token, tens of microseconds apart. A pool whose
//! workers sleep between ops (rayon parks them) pays a futex wake-up per op, which on
//! sandboxed hosts costs as much as the op itself: measured on the H200 host, decode did
//! not get faster past one thread. These workers spin for a while after each job, so the
//! next op finds them awake, and park only once the backend has been idle for
//! `SPIN_BEFORE_PARK` (a server waiting for requests burns no CPU).

use std::{
    cell::UnsafeCell,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Condvar, Mutex,
    },
    time::{Duration, Instant},
};

const SPIN_BEFORE_PARK: Duration = Duration::from_millis(2);

/// A job: `f(task)` for every task index below `n`.
#[derive(Clone, Copy)]
struct Job {
    /// Borrowed for the duration of `Pool::run`, which waits for every task.
    f: *const (dyn Fn(usize) + Sync),
    n: usize,
}

struct Shared {
    /// Bumped (Release) after `job` is written; workers read `job` after seeing it (Acquire).
    generation: AtomicU64,
    job: UnsafeCell<Job>,
    next: AtomicUsize,
    done: AtomicUsize,
    /// Workers that have finished with the current generation. `run` waits for all of
    /// them, so no straggler can touch `next`/`job` while the next job is being posted.
    acks: AtomicUsize,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    wake: (Mutex<()>, Condvar),
}

// `job` is written only by the one thread inside `run` (serialised by `Pool::busy`) while
// no worker reads it, and read by workers only after the generation publishes it.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    busy: Mutex<()>,
    threads: usize,
}

fn noop(_: usize) {}

impl Pool {
    /// A pool of `threads` (the calling thread counts as one of them).
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let noop_ref: &(dyn Fn(usize) + Sync) = &noop;
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(Job { f: noop_ref, n: 0 }),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            acks: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            wake: (Mutex::new(()), Condvar::new()),
        });
        for i in 1..threads {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("cpu-backend-{i}"))
                .spawn(move || worker(&s))
                .expect("spawning a cpu backend worker");
        }
        Pool {
            shared,
            busy: Mutex::new(()),
            threads,
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0..n)` across the pool and returns when every task has finished. A panic
    /// in a task is reported as an error after the others finish.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        // Another thread already running a job here: do this one inline.
        let Ok(_guard) = self.busy.try_lock() else {
            return catch_unwind(AssertUnwindSafe(|| (0..n).for_each(f)))
                .map_err(|_| "a cpu kernel task panicked".to_string());
        };
        let s = &*self.shared;
        // Every worker acknowledged the previous job: none reads these now.
        s.next.store(0, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.acks.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        // SAFETY: see `unsafe impl Sync for Shared`; the lifetime of `f` is erased, and
        // this function does not return before every task that can use it is done.
        unsafe {
            let f: *const (dyn Fn(usize) + Sync) = std::mem::transmute(f);
            *s.job.get() = Job { f, n };
        }
        // SeqCst pairs with the parking worker's `sleepers` increment and re-check.
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.wake.0.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.1.notify_all();
        }
        work(s);
        let workers = self.threads - 1;
        while s.done.load(Ordering::Acquire) < n || s.acks.load(Ordering::Acquire) < workers {
            std::hint::spin_loop();
        }
        if s.panicked.load(Ordering::Relaxed) {
            return Err("a cpu kernel task panicked".into());
        }
        Ok(())
    }
}

/// Takes tasks of the current job until none are left.
fn work(s: &Shared) {
    // SAFETY: called after observing the generation that published this job.
    let job = unsafe { *s.job.get() };
    loop {
        let t = s.next.fetch_add(1, Ordering::Relaxed);
        if t >= job.n {
            return;
        }
        // SAFETY: `run` keeps `f` alive until `done` reaches `n`.
        let f = unsafe { &*job.f };
        if catch_unwind(AssertUnwindSafe(|| f(t))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

fn worker(s: &Shared) {
    // Generation 0 is the pool's starting value; a job posted before this thread first
    // looks (generation already 1) must still be taken, so don't read it here.
    let mut seen = 0;
    loop {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                work(s);
                s.acks.fetch_add(1, Ordering::Release);
                break;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && idle_since.elapsed() > SPIN_BEFORE_PARK {
                let lock = s.wake.0.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                // Re-check under the lock: a job posted meanwhile notifies after locking.
                if s.generation.load(Ordering::SeqCst) == seen {
                    let _ = s
                        .wake
                        .1
                        .wait_timeout(lock, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner());
                } else {
                    drop(lock);
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                spins = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let pool = Pool::new(3);
        for n in [0usize, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn a_panicking_task_is_an_error_not_a_hang() {
        let pool = Pool::new(2);
        let r = pool.run(8, &|t| {
            if t == 5 {
                panic!("boom");
            }
        });
        assert!(r.is_err());
        pool.run(4, &|_| {}).unwrap();
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = Pool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let count = AtomicUsize::new(0);
        pool.run(64, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }
}
