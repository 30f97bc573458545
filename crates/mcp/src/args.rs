//! What each tool takes. The descriptions are written for a model: what a field means, and
//! what it defaults to.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// A name for the cell (letters, digits, `-` and `_`, up to 63); one is made up when left
    /// out.
    pub name: Option<String>,
    /// A built-in policy preset (`default`: no network, the host's system directories
    /// read-only, a scratch workspace). Give either this or `policy`.
    pub preset: Option<String>,
    /// A whole policy document, as YAML (see the warden's docs: filesystem, network, commands,
    /// limits, approvals).
    pub policy: Option<String>,
    /// A directory on the warden's host to work on: the cell sees it at its workspace mount,
    /// through a copy-on-write layer (nothing reaches the host until `apply`).
    pub workspace: Option<String>,
    /// Start from a snapshot (`CELL@SNAPSHOT`), or from a snapshot taken now of a running cell
    /// (`CELL`): a fork with that cell's files as they are.
    pub from: Option<String>,
    /// Environment variables for every process of the cell.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CellArg {
    /// The cell's name.
    pub cell: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KillArgs {
    /// The cell's name.
    pub cell: String,
    /// Also forget the cell: its workspace changes and network record are discarded. Without
    /// it an ended cell's changes stay for `diff` and `apply`.
    #[serde(default)]
    pub delete: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    /// The cell's name.
    pub cell: String,
    /// A shell command line, run with `sh -c`. Give either this or `argv`.
    pub command: Option<String>,
    /// The program and its arguments, run as they are (no shell).
    pub argv: Option<Vec<String>>,
    /// The directory to run in, inside the cell (default: the workspace).
    pub cwd: Option<String>,
    /// Extra environment variables for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Text for the command's standard input (default: none, input closed).
    pub stdin: Option<String>,
    /// Kill the command after this many seconds (default: 120).
    pub timeout_s: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathArgs {
    /// The cell's name.
    pub cell: String,
    /// A path relative to the cell's workspace (no `..`, not absolute).
    pub path: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// The cell's name.
    pub cell: String,
    /// A directory relative to the cell's workspace (default: the workspace itself).
    #[serde(default = "here")]
    pub path: String,
}

fn here() -> String {
    ".".to_owned()
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    /// The cell's name.
    pub cell: String,
    /// A path relative to the cell's workspace; its directory must exist.
    pub path: String,
    /// The whole new content of the file, as text.
    pub content: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EditArgs {
    /// The cell's name.
    pub cell: String,
    /// A path relative to the cell's workspace.
    pub path: String,
    /// Text to find: it must occur exactly once (or give `replace_all`), byte for byte,
    /// whitespace included.
    pub old_text: String,
    /// What replaces it.
    pub new_text: String,
    /// Replace every occurrence instead of requiring exactly one.
    #[serde(default)]
    pub replace_all: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchArgs {
    /// The cell's name.
    pub cell: String,
    /// A regular expression (grep's extended syntax), looked for in every text file.
    pub pattern: String,
    /// A directory or file relative to the cell's workspace (default: all of it).
    #[serde(default = "here")]
    pub path: String,
    /// Match without regard to case.
    #[serde(default)]
    pub ignore_case: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyArgs {
    /// The cell's name.
    pub cell: String,
    /// The changed paths to apply (default: every change).
    #[serde(default)]
    pub paths: Vec<String>,
    /// The `digest` a `diff` answered: the apply is refused if the changes differ from what
    /// was reviewed.
    pub digest: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotArgs {
    /// The cell's name.
    pub cell: String,
    /// A name for the snapshot (default: a number).
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotId {
    /// The snapshot, `CELL@NAME` (as `snapshot` or `list_snapshots` gave it).
    pub snapshot: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResetArgs {
    /// The cell's name.
    pub cell: String,
    /// The snapshot to go back to (its name or number; default: the cell's start).
    pub snapshot: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// What to fork: a running cell (`CELL`, snapshotted now) or a snapshot
    /// (`CELL@SNAPSHOT`).
    pub from: String,
    /// The new cell's name (default: one is made up).
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AnswerArgs {
    /// The cell that asked.
    pub cell: String,
    /// The approval's id (from `list_approvals`).
    pub id: u64,
    /// `true` to let it through, `false` to refuse it.
    pub allow: bool,
    /// How far a yes reaches: `once` (default), `cell` (the same request from this cell from
    /// now on) or `always` (from every cell).
    #[serde(default)]
    pub scope: warden_protocol::Scope,
}
