//! `warden doctor`: each tier's word on what it needs of this host (`tier::probe`, the same
//! checks its `Backend::probe` gives), then one line per tier: implemented, prerequisites
//! present, usable here. Nothing falls back to another tier silently.

use std::path::{Path, PathBuf};

use serde::Serialize;
use warden_policy::Tier;

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

/// Every tier's checks, then one summary line per tier. `state`: Warden's state directory
/// (where a tier keeps what it needs; nothing is made there).
pub fn doctor(state: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    for tier in Tier::ALL {
        out.extend(crate::tier::probe(tier, state));
    }
    let summaries: Vec<Check> = Tier::ALL
        .iter()
        .map(|tier| summary(*tier, crate::tier::implemented(*tier), &out))
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
        .filter(|t| crate::tier::implemented(**t))
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

/// What the planned microVM tier will need: KVM and a VMM.
pub(crate) fn microvm() -> Vec<Check> {
    let kvm = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => check(
            "microvm",
            "kvm",
            Status::Ok,
            "/dev/kvm is usable".to_owned(),
            None,
        ),
        Err(err) => check(
            "microvm",
            "kvm",
            Status::Missing,
            format!("/dev/kvm: {err}"),
            Some(
                "enable virtualization and load kvm_intel or kvm_amd; add the user to the kvm group",
            ),
        ),
    };
    let vmm = match which("qemu-system-x86_64")
        .or_else(|| which("firecracker"))
        .or_else(|| which("cloud-hypervisor"))
    {
        Some(path) => check(
            "microvm",
            "vmm",
            Status::Ok,
            path.display().to_string(),
            None,
        ),
        None => check(
            "microvm",
            "vmm",
            Status::Missing,
            "no VMM found".to_owned(),
            Some("apt-get install qemu-system-x86"),
        ),
    };
    vec![kvm, vmm]
}

fn check(
    tier: &'static str,
    feature: &'static str,
    status: Status,
    detail: String,
    fix: Option<&str>,
) -> Check {
    Check {
        tier,
        feature,
        status,
        detail,
        fix: fix.map(str::to_owned),
    }
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}
