//! A cell's workspace changes, seen and applied from outside: `warden diff`, `apply` and `rm`.
//! A running cell is frozen while its layer is read, so the warden sees a consistent state;
//! nothing runs inside the cell for any of this.

use std::os::unix::fs::MetadataExt as _;

use warden_workspace::{
    ApplyOptions, ApplyReport, Diff, DiffOptions, Layer, LayerMeta, Sensitivity, WorkspaceError,
};

use super::cgroup::{CellCgroup, CgroupError};
use super::registry::{Registry, RegistryError};
use super::store::Store;

#[derive(Debug, thiserror::Error)]
pub enum ChangesError {
    #[error(
        "cell `{0}` has no copy-on-write workspace layer (it ran without --workspace, in direct mode, changed nothing, or was removed)"
    )]
    NoLayer(String),
    #[error("cell `{0}` is still running; stop it with `warden kill {0}` first")]
    Running(String),
    #[error("reading the layer of cell `{name}`: {source}")]
    Layer {
        name: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Workspace(#[from] WorkspaceError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// Keeps a running cell's layer still while a read (or a copy) of it lasts: the cell frozen,
/// thawed again however the read ends; or, when the init alone ran, the cell's starts held
/// back (`starts`), let go at the end.
#[derive(Debug)]
pub struct Frozen {
    cgroup: Option<CellCgroup>,
    _quiet: Option<std::os::fd::OwnedFd>,
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Some(cgroup) = &self.cgroup {
            let _ = cgroup.thaw();
        }
    }
}

/// Opens a cell's layer and keeps it still while the caller holds the guard: without a freeze
/// when nothing but the init runs in the cell and no start is under way (the starts are held
/// back instead), frozen otherwise.
pub fn hold(
    registry: &Registry,
    store: &Store,
    name: &str,
) -> Result<(Layer, LayerMeta, Frozen), ChangesError> {
    let Some(quiet) = quiet(registry, name) else {
        return hold_frozen(registry, store, name);
    };
    let (layer, meta) = open(store, name)?;
    let still = Frozen {
        cgroup: None,
        _quiet: Some(quiet),
    };
    Ok((layer, meta, still))
}

/// Like `hold`, always with a freeze (for a reset, which writes the layer through the cell's
/// own mount while it holds it).
pub fn hold_frozen(
    registry: &Registry,
    store: &Store,
    name: &str,
) -> Result<(Layer, LayerMeta, Frozen), ChangesError> {
    let (layer, meta) = open(store, name)?;
    let frozen = freeze(registry, name)?;
    Ok((layer, meta, frozen))
}

/// The cell's starts lock, held exclusive, when the cell runs in a cgroup of its own that holds
/// its init and nothing else, and no start is under way: then nothing can change its layer
/// until the lock is let go.
fn quiet(registry: &Registry, name: &str) -> Option<std::os::fd::OwnedFd> {
    let record = registry.get(name).ok()?;
    let cgroup = record.cgroup.as_ref()?;
    let lock = super::starts::quiet(&registry.starts_lock(name))?;
    // Taken first, then looked: a start that came before the lock is in the cgroup by now.
    (cgroup.pids() == [record.pid] && !cgroup.is_frozen()).then_some(lock)
}

fn open(store: &Store, name: &str) -> Result<(Layer, LayerMeta), ChangesError> {
    if super::plan::check_name(name).is_err() {
        return Err(ChangesError::NoLayer(name.to_owned()));
    }
    let layer = store.layer(name);
    if !layer.exists() {
        return Err(ChangesError::NoLayer(name.to_owned()));
    }
    let meta = layer.meta().map_err(|source| ChangesError::Layer {
        name: name.to_owned(),
        source,
    })?;
    // A layer with a file system of its own whose mount went (a reboot) is mounted again.
    super::disk::attach(&layer).map_err(|e| ChangesError::Layer {
        name: name.to_owned(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok((layer, meta))
}

fn options(meta: &LayerMeta) -> DiffOptions {
    DiffOptions {
        sensitivity: Sensitivity::new(meta.protected.clone()),
        ..DiffOptions::default()
    }
}

/// Freezes the cell when it runs and can be frozen (a cell without a freezer is read live).
fn freeze(registry: &Registry, name: &str) -> Result<Frozen, ChangesError> {
    let cgroup = registry.get(name).ok().and_then(|r| r.cgroup);
    // Already paused by the user: leave it paused afterwards.
    let cgroup = cgroup.filter(|cg| !cg.is_frozen());
    if let Some(cg) = &cgroup {
        cg.freeze()?;
    }
    Ok(Frozen {
        cgroup,
        _quiet: None,
    })
}

/// The changes of a cell's workspace, running or stopped.
pub fn diff(
    registry: &Registry,
    store: &Store,
    name: &str,
) -> Result<(Diff, LayerMeta), ChangesError> {
    let (layer, meta, _frozen) = hold(registry, store, name)?;
    let diff = warden_workspace::diff(&meta.lower, &layer.stack(&meta), &options(&meta))?;
    Ok((diff, meta))
}

/// Applies chosen changes of a cell's workspace to the host directory.
pub fn apply(
    registry: &Registry,
    store: &Store,
    name: &str,
    mut options: ApplyOptions,
) -> Result<ApplyReport, ChangesError> {
    let (layer, meta, _frozen) = hold(registry, store, name)?;
    let diff = warden_workspace::diff(&meta.lower, &layer.stack(&meta), &self::options(&meta))?;
    options.started = Some(meta.started);
    if nix::unistd::geteuid().is_root() {
        // New files belong to the directory's owner, not to root or the cell.
        if let Ok(dir) = std::fs::metadata(&meta.lower) {
            options.owner = Some((dir.uid(), dir.gid()));
        }
    }
    Ok(warden_workspace::apply(
        &meta.lower,
        &layer.stack(&meta),
        &diff,
        &options,
    )?)
}

/// Removes a stopped cell's layer (its unapplied changes are lost).
pub fn remove(registry: &Registry, store: &Store, name: &str) -> Result<(), ChangesError> {
    if registry.get(name).is_ok() {
        return Err(ChangesError::Running(name.to_owned()));
    }
    let (layer, _) = open(store, name)?;
    layer.remove().map_err(|source| ChangesError::Layer {
        name: name.to_owned(),
        source,
    })
}
