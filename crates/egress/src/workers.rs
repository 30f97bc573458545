//! The threads that serve a gateway's connections. Each connection still has a thread of its
//! own for its whole life (the relays block on their sockets), but a thread that finished one
//! waits a while for the next instead of ending: a new connection is handed to a waiting
//! thread (a wake-up) rather than to a new one (a `clone`, a stack mapped and faulted in, the
//! thread's setup, and its teardown after), which is most of what a short request through the
//! gateway costs beyond the relaying itself.
//!
//! The daemon's control of its cells (a freeze, a thaw, a kill) runs on such threads too, for
//! the same two reasons: a piece never waits behind another, and a delete's kill does not pay
//! for a thread's start and end on its way to the answer.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How long a thread waits for another connection before it ends.
const IDLE: Duration = Duration::from_secs(10);
/// The most threads kept waiting; one that finishes beyond them ends at once.
const KEPT: usize = 16;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Threads named `name`, started on demand and kept for a while.
pub struct Workers {
    name: String,
    state: Mutex<State>,
    ready: Condvar,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers").field("name", &self.name).finish()
    }
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Threads waiting for a job (they count themselves out once they hold the lock again).
    idle: usize,
}

impl Workers {
    pub fn new(name: &str) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
        })
    }

    /// Runs `job` on a waiting thread, or on a new one when none waits. Fails only when no
    /// thread could be started; the job is then dropped (a connection in it is closed).
    pub fn run(self: &Arc<Self>, job: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        let job: Job = Box::new(job);
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.idle > state.jobs.len() {
                state.jobs.push_back(job);
                drop(state);
                self.ready.notify_one();
                return Ok(());
            }
        }
        let workers = Arc::clone(self);
        std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || {
                job();
                workers.serve();
            })
            .map(drop)
    }

    /// A thread's life after its first job: the next jobs, until none comes for `IDLE` or
    /// enough threads wait already.
    fn serve(&self) {
        loop {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.jobs.is_empty() && state.idle >= KEPT {
                return;
            }
            state.idle += 1;
            let (mut state, _) = self
                .ready
                .wait_timeout_while(state, IDLE, |s| s.jobs.is_empty())
                .unwrap_or_else(|e| e.into_inner());
            state.idle -= 1;
            // A job pushed while this thread was counted as waiting is taken, even at the end
            // of its wait: the pusher counted on it.
            let Some(job) = state.jobs.pop_front() else {
                return;
            };
            drop(state);
            job();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn jobs_reuse_waiting_threads_and_every_job_runs() {
        let workers = Workers::new("test-worker");
        let done = Arc::new(AtomicUsize::new(0));
        let threads = Arc::new(Mutex::new(std::collections::HashSet::new()));
        for i in 0..200 {
            let (counter, threads) = (done.clone(), threads.clone());
            workers
                .run(move || {
                    threads.lock().unwrap().insert(std::thread::current().id());
                    counter.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            // One at a time: each finds the thread the last one used waiting again.
            let until = std::time::Instant::now() + Duration::from_secs(5);
            while done.load(Ordering::SeqCst) <= i && std::time::Instant::now() < until {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(done.load(Ordering::SeqCst), 200);
        let used = threads.lock().unwrap().len();
        assert!(used <= 3, "200 jobs one after another used {used} threads");
    }

    #[test]
    fn jobs_that_block_each_get_a_thread() {
        let workers = Workers::new("test-worker");
        let (tx, rx) = std::sync::mpsc::channel();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        // 40 jobs that all wait for the gate: none may wait behind another.
        for _ in 0..40 {
            let (tx, gate) = (tx.clone(), gate.clone());
            workers
                .run(move || {
                    tx.send(()).unwrap();
                    let (open, cv) = &*gate;
                    let _open = cv.wait_while(open.lock().unwrap(), |o| !*o).unwrap();
                })
                .unwrap();
        }
        for _ in 0..40 {
            rx.recv_timeout(Duration::from_secs(5))
                .expect("a job waited behind a blocked one");
        }
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
    }
}
