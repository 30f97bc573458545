//! The gVisor tier: each cell is a gVisor sandbox (`runsc`, on its ptrace platform), whose
//! application kernel stands between the cell's processes and the host's. The cell is made from
//! the same plan as a process-tier cell (root, workspace layer, `/etc`, environment, gateway)
//! and kept the same way: by a keeper of its own (`keeper`), published in the same registry,
//! served over the same exec protocol (`host`, the host side of its processes), frozen, killed
//! and accounted through its cgroup. Everything above the tier boundary is unchanged.

mod attached;
mod bundle;
mod checkpoint;
pub mod compat;
mod host;
pub mod keeper;
pub mod probe;
pub mod runsc;
mod setid;

use std::path::Path;
use std::sync::Arc;

use warden_policy::{Policy, Tier};

use crate::process::backend::ProcessBackend;
use crate::tier::{Attached, Backend, Cell, CellError, CellSpec, Check, StartError};

/// The gVisor tier behind the boundary. Its cells are kept by keepers like the process tier's
/// (the keeper takes the tier from the cell's policy), so starting, taking back and the cell's
/// handle are the process tier's; what differs is inside the keeper.
#[derive(Debug)]
pub struct GvisorBackend {
    keepers: ProcessBackend,
}

impl GvisorBackend {
    pub fn open(config: crate::tier::ProcessConfig) -> Result<Self, CellError> {
        Ok(Self {
            keepers: ProcessBackend::open(config)?.keeping_sandboxes(),
        })
    }
}

impl Backend for GvisorBackend {
    fn tier(&self) -> Tier {
        Tier::Gvisor
    }

    fn check_name(&self, name: &str) -> Result<(), CellError> {
        self.keepers.check_name(name)
    }

    fn check(&self, policy: &Policy, workspace: Option<&Path>) -> Result<(), CellError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(CellError::Unsupported(
                keeper::GvisorError::NotRoot.to_string(),
            ));
        }
        let config = self.keepers.config();
        if runsc::Runsc::find(&config.state).is_none() {
            return Err(CellError::Unsupported(
                keeper::GvisorError::NoRunsc.to_string(),
            ));
        }
        crate::process::plan::check_request(policy, workspace, &config.state, &config.runtime)
            .map_err(|e| CellError::Invalid(e.to_string()))
    }

    fn start(&self, spec: CellSpec) -> Result<Arc<dyn Cell>, StartError> {
        self.keepers.start(spec)
    }

    fn run_attached(
        &self,
        spec: CellSpec,
        argv: Vec<std::ffi::OsString>,
        discard_changes: bool,
        before_start: &mut (dyn FnMut() -> Result<(), String> + Send),
    ) -> Result<Attached, StartError> {
        attached::run(&self.keepers, spec, argv, discard_changes, before_start)
    }

    fn settle_starts(&self) {
        self.keepers.settle_starts();
    }

    fn adopt(&self, name: &str) -> Result<Option<Arc<dyn Cell>>, CellError> {
        self.keepers.adopt(name)
    }

    fn exists(&self, name: &str) -> bool {
        self.keepers.exists(name)
    }

    fn layers(&self) -> Option<crate::tier::Layers> {
        self.keepers.layers()
    }

    fn probe(&self) -> Vec<Check> {
        probe::checks(&self.keepers.config().state)
    }

    fn checkpoint(
        &self,
        name: &str,
        image: &Path,
        while_held: &mut dyn FnMut() -> Result<(), String>,
    ) -> Result<(), CellError> {
        let runsc = runsc::Runsc::find(&self.keepers.config().state)
            .ok_or_else(|| CellError::Unsupported(keeper::GvisorError::NoRunsc.to_string()))?;
        // The cell's runtime folder: its bundle, which says its user, and its mark of execs.
        let folder = self.keepers.config().runtime.join("cells").join(name);
        let spec = oci_spec::runtime::Spec::load(folder.join("bundle").join("config.json"))
            .map_err(|e| CellError::Ended(format!("cell `{name}` has no bundle ({e})")))?;
        let user = spec
            .process()
            .as_ref()
            .map_or((0, 0), |p| (p.user().uid(), p.user().gid()));
        let execs = folder.join(checkpoint::EXECS_MARKER);
        checkpoint::save(&runsc, name, user, (image, &execs), while_held)?;
        // The image is whole; the cell ends there (runsc leaves a container it saved paused).
        match self.keepers.adopt(name)? {
            Some(cell) => cell.kill(),
            None => Ok(()),
        }
    }
}
