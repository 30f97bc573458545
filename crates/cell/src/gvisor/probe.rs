//! What `warden doctor` says of the gVisor tier: runsc, root, and a sandbox actually started.

use std::path::Path;
use std::process::Stdio;

use crate::check::{Check, Status};

fn check(feature: &'static str, status: Status, detail: String, fix: Option<&str>) -> Check {
    Check {
        tier: "gvisor",
        feature,
        status,
        detail,
        fix: fix.map(str::to_owned),
    }
}

/// The tier's prerequisites on this host. `state`: Warden's state directory (runsc's own state
/// goes below it).
pub fn checks(state: &Path) -> Vec<Check> {
    let Some(runsc) = super::runsc::Runsc::find(state) else {
        return vec![check(
            "runsc",
            Status::Missing,
            "runsc is not installed".to_owned(),
            Some("apt-get install runsc (or set WARDEN_RUNSC to its path)"),
        )];
    };
    let version = runsc.version().unwrap_or_default();
    let mut out = vec![check(
        "runsc",
        Status::Ok,
        format!("{} ({version})", runsc.binary.display()),
        None,
    )];
    if !nix::unistd::geteuid().is_root() {
        out.push(check(
            "root",
            Status::Missing,
            "runsc makes its sandboxes as root; this user is not".to_owned(),
            Some("run the daemon or `warden run` as root, or use `tier: process` (rootless)"),
        ));
        return out;
    }
    out.push(sandbox_starts(&runsc));
    out
}

/// Starts a sandbox on the ptrace platform with the host's root (`runsc do true`): the one way
/// to know that this kernel and this runsc work together.
fn sandbox_starts(runsc: &super::runsc::Runsc) -> Check {
    let scratch = std::env::temp_dir().join(format!("warden-doctor-runsc-{}", std::process::id()));
    let mut command = std::process::Command::new(&runsc.binary);
    command
        .arg("--root")
        .arg(&scratch)
        .args([
            "--platform=ptrace",
            "--network=none",
            "--ignore-cgroups",
            "do",
            "true",
        ])
        // Pipes of its own: runsc takes over (and re-owns) what it is given.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = std::time::Instant::now();
    let result = command.output();
    let _ = std::fs::remove_dir_all(&scratch);
    match result {
        Ok(out) if out.status.success() => check(
            "sandbox",
            Status::Ok,
            format!(
                "a sandbox started and ran `true` on the ptrace platform in {} ms",
                started.elapsed().as_millis()
            ),
            None,
        ),
        Ok(out) => check(
            "sandbox",
            Status::Missing,
            format!(
                "runsc could not start a sandbox: {}",
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("it said nothing")
            ),
            Some("run `runsc --platform=ptrace do true` as root to see why"),
        ),
        Err(e) => check(
            "sandbox",
            Status::Missing,
            format!("starting runsc: {e}"),
            Some("check that runsc is executable"),
        ),
    }
}
