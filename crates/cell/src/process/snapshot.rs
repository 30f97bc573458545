//! Snapshots: immutable copies of a cell's upper layer. Their cost is what the cell changed, not
//! the size of the tree; forks stack them as lower layers under a fresh upper layer, so a fork
//! copies nothing at all.

use std::fs;
use std::io;
use std::os::fd::AsFd as _;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use nix::sys::stat::{Mode, SFlag, mknod};
use serde::{Deserialize, Serialize};
use warden_workspace::{Layer, LayerMeta};

use super::changes::{self, ChangesError};
use super::registry::Registry;
use super::store::Store;
use super::sys;

/// What is recorded with a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// `CELL@NAME`.
    pub id: String,
    pub cell: String,
    /// The host directory at the bottom of the stack.
    pub lower: PathBuf,
    /// The snapshot's own layer, then the layers under it (topmost first).
    pub layer: PathBuf,
    pub base: Vec<PathBuf>,
    pub protected: Vec<String>,
    pub created: SystemTime,
    /// Bytes of file content in the snapshot's own layer; `None` while it is being counted (a
    /// snapshot that took the cell's layer instead of a copy is counted after it is taken).
    #[serde(default)]
    pub size: Option<u64>,
}

impl SnapshotInfo {
    /// The snapshot's layers, topmost first.
    pub fn stack(&self) -> Vec<PathBuf> {
        let mut out = vec![self.layer.clone()];
        out.extend(self.base.iter().cloned());
        out
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    Changes(#[from] ChangesError),
    #[error("snapshot name `{0}` is not valid: use letters, digits, `-` or `_`")]
    Name(String),
    #[error("snapshot `{0}` already exists")]
    Exists(String),
    #[error("no snapshot `{0}` (see `warden snapshots`)")]
    NotFound(String),
    #[error("snapshot `{id}` is the base of {user}; remove that first")]
    InUse { id: String, user: String },
    #[error("snapshot `{id}` belongs to another cell; reset takes a snapshot of `{cell}`")]
    Foreign { id: String, cell: String },
    #[error(
        "snapshot `{id}` was taken of an earlier cell named `{cell}`, which is gone; a reset takes a snapshot of this cell only: start a new cell from it instead (`--from {id}`)"
    )]
    Earlier { id: String, cell: String },
    #[error("copying {path}: {source}")]
    Copy { path: PathBuf, source: io::Error },
    /// A directory of a layer deeper than a copy goes: the copy stops there, and fails.
    #[error(
        "copying {path}: a directory deeper than {limit} levels, more than a layer's copy goes; \
         nothing was copied: remove that tree in the cell, or snapshot the cell while none of \
         its processes runs (that snapshot copies nothing)"
    )]
    TooDeep { path: PathBuf, limit: usize },
    #[error("snapshot record {path}: {source}")]
    Record { path: PathBuf, source: io::Error },
    #[error("remounting the workspace of cell `{cell}`: {source}")]
    Remount { cell: String, source: io::Error },
    /// A layer of the stack a cell was being made on was removed meanwhile (its snapshot, by
    /// a removal at the same moment).
    #[error(
        "the snapshot layer {0} was removed while a cell was being made on it; make it from a snapshot `warden snapshots` lists"
    )]
    LayerGone(PathBuf),
}

impl From<super::reset::ResetError> for SnapshotError {
    fn from(err: super::reset::ResetError) -> Self {
        match err {
            super::reset::ResetError::Plan(e) => Self::Changes(ChangesError::Workspace(e)),
            super::reset::ResetError::Remount { cell, source } => Self::Remount { cell, source },
        }
    }
}

fn snapshots_dir(store: &Store) -> PathBuf {
    store.root().join("snapshots")
}

fn record_path(store: &Store, id: &str) -> PathBuf {
    snapshots_dir(store).join(id).join("snapshot.json")
}

/// Reads one snapshot's record.
pub fn get(store: &Store, id: &str) -> Result<SnapshotInfo, SnapshotError> {
    let valid = id.split_once('@').is_some_and(|(cell, snap)| {
        super::plan::check_name(cell).is_ok() && super::plan::check_name(snap).is_ok()
    });
    if !valid {
        return Err(SnapshotError::NotFound(id.to_owned()));
    }
    let path = record_path(store, id);
    let text = fs::read_to_string(&path).map_err(|_| SnapshotError::NotFound(id.to_owned()))?;
    let info: SnapshotInfo = serde_json::from_str(&text).map_err(|e| SnapshotError::Record {
        path,
        source: io::Error::other(e),
    })?;
    super::disk::attach_holding(store, &info.layer);
    Ok(info)
}

/// Records a snapshot (written aside, then renamed over).
fn write_record(store: &Store, info: &SnapshotInfo) -> Result<(), SnapshotError> {
    let path = record_path(store, &info.id);
    let text = serde_json::to_vec_pretty(info).map_err(|e| SnapshotError::Record {
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    replace_file(&path, &text).map_err(|source| SnapshotError::Record { path, source })
}

/// Writes `path` whole: aside under a name of this writer's own (two writers of one file never
/// share it), then renamed over it.
fn replace_file(path: &Path, text: &[u8]) -> io::Result<()> {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".new-{}-{n}", std::process::id()));
    let aside = PathBuf::from(aside);
    let written = fs::write(&aside, text).and_then(|()| fs::rename(&aside, path));
    if written.is_err() {
        let _ = fs::remove_file(&aside);
    }
    written
}

/// Held while snapshot records are read, changed and written back (a size counted aside, the
/// layers a removal or a cell's end moves): two such updates never interleave, so that neither
/// writes back a record the other changed meanwhile (a moved layer's old place, in the record
/// of a snapshot stacked on it). Every process of the store takes it (a `flock`).
struct RecordsLock {
    _held: fs::File,
}

impl RecordsLock {
    fn take(store: &Store) -> Result<Self, SnapshotError> {
        // Beside the snapshots' folder, not in it (where every entry is a snapshot's).
        let dir = snapshots_dir(store);
        let path = dir.with_file_name("snapshots.lock");
        let opened = fs::create_dir_all(&dir).and_then(|()| {
            fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        });
        let file = opened.map_err(|source| SnapshotError::Record {
            path: path.clone(),
            source,
        })?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).map_err(|e| {
            SnapshotError::Record {
                path,
                source: e.into(),
            }
        })?;
        Ok(Self { _held: file })
    }
}

/// Removes a stopped cell's layer (its unapplied changes are lost); the snapshot layers kept in
/// its file system of its own are moved out first (see `release`).
pub fn remove_layer(registry: &Registry, store: &Store, name: &str) -> Result<(), ChangesError> {
    if registry.get(name).is_ok() {
        return Err(ChangesError::Running(name.to_owned()));
    }
    let (layer, _, _lock) = changes::open(store, name, changes::Use::Change)?;
    release(store, &layer, name).map_err(|e| ChangesError::Layer {
        name: name.to_owned(),
        source: io::Error::other(format!("moving its snapshots out of its layer: {e}")),
    })?;
    let failed = |source| ChangesError::Layer {
        name: name.to_owned(),
        source,
    };
    // Out of its place first, whole (`.gone-NAME-TIME`, its file system detached), then
    // removed: a removal killed half way had left a layer under the cell's name that no open
    // could read again (its image or record gone before the rest), and so no later removal
    // either. What a kill leaves out of place is swept when the tier is next opened.
    let attaching = super::disk::hold_off_attach(&layer);
    layer.detach().map_err(failed)?;
    let gone = super::background::gone_path(layer.dir());
    fs::rename(layer.dir(), &gone).map_err(failed)?;
    drop(attaching);
    Layer::at(gone).remove().map_err(failed)?;
    released(store);
    Ok(())
}

/// Finishes every making over of a layer that was cut short (the warden was killed in the
/// middle of a snapshot or a reset): called when the process tier is opened.
pub fn finish_all_interrupted(store: &Store) {
    // Records a killed removal or cell's end left naming a layer it had moved.
    if moving_path(store).exists()
        && let Ok(_records) = RecordsLock::take(store)
    {
        let _ = finish_moves_held(store);
    }
    let Ok(marks) = fs::read_dir(Making::marks(store)) else {
        return;
    };
    for mark in marks.flatten() {
        let layer = store.layer(&mark.file_name().to_string_lossy());
        if !interrupted(&layer) {
            let _ = fs::remove_file(mark.path());
            continue;
        }
        let Ok(_lock) = changes::lock(&layer, changes::Use::Change) else {
            continue;
        };
        // Finished by another opener meanwhile, or left for the next.
        if interrupted(&layer) {
            let _ = finish_interrupted(store, &layer);
        }
    }
}

/// Before the layer of cell `name` is removed: the snapshot layers kept in the layer's file
/// system of its own that anything else still stacks are moved out (copied into the snapshots
/// directory), and every record that stacks them is told where they are now.
pub fn release(store: &Store, layer: &Layer, name: &str) -> Result<(), SnapshotError> {
    if !layer.has_image() {
        return Ok(());
    }
    if !layer.is_attached() {
        super::disk::attach(layer).map_err(|e| SnapshotError::Copy {
            path: layer.image(),
            source: io::Error::other(e.to_string()),
        })?;
    }
    let inside = upper_dir(layer);
    let mut used: Vec<(PathBuf, Option<String>)> = Vec::new();
    for info in list(store) {
        if info.layer.starts_with(&inside) {
            used.push((info.layer.clone(), Some(info.id.clone())));
        }
        used.extend(
            info.base
                .iter()
                .filter(|l| l.starts_with(&inside))
                .map(|l| (l.clone(), None)),
        );
    }
    for (cell, meta) in store.layers() {
        if cell != name {
            used.extend(
                stacks(&meta)
                    .filter(|l| l.starts_with(&inside))
                    .map(|l| (l.clone(), None)),
            );
        }
    }
    let mut moves: Vec<(PathBuf, PathBuf)> = Vec::new();
    for (path, id) in used {
        if moves.iter().any(|(from, _)| *from == path) {
            continue;
        }
        let to = match id {
            Some(id) => snapshots_dir(store).join(id).join("layer"),
            None => kept_dir(store).join(format!(
                "{name}-{}",
                path.file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
            )),
        };
        // What an earlier, interrupted attempt left.
        let _ = Layer::at(to.clone()).remove_tree();
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent).map_err(copy_err(parent))?;
        }
        copy_tree(&path, &to)?;
        moves.push((path, to));
    }
    relocate(store, &moves)
}

/// After a cell's layer is gone: the kept layers nothing stacks any more go too.
pub fn released(store: &Store) {
    collect(store);
}

/// Every snapshot, by id.
pub fn list(store: &Store) -> Vec<SnapshotInfo> {
    let Ok(entries) = fs::read_dir(snapshots_dir(store)) else {
        return Vec::new();
    };
    let mut out: Vec<SnapshotInfo> = entries
        .flatten()
        .filter_map(|e| get(store, e.file_name().to_str()?).ok())
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

/// Every snapshot, by id, each with its size (those not counted yet are counted now).
pub fn listed(store: &Store) -> Vec<SnapshotInfo> {
    list(store)
        .into_iter()
        .map(|info| match info.size {
            Some(_) => info,
            None => counted(store, &info.id).unwrap_or(info),
        })
        .collect()
}

/// The next number to try for a cell's unnamed snapshot (`s1`, `s2`, ...), by store and cell:
/// a hint, so that a long session's snapshots are not counted again each time (the claim
/// below is what makes a name the snapshot's).
static NEXT_UNNAMED: std::sync::Mutex<Option<std::collections::HashMap<(PathBuf, String), u64>>> =
    std::sync::Mutex::new(None);

/// Makes the snapshot's folder, which claims its id: `name`, or for an unnamed one the first
/// `sN` free from the hint on. The folder is held (a `flock` of it, the returned file) until
/// its record is written: one without a record that nobody holds was claimed by a process that
/// was killed before it finished, and is taken over (see `take_over`).
fn claim(
    store: &Store,
    cell: &str,
    name: Option<&str>,
) -> Result<(String, PathBuf, fs::File), SnapshotError> {
    let make = |id: &str| {
        let dir = snapshots_dir(store).join(id);
        match make_held(&dir) {
            Ok(held) => Ok(Some((dir, held))),
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {
                Ok(take_over(&dir).map(|held| (dir, held)))
            }
            Err(source) => Err(SnapshotError::Copy { path: dir, source }),
        }
    };
    if let Some(name) = name {
        let id = format!("{cell}@{name}");
        return match make(&id)? {
            Some((dir, held)) => Ok((id, dir, held)),
            None => Err(SnapshotError::Exists(id)),
        };
    }
    let key = (store.root().to_path_buf(), cell.to_owned());
    let mut next = NEXT_UNNAMED
        .lock()
        .ok()
        .and_then(|hints| hints.as_ref()?.get(&key).copied())
        .unwrap_or(1);
    // A hint whose last snapshot is gone (the cell was removed and made again) starts over.
    if next > 1
        && !snapshots_dir(store)
            .join(format!("{cell}@s{}", next - 1))
            .exists()
    {
        next = 1;
    }
    loop {
        let id = format!("{cell}@s{next}");
        if let Some((dir, held)) = make(&id)? {
            if let Ok(mut hints) = NEXT_UNNAMED.lock() {
                hints
                    .get_or_insert_with(Default::default)
                    .insert(key, next + 1);
            }
            return Ok((id, dir, held));
        }
        next += 1;
    }
}

/// A claim folder being made (`.claim-PID-N`): made and locked here, then renamed to its id.
const CLAIMING: &str = ".claim-";

/// Makes the folder `dir`, held: made aside, locked, and renamed into place without replacing
/// anything (so that no other process finds it there unheld). `AlreadyExists` where it is.
fn make_held(dir: &Path) -> io::Result<fs::File> {
    static CLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CLAIMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let aside = dir.with_file_name(format!("{CLAIMING}{}-{n}", std::process::id()));
    let _ = fs::remove_dir_all(&aside);
    fs::create_dir(&aside)?;
    let held = fs::File::open(&aside)
        .and_then(|file| {
            rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)?;
            Ok(file)
        })
        .and_then(|file| {
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                &aside,
                rustix::fs::CWD,
                dir,
                rustix::fs::RenameFlags::NOREPLACE,
            )?;
            Ok(file)
        });
    if held.is_err() {
        let _ = fs::remove_dir(&aside);
    }
    held
}

/// Takes over the snapshot folder `dir` if a killed process left it claimed (no record, and no
/// process holds it): what it holds (a part of a copy) is removed, and the folder is this
/// caller's, held. `None`: it is a snapshot's, or another process's claim.
fn take_over(dir: &Path) -> Option<fs::File> {
    let held = abandoned(dir)?;
    for entry in fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let removed = match entry.file_type().is_ok_and(|t| t.is_dir()) {
            true => Layer::at(path).remove_tree(),
            false => fs::remove_file(path),
        };
        removed.ok()?;
    }
    Some(held)
}

/// The snapshot folder `dir`, held, if a killed process left it claimed: it has no record and
/// no process holds it.
fn abandoned(dir: &Path) -> Option<fs::File> {
    let file = fs::File::open(dir).ok()?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).ok()?;
    (!dir.join("snapshot.json").exists()).then_some(file)
}

/// Takes a snapshot of a cell's workspace (frozen while it is copied, if it runs).
pub fn take(
    registry: &Registry,
    store: &Store,
    cell: &str,
    name: Option<&str>,
) -> Result<SnapshotInfo, SnapshotError> {
    if let Some(name) = name {
        super::plan::check_name(name).map_err(|_| SnapshotError::Name(name.to_owned()))?;
    }
    let (layer, meta, frozen) = changes::hold_for(registry, store, cell, changes::Use::Change)?;
    store.prepare().map_err(|e| SnapshotError::Copy {
        path: store.root().to_path_buf(),
        source: io::Error::other(e.to_string()),
    })?;
    fs::create_dir_all(snapshots_dir(store)).map_err(|source| SnapshotError::Copy {
        path: snapshots_dir(store),
        source,
    })?;
    // Held until the record is written (or the folder removed).
    let (id, dir, _claim) = claim(store, cell, name)?;
    // A clone of the cell's tree a killed snapshot of this id made, and no record names.
    if layer.has_image() {
        let stale = upper_dir(&layer).join("snapshots");
        if stale.join(format!("{CLONE}{id}")).exists() {
            let _ = destroy_clone(&stale, &format!("{CLONE}{id}"));
        }
    }
    // A few small changes are copied: that is quicker than either way below (a few
    // milliseconds, whatever changed), and a later turn-over takes them along.
    let small = copied_quicker(&layer.upper());
    // A cell whose init runs alone gives its upper layer up as the snapshot and goes on on a
    // fresh one: nothing is copied, and each snapshot's layer holds only what changed since
    // the one before.
    let turned = match frozen.is_quiet() && !small {
        true => turn_over(registry, store, &layer, &meta, cell, &id, &dir),
        false => Ok(None),
    };
    // Else (a process runs), in a btrfs file system of the layer's own, the snapshot is a clone
    // of its tree, taken while the cell is frozen: nothing is copied either. (A clone holds the
    // whole upper layer of its moment, as a copy would.)
    let turned = match turned {
        Ok(None) if !small => clone_tree(&layer, &id),
        other => other,
    };
    let mut own = dir.join("layer");
    let result = match turned {
        Ok(Some(turned)) => {
            own = turned;
            Ok(None)
        }
        Ok(None) => copy_tree(&layer.upper(), &own).map(Some),
        Err(err) => Err(err),
    };
    let result = result.map(|size| SnapshotInfo {
        id: id.clone(),
        cell: cell.to_owned(),
        lower: meta.lower.clone(),
        layer: own.clone(),
        base: meta.base.clone(),
        protected: meta.protected.clone(),
        created: SystemTime::now(),
        size,
    });
    let info = match result {
        Ok(info) => info,
        Err(err) => {
            let _ = fs::remove_dir_all(&dir);
            return Err(err);
        }
    };
    let info = match write_new_record(store, &info) {
        Ok(info) => info,
        Err(err) => {
            if let Some((parent, name)) = clone_of(&info.layer) {
                let _ = destroy_clone(&parent, &name);
            }
            return Err(err);
        }
    };
    if info.size.is_none() {
        // Counted aside (a walk of every file it holds); `list` counts what this did not.
        let (store, id) = (store.clone(), info.id.clone());
        std::thread::spawn(move || {
            super::background::settle();
            sys::run_when_idle();
            let _ = counted(&store, &id);
        });
    }
    Ok(info)
}

/// Counts the size of snapshot `id` if it is not counted yet, and records it.
fn counted(store: &Store, id: &str) -> Result<SnapshotInfo, SnapshotError> {
    let info = get(store, id)?;
    if info.size.is_some() {
        return Ok(info);
    }
    let size = layer_size(&info.layer);
    // Recorded unless the snapshot changed meanwhile (removed, or its layer moved); read again
    // and written under the records' lock, so that a move recorded meanwhile is kept.
    let _records = RecordsLock::take(store)?;
    let now = get(store, id)?;
    if now.layer != info.layer || now.size.is_some() {
        return Ok(now);
    }
    let info = SnapshotInfo {
        size: Some(size),
        ..now
    };
    write_record(store, &info)?;
    Ok(info)
}

/// Where the clones of a btrfs layer's tree are kept, in its file system: `snapshots/.sv-ID`,
/// the snapshot's layer being the clone's `upper/`. (A removed one still stacked is renamed
/// `.kept-sv-ID-STAMP` until nothing stacks it.)
const CLONE: &str = ".sv-";
const KEPT_CLONE: &str = ".kept-sv-";

/// Takes the snapshot of a frozen (or quiet) cell whose layer has a btrfs file system of its
/// own as a clone of that file system's tree: the snapshot's layer is the clone's `upper/`, in
/// the cell's disk like a turned-over layer (and so kept there only while the disk is at most
/// half full). The clone shares every block with the cell's tree until either changes, costs a
/// few milliseconds however much changed (the file system writes out what is still in memory
/// first), and needs no new mount: the cell goes on on the same upper layer. `Ok(None)`: the
/// layer is no such, the caller turns it over or copies.
fn clone_tree(layer: &Layer, id: &str) -> Result<Option<PathBuf>, SnapshotError> {
    let root = upper_dir(layer);
    if !layer.has_image() || !sys::on_btrfs(&root) || !half_free(&root) {
        return Ok(None);
    }
    let turned = root.join("snapshots");
    fs::create_dir_all(&turned).map_err(copy_err(&turned))?;
    let open = |dir: &Path| {
        fs::File::open(dir).map_err(|source| SnapshotError::Copy {
            path: dir.to_path_buf(),
            source,
        })
    };
    let (source, into) = (open(&root)?, open(&turned)?);
    let name = format!("{CLONE}{id}");
    sys::btrfs_snapshot(source.as_fd(), into.as_fd(), &name).map_err(|source| {
        SnapshotError::Copy {
            path: turned.join(&name),
            source,
        }
    })?;
    Ok(Some(turned.join(name).join("upper")))
}

/// The clone (its directory and name) whose `upper/` `layer` is, if it is one.
fn clone_of(layer: &Path) -> Option<(PathBuf, String)> {
    if layer.file_name()? != "upper" {
        return None;
    }
    let clone = layer.parent()?;
    let name = clone.file_name()?.to_string_lossy().into_owned();
    let is_clone = name.starts_with(CLONE) || name.starts_with(KEPT_CLONE);
    is_clone.then_some((clone.parent()?.to_path_buf(), name))
}

/// Removes the clone `name` of directory `parent` at once (the file system frees its blocks
/// afterwards).
fn destroy_clone(parent: &Path, name: &str) -> io::Result<()> {
    let dir = fs::File::open(parent)?;
    sys::btrfs_destroy(dir.as_fd(), name)
}

/// Takes the snapshot of a quiet running cell by turning its upper layer into the snapshot's
/// layer `own` and mounting the workspace again on a fresh upper above it (see `swap`).
/// `Ok(false)`: not possible now (the layer has a file system of its own, its stack is deep,
/// something holds the workspace), nothing changed, the caller copies instead.
fn turn_over(
    registry: &Registry,
    store: &Store,
    layer: &Layer,
    meta: &LayerMeta,
    cell: &str,
    id: &str,
    dir: &Path,
) -> Result<Option<PathBuf>, SnapshotError> {
    if meta.base.len() >= super::swap::MAX_DEPTH {
        return Ok(None);
    }
    let Ok(record) = registry.get(cell) else {
        return Ok(None);
    };
    // The upper layer is renamed to be the snapshot's: into the snapshot's folder, or, for a
    // layer with a file system of its own, within that file system, where it counts against
    // the cell's disk limit until the cell is removed (when it is moved out). So that the
    // snapshots of a long session cannot fill the cell's disk, they are kept there while it is
    // at most half full (its blocks and its inodes); past that, snapshots copy (out of it), as
    // they always may.
    if layer.has_image() && !half_free(&upper_dir(layer)) {
        return Ok(None);
    }
    let own = if layer.has_image() {
        let turned = upper_dir(layer).join("snapshots");
        fs::create_dir_all(&turned).map_err(copy_err(&turned))?;
        turned.join(id)
    } else {
        dir.join("layer")
    };
    let same_fs = fs::metadata(upper_dir(layer))
        .ok()
        .zip(own.parent().and_then(|p| fs::metadata(p).ok()))
        .is_some_and(|(a, b)| a.dev() == b.dev());
    if !same_fs {
        return Ok(None);
    }
    let upper = layer.upper();
    let work = layer.work();
    // A layer of few entries at its top has them moved into a fresh directory once the old
    // overlay is unmounted (one rename each: 40-60 us on btrfs), which the new overlay stacks.
    // One of more is stacked itself, as it is: no entry moves, whatever the cell wrote at its
    // top. (The kernel logs that a lower layer of the new overlay is the upper layer of
    // another mount: the old overlay, detached from every namespace and held only until its
    // teardown in the background, through which nothing can reach a file. Moving a few
    // entries keeps that line out of the log for the usual snapshot.)
    let whole = !few_at_top(&upper);
    let (fresh, turned) = fresh_dirs(layer)?;
    let turned = turned.join("upper.turned");
    let _ = fs::remove_dir_all(&turned);
    if !whole {
        empty_like(&upper, &turned)?;
    }
    let old = super::swap::Stack {
        lowers: meta.base.clone(),
        upper: upper.clone(),
        work: work.clone(),
    };
    // Under the turned layer: the cell's stack, with its own snapshots' layers merged into one
    // when a squash of them is ready.
    let base = super::squash::base_for(layer, meta);
    let top = match whole {
        true => upper.clone(),
        false => turned.clone(),
    };
    let mut lowers = vec![top.clone()];
    lowers.extend(base.iter().cloned());
    let new = super::swap::Stack {
        lowers,
        upper: fresh.upper.clone(),
        work: fresh.work.clone(),
    };
    let turn = (!whole).then(|| super::swap::Turn {
        from: upper.clone(),
        into: turned.clone(),
    });
    let mut stacked = vec![own.clone()];
    stacked.extend(base.iter().cloned());
    let mut making = Making {
        made: false,
        whole,
        base: stacked.clone(),
        snapshot: Some(SnapshotInfo {
            id: id.to_owned(),
            cell: cell.to_owned(),
            lower: meta.lower.clone(),
            layer: own.clone(),
            base: meta.base.clone(),
            protected: meta.protected.clone(),
            created: SystemTime::now(),
            size: None,
        }),
    };
    let place = place(store, layer, meta, cell, (record.pid, record.pid_start));
    if !make_over(
        registry,
        store,
        layer,
        &place,
        &mut making,
        [&old, &new],
        turn.as_ref(),
        &fresh,
    )? {
        // Nothing changed in the cell: the copy does it.
        let _ = fs::remove_dir(&turned);
        return Ok(None);
    }
    // The overlay holds its layers by their directories, not their names: the mounted
    // workspace stays as it is while they take the names the records give them. (Turned over
    // whole, the old upper is the snapshot's layer, and the fresh one takes its name alone.)
    fs::rename(&top, &own).map_err(copy_err(&top))?;
    swap_in(layer, "upper")?;
    swap_in(layer, "work")?;
    let now = on(meta, stacked);
    write_meta(store, layer, &now)?;
    Making::done(store, layer);
    if base != meta.base {
        super::squash::forget(layer);
    }
    // A deep stack is merged aside for the next turn-over.
    let stamp = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let merged = match layer.has_image() {
        true => upper_dir(layer)
            .join("snapshots")
            .join(format!(".kept-squash-{stamp}")),
        false => kept_dir(store).join(format!("{cell}-squash-{stamp}")),
    };
    super::squash::start(layer, &now, merged);
    Ok(Some(own))
}

/// Records `making`, mounts the cell's workspace again from `old` on `new` (see `swap`), and
/// records that the new overlay is the cell's. `Ok(false)`: it was not made and nothing changed
/// in the cell (the fresh directories and the record are gone again); the caller goes the
/// slower way. An error: the cell has no workspace mounted.
#[allow(clippy::too_many_arguments)]
fn make_over(
    registry: &Registry,
    store: &Store,
    layer: &Layer,
    place: &super::swap::Place<'_>,
    making: &mut Making,
    [old, new]: [&super::swap::Stack; 2],
    turn: Option<&super::swap::Turn>,
    fresh: &Fresh,
) -> Result<bool, SnapshotError> {
    making.write(store, layer)?;
    // Held by the helper too, until it ends (see `finish_interrupted`).
    let hold = Making::hold(layer).map_err(|source| SnapshotError::Record {
        path: layer.dir().join("making.lock"),
        source,
    })?;
    match super::swap::swap(registry, place, [old, new], turn, hold.as_fd()) {
        Ok(()) => {
            Making::made(layer)?;
            Ok(true)
        }
        Err(err) => {
            fresh.remove();
            Making::done(store, layer);
            match err {
                super::swap::SwapError::Busy(_) | super::swap::SwapError::Failed { .. } => {
                    Ok(false)
                }
                err => Err(SnapshotError::Remount {
                    cell: place.cell.to_owned(),
                    source: io::Error::other(err.to_string()),
                }),
            }
        }
    }
}

/// A layer being made over (mounted again on other directories), recorded before the cell's
/// mount is touched: if the warden is killed before the layer's records say what it is made of
/// now, the next one to open the layer finishes it (see `finish_interrupted`).
#[derive(Debug, Serialize, Deserialize)]
struct Making {
    /// The layer's stack once made over.
    base: Vec<PathBuf>,
    /// For a snapshot's turn-over: the snapshot, its layer where it goes.
    snapshot: Option<SnapshotInfo>,
    /// The turn-over stacks the old upper layer itself (its entries are not moved to
    /// `upper.turned`): once the new overlay is made, the old upper is the snapshot's layer.
    #[serde(default)]
    whole: bool,
    /// The new overlay is the cell's: what is left is renaming and recording. (As earlier
    /// builds wrote it; the record is now renamed `making.made.json` instead.)
    #[serde(default)]
    made: bool,
}

impl Making {
    fn path(layer: &Layer) -> PathBuf {
        changes::making_path(layer)
    }

    /// The marks of layers being made over, one file named after each cell: what the warden
    /// looks at when it starts (one directory read, nothing when there is none).
    fn marks(store: &Store) -> PathBuf {
        store.root().join("making")
    }

    fn mark(store: &Store, layer: &Layer) -> PathBuf {
        Self::marks(store).join(layer.dir().file_name().unwrap_or_default())
    }

    /// The record of the last making over, kept once done (`making.idle`): the next record is
    /// written over it and renamed into place, so that no record's file is ever removed (a
    /// removed file frees its block, whose discard the removal waits for on a disk mounted with
    /// `discard`: 0.09-0.32 ms of each quiet reset or snapshot, traced).
    fn idle(layer: &Layer) -> PathBuf {
        layer.dir().join("making.idle")
    }

    /// The record once the new overlay is the cell's (renamed, see `made`).
    fn made_path(layer: &Layer) -> PathBuf {
        changes::making_made_path(layer)
    }

    /// Takes `making.lock` of `layer`, waiting for whoever holds it: the warden while it makes
    /// the layer over, and with it the swap's helper, which goes on when the warden is killed
    /// (it is a child of the fork server, which outlives the warden by a moment) until it
    /// ends. The next warden finishes the making over only once the helper has ended: before,
    /// it took the new overlay for one not made, removed its fresh upper and work directories
    /// from under the helper, and the helper then mounted the cell's workspace on the removed
    /// directories, whose records said the old stack.
    fn hold(layer: &Layer) -> io::Result<fs::File> {
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(layer.dir().join("making.lock"))?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)?;
        Ok(file)
    }

    fn write(&self, store: &Store, layer: &Layer) -> Result<(), SnapshotError> {
        let path = Self::path(layer);
        let text = serde_json::to_vec(self).map_err(|e| SnapshotError::Record {
            path: path.clone(),
            source: io::Error::other(e),
        })?;
        let marks = Self::marks(store);
        fs::create_dir_all(&marks)
            .and_then(|()| fs::write(Self::mark(store, layer), b""))
            .map_err(copy_err(&marks))?;
        let record_err = |source| SnapshotError::Record {
            path: path.clone(),
            source,
        };
        let idle = Self::idle(layer);
        // Written whole over the idle file, then named the record: one that is there is the
        // whole record.
        warden_workspace::write_over(&idle, &text).map_err(record_err)?;
        fs::rename(&idle, &path).map_err(record_err)
    }

    /// Records that the new overlay is the cell's (what is left is renaming and recording): the
    /// record renamed, not written again.
    fn made(layer: &Layer) -> Result<(), SnapshotError> {
        let path = Self::path(layer);
        fs::rename(&path, Self::made_path(layer))
            .map_err(|source| SnapshotError::Record { path, source })
    }

    fn done(store: &Store, layer: &Layer) {
        let idle = Self::idle(layer);
        if fs::rename(Self::made_path(layer), &idle).is_err() {
            let _ = fs::rename(Self::path(layer), &idle);
        }
        let _ = fs::remove_file(Self::mark(store, layer));
    }
}

/// Whether the making over of `layer` was cut short.
pub(super) fn interrupted(layer: &Layer) -> bool {
    changes::making_cut_short(layer)
}

/// Finishes the making over of `layer` that was cut short (the caller holds the layer's lock
/// exclusive): when the new overlay was made (its fresh work directory has overlayfs's own
/// `work` in it), the directories take their names and the records say what the layer is made
/// of; otherwise what was readied is removed and the layer is as it was.
pub(super) fn finish_interrupted(store: &Store, layer: &Layer) -> Result<(), SnapshotError> {
    // Once the killed warden's helper has ended (it holds this as long as it runs).
    let _helper_ended = Making::hold(layer).map_err(|source| SnapshotError::Record {
        path: layer.dir().join("making.lock"),
        source,
    })?;
    let renamed = Making::made_path(layer);
    let (path, made) = match renamed.exists() {
        true => (renamed, true),
        false => (Making::path(layer), false),
    };
    let text = fs::read(&path).map_err(|source| SnapshotError::Record {
        path: path.clone(),
        source,
    })?;
    let making: Making = serde_json::from_slice(&text).map_err(|e| SnapshotError::Record {
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    let dir = upper_dir(layer);
    let turned = dir.join("upper.turned");
    if made || making.made || dir.join("work.new").join("work").exists() {
        if let Some(info) = &making.snapshot {
            // Turned over whole, the old upper is the snapshot's layer: renamed there unless it
            // was already (then `upper` is gone, or is the fresh one, `upper.new` gone).
            let upper = layer.upper();
            if making.whole && dir.join("upper.new").exists() && upper.exists() {
                fs::rename(&upper, &info.layer).map_err(copy_err(&upper))?;
            }
            if turned.exists() {
                fs::rename(&turned, &info.layer).map_err(copy_err(&turned))?;
            }
            if get(store, &info.id).is_err() {
                write_new_record(store, info)?;
            }
        }
        if dir.join("upper.new").exists() {
            swap_in(layer, "upper")?;
        }
        if dir.join("work.new").exists() {
            swap_in(layer, "work")?;
        }
        let meta = layer.meta().map_err(|source| SnapshotError::Record {
            path: layer.dir().join("layer.json"),
            source,
        })?;
        write_meta(store, layer, &on(&meta, making.base))?;
    } else {
        // The old overlay is the cell's: what was moved out of its upper layer goes back.
        if let Ok(entries) = fs::read_dir(&turned) {
            for entry in entries.flatten() {
                let back = layer.upper().join(entry.file_name());
                fs::rename(entry.path(), &back).map_err(copy_err(&back))?;
            }
        }
        let _ = fs::remove_dir(&turned);
        Fresh {
            upper: dir.join("upper.new"),
            work: dir.join("work.new"),
        }
        .remove();
        if let Some(info) = &making.snapshot
            && get(store, &info.id).is_err()
        {
            let _ = fs::remove_dir_all(snapshots_dir(store).join(&info.id));
        }
    }
    Making::done(store, layer);
    Ok(())
}

/// A fresh upper and work directory for a workspace mounted again (`upper.new`, `work.new`
/// beside the current ones, which the old mount keeps until it is torn down), and the directory
/// they are in.
struct Fresh {
    upper: PathBuf,
    work: PathBuf,
}

impl Fresh {
    fn remove(&self) {
        let _ = fs::remove_dir(&self.upper);
        let _ = Layer::at(self.work.clone()).remove_tree();
    }
}

fn fresh_dirs(layer: &Layer) -> Result<(Fresh, PathBuf), SnapshotError> {
    let dir = upper_dir(layer);
    let fresh = Fresh {
        upper: dir.join("upper.new"),
        work: dir.join("work.new"),
    };
    fresh.remove();
    empty_like(&layer.upper(), &fresh.upper)?;
    if let Err(err) = empty_like(&layer.work(), &fresh.work) {
        fresh.remove();
        return Err(err);
    }
    Ok((fresh, dir))
}

fn place<'a>(
    store: &Store,
    layer: &'a Layer,
    meta: &'a LayerMeta,
    cell: &'a str,
    (pid, pid_start): (i32, u64),
) -> super::swap::Place<'a> {
    super::swap::Place {
        cell,
        pid,
        pid_start,
        host: &meta.lower,
        layer_dir: upper_dir(layer),
        snapshots_dir: snapshots_dir(store),
        mount: &meta.mount,
    }
}

/// Makes `fresh` an empty directory with the mode and owner of `like`.
fn empty_like(like: &Path, fresh: &Path) -> Result<(), SnapshotError> {
    let meta = fs::symlink_metadata(like).map_err(copy_err(like))?;
    fs::create_dir(fresh).map_err(copy_err(fresh))?;
    fs::set_permissions(fresh, fs::Permissions::from_mode(meta.mode() & 0o7777))
        .map_err(copy_err(fresh))?;
    std::os::unix::fs::lchown(fresh, Some(meta.uid()), Some(meta.gid())).map_err(copy_err(fresh))
}

/// Whether the file system `dir` is on has at least half of its blocks and half of its inodes
/// free: a session of many small files runs out of inodes long before blocks.
fn half_free(dir: &Path) -> bool {
    rustix::fs::statvfs(dir).is_ok_and(|s| {
        s.f_bfree.saturating_mul(2) >= s.f_blocks && s.f_ffree.saturating_mul(2) >= s.f_files
    })
}

/// The most entries at the top of an upper layer that a turn-over moves (see `turn_over`).
const MOVED_AT_MOST: usize = 8;

/// Whether the upper layer `dir` has at most [`MOVED_AT_MOST`] entries at its top (listed
/// until one more is seen).
fn few_at_top(dir: &Path) -> bool {
    fs::read_dir(dir).is_ok_and(|entries| entries.take(MOVED_AT_MOST + 1).count() <= MOVED_AT_MOST)
}

/// Whether copying the upper layer `dir` takes less time than turning it over: at most 100
/// entries and 4 MiB of file content (a copy of that takes about as long as a turn-over; the
/// walk stops as soon as either is passed). A directory's entries are counted before any of
/// them is looked at or walked: a layer with more than 100 entries at its top is known as such
/// from one listing, where a walk into its first directory looked at every file there first.
/// The walk recurses, but never more than 100 levels: each level is an entry counted.
fn copied_quicker(dir: &Path) -> bool {
    const ENTRIES: usize = 100;
    const BYTES: u64 = 4 << 20;
    fn walk(dir: &Path, entries: &mut usize, bytes: &mut u64) -> bool {
        let Ok(read) = fs::read_dir(dir) else {
            return false;
        };
        // One more than may be counted is enough to know: a folder of thousands is not listed
        // whole.
        let listed: Vec<fs::DirEntry> = read.flatten().take(ENTRIES + 1 - *entries).collect();
        *entries += listed.len();
        if *entries > ENTRIES {
            return false;
        }
        for entry in listed {
            let Ok(kind) = entry.file_type() else {
                return false;
            };
            if kind.is_dir() {
                if !walk(&entry.path(), entries, bytes) {
                    return false;
                }
            } else if kind.is_file() {
                *bytes += entry.metadata().map_or(u64::MAX / 2, |m| m.len());
            }
            if *bytes > BYTES {
                return false;
            }
        }
        true
    }
    walk(dir, &mut 0, &mut 0)
}

/// Bytes of file content in a layer, counted as a copy counts them: a file's data (its holes
/// not counted), a hard-linked file once. A read of the directory tree only.
fn layer_size(dir: &Path) -> u64 {
    // With a stack of its own, not by recursion: the layer is the cell's, as deep as it made it.
    let mut seen = std::collections::HashSet::new();
    let mut pending = vec![dir.to_path_buf()];
    let mut sum = 0;
    while let Some(dir) = pending.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => pending.push(entry.path()),
                Ok(t) if t.is_file() => {
                    let Ok(meta) = entry.metadata() else {
                        continue;
                    };
                    if meta.nlink() > 1 && !seen.insert((meta.dev(), meta.ino())) {
                        continue;
                    }
                    sum += meta.len().min(meta.blocks() * 512);
                }
                _ => {}
            }
        }
    }
    sum
}

/// Removes a snapshot: its name at once, its layer once nothing stacks on it any more. A snapshot
/// that another cell was forked from stays until that cell is removed.
pub fn remove(store: &Store, id: &str) -> Result<(), SnapshotError> {
    // The look for what stacks it and what follows from it, as one update of the records: a
    // layer made on it meanwhile (a fork) is either seen here or finds it gone.
    let records = RecordsLock::take(store)?;
    finish_moves_held(store)?;
    let info = get(store, id)?;
    let cells = store.layers();
    for (cell, meta) in &cells {
        if *cell != info.cell && stacks(meta).any(|l| *l == info.layer) {
            return Err(SnapshotError::InUse {
                id: id.to_owned(),
                user: format!("cell `{cell}`"),
            });
        }
    }
    // Its own cell, or snapshots taken later, still stack it (a snapshot of a cell whose init
    // ran alone is the layer the next one is on): the layer is kept, nameless, until they go.
    let used = cells
        .iter()
        .any(|(_, meta)| stacks(meta).any(|l| *l == info.layer))
        || list(store)
            .iter()
            .any(|other| other.id != info.id && other.base.contains(&info.layer));
    let dir = snapshots_dir(store).join(id);
    if used {
        let stamp = SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        // What is renamed (a clone whole: its `upper/` cannot leave it), where to, and where the
        // layer then is.
        let (from, to, kept) = match clone_of(&info.layer) {
            _ if info.layer.starts_with(&dir) => {
                let kept = kept_dir(store).join(format!("{id}-{stamp}"));
                (info.layer.clone(), kept.clone(), kept)
            }
            Some((parent, name)) => {
                let to = parent.join(format!("{KEPT_CLONE}{id}-{stamp}"));
                (parent.join(name), to.clone(), to.join("upper"))
            }
            None => {
                let kept = info.layer.with_file_name(format!(".kept-{id}-{stamp}"));
                (info.layer.clone(), kept.clone(), kept)
            }
        };
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent).map_err(copy_err(parent))?;
        }
        // The move is logged, and marked as not yet told, before it is made: a removal killed
        // between the rename and the last record's rewrite left records (this snapshot's, still
        // listed, and those stacking it) naming a place nothing was at, and the next collection
        // took the kept layer for one nothing stacks and deleted it.
        let moves = [(info.layer.clone(), kept)];
        log_moves(store, &moves)?;
        fs::rename(&from, &to).map_err(copy_err(&from))?;
        tell_moves_held(store, &moves)?;
    }
    // What goes leaves its name under the lock and is deleted after it: a long deletion (a
    // copied layer of many files) holds up no other update of the records.
    let mut doomed = Vec::new();
    if !used {
        if let Some((parent, name)) = clone_of(&info.layer) {
            // A clone goes at once (its file system frees its blocks afterwards).
            destroy_clone(&parent, &name).map_err(copy_err(&info.layer))?;
        } else if !info.layer.starts_with(&dir) {
            // Kept in its cell's file system of its own.
            doomed.push(doom(&info.layer)?);
        }
    }
    doomed.push(doom(&dir)?);
    drop(records);
    for tree in doomed {
        Layer::at(tree.clone())
            .remove_tree()
            .map_err(|source| SnapshotError::Copy { path: tree, source })?;
    }
    collect(store);
    Ok(())
}

/// The prefix of a tree renamed out of the records' way to be deleted (see `doom`).
const DOOMED: &str = ".removing-";

/// Renames `path` beside itself to a name no record uses and no collection looks at (with this
/// process's id, for a later collection to finish what a killed process left); the new name.
fn doom(path: &Path) -> Result<PathBuf, SnapshotError> {
    let to = path.with_file_name(doomed_name());
    fs::rename(path, &to).map_err(copy_err(path))?;
    Ok(to)
}

/// `.removing-PID-N-TIME`: N counts this process's renames (TIME keeps a later process that
/// got the same id from meeting a name left by a killed one).
fn doomed_name() -> String {
    static DOOMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = DOOMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stamp = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{DOOMED}{}-{n}-{stamp}", std::process::id())
}

/// Trees left renamed for deletion in `dir` by a process that is gone (killed before it
/// deleted them).
fn doomed_by_the_gone(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DOOMED)) else {
                return false;
            };
            rest.split('-')
                .next()
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .map(|e| e.path())
        .collect()
}

/// Where the layers of removed snapshots wait while something still stacks them.
fn kept_dir(store: &Store) -> PathBuf {
    snapshots_dir(store).join(".kept")
}

/// Every layer a cell's workspace stacks, or goes back to on a reset to its start.
fn stacks(meta: &LayerMeta) -> impl Iterator<Item = &PathBuf> {
    meta.base.iter().chain(meta.start.iter().flatten())
}

/// Tells every record (snapshots, cells' layers) that stacks a layer of `moves` where it is now.
fn relocate(store: &Store, moves: &[(PathBuf, PathBuf)]) -> Result<(), SnapshotError> {
    let _records = RecordsLock::take(store)?;
    relocate_held(store, moves)
}

/// `relocate`, the records' lock held by the caller.
fn relocate_held(store: &Store, moves: &[(PathBuf, PathBuf)]) -> Result<(), SnapshotError> {
    log_moves(store, moves)?;
    tell_moves_held(store, moves)
}

/// Rewrites every record that names a layer of `moves` (logged, see `log_moves`) with its new
/// place, then marks the moves told.
fn tell_moves_held(store: &Store, moves: &[(PathBuf, PathBuf)]) -> Result<(), SnapshotError> {
    rewrite_records(store, |path| {
        moves
            .iter()
            .find(|(from, _)| from == path)
            .map_or_else(|| path.clone(), |(_, to)| to.clone())
    })?;
    let _ = fs::remove_file(moving_path(store));
    Ok(())
}

/// Where a move is marked logged and not yet told to every record (see `finish_moves_held`).
fn moving_path(store: &Store) -> PathBuf {
    snapshots_dir(store).with_file_name("snapshots.moving")
}

/// What a process killed between a logged move and the last record it told left: every record
/// that names a layer no longer where it was is told its place now (`placed`). The records'
/// lock is held.
fn finish_moves_held(store: &Store) -> Result<(), SnapshotError> {
    if !moving_path(store).exists() {
        return Ok(());
    }
    let moves = logged_moves(store);
    rewrite_records(store, |path| {
        placed(&moves, std::slice::from_ref(path))
            .pop()
            .unwrap_or_else(|| path.clone())
    })?;
    let _ = fs::remove_file(moving_path(store));
    Ok(())
}

/// Writes again each record (snapshots, cells' layers) in which `now` changes a layer's path.
fn rewrite_records(store: &Store, now: impl Fn(&PathBuf) -> PathBuf) -> Result<(), SnapshotError> {
    for info in list(store) {
        let told = SnapshotInfo {
            layer: now(&info.layer),
            base: info.base.iter().map(&now).collect(),
            ..info.clone()
        };
        if told != info {
            write_record(store, &told)?;
        }
    }
    for (name, meta) in store.layers() {
        let told = LayerMeta {
            base: meta.base.iter().map(&now).collect(),
            start: meta.start.as_ref().map(|s| s.iter().map(&now).collect()),
            ..meta.clone()
        };
        if told != meta {
            write_meta_held(&store.layer(&name), &told)?;
        }
    }
    Ok(())
}

/// Where the moves of layers are logged (see `placed`), beside the snapshots' folder.
fn moves_path(store: &Store) -> PathBuf {
    snapshots_dir(store).with_file_name("snapshots.moves")
}

/// The logged moves of layers, oldest first (the records' lock held).
fn logged_moves(store: &Store) -> Vec<(PathBuf, PathBuf)> {
    fs::read(moves_path(store))
        .ok()
        .and_then(|text| serde_json::from_slice(&text).ok())
        .unwrap_or_default()
}

/// Adds `moves` to the log, and leaves out those whose layer is gone from where they lead
/// (collected: nothing can stack it).
/// The moves are marked not yet told (`finish_moves_held`) until `tell_moves_held` is done;
/// they may be logged before they are made.
fn log_moves(store: &Store, moves: &[(PathBuf, PathBuf)]) -> Result<(), SnapshotError> {
    let mut all = logged_moves(store);
    all.extend(moves.iter().cloned());
    let mut leading: Vec<_> = all[..all.len() - moves.len()]
        .iter()
        .filter(|(_, to)| placed(&all, std::slice::from_ref(to))[0].exists())
        .cloned()
        .collect();
    leading.extend(moves.iter().cloned());
    let marked = moving_path(store);
    fs::write(&marked, b"").map_err(|source| SnapshotError::Record {
        path: marked,
        source,
    })?;
    let path = moves_path(store);
    let text = serde_json::to_vec(&leading).map_err(|e| SnapshotError::Record {
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    replace_file(&path, &text).map_err(|source| SnapshotError::Record { path, source })
}

/// `paths` as they are now: each that is not where it was read, and that a logged move took
/// elsewhere, at its new place (a move of a move followed). A record made from what was read
/// before a removal or a cell's end moved a layer it stacks (a turn-over under way meanwhile)
/// is written with the layer's new place, not its old one. The records' lock is held.
fn placed(moves: &[(PathBuf, PathBuf)], paths: &[PathBuf]) -> Vec<PathBuf> {
    paths
        .iter()
        .map(|path| {
            let mut now = path.clone();
            for _ in 0..moves.len() {
                if now.exists() {
                    break;
                }
                match moves.iter().rev().find(|(from, _)| *from == now) {
                    Some((_, to)) => now = to.clone(),
                    None => break,
                }
            }
            now
        })
        .collect()
}

/// Makes a cell's layer on `meta.base` (a snapshot's stack, read before): under the records'
/// lock, with each layer where it is now (see `placed`), and only while each still exists, so
/// that a removal of the snapshot at the same moment either sees this layer stack it (and
/// keeps it) or has removed it first (and this is refused with what to do). The stack as
/// recorded.
pub fn create_layer(
    store: &Store,
    layer: &Layer,
    meta: &LayerMeta,
) -> Result<Vec<PathBuf>, SnapshotError> {
    let record_err = |source| SnapshotError::Record {
        path: layer.dir().join("layer.json"),
        source,
    };
    if meta.base.is_empty() {
        return layer.create(meta).map(|()| Vec::new()).map_err(record_err);
    }
    let _records = RecordsLock::take(store)?;
    let base = placed(&logged_moves(store), &meta.base);
    if let Some(gone) = base.iter().find(|l| !l.is_dir()) {
        return Err(SnapshotError::LayerGone(gone.clone()));
    }
    let meta = LayerMeta {
        base,
        ..meta.clone()
    };
    layer.create(&meta).map_err(record_err)?;
    Ok(meta.base)
}

/// Writes a new snapshot's record, its stack as it is now (see `placed`).
fn write_new_record(store: &Store, info: &SnapshotInfo) -> Result<SnapshotInfo, SnapshotError> {
    let _records = RecordsLock::take(store)?;
    let info = SnapshotInfo {
        base: placed(&logged_moves(store), &info.base),
        ..info.clone()
    };
    write_record(store, &info)?;
    Ok(info)
}

/// Every layer some record stacks.
fn referenced(store: &Store) -> std::collections::HashSet<PathBuf> {
    let mut out = std::collections::HashSet::new();
    for info in list(store) {
        out.insert(info.layer.clone());
        out.extend(info.base.iter().cloned());
    }
    for (name, meta) in store.layers() {
        out.extend(stacks(&meta).cloned());
        if let Some(ready) = super::squash::ready(&store.layer(&name)) {
            out.insert(ready.merged);
        }
    }
    out
}

/// Removes the kept layers of removed snapshots that nothing stacks any more.
fn collect(store: &Store) {
    // Under the records' lock: a layer made on a kept one meanwhile is seen as its user.
    let Ok(records) = RecordsLock::take(store) else {
        return;
    };
    // Not while a record may still name a moved layer's old place.
    if finish_moves_held(store).is_err() {
        return;
    }
    let used = referenced(store);
    let mut kept: Vec<PathBuf> = fs::read_dir(kept_dir(store))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    // And what a killed process left renamed for deletion, there and in the snapshots' folder,
    // and the folders of snapshots it claimed and never recorded (a part of a copy).
    let mut doomed = doomed_by_the_gone(&snapshots_dir(store));
    doomed.extend(claimed_by_the_gone(store));
    for (name, _) in store.layers() {
        let layer = store.layer(&name);
        if layer.has_image() {
            let turned = upper_dir(&layer).join("snapshots");
            doomed.extend(doomed_by_the_gone(&turned));
            // Clones a killed snapshot made and never recorded.
            for entry in fs::read_dir(&turned).into_iter().flatten().flatten() {
                let clone = entry.file_name().to_string_lossy().into_owned();
                let Some(id) = clone.strip_prefix(CLONE) else {
                    continue;
                };
                // Its claim's folder gone (collected), or left by a killed process.
                let folder = snapshots_dir(store).join(id);
                let _held = match fs::symlink_metadata(&folder) {
                    Err(_) => None,
                    Ok(_) => match abandoned(&folder) {
                        Some(held) => Some(held),
                        None => continue,
                    },
                };
                if !used.contains(&entry.path().join("upper")) {
                    let _ = destroy_clone(&turned, &clone);
                }
            }
            kept.extend(
                fs::read_dir(turned)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(".kept-"))
                    .map(
                        |e| match e.file_name().to_string_lossy().starts_with(KEPT_CLONE) {
                            true => e.path().join("upper"),
                            false => e.path(),
                        },
                    ),
            );
        }
    }
    for path in kept {
        if used.contains(&path) {
            continue;
        }
        match clone_of(&path) {
            Some((parent, name)) => {
                let _ = destroy_clone(&parent, &name);
            }
            // Renamed out of the kept ones now, deleted once the lock is let go of.
            None => match doom_aside(store, &path) {
                Ok(to) => doomed.push(to),
                Err(_) => {
                    let _ = Layer::at(path).remove_tree();
                }
            },
        }
    }
    drop(records);
    for tree in doomed {
        let _ = Layer::at(tree).remove_tree();
    }
}

/// The folders of snapshots that killed processes claimed and never recorded, each renamed for
/// deletion: those nobody holds, but for a cell whose making over is still to be finished
/// (which may record its snapshot there).
fn claimed_by_the_gone(store: &Store) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let dir = snapshots_dir(store);
    for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let claim = name.starts_with(CLAIMING);
        let cell = match name.split_once('@') {
            Some((cell, _)) if !claim => cell,
            _ if claim => "",
            _ => continue,
        };
        if !claim && Making::marks(store).join(cell).exists() {
            continue;
        }
        let path = entry.path();
        // Held here while it is renamed: a claim under way holds its folder.
        let Some(_held) = abandoned(&path) else {
            continue;
        };
        if let Ok(to) = doom(&path) {
            out.push(to);
        }
    }
    out
}

/// `doom` for a kept layer: one in the kept folder goes to the snapshots' folder (where the
/// kept ones are not looked for), one in a cell's own file system stays beside itself.
fn doom_aside(store: &Store, path: &Path) -> Result<PathBuf, SnapshotError> {
    if path.parent() != Some(kept_dir(store).as_path()) {
        return doom(path);
    }
    let to = snapshots_dir(store).join(doomed_name());
    fs::rename(path, &to).map_err(copy_err(path))?;
    Ok(to)
}

/// The layers a reset goes back to: the snapshot's (which must be one of `cell`'s), or the
/// cell's start.
fn target_stack(
    store: &Store,
    meta: &LayerMeta,
    cell: &str,
    to: Option<&str>,
) -> Result<Vec<PathBuf>, SnapshotError> {
    match to {
        Some(id) => {
            let info = get(store, id)?;
            if info.cell != cell {
                return Err(SnapshotError::Foreign {
                    id: id.to_owned(),
                    cell: cell.to_owned(),
                });
            }
            // Records name their cell by its name alone, which outlives the cell: one taken
            // before this cell's layer was made is an earlier cell's (its files, of another
            // workspace perhaps, which an apply would then write into this one's).
            if info.created < meta.started {
                return Err(SnapshotError::Earlier {
                    id: id.to_owned(),
                    cell: cell.to_owned(),
                });
            }
            Ok(info.stack())
        }
        // The start: the layers the cell was forked from (none for a plain cell).
        None => Ok(Layer::start(meta).to_vec()),
    }
}

/// The record of a layer whose stack is now `base`.
fn on(meta: &LayerMeta, base: Vec<PathBuf>) -> LayerMeta {
    LayerMeta {
        base,
        start: Some(Layer::start(meta).to_vec()),
        ..meta.clone()
    }
}

/// Writes a layer's record, its stack as it is now (see `placed`), under the records' lock.
fn write_meta(store: &Store, layer: &Layer, meta: &LayerMeta) -> Result<(), SnapshotError> {
    let _records = RecordsLock::take(store)?;
    let moves = logged_moves(store);
    let meta = LayerMeta {
        base: placed(&moves, &meta.base),
        start: meta.start.as_ref().map(|s| placed(&moves, s)),
        ..meta.clone()
    };
    write_meta_held(layer, &meta)
}

/// Writes a layer's record as it is (the records' lock held by the caller).
fn write_meta_held(layer: &Layer, meta: &LayerMeta) -> Result<(), SnapshotError> {
    layer
        .write_meta(meta)
        .map_err(|source| SnapshotError::Record {
            path: layer.dir().join("layer.json"),
            source,
        })
}

/// The directory that holds the layer's `upper/` (its own file system, when it has one).
fn upper_dir(layer: &Layer) -> PathBuf {
    layer
        .upper()
        .parent()
        .map_or_else(|| layer.dir().to_path_buf(), Path::to_path_buf)
}

/// Swaps `name.new` in for `name` in the layer directory and removes the old one.
fn swap_in(layer: &Layer, name: &str) -> Result<(), SnapshotError> {
    let current = upper_dir(layer).join(name);
    let fresh = upper_dir(layer).join(format!("{name}.new"));
    let stamp = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let old = upper_dir(layer).join(format!("{name}.old-{stamp}"));
    // (Gone already when an interrupted swap is finished.)
    match fs::rename(&current, &old) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(SnapshotError::Copy {
                path: current.clone(),
                source,
            });
        }
        Ok(()) => {}
    }
    fs::rename(&fresh, &current).map_err(|source| SnapshotError::Copy {
        path: current.clone(),
        source,
    })?;
    remove_in_background(old);
    Ok(())
}

/// Removes a discarded layer directory in the background (`background::run_holding`), so that the
/// caller does not wait for thousands of unlinks; a leftover goes with the layer when the cell
/// is removed. A file system of the layer's own that is still mounted is let go of first: a
/// look at the layer (its changes) may have mounted it again between its owner's unmount and
/// the move out of the way, and its removal would then delete the image under the mount, which
/// stayed on the host for good (one cell in 18 whose daemon deleted it at once).
pub(super) fn remove_in_background(dir: PathBuf) {
    remove_in_background_holding(dir, None);
}

/// `remove_in_background`, with `mount` (a hold on the layer's file system, taken before it was
/// detached) let go of by the remover once its caller has ended: the file system's teardown
/// (its commit, the loop device's end) is then the remover's, not the end of a `warden run`
/// whose cell's mount namespace was the file system's last user.
pub(super) fn remove_in_background_holding(dir: PathBuf, mount: Option<std::os::fd::OwnedFd>) {
    // At once as well: work left undone by a killed daemon then leaves no mount behind.
    let _ = Layer::at(dir.clone()).detach();
    super::background::run_holding(mount.into_iter().collect(), move || {
        let layer = Layer::at(dir);
        let _ = layer.detach();
        // Its image held (a path's hold is enough), so that its blocks are freed when this
        // lets go of it, not when the loop device under a cell's last mount does.
        let image = rustix::fs::open(
            layer.image(),
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok();
        let _ = layer.remove_tree();
        image
    });
}

/// Returns a stopped cell's workspace to a snapshot of it, or to its start: the target's
/// layers become the layer's stack, under an empty upper layer (nothing is copied).
pub fn reset_stopped(
    store: &Store,
    layer: &Layer,
    cell: &str,
    to: Option<&str>,
) -> Result<(), SnapshotError> {
    let meta = layer.meta().map_err(|source| SnapshotError::Record {
        path: layer.dir().join("layer.json"),
        source,
    })?;
    let target = target_stack(store, &meta, cell, to)?;
    let upper = layer.upper();
    let fresh = upper_dir(layer).join("upper.new");
    let _ = fs::remove_dir_all(&fresh);
    empty_like(&upper, &fresh)?;
    write_meta(store, layer, &on(&meta, target))?;
    swap_in(layer, "upper")
}

/// Returns a running (frozen) cell's workspace to a snapshot of it, or to its start, in place
/// (see `reset`): its processes see the reset tree at once, and go on writing it.
pub fn reset_running(
    registry: &Registry,
    store: &Store,
    layer: &Layer,
    meta: &LayerMeta,
    cell: &str,
    cell_pid: i32,
    to: Option<&str>,
) -> Result<(), SnapshotError> {
    let target = target_stack(store, meta, cell, to)?;
    Ok(super::reset::in_place(
        registry,
        meta,
        cell,
        cell_pid,
        &layer.stack(meta),
        &target,
    )?)
}

/// Resets a quiet running cell by mounting its workspace again on the target's layers under a
/// fresh upper layer (see `swap`): nothing is copied. `Ok(false)`: not possible now, nothing
/// changed.
fn reset_by_swap(
    registry: &Registry,
    store: &Store,
    layer: &Layer,
    meta: &LayerMeta,
    cell: &str,
    to: Option<&str>,
) -> Result<bool, SnapshotError> {
    let target = target_stack(store, meta, cell, to)?;
    if target.len() > super::swap::MAX_DEPTH || fs::create_dir_all(snapshots_dir(store)).is_err() {
        return Ok(false);
    }
    let Ok(record) = registry.get(cell) else {
        return Ok(false);
    };
    let (fresh, _) = fresh_dirs(layer)?;
    let old = super::swap::Stack {
        lowers: meta.base.clone(),
        upper: layer.upper(),
        work: layer.work(),
    };
    let new = super::swap::Stack {
        lowers: target.clone(),
        upper: fresh.upper.clone(),
        work: fresh.work.clone(),
    };
    let mut making = Making {
        base: target.clone(),
        snapshot: None,
        made: false,
        whole: false,
    };
    let place = place(store, layer, meta, cell, (record.pid, record.pid_start));
    if !make_over(
        registry,
        store,
        layer,
        &place,
        &mut making,
        [&old, &new],
        None,
        &fresh,
    )? {
        return Ok(false);
    }
    swap_in(layer, "work")?;
    write_meta(store, layer, &on(meta, target))?;
    swap_in(layer, "upper")?;
    Making::done(store, layer);
    Ok(true)
}

/// Copies an overlayfs layer: directories with their overlay xattrs (opaque), files, symlinks,
/// whiteouts and FIFOs, with modes and (as root) owners. A sparse file keeps its holes (only
/// its data is read and written) and hard links stay links (each inode is copied once).
/// Returns the bytes of file data copied. The top level is split between two threads: a
/// snapshot's cost is its many small files. Below that the walk keeps a stack of its own, never
/// recursing, and a directory more than [`warden_workspace::MAX_DEPTH`] levels below `from`
/// fails the copy ([`SnapshotError::TooDeep`]): a cell makes a tree thousands of levels deep
/// for nothing, where no project goes that deep, and no diff reads that far. The caller
/// removes what was copied, as after any failure.
pub fn copy_tree(from: &Path, to: &Path) -> Result<u64, SnapshotError> {
    let top = rustix::fs::open(
        from,
        rustix::fs::OFlags::RDONLY
            | rustix::fs::OFlags::DIRECTORY
            | rustix::fs::OFlags::NOFOLLOW
            | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| copy_err(from)(e.into()))?;
    let copy = Copy {
        as_root: nix::unistd::geteuid().is_root(),
        linked: std::sync::Mutex::new(std::collections::HashMap::new()),
    };
    let meta = fs::symlink_metadata(from).map_err(copy_err(from))?;
    copy.top(from, std::sync::Arc::new(fs::File::from(top)), to, &meta)
}

/// One tree copy: whether owners are carried, and where each multiply-linked inode went.
struct Copy {
    as_root: bool,
    linked: std::sync::Mutex<std::collections::HashMap<(u64, u64), PathBuf>>,
}

/// Where an entry of a copy is read: the directory it was listed in and its name there. Every
/// directory of the copy is opened from its parent's descriptor by one name, never following a
/// symlink, down from the top: the tree may be a running cell's that no freezer holds still
/// (rootless, without a cgroup of its own), and the cell can swap a directory for a symlink
/// between its listing and its copy. Followed by its path, such a symlink led the copy to any
/// host directory the warden's user may read, into the snapshot (and, through a reset or a
/// fork, into the cell).
#[derive(Clone)]
struct Source {
    dir: std::sync::Arc<fs::File>,
    name: std::ffi::OsString,
}

impl Source {
    /// The entry, opened with `flags`; a symlink there now fails the open.
    fn open(&self, flags: rustix::fs::OFlags) -> io::Result<fs::File> {
        use rustix::fs::OFlags;
        rustix::fs::openat(
            &*self.dir,
            self.name.as_os_str(),
            flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map(fs::File::from)
        .map_err(io::Error::from)
    }
}

/// An entry of a copy: where it is read (its path for errors), where it goes, what it is.
#[derive(Clone)]
struct Child {
    from: PathBuf,
    source: Source,
    to: PathBuf,
    meta: fs::Metadata,
}

fn copy_err(path: &Path) -> impl FnOnce(io::Error) -> SnapshotError + use<> {
    let path = path.to_path_buf();
    move |source| SnapshotError::Copy { path, source }
}

fn nix_copy_err(path: &Path) -> impl FnOnce(nix::Error) -> SnapshotError + use<> {
    let path = path.to_path_buf();
    move |e| SnapshotError::Copy {
        path,
        source: io::Error::from_raw_os_error(e as i32),
    }
}

/// What is left of a copy's walk: an entry to copy (with its depth below the top), or a
/// directory whose entries are all copied, to be given its mode, owner and times.
enum Work {
    Copy(Child, usize),
    Close(PathBuf, fs::Metadata),
}

impl Copy {
    /// Copies the directory `from` (opened: `dir`) to `to`, and everything below it; its
    /// entries are split between two threads.
    fn top(
        &self,
        from: &Path,
        dir: std::sync::Arc<fs::File>,
        to: &Path,
        meta: &fs::Metadata,
    ) -> Result<u64, SnapshotError> {
        let children = self.open_dir(from, dir, to, 0)?;
        let copy_all = |part: &[Child]| -> Result<u64, SnapshotError> {
            part.iter()
                .try_fold(0, |sum, child| Ok(sum + self.tree(child, 1)?))
        };
        let size = if children.len() > 8 {
            let (left, right) = children.split_at(children.len() / 2);
            std::thread::scope(|scope| {
                let other = scope.spawn(|| copy_all(right));
                let mine = copy_all(left);
                let theirs = other.join().unwrap_or_else(|_| {
                    Err(SnapshotError::Copy {
                        path: to.to_path_buf(),
                        source: io::Error::other("copy thread panicked"),
                    })
                });
                Ok::<u64, SnapshotError>(mine? + theirs?)
            })?
        } else {
            copy_all(&children)?
        };
        self.close_dir(to, meta)?;
        Ok(size)
    }

    /// Copies `child`, `depth` levels below the copy's top, and everything below it, with a
    /// stack of its own on the heap instead of recursion: the tree is the cell's, and a
    /// recursive copy of one 256 levels deep overflowed a 2 MiB stack (a debug build's frames).
    fn tree(&self, child: &Child, depth: usize) -> Result<u64, SnapshotError> {
        let mut work = vec![Work::Copy(child.clone(), depth)];
        let mut size = 0;
        while let Some(next) = work.pop() {
            match next {
                Work::Close(to, meta) => self.close_dir(&to, &meta)?,
                Work::Copy(child, depth) if child.meta.is_dir() => {
                    let dir = child
                        .source
                        .open(rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY)
                        .map_err(copy_err(&child.from))?;
                    let children =
                        self.open_dir(&child.from, std::sync::Arc::new(dir), &child.to, depth)?;
                    work.push(Work::Close(child.to, child.meta));
                    // Popped in the order they were listed.
                    work.extend(
                        children
                            .into_iter()
                            .rev()
                            .map(|child| Work::Copy(child, depth + 1)),
                    );
                }
                Work::Copy(child, _) => size += self.leaf(&child)?,
            }
        }
        Ok(size)
    }

    /// Makes the directory `to` for `from` (opened: `dir`; `depth` levels below the copy's
    /// top), with its overlay marks, and lists what is to be copied into it.
    fn open_dir(
        &self,
        from: &Path,
        dir: std::sync::Arc<fs::File>,
        to: &Path,
        depth: usize,
    ) -> Result<Vec<Child>, SnapshotError> {
        if depth > warden_workspace::MAX_DEPTH {
            return Err(SnapshotError::TooDeep {
                path: from.to_path_buf(),
                limit: warden_workspace::MAX_DEPTH,
            });
        }
        fs::create_dir(to).map_err(copy_err(to))?;
        copy_overlay_marks(&dir, to).map_err(copy_err(to))?;
        // Listed through its descriptor, each entry looked at in it (`fstatat`, never
        // following).
        let listed =
            Path::new("/proc/self/fd").join(std::os::fd::AsRawFd::as_raw_fd(&*dir).to_string());
        let mut children = Vec::new();
        for entry in fs::read_dir(&listed).map_err(copy_err(from))? {
            let entry = entry.map_err(copy_err(from))?;
            let name = entry.file_name();
            let path = from.join(&name);
            let meta = entry.metadata().map_err(copy_err(&path))?; // lstat: never follows
            children.push(Child {
                from: path,
                to: to.join(&name),
                meta,
                source: Source {
                    dir: std::sync::Arc::clone(&dir),
                    name,
                },
            });
        }
        Ok(children)
    }

    /// Gives the copied directory `to` the mode, owner (as root) and times of `meta`, once its
    /// entries are copied.
    fn close_dir(&self, to: &Path, meta: &fs::Metadata) -> Result<(), SnapshotError> {
        fs::set_permissions(to, fs::Permissions::from_mode(meta.mode() & 0o7777))
            .map_err(copy_err(to))?;
        if self.as_root {
            std::os::unix::fs::lchown(to, Some(meta.uid()), Some(meta.gid()))
                .map_err(copy_err(to))?;
        }
        // Last: each entry made in it changed its times.
        keep_times(to, meta).map_err(copy_err(to))
    }

    /// Copies `child`, anything but a directory.
    fn leaf(&self, child: &Child) -> Result<u64, SnapshotError> {
        let (from, to, meta) = (child.from.as_path(), child.to.as_path(), &child.meta);
        let as_root = self.as_root;
        let file_type = meta.file_type();
        let mode = fs::Permissions::from_mode(meta.mode() & 0o7777);
        let owner = (Some(meta.uid()), Some(meta.gid()));
        if file_type.is_file() {
            let create = || {
                fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(to)
                    .map_err(copy_err(to))
            };
            let target = if meta.nlink() > 1 {
                // The first copy of an inode is made (created) under the lock, so that a link
                // from the other thread never finds its target missing.
                let key = (meta.dev(), meta.ino());
                let mut linked = self.linked.lock().map_err(|_| SnapshotError::Copy {
                    path: to.to_path_buf(),
                    source: io::Error::other("a copy thread panicked"),
                })?;
                if let Some(first) = linked.get(&key) {
                    fs::hard_link(first, to).map_err(copy_err(to))?;
                    return Ok(0);
                }
                let target = create()?;
                linked.insert(key, to.to_path_buf());
                target
            } else {
                create()?
            };
            // Never through a symlink; not waiting on a FIFO swapped in.
            let source = child
                .source
                .open(rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK)
                .map_err(copy_err(from))?;
            if !source.metadata().map_err(copy_err(from))?.is_file() {
                return Err(copy_err(from)(io::Error::other(
                    "the file changed while it was copied",
                )));
            }
            let size = sys::copy_data(&source, &target, meta.len(), Some(meta.blocks() * 512))
                .map_err(copy_err(to))?;
            target.set_permissions(mode).map_err(copy_err(to))?;
            if as_root {
                std::os::unix::fs::fchown(&target, owner.0, owner.1).map_err(copy_err(to))?;
            }
            copy_overlay_marks(&source, to).map_err(copy_err(to))?;
            rustix::fs::futimens(&target, &times_of(meta)).map_err(|e| copy_err(to)(e.into()))?;
            return Ok(size);
        }
        if file_type.is_symlink() {
            let target = rustix::fs::readlinkat(
                &*child.source.dir,
                child.source.name.as_os_str(),
                Vec::new(),
            )
            .map(|target| {
                PathBuf::from(
                    <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(
                        target.into_bytes(),
                    ),
                )
            })
            .map_err(|e| copy_err(from)(e.into()))?;
            std::os::unix::fs::symlink(target, to).map_err(copy_err(to))?;
        } else if file_type.is_char_device() && meta.rdev() == 0 {
            mknod(to, SFlag::S_IFCHR, Mode::empty(), 0).map_err(nix_copy_err(to))?;
            fs::set_permissions(to, mode).map_err(copy_err(to))?;
        } else if file_type.is_fifo() {
            nix::unistd::mkfifo(to, Mode::from_bits_truncate(0o600)).map_err(nix_copy_err(to))?;
            fs::set_permissions(to, mode).map_err(copy_err(to))?;
        } else {
            return Ok(0); // sockets and device nodes cannot be carried; the cell could not make them
        }
        if as_root {
            std::os::unix::fs::lchown(to, owner.0, owner.1).map_err(copy_err(to))?;
        }
        keep_times(to, meta).map_err(copy_err(to))?;
        Ok(0)
    }
}

/// Gives `to` (never followed, if a link) the access and modification times of `meta`: a copy
/// of a layer (a snapshot, or one moved out of a cell's disk) shows the times the cell saw,
/// which build tools compare.
fn keep_times(to: &Path, meta: &fs::Metadata) -> io::Result<()> {
    rustix::fs::utimensat(
        rustix::fs::CWD,
        to,
        &times_of(meta),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(io::Error::from)
}

/// The access and modification times of `meta`.
fn times_of(meta: &fs::Metadata) -> rustix::fs::Timestamps {
    let time = |sec: i64, nsec: i64| rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    rustix::fs::Timestamps {
        last_access: time(meta.atime(), meta.atime_nsec()),
        last_modification: time(meta.mtime(), meta.mtime_nsec()),
    }
}

pub(super) fn copy_overlay_xattrs(from: &Path, to: &Path) -> io::Result<()> {
    for name in xattr::list(from)? {
        if is_overlay_mark(&name)
            && let Some(value) = xattr::get(from, &name)?
        {
            xattr::set(to, &name, &value)?;
        }
    }
    Ok(())
}

/// `copy_overlay_xattrs` from an open file or directory.
fn copy_overlay_marks(from: &fs::File, to: &Path) -> io::Result<()> {
    use xattr::FileExt as _;
    for name in from.list_xattr()? {
        if is_overlay_mark(&name)
            && let Some(value) = from.get_xattr(&name)?
        {
            xattr::set(to, &name, &value)?;
        }
    }
    Ok(())
}

/// Whether an extended attribute is one of overlayfs's marks.
fn is_overlay_mark(name: &std::ffi::OsStr) -> bool {
    let text = name.to_string_lossy();
    text.starts_with("user.overlay.") || text.starts_with("trusted.overlay.")
}

/// Returns a cell's workspace to a snapshot of it (`to`), or to its start.
pub fn reset(
    registry: &Registry,
    store: &Store,
    name: &str,
    to: Option<&str>,
) -> Result<(), SnapshotError> {
    if let Some((layer, meta, _quiet)) = changes::hold_quiet(registry, store, name)?
        && reset_by_swap(registry, store, &layer, &meta, name, to)?
    {
        return Ok(());
    }
    let (layer, meta, frozen) = changes::hold_frozen(registry, store, name)?;
    match registry.get(name) {
        Ok(record) => {
            let _pinned = super::sys::pidfd_open(record.pid)
                .map_err(|_| ChangesError::Running(name.to_owned()))?;
            if super::sys::process_start_ticks(record.pid) != Some(record.pid_start) {
                return reset_stopped(store, &layer, name, to);
            }
            let result = reset_running(registry, store, &layer, &meta, name, record.pid, to);
            drop(frozen);
            result
        }
        Err(_) => reset_stopped(store, &layer, name, to),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::process::deep::{deep_chain, on_small_stack};

    /// A copy goes as deep as a diff does, on a daemon thread's stack, and fails past that,
    /// saying where and what to do; a layer's size is counted however deep it is.
    #[test]
    fn a_copy_of_a_tree_deeper_than_it_goes_fails_and_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        let (within, past) = (tmp.path().join("within"), tmp.path().join("past"));
        fs::create_dir_all(&within).unwrap();
        fs::create_dir_all(&past).unwrap();
        deep_chain(&within, warden_workspace::MAX_DEPTH);
        deep_chain(&past, 3000);
        let (from, to) = (within.clone(), tmp.path().join("within-copy"));
        on_small_stack(move || copy_tree(&from, &to)).unwrap();
        let bottom = vec!["d"; warden_workspace::MAX_DEPTH].join("/");
        assert!(
            tmp.path()
                .join("within-copy")
                .join(bottom)
                .join("deep.txt")
                .exists()
        );
        let (from, to) = (past.clone(), tmp.path().join("past-copy"));
        let err = on_small_stack(move || copy_tree(&from, &to)).unwrap_err();
        let deepest = past.join(vec!["d"; warden_workspace::MAX_DEPTH + 1].join("/"));
        assert!(
            matches!(&err, SnapshotError::TooDeep { path, limit: 256 } if *path == deepest),
            "{err}"
        );
        assert!(err.to_string().contains("deeper than 256 levels"), "{err}");
        let from = past.clone();
        assert_eq!(on_small_stack(move || layer_size(&from)), 0);
    }

    /// A store with the layer of cell `c` (on a host directory that is not there), and the
    /// layer's record.
    fn store_with_layer() -> (tempfile::TempDir, Store, Layer, LayerMeta) {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path().to_path_buf()).unwrap();
        let layer = store.layer("c");
        let meta = LayerMeta {
            lower: tmp.path().join("host"),
            started: SystemTime::now(),
            protected: Vec::new(),
            base: Vec::new(),
            start: None,
            mount: "/workspace".into(),
        };
        layer.create(&meta).unwrap();
        (tmp, store, layer, meta)
    }

    /// A store with the layer of cell `c` and its claimed snapshot `c@s1`, as a turn-over that
    /// was cut short left them: the old upper's entries moved to `upper.turned`, fresh `upper.new`
    /// and `work.new` beside. `made`: the new overlay had been made (overlayfs made its `work`).
    /// `whole`: turned over whole, the old upper stacked as it is (its entries not moved).
    fn cut_short(made: bool, recorded: bool, whole: bool) -> (tempfile::TempDir, Store, Layer) {
        let (tmp, store, layer, meta) = store_with_layer();
        let dir = layer.dir().to_path_buf();
        match whole {
            true => fs::write(layer.upper().join("before.txt"), "before").unwrap(),
            false => {
                fs::create_dir(dir.join("upper.turned")).unwrap();
                fs::write(dir.join("upper.turned/before.txt"), "before").unwrap();
            }
        }
        fs::create_dir(dir.join("upper.new")).unwrap();
        fs::create_dir(dir.join("work.new")).unwrap();
        if made {
            fs::create_dir(dir.join("work.new/work")).unwrap();
            fs::write(dir.join("upper.new/after.txt"), "after").unwrap();
        }
        let claimed = snapshots_dir(&store).join("c@s1");
        fs::create_dir_all(&claimed).unwrap();
        let info = SnapshotInfo {
            id: "c@s1".into(),
            cell: "c".into(),
            lower: meta.lower.clone(),
            layer: claimed.join("layer"),
            base: Vec::new(),
            protected: Vec::new(),
            created: SystemTime::now(),
            size: None,
        };
        Making {
            base: vec![info.layer.clone()],
            snapshot: Some(info.clone()),
            made: false,
            whole,
        }
        .write(&store, &layer)
        .unwrap();
        if made && recorded {
            Making::made(&layer).unwrap();
            // As an earlier build recorded it: the record written again, with its flag.
            fs::write(
                dir.join("making.legacy.json"),
                serde_json::to_vec(&Making {
                    base: vec![info.layer.clone()],
                    snapshot: Some(info),
                    made: true,
                    whole,
                })
                .unwrap(),
            )
            .unwrap();
        }
        (tmp, store, layer)
    }

    /// A layer of at most 100 entries and 4 MiB is copied; one entry or one byte more is
    /// turned over (a directory counts as an entry, and so does each of its entries).
    #[test]
    fn a_layer_is_copied_up_to_100_entries_and_4_mib() {
        let tmp = tempfile::tempdir().unwrap();
        let layer = |name: &str, dirs: usize, files: usize, bytes: usize| {
            let root = tmp.path().join(name);
            for d in 0..dirs {
                let dir = root.join(format!("d{d}"));
                fs::create_dir_all(&dir).unwrap();
                for f in 0..files {
                    fs::write(dir.join(format!("f{f}")), vec![b'x'; bytes]).unwrap();
                }
            }
            root
        };
        assert!(copied_quicker(&layer("one-dir-99", 1, 99, 10)));
        assert!(!copied_quicker(&layer("one-dir-100", 1, 100, 10)));
        assert!(copied_quicker(&layer("ten-dirs", 10, 9, 10)));
        let one_more = layer("ten-dirs-one-more", 10, 9, 10);
        fs::write(one_more.join("top-file"), b"x").unwrap();
        assert!(!copied_quicker(&one_more));
        assert!(copied_quicker(&layer("4-mib", 1, 4, 1 << 20)));
        assert!(!copied_quicker(&layer("past-4-mib", 1, 5, 1 << 20)));
        // Many top entries: not copied, whatever they hold.
        assert!(!copied_quicker(&layer("top", 101, 0, 0)));
    }

    /// A making over's record goes from name to name (written over the last one's file,
    /// renamed once the new overlay is made, renamed aside once done) and is never removed: a
    /// removed file frees its block, which a disk mounted with `discard` waits for.
    #[test]
    fn a_making_over_record_is_renamed_through_its_states_and_never_removed() {
        let (_tmp, store, layer, _) = store_with_layer();
        let making = Making {
            base: Vec::new(),
            snapshot: None,
            made: false,
            whole: false,
        };
        use std::os::unix::fs::MetadataExt as _;
        let ino = |path: PathBuf| fs::metadata(path).unwrap().ino();
        making.write(&store, &layer).unwrap();
        assert!(interrupted(&layer));
        let record = ino(Making::path(&layer));
        Making::made(&layer).unwrap();
        assert!(interrupted(&layer), "a made record is not a cut-short one");
        assert!(!Making::path(&layer).exists());
        assert_eq!(ino(Making::made_path(&layer)), record);
        Making::done(&store, &layer);
        assert!(!interrupted(&layer));
        assert_eq!(ino(Making::idle(&layer)), record, "the record was removed");
        // The next one is written over it; one not made is put aside as well.
        making.write(&store, &layer).unwrap();
        assert_eq!(ino(Making::path(&layer)), record);
        assert!(!Making::idle(&layer).exists());
        Making::done(&store, &layer);
        assert!(!interrupted(&layer));
        assert_eq!(ino(Making::idle(&layer)), record);
    }

    #[test]
    fn a_turn_over_cut_short_after_the_new_overlay_was_made_is_finished() {
        // Turned over whole, `renamed`: the old upper had taken the snapshot's layer's name;
        // `taken`: the fresh upper had taken the old one's too.
        for (recorded, legacy, whole, renamed, taken) in [
            (true, false, false, false, false),
            (true, true, false, false, false),
            (false, false, false, false, false),
            (true, false, true, false, false),
            (false, false, true, false, false),
            (true, false, true, true, false),
            (true, false, true, true, true),
        ] {
            let (_tmp, store, layer) = cut_short(true, recorded, whole);
            let own = snapshots_dir(&store).join("c@s1/layer");
            if renamed {
                fs::rename(layer.upper(), &own).unwrap();
            }
            if taken {
                fs::rename(layer.dir().join("upper.new"), layer.upper()).unwrap();
            }
            if legacy {
                // An earlier build's record: `making.json` again, made by its flag.
                fs::rename(Making::made_path(&layer), layer.dir().join("gone.json")).unwrap();
                fs::rename(layer.dir().join("making.legacy.json"), Making::path(&layer)).unwrap();
            }
            assert!(interrupted(&layer));
            finish_all_interrupted(&store);
            assert!(!interrupted(&layer));
            let info = get(&store, "c@s1").unwrap();
            assert_eq!(
                fs::read_to_string(info.layer.join("before.txt")).unwrap(),
                "before"
            );
            assert_eq!(
                fs::read_to_string(layer.upper().join("after.txt")).unwrap(),
                "after"
            );
            let meta = layer.meta().unwrap();
            assert_eq!(meta.base, vec![info.layer.clone()]);
            assert_eq!(meta.start, Some(Vec::new()));
            for gone in ["upper.turned", "upper.new", "work.new"] {
                assert!(!layer.dir().join(gone).exists(), "{gone} is left");
            }
            assert!(layer.work().exists());
        }
    }

    /// A copied layer keeps its entries' modification times (files, directories, links), as
    /// a hard link or a clone would.
    #[test]
    fn a_copy_keeps_the_times_of_what_it_copies() {
        let tmp = tempfile::tempdir().unwrap();
        let from = tmp.path().join("from");
        fs::create_dir_all(from.join("dir")).unwrap();
        fs::write(from.join("dir/file"), "data").unwrap();
        std::os::unix::fs::symlink("file", from.join("dir/link")).unwrap();
        let old = |secs: i64| rustix::fs::Timestamps {
            last_access: rustix::fs::Timespec {
                tv_sec: secs,
                tv_nsec: 5,
            },
            last_modification: rustix::fs::Timespec {
                tv_sec: secs,
                tv_nsec: 7,
            },
        };
        for (path, secs) in [("dir/file", 1_000_000), ("dir/link", 2_000_000)] {
            rustix::fs::utimensat(
                rustix::fs::CWD,
                from.join(path),
                &old(secs),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            )
            .unwrap();
        }
        rustix::fs::utimensat(
            rustix::fs::CWD,
            from.join("dir"),
            &old(3_000_000),
            rustix::fs::AtFlags::empty(),
        )
        .unwrap();
        let to = tmp.path().join("to");
        copy_tree(&from, &to).unwrap();
        for (path, secs) in [
            ("dir/file", 1_000_000),
            ("dir/link", 2_000_000),
            ("dir", 3_000_000),
        ] {
            let meta = fs::symlink_metadata(to.join(path)).unwrap();
            assert_eq!((meta.mtime(), meta.mtime_nsec()), (secs, 7), "{path}");
        }
        assert_eq!(fs::read_to_string(to.join("dir/file")).unwrap(), "data");
    }

    #[test]
    fn a_turn_over_cut_short_before_the_new_overlay_was_made_is_undone() {
        for whole in [false, true] {
            turn_over_cut_short_before_made_is_undone(whole);
        }
    }

    fn turn_over_cut_short_before_made_is_undone(whole: bool) {
        let (_tmp, store, layer) = cut_short(false, false, whole);
        finish_all_interrupted(&store);
        assert!(!interrupted(&layer));
        assert_eq!(
            fs::read_to_string(layer.upper().join("before.txt")).unwrap(),
            "before"
        );
        let meta = layer.meta().unwrap();
        assert!(meta.base.is_empty() && meta.start.is_none(), "{meta:?}");
        for gone in ["upper.turned", "upper.new", "work.new"] {
            assert!(!layer.dir().join(gone).exists(), "{gone} is left");
        }
        assert!(get(&store, "c@s1").is_err());
        assert!(!snapshots_dir(&store).join("c@s1").exists());
    }

    /// A snapshot's size, counted aside while a removal moves a layer it stacks: whichever
    /// writes its record last, the record keeps both the size and the layer's new place (the
    /// count writes back what it read only under the records' lock). Many rounds, the two on
    /// threads of their own, the count made slow enough to overlap.
    #[test]
    fn a_size_counted_aside_never_undoes_a_layers_move() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path().to_path_buf()).unwrap();
        let own = tmp.path().join("own");
        fs::create_dir_all(&own).unwrap();
        for i in 0..200 {
            fs::write(own.join(format!("f{i}")), "x").unwrap();
        }
        let mut lost = Vec::new();
        for round in 0..150 {
            let id = format!("c@s{round}");
            let (from, to) = (
                tmp.path().join(format!("k{round}")),
                tmp.path().join(format!("moved-k{round}")),
            );
            let info = SnapshotInfo {
                id: id.clone(),
                cell: "c".into(),
                lower: tmp.path().join("host"),
                layer: own.clone(),
                base: vec![from.clone()],
                protected: Vec::new(),
                created: SystemTime::now(),
                size: None,
            };
            fs::create_dir_all(snapshots_dir(&store).join(&id)).unwrap();
            write_record(&store, &info).unwrap();
            let counting = {
                let (store, id) = (store.clone(), id.clone());
                std::thread::spawn(move || counted(&store, &id).map(drop))
            };
            let moving = {
                let store = store.clone();
                std::thread::spawn(move || relocate(&store, &[(from, to)]))
            };
            counting.join().unwrap().unwrap();
            moving.join().unwrap().unwrap();
            let now = get(&store, &id).unwrap();
            if now.base != [tmp.path().join(format!("moved-k{round}"))] || now.size.is_none() {
                lost.push(round);
            }
        }
        assert!(
            lost.is_empty(),
            "rounds whose record lost an update: {lost:?}"
        );
        // Nothing of the writers is left beside the records.
        for entry in fs::read_dir(snapshots_dir(&store)).unwrap().flatten() {
            let names: Vec<_> = fs::read_dir(entry.path())
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            assert_eq!(names, ["snapshot.json"], "{}", entry.path().display());
        }
    }

    /// A layer's record made from what was read before a removal moved a layer it stacks (a
    /// turn-over or a reset under way meanwhile), and a new snapshot's record likewise, are
    /// written with the layer's new place: a reset or fork from them finds it, and the kept
    /// layer is not taken for one nothing stacks. A move of a move is followed; a layer made
    /// again at an old place is not redirected.
    #[test]
    fn a_record_written_from_a_read_before_a_move_names_the_new_place() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path().to_path_buf()).unwrap();
        let layer = store.layer("c");
        let (k1, k2) = (tmp.path().join("k1"), tmp.path().join("k2"));
        for dir in [&k1, &k2] {
            fs::create_dir_all(dir).unwrap();
        }
        let meta = LayerMeta {
            lower: tmp.path().join("host"),
            started: SystemTime::now(),
            protected: Vec::new(),
            base: vec![k2.clone(), k1.clone()],
            start: Some(vec![k1.clone()]),
            mount: "/workspace".into(),
        };
        layer.create(&meta).unwrap();
        // Read by a turn-over; then a removal moves k1 (twice over) and tells the records.
        let read = layer.meta().unwrap();
        let (kept, again) = (tmp.path().join("kept-k1"), tmp.path().join("kept-again"));
        fs::rename(&k1, &kept).unwrap();
        relocate(&store, &[(k1.clone(), kept.clone())]).unwrap();
        fs::rename(&kept, &again).unwrap();
        relocate(&store, &[(kept.clone(), again.clone())]).unwrap();
        assert_eq!(layer.meta().unwrap().base, [k2.clone(), again.clone()]);
        // The turn-over writes what it made from its read.
        let own = tmp.path().join("own");
        fs::create_dir_all(&own).unwrap();
        let mut stacked = vec![own.clone()];
        stacked.extend(read.base.iter().cloned());
        write_meta(&store, &layer, &on(&read, stacked)).unwrap();
        let now = layer.meta().unwrap();
        assert_eq!(
            now.base,
            [own.clone(), k2.clone(), again.clone()],
            "{now:?}"
        );
        assert_eq!(now.start, Some(vec![again.clone()]), "{now:?}");
        // Its snapshot's record too.
        fs::create_dir_all(snapshots_dir(&store).join("c@s1")).unwrap();
        let info = SnapshotInfo {
            id: "c@s1".into(),
            cell: "c".into(),
            lower: read.lower.clone(),
            layer: own.clone(),
            base: read.base.clone(),
            protected: Vec::new(),
            created: SystemTime::now(),
            size: Some(0),
        };
        let written = write_new_record(&store, &info).unwrap();
        assert_eq!(written.base, [k2.clone(), again.clone()]);
        assert_eq!(
            get(&store, "c@s1").unwrap().base,
            [k2.clone(), again.clone()]
        );
        // A layer at an old place again is that one.
        fs::create_dir_all(&k1).unwrap();
        assert_eq!(
            placed(&logged_moves(&store), std::slice::from_ref(&k1)),
            [k1]
        );
        // Once the moved layer is gone, its moves leave the log.
        fs::remove_dir_all(&again).unwrap();
        relocate(&store, &[]).unwrap();
        assert!(
            logged_moves(&store).is_empty(),
            "{:?}",
            logged_moves(&store)
        );
    }

    /// A layer made on a snapshot's stack read before the snapshot's removal: where the
    /// removal kept the layer (a later snapshot stacks it), the new layer stacks it where it
    /// was kept; where the removal took it (nothing stacked it), the new layer is refused, and
    /// nothing of it is made.
    #[test]
    fn a_layer_made_on_a_removed_snapshot_finds_it_kept_or_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path().to_path_buf()).unwrap();
        let snapshot = |name: &str, base: Vec<PathBuf>| {
            let id = format!("c@{name}");
            let layer = snapshots_dir(&store).join(&id).join("layer");
            fs::create_dir_all(&layer).unwrap();
            fs::write(layer.join(format!("{name}.txt")), name).unwrap();
            write_record(
                &store,
                &SnapshotInfo {
                    id,
                    cell: "c".into(),
                    lower: tmp.path().join("host"),
                    layer: layer.clone(),
                    base,
                    protected: Vec::new(),
                    created: SystemTime::now(),
                    size: Some(1),
                },
            )
            .unwrap();
            layer
        };
        let meta_on = |base: Vec<PathBuf>| LayerMeta {
            lower: tmp.path().join("host"),
            started: SystemTime::now(),
            protected: Vec::new(),
            base,
            start: None,
            mount: "/workspace".into(),
        };
        let s1 = snapshot("s1", Vec::new());
        snapshot("s2", vec![s1.clone()]);
        let s3 = snapshot("s3", Vec::new());
        // Read before: s1's stack, s3's stack. Then both are removed.
        remove(&store, "c@s1").unwrap();
        remove(&store, "c@s3").unwrap();
        assert!(!s1.exists() && !s3.exists());
        let kept = get(&store, "c@s2").unwrap().base;
        assert_ne!(kept.as_slice(), std::slice::from_ref(&s1));
        let on_kept = create_layer(&store, &store.layer("f"), &meta_on(vec![s1])).unwrap();
        assert_eq!(on_kept, kept);
        assert_eq!(store.layer("f").meta().unwrap().base, kept);
        assert_eq!(fs::read_to_string(kept[0].join("s1.txt")).unwrap(), "s1");
        let refused = create_layer(&store, &store.layer("g"), &meta_on(vec![s3])).unwrap_err();
        assert!(matches!(&refused, SnapshotError::LayerGone(_)), "{refused}");
        assert!(!store.layer("g").dir().join("layer.json").exists());
    }

    /// A removal renames what it deletes out of the records' way (under their lock) and deletes
    /// it after: nothing of it is left once it answers. What a killed process left renamed is
    /// deleted by a later collection; what a live one is deleting is not touched.
    #[test]
    fn what_a_removal_deletes_leaves_no_name_behind_and_a_killed_ones_is_collected() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path().to_path_buf()).unwrap();
        let dir = snapshots_dir(&store).join("c@s1");
        let layer = dir.join("layer");
        fs::create_dir_all(layer.join("sub")).unwrap();
        for i in 0..50 {
            fs::write(layer.join("sub").join(format!("f{i}")), "x").unwrap();
        }
        write_record(
            &store,
            &SnapshotInfo {
                id: "c@s1".into(),
                cell: "c".into(),
                lower: tmp.path().join("host"),
                layer: layer.clone(),
                base: Vec::new(),
                protected: Vec::new(),
                created: SystemTime::now(),
                size: Some(50),
            },
        )
        .unwrap();
        remove(&store, "c@s1").unwrap();
        let left: Vec<_> = fs::read_dir(snapshots_dir(&store))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // Left by a process that is gone (no pid 0 under /proc), and by this one.
        let gone = snapshots_dir(&store).join(format!("{DOOMED}0-3-1"));
        let live = snapshots_dir(&store).join(doomed_name());
        for tree in [&gone, &live] {
            fs::create_dir_all(tree.join("deep")).unwrap();
            fs::write(tree.join("deep").join("f"), "x").unwrap();
        }
        collect(&store);
        assert!(!gone.exists(), "a killed process's tree is left");
        assert!(live.exists(), "a live process's tree was taken");
        assert!(list(&store).is_empty());
    }

    /// A layer whose file system of its own is mounted when it is moved out of the way (mounted
    /// again by a look at its changes after its owner's unmount) is let go of by the remover,
    /// not left mounted on a deleted image.
    /// A store with the layer of cell `c` given a 64 MiB file system of its own (mounted); `None`
    /// (the test skipped) without root or loop devices.
    fn layer_with_disk() -> Option<(tempfile::TempDir, Store, Layer)> {
        if !nix::unistd::geteuid().is_root() || super::super::disk::unavailable().is_some() {
            eprintln!("skipped: needs root and loop devices");
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path().join("state")).unwrap();
        let layer = store.layer("c");
        fs::create_dir_all(layer.dir()).unwrap();
        super::super::disk::create(&layer, &tmp.path().join("templates"), 64 << 20).unwrap();
        Some((tmp, store, layer))
    }

    /// Whether something is mounted at or below `path` in this process's mount namespace.
    fn mounted_under(path: &Path) -> bool {
        fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(&*path.to_string_lossy())
    }

    #[test]
    fn the_remover_unmounts_a_layer_moved_out_while_mounted() {
        let Some((_tmp, _store, layer)) = layer_with_disk() else {
            return;
        };
        assert!(layer.is_attached());
        fs::write(layer.fs_dir().join("kept.txt"), "x").unwrap();
        let gone = layer.dir().with_file_name(".gone-c-1");
        fs::rename(layer.dir(), &gone).unwrap();
        let mounted = || mounted_under(&gone);
        assert!(mounted());
        remove_in_background(gone.clone());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while (gone.exists() || mounted()) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let leaked = mounted();
        if leaked {
            let _ = rustix::mount::unmount(gone.join("fs"), rustix::mount::UnmountFlags::DETACH);
        }
        assert!(!leaked, "the layer's file system is still mounted");
        assert!(!gone.exists(), "the layer's directory is still there");
    }

    /// A look at a layer that mounts its file system (`disk::attach`) waits while the layer is
    /// moved out of the way, and then mounts nothing: no mount lands on the moved layer after
    /// its unmount (one did, in a benchmark that deleted 20 cells at once, and stayed on the
    /// host over the removed image).
    #[test]
    fn no_mount_comes_between_a_layers_unmount_and_its_move() {
        use super::super::disk;
        let Some((_tmp, _store, layer)) = layer_with_disk() else {
            return;
        };
        let held = disk::hold_off_attach(&layer).expect("the layer has a disk");
        layer.detach().unwrap();
        let look = {
            let layer = Layer::at(layer.dir().to_path_buf());
            std::thread::spawn(move || disk::attach(&layer))
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!look.is_finished(), "the look did not wait");
        assert!(!layer.is_attached(), "mounted while held off");
        let gone = layer.dir().with_file_name(".gone-c-1");
        fs::rename(layer.dir(), &gone).unwrap();
        drop(held);
        let looked = look.join().unwrap();
        let mounted = mounted_under(&gone);
        if mounted {
            let _ = rustix::mount::unmount(gone.join("fs"), rustix::mount::UnmountFlags::DETACH);
        }
        assert!(!mounted, "the moved layer's file system was mounted again");
        assert!(looked.is_err(), "the look mounted something");
        assert!(
            !layer.dir().exists(),
            "the look made the layer's folder again"
        );
        let _ = fs::remove_dir_all(&gone);
    }
}
