//! The process tier without root: run as an unprivileged host user (when the tests run as root,
//! they drop to `nobody` with setpriv; otherwise they already are unprivileged).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use support::*;

const NOBODY: u32 = 65534;

/// A copy of the warden binary that an unprivileged user can execute, and a directory it owns.
struct Rootless {
    _dir: TestDir,
    bin: PathBuf,
    workspace: PathBuf,
    runtime: PathBuf,
    state: PathBuf,
}

fn setup() -> Rootless {
    let dir = tempdir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.path().join("warden");
    copy_program(BIN, &bin);
    let workspace = dir.path().join("ws");
    let runtime = dir.path().join("run");
    let state = dir.path().join("state");
    std::fs::create_dir(&workspace).unwrap();
    std::fs::create_dir(&runtime).unwrap();
    std::fs::create_dir(&state).unwrap();
    if is_root() {
        for path in [&workspace, &runtime, &state] {
            std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY)).unwrap();
        }
    }
    Rootless {
        _dir: dir,
        bin,
        workspace,
        runtime,
        state,
    }
}

fn as_user(env: &Rootless, args: &[&str]) -> Command {
    let mut cmd = if is_root() {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(&env.bin);
        c
    } else {
        Command::new(&env.bin)
    };
    cmd.args(args)
        .env("WARDEN_RUNTIME_DIR", &env.runtime)
        .env("WARDEN_STATE_DIR", &env.state)
        .env_remove("XDG_RUNTIME_DIR")
        .stdin(Stdio::null());
    cmd
}

fn host_uid() -> u32 {
    if is_root() {
        NOBODY
    } else {
        std::fs::metadata("/proc/self").unwrap().uid()
    }
}

#[test]
fn rootless_cell_is_confined_and_writes_its_workspace() {
    let env = setup();
    let ws = env.workspace.to_str().unwrap().to_owned();
    let out = as_user(
        &env,
        &[
            "run",
            "--policy",
            &direct_policy(),
            "--workspace",
            &ws,
            "--",
            "sh",
            "-c",
            "id -u; cat /proc/self/uid_map; echo x > /etc/x 2>/dev/null || echo etc-denied; \
         echo hello > /workspace/made-inside && echo ws-ok; grep CapEff /proc/self/status",
        ],
    )
    .output()
    .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 0, "{ran:?}");
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines[0], "1000");
    let map: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(map, ["1000", host_uid().to_string().as_str(), "1"]);
    assert!(
        ran.stdout
            .contains("etc-denied\nws-ok\nCapEff:\t0000000000000000"),
        "{ran:?}"
    );
    let made = Path::new(&ws).join("made-inside");
    assert_eq!(std::fs::read_to_string(&made).unwrap(), "hello\n");
    assert_eq!(std::fs::metadata(&made).unwrap().uid(), host_uid());
}

#[test]
fn rootless_cell_refuses_the_dangerous_surface() {
    let env = setup();
    let code = "import ctypes, errno, socket\n\
                libc = ctypes.CDLL(None, use_errno=True)\n\
                for name, call in [('ptrace', lambda: libc.ptrace(0,0,0,0)), ('unshare', lambda: libc.unshare(0x10000000)), ('mount', lambda: libc.mount(b'n', b'/tmp', b'tmpfs', 0, None))]:\n\
                \x20   r = call(); print(name, errno.errorcode.get(ctypes.get_errno()) if r == -1 else 'ALLOWED')";
    let ran = Ran::from(
        as_user(&env, &["run", "--", "python3", "-c", code])
            .output()
            .unwrap(),
    );
    assert_eq!(
        ran.stdout, "ptrace EPERM\nunshare EPERM\nmount EPERM\n",
        "{ran:?}"
    );
}

#[test]
fn rootless_cells_are_listed_and_killed_from_outside() {
    let env = setup();
    let name = unique("rootless");
    let ws = env.workspace.to_str().unwrap().to_owned();
    let cell = as_user(
        &env,
        &[
            "run",
            "--policy",
            &direct_policy(),
            "--name",
            &name,
            "--workspace",
            &ws,
            "--",
            "sh",
            "-c",
            "trap '' TERM; echo up > /workspace/up; while true; do sleep 0.05; done",
        ],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !env.workspace.join("up").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the rootless cell did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let ps = Ran::from(as_user(&env, &["ps"]).output().unwrap());
    assert!(ps.stdout.contains(&name), "{ps:?}");
    let kill = Ran::from(as_user(&env, &["kill", &name]).output().unwrap());
    assert_eq!(kill.code, 0, "{kill:?}");
    let out = cell.wait_with_output().unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 137, "{ran:?}");
    if is_root() {
        // Without a delegated cgroup the fallback is announced, never silent.
        assert!(ran.stderr.contains("no writable cgroup"), "{ran:?}");
    }
    let ps = Ran::from(as_user(&env, &["ps"]).output().unwrap());
    assert!(!ps.stdout.contains(&name), "{ps:?}");
}

#[test]
fn rootless_copy_on_write_workspace_reaches_the_host_only_through_apply() {
    let env = setup();
    let name = unique("rootless-cow");
    let ws = env.workspace.to_str().unwrap().to_owned();
    std::fs::write(env.workspace.join("kept.txt"), "original\n").unwrap();
    if is_root() {
        std::os::unix::fs::chown(env.workspace.join("kept.txt"), Some(NOBODY), Some(NOBODY))
            .unwrap();
    }
    let ran = Ran::from(
        as_user(
            &env,
            &[
                "run",
                "--name",
                &name,
                "--workspace",
                &ws,
                "--",
                "sh",
                "-c",
                "echo changed > /workspace/kept.txt && echo new > /workspace/new.txt",
            ],
        )
        .output()
        .unwrap(),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(
        ran.stderr.contains(&format!("warden diff {name}")),
        "{ran:?}"
    );
    assert_eq!(
        std::fs::read_to_string(env.workspace.join("kept.txt")).unwrap(),
        "original\n"
    );
    assert!(!env.workspace.join("new.txt").exists());
    let diff = Ran::from(as_user(&env, &["diff", &name, "--stat"]).output().unwrap());
    assert!(
        diff.stdout.starts_with("M kept.txt\nA new.txt\n"),
        "{diff:?}"
    );
    let applied = Ran::from(as_user(&env, &["apply", &name]).output().unwrap());
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(env.workspace.join("kept.txt")).unwrap(),
        "changed\n"
    );
    assert_eq!(
        std::fs::metadata(env.workspace.join("new.txt"))
            .unwrap()
            .uid(),
        host_uid()
    );
    let removed = Ran::from(as_user(&env, &["rm", &name]).output().unwrap());
    assert_eq!(removed.code, 0, "{removed:?}");
}

#[test]
fn rootless_cells_get_the_egress_gateway_too() {
    let env = setup();
    let upstream = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = upstream.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in upstream.incoming().flatten() {
            let mut conn = conn;
            let mut buf = [0u8; 4096];
            let _ = std::io::Read::read(&mut conn, &mut buf);
            let _ = std::io::Write::write_all(
                &mut conn,
                b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nupstream",
            );
        }
    });
    let policy = env.state.parent().unwrap().join("net.yaml");
    std::fs::write(
        &policy,
        format!("version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n"),
    )
    .unwrap();
    let code = format!(
        "import urllib.request, urllib.error\n\
         print(urllib.request.urlopen('http://127.0.0.2:{port}/').read().decode())\n\
         try:\n    urllib.request.urlopen('http://127.0.0.2:{}/')\n\
         except urllib.error.HTTPError as e: print(e.code)",
        port.wrapping_add(1)
    );
    let out = as_user(
        &env,
        &[
            "run",
            "--rm",
            "--policy",
            policy.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            &code,
        ],
    )
    .output()
    .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.stdout, "upstream\n403\n", "{ran:?}");
}

#[test]
fn rootless_a_running_cell_writes_creates_and_deletes_after_a_reset() {
    let env = setup();
    std::fs::create_dir_all(env.workspace.join("src")).unwrap();
    std::fs::write(env.workspace.join("README.md"), "# Project\n").unwrap();
    std::fs::write(env.workspace.join("src/main.rs"), "fn main() {}\n").unwrap();
    if is_root() {
        for path in ["README.md", "src", "src/main.rs"] {
            std::os::unix::fs::chown(env.workspace.join(path), Some(NOBODY), Some(NOBODY)).unwrap();
        }
    }
    writes_after_reset(
        &|args: &[&str]| as_user(&env, args),
        &env.workspace,
        &unique("rootless-rewrite"),
    );
}

#[test]
fn rootless_a_workspace_is_held_to_its_disk_limit() {
    let env = setup();
    let ws = env.workspace.to_str().unwrap().to_owned();
    let policy_path = env.state.join("disk.yaml");
    std::fs::write(
        &policy_path,
        "version: 1\nlimits:\n  disk: 64MiB\n  open_files: 100\n",
    )
    .unwrap();
    if is_root() {
        std::os::unix::fs::chown(&policy_path, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let policy = policy_path.to_str().unwrap().to_owned();
    let run = |name: &str, script: &str| {
        Ran::from(
            as_user(
                &env,
                &[
                    "run",
                    "--rm",
                    "--name",
                    name,
                    "--policy",
                    &policy,
                    "--workspace",
                    &ws,
                    "--",
                    "sh",
                    "-c",
                    script,
                ],
            )
            .output()
            .unwrap(),
        )
    };
    // One file past the limit: the kernel refuses the write, the cell goes on.
    let one = run(
        &unique("rl-disk-one"),
        "dd if=/dev/zero of=/workspace/one bs=1M count=128 2>&1 | grep -o 'File too large' | head -1; \
         ls -l /workspace/one | awk '{print $5}'; ulimit -n",
    );
    assert_eq!(one.code, 0, "{one:?}");
    assert_eq!(
        one.stdout,
        format!("File too large\n{}\n100\n", 64 << 20),
        "{one:?}"
    );
    // Many files past it, some in a directory closed even to its owner: the warden's watch
    // sees them all and ends the cell.
    let started = std::time::Instant::now();
    let many = run(
        &unique("rl-disk-many"),
        "mkdir /workspace/hidden; i=0; while [ $i -lt 12 ]; do head -c 8388608 /dev/zero > /workspace/hidden/f$i; i=$((i+1)); done; \
         chmod 000 /workspace/hidden; echo written; sleep 60; echo survived",
    );
    assert_eq!(many.code, 253, "{many:?}");
    assert_eq!(many.stdout, "written\n", "{many:?}");
    assert!(
        many.stderr
            .contains("disk limit 64 MiB of its workspace exceeded: killed"),
        "{many:?}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    // Under the limit nothing happens.
    let under = run(
        &unique("rl-disk-under"),
        "head -c 8388608 /dev/zero > /workspace/f; sleep 5; echo fine",
    );
    assert_eq!(
        (under.code, under.stdout.as_str()),
        (0, "fine\n"),
        "{under:?}"
    );
}

/// A cell that writes past its disk limit and ends before the watch's next look (a few seconds)
/// is not let off: a last look at its end tells the breach.
#[test]
fn rootless_a_cell_that_ends_past_its_disk_limit_between_looks_is_told() {
    let env = setup();
    let ws = env.workspace.to_str().unwrap().to_owned();
    let policy_path = env.state.join("quick-disk.yaml");
    std::fs::write(&policy_path, "version: 1\nlimits:\n  disk: 64MiB\n").unwrap();
    if is_root() {
        std::os::unix::fs::chown(&policy_path, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let name = unique("rl-disk-quick");
    let ran = Ran::from(
        as_user(
            &env,
            &[
                "run",
                "--rm",
                "--name",
                &name,
                "--policy",
                policy_path.to_str().unwrap(),
                "--workspace",
                &ws,
                "--",
                "sh",
                "-c",
                "i=0; while [ $i -lt 12 ]; do head -c 8388608 /dev/zero > /workspace/f$i; i=$((i+1)); done; echo written",
            ],
        )
        .output()
        .unwrap(),
    );
    assert_eq!(ran.code, 253, "{ran:?}");
    assert_eq!(ran.stdout, "written\n", "{ran:?}");
    assert!(
        ran.stderr
            .contains("disk limit 64 MiB of its workspace exceeded"),
        "{ran:?}"
    );
}

/// A user who may not write Warden's state directory (`nobody`'s default, under a home of
/// /nonexistent) is told where it is and how to move it, and nothing runs.
#[test]
fn rootless_a_state_directory_it_may_not_write_is_named_with_what_to_do() {
    let env = setup();
    // A directory nobody but root may write into (root-owned when the tests run as root).
    let closed = env.state.parent().unwrap().join("closed");
    std::fs::create_dir(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o555)).unwrap();
    let state = closed.join("state");
    let marker = env.workspace.join("ran");
    let out = as_user(
        &env,
        &[
            "run",
            "-w",
            env.workspace.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "touch /workspace/ran",
        ],
    )
    .env("WARDEN_STATE_DIR", &state)
    .output()
    .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(
        ran.stderr.contains("Permission denied")
            && ran.stderr.contains(&state.display().to_string())
            && ran.stderr.contains("set WARDEN_STATE_DIR"),
        "{ran:?}"
    );
    assert!(!marker.exists());
    assert!(!state.exists());
    // The folder can go with the test's.
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A rootless cell without a cgroup of its own is not frozen while its workspace is snapshotted:
/// it swaps a directory of its workspace for a symlink to a host directory it cannot see, back
/// and forth, while snapshots are taken. A copy that followed the symlink by its path copied the
/// host's file into the snapshot (seen in about one snapshot in six), and a fork or a reset put
/// it in the cell.
#[test]
fn rootless_a_snapshot_of_a_running_cell_never_follows_its_symlinks_to_the_host() {
    let env = setup();
    let secret_dir = env.state.join("secret");
    std::fs::create_dir(&secret_dir).unwrap();
    std::fs::write(secret_dir.join("secret.txt"), "HOST-SECRET\n").unwrap();
    std::fs::set_permissions(
        secret_dir.join("secret.txt"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    if is_root() {
        for path in [&secret_dir, &secret_dir.join("secret.txt")] {
            std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY)).unwrap();
        }
    }
    let name = unique("rootless-swap");
    let ws = env.workspace.to_str().unwrap().to_owned();
    let script = format!(
        "import ctypes, os, sys, time\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         os.chdir('/workspace')\n\
         os.makedirs('d')\n\
         open('d/secret.txt', 'w').write('decoy\\n')\n\
         for i in range(50): open('pad%d' % i, 'w').write('x')\n\
         os.symlink({secret:?}, 'l')\n\
         print('ready', flush=True)\n\
         end = time.time() + 60\n\
         while time.time() < end and not os.path.exists('/tmp/stop'):\n\
         \x20   libc.renameat2(-100, b'd', -100, b'l', 2)\n",
        secret = secret_dir.to_str().unwrap()
    );
    let mut cell = as_user(
        &env,
        &[
            "run",
            "--name",
            &name,
            "--workspace",
            &ws,
            "--",
            "python3",
            "-c",
            &script,
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let mut out = std::io::BufReader::new(cell.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "ready\n");
    for _ in 0..40 {
        let _ = as_user(&env, &["snapshot", &name]).output().unwrap();
    }
    // Ended through the warden, and waited for: a cell still swapping while the tree below is
    // walked by path would lead the walk itself through its symlink (its own upper layer's
    // `d/secret.txt`, read through `d` turned symlink, was reported as a leak).
    let killed = as_user(&env, &["kill", &name]).output().unwrap();
    assert!(killed.status.success(), "{killed:?}");
    let _ = cell.wait();
    let mut leaked = Vec::new();
    let mut stack = vec![env.state.clone()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() && path != secret_dir {
                stack.push(path);
            } else if kind.is_file()
                && std::fs::read(&path).is_ok_and(|data| data.starts_with(b"HOST-SECRET"))
            {
                leaked.push(path);
            }
        }
    }
    assert!(leaked.is_empty(), "the host's file was copied: {leaked:?}");
}
