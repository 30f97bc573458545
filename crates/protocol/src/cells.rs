//! Cells: the request that makes one, and a cell as every face shows it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Whether a cell's processes may run. One vocabulary for every face.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CellState {
    Running,
    Paused,
    /// The processes are gone; workspace changes, if any, are kept for review.
    Ended,
}

impl CellState {
    pub fn name(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Ended => "ended",
        }
    }
}

/// One line of `warden ps`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CellSummary {
    pub name: String,
    pub state: CellState,
    /// Host pid of the cell's init, while it runs.
    pub pid: Option<i32>,
    pub started_unix_ms: u64,
    pub command: Vec<String>,
    pub workspace: Option<String>,
}

/// A request to make a cell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCell {
    pub name: Option<String>,
    /// A policy document (YAML, as `warden run --policy` takes it).
    pub policy: Option<String>,
    /// A built-in preset, instead of `policy`.
    pub preset: Option<String>,
    /// Host directory that appears at the policy's workspace mount.
    pub workspace: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Start from this snapshot (`CELL@SNAP`), or from a snapshot taken now of a cell (`CELL`):
    /// a fork. Its workspace is the snapshot's.
    pub from: Option<String>,
    /// Bring back a checkpoint (`CELL@CKPT`, see `POST /v1/cells/{name}/checkpoint`): its
    /// processes go on where they were, its workspace is as it was, its policy and environment
    /// are the checkpointed cell's (give no `policy`, `preset`, `workspace` or `from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<String>,
    /// The values of the policy's `from_env` credentials, by variable name, taken from the
    /// caller's environment (a face sends them; the daemon's own environment is not the
    /// caller's). Only the gateway gets them; they are never journaled or shown.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, String>,
}

/// What `POST /v1/cells/{name}/checkpoint` asks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    /// The checkpoint's name (`CELL@NAME`); one is made up when none is given.
    #[serde(rename = "as", default)]
    pub as_name: Option<String>,
}

/// A cell's memory and workspace, saved at one moment (the cell ended there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Checkpoint {
    /// `CELL@NAME`: restore it with `POST /v1/cells` and `restore`.
    pub id: String,
    /// Bytes of the memory image.
    pub memory_bytes: u64,
    /// Bytes of file data of the workspace snapshot taken with it.
    pub workspace_bytes: u64,
}

/// A cell as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CellInfo {
    pub name: String,
    pub state: CellState,
    pub pid: Option<i32>,
    pub created_ms: u64,
    pub workspace: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// Why it ended, once it has.
    pub ended: Option<String>,
    pub processes: usize,
    /// The isolation tier it runs in (`process`, `gvisor`, `microvm`).
    #[serde(default)]
    pub tier: String,
    /// The preset it was made from, or `extends:` of the policy document it was given.
    #[serde(default)]
    pub preset: Option<String>,
}

/// What a face may do to a running cell from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ControlAction {
    /// Freeze every process of the cell (its cgroup freezer).
    Pause,
    /// Thaw it.
    Resume,
    /// End every process of the cell.
    Kill,
}

impl ControlAction {
    pub fn name(self) -> &'static str {
        match self {
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Kill => "kill",
        }
    }
}

/// What a cell uses now, from the warden's own accounting (its cgroup), sampled by the daemon.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct CellUsage {
    /// When it was read, milliseconds since the epoch.
    pub time_ms: u64,
    /// CPU time used by the cell's processes so far, in microseconds.
    pub cpu_usec: Option<u64>,
    /// Memory charged to the cell now, in bytes.
    pub memory_bytes: Option<u64>,
    /// How many processes (tasks) it holds now.
    pub pids: Option<u64>,
}

/// Cells of one policy that the daemon keeps made ahead (`warden serve --pool`), so that a
/// create asking for that policy, with no name, workspace, source or environment of its own,
/// takes one that is ready instead of waiting for one to start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PoolInfo {
    /// The preset, or the policy file, its cells are made with.
    pub policy: String,
    /// The tier they run in.
    pub tier: String,
    /// How many it keeps made ahead.
    pub size: usize,
    /// How many are ready now.
    pub ready: usize,
    /// Memory charged to the ready ones now, in bytes.
    pub memory_bytes: u64,
    /// Cells it has handed out since the daemon started.
    pub taken: u64,
    /// Why it could not make its last cell (it tries again at the next create it serves).
    pub error: Option<String>,
}

/// Recent samples of one cell's use, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct UsageHistory {
    pub cell: String,
    pub samples: Vec<CellUsage>,
}
