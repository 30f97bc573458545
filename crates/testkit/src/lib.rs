//! What Warden's end-to-end tests (and benchmarks) share: they drive the real `warden` binary,
//! which creates real namespaces, cgroups and filters on the running kernel. Here: the binary
//! and commands of it, a daemon of a test's own ([`daemon`]), a scripted model server that
//! speaks the real wire formats ([`model`]), host probes (processes, cgroups), a test CA.
//!
//! The binary is `WARDEN_BIN` where set, else the `warden` cargo built beside the running test
//! (`target/<profile>/warden`; a crate's integration tests get it built by depending on the CLI).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The `warden` binary the tests drive.
pub fn bin() -> &'static Path {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(path) = std::env::var_os("WARDEN_BIN") {
            return PathBuf::from(path);
        }
        let exe = std::env::current_exe().expect("the test knows its own path");
        // target/<profile>/deps/<test>: the binary is in target/<profile>.
        let profile = exe
            .parent()
            .filter(|dir| dir.ends_with("deps"))
            .and_then(Path::parent)
            .unwrap_or_else(|| exe.parent().expect("the test's folder"));
        let path = profile.join("warden");
        assert!(
            path.is_file(),
            "no warden binary at {}: build it (`cargo build -p warden-cli`) or set WARDEN_BIN",
            path.display()
        );
        path
    })
}

/// Copies the program `from` to `to` (mode 0755) by a `cp` of its own: no descriptor that
/// writes the copy is ever open in this process, where another test's fork could carry it
/// until that child's exec, and the copy's own exec then fails with "Text file busy".
pub fn copy_program(from: impl AsRef<Path>, to: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let copied = Command::new("cp")
        .arg("--")
        .arg(from.as_ref())
        .arg(to)
        .status()
        .expect("cp runs");
    assert!(copied.success(), "cp of {} failed", from.as_ref().display());
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The most process `pid`'s resident memory rose to (`VmHWM`, in KiB), since it started or
/// since [`reset_peak`].
pub fn peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|n| n.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Starts the peak of `pid`'s resident memory over from what it holds now (root only):
/// whether it could.
pub fn reset_peak(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// One raw HTTP/1.1 exchange with `addr`: `head` (the request line and any headers, each
/// ending in CRLF) is sent with `Connection: close` and the body's length, then `body`; the
/// answer's status and body. A refusal may come before the whole body is read: what could not
/// be sent then is no matter.
pub fn raw_http(addr: &str, head: &str, body: &[u8]) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.write_all(
        format!(
            "{head}Connection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    let _ = tcp.write_all(body);
    let mut answer = Vec::new();
    let _ = tcp.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.split(' ').nth(1).unwrap_or("0").parse().unwrap_or(0);
    (status, body.to_owned())
}

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
    let mut cmd = Command::new(bin());
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

/// A cell named `name` that runs `python3 -c CODE` (ended by `--timeout` after `timeout` at
/// most), holding what the code takes while the test looks at others; `first_line` is the first
/// line it printed (the code prints once it holds what it takes). Ended by `warden kill` when
/// dropped.
#[derive(Debug)]
pub struct Holding {
    name: String,
    child: std::process::Child,
    pub first_line: String,
}

impl Holding {
    pub fn start(name: &str, timeout: &str, code: &str) -> Self {
        let mut child = warden()
            .args(["run", "--name", name, "--timeout", timeout])
            .args(["--", "python3", "-c", code])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("warden runs");
        let mut first_line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().expect("piped")),
            &mut first_line,
        )
        .expect("the cell's first line");
        Self {
            name: name.to_owned(),
            child,
            first_line,
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = warden().args(["kill", &self.name]).status();
        let _ = self.child.wait();
    }
}

/// Writes a policy file into `dir` and returns its path.
pub fn policy(dir: &Path, yaml: &str) -> PathBuf {
    let path = dir.join(format!("policy-{}.yaml", unique("p")));
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(yaml.as_bytes()).unwrap();
    path
}

/// Where test folders go that a cell must see at their own path: not under /tmp (every cell
/// has a /tmp of its own), even when the checkout is.
pub fn outside_tmp() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        // cargo's folder for tests' files: target/tmp.
        let target = bin()
            .parent()
            .and_then(Path::parent)
            .expect("the binary is in target/<profile>");
        let dir = target.join("tmp");
        if dir.starts_with("/tmp") {
            return PathBuf::from("/var/tmp");
        }
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

/// A run's own folders, outside /tmp: Warden's state and runtime directories, and a host
/// directory the cell's user may write (for a policy's `read_write`, to see whether a command
/// ran).
#[derive(Debug)]
pub struct RunDirs {
    pub dir: tempfile::TempDir,
    pub state: PathBuf,
    pub runtime: PathBuf,
    pub host: PathBuf,
}

pub fn run_dirs() -> RunDirs {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::Builder::new()
        .prefix("warden-test-")
        .tempdir_in(outside_tmp())
        .unwrap();
    let (state, runtime, host) = (
        dir.path().join("state"),
        dir.path().join("run"),
        dir.path().join("host"),
    );
    std::fs::create_dir(&host).unwrap();
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o777)).unwrap();
    RunDirs {
        dir,
        state,
        runtime,
        host,
    }
}

pub fn tempdir() -> TestDir {
    TestDir(Some(
        tempfile::Builder::new()
            .prefix("warden-test-")
            .tempdir()
            .unwrap(),
    ))
}

/// A test's temporary folder, removed when dropped together with whatever is still mounted
/// beneath it: a cell run without a daemon keeps the layer of a workspace it changed (its own
/// file system, under the disk limit) mounted until `warden rm`, which a test that only checks
/// the run does not call; without this the folder's removal fails on the mount and leaves it.
#[derive(Debug)]
pub struct TestDir(Option<tempfile::TempDir>);

impl TestDir {
    pub fn path(&self) -> &Path {
        self.0
            .as_ref()
            .expect("the folder is there until dropped")
            .path()
    }
}

impl AsRef<Path> for TestDir {
    fn as_ref(&self) -> &Path {
        self.path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            unmount_beneath(dir.path());
        }
    }
}

/// Detaches every mount beneath `dir` (deepest first), as `umount -l` does; what cannot be
/// unmounted (not ours, not root) is left.
pub fn unmount_beneath(dir: &Path) {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let prefix = format!("{}/", dir.display());
    let mut points: Vec<String> = table
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| {
            field
                .replace("\\040", " ")
                .replace("\\011", "\t")
                .replace("\\012", "\n")
                .replace("\\134", "\\")
        })
        .filter(|point| point.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for point in points {
        let _ = std::process::Command::new("umount")
            .args(["-l", "--"])
            .arg(&point)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Host processes whose command line contains `marker`.
pub fn host_processes_with(marker: &str) -> Vec<i32> {
    // The warden that launched the cell carries the marker in its own arguments.
    processes_whose_command_line(|cmdline| {
        cmdline.contains(marker)
            && !cmdline.contains(&*bin().to_string_lossy())
            && !cmdline.starts_with("warden")
    })
}

/// Host processes (this one aside) whose command line (its arguments joined by spaces) `is`.
pub fn processes_whose_command_line(is: impl Fn(&str) -> bool) -> Vec<i32> {
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
        if is(&String::from_utf8_lossy(&cmdline).replace('\0', " ")) {
            found.push(pid);
        }
    }
    found
}

/// Waits until `done` (looked at every 20 ms), failing the test after 15 s with `what`.
pub fn wait_for(what: &str, done: impl FnMut() -> bool) {
    assert!(waited(done), "waited 15 s for {what}");
}

/// Waits until `done` (looked at every 20 ms), 15 s at most: whether it came, for a caller
/// that says more than `wait_for` when it did not.
pub fn waited(mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while !done() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    true
}

/// Whether process `pid` runs (neither gone nor ended and waiting to be reaped).
pub fn alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit(')')
            .next()
            .is_some_and(|s| !s.trim_start().starts_with('Z'))
    })
}

/// The children of `pid` that have ended and wait to be reaped.
pub fn zombies_of(pid: u32) -> Vec<u32> {
    children_where(pid, |state, _| state == "Z")
}

/// The live children of `pid` whose command line's second word (a warden's subcommand, or the
/// title it gave itself) is `what`.
pub fn children_called(pid: u32, what: &str) -> Vec<u32> {
    children_where(pid, |state, child| {
        state != "Z"
            && std::fs::read(format!("/proc/{child}/cmdline"))
                .is_ok_and(|line| line.split(|b| *b == 0).nth(1) == Some(what.as_bytes()))
    })
}

/// The children of `pid` for which `is` (their state letter, their pid) holds.
fn children_where(pid: u32, is: impl Fn(&str, u32) -> bool) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let mut fields = stat[close + 2..].split(' ');
        let (state, parent) = (fields.next(), fields.next());
        if parent == Some(pid.to_string().as_str())
            && let Some(state) = state
            && is(state, child)
        {
            found.push(child);
        }
    }
    found
}

/// Whether a cgroup directory's name is cell `name`'s: `NAME.INSTANCE` (the instance: a hash
/// of the warden's runtime directory).
pub fn is_cgroup_of(dir_name: &str, name: &str) -> bool {
    dir_name
        .split_once('.')
        .is_some_and(|(cell, _)| cell == name)
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
                if is_cgroup_of(&entry.file_name().to_string_lossy(), name) {
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

/// What is left in a runtime directory's `cells/` but the emptied folders of ended cells that it
/// keeps for the next ones (`.spare-N`): a spare with anything in it is listed too.
pub fn cell_folders_left(runtime: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(runtime.join("cells"))
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    !e.file_name().to_string_lossy().starts_with(".spare-")
                        || std::fs::read_dir(e.path()).map_or(true, |mut d| d.next().is_some())
                })
                .map(|e| e.file_name())
                .collect()
        })
        .unwrap_or_default()
}

/// The runsc installed in one of the usual places (the tests' gVisor tier needs one), if any.
pub fn installed_runsc() -> Option<PathBuf> {
    ["/usr/bin/runsc", "/usr/sbin/runsc", "/usr/local/bin/runsc"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
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
        // One file for every test process, each writing it whole aside and renaming it into
        // place (a file per process was left behind by each).
        let path = std::env::temp_dir().join("warden-test-direct.yaml");
        let aside =
            std::env::temp_dir().join(format!("warden-test-direct.yaml.{}", std::process::id()));
        std::fs::write(
            &aside,
            "version: 1\nfilesystem:\n  workspace:\n    mode: direct\n",
        )
        .unwrap();
        let mut perms = std::fs::metadata(&aside).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o644);
        std::fs::set_permissions(&aside, perms).unwrap();
        std::fs::rename(&aside, &path).unwrap();
        path
    })
    .display()
    .to_string()
}
pub mod daemon;
pub mod model;

/// Proves that a running cell writes, creates and deletes in its workspace after a reset to its
/// start and after a reset to a snapshot. `warden(args)` makes the warden command (as whoever
/// the test runs cells as); `workspace` holds `README.md` ("# Project") and `src/main.rs`.
pub fn writes_after_reset(warden: &dyn Fn(&[&str]) -> Command, workspace: &Path, name: &str) {
    use std::io::{BufRead as _, Write as _};
    let ws = workspace.display().to_string();
    // Each line read from stdin is a round: write, create, delete, and report.
    let script = "cd /workspace; echo edited > README.md; echo ready; \
        while read round; do \
          echo \"$round\" >> README.md && echo new > \"new-$round.txt\" && rm -f src/main.rs \
          && mkdir -p \"dir-$round\" && touch \"dir-$round/f\" && rm -r \"dir-$round\" \
          && echo \"done $round\" || echo \"failed $round\"; \
        done";
    let mut cell = warden(&[
        "run",
        "--name",
        name,
        "--workspace",
        &ws,
        "--",
        "sh",
        "-c",
        script,
    ])
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    .spawn()
    .unwrap();
    let mut stdin = cell.stdin.take().unwrap();
    let mut lines = std::io::BufReader::new(cell.stdout.take().unwrap()).lines();
    let mut next = || lines.next().unwrap().unwrap();
    assert_eq!(next(), "ready");
    let ok = |args: &[&str]| {
        let out = warden(args).stdin(Stdio::null()).output().unwrap();
        assert!(
            out.status.success(),
            "warden {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(&["snapshot", name, "--as", "edited"]);
    for (round, reset) in [
        ("one", vec!["reset", name]),
        ("two", vec!["reset", name, "--to", "edited"]),
    ] {
        ok(&reset);
        writeln!(stdin, "{round}").unwrap();
        assert_eq!(next(), format!("done {round}"), "after `warden {reset:?}`");
    }
    let diff = ok(&["diff", name, "--json"]);
    let diff: serde_json::Value = serde_json::from_str(&diff).unwrap();
    let mut changes: Vec<(String, String)> = diff["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["path"].as_str().unwrap().to_owned(),
                c["kind"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    changes.sort();
    // Back at the snapshot (README edited), then round two: what the cell did after the resets.
    assert_eq!(
        changes,
        [
            ("README.md".to_owned(), "modified".to_owned()),
            ("new-two.txt".to_owned(), "added".to_owned()),
            ("src/main.rs".to_owned(), "deleted".to_owned()),
        ],
        "{diff}"
    );
    drop(stdin);
    let _ = cell.wait();
    ok(&["rm", &format!("{name}@edited")]);
    ok(&["rm", name]);
}

/// A TLS server configuration for `ip` with a certificate that a new test CA signed, and that
/// CA's PEM (for the client to trust).
pub fn tls_server_config(ip: &str) -> (std::sync::Arc<rustls::ServerConfig>, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![ip.to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
            key.serialize_der(),
        )),
    )
    .unwrap();
    (std::sync::Arc::new(config), ca.pem())
}

/// Adds a regular file to a layer's tar.
pub fn tar_file(b: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32, data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.set_path(path).unwrap();
    h.set_mode(mode);
    h.set_size(data.len() as u64);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    b.append(&h, data).unwrap();
}

/// A `docker save` archive (`manifest.json`, the configuration named by its digest,
/// `lN/layer.tar`) of these layers (uncompressed tars), tagged `tag`, in a new file in `dir`;
/// `config` is the image configuration's `config` object (environment, user, working folder).
pub fn docker_archive(
    dir: &Path,
    layers: &[Vec<u8>],
    tag: &str,
    config: serde_json::Value,
) -> PathBuf {
    use sha2::Digest as _;
    let sha = |bytes: &[u8]| format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)));
    let mut archive = tar::Builder::new(Vec::new());
    let mut names = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        names.push(format!("l{i}/layer.tar"));
        tar_file(&mut archive, &names[i], 0o644, layer);
    }
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": config,
        "rootfs": { "type": "layers", "diff_ids": layers.iter().map(|l| sha(l)).collect::<Vec<_>>() },
    })
    .to_string();
    let config_name = format!("{}.json", &sha(config.as_bytes())[7..]);
    tar_file(&mut archive, &config_name, 0o644, config.as_bytes());
    let manifest =
        serde_json::json!([{ "Config": config_name, "RepoTags": [tag], "Layers": names }]);
    tar_file(
        &mut archive,
        "manifest.json",
        0o644,
        manifest.to_string().as_bytes(),
    );
    let path = dir.join(format!("{}.tar", unique("image")));
    std::fs::write(&path, archive.into_inner().unwrap()).unwrap();
    path
}

/// An image layer (an uncompressed tar) of the host's `/bin/sh` and what `ldd` says it loads, at
/// their paths, and `extra` files (path, mode, content): enough for a cell to run `sh` from an
/// image built from host files.
pub fn host_shell_layer(extra: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let ldd = Command::new("ldd").arg("/bin/sh").output().unwrap();
    let mut files = vec![PathBuf::from("/bin/sh")];
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = line
            .split("=>")
            .last()
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap_or("");
        if path.starts_with('/') {
            files.push(PathBuf::from(path));
        }
    }
    for file in &files {
        let data = std::fs::read(file).unwrap();
        tar_file(
            &mut b,
            file.to_str().unwrap().trim_start_matches('/'),
            0o755,
            &data,
        );
    }
    for (path, mode, data) in extra {
        tar_file(&mut b, path, *mode, data);
    }
    b.into_inner().unwrap()
}
