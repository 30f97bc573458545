//! The journal: an append-only, hash-chained record of everything the warden observes.
//!
//! Each entry is one JSON line `{seq, time_ms, cell, kind, data, prev, hash}`; `hash` is the
//! BLAKE3 hash of the entry's canonical form without it, and `prev` is the hash of the entry
//! before, so changing, removing or reordering any entry breaks every hash after it. Every so
//! often the writer appends a *checkpoint* entry that signs the chain's head with the host's
//! ed25519 key, so that rewriting the chain from some point on also needs the key.
//!
//! Appends are group-committed: entries are sealed by the threads that append them, and one
//! syncer thread writes what waits, calls `fdatasync` once, and only then acknowledges them (an
//! entry that finds nothing else waiting is written and synced by its own thread). An
//! acknowledged entry survives a crash of the process; a torn last line (written but never
//! acknowledged) is cut off at the next open.
//!
//! The chain lives in segments: the active `journal.jsonl`, and, once it grew past the rotation
//! size, closed segments `journal-<first seq>.jsonl` that the chain runs through unbroken. Each
//! closed segment ends with a checkpoint and is never written again; an operator may archive or
//! remove the oldest, and `verify` then starts at the first segment still there.

mod entry;
mod export;
mod keys;
mod verify;
mod writer;

pub use entry::{Entry, GENESIS, redact};
pub use export::{Format, export};
pub use keys::{KEY_FILE, PUBLIC_FILE, SigningKeys};
pub use verify::{Report, VerifyError, verify};
pub use writer::{Journal, JournalError, Receipt, Segments};

/// The active segment inside the journal directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";

/// The name of a closed segment whose first entry is `first_seq`.
pub(crate) fn segment_name(first_seq: u64) -> String {
    format!("journal-{first_seq:020}.jsonl")
}

/// The first sequence number a closed segment's path names (`journal-<seq>.jsonl`); none for
/// the active segment or a file that is not a segment.
pub fn segment_first_seq(path: &std::path::Path) -> Option<u64> {
    path.file_name()?
        .to_str()?
        .strip_prefix("journal-")?
        .strip_suffix(".jsonl")?
        .parse()
        .ok()
}

/// The journal's segments in chain order: the closed ones, oldest first, then the active one
/// (when it exists).
pub fn segments(dir: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut closed: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("journal-"))
                .and_then(|n| n.strip_suffix(".jsonl"))
                .is_some_and(|seq| seq.len() == 20 && seq.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    closed.sort();
    let active = dir.join(JOURNAL_FILE);
    if active.exists() {
        closed.push(active);
    }
    Ok(closed)
}

/// The kind of a checkpoint entry.
pub const CHECKPOINT: &str = "journal.checkpoint";
