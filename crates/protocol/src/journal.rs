//! The journal as faces read it: pages of whole entries (with their place in the chain) and
//! the result of checking the chain.

use serde::{Deserialize, Serialize};

/// One journal entry as it is on disk: `hash` covers the rest, `prev` is the hash before it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct JournalEntry {
    pub seq: u64,
    /// Milliseconds since the epoch, from the warden's clock.
    pub time_ms: u64,
    pub cell: Option<String>,
    /// `area.event`: `cell.create`, `exec.exit`, `net.decision`, ...
    pub kind: String,
    pub data: serde_json::Value,
    pub prev: String,
    pub hash: String,
}

/// Which entries a page holds: the newest first, before `before` (a sequence number).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JournalQuery {
    /// Only entries with a smaller sequence number (paging back); the newest without it.
    pub before: Option<u64>,
    /// At most this many (default 200, at most 1,000).
    pub limit: Option<usize>,
    /// Only this cell's entries.
    pub cell: Option<String>,
    /// Only kinds that start with this (`net.`, `exec.exit`).
    pub kind: Option<String>,
    /// Only entries at or after this time (milliseconds since the epoch).
    pub since_ms: Option<u64>,
    /// Only entries before this time.
    pub until_ms: Option<u64>,
}

/// A page of the journal, newest entry first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct JournalPage {
    pub entries: Vec<JournalEntry>,
    /// Pass as `before` for the next, older page; none when the journal has no more.
    pub next_before: Option<u64>,
    /// The newest entry's sequence number in the whole journal.
    pub head_seq: u64,
}

/// What a check of the whole chain and its signed checkpoints found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct JournalCheck {
    /// Whether every entry's hash, link and every checkpoint's signature holds.
    pub ok: bool,
    /// What is wrong, when something is.
    pub error: Option<String>,
    pub first_seq: u64,
    pub last_seq: u64,
    pub entries: u64,
    pub checkpoints: u64,
    /// Entries after the last signed checkpoint (chained, not yet signed).
    pub unsigned_tail: u64,
    pub head: String,
    /// The public key the checkpoints were checked against (hex).
    pub key: String,
}
