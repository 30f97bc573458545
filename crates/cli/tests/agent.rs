//! The warden's own agent loop, driven by a scripted model server that speaks the three wire
//! formats (`support::model`): a multi-step task in a cell; pause, say, step, stop; rewind and
//! fork; denied and held tool calls; bad model output, budgets, retries.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::daemon::Daemon;
use support::model::{ModelServer, Step, call};

const KEY: &str = "sk-test-4b1d9a7c2e8f6035";

fn start(daemon: &Daemon, server: &ModelServer, provider: &str, mut body: Value) -> Value {
    body["model"] = format!("{provider}:scripted-1").into();
    body["base_url"] = server.base_url(provider).into();
    body["api_key"] = KEY.into();
    let answer = daemon.call("POST", "/v1/agents", Some(body));
    assert_eq!(
        answer.status,
        201,
        "start: {}",
        String::from_utf8_lossy(&answer.body)
    );
    answer.json()
}

fn info(daemon: &Daemon, id: &str) -> Value {
    daemon.call("GET", &format!("/v1/agents/{id}"), None).json()
}

/// Polls the session until `ready` holds of it.
fn until(daemon: &Daemon, id: &str, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = info(daemon, id);
        if ready(&now) {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "session {id} never got {what}: {now}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn act(daemon: &Daemon, id: &str, action: &str) -> Value {
    let answer = daemon.call(
        "POST",
        &format!("/v1/agents/{id}/{action}"),
        Some(json!({})),
    );
    assert_eq!(
        answer.status,
        200,
        "{action}: {}",
        String::from_utf8_lossy(&answer.body)
    );
    answer.json()
}

fn file(daemon: &Daemon, cell: &str, path: &str) -> Option<String> {
    let answer = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/files/content?path={path}"),
        None,
    );
    (answer.status == 200).then(|| String::from_utf8_lossy(&answer.body).into_owned())
}

fn journal(daemon: &Daemon) -> Vec<Value> {
    std::fs::read_to_string(daemon.journal())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn kinds(daemon: &Daemon, kind: &str, id: &str) -> Vec<Value> {
    journal(daemon)
        .into_iter()
        .filter(|e| e["kind"] == kind && e["data"]["id"] == id)
        .collect()
}

/// The tool results a request carried, in any of the three shapes.
fn results(request: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for m in request["messages"].as_array().into_iter().flatten() {
        if m["role"] == "tool" {
            out.push(m["content"].as_str().unwrap_or("").to_owned());
        }
        for block in m["content"].as_array().into_iter().flatten() {
            if block["type"] == "tool_result" {
                out.push(block["content"].as_str().unwrap_or("").to_owned());
            }
        }
    }
    for item in request["input"].as_array().into_iter().flatten() {
        if item["type"] == "function_call_output" {
            out.push(item["output"].as_str().unwrap_or("").to_owned());
        }
    }
    out
}

/// In each wire format: the model lists, reads, edits, runs and writes over five turns (calls
/// in parallel, arguments in fragments); the result is on the workspace diff, not on the host;
/// the key reached the model server and nowhere else.
#[test]
fn a_scripted_model_carries_out_a_multi_step_task_in_each_wire_format() {
    let daemon = Daemon::start(&[]);
    for provider in ["openai", "openai-responses", "anthropic"] {
        let workspace = tempfile::tempdir().unwrap();
        std::fs::write(workspace.path().join("greet.sh"), "echo helo world\n").unwrap();
        let server = ModelServer::start(vec![
            Step::Calls(vec![
                ("list_dir".into(), "{}".into()),
                ("read_file".into(), json!({"path": "greet.sh"}).to_string()),
            ]),
            call(
                "edit_file",
                json!({"path": "greet.sh", "old_text": "helo", "new_text": "hello"}),
            ),
            call(
                "exec",
                json!({"command": "sh greet.sh > out.txt && cat out.txt"}),
            ),
            call(
                "write_file",
                json!({"path": "notes/summary.md", "content": "fixed the typo\n"}),
            ),
            Step::Text("Fixed the typo in greet.sh.".into()),
        ]);
        let out = daemon
            .warden()
            .args([
                "agent",
                "run",
                "--model",
                &format!("{provider}:scripted-1"),
                "--base-url",
                &server.base_url(provider),
                "--workspace",
            ])
            .arg(workspace.path())
            .arg("fix the typo in greet.sh")
            .env("OPENAI_API_KEY", KEY)
            .env("ANTHROPIC_API_KEY", KEY)
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{provider}: {stdout}\n{stderr}");
        assert!(stdout.contains("Fixed the typo"), "{provider}: {stdout}");
        assert!(
            stderr.contains("-> edit_file"),
            "{provider}: the run shows the calls: {stderr}"
        );
        let requests = server.requests();
        assert_eq!(requests.len(), 5, "{provider}");
        // The parallel calls' results came back, the file's text among them.
        let first = results(&requests[1].body);
        assert_eq!(first.len(), 2, "{provider}: {first:?}");
        assert!(
            first[0].contains("greet.sh") && first[1].contains("echo helo world"),
            "{provider}: {first:?}"
        );
        assert!(
            results(&requests[3].body)
                .iter()
                .any(|r| r.contains("hello world")),
            "{provider}"
        );
        // The key went to the model server, in the provider's header.
        let auth = match provider {
            "anthropic" => {
                assert_eq!(requests[0].header("anthropic-version"), Some("2023-06-01"));
                requests[0].header("x-api-key").map(str::to_owned)
            }
            _ => requests[0].header("authorization").map(str::to_owned),
        };
        assert!(auth.unwrap().ends_with(KEY), "{provider}");
        // The workspace diff holds the work; the host does not, until apply.
        let cell = stderr
            .split("in cell ")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_owned();
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
        assert_eq!(
            paths,
            ["greet.sh", "notes", "notes/summary.md", "out.txt"],
            "{provider}"
        );
        assert_eq!(
            std::fs::read_to_string(workspace.path().join("greet.sh")).unwrap(),
            "echo helo world\n"
        );
        let apply = daemon.warden().args(["apply", &cell]).output().unwrap();
        assert!(
            apply.status.success(),
            "{}",
            String::from_utf8_lossy(&apply.stderr)
        );
        assert_eq!(
            std::fs::read_to_string(workspace.path().join("greet.sh")).unwrap(),
            "echo hello world\n"
        );
        assert_eq!(
            std::fs::read_to_string(workspace.path().join("out.txt")).unwrap(),
            "hello world\n"
        );
        // The journal has every exchange and every call, and never the key.
        let id = cell.clone();
        let models = kinds(&daemon, "agent.model", &id);
        assert_eq!(models.len(), 5, "{provider}");
        assert_eq!(
            models[0]["data"]["usage"],
            json!({"input": 100, "output": 20}),
            "{provider}"
        );
        assert_eq!(models[1]["data"]["calls"][0]["name"], "edit_file");
        assert_eq!(kinds(&daemon, "agent.tool", &id).len(), 5, "{provider}");
        let end = kinds(&daemon, "agent.end", &id);
        assert_eq!(end[0]["data"]["state"], "done");
        assert!(
            journal(&daemon)
                .iter()
                .any(|e| e["kind"] == "exec.start" && e["cell"] == cell.as_str())
        );
    }
    let text = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(!text.contains(KEY), "the key is in the journal");
    let saved = std::fs::read_dir(daemon.state().join("daemon").join("agents")).unwrap();
    for entry in saved.flatten() {
        assert!(
            !std::fs::read_to_string(entry.path()).unwrap().contains(KEY),
            "the key is in {}",
            entry.path().display()
        );
    }
    daemon.assert_journal_verifies();
}
