//! Work that a request leaves behind and does not wait for: removing a discarded layer,
//! letting go of an old overlay (its teardown lets go of every inode it cached).
//!
//! In a process that outlives its requests (the daemon, once it calls [`outlive_requests`]),
//! the work goes to one thread of its own, at the lowest priority of the normal class, one
//! piece after another, each begun once the request that left it has answered ([`SETTLE`]). A
//! fork of the daemon for it would cost the request about a millisecond (the kernel copies the
//! page tables of its tens of MiB, and every page the daemon writes afterwards is copied once
//! more), which is most of what a quick snapshot or reset costs. A
//! daemon that is told to end finishes what is queued first ([`finish`]); a piece still waiting
//! when the daemon is killed is lost: what it would have removed is a leftover that goes with
//! its cell's layer (`upper.old-*`), or, for a removed cell's layer (`.gone-*`), is removed by
//! the next daemon's start ([`sweep_gone_layers`]); a layer's own file system is unmounted
//! before its removal is queued, so no mount is left.
//!
//! In a process that ends with its request (`warden snapshot` without a daemon), a forked
//! child does the work, so that it is done after the caller has exited; a small thread reaps
//! the child, so that a caller that forks many keeps no zombies.

use std::io::Read as _;
use std::os::fd::{AsRawFd as _, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use super::sys;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A piece of work for the background thread, and when it was handed over.
type Piece = (Instant, Job);

/// How long the background thread lets a piece wait after it was handed over: the request that
/// left it behind answers meanwhile, its last steps not sharing two cores, and the cell's file
/// system, with that work. (Begun at once, an old overlay's teardown and a snapshot's size
/// count ran beside the snapshot's last renames and records. Quiet snapshots of 10,000 and
/// 1,000 changed files, btrfs, 15 rounds each, taking turns with the build before on a daemon
/// of its own: medians 4.03 and 4.07 ms against 4.27 and 4.58, p90 5.82 and 5.39 against 8.44
/// and 7.11.)
pub(super) const SETTLE: Duration = Duration::from_millis(50);

/// In a process that outlives its requests, waits [`SETTLE`]: for work begun on a thread of
/// its own after a request left it behind (a snapshot's size count).
pub(super) fn settle() {
    if outlives_requests() {
        std::thread::sleep(SETTLE);
    }
}

static OUTLIVES_REQUESTS: AtomicBool = AtomicBool::new(false);

/// The worker thread's queue, made with the first piece of work.
static QUEUE: OnceLock<Mutex<Option<mpsc::Sender<Piece>>>> = OnceLock::new();

/// Says that this process outlives the requests it serves (the daemon): background work runs
/// on a thread of its own from now on.
pub fn outlive_requests() {
    OUTLIVES_REQUESTS.store(true, Ordering::Relaxed);
}

/// Whether this process said it outlives its requests.
pub fn outlives_requests() -> bool {
    OUTLIVES_REQUESTS.load(Ordering::Relaxed)
}

/// Runs `job` after the caller goes on: on the background thread in a process that outlives
/// its requests, else in a forked child that holds none of the caller's descriptors (no lock
/// of the caller's stays held while it works); where neither can be had, here and now. The
/// descriptor `job` answers with is let go of last: in a forked child, not before the caller
/// has ended, so that the caller's own last holds on what it names
/// go first. A removed layer's disk image is freed (its blocks, each discarded on a disk mounted
/// with `discard`, 0.5-0.6 ms for a cell's image here) by whoever lets go of it last: with the
/// image held here, that is this child, not the caller's end (whose mount namespace, torn down
/// as the caller ends, holds the image's file system and so its loop device). On the background
/// thread, it is let go of at once.
///
/// `also` is held the same way from the start (the caller's holds on what it names: a detached
/// mount of the layer's file system, whose teardown, a commit of the file system and the loop
/// device's end, is then the child's too, not the caller's end's).
pub fn run_holding(also: Vec<OwnedFd>, job: impl FnOnce() -> Option<OwnedFd> + Send + 'static) {
    if outlives_requests() {
        return dispatch(Box::new(move || drop((job(), also))), &[]);
    }
    // The caller, watched by the child (opened here: the child's parent may have ended
    // before it looks).
    let Ok(caller) = sys::pidfd_open(std::process::id() as libc::pid_t) else {
        return dispatch(Box::new(move || drop((job(), also))), &[]);
    };
    let mut keep: Vec<RawFd> = also.iter().map(|fd| fd.as_raw_fd()).collect();
    keep.push(caller.as_raw_fd());
    dispatch(
        Box::new(move || {
            let held = (job(), also);
            if held.0.is_some() || !held.1.is_empty() {
                let mut fds = [nix::poll::PollFd::new(
                    std::os::fd::AsFd::as_fd(&caller),
                    nix::poll::PollFlags::POLLIN,
                )];
                // Bounded: a caller that goes on for long has let go of its holds long before.
                let _ = nix::poll::poll(&mut fds, CALLER_END_WAIT_MS);
            }
            drop(held);
        }),
        &keep,
    );
}

/// How long `run_holding`'s child waits for its caller's end (milliseconds).
const CALLER_END_WAIT_MS: u16 = 30_000;

/// Lets go of `held` after the caller goes on (the last reference to a detached mount: its
/// teardown), as `run_holding` does its work; the caller's own copies must be gone by then (a forked
/// child lets go of its copies once the caller has dropped the ones it had).
pub fn let_go(held: Vec<OwnedFd>) {
    let raw: Vec<RawFd> = held.iter().map(|fd| fd.as_raw_fd()).collect();
    dispatch(Box::new(move || drop(held)), &raw);
}

/// Runs `job` on the background thread, in a process that outlives its requests (a daemon's
/// work made ready for its next request); elsewhere it is not run, nor once the daemon
/// finishes (`finish`: there is no next request to ready anything for).
pub(super) fn later(job: impl FnOnce() + Send + 'static) {
    if outlives_requests() {
        let _ = queue(Box::new(move || {
            if !FINISHING.load(Ordering::Relaxed) {
                job();
            }
        }));
    }
}

/// The daemon finishes: work that readies its next request is not done any more.
static FINISHING: AtomicBool = AtomicBool::new(false);

/// Reaps `child` (a child of this process's that is about to end) on the background thread,
/// or on a small thread of its own where there is none.
pub(super) fn reap(child: libc::pid_t) {
    let wait = move || {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child), None);
    };
    if !outlives_requests() || queue(Box::new(wait)).is_err() {
        reap_on_own_thread(child);
    }
}

/// Reaps `child` on a small thread of its own, so that a caller that forks many keeps no
/// zombies.
fn reap_on_own_thread(child: libc::pid_t) {
    let _ = std::thread::Builder::new()
        .name("background-reaper".to_owned())
        .stack_size(64 * 1024)
        .spawn(move || {
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child), None);
        });
}

/// `job` to the thread or to a child that keeps the descriptors `keep` only.
fn dispatch(job: Job, keep: &[RawFd]) {
    let handed = match outlives_requests() {
        true => queue(job),
        false => fork(job, keep),
    };
    if let Err(job) = handed {
        job();
    }
}

/// Waits, at most `within`, until the work handed to the background thread so far is done:
/// for a daemon's end, so that what its last requests left behind is not left undone. Whether
/// it was done (or there was none).
pub fn finish(within: std::time::Duration) -> bool {
    FINISHING.store(true, Ordering::Relaxed);
    let Some(slot) = QUEUE.get() else {
        return true;
    };
    let (done_tx, done) = mpsc::channel::<()>();
    let sent = match slot.lock() {
        Ok(sender) => sender.as_ref().is_some_and(|tx| {
            let mark: Job = Box::new(move || {
                let _ = done_tx.send(());
            });
            tx.send((Instant::now(), mark)).is_ok()
        }),
        Err(_) => false,
    };
    // The pieces run in order: this one runs once those before it have.
    !sent || done.recv_timeout(within).is_ok()
}

/// Hands `job` to the background thread (started with the first): `Err(job)` where the thread
/// cannot be had.
fn queue(job: Job) -> Result<(), Job> {
    let slot = QUEUE.get_or_init(|| Mutex::new(start()));
    let Ok(mut sender) = slot.lock() else {
        return Err(job);
    };
    let Some(tx) = sender.as_ref() else {
        return Err(job);
    };
    match tx.send((Instant::now(), job)) {
        Ok(()) => Ok(()),
        Err(mpsc::SendError((_, job))) => {
            // The thread ended (a piece of work panicked): the next piece starts another.
            *sender = start();
            match sender.as_ref() {
                Some(tx) => tx
                    .send((Instant::now(), job))
                    .map_err(|mpsc::SendError((_, job))| job),
                None => Err(job),
            }
        }
    }
}

/// The background thread: `None` where it cannot be started.
fn start() -> Option<mpsc::Sender<Piece>> {
    let (tx, rx) = mpsc::channel::<Piece>();
    std::thread::Builder::new()
        .name("background".to_owned())
        .spawn(move || {
            // Below the requests, yet never starved: a piece of work may take the kernel's
            // mount lock for a moment (an overlay's teardown), which the idle class could hold
            // up for as long as the machine stays busy.
            sys::lower_priority(0);
            for (handed, job) in rx {
                // Not before the request that left it has answered (`SETTLE` after it was
                // handed over; a piece that waited behind others that long already goes on).
                std::thread::sleep((handed + SETTLE).saturating_duration_since(Instant::now()));
                job();
            }
        })
        .ok()
        .map(|_| tx)
}

/// Runs `job` in a forked child that exits after it, with the descriptors `keep` and none
/// other of the caller's: `Err(job)` where the fork failed. The child starts once the caller
/// has dropped its own copy of `job` (so that the child's copies of what it holds are the last).
fn fork(job: Job, keep: &[RawFd]) -> Result<(), Job> {
    let Ok((go_r, go_w)) = sys::pipe() else {
        return Err(job);
    };
    match sys::clone_process(0) {
        Ok(0) => {
            drop(go_w);
            // Let go of the caller's stdio, so that nobody waits on this child's pipes.
            sys::stdio_to_null();
            let mut keep = keep.to_vec();
            keep.push(go_r.as_raw_fd());
            let _ = sys::close_except(&keep);
            // End of file once the caller has dropped its copies (and every other process
            // that was forked meanwhile has ended or let go of the pipe).
            let _ = std::fs::File::from(go_r).read(&mut [0u8; 1]);
            job();
            sys::exit_now(0);
        }
        Ok(child) => {
            drop(job);
            drop((go_r, go_w));
            reap_on_own_thread(child);
            Ok(())
        }
        Err(_) => Err(job),
    }
}

/// Where a removed cell's layer at `dir` goes out of its place before it is removed:
/// `.gone-NAME-TIME` beside it, which `sweep_gone_layers` finds where a kill cut the removal.
pub(super) fn gone_path(dir: &std::path::Path) -> std::path::PathBuf {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    dir.with_file_name(format!(
        ".gone-{}-{stamp}",
        dir.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ))
}

/// Removes the layers of removed cells (`.gone-*` in `layers`) that a killed warden left
/// behind, in the background. For a daemon's start.
pub fn sweep_gone_layers(layers: &Path) {
    let Ok(entries) = std::fs::read_dir(layers) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".gone-") {
            super::snapshot::remove_in_background(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread begins a piece no sooner than `SETTLE` after it was handed over (the request
    /// that left it answers meanwhile), and pieces handed over together wait that once, not
    /// once each.
    #[test]
    fn a_piece_waits_until_the_request_that_left_it_has_answered() {
        let (tx, rx) = mpsc::channel();
        let handed = Instant::now();
        for i in 0..4 {
            let tx = tx.clone();
            queue(Box::new(move || {
                let _ = tx.send((i, Instant::now()));
            }))
            .unwrap_or_else(|_| panic!("no background thread"));
        }
        let begun: Vec<(i32, Instant)> = (0..4)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(
            begun.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        for (i, at) in &begun {
            assert!(
                at.duration_since(handed) >= SETTLE,
                "piece {i} began {:?} after it was handed over",
                at.duration_since(handed)
            );
        }
        let spread = begun[3].1.duration_since(begun[0].1);
        assert!(
            spread < SETTLE,
            "the pieces waited one after another: {spread:?}"
        );
    }

    /// Both ways run the work after the caller has gone on: the forked child in a process of
    /// its own, the thread in this one, in order.
    #[test]
    fn work_runs_after_the_caller_in_a_child_or_on_the_thread() {
        let tmp = tempfile::tempdir().unwrap();
        let mark = tmp.path().join("forked");
        let pid = std::process::id();
        let (mark_in_child, owner) = (mark.clone(), tmp.path().join("owner"));
        fork(
            Box::new(move || {
                // The child's own pid, not the caller's.
                let _ = std::fs::write(&owner, std::process::id().to_string());
                let _ = std::fs::write(&mark_in_child, "done");
            }),
            &[],
        )
        .unwrap_or_else(|_| panic!("fork failed"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !mark.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(mark.exists(), "the forked child did not run the work");
        let owner: u32 = std::fs::read_to_string(tmp.path().join("owner"))
            .unwrap()
            .parse()
            .unwrap();
        assert_ne!(owner, pid, "the work ran in the caller");

        let (tx, rx) = mpsc::channel();
        for i in 0..3 {
            let tx = tx.clone();
            queue(Box::new(move || {
                let on = std::thread::current().name().map(str::to_owned);
                let _ = tx.send((i, on));
            }))
            .unwrap_or_else(|_| panic!("no background thread"));
        }
        let got: Vec<_> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(
            got.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [0, 1, 2],
            "the pieces ran out of order"
        );
        assert!(
            got.iter()
                .all(|(_, on)| on.as_deref() == Some("background")),
            "a piece ran elsewhere: {got:?}"
        );
    }

    /// What `run_holding`'s work answers with is held past the caller's end, and let go of
    /// then: a FIFO the work opens for writing has a writer while the caller lives on, and
    /// reads as ended once the caller has ended (a removed layer's image, so held, is freed by
    /// the background child, not by the caller's last mount).
    #[test]
    fn a_held_descriptor_is_let_go_of_once_the_caller_has_ended() {
        use std::io::Read as _;
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let mut reader = std::fs::File::from(
            rustix::fs::open(
                &fifo,
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK,
                rustix::fs::Mode::empty(),
            )
            .unwrap(),
        );
        // Whether someone holds the FIFO for writing (no data is ever written).
        let mut has_writer = || matches!(reader.read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        let (end_r, end_w) = sys::pipe().unwrap();
        let caller = match sys::clone_process(0).unwrap() {
            0 => {
                drop(end_w);
                let path = fifo.clone();
                run_holding(Vec::new(), move || {
                    rustix::fs::open(
                        &path,
                        rustix::fs::OFlags::WRONLY
                            | rustix::fs::OFlags::NONBLOCK
                            | rustix::fs::OFlags::CLOEXEC,
                        rustix::fs::Mode::empty(),
                    )
                    .ok()
                });
                // Lives on until told to end.
                let _ = std::fs::File::from(end_r).read(&mut [0u8; 1]);
                sys::exit_now(0);
            }
            caller => caller,
        };
        drop(end_r);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !has_writer() {
            assert!(Instant::now() < deadline, "the work never held the FIFO");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(300));
        assert!(has_writer(), "let go of while the caller lives on");
        drop(end_w);
        nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(caller), None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while has_writer() {
            assert!(
                Instant::now() < deadline,
                "still held after the caller ended"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A forked child keeps no descriptor of the caller's but those it is given: a lock the
    /// caller lets go of is free while the child still works; the descriptor it was given
    /// stays open in it until its work drops it (a pipe's far end sees its end then).
    #[test]
    fn a_forked_child_holds_only_what_it_was_given() {
        use std::os::fd::AsFd as _;
        let tmp = tempfile::tempdir().unwrap();
        let lock_path = tmp.path().join("lock");
        let lock = std::fs::File::create(&lock_path).unwrap();
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
        let (given_r, given_w) = sys::pipe().unwrap();
        let (done_r, done_w) = sys::pipe().unwrap();
        let raw = [given_w.as_raw_fd(), done_w.as_raw_fd()];
        fork(
            Box::new(move || {
                // Says it has started, holds on a moment, then lets go of both.
                let mut started = std::fs::File::from(done_w);
                let _ = std::io::Write::write_all(&mut started, b"s");
                std::thread::sleep(Duration::from_secs(2));
                drop((given_w, started));
            }),
            &raw,
        )
        .unwrap_or_else(|_| panic!("fork failed"));
        let mut done = std::fs::File::from(done_r);
        let mut byte = [0u8; 1];
        assert_eq!(done.read(&mut byte).unwrap(), 1, "the work did not start");
        drop(lock);
        // The child still works: the lock is free all the same (tried for a second: another
        // test's child forked meanwhile holds a copy for a moment).
        let again = std::fs::File::open(&lock_path).unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        while rustix::fs::flock(&again, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the forked child holds the caller's lock"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            !sys::wait_readable(given_r.as_fd(), Duration::from_millis(50)).unwrap(),
            "the child let go of what it was given before its work"
        );
        assert_eq!(done.read(&mut byte).unwrap(), 0, "a second byte came");
        assert!(
            sys::wait_readable(given_r.as_fd(), Duration::from_secs(5)).unwrap(),
            "the child did not let go of what it was given"
        );
    }

    /// A daemon's start removes the layers of removed cells that a killed warden left, and no
    /// cell's layer.
    #[test]
    fn the_sweep_removes_only_layers_on_their_way_out() {
        let tmp = tempfile::tempdir().unwrap();
        let gone = tmp.path().join(".gone-c-1");
        let kept = tmp.path().join("c");
        for dir in [&gone, &kept] {
            std::fs::create_dir_all(dir.join("upper/d")).unwrap();
            std::fs::write(dir.join("upper/d/f"), "x").unwrap();
        }
        sweep_gone_layers(tmp.path());
        let deadline = Instant::now() + Duration::from_secs(10);
        while gone.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!gone.exists(), "the left layer is still there");
        assert!(kept.join("upper/d/f").exists(), "a cell's layer went");
    }

    /// A daemon's end waits for what it queued, and no longer than it said.
    #[test]
    fn finishing_waits_for_the_work_queued_before() {
        use std::sync::atomic::AtomicBool;
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&done);
        queue(Box::new(move || {
            std::thread::sleep(Duration::from_millis(400));
            flag.store(true, Ordering::SeqCst);
        }))
        .unwrap_or_else(|_| panic!("no background thread"));
        assert!(
            !finish(Duration::from_millis(50)),
            "finished before the work was done"
        );
        assert!(finish(Duration::from_secs(10)), "the work did not finish");
        assert!(done.load(Ordering::SeqCst), "finished before the work ran");
    }
}
