//! The dashboard in a real browser: headless Chromium driven by playwright-core
//! (`dashboard.mjs`) against a daemon listening on loopback TCP. `.ci/run` installs both.

mod support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::json;
use support::daemon::Daemon;
use support::model::{ModelServer, Step, call};
use support::*;

#[test]
fn the_dashboard_watches_and_steers_cells_in_a_browser() {
    if !cgroups_available("dashboard") {
        return;
    }
    let playwright = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/nodedeps"
    ));
    let package = playwright.join("node_modules/playwright-core/package.json");
    assert!(
        package.is_file(),
        "playwright-core is not installed in {} (.ci/run installs it with npm)",
        playwright.display()
    );
    let chromium = ["chromium", "chromium-browser"]
        .iter()
        .map(|name| PathBuf::from("/usr/bin").join(name))
        .find(|path| path.is_file())
        .expect("Debian's chromium package is installed (.ci/run installs it)");
    // The agent session's model: one tool call, then its summary.
    let model = ModelServer::start(vec![
        call("exec", json!({ "command": "echo tool-ran-$((2+3))" })),
        Step::Text("all done: tool-ran-5".into()),
    ]);
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0"]);
    let addr = std::fs::read_to_string(daemon.runtime().join("daemon.addr")).unwrap();
    let token = std::fs::read_to_string(daemon.runtime().join("daemon.token")).unwrap();
    let workspace = tempdir();
    std::fs::write(workspace.path().join("README"), "the host's copy\n").unwrap();
    let shots = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/dashboard-screenshots"
    ));
    let _ = std::fs::remove_dir_all(&shots);
    let policy = "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [9]\ncommands:\n  ask: [\"echo held*\"]\napprovals:\n  timeout: 60s\n";
    let out = Command::new("node")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/dashboard.mjs"))
        .env("WARDEN_URL", format!("http://{}", addr.trim()))
        .env("WARDEN_TOKEN", token.trim())
        .env("WORKSPACE", workspace.path())
        .env("POLICY", policy)
        .env("MODEL_URL", model.base_url("openai"))
        .env("SHOTS", &shots)
        .env(
            "PLAYWRIGHT_DIR",
            playwright.join("node_modules/playwright-core"),
        )
        .env("CHROMIUM", &chromium)
        .output()
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The load figures are printed, not asserted (the issue asks for them in the test's output).
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the browser test failed (screenshots in {}):\n{stdout}\n{stderr}",
        shots.display()
    );
    assert!(stdout.contains("dashboard: every step passed"), "{stdout}");
    for shot in [
        "login",
        "terminal",
        "network",
        "approvals",
        "workspace",
        "cell",
        "journal",
    ] {
        assert!(
            shots.join(format!("{shot}.png")).is_file(),
            "no screenshot of the {shot} view"
        );
    }
    daemon.assert_journal_verifies();
}
