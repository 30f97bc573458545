//! What opening or writing the journal may meet.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, thiserror::Error)]
pub enum JournalError {
    #[error("{what} ({path}): {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("the journal signing key {path} is not 32 bytes; restore it from a backup")]
    BadKey { path: PathBuf },
    #[error(
        "the last entry of {path} does not verify ({reason}); run `warden audit verify` to find the first bad entry, and move the journal aside to start a new one"
    )]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "the journal {path} lost entries that this process wrote and acknowledged: {found}, where this process had written up to entry {written}. It was cut or rewritten from outside, and the journal's ring (journal.ring) does not hold the missing entries as they were written (or there is none); no entry is written or signed until the file holds them again: restore it from a backup, run `warden audit verify`, and append again (or move the journal aside to start a new one)"
    )]
    Cut {
        path: PathBuf,
        /// What the file holds now, in words.
        found: String,
        /// The newest entry this process had written to it.
        written: u64,
    },
    /// Nothing is acknowledged after a failed write, for the life of the process: what was
    /// acknowledged before is on disk, and the next open cuts the torn line a failure may leave.
    #[error(
        "the journal stopped accepting entries after a write failure ({0}), so nothing that must be recorded is done: fix the cause (free space on the journal's disk, for one) and restart the warden, whose journal then cuts the torn last line and goes on"
    )]
    Stopped(String),
}

impl JournalError {
    pub(crate) fn io<'a>(
        what: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(io::Error) -> Self + 'a {
        move |source| Self::Io {
            what,
            path: path.to_path_buf(),
            source: Arc::new(source),
        }
    }
}
