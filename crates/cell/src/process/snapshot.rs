//! Snapshots: immutable copies of a cell's upper layer. Their cost is what the cell changed, not
//! the size of the tree; forks stack them as lower layers under a fresh upper layer, so a fork
//! copies nothing at all.

use std::fs;
use std::io;
use std::os::unix::fs::{
    FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
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
    /// Bytes of file content in the snapshot's own layer.
    pub size: u64,
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
    #[error("copying {path}: {source}")]
    Copy { path: PathBuf, source: io::Error },
    #[error("snapshot record {path}: {source}")]
    Record { path: PathBuf, source: io::Error },
    #[error("remounting the workspace of cell `{cell}`: {source}")]
    Remount { cell: String, source: io::Error },
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
    serde_json::from_str(&text).map_err(|e| SnapshotError::Record {
        path,
        source: io::Error::other(e),
    })
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

/// The next number to try for a cell's unnamed snapshot (`s1`, `s2`, ...), by store and cell:
/// a hint, so that a long session's snapshots are not counted again each time (the claim
/// below is what makes a name the snapshot's).
static NEXT_UNNAMED: std::sync::Mutex<Option<std::collections::HashMap<(PathBuf, String), u64>>> =
    std::sync::Mutex::new(None);

/// Makes the snapshot's folder, which claims its id: `name`, or for an unnamed one the first
/// `sN` free from the hint on.
fn claim(
    store: &Store,
    cell: &str,
    name: Option<&str>,
) -> Result<(String, PathBuf), SnapshotError> {
    let make = |id: &str| {
        let dir = snapshots_dir(store).join(id);
        match fs::create_dir(&dir) {
            Ok(()) => Ok(Some(dir)),
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(None),
            Err(source) => Err(SnapshotError::Copy { path: dir, source }),
        }
    };
    if let Some(name) = name {
        let id = format!("{cell}@{name}");
        return match make(&id)? {
            Some(dir) => Ok((id, dir)),
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
        if let Some(dir) = make(&id)? {
            if let Ok(mut hints) = NEXT_UNNAMED.lock() {
                hints
                    .get_or_insert_with(Default::default)
                    .insert(key, next + 1);
            }
            return Ok((id, dir));
        }
        next += 1;
    }
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
    let (layer, meta, _frozen) = changes::hold(registry, store, cell)?;
    store.prepare().map_err(|e| SnapshotError::Copy {
        path: store.root().to_path_buf(),
        source: io::Error::other(e.to_string()),
    })?;
    fs::create_dir_all(snapshots_dir(store)).map_err(|source| SnapshotError::Copy {
        path: snapshots_dir(store),
        source,
    })?;
    let (id, dir) = claim(store, cell, name)?;
    let own = dir.join("layer");
    let result = copy_tree(&layer.upper(), &own).map(|size| SnapshotInfo {
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
    let path = record_path(store, &id);
    let text = serde_json::to_vec_pretty(&info).map_err(|e| SnapshotError::Record {
        path: path.clone(),
        source: io::Error::other(e),
    })?;
    fs::write(&path, text).map_err(|source| SnapshotError::Record { path, source })?;
    Ok(info)
}

/// Removes a snapshot nothing is built on.
pub fn remove(store: &Store, id: &str) -> Result<(), SnapshotError> {
    let info = get(store, id)?;
    for (cell, meta) in store.layers() {
        if meta.base.contains(&info.layer) {
            return Err(SnapshotError::InUse {
                id: id.to_owned(),
                user: format!("cell `{cell}`"),
            });
        }
    }
    for other in list(store) {
        if other.base.contains(&info.layer) {
            return Err(SnapshotError::InUse {
                id: id.to_owned(),
                user: format!("snapshot `{}`", other.id),
            });
        }
    }
    let dir = snapshots_dir(store).join(id);
    fs::remove_dir_all(&dir).map_err(|source| SnapshotError::Copy { path: dir, source })
}

/// The upper layer a reset starts from: a copy of the snapshot's layer, or an empty directory
/// with the current upper's mode and owner. Built next to the current one, as `upper.new`.
fn fresh_upper(
    store: &Store,
    layer: &Layer,
    cell: &str,
    to: Option<&str>,
) -> Result<PathBuf, SnapshotError> {
    let upper = layer.upper();
    let fresh = upper_dir(layer).join("upper.new");
    let _ = fs::remove_dir_all(&fresh);
    let copy_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::Copy { path, source }
    };
    match to {
        Some(id) => {
            let info = get(store, id)?;
            if info.cell != cell {
                return Err(SnapshotError::Foreign {
                    id: id.to_owned(),
                    cell: cell.to_owned(),
                });
            }
            copy_tree(&info.layer, &fresh)?;
        }
        None => {
            fs::create_dir(&fresh).map_err(copy_err(&fresh))?;
            let meta = fs::symlink_metadata(&upper).map_err(copy_err(&upper))?;
            fs::set_permissions(&fresh, fs::Permissions::from_mode(meta.mode() & 0o7777))
                .map_err(copy_err(&fresh))?;
            std::os::unix::fs::lchown(&fresh, Some(meta.uid()), Some(meta.gid()))
                .map_err(copy_err(&fresh))?;
        }
    }
    Ok(fresh)
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
    fs::rename(&current, &old).map_err(|source| SnapshotError::Copy {
        path: current.clone(),
        source,
    })?;
    fs::rename(&fresh, &current).map_err(|source| SnapshotError::Copy {
        path: current.clone(),
        source,
    })?;
    remove_in_background(old);
    Ok(())
}

/// Removes a discarded layer directory in a child process, so that the caller does not wait
/// for thousands of unlinks; a leftover goes with the layer when the cell is removed.
pub(super) fn remove_in_background(dir: PathBuf) {
    match sys::clone_process(0) {
        Ok(0) => {
            // Let go of the caller's stdio, so that nobody waits on this child's pipes.
            if let Ok(null) = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
            {
                use std::os::fd::AsRawFd as _;
                for fd in 0..3 {
                    let _ = sys::dup_onto(null.as_raw_fd(), fd);
                }
            }
            let _ = Layer::at(dir).remove_tree();
            sys::exit_now(0);
        }
        Ok(_) => {} // reaped by init once the warden command exits
        Err(_) => {
            let _ = Layer::at(dir).remove_tree();
        }
    }
}

/// Returns a stopped cell's workspace to a snapshot of it, or to its start.
pub fn reset_stopped(
    store: &Store,
    layer: &Layer,
    cell: &str,
    to: Option<&str>,
) -> Result<(), SnapshotError> {
    fresh_upper(store, layer, cell, to)?;
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
    let target = match to {
        Some(id) => {
            let info = get(store, id)?;
            if info.cell != cell {
                return Err(SnapshotError::Foreign {
                    id: id.to_owned(),
                    cell: cell.to_owned(),
                });
            }
            info.stack()
        }
        // The start: the layers the cell was forked from (none for a plain cell).
        None => meta.base.clone(),
    };
    Ok(super::reset::in_place(
        registry,
        meta,
        cell,
        cell_pid,
        &layer.stack(meta),
        &target,
    )?)
}

/// Copies an overlayfs layer: directories with their overlay xattrs (opaque), files, symlinks,
/// whiteouts and FIFOs, with modes and (as root) owners. A sparse file keeps its holes (only
/// its data is read and written) and hard links stay links (each inode is copied once).
/// Returns the bytes of file data copied. The top level is split between two threads: a
/// snapshot's cost is its many small files.
pub fn copy_tree(from: &Path, to: &Path) -> Result<u64, SnapshotError> {
    let copy = Copy {
        as_root: nix::unistd::geteuid().is_root(),
        linked: std::sync::Mutex::new(std::collections::HashMap::new()),
    };
    let meta = fs::symlink_metadata(from).map_err(copy_err(from))?;
    copy.entry(from, to, &meta, true)
}

/// One tree copy: whether owners are carried, and where each multiply-linked inode went.
struct Copy {
    as_root: bool,
    linked: std::sync::Mutex<std::collections::HashMap<(u64, u64), PathBuf>>,
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

impl Copy {
    fn entry(
        &self,
        from: &Path,
        to: &Path,
        meta: &fs::Metadata,
        parallel: bool,
    ) -> Result<u64, SnapshotError> {
        let as_root = self.as_root;
        let file_type = meta.file_type();
        let mode = fs::Permissions::from_mode(meta.mode() & 0o7777);
        let owner = (Some(meta.uid()), Some(meta.gid()));
        if file_type.is_dir() {
            fs::create_dir(to).map_err(copy_err(to))?;
            copy_overlay_xattrs(from, to).map_err(copy_err(to))?;
            let mut children = Vec::new();
            for entry in fs::read_dir(from).map_err(copy_err(from))? {
                let entry = entry.map_err(copy_err(from))?;
                let meta = entry.metadata().map_err(copy_err(&entry.path()))?; // lstat: never follows
                children.push((entry.path(), to.join(entry.file_name()), meta));
            }
            let copy_all =
                |part: &[(PathBuf, PathBuf, fs::Metadata)]| -> Result<u64, SnapshotError> {
                    part.iter()
                        .try_fold(0, |sum, (f, t, m)| Ok(sum + self.entry(f, t, m, false)?))
                };
            let size = if parallel && children.len() > 8 {
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
            fs::set_permissions(to, mode).map_err(copy_err(to))?;
            if as_root {
                std::os::unix::fs::lchown(to, owner.0, owner.1).map_err(copy_err(to))?;
            }
            return Ok(size);
        }
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
            let source = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(from)
                .map_err(copy_err(from))?;
            let size = sys::copy_data(&source, &target, meta.len()).map_err(copy_err(to))?;
            target.set_permissions(mode).map_err(copy_err(to))?;
            if as_root {
                std::os::unix::fs::fchown(&target, owner.0, owner.1).map_err(copy_err(to))?;
            }
            copy_overlay_xattrs(from, to).map_err(copy_err(to))?;
            return Ok(size);
        }
        if file_type.is_symlink() {
            let target = fs::read_link(from).map_err(copy_err(from))?;
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
        Ok(0)
    }
}

fn copy_overlay_xattrs(from: &Path, to: &Path) -> io::Result<()> {
    for name in xattr::list(from)? {
        let text = name.to_string_lossy();
        if (text.starts_with("user.overlay.") || text.starts_with("trusted.overlay."))
            && let Some(value) = xattr::get(from, &name)?
        {
            xattr::set(to, &name, &value)?;
        }
    }
    Ok(())
}

/// Returns a cell's workspace to a snapshot of it (`to`), or to its start.
pub fn reset(
    registry: &Registry,
    store: &Store,
    name: &str,
    to: Option<&str>,
) -> Result<(), SnapshotError> {
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
