//! Questions of `ask` rules, and their answers.

use serde::{Deserialize, Serialize};

/// A pending question. Its `id` is the sequence number of the journal entry that asked it:
/// short, unique for as long as the journal lives, and the same after a daemon restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Approval {
    pub cell: String,
    pub id: u64,
    pub request: String,
    pub rule: String,
    /// When it was asked (seconds since the epoch).
    pub asked_at: u64,
    pub timeout_s: u64,
}

/// How far an approval reaches.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// This question only.
    #[default]
    Once,
    /// What the question is about (a connection's rule and destination, a command line, an
    /// apply's changes), from this cell, from now on.
    Cell,
    /// The same, from every cell.
    Always,
}

impl Scope {
    pub fn name(self) -> &'static str {
        match self {
            Self::Once => "once",
            Self::Cell => "cell",
            Self::Always => "always",
        }
    }
}

/// A person's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Approve,
    Deny,
}

/// `POST /v1/approvals/CELL/ID`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    pub decision: Decision,
    #[serde(default)]
    pub scope: Scope,
}
