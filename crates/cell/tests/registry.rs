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
    // One name taken and let go of by three wardens at once, beside the sweeps: a warden's
    // folder is never moved or removed under it by another's end (which lets go of the name
    // and keeps its folder as a spare), so its lock stays in place while it holds the name.
    let done = Arc::new(AtomicBool::new(false));
    let sweepers: Vec<_> = (0..2)
        .map(|_| {
            let (registry, done) = (Arc::clone(&registry), Arc::clone(&done));
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    registry.list().unwrap();
                }
            })
        })
        .collect();
    let contenders: Vec<_> = (0..3)
        .map(|_| {
            let registry = Arc::clone(&registry);
            std::thread::spawn(move || {
                let mut held = 0;
                for _ in 0..400 {
                    match registry.reserve("shared") {
                        Ok(reservation) => {
                            held += 1;
                            for _ in 0..3 {
                                assert!(
                                    reservation.file("lock").is_file(),
                                    "a held name's folder was moved or removed"
                                );
                                std::thread::yield_now();
                            }
                        }
                        Err(warden_cell::RegistryError::Taken(_)) => {}
                        Err(e) => panic!("reserving a contended name: {e}"),
                    }
                }
                held
            })
        })
        .collect();
    let held: u32 = contenders.into_iter().map(|c| c.join().unwrap()).sum();
    done.store(true, Ordering::Relaxed);
    for sweeper in sweepers {
        sweeper.join().unwrap();
    }
    assert!(held > 100, "the name was held {held} times");
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

/// An ended cell's folder is emptied and kept for the next cell (its directory's block is never
/// freed, which on a disk mounted with `discard` is a wait for the device at each cell's end);
/// no more than four are kept, and no listing shows one.
#[test]
fn an_ended_cells_folder_is_emptied_and_taken_by_the_next() {
    use std::os::unix::fs::MetadataExt as _;
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::open(dir.path().to_path_buf()).unwrap();
    let cells = dir.path().join("cells");
    let entries = || {
        let mut names: Vec<String> = std::fs::read_dir(&cells)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let first = registry.reserve("a").unwrap();
    std::fs::write(first.file("cell.json"), "{}").unwrap();
    std::fs::create_dir(first.file("state")).unwrap();
    std::fs::write(first.file("state").join("deep"), "x").unwrap();
    let folder = std::fs::metadata(first.dir()).unwrap().ino();
    drop(first);
    assert_eq!(entries(), vec![".spare-0"], "the folder was not kept");
    let spare = cells.join(".spare-0");
    assert_eq!(std::fs::metadata(&spare).unwrap().ino(), folder);
    assert_eq!(
        std::fs::read_dir(&spare).unwrap().count(),
        0,
        "the kept folder was not emptied"
    );
    assert!(registry.list().unwrap().is_empty(), "a spare was listed");
    assert!(spare.exists(), "a listing swept the spare");
    let second = registry.reserve("b").unwrap();
    assert_eq!(std::fs::metadata(second.dir()).unwrap().ino(), folder);
    assert!(second.file("lock").is_file());
    assert_eq!(entries(), vec!["b"]);
    // The name of an ended cell is free at once.
    drop(registry.reserve("a").unwrap());
    let many: Vec<_> = (0..6)
        .map(|i| registry.reserve(&format!("m{i}")).unwrap())
        .collect();
    drop(many);
    let mut kept: Vec<String> = ["b", ".spare-0", ".spare-1", ".spare-2", ".spare-3"]
        .map(str::to_owned)
        .into();
    kept.sort();
    assert_eq!(entries(), kept, "more than four folders were kept");
    drop(second);
    assert!(registry.reserve("b").is_ok(), "the name stayed taken");
}

/// A folder being made is told from a dead warden's half-made one by the age of its last
/// change of status, which taking a spare folder (a rename) sets: a spare's modification time
/// may be hours old, and a sweep beside the reservation must not take the folder from it.
#[test]
fn a_folder_being_made_from_an_old_spare_is_not_swept() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::open(dir.path().to_path_buf()).unwrap();
    let made = dir.path().join("cells").join(".new-1-0");
    std::fs::create_dir(&made).unwrap();
    let hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    std::fs::File::open(&made)
        .unwrap()
        .set_modified(hours_ago)
        .unwrap();
    registry.list().unwrap();
    assert!(
        made.exists(),
        "a fresh folder with an old modification time was swept"
    );
}

/// A folder that could not be emptied (a mount left in it) is never kept for the next cell:
/// whatever is left must not meet it (a `killed` mark would end it).
#[test]
fn a_folder_that_could_not_be_emptied_is_not_kept() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: mounting needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::open(dir.path().to_path_buf()).unwrap();
    let cells = dir.path().join("cells");
    let reservation = registry.reserve("stuck").unwrap();
    let held = reservation.file("held");
    std::fs::create_dir(&held).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &held,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .unwrap();
    std::fs::write(reservation.file("killed"), "").unwrap();
    drop(reservation);
    let names: Vec<String> = std::fs::read_dir(&cells)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    // The mount is found wherever the folder went, and let go of.
    let left: Vec<_> = names
        .iter()
        .filter(|n| cells.join(n).join("held").exists())
        .collect();
    for name in &left {
        nix::mount::umount2(
            &cells.join(name).join("held"),
            nix::mount::MntFlags::MNT_DETACH,
        )
        .unwrap();
    }
    assert_eq!(left.len(), 1, "the mount went somewhere unseen: {names:?}");
    assert!(
        names.iter().all(|n| !n.starts_with(".spare-")),
        "a folder with a mount in it was kept as a spare: {names:?}"
    );
    // The next cell is made afresh, without the mark.
    let next = registry.reserve("next").unwrap();
    assert!(!next.file("killed").exists());
}
