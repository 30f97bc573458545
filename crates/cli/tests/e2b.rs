//! The E2B-compatible API end to end: the real `e2b` SDK, both generations (2.31.0, which
//! `openai-agents[e2b]` pins, and 2.63.0), pointed at `warden serve --e2b` by its environment
//! variables only, sync and async (`e2b_client.py`); the journal read back; and the refusals
//! a stranger gets.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use support::daemon::Daemon;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b_client.py");
const SDKS: [&str; 2] = ["2.31.0", "2.63.0"];

/// Where `.ci/run` installs each SDK version (`pip install --target`).
fn sdk(version: &str) -> PathBuf {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/pydeps"))
        .join(format!("e2b-{version}"));
    assert!(
        dir.join("e2b").is_dir(),
        "the e2b SDK {version} is not installed: `python3 -m pip install --target {} e2b=={version}` (.ci/run does it)",
        dir.display()
    );
    dir
}

struct E2b {
    daemon: Daemon,
    addr: String,
    key: String,
}

fn start() -> E2b {
    start_with(&[])
}

fn start_with(extra: &[&str]) -> E2b {
    let args: Vec<&str> = ["--e2b", "127.0.0.1:0"]
        .iter()
        .chain(extra)
        .copied()
        .collect();
    let daemon = Daemon::start(&args);
    let addr = std::fs::read_to_string(daemon.runtime().join("e2b.addr")).unwrap();
    let key = std::fs::read_to_string(daemon.runtime().join("e2b.key")).unwrap();
    E2b { daemon, addr, key }
}

/// Runs a flow of the client with one SDK version; returns the sandbox it used.
fn flow(e2b: &E2b, version: &str, which: &str) -> String {
    let out = Command::new("python3")
        .args([CLIENT, which])
        .env("PYTHONPATH", sdk(version))
        .env("E2B_API_URL", format!("http://{}", e2b.addr))
        .env("E2B_SANDBOX_URL", format!("http://{}", e2b.addr))
        .env("E2B_API_KEY", &e2b.key)
        .env_remove("E2B_DOMAIN")
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.lines().any(|l| l.starts_with("ok")),
        "{which} with e2b {version} failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("sandbox "))
        .unwrap()
        .to_owned()
}

fn kinds(e2b: &E2b, cell: &str) -> Vec<String> {
    std::fs::read_to_string(e2b.daemon.journal())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["cell"] == cell)
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn the_e2b_sdk_of_both_generations_works_unmodified_and_the_journal_shows_every_effect() {
    let e2b = start();
    for version in SDKS {
        let id = flow(&e2b, version, "sync");
        let kinds = kinds(&e2b, &id);
        for kind in [
            "cell.create",
            "exec.start",
            "exec.exit",
            "exec.stdin",
            "exec.signal",
            "file.write",
            "file.read",
            "file.remove",
            "file.mkdir",
            "cell.kill",
            "cell.delete",
        ] {
            assert!(
                kinds.iter().any(|k| k == kind),
                "e2b {version}: no {kind} for {id} in {kinds:?}"
            );
        }
        let id = flow(&e2b, version, "async");
        assert!(
            kinds_of_delete(&e2b, &id),
            "e2b {version}: {id} was deleted"
        );
    }
    e2b.daemon.assert_journal_verifies();
}

fn kinds_of_delete(e2b: &E2b, id: &str) -> bool {
    kinds(e2b, id).iter().any(|k| k == "cell.delete")
}

#[test]
fn a_sandbox_past_its_timeout_is_gone() {
    // With a sandbox of the template made ahead, which the SDK's create takes.
    let e2b = start_with(&["--pool", "e2b:base=1"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while e2b.daemon.call("GET", "/v1/pools", None).json()[0]["ready"] != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool made no cell"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let id = flow(&e2b, "2.63.0", "timeout");
    let created: Value = std::fs::read_to_string(e2b.daemon.journal())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["cell"] == id.as_str() && e["kind"] == "cell.create")
        .unwrap();
    assert_eq!(created["data"]["pooled"], true, "{created}");
    // Past its timeout the sandbox is deleted: journaled, and gone from the list (the entry
    // is in the journal's file a moment before the list lets go of it).
    let listed = || {
        let cells = e2b.daemon.call("GET", "/v1/cells", None).json();
        cells.as_array().unwrap().iter().any(|c| c["name"] == id)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while (!kinds_of_delete(&e2b, &id) || listed()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let kinds = kinds(&e2b, &id);
    assert!(kinds.iter().any(|k| k == "cell.delete"), "{kinds:?}");
    assert!(!listed(), "the deleted sandbox is still listed");
}

/// A raw request to the E2B listener; its status line and body.
fn raw(e2b: &E2b, request: &str) -> (String, String) {
    raw_at(&e2b.addr, request)
}

fn raw_at(addr: &str, request: &str) -> (String, String) {
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    )
}

fn post(path: &str, headers: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// A sandbox made through the control plane's REST route with `timeout` seconds: its id and
/// envd access token.
fn sandbox(e2b: &E2b, timeout: u64) -> (String, String) {
    let key = format!("X-API-KEY: {}\r\n", e2b.key);
    let body = format!(r#"{{"timeout":{timeout}}}"#);
    let (status, body) = raw(e2b, &post("/v2/sandboxes", &key, &body));
    assert!(status.contains(" 201 "), "{status} {body}");
    let sandbox: Value = serde_json::from_str(&body).unwrap();
    (
        sandbox["sandboxID"].as_str().unwrap().to_owned(),
        sandbox["envdAccessToken"].as_str().unwrap().to_owned(),
    )
}

#[test]
fn strangers_and_unsupported_calls_get_clear_refusals() {
    let e2b = start();
    let key = format!("X-API-KEY: {}\r\n", e2b.key);
    // No key, a wrong key: refused, and nothing is made.
    let (status, body) = raw(&e2b, &post("/v2/sandboxes", "", "{}"));
    assert!(status.contains(" 401 "), "{status} {body}");
    assert!(body.contains("e2b.key"), "{body}");
    let wrong = "X-API-KEY: e2b_0000000000000000000000000000000000000000\r\n";
    let (status, _) = raw(&e2b, &post("/sandboxes", wrong, "{}"));
    assert!(status.contains(" 401 "), "{status}");
    let cells = e2b.daemon.call("GET", "/v1/cells", None).json();
    assert_eq!(cells.as_array().unwrap().len(), 0, "{cells}");
    // A template that is no preset: the known ones are named.
    let (status, body) = raw(
        &e2b,
        &post("/v2/sandboxes", &key, r#"{"templateID":"no-such-image"}"#),
    );
    assert!(status.contains(" 400 "), "{status} {body}");
    assert!(body.contains("base") && body.contains("python"), "{body}");
    // A sandbox, then envd calls without its token, or with another's.
    let (id, token) = sandbox(&e2b, 60);
    let list = r#"{"path":"/home/user","depth":1}"#;
    for headers in [
        format!("E2b-Sandbox-Id: {id}\r\n"),
        format!("E2b-Sandbox-Id: {id}\r\nX-Access-Token: not-{token}\r\n"),
        format!("E2b-Sandbox-Id: {id}\r\n{key}"),
    ] {
        let (status, body) = raw(
            &e2b,
            &post("/filesystem.Filesystem/ListDir", &headers, list),
        );
        assert!(status.contains(" 401 "), "{headers:?}: {status} {body}");
    }
    let envd = format!("E2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\n");
    let (status, body) = raw(&e2b, &post("/filesystem.Filesystem/ListDir", &envd, list));
    assert!(status.contains(" 200 "), "{status} {body}");
    // What is not supported says so, by name.
    let (status, body) = raw(&e2b, &post("/process.Process/StreamInput", &envd, "{}"));
    assert!(status.contains(" 501 "), "{status}");
    assert!(
        body.contains("unimplemented") && body.contains("StreamInput"),
        "{body}"
    );
    // Watchers: a sandbox's own, a bounded number of them, and gone once removed.
    let (status, body) = raw(
        &e2b,
        &post(
            "/filesystem.Filesystem/CreateWatcher",
            &envd,
            r#"{"path":"/home/user"}"#,
        ),
    );
    assert!(status.contains(" 200 "), "{status} {body}");
    let watcher: Value = serde_json::from_str(&body).unwrap();
    let wid = watcher["watcherId"].as_str().unwrap().to_owned();
    let remove = format!(r#"{{"watcherId":"{wid}"}}"#);
    let (status, _) = raw(
        &e2b,
        &post("/filesystem.Filesystem/RemoveWatcher", &envd, &remove),
    );
    assert!(status.contains(" 200 "), "{status}");
    let (status, _) = raw(
        &e2b,
        &post("/filesystem.Filesystem/GetWatcherEvents", &envd, &remove),
    );
    assert!(status.contains(" 404 "), "{status}");
    for i in 0.. {
        let (status, body) = raw(
            &e2b,
            &post(
                "/filesystem.Filesystem/CreateWatcher",
                &envd,
                r#"{"path":"."}"#,
            ),
        );
        if !status.contains(" 200 ") {
            assert!(
                body.contains("resource_exhausted") && i == 64,
                "{i}: {status} {body}"
            );
            break;
        }
    }
    let (status, body) = raw(
        &e2b,
        &post(&format!("/sandboxes/{id}/snapshots"), &key, "{}"),
    );
    assert!(status.contains(" 501 "), "{status}");
    assert!(
        body.contains("/snapshots") && body.contains("not supported"),
        "{body}"
    );
    // A malformed stream request ends its stream with an error, not a hang.
    let (status, body) = raw(&e2b, &post("/process.Process/Start", &envd, "{}"));
    assert!(status.contains(" 200 "), "{status}");
    assert!(body.contains("invalid_argument"), "{body}");
    // Cells the daemon made for others are not the E2B API's to see or end.
    let other = e2b
        .daemon
        .create(&support::unique("not-e2b"), serde_json::json!({}));
    let (status, _) = raw(
        &e2b,
        &format!("GET /sandboxes/{other} HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n"),
    );
    assert!(status.contains(" 404 "), "{status}");
    let (status, _) = raw(
        &e2b,
        &format!("DELETE /sandboxes/{other} HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n"),
    );
    assert!(status.contains(" 404 "), "{status}");
    let (status, _) = raw(
        &e2b,
        &post(
            "/filesystem.Filesystem/ListDir",
            &format!("E2b-Sandbox-Id: {other}\r\nX-Access-Token: {token}\r\n"),
            list,
        ),
    );
    assert!(
        status.contains(" 404 "),
        "another cell by a sandbox's token: {status}"
    );
    let cell = e2b
        .daemon
        .call("GET", &format!("/v1/cells/{other}"), None)
        .json();
    assert_eq!(cell["state"], "running", "{cell}");
    // The sandbox goes with its DELETE; a second is a 404.
    let delete =
        format!("DELETE /sandboxes/{id} HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n");
    assert!(raw(&e2b, &delete).0.contains(" 204 "));
    assert!(raw(&e2b, &delete).0.contains(" 404 "));
}

/// Runs a command through envd's `process.Process/Start` to its end: the stream's status and
/// its envelopes (as text).
fn run(e2b: &E2b, envd: &str, argv: &[&str]) -> (String, String) {
    let start =
        serde_json::json!({ "process": { "cmd": argv[0], "args": &argv[1..] } }).to_string();
    let mut envelope = vec![0u8];
    envelope.extend_from_slice(&(start.len() as u32).to_be_bytes());
    envelope.extend_from_slice(start.as_bytes());
    let request = format!(
        "POST /process.Process/Start HTTP/1.1\r\nHost: x\r\n{envd}Content-Type: application/connect+json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
        envelope.len(),
        String::from_utf8(envelope).unwrap()
    );
    raw(e2b, &request)
}

#[test]
fn a_listing_answers_at_most_its_limit_of_entries() {
    let e2b = start();
    let (id, token) = sandbox(&e2b, 120);
    let envd = format!("E2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\n");
    // The cell makes 120,000 entries in three directories: each answers whole, all three to
    // depth 2 are more than one listing answers (the daemon held them all at once).
    let make =
        "for d in 0 1 2; do mkdir t$d && (cd t$d && seq 40000 | xargs touch) || exit 1; done";
    let (status, body) = run(&e2b, &envd, &["sh", "-c", make]);
    assert!(
        status.contains(" 200 ") && body.contains("exit status 0"),
        "{status} {body}"
    );
    let list = |path: &str, depth: u32| {
        let body = format!(r#"{{"path":"{path}","depth":{depth}}}"#);
        raw(&e2b, &post("/filesystem.Filesystem/ListDir", &envd, &body))
    };
    let (status, body) = list("/home/user/t0", 1);
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(body.matches("\"name\"").count(), 40_000);
    let (status, body) = list("/home/user", 2);
    assert!(
        status.contains(" 429 ")
            && body.contains("resource_exhausted")
            && body.contains("more than 100000 entries to depth 2")
            && body.contains("a smaller depth"),
        "{status} {}",
        &body[..body.len().min(300)]
    );
    // The sandbox goes on answering.
    let (status, body) = list("/home/user", 1);
    assert!(
        status.contains(" 200 ") && body.contains("t2"),
        "{status} {body}"
    );
}

#[test]
fn an_upload_refused_for_one_of_its_files_writes_none() {
    let e2b = start();
    let (id, token) = sandbox(&e2b, 120);
    let envd = format!("E2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\n");
    // Several files in one upload (the SDK's `write_files`), the last one out of bounds.
    for (bad, refusal) in [("/etc/passwd", " 403 "), ("sub/../../x", " 400 ")] {
        let mut body = String::new();
        for (name, content) in [
            ("first.txt", "one"),
            ("dir/second.txt", "two"),
            (bad, "three"),
        ] {
            body.push_str(&format!(
                "--BOUNDARY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n{content}\r\n"
            ));
        }
        body.push_str("--BOUNDARY--\r\n");
        let request = format!(
            "POST /files HTTP/1.1\r\nHost: x\r\n{envd}Content-Type: multipart/form-data; boundary=BOUNDARY\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let (status, answer) = raw(&e2b, &request);
        assert!(status.contains(refusal), "{bad}: {status} {answer}");
        let (_, listing) = raw(
            &e2b,
            &post(
                "/filesystem.Filesystem/ListDir",
                &envd,
                r#"{"path":"/home/user","depth":2}"#,
            ),
        );
        assert!(
            !listing.contains("first.txt") && !listing.contains(r#""name":"dir""#),
            "{bad}: a refused upload wrote {listing}"
        );
        assert!(
            answer.contains("nothing of the upload was written"),
            "{answer}"
        );
    }
}

#[test]
fn a_sandbox_whose_cell_was_deleted_reaches_no_cell_that_takes_its_name() {
    let e2b = start();
    let key = format!("X-API-KEY: {}\r\n", e2b.key);
    // One sandbox for its token, one for its timeout. Each cell is deleted through the
    // daemon's own API, and a cell of someone else's made under its name.
    let (id, token) = sandbox(&e2b, 120);
    let (short, _) = sandbox(&e2b, 2);
    let made = std::time::Instant::now();
    for name in [&id, &short] {
        let deleted = e2b
            .daemon
            .call("DELETE", &format!("/v1/cells/{name}"), None);
        assert_eq!(
            deleted.status,
            204,
            "{}",
            String::from_utf8_lossy(&deleted.body)
        );
        e2b.daemon.create(name, serde_json::json!({}));
    }
    // The short sandbox's timeout ends nothing: the cell of its name is not its own (the
    // reaper looks every 500 ms).
    let state = |name: &str| {
        e2b.daemon
            .call("GET", &format!("/v1/cells/{name}"), None)
            .json()["state"]
            .clone()
    };
    while made.elapsed() < std::time::Duration::from_secs(4) {
        assert_eq!(
            state(&short),
            "running",
            "the sandbox's timeout ended another's cell"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The old token reaches neither the new cell's files nor its commands.
    let envd = format!("E2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\n");
    for (path, body) in [
        (
            "/filesystem.Filesystem/ListDir",
            r#"{"path":"/home/user","depth":1}"#,
        ),
        (
            "/filesystem.Filesystem/MakeDir",
            r#"{"path":"/home/user/planted"}"#,
        ),
    ] {
        let (status, body) = raw(&e2b, &post(path, &envd, body));
        assert!(
            status.contains(" 404 ") && body.contains("no sandbox"),
            "{path} by a deleted sandbox's token: {status} {body}"
        );
    }
    let (status, body) = run(&e2b, &envd, &["touch", "ran"]);
    assert!(
        status.contains(" 404 "),
        "a command by a deleted sandbox's token: {status} {body}"
    );
    let listed = e2b
        .daemon
        .call("GET", &format!("/v1/cells/{id}/files/list?path=."), None);
    let listing = String::from_utf8_lossy(&listed.body);
    assert!(
        listed.status == 200 && !listing.contains("planted") && !listing.contains("\"ran\""),
        "{listing}"
    );
    // Neither is a sandbox any more, for the key holder either.
    for name in [&id, &short] {
        let get =
            format!("GET /sandboxes/{name} HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n");
        assert!(raw(&e2b, &get).0.contains(" 404 "), "{name}");
    }
    let (_, list) = raw(
        &e2b,
        &format!("GET /sandboxes HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n"),
    );
    assert_eq!(list.trim(), "[]", "{list}");
    for name in [&id, &short] {
        assert_eq!(state(name), "running", "{name}");
    }
}

/// Reads one answer from a kept-alive connection; its status, or `None` where the connection
/// ended (or stayed silent) first.
fn status_of_answer(tcp: &mut std::net::TcpStream) -> Option<u16> {
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |n| n.trim().parse().unwrap());
            if raw.len() >= end + 4 + length {
                return head.split(' ').nth(1)?.parse().ok();
            }
        }
        match tcp.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
}

#[test]
fn strangers_answered_404_cannot_lock_the_key_holder_out() {
    // Few descriptors: the listener admits a quarter of them, 25 connections.
    let daemon = Daemon::start_wrapped_with(
        &["prlimit", "--nofile=100", "--"],
        &["--e2b", "127.0.0.1:0"],
    );
    let addr = std::fs::read_to_string(daemon.runtime().join("e2b.addr")).unwrap();
    let key = std::fs::read_to_string(daemon.runtime().join("e2b.key")).unwrap();
    // Strangers without a key, on kept-alive connections, whose requests are answered 404: a
    // sandbox nobody made on an envd path, and a route there is none of.
    let mut strangers = Vec::new();
    let mut answers = Vec::new();
    for i in 0..60 {
        let mut tcp = std::net::TcpStream::connect(&addr).unwrap();
        let path = if i % 2 == 0 {
            "/health"
        } else {
            "/process.Process/NoSuchCall/at/all"
        };
        // A connection the listener had no room for may be closed before the request is sent.
        let sent = write!(
            tcp,
            "GET {path} HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: nope\r\n\r\n"
        );
        let answer = sent.ok().and_then(|()| status_of_answer(&mut tcp));
        answers.push((path, answer));
        strangers.push(tcp);
    }
    // The key holder still gets in, at once.
    let begun = std::time::Instant::now();
    let mut tcp = std::net::TcpStream::connect(&addr).unwrap();
    let sent = write!(
        tcp,
        "GET /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-KEY: {key}\r\n\r\n"
    );
    let status = sent.ok().and_then(|()| status_of_answer(&mut tcp));
    let waited = begun.elapsed();
    assert_eq!(
        status,
        Some(200),
        "the key holder was locked out by {} strangers: {answers:?}",
        strangers.len()
    );
    assert!(waited < std::time::Duration::from_secs(2), "{waited:?}");
    // Each stranger was answered, and answered 404: none of them was refused room.
    for (path, answer) in &answers {
        assert_eq!(*answer, Some(404), "{path}: {answers:?}");
    }
    drop(strangers);
}

#[test]
fn the_e2b_api_listens_on_loopback_only() {
    let dir = support::tempdir();
    let out = support::warden()
        .env("WARDEN_RUNTIME_DIR", dir.path().join("run"))
        .env("WARDEN_STATE_DIR", dir.path().join("state"))
        .args(["serve", "--e2b", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("loopback"), "{stderr}");
}

#[test]
fn sandboxes_outlive_a_daemon_crash_and_their_tokens_go_on_working() {
    let mut e2b = start();
    let key = format!("X-API-KEY: {}\r\n", e2b.key);
    let (status, body) = raw(
        &e2b,
        &post(
            "/v2/sandboxes",
            &key,
            r#"{"timeout":120,"metadata":{"team":"qa"}}"#,
        ),
    );
    assert!(status.contains(" 201 "), "{status} {body}");
    let sandbox: Value = serde_json::from_str(&body).unwrap();
    let id = sandbox["sandboxID"].as_str().unwrap().to_owned();
    let token = sandbox["envdAccessToken"].as_str().unwrap().to_owned();
    let envd = |token: &str| format!("E2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\n");
    let (status, _) = raw(
        &e2b,
        &post(
            "/filesystem.Filesystem/MakeDir",
            &envd(&token),
            r#"{"path":"/home/user/kept"}"#,
        ),
    );
    assert!(status.contains(" 200 "), "{status}");
    // The token is in no label and no journal entry: only its digest is.
    let journal = std::fs::read_to_string(e2b.daemon.journal()).unwrap();
    assert!(!journal.contains(&token));
    e2b.daemon.restart();
    let addr = std::fs::read_to_string(e2b.daemon.runtime().join("e2b.addr")).unwrap();
    let new_key = std::fs::read_to_string(e2b.daemon.runtime().join("e2b.key")).unwrap();
    let key = format!("X-API-KEY: {new_key}\r\n");
    let get = format!("GET /sandboxes/{id} HTTP/1.1\r\nHost: x\r\n{key}Connection: close\r\n\r\n");
    let (status, body) = raw_at(&addr, &get);
    assert!(status.contains(" 200 "), "taken back: {status} {body}");
    let info: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(info["metadata"]["team"], "qa", "{info}");
    assert_eq!(info["state"], "running", "{info}");
    // The old token goes on working; a connect gives a new one, which works too.
    let list = r#"{"path":"/home/user","depth":1}"#;
    let (status, body) = raw_at(
        &addr,
        &post("/filesystem.Filesystem/ListDir", &envd(&token), list),
    );
    assert!(
        status.contains(" 200 ") && body.contains("kept"),
        "{status} {body}"
    );
    let (status, body) = raw_at(
        &addr,
        &post(&format!("/sandboxes/{id}/connect"), &key, "{}"),
    );
    assert!(status.contains(" 200 "), "{status} {body}");
    let again: Value = serde_json::from_str(&body).unwrap();
    let new_token = again["envdAccessToken"].as_str().unwrap();
    assert!(!new_token.is_empty() && new_token != token);
    let (status, _) = raw_at(
        &addr,
        &post("/filesystem.Filesystem/ListDir", &envd(new_token), list),
    );
    assert!(status.contains(" 200 "), "{status}");
    let (status, _) = raw_at(
        &addr,
        &post("/filesystem.Filesystem/ListDir", &envd("not-a-token"), list),
    );
    assert!(status.contains(" 401 "), "{status}");
    e2b.addr = addr;
    e2b.key = new_key;
    let delete = format!(
        "DELETE /sandboxes/{id} HTTP/1.1\r\nHost: x\r\nX-API-KEY: {}\r\nConnection: close\r\n\r\n",
        e2b.key
    );
    assert!(raw(&e2b, &delete).0.contains(" 204 "));
}

/// A raw request of bytes to the E2B listener: its status and body.
fn raw_bytes(e2b: &E2b, head: &str, body: &[u8]) -> (u16, String) {
    support::raw_http(&e2b.addr, &format!("{head}Host: x\r\n"), body)
}

fn connect_envelope(message: &[u8]) -> Vec<u8> {
    let mut envelope = vec![0u8];
    envelope.extend_from_slice(&(message.len() as u32).to_be_bytes());
    envelope.extend_from_slice(message);
    envelope
}

#[test]
fn bad_bodies_envelopes_and_queries_are_refused_in_the_faces_own_shape() {
    let e2b = start();
    let key = format!("X-API-KEY: {}\r\n", e2b.key);
    let (id, token) = sandbox(&e2b, 60);
    let envd = format!("E2b-Sandbox-Id: {id}\r\nX-Access-Token: {token}\r\n");
    let big = vec![b' '; 3 << 20];
    // Bodies over the limit, and a query that cannot be read: the face's JSON errors, not the
    // web framework's plain text.
    for (head, body, code) in [
        (
            format!("POST /v2/sandboxes HTTP/1.1\r\n{key}Content-Type: application/json\r\n"),
            &big[..],
            Value::from(413),
        ),
        (
            format!(
                "POST /filesystem.Filesystem/ListDir HTTP/1.1\r\n{envd}Content-Type: application/json\r\n"
            ),
            &big[..],
            Value::from("resource_exhausted"),
        ),
        (
            format!("GET /files?path=a&path=b HTTP/1.1\r\n{envd}"),
            &b""[..],
            Value::from(400),
        ),
    ] {
        let (status, answer) = raw_bytes(&e2b, &head, body);
        let answer: Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("{head:?}: {status}, not JSON ({e}): {answer}"));
        assert_eq!(answer["code"], code, "{head:?}: {answer}");
        assert!(answer["message"].as_str().is_some(), "{answer}");
    }
    // A template name of 100 KB is not echoed whole.
    let template = serde_json::json!({ "templateID": "x".repeat(100_000) }).to_string();
    let (status, answer) = raw_bytes(
        &e2b,
        &format!("POST /v2/sandboxes HTTP/1.1\r\n{key}Content-Type: application/json\r\n"),
        template.as_bytes(),
    );
    assert_eq!(status, 400, "{}", &answer[..answer.len().min(300)]);
    assert!(
        answer.len() < 1000 && answer.contains("not known here"),
        "{} bytes: {}",
        answer.len(),
        &answer[..answer.len().min(300)]
    );
    // A stream request with bytes after its one envelope, or a command line longer than
    // reaches the cell: `invalid_argument` that says why, not a run that ignored the rest or
    // "Message too long" as if the sandbox were in the wrong state.
    let start = |body: &[u8]| {
        raw_bytes(
            &e2b,
            &format!(
                "POST /process.Process/Start HTTP/1.1\r\n{envd}Content-Type: application/connect+json\r\n"
            ),
            body,
        )
    };
    let echo = br#"{"process":{"cmd":"echo","args":["hi"]}}"#;
    let mut trailing = connect_envelope(echo);
    trailing.extend_from_slice(&connect_envelope(echo));
    let long = serde_json::json!({ "process": { "cmd": "echo", "args": ["x".repeat(300 << 10)] } })
        .to_string();
    for (body, says) in [
        (trailing, "after its one envelope"),
        (connect_envelope(long.as_bytes()), "an exec takes"),
    ] {
        let (status, answer) = start(&body);
        assert_eq!(status, 200, "{answer}");
        assert!(
            answer.contains("invalid_argument") && answer.contains(says),
            "{says}: {answer}"
        );
        assert!(!answer.contains("\"start\""), "{says}: it ran: {answer}");
    }
    assert_eq!(e2b.daemon.call("GET", "/v1/health", None).status, 200);
}
