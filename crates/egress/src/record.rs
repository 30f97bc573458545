//! The gateway's record of every decision, one JSON line each, written by the warden (never by
//! the cell): destination, method and path when known, verdict, rule, bytes each way.
//!
//! A cell decides how many decisions it causes, so what the record costs the host is bounded
//! here, whatever the cell does: within each second, a decision like one already written in
//! that second is only counted (one line with `repeats` follows at the end of the second), at
//! most [`LINES_PER_SECOND`] lines are written one by one (the rest are summed up in one line),
//! and the record stops at its quota (`limits.records`) with a line that says so; from then on
//! decisions are counted, and the count is written when the record closes.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Lines written one by one per second; more decisions in that second are summed up.
pub const LINES_PER_SECOND: u32 = 100;
const WINDOW: Duration = Duration::from_secs(1);

/// One decision of the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub time_unix_ms: u64,
    pub cell: String,
    /// `connect` (a tunnel), `http` (a plain request), `https` (inside intercepted TLS),
    /// `transparent`, `dns`; `summary` for a line that sums up decisions not written one by one.
    pub kind: String,
    pub host: String,
    pub port: u16,
    pub method: Option<String>,
    pub path: Option<String>,
    pub allowed: bool,
    pub rule: String,
    pub reason: String,
    /// The address actually connected to, when the connection was made.
    pub address: Option<String>,
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// On a line that sums up (written at the end of a second): how many decisions it stands
    /// for, with their bytes added up. Decisions like one already written in that second come
    /// to this; so do (with `kind: summary`) those past the rate or the quota. An ordinary line
    /// has none and stands for itself.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub repeats: u64,
    /// A model exchange (through `network.inference`, or a model call the gateway saw on its
    /// way elsewhere), as read from its wire format (model,
    /// tokens, latency, stop reason, the text up to a limit): such a line is never folded into
    /// another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference: Option<serde_json::Value>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Decision {
    pub fn now_ms() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    /// What makes two decisions alike: everything but the time, the bytes and the address.
    fn key(&self) -> Key {
        (
            self.kind.clone(),
            self.host.clone(),
            self.port,
            self.method.clone(),
            self.path.clone(),
            self.allowed,
            self.rule.clone(),
            self.reason.clone(),
        )
    }

    fn summary(cell: &str, reason: String, allowed: u64, refused: u64) -> Self {
        Self {
            time_unix_ms: Self::now_ms(),
            cell: cell.to_owned(),
            kind: "summary".to_owned(),
            host: String::new(),
            port: 0,
            method: None,
            path: None,
            allowed: refused == 0,
            rule: "record".to_owned(),
            reason: format!("{reason} ({allowed} allowed, {refused} refused)"),
            address: None,
            bytes_up: 0,
            bytes_down: 0,
            repeats: allowed + refused,
            inference: None,
        }
    }
}

type Key = (
    String,
    String,
    u16,
    Option<String>,
    Option<String>,
    bool,
    String,
    String,
);

/// An append-only log file shared by the gateway's connection threads.
#[derive(Debug)]
pub struct Log {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    file: File,
    cell: String,
    written: u64,
    quota: u64,
    window: Instant,
    /// Decisions written one by one in this window, with what came after them like them.
    seen: HashMap<Key, Decision>,
    /// Model exchanges written in this window (each its own line, within the same rate).
    exchanges: usize,
    /// Decisions of this window past the rate: (allowed, refused).
    over_rate: (u64, u64),
    /// Decisions past the quota: (allowed, refused).
    over_quota: (u64, u64),
    quota_said: bool,
}

impl Log {
    /// Opens (appends to) the record at `path`, which may grow to `quota` bytes more; a thread
    /// writes what each second summed up, for as long as the log lives.
    pub fn open(path: &Path, cell: &str, quota: u64) -> io::Result<Arc<Self>> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let log = Arc::new(Self {
            state: Mutex::new(State {
                file,
                cell: cell.to_owned(),
                written: 0,
                quota,
                window: Instant::now(),
                seen: HashMap::new(),
                exchanges: 0,
                over_rate: (0, 0),
                over_quota: (0, 0),
                quota_said: false,
            }),
        });
        let weak = Arc::downgrade(&log);
        std::thread::Builder::new()
            .name("egress-record".to_owned())
            .spawn(move || flush_windows(&weak))?;
        Ok(log)
    }

    pub fn write(&self, decision: &Decision) {
        if let Ok(mut state) = self.state.lock() {
            state.add(decision);
        }
    }

    /// Writes what is summed up so far, and the count of what the quota kept out: the
    /// record's last lines, when the cell ends (threads still serving it keep the log alive).
    pub fn close(&self) {
        if let Ok(mut state) = self.state.lock() {
            state.close();
        }
    }
}

/// Ends each window a second after it began, until the log is dropped.
fn flush_windows(log: &Weak<Log>) {
    loop {
        std::thread::sleep(WINDOW / 4);
        let Some(log) = log.upgrade() else { return };
        if let Ok(mut state) = log.state.lock()
            && state.window.elapsed() >= WINDOW
        {
            state.end_window();
        }
    }
}

impl State {
    fn add(&mut self, decision: &Decision) {
        if self.window.elapsed() >= WINDOW {
            self.end_window();
        }
        let tally = |counts: &mut (u64, u64)| {
            if decision.allowed {
                counts.0 += 1;
            } else {
                counts.1 += 1;
            }
        };
        if self.quota_said {
            return tally(&mut self.over_quota);
        }
        if decision.inference.is_some() {
            // Each exchange is its own line (within the rate and the quota).
            if self.seen.len() + self.exchanges >= LINES_PER_SECOND as usize {
                return tally(&mut self.over_rate);
            }
            self.exchanges += 1;
            return self.line(decision);
        }
        if let Some(first) = self.seen.get_mut(&decision.key()) {
            first.repeats += 1;
            first.bytes_up += decision.bytes_up;
            first.bytes_down += decision.bytes_down;
            return;
        }
        if self.seen.len() + self.exchanges >= LINES_PER_SECOND as usize {
            return tally(&mut self.over_rate);
        }
        self.line(decision);
        let mut first = decision.clone();
        first.repeats = 0;
        first.bytes_up = 0;
        first.bytes_down = 0;
        self.seen.insert(decision.key(), first);
    }

    /// Writes what the window summed up and starts the next.
    fn end_window(&mut self) {
        self.exchanges = 0;
        let repeated: Vec<Decision> = self
            .seen
            .drain()
            .map(|(_, d)| d)
            .filter(|d| d.repeats > 0)
            .collect();
        for mut decision in repeated {
            decision.time_unix_ms = Decision::now_ms();
            self.line(&decision);
        }
        let (allowed, refused) = std::mem::take(&mut self.over_rate);
        if allowed + refused > 0 {
            let summary = Decision::summary(
                &self.cell,
                format!(
                    "{} more decisions within one second were not written one by one (more than {LINES_PER_SECOND} different ones a second)",
                    allowed + refused
                ),
                allowed,
                refused,
            );
            self.line(&summary);
        }
        self.window = Instant::now();
    }

    /// Writes one line, unless the quota is reached: then, once, the line that says so.
    fn line(&mut self, decision: &Decision) {
        let Ok(mut line) = serde_json::to_vec(decision) else {
            return;
        };
        line.push(b'\n');
        if self.quota_said {
            return;
        }
        if self.written + line.len() as u64 > self.quota {
            self.quota_said = true;
            let notice = Decision::summary(
                &self.cell,
                format!(
                    "the record reached its quota of {} bytes (limits.records): later decisions are counted, not written",
                    self.quota
                ),
                0,
                0,
            );
            if let Ok(mut notice) = serde_json::to_vec(&notice) {
                notice.push(b'\n');
                self.append(&notice);
            }
            return;
        }
        self.append(&line);
    }

    fn append(&mut self, line: &[u8]) {
        if self.file.write_all(line).is_ok() {
            self.written += line.len() as u64;
        }
    }
}

impl State {
    /// The count of what the quota kept out, as the record's last line.
    fn close(&mut self) {
        self.end_window();
        let (allowed, refused) = std::mem::take(&mut self.over_quota);
        if allowed + refused > 0 {
            let summary = Decision::summary(
                &self.cell,
                format!(
                    "{} decisions after the quota was reached were not written",
                    allowed + refused
                ),
                allowed,
                refused,
            );
            if let Ok(mut line) = serde_json::to_vec(&summary) {
                line.push(b'\n');
                self.append(&line);
            }
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        self.close();
    }
}

/// Reads a log written by [`Log`]; unreadable lines are skipped.
pub fn read_log(path: &Path) -> io::Result<Vec<Decision>> {
    let file = File::open(path)?;
    Ok(BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(host: &str, allowed: bool) -> Decision {
        Decision {
            time_unix_ms: 0,
            cell: "c".into(),
            kind: "dns".into(),
            host: host.into(),
            port: 53,
            method: None,
            path: None,
            allowed,
            rule: "default".into(),
            reason: "r".into(),
            address: None,
            bytes_up: 1,
            bytes_down: 2,
            repeats: 0,
            inference: None,
        }
    }

    fn temp_log(quota: u64) -> (Arc<Log>, std::path::PathBuf) {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "warden-record-test-{}-{}.jsonl",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        (Log::open(&path, "c", quota).unwrap(), path)
    }

    #[test]
    fn repeats_are_counted_on_one_line_and_a_flood_is_summed_up() {
        let (log, path) = temp_log(1 << 30);
        for _ in 0..10_000 {
            log.write(&decision("same.test", false));
        }
        for i in 0..5_000 {
            log.write(&decision(&format!("n{i}.test"), i % 2 == 0));
        }
        drop(log);
        let lines = read_log(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        // The first of each kind, its repeats, and one summary of what passed the rate.
        assert!(
            lines.len() <= 2 + LINES_PER_SECOND as usize * 2,
            "{} lines",
            lines.len()
        );
        let total: u64 = lines
            .iter()
            .map(|d| {
                if d.kind == "summary" || d.repeats > 0 {
                    d.repeats
                } else {
                    1
                }
            })
            .sum();
        assert_eq!(total, 15_000, "every decision is counted once");
        let same: Vec<&Decision> = lines.iter().filter(|d| d.host == "same.test").collect();
        assert_eq!(same.len(), 2);
        assert_eq!(same[1].repeats, 9_999);
        assert_eq!(same[1].bytes_down, 2 * 9_999);
    }

    #[test]
    fn the_record_stops_at_its_quota_and_says_so() {
        let (log, path) = temp_log(4096);
        for i in 0..50_000 {
            log.write(&decision(&format!("n{i}.test"), true));
            if i % 90 == 0 {
                // Across windows, as a slow flood would be.
                log.state.lock().unwrap().end_window();
            }
        }
        drop(log);
        let size = std::fs::metadata(&path).unwrap().len();
        let lines = read_log(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(size < 4096 + 1024, "the record grew to {size} bytes");
        assert!(
            lines.iter().any(|d| d.reason.contains("reached its quota")),
            "{lines:?}"
        );
        let last = lines.last().unwrap();
        assert!(last.reason.contains("after the quota"), "{last:?}");
    }
}
