//! Workspace operations of a cell: snapshots and applies.

use serde::{Deserialize, Serialize};

/// A snapshot of a cell's workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Snapshot {
    /// `CELL@SNAP`.
    pub id: String,
    /// Bytes of file data it holds; `null` while they are being counted (a snapshot that took
    /// the cell's layer instead of a copy is counted just after it is taken; listing the
    /// snapshots counts it at once).
    pub size: Option<u64>,
}

/// Which workspace changes to apply, and how.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    /// Paths (a directory selects what is below it); none: every change.
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub dry_run: bool,
    /// Overwrite host files edited since the cell started.
    #[serde(default)]
    pub force: bool,
    /// Apply sensitive changes (hooks, rc files, new executables, outward symlinks) too.
    #[serde(default)]
    pub include_sensitive: bool,
    /// The digest of the diff that was reviewed (`GET .../diff` gives it): the apply writes
    /// those changes exactly, or nothing. Without it, an apply held for a person is bound to
    /// the diff as it was when the question was asked.
    #[serde(default)]
    pub digest: Option<String>,
}
