//! The Python SDK (`sdk/python`) against a real `warden serve`: its own tests
//! (`sdk/python/tests`, sync and async, streaming, errors, approvals, the journal, and its types
//! against `docs/openapi.json`), run from the source tree with the daemon's addresses.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::process::Command;

use support::daemon::Daemon;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

#[test]
fn the_python_sdk_passes_its_tests_against_a_real_daemon() {
    let daemon = Daemon::start(&["--listen", "127.0.0.1:0", "--pool", "default=1"]);
    let addr = std::fs::read_to_string(daemon.runtime().join("daemon.addr")).unwrap();
    let token = std::fs::read_to_string(daemon.runtime().join("daemon.token")).unwrap();
    let workspace = support::tempdir();
    std::fs::write(workspace.path().join("notes.txt"), "from the host\n").unwrap();
    let out = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(format!("{ROOT}/sdk/python/tests"))
        .env(
            "PYTHONPATH",
            format!("{ROOT}/sdk/python/src:{ROOT}/crates/cli/tests"),
        )
        .env("WARDEN_RUNTIME_DIR", daemon.runtime())
        .env("WARDEN_TEST_URL", format!("http://{addr}"))
        .env("WARDEN_TEST_TOKEN", token.trim())
        .env("WARDEN_OPENAPI", format!("{ROOT}/docs/openapi.json"))
        .env("WARDEN_TEST_WORKSPACE", workspace.path())
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'httpx'"),
        "the SDK's dependency is missing: `pip install ./sdk/python` (.ci/run does it)"
    );
    assert!(
        out.status.success() && stderr.contains("\nOK"),
        "the SDK's tests failed:\n{stderr}"
    );
    // Every test ran: none was skipped or lost.
    assert!(stderr.contains("Ran 14 tests"), "{stderr}");
    // The checkpoint test needs the gVisor tier: as root with runsc, nothing may be skipped.
    if support::is_root() && support::installed_runsc().is_some() {
        assert!(!stderr.contains("skipped"), "{stderr}");
    }
    daemon.assert_journal_verifies();
}
