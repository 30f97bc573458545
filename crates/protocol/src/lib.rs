//! Wire types shared by every face of Warden (CLI, API, SDKs): what a cell looks like from
//! outside and how its ending is reported. No operating-system code lives here.

use serde::{Deserialize, Serialize};

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
    /// The memory limit was exceeded and the cell was killed.
    pub const MEMORY_LIMIT: i32 = 251;
    /// The output limit was exceeded and the cell was killed.
    pub const OUTPUT_LIMIT: i32 = 252;
}

/// Whether a cell's processes may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CellState {
    Running,
    Paused,
    /// The processes are gone; workspace changes are kept for review.
    Stopped,
}

/// One line of `warden ps`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellSummary {
    pub name: String,
    pub state: CellState,
    /// Host pid of the cell's init, while it runs.
    pub pid: Option<i32>,
    pub started_unix_ms: u64,
    pub command: Vec<String>,
    pub workspace: Option<String>,
}
