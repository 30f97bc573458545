//! The Landlock ruleset of the process tier: a second, independent fence around the file system
//! view that the mounts build, plus scoping of abstract unix sockets and signals to the cell.

use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, Scope,
};

/// The newest Landlock ABI this code knows how to use; older kernels get what they support.
pub const TARGET_ABI: ABI = ABI::V7;

#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("Landlock ruleset failed: {0}")]
    Ruleset(#[from] landlock::RulesetError),
    #[error("Landlock is not enforced by this kernel (see `warden doctor`)")]
    NotEnforced,
    #[error("looking at the workspace before a process starts: {0}")]
    Workspace(std::io::Error),
}

/// Paths (inside the cell, after pivot_root) and what may be done beneath them.
#[derive(Debug, Default, Clone)]
pub struct FsRules {
    pub read_only: Vec<PathBuf>,
    pub read_write: Vec<PathBuf>,
}

/// How much of the target ABI the kernel enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforcement {
    Full,
    Partial,
}

/// Restricts the calling thread (and its future children) to `rules`.
pub fn restrict(rules: &FsRules) -> Result<Enforcement, LandlockError> {
    let status = ruleset(rules, true)?.restrict_self()?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok(Enforcement::Full),
        RulesetStatus::PartiallyEnforced => Ok(Enforcement::Partial),
        RulesetStatus::NotEnforced => Err(LandlockError::NotEnforced),
    }
}

/// A ruleset of `rules` (file system access only) for processes to put themselves under later,
/// as a layer on top of the domain they inherit.
pub fn prepare(rules: &FsRules) -> Result<std::os::fd::OwnedFd, LandlockError> {
    Option::<std::os::fd::OwnedFd>::from(ruleset(rules, false)?).ok_or(LandlockError::NotEnforced)
}

/// The ruleset of `rules`, with the scoping of abstract unix sockets and signals when `scoped`.
fn ruleset(rules: &FsRules, scoped: bool) -> Result<landlock::RulesetCreated, LandlockError> {
    let all = AccessFs::from_all(TARGET_ABI);
    let read = AccessFs::from_read(TARGET_ABI);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)?;
    if scoped {
        ruleset = ruleset.scope(Scope::from_all(TARGET_ABI))?;
    }
    let mut ruleset = ruleset.create()?;
    for path in &rules.read_only {
        ruleset = add(ruleset, path, read)?;
    }
    for path in &rules.read_write {
        ruleset = add(ruleset, path, all)?;
    }
    Ok(ruleset)
}

fn add(
    ruleset: landlock::RulesetCreated,
    path: &Path,
    access: landlock::BitFlags<AccessFs>,
) -> Result<landlock::RulesetCreated, LandlockError> {
    // A path that does not exist in the cell simply grants nothing.
    let Ok(fd) = PathFd::new(path) else {
        return Ok(ruleset);
    };
    Ok(ruleset.add_rule(PathBeneath::new(fd, access))?)
}
