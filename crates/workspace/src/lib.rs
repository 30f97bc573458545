//! Copy-on-write workspaces: the cell works on an overlay of a host directory; this crate reads
//! the cell's upper layer from outside to say exactly what changed, and applies chosen changes
//! back to the host directory.
//!
//! Everything in an upper layer is hostile input: it was written by whatever ran in the cell.
//! Nothing here follows a symlink of the layer, writes outside the host directory, or carries
//! ownership, device nodes or set-id bits over; and nothing here runs anything in the cell.

mod apply;
mod change;
mod diff;
mod layer;
mod sensitive;

pub use apply::{ApplyOptions, ApplyReport, DEFAULT_MAX_WRITE_BYTES, apply, data_extents, recover};
pub use change::{Change, ChangeKind, Diff, EntryKind};
pub use diff::{
    DEFAULT_MAX_PATCHES_BYTES, DEFAULT_MAX_READ_BYTES, DiffOptions, MAX_DEPTH, NOT_UTF8, diff,
    escaped,
};
pub use layer::{Layer, LayerMeta, note, write_over};
pub use sensitive::Sensitivity;

use std::path::PathBuf;

/// Why a workspace operation failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{0}` is not among the changes of this cell (see `warden diff`)")]
    UnknownPath(String),
    #[error(
        "{count} change(s) conflict with edits made on the host since the cell started: {paths}; \
             re-run with --force to overwrite them"
    )]
    Conflict { count: usize, paths: String },
    #[error("`{path}` cannot be applied: {reason}")]
    Refused { path: String, reason: String },
    #[error(
        "the workspace changed since it was reviewed (digest {expected}, now {found}); nothing was applied: look at `warden diff` again"
    )]
    Changed { expected: String, found: String },
    #[error(
        "the apply would write {total} bytes of file data, more than its bound of {bound} bytes; \
             nothing was applied: apply fewer paths at a time (name them), or raise the bound \
             (`WARDEN_APPLY_MAX_BYTES` in the environment of the warden that applies)"
    )]
    TooLarge { total: u64, bound: u64 },
    /// A part of the tree a diff that must read all of it could not read.
    #[error(
        "`{path}` could not be read: {reason}; nothing was changed: remove it in the cell (or \
             the tree it is in), then try again"
    )]
    Unread { path: String, reason: String },
    /// A file of the cell was not what the diff read when the apply came to copy it (a cell
    /// that runs while its changes are applied): rolled back whole.
    #[error(
        "`{path}` changed in the cell since the diff (its bytes are not the ones reviewed); the \
             apply was rolled back and nothing was changed: look at `warden diff` again, and \
             pause the cell while its changes are applied"
    )]
    ChangedInCell { path: String },
    #[error("apply failed at `{path}` and was rolled back: {source}")]
    RolledBack {
        path: String,
        source: std::io::Error,
    },
    /// An apply failed and undoing its steps failed too: they are kept, with their log, for the
    /// next apply or diff to undo.
    #[error(
        "apply failed at `{path}`: {source}; undoing what it did failed too ({undo}): its log \
             and backups are kept in {staging}, and the next `warden diff` or apply of this \
             directory undoes it"
    )]
    NotRolledBack {
        path: String,
        source: std::io::Error,
        undo: std::io::Error,
        staging: PathBuf,
    },
    /// An apply that was killed before it finished could not be undone.
    #[error(
        "an apply to this directory was killed before it finished, and undoing what it did \
             failed: {source}; nothing else was changed: its log and backups are kept in \
             {staging}; fix the cause, then run `warden diff` again to undo it"
    )]
    Unrecovered {
        staging: PathBuf,
        source: std::io::Error,
    },
}
