//! The one error body every face answers with.

use serde::{Deserialize, Serialize};

/// What kind of failure, for a program to act on (the HTTP status says the same in its terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    /// The request is malformed or names something that cannot be (400, 422).
    BadRequest,
    /// The bearer token (or the dashboard's session) is missing or wrong (401, TCP only).
    Unauthorized,
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

impl ErrorCode {
    /// The HTTP status of the code: the one mapping every HTTP face (the API, the E2B API)
    /// answers with.
    pub fn http_status(self) -> u16 {
        match self {
            Self::BadRequest => 400,
            Self::Unauthorized => 401,
            Self::Forbidden => 403,
            Self::NotFound => 404,
            Self::Conflict => 409,
            Self::TooLarge => 413,
            Self::Unavailable => 503,
            Self::Internal => 500,
        }
    }
}

/// An error as the API answers it: `{"error": "...", "code": "...", "reason": "...", "hint": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ErrorBody {
    /// What failed and why, in words.
    pub error: String,
    pub code: ErrorCode,
    /// What to do about it, where the warden knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Which failure it is, within its code (`cell-paused`, `denied`, `no-such-process`,
    /// `journal-unavailable`, ...): the variant of the operation's error, for a program to act
    /// on. Absent where the answer is the API's own (a malformed request, a missing route).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}
