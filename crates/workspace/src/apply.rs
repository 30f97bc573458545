//! Applying chosen changes of an upper layer to the host directory: all of them or none, each
//! file replaced atomically, nothing written outside the directory, no ownership, device nodes or
//! set-id bits carried over.
//!
//! What a cell's layer holds costs the cell little that could cost the host much: a sparse file
//! of 1 GiB takes no blocks, and a thousand hard links to it take none more. So a file's holes
//! stay holes on the host, names that share an inode in the layer share one on the host, and the
//! bytes of file data one apply writes are bounded, counted before anything is written.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use cap_std::ambient_authority;
use cap_std::fs::{Dir, MetadataExt as _, Permissions, PermissionsExt as _};
use serde::Serialize;

use crate::WorkspaceError;
use crate::change::{Change, ChangeKind, Diff, EntryKind};

/// The most bytes of file data one apply writes unless told otherwise: more than a workspace's
/// changes usually hold, and little enough that a host disk has room for it.
pub const DEFAULT_MAX_WRITE_BYTES: u64 = 4 << 30;

/// What to apply and how.
#[derive(Debug, Clone)]
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
    /// The most bytes of file data the apply writes, all files together (holes and the other
    /// names of a file written already count nothing): an apply that would write more is
    /// refused before it writes anything.
    pub max_write_bytes: u64,
    /// The warden's own key (kept where no cell reaches) with which the apply's undo log and
    /// its record of restored entries are authenticated: the staging folder and the record lie
    /// in the host directory, where a cell's files can be (applied, or written in direct mode),
    /// and a forged log undone by the warden had it set any mode on any host file (a setuid
    /// root program). Without a key no log is trusted, and none is undone.
    pub key: Option<[u8; 32]>,
}

impl Default for ApplyOptions {
    fn default() -> Self {
        Self {
            paths: Vec::new(),
            dry_run: false,
            force: false,
            include_sensitive: false,
            started: None,
            owner: None,
            digest: None,
            max_write_bytes: DEFAULT_MAX_WRITE_BYTES,
            key: None,
        }
    }
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
    if !options.dry_run
        && let Some(key) = &options.key
    {
        recover_in(&host, lower, key)?;
    }
    if !options.force {
        check_conflicts(&host, &selected, options.started, options.key.as_ref())?;
    }
    // Counted up front, so that an apply past the bound is refused whole; the copies count
    // again as they write (a file the cell filled in meanwhile cannot take them past it).
    let roots = layer_roots(layers);
    let total = data_to_write(&roots, &selected);
    if total > options.max_write_bytes {
        return Err(WorkspaceError::TooLarge {
            total,
            bound: options.max_write_bytes,
        });
    }
    if options.dry_run {
        report.applied = selected.iter().map(|c| c.path.clone()).collect();
        return Ok(report);
    }
    let staging_name = staging_name();
    host.create_dir(&staging_name)
        .map_err(|source| WorkspaceError::Write {
            path: lower.join(&staging_name),
            source,
        })?;
    let opened = host.open_dir(&staging_name).and_then(|staging| {
        let log = staging.create(LOG)?.into_std();
        Ok((staging, log))
    });
    let (staging, log) = match opened {
        Ok(opened) => opened,
        Err(source) => {
            let _ = host.remove_dir_all(&staging_name);
            return Err(WorkspaceError::Write {
                path: lower.join(&staging_name),
                source,
            });
        }
    };
    let mut tx = Transaction {
        host: &host,
        staging: &staging,
        staging_name: &staging_name,
        log,
        key: options.key.unwrap_or_default(),
        mac: [0; 32],
        undo: Vec::new(),
        next: 0,
        linked: HashMap::new(),
        written: 0,
        bound: options.max_write_bytes,
    };
    let result = selected
        .iter()
        .try_for_each(|change| {
            tx.apply_one(&roots, change, options.owner)
                .map_err(|e| (change.path.clone(), e))
        })
        // The commit: without its log, staging holds nothing to undo.
        .and_then(|()| {
            staging
                .remove_file(LOG)
                .map_err(|e| (staging_name.clone(), e))
        });
    if let Err((path, source)) = result {
        return Err(
            match settle(&host, &staging, &staging_name, tx.undo.iter().rev()) {
                Ok(_) if source.get_ref().is_some_and(|e| e.is::<ChangedInCell>()) => {
                    WorkspaceError::ChangedInCell { path }
                }
                Ok(_) => WorkspaceError::RolledBack { path, source },
                Err((staging, undo)) => WorkspaceError::NotRolledBack {
                    path,
                    source,
                    undo,
                    staging: lower.join(staging),
                },
            },
        );
    }
    let _ = host.remove_dir_all(&staging_name);
    if let Some(key) = &options.key {
        let restored = Restored::load(&host, key);
        if !restored.entries.is_empty() {
            restored.save(&host, key);
        }
    }
    report.applied = selected.iter().map(|c| c.path.clone()).collect();
    Ok(report)
}

const STAGING_PREFIX: &str = ".warden-apply-";

/// The log of an apply's steps in its staging folder: each step's undo is written to it before
/// the step is taken; its removal is the apply's commit.
const LOG: &str = "log";

/// A fresh staging folder's name: the process's id and start time (which tell whether the
/// process still runs, the id alone being reused), and the time.
fn staging_name() -> String {
    static STARTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let pid = std::process::id();
    let started = STARTED.get_or_init(|| started_at(pid).unwrap_or(0));
    format!("{STAGING_PREFIX}{pid}-{started}-{}", now_nanos())
}

/// When the process `pid` started (`/proc/PID/stat`, clock ticks since boot), while it runs.
fn started_at(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// Whether the staging folder `name` belongs to a process that is gone (`None`: not one).
fn is_dead(name: &str) -> Option<bool> {
    let rest = name.strip_prefix(STAGING_PREFIX)?;
    let mut parts = rest.split('-');
    let pid = parts.next()?.parse::<u32>().ok()?;
    match (parts.next(), parts.next(), parts.next()) {
        (Some(started), Some(_), None) => {
            let started = started.parse::<u64>().ok()?;
            Some(started_at(pid) != Some(started))
        }
        // Named by an earlier build: the process id alone.
        (Some(_), None, None) => Some(!Path::new(&format!("/proc/{pid}")).exists()),
        _ => None,
    }
}

/// Undoes what applies to `lower` that were killed before their commit did (their staging
/// folder still holds their log), in reverse, and removes what every dead apply left there.
/// Only a step that was taken and is not undone yet is undone, so a recovery killed in turn is
/// finished by the next. Called by each apply and diff of the directory before it reads it.
pub fn recover(lower: &Path, key: Option<&[u8; 32]>) -> Result<(), WorkspaceError> {
    // Without the warden's key no log is trusted (see `ApplyOptions::key`).
    let Some(key) = key else {
        return Ok(());
    };
    match Dir::open_ambient_dir(lower, ambient_authority()) {
        Ok(host) => recover_in(&host, lower, key),
        // The diff or apply that follows says why it cannot open it.
        Err(_) => Ok(()),
    }
}

fn recover_in(host: &Dir, lower: &Path, key: &[u8; 32]) -> Result<(), WorkspaceError> {
    let Ok(entries) = host.entries() else {
        return Ok(());
    };
    let dead: Vec<std::ffi::OsString> = entries
        .flatten()
        .map(|entry| entry.file_name())
        .filter(|name| name.to_str().and_then(is_dead) == Some(true))
        .collect();
    for name in dead {
        // Claimed first, by a rename to a name of this process: of two that find it, one
        // undoes it. A directory this process may not change is left as it is.
        let claimed = staging_name();
        if host.rename(&name, host, &claimed).is_err() {
            continue;
        }
        let Ok(staging) = host.open_dir(&claimed) else {
            continue;
        };
        // Only the steps whose records carry the key's mark: a log this process's key did not
        // write (one a cell put there) undoes nothing.
        let steps = match staging.read(LOG) {
            Ok(bytes) => Undo::decode_all(&bytes, key),
            Err(_) => Vec::new(),
        };
        let put_back =
            settle(host, &staging, &claimed, steps.iter().rev()).map_err(|(staging, source)| {
                WorkspaceError::Unrecovered {
                    staging: lower.join(staging),
                    source,
                }
            })?;
        Restored::record(host, put_back, key);
    }
    Ok(())
}

/// The host entries a recovery put back (`.warden-apply-restored.json`), each with its inode
/// and change time then: putting an entry back changes its ctime, which the conflict check
/// took for an edit on the host, so that each apply after a recovered one was refused without
/// `--force`. An entry still as the recovery left it is no conflict; one changed since is.
/// Records of entries changed since are dropped as the file is saved, and the file with the
/// last of them.
#[derive(Default, serde::Deserialize, Serialize)]
struct Restored {
    entries: Vec<RestoredEntry>,
    /// The key's mark of `entries` (hex): a record a cell wrote would have let its own changes
    /// over host edits pass the conflict check.
    #[serde(default)]
    mac: String,
}

/// The key's mark of `bytes`, chained from `before`.
fn mark(key: &[u8; 32], before: &[u8; 32], bytes: &[u8]) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new_keyed(key);
    hasher.update(before);
    hasher.update(bytes);
    *hasher.finalize().as_bytes()
}

/// The mark of a restored record's entries.
fn entries_mark(key: &[u8; 32], entries: &[RestoredEntry]) -> String {
    let bytes = serde_json::to_vec(entries).unwrap_or_default();
    blake3::Hash::from(mark(key, &[0; 32], &bytes))
        .to_hex()
        .to_string()
}

#[derive(serde::Deserialize, Serialize, PartialEq)]
struct RestoredEntry {
    /// The path's bytes (any name, one not UTF-8 too).
    path: Vec<u8>,
    dev: u64,
    ino: u64,
    ctime: (i64, i64),
}

const RESTORED: &str = ".warden-apply-restored.json";

impl RestoredEntry {
    fn of(path: &Path, meta: &cap_std::fs::Metadata) -> Self {
        use std::os::unix::ffi::OsStrExt as _;
        Self {
            path: path.as_os_str().as_bytes().to_vec(),
            dev: meta.dev(),
            ino: meta.ino(),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    fn path(&self) -> &Path {
        use std::os::unix::ffi::OsStrExt as _;
        Path::new(std::ffi::OsStr::from_bytes(&self.path))
    }
}

impl Restored {
    fn load(host: &Dir, key: &[u8; 32]) -> Self {
        host.read(RESTORED)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Self>(&bytes).ok())
            .filter(|read| read.mac == entries_mark(key, &read.entries))
            .unwrap_or_default()
    }

    fn holds(&self, path: &Path, meta: &cap_std::fs::Metadata) -> bool {
        let entry = RestoredEntry::of(path, meta);
        self.entries.contains(&entry)
    }

    /// Adds the entries at `put_back`, as they are now.
    fn record(host: &Dir, put_back: Vec<&Path>, key: &[u8; 32]) {
        if put_back.is_empty() {
            return;
        }
        let mut restored = Self::load(host, key);
        let again: std::collections::HashSet<&Path> = put_back.iter().copied().collect();
        restored.entries.retain(|e| !again.contains(e.path()));
        for path in again {
            if let Ok(meta) = host.symlink_metadata(path) {
                restored.entries.push(RestoredEntry::of(path, &meta));
            }
        }
        restored.save(host, key);
    }

    /// Writes what still holds (aside, then renamed over), or removes the file.
    fn save(mut self, host: &Dir, key: &[u8; 32]) {
        self.entries.retain(|e| {
            host.symlink_metadata(e.path())
                .is_ok_and(|meta| RestoredEntry::of(e.path(), &meta) == *e)
        });
        if self.entries.is_empty() {
            let _ = host.remove_file(RESTORED);
            return;
        }
        self.mac = entries_mark(key, &self.entries);
        let Ok(bytes) = serde_json::to_vec(&self) else {
            return;
        };
        let aside = format!("{RESTORED}.{}", std::process::id());
        if host.write(&aside, bytes).is_ok() && host.rename(&aside, host, RESTORED).is_err() {
            let _ = host.remove_file(&aside);
        }
    }
}

/// Undoes `steps` (the last taken first) and removes the staging folder `name`; where a step
/// cannot be undone, keeps the folder with its log under a name no process owns, for a later
/// recovery, and says which with the error.
fn settle<'u>(
    host: &Dir,
    staging: &Dir,
    name: &str,
    steps: impl Iterator<Item = &'u Undo>,
) -> Result<Vec<&'u Path>, (String, io::Error)> {
    let mut failed = None;
    let mut put_back = Vec::new();
    for step in steps {
        match step.undo(host, staging, name) {
            Ok(Some(path)) => put_back.push(path),
            Ok(None) => {}
            Err(e) => {
                failed.get_or_insert(e);
            }
        }
    }
    match failed {
        None => {
            let _ = staging.remove_file(LOG);
            let _ = host.remove_dir_all(name);
            Ok(put_back)
        }
        Some(e) => {
            let kept = format!("{STAGING_PREFIX}0-0-{}", now_nanos());
            let kept = if host.rename(name, host, &kept).is_ok() {
                kept
            } else {
                name.to_owned()
            };
            Err((kept, e))
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
    prefix.is_empty()
        || prefix == "."
        || path == prefix
        || (path.starts_with(prefix) && path.as_bytes().get(prefix.len()) == Some(&b'/'))
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
    // The deleted (or replaced) paths selected so far: what lies below one is looked up by its
    // ancestors, one lookup each, not against every change selected (a diff of tens of
    // thousands of changes took minutes so).
    let mut deleted: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for change in &diff.changes {
        let named_exactly = options
            .paths
            .iter()
            .any(|p| p.trim_end_matches('/') == change.path);
        if !options.paths.is_empty() && !options.paths.iter().any(|p| under(&change.path, p)) {
            continue;
        }
        // Below a deleted or replaced directory there is nothing left to do separately: it
        // goes with the directory, as it went in the cell (a name that is not UTF-8 too, which
        // is refused only where it would be written or removed by its shown name).
        let below_deleted = || {
            change
                .path
                .match_indices('/')
                .any(|(at, _)| deleted.contains(&change.path[..at]))
        };
        if !(named_exactly && change.refused.is_some()) && below_deleted() {
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
        // A file or link the host has a directory for replaces all of it: the host's entries
        // the diff lists as deleted below it go with it.
        if change.kind == ChangeKind::Deleted || change.entry != EntryKind::Dir {
            deleted.insert(change.path.as_str());
        }
        selected.push(change);
    }
    Ok(selected)
}

fn check_conflicts(
    host: &Dir,
    selected: &[&Change],
    started: Option<SystemTime>,
    key: Option<&[u8; 32]>,
) -> Result<(), WorkspaceError> {
    let Some(started) = started else {
        return Ok(());
    };
    let since = started.duration_since(UNIX_EPOCH).unwrap_or_default();
    let restored = key.map(|key| Restored::load(host, key)).unwrap_or_default();
    let mut conflicts = Vec::new();
    for change in selected {
        let Ok(meta) = host.symlink_metadata(&change.path) else {
            continue;
        };
        if restored.holds(Path::new(&change.path), &meta) {
            continue;
        }
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

/// How to undo one step of an apply, recorded (in memory and in the log) before the step is
/// taken; each undoes only what its step did, so that it is harmless where the step was not
/// taken, or was undone already.
#[derive(Debug, PartialEq)]
enum Undo {
    /// `path` did not exist; the entry `made` (device, inode) was put there: remove it while
    /// it is that one.
    Remove { path: PathBuf, made: (u64, u64) },
    /// `path` was moved or linked to the staging entry `backup`: put it back, where it is.
    Restore { path: PathBuf, backup: String },
    /// `path` had these permissions.
    Permissions { path: PathBuf, mode: u32 },
    /// `path` and the staging entry `slot`, the new entry `staged` (device, inode), were
    /// exchanged: exchange them back while `path` is the new entry.
    Exchange {
        path: PathBuf,
        slot: String,
        staged: (u64, u64),
    },
}

impl Undo {
    /// Undoes the step where it was taken; the host entry it put back, if it did.
    fn undo(&self, host: &Dir, staging: &Dir, staging_name: &str) -> io::Result<Option<&Path>> {
        let is = |path: &Path, id: (u64, u64)| {
            host.symlink_metadata(path)
                .ok()
                .filter(|meta| (meta.dev(), meta.ino()) == id)
        };
        match self {
            Undo::Remove { path, made } => match is(path, *made) {
                Some(meta) if meta.is_dir() => host.remove_dir_all(path).map(|()| None),
                Some(_) => host.remove_file(path).map(|()| None),
                None => Ok(None),
            },
            Undo::Restore { path, backup } => match staging.symlink_metadata(backup) {
                // A link beside the entry still there: the rename does nothing.
                Ok(_) => host
                    .rename(Path::new(staging_name).join(backup), host, path)
                    .map(|()| Some(path.as_path())),
                Err(_) => Ok(None),
            },
            Undo::Permissions { path, mode } => {
                match host.set_permissions(path, Permissions::from_mode(*mode)) {
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                    done => done.map(|()| Some(path.as_path())),
                }
            }
            Undo::Exchange { path, slot, staged } => match is(path, *staged) {
                Some(_) => exchange(host, staging, slot, path).map(|()| Some(path.as_path())),
                None => Ok(None),
            },
        }
    }

    /// The step as a record of the log: a tag, then each field as its length and its bytes,
    /// so that any name (one with a newline too) reads back as it was.
    fn encode(&self) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt as _;
        fn field(out: &mut Vec<u8>, bytes: &[u8]) {
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        let mut out = Vec::with_capacity(64);
        match self {
            Undo::Remove { path, made } => {
                out.push(b'R');
                field(&mut out, path.as_os_str().as_bytes());
                field(&mut out, &made.0.to_le_bytes());
                field(&mut out, &made.1.to_le_bytes());
            }
            Undo::Restore { path, backup } => {
                out.push(b'B');
                field(&mut out, path.as_os_str().as_bytes());
                field(&mut out, backup.as_bytes());
            }
            Undo::Permissions { path, mode } => {
                out.push(b'P');
                field(&mut out, path.as_os_str().as_bytes());
                field(&mut out, &mode.to_le_bytes());
            }
            Undo::Exchange { path, slot, staged } => {
                out.push(b'X');
                field(&mut out, path.as_os_str().as_bytes());
                field(&mut out, slot.as_bytes());
                field(&mut out, &staged.0.to_le_bytes());
                field(&mut out, &staged.1.to_le_bytes());
            }
        }
        out
    }

    /// The steps a log holds, in order; a record cut short (its step was not taken) or not
    /// understood ends it.
    fn decode_all(mut log: &[u8], key: &[u8; 32]) -> Vec<Undo> {
        use std::os::unix::ffi::OsStrExt as _;
        fn field<'b>(log: &mut &'b [u8]) -> Option<&'b [u8]> {
            let len = u32::from_le_bytes(log.get(..4)?.try_into().ok()?) as usize;
            let value = log.get(4..4usize.checked_add(len)?)?;
            *log = &log[4 + len..];
            Some(value)
        }
        fn path(log: &mut &[u8]) -> Option<PathBuf> {
            Some(PathBuf::from(std::ffi::OsStr::from_bytes(field(log)?)))
        }
        fn text(log: &mut &[u8]) -> Option<String> {
            String::from_utf8(field(log)?.to_vec()).ok()
        }
        fn id(log: &mut &[u8]) -> Option<(u64, u64)> {
            let dev = u64::from_le_bytes(field(log)?.try_into().ok()?);
            let ino = u64::from_le_bytes(field(log)?.try_into().ok()?);
            Some((dev, ino))
        }
        fn step(tag: u8, log: &mut &[u8]) -> Option<Undo> {
            Some(match tag {
                b'R' => Undo::Remove {
                    path: path(log)?,
                    made: id(log)?,
                },
                b'B' => Undo::Restore {
                    path: path(log)?,
                    backup: text(log)?,
                },
                b'P' => Undo::Permissions {
                    path: path(log)?,
                    mode: u32::from_le_bytes(field(log)?.try_into().ok()?),
                },
                b'X' => Undo::Exchange {
                    path: path(log)?,
                    slot: text(log)?,
                    staged: id(log)?,
                },
                _ => return None,
            })
        }
        let mut steps = Vec::new();
        let mut before = [0u8; 32];
        while let Some((&tag, rest)) = log.split_first() {
            let record = log;
            log = rest;
            let Some(step) = step(tag, &mut log) else {
                break;
            };
            // The record's own bytes, then its mark: one the key did not make ends the log.
            let bytes = &record[..record.len() - log.len()];
            let expected = mark(key, &before, bytes);
            if log.get(..32) != Some(&expected[..]) {
                break;
            }
            log = &log[32..];
            before = expected;
            steps.push(step);
        }
        steps
    }
}

/// Atomically exchanges the staging entry `slot` with the host entry at `path`, naming each by
/// its own directory so that no path is resolved through a symlink.
fn exchange(host: &Dir, staging: &Dir, slot: &str, path: &Path) -> io::Result<()> {
    let (parent, name) = parent_of(host, path)?;
    rustix::fs::renameat_with(
        staging,
        slot,
        &parent,
        name,
        rustix::fs::RenameFlags::EXCHANGE,
    )
    .map_err(io::Error::from)
}

/// The directory that holds `path` in `host`, opened, and its name there.
fn parent_of<'p>(host: &Dir, path: &'p Path) -> io::Result<(Dir, &'p std::ffi::OsStr)> {
    let parent = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => host.open_dir(parent)?,
        None => host.try_clone()?,
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("a change without a file name"))?;
    Ok((parent, name))
}

struct Transaction<'a> {
    host: &'a Dir,
    staging: &'a Dir,
    staging_name: &'a str,
    /// The log in staging: each step's undo is written to it before the step is taken, for a
    /// recovery to undo when this process is killed before its commit.
    log: fs::File,
    /// The key each record is marked with, and the last record's mark (each record's is
    /// chained from the one before, so none can be dropped or moved).
    key: [u8; 32],
    mac: [u8; 32],
    undo: Vec<Undo>,
    next: usize,
    /// The layer's files (device, inode) staged so far that have other names, each with the
    /// staging name that keeps its staged copy (its other names are links to that copy) and
    /// the hash of what was copied.
    linked: HashMap<(u64, u64), (String, String)>,
    /// Bytes of file data written so far, and the most that may be.
    written: u64,
    bound: u64,
}

impl Transaction<'_> {
    fn slot(&mut self) -> String {
        self.next += 1;
        format!("{}", self.next)
    }

    fn staged(&self, slot: &str) -> PathBuf {
        Path::new(self.staging_name).join(slot)
    }

    /// Records `step` before its step is taken: one write, which the page cache keeps when the
    /// process is killed.
    fn record(&mut self, step: Undo) -> io::Result<()> {
        let mut bytes = step.encode();
        self.mac = mark(&self.key, &self.mac, &bytes);
        bytes.extend_from_slice(&self.mac);
        io::Write::write_all(&mut self.log, &bytes)?;
        self.undo.push(step);
        Ok(())
    }

    /// The (device, inode) of the staging entry `slot`.
    fn id_of(&self, slot: &str) -> io::Result<(u64, u64)> {
        let meta = self.staging.symlink_metadata(slot)?;
        Ok((meta.dev(), meta.ino()))
    }

    /// Keeps the current host entry at `path` reachable from staging, without removing it.
    fn back_up(&mut self, path: &Path) -> io::Result<()> {
        let Ok(meta) = self.host.symlink_metadata(path) else {
            return Ok(());
        };
        let backup = self.slot();
        self.record(Undo::Restore {
            path: path.to_path_buf(),
            backup: backup.clone(),
        })?;
        if meta.is_dir() {
            // A directory leaves in one rename: present, then absent.
            self.host.rename(path, self.host, self.staged(&backup))?;
        } else if self.host.hard_link(path, self.staging, &backup).is_err() {
            self.host.rename(path, self.host, self.staged(&backup))?;
        }
        Ok(())
    }

    /// Makes the directory `path`, which is not there: in staging first (with `mode` and
    /// `owner` where given), recorded by its inode, then renamed into place, replacing
    /// nothing, so that its undo removes this directory and no other.
    fn make_dir(
        &mut self,
        path: &Path,
        mode: Option<u32>,
        owner: Option<(u32, u32)>,
    ) -> io::Result<()> {
        let slot = self.slot();
        self.staging.create_dir(&slot)?;
        if let Some(mode) = mode {
            self.staging
                .set_permissions(&slot, Permissions::from_mode(mode))?;
            chown(self.staging, Path::new(&slot), owner)?;
        }
        let made = self.id_of(&slot)?;
        self.record(Undo::Remove {
            path: path.to_path_buf(),
            made,
        })?;
        let (parent, name) = parent_of(self.host, path)?;
        rustix::fs::renameat_with(
            self.staging,
            slot.as_str(),
            &parent,
            name,
            rustix::fs::RenameFlags::NOREPLACE,
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
                Err(_) => self.make_dir(&partial, None, None)?,
            }
        }
        Ok(())
    }

    fn apply_one(
        &mut self,
        layers: &[LayerRoot],
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
                        self.record(Undo::Permissions {
                            path: path.clone(),
                            mode: meta.mode() & 0o7777,
                        })?;
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
                        self.make_dir(&path, Some(mode), owner)
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
                    let (input, meta) = open_source(layers, &path)?.ok_or_else(|| {
                        io::Error::other(
                            "the file is gone from the cell's layers; run the diff again",
                        )
                    })?;
                    if Some(meta.len()) != change.size {
                        return Err(changed_in_cell());
                    }
                    let inode = (meta.dev(), meta.ino());
                    // What is staged is what was reviewed: the hash of the bytes copied (not
                    // of the file as it is now, which a cell read live can change while it is
                    // copied) must be the diff's.
                    let reviewed = change.hash.as_deref().ok_or_else(|| {
                        io::Error::other("the diff did not hash the file; run the diff again")
                    })?;
                    let staged_hash = if let Some((copy, hash)) = self.linked.get(&inode) {
                        // Another name of a file staged already: a link to that copy, as in
                        // the layer, where a copy of its own would write all its bytes again.
                        self.staging.hard_link(copy, self.staging, &slot)?;
                        hash.clone()
                    } else {
                        let hash = self.stage_file(&input, meta.len(), &slot, mode)?;
                        chown(self.staging, Path::new(&slot), owner)?;
                        if meta.nlink() > 1 {
                            // Kept under a name of its own: `slot` leaves staging below.
                            let copy = self.slot();
                            self.staging.hard_link(&slot, self.staging, &copy)?;
                            self.linked.insert(inode, (copy, hash.clone()));
                        }
                        hash
                    };
                    if staged_hash != reviewed {
                        return Err(changed_in_cell());
                    }
                }
                self.ensure_parent(&path)?;
                let staged = self.id_of(&slot)?;
                match self.host.symlink_metadata(&path) {
                    Ok(meta) if !meta.is_dir() => {
                        // Swap the staged file and the host's in one atomic step: a reader sees
                        // the old or the new file, and the old inode moves to staging untouched
                        // (so an interrupted apply leaves no false conflict behind).
                        self.record(Undo::Exchange {
                            path: path.clone(),
                            slot: slot.clone(),
                            staged,
                        })?;
                        return exchange(self.host, self.staging, &slot, &path);
                    }
                    Ok(_) => self.back_up(&path)?, // a directory replaced by a file leaves first
                    Err(_) => {}
                }
                self.record(Undo::Remove {
                    path: path.clone(),
                    made: staged,
                })?;
                self.host.rename(self.staged(&slot), self.host, &path)
            }
            (_, EntryKind::Special) => Err(io::Error::other("special files are never applied")),
        }
    }

    /// Copies the `len` bytes of `input` to the staging file `slot`: its data only, so that
    /// its holes stay holes, each byte counted against the apply's bound. Returns the BLAKE3
    /// hash of what it wrote (holes as the zeros they read as), as the diff hashes a file.
    fn stage_file(
        &mut self,
        input: &fs::File,
        len: u64,
        slot: &str,
        mode: u32,
    ) -> io::Result<String> {
        let output = self.staging.create(slot)?.into_std();
        let mut buf = vec![0u8; 256 * 1024];
        let mut hasher = blake3::Hasher::new();
        let mut hashed = 0u64;
        for extent in data_extents(input, len) {
            let (start, end) = extent?;
            hash_zeros(&mut hasher, start - hashed.min(start));
            hashed = hashed.max(start);
            let mut at = start;
            while at < end {
                let want = usize::try_from(end - at).map_or(buf.len(), |n| n.min(buf.len()));
                let n = input.read_at(&mut buf[..want], at)?;
                if n == 0 {
                    return Err(changed_in_cell());
                }
                self.written += n as u64;
                if self.written > self.bound {
                    return Err(io::Error::other(format!(
                        "the apply wrote more than its bound of {} bytes (the cell's files grew \
                         since they were counted)",
                        self.bound
                    )));
                }
                output.write_all_at(&buf[..n], at)?;
                hasher.update(&buf[..n]);
                at += n as u64;
                hashed = at;
            }
        }
        // The length, which a hole at the end gives the file without a block.
        hash_zeros(&mut hasher, len.saturating_sub(hashed));
        output.set_len(len)?;
        output.sync_all()?;
        self.staging
            .set_permissions(slot, Permissions::from_mode(mode))?;
        Ok(hasher.finalize().to_hex().to_string())
    }
}

/// Feeds `hasher` `n` zero bytes: a hole, as a read of it sees it.
fn hash_zeros(hasher: &mut blake3::Hasher, mut n: u64) {
    static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
    while n > 0 {
        let take = usize::try_from(n).map_or(ZEROS.len(), |n| n.min(ZEROS.len()));
        hasher.update(&ZEROS[..take]);
        n -= take as u64;
    }
}

/// Gives the entry at `path` in `dir` the owner `owner`, never following a symlink: its parent
/// is opened beneath `dir` without following any symlink on the way (`openat2`), and the entry
/// is changed by name in that parent, so that a directory swapped for a symlink meanwhile
/// cannot lead the change anywhere else.
fn chown(dir: &Dir, path: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let Some((uid, gid)) = owner else {
        return Ok(());
    };
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    let parent = rustix::fs::openat2(
        dir,
        parent.unwrap_or(Path::new(".")),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("a change without a file name"))?;
    rustix::fs::chownat(
        &parent,
        name,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(io::Error::from)
}

/// A layer's top directory, opened once for an apply (or why it could not be).
type LayerRoot = rustix::io::Result<std::os::fd::OwnedFd>;

/// The top directories of `layers`, topmost first.
fn layer_roots(layers: &[PathBuf]) -> Vec<LayerRoot> {
    use rustix::fs::{Mode, OFlags};
    layers
        .iter()
        .map(|layer| {
            rustix::fs::open(
                layer,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
        })
        .collect()
}

/// The file at `rel` in the topmost of the layers (`roots`) that has it, opened beneath that
/// layer with no symlink followed on the way (`openat2`) and without waiting (a FIFO put there
/// since the diff is not opened for a writer), with what it is; anything but a regular file is
/// refused. By its path alone, a cell that runs unfrozen (rootless, without a cgroup of its
/// own) could swap a directory on the way for a symlink to a host directory between the diff
/// and the copy, and have the apply copy a host file the caller may read into the workspace,
/// where the cell sees it. `None`: no layer has it.
fn open_source(roots: &[LayerRoot], rel: &Path) -> io::Result<Option<(fs::File, fs::Metadata)>> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let changed = changed_in_cell;
    for root in roots {
        let opened = root.as_ref().map_err(|e| *e).and_then(|root| {
            rustix::fs::openat2(
                root,
                rel,
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
        });
        let input = match opened {
            Ok(fd) => fs::File::from(fd),
            Err(rustix::io::Errno::NOENT) => continue,
            // A symlink where the diff saw a directory or a file.
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::XDEV | rustix::io::Errno::NOTDIR) => {
                return Err(changed());
            }
            Err(e) => return Err(e.into()),
        };
        let meta = input.metadata()?;
        if !meta.is_file() {
            return Err(changed());
        }
        return Ok(Some((input, meta)));
    }
    Ok(None)
}

/// The bytes of file data applying `selected` writes: each file's data without its holes, and
/// once for all the names of one file. A file that cannot be read now counts nothing here (its
/// copy fails, and the apply is rolled back).
fn data_to_write(layers: &[LayerRoot], selected: &[&Change]) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    for change in selected {
        if change.kind == ChangeKind::Deleted || change.entry != EntryKind::File {
            continue;
        }
        let Ok(Some((input, meta))) = open_source(layers, Path::new(&change.path)) else {
            continue;
        };
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        for extent in data_extents(&input, meta.len()) {
            match extent {
                Ok((start, end)) => total = total.saturating_add(end - start),
                // Where the holes cannot be told, every byte counts.
                Err(_) => {
                    total = total.saturating_add(meta.len());
                    break;
                }
            }
        }
    }
    total
}

/// The data of `file`'s first `len` bytes, as `(start, end)` ranges in order: what is between
/// them (and after the last) is holes, which read as zeros and take no blocks. A file system
/// that keeps no holes says the whole file is data.
pub fn data_extents(
    file: &fs::File,
    len: u64,
) -> impl Iterator<Item = io::Result<(u64, u64)>> + '_ {
    use rustix::fs::{SeekFrom, seek};
    let mut at = 0u64;
    std::iter::from_fn(move || {
        if at >= len {
            return None;
        }
        let start = match seek(file, SeekFrom::Data(at)) {
            Ok(start) if start < len => start,
            // No data after `at` (within `len`): the rest is a hole.
            Ok(_) | Err(rustix::io::Errno::NXIO) => return None,
            Err(e) => {
                at = len;
                return Some(Err(e.into()));
            }
        };
        let end = match seek(file, SeekFrom::Hole(start)) {
            Ok(end) => end.clamp(start + 1, len),
            Err(e) => {
                at = len;
                return Some(Err(e.into()));
            }
        };
        at = end;
        Some(Ok((start, end)))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The owner is given by name in a parent opened beneath the directory without following
    /// symlinks: a directory on the way that is (or became) a symlink fails the step, and what
    /// it leads to keeps its owner.
    #[test]
    fn chown_follows_no_symlink_on_the_way() {
        if fs::metadata("/proc/self").is_ok_and(|m| m.uid() != 0) {
            eprintln!("skipping: giving files another owner needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path().join("host");
        let outside = tmp.path().join("outside");
        fs::create_dir_all(host.join("real")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        fs::write(host.join("real/file"), "in").unwrap();
        fs::write(outside.join("file"), "out").unwrap();
        std::os::unix::fs::symlink(&outside, host.join("swapped")).unwrap();
        let dir = Dir::open_ambient_dir(&host, ambient_authority()).unwrap();
        let owner = Some((4242, 4343));
        chown(&dir, Path::new("real/file"), owner).unwrap();
        let meta = fs::metadata(host.join("real/file")).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (4242, 4343));
        assert!(chown(&dir, Path::new("swapped/file"), owner).is_err());
        assert_eq!(fs::metadata(outside.join("file")).unwrap().uid(), 0);
    }

    /// A source is opened beneath its layer: a directory of the layer that is (or became) a
    /// symlink to a host directory fails the open, where a path's open followed it to the host
    /// file; a file of a lower layer is found where the upper lacks it.
    #[test]
    fn a_source_is_never_read_through_a_symlink_on_the_way() {
        let tmp = tempfile::tempdir().unwrap();
        let (upper, lower, outside) = (
            tmp.path().join("upper"),
            tmp.path().join("lower"),
            tmp.path().join("outside"),
        );
        fs::create_dir_all(upper.join("real")).unwrap();
        fs::create_dir_all(lower.join("deep")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        fs::write(upper.join("real/file"), "in the cell").unwrap();
        fs::write(lower.join("deep/file"), "below").unwrap();
        fs::write(outside.join("secret"), "the host's").unwrap();
        std::os::unix::fs::symlink(&outside, upper.join("swapped")).unwrap();
        let layers = layer_roots(&[upper.clone(), lower]);
        let read = |rel: &str| {
            open_source(&layers, Path::new(rel)).map(|found| {
                found.map(|(mut file, _)| {
                    let mut text = String::new();
                    std::io::Read::read_to_string(&mut file, &mut text).unwrap();
                    text
                })
            })
        };
        assert_eq!(read("real/file").unwrap().as_deref(), Some("in the cell"));
        assert_eq!(read("deep/file").unwrap().as_deref(), Some("below"));
        assert_eq!(read("missing").unwrap(), None);
        let through = read("swapped/secret");
        assert!(through.is_err(), "read through a symlink: {through:?}");
        // The last component too.
        std::os::unix::fs::symlink(outside.join("secret"), upper.join("link")).unwrap();
        assert!(read("link").is_err());
    }

    /// A log reads back as written, names of any bytes too; a record cut short (the process
    /// was killed while writing it, before its step) ends it.
    #[test]
    fn the_log_reads_back_and_a_record_cut_short_ends_it() {
        use std::os::unix::ffi::OsStrExt as _;
        let odd = PathBuf::from(std::ffi::OsStr::from_bytes(b"a\nb/\xff\x00c"));
        let steps = vec![
            Undo::Remove {
                path: odd.clone(),
                made: (7, u64::MAX),
            },
            Undo::Restore {
                path: "x/y".into(),
                backup: "12".into(),
            },
            Undo::Permissions {
                path: odd,
                mode: 0o4755,
            },
            Undo::Exchange {
                path: "z".into(),
                slot: "3".into(),
                staged: (1, 2),
            },
        ];
        let log = marked(&steps, &KEY);
        assert_eq!(Undo::decode_all(&log, &KEY), steps);
        for cut in 0..log.len() {
            let read = Undo::decode_all(&log[..cut], &KEY);
            assert!(read.len() < steps.len());
            assert_eq!(read[..], steps[..read.len()]);
        }
        // Another key's log, one without marks, and one with a record left out are nothing
        // (or nothing past the gap): a log a cell wrote undoes nothing.
        assert!(Undo::decode_all(&marked(&steps, &[7; 32]), &KEY).is_empty());
        let unmarked: Vec<u8> = steps.iter().flat_map(Undo::encode).collect();
        assert!(Undo::decode_all(&unmarked, &KEY).is_empty());
        let first = marked(&steps[..1], &KEY).len();
        let mut gap = log[..first].to_vec();
        gap.extend_from_slice(&marked(&steps, &KEY)[marked(&steps[..2], &KEY).len()..]);
        assert_eq!(Undo::decode_all(&gap, &KEY), steps[..1]);
    }

    /// A staging folder a cell put in the host directory (applied, or written in direct mode),
    /// with a log of its own making that asks for a host file's mode to be set-id: the warden
    /// undoes nothing of it (it made a host file setuid root), and the folder goes.
    #[test]
    fn a_log_the_warden_did_not_write_undoes_nothing() {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path();
        fs::write(host.join("f"), "a host file").unwrap();
        fs::set_permissions(host.join("f"), fs::Permissions::from_mode(0o644)).unwrap();
        let step = [Undo::Permissions {
            path: "f".into(),
            mode: 0o4755,
        }];
        for (n, log) in [
            step.iter().flat_map(Undo::encode).collect::<Vec<u8>>(),
            marked(&step, &[7; 32]),
        ]
        .into_iter()
        .enumerate()
        {
            let staging = host.join(format!("{STAGING_PREFIX}999999-1-{n}"));
            fs::create_dir(&staging).unwrap();
            fs::write(staging.join(LOG), log).unwrap();
            recover(host, Some(&KEY)).unwrap();
            let mode = fs::metadata(host.join("f")).unwrap().mode() & 0o7777;
            assert_eq!(mode, 0o644, "a forged log set the mode");
            assert!(!staging.exists());
        }
        // Nor is a record of restored entries the warden did not mark read.
        fs::write(
            host.join(RESTORED),
            r#"{"entries":[{"path":[102],"dev":1,"ino":2,"ctime":[3,4]}],"mac":"00"}"#,
        )
        .unwrap();
        let dir = Dir::open_ambient_dir(host, ambient_authority()).unwrap();
        assert!(Restored::load(&dir, &KEY).entries.is_empty());
    }

    const KEY: [u8; 32] = [42; 32];

    /// `steps` as an apply marked with `key` writes them.
    fn marked(steps: &[Undo], key: &[u8; 32]) -> Vec<u8> {
        let mut mac = [0u8; 32];
        let mut out = Vec::new();
        for step in steps {
            let bytes = step.encode();
            mac = mark(key, &mac, &bytes);
            out.extend_from_slice(&bytes);
            out.extend_from_slice(&mac);
        }
        out
    }

    /// The log of a dead apply whose steps were taken, not taken, or taken and undone already:
    /// the recovery undoes exactly the ones taken, touches nothing the apply did not put
    /// there, and removes the staging folder.
    #[test]
    fn a_dead_applys_log_undoes_what_was_done_and_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let host = tmp.path();
        let staging_name = format!("{STAGING_PREFIX}0-0-1");
        let staging = host.join(&staging_name);
        fs::create_dir(&staging).unwrap();
        let id = |path: &Path| {
            let meta = fs::symlink_metadata(path).unwrap();
            (meta.dev(), meta.ino())
        };
        // Deleted: the host file was linked to staging, then removed.
        fs::write(staging.join("1"), "deleted").unwrap();
        // Exchanged: the host has the new file, staging the old.
        fs::write(host.join("swapped"), "new").unwrap();
        fs::write(staging.join("2"), "old").unwrap();
        // An exchange not taken: the host still has the old file, staging the new.
        fs::write(host.join("unswapped"), "old").unwrap();
        fs::write(staging.join("3"), "new").unwrap();
        // A new file put in place, and one whose rename was not taken, where something else
        // came meanwhile.
        fs::write(host.join("added"), "new").unwrap();
        fs::write(host.join("other"), "not the apply's").unwrap();
        fs::write(staging.join("4"), "new").unwrap();
        // A directory made, with a new file in it.
        fs::create_dir(host.join("made")).unwrap();
        fs::write(host.join("made/inside"), "new").unwrap();
        let steps = [
            Undo::Restore {
                path: "deleted".into(),
                backup: "1".into(),
            },
            Undo::Exchange {
                path: "swapped".into(),
                slot: "2".into(),
                staged: id(&host.join("swapped")),
            },
            Undo::Exchange {
                path: "unswapped".into(),
                slot: "3".into(),
                staged: id(&staging.join("3")),
            },
            Undo::Remove {
                path: "added".into(),
                made: id(&host.join("added")),
            },
            Undo::Remove {
                path: "other".into(),
                made: id(&staging.join("4")),
            },
            Undo::Remove {
                path: "made".into(),
                made: id(&host.join("made")),
            },
            Undo::Remove {
                path: "made/inside".into(),
                made: id(&host.join("made/inside")),
            },
            // Never taken: its backup was not made.
            Undo::Restore {
                path: "other".into(),
                backup: "9".into(),
            },
        ];
        fs::write(staging.join(LOG), marked(&steps, &KEY)).unwrap();
        recover(host, Some(&KEY)).unwrap();
        let read = |name: &str| fs::read_to_string(host.join(name)).ok();
        assert_eq!(read("deleted").as_deref(), Some("deleted"));
        assert_eq!(read("swapped").as_deref(), Some("old"));
        assert_eq!(read("unswapped").as_deref(), Some("old"));
        assert_eq!(read("other").as_deref(), Some("not the apply's"));
        assert_eq!(read("added"), None);
        assert!(!host.join("made").exists());
        assert!(!staging.exists());
        // Again, on what is now the state before: nothing to do.
        recover(host, Some(&KEY)).unwrap();
        assert_eq!(read("swapped").as_deref(), Some("old"));
    }
}

/// What a step of an apply fails with where the cell's file is not what the diff read (its
/// size, its bytes, its kind): the apply is rolled back whole, and told as
/// [`WorkspaceError::ChangedInCell`], the cell's doing, not the warden's failure.
#[derive(Debug)]
struct ChangedInCell;

impl std::fmt::Display for ChangedInCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the file changed in the cell since the diff")
    }
}

impl std::error::Error for ChangedInCell {}

fn changed_in_cell() -> io::Error {
    io::Error::other(ChangedInCell)
}
