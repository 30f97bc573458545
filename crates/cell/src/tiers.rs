//! Which tiers this warden runs, and the one place a tier is chosen: `Tiers` holds each
//! tier's backend (opened on first use), `backend` makes one, `probe` asks one what it needs of
//! this host without making anything. Above the tiers; they know nothing of it.

use std::sync::Arc;

use warden_policy::Tier;

use crate::tier::{Backend, CellError, Check, ProcessConfig};

/// Whether this warden implements `tier`.
pub fn implemented(tier: Tier) -> bool {
    matches!(tier, Tier::Process | Tier::Gvisor)
}

/// What `tier` needs of this host and whether it has it: the checks its backend's `probe`
/// gives, without opening a backend (`doctor` makes nothing). `state`: Warden's state
/// directory.
pub fn probe(tier: Tier, state: &std::path::Path) -> Vec<Check> {
    match tier {
        Tier::Process => crate::process::probe::checks(),
        Tier::Gvisor => crate::gvisor::probe::checks(state),
        Tier::Microvm => crate::microvm::checks(),
    }
}

/// The tiers a warden runs, each opened on its first use. Every tier's cells are found by name
/// in the same registry, so a name is one cell whatever its tier.
#[derive(Debug)]
pub struct Tiers {
    source: TierSource,
    opened: std::sync::Mutex<std::collections::HashMap<Tier, Arc<dyn Backend>>>,
}

#[derive(Debug)]
enum TierSource {
    /// Every built-in tier, from this configuration.
    BuiltIn(ProcessConfig),
    /// One backend only (a test's); other tiers are refused.
    Only(Arc<dyn Backend>),
}

impl Tiers {
    /// The built-in tiers.
    pub fn built_in(config: ProcessConfig) -> Self {
        Self {
            source: TierSource::BuiltIn(config),
            opened: Default::default(),
        }
    }

    /// One backend alone, for its own tier.
    pub fn only(backend: Arc<dyn Backend>) -> Self {
        Self {
            source: TierSource::Only(backend),
            opened: Default::default(),
        }
    }

    /// The backend of `tier`.
    pub fn get(&self, tier: Tier) -> Result<Arc<dyn Backend>, CellError> {
        match &self.source {
            TierSource::Only(backend) if backend.tier() == tier => Ok(Arc::clone(backend)),
            TierSource::Only(backend) => Err(CellError::Unsupported(format!(
                "this warden runs only the {} tier, not the {} tier",
                backend.tier().name(),
                tier.name()
            ))),
            TierSource::BuiltIn(config) => {
                let mut opened = self
                    .opened
                    .lock()
                    .map_err(|_| CellError::Host("the tiers' table is poisoned".to_owned()))?;
                if let Some(backend) = opened.get(&tier) {
                    return Ok(Arc::clone(backend));
                }
                let backend = backend(tier, config.clone())?;
                opened.insert(tier, Arc::clone(&backend));
                Ok(backend)
            }
        }
    }

    /// The backend that answers for names of any tier (the default tier's).
    pub fn default_tier(&self) -> Result<Arc<dyn Backend>, CellError> {
        match &self.source {
            TierSource::Only(backend) => Ok(Arc::clone(backend)),
            TierSource::BuiltIn(_) => self.get(Tier::default()),
        }
    }
}

/// The backend of a tier: the process tier and the gVisor tier are built in; the others are
/// refused with what to use instead.
pub fn backend(tier: Tier, config: ProcessConfig) -> Result<Arc<dyn Backend>, CellError> {
    match tier {
        Tier::Process => Ok(Arc::new(crate::process::backend::ProcessBackend::open(
            config,
        )?)),
        Tier::Gvisor => Ok(Arc::new(crate::gvisor::GvisorBackend::open(config)?)),
        other => Err(CellError::Unsupported(
            crate::process::plan::PlanError::Tier(other.name()).to_string(),
        )),
    }
}
