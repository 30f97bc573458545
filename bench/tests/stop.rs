//! A benchmark stopped by a signal ends what it started: its daemon's cells, the daemon, every
//! process below it. (Killed by the default action, it left the daemon, its keeper and the cell
//! running, and the cell's cgroups in place.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where the test fails, what the benchmark left is killed (its cell's cgroups stay) and its
/// folder removed.
struct Leftovers(Vec<u32>, PathBuf);

impl Drop for Leftovers {
    fn drop(&mut self) {
        for pid in self.0.iter().filter(|pid| !warden_bench::ended(**pid)) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

#[test]
fn a_benchmark_stopped_by_sigterm_leaves_no_daemon_cell_or_cgroup() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_daemon-bench"));
    let warden = bench.with_file_name("warden");
    assert!(
        warden.exists(),
        "{} is missing: the benchmarks drive the warden binary beside them (`cargo test --workspace` builds it)",
        warden.display()
    );
    let mut child = Command::new(&bench)
        .args(["--exec-only", "--runs", "10000000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("warden-bench-daemon-{}", child.id()));
    let cell = dir.join("run/cells/bench");
    wait_for("the benchmark's cell", Duration::from_secs(60), || {
        cell.join("cell.json").exists()
    });
    // Running execs in the cell for a moment.
    std::thread::sleep(Duration::from_millis(300));
    let started = warden_bench::tree_pids(child.id());
    let _leftovers = Leftovers(started.clone(), dir.clone());
    assert!(
        started.len() >= 4,
        "the benchmark, its daemon, the keeper and the cell: {started:?}"
    );
    // The cell's cgroups, as its record names them.
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cell.join("cell.json")).unwrap()).unwrap();
    let cgroups: Vec<PathBuf> = record["cgroup"]["dirs"]
        .as_array()
        .map(|dirs| {
            dirs.iter()
                .filter_map(|d| d["path"].as_str().map(PathBuf::from))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !cgroups.is_empty() && cgroups.iter().all(|c| c.exists()),
        "the cell's cgroups: {cgroups:?}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "the benchmark did not end");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    // The keeper and the cell's init are the daemon's children (not the benchmark's): they end
    // once their cell is deleted.
    wait_for(
        "every process the benchmark started to end",
        Duration::from_secs(30),
        || started.iter().all(|pid| warden_bench::ended(*pid)),
    );
    assert!(!cell.exists(), "the cell's folder is left: {cell:?}");
    let left: Vec<&PathBuf> = cgroups.iter().filter(|c| c.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
}
