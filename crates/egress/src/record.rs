//! The gateway's record of every decision, one JSON line each, written by the warden (never by
//! the cell): destination, method and path when known, verdict, rule, bytes each way.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One decision of the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub time_unix_ms: u64,
    pub cell: String,
    /// `connect` (a tunnel) or `http` (a plain request).
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
}

impl Decision {
    pub fn now_ms() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
}

/// An append-only log file shared by the gateway's connection threads.
#[derive(Debug)]
pub struct Log {
    file: Mutex<File>,
}

impl Log {
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Mutex::new(file),
        })
    }

    pub fn write(&self, decision: &Decision) {
        let Ok(mut line) = serde_json::to_vec(decision) else {
            return;
        };
        line.push(b'\n');
        if let Ok(mut file) = self.file.lock() {
            let _ = file.write_all(&line);
        }
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
