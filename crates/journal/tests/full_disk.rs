//! The journal on a disk that fills up: it stops, says what to do, and loses nothing it
//! acknowledged. In a test binary of its own: it mounts a small tmpfs (root only).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use serde_json::json;
use warden_journal::{Journal, Segments, verify};

#[test]
fn a_full_disk_stops_the_journal_which_says_what_to_do_and_keeps_what_it_acknowledged() {
    if !nix_is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mount = |options: &str| {
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "mount -o {options}");
    };
    mount("size=256k");
    let unmount = Unmount(dir.path().to_path_buf());
    let segments = Segments {
        ring: 64 * 1024,
        ..Default::default()
    };
    let journal = Journal::open_with(dir.path(), segments).unwrap();
    let filler = "x".repeat(2000);
    let mut acknowledged = 0u64;
    let stopped = loop {
        match journal.append(None, "t.fill", json!({ "filler": filler })) {
            Ok(receipt) => acknowledged = receipt.seq,
            Err(e) => break e.to_string(),
        }
        assert!(acknowledged < 10_000, "a 256 KiB disk never filled");
    };
    assert!(acknowledged > 10, "only {acknowledged} entries went in");
    assert!(stopped.contains("No space left on device"), "{stopped}");
    assert!(
        stopped.contains("free space") && stopped.contains("restart"),
        "the error does not say what to do: {stopped}"
    );
    // Stopped for good in this process: a small entry that would fit is refused too.
    let again = journal.append(None, "t.small", json!({})).unwrap_err();
    assert!(again.to_string().contains("stopped accepting"), "{again}");
    drop(journal);

    // With room again, an open cuts what the failure tore and goes on; every acknowledged
    // entry is there and the chain verifies.
    Command::new("mount")
        .args(["-o", "remount,size=4m"])
        .arg(dir.path())
        .status()
        .unwrap();
    let journal = Journal::open_with(dir.path(), segments).unwrap();
    let next = journal.append(None, "t.after", json!({})).unwrap();
    assert!(next.seq > acknowledged, "{} after {acknowledged}", next.seq);
    drop(journal);
    let report = verify(dir.path(), None).unwrap();
    assert_eq!(report.first_seq, 1);
    // (A close adds its checkpoint after the last entry.)
    assert!(report.last_seq >= next.seq, "{report:?}");
    drop(unmount);
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        .unwrap_or(false)
}

/// Unmounts the test's tmpfs however the test ends.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}
