//! The daemon end to end: a real `warden serve`, real cells behind it, requests over its real
//! sockets, and its journal read back from disk.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::daemon::{Daemon, assert_has_kinds, exchange, read_file, stream_bytes};
use support::*;

fn exit_of(events: &[(String, Value)]) -> Value {
    let (name, data) = events.last().expect("some events");
    assert_eq!(name, "exit", "the stream ends with exit: {events:?}");
    data.clone()
}

#[test]
fn api_end_to_end_create_exec_background_pause_kill_delete() {
    if !cgroups_available("api_end_to_end") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("api"), json!({ "labels": { "team": "qa" } }));

    // Streamed output, both streams, and the exit code.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo out; echo err >&2; id -u; exit 7"] }),
    );
    assert_eq!(events[0].0, "started");
    assert_eq!(stream_bytes(&events, "stdout"), b"out\n1000\n");
    assert_eq!(stream_bytes(&events, "stderr"), b"err\n");
    let exit = exit_of(&events);
    assert_eq!(
        (exit["reason"].as_str(), exit["code"].as_i64()),
        (Some("exited"), Some(7))
    );

    // Stdin, and bytes that are not UTF-8 come back exactly.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "cat; printf '\\377\\376'"], "stdin": "line one\nline two\n" }),
    );
    assert_eq!(
        stream_bytes(&events, "stdout"),
        b"line one\nline two\n\xff\xfe"
    );

    // A process that lives in the cell between execs: files persist, and so do processes.
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo kept > /tmp/note"] }),
    );
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "/tmp/note"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"kept\n");

    // Background: started, read twice from the start, fed stdin, waited for.
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo first; read line; echo got $line"], "background": true })),
    );
    assert_eq!(
        started.status,
        201,
        "{}",
        String::from_utf8_lossy(&started.body)
    );
    let id = started.json()["id"].as_u64().unwrap();
    let answer = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/stdin"),
        Some(json!({ "data": "second\n", "close": true })),
    );
    assert_eq!(
        answer.status,
        204,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let waited = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/wait"),
        None,
    );
    assert_eq!(waited.json()["code"], 0);
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

    // A timeout ends the process and says so.
    let events = daemon.exec(&cell, json!({ "argv": ["sleep", "30"], "timeout_ms": 300 }));
    assert_eq!(exit_of(&events)["reason"], "timeout");
    // A command that does not exist is an exit event with 127, not a hang.
    let events = daemon.exec(&cell, json!({ "argv": ["no-such-command"] }));
    assert_eq!(exit_of(&events)["code"], 127);

    // Pause: the cell's processes stop running; exec is refused until resume.
    let bg = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "while true; do date +%s%N >> /tmp/ticks; sleep 0.02; done"], "background": true })),
    );
    assert_eq!(bg.status, 201);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/pause"), None)
            .json()["state"],
        "paused"
    );
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!(refused.status, 409);
    assert!(refused.json()["error"].as_str().unwrap().contains("resume"));
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/resume"), None)
            .json()["state"],
        "running"
    );
    let count = |d: &Daemon| {
        let events = d.exec(&cell, json!({ "argv": ["sh", "-c", "wc -l < /tmp/ticks"] }));
        String::from_utf8(stream_bytes(&events, "stdout"))
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let before = count(&daemon);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        count(&daemon) > before,
        "the background loop runs again after resume"
    );

    // Kill: the cell ends, its processes with it; exec is refused; delete removes it.
    let killed = daemon.call("POST", &format!("/v1/cells/{cell}/kill"), None);
    assert_eq!(killed.json()["state"], "ended");
    assert!(host_processes_with(&cell).is_empty());
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
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .status,
        404
    );
    assert!(cgroup_dirs_of(&cell).is_empty(), "no cgroup is left behind");

    // Everything above is in the journal, in order, and the chain verifies.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let kinds: Vec<String> = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["cell"] == cell.as_str())
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect();
    for kind in [
        "cell.create",
        "cell.start",
        "exec.start",
        "exec.exit",
        "exec.stdin",
        "cell.pause",
        "cell.resume",
        "cell.kill",
        "cell.end",
        "cell.delete",
    ] {
        assert!(
            kinds.contains(&kind.to_owned()),
            "{kind} missing from {kinds:?}"
        );
    }
    assert!(journal.contains(r#""argv":["sh","-c","echo out; echo err >&2; id -u; exit 7"]"#));
    daemon.assert_journal_verifies();
}

#[test]
fn cli_create_exec_and_the_exit_status() {
    if !cgroups_available("cli_create_exec") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let name = unique("cli");
    let out = daemon.warden().args(["create", &name]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = daemon
        .warden()
        .args([
            "exec",
            &name,
            "--",
            "sh",
            "-c",
            "echo hi; echo there >&2; exit 4",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.stderr, b"there\n");
    let out = daemon
        .warden()
        .args(["exec", &name, "--", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    // -i passes stdin as it comes.
    let mut child = daemon
        .warden()
        .args([
            "exec",
            "-i",
            &name,
            "--",
            "sh",
            "-c",
            "read a; echo first:$a; read b; echo second:$b",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"one\n").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        stdin.write_all(b"two\n").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "first:one\nsecond:two\n"
    );
    // -t gives the process a terminal of the cell, sized like the client's.
    let script = format!(
        "import os, pty, struct, fcntl, termios, sys\n\
         pid, fd = pty.fork()\n\
         if pid == 0:\n    os.execv({BIN:?}, ['warden', 'exec', '-t', {name:?}, '--', 'sh', '-c', 'tty; stty size'])\n\
         fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack('HHHH', 33, 99, 0, 0))\n\
         out = b''\n\
         while True:\n    try:\n        chunk = os.read(fd, 4096)\n    except OSError:\n        break\n    if not chunk:\n        break\n    out += chunk\n\
         _, status = os.waitpid(pid, 0)\n\
         sys.stdout.write(out.decode(errors='replace'))\n\
         sys.stdout.write('status=%d' % os.waitstatus_to_exitcode(status))"
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .env("WARDEN_RUNTIME_DIR", &daemon.runtime)
        .env("WARDEN_STATE_DIR", &daemon.state)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("/dev/pts/") && text.contains("33 99") && text.contains("status=0"),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // `warden logs`: what the processes printed, without waiting for running ones.
    let bg = daemon.call(
        "POST",
        &format!("/v1/cells/{name}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo still-running; sleep 30"], "background": true })),
    );
    assert_eq!(bg.status, 201);
    std::thread::sleep(Duration::from_millis(300));
    let logs = daemon.warden().args(["logs", &name]).output().unwrap();
    assert!(
        logs.status.success(),
        "{}",
        String::from_utf8_lossy(&logs.stderr)
    );
    let text = String::from_utf8_lossy(&logs.stdout);
    assert!(
        text.contains("hi\n") && text.contains("still-running\n"),
        "{text}"
    );
    // `warden kill` goes through the daemon, so the journal has it.
    let out = daemon.warden().args(["kill", &name]).output().unwrap();
    assert!(out.status.success());
    let replay = daemon.warden().args(["replay", &name]).output().unwrap();
    let text = String::from_utf8_lossy(&replay.stdout);
    assert!(
        text.contains("cell.kill") && text.contains("exec.exit"),
        "{text}"
    );
    let out = daemon
        .warden()
        .args(["exec", &name, "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ended"));
}

#[test]
fn a_crashed_daemon_leaves_cells_controllable_and_the_journal_whole() {
    if !cgroups_available("daemon_crash") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("crash"), json!({}));
    // Acknowledged work before the crash.
    let mut acknowledged = Vec::new();
    for i in 0..5 {
        let events = daemon.exec(&cell, json!({ "argv": ["echo", format!("run {i}")] }));
        acknowledged.push(exit_of(&events)["journal_seq"].as_u64().unwrap());
    }
    // A client streams output while the daemon dies.
    let socket = daemon.socket();
    let path = format!("/v1/cells/{cell}/exec");
    let streaming = std::thread::spawn(move || {
        let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        let body = json!({ "argv": ["sh", "-c", "while true; do echo tick; sleep 0.05; done"] })
            .to_string();
        exchange(stream, "POST", &path, Some(&body), &[])
    });
    let quiet_socket = daemon.socket();
    let quiet_path = format!("/v1/cells/{cell}/exec");
    let quiet = std::thread::spawn(move || {
        let stream = std::os::unix::net::UnixStream::connect(quiet_socket).unwrap();
        let body = json!({ "argv": ["sleep", "1000"] }).to_string();
        exchange(stream, "POST", &quiet_path, Some(&body), &[])
    });
    std::thread::sleep(Duration::from_millis(500));
    daemon.restart();
    let cut = streaming.join().unwrap();
    quiet.join().unwrap();
    assert!(
        String::from_utf8_lossy(&cut.body).contains("tick"),
        "output streamed before the crash"
    );

    // The cell survived and is controllable by the new daemon.
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .json()["state"],
        "running"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "after"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"after\n");
    // A quiet process whose client was the dead daemon lost that client (its pipes may stay
    // quiet forever), so the cell's init killed it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let events = daemon.exec(&cell, json!({ "argv": ["ps", "-eo", "args"] }));
        let listing = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
        assert!(listing.contains("ps -eo args"), "{listing}");
        if !listing.contains("while true") && !listing.contains("sleep 1000") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the process of the lost client still runs: {listing}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/pause"), None)
            .json()["state"],
        "paused"
    );
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/resume"), None)
            .json()["state"],
        "running"
    );

    // Every acknowledged entry is there, and the journal verifies.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let entries: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for seq in &acknowledged {
        let entry = entries
            .iter()
            .find(|e| e["seq"] == *seq)
            .expect("acknowledged entry kept");
        assert_eq!(entry["kind"], "exec.exit");
    }
    assert!(
        entries
            .iter()
            .any(|e| e["kind"] == "cell.reattach" && e["cell"] == cell.as_str())
    );
    daemon.assert_journal_verifies();

    // Kill the cell with the new daemon; nothing of it is left.
    daemon.call("POST", &format!("/v1/cells/{cell}/kill"), None);
    assert!(host_processes_with(&cell).is_empty());
    assert!(cgroup_dirs_of(&cell).is_empty());

    // One changed byte in an entry in the middle: verify fails and names that entry.
    let mut lines: Vec<String> = journal.lines().map(str::to_owned).collect();
    let target = acknowledged[2] as usize;
    let index = lines
        .iter()
        .position(|l| l.starts_with(&format!("{{\"seq\":{target},")))
        .unwrap();
    lines[index] = lines[index].replacen("run 2", "run X", 1);
    std::fs::write(daemon.journal(), lines.join("\n") + "\n").unwrap();
    let verify = daemon.warden().args(["audit", "verify"]).output().unwrap();
    let text = String::from_utf8_lossy(&verify.stdout);
    assert_eq!(verify.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "entry {target} (journal.jsonl line {})",
            index + 1
        )),
        "{text}"
    );
}

#[test]
fn tcp_needs_the_token_and_cells_cannot_reach_the_daemon() {
    if !cgroups_available("tcp_token") {
        return;
    }
    // Port 0: the daemon says which port it got in `daemon.addr`.
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let token = std::fs::read_to_string(daemon.runtime.join("daemon.token")).unwrap();
    let addr = std::fs::read_to_string(daemon.runtime.join("daemon.addr")).unwrap();
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let tcp = |headers: &[(&str, &str)]| {
        let mut last = None;
        for _ in 0..50 {
            if let Ok(stream) = std::net::TcpStream::connect(&addr) {
                last = Some(exchange(stream, "GET", "/v1/cells", None, headers));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        last.expect("the TCP listener answers")
    };
    assert_eq!(tcp(&[]).status, 401);
    assert_eq!(tcp(&[("Authorization", "Bearer wrong")]).status, 401);
    let bearer = format!("Bearer {token}");
    assert_eq!(tcp(&[("Authorization", bearer.as_str())]).status, 200);

    // From inside a cell: neither the TCP port nor the unix socket is reachable.
    let cell = daemon.create(&unique("reach"), json!({}));
    let socket = daemon.socket().display().to_string();
    let script = format!(
        "import socket\n\
         for target in [('tcp', ('127.0.0.1', {port})), ('unix', '{socket}')]:\n\
         \x20   kind, address = target\n\
         \x20   s = socket.socket(socket.AF_INET if kind == 'tcp' else socket.AF_UNIX)\n\
         \x20   s.settimeout(2)\n\
         \x20   try:\n\
         \x20       s.connect(address); print(kind, 'CONNECTED')\n\
         \x20   except OSError as e:\n\
         \x20       print(kind, 'refused', type(e).__name__)\n"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["python3", "-c", script] }));
    let out = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(
        out.contains("tcp refused") && out.contains("unix refused"),
        "{out}"
    );
    assert!(!out.contains("CONNECTED"), "{out}");
}

#[test]
fn bad_api_input_gets_clear_errors_and_changes_nothing() {
    if !cgroups_available("bad_api_input") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let bad = |method: &str, path: &str, body: Option<&str>, status: u16, says: &str| {
        let answer = daemon.request(method, path, body);
        assert_eq!(
            answer.status,
            status,
            "{method} {path}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        let message = answer.json()["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            message.contains(says),
            "{method} {path}: `{message}` should say `{says}`"
        );
    };
    bad("POST", "/v1/cells", Some("{not json"), 400, "request body");
    bad(
        "POST",
        "/v1/cells",
        Some(r#"{"name": "x", "colour": "red"}"#),
        422,
        "unknown field",
    );
    bad(
        "POST",
        "/v1/cells",
        Some(r#"{"name": "../etc"}"#),
        400,
        "name",
    );
    bad(
        "POST",
        "/v1/cells",
        Some(r#"{"name": "ok", "preset": "nope"}"#),
        400,
        "nope",
    );
    bad(
        "POST",
        "/v1/cells",
        Some(r#"{"name": "ok2", "policy": "version: 1\nnetwork:\n  defualt: deny\n"}"#),
        400,
        "defualt",
    );
    bad(
        "POST",
        "/v1/cells",
        Some(r#"{"name": "ok3", "workspace": "/no/such/dir"}"#),
        400,
        "not a directory",
    );
    let huge = format!(
        r#"{{"name": "big", "labels": {{"a": "{}"}}}}"#,
        "x".repeat(2 * 1024 * 1024)
    );
    bad("POST", "/v1/cells", Some(&huge), 413, "request body");
    bad("GET", "/v1/cells/nope", None, 404, "no cell");
    bad(
        "POST",
        "/v1/cells/nope/exec",
        Some(r#"{"argv": ["true"]}"#),
        404,
        "no cell",
    );
    bad("GET", "/v1/nothing", None, 404, "openapi");
    let cell = daemon.create(&unique("bad"), json!({}));
    bad(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(r#"{"argv": []}"#),
        400,
        "argv",
    );
    bad(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(r#"{"argv": "ls"}"#),
        422,
        "argv",
    );
    bad(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(r#"{"argv": ["true"], "env": {"A=B": "c"}}"#),
        400,
        "A=B",
    );
    bad(
        "POST",
        &format!("/v1/cells/{cell}/processes/99/signal"),
        Some(r#"{"signal": 9}"#),
        404,
        "no process",
    );
    // A working directory that does not exist is the process's failure, reported as its end.
    let events = daemon.exec(&cell, json!({ "argv": ["true"], "cwd": "/no/such/dir" }));
    let exit = events.last().unwrap().1.clone();
    assert_eq!(exit["reason"], "failed");
    assert!(
        exit["message"].as_str().unwrap().contains("/no/such/dir"),
        "{exit}"
    );
    // None of the refused creations left a cell behind.
    let cells = daemon.call("GET", "/v1/cells", None).json();
    assert_eq!(cells.as_array().unwrap().len(), 1, "{cells}");
    // The committed OpenAPI document is what the daemon serves, and names every route.
    let served = daemon.call("GET", "/openapi.json", None).json();
    let committed: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/openapi.json"
        ))
        .unwrap(),
    )
    .unwrap();
    assert_eq!(served, committed);
    for path in [
        "/v1/cells",
        "/v1/cells/{name}/exec",
        "/v1/cells/{name}/processes/{id}/output",
    ] {
        assert!(served["paths"].get(path).is_some(), "{path} documented");
    }
}

#[test]
fn a_hundred_concurrent_exec_streams_from_twenty_cells_deliver_every_byte_in_order() {
    if !cgroups_available("exec_load") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let cells: Vec<String> = (0..20)
        .map(|i| daemon.create(&unique(&format!("load{i}")), json!({})))
        .collect();
    let mut threads = Vec::new();
    for (c, cell) in cells.iter().enumerate() {
        for e in 0..5 {
            let daemon = std::sync::Arc::clone(&daemon);
            let cell = cell.clone();
            threads.push(std::thread::spawn(move || {
                let tag = format!("{c}-{e}");
                let events = daemon.exec(
                    &cell,
                    json!({ "argv": ["sh", "-c", format!("seq 1 20000 | sed 's/^/{tag}:/'")] }),
                );
                let expected: String = (1..=20000).map(|n| format!("{tag}:{n}\n")).collect();
                let got = stream_bytes(&events, "stdout");
                assert_eq!(got.len(), expected.len(), "{tag}: byte count");
                assert!(
                    got == expected.as_bytes(),
                    "{tag}: bytes out of order or changed"
                );
                assert_eq!(
                    exit_of(&events)["stdout_bytes"].as_u64(),
                    Some(expected.len() as u64)
                );
            }));
        }
    }
    for thread in threads {
        thread.join().unwrap();
    }
}

/// A local upstream that answers every request with 200 "ok" and counts connections.
fn upstream() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&hits);
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
        }
    });
    (port, hits)
}

#[test]
fn approvals_held_by_the_daemon_proceed_on_approve_and_fail_on_deny_or_timeout() {
    if !cgroups_available("daemon_approvals") {
        return;
    }
    let (port, hits) = upstream();
    let daemon = Daemon::start(&[]);
    let policy = format!(
        "version: 1\nnetwork:\n  ask:\n    - host: 127.0.0.2\n      ports: [{port}]\napprovals:\n  timeout: 2s\n  on_timeout: deny\n"
    );
    let cell = daemon.create(&unique("approve"), json!({ "policy": policy }));
    let fetch = |path: &str| -> u64 {
        let code = format!(
            "import urllib.request, urllib.error\n\
             try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/{path}').status)\n\
             except urllib.error.HTTPError as e:\n    print(e.code)"
        );
        let started = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": ["python3", "-c", code], "background": true })),
        );
        assert_eq!(started.status, 201);
        started.json()["id"].as_u64().unwrap()
    };
    let question = |path: &str| -> u64 {
        for _ in 0..200 {
            let list = daemon.call("GET", "/v1/approvals", None).json();
            if let Some(q) = list.as_array().unwrap().iter().find(|q| {
                q["request"]
                    .as_str()
                    .unwrap()
                    .ends_with(&format!("/{path}"))
            }) {
                assert_eq!(q["cell"], cell.as_str());
                return q["id"].as_u64().unwrap();
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("no approval appeared for /{path}");
    };
    let result = |id: u64| -> String {
        daemon.call(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/wait"),
            None,
        );
        let out = daemon.call(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/output"),
            None,
        );
        String::from_utf8(stream_bytes(&out.events(), "stdout"))
            .unwrap()
            .trim()
            .to_owned()
    };
    let answer = |id: u64, decision: &str, scope: &str| {
        let answer = daemon.call(
            "POST",
            &format!("/v1/approvals/{cell}/{id}"),
            Some(json!({ "decision": decision, "scope": scope })),
        );
        assert_eq!(
            answer.status,
            204,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    };

    // Approved: the request goes through, and only then reaches the upstream.
    let p = fetch("a");
    let q = question("a");
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "held until answered"
    );
    answer(q, "approve", "once");
    assert_eq!(result(p), "200");

    // Denied: a 403, and the upstream never sees it.
    let before = hits.load(std::sync::atomic::Ordering::SeqCst);
    let p = fetch("b");
    answer(question("b"), "deny", "once");
    assert_eq!(result(p), "403");
    // Unanswered: the policy's timeout decides (deny).
    let p = fetch("c");
    question("c");
    assert_eq!(result(p), "403");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), before);

    // Scope `cell`: the same request from this cell is approved from now on without asking.
    let p = fetch("d");
    answer(question("d"), "approve", "cell");
    assert_eq!(result(p), "200");
    let p = fetch("d");
    assert_eq!(result(p), "200");

    // The journal says who answered what, and that the timeout decided one; the gateway's
    // decisions reach it within a tick of the daemon's watch.
    let mut entries: Vec<Value> = Vec::new();
    for _ in 0..40 {
        let journal = std::fs::read_to_string(daemon.journal()).unwrap();
        entries = journal
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if entries
            .iter()
            .filter(|e| e["kind"] == "net.decision")
            .count()
            >= 5
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let answers: Vec<&Value> = entries
        .iter()
        .filter(|e| e["kind"] == "approval.answer")
        .collect();
    assert_eq!(answers.len(), 4, "{answers:?}");
    assert!(
        answers[0]["data"]["by"]
            .as_str()
            .unwrap()
            .contains("on the unix socket"),
        "{}",
        answers[0]
    );
    assert_eq!(answers[1]["data"]["decision"], "deny");
    assert!(
        answers[3]["data"]["by"]
            .as_str()
            .unwrap()
            .starts_with("grant:"),
        "{}",
        answers[3]
    );
    assert!(entries.iter().any(|e| e["kind"] == "approval.timeout"
        && e["data"]["request"].as_str().unwrap().ends_with("/c")));
    let decisions = entries
        .iter()
        .filter(|e| e["kind"] == "net.decision")
        .count();
    assert!(
        decisions >= 5,
        "gateway decisions are journaled ({decisions})"
    );
}

#[test]
fn an_idle_cell_is_paused_and_the_next_exec_wakes_it() {
    if !cgroups_available("daemon_idle") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(
        &unique("idle"),
        json!({ "policy": "version: 1\nlimits:\n  idle: 1s\n  on_idle: pause\n" }),
    );
    let mut state = String::new();
    for _ in 0..60 {
        state = daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .json()["state"]
            .as_str()
            .unwrap()
            .to_owned();
        if state == "paused" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(state, "paused", "idle for 1 s: paused");
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "awake"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"awake\n");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(journal.contains("\"kind\":\"cell.idle\""));
    assert!(journal.contains("exec after an idle pause"));
}

#[test]
fn files_round_trip_and_paths_cannot_leave_the_cell() {
    if !cgroups_available("daemon_files") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("readme.txt"), "from the host\n").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", host.path().join("escape")).unwrap();
    let workspace = host.path().display().to_string();
    let cell = daemon.create(&unique("files"), json!({ "workspace": workspace }));
    let files = |op: &str, query: &str| format!("/v1/cells/{cell}/files/{op}?path={query}");

    // Read what the host put there; write, list, stat, move, remove.
    let read = daemon.request("GET", &files("content", "readme.txt"), None);
    assert_eq!(
        (read.status, read.body.as_slice()),
        (200, &b"from the host\n"[..])
    );
    assert_eq!(
        daemon
            .call(
                "POST",
                &format!("/v1/cells/{cell}/files/mkdir"),
                Some(json!({"path": "notes/deep"}))
            )
            .status,
        204
    );
    let write = daemon.request(
        "PUT",
        &files("content", "notes/a.txt"),
        Some("hello\u{0}bytes"),
    );
    assert_eq!(
        write.status,
        204,
        "{}",
        String::from_utf8_lossy(&write.body)
    );
    assert_eq!(
        daemon
            .request("GET", &files("content", "notes/a.txt"), None)
            .body,
        b"hello\0bytes"
    );
    let list = daemon.call("GET", &files("list", "notes"), None).json();
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a.txt", "deep"]);
    let stat = daemon
        .call("GET", &files("stat", "notes/a.txt"), None)
        .json();
    assert_eq!(
        (stat["kind"].as_str(), stat["size"].as_u64()),
        (Some("file"), Some(11))
    );
    let moved = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/files/move"),
        Some(json!({"from": "notes/a.txt", "to": "notes/b.txt"})),
    );
    assert_eq!(
        moved.status,
        204,
        "{}",
        String::from_utf8_lossy(&moved.body)
    );
    assert_eq!(
        daemon
            .request("GET", &files("content", "notes/a.txt"), None)
            .status,
        404
    );
    assert_eq!(
        daemon
            .call(
                "POST",
                &format!("/v1/cells/{cell}/files/remove"),
                Some(json!({"path": "notes", "recursive": true}))
            )
            .status,
        204
    );
    assert_eq!(
        daemon.call("GET", &files("stat", "notes"), None).status,
        404
    );

    // The cell sees what the API wrote, and the host directory is untouched (copy-on-write).
    daemon.request("PUT", &files("content", "made-by-api"), Some("x"));
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "/workspace/made-by-api"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"x");
    assert!(!host.path().join("made-by-api").exists());

    // Escapes: `..`, absolute paths, and symlinks (from the host or made in the cell) that
    // point out of the files root are refused with 400 before anything is done.
    daemon.exec(
        &cell,
        json!({ "argv": ["ln", "-s", "/etc", "/workspace/etc-link"] }),
    );
    let passwd_before = std::fs::read("/etc/passwd").unwrap();
    for (method, url, body) in [
        ("GET", files("content", "../../etc/passwd"), None),
        ("GET", files("content", "/etc/passwd"), None),
        ("GET", files("content", "escape"), None),
        ("PUT", files("content", "etc-link/passwd"), Some("owned")),
        ("PUT", files("content", "escape"), Some("owned")),
        ("GET", files("archive", "etc-link"), None),
    ] {
        let answer = daemon.request(method, &url, body);
        assert_eq!(
            answer.status,
            400,
            "{method} {url}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        let message = answer.json()["error"].as_str().unwrap().to_owned();
        assert!(
            message.contains("outside") || message.contains("..") || message.contains("absolute"),
            "{message}"
        );
    }
    assert_eq!(std::fs::read("/etc/passwd").unwrap(), passwd_before);

    // Archives: upload unpacks (members with `..` are refused by tar in the cell), download packs.
    let staging = tempdir();
    std::fs::create_dir(staging.path().join("sub")).unwrap();
    std::fs::write(staging.path().join("sub/ok.txt"), "fine\n").unwrap();
    std::fs::write(staging.path().join("evil"), "evil\n").unwrap();
    let tar = staging.path().join("x.tar");
    let made = std::process::Command::new("tar")
        .args([
            "-C",
            &staging.path().join("sub").display().to_string(),
            "-cPf",
            &tar.display().to_string(),
            "ok.txt",
            "../evil",
        ])
        .status()
        .unwrap();
    assert!(made.success());
    let bytes = std::fs::read(&tar).unwrap();
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    use std::io::Write as _;
    let head = format!(
        "PUT {} HTTP/1.1\r\nHost: w\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        files("archive", "unpacked"),
        bytes.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&bytes).unwrap();
    let mut raw = Vec::new();
    use std::io::Read as _;
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.starts_with("HTTP/1.1 400"),
        "tar refuses the `..` member: {text}"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", "cat /workspace/unpacked/ok.txt; ls /workspace/evil /evil 2>&1 | wc -l"] }));
    let out = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(out.starts_with("fine\n"), "{out}");
    assert!(!host.path().join("evil").exists() && !staging.path().join("sub/evil").exists());
    let archive = daemon.request("GET", &files("archive", "unpacked"), None);
    assert_eq!(archive.status, 200);
    let listed = std::process::Command::new("tar")
        .arg("-t")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    listed
        .stdin
        .as_ref()
        .unwrap()
        .write_all(&archive.body)
        .unwrap();
    let listed = listed.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&listed.stdout).contains("./ok.txt"));

    // Deleting the cell journals what it changed in its workspace, then every change is there.
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{cell}"), None)
            .status,
        204
    );
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let changes: Value = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["kind"] == "workspace.changes")
        .expect("workspace.changes journaled");
    let paths: Vec<&str> = changes["data"]["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"made-by-api") && paths.contains(&"unpacked/ok.txt"),
        "{paths:?}"
    );
    assert_has_kinds(
        &journal,
        &[
            "file.write",
            "file.mkdir",
            "file.move",
            "file.remove",
            "file.upload",
            "file.read",
        ],
    );
}

#[test]
fn snapshot_reset_fork_policy_and_events_over_the_api() {
    if !cgroups_available("daemon_workspace") {
        return;
    }
    let (port, _hits) = upstream();
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("a.txt"), "v1\n").unwrap();
    let allow =
        format!("version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n");
    let cell = daemon.create(
        &unique("ws"),
        json!({ "workspace": host.path().display().to_string(), "policy": allow }),
    );
    // The events stream: journal entries as they are written.
    let socket = daemon.socket();
    let watched = cell.clone();
    let stream_thread = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        write!(
            stream,
            "GET /v1/events?cell={watched} HTTP/1.1\r\nHost: w\r\n\r\n"
        )
        .unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 4096];
        while !seen.contains("workspace.reset") {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        seen
    });
    std::thread::sleep(Duration::from_millis(300));
    let sh = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        String::from_utf8(stream_bytes(&events, "stdout")).unwrap()
    };
    sh("echo v2 > /workspace/a.txt");
    let snap = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({ "as": "s1" })),
    );
    assert_eq!(snap.status, 201, "{}", String::from_utf8_lossy(&snap.body));
    assert_eq!(snap.json()["id"], format!("{cell}@s1"));
    sh("echo v3 > /workspace/a.txt");
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": "s1" })),
    );
    assert_eq!(
        reset.status,
        200,
        "{}",
        String::from_utf8_lossy(&reset.body)
    );
    assert_eq!(sh("cat /workspace/a.txt"), "v2\n");
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/reset"), Some(json!({})))
            .status,
        200
    );
    assert_eq!(sh("cat /workspace/a.txt"), "v1\n");
    assert_eq!(
        std::fs::read_to_string(host.path().join("a.txt")).unwrap(),
        "v1\n"
    );
    let listed = daemon
        .call("GET", &format!("/v1/cells/{cell}/snapshots"), None)
        .json();
    assert_eq!(listed[0]["id"], format!("{cell}@s1"));

    // A fork from the snapshot sees the snapshot, not the parent's present.
    let fork = daemon.create(&unique("fork"), json!({ "from": format!("{cell}@s1") }));
    let events = daemon.exec(&fork, json!({ "argv": ["cat", "/workspace/a.txt"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"v2\n");

    // Policy: read it back, then replace the network rules of the running cell.
    let policy = daemon
        .call("GET", &format!("/v1/cells/{cell}/policy"), None)
        .json();
    assert!(policy["policy"].as_str().unwrap().contains("127.0.0.2"));
    let fetch = format!(
        "import urllib.request, urllib.error\n\
         try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/').status)\n\
         except urllib.error.HTTPError as e:\n    print(e.code)"
    );
    let run = |d: &Daemon| {
        let events = d.exec(&cell, json!({ "argv": ["python3", "-c", fetch] }));
        String::from_utf8(stream_bytes(&events, "stdout"))
            .unwrap()
            .trim()
            .to_owned()
    };
    assert_eq!(run(&daemon), "200");
    let replaced = daemon.call(
        "PUT",
        &format!("/v1/cells/{cell}/policy"),
        Some(json!({ "policy": "version: 1\nnetwork:\n  default: deny\n  allow:\n    - host: example.invalid\n" })),
    );
    assert_eq!(
        replaced.status,
        200,
        "{}",
        String::from_utf8_lossy(&replaced.body)
    );
    assert_eq!(run(&daemon), "403");

    let seen = stream_thread.join().unwrap();
    assert_has_kinds(
        &seen,
        &[
            "workspace.snapshot",
            "exec.start",
            "exec.exit",
            "workspace.reset",
        ],
    );
}

#[test]
fn a_terminal_in_the_cell_with_input_and_resize_from_outside() {
    if !cgroups_available("daemon_pty") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("pty"), json!({}));
    // A foreground process on a terminal of the cell's own devpts.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "tty; stty size; test -t 0 && echo interactive"], "tty": { "rows": 24, "cols": 80 } }),
    );
    let out = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(out.contains("/dev/pts/0"), "{out}");
    assert!(
        out.contains("24 80") && out.contains("interactive"),
        "{out}"
    );

    // In the background: typed input reaches it, and a resize from outside is seen inside.
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "read line; echo got:$line; stty size"], "tty": { "rows": 10, "cols": 20 }, "background": true })),
    );
    assert_eq!(
        started.status,
        201,
        "{}",
        String::from_utf8_lossy(&started.body)
    );
    let id = started.json()["id"].as_u64().unwrap();
    let resized = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/resize"),
        Some(json!({ "rows": 40, "cols": 100 })),
    );
    assert_eq!(
        resized.status,
        204,
        "{}",
        String::from_utf8_lossy(&resized.body)
    );
    daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/stdin"),
        Some(json!({ "data": "hello\n" })),
    );
    let exit = daemon
        .call(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/wait"),
            None,
        )
        .json();
    assert_eq!(exit["code"], 0, "{exit}");
    let out = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/output"),
        None,
    );
    let text = String::from_utf8(stream_bytes(&out.events(), "stdout")).unwrap();
    assert!(text.contains("got:hello"), "{text}");
    assert!(text.contains("40 100"), "{text}");
    // A process without a terminal cannot be resized.
    let plain = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "5"], "background": true })),
    );
    let plain_id = plain.json()["id"].as_u64().unwrap();
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{plain_id}/resize"),
        Some(json!({ "rows": 1, "cols": 1 })),
    );
    assert_eq!(refused.status, 409);
}

#[test]
fn fuzzed_api_input_gets_4xx_answers_and_leaves_the_daemon_well() {
    if !cgroups_available("daemon_fuzz") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("fuzz"), json!({}));
    let canary = tempdir();
    std::fs::write(canary.path().join("canary"), "untouched").unwrap();
    // A small deterministic generator: the same inputs on every run.
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let canary_path = canary.path().join("canary").display().to_string();
    let segments = [
        cell.as_str(),
        "..",
        "%2e%2e",
        "nope",
        "",
        "a/b",
        "%00",
        "\u{202e}x",
        "0",
        "-1",
        "18446744073709551616",
        &canary_path,
        "processes",
        "files",
        "exec",
    ];
    let tails = [
        "",
        "/exec",
        "/pause",
        "/resume",
        "/processes",
        "/processes/1",
        "/processes/1/stdin",
        "/processes/abc/signal",
        "/files/content?path=",
        "/files/content?path=../../etc/passwd",
        "/files/list?path=%2Fetc",
        "/files/mkdir",
        "/files/move",
        "/snapshot",
        "/reset",
        "/policy",
        "/files/content?path=x&bogus=1",
        "/processes/1/output?from=-3",
    ];
    let bodies = [
        "",
        "{",
        "}",
        "null",
        "[]",
        "\"x\"",
        "{\"argv\": null}",
        "{\"argv\": [1, 2]}",
        "{\"argv\": [\"sh\"], \"timeout_ms\": -5}",
        "{\"name\": 7}",
        "{\"path\": {\"a\": 1}}",
        "{\"from\": \"..\", \"to\": \"/etc\"}",
        "{\"policy\": \"version: 2\"}",
        "\u{0}\u{1}\u{2}",
        "{\"argv\": [\"true\"], \"env\": {\"\": \"x\"}}",
        "{\"signal\": 99999}",
        "{\"decision\": \"maybe\"}",
        "{\"rows\": 0, \"cols\": 0}",
    ];
    let methods = ["GET", "POST", "PUT", "DELETE", "PATCH"];
    for round in 0..300 {
        let method = methods[(next() % methods.len() as u64) as usize];
        let path = match next() % 3 {
            0 => format!(
                "/v1/cells/{}{}",
                segments[(next() % segments.len() as u64) as usize],
                tails[(next() % tails.len() as u64) as usize]
            ),
            1 => format!(
                "/v1/approvals/{}/{}",
                segments[(next() % segments.len() as u64) as usize],
                next() % 5
            ),
            _ => format!(
                "/v1/{}",
                segments[(next() % segments.len() as u64) as usize]
            ),
        };
        let mut body = bodies[(next() % bodies.len() as u64) as usize].to_owned();
        if next() % 5 == 0 {
            // Random bytes, cut to valid UTF-8 for the request line's sake.
            body = (0..(next() % 200))
                .map(|_| char::from((next() % 95 + 32) as u8))
                .collect();
        }
        let answer = daemon.request(method, &path, Some(&body));
        assert!(
            answer.status < 500,
            "round {round}: {method} {path} {body:?} -> {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
        if answer.status >= 400 {
            let value: Value = serde_json::from_slice(&answer.body).unwrap_or_else(|_| {
                panic!(
                    "round {round}: {method} {path}: a non-JSON error: {}",
                    String::from_utf8_lossy(&answer.body)
                )
            });
            assert!(
                !value["error"].as_str().unwrap_or_default().is_empty(),
                "round {round}: {value}"
            );
        }
    }
    assert_eq!(
        std::fs::read_to_string(canary.path().join("canary")).unwrap(),
        "untouched"
    );
    assert_eq!(daemon.call("GET", "/v1/health", None).status, 200);
    daemon.assert_journal_verifies();
}

#[test]
fn warden_run_goes_through_a_running_daemon_with_the_same_behaviour() {
    if !cgroups_available("daemon_run") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let dir = tempdir();
    let run = |extra: &[&str], input: Option<&str>| {
        let mut cmd = daemon.warden();
        cmd.arg("run").args(extra);
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if input.is_some() {
            cmd.stdin(std::process::Stdio::piped());
        }
        let mut child = cmd.spawn().unwrap();
        if let Some(text) = input {
            use std::io::Write as _;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
        }
        Ran::from(child.wait_with_output().unwrap())
    };
    let ran = run(&["--", "sh", "-c", "echo out; echo err >&2; exit 3"], None);
    assert_eq!(
        (ran.code, ran.stdout.as_str(), ran.stderr.as_str()),
        (3, "out\n", "err\n"),
        "{ran:?}"
    );
    let ran = run(&["--", "tr", "a-z", "A-Z"], Some("through the daemon\n"));
    assert_eq!(ran.stdout, "THROUGH THE DAEMON\n", "{ran:?}");
    let ran = run(&["--", "no-such-command"], None);
    assert_eq!(ran.code, 127, "{ran:?}");
    assert!(ran.stderr.contains("command not found"), "{ran:?}");

    // Ctrl-C reaches the command, not the client.
    let mut child = daemon
        .warden()
        .args([
            "run",
            "--",
            "sh",
            "-c",
            "trap 'echo got-int; exit 9' INT; echo ready; sleep 30 & wait",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "ready\n");
    std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert_eq!(rest, "got-int\n");
    assert_eq!(child.wait().unwrap().code(), Some(9));

    // The limits end the command with the same statuses and messages.
    let limits = policy(
        dir.path(),
        "version: 1\nlimits:\n  wall: 1s\n  output: 1KiB\n  memory: 64MiB\n",
    );
    let limits = limits.to_str().unwrap();
    let ran = run(&["--policy", limits, "--", "sleep", "30"], None);
    assert_eq!(ran.code, 124, "{ran:?}");
    assert!(
        ran.stderr.contains("wall-clock limit 1s exceeded: killed"),
        "{ran:?}"
    );
    let ran = run(
        &[
            "--policy",
            limits,
            "--",
            "sh",
            "-c",
            "while true; do echo xxxxxxxxxxxxxxxx; done",
        ],
        None,
    );
    assert_eq!(ran.code, 252, "{ran:?}");
    let ran = run(
        &[
            "--policy",
            limits,
            "--",
            "python3",
            "-c",
            "x = []\nwhile True: x.append(bytearray(8 << 20))",
        ],
        None,
    );
    assert_eq!(ran.code, 251, "{ran:?}");
    assert!(
        ran.stderr.contains("memory limit 64 MiB exceeded: killed"),
        "{ran:?}"
    );

    // Workspace changes wait for review, as with an in-process run.
    let host = tempdir();
    let name = unique("viad");
    let ran = run(
        &[
            "--name",
            &name,
            "-w",
            host.path().to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "echo new > /workspace/f",
        ],
        None,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(
        ran.stderr.contains(&format!("warden diff {name}")),
        "{ran:?}"
    );
    assert!(!host.path().join("f").exists());
    let diff = daemon
        .warden()
        .args(["diff", &name, "--stat"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&diff.stdout).contains("A f"));
    // The runs are in the daemon's journal; the cells without changes are gone from its list.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(journal.contains(r#""argv":["tr","a-z","A-Z"]"#));
    let cells = daemon.call("GET", "/v1/cells", None).json();
    let names: Vec<&str> = cells
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [name.as_str()],
        "only the cell with changes to review is kept"
    );
    let rm = daemon.warden().args(["rm", &name]).output().unwrap();
    assert!(rm.status.success());
    assert_eq!(daemon.call("GET", "/v1/cells", None).json(), json!([]));
}

#[test]
fn commands_held_by_an_ask_rule_run_after_approve_and_are_refused_after_deny_or_timeout() {
    if !cgroups_available("daemon_exec_ask") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let policy = "version: 1\ncommands:\n  deny: [\"rm -rf *\"]\n  ask: [\"echo push*\"]\napprovals:\n  timeout: 2s\n";
    let cell = daemon.create(&unique("cmdask"), json!({ "policy": policy }));
    // Refused outright by a deny rule.
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["rm", "-rf", "/tmp/x"] })),
    );
    assert_eq!(refused.status, 403);
    assert!(
        refused.json()["error"]
            .as_str()
            .unwrap()
            .contains("rm -rf *")
    );
    // Held: the request waits for the answer.
    let ask = |words: &'static str| {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            let argv: Vec<&str> = words.split(' ').collect();
            daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/exec"),
                Some(json!({ "argv": argv })),
            )
        })
    };
    let question = |request: &str| -> u64 {
        for _ in 0..200 {
            let list = daemon.call("GET", "/v1/approvals", None).json();
            if let Some(q) = list
                .as_array()
                .unwrap()
                .iter()
                .find(|q| q["request"] == request)
            {
                return q["id"].as_u64().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("no question `{request}`");
    };
    let held = ask("echo push one");
    let id = question("exec echo push one");
    std::thread::sleep(Duration::from_millis(200));
    assert!(!held.is_finished(), "the exec waits for its answer");
    let answered = daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "approve" })),
    );
    assert_eq!(answered.status, 204);
    let ran = held.join().unwrap();
    assert_eq!(ran.status, 200);
    assert_eq!(stream_bytes(&ran.events(), "stdout"), b"push one\n");

    let held = ask("echo push two");
    let id = question("exec echo push two");
    daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "deny" })),
    );
    let ran = held.join().unwrap();
    assert_eq!(ran.status, 403);
    assert!(ran.json()["error"].as_str().unwrap().contains("refused"));

    let held = ask("echo push three");
    question("exec echo push three");
    let ran = held.join().unwrap();
    assert_eq!(ran.status, 403, "the policy's timeout (2 s) denies");
    assert!(
        ran.json()["error"]
            .as_str()
            .unwrap()
            .contains("nobody answered")
    );

    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let entries: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds = |kind: &str| entries.iter().filter(|e| e["kind"] == kind).count();
    assert_eq!(
        (
            kinds("approval.ask"),
            kinds("approval.answer"),
            kinds("approval.timeout"),
            kinds("exec.denied")
        ),
        (3, 2, 1, 1)
    );
    let answer = entries
        .iter()
        .find(|e| e["kind"] == "approval.answer")
        .unwrap();
    assert!(
        answer["data"]["by"]
            .as_str()
            .unwrap()
            .contains("unix socket"),
        "{answer}"
    );
    // Only the approved command ran.
    assert_eq!(
        entries.iter().filter(|e| e["kind"] == "exec.start").count(),
        1
    );
}

#[test]
fn credential_secrets_never_reach_the_journal() {
    if !cgroups_available("daemon_redaction") {
        return;
    }
    let secret = format!("s3cr3t-{}-value", std::process::id());
    let daemon = Daemon::start_with(&[], &[("WARDEN_TEST_JOURNAL_TOKEN", secret.as_str())]);
    let policy = "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [9]\n      credential: api\ncredentials:\n  api: { from_env: WARDEN_TEST_JOURNAL_TOKEN }\n";
    let cell = daemon.create(&unique("redact"), json!({ "policy": policy }));
    // The cell sees a placeholder, not the secret.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "printf %s \"$WARDEN_TEST_JOURNAL_TOKEN\""] }),
    );
    let seen = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(
        !seen.is_empty() && seen != secret,
        "the cell has a placeholder: {seen}"
    );
    // A client that passes the secret itself (in argv, so in the output too) is answered, but
    // the journal never holds it.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["echo", format!("token={secret}")] }),
    );
    assert_eq!(
        stream_bytes(&events, "stdout"),
        format!("token={secret}\n").as_bytes()
    );
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(!journal.contains(&secret), "the secret is in the journal");
    assert!(journal.contains("token=[redacted]"));
    daemon.assert_journal_verifies();
}

#[test]
fn diff_and_apply_over_the_api_with_apply_held_for_a_person() {
    if !cgroups_available("daemon_apply") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    std::fs::write(host.path().join("kept.txt"), "old\n").unwrap();
    let cell = daemon.create(
        &unique("apply"),
        json!({ "workspace": host.path().display().to_string(), "policy": "version: 1\napprovals:\n  timeout: 10s\n  apply: ask\n" }),
    );
    daemon.exec(&cell, json!({ "argv": ["sh", "-c", "echo new > /workspace/kept.txt; echo made > /workspace/made.txt"] }));
    let diff = daemon
        .call("GET", &format!("/v1/cells/{cell}/diff"), None)
        .json();
    let mut paths: Vec<&str> = diff["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    paths.sort();
    assert_eq!(paths, ["kept.txt", "made.txt"]);
    // A dry run says what would happen and needs nobody.
    let dry = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/apply"),
        Some(json!({ "dry_run": true, "paths": ["made.txt"] })),
    );
    assert_eq!(dry.status, 200, "{}", String::from_utf8_lossy(&dry.body));
    assert_eq!(dry.json()["applied"], json!(["made.txt"]));
    assert!(!host.path().join("made.txt").exists());
    // The real apply waits for a person.
    let applying = {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/apply"),
                Some(json!({ "paths": ["made.txt"] })),
            )
        })
    };
    let mut id = None;
    for _ in 0..200 {
        let list = daemon.call("GET", "/v1/approvals", None).json();
        if let Some(q) = list
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["request"].as_str().unwrap().starts_with("apply made.txt"))
        {
            id = q["id"].as_u64();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let id = id.expect("the apply asks");
    assert!(
        !host.path().join("made.txt").exists(),
        "nothing is applied before the answer"
    );
    daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "approve" })),
    );
    let applied = applying.join().unwrap();
    assert_eq!(
        applied.status,
        200,
        "{}",
        String::from_utf8_lossy(&applied.body)
    );
    assert_eq!(
        std::fs::read_to_string(host.path().join("made.txt")).unwrap(),
        "made\n"
    );
    assert_eq!(
        std::fs::read_to_string(host.path().join("kept.txt")).unwrap(),
        "old\n",
        "only the chosen path"
    );
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert_has_kinds(
        &journal,
        &["workspace.apply", "approval.answer", "workspace.applied"],
    );
}

#[test]
fn a_process_attached_over_a_websocket_takes_input_resize_and_streams_its_terminal() {
    if !cgroups_available("daemon_websocket") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("ws"), json!({}));
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo ready; read line; echo got:$line; stty size"], "tty": { "rows": 24, "cols": 80 }, "background": true })),
    );
    assert_eq!(started.status, 201);
    let id = started.json()["id"].as_u64().unwrap();
    let stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let url = format!("ws://warden/v1/cells/{cell}/processes/{id}/attach");
    let (mut socket, _) =
        tungstenite::client::client(url.as_str(), stream).expect("the upgrade succeeds");
    let mut output = String::new();
    let mut sent = false;
    let exit = loop {
        let message = socket.read().expect("a message before the end");
        let tungstenite::Message::Text(text) = message else {
            continue;
        };
        let event: Value = serde_json::from_str(text.as_str()).unwrap();
        match event["event"].as_str().unwrap() {
            "stdout" => output.push_str(event["text"].as_str().unwrap_or_default()),
            "exit" => break event,
            other => panic!("unexpected {other}: {event}"),
        }
        if !sent && output.contains("ready") {
            sent = true;
            for message in [
                json!({ "resize": { "rows": 50, "cols": 132 } }),
                json!({ "stdin": "over the socket\n" }),
            ] {
                socket
                    .send(tungstenite::Message::Text(message.to_string().into()))
                    .unwrap();
            }
        }
    };
    assert_eq!(exit["code"], 0, "{exit}");
    assert!(output.contains("got:over the socket"), "{output}");
    assert!(output.contains("50 132"), "{output}");
    // Input and the resize went through the journal like any other request.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        journal.contains("\"kind\":\"exec.resize\"") && journal.contains("\"kind\":\"exec.stdin\"")
    );
}

#[test]
fn ended_processes_leave_no_descriptors_or_threads_behind() {
    if !cgroups_available("daemon_release") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("release"), json!({}));
    let init: u32 = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json()["pid"]
        .as_u64()
        .unwrap() as u32;
    let stat = std::fs::read_to_string(format!("/proc/{init}/stat")).unwrap();
    let keeper: u32 = stat[stat.rfind(')').unwrap() + 2..]
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let count = |dir: String| std::fs::read_dir(dir).unwrap().count();
    let daemon_fds = || count(format!("/proc/{}/fd", daemon.pid().unwrap()));
    let keeper_threads = || count(format!("/proc/{keeper}/task"));
    for _ in 0..3 {
        daemon.exec(&cell, json!({ "argv": ["true"] }));
    }
    std::thread::sleep(Duration::from_millis(200));
    let (fds_before, threads_before) = (daemon_fds(), keeper_threads());
    for i in 0..40 {
        let events = daemon.exec(&cell, json!({ "argv": ["echo", i.to_string()], "tty": if i % 2 == 0 { json!({"rows": 5, "cols": 20}) } else { Value::Null } }));
        assert_eq!(exit_of(&events)["code"], 0);
    }
    std::thread::sleep(Duration::from_millis(300));
    let (fds_after, threads_after) = (daemon_fds(), keeper_threads());
    assert!(
        fds_after <= fds_before + 4,
        "the daemon kept descriptors: {fds_before} -> {fds_after}"
    );
    assert!(
        threads_after <= threads_before + 2,
        "the keeper kept threads: {threads_before} -> {threads_after}"
    );
}

#[test]
fn exec_finds_programs_in_the_process_path_and_starts_them_clean() {
    if !cgroups_available("daemon_spawn") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("spawn"), json!({}));
    let out = |spec: Value| {
        let events = daemon.exec(&cell, spec);
        (
            String::from_utf8(stream_bytes(&events, "stdout")).unwrap(),
            exit_of(&events),
        )
    };
    // No blocked signals, none ignored that a program could care about, whatever the init
    // blocks for itself.
    let (status, exit) =
        out(json!({ "argv": ["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"] }));
    assert_eq!(exit["code"], 0, "{exit}");
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
    };
    assert_eq!(field("SigBlk:"), 0, "{status}");
    // SIGHUP..SIGTERM and SIGPIPE (bits 0-14) are at their defaults.
    assert_eq!(field("SigIgn:") & 0x7fff, 0, "{status}");
    // Nothing but its stdio is open in it: not the client's socket, not the init's channel.
    let (fds, _) = out(json!({ "argv": ["sh", "-c", "ls /proc/$$/fd"] }));
    assert_eq!(fds.split_whitespace().collect::<Vec<_>>(), ["0", "1", "2"]);
    // argv[0] stays as given; the process leads a group of its own.
    let (text, _) = out(json!({ "argv": ["sh", "-c", "echo $0; ps -o pgid= -p $$; echo $$"] }));
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    assert_eq!(lines[0], "sh", "{text}");
    assert_eq!(lines[1], lines[2], "not a group leader: {text}");
    // The PATH searched is the process's own: a program in a directory it names is found, and
    // without a PATH entry that has it, nothing is.
    out(
        json!({ "argv": ["sh", "-c", "mkdir -p /tmp/bin && printf '#!/bin/sh\\necho mine $0\\n' > /tmp/bin/mine && chmod +x /tmp/bin/mine"] }),
    );
    let (text, exit) =
        out(json!({ "argv": ["mine"], "env": { "PATH": "/tmp/bin:/usr/bin:/bin" } }));
    assert_eq!(
        (text.as_str(), exit["code"].as_i64()),
        ("mine /tmp/bin/mine\n", Some(0))
    );
    // A relative entry is relative to the process's working directory.
    let (text, _) = out(json!({ "argv": ["mine"], "cwd": "/tmp", "env": { "PATH": "bin" } }));
    assert_eq!(text, "mine bin/mine\n");
    let (_, exit) = out(json!({ "argv": ["mine"] }));
    assert_eq!(exit["code"], 127, "{exit}");
    let (_, exit) = out(json!({ "argv": ["true"], "env": { "PATH": "/nowhere" } }));
    assert_eq!(exit["code"], 127, "{exit}");
    // A background exec that could not start is a process like any other: looked up, read.
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["nosuch"], "background": true })),
    );
    assert_eq!(started.status, 201);
    let id = started.json()["id"].as_u64().unwrap();
    let info = daemon.call("GET", &format!("/v1/cells/{cell}/processes/{id}"), None);
    assert_eq!(info.status, 200);
    assert_eq!(info.json()["exit"]["code"], 127);
    let output = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/output"),
        None,
    );
    assert_eq!(exit_of(&output.events())["reason"], "failed");
    // A file that is not executable is found and refused as such.
    out(json!({ "argv": ["sh", "-c", "printf 'echo no\\n' > /tmp/bin/plain"] }));
    let (_, exit) = out(json!({ "argv": ["plain"], "env": { "PATH": "/tmp/bin" } }));
    assert_eq!(exit["code"], 126, "{exit}");
    assert!(
        exit["message"]
            .as_str()
            .unwrap()
            .contains("permission denied"),
        "{exit}"
    );
}

#[test]
fn the_journal_rotates_into_segments_that_verify_replay_and_export_read_as_one() {
    if !cgroups_available("daemon_rotate") {
        return;
    }
    let mut daemon = Daemon::start(&["--journal-segment-mib", "1"]);
    let cell = daemon.create(&unique("rotate"), json!({}));
    // Kept output goes into the journal (64 KiB of each stream per exec): 2.5 MiB in 20 execs.
    for i in 0..20 {
        let events = daemon.exec(
            &cell,
            json!({ "argv": ["sh", "-c", format!("echo start {i}; head -c 98304 /dev/zero | base64 -w 0; head -c 98304 /dev/zero | base64 -w 0 >&2")] }),
        );
        assert_eq!(exit_of(&events)["code"], 0);
    }
    // A crash and a restart on the way do not break the chain across segments.
    daemon.crash();
    daemon.restart();
    daemon.exec(&cell, json!({ "argv": ["echo", "after"] }));
    let dir = daemon.journal().parent().unwrap().to_path_buf();
    let closed: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.starts_with("journal-").then_some(name)
        })
        .collect();
    assert!(closed.len() >= 2, "no rotation: {closed:?}");
    let verify = daemon.warden().args(["audit", "verify"]).output().unwrap();
    let said = String::from_utf8_lossy(&verify.stdout);
    assert!(verify.status.success(), "{said}");
    assert!(
        said.contains(&format!("in {} segment(s)", closed.len() + 1)),
        "{said}"
    );
    // The timeline of the cell spans every segment, in order.
    let replay = daemon
        .warden()
        .args(["replay", &cell, "--json"])
        .output()
        .unwrap();
    let lines = String::from_utf8_lossy(&replay.stdout);
    let seqs: Vec<u64> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let starts = lines
        .lines()
        .filter(|l| l.contains("\"exec.start\""))
        .count();
    assert_eq!(starts, 21, "{lines}");
    // A closed segment changed by one byte is caught and named.
    let first = dir.join(closed.iter().min().unwrap());
    let mut bytes = std::fs::read(&first).unwrap();
    let at = bytes.len() / 2;
    bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
    std::fs::write(&first, bytes).unwrap();
    let verify = daemon.warden().args(["audit", "verify"]).output().unwrap();
    let said = String::from_utf8_lossy(&verify.stdout);
    assert!(!verify.status.success(), "{said}");
    assert!(
        said.contains(closed.iter().min().unwrap().as_str()),
        "{said}"
    );
}

#[test]
fn the_daemon_takes_the_hard_limit_of_open_files_and_cells_get_their_policys() {
    if !cgroups_available("daemon_nofile") {
        return;
    }
    let limits = |pid: u32| -> (String, String) {
        let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap()
            .to_owned();
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields[3].to_owned(), fields[4].to_owned())
    };
    let (_, hard) = limits(std::process::id());
    // Started as many hosts start services: a soft limit of a few hundred.
    let daemon = Daemon::start_wrapped(&["prlimit", &format!("--nofile=256:{hard}"), "--"]);
    let (soft, daemon_hard) = limits(daemon.pid().unwrap());
    assert_eq!(
        (soft.as_str(), daemon_hard.as_str()),
        (hard.as_str(), hard.as_str())
    );
    // The keeper takes the soft limit back; the cell has its policy's `open_files`, soft and
    // hard, whatever the daemon has.
    let cell = daemon.create(
        &unique("nofile"),
        json!({ "policy": "version: 1\nlimits:\n  open_files: 300\n" }),
    );
    let init = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json()["pid"]
        .as_u64()
        .unwrap() as u32;
    assert_eq!(
        limits(init),
        ("300".to_owned(), "300".to_owned()),
        "the cell's init"
    );
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "ulimit -n; ulimit -Hn"] }),
    );
    assert_eq!(stream_bytes(&events, "stdout"), b"300\n300\n");
}

#[test]
fn a_replaced_policy_changes_the_command_rules_and_nothing_fixed() {
    if !cgroups_available("daemon_policy_commands") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let made =
        "version: 1\nlimits:\n  memory: 256MiB\n  pids: 64\ncommands:\n  deny: [\"rm -rf *\"]\n";
    let cell = daemon.create(&unique("cmdswap"), json!({ "policy": made }));
    let exec_status = |d: &Daemon, argv: &[&str]| {
        d.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": argv })),
        )
        .status
    };
    // A replacement, answered with its status (the body shown when it is not the one expected).
    let put = |d: &Daemon, policy: &str, expected: u16| {
        let answer = d.call(
            "PUT",
            &format!("/v1/cells/{cell}/policy"),
            Some(json!({ "policy": policy })),
        );
        assert_eq!(
            answer.status,
            expected,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        answer
    };
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/x"]), 200);
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 403);

    // Only the command rules: in force for the very next exec.
    let commands = "version: 1\ncommands:\n  deny: [\"touch *\"]\n";
    put(&daemon, commands, 200);
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/y"]), 403);
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 200);

    // A section fixed when the cell was made may be repeated as it is, not changed: the
    // refusal names it, and nothing of the document takes effect.
    let same_limits =
        "version: 1\nlimits:\n  memory: 256MiB\n  pids: 64\ncommands:\n  deny: [\"touch *\"]\n";
    put(&daemon, same_limits, 200);
    let changing =
        "version: 1\nlimits:\n  memory: 2GiB\nprocess:\n  user: 0\ncommands:\n  default: allow\n";
    let refused = put(&daemon, changing, 409);
    let message = refused.json()["error"].as_str().unwrap().to_owned();
    assert!(
        message.contains("this policy also changes `limits`, `process`, which are fixed"),
        "{message}"
    );
    assert_eq!(
        exec_status(&daemon, &["touch", "/tmp/y"]),
        403,
        "the refused document changed nothing"
    );

    // The record: the policy as made, and the replacement in force.
    let record = daemon
        .call("GET", &format!("/v1/cells/{cell}/policy"), None)
        .json();
    assert_eq!(record["policy"], made);
    assert_eq!(record["replaced"], same_limits);

    // A daemon that starts again finds the same rules in force.
    daemon.restart();
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/y"]), 403);
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 200);

    // `warden policy set` goes through the daemon that keeps the cell, so it is journaled and
    // the daemon's own decisions follow it.
    let dir = tempdir();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, "version: 1\ncommands:\n  deny: [\"rm *\"]\n").unwrap();
    let set = Ran::from(
        daemon
            .warden()
            .args(["policy", "set", &cell, file.to_str().unwrap()])
            .output()
            .unwrap(),
    );
    assert_eq!(set.code, 0, "{set:?}");
    assert!(set.stdout.contains("network and command rules"), "{set:?}");
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 403);
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/y"]), 200);
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert_eq!(journal.matches("\"kind\":\"policy.replaced\"").count(), 3);
    assert_eq!(journal.matches("\"kind\":\"policy.refused\"").count(), 1);
    let replay = Ran::from(daemon.warden().args(["replay", &cell]).output().unwrap());
    assert!(
        replay
            .stdout
            .contains("network and command rules replaced, 0 open connection(s) closed")
            && replay
                .stdout
                .contains("this policy also changes `limits`, `process`"),
        "{replay:?}"
    );
    daemon.assert_journal_verifies();
}

/// Threads of a host process, from its status file.
fn threads_of(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn a_file_the_cell_controls_cannot_freeze_the_harness() {
    if !cgroups_available("daemon_fifo") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let hostile = daemon.create(&unique("fifo"), json!({}));
    let other = daemon.create(&unique("other"), json!({}));
    daemon.exec(
        &hostile,
        json!({ "argv": ["sh", "-c", "mkfifo pipe && ln -s pipe link && mkdir d && mkfifo d/p && mkdir out && mkfifo out/x"] }),
    );
    let threads_before = threads_of(daemon.pid().unwrap());
    // 600 reads and writes of FIFOs at once (more than the runtime's blocking pool), each
    // client giving up after two seconds.
    let socket = daemon.socket();
    let askers: Vec<_> = (0..600)
        .map(|i| {
            let socket = socket.clone();
            let hostile = hostile.clone();
            std::thread::spawn(move || {
                let (method, path, body) = match i % 4 {
                    0 => ("GET", "content?path=pipe", ""),
                    1 => ("GET", "content?path=link", ""),
                    2 => ("PUT", "content?path=d/p", "data"),
                    _ => ("GET", "archive?path=out", ""),
                };
                let mut stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
                stream
                    .set_read_timeout(Some(Duration::from_secs(2)))
                    .unwrap();
                use std::io::{Read as _, Write as _};
                let _ = write!(
                    stream,
                    "{method} /v1/cells/{hostile}/files/{path} HTTP/1.1\r\nHost: w\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                let mut answer = Vec::new();
                let _ = stream.read_to_end(&mut answer);
                String::from_utf8_lossy(&answer).into_owned()
            })
        })
        .collect();
    // Meanwhile, the other cell is paused, resumed and killed, and each lands at once.
    std::thread::sleep(Duration::from_millis(300));
    let mut took = Vec::new();
    for action in ["pause", "resume", "kill"] {
        let begun = std::time::Instant::now();
        let answer = daemon.call("POST", &format!("/v1/cells/{other}/{action}"), None);
        took.push((action, begun.elapsed()));
        assert_eq!(
            answer.status,
            200,
            "{action}: {}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    let answers: Vec<String> = askers.into_iter().map(|t| t.join().unwrap()).collect();
    eprintln!("control of another cell during 600 FIFO requests: {took:?}");
    for (action, elapsed) in &took {
        assert!(
            *elapsed < Duration::from_secs(5),
            "{action} of another cell took {elapsed:?}"
        );
    }
    let refused = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 400") && a.contains("FIFO"))
        .count();
    let packed = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 200"))
        .count();
    assert_eq!(
        refused + packed,
        600,
        "some requests hung or failed otherwise: {:?}",
        answers
            .iter()
            .find(|a| !a.starts_with("HTTP/1.1 400") && !a.starts_with("HTTP/1.1 200"))
    );
    // The archive of a directory holding only a FIFO is an archive without it.
    assert_eq!(packed, 150);
    let threads_after = threads_of(daemon.pid().unwrap());
    assert!(
        threads_after <= threads_before + 16,
        "the daemon went from {threads_before} to {threads_after} threads"
    );

    // A helper frozen mid-transfer, whose client goes away, is killed once the cell runs again.
    daemon.exec(
        &hostile,
        json!({ "argv": ["dd", "if=/dev/zero", "of=big", "bs=1M", "count=48", "status=none"] }),
    );
    {
        use std::io::Write as _;
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        write!(
            stream,
            "GET /v1/cells/{hostile}/files/content?path=big HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(
            daemon
                .call("POST", &format!("/v1/cells/{hostile}/pause"), None)
                .status,
            200
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{hostile}/resume"), None)
            .status,
        200
    );
    std::thread::sleep(Duration::from_millis(500));
    let events = daemon.exec(
        &hostile,
        json!({ "argv": ["sh", "-c", "cat /proc/[0-9]*/comm | grep -c warden"] }),
    );
    assert_eq!(
        String::from_utf8(stream_bytes(&events, "stdout")).unwrap(),
        "1\n",
        "a file helper outlived its client (only the init should be left)"
    );
}

#[test]
fn strangers_cannot_take_the_daemon_down_or_make_it_forget_a_cell() {
    if !cgroups_available("daemon_strangers") {
        return;
    }
    // A host that starts services with few descriptors, and the API on TCP.
    let daemon = Daemon::start_wrapped_with(
        &["prlimit", "--nofile=400", "--"],
        &["--listen", "127.0.0.1:0"],
    );
    let cell = daemon.create(&unique("strangers"), json!({}));
    let runtime = daemon.socket().parent().unwrap().to_owned();
    let address: std::net::SocketAddr = read_file(&runtime.join("daemon.addr")).parse().unwrap();
    let token = read_file(&runtime.join("daemon.token"));
    // Thousands of strangers that connect and say nothing.
    let idle: Vec<std::net::TcpStream> = (0..1000)
        .filter_map(|_| std::net::TcpStream::connect(address).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // The owner still gets in, over TCP with the token and over the unix socket.
    let begun = std::time::Instant::now();
    let health = exchange(
        std::net::TcpStream::connect(address).unwrap(),
        "GET",
        "/v1/health",
        None,
        &[("Authorization", &format!("Bearer {token}"))],
    );
    let waited = begun.elapsed();
    assert_eq!(
        health.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&health.body)
    );
    let pid = daemon.pid().unwrap();
    let descriptors = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    eprintln!(
        "{} idle strangers connected; the owner waited {waited:?}; the daemon holds {descriptors} descriptors (limit 400)",
        idle.len()
    );
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(descriptors < 400, "{descriptors} descriptors");
    let info = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json();
    assert_eq!(info["state"], "running", "{info}");
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "still here"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"still here\n");
    drop(idle);
    // A slow stranger, once the crowd is gone: a head that never ends, a byte every two seconds.
    let slow = std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        stream.write_all(b"GET /v1/health HTTP/1.1\r\n").unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let begun = std::time::Instant::now();
        let mut byte = [0u8; 1];
        while begun.elapsed() < Duration::from_secs(60) {
            if stream.write_all(b"X").is_err() {
                break;
            }
            match stream.read(&mut byte) {
                Ok(0) => break,
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
        }
        begun.elapsed()
    });
    let slow_for = slow.join().unwrap();
    eprintln!("a head trickled byte by byte was cut after {slow_for:?}");
    assert!(
        slow_for >= Duration::from_secs(18) && slow_for < Duration::from_secs(30),
        "{slow_for:?}"
    );
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        !journal.contains("\"cell.end\"") && !journal.contains("\"cell.lost\""),
        "the cell was taken for ended"
    );
}

#[test]
fn an_apply_writes_what_was_reviewed_and_approved_or_nothing() {
    if !cgroups_available("daemon_apply_digest") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    let cell = daemon.create(
        &unique("digest"),
        json!({ "workspace": host.path().display().to_string(), "policy": "version: 1\napprovals:\n  timeout: 10s\n  apply: ask\n" }),
    );
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo reviewed > /workspace/a.txt"] }),
    );
    // Asked while the change is the reviewed one...
    let applying = {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            daemon.call("POST", &format!("/v1/cells/{cell}/apply"), Some(json!({})))
        })
    };
    let mut id = None;
    for _ in 0..200 {
        let list = daemon.call("GET", "/v1/approvals", None).json();
        if let Some(q) = list.as_array().unwrap().iter().find(|q| q["cell"] == cell) {
            id = q["id"].as_u64();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let id = id.expect("the apply asks");
    // ...then the cell swaps the content while the person reads the question.
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo EVIL > /workspace/a.txt"] }),
    );
    daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "approve" })),
    );
    let applied = applying.join().unwrap();
    assert_eq!(
        applied.status,
        409,
        "{}",
        String::from_utf8_lossy(&applied.body)
    );
    assert!(
        applied.json()["error"]
            .as_str()
            .unwrap()
            .contains("changed since it was reviewed"),
        "{}",
        String::from_utf8_lossy(&applied.body)
    );
    assert!(
        !host.path().join("a.txt").exists(),
        "the swapped content reached the host"
    );

    // The same from the CLI: `warden diff` prints the digest, `warden apply --digest` holds to
    // it, while the cell goes on writing.
    let project = tempdir();
    let name = unique("digest-cli");
    let mut running = warden()
        .args([
            "run",
            "--name",
            &name,
            "--workspace",
            &project.path().display().to_string(),
        ])
        .args([
            "--",
            "sh",
            "-c",
            "echo reviewed > b.txt; sleep 3; echo other > b.txt; sleep 60",
        ])
        .spawn()
        .unwrap();
    let mut diff = Ran::from(warden().args(["diff", &name]).output().unwrap());
    for _ in 0..100 {
        if diff.stdout.contains("digest ") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        diff = Ran::from(warden().args(["diff", &name]).output().unwrap());
    }
    assert!(diff.stdout.contains("+reviewed"), "{diff:?}");
    let digest = diff
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("digest "))
        .and_then(|l| l.split(':').next())
        .unwrap_or_else(|| panic!("{diff:?}"))
        .to_owned();
    let json = Ran::from(warden().args(["diff", &name, "--json"]).output().unwrap());
    assert_eq!(
        serde_json::from_str::<Value>(&json.stdout).unwrap()["digest"],
        digest
    );
    std::thread::sleep(Duration::from_secs(4));
    let refused = Ran::from(
        warden()
            .args(["apply", &name, "--digest", &digest])
            .output()
            .unwrap(),
    );
    assert_eq!(refused.code, 125, "{refused:?}");
    assert!(
        refused.stderr.contains("changed since it was reviewed"),
        "{refused:?}"
    );
    assert!(!project.path().join("b.txt").exists());
    assert!(warden().args(["kill", &name]).status().unwrap().success());
    let _ = running.wait();
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn a_cell_whose_tmp_fills_its_memory_ends_by_the_memory_limit() {
    if !cgroups_available("daemon_tmp_oom") {
        return;
    }
    let dir = tempdir();
    let daemon = Daemon::start(&[]);
    let policy = policy(
        dir.path(),
        "version: 1\nfilesystem:\n  tmp_size: 512MiB\nlimits:\n  memory: 64MiB\n",
    );
    // Through the daemon, as a `warden run`: files in /tmp are memory, and filling it past the
    // limit is the memory limit, not a kill by someone.
    let ran = Ran::from(
        daemon
            .warden()
            .args(["run", "--policy", policy.to_str().unwrap(), "--"])
            .args([
                "sh",
                "-c",
                "head -c 300000000 /dev/zero > /tmp/fill; echo survived",
            ])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 251, "{ran:?}");
    assert!(
        ran.stderr.contains("memory limit 64 MiB exceeded"),
        "{ran:?}"
    );
    assert!(!ran.stderr.contains("warden kill"), "{ran:?}");
    // Over the API, the exec and the cell say so too.
    let cell = daemon.create(&unique("tmpoom"), json!({ "policy": "version: 1\nfilesystem:\n  tmp_size: 512MiB\nlimits:\n  memory: 64MiB\n" }));
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "head -c 300000000 /dev/zero > /tmp/fill; sleep 5"] }),
    );
    let exit = exit_of(&events);
    assert_eq!(exit["reason"], "memory-limit", "{exit}");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let end = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["kind"] == "cell.end" && e["cell"] == cell.as_str());
    if let Some(end) = end {
        assert!(
            end["data"]["reason"]
                .as_str()
                .unwrap()
                .contains("memory limit"),
            "{end}"
        );
    }
}

#[test]
fn a_daemon_cell_writes_after_its_workspace_is_reset() {
    if !cgroups_available("daemon_reset_writes") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("readme.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("resetw"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo cell > readme.txt"] }),
    );
    let snap = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({"as": "s"})),
    );
    assert_eq!(snap.status, 201, "{}", String::from_utf8_lossy(&snap.body));
    for to in [json!({}), json!({ "to": "s" })] {
        let reset = daemon.call("POST", &format!("/v1/cells/{cell}/reset"), Some(to.clone()));
        assert!(
            reset.status < 300,
            "{to}: {}",
            String::from_utf8_lossy(&reset.body)
        );
        let events = daemon.exec(
            &cell,
            json!({ "argv": ["sh", "-c", "echo x >> readme.txt && echo y > new.txt && rm new.txt && mkdir d && rmdir d && cat readme.txt"] }),
        );
        let exit = exit_of(&events);
        assert_eq!(exit["code"], 0, "after a reset to {to}: {events:?}");
    }
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "readme.txt"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"cell\nx\n");
}

#[test]
fn each_gateway_decision_is_journaled_once_across_restarts() {
    if !cgroups_available("daemon_decisions_once") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let upstream = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = upstream.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in upstream.incoming().flatten() {
            use std::io::Write as _;
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
        }
    });
    let policy =
        format!("version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n");
    let cell = daemon.create(&unique("once"), json!({ "policy": policy }));
    let journaled = |daemon: &Daemon| {
        std::fs::read_to_string(daemon.journal())
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["kind"] == "net.decision" && e["cell"] == cell.as_str())
            .count()
    };
    let wait_for = |daemon: &Daemon, count: usize| {
        for _ in 0..200 {
            if journaled(daemon) >= count {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        journaled(daemon)
    };
    // Distinct requests, each a decision of its own.
    let request = |daemon: &Daemon, path: &str| {
        let script = format!(
            "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.2:{port}/{path}').read())"
        );
        daemon.exec(&cell, json!({ "argv": ["python3", "-c", script] }));
    };
    request(&daemon, "one");
    request(&daemon, "two");
    assert_eq!(wait_for(&daemon, 2), 2);
    // Restart twice (a crash, then a clean stop): nothing is journaled a second time, and what
    // comes after is journaled once.
    daemon.restart();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        journaled(&daemon),
        2,
        "decisions were journaled again after a crash"
    );
    request(&daemon, "three");
    assert_eq!(wait_for(&daemon, 3), 3);
    daemon.restart();
    std::thread::sleep(Duration::from_millis(500));
    request(&daemon, "four");
    assert_eq!(wait_for(&daemon, 4), 4);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(journaled(&daemon), 4, "a decision was journaled twice");
}

/// Reads a child's stderr on a thread; lines arrive on the channel as they are written.
fn stderr_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The id in the announcement `... warden approve CELL ID ...`, waiting for it (up to 20 s);
/// every line read is kept in `seen`.
fn announced_id(
    lines: &std::sync::mpsc::Receiver<String>,
    cell: &str,
    seen: &mut Vec<String>,
) -> u64 {
    let marker = format!("`warden approve {cell} ");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        let Ok(line) = lines.recv_timeout(left) else {
            break;
        };
        seen.push(line.clone());
        if let Some(at) = line.find(&marker) {
            let digits: String = line[at + marker.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            return digits.parse().unwrap();
        }
    }
    panic!("no question was announced on the terminal: {seen:?}");
}

#[test]
fn questions_are_announced_on_the_waiting_terminal_listed_for_all_cells_and_answered_by_id() {
    if !cgroups_available("daemon_questions_cli") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let policy = "version: 1\ncommands:\n  deny: [\"rm *\"]\n  ask: [\"echo push*\"]\napprovals:\n  timeout: 30s\n";
    let cell = daemon.create(&unique("qcli"), json!({ "policy": policy }));
    let exec = |words: &[&str]| {
        daemon
            .warden()
            .arg("exec")
            .arg(&cell)
            .arg("--")
            .args(words)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let cli = |args: &[&str]| daemon.warden().args(args).output().unwrap();

    // Held: `warden exec` says so, with the id and how to answer.
    let mut held = exec(&["echo", "push", "one"]);
    let lines = stderr_lines(&mut held);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &cell, &mut seen);
    assert!(seen.last().unwrap().contains("echo push one"), "{seen:?}");
    // `warden approvals` with no name lists every cell's questions, with that id.
    let all = cli(&["approvals"]);
    let listed = String::from_utf8_lossy(&all.stdout);
    assert!(all.status.success());
    assert!(
        listed.lines().any(|l| l.starts_with(cell.as_str())
            && l.split_whitespace().nth(1) == Some(id.to_string().as_str())
            && l.contains("exec echo push one")),
        "{listed}"
    );
    let one: Value = serde_json::from_slice(&cli(&["approvals", &cell, "--json"]).stdout).unwrap();
    assert_eq!(one.as_array().unwrap().len(), 1, "{one}");
    assert_eq!(one[0]["id"], id);
    let approve = cli(&["approve", &cell, &id.to_string()]);
    assert!(
        approve.status.success(),
        "{}",
        String::from_utf8_lossy(&approve.stderr)
    );
    let out = held.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, b"push one\n");

    // Denied by a person: its own exit status, and the words say so.
    let mut held = exec(&["echo", "push", "two"]);
    let lines = stderr_lines(&mut held);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &cell, &mut seen);
    let deny = cli(&["deny", &cell, &id.to_string()]);
    assert!(
        deny.status.success(),
        "{}",
        String::from_utf8_lossy(&deny.stderr)
    );
    let status = held.wait().unwrap();
    seen.extend(lines.iter());
    assert_eq!(
        status.code(),
        Some(warden_protocol::exit::REFUSED),
        "{seen:?}"
    );
    assert!(seen.iter().any(|l| l.contains("refused")), "{seen:?}");
    assert!(held.stdout.take().is_none_or(|mut o| {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut o, &mut text).unwrap();
        text.is_empty()
    }));
    // Refused by a rule: the same status, the rule named.
    let ruled = cli(&["exec", &cell, "--", "rm", "/tmp/x"]);
    assert_eq!(ruled.status.code(), Some(warden_protocol::exit::REFUSED));
    assert!(String::from_utf8_lossy(&ruled.stderr).contains("rm *"));
    // Nothing is left open.
    let empty: Value = serde_json::from_slice(&cli(&["approvals", "--json"]).stdout).unwrap();
    assert_eq!(empty, json!([]));
}

#[test]
fn a_network_question_keeps_its_id_across_a_restart_and_scope_cell_covers_the_host() {
    if !cgroups_available("daemon_questions_restart") {
        return;
    }
    let (port, hits) = upstream();
    let mut daemon = Daemon::start(&[]);
    let policy = format!(
        "version: 1\nnetwork:\n  ask:\n    - host: 127.0.0.2\n      ports: [{port}]\napprovals:\n  timeout: 60s\n"
    );
    let cell = daemon.create(&unique("qrestart"), json!({ "policy": policy }));
    let fetch = |daemon: &Daemon, path: &str| {
        let code = format!(
            "import urllib.request, urllib.error\n\
             try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/{path}').status)\n\
             except urllib.error.HTTPError as e:\n    print(e.code)"
        );
        daemon
            .warden()
            .args(["exec", &cell, "--", "python3", "-c", &code])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let open = |daemon: &Daemon| -> Vec<u64> {
        daemon
            .call("GET", "/v1/approvals", None)
            .json()
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["id"].as_u64().unwrap())
            .collect()
    };
    // Announced on the terminal that waits, for a connection as for a command.
    let mut held = fetch(&daemon, "zero");
    let lines = stderr_lines(&mut held);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &cell, &mut seen);
    assert!(
        seen.last()
            .unwrap()
            .contains(&format!("127.0.0.2:{port}/zero")),
        "{seen:?}"
    );
    assert_eq!(open(&daemon), vec![id]);
    assert!(
        daemon
            .warden()
            .args(["approve", &cell, &id.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let zero = held.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&zero.stdout).trim(), "200");
    // A question open while the daemon dies and comes back is the same question, by the same
    // id. (The process that waits is the daemon's background one: a terminal's stream ends with
    // the daemon.)
    let code =
        format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.2:{port}/first')");
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["python3", "-c", code], "background": true })),
    );
    assert_eq!(started.status, 201);
    let mut before = Vec::new();
    for _ in 0..200 {
        before = open(&daemon);
        if !before.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(before.len(), 1, "no question for /first");
    let id = before[0];
    daemon.restart();
    let mut after = Vec::new();
    for _ in 0..100 {
        after = open(&daemon);
        if !after.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        after,
        vec![id],
        "the question's id changed across the restart"
    );
    let journal_path = daemon.journal();
    let asks = || {
        std::fs::read_to_string(&journal_path)
            .unwrap()
            .lines()
            .filter(|l| l.contains("\"approval.ask\""))
            .count()
    };
    assert_eq!(asks(), 2, "the question was asked again after the restart");
    // Scope cell: the person means the host, so another path on it goes through unasked.
    let approve = daemon
        .warden()
        .args(["approve", &cell, &id.to_string(), "--scope", "cell"])
        .output()
        .unwrap();
    assert!(
        approve.status.success(),
        "{}",
        String::from_utf8_lossy(&approve.stderr)
    );
    for _ in 0..200 {
        if hits.load(std::sync::atomic::Ordering::SeqCst) == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "/first went through"
    );
    // The grant is kept across a restart.
    daemon.restart();
    let second = fetch(&daemon, "second/path?q=1")
        .wait_with_output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&second.stdout).trim(), "200");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(
        asks(),
        3,
        "the second request was asked and answered by the grant"
    );
    // `warden run` through the daemon tells its terminal too.
    let dir = tempdir();
    let file = support::policy(dir.path(), &policy);
    let ran_name = unique("qrun");
    let code = format!(
        "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.2:{port}/run').status)"
    );
    let mut ran = daemon
        .warden()
        .args([
            "run",
            "--name",
            &ran_name,
            "--policy",
            file.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            &code,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = stderr_lines(&mut ran);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &ran_name, &mut seen);
    assert!(
        daemon
            .warden()
            .args(["approve", &ran_name, &id.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let ran = ran.wait_with_output().unwrap();
    assert_eq!(ran.status.code(), Some(0), "{seen:?}");
    assert_eq!(String::from_utf8_lossy(&ran.stdout).trim(), "200");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        journal
            .lines()
            .any(|l| l.contains("\"approval.answer\"") && l.contains("grant:")),
        "the grant answered the second request"
    );
}

#[test]
fn copies_removals_logs_events_signals_and_refusals_say_what_they_mean() {
    if !cgroups_available("daemon_small_things") {
        return;
    }
    let (port, _) = upstream();
    let daemon = Daemon::start(&[]);
    let policy = format!(
        "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [GET]\n      paths: [\"/api/**\"]\n"
    );
    let cell = daemon.create(&unique("small"), json!({ "policy": policy }));
    let cli = |args: &[&str]| daemon.warden().args(args).output().unwrap();
    let sh = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        String::from_utf8(stream_bytes(&events, "stdout")).unwrap()
    };
    let dir = tempdir();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "hello\n").unwrap();
    let file = file.to_str().unwrap();

    // cp into a directory of the cell, named with a slash or existing, keeps the file's name.
    sh("mkdir -p /workspace/inbox");
    assert!(cli(&["cp", file, &format!("{cell}:new/")]).status.success());
    assert!(
        cli(&["cp", file, &format!("{cell}:inbox")])
            .status
            .success()
    );
    assert_eq!(
        sh("cat /workspace/new/notes.txt /workspace/inbox/notes.txt"),
        "hello\nhello\n"
    );
    // A missing host file is named, with the reason.
    let missing = cli(&["cp", "./no-such-file", &format!("{cell}:x")]);
    assert_eq!(missing.status.code(), Some(125));
    let words = String::from_utf8_lossy(&missing.stderr);
    assert!(
        words.contains("no-such-file") && words.contains("No such file"),
        "{words}"
    );

    // A 403 for a wrong method on an allowed host names the rule and what it needs.
    let post = format!(
        "import urllib.request, urllib.error\n\
         try:\n    urllib.request.urlopen(urllib.request.Request('http://127.0.0.2:{port}/api/x', data=b'1'))\n\
         except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["python3", "-c", post] }));
    let refusal = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(refusal.starts_with("403"), "{refusal}");
    assert!(
        refusal.contains("covers the host")
            && refusal.contains("only GET")
            && refusal.contains("/api/**"),
        "{refusal}"
    );

    // A command that is not found ends with 127 and never says it started.
    let events = daemon.exec(&cell, json!({ "argv": ["no-such-program"] }));
    assert!(!events.iter().any(|(e, _)| e == "started"), "{events:?}");
    assert_eq!(exit_of(&events)["code"], 127);

    // Signals by name.
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "30"], "background": true })),
    );
    let id = started.json()["id"].as_u64().unwrap();
    for bad in [json!("SIGNOPE"), json!(0), json!(99), json!("")] {
        let answer = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/processes/{id}/signal"),
            Some(json!({ "signal": bad })),
        );
        assert_eq!(
            answer.status,
            400,
            "{bad}: {}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    let sent = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/signal"),
        Some(json!({ "signal": "term" })),
    );
    assert!(sent.status < 300, "{}", String::from_utf8_lossy(&sent.body));
    let waited = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/wait"),
        None,
    );
    assert_eq!(
        waited.json()["signal"],
        15,
        "{}",
        String::from_utf8_lossy(&waited.body)
    );

    // The events stream resumes after a cursor: exactly what came after it.
    let journal: Vec<Value> = std::fs::read_to_string(daemon.journal())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mine: Vec<&Value> = journal
        .iter()
        .filter(|e| e["cell"] == cell.as_str())
        .collect();
    let cursor = mine[mine.len() / 2]["seq"].as_u64().unwrap();
    let expected: Vec<u64> = mine
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .filter(|s| *s > cursor)
        .collect();
    let resumed = |request: String| -> Vec<u64> {
        use std::io::{Read as _, Write as _};
        let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(1500)))
            .unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 8192];
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        seen.lines()
            .filter_map(|l| l.strip_prefix("id: "))
            .map(|id| id.trim().parse().unwrap())
            .collect()
    };
    // What was journaled before the cursor never comes again; what came after comes in order
    // (entries journaled since the read above may follow).
    for request in [
        format!("GET /v1/events?cell={cell}&after={cursor} HTTP/1.1\r\nHost: w\r\n\r\n"),
        format!(
            "GET /v1/events?cell={cell} HTTP/1.1\r\nHost: w\r\nLast-Event-ID: {cursor}\r\n\r\n"
        ),
    ] {
        let got = resumed(request);
        assert!(got.len() >= expected.len(), "{got:?} {expected:?}");
        assert_eq!(got[..expected.len()], expected[..]);
        assert!(got.windows(2).all(|w| w[0] < w[1]), "{got:?}");
    }

    // `logs -f` with nothing running waits, shows a process started later, and ends with the cell.
    let mut follow = daemon
        .warden()
        .args(["logs", "-f", &cell])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        follow.try_wait().unwrap().is_none(),
        "logs -f returned with the cell running"
    );
    sh("echo came-later");

    // `rm` of a running cell is refused without --force; nothing is lost by the refusal.
    let refused = cli(&["rm", &cell]);
    assert_ne!(refused.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"));
    assert_eq!(sh("cat /workspace/new/notes.txt"), "hello\n");
    std::thread::sleep(Duration::from_millis(700));
    let forced = cli(&["rm", "--force", &cell]);
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .status,
        404
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while follow.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let followed = follow.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&followed.stdout).contains("came-later"));
}

#[test]
fn a_cell_made_with_a_gateway_and_no_rules_can_be_given_network_later() {
    if !cgroups_available("daemon_network_later") {
        return;
    }
    let (port, hits) = upstream();
    let daemon = Daemon::start(&[]);
    // Without a gateway a cell has none for life, and says how to ask for one.
    let without = daemon.create(&unique("nonet"), json!({ "preset": "default" }));
    let refused = daemon.call(
        "PUT",
        &format!("/v1/cells/{without}/policy"),
        Some(json!({ "policy": "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n" })),
    );
    assert_eq!(
        refused.status,
        409,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    assert!(String::from_utf8_lossy(&refused.body).contains("gateway: true"));
    let cell = daemon.create(
        &unique("netlater"),
        json!({ "policy": "version: 1\nnetwork:\n  gateway: true\n" }),
    );
    let fetch = || {
        let code = format!(
            "import urllib.request, urllib.error\n\
             try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/', timeout=10).status)\n\
             except urllib.error.HTTPError as e:\n    print(e.code)\n\
             except OSError as e:\n    print('unreachable')"
        );
        let events = daemon.exec(&cell, json!({ "argv": ["python3", "-c", code] }));
        String::from_utf8(stream_bytes(&events, "stdout"))
            .unwrap()
            .trim()
            .to_owned()
    };
    // Nothing gets out, and what was tried is on record.
    assert_eq!(fetch(), "403");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    // A replacement of its network rules lets the host out, from the next connection on.
    let answer = daemon.call(
        "PUT",
        &format!("/v1/cells/{cell}/policy"),
        Some(json!({ "policy": format!("version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n") })),
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(fetch(), "200");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    // And taken away again.
    let answer = daemon.call(
        "PUT",
        &format!("/v1/cells/{cell}/policy"),
        Some(json!({ "policy": "version: 1\n" })),
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(fetch(), "403");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[test]
fn credentials_come_from_the_callers_environment_through_the_daemon_too() {
    if !cgroups_available("daemon_callers_secrets") {
        return;
    }
    use std::io::{Read as _, Write as _};
    // An upstream that says whether it got the caller's secret (it may not echo it: the
    // gateway scrubs a secret out of what comes back).
    let secret = format!("callers-{}-token", std::process::id());
    let expected = format!("Bearer {secret}");
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = vec![0u8; 8192];
            let n = conn.read(&mut buf).unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]).to_string();
            let got = head.lines().any(|l| {
                l.split_once(':').is_some_and(|(k, v)| {
                    k.eq_ignore_ascii_case("authorization") && v.trim() == expected
                })
            });
            let answer = if got { "got it" } else { "not it" };
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    // The daemon's environment has no such variable; the caller's has.
    let daemon = Daemon::start(&[]);
    let dir = tempdir();
    let file = support::policy(
        dir.path(),
        &format!(
            "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      credential: api\n\
             credentials:\n  api: {{ from_env: WARDEN_TEST_CALLERS_TOKEN, format: \"Bearer {{}}\" }}\n"
        ),
    );
    let code = format!(
        "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.2:{port}/').read().decode())"
    );
    let ran = daemon
        .warden()
        .env("WARDEN_TEST_CALLERS_TOKEN", &secret)
        .args([
            "run",
            "--rm",
            "--policy",
            file.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            &code,
        ])
        .output()
        .unwrap();
    assert_eq!(
        ran.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&ran.stdout).trim(), "got it");
    // `warden create` the same; without the variable, the caller is told before anything starts.
    let made = daemon
        .warden()
        .env("WARDEN_TEST_CALLERS_TOKEN", &secret)
        .args(["create", &unique("sec"), "--policy", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let missing = daemon
        .warden()
        .args([
            "create",
            &unique("nosec"),
            "--policy",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&missing.stderr)
            .contains("the caller's environment has no WARDEN_TEST_CALLERS_TOKEN")
    );
    // A secret the policy does not read is refused.
    let extra = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "name": unique("extra"), "secrets": { "HOME": "x" } })),
    );
    assert_eq!(
        extra.status,
        400,
        "{}",
        String::from_utf8_lossy(&extra.body)
    );
    // And the journal never holds it.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(!journal.contains(&secret), "the secret is in the journal");
}

/// One path: `warden run` without a daemon goes through the same harness (an ephemeral one in
/// the CLI's process) as with one, so the same commands leave the same result and the same
/// kinds of journal entries, command rules included, in the one journal both append to. The
/// only differences are how the daemon carries a run (it starts the cell before it is given
/// the command, relays stdin, and kills the cell after): `cell.start`, `exec.stdin` and
/// `cell.kill`.
#[test]
fn a_run_leaves_the_same_journal_and_result_with_and_without_a_daemon() {
    if !cgroups_available("one_path") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let dir = tempdir();
    let policy = support::policy(
        dir.path(),
        "version: 1\ncommands:\n  deny: ['rm *']\n  ask: ['curl *']\n",
    );
    let policy = policy.to_str().unwrap();
    let runs: [(&str, &[&str]); 4] = [
        ("exits", &["sh", "-c", "echo out; echo err >&2; exit 4"]),
        ("denied", &["rm", "-rf", "/tmp/x"]),
        ("missing", &["no-such-command"]),
        ("killed", &["sh", "-c", "kill -9 $$"]),
    ];
    let run_all = |daemon: &Daemon, suffix: &str| -> Vec<(String, Ran)> {
        runs.iter()
            .map(|(name, argv)| {
                let name = format!("{name}-{suffix}-{}", std::process::id());
                let out = daemon
                    .warden()
                    .args(["run", "--policy", policy, "--name", &name, "--"])
                    .args(*argv)
                    .output()
                    .unwrap();
                (name, Ran::from(out))
            })
            .collect()
    };
    let through = run_all(&daemon, "daemon");
    daemon.crash();
    let without = run_all(&daemon, "alone");
    // An asked command has nobody to answer it without a daemon: refused, and said so.
    let asked = daemon
        .warden()
        .args(["run", "--policy", policy, "--", "curl", "--version"])
        .output()
        .unwrap();
    let asked = Ran::from(asked);
    assert_eq!(asked.code, 250, "{asked:?}");
    assert!(
        asked.stderr.contains("without a daemon nobody can answer"),
        "{asked:?}"
    );

    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let entries: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds_of = |cell: &str| -> Vec<String> {
        entries
            .iter()
            .filter(|e| e["cell"] == cell)
            .map(|e| e["kind"].as_str().unwrap().to_owned())
            .filter(|k| !["cell.start", "exec.stdin", "cell.kill"].contains(&k.as_str()))
            .collect()
    };
    for ((a_name, a), (b_name, b)) in through.iter().zip(&without) {
        assert_eq!(
            (a.code, &a.stdout, &a.stderr.replace(a_name, "NAME")),
            (b.code, &b.stdout, &b.stderr.replace(b_name, "NAME")),
            "the same result:\n{a:?}\n{b:?}"
        );
        let (a_kinds, b_kinds) = (kinds_of(a_name), kinds_of(b_name));
        assert!(!a_kinds.is_empty(), "{a_name} is journaled");
        assert_eq!(
            a_kinds, b_kinds,
            "the same entries for {a_name} and {b_name}"
        );
        let exit_of = |cell: &str| {
            entries
                .iter()
                .find(|e| e["cell"] == cell && e["kind"] == "exec.exit")
                .map(|e| (e["data"]["reason"].clone(), e["data"]["code"].clone()))
        };
        assert_eq!(exit_of(a_name), exit_of(b_name), "{a_name}");
    }
    let codes: Vec<i32> = without.iter().map(|(_, r)| r.code).collect();
    assert_eq!(codes, [4, 250, 127, 137], "{without:?}");
    let denied = entries
        .iter()
        .find(|e| e["cell"] == without[1].0.as_str() && e["kind"] == "exec.denied")
        .expect("the refused command is journaled");
    assert_eq!(denied["data"]["rule"], "deny: rm *");
    daemon.assert_journal_verifies();
}

/// Several runs without a daemon append to one journal at once: each takes the journal's lock
/// in turn, and the chain they leave is one that verifies, with every run in it.
#[test]
fn runs_without_a_daemon_at_once_leave_one_chain() {
    let mut daemon = Daemon::start(&[]);
    daemon.crash();
    let children: Vec<_> = (0..6)
        .map(|i| {
            daemon
                .warden()
                .args(["run", "--name", &format!("many-{i}-{}", std::process::id())])
                .args(["--", "sh", "-c", &format!("exit {i}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(i as i32),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    for i in 0..6 {
        let cell = format!("many-{i}-{}", std::process::id());
        let kinds: Vec<String> = journal
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["cell"] == cell.as_str())
            .map(|e| e["kind"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            kinds,
            [
                "cell.create",
                "exec.start",
                "exec.exit",
                "cell.end",
                "cell.delete"
            ],
            "{cell}"
        );
    }
    daemon.assert_journal_verifies();
}
