//! Resource limits on real cgroups: each breach ends the cell with its message and exit status.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::process::Command;
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

/// The init moves itself into the v1 hierarchies (one thread through `tasks`) and the warden
/// places it in the v2 ones: either way, every process of the cell is in every directory of
/// its cgroup, whole, from the start.
#[test]
fn every_process_of_a_cell_is_whole_in_each_directory_of_its_cgroup() {
    if !cgroups_available("every_process_of_a_cell_is_whole_in_each_directory_of_its_cgroup") {
        return;
    }
    let dir = tempdir();
    let name = unique("member");
    let policy = policy(dir.path(), "version: 1\nlimits:\n  pids: 64\n  wall: 20s\n");
    let mut cell = warden()
        .args(["run", "--name", &name, "--policy", policy.to_str().unwrap()])
        .args(["--", "sh", "-c", "sleep 30 & exec sleep 30"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let read_ids = |file: std::path::PathBuf| -> std::collections::BTreeSet<u32> {
        std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    // The init, the shell's background sleep and the sleep the shell became.
    let deadline = Instant::now() + Duration::from_secs(10);
    let dirs = loop {
        let dirs = cgroup_dirs_of(&name);
        if !dirs.is_empty()
            && dirs
                .iter()
                .all(|d| read_ids(d.join("cgroup.procs")).len() >= 3)
        {
            break dirs;
        }
        assert!(
            Instant::now() < deadline,
            "the cell's cgroup never held its 3 processes: {dirs:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let procs: Vec<_> = dirs
        .iter()
        .map(|d| read_ids(d.join("cgroup.procs")))
        .collect();
    assert!(
        procs.iter().all(|p| *p == procs[0]),
        "the directories hold different processes: {dirs:?} {procs:?}"
    );
    for pid in &procs[0] {
        // Each process's own view: the cell's directory in as many hierarchies as it has.
        let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let inside = own
            .lines()
            .filter(|l| {
                l.rsplit('/')
                    .next()
                    .is_some_and(|leaf| is_cgroup_of(leaf, &name))
            })
            .count();
        assert_eq!(
            inside,
            dirs.len(),
            "process {pid} is not in each of {dirs:?}: {own}"
        );
    }
    for (dir, procs) in dirs.iter().zip(&procs) {
        // A v1 directory lists threads too: every thread of each process is in it.
        if dir.join("tasks").exists() {
            let tasks = read_ids(dir.join("tasks"));
            for pid in procs {
                let threads: std::collections::BTreeSet<u32> =
                    std::fs::read_dir(format!("/proc/{pid}/task"))
                        .map(|d| {
                            d.flatten()
                                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                                .collect()
                        })
                        .unwrap_or_default();
                assert!(
                    threads.is_subset(&tasks),
                    "threads of {pid} outside {}: {threads:?} vs {tasks:?}",
                    dir.display()
                );
            }
        }
    }
    let _ = Command::new(bin()).args(["kill", &name]).status();
    let _ = cell.kill();
    let _ = cell.wait();
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

/// The buffers of a cell's sockets are memory too: on cgroup v1 they count to no limit of the
/// cell's until a TCP limit is written, and one process of a cell limited to 64 MiB held
/// gigabytes of TCP buffers over its own loopback (the host's whole TCP allowance, which
/// stalled the host's own connections). The cell fills TCP connections and UDP sockets it
/// never reads and counts what their queues hold.
#[test]
fn socket_buffers_of_a_cell_are_held_to_its_memory_limit() {
    if !cgroups_available("socket_buffers_of_a_cell_are_held_to_its_memory_limit") {
        return;
    }
    let code = "import socket\n\
                CAP = 256 << 20\n\
                def queued(kind):\n\
                \x20   rows = open('/proc/net/' + kind).readlines()[1:]\n\
                \x20   return sum(int(q, 16) for r in rows for q in r.split()[4].split(':')) >> 20\n\
                l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(64)\n\
                held, sent, chunk = [], 0, b'x' * 65536\n\
                while sent < CAP and len(held) < 200:\n\
                \x20   a = socket.create_connection(l.getsockname(), timeout=5); b, _ = l.accept()\n\
                \x20   a.setblocking(False)\n\
                \x20   try:\n\
                \x20       while sent < CAP: sent += a.send(chunk)\n\
                \x20   except OSError: pass\n\
                \x20   held.append((a, b))\n\
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False)\n\
                for _ in range(200):\n\
                \x20   r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                \x20   r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20); r.bind(('127.0.0.1', 0))\n\
                \x20   held.append(r)\n\
                \x20   for _ in range(150):\n\
                \x20       try: s.sendto(chunk[:60000], r.getsockname())\n\
                \x20       except OSError: break\n\
                print('tcp', queued('tcp'), 'udp', queued('udp'), flush=True)\n";
    let ran = run_py(&["--memory", "64MiB", "--timeout", "60s"], code);
    // Where socket memory counts with the rest (cgroup v2), the cell may instead end at its
    // limit; either way it holds no more than it may.
    if ran.code == 251 {
        assert!(
            ran.stderr.contains("memory limit 64 MiB exceeded: killed"),
            "{ran:?}"
        );
        return;
    }
    assert_eq!(ran.code, 0, "{ran:?}");
    let held: Vec<u64> = ran
        .stdout
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(held.len(), 2, "{ran:?}");
    // 64 MiB of buffers, and what the kernel gives each socket past any limit (one packet).
    assert!(
        held.iter().all(|mib| *mib < 128),
        "a cell limited to 64 MiB held {} MiB in TCP and {} MiB in UDP buffers",
        held[0],
        held[1]
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

#[test]
fn a_workspace_cannot_be_written_past_its_disk_limit_and_the_cell_goes_on() {
    if !is_root() {
        return; // rootless: tests/rootless.rs
    }
    let dir = tempdir();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let state = dir.path().join("state");
    let name = unique("disk");
    let policy = policy(dir.path(), "version: 1\nlimits:\n  disk: 64MiB\n");
    // Twice the limit, in one file and then in many; each write past it fails, the cell goes on
    // and can still free room and write again.
    let script = "dd if=/dev/zero of=/workspace/one bs=1M count=128 2>&1 | grep -o 'No space left on device' | head -1; \
                  rm /workspace/one; \
                  i=0; while [ $i -lt 32 ]; do head -c 4194304 /dev/zero > /workspace/f$i 2>/dev/null || { echo full at $i; break; }; i=$((i+1)); done; \
                  rm -f /workspace/f*; echo again > /workspace/after && cat /workspace/after";
    let ran = warden()
        .env("WARDEN_STATE_DIR", &state)
        .args(["run", "--name", &name, "--policy", policy.to_str().unwrap()])
        .arg("-w")
        .arg(&ws)
        .args(["--", "sh", "-c", script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&ran.stdout);
    assert_eq!(
        ran.status.code(),
        Some(0),
        "{stdout} {}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "No space left on device", "{stdout}");
    let full_at: u32 = lines[1].strip_prefix("full at ").unwrap().parse().unwrap();
    assert!(
        (10..16).contains(&full_at),
        "64 MiB held {full_at} files of 4 MiB: {stdout}"
    );
    assert_eq!(lines[2], "again");
    // Another cell, meanwhile and after, writes as it likes: the limit was this one's.
    let other = run_sh(
        &["--rm"],
        "head -c 100000000 /dev/zero > /workspace/big && wc -c < /workspace/big",
    );
    assert_eq!(
        (other.code, other.stdout.trim()),
        (0, "100000000"),
        "{other:?}"
    );
    // The host holds no more than the limit for it, and the host directory nothing.
    let image = state.join("layers").join(&name).join("disk.img");
    let held = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&image).unwrap()) * 512;
    assert!(held <= 64 << 20, "the image takes {held} bytes on the host");
    assert_eq!(std::fs::read_dir(&ws).unwrap().count(), 0);
    // The change is there for review; removing the cell lets go of its file system.
    let diff = warden()
        .env("WARDEN_STATE_DIR", &state)
        .args(["diff", &name])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&diff.stdout).contains("A after"));
    let mounts = || std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(mounts().contains(&format!("/layers/{name}/fs")));
    assert!(
        warden()
            .env("WARDEN_STATE_DIR", &state)
            .args(["rm", &name])
            .status()
            .unwrap()
            .success()
    );
    assert!(
        !mounts().contains(&format!("/layers/{name}/fs")),
        "the layer's mount stayed"
    );
    assert!(!image.exists());
}

#[test]
fn a_kept_layer_whose_mount_went_is_mounted_again_when_it_is_read() {
    if !is_root() {
        return;
    }
    let dir = tempdir();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let state = dir.path().join("state");
    let name = unique("remount");
    let ran = warden()
        .env("WARDEN_STATE_DIR", &state)
        .args(["run", "--name", &name, "-w"])
        .arg(&ws)
        .args(["--", "sh", "-c", "echo kept > /workspace/kept"])
        .output()
        .unwrap();
    assert_eq!(ran.status.code(), Some(0));
    // As after a reboot: the mount is gone, the image stays.
    let fs_dir = state.join("layers").join(&name).join("fs");
    assert!(
        Command::new("umount")
            .arg("-l")
            .arg(&fs_dir)
            .status()
            .unwrap()
            .success()
    );
    let warden_in = |args: &[&str]| {
        warden()
            .env("WARDEN_STATE_DIR", &state)
            .args(args)
            .output()
            .unwrap()
    };
    assert!(String::from_utf8_lossy(&warden_in(&["diff", &name]).stdout).contains("A kept"));
    // Read twice at once: one attachment only.
    let both: Vec<_> = (0..2)
        .map(|_| {
            let state = state.clone();
            let name = name.clone();
            std::thread::spawn(move || {
                warden()
                    .env("WARDEN_STATE_DIR", &state)
                    .args(["diff", &name])
                    .output()
                    .unwrap()
            })
        })
        .collect();
    for diff in both {
        assert!(String::from_utf8_lossy(&diff.join().unwrap().stdout).contains("A kept"));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert_eq!(
        mounts.matches(&format!("/layers/{name}/fs ")).count(),
        1,
        "{mounts}"
    );
    assert!(warden_in(&["apply", &name]).status.success());
    assert_eq!(std::fs::read_to_string(ws.join("kept")).unwrap(), "kept\n");
    assert!(warden_in(&["rm", &name]).status.success());
}

#[test]
fn a_process_cannot_open_more_files_than_its_limit_or_raise_it() {
    let dir = tempdir();
    let policy = policy(dir.path(), "version: 1\nlimits:\n  open_files: 64\n");
    let ran = run_py(
        &["--policy", policy.to_str().unwrap()],
        "import resource, os\n\
         print(resource.getrlimit(resource.RLIMIT_NOFILE))\n\
         try:\n    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))\n    print('raised')\n\
         except (ValueError, OSError) as e:\n    print('not raised')\n\
         fds = []\n\
         try:\n    [fds.append(os.open('/dev/null', os.O_RDONLY)) for _ in range(1000)]\n\
         except OSError as e:\n    print(len(fds), e.strerror)",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines[0], "(64, 64)", "{ran:?}");
    assert_eq!(lines[1], "not raised");
    let (opened, why) = lines[2].split_once(' ').unwrap();
    let opened: usize = opened.parse().unwrap();
    assert!((55..64).contains(&opened), "{ran:?}");
    assert_eq!(why, "Too many open files");
}

/// `Cpus_allowed_list` of a `/proc/PID/status` text.
fn cpus_allowed(status: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

/// The warden keeps a cell's init off its own CPU while the init assembles the root, and the
/// init takes the rest back: the cell's command runs on every CPU its caller may use, and
/// on no other (a caller narrowed by `taskset` narrows the cell).
#[test]
fn a_cell_runs_on_the_cpus_its_caller_may_use() {
    let ours = cpus_allowed(&std::fs::read_to_string("/proc/self/status").unwrap());
    let ran = run_sh(&[], "cat /proc/self/status");
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(cpus_allowed(&ran.stdout), ours, "{ran:?}");
    // And its exec'd processes, started by the init later.
    let ran = run_sh(&[], "sh -c 'cat /proc/self/status' | cat");
    assert_eq!(cpus_allowed(&ran.stdout), ours, "{ran:?}");
    let first = ours.split([',', '-']).next().expect("a CPU").to_owned();
    let warden = warden();
    let mut narrowed = Command::new("taskset");
    narrowed
        .args(["-c", &first])
        .arg(warden.get_program())
        .args(["run", "--", "cat", "/proc/self/status"]);
    for (key, value) in warden.get_envs() {
        match value {
            Some(value) => narrowed.env(key, value),
            None => narrowed.env_remove(key),
        };
    }
    let ran: Ran = narrowed.output().expect("taskset runs").into();
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(cpus_allowed(&ran.stdout), first, "{ran:?}");
}

/// Inotify instances and watches are counted per user in the host's user namespace, and a cell's
/// are counted to the owner of its user namespace too: a cell whose namespace root owned could
/// take all of root's (128 instances by default), and then no root process of the host, the
/// warden among them, could watch a file.
#[test]
fn a_cell_cannot_use_up_the_inotify_instances_of_host_root() {
    if !is_root() {
        eprintln!("skipped: a_cell_cannot_use_up_the_inotify_instances_of_host_root needs root");
        return;
    }
    let name = unique("inotify");
    let code = "import ctypes, os, sys, time\n\
                libc = ctypes.CDLL(None, use_errno=True)\n\
                fds = []\n\
                while len(fds) < 4096 and (fd := libc.inotify_init1(0)) >= 0: fds.append(fd)\n\
                print(len(fds), flush=True)\n\
                time.sleep(30)\n";
    let cell = Holding::start(&name, "40s", code);
    // While the cell holds every instance it could get, host root can still make one.
    let host = Command::new("python3")
        .args([
            "-c",
            "import ctypes, os, sys\n\
             libc = ctypes.CDLL(None, use_errno=True)\n\
             fd = libc.inotify_init1(0)\n\
             print(os.strerror(ctypes.get_errno()) if fd < 0 else 'made')",
        ])
        .output()
        .unwrap();
    let host = String::from_utf8_lossy(&host.stdout).trim().to_owned();
    let line = cell.first_line.clone();
    drop(cell);
    assert!(
        line.trim().parse::<u32>().unwrap() > 0,
        "the cell made no inotify instance: {line:?}"
    );
    assert_eq!(
        host,
        "made",
        "host root could not make an inotify instance while the cell held {}",
        line.trim()
    );
}

/// A process that writes a byte at a time, with nobody reading its output, costs the daemon
/// its kept output's bound (4 MiB), not a chunk's bookkeeping for each write: each read of
/// its pipe was a chunk of its own (a dozen bytes on average, ~60 bytes of overhead each), and
/// three such processes grew the daemon by ~80 MB.
#[test]
fn output_written_a_byte_at_a_time_is_kept_within_its_bound() {
    if !cgroups_available("output_written_a_byte_at_a_time") {
        return;
    }
    let daemon = support::daemon::Daemon::start(&[]);
    let pid = daemon.pid().unwrap();
    let cell = daemon.create(&unique("bytes"), serde_json::json!({}));
    daemon.exec(&cell, serde_json::json!({ "argv": ["true"] }));
    let _ = reset_peak(pid);
    let before = peak_kib(pid);
    for _ in 0..3 {
        let answer = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(serde_json::json!({
                "argv": ["dd", "if=/dev/zero", "bs=1", "count=100000000"],
                "background": true,
            })),
        );
        assert_eq!(answer.status, 201, "{}", answer.text());
    }
    std::thread::sleep(Duration::from_secs(8));
    let grown = peak_kib(pid).saturating_sub(before);
    assert!(
        grown < 32 * 1024,
        "the daemon grew by {} MiB for three processes' output",
        grown / 1024
    );
    // Their output is still there to read, gathered into few chunks.
    let listed = daemon.call("GET", &format!("/v1/cells/{cell}/processes"), None);
    let listed = listed.json();
    let id = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["argv"][0] == "dd")
        .unwrap()["id"]
        .as_u64()
        .unwrap();
    let output = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/output?follow=false"),
        None,
    );
    let events = output.events();
    assert!(
        events.iter().any(|(name, _)| name == "stdout"),
        "{events:?}"
    );
    assert!(events.len() < 1000, "{} events", events.len());
}
