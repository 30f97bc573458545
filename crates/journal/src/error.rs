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
    #[error("the journal stopped accepting entries after a write failure: {0}")]
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
