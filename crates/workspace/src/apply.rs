//! Applying chosen changes of an upper layer to the host directory: all of them or none, each
//! file replaced atomically, nothing written outside the directory, no ownership, device nodes or
//! set-id bits carried over.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use cap_std::ambient_authority;
use cap_std::fs::{Dir, MetadataExt as _, Permissions, PermissionsExt as _};
use serde::Serialize;

use crate::WorkspaceError;
use crate::change::{Change, ChangeKind, Diff, EntryKind};

/// What to apply and how.
#[derive(Debug, Clone, Default)]
pub struct ApplyOptions {
    /// Paths to apply (a directory selects what is below it); empty applies everything.
    pub paths: Vec<String>,
    pub dry_run: bool,
    /// Overwrite host files changed since the cell started.
    pub force: bool,
    /// Apply sensitive changes without naming each one.
    pub include_sensitive: bool,
    /// When the cell started: a host entry changed after this is a conflict.
    pub started: Option<SystemTime>,
    /// Owner for new files (when the warden runs as root for another user's directory).
    pub owner: Option<(u32, u32)>,
    /// The digest of the diff that was reviewed: the apply goes ahead only while the changes
    /// are still exactly those.
    pub digest: Option<String>,
}

/// What an apply did (or, with `dry_run`, would do).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct ApplyReport {
    pub applied: Vec<String>,
    /// Changes left out, with the reason.
    pub skipped: Vec<(String, String)>,
    pub dry_run: bool,
}

/// Applies the selected changes of `diff` (computed from `layers` against `lower`) to `lower`.
pub fn apply(
    lower: &Path,
    layers: &[PathBuf],
    diff: &Diff,
    options: &ApplyOptions,
) -> Result<ApplyReport, WorkspaceError> {
    if let Some(expected) = &options.digest
        && *expected != diff.digest
    {
        return Err(WorkspaceError::Changed {
            expected: expected.clone(),
            found: diff.digest.clone(),
        });
    }
    let mut report = ApplyReport {
        dry_run: options.dry_run,
        ..ApplyReport::default()
    };
    let selected = select(diff, options, &mut report)?;
    let host = Dir::open_ambient_dir(lower, ambient_authority()).map_err(|source| {
        WorkspaceError::Write {
            path: lower.to_path_buf(),
            source,
        }
    })?;
    if !options.force {
        check_conflicts(&host, &selected, options.started)?;
    }
    if options.dry_run {
        report.applied = selected.iter().map(|c| c.path.clone()).collect();
        return Ok(report);
    }
    remove_stale_staging(&host);
    let staging_name = format!("{STAGING_PREFIX}{}-{}", std::process::id(), now_nanos());
    host.create_dir(&staging_name)
        .map_err(|source| WorkspaceError::Write {
            path: lower.join(&staging_name),
            source,
        })?;
    let staging = host
        .open_dir(&staging_name)
        .map_err(|source| WorkspaceError::Write {
            path: lower.join(&staging_name),
            source,
        })?;
    let mut tx = Transaction {
        host: &host,
        staging: &staging,
        staging_name: &staging_name,
        undo: Vec::new(),
        next: 0,
    };
    let result = selected.iter().try_for_each(|change| {
        tx.apply_one(layers, change, options.owner)
            .map_err(|e| (change.path.clone(), e))
    });
    if let Err((path, source)) = result {
        tx.roll_back();
        let _ = host.remove_dir_all(&staging_name);
        return Err(WorkspaceError::RolledBack { path, source });
    }
    let _ = host.remove_dir_all(&staging_name);
    report.applied = selected.iter().map(|c| c.path.clone()).collect();
    Ok(report)
}

const STAGING_PREFIX: &str = ".warden-apply-";

/// Removes staging directories left by an apply that was killed (its process is gone). What
/// that apply had renamed into place stays: each file is either its old or its new version.
fn remove_stale_staging(host: &Dir) {
    let Ok(entries) = host.entries() else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(STAGING_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = host.remove_dir_all(&name);
        }
    }
}

fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn under(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty() || prefix == "." || path == prefix || path.starts_with(&format!("{prefix}/"))
}

fn select<'d>(
    diff: &'d Diff,
    options: &ApplyOptions,
    report: &mut ApplyReport,
) -> Result<Vec<&'d Change>, WorkspaceError> {
    for named in &options.paths {
        if !diff.changes.iter().any(|c| under(&c.path, named)) {
            return Err(WorkspaceError::UnknownPath(named.clone()));
        }
    }
    let mut selected = Vec::new();
    for change in &diff.changes {
        let named_exactly = options
            .paths
            .iter()
            .any(|p| p.trim_end_matches('/') == change.path);
        if !options.paths.is_empty() && !options.paths.iter().any(|p| under(&change.path, p)) {
            continue;
        }
        if let Some(reason) = &change.refused {
            if named_exactly {
                return Err(WorkspaceError::Refused {
                    path: change.path.clone(),
                    reason: reason.clone(),
                });
            }
            report
                .skipped
                .push((change.path.clone(), format!("refused: {reason}")));
            continue;
        }
        if let Some(reason) = &change.sensitive
            && !named_exactly
            && !options.include_sensitive
        {
            report.skipped.push((
                change.path.clone(),
                format!("sensitive ({reason}): name it or pass --include-sensitive"),
            ));
            continue;
        }
        // Below a deleted or replaced directory there is nothing left to do separately.
        if selected.iter().any(|s: &&Change| {
            s.kind == ChangeKind::Deleted && under(&change.path, &s.path) && s.path != change.path
        }) {
            continue;
        }
        selected.push(change);
    }
    Ok(selected)
}

fn check_conflicts(
    host: &Dir,
    selected: &[&Change],
    started: Option<SystemTime>,
) -> Result<(), WorkspaceError> {
    let Some(started) = started else {
        return Ok(());
    };
    let since = started.duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut conflicts = Vec::new();
    for change in selected {
        let Ok(meta) = host.symlink_metadata(&change.path) else {
            continue;
        };
        // ctime cannot be set from user space: any change to the host entry after the cell
        // started moves it past the start time.
        let changed = (meta.ctime() as u64, meta.ctime_nsec() as u32);
        if changed > (since.as_secs(), since.subsec_nanos()) {
            conflicts.push(change.path.clone());
        }
    }
    if conflicts.is_empty() {
        Ok(())
    } else {
        Err(WorkspaceError::Conflict {
            count: conflicts.len(),
            paths: conflicts.join(", "),
        })
    }
}

/// Steps done so far, undone in reverse on failure.
enum Undo {
    /// `path` did not exist before: remove it.
    Remove { path: PathBuf, dir: bool },
    /// `path` was moved or linked to the staging entry `backup`: put it back.
    Restore { path: PathBuf, backup: String },
    /// `path` had these permissions.
    Permissions { path: PathBuf, mode: u32 },
    /// `path` and the staging entry `slot` were exchanged: exchange them back.
    Exchange { path: PathBuf, slot: String },
}

struct Transaction<'a> {
    host: &'a Dir,
    staging: &'a Dir,
    staging_name: &'a str,
    undo: Vec<Undo>,
    next: usize,
}

impl Transaction<'_> {
    fn slot(&mut self) -> String {
        self.next += 1;
        format!("{}", self.next)
    }

    fn staged(&self, slot: &str) -> PathBuf {
        Path::new(self.staging_name).join(slot)
    }

    /// Keeps the current host entry at `path` reachable from staging, without removing it.
    fn back_up(&mut self, path: &Path) -> io::Result<()> {
        let Ok(meta) = self.host.symlink_metadata(path) else {
            return Ok(());
        };
        let backup = self.slot();
        if meta.is_dir() {
            // A directory leaves in one rename: present, then absent.
            self.host.rename(path, self.host, self.staged(&backup))?;
        } else if self.host.hard_link(path, self.staging, &backup).is_err() {
            self.host.rename(path, self.host, self.staged(&backup))?;
        }
        self.undo.push(Undo::Restore {
            path: path.to_path_buf(),
            backup,
        });
        Ok(())
    }

    /// Atomically exchanges the staging entry `slot` with the host entry at `path`, naming each
    /// by its own directory so that no path is resolved through a symlink.
    fn exchange(&self, slot: &str, path: &Path) -> io::Result<()> {
        let parent = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => self.host.open_dir(parent)?,
            None => self.host.try_clone()?,
        };
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::other("a change without a file name"))?;
        rustix::fs::renameat_with(
            self.staging,
            slot,
            &parent,
            name,
            rustix::fs::RenameFlags::EXCHANGE,
        )
        .map_err(io::Error::from)
    }

    fn ensure_parent(&mut self, path: &Path) -> io::Result<()> {
        let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else {
            return Ok(());
        };
        let mut partial = PathBuf::new();
        for component in parent.components() {
            partial.push(component);
            match self.host.symlink_metadata(&partial) {
                Ok(meta) if meta.is_dir() => {}
                Ok(_) => {
                    return Err(io::Error::other(format!(
                        "{} is not a directory on the host",
                        partial.display()
                    )));
                }
                Err(_) => {
                    self.host.create_dir(&partial)?;
                    self.undo.push(Undo::Remove {
                        path: partial.clone(),
                        dir: true,
                    });
                }
            }
        }
        Ok(())
    }

    fn apply_one(
        &mut self,
        layers: &[PathBuf],
        change: &Change,
        owner: Option<(u32, u32)>,
    ) -> io::Result<()> {
        let path = PathBuf::from(&change.path);
        let mode = change.new_mode.unwrap_or(0o644) & 0o777; // never set-id or sticky bits
        match (change.kind, change.entry) {
            (ChangeKind::Deleted, _) => {
                self.back_up(&path)?;
                // Files were linked to staging; the host copy goes now.
                if self.host.symlink_metadata(&path).is_ok() {
                    self.host.remove_file(&path)?;
                }
                Ok(())
            }
            (_, EntryKind::Dir) => {
                self.ensure_parent(&path)?;
                match self.host.symlink_metadata(&path) {
                    Ok(meta) if meta.is_dir() => {
                        self.undo.push(Undo::Permissions {
                            path: path.clone(),
                            mode: meta.mode() & 0o7777,
                        });
                        self.host
                            .set_permissions(&path, Permissions::from_mode(mode))
                    }
                    existing => {
                        if existing.is_ok() {
                            self.back_up(&path)?;
                            if self.host.symlink_metadata(&path).is_ok() {
                                self.host.remove_file(&path)?;
                            }
                        }
                        self.host.create_dir(&path)?;
                        self.undo.push(Undo::Remove {
                            path: path.clone(),
                            dir: true,
                        });
                        self.host
                            .set_permissions(&path, Permissions::from_mode(mode))?;
                        chown(self.host, &path, owner)
                    }
                }
            }
            (_, EntryKind::File | EntryKind::Symlink) => {
                let slot = self.slot();
                if change.entry == EntryKind::Symlink {
                    // Any target, absolute ones too (it is only a name; what it leads to is
                    // the reviewer's call, made when the change was named).
                    let target = change.link_target.clone().unwrap_or_default();
                    rustix::fs::symlinkat(target.as_str(), self.staging, slot.as_str())?;
                } else {
                    let source = crate::diff::locate(layers, &path).ok_or_else(|| {
                        io::Error::other(
                            "the file is gone from the cell's layers; run the diff again",
                        )
                    })?;
                    self.stage_file(&source, &slot, mode, change.size)?;
                    chown(self.staging, Path::new(&slot), owner)?;
                }
                self.ensure_parent(&path)?;
                match self.host.symlink_metadata(&path) {
                    Ok(meta) if !meta.is_dir() => {
                        // Swap the staged file and the host's in one atomic step: a reader sees
                        // the old or the new file, and the old inode moves to staging untouched
                        // (so an interrupted apply leaves no false conflict behind).
                        self.exchange(&slot, &path)?;
                        self.undo.push(Undo::Exchange {
                            path: path.clone(),
                            slot,
                        });
                        return Ok(());
                    }
                    Ok(_) => self.back_up(&path)?, // a directory replaced by a file leaves first
                    Err(_) => self.undo.push(Undo::Remove {
                        path: path.clone(),
                        dir: false,
                    }),
                }
                self.host.rename(self.staged(&slot), self.host, &path)
            }
            (_, EntryKind::Special) => Err(io::Error::other("special files are never applied")),
        }
    }

    fn stage_file(
        &self,
        source: &Path,
        slot: &str,
        mode: u32,
        expected: Option<u64>,
    ) -> io::Result<()> {
        let mut input = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(source)?;
        let meta = input.metadata()?;
        if !meta.is_file() || Some(meta.len()) != expected {
            return Err(io::Error::other(
                "the file changed in the cell since the diff; run the diff again",
            ));
        }
        let mut output = self.staging.create(slot)?;
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = input.read(&mut buf)?;
            if n == 0 {
                break;
            }
            output.write_all(&buf[..n])?;
        }
        output.sync_all()?;
        self.staging
            .set_permissions(slot, Permissions::from_mode(mode))
    }

    fn roll_back(&mut self) {
        while let Some(step) = self.undo.pop() {
            let _ = match step {
                Undo::Remove { path, dir: true } => self.host.remove_dir_all(&path),
                Undo::Remove { path, dir: false } => self.host.remove_file(&path),
                Undo::Restore { path, backup } => {
                    self.host.rename(self.staged(&backup), self.host, &path)
                }
                Undo::Permissions { path, mode } => self
                    .host
                    .set_permissions(&path, Permissions::from_mode(mode)),
                Undo::Exchange { path, slot } => self.exchange(&slot, &path),
            };
        }
    }
}

fn chown(dir: &Dir, path: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    let Some((uid, gid)) = owner else {
        return Ok(());
    };
    // cap-std has no chown; resolve through the directory's descriptor path.
    use std::os::fd::AsRawFd as _;
    let full = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(path);
    std::os::unix::fs::lchown(full, Some(uid), Some(gid))
}
