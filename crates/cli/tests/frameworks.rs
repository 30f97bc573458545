//! Agent frameworks against Warden, unmodified: the OpenAI Agents SDK's own runner drives a
//! `SandboxAgent` on its built-in E2B backend (`openai-agents[e2b]` 0.24.0, which pins e2b
//! 2.31.0), pointed at `warden serve --e2b` by E2B's environment variables only, with a
//! scripted model speaking the Responses wire format, plain and streamed (`agents_client.py`,
//! `model_server.py`). The command the model asks for runs in a cell; the journal shows it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use support::daemon::Daemon;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/agents_client.py");

fn packages() -> PathBuf {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/pydeps"))
        .join("openai-agents-0.24.0");
    assert!(
        dir.join("agents").is_dir(),
        "openai-agents is not installed: `python3 -m pip install --target {} 'openai-agents[e2b]==0.24.0'` (.ci/run does it)",
        dir.display()
    );
    dir
}

#[test]
fn the_openai_agents_sdk_runs_its_sandbox_agent_in_a_cell_through_the_e2b_api() {
    let daemon = Daemon::start(&["--e2b", "127.0.0.1:0"]);
    let addr = std::fs::read_to_string(daemon.runtime().join("e2b.addr")).unwrap();
    let key = std::fs::read_to_string(daemon.runtime().join("e2b.key")).unwrap();
    for mode in ["plain", "stream"] {
        let marker = support::unique("proof");
        let out = Command::new("python3")
            .args([CLIENT, mode])
            .env("PYTHONPATH", packages())
            .env("E2B_API_URL", format!("http://{addr}"))
            .env("E2B_SANDBOX_URL", format!("http://{addr}"))
            .env("E2B_API_KEY", key.trim())
            .env("MARKER", &marker)
            .env_remove("OPENAI_API_KEY")
            .output()
            .expect("python3 runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.lines().any(|l| l == "ok"),
            "{mode}: {}\nstdout: {stdout}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let sandbox = stdout
            .lines()
            .find_map(|l| l.strip_prefix("sandbox "))
            .unwrap();
        // The model's command is the warden's to see: journaled with the cell's name.
        let journal = std::fs::read_to_string(daemon.journal()).unwrap();
        let started: Vec<Value> = journal
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["cell"] == sandbox && e["kind"] == "exec.start")
            .collect();
        assert!(
            started
                .iter()
                .any(|e| e["data"]["argv"].to_string().contains(&marker)),
            "{mode}: the agent's command is not in the journal: {started:?}"
        );
    }
    daemon.assert_journal_verifies();
}
