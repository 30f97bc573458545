//! A tier's word on what it needs of this host: one line of `warden doctor`, as every tier's
//! `Backend::probe` gives it.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Missing,
}

/// One line of the doctor's report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub tier: &'static str,
    pub feature: &'static str,
    pub status: Status,
    pub detail: String,
    /// What to do when the status is not ok.
    pub fix: Option<String>,
}

impl Check {
    pub fn new(
        tier: &'static str,
        feature: &'static str,
        status: Status,
        detail: String,
        fix: Option<&str>,
    ) -> Self {
        Self {
            tier,
            feature,
            status,
            detail,
            fix: fix.map(str::to_owned),
        }
    }
}
