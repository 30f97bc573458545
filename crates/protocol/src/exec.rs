//! Processes in cells: what starts one, what it emits, how it ends.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The size of a terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TtySize {
    pub rows: u16,
    pub cols: u16,
}

/// CPU time and peak memory of a process, as the cell's init saw them when it reaped it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Usage {
    pub cpu_user_ms: u64,
    pub cpu_system_ms: u64,
    pub max_rss_kib: u64,
}

/// A request to start a process in a cell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// Bytes for stdin, then end of input; without it stdin stays open for later writes
    /// (background processes) or is closed at once (foreground).
    pub stdin: Option<String>,
    /// Kill the process after this many milliseconds.
    pub timeout_ms: Option<u64>,
    /// Keep running when the client that started it goes away; read it again by its id.
    #[serde(default)]
    pub background: bool,
    /// Run on a terminal of this size (one output stream; resize it later).
    pub tty: Option<TtySize>,
    /// Kill the process once it has written more than this many bytes (stdout and stderr).
    pub output_limit: Option<u64>,
    /// The user to run as: a cell runs every process as its one user (`process.user` of its
    /// policy; no process in it can change ids), so only that uid is accepted.
    pub user: Option<u32>,
}

/// A request to run one command in a cell made for it, deleted once the command ends
/// (`POST /v1/run`): a create and a foreground exec in one call, the cell's delete before the
/// answer's last event.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunOnce {
    /// The cell, as for a create; an unnamed one of a pool's policy with no workspace, secrets
    /// or environment is taken from the pool.
    #[serde(default)]
    pub cell: crate::CreateCell,
    /// The command, as for an exec, in the foreground (`background` is refused).
    pub exec: ExecSpec,
}

/// Why a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ExitReason {
    /// It exited with `code`.
    Exited,
    /// A signal ended it (`signal`).
    Signaled,
    /// It never started (`code` 126 or 127, `message` says why).
    Failed,
    /// It ran past its `timeout_ms`, or the cell's wall-clock limit.
    Timeout,
    /// A client or the cell's end killed it.
    Killed,
    /// The cell ended under it.
    CellEnded,
    /// The cell's memory limit was reached and the kernel killed it.
    MemoryLimit,
    /// It wrote more than its output limit and was killed.
    OutputLimit,
    /// The cell's workspace passed its disk limit and the warden ended the cell.
    DiskLimit,
}

impl ExitReason {
    pub fn name(self) -> &'static str {
        match self {
            Self::Exited => "exited",
            Self::Signaled => "signaled",
            Self::Failed => "failed",
            Self::Timeout => "timeout",
            Self::Killed => "killed",
            Self::CellEnded => "cell-ended",
            Self::MemoryLimit => "memory-limit",
            Self::OutputLimit => "output-limit",
            Self::DiskLimit => "disk-limit",
        }
    }
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ExitInfo {
    pub reason: ExitReason,
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub message: Option<String>,
    pub duration_ms: u64,
    /// CPU time and peak memory, as the cell's init saw them when it reaped the process.
    pub usage: Option<Usage>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// The journal entry that records the ending.
    pub journal_seq: Option<u64>,
}

impl ExitInfo {
    /// The exit status a command line gives for this ending (see [`crate::exit`]).
    pub fn status(&self) -> i32 {
        use crate::exit;
        match self.reason {
            ExitReason::Exited => self.code.unwrap_or(0),
            ExitReason::Signaled => 128 + self.signal.unwrap_or(0),
            ExitReason::Failed => self.code.unwrap_or(exit::WARDEN_ERROR),
            ExitReason::Timeout => exit::WALL_LIMIT,
            ExitReason::MemoryLimit => exit::MEMORY_LIMIT,
            ExitReason::OutputLimit => exit::OUTPUT_LIMIT,
            ExitReason::DiskLimit => exit::DISK_LIMIT,
            ExitReason::Killed => exit::KILLED,
            ExitReason::CellEnded => exit::WARDEN_ERROR,
        }
    }
}

/// One of a process's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Bytes of output: `text` when they are UTF-8, else `base64`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Chunk {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base64: Option<String>,
}

/// The answer to a background exec, and the `started` event of a foreground one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Started {
    /// The process's id in the daemon (for output, stdin, signals, wait).
    pub id: u64,
    /// Its pid inside the cell.
    pub pid: i32,
}

/// A process in a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ProcessInfo {
    pub id: u64,
    pub cell: String,
    pub argv: Vec<String>,
    pub pid: i32,
    pub started_ms: u64,
    pub background: bool,
    pub running: bool,
    pub exit: Option<ExitInfo>,
}

/// A signal for a process, by number or by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    pub signal: crate::Signal,
}
