//! Bad input gets a clear error (what failed, why, what to do) and a distinct exit status.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::os::unix::fs::PermissionsExt as _;

use support::*;

#[test]
fn invalid_policy_reports_line_and_column() {
    let dir = tempdir();
    let file = policy(
        dir.path(),
        "version: 1\nlimits:\n  memory: 1GiB\n  pidz: 5\n",
    );
    let out = warden()
        .args(["policy", "check", file.to_str().unwrap()])
        .output()
        .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr.contains(&format!("{}:4:3:", file.display())),
        "{ran:?}"
    );
    assert!(ran.stderr.contains("pidz"), "{ran:?}");

    let ran = run_sh(&["--policy", file.to_str().unwrap()], "echo should-not-run");
    assert_eq!(ran.code, 125);
    assert!(ran.stdout.is_empty());
    assert!(ran.stderr.contains(":4:3:"), "{ran:?}");
}

#[test]
fn bad_values_point_at_their_line() {
    let dir = tempdir();
    let file = policy(dir.path(), "version: 1\nlimits:\n  wall: forever\n");
    let ran = policy_command(&["check", file.to_str().unwrap()]);
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr.contains(":3:") && ran.stderr.contains("not a duration"),
        "{ran:?}"
    );
}

#[test]
fn yaml_edge_cases_name_their_line_and_what_to_write_not_the_parsers_types() {
    let dir = tempdir();
    for (text, at, says) in [
        (
            "version: 1\nlimits:\n  memory: 1GiB\n  memory: 2GiB\n",
            ":4:3:",
            "`memory` is given twice",
        ),
        (
            "version: 1\nlimits:\n  memory: -5\n",
            ":3:11:",
            "not a size",
        ),
        (
            "version: 1\nlimits:\n  memory: 99999999999999999999999\n",
            ":3:11:",
            "not a size",
        ),
        (
            "version: 1\nlimits:\n  pids: -1\n",
            ":3:9:",
            "expected a whole number from 0 to",
        ),
        (
            "version: 99999999999999999999\n",
            ":1:10:",
            "expected a whole number from 0 to",
        ),
        (
            "version: 1\n---\nversion: 1\n",
            ":3:1:",
            "a policy is one YAML document",
        ),
    ] {
        let file = policy(dir.path(), text);
        let ran = policy_command(&["check", file.to_str().unwrap()]);
        assert_eq!(ran.code, 125, "{text:?}: {ran:?}");
        assert!(
            ran.stderr.contains(at) && ran.stderr.contains(says),
            "{text:?}: {ran:?}"
        );
        for internal in [
            "DuplicateKeyPolicy",
            "untagged enum",
            "invalid u",
            "from_str",
        ] {
            assert!(!ran.stderr.contains(internal), "{text:?}: {ran:?}");
        }
    }
}

#[test]
fn valid_policy_checks_and_explains() {
    let dir = tempdir();
    let file = policy(
        dir.path(),
        "version: 1\nlimits:\n  memory: 256MiB\n  pids: 32\n",
    );
    let ran = policy_command(&["check", file.to_str().unwrap()]);
    assert_eq!(ran.code, 0, "{ran:?}");
    let ran = policy_command(&["explain", file.to_str().unwrap()]);
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stdout.contains("Memory: 256 MiB."), "{}", ran.stdout);
    assert!(
        ran.stdout.contains("Processes and threads: 32."),
        "{}",
        ran.stdout
    );
    assert!(
        ran.stdout.contains("only its own loopback"),
        "{}",
        ran.stdout
    );
}

#[test]
fn missing_workspace_is_named() {
    let ran = run_sh(&["--workspace", "/nonexistent/project"], "true");
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr
            .contains("workspace /nonexistent/project does not exist"),
        "{ran:?}"
    );
}

#[test]
fn unknown_preset_lists_the_known_ones() {
    let ran = run_sh(&["--preset", "yolo"], "true");
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr
            .contains("unknown preset `yolo`; the built-in presets are: default, minimal"),
        "{ran:?}"
    );
}

#[test]
fn command_not_found_exits_127() {
    let out = warden()
        .args(["run", "--", "definitely-not-a-command"])
        .output()
        .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 127, "{ran:?}");
    assert!(
        ran.stderr
            .contains("command not found: definitely-not-a-command"),
        "{ran:?}"
    );
}

#[test]
fn exit_status_and_signals_pass_through() {
    assert_eq!(run_sh(&[], "exit 42").code, 42);
    assert_eq!(run_sh(&[], "kill -TERM $$").code, 128 + 15);
}

#[test]
fn invalid_cell_names_are_refused() {
    let ran = run_sh(&["--name", "../escape"], "true");
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr.contains("cell name `../escape` is not valid"),
        "{ran:?}"
    );
}

#[test]
fn a_huge_cell_name_is_not_echoed_whole() {
    let name = "n".repeat(100_000);
    let ran = run_sh(&["--name", &name], "true");
    assert_eq!(ran.code, 125);
    assert!(
        ran.stderr.contains(&format!(
            "cell name `{}... (100000 bytes)` is not valid",
            "n".repeat(256)
        )),
        "{}",
        &ran.stderr[..ran.stderr.len().min(400)]
    );
    assert!(ran.stderr.len() < 2000, "{} bytes", ran.stderr.len());
}

#[test]
fn stdin_reaches_the_command() {
    use std::io::Write;
    let mut child = warden()
        .args(["run", "--", "sh", "-c", "tr a-z A-Z"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello cell\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO CELL\n");
}

/// A host without user namespaces, made real by running warden inside a cell, whose seccomp
/// filter refuses new user namespaces.
#[test]
fn missing_kernel_feature_is_named_and_points_to_doctor() {
    // The inner warden is copied outside /tmp: the cell's own /tmp would cover a path there.
    let dir = tempfile::Builder::new()
        .prefix("warden-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let inner = dir.path().join("warden");
    copy_program(BIN, &inner);
    let (bin_dir, inner) = (dir.path().display(), inner.display());
    let file = policy(
        dir.path(),
        &format!(
            "version: 1\nfilesystem:\n  read_only: [/usr, /bin, /sbin, /lib, /lib64, /etc/alternatives, /etc/ld.so.cache, {bin_dir}]\n"
        ),
    );
    let script = format!(
        "WARDEN_RUNTIME_DIR=/tmp/wr {inner} run -- true; echo status=$?; {inner} doctor; echo doctor=$?"
    );
    let ran = run_sh(&["--policy", file.to_str().unwrap()], &script);
    assert!(ran.stdout.contains("status=125"), "{ran:?}");
    assert!(
        ran.stderr.contains("user namespaces") && ran.stderr.contains("warden doctor"),
        "{ran:?}"
    );
    assert!(
        ran.stdout.contains("[MISS] process  user namespaces"),
        "{ran:?}"
    );
    assert!(ran.stdout.contains("doctor=1"), "{ran:?}");
}

#[test]
fn a_reader_that_stops_reading_ends_the_writer_in_the_cell() {
    // `warden run -- yes | head -1`: when the caller's stdout closes, the cell's writer must get
    // EPIPE like in any pipeline instead of running (and being relayed) forever.
    let script = format!("{BIN} run -- yes | head -n 1; echo piped");
    let start = std::time::Instant::now();
    let out = std::process::Command::new("timeout")
        .args(["20", "sh", "-c", &script])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "y\npiped\n");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn wardens_own_directories_are_never_shown_to_a_cell() {
    let state = tempdir();
    let dir = tempdir();
    std::fs::create_dir_all(state.path().join("journal")).unwrap();
    std::fs::write(state.path().join("journal/signing.key"), "secret key").unwrap();
    let holding = policy(
        dir.path(),
        &format!(
            "version: 1\nfilesystem:\n  read_only: [/usr, /bin, /lib, /lib64, {}]\n",
            state.path().parent().unwrap().display()
        ),
    );
    for (args, what) in [
        (
            vec!["--workspace".to_owned(), state.path().display().to_string()],
            "workspace",
        ),
        (
            vec![
                "--workspace".to_owned(),
                state.path().join("journal").display().to_string(),
            ],
            "workspace",
        ),
        (
            vec!["--policy".to_owned(), holding.display().to_string()],
            "read_only path",
        ),
    ] {
        let ran = Ran::from(
            warden()
                .arg("run")
                .arg("--rm")
                .args(&args)
                .args(["--", "cat", "/workspace/journal/signing.key"])
                .env("WARDEN_STATE_DIR", state.path())
                .output()
                .unwrap(),
        );
        assert_eq!(ran.code, 125, "{args:?}: {ran:?}");
        assert!(
            ran.stderr.contains(what) && ran.stderr.contains("Warden's own state directory"),
            "{args:?}: {ran:?}"
        );
        assert!(!ran.stdout.contains("secret key"));
    }
}

#[test]
fn paths_the_cell_could_not_see_are_refused_before_it_starts_with_the_reason() {
    let dir = tempdir();
    // A directory above the path that the cell's setup may not search (not under /tmp, which
    // is refused for its own reason, even when the checkout itself is there).
    let closed = tempfile::Builder::new()
        .prefix("warden-test-closed-")
        .tempdir_in(outside_tmp())
        .unwrap();
    std::fs::set_permissions(closed.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::create_dir(closed.path().join("data")).unwrap();
    let unreachable = policy(
        dir.path(),
        &format!(
            "version: 1\nfilesystem:\n  read_only: [/usr, /bin, /lib, /lib64, {}]\n",
            closed.path().join("data").display()
        ),
    );
    let under_tmp = policy(
        dir.path(),
        "version: 1\nfilesystem:\n  read_write: [/tmp/from-the-host]\n",
    );
    let microvm = policy(dir.path(), "version: 1\ntier: microvm\n");
    // The kernel's controls, writable: a cell could undo its own limits (rootless, with the
    // caller's cgroups delegated) or change the host's settings.
    let sys = policy(
        dir.path(),
        "version: 1\nfilesystem:\n  read_write: [/sys/fs/cgroup]\n",
    );
    let cases = vec![
        (under_tmp, "is under /tmp, which is the cell's own"),
        (
            sys,
            "read_write path /sys/fs/cgroup is under /sys, the kernel's own controls",
        ),
        (
            microvm,
            "the microvm tier is not implemented in this version",
        ),
    ];
    for (file, reason) in cases {
        // `warden policy check` says it, and so does a run, before anything starts.
        let checked = policy_command(&["check", file.to_str().unwrap()]);
        assert_eq!(checked.code, 125, "{checked:?}");
        assert!(checked.stderr.contains(reason), "{checked:?}");
        let ran = run_sh(&["--rm", "--policy", file.to_str().unwrap()], "echo ran");
        assert_eq!(ran.code, 125, "{ran:?}");
        assert!(ran.stderr.contains(reason), "{ran:?}");
        assert!(!ran.stderr.contains("Broken pipe"), "{ran:?}");
        assert!(ran.stdout.is_empty());
    }
    if is_root() {
        // A root warden opens what the policy shows for the cell's setup (an unprivileged host
        // id), so a path below a directory closed to others is seen all the same...
        std::fs::write(closed.path().join("data").join("note"), "seen\n").unwrap();
        let ran = run_sh(
            &["--rm", "--policy", unreachable.to_str().unwrap()],
            &format!("cat {}/data/note", closed.path().display()),
        );
        assert_eq!((ran.code, ran.stdout.as_str()), (0, "seen\n"), "{ran:?}");
        // ...but its own state directory must be reachable by the setup: said before it starts.
        let state = closed.path().join("state");
        let ran = Ran::from(
            warden()
                .env("WARDEN_STATE_DIR", &state)
                .args(["run", "--rm", "--", "true"])
                .output()
                .unwrap(),
        );
        assert_eq!(ran.code, 125, "{ran:?}");
        assert!(
            ran.stderr.contains("cannot be reached by the cell's setup"),
            "{ran:?}"
        );
        assert!(!ran.stderr.contains("Broken pipe"), "{ran:?}");
    }
    // `warden doctor` keeps prerequisites and what is implemented apart.
    let doctor: serde_json::Value =
        serde_json::from_slice(&warden().args(["doctor", "--json"]).output().unwrap().stdout)
            .unwrap();
    let tier = |name: &str| {
        doctor
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["tier"] == name && c["feature"] == "tier")
            .cloned()
            .unwrap()
    };
    assert!(
        tier("gvisor")["detail"]
            .as_str()
            .unwrap()
            .contains("implemented: yes")
    );
    assert_eq!(tier("microvm")["status"], "missing");
    assert!(
        tier("microvm")["detail"]
            .as_str()
            .unwrap()
            .contains("implemented: no")
    );
    assert!(
        tier("microvm")["fix"]
            .as_str()
            .unwrap()
            .contains("`tier: gvisor`")
    );
    assert!(
        tier("process")["detail"]
            .as_str()
            .unwrap()
            .contains("implemented: yes")
    );
}

/// The workspace disk's file system: `doctor` names it and what its snapshots cost; a choice
/// that names none is said there, and a cell with a workspace is refused with it, before
/// anything of the cell is made.
#[test]
fn a_workspace_disk_of_no_known_file_system_is_refused_and_doctor_says_which_there_are() {
    if !is_root() {
        return; // rootless cells keep the disk limit without a disk of their own
    }
    let doctor = |kind: &str| {
        let out = warden()
            .env("WARDEN_LAYER_FS", kind)
            .arg("doctor")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.contains("workspace disk"))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        doctor("ext4").contains("[ok  ] process  workspace disk   ext4 (WARDEN_LAYER_FS)"),
        "{}",
        doctor("ext4")
    );
    let wrong = doctor("zfs");
    assert!(
        wrong.starts_with("[warn]") && wrong.contains("`btrfs` or `ext4`"),
        "{wrong}"
    );
    let ws = tempdir();
    let state = tempdir();
    let ran = Ran::from(
        warden()
            .env("WARDEN_LAYER_FS", "zfs")
            .env("WARDEN_STATE_DIR", state.path())
            .args(["run", "--rm", "-w"])
            .arg(ws.path())
            .args(["--", "true"])
            .output()
            .unwrap(),
    );
    assert_ne!(ran.code, 0, "{ran:?}");
    assert!(
        ran.stderr.contains("WARDEN_LAYER_FS=zfs") && ran.stderr.contains("`btrfs` or `ext4`"),
        "{ran:?}"
    );
    assert!(
        !state.path().join("layers").exists()
            || std::fs::read_dir(state.path().join("layers"))
                .unwrap()
                .next()
                .is_none(),
        "a layer was left"
    );
}

/// The keepers' fork server, started by hand, says that the daemon starts it, and what it
/// needs, and does nothing.
#[test]
fn the_keepers_fork_server_started_by_hand_says_it_is_the_daemons() {
    let out = warden()
        .arg("keepers")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let ran = Ran::from(out);
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(ran.stderr.contains("is started by the daemon"), "{ran:?}");
    let (ours, theirs) = std::os::unix::net::UnixDatagram::pair().unwrap();
    let out = warden()
        .arg("keepers")
        .stdin(std::os::fd::OwnedFd::from(theirs))
        .output()
        .unwrap();
    drop(ours);
    let ran = Ran::from(out);
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(ran.stderr.contains("datagram-sequence socket"), "{ran:?}");
}

/// Started with its stdin, stdout or stderr closed, the warden puts `/dev/null` there before
/// it opens anything: no file of its own (a policy, the journal, a socket) takes the number and
/// is read as the cell's input or written with its output.
#[test]
fn closed_stdio_takes_nothing_of_the_wardens() {
    let dir = tempdir();
    let file = policy(dir.path(), "version: 1\n");
    // `warden run --policy FILE -- ARGS` through a shell that closes what `redirect` says.
    let run = |args: &str, redirect: &str| {
        let script = format!(r#"exec "$0" run --policy "$1" -- {args} {redirect}"#);
        let mut command = std::process::Command::new("sh");
        command.args([
            "-c",
            &script,
            bin().to_str().unwrap(),
            file.to_str().unwrap(),
        ]);
        command
    };
    // stdin closed: the cell's `cat` reads an empty input, not a file the warden opened.
    let ran = Ran::from(run("cat", "<&-").output().unwrap());
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stdout.is_empty(), "the cell read something: {ran:?}");
    // stdout and stderr closed: the command's output goes nowhere, and the run still works.
    let status = run("sh -c 'echo out; echo err >&2'", ">&- 2>&-")
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// A journal whose last entry does not verify stops a run before its command, with the
/// journal's reason and what to do, and leaves the journal as it was and no cell behind (the
/// journal is opened while the cell is made, and the command waits for its start in it).
#[test]
fn a_journal_that_does_not_verify_stops_a_run_before_its_command() {
    let dirs = run_dirs();
    let (state, runtime, host) = (&dirs.state, &dirs.runtime, &dirs.host);
    std::fs::create_dir_all(state.join("journal")).unwrap();
    let journal = state.join("journal").join("journal.jsonl");
    let bad = "{\"seq\":1,\"time_ms\":1,\"cell\":null,\"kind\":\"t\",\"data\":{},\"prev\":\"0\",\"hash\":\"0\"}\n";
    std::fs::write(&journal, bad).unwrap();
    let file = policy(
        dirs.dir.path(),
        &format!(
            "version: 1\nfilesystem:\n  read_write: [{}]\n",
            host.display()
        ),
    );
    let ran = Ran::from(
        warden()
            .env("WARDEN_STATE_DIR", state)
            .env("WARDEN_RUNTIME_DIR", runtime)
            .args(["run", "--policy"])
            .arg(&file)
            .args(["--", "sh", "-c"])
            .arg(format!("touch {}/ran; echo ran", host.display()))
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(
        ran.stderr.contains("does not verify") && ran.stderr.contains("warden audit verify"),
        "{ran:?}"
    );
    assert!(!ran.stdout.contains("ran"), "{ran:?}");
    assert!(!host.join("ran").exists(), "the command ran");
    assert_eq!(std::fs::read_to_string(&journal).unwrap(), bad);
    // Nothing but an emptied folder kept for the next cell.
    let left = cell_folders_left(runtime);
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A runtime directory another user made first (the default `/tmp/warden-UID`, where no
/// `XDG_RUNTIME_DIR` is set, is anyone's to make) would be theirs to fill with cell records,
/// locks and start notes that this warden then acts on: it is refused, naming its owner and
/// what to do, and nothing is made in it.
#[test]
fn a_runtime_directory_another_user_made_is_refused() {
    if !is_root() {
        eprintln!("skipped: it makes a directory of another user's");
        return;
    }
    let dir = tempdir();
    let runtime = dir.path().join("run");
    std::fs::create_dir(&runtime).unwrap();
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&runtime, Some(65534), Some(65534)).unwrap();
    let ran = Ran::from(
        warden()
            .env("WARDEN_RUNTIME_DIR", &runtime)
            .args(["run", "--", "true"])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(
        ran.stderr.contains("belongs to uid 65534") && ran.stderr.contains("WARDEN_RUNTIME_DIR"),
        "{ran:?}"
    );
    assert_eq!(std::fs::read_dir(&runtime).unwrap().count(), 0);
}

/// A daemon that dies under `warden exec` (killed, restarted) breaks its stream: the CLI says
/// what broke and what to do, with warden's own status, not only the transport's words.
#[test]
fn a_daemon_that_dies_mid_exec_is_named_with_what_to_do() {
    if !cgroups_available("daemon_dies_mid_exec") {
        return;
    }
    let mut daemon = support::daemon::Daemon::start(&[]);
    let cell = daemon.create(&unique("dies"), serde_json::json!({}));
    let mut exec = daemon
        .warden()
        .args(["exec", &cell, "--", "sh", "-c", "echo up; sleep 30"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(exec.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line, "up\n");
    daemon.crash();
    let ran = Ran::from(exec.wait_with_output().unwrap());
    // A daemon again, which takes the cell back and so deletes it with the rest (before any
    // assertion, so that a failed one leaves no cell behind).
    daemon.restart();
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(
        ran.stderr.contains("the daemon may have stopped")
            && ran.stderr.contains("`warden serve`")
            && !ran.stderr.contains("panicked"),
        "{ran:?}"
    );
}

/// A policy or a file to copy that is not a file is refused before it is read: `/dev/zero`
/// was read without end (memory growing until the warden was killed), a FIFO with no writer
/// waited forever. A policy may come through a pipe (`--policy <(...)`), up to its limit.
#[test]
fn devices_and_endless_streams_are_refused_before_they_are_read() {
    let within = |args: &[&str]| {
        Ran::from(
            std::process::Command::new("timeout")
                .arg("20")
                .arg(bin())
                .args(args)
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap(),
        )
    };
    let dir = tempdir();
    let fifo = dir.path().join("fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let binary = dir.path().join("binary.yaml");
    std::fs::write(&binary, b"version: 1\n\xff\xfe\n").unwrap();
    let large = dir.path().join("large.yaml");
    std::fs::write(&large, "# filler\n".repeat(200_000)).unwrap();
    let dir_path = dir.path().to_str().unwrap();
    for (file, says) in [
        ("/dev/zero", "it is a device or a socket, not a file"),
        (dir_path, "it is a directory"),
        (binary.to_str().unwrap(), "it is not UTF-8 text"),
        (large.to_str().unwrap(), "it is larger than the 1 MiB"),
    ] {
        for args in [
            vec!["policy", "check", file],
            vec!["run", "--policy", file, "--", "true"],
        ] {
            let ran = within(&args);
            assert_eq!(ran.code, 125, "{args:?}: {ran:?}");
            assert!(
                ran.stderr
                    .contains(&format!("cannot read policy {file}: {says}")),
                "{args:?}: {ran:?}"
            );
        }
    }
    // Through a pipe, as `--policy <(...)` gives it.
    let piped = Ran::from(
        std::process::Command::new("bash")
            .args([
                "-c",
                &format!("{} policy check <(printf 'version: 1\\n')", bin().display()),
            ])
            .output()
            .unwrap(),
    );
    assert_eq!(piped.code, 0, "{piped:?}");

    if !cgroups_available("devices_refused") {
        return;
    }
    let daemon = support::daemon::Daemon::start(&[]);
    for (source, says) in [
        ("/dev/zero", "is a character device"),
        (fifo.to_str().unwrap(), "is a FIFO"),
    ] {
        let ran = Ran::from(
            std::process::Command::new("timeout")
                .arg("20")
                .arg(bin())
                .args(["cp", source, "some-cell:x"])
                .env("WARDEN_RUNTIME_DIR", daemon.runtime())
                .env("WARDEN_STATE_DIR", daemon.state())
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap(),
        );
        assert_eq!(ran.code, 125, "{source}: {ran:?}");
        assert!(
            ran.stderr.contains(says) && ran.stderr.contains("warden exec some-cell"),
            "{source}: {ran:?}"
        );
    }
}

/// `policy explain` prints the policy's patterns, its author's text (an agent may write a
/// policy): a control character in one is shown escaped, not sent to the terminal.
#[test]
fn policy_explain_escapes_what_would_steer_the_terminal() {
    let dir = tempdir();
    let file = policy(
        dir.path(),
        "version: 1\ncommands:\n  ask: [\"echo \\e]0;title\\a hidden*\"]\n",
    );
    let ran = policy_command(&["explain", file.to_str().unwrap()]);
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(!ran.stdout.contains('\u{1b}'), "{:?}", ran.stdout);
    assert!(
        ran.stdout.contains("echo \\u{1b}]0;title\\u{7} hidden*"),
        "{}",
        ran.stdout
    );
}

#[test]
fn a_command_line_warden_cannot_read_exits_125_not_a_commands_status() {
    // 2 (clap's own) is in the range of the command's statuses: a supervisor would read
    // `warden run --bogus -- true` as a command that failed with 2.
    for args in [
        &["run", "--bogus", "--", "true"][..],
        &["run"][..],
        &["run", "--memory"][..],
        &["no-such-command"][..],
        &["completions", "tcsh"][..],
        &["ps", "--bogus"][..],
    ] {
        let ran = Ran::from(warden().args(args).output().unwrap());
        assert_eq!(ran.code, 125, "{args:?}: {ran:?}");
        assert!(ran.stdout.is_empty(), "{args:?}: {ran:?}");
        assert!(ran.stderr.contains("error:"), "{args:?}: {ran:?}");
    }
    // Help and the version are answers, not failures.
    for args in [&["--help"][..], &["run", "--help"][..], &["--version"][..]] {
        let ran = Ran::from(warden().args(args).output().unwrap());
        assert_eq!(ran.code, 0, "{args:?}: {ran:?}");
        assert!(!ran.stdout.is_empty(), "{args:?}: {ran:?}");
    }
}

#[test]
fn explain_writes_its_sentences_without_runs_of_spaces() {
    for preset in ["default", "minimal", "python", "node", "rust"] {
        let ran = policy_command(&["explain", "--preset", preset]);
        assert_eq!(ran.code, 0, "{ran:?}");
        for line in ran.stdout.lines() {
            assert!(
                !line.trim_start().contains("  "),
                "{preset}: a run of spaces in: {line:?}"
            );
        }
    }
}

/// `warden policy ARGS...`, run.
fn policy_command(args: &[&str]) -> Ran {
    Ran::from(warden().arg("policy").args(args).output().unwrap())
}
