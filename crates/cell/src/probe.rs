//! `warden doctor`: each tier's word on what it needs of this host (`tiers::probe`, the same
//! checks its `Backend::probe` gives), then one line per tier: implemented, prerequisites
//! present, usable here. Nothing falls back to another tier silently.

use std::path::Path;

use warden_policy::Tier;

pub use crate::check::{Check, Status};

/// Every tier's checks, then one summary line per tier. `state`: Warden's state directory
/// (where a tier keeps what it needs; nothing is made there).
pub fn doctor(state: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    for tier in Tier::ALL {
        out.extend(crate::tiers::probe(tier, state));
    }
    let summaries: Vec<Check> = Tier::ALL
        .iter()
        .map(|tier| summary(*tier, crate::tiers::implemented(*tier), &out))
        .collect();
    out.extend(summaries);
    out
}

/// One line for a tier, apart from its prerequisites: implemented, prerequisites present,
/// usable here. A tier is usable only when both hold.
fn summary(tier: Tier, implemented: bool, checks: &[Check]) -> Check {
    let name = tier.name();
    let missing: Vec<&str> = checks
        .iter()
        .filter(|c| c.tier == name && c.status == Status::Missing)
        .map(|c| c.feature)
        .collect();
    let prerequisites = if missing.is_empty() {
        "prerequisites present".to_owned()
    } else {
        format!("prerequisites missing: {}", missing.join(", "))
    };
    let usable_tiers: Vec<String> = Tier::ALL
        .iter()
        .filter(|t| crate::tiers::implemented(**t))
        .map(|t| format!("`tier: {}`", t.name()))
        .collect();
    let (status, usable, fix) = match (implemented, missing.is_empty()) {
        (true, true) => (Status::Ok, "usable here", None),
        (true, false) => (
            Status::Missing,
            "not usable here",
            Some("fix the prerequisites above".to_owned()),
        ),
        (false, _) => (
            Status::Missing,
            "not usable: not implemented in this version",
            Some(format!("use {}", usable_tiers.join(" or "))),
        ),
    };
    Check {
        tier: name,
        feature: "tier",
        status,
        detail: format!(
            "implemented: {}; {prerequisites}; {usable}",
            if implemented { "yes" } else { "no (planned)" }
        ),
        fix,
    }
}
