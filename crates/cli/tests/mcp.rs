//! The MCP face end to end, driven by the official Python `mcp` package (`mcp_client.py`): over
//! stdio with the core in `warden mcp` itself, over stdio through a running daemon, and over the
//! daemon's streamable HTTP, each in the current protocol (2026-07-28, stateless) and the one
//! before (2025-11-25, with a session). Real cells behind every call; the journal read back; a
//! cancelled call and an ended session must kill the command they ran (the client looks for it
//! among the host's processes).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::{Read as _, Write as _};
use std::path::Path;
use std::process::Command;

use serde_json::Value;
use support::daemon::Daemon;
use support::*;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp_client.py");

/// A host directory for a cell's workspace, with one file in it.
fn workspace() -> TestDir {
    let dir = tempdir();
    std::fs::write(dir.path().join("notes.txt"), "from the host\n").unwrap();
    dir
}

/// Runs the Python client's `scenario` in `mode`; fails the test with its output unless it
/// printed `ok`.
fn client(scenario: &str, mode: &str, envs: &[(&str, &Path)], vars: &[(&str, &str)]) {
    let out = Command::new("python3")
        .args([CLIENT, scenario, mode])
        .env("WARDEN", BIN)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .envs(vars.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'mcp'"),
        "the `mcp` package is missing: `pip install mcp==2.3.0` (.ci/run installs it)"
    );
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "{scenario} ({mode}) failed: {}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
}

/// The journal's entries about `cell`.
fn entries(journal: &Path, cell: &str) -> Vec<Value> {
    std::fs::read_to_string(journal)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["cell"] == cell)
        .collect()
}

fn kinds(entries: &[Value]) -> Vec<String> {
    entries
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect()
}

fn assert_journaled(journal: &Path, cell: &str, by: &str) {
    let entries = entries(journal, cell);
    let kinds = kinds(&entries);
    for kind in [
        "cell.create",
        "exec.start",
        "exec.exit",
        "exec.denied",
        "approval.ask",
        "approval.answer",
        "file.read",
        "file.write",
        "workspace.snapshot",
        "workspace.snapshot.remove",
        "cell.kill",
        "cell.end",
    ] {
        assert!(kinds.iter().any(|k| k == kind), "no {kind} in {kinds:?}");
    }
    let who: Vec<&str> = entries
        .iter()
        .filter_map(|e| e["data"]["by"].as_str())
        .collect();
    assert!(
        who.iter().any(|w| w.contains(by)),
        "nobody named `{by}` in the journal: {who:?}"
    );
}

#[test]
fn mcp_over_stdio_without_a_daemon_runs_the_core_in_warden_mcp() {
    for mode in ["auto", "legacy"] {
        let dir = tempdir();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap();
        let (runtime, state) = (dir.path().join("run"), dir.path().join("state"));
        let ws = workspace();
        let cell = unique("mcp-core");
        client(
            "stdio-core",
            mode,
            &[
                ("WARDEN_RUNTIME_DIR", &runtime),
                ("WARDEN_STATE_DIR", &state),
                ("WORKSPACE", ws.path()),
            ],
            &[("CELL", &cell)],
        );
        let journal = state.join("journal/journal.jsonl");
        assert_journaled(&journal, &cell, "warden mcp (uid");
        // The chain the session left verifies.
        let verify = warden()
            .env("WARDEN_RUNTIME_DIR", &runtime)
            .env("WARDEN_STATE_DIR", &state)
            .args(["audit", "verify"])
            .output()
            .unwrap();
        assert!(verify.status.success(), "{verify:?}");
        // Nothing of the cell went to the host without an apply.
        assert!(!ws.path().join("new.txt").exists());
        // A cancelled call kills its command; so does a session ended in the middle of one.
        client(
            "cancel-core",
            mode,
            &[
                ("WARDEN_RUNTIME_DIR", &runtime),
                ("WARDEN_STATE_DIR", &state),
            ],
            &[("CELL", &unique("mcp-cancel"))],
        );
        // The core's cells outlive it by design: ended and removed here, with their layers
        // (and so their file systems' mounts).
        for args in [["kill", cell.as_str()], ["rm", cell.as_str()]] {
            let _ = warden()
                .env("WARDEN_RUNTIME_DIR", &runtime)
                .env("WARDEN_STATE_DIR", &state)
                .args(args)
                .output();
        }
    }
}

#[test]
fn mcp_over_stdio_goes_through_a_running_daemon() {
    let daemon = Daemon::start(&[]);
    let ws = workspace();
    for mode in ["auto", "legacy"] {
        let cell = unique("mcp-daemon");
        client(
            "stdio-daemon",
            mode,
            &[
                ("WARDEN_RUNTIME_DIR", daemon.runtime()),
                ("WARDEN_STATE_DIR", daemon.state()),
                ("WORKSPACE", ws.path()),
            ],
            &[("CELL", &cell)],
        );
        assert_journaled(&daemon.journal(), &cell, "through `warden mcp`");
        // The cell was the daemon's: it still knows it after the session.
        let info = daemon.call("GET", &format!("/v1/cells/{cell}"), None);
        assert_eq!(info.status, 200, "{}", String::from_utf8_lossy(&info.body));
        assert_eq!(info.json()["state"], "ended");
        client(
            "cancel-daemon",
            mode,
            &[
                ("WARDEN_RUNTIME_DIR", daemon.runtime()),
                ("WARDEN_STATE_DIR", daemon.state()),
            ],
            &[("CELL", &unique("mcp-cancel"))],
        );
    }
    daemon.assert_journal_verifies();
}

#[test]
fn mcp_over_http_streams_and_answers_only_the_token_and_loopback_hosts() {
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let addr = std::fs::read_to_string(daemon.runtime().join("daemon.addr")).unwrap();
    let token = std::fs::read_to_string(daemon.runtime().join("daemon.token")).unwrap();
    let token = token.trim();
    let ws = workspace();
    for mode in ["auto", "legacy"] {
        let cell = unique("mcp-http");
        client(
            "http",
            mode,
            &[("WORKSPACE", ws.path())],
            &[("CELL", &cell), ("ADDR", &addr), ("TOKEN", token)],
        );
        assert_journaled(&daemon.journal(), &cell, "the bearer token, over TCP");
        client(
            "cancel-http",
            mode,
            &[],
            &[
                ("CELL", &unique("mcp-cancel")),
                ("ADDR", &addr),
                ("TOKEN", token),
            ],
        );
    }
    let list = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}"#;
    let post = |host: &str, auth: Option<&str>| -> String {
        let mut tcp = std::net::TcpStream::connect(&addr).unwrap();
        let auth = auth
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        write!(
            tcp,
            "POST /mcp HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2025-11-25\r\n\
             Connection: close\r\nContent-Length: {}\r\n\r\n{list}",
            list.len()
        )
        .unwrap();
        let mut answer = String::new();
        tcp.read_to_string(&mut answer).unwrap();
        answer
    };
    // No token, or another's: refused before the MCP layer sees the request.
    assert!(post(&addr, None).starts_with("HTTP/1.1 401"));
    assert!(post(&addr, Some("not-the-token-at-all")).starts_with("HTTP/1.1 401"));
    // The token, but a name a web page could have rebound to loopback: refused.
    let rebound = post("attacker.example", Some(token));
    assert!(
        rebound.starts_with("HTTP/1.1 4"),
        "a foreign Host was answered: {rebound}"
    );
    assert!(!rebound.contains("create_cell"), "{rebound}");
    // The upgrade endpoint of `warden mcp` says what it is for when asked plainly.
    let plain = daemon.call("GET", "/v1/mcp", None);
    assert_eq!(plain.status, 400);
    let body = String::from_utf8_lossy(&plain.body);
    assert!(body.contains("/mcp"), "{body}");
    daemon.assert_journal_verifies();
}

#[test]
fn an_edit_or_a_write_past_the_write_limit_is_refused_and_the_daemon_lives() {
    // The daemon's address space bounded (4 GiB): an edit that asked for more of it than that
    // (one letter of a cell's 16 MiB file replaced by 257 bytes throughout) ended the daemon.
    let daemon = Daemon::start_wrapped_with(
        &["prlimit", "--as=4294967296", "--"],
        &["--listen", "127.0.0.1:0"],
    );
    let addr = std::fs::read_to_string(daemon.runtime().join("daemon.addr")).unwrap();
    let token = std::fs::read_to_string(daemon.runtime().join("daemon.token")).unwrap();
    client(
        "limits",
        "auto",
        &[
            ("WARDEN_RUNTIME_DIR", daemon.runtime()),
            ("WARDEN_STATE_DIR", daemon.state()),
        ],
        &[
            ("CELL", &unique("mcp-limits")),
            ("ADDR", &addr),
            ("TOKEN", token.trim()),
        ],
    );
    // Still there, and answering.
    assert_eq!(daemon.call("GET", "/v1/cells", None).status, 200);
    daemon.assert_journal_verifies();
}

#[test]
fn a_daemon_started_beside_a_warden_mcp_without_one_says_who_holds_the_state() {
    let dir = tempdir();
    let (runtime, state) = (dir.path().join("run"), dir.path().join("state"));
    let mut mcp = warden()
        .env("WARDEN_RUNTIME_DIR", &runtime)
        .env("WARDEN_STATE_DIR", &state)
        .arg("mcp")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Until it holds the state.
    let held = state.join("daemon/state.redb");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !held.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let serve = warden()
        .env("WARDEN_RUNTIME_DIR", &runtime)
        .env("WARDEN_STATE_DIR", &state)
        .arg("serve")
        .output()
        .unwrap();
    drop(mcp.stdin.take());
    let _ = mcp.wait();
    assert_eq!(serve.status.code(), Some(125), "{serve:?}");
    let stderr = String::from_utf8_lossy(&serve.stderr);
    assert!(
        stderr.contains("another warden holds the state") && stderr.contains("warden mcp"),
        "{stderr}"
    );
}

/// `warden mcp` through a daemon that goes away while the client still has the session open
/// ends, saying so: it had waited on the client's stdin for good, and the client on answers
/// that could never come.
#[test]
fn warden_mcp_ends_when_its_daemon_goes_away() {
    use std::io::{BufRead as _, Write as _};
    let mut daemon = Daemon::start(&[]);
    let mut mcp = daemon
        .warden()
        .arg("mcp")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = mcp.stdin.take().unwrap();
    writeln!(
        stdin,
        r#"{{"jsonrpc":"2.0","id":1,"method":"initialize","params":{{"protocolVersion":"2025-06-18","capabilities":{{}},"clientInfo":{{"name":"t","version":"1"}}}}}}"#
    )
    .unwrap();
    let mut answer = String::new();
    std::io::BufReader::new(mcp.stdout.take().unwrap())
        .read_line(&mut answer)
        .unwrap();
    assert!(answer.contains("\"id\":1"), "{answer}");
    daemon.crash();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = mcp.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = mcp.kill();
            panic!("warden mcp still waits 10 s after its daemon went away");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut mcp.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_ne!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("ended the MCP session"), "{stderr}");
    drop(stdin);
}

/// A raw POST to the daemon's `/mcp` (protocol 2026-07-28, stateless): status and body.
fn mcp_post(addr: &str, token: &str, method: &str, body: &[u8]) -> (u16, String) {
    // `tools/call` names its tool in a header too.
    let (method, name) = method.split_once(' ').unwrap_or((method, ""));
    let name = if name.is_empty() {
        String::new()
    } else {
        format!("Mcp-Name: {name}\r\n")
    };
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n\
         MCP-Protocol-Version: 2026-07-28\r\nMcp-Method: {method}\r\n{name}"
    );
    raw_http(addr, &head, body)
}

/// A `tools/call` of `name` as JSON-RPC, with the `_meta` of protocol 2026-07-28.
fn call_tool(name: &str, arguments: Value) -> Vec<u8> {
    serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {
            "name": name, "arguments": arguments,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            },
        },
    })
    .to_string()
    .into_bytes()
}

#[test]
fn bodies_that_are_no_jsonrpc_and_oversized_arguments_get_clear_errors() {
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let addr = std::fs::read_to_string(daemon.runtime().join("daemon.addr")).unwrap();
    let token = std::fs::read_to_string(daemon.runtime().join("daemon.token")).unwrap();
    let token = token.trim();
    // What is no JSON-RPC request is a JSON-RPC error, not a 415 in plain text.
    for (body, code, says) in [
        (&b"{{{"[..], -32700, "not JSON"),
        (b"\xff\xfe", -32700, "not JSON"),
        (b"[]", -32600, "batches"),
        (
            br#"{"jsonrpc":"2.0","id":{"a":1},"method":"tools/list"}"#,
            -32600,
            "an `id` that is a string or a whole number",
        ),
    ] {
        let (status, answer) = mcp_post(&addr, token, "tools/list", body);
        assert_eq!(status, 400, "{body:?}: {answer}");
        let answer: Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("{body:?}: not JSON ({e}): {answer}"));
        assert_eq!(answer["jsonrpc"], "2.0", "{answer}");
        assert_eq!(answer["error"]["code"], code, "{body:?}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body:?}: {answer}");
    }
    // A method this server has not, or one whose params cannot be read: which, and what to
    // send (the MCP layer's answer was the method's name alone).
    let mut odd = serde_json::from_slice::<Value>(&call_tool("exec", Value::Null)).unwrap();
    odd["params"]["arguments"] = Value::from("not an object");
    let mut unknown = odd.clone();
    unknown["method"] = Value::from("no/such");
    for (method, body) in [
        ("tools/call exec", odd.to_string()),
        ("no/such", unknown.to_string()),
    ] {
        let (_, answer) = mcp_post(&addr, token, method, body.as_bytes());
        let answer: Value = serde_json::from_str(&answer).unwrap();
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("`params`") && message.contains("tools/list"),
            "{method}: {answer}"
        );
    }
    let (status, answer) = mcp_post(&addr, token, "tools/list", &vec![b' '; 5 << 20]);
    assert_eq!(status, 413, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("files route"),
        "{answer}"
    );
    // A command line or a path longer than reaches the cell: a bad request that says why, not
    // the socket's "Message too long" as if the cell were in the wrong state.
    let cell = daemon.create(&unique("mcp-big"), serde_json::json!({}));
    let command = format!("echo {}", "x".repeat(300 << 10));
    let path = "d/".repeat(150 << 10);
    for (tool, arguments, says) in [
        (
            "exec",
            serde_json::json!({ "cell": cell, "command": command }),
            "an exec takes",
        ),
        (
            "read_file",
            serde_json::json!({ "cell": cell, "path": path }),
            "a path may be",
        ),
    ] {
        let method = format!("tools/call {tool}");
        let (status, answer) = mcp_post(&addr, token, &method, &call_tool(tool, arguments));
        assert_eq!(status, 200, "{tool}: {answer}");
        assert!(
            answer.contains("refused (bad-request)") && answer.contains(says),
            "{tool}: {}",
            &answer[..answer.len().min(2000)]
        );
        assert!(!answer.contains("Message too long"), "{tool}: {answer}");
    }
    assert_eq!(daemon.call("GET", "/v1/health", None).status, 200);
}
