//! Threads for blocking control work (freezing, thawing, killing a cell; ending a cell made
//! ahead; handing a running cell its new rules): each piece runs on a thread that does nothing
//! else meanwhile, so that it never waits behind other blocking work (whatever a cell makes
//! slow) nor behind another piece.
//!
//! A thread whose piece is done waits a while for the next, rather than ending: a delete's
//! kill took a thread's start and end (a `clone3`, its stack's mapping and release) on its way
//! to the answer. A piece takes an idle thread where one waits, and starts a new one where none
//! does, so that it still never waits for another's end.

use std::ffi::CStr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::time::Duration;

use crate::{CellFailure, HarnessError};

type Job = Box<dyn FnOnce() + Send>;

/// At most this many threads wait for work; one done when as many wait ends.
const KEPT_IDLE: usize = 4;

/// How long a thread waits for its next piece before it ends.
const IDLE_FOR: Duration = Duration::from_secs(10);

/// The daemon's control threads.
static THREADS: Threads = Threads::new();

/// Control threads: those that wait for work, each by a number of its own and the way to hand
/// it a piece.
struct Threads {
    idle: Mutex<Vec<(u64, Sender<Job>)>>,
    numbers: AtomicU64,
}

thread_local! {
    /// The number of the control thread this is (0: none).
    static NUMBER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Runs `work` on a control thread that does nothing else until it is done (named `name` while
/// it runs, as `ps -L` and a debugger show it), and returns what it returned.
pub(crate) async fn on_own_thread<T: Send + 'static>(
    name: &'static CStr,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, HarnessError> {
    THREADS.on_own_thread(name, work).await
}

impl Threads {
    const fn new() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            numbers: AtomicU64::new(1),
        }
    }

    async fn on_own_thread<T: Send + 'static>(
        &'static self,
        name: &'static CStr,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, HarnessError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = nix::sys::prctl::set_name(name);
            let _ = tx.send(work());
        });
        self.hand_out(job).map_err(|e| {
            HarnessError::from(CellFailure::Unavailable(format!("starting a thread: {e}")))
        })?;
        rx.await.map_err(|_| {
            HarnessError::from(CellFailure::Core(
                "the control thread ended without an answer".into(),
            ))
        })
    }

    /// Gives `job` to a thread that waits, or to a new one where none does.
    fn hand_out(&'static self, mut job: Job) -> std::io::Result<()> {
        loop {
            let idle = self.idle.lock().ok().and_then(|mut idle| idle.pop());
            match idle {
                // A thread that ended after it was taken off the list sends the piece back.
                Some((_, thread)) => match thread.send(job) {
                    Ok(()) => return Ok(()),
                    Err(mpsc::SendError(back)) => job = back,
                },
                None => return self.start(job),
            }
        }
    }

    /// A new control thread, which runs `first` and then waits for more.
    fn start(&'static self, first: Job) -> std::io::Result<()> {
        let number = self.numbers.fetch_add(1, Ordering::Relaxed);
        std::thread::Builder::new()
            .name("cell-control".to_owned())
            .spawn(move || {
                NUMBER.with(|n| n.set(number));
                let (tx, rx) = mpsc::channel::<Job>();
                let mut job = first;
                loop {
                    job();
                    match self.idle.lock() {
                        Ok(mut idle) if idle.len() < KEPT_IDLE => idle.push((number, tx.clone())),
                        _ => return,
                    }
                    job = match rx.recv_timeout(IDLE_FOR) {
                        Ok(job) => job,
                        Err(RecvTimeoutError::Disconnected) => return,
                        Err(RecvTimeoutError::Timeout) => match self.stop_waiting(number) {
                            true => return,
                            // Taken off the list by a piece of work on its way here.
                            false => match rx.recv() {
                                Ok(job) => job,
                                Err(_) => return,
                            },
                        },
                    };
                }
            })
            .map(drop)
    }

    /// Takes thread `number` off the list of those that wait: false where a piece of work took
    /// it off first (and is handed to it next).
    fn stop_waiting(&self, number: u64) -> bool {
        let Ok(mut idle) = self.idle.lock() else {
            return true;
        };
        match idle.iter().position(|(n, _)| *n == number) {
            Some(at) => {
                idle.remove(at);
                true
            }
            None => false,
        }
    }

    /// The numbers of the threads that wait.
    #[cfg(test)]
    fn waiting(&self) -> Vec<u64> {
        self.idle.lock().unwrap().iter().map(|(n, _)| *n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two pieces at once each get a thread (neither waits for the other); a piece after them
    /// runs on a thread one of them left waiting, named for the piece; threads beyond those
    /// kept waiting end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pieces_at_once_run_at_once_and_a_later_one_takes_a_waiting_thread() {
        static OWN: Threads = Threads::new();
        let (first_in, first_wait) = std::sync::mpsc::channel::<()>();
        let (second_in, second_wait) = std::sync::mpsc::channel::<()>();
        // Each waits until the other has started: one thread for both would wait out its 10 s.
        let a = tokio::spawn(OWN.on_own_thread(c"test-a", move || {
            first_in.send(()).unwrap();
            second_wait.recv_timeout(Duration::from_secs(10)).is_ok()
        }));
        let b = tokio::spawn(OWN.on_own_thread(c"test-b", move || {
            second_in.send(()).unwrap();
            first_wait.recv_timeout(Duration::from_secs(10)).is_ok()
        }));
        assert!(
            a.await.unwrap().unwrap(),
            "the first piece waited for the second"
        );
        assert!(
            b.await.unwrap().unwrap(),
            "the second piece waited for the first"
        );
        // (A thread lists itself once its piece's answer is sent.)
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while OWN.waiting().len() < 2 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        let waiting = OWN.waiting();
        assert_eq!(
            waiting.len(),
            2,
            "two threads should wait for work: {waiting:?}"
        );
        let (number, name) = OWN
            .on_own_thread(c"test-later", || {
                let name = std::fs::read_to_string("/proc/thread-self/comm").unwrap();
                (NUMBER.with(|n| n.get()), name)
            })
            .await
            .unwrap();
        assert_eq!(name.trim_end(), "test-later");
        assert!(
            waiting.contains(&number),
            "the later piece ran on thread {number}, not on one of those waiting ({waiting:?})"
        );
        // Six at once: four threads are kept waiting after, the others end.
        let pieces: Vec<_> = (0..6)
            .map(|_| {
                tokio::spawn(OWN.on_own_thread(c"test-many", || {
                    std::thread::sleep(Duration::from_millis(50));
                }))
            })
            .collect();
        for piece in pieces {
            piece.await.unwrap().unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(OWN.waiting().len(), KEPT_IDLE);
    }
}
