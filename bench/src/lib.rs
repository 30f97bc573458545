//! What the benchmarks share: a daemon of their own, requests over its unix socket, the
//! memory of process trees, percentiles and tables.

use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// `println!` that does not end the benchmark when its output is closed (a reader such as
/// `head` that has seen enough): the rest of the run goes on unseen and cleans up after itself
/// (its daemon's cells, sandboxes made by hand), where a panic would leave them behind.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` that, like `say!`, lets a closed standard error pass (`2>&1 | head`).
#[macro_export]
macro_rules! tell {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Where a rootless run as `nobody` keeps its runtime and state folders (where `nobody` may
/// make them): the environment `coldstart` and `order-startup` give such a run, with
/// `XDG_RUNTIME_DIR` (root's) removed.
pub fn nobody_env() -> [(&'static str, PathBuf); 2] {
    let tmp = std::env::temp_dir();
    [
        ("WARDEN_RUNTIME_DIR", tmp.join("warden-bench-nobody")),
        ("WARDEN_STATE_DIR", tmp.join("warden-bench-nobody-state")),
    ]
}

/// The `p`th percentile of `samples` (sorted in place).
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index.min(samples.len().saturating_sub(1))]
}

pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// Median and p99 of each row, and the median's ratio to the first row's.
pub fn table(rows: &mut [(String, Vec<Duration>)], versus: &str) {
    let base = percentile(&mut rows[0].1.clone(), 0.5);
    say!("{:<44} {:>11} {:>11} {:>14}", "", "median", "p99", versus);
    for (name, samples) in rows.iter_mut() {
        let median = percentile(samples, 0.5);
        let p99 = percentile(samples, 0.99);
        say!(
            "{name:<44} {:>11} {:>11} {:>13.2}x",
            ms(median),
            ms(p99),
            median.as_secs_f64() / base.as_secs_f64()
        );
    }
}

/// One HTTP/1.1 request on a fresh unix connection, read to the end of its answer (as its
/// framing says: a `Content-Length`, the last chunk of a chunked body, or none for a 204), not
/// to the connection's close, which a client of the API does not wait for: the status and the
/// raw answer.
pub fn request(socket: &Path, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let mut stream = UnixStream::connect(socket).context("connecting to the daemon")?;
    send(&mut stream, method, path, body, "Connection: close\r\n")?;
    let raw = read_answer(&mut std::io::BufReader::new(stream))?;
    Ok((status_of(&raw), raw))
}

/// Writes one request; `more`: header lines of its own, each ending in CRLF.
fn send(
    to: &mut impl std::io::Write,
    method: &str,
    path: &str,
    body: &str,
    more: &str,
) -> Result<()> {
    write!(
        to,
        "{method} {path} HTTP/1.1\r\nHost: w\r\n{more}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    Ok(())
}

/// An answer's status (0 where its first line has none).
fn status_of(raw: &str) -> u16 {
    raw.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// One connection to the daemon's API kept for many requests, as an SDK's HTTP client keeps
/// its connections: no connect and accept per request.
#[derive(Debug)]
pub struct Kept {
    reader: std::io::BufReader<UnixStream>,
    writer: UnixStream,
}

impl Kept {
    pub fn open(socket: &Path) -> Result<Self> {
        let writer = UnixStream::connect(socket).context("connecting to the daemon")?;
        let reader = std::io::BufReader::new(writer.try_clone()?);
        Ok(Self { reader, writer })
    }

    /// One request on the connection, read to the end of its answer: the status and the raw
    /// answer.
    pub fn request(&mut self, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
        send(&mut self.writer, method, path, body, "")?;
        let raw = read_answer(&mut self.reader)?;
        if raw.to_ascii_lowercase().contains("\r\nconnection: close") {
            bail!("the daemon closed a kept connection: {raw}");
        }
        Ok((status_of(&raw), raw))
    }
}

/// An HTTP/1.1 answer, its head and body as they came (chunk sizes too), up to its end.
fn read_answer(reader: &mut impl std::io::BufRead) -> Result<String> {
    let mut raw = String::new();
    let mut length = None;
    let mut chunked = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            bail!("the daemon closed the connection within an answer's head: {raw}");
        }
        raw.push_str(&line);
        let header = line.trim_end().to_ascii_lowercase();
        if header.is_empty() {
            break;
        }
        if let Some(value) = header.strip_prefix("content-length:") {
            length = value.trim().parse::<usize>().ok();
        }
        if header.starts_with("transfer-encoding:") && header.contains("chunked") {
            chunked = true;
        }
    }
    let status = raw.split(' ').nth(1).unwrap_or_default();
    if chunked {
        loop {
            let mut size = String::new();
            if reader.read_line(&mut size)? == 0 {
                bail!("the daemon closed the connection within a chunked answer: {raw}");
            }
            raw.push_str(&size);
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                .with_context(|| format!("a chunk's size in: {raw}"))?;
            // The chunk and its CRLF; after the last (empty) chunk, the CRLF that ends it.
            let mut chunk = vec![0; n + 2];
            reader.read_exact(&mut chunk)?;
            raw.push_str(&String::from_utf8_lossy(&chunk));
            if n == 0 {
                return Ok(raw);
            }
        }
    }
    match length {
        Some(n) => {
            let mut body = vec![0; n];
            reader.read_exact(&mut body)?;
            raw.push_str(&String::from_utf8_lossy(&body));
        }
        None if status == "204" || status == "304" => {}
        None => {
            reader.read_to_string(&mut raw)?;
        }
    }
    Ok(raw)
}

/// The first string field `key` of a raw answer's JSON body, if it has one.
pub fn string_field(raw: &str, key: &str) -> Option<String> {
    raw.split(&format!("\"{key}\":\""))
        .nth(1)
        .and_then(|r| r.split('"').next())
        .map(str::to_owned)
}

/// Through a daemon's API: creates a cell (`body`), runs `true` in it, deletes it; its name.
pub fn create_exec_delete(socket: &Path, body: &str) -> Result<String> {
    let (status, raw) = request(socket, "POST", "/v1/cells", body)?;
    if status != 201 {
        bail!("creating a cell failed: {raw}");
    }
    let name = string_field(&raw, "name").context("no name in the create's answer")?;
    let exec = format!("/v1/cells/{name}/exec");
    let (_, raw) = request(socket, "POST", &exec, r#"{"argv":["true"]}"#)?;
    if !raw.contains("event: exit") || !raw.contains("\"code\":0") {
        bail!("exec failed: {raw}");
    }
    let (status, raw) = request(socket, "DELETE", &format!("/v1/cells/{name}"), "")?;
    if status != 204 {
        bail!("deleting {name} failed: {raw}");
    }
    Ok(name)
}

/// One exec of `true` in `cell` through a daemon's API, timed until its `exit` event is read.
pub fn timed_exec(socket: &Path, cell: &str) -> Result<Duration> {
    timed(cell, |path, body| request(socket, "POST", path, body))
}

/// Like `timed_exec`, on a kept connection.
pub fn timed_exec_on(connection: &mut Kept, cell: &str) -> Result<Duration> {
    timed(cell, |path, body| connection.request("POST", path, body))
}

/// How long the exec of `true` in `cell` takes, sent by `post` (a path and a body).
fn timed(cell: &str, post: impl FnOnce(&str, &str) -> Result<(u16, String)>) -> Result<Duration> {
    let start = Instant::now();
    let (status, raw) = post(&format!("/v1/cells/{cell}/exec"), r#"{"argv":["true"]}"#)?;
    let took = start.elapsed();
    if status != 200 || !raw.contains("event: exit") {
        bail!("exec in cell `{cell}` failed: {raw}");
    }
    Ok(took)
}

/// Through a daemon's API, in one call (`POST /v1/run`): a cell made from `cell` (a create's
/// body) runs `true` and is deleted before the answer ends; the cell's name.
pub fn run_once(socket: &Path, cell: &str) -> Result<String> {
    let body = format!(r#"{{"cell":{cell},"exec":{{"argv":["true"]}}}}"#);
    let (status, raw) = request(socket, "POST", "/v1/run", &body)?;
    if status != 200 || !raw.contains("event: exit") || !raw.contains("\"code\":0") {
        bail!("the run failed: {raw}");
    }
    if raw.contains("event: error") {
        bail!("the run's cell was not deleted: {raw}");
    }
    string_field(&raw, "cell").context("no cell named in the run's `started`")
}

/// Waits until the daemon's (only) pool has `ready` cells made ahead, for at most `within`.
pub fn wait_for_pool(socket: &Path, ready: usize, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    let want = format!("\"ready\":{ready}");
    while !request(socket, "GET", "/v1/pools", "")?.1.contains(&want) {
        if Instant::now() > deadline {
            bail!("the daemon's pool had no {ready} cells ready within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// A `warden serve` of the benchmark's own, with its runtime and state under `dir`.
#[derive(Debug)]
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
}

impl Daemon {
    pub fn start(warden: &Path, dir: &Path, extra: &[&str]) -> Result<Self> {
        Self::start_with_env(warden, dir, extra, &[])
    }

    /// The same, with these variables in the daemon's environment.
    pub fn start_with_env(
        warden: &Path,
        dir: &Path,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> Result<Self> {
        let runtime = dir.join("run");
        let state = dir.join("state");
        // In a process group of its own: a terminal's Ctrl-C reaches the benchmark, which
        // deletes the daemon's cells before it ends it (`end_on_signal`), not the daemon first.
        let mut child = Command::new(warden)
            .arg("serve")
            .args(extra)
            .envs(envs.iter().copied())
            .env("WARDEN_RUNTIME_DIR", &runtime)
            .env("WARDEN_STATE_DIR", &state)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", warden.display()))?;
        let socket = runtime.join("daemon.sock");
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&socket).is_err() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the daemon did not come up within 20 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        daemons().push((socket.clone(), child.id()));
        Ok(Self { child, socket })
    }

    pub fn runtime(&self) -> &Path {
        self.socket.parent().unwrap_or(Path::new("."))
    }
}

impl Drop for Daemon {
    /// Deletes every cell (their keepers outlive a daemon by design), then ends the daemon.
    fn drop(&mut self) {
        let pid = self.child.id();
        daemons().retain(|(_, p)| *p != pid);
        delete_cells(&self.socket);
        terminate(pid);
        let _ = self.child.wait();
    }
}

/// The daemons of this benchmark that are up: their sockets and pids.
fn daemons() -> std::sync::MutexGuard<'static, Vec<(PathBuf, u32)>> {
    static DAEMONS: std::sync::Mutex<Vec<(PathBuf, u32)>> = std::sync::Mutex::new(Vec::new());
    DAEMONS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Deletes every cell of the daemon at `socket`.
fn delete_cells(socket: &Path) {
    if let Ok((_, raw)) = request(socket, "GET", "/v1/cells", "") {
        for name in raw.split("\"name\":\"").skip(1) {
            if let Some(name) = name.split('"').next() {
                let _ = request(socket, "DELETE", &format!("/v1/cells/{name}"), "");
            }
        }
    }
}

fn terminate(pid: u32) {
    signal(pid, nix::sys::signal::Signal::SIGTERM);
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
    }
}

/// How long the processes below a stopped benchmark have to end before they are killed (a
/// daemon finishes the removal of its cells' layers first, for up to 30 s).
const STOP_WITHIN: Duration = Duration::from_secs(40);

/// Makes a stop by SIGINT, SIGTERM or SIGHUP end what the benchmark started rather than leave
/// it behind: each daemon of the benchmark's own has its cells deleted and is ended (a cell's
/// keeper outlives its daemon by design), the benchmark's other children get SIGTERM (a `warden
/// run` ends its cell, a benchmark run by `bench-report` its own daemons), and what is still
/// below the benchmark after `STOP_WITHIN` SIGKILL; then the benchmark exits with 128 and the
/// signal's number. The signals are taken by a thread of their own (handlers, not a blocked
/// mask, which the processes the benchmark starts would inherit: a daemon that inherited them
/// blocked never heard its SIGTERM).
pub fn end_on_signal() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("taking the signals that stop a benchmark")?;
    std::thread::Builder::new()
        .name("stop".to_owned())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let name = signal_hook::low_level::signal_name(signal).unwrap_or("a signal");
                tell!("{name}: ending what the benchmark started");
                end_all();
                std::process::exit(128 + signal);
            }
        })
        .context("starting the thread that takes the signals that stop a benchmark")?;
    Ok(())
}

/// Ends every daemon of the benchmark's (their cells deleted first), then the benchmark's other
/// children (each ends what it started: a `warden run` its cell, a benchmark run by
/// `bench-report` its own daemons), and kills what is still below the benchmark at the end.
fn end_all() {
    let up = std::mem::take(&mut *daemons());
    for (socket, pid) in &up {
        delete_cells(socket);
        terminate(*pid);
    }
    let me = std::process::id();
    for (pid, _) in parents().into_iter().filter(|(_, parent)| *parent == me) {
        terminate(pid);
    }
    let below = || -> Vec<u32> {
        tree_pids(me)
            .into_iter()
            .filter(|pid| *pid != me && !ended(*pid))
            .collect()
    };
    let deadline = Instant::now() + STOP_WITHIN;
    loop {
        let left = below();
        if left.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            tell!(
                "killing {} processes still up {} s after the stop",
                left.len(),
                STOP_WITHIN.as_secs()
            );
            for pid in left {
                signal(pid, nix::sys::signal::Signal::SIGKILL);
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `pid` has ended: gone, or a zombie its parent has not reaped yet.
pub fn ended(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rfind(')')
        .and_then(|i| stat.get(i + 2..i + 3))
        .is_none_or(|state| state == "Z")
}

/// PSS and RSS of one process, in KiB.
pub fn memory_kib(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("Pss:"), field("Rss:"))
}

/// PSS and RSS (KiB) of `root` and every process below it, and how many they are.
/// The children of `parent` whose command line is `BINARY WHAT ...` (a warden subcommand).
pub fn children_named(parent: u32, what: &str) -> Vec<u32> {
    parents()
        .into_iter()
        .filter(|(pid, ppid)| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            *ppid == parent && cmdline.split(|b| *b == 0).nth(1) == Some(what.as_bytes())
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// Every process, with its parent: (pid, ppid).
fn parents() -> Vec<(u32, u32)> {
    let mut parents = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        if let Some(ppid) = rest.split(' ').nth(1).and_then(|p| p.parse().ok()) {
            parents.push((pid, ppid));
        }
    }
    parents
}

pub fn tree_memory(root: u32) -> (u64, u64, usize) {
    let tree = tree_pids(root);
    let (mut pss, mut rss) = (0, 0);
    for pid in &tree {
        let (p, r) = memory_kib(*pid);
        pss += p;
        rss += r;
    }
    (pss, rss, tree.len())
}

/// `root` and every process below it.
pub fn tree_pids(root: u32) -> Vec<u32> {
    let parents = parents();
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

pub fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Puts a binary's file in the page cache as an installed one's is: written to the disk and
/// dropped from memory, so that its first start reads it back (as after a reboot) and every
/// start after that maps what was read. A binary just linked by cargo (written in small
/// pieces) ran `warden --version` 0.25-0.35 ms slower, with 18 more page faults, than a copy of
/// it, and two copies of one build differed by 0.4 ms in `warden run -- true` (300 interleaved
/// runs): without this, a build measured right after it was made is measured at a disadvantage
/// that no user has.
pub fn settle(binary: &Path) -> Result<()> {
    use std::os::fd::AsFd as _;
    let file = std::fs::File::open(binary)
        .with_context(|| format!("opening {} to settle it", binary.display()))?;
    file.sync_data()
        .with_context(|| format!("writing {} to the disk", binary.display()))?;
    rustix::fs::fadvise(file.as_fd(), 0, None, rustix::fs::Advice::DontNeed)
        .with_context(|| format!("dropping {} from the page cache", binary.display()))?;
    Ok(())
}

/// Where [`shuffle`]'s orders start: the same from run to run.
pub const SHUFFLE_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// Fisher-Yates with a xorshift, for the order of a benchmark's rows in each round: what one
/// row leaves behind falls on whichever runs next, so no row may always follow the same one.
/// The order needs no more than to differ from round to round.
pub fn shuffle(items: &mut [usize], seed: &mut u64) {
    for i in (1..items.len()).rev() {
        items.swap(i, (next_random(seed) % (i as u64 + 1)) as usize);
    }
}

/// The next number of a xorshift sequence (`seed` is its state): for a benchmark's orders and
/// resamples, the same every run.
pub fn next_random(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

#[cfg(test)]
mod tests {
    use super::read_answer;

    fn read(raw: &str) -> String {
        read_answer(&mut std::io::Cursor::new(raw.as_bytes())).unwrap()
    }

    #[test]
    fn an_answer_ends_where_its_framing_says_not_at_the_close() {
        let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n";
        assert_eq!(read(&format!("{chunked}left over")), chunked);
        let sized = "HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\n{\"a\"";
        assert_eq!(read(&format!("{sized}}} more")), sized);
        let empty = "HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(read(&format!("{empty}junk")), empty);
        // Without framing, the close ends it.
        let closed = "HTTP/1.1 200 OK\r\n\r\nuntil the end";
        assert_eq!(read(closed), closed);
    }

    #[test]
    fn an_answer_cut_short_is_an_error() {
        let cut = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel";
        assert!(read_answer(&mut std::io::Cursor::new(cut.as_bytes())).is_err());
        assert!(read_answer(&mut std::io::Cursor::new(b"HTTP/1.1 200 OK\r\n".as_slice())).is_err());
    }
}
