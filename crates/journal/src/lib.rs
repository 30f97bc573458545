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
//! entry that finds nothing else waiting is written and synced by its own thread). The
//! `fdatasync` is of the journal's ring, a file of fixed size that holds a copy of the active
//! segment's newest bytes (see the `ring` module): an acknowledged entry survives a crash of
//! the process and of the host, from the segment or, where the crash took it from there, from
//! the ring at the next open. A torn last line (written but never acknowledged) is cut off at
//! the next open. Entries cut from the segment from outside while a writer has it open come
//! back from the ring at that writer's next entry, or the writer refuses entries (and signs
//! nothing) until the file holds them again: it never gives a number twice.
//!
//! The chain lives in segments: the active `journal.jsonl`, and, once it grew past the rotation
//! size, closed segments `journal-<first seq>.jsonl` that the chain runs through unbroken. Each
//! closed segment ends with a checkpoint and is never written again; an operator may archive or
//! remove the oldest, and `verify` then starts at the first segment still there.

mod entry;
mod error;
mod export;
mod keys;
mod ring;
mod segments;
mod verify;
mod writer;

pub use entry::{CHECKPOINT, Entry, GENESIS, redact};
pub use error::JournalError;
pub use export::{Format, export};
pub use keys::{KEY_FILE, PUBLIC_FILE, SigningKeys};
pub use ring::RING_FILE;
pub use segments::{JOURNAL_FILE, segment_first_seq, segments};
pub use verify::{Report, VerifyError, verify};
pub use writer::{Journal, Receipt, Segments, Urgency};
