//! Shared helpers for the end-to-end tests: they drive the real `warden` binary, which creates
//! real namespaces, cgroups and filters on the running kernel.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

pub const BIN: &str = env!("CARGO_BIN_EXE_warden");

/// A unique cell name for this test process.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn warden() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.stdin(Stdio::null());
    cmd
}

/// Result of one `warden run`.
#[derive(Debug)]
pub struct Ran {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Ran {
    fn from(out: Output) -> Self {
        Self {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// `warden run [extra...] -- sh -c SCRIPT`.
pub fn run_sh(extra: &[&str], script: &str) -> Ran {
    let mut cmd = warden();
    cmd.arg("run").args(extra).args(["--", "sh", "-c", script]);
    cmd.output().expect("warden runs").into()
}

/// `warden run [extra...] -- python3 -c CODE`.
pub fn run_py(extra: &[&str], code: &str) -> Ran {
    let mut cmd = warden();
    cmd.arg("run")
        .args(extra)
        .args(["--", "python3", "-c", code]);
    cmd.output().expect("warden runs").into()
}

/// Writes a policy file into `dir` and returns its path.
pub fn policy(dir: &Path, yaml: &str) -> PathBuf {
    let path = dir.join(format!("policy-{}.yaml", unique("p")));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(yaml.as_bytes()).unwrap();
    path
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("warden-test-")
        .tempdir()
        .unwrap()
}

/// Host processes whose command line contains `marker`.
pub fn host_processes_with(marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if pid == std::process::id() as i32 {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        // The warden that launched the cell carries the marker in its own arguments.
        if cmdline.contains(marker) && !cmdline.contains(BIN) && !cmdline.starts_with("warden") {
            found.push(pid);
        }
    }
    found
}

/// Every cgroup directory named after the cell, in any hierarchy.
pub fn cgroup_dirs_of(name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![PathBuf::from("/sys/fs/cgroup")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if entry.file_name().to_string_lossy() == name {
                    found.push(path.clone());
                }
                // Cells live under warden/ in the warden's own cgroup; no need to walk further.
                if path.components().count() < 12 {
                    stack.push(path);
                }
            }
        }
    }
    found
}

pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Whether this test process can give cells cgroups (root, or a delegated subtree). When it
/// cannot, the caller skips and says why.
pub fn cgroups_available(test: &str) -> bool {
    let out = warden()
        .args(["doctor", "--json"])
        .output()
        .expect("warden doctor runs");
    let checks: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("doctor prints JSON");
    let ok = checks.as_array().is_some_and(|all| {
        all.iter()
            .filter(|c| {
                let controllers = [
                    "cgroup memory",
                    "cgroup pids",
                    "cgroup cpu",
                    "cgroup freezer",
                ];
                c["feature"]
                    .as_str()
                    .is_some_and(|f| controllers.contains(&f))
            })
            .all(|c| c["status"] == "ok")
    });
    if !ok {
        eprintln!(
            "skipped {test}: no writable cgroup hierarchy for this user (run the tests as root)"
        );
    }
    ok
}

/// Path of a policy whose workspace is written directly (no copy-on-write layer), for tests
/// that watch the host directory while a cell writes it.
pub fn direct_policy() -> String {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("warden-test-direct-{}.yaml", std::process::id()));
        std::fs::write(
            &path,
            "version: 1\nfilesystem:\n  workspace:\n    mode: direct\n",
        )
        .unwrap();
        let mut perms = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o644);
        std::fs::set_permissions(&path, perms).unwrap();
        path
    })
    .display()
    .to_string()
}
pub mod daemon;
