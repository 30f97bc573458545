//! One conformance suite for every tier: the same test code runs once per tier, through the
//! daemon's API and through `warden run`. Exec (streams, stdin, a terminal, background and
//! reconnect, signals to a process group), files, pause and resume, reset while running, kill,
//! the gateway's allow, deny and credential cases, the journal's entries, and the confinement a
//! cell may not break out of. A tier this host cannot run is skipped with its reason printed
//! (the gVisor tier needs runsc and root; CI has both).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{Read as _, Write as _};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::daemon::{Daemon, exit_of, stream_bytes};
use support::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    Process,
    Gvisor,
}

impl Tier {
    fn name(self) -> &'static str {
        match self {
            Self::Process => "process",
            Self::Gvisor => "gvisor",
        }
    }

    /// Why this host cannot run the tier, if it cannot.
    fn unavailable(self) -> Option<String> {
        match self {
            Self::Process => None,
            Self::Gvisor => {
                if !is_root() {
                    return Some("it needs root".to_owned());
                }
                let found = std::env::var_os("WARDEN_RUNSC")
                    .map(std::path::PathBuf::from)
                    .is_some_and(|p| p.is_file())
                    || support::installed_runsc().is_some();
                (!found).then(|| "runsc is not installed (apt-get install runsc)".to_owned())
            }
        }
    }

    /// A policy document of this tier on top of `default`, with `more` (YAML) added.
    fn policy(self, more: &str) -> String {
        format!(
            "version: 1\nextends: default\ntier: {}\n{more}",
            self.name()
        )
    }

    /// A cell of this tier in `daemon`, with `extra` request fields.
    fn cell(self, daemon: &Daemon, prefix: &str, more: &str, extra: Value) -> String {
        let name = unique(prefix);
        let mut body = json!({ "policy": self.policy(more) });
        if let Value::Object(map) = extra {
            for (k, v) in map {
                body[k] = v;
            }
        }
        daemon.create(&name, body)
    }
}

/// Each test, once per tier: `process::NAME` and `gvisor::NAME`.
macro_rules! for_each_tier {
    ($($test:ident),* $(,)?) => {
        mod process {
            $( #[test] fn $test() { super::$test(super::Tier::Process) } )*
        }
        mod gvisor {
            $(
                #[test]
                fn $test() {
                    if let Some(why) = super::Tier::Gvisor.unavailable() {
                        eprintln!("skipped {}: the gvisor tier cannot run here: {why}", stringify!($test));
                        return;
                    }
                    super::$test(super::Tier::Gvisor)
                }
            )*
        }
    };
}

for_each_tier!(
    exec_streams_exit_statuses_and_journal,
    exec_stdin_background_and_reconnect,
    exec_on_a_terminal,
    a_signal_reaches_the_whole_process_group,
    files_through_the_api_stay_inside_the_workspace,
    pause_holds_the_cell_and_resume_goes_on,
    reset_while_running_restores_the_snapshot_byte_for_byte,
    kill_ends_every_process_of_the_cell,
    the_gateway_allows_denies_and_injects_credentials,
    run_without_a_daemon_keeps_statuses_stdin_and_changes,
    a_command_waits_for_its_start_in_the_journal,
    confinement_holds,
);

fn text(events: &[(String, Value)], stream: &str) -> String {
    String::from_utf8(stream_bytes(events, stream)).unwrap()
}

fn exec_streams_exit_statuses_and_journal(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let cell = tier.cell(&daemon, "conf-exec", "", json!({}));
    let info = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json();
    assert_eq!(info["tier"], tier.name(), "{info}");

    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "printf out; printf err >&2; exit 3"] }),
    );
    assert_eq!(text(&events, "stdout"), "out");
    assert_eq!(text(&events, "stderr"), "err");
    let exit = exit_of(&events);
    assert_eq!(
        (exit["reason"].as_str(), exit["code"].as_i64()),
        (Some("exited"), Some(3))
    );

    // Bytes that are not UTF-8 come back exactly; environment and directory are the request's.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "printf '\\377\\376'; printf \"$GREETING\"; pwd >&2"],
                "env": { "GREETING": "hi" }, "cwd": "/tmp" }),
    );
    assert_eq!(stream_bytes(&events, "stdout"), b"\xff\xfehi");
    assert_eq!(text(&events, "stderr"), "/tmp\n");

    let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", "kill -TERM $$"] }));
    let exit = exit_of(&events);
    assert_eq!(
        (exit["reason"].as_str(), exit["signal"].as_i64()),
        (Some("signaled"), Some(15)),
        "{exit}"
    );

    let events = daemon.exec(&cell, json!({ "argv": ["no-such-command-here"] }));
    let exit = exit_of(&events);
    assert_eq!(exit["code"], 127, "{exit}");
    let events = daemon.exec(&cell, json!({ "argv": ["/etc/passwd"] }));
    assert_eq!(exit_of(&events)["code"], 126);
    let events = daemon.exec(&cell, json!({ "argv": ["sleep", "30"], "timeout_ms": 300 }));
    assert_eq!(exit_of(&events)["reason"], "timeout");

    // The cell's user, as its policy says, and no capability.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "id -u; grep CapEff /proc/self/status"] }),
    );
    assert_eq!(text(&events, "stdout"), "1000\nCapEff:\t0000000000000000\n");

    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    support::daemon::assert_has_kinds(
        &journal,
        &["cell.create", "cell.start", "exec.start", "exec.exit"],
    );
    daemon.assert_journal_verifies();
}

fn exec_stdin_background_and_reconnect(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let cell = tier.cell(&daemon, "conf-bg", "", json!({}));
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "tr a-z A-Z"], "stdin": "line one\nline two\n" }),
    );
    assert_eq!(text(&events, "stdout"), "LINE ONE\nLINE TWO\n");

    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo first; read line; echo got $line"], "background": true })),
    );
    assert_eq!(started.status, 201, "{}", started.text());
    let id = started.json()["id"].as_u64().unwrap();
    // A reader that comes back later gets what was written while nobody read.
    std::thread::sleep(Duration::from_millis(300));
    let answer = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/stdin"),
        Some(json!({ "data": "second\n", "close": true })),
    );
    assert_eq!(answer.status, 204, "{}", answer.text());
    let waited = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/wait"),
        None,
    );
    assert_eq!(waited.json()["code"], 0, "{}", waited.text());
    for _ in 0..2 {
        let replay = daemon.call(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/output"),
            None,
        );
        assert_eq!(
            stream_bytes(&replay.events(), "stdout"),
            b"first\ngot second\n"
        );
    }
    // Files and processes live between execs.
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo kept > /tmp/note"] }),
    );
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "/tmp/note"] }));
    assert_eq!(text(&events, "stdout"), "kept\n");
}

fn exec_on_a_terminal(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let cell = tier.cell(&daemon, "conf-tty", "", json!({}));
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "stty size; test -t 0 && echo tty; read x; echo got:$x; stty size"],
                     "background": true, "tty": { "rows": 30, "cols": 100 } })),
    );
    assert_eq!(started.status, 201, "{}", started.text());
    let id = started.json()["id"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let resized = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/resize"),
        Some(json!({ "rows": 40, "cols": 120 })),
    );
    assert_eq!(resized.status, 204, "{}", resized.text());
    daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/stdin"),
        Some(json!({ "data": "hello\r" })),
    );
    let waited = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/wait"),
        None,
    );
    assert_eq!(waited.json()["code"], 0, "{}", waited.text());
    let replay = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/output"),
        None,
    );
    let out = String::from_utf8_lossy(&stream_bytes(&replay.events(), "stdout")).into_owned();
    assert!(out.contains("30 100"), "{out:?}");
    assert!(out.contains("tty"), "{out:?}");
    assert!(out.contains("got:hello"), "{out:?}");
    assert!(
        out.contains("40 120"),
        "the resize reached the terminal: {out:?}"
    );
}

fn a_signal_reaches_the_whole_process_group(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let cell = tier.cell(&daemon, "conf-sig", "", json!({}));
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "sleep 301 & sleep 302 & wait"], "background": true })),
    );
    let id = started.json()["id"].as_u64().unwrap();
    let count = |d: &Daemon| {
        let events = d.exec(
            &cell,
            json!({ "argv": ["sh", "-c", "ps -eo args | grep -c '^sleep 30[12]' || true"] }),
        );
        text(&events, "stdout").trim().parse::<u32>().unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(&daemon) < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count(&daemon), 2);
    let sent = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/signal"),
        Some(json!({ "signal": "TERM" })),
    );
    assert_eq!(sent.status, 204, "{}", sent.text());
    let waited = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/wait"),
        None,
    );
    assert_eq!(waited.json()["reason"], "signaled", "{}", waited.text());
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(&daemon) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count(&daemon), 0, "both children of the group ended too");
}

fn files_through_the_api_stay_inside_the_workspace(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("README.md"), "# Project\n").unwrap();
    let cell = tier.cell(
        &daemon,
        "conf-files",
        "",
        json!({ "workspace": host.path().display().to_string() }),
    );
    let base = format!("/v1/cells/{cell}/files");
    assert_eq!(
        daemon
            .call(
                "POST",
                &format!("{base}/mkdir"),
                Some(json!({ "path": "src" }))
            )
            .status,
        204
    );
    let put = daemon.request(
        "PUT",
        &format!("{base}/content?path=src/lib.rs"),
        Some("fn main() {}\n"),
    );
    assert_eq!(put.status, 204, "{}", put.text());
    let read = daemon.call("GET", &format!("{base}/content?path=src/lib.rs"), None);
    assert_eq!(read.text(), "fn main() {}\n");
    // The cell sees what the API wrote, and the API what the cell wrote.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "cat src/lib.rs; echo made > made.txt"] }),
    );
    assert_eq!(text(&events, "stdout"), "fn main() {}\n");
    assert_eq!(
        daemon
            .call("GET", &format!("{base}/content?path=made.txt"), None)
            .text(),
        "made\n"
    );
    let listed = daemon
        .call("GET", &format!("{base}/list?path="), None)
        .json();
    let mut names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["README.md", "made.txt", "src"]);
    let stat = daemon
        .call("GET", &format!("{base}/stat?path=README.md"), None)
        .json();
    assert_eq!(
        (stat["kind"].as_str(), stat["size"].as_u64()),
        (Some("file"), Some(10)),
        "{stat}"
    );
    let moved = daemon.call(
        "POST",
        &format!("{base}/move"),
        Some(json!({ "from": "made.txt", "to": "src/moved.txt" })),
    );
    assert_eq!(moved.status, 204, "{}", moved.text());
    let removed = daemon.call(
        "POST",
        &format!("{base}/remove"),
        Some(json!({ "path": "src", "recursive": true })),
    );
    assert_eq!(removed.status, 204, "{}", removed.text());
    // Out of the workspace: by `..`, by an absolute path, through a symlink the cell made.
    assert_eq!(
        daemon
            .call("GET", &format!("{base}/content?path=../etc/passwd"), None)
            .status,
        400
    );
    assert_eq!(
        daemon
            .call("GET", &format!("{base}/content?path=/etc/passwd"), None)
            .status,
        400
    );
    daemon.exec(&cell, json!({ "argv": ["ln", "-s", "/etc", "out"] }));
    let through = daemon.call("GET", &format!("{base}/content?path=out/hostname"), None);
    assert!(
        through.status >= 400,
        "a symlink out is not followed: {} {}",
        through.status,
        through.text()
    );
    // The host directory is untouched; the diff has what the cell and the API did.
    assert_eq!(
        std::fs::read_to_string(host.path().join("README.md")).unwrap(),
        "# Project\n"
    );
    assert!(!host.path().join("src").exists());
    assert_eq!(daemon.changed_paths(&cell), ["out"]);
}

fn pause_holds_the_cell_and_resume_goes_on(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let cell = tier.cell(&daemon, "conf-pause", "", json!({}));
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i; sleep 0.05; done"], "background": true })),
    );
    let id = started.json()["id"].as_u64().unwrap();
    let output = |d: &Daemon| {
        let replay = d.request(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/output?follow=false"),
            None,
        );
        stream_bytes(&replay.events(), "stdout").len()
    };
    std::thread::sleep(Duration::from_millis(400));
    let paused = daemon.call("POST", &format!("/v1/cells/{cell}/pause"), None);
    assert_eq!(paused.json()["state"], "paused", "{}", paused.text());
    std::thread::sleep(Duration::from_millis(200));
    let held = output(&daemon);
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        output(&daemon),
        held,
        "nothing runs while the cell is paused"
    );
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!(refused.status, 409);
    let resumed = daemon.call("POST", &format!("/v1/cells/{cell}/resume"), None);
    assert_eq!(resumed.json()["state"], "running");
    std::thread::sleep(Duration::from_millis(600));
    assert!(output(&daemon) > held, "the loop goes on after resume");
}

fn reset_while_running_restores_the_snapshot_byte_for_byte(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("README.md"), "# Project\n").unwrap();
    let cell = tier.cell(
        &daemon,
        "conf-reset",
        "",
        json!({ "workspace": host.path().display().to_string() }),
    );
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "printf 'a\\000b\\377\\303\\251' > blob.bin; echo one > README.md; mkdir -p d/e; echo deep > d/e/f"] }),
    );
    let snap = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({ "as": "s1" })),
    );
    assert_eq!(snap.status, 201, "{}", snap.text());
    let before = daemon
        .call(
            "GET",
            &format!("/v1/cells/{cell}/files/content?path=blob.bin"),
            None,
        )
        .body;
    assert_eq!(before, b"a\x00b\xff\xc3\xa9");
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo two > README.md; rm -r d blob.bin; echo extra > extra.txt"] }),
    );
    // A process keeps running across the reset.
    let bg = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "60"], "background": true })),
    );
    assert_eq!(bg.status, 201);
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": "s1" })),
    );
    assert_eq!(reset.status, 200, "{}", reset.text());
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "cat README.md d/e/f; test -e extra.txt && echo extra-left; od -An -tx1 blob.bin"] }),
    );
    assert_eq!(text(&events, "stdout"), "one\ndeep\n 61 00 62 ff c3 a9\n");
    assert_eq!(
        daemon
            .call(
                "GET",
                &format!("/v1/cells/{cell}/files/content?path=blob.bin"),
                None
            )
            .body,
        before
    );
    // The cell writes its workspace after the reset, and a reset to its start empties it.
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo after > after.txt"] }),
    );
    assert_eq!(
        daemon.changed_paths(&cell),
        ["README.md", "after.txt", "blob.bin", "d", "d/e", "d/e/f"]
    );
    let reset = daemon.call("POST", &format!("/v1/cells/{cell}/reset"), Some(json!({})));
    assert_eq!(reset.status, 200, "{}", reset.text());
    assert!(daemon.changed_paths(&cell).is_empty());
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "README.md"] }));
    assert_eq!(text(&events, "stdout"), "# Project\n");
}

fn kill_ends_every_process_of_the_cell(tier: Tier) {
    let daemon = Daemon::start(&[]);
    let cell = tier.cell(&daemon, "conf-kill", "", json!({}));
    for _ in 0..3 {
        let bg = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": ["sh", "-c", "sleep 300 & sleep 300 & while true; do sleep 1; done"], "background": true })),
        );
        assert_eq!(bg.status, 201);
    }
    // Every process of the cell, as the host sees them: its cgroup's.
    let pids: Vec<i32> = cgroup_dirs_of(&cell)
        .iter()
        .filter_map(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
        .flat_map(|procs| {
            procs
                .lines()
                .filter_map(|l| l.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect();
    assert!(
        pids.len() >= 6,
        "the cell's processes are in its cgroup: {pids:?}"
    );
    let killed = daemon.call("POST", &format!("/v1/cells/{cell}/kill"), None);
    assert_eq!(killed.json()["state"], "ended", "{}", killed.text());
    let living = || -> Vec<i32> {
        pids.iter()
            .copied()
            .filter(|pid| alive(i64::from(*pid)))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !living().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        living().is_empty(),
        "nothing of the cell is left: {:?}",
        living()
    );
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!(refused.status, 409);
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{cell}"), None)
            .status,
        204
    );
    assert!(cgroup_dirs_of(&cell).is_empty(), "no cgroup is left behind");
    let folder = daemon.runtime().join("cells").join(&cell);
    assert!(!folder.exists(), "{folder:?} is left behind");
}

/// What an upstream received: each request's head.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// A local upstream on 127.0.0.2 that answers each request with the request's head (which the
/// gateway scrubs of secrets on the way back), and keeps what it received.
fn echo_upstream() -> (u16, Seen) {
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Seen::default();
    let kept = std::sync::Arc::clone(&seen);
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let kept = std::sync::Arc::clone(&kept);
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).is_ok_and(|n| n == 1) {
                    head.push(byte[0]);
                }
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    head.len()
                );
                let _ = conn.write_all(reply.as_bytes());
                let _ = conn.write_all(&head);
                kept.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&head).into_owned());
            });
        }
    });
    (port, seen)
}

fn the_gateway_allows_denies_and_injects_credentials(tier: Tier) {
    const SECRET: &str = "s3cr3t-token-of-the-host";
    let daemon = Daemon::start(&[]);
    let (port, seen) = echo_upstream();
    let (denied_port, denied_seen) = echo_upstream();
    let cell = tier.cell(
        &daemon,
        "conf-net",
        &format!(
            "network:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [GET]\n      credential: api\ncredentials:\n  api: {{ from_env: CONF_API_TOKEN, header: Authorization, format: \"Bearer {{}}\" }}\n"
        ),
        json!({ "secrets": { "CONF_API_TOKEN": SECRET } }),
    );
    let script = format!(
        "echo \"env=$CONF_API_TOKEN\"; \
         curl -s http://127.0.0.2:{port}/api/x; \
         curl -s -o /dev/null -w 'post=%{{http_code}}\\n' -X POST http://127.0.0.2:{port}/api/x; \
         curl -s -o /dev/null -w 'other=%{{http_code}}\\n' http://127.0.0.2:{denied_port}/; \
         curl -s -m 5 --noproxy '*' -o /dev/null -w 'direct=%{{http_code}}\\n' http://127.0.0.2:{denied_port}/"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
    let out = text(&events, "stdout");
    let env_line = out.lines().next().unwrap();
    assert!(
        env_line.starts_with("env=") && env_line.len() > 10,
        "the cell holds a placeholder: {out}"
    );
    assert!(
        !out.contains(SECRET),
        "nothing the cell receives holds the secret: {out}"
    );
    let received = seen.lock().unwrap().clone();
    assert_eq!(
        received.len(),
        1,
        "only the allowed GET reached the upstream: {received:?}"
    );
    assert!(
        received[0].contains(&format!("Authorization: Bearer {SECRET}")),
        "the upstream got the secret: {received:?}"
    );
    assert!(
        out.contains("GET /api/x HTTP/1.1"),
        "the answer reached the cell: {out}"
    );
    assert!(
        denied_seen.lock().unwrap().is_empty(),
        "nothing reached the other port"
    );
    assert!(out.contains("post=403"), "{out}");
    assert!(out.contains("other=403"), "{out}");
    assert!(
        out.contains("direct=403"),
        "a client that ignores the proxy is decided too: {out}"
    );
    // The decisions are in the journal, and the secret is nowhere in it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let journal = loop {
        let journal = std::fs::read_to_string(daemon.journal()).unwrap();
        if journal.matches("\"kind\":\"net.decision\"").count() >= 4 || Instant::now() > deadline {
            break journal;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        journal.matches("\"kind\":\"net.decision\"").count() >= 4,
        "{journal}"
    );
    assert!(!journal.contains(SECRET));
}

/// `warden run` journals a cell's start while the cell is made (a gVisor cell's keeper, forked,
/// makes it; a process cell's init assembles its root while the start's own thread journals
/// it), and the command starts only once the start is in the journal. Here the journal refuses
/// the start: a file-size limit below the size its file already has (every other file the run
/// writes is smaller). The run fails with the journal's reason, the command never ran
/// (it would have made a file in a folder of the host's), and nothing of the cell is left.
fn a_command_waits_for_its_start_in_the_journal(tier: Tier) {
    let RunDirs {
        dir,
        state,
        runtime,
        host,
    } = run_dirs();
    let policy = policy(
        dir.path(),
        &tier.policy(&format!(
            "filesystem:\n  read_write: [{}]\n",
            host.display()
        )),
    );
    let run = |limit: Option<u64>, argv: &[&str]| {
        let mut command = match limit {
            // Ignored, SIGXFSZ leaves the refusal to the write (EFBIG).
            Some(blocks) => {
                let mut sh = std::process::Command::new("sh");
                sh.args([
                    "-c",
                    &format!("trap '' XFSZ; ulimit -f {blocks}; exec \"$0\" \"$@\""),
                    BIN,
                ]);
                sh
            }
            None => warden(),
        };
        command
            .env("WARDEN_STATE_DIR", &state)
            .env("WARDEN_RUNTIME_DIR", &runtime)
            .args(["run", "--policy"])
            .arg(&policy)
            .arg("--")
            .args(argv)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    // A journal past 100 KB: one run with a long argument.
    let long = "a".repeat(100_000);
    let first = run(None, &["true", &long]);
    assert!(first.status.success(), "{first:?}");
    let journal = state.join("journal").join("journal.jsonl");
    let size = std::fs::metadata(&journal).unwrap().len();
    assert!(size > 100_000, "the journal has {size} bytes");
    let ran = host.join("ran");
    let touch = format!("touch {}", ran.display());
    let refused = run(Some(size / 512 - 1), &["sh", "-c", &touch]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(125), "{refused:?}");
    assert!(
        stderr.contains("journal") && stderr.contains("File too large"),
        "{stderr}"
    );
    // Only the journal's reason: the keeper, told not to start, says nothing.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        !ran.exists(),
        "the command ran before its start was journaled"
    );
    let left = cell_folders_left(&runtime);
    assert!(left.is_empty(), "left behind: {left:?}");
    // No process of the run is left; on gVisor, runsc (which starts before the start is
    // journaled, its spec held back) went with the cell and made no container.
    let runsc_left = || {
        let containers: Vec<_> = std::fs::read_dir(state.join("gvisor").join("runsc"))
            .map(|dir| dir.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        let processes = processes_naming(&state);
        (containers, processes)
    };
    let (containers, processes) = runsc_left();
    assert!(containers.is_empty(), "runsc's state left: {containers:?}");
    assert!(processes.is_empty(), "processes left: {processes:?}");
    assert_eq!(std::fs::metadata(&journal).unwrap().len(), size);
    // The same run, with the journal taking entries again, runs.
    let again = run(None, &["sh", "-c", &touch]);
    assert!(again.status.success(), "{again:?}");
    assert!(ran.exists());
    // A command that is not there ends the run before its sandbox starts, runsc with it.
    let missing = run(None, &["no-such-program-here"]);
    assert_eq!(missing.status.code(), Some(127), "{missing:?}");
    let (containers, processes) = runsc_left();
    assert!(containers.is_empty(), "runsc's state left: {containers:?}");
    assert!(processes.is_empty(), "processes left: {processes:?}");
}

/// A root `warden run` begins its cell's network namespace before it has read its policy, and
/// a cell of the gVisor tier lets go of it: the run is back to one thread before it starts the
/// keeper, which it then forks (the keeper shows the run's own command line) rather than
/// starting `warden keep`, which it does only from a process of more threads.
#[test]
fn a_gvisor_run_lets_go_of_its_early_network_and_forks_its_keeper() {
    if let Some(why) = Tier::Gvisor.unavailable() {
        eprintln!("skipped: the gvisor tier cannot run here: {why}");
        return;
    }
    let name = unique("forked-keeper");
    let mut run = warden()
        .args(["run", "--tier", "gvisor", "--name", &name, "--"])
        .args(["sh", "-c", "echo up; exec sleep 30"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut up = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(run.stdout.take().unwrap()),
        &mut up,
    )
    .unwrap();
    assert_eq!(up, "up\n");
    // The cell runs: its keeper, started before it, is what it will be.
    let children: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("status")).is_ok_and(|status| {
                status
                    .lines()
                    .any(|l| l.split_whitespace().eq(["PPid:", &run.id().to_string()]))
            })
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .collect();
    let _ = warden().args(["kill", &name]).status();
    let _ = run.wait();
    assert!(
        !children.is_empty() && children.iter().all(|c| c.contains(" run ")),
        "the run's children: {children:?}"
    );
}

/// The command lines of the processes that name `path` (a test's own state folder).
fn processes_naming(path: &std::path::Path) -> Vec<String> {
    let needle = path.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .filter(|line| line.contains(&needle))
        .collect()
}

fn run_without_a_daemon_keeps_statuses_stdin_and_changes(tier: Tier) {
    let dir = tempdir();
    std::fs::write(dir.path().join("a.txt"), "original\n").unwrap();
    let policy = policy(dir.path(), &tier.policy(""));
    let policy = policy.display().to_string();
    let name = unique("conf-run");
    let ws = dir.path().display().to_string();
    let ran = run_sh(
        &["--policy", &policy, "--name", &name, "-w", &ws],
        "cat a.txt; echo changed > a.txt; echo new > b.txt; printf err >&2; exit 7",
    );
    assert_eq!(
        (ran.code, ran.stdout.as_str()),
        (7, "original\n"),
        "{ran:?}"
    );
    assert!(ran.stderr.starts_with("err"), "{ran:?}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("a.txt")).unwrap(),
        "original\n"
    );
    // The cell's folder in the runtime directory (the default one, as root) went with it,
    // before any other command could sweep it.
    let runtime = std::env::var_os("WARDEN_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .or_else(|| is_root().then(|| "/run/warden".into()));
    if let Some(folder) = runtime.map(|r| r.join("cells").join(&name)) {
        assert!(!folder.exists(), "{folder:?} is left behind");
    }
    let diff = warden().args(["diff", &name, "--stat"]).output().unwrap();
    let diff = String::from_utf8_lossy(&diff.stdout);
    assert!(
        diff.contains("M a.txt") && diff.contains("A b.txt"),
        "{diff}"
    );
    assert!(warden().args(["rm", &name]).status().unwrap().success());
    // What the command writes the moment it starts is the caller's, whole (the tier's own
    // word that the cell is up travels in the same pipe on the gVisor tier).
    let burst: String = (0..40)
        .map(|i| format!("line {i} of the first burst\n"))
        .collect();
    for _ in 0..3 {
        let ran = run_sh(&["--policy", &policy], &format!("printf '{burst}'"));
        assert_eq!(
            (ran.code, ran.stdout.as_str()),
            (0, burst.as_str()),
            "{ran:?}"
        );
    }
    // The command starts with every signal at its default: a writer into a closed pipe ends
    // on SIGPIPE (an ignored one would have `yes` say "Broken pipe" and fail).
    let piped = run_sh(&["--policy", &policy], "yes | head -n 1");
    assert_eq!(
        (piped.code, piped.stdout.as_str(), piped.stderr.as_str()),
        (0, "y\n", ""),
        "{piped:?}"
    );
    // Stdin, a missing program, a signal, the wall-clock limit.
    let mut child = warden()
        .args(["run", "--policy", &policy, "--", "tr", "a-z", "A-Z"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"piped\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "PIPED\n");
    assert_eq!(
        run_sh(&["--policy", &policy], "exec no-such-program").code,
        127
    );
    let missing = warden()
        .args(["run", "--policy", &policy, "--", "no-such-program"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(127));
    assert_eq!(run_sh(&["--policy", &policy], "kill -KILL $$").code, 137);
    let begun = Instant::now();
    assert_eq!(
        run_sh(&["--policy", &policy, "--timeout", "1s"], "sleep 30").code,
        124
    );
    assert!(begun.elapsed() < Duration::from_secs(20));
    signals_reach_the_command_once(&policy);
}

/// A signal to `warden run`'s process group (a terminal's Ctrl-C) reaches the command once, one
/// to warden's own pid (a supervisor's `kill`) reaches it too, and a SIGTERM runs the command's
/// own handler, whose exit status is warden's.
fn signals_reach_the_command_once(policy: &str) {
    use std::io::BufRead as _;
    use std::os::unix::process::CommandExt as _;
    let script = "n=0; trap 'n=$((n+1)); echo INT $n' INT; \
                  trap 'echo TERM after $n; exit 9' TERM; echo ready; \
                  i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; echo timeout";
    let mut child = warden()
        .args(["run", "--policy", policy, "--", "sh", "-c", script])
        .process_group(0)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let _ = tx.send(line.unwrap_or_default());
        }
    });
    let next = || {
        lines
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("the command's next line: {e}"))
    };
    assert_eq!(next(), "ready");
    let pid = child.id().to_string();
    let kill = |args: &[&str]| {
        assert!(
            std::process::Command::new("kill")
                .args(args)
                .status()
                .unwrap()
                .success()
        );
    };
    kill(&["-INT", "--", &format!("-{pid}")]);
    assert_eq!(next(), "INT 1");
    // Not twice: nothing more comes meanwhile.
    assert!(lines.recv_timeout(Duration::from_millis(700)).is_err());
    kill(&["-INT", &pid]);
    assert_eq!(next(), "INT 2");
    kill(&["-TERM", &pid]);
    assert_eq!(next(), "TERM after 2");
    assert_eq!(child.wait().unwrap().code(), Some(9));
}

fn confinement_holds(tier: Tier) {
    let daemon = Daemon::start(&[]);
    // What the host has that the cell must not reach.
    let secret_dir = tempfile::Builder::new()
        .prefix("warden-secret-")
        .tempdir_in(outside_tmp())
        .unwrap();
    std::fs::write(secret_dir.path().join("key"), "host secret\n").unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let host_port = listener.local_addr().unwrap().port();
    let marker = unique("host-marker");
    let mut host_proc = std::process::Command::new("sh")
        .args(["-c", &format!("exec -a {marker} sleep 60")])
        .spawn()
        .unwrap();
    let cell = tier.cell(&daemon, "conf-conf", "", json!({}));
    let script = format!(
        "cat {key} 2>/dev/null && echo read-secret; \
         ls {runtime} 2>/dev/null && echo saw-runtime; \
         test -S {socket} && echo saw-socket; \
         pgrep -f \"$MARK\" >/dev/null && echo saw-host-process; \
         python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {host_port}), timeout=2)' 2>/dev/null && echo reached-host-loopback; \
         ls /proc/1/root/ 2>/dev/null | grep -q run && echo host-root; \
         echo x > /usr/x 2>/dev/null && echo wrote-usr; \
         id -u; echo done",
        key = secret_dir.path().join("key").display(),
        runtime = daemon.runtime().display(),
        socket = daemon.socket().display(),
    );
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", script], "env": { "MARK": marker } }),
    );
    assert_eq!(
        text(&events, "stdout"),
        "1000\ndone\n",
        "stderr: {}",
        text(&events, "stderr")
    );
    // The caller's environment and descriptors do not reach a cell made by `warden run`.
    let policy = policy(secret_dir.path(), &tier.policy(""));
    let key = std::fs::File::open(secret_dir.path().join("key")).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&key);
    let mut cmd = warden();
    cmd.env("CONF_CALLER_SECRET", "caller-value")
        .args(["run", "--policy", &policy.display().to_string(), "--", "sh", "-c"])
        .arg(format!("echo \"[$CONF_CALLER_SECRET]\"; cat /proc/self/fd/{fd} 2>/dev/null && echo inherited; ls /proc/self/fd | wc -l"));
    clear_cloexec(&key);
    let ran: Ran = cmd.output().unwrap().into();
    drop(key);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"[]"), "{ran:?}");
    assert!(
        !ran.stdout.contains("inherited") && !ran.stdout.contains("host secret"),
        "{ran:?}"
    );
    let _ = host_proc.kill();
    let _ = host_proc.wait();
    drop(listener);
}

/// Lets a descriptor of this process pass into the children it starts (as a careless caller's
/// would).
fn clear_cloexec(file: &std::fs::File) {
    let flags = rustix::io::fcntl_getfd(file).unwrap();
    rustix::io::fcntl_setfd(file, flags - rustix::io::FdFlags::CLOEXEC).unwrap();
}
