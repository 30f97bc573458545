//! Process starts kept apart from a look at a cell's workspace that does without a freeze.
//!
//! Copying a running cell's layer (a snapshot) needs the layer to hold still: no process of
//! the cell may write it meanwhile. The cgroup freezer gives that, at a price (on a v1 freezer
//! each write of `freezer.state` waits for the kernel, ~160 us, and a snapshot writes it
//! twice). When nothing but the init runs in the cell, nothing can write the layer but a
//! process the init starts, and the init starts processes only when asked, over a line
//! (`exec::Line`). So every start holds this lock shared from before its request until the
//! init's answer (by then the process is in the cell's cgroup), and a look that takes the lock
//! exclusive without waiting and then finds the init alone in the cell's cgroup copies the
//! layer without a freeze, holding the lock: starts that come meanwhile wait for it.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{FlockOperation, Mode, OFlags, flock};

/// The lock's file, in the cell's runtime folder.
pub const LOCK_FILE: &str = "starts.lock";

fn open(path: &Path) -> io::Result<OwnedFd> {
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::CREATE | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::from_raw_mode(0o600),
    )
    .map_err(io::Error::from)
}

/// Makes the lock's file (with the cell's folder; a start makes it where it is missing).
pub fn create(path: &Path) -> io::Result<()> {
    open(path).map(drop)
}

/// Holds the lock shared, for one start: a look without a freeze under way is waited for.
pub fn starting(path: &Path) -> io::Result<OwnedFd> {
    let fd = open(path)?;
    match flock(&fd, FlockOperation::NonBlockingLockShared) {
        Ok(()) => Ok(fd),
        Err(rustix::io::Errno::WOULDBLOCK) => {
            flock(&fd, FlockOperation::LockShared).map_err(io::Error::from)?;
            Ok(fd)
        }
        Err(err) => Err(err.into()),
    }
}

/// The lock held exclusive, when no start is under way (`None` when one is, or when the lock
/// cannot be had).
pub fn quiet(path: &Path) -> Option<OwnedFd> {
    let fd = open(path).ok()?;
    flock(&fd, FlockOperation::NonBlockingLockExclusive).ok()?;
    Some(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_under_way_keeps_a_quiet_look_out_and_the_look_holds_starts_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        let start = starting(&path).unwrap();
        let other = starting(&path).unwrap();
        assert!(quiet(&path).is_none(), "a start is under way");
        drop(start);
        assert!(quiet(&path).is_none(), "another start is under way");
        drop(other);
        let look = quiet(&path).expect("no start under way");
        let (tx, rx) = std::sync::mpsc::channel();
        let waiting = {
            let path = path.clone();
            std::thread::spawn(move || {
                let held = starting(&path).unwrap();
                tx.send(()).unwrap();
                drop(held);
            })
        };
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(100))
                .is_err(),
            "a start went ahead while the look held the lock"
        );
        drop(look);
        rx.recv_timeout(std::time::Duration::from_secs(5))
            .expect("the start goes ahead once the look is done");
        waiting.join().unwrap();
    }
}
