//! A real `warden serve` with its own runtime and state directories, and a minimal HTTP/1.1
//! client over its unix socket (or TCP) for the tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::bin;

#[derive(Debug)]
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub runtime: PathBuf,
    pub state: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
    envs: Vec<(String, String)>,
    /// A program that starts `warden serve` (e.g. `prlimit` with limits), with its arguments.
    wrapper: Vec<String>,
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: String,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            panic!(
                "not JSON ({}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// Server-sent events as (event, data) pairs.
    pub fn events(&self) -> Vec<(String, Value)> {
        parse_events(&String::from_utf8_lossy(&self.body))
    }
}

pub fn parse_events(text: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut event = String::new();
        let mut data = String::new();
        for line in block.lines() {
            if let Some(e) = line.strip_prefix("event:") {
                event = e.trim().to_owned();
            } else if let Some(d) = line.strip_prefix("data:") {
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
        }
        if !data.is_empty() {
            out.push((
                event,
                serde_json::from_str(&data).unwrap_or(Value::String(data)),
            ));
        }
    }
    out
}

/// Each of `kinds` appears as an entry kind in `text` (the journal, or an events stream).
pub fn assert_has_kinds(text: &str, kinds: &[&str]) {
    for kind in kinds {
        assert!(
            text.contains(&format!("\"kind\":\"{kind}\"")),
            "{kind} is missing from: {text}"
        );
    }
}

/// The bytes of one stream in a list of events, in order.
pub fn stream_bytes(events: &[(String, Value)], stream: &str) -> Vec<u8> {
    use base64::Engine as _;
    let mut out = Vec::new();
    for (event, data) in events {
        if event == stream {
            if let Some(text) = data["text"].as_str() {
                out.extend_from_slice(text.as_bytes());
            } else if let Some(b64) = data["base64"].as_str() {
                out.extend(
                    base64::engine::general_purpose::STANDARD
                        .decode(b64)
                        .unwrap(),
                );
            }
        }
    }
    out
}

impl Daemon {
    pub fn start(extra: &[&str]) -> Self {
        Self::start_with(extra, &[])
    }

    /// A daemon started by `wrapper` (a program and its arguments, followed by the warden's
    /// command line), as `prlimit --nofile=...` starts it.
    pub fn start_wrapped(wrapper: &[&str]) -> Self {
        Self::start_full(&[], &[], wrapper)
    }

    /// A daemon started by `wrapper`, with these arguments to `warden serve`.
    pub fn start_wrapped_with(wrapper: &[&str], extra: &[&str]) -> Self {
        Self::start_full(extra, &[], wrapper)
    }

    /// A daemon with these extra environment variables (credentials' sources).
    pub fn start_with(extra: &[&str], envs: &[(&str, &str)]) -> Self {
        Self::start_full(extra, envs, &[])
    }

    fn start_full(extra: &[&str], envs: &[(&str, &str)], wrapper: &[&str]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-daemon-")
            .tempdir()
            .unwrap();
        // A root-started cell's setup runs as an unprivileged id and must traverse to its
        // mount point under the runtime directory.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let runtime = dir.path().join("run");
        let state = dir.path().join("state");
        let mut daemon = Self {
            dir,
            runtime,
            state,
            child: None,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            envs: envs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            wrapper: wrapper.iter().map(|s| (*s).to_owned()).collect(),
        };
        daemon.spawn();
        daemon
    }

    pub fn warden(&self) -> Command {
        let mut cmd = Command::new(bin());
        cmd.env("WARDEN_RUNTIME_DIR", &self.runtime)
            .env("WARDEN_STATE_DIR", &self.state)
            .stdin(Stdio::null());
        cmd
    }

    fn spawn(&mut self) {
        let mut cmd = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args)
                    .arg(bin())
                    .env("WARDEN_RUNTIME_DIR", &self.runtime)
                    .env("WARDEN_STATE_DIR", &self.state)
                    .stdin(Stdio::null());
                cmd
            }
            None => self.warden(),
        };
        cmd.arg("serve")
            .args(&self.extra)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(cmd.spawn().expect("warden serve starts"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.answers() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("warden serve did not come up");
    }

    /// Whether the daemon answers a request on its socket: a socket that takes a connection
    /// may still be an earlier daemon's, its listener held by a process that outlived it.
    fn answers(&self) -> bool {
        let Ok(mut stream) = UnixStream::connect(self.socket()) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let mut head = [0u8; 12];
        stream
            .write_all(b"GET /v1/health HTTP/1.1\r\nHost: warden\r\nConnection: close\r\n\r\n")
            .and_then(|()| stream.read_exact(&mut head))
            .is_ok_and(|()| head.starts_with(b"HTTP/1.1 2"))
    }

    /// `warden audit verify` of this daemon's journal must pass.
    pub fn assert_journal_verifies(&self) {
        let verify = self.warden().args(["audit", "verify"]).output().unwrap();
        assert!(
            verify.status.success(),
            "audit verify: {}",
            String::from_utf8_lossy(&verify.stdout)
        );
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn runtime(&self) -> &Path {
        &self.runtime
    }

    pub fn state(&self) -> &Path {
        &self.state
    }

    pub fn socket(&self) -> PathBuf {
        self.runtime.join("daemon.sock")
    }

    pub fn journal(&self) -> PathBuf {
        self.state.join("journal").join("journal.jsonl")
    }

    /// Where snapshot `CELL@NAME`'s layer is, as its record says.
    pub fn snapshot_layer(&self, cell: &str, name: &str) -> PathBuf {
        let record = self
            .state()
            .join("snapshots")
            .join(format!("{cell}@{name}"))
            .join("snapshot.json");
        let record: Value = serde_json::from_str(&read_file(&record)).unwrap();
        record["layer"].as_str().unwrap().into()
    }

    /// The journal's entries about `cell`, in order, read from its file.
    pub fn entries_of(&self, cell: &str) -> Vec<Value> {
        std::fs::read_to_string(self.journal())
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["cell"] == cell)
            .collect()
    }

    /// `kill -9` of the daemon, as a crash.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    pub fn restart(&mut self) {
        self.crash();
        self.spawn();
    }

    /// A crash, and the daemon started again with these arguments to `warden serve` instead.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.crash();
        self.extra = extra.iter().map(|s| (*s).to_owned()).collect();
        self.spawn();
    }

    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> Answer {
        let stream = UnixStream::connect(self.socket()).expect("the daemon's socket answers");
        exchange(stream, method, path, body, &[])
    }

    /// The paths of a cell's workspace changes, sorted.
    pub fn changed_paths(&self, cell: &str) -> Vec<String> {
        let diff = self
            .call("GET", &format!("/v1/cells/{cell}/diff"), None)
            .json();
        let mut paths: Vec<String> = diff["changes"]
            .as_array()
            .unwrap_or_else(|| panic!("no diff of {cell}: {diff}"))
            .iter()
            .map(|c| c["path"].as_str().unwrap().to_owned())
            .collect();
        paths.sort();
        paths
    }

    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Answer {
        self.request(method, path, body.map(|b| b.to_string()).as_deref())
    }

    /// Creates a cell and returns its name.
    pub fn create(&self, name: &str, extra: Value) -> String {
        let mut body = serde_json::json!({ "name": name });
        if let Value::Object(map) = extra {
            for (k, v) in map {
                body[k] = v;
            }
        }
        let answer = self.call("POST", "/v1/cells", Some(body));
        assert_eq!(
            answer.status,
            201,
            "create: {}",
            String::from_utf8_lossy(&answer.body)
        );
        name.to_owned()
    }

    /// A foreground exec; returns its events.
    pub fn exec(&self, cell: &str, spec: Value) -> Vec<(String, Value)> {
        let answer = self.call("POST", &format!("/v1/cells/{cell}/exec"), Some(spec));
        assert_eq!(
            answer.status,
            200,
            "exec: {}",
            String::from_utf8_lossy(&answer.body)
        );
        answer.events()
    }

    /// Runs `script` with `sh -c` in `cell` and returns what it printed; fails the test unless
    /// it exits with 0.
    pub fn sh_ok(&self, cell: &str, script: &str) -> String {
        let events = self.exec(cell, serde_json::json!({ "argv": ["sh", "-c", script] }));
        assert_eq!(exit_of(&events)["code"], 0, "{script}: {events:?}");
        String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Delete every cell (their keepers outlive the daemon by design), ended ones too (with
        // their layers, and so their file systems' mounts), then end the daemon.
        if self.child.is_some() {
            let list = self.call("GET", "/v1/cells", None);
            if let Ok(Value::Array(cells)) = serde_json::from_slice::<Value>(&list.body) {
                for cell in cells {
                    let name = cell["name"].as_str().unwrap_or_default();
                    let _ = self.call("DELETE", &format!("/v1/cells/{name}"), None);
                }
            }
            if let Some(mut child) = self.child.take() {
                unsafe_free_terminate(&mut child);
            }
        }
        // What a cell's keeper still held (a cell the daemon could not delete).
        crate::unmount_beneath(self.dir.path());
    }
}

fn unsafe_free_terminate(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// One HTTP/1.1 request on a fresh connection, read to its end.
pub fn exchange(
    mut stream: impl Read + Write,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Answer {
    let body = body.unwrap_or("");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: warden\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    // A refused large body may close the connection before it is all sent.
    let _ = stream.write_all(body.as_bytes());
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP answer");
    let headers = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status: u16 = headers.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Answer {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(end) = data.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&data[..end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        let start = end + 2;
        out.extend_from_slice(&data[start..start + size]);
        data = &data[start + size + 2..];
    }
    out
}

pub fn read_file(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

pub fn exit_of(events: &[(String, Value)]) -> Value {
    let (name, data) = events.last().expect("some events");
    assert_eq!(name, "exit", "the stream ends with exit: {events:?}");
    data.clone()
}

/// A local upstream that answers every request with 200 "ok" and counts connections.
pub fn upstream() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&hits);
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
        }
    });
    (port, hits)
}

/// The resident memory of a process, in KiB (0 when it cannot be read).
pub fn resident_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|n| n.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Threads of a host process, from its status file.
pub fn threads_of(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Reads a child's stderr on a thread; lines arrive on the channel as they are written.
pub fn stderr_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// The id in the announcement `... warden approve CELL ID ...`, waiting for it (up to 20 s);
/// every line read is kept in `seen`.
pub fn announced_id(
    lines: &std::sync::mpsc::Receiver<String>,
    cell: &str,
    seen: &mut Vec<String>,
) -> u64 {
    let marker = format!("`warden approve {cell} ");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        let Ok(line) = lines.recv_timeout(left) else {
            break;
        };
        seen.push(line.clone());
        if let Some(at) = line.find(&marker) {
            let digits: String = line[at + marker.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            return digits.parse().unwrap();
        }
    }
    panic!("no question was announced on the terminal: {seen:?}");
}
