//! The registry of running cells under wardens that start and sweep at once: a folder being
//! made for one cell is never taken for a dead warden's by another's sweep.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use warden_cell::Registry;

#[test]
fn reservations_survive_sweeps_running_beside_them() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Arc::new(Registry::open(dir.path().to_path_buf()).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    // Sweeps, as every warden that starts makes one.
    let sweepers: Vec<_> = (0..2)
        .map(|_| {
            let (registry, done) = (Arc::clone(&registry), Arc::clone(&done));
            std::thread::spawn(move || {
                let mut sweeps = 0u64;
                while !done.load(Ordering::Relaxed) {
                    registry.list().unwrap();
                    sweeps += 1;
                }
                sweeps
            })
        })
        .collect();
    let makers: Vec<_> = (0..3)
        .map(|t| {
            let registry = Arc::clone(&registry);
            std::thread::spawn(move || {
                for i in 0..400 {
                    let name = format!("cell-{t}-{i}");
                    let reservation = registry
                        .reserve(&name)
                        .unwrap_or_else(|e| panic!("reserving {name}: {e}"));
                    // The reserved folder is whole (its lock is there), and the cells' mount
                    // point is left alone.
                    assert!(reservation.file("lock").is_file(), "{name} lost its lock");
                    assert!(registry.mount_point().is_dir(), "the mount point went");
                    drop(reservation);
                }
            })
        })
        .collect();
    for maker in makers {
        maker.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    let sweeps: u64 = sweepers.into_iter().map(|s| s.join().unwrap()).sum();
    assert!(
        sweeps > 10,
        "the sweeps ran beside the reservations ({sweeps})"
    );
    // A name is still taken while its reservation lives, and free once it went.
    let held = registry.reserve("held").unwrap();
    assert!(registry.reserve("held").is_err());
    drop(held);
    registry.reserve("held").unwrap();
}

/// A cell that takes execs has its starts lock in its folder from the start (its first exec
/// does not make the file); one that runs one command has none.
#[test]
fn a_cell_that_takes_execs_has_its_starts_lock_made_with_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::open(dir.path().to_path_buf()).unwrap();
    let lock = |name: &str| dir.path().join("cells").join(name).join("starts.lock");
    let _execs = registry.reserve_with("execs", true).unwrap();
    let _once = registry.reserve_with("once", false).unwrap();
    assert!(lock("execs").is_file(), "no starts lock in the folder");
    assert!(
        !lock("once").exists(),
        "a starts lock for a cell that takes no execs"
    );
}
