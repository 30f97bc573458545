//! The daemon's API end to end: a real `warden serve`, real cells behind it, requests over its
//! real sockets: lifecycle, streams, auth, bad and hostile input, the daemon's own limits.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

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
    // Its end once, though the kill and the daemon's watch both see it.
    assert_eq!(
        kinds.iter().filter(|k| *k == "cell.end").count(),
        1,
        "{kinds:?}"
    );
    daemon.assert_journal_verifies();
}

/// A killed cell's end is journaled once: the kill and the daemon's watch of its cells both
/// see it end, and only the first to mark it journals it.
#[test]
fn a_killed_cells_end_is_journaled_once() {
    if !cgroups_available("killed_once") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cells: Vec<String> = (0..8)
        .map(|_| daemon.create(&unique("once"), json!({})))
        .collect();
    for cell in &cells {
        let killed = daemon.call("POST", &format!("/v1/cells/{cell}/kill"), None);
        assert_eq!(killed.json()["state"], "ended", "{}", killed.text());
    }
    // The watch looks every 100 ms: give it its turns.
    std::thread::sleep(Duration::from_millis(400));
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    for cell in &cells {
        let ends = journal
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["cell"] == cell.as_str() && e["kind"] == "cell.end")
            .count();
        assert_eq!(ends, 1, "{cell} ended {ends} times in the journal");
    }
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
    let wrong = tcp(&[("Authorization", "Bearer wrong")]);
    assert_eq!(wrong.status, 401);
    // The error body's code says what the status does (it said `bad-request`).
    assert_eq!(wrong.json()["code"], "unauthorized", "{}", wrong.text());
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
fn nul_bytes_bad_utf8_and_nameless_labels_are_refused_before_anything_is_made() {
    if !cgroups_available("nul_bytes_refused") {
        return;
    }
    let daemon = Daemon::start(&[]);
    // JSON can carry a NUL (`\u0000`) where a process's environment or path cannot: a value
    // with one would make a cell whose every command then failed to start.
    for (body, says) in [
        (
            r#"{"name": "nul-env", "env": {"A": "b\u0000c"}}"#,
            "may contain NUL",
        ),
        (
            r#"{"name": "nul-label", "labels": {"a\u0000": "b"}}"#,
            "label",
        ),
        (r#"{"name": "empty-label", "labels": {"": "b"}}"#, "label"),
        (r#"{"name": "nl-label", "labels": {"a\nb": "c"}}"#, "label"),
    ] {
        let answer = daemon.request("POST", "/v1/cells", Some(body));
        assert_eq!(
            answer.status,
            400,
            "{body}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        let message = answer.json()["error"].as_str().unwrap().to_owned();
        assert!(
            message.contains(says) && message.contains("nothing was made"),
            "{body}: {message}"
        );
    }
    let cells = daemon.call("GET", "/v1/cells", None).json();
    assert_eq!(cells.as_array().unwrap().len(), 0, "{cells}");

    // A working directory with a NUL is the request's fault, refused before anything starts,
    // not a process that failed.
    let cell = daemon.create(&unique("nul"), json!({}));
    let answer = daemon.request(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(r#"{"argv": ["true"], "cwd": "/tm\u0000p"}"#),
    );
    assert_eq!(
        answer.status,
        400,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert!(
        answer.json()["error"].as_str().unwrap().contains("`cwd`"),
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let processes = daemon
        .call("GET", &format!("/v1/cells/{cell}/processes"), None)
        .json();
    assert_eq!(processes.as_array().unwrap().len(), 0, "{processes}");

    // A query whose percent-encoding is not UTF-8 is refused, not read as other text (U+FFFD
    // in place of the bytes): a file looked up by the wrong name, a filter that matches nothing.
    for path in [
        format!("/v1/cells/{cell}/files/content?path=a%FFb"),
        "/v1/journal?cell=%ff".to_owned(),
        "/v1/usage?c%e9ll=x".to_owned(),
    ] {
        let answer = daemon.request("GET", &path, None);
        assert_eq!(
            answer.status,
            400,
            "{path}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert!(
            answer.json()["error"]
                .as_str()
                .unwrap()
                .contains("not UTF-8"),
            "{path}: {}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    // UTF-8, percent-encoded or not, and `+` for a space, still read as text.
    let answer = daemon.request("GET", "/v1/journal?cell=caf%C3%A9+x", None);
    assert_eq!(answer.status, 200);

    // A body that ends before its first field says so, without a `?` for where.
    let answer = daemon.request("POST", "/v1/cells", Some("{"));
    assert_eq!(answer.status, 400);
    let message = answer.json()["error"].as_str().unwrap().to_owned();
    assert!(
        message.starts_with("request body: EOF") && !message.contains("?:"),
        "{message}"
    );
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

/// One task reads both pipes of an exec, the cell's init holds its copies until it has told
/// the end, and the end waits for the pipes' end: every byte of both streams arrives, what a
/// process writes right before it exits included, and so does what a child it left behind
/// writes to the same pipe a moment after, all before the `exit` that counts them.
#[test]
fn both_streams_arrive_whole_with_what_a_child_left_behind_writes_after_the_end() {
    if !cgroups_available("exec_streams") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("streams"), json!({}));
    let script = "(sleep 0.3; echo late) & seq 1 20000; seq 1 20000 >&2; echo last";
    let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
    let numbers: String = (1..=20000).map(|n| format!("{n}\n")).collect();
    let expected_out = format!("{numbers}last\nlate\n");
    let out = stream_bytes(&events, "stdout");
    assert!(
        out == expected_out.as_bytes(),
        "stdout: {} bytes, {} expected; ends with {:?}",
        out.len(),
        expected_out.len(),
        String::from_utf8_lossy(&out[out.len().saturating_sub(20)..])
    );
    assert!(
        stream_bytes(&events, "stderr") == numbers.as_bytes(),
        "stderr changed"
    );
    let exit = exit_of(&events);
    assert_eq!(exit["code"], 0, "{exit}");
    assert_eq!(
        exit["stdout_bytes"].as_u64(),
        Some(expected_out.len() as u64)
    );
    assert_eq!(exit["stderr_bytes"].as_u64(), Some(numbers.len() as u64));
    assert_eq!(events.last().map(|(event, _)| event.as_str()), Some("exit"));
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
    // A WebSocket's route asked without a WebSocket's opening: the API's error too, for a
    // process that runs and for one there is none of.
    let running = daemon
        .call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": ["sleep", "30"], "background": true })),
        )
        .json()["id"]
        .as_u64()
        .unwrap();
    for (id, status) in [(running, 400), (running + 1000, 404)] {
        let answer = daemon.request(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/attach"),
            None,
        );
        assert_eq!(answer.status, status, "{}", answer.text());
        let value: Value = serde_json::from_slice(&answer.body)
            .unwrap_or_else(|_| panic!("attach {id}: a non-JSON error: {}", answer.text()));
        assert!(
            !value["error"].as_str().unwrap_or_default().is_empty(),
            "{value}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(canary.path().join("canary")).unwrap(),
        "untouched"
    );
    assert_eq!(daemon.call("GET", "/v1/health", None).status, 200);
    daemon.assert_journal_verifies();
}

/// A foreground exec whose client goes away (the connection closed mid-stream) has nobody left
/// to stream to: its process is killed, and its end journaled.
#[test]
fn a_foreground_exec_whose_client_goes_away_is_killed_and_its_end_journaled() {
    use std::io::{Read as _, Write as _};
    if !cgroups_available("exec_hangup") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("hangup"), json!({}));
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    let body = json!({ "argv": ["sleep", "300"] }).to_string();
    write!(
        stream,
        "POST /v1/cells/{cell}/exec HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"pid\":") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let seen = String::from_utf8_lossy(&seen).into_owned();
    let id: u64 = seen
        .split("\"process\":")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no process id in {seen}"));
    let info = |id: u64| {
        daemon
            .call("GET", &format!("/v1/cells/{cell}/processes/{id}"), None)
            .json()
    };
    assert_eq!(info(id)["running"], true, "{}", info(id));
    drop(stream);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while info(id)["running"] == true {
        assert!(
            std::time::Instant::now() < deadline,
            "the process of a client that went away still runs: {}",
            info(id)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let exit = info(id)["exit"].clone();
    assert_eq!(exit["signal"], 9, "{exit}");
    let ended = daemon
        .entries_of(&cell)
        .into_iter()
        .filter(|e| e["kind"] == "exec.exit" && e["data"]["process"] == id)
        .count();
    assert_eq!(ended, 1);
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

/// Input that the process does not read (more than its pipe holds) waits for it, but the
/// attached socket goes on carrying the process's output meanwhile: the input used to be
/// written in the socket's own loop, which then sent nothing more until the process read it.
#[test]
fn an_attached_process_that_does_not_read_its_input_still_streams_its_output() {
    if !cgroups_available("daemon_ws_input") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("wsin"), json!({}));
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo ready; while :; do echo tick; sleep 0.2; done"], "background": true })),
    );
    assert_eq!(started.status, 201, "{}", started.text());
    let id = started.json()["id"].as_u64().unwrap();
    let stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let url = format!("ws://warden/v1/cells/{cell}/processes/{id}/attach");
    let (mut socket, _) =
        tungstenite::client::client(url.as_str(), stream).expect("the upgrade succeeds");
    let mut sent = false;
    let mut ticks_after = 0;
    while ticks_after < 3 {
        let message = socket
            .read()
            .unwrap_or_else(|e| panic!("output stopped once input was sent ({sent}): {e}"));
        let tungstenite::Message::Text(text) = message else {
            continue;
        };
        let event: Value = serde_json::from_str(text.as_str()).unwrap();
        assert_eq!(event["event"], "stdout", "{event}");
        if sent {
            ticks_after += event["text"]
                .as_str()
                .unwrap_or_default()
                .matches("tick")
                .count();
        } else {
            sent = true;
            // 256 KiB: four times what a pipe holds, and the shell never reads it.
            let input = json!({ "stdin": "x".repeat(256 * 1024) });
            socket
                .send(tungstenite::Message::Text(input.to_string().into()))
                .unwrap();
        }
    }
    drop(socket);
    let killed = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/signal"),
        Some(json!({ "signal": "KILL" })),
    );
    assert_eq!(killed.status, 204, "{}", killed.text());
}

#[test]
fn strangers_cannot_make_the_daemon_hold_their_bytes() {
    use std::io::{Read as _, Write as _};
    // No cell is needed: what a stranger can send is the listener's and the gate's concern.
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let runtime = daemon.socket().parent().unwrap().to_owned();
    let address: std::net::SocketAddr = read_file(&runtime.join("daemon.addr")).parse().unwrap();
    let token = read_file(&runtime.join("daemon.token"));
    let pid = daemon.pid().unwrap();
    let before = resident_kib(pid);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Strangers without the token: 150 logins of 1 MiB each, all but the last byte sent (the
    // login passes the gate without proof), and 150 heads of 300 KiB that never end.
    let mut strangers = Vec::new();
    for i in 0..300 {
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        stream
            .set_write_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let sent = if i % 2 == 0 {
            let body = vec![b'x'; (1 << 20) - 1];
            stream
                .write_all(
                    format!(
                        "POST /ui/login HTTP/1.1\r\nHost: {address}\r\nContent-Length: {}\r\n\r\n",
                        1 << 20
                    )
                    .as_bytes(),
                )
                .and_then(|()| stream.write_all(&body))
        } else {
            let line = format!("X-Filler: {}\r\n", "y".repeat(8000));
            stream
                .write_all(format!("GET /ui/ HTTP/1.1\r\nHost: {address}\r\n").as_bytes())
                .and_then(|()| stream.write_all(line.repeat(300 * 1024 / line.len()).as_bytes()))
        };
        // A refusal may close the connection before all is sent.
        let _ = sent;
        strangers.push(stream);
    }
    // Each is answered (or its connection closed) at once, not held for more of its bytes.
    let mut held = 0;
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    for stream in &mut strangers {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        let mut answer = [0u8; 256];
        match stream.read(&mut answer) {
            Ok(n) => {
                let text = String::from_utf8_lossy(&answer[..n]);
                let status = text.split(' ').nth(1).unwrap_or("closed").to_owned();
                *answers.entry(status).or_default() += 1;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                held += 1;
            }
            Err(_) => *answers.entry("reset".to_owned()).or_default() += 1,
        }
    }
    let grown = resident_kib(pid).saturating_sub(before) / 1024;
    eprintln!("strangers' answers {answers:?}, {held} held; the daemon grew by {grown} MiB");
    assert_eq!(
        held, 0,
        "{held} strangers were held for more bytes (answers {answers:?}); the daemon grew by {grown} MiB"
    );
    assert!(grown < 48, "the daemon grew by {grown} MiB for strangers");
    for refused in ["413", "431"] {
        assert!(answers.contains_key(refused), "{answers:?}");
    }
    drop(strangers);
    // A login's body says why it was refused; the owner's requests and heads of a usual size
    // (a browser's cookies, say) go through as before.
    let refused = exchange(
        std::net::TcpStream::connect(address).unwrap(),
        "POST",
        "/ui/login",
        Some(&format!("{{\"token\": \"{}\"}}", "x".repeat(20_000))),
        &[],
    );
    assert_eq!(refused.status, 413, "{}", refused.text());
    assert!(refused.text().contains("login"), "{}", refused.text());
    let cookies = format!("other={}", "c".repeat(16_000));
    let health = exchange(
        std::net::TcpStream::connect(address).unwrap(),
        "GET",
        "/v1/health",
        None,
        &[
            ("Authorization", &format!("Bearer {token}")),
            ("Cookie", &cookies),
        ],
    );
    assert_eq!(health.status, 200, "{}", health.text());
    let login = exchange(
        std::net::TcpStream::connect(address).unwrap(),
        "POST",
        "/ui/login",
        Some(&json!({ "token": token }).to_string()),
        &[],
    );
    assert_eq!(login.status, 200, "{}", login.text());
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
    // 600 reads and writes of FIFOs at once (more than the runtime's blocking pool). A request
    // that opened a FIFO would hang until the operation's deadline (60 s) and then answer that
    // it timed out; each client gives up well before that.
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
                    .set_read_timeout(Some(Duration::from_secs(30)))
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

/// The dashboard's session on TCP: a login trades the token for an HttpOnly, SameSite=Strict
/// cookie; a change made with the cookie needs the session's CSRF token and the daemon's own
/// origin; a WebSocket opened with it must come from that origin; logout ends it; forged or
/// foreign cookies are nobody. Cross-site requests are refused even with the bearer token and
/// on the unix socket.
#[test]
fn the_dashboard_session_needs_its_csrf_token_and_its_own_origin() {
    if !cgroups_available("dashboard_session") {
        return;
    }
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let token = std::fs::read_to_string(daemon.runtime.join("daemon.token")).unwrap();
    let addr = std::fs::read_to_string(daemon.runtime.join("daemon.addr")).unwrap();
    let tcp = |method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]| {
        let stream = std::net::TcpStream::connect(&addr).expect("the TCP listener answers");
        exchange(stream, method, path, body, headers)
    };
    // The page comes without a login, with 401; the API does not.
    let page = tcp("GET", "/ui/", None, &[]);
    assert_eq!(page.status, 401);
    assert!(page.text().contains("<title>Warden</title>"));
    assert!(
        page.headers
            .to_ascii_lowercase()
            .contains("content-security-policy: default-src 'none'; script-src 'self'")
    );
    assert_eq!(tcp("GET", "/ui/session", None, &[]).status, 401);
    let wrong = tcp(
        "POST",
        "/ui/login",
        Some(r#"{"token":"guess-guess-guess-guess"}"#),
        &[],
    );
    assert_eq!(wrong.status, 401, "{}", wrong.text());
    assert!(!wrong.headers.to_ascii_lowercase().contains("set-cookie"));

    let login = tcp(
        "POST",
        "/ui/login",
        Some(&json!({ "token": token.trim() }).to_string()),
        &[],
    );
    assert_eq!(login.status, 200, "{}", login.text());
    let set_cookie = login
        .headers
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .expect("a session cookie")
        .to_owned();
    assert!(
        set_cookie.contains("HttpOnly") && set_cookie.contains("SameSite=Strict"),
        "{set_cookie}"
    );
    let cookie = set_cookie
        .split_once(':')
        .unwrap()
        .1
        .split(';')
        .next()
        .unwrap()
        .trim()
        .to_owned();
    // Test-long strings, borrowed by every header list below.
    let cookie: &'static str = Box::leak(cookie.into_boxed_str());
    let csrf: &'static str = Box::leak(
        login.json()["csrf"]
            .as_str()
            .unwrap()
            .to_owned()
            .into_boxed_str(),
    );
    assert_eq!(csrf.len(), 64);
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut headers = vec![("Cookie", cookie)];
        headers.extend_from_slice(extra);
        headers
    };

    assert_eq!(
        tcp("GET", "/v1/cells", None, &with(&[("X-Warden-CSRF", csrf)])).status,
        200
    );
    // A second login from the same browser (the link opened again) starts a new session.
    let again = tcp(
        "POST",
        "/ui/login",
        Some(&json!({ "token": token.trim() }).to_string()),
        &with(&[]),
    );
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(
        tcp(
            "GET",
            "/ui/session",
            None,
            &with(&[("X-Warden-CSRF", csrf)])
        )
        .json()["csrf"],
        csrf
    );
    let make = |name: &str| json!({ "name": name, "preset": "minimal" }).to_string();
    // Changes without the CSRF token, with a wrong one, or from another origin: refused.
    for (name, headers) in [
        ("csrf-none", with(&[])),
        ("csrf-wrong", with(&[("X-Warden-CSRF", "0000")])),
        (
            "csrf-origin",
            with(&[("X-Warden-CSRF", csrf), ("Origin", "http://evil.example")]),
        ),
        (
            "csrf-site",
            with(&[("X-Warden-CSRF", csrf), ("Sec-Fetch-Site", "cross-site")]),
        ),
    ] {
        let refused = tcp("POST", "/v1/cells", Some(&make(name)), &headers);
        assert_eq!(refused.status, 403, "{name}: {}", refused.text());
        assert_eq!(
            daemon
                .call("GET", &format!("/v1/cells/{name}"), None)
                .status,
            404,
            "{name} was made"
        );
    }
    let made = tcp(
        "POST",
        "/v1/cells",
        Some(&make("csrf-ok")),
        &with(&[("X-Warden-CSRF", csrf), ("Origin", "http://warden")]),
    );
    assert_eq!(made.status, 201, "{}", made.text());
    // Listed with its tier and preset (for a document, the preset it extends).
    assert_eq!(
        (made.json()["tier"].as_str(), made.json()["preset"].as_str()),
        (Some("process"), Some("minimal"))
    );
    let extending = daemon.create(
        "csrf-yaml",
        json!({ "policy": "version: 1\nextends: minimal\n" }),
    );
    let listed = daemon
        .call("GET", &format!("/v1/cells/{extending}"), None)
        .json();
    assert_eq!(listed["preset"], "minimal", "{listed}");

    // A WebSocket with the cookie: only from the daemon's own origin.
    let shell = daemon.call(
        "POST",
        "/v1/cells/csrf-ok/exec",
        Some(json!({ "argv": ["sleep", "30"], "background": true })),
    );
    assert_eq!(shell.status, 201, "{}", shell.text());
    let id = shell.json()["id"].as_u64().unwrap();
    let attach = format!("/v1/cells/csrf-ok/processes/{id}/attach?csrf={csrf}");
    let upgrade: [(&str, &str); 4] = [
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Version", "13"),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ];
    let ws = |origin: Option<&str>| {
        let mut headers = with(&upgrade);
        if let Some(origin) = origin {
            headers.push(("Origin", origin));
        }
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        use std::io::{Read as _, Write as _};
        let mut head = format!("GET {attach} HTTP/1.1\r\nHost: warden\r\n");
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 12];
        stream.read_exact(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[9..12]).into_owned()
    };
    assert_eq!(ws(None), "403");
    assert_eq!(ws(Some("http://evil.example")), "403");
    assert_eq!(ws(Some("http://warden")), "101");

    // The bearer token from another site is refused too (a browser would have sent it).
    let bearer = format!("Bearer {}", token.trim());
    let cross = tcp(
        "GET",
        "/v1/cells",
        None,
        &[("Authorization", &bearer), ("Sec-Fetch-Site", "cross-site")],
    );
    assert_eq!(cross.status, 403);
    // A forged cookie is nobody.
    let forged = tcp(
        "GET",
        "/v1/cells",
        None,
        &[("Cookie", "warden_session=00ff")],
    );
    assert_eq!(forged.status, 401);

    // Logout ends the session.
    let out = tcp(
        "POST",
        "/ui/logout",
        None,
        &with(&[("X-Warden-CSRF", csrf)]),
    );
    assert_eq!(out.status, 204);
    assert_eq!(tcp("GET", "/v1/cells", None, &with(&[])).status, 401);

    // The unix socket needs no login, and still refuses other sites.
    assert_eq!(daemon.request("GET", "/ui/", None).status, 200);
    assert_eq!(
        daemon.call("GET", "/ui/session", None).json()["via"],
        "unix"
    );
    let stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    let foreign = exchange(
        stream,
        "POST",
        "/v1/cells",
        Some(&make("csrf-unix")),
        &[("Origin", "http://evil.example")],
    );
    assert_eq!(foreign.status, 403);
    assert_eq!(daemon.call("GET", "/v1/cells/csrf-unix", None).status, 404);
}

/// A browser sends a host's cookies to every port of it, so a server another local user runs
/// on a loopback port receives the dashboard's session cookie whenever the owner's browser opens
/// a page there. The cookie alone must prove nothing: without the session's CSRF token (which
/// only the daemon's own page holds) no read, no change and no WebSocket passes, and the
/// session's answer does not hand the token out; with it (in the header, or in a GET's query)
/// everything does, and the page itself still loads.
#[test]
fn a_session_cookie_taken_to_another_port_proves_nothing_without_its_csrf_token() {
    if !cgroups_available("dashboard_cookie_alone") {
        return;
    }
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let token = std::fs::read_to_string(daemon.runtime.join("daemon.token")).unwrap();
    let addr = std::fs::read_to_string(daemon.runtime.join("daemon.addr")).unwrap();
    let tcp = |method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]| {
        let stream = std::net::TcpStream::connect(&addr).expect("the TCP listener answers");
        exchange(stream, method, path, body, headers)
    };
    let login = tcp(
        "POST",
        "/ui/login",
        Some(&json!({ "token": token.trim() }).to_string()),
        &[],
    );
    assert_eq!(login.status, 200, "{}", login.text());
    let cookie = login
        .headers
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase().starts_with("set-cookie:").then(|| {
                l.split_once(':')
                    .unwrap()
                    .1
                    .split(';')
                    .next()
                    .unwrap()
                    .trim()
                    .to_owned()
            })
        })
        .expect("a session cookie");
    let csrf = login.json()["csrf"].as_str().unwrap().to_owned();
    let alone = [("Cookie", cookie.as_str())];
    // What a thief holding the cookie alone tries: the session (for its token), reads, a
    // change, the events stream. Each is refused, and says what is missing.
    let session = tcp("GET", "/ui/session", None, &alone);
    assert_eq!(session.status, 403, "{}", session.text());
    assert!(!session.text().contains(&csrf), "{}", session.text());
    assert!(session.text().contains("CSRF token"), "{}", session.text());
    for (method, path, body) in [
        ("GET", "/v1/cells", None),
        ("GET", "/v1/approvals", None),
        ("GET", "/v1/events?csrf=00ff", None),
        ("POST", "/v1/cells", Some(r#"{"name":"stolen"}"#)),
    ] {
        let refused = tcp(method, path, body, &alone);
        assert_eq!(refused.status, 403, "{method} {path}: {}", refused.text());
    }
    assert_eq!(daemon.call("GET", "/v1/cells/stolen", None).status, 404);
    // A WebSocket from the daemon's own origin with the cookie but not the token: refused.
    let upgrade = |path: &str| {
        use std::io::{Read as _, Write as _};
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        let head = format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nOrigin: http://{host}\r\nCookie: {cookie}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
            host = addr.trim()
        );
        stream.write_all(head.as_bytes()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 12];
        stream.read_exact(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[9..12]).into_owned()
    };
    let shell = daemon.create("cookie-alone", json!({ "preset": "minimal" }));
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{shell}/exec"),
        Some(json!({ "argv": ["sleep", "30"], "background": true })),
    );
    assert_eq!(started.status, 201, "{}", started.text());
    let attach = format!(
        "/v1/cells/{shell}/processes/{}/attach",
        started.json()["id"].as_u64().unwrap()
    );
    assert_eq!(upgrade(&attach), "403");
    // The page still comes (it asks for a login again).
    assert_eq!(tcp("GET", "/ui/", None, &alone).status, 401);

    // With the token, as the daemon's own page sends it: in the header, or in a GET's query
    // (which the handlers never see: their queries take no unknown parameter).
    let with = [
        ("Cookie", cookie.as_str()),
        ("X-Warden-CSRF", csrf.as_str()),
    ];
    let session = tcp("GET", "/ui/session", None, &with);
    assert_eq!(session.status, 200, "{}", session.text());
    assert_eq!(session.json()["via"], "cookie");
    assert_eq!(tcp("GET", "/v1/cells", None, &with).status, 200);
    let usage = tcp("GET", &format!("/v1/usage?csrf={csrf}"), None, &alone);
    assert_eq!(usage.status, 200, "{}", usage.text());
    let usage = tcp(
        "GET",
        &format!("/v1/usage?cell={shell}&csrf={csrf}"),
        None,
        &alone,
    );
    assert_eq!(usage.status, 200, "{}", usage.text());
    // In a query, only for a read: a change carries it in the header.
    let change = tcp(
        "POST",
        &format!("/v1/cells?csrf={csrf}"),
        Some(r#"{"name":"stolen"}"#),
        &alone,
    );
    assert_eq!(change.status, 403, "{}", change.text());
    assert_eq!(upgrade(&format!("{attach}?csrf={csrf}")), "101");
}

/// A daemon killed while it listened on TCP leaves its address behind; the next one, started
/// without `--listen` (or `--e2b`), removes it, so that `warden dashboard` does not print a
/// link with the token to whatever program took that port since (a page there reads the
/// fragment), and no E2B client is sent there with a key that opens nothing.
#[test]
fn a_daemon_without_tcp_leaves_no_earlier_daemons_address_to_link_to() {
    if !cgroups_available("stale_address") {
        return;
    }
    let mut daemon = Daemon::start(&["--listen", "127.0.0.1:0", "--e2b", "127.0.0.1:0"]);
    let addr = std::fs::read_to_string(daemon.runtime.join("daemon.addr")).unwrap();
    let link = daemon.warden().arg("dashboard").output().unwrap();
    assert!(
        link.status.success(),
        "{}",
        String::from_utf8_lossy(&link.stderr)
    );
    assert!(
        String::from_utf8_lossy(&link.stdout).contains(addr.trim()),
        "{}",
        String::from_utf8_lossy(&link.stdout)
    );
    daemon.restart_with(&[]);
    // Another program holds the port the killed daemon listened on.
    let _squatter = std::net::TcpListener::bind(addr.trim()).unwrap();
    let link = daemon.warden().arg("dashboard").output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&link.stdout),
        String::from_utf8_lossy(&link.stderr),
    );
    assert!(!link.status.success(), "{out}");
    assert!(!out.contains("token="), "{out}");
    assert!(err.contains("does not listen on TCP"), "{err}");
    for file in ["daemon.addr", "e2b.addr", "e2b.key"] {
        assert!(
            !daemon.runtime.join(file).exists(),
            "{file} of the killed daemon is left"
        );
    }
}

/// `--token-file` names the file whose token is the whole API on TCP: one that other local
/// users can read (or that another user owns) is refused at start, with what to do; an
/// owner-only one serves.
#[test]
fn a_token_file_other_users_can_read_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempdir();
    let file = dir.path().join("token");
    std::fs::write(&file, "a-token-of-the-owners-0123456789\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut serve = std::process::Command::new(bin())
        .env("WARDEN_RUNTIME_DIR", dir.path().join("run"))
        .env("WARDEN_STATE_DIR", dir.path().join("state"))
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = serve.kill();
            let _ = serve.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut said = String::new();
    use std::io::Read as _;
    serve
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut said)
        .unwrap();
    assert!(
        status.is_some_and(|s| !s.success()),
        "a daemon served a token every local user can read ({status:?}): {said}"
    );
    assert!(
        said.contains("has mode 644") && said.contains("chmod 600"),
        "{said}"
    );
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut serve = std::process::Command::new(bin())
        .env("WARDEN_RUNTIME_DIR", dir.path().join("run"))
        .env("WARDEN_STATE_DIR", dir.path().join("state"))
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It says where the token is: the file given, not one of its own.
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(serve.stderr.take().unwrap()));
    let told = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.contains("token in"));
    let cells = told.as_ref().map(|_| {
        let addr = std::fs::read_to_string(dir.path().join("run").join("daemon.addr")).unwrap();
        let stream = std::net::TcpStream::connect(addr.trim()).unwrap();
        exchange(
            stream,
            "GET",
            "/v1/cells",
            None,
            &[("Authorization", "Bearer a-token-of-the-owners-0123456789")],
        )
    });
    let _ = serve.kill();
    let _ = serve.wait();
    let told = told.expect("the daemon says where its token is");
    assert!(
        told.contains(&format!("token in {})", file.display())),
        "{told}"
    );
    let cells = cells.unwrap();
    assert_eq!(cells.status, 200, "{}", cells.text());
}

/// The cells' use over time, from their cgroups: CPU time that grows while a process burns
/// it, memory charged, tasks counted; the same rounds on the events stream.
#[test]
fn usage_is_sampled_from_the_cells_accounting() {
    if !cgroups_available("usage_samples") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("use"), json!({}));
    let burn = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["python3", "-c", "import time\nx = bytearray(48 << 20)\nend = time.time() + 4\nwhile time.time() < end: pass\ntime.sleep(30)"], "background": true })),
    );
    assert_eq!(burn.status, 201, "{}", burn.text());
    let samples = |cell: &str| -> Vec<Value> {
        let all = daemon
            .call("GET", &format!("/v1/usage?cell={cell}"), None)
            .json();
        all.as_array()
            .unwrap()
            .first()
            .map(|h| h["samples"].as_array().unwrap().clone())
            .unwrap_or_default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let got = loop {
        let got = samples(&cell);
        let cpu = |s: &Value| s["cpu_usec"].as_u64().unwrap_or(0);
        if got.len() >= 3 && cpu(got.last().unwrap()) >= cpu(&got[0]) + 1_000_000 {
            break got;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no CPU time seen growing: {got:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let last = got.last().unwrap();
    assert!(last["memory_bytes"].as_u64().unwrap() >= 48 << 20, "{last}");
    assert!(last["pids"].as_u64().unwrap() >= 2, "{last}");
    // The events stream carries the rounds.
    let stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut stream = std::io::BufReader::new(stream);
    use std::io::{BufRead as _, Write as _};
    stream
        .get_mut()
        .write_all(b"GET /v1/events?usage=true HTTP/1.1\r\nHost: warden\r\n\r\n")
        .unwrap();
    let mut line = String::new();
    let mut saw = false;
    while stream.read_line(&mut line).unwrap() > 0 {
        if line.starts_with("data: [") && line.contains(&cell) && line.contains("cpu_usec") {
            saw = true;
            break;
        }
        line.clear();
    }
    assert!(saw, "no usage event for {cell}");
    // A cell that is gone has no history left.
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{cell}"), None)
            .status,
        204
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !samples(&cell).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the history of a deleted cell stays"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The journal read back whole, newest first, page by page, with the chain checked.
#[test]
fn the_journal_pages_back_and_checks_its_chain() {
    if !cgroups_available("journal_pages") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("pages"), json!({}));
    for i in 0..30 {
        let put = daemon.request(
            "PUT",
            &format!("/v1/cells/{cell}/files/content?path=f{i}"),
            Some("x"),
        );
        assert_eq!(put.status, 204, "{}", put.text());
    }
    let first = daemon
        .call(
            "GET",
            &format!("/v1/journal?cell={cell}&kind=file.&limit=12"),
            None,
        )
        .json();
    let entries = first["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 12);
    let seqs: Vec<u64> = entries.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] > w[1]),
        "not newest first: {seqs:?}"
    );
    assert!(
        entries
            .iter()
            .all(|e| e["kind"] == "file.write" && e["cell"] == cell.as_str())
    );
    assert!(entries.iter().all(
        |e| e["hash"].as_str().unwrap().len() == 64 && e["prev"].as_str().unwrap().len() == 64
    ));
    let mut all = seqs.clone();
    let mut before = first["next_before"].as_u64();
    while let Some(b) = before {
        let page = daemon
            .call(
                "GET",
                &format!("/v1/journal?cell={cell}&kind=file.&limit=12&before={b}"),
                None,
            )
            .json();
        all.extend(
            page["entries"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["seq"].as_u64().unwrap()),
        );
        before = page["next_before"].as_u64();
    }
    assert_eq!(all.len(), 30, "{all:?}");
    // Each entry links to the one before it in the whole journal.
    let newest = daemon.call("GET", "/v1/journal?limit=2", None).json();
    let two = newest["entries"].as_array().unwrap();
    assert_eq!(two[0]["prev"], two[1]["hash"]);
    assert_eq!(newest["head_seq"], two[0]["seq"]);
    let bad = daemon.call("GET", "/v1/journal?limit=5000", None);
    assert_eq!(bad.status, 400, "{}", bad.text());
    let check = daemon.call("GET", "/v1/journal/verify", None).json();
    assert_eq!(check["ok"], true, "{check}");
    assert!(check["last_seq"].as_u64().unwrap() >= two[0]["seq"].as_u64().unwrap());
    // A changed byte in the journal is found.
    daemon_tamper(&daemon);
    let check = daemon.call("GET", "/v1/journal/verify", None).json();
    assert_eq!(check["ok"], false, "{check}");
    assert!(
        check["error"].as_str().unwrap().contains("entry"),
        "{check}"
    );
}

/// Changes one entry's data in the journal file, as an intruder would.
fn daemon_tamper(daemon: &Daemon) {
    let path = daemon.journal();
    let text = std::fs::read_to_string(&path).unwrap();
    let changed = text.replacen(
        "\"path\":\"/workspace/f3\"",
        "\"path\":\"/workspace/f4\"",
        1,
    );
    assert!(text != changed, "the entry to change is not in the journal");
    std::fs::write(&path, changed).unwrap();
}

/// A handler that takes no body (pause, step, kill...) still has the body read before it
/// answers: a kept-alive connection whose body came late is not closed under the client's next
/// request (which then got a reset instead of an answer).
#[test]
fn a_late_body_to_a_handler_without_one_keeps_the_connection() {
    use std::io::{Read as _, Write as _};
    let daemon = Daemon::start(&[]);
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(b"POST /v1/cells/no-such-cell/pause HTTP/1.1\r\nHost: warden\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    stream
        .write_all(b"{}GET /v1/health HTTP/1.1\r\nHost: warden\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answers = Vec::new();
    let _ = stream.read_to_end(&mut answers);
    let answers = String::from_utf8_lossy(&answers);
    assert_eq!(answers.matches("HTTP/1.1 ").count(), 2, "{answers}");
    assert!(answers.starts_with("HTTP/1.1 404"), "{answers}");
    assert!(answers.contains("\"status\":\"ok\""), "{answers}");
}

#[test]
fn every_refusal_names_its_failure_for_a_program_to_act_on() {
    // The error body's `reason` is the operation's failure, within the code: a client tells a
    // paused cell from an ended one, a rule's refusal from a missing process, by it.
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(
        &unique("reasons"),
        json!({ "policy": "version: 1\ncommands:\n  deny: [\"rm *\"]\n" }),
    );
    let reason = |answer: &support::daemon::Answer| {
        answer.json()["reason"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let missing = daemon.call("GET", "/v1/cells/no-such-cell", None);
    assert_eq!(
        (missing.status, reason(&missing).as_str()),
        (404, "no-such-cell")
    );
    let denied = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["rm", "-rf", "/workspace"] })),
    );
    assert_eq!(
        (denied.status, reason(&denied).as_str()),
        (403, "denied"),
        "{}",
        denied.text()
    );
    let bad = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": [] })),
    );
    assert_eq!(
        (bad.status, reason(&bad).as_str()),
        (400, "invalid-request")
    );
    let no_process = daemon.call("GET", &format!("/v1/cells/{cell}/processes/999999"), None);
    assert_eq!(
        (no_process.status, reason(&no_process).as_str()),
        (404, "no-such-process")
    );
    let outside = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/files/content?path=../x"),
        None,
    );
    assert_eq!(
        (outside.status, reason(&outside).as_str()),
        (400, "invalid-path")
    );
    daemon.call("POST", &format!("/v1/cells/{cell}/pause"), None);
    let paused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!(
        (paused.status, reason(&paused).as_str()),
        (409, "cell-paused")
    );
    daemon.call("POST", &format!("/v1/cells/{cell}/kill"), None);
    let ended = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["true"] })),
    );
    assert_eq!((ended.status, reason(&ended).as_str()), (409, "cell-ended"));
    let no_snapshot = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "from": "nobody@nothing" })),
    );
    assert_eq!(
        (no_snapshot.status, reason(&no_snapshot).as_str()),
        (404, "no-such-snapshot")
    );
    // A malformed request is the API's own answer: no reason.
    let malformed = daemon.request("POST", "/v1/cells", Some("{not json"));
    assert_eq!(malformed.status, 400);
    assert!(
        malformed.json().get("reason").is_none(),
        "{}",
        malformed.text()
    );
}

/// A client that asks for the events from far back (`after=0`) and reads slowly has the daemon
/// hold a few entries ahead of it, not every entry it missed: read whole into memory, a journal
/// of about 100 MB grew the daemon by hundreds of MB for as long as the client stayed.
#[test]
fn a_client_far_behind_on_the_events_stream_costs_the_daemon_little_memory() {
    use std::io::{Read as _, Write as _};
    let mut daemon = Daemon::start(&[]);
    // A long journal, written while no daemon runs.
    daemon.crash();
    let dir = daemon.journal().parent().unwrap().to_path_buf();
    {
        let journal = warden_journal::Journal::open(&dir).unwrap();
        let filler = "x".repeat(2000);
        for _ in 0..50 {
            let batch = (0..1000)
                .map(|_| ("test.filler".to_owned(), json!({ "filler": filler })))
                .collect();
            let (tx, rx) = std::sync::mpsc::channel();
            journal.submit_batch(None, batch, false, move |done| {
                let _ = tx.send(done.map(|_| ()));
            });
            rx.recv().unwrap().unwrap();
        }
    }
    daemon.restart();
    let pid = daemon.pid().unwrap();
    let before = resident_kib(pid);
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    stream
        .write_all(b"GET /v1/events?after=0 HTTP/1.1\r\nHost: warden\r\n\r\n")
        .unwrap();
    // The stream starts with the first entry; then the client reads no more.
    let mut first = vec![0; 256 * 1024];
    let mut got = 0;
    while !String::from_utf8_lossy(&first[..got]).contains("test.filler") {
        let n = stream.read(&mut first[got..]).unwrap();
        assert!(
            n > 0 && got + n < first.len(),
            "no first entry: {:?}",
            String::from_utf8_lossy(&first[..got])
        );
        got += n;
    }
    let mut grown = 0;
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(100));
        grown = grown.max(resident_kib(pid).saturating_sub(before));
    }
    assert!(
        grown < 48 * 1024,
        "the daemon grew by {} MiB for a client far behind",
        grown / 1024
    );
}

/// Subscribers of `/v1/events` that stop reading while cells write large entries (an exec's
/// journaled output, 64 KiB a stream) hold what their connections buffer and the shared ring
/// of entries: each had a queue of 64 rendered entries of its own, ~11 MB a subscriber (40 of
/// them grew the daemon by 545 MB).
#[test]
fn stalled_event_subscribers_cost_the_daemon_little_memory() {
    use std::io::{Read as _, Write as _};
    if !cgroups_available("stalled_event_subscribers") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let pid = daemon.pid().unwrap();
    let cell = daemon.create(&unique("loud"), json!({}));
    daemon.exec(&cell, json!({ "argv": ["true"] }));
    let mut stalled = Vec::new();
    for _ in 0..30 {
        let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
        stream
            .write_all(b"GET /v1/events HTTP/1.1\r\nHost: warden\r\n\r\n")
            .unwrap();
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).unwrap();
        assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
        stalled.push(stream);
    }
    let _ = reset_peak(pid);
    let before = peak_kib(pid);
    let script = "head -c 70000 /dev/urandom; head -c 70000 /dev/urandom >&2";
    for _ in 0..150 {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        assert_eq!(exit_of(&events)["code"], 0);
    }
    let grown = peak_kib(pid).saturating_sub(before);
    // 150 entries of ~180 KB in the ring, and each connection's buffer.
    assert!(
        grown < 100 * 1024,
        "the daemon grew by {} MiB for 30 stalled subscribers",
        grown / 1024
    );
    drop(stalled);
}

/// A reader slower than its process loses the oldest output (4 MiB is kept), told by
/// `dropped` events: each says the bytes this reader missed since the last, so that what it
/// got and what it missed add up to what the process wrote. Each said all that was ever
/// dropped, and a client that added them up (the SDK, `run_to_end`) counted gigabytes.
#[test]
fn a_slow_reader_is_told_the_bytes_it_missed_and_they_add_up() {
    use std::io::{Read as _, Write as _};
    if !cgroups_available("a_slow_reader_is_told_the_bytes_it_missed") {
        return;
    }
    const WRITTEN: u64 = 200 << 20;
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("fast"), json!({}));
    let body = json!({ "argv": ["sh", "-c", format!("head -c {WRITTEN} /dev/zero | tr '\\0' a")] })
        .to_string();
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    // HTTP/1.0: the answer is the stream to the connection's end, not chunked.
    write!(
        stream,
        "POST /v1/cells/{cell}/exec HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        std::thread::sleep(Duration::from_millis(5));
    }
    let text = String::from_utf8_lossy(&raw);
    let events = parse_events(&text[text.find("\r\n\r\n").unwrap() + 4..]);
    let exit = exit_of(&events);
    assert_eq!(exit["stdout_bytes"], WRITTEN, "{exit}");
    let drops: Vec<u64> = events
        .iter()
        .filter(|(name, _)| name == "dropped")
        .map(|(_, data)| data["bytes"].as_u64().unwrap())
        .collect();
    assert!(drops.len() >= 2, "the reader fell behind only {drops:?}");
    let got = stream_bytes(&events, "stdout").len() as u64;
    assert_eq!(
        got + drops.iter().sum::<u64>(),
        WRITTEN,
        "got {got} bytes, told of {drops:?} dropped"
    );
}

/// Asserts `answer` is a refusal with `status` whose message says `says`, and gives it back.
fn refused(answer: support::daemon::Answer, status: u16, says: &str) -> support::daemon::Answer {
    assert_eq!(answer.status, status, "{}", answer.text());
    assert!(
        answer.json()["error"]
            .as_str()
            .unwrap_or_default()
            .contains(says),
        "{}",
        answer.text()
    );
    answer
}

/// A wrong method and a missing route name their failure in `reason`; the code stays the
/// `not-found` clients map.
#[test]
fn a_wrong_method_and_a_missing_route_name_their_failure() {
    let daemon = Daemon::start(&[]);
    let wrong = refused(daemon.call("DELETE", "/v1/journal", None), 405, "method");
    assert_eq!(
        (
            wrong.json()["code"].as_str(),
            wrong.json()["reason"].as_str()
        ),
        (Some("not-found"), Some("method-not-allowed"))
    );
    let missing = refused(
        daemon.call("GET", "/v1/no-such-thing", None),
        404,
        "no such endpoint",
    );
    assert_eq!(
        (
            missing.json()["code"].as_str(),
            missing.json()["reason"].as_str()
        ),
        (Some("not-found"), Some("no-such-endpoint"))
    );
}

/// Endpoints that take no query parameters refuse one by name, as those that take some do,
/// rather than ignore it.
#[test]
fn query_parameters_an_endpoint_does_not_take_are_refused_by_name() {
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("noquery"), json!({}));
    for path in [
        "/v1/agents?bogus=1".to_owned(),
        format!("/v1/cells/{cell}/processes?bogus=1"),
        format!("/v1/cells/{cell}/processes/1/wait?bogus=1"),
        "/v1/agents/nobody/wait?bogus=1".to_owned(),
    ] {
        refused(daemon.call("GET", &path, None), 400, "bogus");
    }
    for path in [
        "/v1/agents".to_owned(),
        format!("/v1/cells/{cell}/processes"),
    ] {
        assert_eq!(daemon.call("GET", &path, None).status, 200, "{path}");
    }
}

/// An empty `cwd` is refused, with what to do, before anything runs.
#[test]
fn an_empty_cwd_is_refused_before_anything_runs() {
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("emptycwd"), json!({}));
    refused(
        daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": ["true"], "cwd": "" })),
        ),
        400,
        "`cwd` is empty",
    );
}

/// A journal query whose time window ends before it starts is refused: it could hold nothing.
#[test]
fn a_journal_window_that_ends_before_it_starts_is_refused() {
    let daemon = Daemon::start(&[]);
    refused(
        daemon.call("GET", "/v1/journal?since_ms=10&until_ms=5", None),
        400,
        "since_ms 10 is after until_ms 5",
    );
    assert_eq!(
        daemon
            .call("GET", "/v1/journal?since_ms=5&until_ms=10", None)
            .status,
        200
    );
}

/// A body that begins with a UTF-8 byte-order mark says so, not "expected value".
#[test]
fn a_body_with_a_byte_order_mark_says_so() {
    let daemon = Daemon::start(&[]);
    refused(
        daemon.request("POST", "/v1/cells", Some("\u{feff}{}")),
        400,
        "byte-order mark",
    );
}

/// A huge name (or other text a request sent) is echoed cut, with its length, not whole.
#[test]
fn a_huge_name_is_not_echoed_whole() {
    let daemon = Daemon::start(&[]);
    let name = "n".repeat(100_000);
    let cut = format!("`{}... (100000 bytes)`", "n".repeat(256));
    let made = refused(
        daemon.call("POST", "/v1/cells", Some(json!({ "name": name }))),
        400,
        &cut,
    );
    assert!(made.body.len() < 2000, "{} bytes", made.body.len());
    let name = "m".repeat(10_000);
    let missing = refused(
        daemon.call("GET", &format!("/v1/cells/{name}"), None),
        404,
        &format!("`{}... (10000 bytes)`", "m".repeat(256)),
    );
    assert!(missing.body.len() < 2000, "{} bytes", missing.body.len());
}
