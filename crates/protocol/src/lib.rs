//! Wire types shared by every face of Warden (CLI, API, SDKs): what a cell looks like from
//! outside and how its ending is reported. No operating-system code lives here.

use serde::{Deserialize, Serialize};

pub mod agents;
pub mod approvals;
pub mod cells;
pub mod error;
pub mod exec;
pub mod files;
pub mod journal;
pub mod text;
pub mod workspace;

pub use agents::{
    AgentAction, AgentInfo, AgentState, Budgets, ForkAgent, Rerun, RerunCall, Rewind, Say,
    StartAgent, TokenUsage, ToolMode, Transcript, TurnInfo,
};
pub use approvals::{Answer, Approval, Decision, Scope};
pub use cells::{
    CellInfo, CellState, CellSummary, CellUsage, Checkpoint, CheckpointRequest, ControlAction,
    CreateCell, PoolInfo, UsageHistory,
};
pub use error::{ErrorBody, ErrorCode};
pub use exec::{
    Chunk, ExecSpec, ExitInfo, ExitReason, ProcessInfo, RunOnce, SignalBody, Started, Stream,
    TtySize, Usage,
};
pub use files::{FileInfo, FileKind};
pub use journal::{JournalCheck, JournalEntry, JournalPage, JournalQuery};
pub use workspace::{ApplyRequest, Snapshot};

/// The daemon's socket in the runtime directory.
pub const DAEMON_SOCKET: &str = "daemon.sock";

/// The `Upgrade` protocol of the daemon's `GET /v1/mcp`: the connection becomes one MCP
/// session over its bare bytes (newline-delimited JSON-RPC, as over stdio).
pub const MCP_UPGRADE: &str = "warden-mcp";

/// Exit statuses of `warden run`, beside the command's own status (0-123) and 128+N for a
/// command killed by signal N.
pub mod exit {
    /// The wall-clock limit ended the cell (the same code as coreutils `timeout`).
    pub const WALL_LIMIT: i32 = 124;
    /// Warden itself failed: bad input, a missing kernel feature, a setup step that failed.
    pub const WARDEN_ERROR: i32 = 125;
    /// The command exists but could not be executed.
    pub const CANNOT_EXECUTE: i32 = 126;
    /// The command was not found in the cell.
    pub const NOT_FOUND: i32 = 127;
    /// `warden kill` ended the cell (128 + SIGKILL).
    pub const KILLED: i32 = 137;
    /// A command rule, or a person answering an `ask` rule, refused the command: nothing ran.
    pub const REFUSED: i32 = 250;
    /// The memory limit was exceeded and the cell was killed.
    pub const MEMORY_LIMIT: i32 = 251;
    /// The output limit was exceeded and the cell was killed.
    pub const OUTPUT_LIMIT: i32 = 252;
    /// The workspace passed its disk limit where the warden's watch keeps it (rootless), and
    /// the cell was killed. (Where the kernel keeps it, a write past it fails with ENOSPC.)
    pub const DISK_LIMIT: i32 = 253;
}

/// A signal as a face may name it: a number (`15`), or a name with or without `SIG` (`TERM`,
/// `SIGTERM`, `term`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum Signal {
    Number(i32),
    Name(String),
}

/// The signals a client may name, with their numbers on Linux.
pub const SIGNALS: [(&str, i32); 20] = [
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ILL", 4),
    ("TRAP", 5),
    ("ABRT", 6),
    ("BUS", 7),
    ("FPE", 8),
    ("KILL", 9),
    ("USR1", 10),
    ("SEGV", 11),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CHLD", 17),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("WINCH", 28),
];

impl Signal {
    /// The signal's number, or why it names none.
    pub fn number(&self) -> Result<i32, String> {
        match self {
            Self::Number(n) if (1..=64).contains(n) => Ok(*n),
            Self::Number(n) => Err(format!("{n} is not a signal number (1-64)")),
            Self::Name(name) => {
                let upper = name.trim().to_ascii_uppercase();
                let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
                if let Ok(n) = bare.parse::<i32>() {
                    return Self::Number(n).number();
                }
                SIGNALS
                    .iter()
                    .find(|(known, _)| *known == bare)
                    .map(|(_, n)| *n)
                    .ok_or_else(|| {
                        let known: Vec<&str> = SIGNALS.iter().map(|(k, _)| *k).collect();
                        format!(
                            "`{name}` is not a signal; use a number or one of {}",
                            known.join(", ")
                        )
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_forms_are_the_documented_words() {
        fn words<T: Serialize>(value: &T) -> String {
            serde_json::to_string(value).unwrap_or_default()
        }
        assert_eq!(words(&ExitReason::CellEnded), "\"cell-ended\"");
        assert_eq!(words(&ExitReason::MemoryLimit), "\"memory-limit\"");
        assert_eq!(words(&CellState::Ended), "\"ended\"");
        assert_eq!(words(&Scope::default()), "\"once\"");
        assert_eq!(words(&FileKind::Symlink), "\"symlink\"");
        let body = ErrorBody {
            error: "no cell".into(),
            code: ErrorCode::NotFound,
            hint: None,
            reason: None,
        };
        assert_eq!(words(&body), r#"{"error":"no cell","code":"not-found"}"#);
        // Every reason reads back as itself, and its name is its wire word.
        for reason in [
            ExitReason::Exited,
            ExitReason::Signaled,
            ExitReason::Failed,
            ExitReason::Timeout,
            ExitReason::Killed,
            ExitReason::CellEnded,
            ExitReason::MemoryLimit,
            ExitReason::OutputLimit,
            ExitReason::DiskLimit,
        ] {
            assert_eq!(words(&reason), format!("\"{}\"", reason.name()));
            let back: ExitReason =
                serde_json::from_str(&words(&reason)).unwrap_or(ExitReason::Exited);
            assert_eq!(back, reason);
        }
        // An answer without a scope is for this question only; unknown fields are refused.
        let answer: Answer = serde_json::from_str(r#"{"decision":"approve"}"#).unwrap_or(Answer {
            decision: Decision::Deny,
            scope: Scope::Always,
        });
        assert_eq!(
            (answer.decision, answer.scope),
            (Decision::Approve, Scope::Once)
        );
        assert!(serde_json::from_str::<Answer>(r#"{"decision":"approve","why":1}"#).is_err());
    }

    #[test]
    fn an_ending_gives_the_documented_exit_status() {
        let exit = |reason, code, signal| ExitInfo {
            reason,
            code,
            signal,
            message: None,
            duration_ms: 0,
            usage: None,
            stdout_bytes: 0,
            stderr_bytes: 0,
            journal_seq: None,
        };
        assert_eq!(exit(ExitReason::Exited, Some(3), None).status(), 3);
        assert_eq!(exit(ExitReason::Signaled, None, Some(9)).status(), 137);
        assert_eq!(exit(ExitReason::Failed, Some(127), None).status(), 127);
        assert_eq!(
            exit(ExitReason::Timeout, None, Some(9)).status(),
            exit::WALL_LIMIT
        );
        assert_eq!(exit(ExitReason::DiskLimit, None, None).status(), 253);
    }

    #[test]
    fn signals_are_numbers_or_names() {
        assert_eq!(Signal::Number(15).number(), Ok(15));
        assert_eq!(Signal::Name("TERM".into()).number(), Ok(15));
        assert_eq!(Signal::Name("sigkill".into()).number(), Ok(9));
        assert_eq!(Signal::Name("9".into()).number(), Ok(9));
        assert!(Signal::Name("TERMINATE".into()).number().is_err());
        assert!(Signal::Number(0).number().is_err());
    }
}
