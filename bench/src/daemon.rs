//! The daemon's speed and weight: exec round trip of `true` through the API and the MCP tool beside a plain
//! fork/exec and `runsc exec` into a running gVisor container; memory per idle cell; journal
//! entries per second with fsync.
//!
//! `cargo build --release --workspace && target/release/daemon-bench [--runs N] [--cells N]`
//! (as root, for cgroups and runsc). `--exec-only` stops after the exec round trip;
//! `--baseline PATH` runs a second daemon from another `warden` binary beside the first and
//! interleaves its exec round trips with the others (a change's own effect on this noisy host).

use std::io::{BufRead as _, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use warden_bench::{
    Daemon, create_exec_delete, is_root, ms, percentile, request, string_field, table, tree_memory,
    which,
};

struct Args {
    runs: usize,
    cells: usize,
    entries: usize,
    exec_only: bool,
    baseline: Option<PathBuf>,
}

fn args() -> Result<Args> {
    let mut out = Args {
        runs: 200,
        cells: 100,
        entries: 200_000,
        exec_only: false,
        baseline: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--exec-only" => {
                out.exec_only = true;
                continue;
            }
            "--help" | "-h" => {
                warden_bench::say!(
                    "usage: daemon-bench [--runs N] [--cells N] [--entries N] [--exec-only] [--baseline PATH]"
                );
                std::process::exit(0);
            }
            "--baseline" => {
                let path = PathBuf::from(it.next().context("a warden binary must follow")?);
                if !path.is_file() {
                    bail!("--baseline {}: no such file", path.display());
                }
                out.baseline = Some(path);
                continue;
            }
            _ => {}
        }
        let mut value = || -> Result<usize> {
            it.next()
                .context("a number must follow")?
                .parse()
                .context("not a number")
        };
        match arg.as_str() {
            "--runs" => out.runs = value()?,
            "--cells" => out.cells = value()?,
            "--entries" => out.entries = value()?,
            other => bail!(
                "unknown argument {other}; use --runs N --cells N --entries N --exec-only --baseline PATH"
            ),
        }
    }
    Ok(out)
}

/// An MCP session over the daemon's unix socket, as `warden mcp` opens one (`GET /v1/mcp`
/// upgraded; newline-delimited JSON-RPC), initialized in the 2025-11-25 protocol.
struct McpSession {
    reader: std::io::BufReader<UnixStream>,
    writer: UnixStream,
    next: u64,
}

impl McpSession {
    fn open(socket: &Path) -> Result<Self> {
        let mut stream = UnixStream::connect(socket).context("connecting to the daemon")?;
        write!(
            stream,
            "GET /v1/mcp HTTP/1.1\r\nHost: w\r\nConnection: upgrade\r\nUpgrade: warden-mcp\r\n\r\n"
        )?;
        let mut reader = std::io::BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if !line.contains(" 101 ") {
            bail!("the daemon did not upgrade to MCP: {line}");
        }
        while line != "\r\n" {
            line.clear();
            reader.read_line(&mut line)?;
        }
        let mut session = Self {
            reader,
            writer: stream,
            next: 1,
        };
        session.call(
            "initialize",
            r#"{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"bench","version":"1"}}"#,
        )?;
        writeln!(
            session.writer,
            r#"{{"jsonrpc":"2.0","method":"notifications/initialized"}}"#
        )?;
        Ok(session)
    }

    /// One request; its answer's line.
    fn call(&mut self, method: &str, params: &str) -> Result<String> {
        let id = self.next;
        self.next += 1;
        writeln!(
            self.writer,
            r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{params}}}"#
        )?;
        let want = format!(r#""id":{id},"#);
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                bail!("the MCP session ended");
            }
            if line.contains(&want) {
                return Ok(line);
            }
        }
    }
}

/// What the real `e2b` SDK times against the daemon's E2B-compatible API: each round
/// `Sandbox.create()`, `commands.run("true")`, `kill()`; milliseconds to the end of the
/// first command, and of the whole round.
const E2B_ROUNDS: &str = r#"
import json, sys, time
from e2b import Sandbox
first, whole = [], []
for i in range(int(sys.argv[1]) + 3):
    t = time.perf_counter()
    s = Sandbox.create()
    r = s.commands.run("true")
    f = time.perf_counter()
    s.kill()
    e = time.perf_counter()
    assert r.exit_code == 0
    if i >= 3:
        first.append((f - t) * 1000)
        whole.append((e - t) * 1000)
print(json.dumps({"first": first, "whole": whole}))
"#;

/// Rounds of create, exec `true`, delete through the daemon's own API, and the same through
/// the `e2b` SDK (2.63.0, installed where `.ci/run` puts it), when it is there.
fn lifecycle(daemon: &Daemon, runs: usize) -> Result<Vec<(String, Vec<Duration>)>> {
    let mut api = Vec::new();
    for i in 0..runs + 3 {
        let start = Instant::now();
        create_exec_delete(&daemon.socket, &format!(r#"{{"name":"life{i}"}}"#))?;
        if i >= 3 {
            api.push(start.elapsed());
        }
    }
    let mut rows = vec![("API: create + exec + delete".to_owned(), api)];
    let sdk = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/pydeps/e2b-2.63.0");
    if !sdk.join("e2b").is_dir() {
        warden_bench::tell!(
            "(no e2b SDK in {}: its rows are left out; .ci/run installs it)",
            sdk.display()
        );
        return Ok(rows);
    }
    let addr = std::fs::read_to_string(daemon.runtime().join("e2b.addr"))?;
    let key = std::fs::read_to_string(daemon.runtime().join("e2b.key"))?;
    let out = Command::new("python3")
        .args(["-c", E2B_ROUNDS, &runs.to_string()])
        .env("PYTHONPATH", &sdk)
        .env("E2B_API_URL", format!("http://{addr}"))
        .env("E2B_SANDBOX_URL", format!("http://{addr}"))
        .env("E2B_API_KEY", key.trim())
        .output()?;
    if !out.status.success() {
        bail!(
            "the e2b rounds failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let times: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    for (key, name) in [
        ("first", "e2b SDK: create() to first run() done"),
        ("whole", "e2b SDK: create + run + kill"),
    ] {
        let samples = times[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(serde_json::Value::as_f64)
                    .map(|ms| Duration::from_secs_f64(ms / 1000.0))
                    .collect()
            })
            .unwrap_or_default();
        rows.push((name.to_owned(), samples));
    }
    Ok(rows)
}

/// A model that answers every request at once: an exec of `true` until `turns` requests came,
/// then a final text. Answers the times between requests (one turn each).
fn instant_model(turns: usize) -> Result<(u16, std::sync::mpsc::Receiver<Instant>)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut served = 0;
        for stream in listener.incoming().flatten() {
            let _ = stream.set_nodelay(true);
            let mut reader = std::io::BufReader::new(match stream.try_clone() {
                Ok(s) => s,
                Err(_) => continue,
            });
            let mut out = stream;
            loop {
                let mut length = 0;
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 {
                        return;
                    }
                    let header = header.trim_end().to_ascii_lowercase();
                    if header.is_empty() {
                        break;
                    }
                    if let Some(value) = header.strip_prefix("content-length:") {
                        length = value.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                let _ = tx.send(Instant::now());
                served += 1;
                let events = if served < turns {
                    concat!(
                        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"exec\",\"arguments\":\"{\\\"command\\\":\\\"true\\\"}\"}}]}}]}\n\n",
                        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n",
                        "data: [DONE]\n\n"
                    )
                } else {
                    concat!(
                        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"done\"},\"finish_reason\":\"stop\"}]}\n\n",
                        "data: [DONE]\n\n"
                    )
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n",
                    events.len()
                );
                if out
                    .write_all(head.as_bytes())
                    .and_then(|()| out.write_all(events.as_bytes()))
                    .is_err()
                {
                    break;
                }
            }
        }
    });
    Ok((port, rx))
}

/// Runs one agent session of `turns` turns; answers each turn's time.
fn agent_turns(daemon: &Daemon, turns: usize) -> Result<Vec<Duration>> {
    let (port, arrivals) = instant_model(turns + 1)?;
    let body = format!(
        r#"{{"task":"bench","model":"openai:instant","base_url":"http://127.0.0.1:{port}/v1","budgets":{{"steps":{}}}}}"#,
        turns + 2
    );
    let (status, raw) = request(&daemon.socket, "POST", "/v1/agents", &body)?;
    if status != 201 {
        bail!("starting the session failed: {raw}");
    }
    let id = string_field(&raw, "id").context("no session id")?;
    let (_, end) = request(&daemon.socket, "GET", &format!("/v1/agents/{id}/wait"), "")?;
    if !end.contains("\"state\":\"done\"") {
        bail!("the session did not finish: {end}");
    }
    let times: Vec<Instant> = arrivals.try_iter().collect();
    if times.len() != turns + 1 {
        bail!("{} model requests, not {}", times.len(), turns + 1);
    }
    Ok(times.windows(2).map(|w| w[1] - w[0]).collect())
}

/// The round trip of a workspace snapshot of a cell with one changed file.
fn snapshot_round_trips(daemon: &Daemon, runs: usize) -> Result<Vec<Duration>> {
    let dir = workspace_dir();
    std::fs::create_dir_all(&dir)?;
    let body = format!(r#"{{"name":"snapbench","workspace":"{}"}}"#, dir.display());
    let (status, raw) = request(&daemon.socket, "POST", "/v1/cells", &body)?;
    if status != 201 {
        bail!("creating a cell failed: {raw}");
    }
    request(
        &daemon.socket,
        "POST",
        "/v1/cells/snapbench/exec",
        r#"{"argv":["sh","-c","echo x > f"]}"#,
    )?;
    let mut out = Vec::new();
    for _ in 0..runs {
        let start = Instant::now();
        let (status, raw) = request(&daemon.socket, "POST", "/v1/cells/snapbench/snapshot", "{}")?;
        out.push(start.elapsed());
        if status != 200 && status != 201 {
            bail!("snapshot failed: {raw}");
        }
    }
    Ok(out)
}

/// The snapshot cell's workspace folder.
fn workspace_dir() -> PathBuf {
    std::env::temp_dir().join(format!("warden-bench-ws-{}", std::process::id()))
}

fn runsc_exec(runs: usize) -> Result<Option<Vec<Duration>>> {
    let Some(runsc) = which("runsc") else {
        return Ok(None);
    };
    if !is_root() {
        return Ok(None);
    }
    let bundle = std::env::temp_dir().join(format!("warden-bench-runsc-{}", std::process::id()));
    std::fs::create_dir_all(&bundle)?;
    let config = r#"{"ociVersion":"1.0.0","process":{"terminal":false,"user":{"uid":0,"gid":0},"args":["sleep","3600"],"env":["PATH=/usr/bin:/bin"],"cwd":"/"},"root":{"path":"/","readonly":true},"hostname":"bench","mounts":[{"destination":"/proc","type":"proc","source":"proc"},{"destination":"/tmp","type":"tmpfs","source":"tmpfs"}],"linux":{"namespaces":[{"type":"pid"},{"type":"network"},{"type":"ipc"},{"type":"uts"},{"type":"mount"}]}}"#;
    std::fs::write(bundle.join("config.json"), config)?;
    let id = format!("warden-bench-{}", std::process::id());
    // Pipes of its own: runsc hands its stdio to the sandbox and re-owns them (never the
    // host's /dev/null).
    let mut container = Command::new(&runsc)
        .args(["--network=none", "--ignore-cgroups", "run", "--bundle"])
        .arg(&bundle)
        .arg(&id)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = Command::new(&runsc)
            .args(["exec", &id, "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            break;
        }
        if Instant::now() > deadline {
            let _ = container.kill();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut samples = Vec::new();
    for _ in 0..runs {
        let start = Instant::now();
        Command::new(&runsc)
            .args(["exec", &id, "true"])
            .stdout(Stdio::null())
            .status()?;
        samples.push(start.elapsed());
    }
    let _ = Command::new(&runsc).args(["kill", &id, "KILL"]).status();
    let _ = container.wait();
    let _ = Command::new(&runsc)
        .args(["delete", "-force", &id])
        .stderr(Stdio::null())
        .status();
    let _ = std::fs::remove_dir_all(&bundle);
    Ok(Some(samples))
}

fn journal_rate(entries: usize, threads: usize) -> Result<(f64, Duration)> {
    let dir = std::env::temp_dir().join(format!("warden-bench-journal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let journal = Arc::new(warden_journal::Journal::open(&dir)?);
    let per_thread = entries / threads;
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let journal = Arc::clone(&journal);
            std::thread::spawn(move || {
                for i in 0..per_thread {
                    let data = serde_json::json!({ "process": i, "thread": t, "argv": ["true"], "code": 0 });
                    if journal.append(Some("bench"), "exec.exit", data).is_err() {
                        return;
                    }
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
    let elapsed = start.elapsed();
    // One writer alone: every append waits for its own fdatasync.
    let single_start = Instant::now();
    for i in 0..200 {
        journal.append(None, "t", serde_json::json!({ "i": i }))?;
    }
    let single = single_start.elapsed() / 200;
    drop(journal);
    let verify = warden_journal::verify(&dir, None)?;
    if verify.entries < (per_thread * threads) as u64 {
        bail!("the journal lost entries: {verify:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok((
        (per_thread * threads) as f64 / elapsed.as_secs_f64(),
        single,
    ))
}

fn main() -> Result<()> {
    warden_bench::end_on_signal()?;
    let args = args()?;
    let warden = std::env::current_exe()?.with_file_name("warden");
    if !warden.exists() {
        bail!(
            "{} is missing: build it with `cargo build --release`",
            warden.display()
        );
    }
    warden_bench::settle(&warden)?;
    let dir = std::env::temp_dir().join(format!("warden-bench-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o711))?;
    let daemon = Daemon::start(&warden, &dir, &["--e2b", "127.0.0.1:0"])?;
    let (status, raw) = request(&daemon.socket, "POST", "/v1/cells", r#"{"name":"bench"}"#)?;
    if status != 201 {
        bail!("creating a cell failed: {raw}");
    }

    warden_bench::say!(
        "exec round trip of `true` ({} runs each, warden and fork/exec interleaved, 2-core VM)",
        args.runs
    );
    let mut rows: Vec<(String, Vec<Duration>)> = Vec::new();
    // Interleaved, one of each per round, so that all see the same moments of a noisy host.
    let (mut api, mut plain, mut mcp, mut kept) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut session = McpSession::open(&daemon.socket)?;
    let mut connection = warden_bench::Kept::open(&daemon.socket)?;
    let mut baseline = match &args.baseline {
        Some(binary) => {
            warden_bench::settle(binary)?;
            let dir = dir.join("baseline");
            std::fs::create_dir_all(&dir)?;
            let other = Daemon::start(binary, &dir, &[])?;
            let (status, raw) = request(&other.socket, "POST", "/v1/cells", r#"{"name":"bench"}"#)?;
            if status != 201 {
                bail!("creating a cell in the baseline's daemon failed: {raw}");
            }
            Some((other, Vec::new()))
        }
        None => None,
    };
    for i in 0..args.runs + 10 {
        let keep = i >= 10;
        if let Some((other, samples)) = &mut baseline {
            // Side by side with a baseline, each round is the two daemons' execs alone, in
            // turns first (the exec that follows another into the same daemon finds it warm:
            // the MCP and kept-connection rows, which only this daemon gets, would favour it).
            let base_first = i % 2 == 0;
            let base = || {
                warden_bench::timed_exec(&other.socket, "bench").context("the baseline's daemon")
            };
            let before = if base_first { Some(base()?) } else { None };
            let took = warden_bench::timed_exec(&daemon.socket, "bench")?;
            let after = if base_first { None } else { Some(base()?) };
            let start = Instant::now();
            Command::new("true").status()?;
            let forked = start.elapsed();
            if keep {
                samples.extend(before.or(after));
                api.push(took);
                plain.push(forked);
            }
            continue;
        }
        let start = Instant::now();
        let answer = session.call(
            "tools/call",
            r#"{"name":"exec","arguments":{"cell":"bench","argv":["true"]}}"#,
        )?;
        let by_mcp = start.elapsed();
        if !answer.contains(r#""status":0"#) {
            bail!("the MCP exec failed: {answer}");
        }
        let took = warden_bench::timed_exec(&daemon.socket, "bench")?;
        let on_kept = warden_bench::timed_exec_on(&mut connection, "bench")?;
        let start = Instant::now();
        Command::new("true").status()?;
        let forked = start.elapsed();
        if keep {
            api.push(took);
            kept.push(on_kept);
            plain.push(forked);
            mcp.push(by_mcp);
        }
    }
    rows.push(("warden exec (API, unix socket)".to_owned(), api));
    if baseline.is_none() {
        rows.push(("warden exec (API, one kept connection)".to_owned(), kept));
        rows.push(("warden exec (MCP tool, one session)".to_owned(), mcp));
    }
    rows.push(("fork/exec on the host".to_owned(), plain));
    if let Some((other, samples)) = baseline {
        rows.push(("baseline exec (API, unix socket)".to_owned(), samples));
        drop(other);
    }
    if !args.exec_only
        && let Some(samples) = runsc_exec(args.runs.min(100))?
    {
        rows.push(("runsc exec (running gVisor container)".to_owned(), samples));
    }
    table(&mut rows, "median/warden");
    let exec_median = percentile(&mut rows[0].1.clone(), 0.5);
    if args.exec_only {
        drop(daemon);
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(());
    }

    warden_bench::say!(
        "\nthe warden's agent loop, per turn ({} turns of one exec of `true`; a model server that answers at once, Chat Completions streamed)",
        args.runs
    );
    let turns = agent_turns(&daemon, args.runs)?;
    let overhead: Vec<Duration> = turns
        .iter()
        .map(|t| t.saturating_sub(exec_median))
        .collect();
    let snapshots = snapshot_round_trips(&daemon, args.runs.min(100))?;
    table(
        &mut [
            (
                "turn (model call + tool + snapshot + journal)".to_owned(),
                turns,
            ),
            ("turn minus the exec round trip".to_owned(), overhead),
            (
                "exec round trip alone (API, above)".to_owned(),
                vec![exec_median],
            ),
            ("a workspace snapshot alone (API)".to_owned(), snapshots),
        ],
        "median/turn",
    );

    let runs = args.runs.min(50);
    warden_bench::say!(
        "\nsandbox lifecycle ({runs} rounds each: the daemon's API beside the real e2b SDK against its E2B-compatible API)"
    );
    table(&mut lifecycle(&daemon, runs)?, "median/API");

    warden_bench::say!(
        "\nmemory of idle cells ({} cells, PSS and RSS of the daemon, keepers and cell inits)",
        args.cells
    );
    let (before_pss, before_rss, _) = tree_memory(daemon.child.id());
    let created = Instant::now();
    for i in 0..args.cells {
        let body = format!(r#"{{"name":"idle{i}"}}"#);
        let (status, raw) = request(&daemon.socket, "POST", "/v1/cells", &body)?;
        if status != 201 {
            bail!("creating cell {i} failed: {raw}");
        }
    }
    let create_each = created.elapsed() / args.cells.max(1) as u32;
    // Idle: each cell up for two seconds or more (a keeper lets go of its start's pages after
    // one).
    std::thread::sleep(Duration::from_secs(2));
    let (after_pss, after_rss, processes) = tree_memory(daemon.child.id());
    let n = args.cells.max(1) as f64;
    warden_bench::say!(
        "{:<40} {:>10.0} KiB PSS {:>10.0} KiB RSS  ({processes} processes)",
        "total",
        after_pss as f64,
        after_rss as f64
    );
    warden_bench::say!(
        "{:<40} {:>10.0} KiB PSS {:>10.0} KiB RSS",
        "per idle cell",
        (after_pss - before_pss) as f64 / n,
        (after_rss - before_rss) as f64 / n
    );
    warden_bench::say!(
        "{:<40} {:>10}",
        "create, each (sequential)",
        ms(create_each)
    );
    drop(daemon);

    warden_bench::say!(
        "\njournal with fdatasync before acknowledgement ({} entries, 64 writers)",
        args.entries
    );
    let (rate, single) = journal_rate(args.entries, 64)?;
    warden_bench::say!(
        "{:<40} {:>10.0} entries/s",
        "group commit, 64 concurrent writers",
        rate
    );
    warden_bench::say!("{:<40} {:>10}", "one writer alone, per entry", ms(single));
    let _ = std::fs::remove_dir_all(&dir);
    // The snapshot cell's workspace, once its daemon (and the cell) are gone.
    let _ = std::fs::remove_dir_all(workspace_dir());
    Ok(())
}
