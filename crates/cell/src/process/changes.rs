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
/// back (`starts`), let go at the end. It also holds the layer's own lock: shared by reads,
/// exclusive for what changes which directories the layer is made of (a snapshot that turns
/// the upper layer over, a reset), so that no read sees a layer half made over.
#[derive(Debug)]
pub struct Frozen {
    cgroup: Option<CellCgroup>,
    _quiet: Option<std::os::fd::OwnedFd>,
    _layer: Option<std::os::fd::OwnedFd>,
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Some(cgroup) = &self.cgroup {
            let _ = cgroup.thaw();
        }
    }
}

/// What a hold is for: reading the layer, or changing what it is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Read,
    Change,
}

/// Opens a cell's layer to read it, and keeps it still while the caller holds the guard:
/// without a freeze when nothing but the init runs in the cell and no start is under way (the
/// starts are held back instead), frozen otherwise.
pub fn hold(
    registry: &Registry,
    store: &Store,
    name: &str,
) -> Result<(Layer, LayerMeta, Frozen), ChangesError> {
    hold_for(registry, store, name, Use::Read)
}

/// Like `hold`, for `what`.
pub fn hold_for(
    registry: &Registry,
    store: &Store,
    name: &str,
    what: Use,
) -> Result<(Layer, LayerMeta, Frozen), ChangesError> {
    match quiet(registry, name) {
        Some(quiet) => hold_still(store, name, what, quiet),
        None => hold_frozen_for(registry, store, name, what),
    }
}

/// The layer open for `what`, held by the cell's starts lock `quiet` (the init alone).
fn hold_still(
    store: &Store,
    name: &str,
    what: Use,
    quiet: std::os::fd::OwnedFd,
) -> Result<(Layer, LayerMeta, Frozen), ChangesError> {
    let (layer, meta, lock) = open(store, name, what)?;
    let still = Frozen {
        cgroup: None,
        _quiet: Some(quiet),
        _layer: Some(lock),
    };
    Ok((layer, meta, still))
}

/// Like `hold` to change the layer, when the init runs alone and no start is under way; `None`
/// (nothing held, nothing frozen) otherwise.
pub fn hold_quiet(
    registry: &Registry,
    store: &Store,
    name: &str,
) -> Result<Option<(Layer, LayerMeta, Frozen)>, ChangesError> {
    quiet(registry, name)
        .map(|quiet| hold_still(store, name, Use::Change, quiet))
        .transpose()
}

impl Frozen {
    /// Whether the cell is held by its starts lock with its init alone (not frozen).
    pub fn is_quiet(&self) -> bool {
        self._quiet.is_some()
    }
}

/// Like `hold` to change the layer, always with a freeze (for a reset, which writes the layer
/// through the cell's own mount while it holds it).
pub fn hold_frozen(
    registry: &Registry,
    store: &Store,
    name: &str,
) -> Result<(Layer, LayerMeta, Frozen), ChangesError> {
    hold_frozen_for(registry, store, name, Use::Change)
}

fn hold_frozen_for(
    registry: &Registry,
    store: &Store,
    name: &str,
    what: Use,
) -> Result<(Layer, LayerMeta, Frozen), ChangesError> {
    let (layer, meta, lock) = open(store, name, what)?;
    let mut frozen = freeze(registry, name)?;
    frozen._layer = Some(lock);
    Ok((layer, meta, frozen))
}

/// The cell's starts lock, held exclusive, when the cell runs in a cgroup of its own that holds
/// its init and nothing else, and no start is under way: then nothing can change its layer
/// until the lock is let go.
fn quiet(registry: &Registry, name: &str) -> Option<std::os::fd::OwnedFd> {
    let record = registry.get(name).ok()?;
    let lock = super::starts::quiet(&registry.starts_lock(name))?;
    // Taken first, then looked: a start that came before the lock is in the cgroup by now.
    let alone = match &record.cgroup {
        Some(cgroup) => cgroup.pids() == [record.pid] && !cgroup.is_frozen(),
        // Without a cgroup of its own (a rootless cell where none is delegated): every process
        // of the cell descends from its init, and one whose parent ended is the init's child.
        None => {
            let children = std::fs::read_to_string(format!(
                "/proc/{pid}/task/{pid}/children",
                pid = record.pid
            ));
            children.is_ok_and(|c| c.trim().is_empty())
                && super::sys::process_start_ticks(record.pid) == Some(record.pid_start)
        }
    };
    alone.then_some(lock)
}

/// Where a making over of `layer` (mounting it again on other directories) is recorded while
/// it lasts (see `snapshot`).
pub(super) fn making_path(layer: &Layer) -> std::path::PathBuf {
    layer.dir().join("making.json")
}

/// The same record once the layer's new overlay is the cell's.
pub(super) fn making_made_path(layer: &Layer) -> std::path::PathBuf {
    layer.dir().join("making.made.json")
}

/// Whether a making over of `layer` (a quiet snapshot or reset) was cut short: its record is
/// there, under either name.
pub(super) fn making_cut_short(layer: &Layer) -> bool {
    making_path(layer).exists() || making_made_path(layer).exists()
}

/// Takes the lock of `layer` for `what`, waiting for whoever holds it.
pub(super) fn lock(layer: &Layer, what: Use) -> std::io::Result<std::os::fd::OwnedFd> {
    use rustix::fs::{FlockOperation, flock};
    let lock: std::os::fd::OwnedFd = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(layer.dir().join("layer.lock"))?
        .into();
    let mode = match what {
        Use::Read => FlockOperation::LockShared,
        Use::Change => FlockOperation::LockExclusive,
    };
    flock(&lock, mode)?;
    Ok(lock)
}

/// Opens a cell's layer with its lock taken for `what` (waiting for whoever holds it). A layer
/// whose making over was cut short is refused until the warden has finished it.
pub(super) fn open(
    store: &Store,
    name: &str,
    what: Use,
) -> Result<(Layer, LayerMeta, std::os::fd::OwnedFd), ChangesError> {
    if super::plan::check_name(name).is_err() {
        return Err(ChangesError::NoLayer(name.to_owned()));
    }
    let layer = store.layer(name);
    if !layer.exists() {
        return Err(ChangesError::NoLayer(name.to_owned()));
    }
    let failed = |source: std::io::Error| ChangesError::Layer {
        name: name.to_owned(),
        source,
    };
    let lock = lock(&layer, what).map_err(failed)?;
    // A layer with a file system of its own whose mount went (a reboot) is mounted again.
    super::disk::attach(&layer).map_err(|e| failed(std::io::Error::other(e.to_string())))?;
    if making_cut_short(&layer) {
        return Err(failed(std::io::Error::other(
            "its last snapshot or reset was cut short (the warden was killed); the warden finishes it when it starts: start `warden serve` again, or run any `warden` command",
        )));
    }
    let meta = layer.meta().map_err(failed)?;
    // So are those that keep the snapshots it stacks.
    for base in &meta.base {
        super::disk::attach_holding(store, base);
    }
    Ok((layer, meta, lock))
}

fn options(layer: &Layer, meta: &LayerMeta) -> DiffOptions {
    DiffOptions {
        sensitivity: Sensitivity::new(meta.protected.clone()),
        // Never less than the default: a diff that cannot read a change cannot show it.
        max_read_bytes: data_bound(layer, meta).max(warden_workspace::DEFAULT_MAX_READ_BYTES),
        ..DiffOptions::default()
    }
}

/// The most bytes of file data an apply of the cell's changes writes (and its diff reads):
/// `WARDEN_APPLY_MAX_BYTES` where set; else, for a layer with a disk limit of its own, that
/// limit once per layer of its stack (each could hold that much: the upper layer in the disk,
/// a snapshot in it or copied out of it), which no change the cell could write needs more
/// than; else the default. A cell's files can take much more room on the host than on its disk
/// (a file that is all holes, reflinked copies): the bound keeps them from filling the host's.
fn data_bound(layer: &Layer, meta: &LayerMeta) -> u64 {
    if let Some(bound) = std::env::var("WARDEN_APPLY_MAX_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        return bound;
    }
    match std::fs::metadata(layer.image()) {
        Ok(image) => image
            .len()
            .saturating_mul(layer.stack(meta).len() as u64)
            .max(1),
        Err(_) => warden_workspace::DEFAULT_MAX_WRITE_BYTES,
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
        _layer: None,
    })
}

/// The changes of a cell's workspace, running or stopped.
pub fn diff(
    registry: &Registry,
    store: &Store,
    name: &str,
) -> Result<(Diff, LayerMeta), ChangesError> {
    let (layer, meta, _frozen) = hold(registry, store, name)?;
    let options = DiffOptions {
        apply_key: store.apply_key(),
        ..options(&layer, &meta)
    };
    let diff = warden_workspace::diff(&meta.lower, &layer.stack(&meta), &options)?;
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
    options.key = store.apply_key();
    let diff = warden_workspace::diff(
        &meta.lower,
        &layer.stack(&meta),
        &DiffOptions {
            apply_key: options.key,
            ..self::options(&layer, &meta)
        },
    )?;
    options.started = Some(meta.started);
    options.max_write_bytes = data_bound(&layer, &meta);
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
