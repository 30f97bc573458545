//! Control from outside: another warden process pauses, resumes and kills a running cell,
//! through the kernel alone.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use support::*;

fn start(name: &str, workspace: &Path, script: &str) -> Child {
    warden()
        .args([
            "run",
            "--policy",
            &direct_policy(),
            "--name",
            name,
            "--workspace",
            workspace.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn counter(ws: &Path) -> u64 {
    std::fs::read_to_string(ws.join("count"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

fn ps_json() -> serde_json::Value {
    let out = warden().args(["ps", "--json"]).output().unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

fn state_of(name: &str) -> Option<String> {
    ps_json()
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .map(|c| c["state"].as_str().unwrap().to_owned())
}

#[test]
fn pause_stops_progress_and_resume_continues_it() {
    if !cgroups_available("pause_stops_progress_and_resume_continues_it") {
        return;
    }
    let ws = tempdir();
    let name = unique("pause");
    let cell = start(
        &name,
        ws.path(),
        "i=0; while true; do i=$((i+1)); echo $i > /workspace/count.tmp; mv /workspace/count.tmp /workspace/count; done",
    );
    wait_for("the counter", || counter(ws.path()) > 10);
    assert_eq!(state_of(&name).as_deref(), Some("running"));

    let out = warden().args(["pause", &name]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(state_of(&name).as_deref(), Some("paused"));
    let frozen_at = counter(ws.path());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        counter(ws.path()),
        frozen_at,
        "the counter advanced while paused"
    );

    let out = warden().args(["resume", &name]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    wait_for("the counter to advance after resume", || {
        counter(ws.path()) > frozen_at + 10
    });
    assert_eq!(state_of(&name).as_deref(), Some("running"));

    assert!(warden().args(["kill", &name]).status().unwrap().success());
    let ran = Ran::from(cell.wait_with_output().unwrap());
    assert_eq!(ran.code, 137, "{ran:?}");
    let _ = cell_gone(&name);
}

fn cell_gone(name: &str) -> bool {
    state_of(name).is_none() && cgroup_dirs_of(name).is_empty()
}

#[test]
fn kill_ends_a_cell_whose_processes_ignore_sigterm_and_fork() {
    if !cgroups_available("kill_ends_a_cell_whose_processes_ignore_sigterm_and_fork") {
        return;
    }
    let ws = tempdir();
    let name = unique("kill");
    let marker = format!("{}.{}", 800 + std::process::id() % 97, std::process::id());
    let script = format!(
        "trap '' TERM INT HUP; while true; do (trap '' TERM; sleep {marker}) & echo x >> /workspace/forks; sleep 0.02; done"
    );
    let cell = start(&name, ws.path(), &script);
    wait_for("forks", || {
        std::fs::read_to_string(ws.path().join("forks")).is_ok_and(|s| s.lines().count() > 5)
    });
    assert!(
        !host_processes_with(&format!("sleep {marker}")).is_empty(),
        "the test cannot see the cell's processes"
    );

    // A paused cell must be killable too.
    assert!(warden().args(["pause", &name]).status().unwrap().success());
    let out = warden().args(["kill", &name]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let ran = Ran::from(cell.wait_with_output().unwrap());
    assert_eq!(ran.code, 137, "{ran:?}");
    assert!(
        ran.stderr.contains("was killed by `warden kill`"),
        "{ran:?}"
    );

    assert!(
        host_processes_with(&format!("sleep {marker}")).is_empty(),
        "processes of the cell survived"
    );
    assert!(cell_gone(&name), "the cell is still listed or has cgroups");
    let runtime = Path::new("/run/warden/cells").join(&name);
    assert!(!is_root() || !runtime.exists(), "runtime files left behind");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&name), "mounts left behind");
}

#[test]
fn ctrl_c_reaches_the_command_and_ends_the_cell() {
    let ws = tempdir();
    let name = unique("sigint");
    let cell = start(
        &name,
        ws.path(),
        "trap 'echo got-int; exit 3' INT; echo ready > /workspace/ready; while true; do sleep 0.05; done",
    );
    wait_for("the cell", || ws.path().join("ready").exists());
    let status = std::process::Command::new("kill")
        .args(["-INT", &cell.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let ran = Ran::from(cell.wait_with_output().unwrap());
    assert_eq!(ran.code, 3, "{ran:?}");
    assert_eq!(ran.stdout, "got-int\n");
}

#[test]
fn control_commands_name_unknown_cells() {
    for verb in ["pause", "resume", "kill"] {
        let out = warden().args([verb, "no-such-cell"]).output().unwrap();
        assert_eq!(out.status.code(), Some(125));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("no running cell named `no-such-cell`"),
            "{stderr}"
        );
    }
}

#[test]
fn a_second_cell_cannot_take_a_running_name() {
    let ws = tempdir();
    let name = unique("dup");
    let mut cell = start(&name, ws.path(), "echo up > /workspace/up; sleep 30");
    wait_for("the cell", || ws.path().join("up").exists());
    let ran = run_sh(&["--name", &name], "true");
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr
            .contains(&format!("a cell named `{name}` is already running")),
        "{ran:?}"
    );
    warden().args(["kill", &name]).status().unwrap();
    let _ = cell.wait();
}

#[test]
fn a_killed_warden_leaves_nothing_behind() {
    let ws = tempdir();
    let name = unique("orphan");
    let marker = format!("{}.{}", 700 + std::process::id() % 97, std::process::id());
    let mut cell = start(
        &name,
        ws.path(),
        &format!("sleep {marker} & echo up > /workspace/up; wait"),
    );
    wait_for("the cell", || ws.path().join("up").exists());
    // SIGKILL the warden itself: no cleanup code of its own runs.
    cell.kill().unwrap();
    let _ = cell.wait();
    wait_for("the cell's processes to die", || {
        host_processes_with(&format!("sleep {marker}")).is_empty()
    });
    // The next warden that looks finds the dead cell and removes what is left of it.
    assert_eq!(state_of(&name), None);
    assert!(cgroup_dirs_of(&name).is_empty(), "cgroups left behind");
    assert!(!Path::new("/run/warden/cells").join(&name).exists() || !is_root());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&name), "mounts left behind");
}

#[test]
fn a_run_returns_with_all_its_output_and_nothing_of_its_cell_left() {
    // The init tells the command's end once everything else of the cell is ended and reaped,
    // and lets go of the command's pipes first; the run goes on while the kernel tears the init
    // down, and waits for that only before the cell's cgroups and folder go. When `warden run`
    // returns, all the output is out and nothing of the cell is left.
    let name = unique("ended");
    let marker = format!("{}.{}", 800 + std::process::id() % 97, std::process::id());
    let out = warden()
        .args([
            "run",
            "--policy",
            &direct_policy(),
            "--name",
            &name,
            "--",
            "sh",
            "-c",
            &format!(
                "sleep {marker} & (trap '' TERM HUP INT; exec sleep {marker}) & seq 200000; \
                 echo to-stderr >&2; exit 7"
            ),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 200_000);
    assert_eq!(stdout.lines().last(), Some("200000"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("to-stderr"));
    assert_eq!(
        host_processes_with(&format!("sleep {marker}")),
        Vec::<i32>::new()
    );
    assert!(cgroup_dirs_of(&name).is_empty(), "cgroups left behind");
    assert!(!Path::new("/run/warden/cells").join(&name).exists() || !is_root());
    assert_eq!(state_of(&name), None);
    // A command killed by a signal is told as such (pid 1 itself cannot die of it).
    let killed = run_sh(&[], "kill -KILL $$");
    assert_eq!(killed.code, 128 + 9, "{}", killed.stderr);
}

#[test]
fn the_command_starts_with_no_signal_blocked_and_signals_at_their_defaults() {
    // The init blocks signals for itself (it reads them from a signalfd); none of that may
    // reach the command, or a SIGTERM sent from outside would never end it.
    let ran = run_sh(&[], "grep -E '^Sig(Blk|Ign)' /proc/self/status; echo $0");
    assert_eq!(ran.code, 0, "{ran:?}");
    let field = |name: &str| {
        let line = ran.stdout.lines().find(|l| l.starts_with(name)).unwrap();
        u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
    };
    assert_eq!(field("SigBlk:"), 0, "{ran:?}");
    assert_eq!(field("SigIgn:") & 0x7fff, 0, "{ran:?}");
    assert!(ran.stdout.ends_with("sh\n"), "argv[0] as given: {ran:?}");
}
