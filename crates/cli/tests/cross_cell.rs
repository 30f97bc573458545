//! What one cell can do to another beside it: observe it, affect it, or starve it of what the
//! kernel counts per user.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use support::*;

/// FNV-1a of a name modulo 2^20: where the search for its cell's user namespace owner starts
/// (the owner once was this, whatever other cell had it too).
fn owner_hash(name: &str) -> u32 {
    name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    }) % (1 << 20)
}

/// Makes as many inotify instances as it can, says how many, and holds them until its stdin
/// closes.
const HOG: &str = "import ctypes, time\n\
                   libc = ctypes.CDLL(None, use_errno=True)\n\
                   fds = []\n\
                   while len(fds) < 4096 and (fd := libc.inotify_init1(0)) >= 0: fds.append(fd)\n\
                   print(len(fds), flush=True)\n\
                   time.sleep(30)\n";

/// The kernel counts a cell's inotify instances (and watches, fanotify groups and marks) to the
/// owner of its user namespace in the host's namespace. Root-started cells' owners were picked
/// by a hash of the name into 2^20 uids, so two cells could share one (by chance: about even
/// odds among 1,200 cells; or by a name chosen for it), and then one holding every instance
/// left the other none.
#[test]
fn a_cell_cannot_use_up_the_inotify_instances_of_another_whose_name_shares_its_hash() {
    if !is_root() {
        eprintln!(
            "skipped: a_cell_cannot_use_up_the_inotify_instances_of_another_whose_name_shares_its_hash needs root"
        );
        return;
    }
    let victim = unique("victim");
    let target = owner_hash(&victim);
    let hog = (0u64..)
        .map(|i| format!("hog-{i}"))
        .find(|n| owner_hash(n) == target)
        .unwrap();
    let hogging = Holding::start(&hog, "30s", HOG);
    let held: u32 = hogging
        .first_line
        .trim()
        .parse()
        .expect("the first cell says how many it holds");
    // While the first cell holds every instance it could get, the second makes its own.
    let made = warden()
        .args([
            "run",
            "--name",
            &victim,
            "--timeout",
            "15s",
            "--",
            "python3",
            "-c",
            "import ctypes\n\
             libc = ctypes.CDLL(None, use_errno=True)\n\
             fds = [fd for fd in (libc.inotify_init1(0) for _ in range(8)) if fd >= 0]\n\
             print(len(fds))",
        ])
        .output()
        .unwrap();
    drop(hogging);
    let made = String::from_utf8_lossy(&made.stdout).trim().to_owned();
    assert!(held > 0, "the first cell made no inotify instance");
    assert_eq!(
        made, "8",
        "cell {victim} made {made:?} of 8 inotify instances while cell {hog} (same name hash) held {held}"
    );
}
