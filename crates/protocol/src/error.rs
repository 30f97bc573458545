//! The one error body every face answers with.

use serde::{Deserialize, Serialize};

/// What kind of failure, for a program to act on (the HTTP status says the same in its terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    /// The request is malformed or names something that cannot be (400, 422).
    BadRequest,
    /// A policy, or a person, refused it (403).
    Forbidden,
    /// What it names does not exist (404).
    NotFound,
    /// It cannot be done in the present state (409).
    Conflict,
    /// Too large (413).
    TooLarge,
    /// The warden cannot do it now; try again (503).
    Unavailable,
    /// The warden failed (500).
    Internal,
}

/// An error as the API answers it: `{"error": "...", "code": "...", "hint": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ErrorBody {
    /// What failed and why, in words.
    pub error: String,
    pub code: ErrorCode,
    /// What to do about it, where the warden knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}
