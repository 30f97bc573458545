//! Killing the daemon (SIGKILL) in the middle of what changes a cell's workspace layers or the
//! snapshots: what the API acknowledged stays true, nothing half done shows as done, and nothing
//! is left mounted or attached once the cell is removed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

/// Lines of the host's mount table that name `dir` (the daemon's folder).
fn mounts_under(dir: &std::path::Path) -> usize {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir = dir.display().to_string();
    table.lines().filter(|l| l.contains(&dir)).count()
}

/// Loop devices whose backing file is under `dir`.
fn loops_under(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return 0;
    };
    let dir = dir.display().to_string();
    entries
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("loop/backing_file"))
                .is_ok_and(|f| f.contains(&dir))
        })
        .count()
}

/// Sends `body` to `path` and kills the daemon `after` the request is written, without reading
/// the answer; then starts it again.
fn crash_during(daemon: &mut Daemon, method: &str, path: &str, body: Value, after: Duration) {
    let mut stream = UnixStream::connect(daemon.socket()).unwrap();
    let body = body.to_string();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: warden\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream.flush().unwrap();
    std::thread::sleep(after);
    daemon.restart();
}

/// The names of `cell`'s snapshots the daemon lists.
fn snapshots_of(daemon: &Daemon, cell: &str) -> Vec<String> {
    let answer = daemon.call("GET", &format!("/v1/cells/{cell}/snapshots"), None);
    assert_eq!(answer.status, 200, "{}", answer.text());
    let list = answer.json();
    let list = list
        .as_array()
        .or_else(|| list["snapshots"].as_array())
        .cloned()
        .unwrap_or_default();
    list.iter()
        .filter_map(|s| s["name"].as_str().or(s["id"].as_str()))
        .map(|s| s.rsplit('@').next().unwrap().to_owned())
        .collect()
}

/// Runs `script` in `cell`; its exit code and stdout.
fn sh(daemon: &Daemon, cell: &str, script: &str) -> (Option<i64>, String) {
    let events = daemon.exec(cell, json!({ "argv": ["sh", "-c", script] }));
    (
        exit_of(&events)["code"].as_i64(),
        String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned(),
    )
}

/// The layer folder a snapshot's record names.
fn snapshot_layer(daemon: &Daemon, cell: &str, name: &str) -> PathBuf {
    let record = daemon
        .state()
        .join("snapshots")
        .join(format!("{cell}@{name}"))
        .join("snapshot.json");
    let record: Value = serde_json::from_str(&read_file(&record)).unwrap();
    record["layer"].as_str().unwrap().into()
}

/// Waits until `done` holds (or panics after `limit`).
fn wait_for(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A quiet cell's snapshot (the turn-over) and reset (the swap), each killed at growing delays:
/// a snapshot listed holds the whole of what the cell had written; the cell's workspace is its
/// whole old or whole new tree; the next snapshot, reset and diff work; and once the cell is
/// removed nothing of it stays mounted or attached.
#[test]
fn a_quiet_cells_snapshot_or_reset_killed_at_any_point_is_whole_or_not_at_all() {
    if !cgroups_available("daemon_crash_quiet") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let mounts_before = mounts_under(daemon.dir.path());
    let host = tempdir();
    std::fs::write(host.path().join("a.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("crashq"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let mut taken: Vec<u32> = Vec::new();
    for round in 0..14u32 {
        // More than a copy is quicker for, so that it turns over.
        let made = sh(
            &daemon,
            &cell,
            &format!(
                "mkdir d{round} && i=1; while [ $i -le 120 ]; do echo {round}-$i > d{round}/f$i; i=$((i+1)); done; echo {round} > a.txt"
            ),
        );
        assert_eq!(made.0, Some(0), "{made:?}");
        let after = Duration::from_micros(u64::from(round) * 700);
        crash_during(
            &mut daemon,
            "POST",
            &format!("/v1/cells/{cell}/snapshot"),
            json!({ "as": format!("s{round}") }),
            after,
        );
        let listed = snapshots_of(&daemon, &cell);
        let name = format!("s{round}");
        if listed.contains(&name) {
            // Whole: the layer holds every file the round wrote.
            let layer = snapshot_layer(&daemon, &cell, &name);
            let files = std::fs::read_dir(layer.join(format!("d{round}")))
                .map(|d| d.count())
                .unwrap_or(0);
            assert_eq!(
                files, 120,
                "round {round}: snapshot {name} is listed partial"
            );
        } else {
            let again = daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/snapshot"),
                Some(json!({ "as": name })),
            );
            // Not listed, so not taken: its name is free.
            assert_eq!(again.status, 201, "round {round}: {}", again.text());
        }
        taken.push(round);
        // The cell's tree is all there.
        let seen = sh(
            &daemon,
            &cell,
            "cat a.txt; for d in d*; do ls $d | wc -l; done | sort -u; ls -d d* | wc -l",
        );
        assert_eq!(
            seen,
            (Some(0), format!("{round}\n120\n{}\n", round + 1)),
            "round {round}"
        );
        assert!(daemon.changed_paths(&cell).contains(&"a.txt".to_owned()));
    }
    // Resets, killed as they go: the cell is wholly at the snapshot it was reset to, or as it
    // was (at the last snapshot: the same tree), never a mix.
    for round in 0..30u32 {
        let made = sh(
            &daemon,
            &cell,
            "echo later > a.txt; rm -rf d0; mkdir -p late; echo x > late/x",
        );
        assert_eq!(made.0, Some(0), "{made:?}");
        let look = "cat a.txt; ls -d d* late 2>/dev/null | tr '\\n' ' '";
        let before = sh(&daemon, &cell, look).1;
        let to = format!("s{}", round % 3);
        crash_during(
            &mut daemon,
            "POST",
            &format!("/v1/cells/{cell}/reset"),
            json!({ "to": to }),
            Duration::from_micros(u64::from(round) * 400),
        );
        let target = round % 3;
        // A diff waits for the layer's lock: a reset's helper that outlived the daemon holds it.
        daemon.changed_paths(&cell);
        let seen = sh(&daemon, &cell, look);
        let reset = format!(
            "{target}\n{}",
            (0..=target).map(|r| format!("d{r} ")).collect::<String>()
        );
        assert!(
            seen.1 == reset || seen.1 == before,
            "round {round}: neither reset ({reset:?}) nor as it was ({before:?}): {seen:?}"
        );
        // The next reset works and is whole.
        let again = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/reset"),
            Some(json!({ "to": to })),
        );
        assert!(again.status < 300, "round {round}: {}", again.text());
        let seen = sh(&daemon, &cell, look);
        assert_eq!(seen.1, reset, "round {round}");
    }
    let gone = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert!(gone.status < 300, "{}", gone.text());
    for snap in taken {
        let removed = daemon.call("DELETE", &format!("/v1/snapshots/{cell}@s{snap}"), None);
        assert!(removed.status < 300, "{}", removed.text());
    }
    wait_for(Duration::from_secs(10), "mounts left behind", || {
        mounts_under(daemon.dir.path()) <= mounts_before
    });
    wait_for(Duration::from_secs(10), "loop devices left behind", || {
        loops_under(daemon.dir.path()) == 0
    });
}

/// A cell with a process running: its snapshot (a clone of its btrfs disk, or a copy, taken
/// frozen) and its reset (in place, frozen), each killed at growing delays. The cell is not
/// left frozen; a snapshot listed holds the whole tree; one not listed can be taken again under
/// its name; the reset's tree is whole, the old or the new.
#[test]
fn a_running_cells_snapshot_or_reset_killed_at_any_point_is_whole_or_not_at_all() {
    if !cgroups_available("daemon_crash_running") {
        return;
    }
    for fs in ["btrfs", "ext4"] {
        let mut daemon = Daemon::start_with(&[], &[("WARDEN_LAYER_FS", fs)]);
        let mounts_before = mounts_under(daemon.dir.path());
        let host = tempdir();
        std::fs::write(host.path().join("a.txt"), "host\n").unwrap();
        let cell = daemon.create(
            &unique("crashr"),
            json!({ "workspace": host.path().display().to_string() }),
        );
        let started = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": ["sleep", "600"], "background": true })),
        );
        assert_eq!(started.status, 201, "{}", started.text());
        let look = "cat a.txt; ls -d d* late 2>/dev/null | tr '\\n' ' '; for d in d*; do ls $d | wc -l; done | sort -u";
        let mut taken = Vec::new();
        for round in 0..8u32 {
            let made = sh(
                &daemon,
                &cell,
                &format!(
                    "mkdir d{round} && i=1; while [ $i -le 300 ]; do echo {round}-$i > d{round}/f$i; i=$((i+1)); done; echo {round} > a.txt"
                ),
            );
            assert_eq!(made.0, Some(0), "{made:?}");
            let name = format!("s{round}");
            crash_during(
                &mut daemon,
                "POST",
                &format!("/v1/cells/{cell}/snapshot"),
                json!({ "as": name }),
                Duration::from_micros(u64::from(round) * 1500),
            );
            // Not left frozen: an exec runs (within its own time).
            let seen = sh(&daemon, &cell, look);
            assert_eq!(seen.0, Some(0), "{fs} round {round}: {seen:?}");
            if snapshots_of(&daemon, &cell).contains(&name) {
                // (Its layer holds what the round wrote, whether a clone, a copy, or, where the
                // process went with the daemon, a turn-over.)
                let layer = snapshot_layer(&daemon, &cell, &name);
                let files = std::fs::read_dir(layer.join(format!("d{round}")))
                    .map(|d| d.count())
                    .unwrap_or(0);
                assert_eq!(files, 300, "{fs} round {round}: {name} is listed partial");
            } else {
                let again = daemon.call(
                    "POST",
                    &format!("/v1/cells/{cell}/snapshot"),
                    Some(json!({ "as": name })),
                );
                assert_eq!(again.status, 201, "{fs} round {round}: {}", again.text());
            }
            taken.push(name);
        }
        for round in 0..8u32 {
            let made = sh(
                &daemon,
                &cell,
                "echo later > a.txt; rm -rf d0; mkdir -p late; echo x > late/x",
            );
            assert_eq!(made.0, Some(0), "{made:?}");
            let before = sh(&daemon, &cell, look).1;
            let target = round % 3;
            crash_during(
                &mut daemon,
                "POST",
                &format!("/v1/cells/{cell}/reset"),
                json!({ "to": format!("s{target}") }),
                Duration::from_micros(u64::from(round) * 1500),
            );
            let reset = format!(
                "{target}\n{}300\n",
                (0..=target).map(|r| format!("d{r} ")).collect::<String>()
            );
            daemon.changed_paths(&cell);
            let seen = sh(&daemon, &cell, look);
            assert!(
                seen.1 == reset || seen.1 == before,
                "{fs} round {round}: neither reset ({reset:?}) nor as it was ({before:?}): {seen:?}"
            );
            let again = daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/reset"),
                Some(json!({ "to": format!("s{target}") })),
            );
            assert!(again.status < 300, "{fs} round {round}: {}", again.text());
            assert_eq!(sh(&daemon, &cell, look).1, reset, "{fs} round {round}");
        }
        let gone = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
        assert!(gone.status < 300, "{}", gone.text());
        for snap in taken {
            let removed = daemon.call("DELETE", &format!("/v1/snapshots/{cell}@{snap}"), None);
            assert!(removed.status < 300, "{}", removed.text());
        }
        let left: Vec<_> = std::fs::read_dir(daemon.state().join("snapshots"))
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name() != ".kept"
                    || std::fs::read_dir(e.path()).is_ok_and(|mut d| d.next().is_some())
            })
            .map(|e| e.file_name())
            .collect();
        assert!(
            left.is_empty(),
            "{fs}: left in the snapshots' folder: {left:?}"
        );
        wait_for(Duration::from_secs(10), "mounts left behind", || {
            mounts_under(daemon.dir.path()) <= mounts_before
        });
        wait_for(Duration::from_secs(10), "loop devices left behind", || {
            loops_under(daemon.dir.path()) == 0
        });
    }
}
