//! Policies that compose: `extends`, `remove`, the command line's knobs, `warden policy show`,
//! and the presets for real stacks, each proven by what a cell can and cannot do.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::{Read as _, Write as _};

use support::*;

/// A directory outside /tmp (which every cell has its own of), for paths shown to cells.
fn host_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("warden-test-policy-")
        .tempdir_in(outside_tmp())
        .unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    dir
}

fn warden_out(args: &[&str]) -> Ran {
    Ran::from(warden().args(args).output().unwrap())
}

#[test]
fn a_policy_that_extends_a_preset_adds_to_it_and_policy_show_prints_the_whole() {
    let dir = host_dir();
    let extra = dir.path().join("tools");
    std::fs::create_dir(&extra).unwrap();
    std::fs::write(extra.join("tool"), "a tool\n").unwrap();
    let file = policy(
        dir.path(),
        &format!(
            "version: 1\nextends: default\nfilesystem:\n  read_only: [{}]\nlimits:\n  pids: 99\n\
             remove:\n  filesystem:\n    read_only: [/etc/perl]\n",
            extra.display()
        ),
    );
    let shown = warden_out(&["policy", "show", "--policy", file.to_str().unwrap()]);
    assert_eq!(shown.code, 0, "{shown:?}");
    // Every section is written out; the default's list kept, the addition there, the removal not.
    for section in [
        "filesystem:",
        "process:",
        "limits:",
        "network:",
        "approvals:",
        "commands:",
    ] {
        assert!(
            shown.stdout.contains(section),
            "{section}: {}",
            shown.stdout
        );
    }
    assert!(
        shown.stdout.contains("- /usr\n")
            && shown.stdout.contains(&format!("- {}\n", extra.display()))
    );
    assert!(!shown.stdout.contains("/etc/perl"));
    assert!(shown.stdout.contains("pids: 99\n") && shown.stdout.contains("memory: 1GiB\n"));
    // What show prints is itself a policy that reads the same.
    let again = dir.path().join("shown.yaml");
    std::fs::write(&again, &shown.stdout).unwrap();
    let reshown = warden_out(&["policy", "show", "--policy", again.to_str().unwrap()]);
    assert_eq!(reshown.stdout, shown.stdout);
    // And a cell made from it sees the addition and keeps the default's paths.
    let ran = run_sh(
        &["--rm", "--policy", file.to_str().unwrap()],
        &format!(
            "cat {}/tool; ls /usr/bin/env; ls /etc/perl 2>&1 | head -1",
            extra.display()
        ),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stdout.starts_with("a tool\n/usr/bin/env\n"), "{ran:?}");
    assert!(ran.stdout.contains("No such file"), "{ran:?}");
}

#[test]
fn the_command_lines_knobs_change_the_policy_and_bind_the_cell() {
    let dir = host_dir();
    let ro = dir.path().join("ro");
    let rw = dir.path().join("rw");
    std::fs::create_dir(&ro).unwrap();
    std::fs::create_dir(&rw).unwrap();
    std::fs::write(ro.join("note"), "read me\n").unwrap();
    if is_root() {
        // The cell's user writes the read-write directory.
        std::fs::set_permissions(&rw, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    }
    let shown = warden_out(&[
        "policy",
        "show",
        "--preset",
        "minimal",
        "--memory",
        "300MiB",
        "--cpus",
        "0.5",
        "--pids",
        "40",
        "--timeout",
        "90s",
        "--disk",
        "none",
        "--allow",
        "127.0.0.2:8080",
        "--allow",
        "10.0.0.0/8",
    ]);
    assert_eq!(shown.code, 0, "{shown:?}");
    for line in [
        "memory: 300MiB",
        "cpus: 0.5",
        "pids: 40",
        "wall: 1m30s",
        "disk: null",
        "host: \"127.0.0.2\"",
        "- 8080",
        "host: 10.0.0.0/8",
    ] {
        assert!(shown.stdout.contains(line), "{line}: {}", shown.stdout);
    }
    // A listener the flag lets the cell reach, and one it does not.
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
        }
    });
    let fetch = |url: &str| {
        format!(
            "import urllib.request, urllib.error\ntry:\n    print(urllib.request.urlopen('{url}', timeout=10).status)\n\
             except urllib.error.HTTPError as e:\n    print(e.code)"
        )
    };
    let allow = format!("127.0.0.2:{port}");
    let ran = run_py(
        &["--rm", "--allow", &allow],
        &fetch(&format!("http://127.0.0.2:{port}/")),
    );
    assert_eq!((ran.code, ran.stdout.trim()), (0, "200"), "{ran:?}");
    let ran = run_py(
        &["--rm", "--allow", "127.0.0.2:1"],
        &fetch(&format!("http://127.0.0.2:{port}/")),
    );
    assert_eq!((ran.code, ran.stdout.trim()), (0, "403"), "{ran:?}");
    // --ro shows a path read-only, --rw a directory read-write.
    let ran = run_sh(
        &[
            "--rm",
            "--ro",
            ro.to_str().unwrap(),
            "--rw",
            rw.to_str().unwrap(),
        ],
        &format!(
            "cat {ro}/note; echo x > {ro}/new 2>/dev/null || echo refused; echo written > {rw}/out",
            ro = ro.display(),
            rw = rw.display()
        ),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(ran.stdout, "read me\nrefused\n");
    assert!(!ro.join("new").exists());
    assert_eq!(
        std::fs::read_to_string(rw.join("out")).unwrap(),
        "written\n"
    );
    // The limits bind: time, processes.
    let ran = run_sh(&["--rm", "--timeout", "1s"], "sleep 20");
    assert_eq!(ran.code, 124, "{ran:?}");
    if cgroups_available("knobs_pids") {
        let ran = run_sh(
            &["--rm", "--pids", "16"],
            "i=0; while [ $i -lt 40 ]; do sleep 5 & i=$((i+1)); done; echo made",
        );
        assert!(ran.stderr.contains("Cannot fork"), "{ran:?}");
        assert!(!ran.stdout.contains("made"), "{ran:?}");
        let ran = run_py(
            &["--rm", "--memory", "64MiB"],
            "x = bytearray(200 << 20)\nx[::4096] = b'x' * len(x[::4096])",
        );
        assert_eq!(ran.code, 251, "{ran:?}");
    }
}

#[test]
fn knobs_that_make_no_sense_are_refused_with_what_to_write() {
    for (args, words) in [
        (vec!["--memory", "lots"], "--memory: `lots` is not a size"),
        (
            vec!["--cpus", "fast"],
            "--cpus fast: write a number of cores",
        ),
        (
            vec!["--cpus", "0"],
            "cpus must be a number of cores of at least 0.01",
        ),
        (
            vec!["--timeout", "soon"],
            "--timeout: `soon` is not a duration",
        ),
        (vec!["--disk", "1MiB"], "disk must be at least 32 MiB"),
        (vec!["--allow", "bad host!"], "must be a host name"),
        (vec!["--allow", "example.com:99999"], "99999 is not a port"),
        (
            vec!["--ro", "/no/such/path"],
            "--ro /no/such/path: no such path",
        ),
    ] {
        let mut full = vec!["run", "--rm"];
        full.extend(&args);
        full.extend(["--", "true"]);
        let ran = warden_out(&full);
        assert_eq!(ran.code, 125, "{args:?}: {ran:?}");
        assert!(ran.stderr.contains(words), "{args:?}: {ran:?}");
    }
}

#[test]
fn the_rust_preset_builds_a_crate_with_the_callers_toolchain() {
    let Ok(home) = std::env::var("HOME") else {
        return;
    };
    if !std::path::Path::new(&home)
        .join(".cargo/bin/cargo")
        .exists()
    {
        eprintln!("skipped: no rustup toolchain under {home}");
        return;
    }
    let dir = tempdir();
    let ws = dir.path().join("hello");
    std::fs::create_dir_all(ws.join("src")).unwrap();
    std::fs::write(
        ws.join("Cargo.toml"),
        "[package]\nname = \"hello\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    std::fs::write(
        ws.join("src/main.rs"),
        "fn main() { println!(\"built in a cell\"); }\n",
    )
    .unwrap();
    if is_root() {
        std::process::Command::new("chown")
            .args(["-R", "1000:1000"])
            .arg(&ws)
            .status()
            .unwrap();
    }
    let ran = Ran::from(
        warden()
            .args(["run", "--rm", "--preset", "rust", "-w"])
            .arg(&ws)
            .args(["--", "sh", "-c", "cargo run --offline -q"])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(ran.stdout, "built in a cell\n");
    // The toolchain is the caller's, read-only.
    let ran = run_sh(
        &["--rm", "--preset", "rust"],
        "touch \"$RUSTUP_HOME/x\" 2>/dev/null || echo read-only",
    );
    assert_eq!(ran.stdout, "read-only\n", "{ran:?}");
    let explained = warden_out(&["policy", "explain", "--preset", "rust"]);
    assert!(
        explained.stdout.contains("index.crates.io"),
        "{explained:?}"
    );
}

#[test]
fn links_name_what_the_cell_sees_and_grant_nothing_more() {
    let dir = tempdir();
    let linked = policy(
        dir.path(),
        "version: 1\nfilesystem:\n  links:\n    /project: /workspace\n    /hostroot: /root\n    /hostshadow: /etc/shadow\n",
    );
    let linked = linked.to_str().unwrap();
    let ran = run_sh(
        &["--policy", linked],
        "echo hi > /project/x && cat /workspace/x && readlink /project; \
         cat /hostshadow 2>/dev/null && echo READ-SHADOW; \
         ls /hostroot/ 2>/dev/null | head -1 | grep -q . && echo LISTED-ROOT; \
         ln -s /tmp /made-here 2>/dev/null && echo MADE-LINK; echo end",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(ran.stdout, "hi\n/workspace\nend\n", "{ran:?}");
    // On, above or inside what the cell mounts: refused with what to do.
    for (path, clash) in [
        ("/workspace", "/workspace"),
        ("/usr/lib/x", "/usr"),
        ("/proc/self/x", "/proc"),
        ("/etc/passwd", "/etc"),
    ] {
        let bad = policy(
            dir.path(),
            &format!("version: 1\nfilesystem:\n  links:\n    {path}: /tmp\n"),
        );
        let ran = run_sh(&["--policy", bad.to_str().unwrap()], "true");
        assert_eq!(ran.code, 125, "{path}: {ran:?}");
        assert!(
            ran.stderr.contains("filesystem.links") && ran.stderr.contains(clash),
            "{path}: {}",
            ran.stderr
        );
    }
    let relative = policy(
        dir.path(),
        "version: 1\nfilesystem:\n  links:\n    /here: relative/path\n",
    );
    let ran = run_sh(&["--policy", relative.to_str().unwrap()], "true");
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(ran.stderr.contains("absolute"), "{}", ran.stderr);
}

/// A network rule's host that the gateway would match against no host (`*.evil.test.`, the
/// trailing dot of a full name: a deny rule of it denied nothing) or against more than it shows
/// (`10.1.2.3/0`, every IPv4 address) is refused where the policy is read, saying what to write.
#[test]
fn a_host_pattern_that_matches_other_than_it_reads_is_refused_with_what_to_write() {
    let dir = host_dir();
    for (rule, says) in [
        ("deny: [{host: \"*.evil.test.\"}]", "write `*.evil.test`"),
        ("allow: [{host: 10.1.2.3/0}]", "write `0.0.0.0/0`"),
    ] {
        let file = policy(
            dir.path(),
            &format!("version: 1\nnetwork:\n  default: allow\n  {rule}\n"),
        );
        let shown = warden_out(&["policy", "show", "--policy", file.to_str().unwrap()]);
        assert_ne!(shown.code, 0, "{rule}: {shown:?}");
        assert!(shown.stderr.contains(says), "{rule}: {shown:?}");
    }
}
