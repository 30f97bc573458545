//! Files of a cell, as the files API lists them.

use serde::{Deserialize, Serialize};

/// What a directory entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct FileInfo {
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits, in octal.
    pub mode: String,
    pub modified_s: u64,
    /// Where a symlink points (as written in it).
    pub target: Option<String>,
}
