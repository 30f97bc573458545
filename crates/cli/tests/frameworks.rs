//! Agent frameworks against Warden, unmodified, pointed at `warden serve --e2b` by E2B's
//! environment variables only, each with a scripted model (`model_server.py`): the OpenAI
//! Agents SDK's own runner drives a `SandboxAgent` on its built-in E2B backend
//! (`openai-agents[e2b]` 0.24.0, which pins e2b 2.31.0; the Responses wire format, plain and
//! streamed: `agents_client.py`), and LangChain's deepagents graph runs on `langchain-e2b` 0.0.6
//! (e2b 2.63.0; Chat Completions: `deepagents_client.py`). The commands the model asks for run
//! in cells; the journal shows them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use support::daemon::Daemon;

/// Where `.ci/run` installs a framework (`pip install --target`), checked for `module`.
fn packages(folder: &str, module: &str, install: &str) -> PathBuf {
    let dir =
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/pydeps")).join(folder);
    assert!(
        dir.join(module).is_dir(),
        "{install} is not installed: `python3 -m pip install --target {} '{install}'` (.ci/run does it)",
        dir.display()
    );
    dir
}

/// Runs a framework's client script against the daemon's E2B API; returns its sandbox's id.
fn drive(
    daemon: &Daemon,
    script: &str,
    packages: &std::path::Path,
    args: &[&str],
    marker: &str,
) -> String {
    let addr = std::fs::read_to_string(daemon.runtime().join("e2b.addr")).unwrap();
    let key = std::fs::read_to_string(daemon.runtime().join("e2b.key")).unwrap();
    let mut command = Command::new("python3");
    command
        .env("PYTHONPATH", packages)
        .env("E2B_API_URL", format!("http://{addr}"))
        .env("E2B_SANDBOX_URL", format!("http://{addr}"))
        .env("E2B_API_KEY", key.trim());
    run_client(command, script, args, marker)
}

/// Runs a client script; returns the id of the sandbox it printed.
fn run_client(mut command: Command, script: &str, args: &[&str], marker: &str) -> String {
    let out = command
        .arg(format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR")))
        .args(args)
        .env("MARKER", marker)
        .env_remove("OPENAI_API_KEY")
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.lines().any(|l| l == "ok"),
        "{script} {args:?}: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("sandbox "))
        .unwrap()
        .to_owned()
}

/// The journal's entries of `kind` about `cell`.
fn journaled(daemon: &Daemon, cell: &str, kind: &str) -> Vec<Value> {
    std::fs::read_to_string(daemon.journal())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["cell"] == cell && e["kind"] == kind)
        .collect()
}

#[test]
fn the_openai_agents_sdk_runs_its_sandbox_agent_in_a_cell_through_the_e2b_api() {
    let daemon = Daemon::start(&["--e2b", "127.0.0.1:0"]);
    let packages = packages(
        "openai-agents-0.24.0",
        "agents",
        "openai-agents[e2b]==0.24.0",
    );
    for mode in ["plain", "stream"] {
        let marker = support::unique("proof");
        let sandbox = drive(&daemon, "agents_client.py", &packages, &[mode], &marker);
        // The model's command is the warden's to see: journaled with the cell's name.
        let started = journaled(&daemon, &sandbox, "exec.start");
        assert!(
            started
                .iter()
                .any(|e| e["data"]["argv"].to_string().contains(&marker)),
            "{mode}: the agent's command is not in the journal: {started:?}"
        );
    }
    daemon.assert_journal_verifies();
}

#[test]
fn deepagents_runs_on_langchain_e2b_in_a_cell_through_the_e2b_api() {
    let daemon = Daemon::start(&["--e2b", "127.0.0.1:0"]);
    let packages = packages(
        "deepagents-langchain-e2b-0.0.6",
        "langchain_e2b",
        "langchain-e2b==0.0.6 langchain-openai==1.7.4",
    );
    let marker = support::unique("plan");
    let sandbox = drive(&daemon, "deepagents_client.py", &packages, &[], &marker);
    let started = journaled(&daemon, &sandbox, "exec.start");
    assert!(
        started
            .iter()
            .any(|e| e["data"]["argv"].to_string().contains("ran-in")),
        "the agent's `execute` is not in the journal: {started:?}"
    );
    assert!(!journaled(&daemon, &sandbox, "cell.delete").is_empty());
    daemon.assert_journal_verifies();
}

/// Runs a client of Warden's own backend for a framework, on a daemon's cell over a host
/// project, with the SDK (and `extra` folders) on PYTHONPATH: the command the policy held must
/// be asked and answered, and the reviewed change applied, all in the journal.
fn native(packages: &std::path::Path, extra: &[&str], script: &str) {
    let daemon = Daemon::start(&[]);
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let project = support::tempdir();
    std::fs::write(project.path().join("main.py"), "print('hi')\n").unwrap();
    let marker = support::unique("native");
    let mut path: Vec<String> = std::iter::once("sdk/python/src")
        .chain(extra.iter().copied())
        .map(|p| format!("{root}/{p}"))
        .collect();
    path.push(packages.display().to_string());
    let mut command = Command::new("python3");
    command
        .env("PYTHONPATH", path.join(":"))
        .env("WARDEN_RUNTIME_DIR", daemon.runtime())
        .env("WORKSPACE", project.path());
    let cell = run_client(command, script, &[], &marker);
    for kind in [
        "approval.ask",
        "approval.answer",
        "exec.start",
        "workspace.apply",
    ] {
        assert!(
            !journaled(&daemon, &cell, kind).is_empty(),
            "no {kind} for {cell} in the journal"
        );
    }
    daemon.assert_journal_verifies();
}

#[test]
fn deepagents_on_wardens_own_backend_waits_for_approval_and_applies_what_was_reviewed() {
    let packages = packages(
        "deepagents-langchain-e2b-0.0.6",
        "deepagents",
        "langchain-e2b==0.0.6 langchain-openai==1.7.4",
    );
    native(
        &packages,
        &["sdk/python/examples"],
        "deepagents_native_client.py",
    );
}

#[test]
fn the_openai_agents_sdk_on_wardens_own_client_waits_for_approval_and_applies_what_was_reviewed() {
    let packages = packages(
        "openai-agents-0.24.0",
        "agents",
        "openai-agents[e2b]==0.24.0",
    );
    native(&packages, &[], "agents_native_client.py");
}
