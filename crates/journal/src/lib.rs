//! The journal: an append-only, hash-chained record of everything the warden observes.
//!
//! Each entry is one JSON line `{seq, time_ms, cell, kind, data, prev, hash}`; `hash` is the
//! BLAKE3 hash of the entry's canonical form without it, and `prev` is the hash of the entry
//! before, so changing, removing or reordering any entry breaks every hash after it. Every so
//! often the writer appends a *checkpoint* entry that signs the chain's head with the host's
//! ed25519 key, so that rewriting the chain from some point on also needs the key.
//!
//! Appends are group-committed: one writer thread takes every entry waiting, writes them, calls
//! `fdatasync` once, and only then acknowledges them. An acknowledged entry survives a crash of
//! the process; a torn last line (written but never acknowledged) is cut off at the next open.

mod entry;
mod export;
mod keys;
mod verify;
mod writer;

pub use entry::{Entry, GENESIS, redact};
pub use export::{Format, export};
pub use keys::{KEY_FILE, PUBLIC_FILE, SigningKeys};
pub use verify::{Report, VerifyError, verify};
pub use writer::{Journal, JournalError, Receipt};

/// The journal file inside the journal directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";

/// The kind of a checkpoint entry.
pub const CHECKPOINT: &str = "journal.checkpoint";
