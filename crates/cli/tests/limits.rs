//! Resource limits on real cgroups: each breach ends the cell with its message and exit status.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::{Duration, Instant};

use support::*;

#[test]
fn fork_bomb_is_contained_and_the_host_stays_responsive() {
    if !cgroups_available("fork_bomb_is_contained_and_the_host_stays_responsive") {
        return;
    }
    let dir = tempdir();
    let name = unique("bomb");
    let policy = policy(dir.path(), "version: 1\nlimits:\n  pids: 64\n  wall: 4s\n");
    let bomb = warden()
        .args([
            "run",
            "--name",
            &name,
            "--policy",
            policy.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            // `exec`: the shell must not need a fork of its own to outlive the bomb.
            "b() { b | b & }; b; exec sleep 30",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    // The host can still start processes while the bomb runs.
    let start = Instant::now();
    let status = std::process::Command::new("true").status().unwrap();
    assert!(status.success());
    let spawn_time = start.elapsed();
    // The cell's pids cgroup holds it to its limit.
    let counts: Vec<usize> = cgroup_dirs_of(&name)
        .iter()
        .filter(|d| d.to_string_lossy().contains("/pids/"))
        .map(|d| {
            std::fs::read_to_string(d.join("pids.current"))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    let out = bomb.wait_with_output().unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 124, "{ran:?}");
    assert!(
        ran.stderr.contains("wall-clock limit 4s exceeded: killed"),
        "{ran:?}"
    );
    assert!(
        spawn_time < Duration::from_secs(2),
        "host took {spawn_time:?} to spawn a process"
    );
    assert!(
        counts.iter().all(|c| *c <= 64),
        "pids above the limit: {counts:?}"
    );
    assert!(cgroup_dirs_of(&name).is_empty(), "cgroups left behind");
}

#[test]
fn process_limit_makes_fork_fail_inside() {
    if !cgroups_available("process_limit_makes_fork_fail_inside") {
        return;
    }
    let dir = tempdir();
    let policy = policy(dir.path(), "version: 1\nlimits:\n  pids: 16\n");
    let code = "import os, time, errno\n\
                n = 0\n\
                try:\n\
                \x20   while True:\n\
                \x20       if os.fork() == 0:\n\
                \x20           time.sleep(30); os._exit(0)\n\
                \x20       n += 1\n\
                except OSError as e: print('blocked after', n, errno.errorcode[e.errno])";
    let ran = run_py(&["--policy", policy.to_str().unwrap()], code);
    assert_eq!(ran.code, 0, "{ran:?}");
    let n: usize = ran
        .stdout
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert!(n < 16, "{ran:?}");
    assert!(ran.stdout.trim().ends_with("EAGAIN"), "{ran:?}");
}

#[test]
fn memory_bomb_is_killed_with_a_clear_message() {
    if !cgroups_available("memory_bomb_is_killed_with_a_clear_message") {
        return;
    }
    let dir = tempdir();
    let policy = policy(
        dir.path(),
        "version: 1\nlimits:\n  memory: 64MiB\n  wall: 60s\n",
    );
    let ran = run_py(
        &["--policy", policy.to_str().unwrap()],
        "x = []\nwhile True: x.append(bytearray(8 << 20))",
    );
    assert_eq!(ran.code, 251, "{ran:?}");
    assert!(
        ran.stderr.contains("memory limit 64 MiB exceeded: killed"),
        "{ran:?}"
    );
}

#[test]
fn wall_timeout_kills_the_whole_process_tree() {
    let dir = tempdir();
    let marker = format!("{}.{}", 900 + std::process::id() % 97, std::process::id());
    let policy = policy(dir.path(), "version: 1\nlimits:\n  wall: 1s\n");
    let script = format!(
        "sleep {marker} & (sleep {marker} &) ; sh -c 'sleep {marker}' & echo started; wait"
    );
    let start = Instant::now();
    let ran = run_sh(&["--policy", policy.to_str().unwrap()], &script);
    let took = start.elapsed();
    assert_eq!(ran.code, 124, "{ran:?}");
    assert_eq!(ran.stdout, "started\n");
    assert!(
        ran.stderr.contains("wall-clock limit 1s exceeded: killed"),
        "{ran:?}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        host_processes_with(&format!("sleep {marker}")).is_empty(),
        "processes of the cell survived"
    );
}

#[test]
fn output_cap_ends_a_flooding_cell() {
    let dir = tempdir();
    let policy = policy(dir.path(), "version: 1\nlimits:\n  output: 1MiB\n");
    let ran = run_sh(&["--policy", policy.to_str().unwrap()], "yes warden");
    assert_eq!(ran.code, 252, "{}", ran.stderr);
    assert_eq!(ran.stdout.len(), 1 << 20);
    assert!(
        ran.stderr.contains("output limit 1 MiB exceeded: killed"),
        "{}",
        ran.stderr
    );
}

#[test]
fn cpu_limit_throttles_a_busy_loop() {
    if !cgroups_available("cpu_limit_throttles_a_busy_loop") {
        return;
    }
    let dir = tempdir();
    let policy = policy(dir.path(), "version: 1\nlimits:\n  cpus: 0.5\n");
    let code = "import time\n\
                t0 = time.time(); c0 = time.process_time()\n\
                while time.time() - t0 < 2: pass\n\
                print(round((time.process_time() - c0) / (time.time() - t0), 2))";
    let ran = run_py(&["--policy", policy.to_str().unwrap()], code);
    assert_eq!(ran.code, 0, "{ran:?}");
    let share: f64 = ran.stdout.trim().parse().unwrap();
    assert!(share <= 0.7, "a 0.5-core cell used {share} of a core");
}
