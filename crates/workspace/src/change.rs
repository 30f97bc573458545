//! What changed in a workspace, as data every face can print or serialize.

use serde::{Deserialize, Serialize};

/// What happened to a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// What the path is (after the change; before it, for deletions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    /// FIFO, socket or device node: never applied.
    Special,
}

/// One changed path, relative to the workspace root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Change {
    pub path: String,
    pub kind: ChangeKind,
    pub entry: EntryKind,
    /// Permission bits before and after, when they differ (or the path is new or gone).
    pub old_mode: Option<u32>,
    pub new_mode: Option<u32>,
    /// Size and BLAKE3 hash of a file's new content.
    pub size: Option<u64>,
    pub hash: Option<String>,
    /// Target of a symlink, as written in the cell.
    pub link_target: Option<String>,
    /// Unified diff of a text file (absent for binary or large files).
    pub patch: Option<String>,
    /// Why this change needs to be named explicitly to be applied.
    pub sensitive: Option<String>,
    /// Why this change can never be applied.
    pub refused: Option<String>,
}

impl Change {
    pub(crate) fn new(path: String, kind: ChangeKind, entry: EntryKind) -> Self {
        Self {
            path,
            kind,
            entry,
            old_mode: None,
            new_mode: None,
            size: None,
            hash: None,
            link_target: None,
            patch: None,
            sensitive: None,
            refused: None,
        }
    }

    /// One-letter marker for listings: A, M, D.
    pub fn marker(&self) -> char {
        match self.kind {
            ChangeKind::Added => 'A',
            ChangeKind::Modified => 'M',
            ChangeKind::Deleted => 'D',
        }
    }
}

/// Every change of a workspace, sorted by path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Diff {
    pub changes: Vec<Change>,
    /// A BLAKE3 digest of what the changes would write (paths, kinds, modes, content hashes,
    /// link targets): an apply given it writes exactly what was reviewed, or nothing.
    pub digest: String,
}

impl Diff {
    pub(crate) fn new(changes: Vec<Change>) -> Self {
        let mut hasher = blake3::Hasher::new();
        for change in &changes {
            // One canonical line per change; none of these fields may hold a newline unescaped.
            let line = serde_json::json!([
                change.path,
                change.kind,
                change.entry,
                change.new_mode,
                change.size,
                change.hash,
                change.link_target,
                change.refused,
            ]);
            hasher.update(line.to_string().as_bytes());
            hasher.update(b"\n");
        }
        Self {
            changes,
            digest: hasher.finalize().to_hex().to_string(),
        }
    }
}
