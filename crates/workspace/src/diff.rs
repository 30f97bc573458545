//! Computing a workspace's changes from its overlay layers, without running anything in the
//! cell: whiteouts are deletions, opaque directories hide everything below them, and every other
//! entry is compared with the host directory. The layers are the cell's upper layer and the
//! snapshots it was forked from, topmost first; the host directory is the bottom.
//!
//! A diff runs on the host, and what it reads was chosen by the cell, where a file of 1 GiB
//! costs nothing (it can be all holes) and a thousand more names for it cost nothing more. So
//! only files a patch can be made of are read whole; larger ones are hashed in a stream through
//! a fixed buffer, once per file whatever its names; and the bytes one diff reads from the
//! layers are bounded: a file past the bound is listed, refused, without being read.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use cap_std::ambient_authority;
use cap_std::fs::{Dir, MetadataExt as _};
use rustix::fs::OFlags;

use crate::WorkspaceError;
use crate::change::{Change, ChangeKind, Diff, EntryKind};
use crate::sensitive::{self, Sensitivity};

/// How much work a diff does.
#[derive(Debug, Clone)]
pub struct DiffOptions {
    pub sensitivity: Sensitivity,
    /// Produce unified diffs for text files up to this size (0: none).
    pub max_patch_bytes: u64,
    /// Files larger than this are refused (and never read in full).
    pub max_file_bytes: u64,
    /// Whether a changed file's content is read and hashed where its lookup alone shows it
    /// changed (the host has no file there, or one of another size): false for a caller that
    /// compares such files itself where it needs to (they then come without `hash` or patch).
    /// A file of the host's size is read either way, to tell a copy from a change (unless
    /// `tell_copies` is false).
    pub hash_changed: bool,
    /// With `hash_changed` false: whether a file of the host's size is read, with the host's,
    /// to tell a copy (listed as nothing) from a change; false lists it as modified, without
    /// `hash` or patch, for a caller that compares it itself where its decision needs the
    /// bytes (a reset, which often has another version to write there whatever this one holds).
    pub tell_copies: bool,
    /// The most bytes of the layers' files one diff reads (each file once, whatever its
    /// names): a file past it is listed with its size and refused, not read. Split evenly
    /// between the diff's two threads, each reading in name order, so that which file is
    /// refused does not depend on their pace.
    pub max_read_bytes: u64,
    /// The most bytes of patches one diff keeps (each text file's `patch`, held in memory and
    /// written out whole in every document of the diff): from the first file whose patch does
    /// not fit in what is left, text files are listed with their hash and no patch, as one too
    /// large for a patch is. Split evenly between the diff's two threads, as `max_read_bytes`
    /// is, each walking in name order.
    pub max_patches_bytes: u64,
    /// Whether a part of the tree the diff cannot read (a directory deeper than [`MAX_DEPTH`],
    /// a path the host cannot reach) fails it ([`WorkspaceError::Unread`], naming the path)
    /// instead of being listed, refused: true for a caller that must see the whole tree or act
    /// on none of it (a reset, which would leave that part as the cell made it).
    pub unread_fails: bool,
    /// The warden's key of applies' undo logs (`ApplyOptions::key`): with it, a diff first
    /// undoes what a killed apply of the directory left half done; without it, nothing is.
    pub apply_key: Option<[u8; 32]>,
}

/// The deepest a diff reads a cell's tree: a directory more than this many levels below the
/// workspace's root is listed, refused, and not read (nor, then, applied). A cell can make a
/// tree thousands of levels deep for nothing, where a real project's deepest (a `node_modules`
/// tree) goes 30 to 60 levels down; each level the walk holds open costs a descriptor per
/// layer.
pub const MAX_DEPTH: usize = 256;

/// The most bytes of the layers' files a diff reads unless told otherwise: what an apply writes
/// at most by default ([`crate::DEFAULT_MAX_WRITE_BYTES`]).
pub const DEFAULT_MAX_READ_BYTES: u64 = crate::DEFAULT_MAX_WRITE_BYTES;

/// The most bytes of patches a diff keeps unless told otherwise. A cell makes patches for
/// almost nothing: one text file of 200 KB and 2,000 more names for it (hard links) made a diff
/// of 2,000 patches, 458 MB as JSON, and took a daemon 1 GB of memory.
pub const DEFAULT_MAX_PATCHES_BYTES: u64 = 64 << 20;

/// The buffer a file too large for a patch is hashed through.
const HASH_BUFFER: usize = 256 * 1024;

impl Default for DiffOptions {
    fn default() -> Self {
        Self {
            sensitivity: Sensitivity::default(),
            max_patch_bytes: 256 * 1024,
            max_file_bytes: 1 << 30,
            hash_changed: true,
            tell_copies: true,
            max_read_bytes: DEFAULT_MAX_READ_BYTES,
            max_patches_bytes: DEFAULT_MAX_PATCHES_BYTES,
            unread_fails: false,
            apply_key: None,
        }
    }
}

const OPAQUE_XATTRS: [&str; 2] = ["trusted.overlay.opaque", "user.overlay.opaque"];

/// Compares the merged `layers` (topmost first) with the lower (host) directory.
pub fn diff(
    lower: &Path,
    layers: &[PathBuf],
    options: &DiffOptions,
) -> Result<Diff, WorkspaceError> {
    // An apply killed before its commit is undone first: what it left half done is neither
    // shown as the host's nor applied over.
    crate::apply::recover(lower, options.apply_key.as_ref())?;
    let lower_dir = Dir::open_ambient_dir(lower, ambient_authority()).map_err(|source| {
        WorkspaceError::Read {
            path: lower.to_path_buf(),
            source,
        }
    })?;
    let mut walker = Walker {
        lower: &lower_dir,
        layers,
        options,
        changes: Vec::new(),
        split: true,
        hashed: HashMap::new(),
        budget: options.max_read_bytes,
        patches: options.max_patches_bytes,
    };
    match walker.list(Path::new(""), true, Above::ROOT)? {
        Ok(root) => walker.walk_listed(&root)?,
        Err(why) => {
            return Err(WorkspaceError::Read {
                path: layers.first().cloned().unwrap_or_default(),
                source: io::Error::other(why),
            });
        }
    }
    let mut changes = walker.changes;
    changes.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Diff::new(changes))
}

struct Walker<'a> {
    lower: &'a Dir,
    layers: &'a [PathBuf],
    options: &'a DiffOptions,
    changes: Vec<Change>,
    /// Whether the first directory of more than one entry is still to be split between two
    /// threads: a diff's cost is its many small files, each a few system calls.
    split: bool,
    /// The hashes of the layers' files too large for a patch, by (device, inode): another name
    /// of one is not read again.
    hashed: HashMap<(u64, u64), String>,
    /// What is left of the bytes this walker may read from the layers. A split gives each
    /// thread half, and each its own `hashed`: which file a thread refuses then depends on its
    /// own walk, in name order, never on the other's pace, so the same layers always give the
    /// same diff (and digest).
    budget: u64,
    /// What is left of the bytes of patches this walker may keep (split as `budget` is).
    patches: u64,
}

fn mode(meta_mode: u32) -> u32 {
    meta_mode & 0o7777
}

impl<'a> Walker<'a> {
    fn read_err(path: &Path) -> impl FnOnce(io::Error) -> WorkspaceError + '_ {
        move |source| WorkspaceError::Read {
            path: path.to_path_buf(),
            source,
        }
    }

    fn lower_meta(&self, rel: &Path) -> Option<LowerEntry> {
        let meta = if rel.as_os_str().is_empty() {
            self.lower.dir_metadata().ok()
        } else {
            self.lower.symlink_metadata(rel).ok()
        }?;
        Some(LowerEntry {
            kind: lower_kind(&meta),
            mode: mode(meta.mode()),
            len: meta.len(),
        })
    }

    /// The host's file `name` in its directory `parent` (`rel` from the host directory, where
    /// that directory could not be opened), of `size` bytes when it was looked up.
    fn lower_read(
        &self,
        parent: Option<&Dir>,
        rel: &Path,
        name: &OsStr,
        size: u64,
    ) -> Option<Vec<u8>> {
        let Some(parent) = parent else {
            return self.lower.read(rel).ok();
        };
        read_sized(&Self::lower_open(parent, name)?, size).ok()
    }

    /// The BLAKE3 hash of the host's file `name` in its directory `parent` (`rel` where that
    /// directory could not be opened), read in a stream.
    fn lower_hash(&self, parent: Option<&Dir>, rel: &Path, name: &OsStr) -> Option<String> {
        let file = match parent {
            Some(parent) => Self::lower_open(parent, name)?,
            None => self.lower.open(rel).ok()?.into_std(),
        };
        hash_stream(&file, u64::MAX).ok()
    }

    /// The host's file `name` in its directory `parent`, opened without following it.
    fn lower_open(parent: &Dir, name: &OsStr) -> Option<fs::File> {
        let file = rustix::fs::openat(
            parent,
            name,
            // Never waits: a FIFO put there since the lookup is not opened for a writer.
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::NOFOLLOW
                | rustix::fs::OFlags::NONBLOCK
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok()?;
        Some(fs::File::from(file))
    }

    /// The host directory's entry `name` in its directory `parent` (opened beneath the host
    /// directory), or at `rel` where that directory could not be opened: one `statx` of a
    /// single name that is not followed, where a lookup of the whole path from the host
    /// directory is three calls (an `openat2` beneath it, a `statx` and a `close`).
    fn lower_entry(&self, parent: Option<&Dir>, rel: &Path, name: &OsStr) -> Option<LowerEntry> {
        let Some(parent) = parent else {
            return self.lower_meta(rel);
        };
        let stat = rustix::fs::statat(parent, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).ok()?;
        let t = rustix::fs::FileType::from_raw_mode(stat.st_mode);
        Some(LowerEntry {
            kind: entry_kind(
                t == rustix::fs::FileType::Directory,
                t == rustix::fs::FileType::Symlink,
                t == rustix::fs::FileType::RegularFile,
            ),
            mode: mode(stat.st_mode),
            len: u64::try_from(stat.st_size).unwrap_or(0),
        })
    }

    /// Reads the directory `rel` of the merged tree: the union of its layers' entries, in name
    /// order, with each layer's copy of it and the host's opened for their lookups. An opaque
    /// copy (or a file in its place) hides the host's entries, which are listed as deleted
    /// here. What hid the host or the lower layers from the directory's parent (`above`) hides
    /// them here too: a directory a cell makes in an opaque one (`rm -r d; mkdir -p d/sub`) is
    /// not opaque itself, and the host's `d/sub/...` are gone all the same. `Ok(Err(why))`
    /// where it could not be read: too deep, or a layer's copy the host cannot reach.
    fn list(
        &mut self,
        rel: &Path,
        lower_is_dir: bool,
        above: Above,
    ) -> Result<Result<Listed<'a>, String>, WorkspaceError> {
        // A cell makes a tree as deep as it likes for nothing; no project needs one this deep
        // (a `node_modules` tree goes 30 to 60 levels down), and each level the walk holds
        // costs it a descriptor per layer.
        if rel.components().count() > MAX_DEPTH {
            return Ok(Err(format!("deeper than {MAX_DEPTH} levels")));
        }
        // The directory's entries are the union over the layers, down to the first layer where
        // it is opaque (or not a directory): that layer hides everything below it.
        let mut names: Vec<std::ffi::OsString> = Vec::new();
        let mut hides_lower = above.hides_lower;
        // Each layer's copy of this directory, opened once: its entries are read, and looked up
        // by name, through it (a layer without it, or below an opaque one, has none).
        let mut dirs: Vec<Option<rustix::fs::Dir>> = Vec::with_capacity(self.layers.len());
        // Names several layers hold are listed once, by the sort and dedup below: a look
        // through the names listed so far for each new one was quadratic in the directory's
        // size (a cell's directory of 100,000 empty files held a diff for 30 s).
        let found = |names: &mut Vec<std::ffi::OsString>, name: &OsStr| {
            if name != "." && name != ".." {
                names.push(name.to_owned());
            }
        };
        for layer in &self.layers[..above.layers.min(self.layers.len())] {
            let dir = layer.join(rel);
            let opened = rustix::fs::open(
                &dir,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            );
            match opened {
                Ok(fd) => {
                    let mut listing =
                        rustix::fs::Dir::new(fd).map_err(|e| Self::read_err(&dir)(e.into()))?;
                    for entry in listing.by_ref().flatten() {
                        found(&mut names, OsStr::from_bytes(entry.file_name().to_bytes()));
                    }
                    dirs.push(Some(listing));
                }
                // Not opened as a directory: looked at as before (a file or a link hides what is
                // below it; a layer without it is passed over).
                Err(_) => match fs::symlink_metadata(&dir) {
                    Ok(meta) if meta.is_dir() => {
                        for entry in fs::read_dir(&dir).map_err(Self::read_err(&dir))?.flatten() {
                            found(&mut names, &entry.file_name());
                        }
                        dirs.push(None);
                    }
                    Ok(_) => {
                        hides_lower = true;
                        break;
                    }
                    Err(e)
                        if e.kind() == io::ErrorKind::NotFound
                            || e.raw_os_error() == Some(libc::ENOTDIR) =>
                    {
                        dirs.push(None);
                        continue;
                    }
                    // Never passed over without a word: what a layer holds there (past
                    // PATH_MAX, say) would be left out of the diff.
                    Err(e) => {
                        return Ok(Err(format!("the host cannot reach it ({e})")));
                    }
                },
            }
            if is_opaque(&dir) {
                hides_lower = true;
                break;
            }
        }
        names.sort_unstable();
        names.dedup();
        if lower_is_dir && hides_lower {
            self.hidden_lower_children(rel, &names)?;
        }
        // The host's side of this directory, opened once for its entries' lookups.
        let lower_dir = match (lower_is_dir, rel.as_os_str().is_empty()) {
            (false, _) => None,
            (true, true) => self.lower.try_clone().ok(),
            (true, false) => self.lower.open_dir(rel).ok(),
        };
        // The layers below the one this directory stopped at are hidden from all below it.
        let layers = if hides_lower {
            dirs.len()
        } else {
            above.layers
        };
        Ok(Ok(Listed {
            below: Above {
                layers,
                hides_lower,
            },
            rel: rel.to_path_buf(),
            lower_is_dir,
            names,
            next: 0,
            dirs: Layers {
                paths: self.layers,
                dirs,
            },
            lower_dir,
        }))
    }

    /// Walks the directory `listed` and everything below it.
    fn walk_listed(&mut self, listed: &Listed<'a>) -> Result<(), WorkspaceError> {
        let names = &listed.names[listed.next..];
        if !self.split || names.len() < 2 {
            return self.walk_entries(listed, names);
        }
        self.split = false;
        let (mine, theirs) = names.split_at(names.len() / 2);
        let half = self.budget / 2;
        self.budget -= half;
        let patches = self.patches / 2;
        self.patches -= patches;
        let other = Walker {
            changes: Vec::new(),
            split: false,
            hashed: HashMap::new(),
            budget: half,
            patches,
            ..*self
        };
        let split = std::thread::scope(|scope| {
            // Where no thread is to be had, every entry is read here, below.
            let handle = std::thread::Builder::new()
                .spawn_scoped(scope, move || {
                    let mut other = other;
                    other.walk_entries(listed, theirs).map(|()| other.changes)
                })
                .ok()?;
            let mine = self.walk_entries(listed, mine);
            let theirs = handle.join().unwrap_or_else(|_| {
                Err(WorkspaceError::Read {
                    path: listed.rel.clone(),
                    source: io::Error::other("a thread of the diff panicked"),
                })
            });
            Some(mine.and(theirs))
        });
        match split {
            Some(theirs) => {
                self.changes.extend(theirs?);
                Ok(())
            }
            None => self.walk_entries(listed, names),
        }
    }

    /// Walks the entries `names` of the directory `within` and everything below them, depth
    /// first in name order, with a stack of its own on the heap: however deep a tree the cell
    /// made, the walk never recurses (a recursive walk of a tree 1,900 levels deep overflowed
    /// a daemon thread's 2 MiB stack, and took the daemon with it). The first directory of more
    /// than one entry below is split between two threads, as the top was.
    fn walk_entries(
        &mut self,
        within: &Listed<'a>,
        names: &[std::ffi::OsString],
    ) -> Result<(), WorkspaceError> {
        let mut names = names.iter();
        let mut below: Vec<Listed<'a>> = Vec::new();
        loop {
            let (rel, descend, above) = match below.last_mut() {
                Some(top) => {
                    let Some(name) = top.names.get(top.next).cloned() else {
                        below.pop();
                        continue;
                    };
                    top.next += 1;
                    let rel = top.rel.join(&name);
                    let lower = top.lower_is_dir.then_some(top.lower_dir.as_ref());
                    let descend = self.entry(&rel, &name, &top.dirs, lower)?;
                    (rel, descend, top.below)
                }
                None => {
                    let Some(name) = names.next() else {
                        return Ok(());
                    };
                    let rel = within.rel.join(name);
                    let lower = within.lower_is_dir.then_some(within.lower_dir.as_ref());
                    let descend = self.entry(&rel, name, &within.dirs, lower)?;
                    (rel, descend, within.below)
                }
            };
            let Some(lower_is_dir) = descend else {
                continue;
            };
            match self.list(&rel, lower_is_dir, above)? {
                Ok(listed) if self.split && listed.names.len() > 1 => self.walk_listed(&listed)?,
                Ok(listed) => below.push(listed),
                Err(why) => self.refuse_dir(&rel, why)?,
            }
        }
    }

    /// Marks the directory `rel`, which could not be read, refused: its own change where
    /// [`Self::entry`] listed one (the last pushed), else a change of its own. Never left out:
    /// a reviewer sees that part of the tree went unread, and an apply skips it.
    /// With [`DiffOptions::unread_fails`], the diff fails there instead.
    fn refuse_dir(&mut self, rel: &Path, why: String) -> Result<(), WorkspaceError> {
        let shown = display(rel);
        if self.options.unread_fails {
            return Err(WorkspaceError::Unread {
                path: shown,
                reason: why,
            });
        }
        let why = format!("{why}: not read; a change below it cannot be applied");
        if let Some(last) = self.changes.last_mut().filter(|c| c.path == shown) {
            last.refused = Some(why);
            return Ok(());
        }
        let mut change = Change::new(shown, ChangeKind::Modified, EntryKind::Dir);
        change.refused = Some(why);
        self.push(change);
        Ok(())
    }

    /// An opaque upper directory hides every lower child it does not itself contain.
    fn hidden_lower_children(
        &mut self,
        rel: &Path,
        present: &[std::ffi::OsString],
    ) -> Result<(), WorkspaceError> {
        let listing = if rel.as_os_str().is_empty() {
            self.lower.entries()
        } else {
            self.lower.read_dir(rel)
        };
        let Ok(listing) = listing else { return Ok(()) };
        for entry in listing.flatten() {
            let name = entry.file_name();
            // `present` is sorted (`list`): a look-up, not a scan, per entry of the host's.
            if present.binary_search(&name).is_ok() {
                continue;
            }
            let child = rel.join(&name);
            if let Some(meta) = self.lower_meta(&child) {
                let mut change = Change::new(display(&child), ChangeKind::Deleted, meta.kind);
                change.old_mode = Some(meta.mode);
                // Shown with its bytes replaced, the name could be another host file's
                // (`a\xff` shows as `a\u{fffd}`), which an apply would then remove.
                if name.to_str().is_none() {
                    change.refused = Some(NOT_UTF8.to_owned());
                }
                self.push(change);
            }
        }
        Ok(())
    }

    fn push(&mut self, mut change: Change) {
        if change.sensitive.is_none() {
            change.sensitive = self.options.sensitivity.of_path(&change.path);
        }
        // A file or directory any user of the host could then write (an apply gives the mode
        // as the cell set it, less set-id and sticky bits): a new entry's mode is not shown
        // otherwise, and a directory the cell made 1777 lands 0777.
        if let Some(why) =
            sensitive::of_mode(change.kind, change.entry, change.old_mode, change.new_mode)
        {
            change.sensitive = Some(match change.sensitive.take() {
                Some(other) => format!("{other}; {why}"),
                None => why,
            });
        }
        if change.sensitive.is_none() && change.kind == ChangeKind::Deleted {
            change.sensitive = self.options.sensitivity.of_removal(&change.path);
        }
        self.changes.push(change);
    }

    /// Lists the change at `rel` (whose last component is `name`), if any; `Some` for a
    /// directory, whose entries are to be walked next (with whether the host has a directory
    /// there). `lower_dir` is `None` where the host has no directory at `rel`'s parent (then
    /// it has nothing at `rel`: a lookup by path would follow a host link in that place, and
    /// take what it leads to for the host's entry), `Some(None)` where it has one that could
    /// not be opened.
    fn entry(
        &mut self,
        rel: &Path,
        name: &OsStr,
        dirs: &Layers<'_>,
        lower_dir: Option<Option<&Dir>>,
    ) -> Result<Option<bool>, WorkspaceError> {
        let (path, meta) = match dirs.locate(rel, name) {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(None),
            // Never dropped without a word: a path the host cannot name (longer than PATH_MAX,
            // say) is listed, and refused.
            Err(err) => {
                let why = format!("the host cannot reach it ({err})");
                if self.options.unread_fails {
                    return Err(WorkspaceError::Unread {
                        path: display(rel),
                        reason: why,
                    });
                }
                let mut change = Change::new(display(rel), ChangeKind::Added, EntryKind::Special);
                change.refused = Some(why);
                self.push(change);
                return Ok(None);
            }
        };
        let (lower, lower_dir) = match lower_dir {
            Some(dir) => (self.lower_entry(dir, rel, name), dir),
            None => (None, None),
        };
        let shown = display(rel);
        let file_type = rustix::fs::FileType::from_raw_mode(meta.st_mode);
        if name.to_str().is_none() {
            let whiteout = file_type == rustix::fs::FileType::CharacterDevice && meta.st_rdev == 0;
            let mut change = match (&lower, whiteout) {
                // A host file the cell removed: a deletion, not a new device.
                (Some(lower), true) => {
                    let mut change = Change::new(shown, ChangeKind::Deleted, lower.kind);
                    change.old_mode = Some(lower.mode);
                    change
                }
                (None, true) => return Ok(None),
                (Some(_), false) => Change::new(shown, ChangeKind::Modified, kind_of(&meta)),
                (None, false) => Change::new(shown, ChangeKind::Added, kind_of(&meta)),
            };
            change.refused = Some(NOT_UTF8.to_owned());
            self.push(change);
            return Ok(None);
        }
        if file_type == rustix::fs::FileType::CharacterDevice && meta.st_rdev == 0 {
            // A whiteout: the path was deleted in the cell.
            if let Some(lower) = lower {
                let mut change = Change::new(shown, ChangeKind::Deleted, lower.kind);
                change.old_mode = Some(lower.mode);
                self.push(change);
            }
            return Ok(None);
        }
        // A file, link or special file where the host has a directory: an apply removes that
        // directory, with everything in it, to put this in its place. What the host holds there
        // is listed as deleted (as below an opaque directory), and the change itself must be
        // named: shown only as this entry, with a patch of a new file, the review never showed
        // the host files that went with it.
        let replaces_dir = file_type != rustix::fs::FileType::Directory
            && lower.as_ref().is_some_and(|l| l.kind == EntryKind::Dir);
        let at = self.changes.len();
        let descend = self.compare(rel, name, &path, &meta, lower, lower_dir, shown)?;
        if replaces_dir {
            if let Some(change) = self.changes.get_mut(at) {
                let why = self
                    .options
                    .sensitivity
                    .of_removal(&change.path)
                    .unwrap_or_else(|| {
                        "replaces a directory of the host, and all it holds (listed as deleted \
                         below it)"
                            .to_owned()
                    });
                change.sensitive = Some(match change.sensitive.take() {
                    Some(other) => format!("{why}; {other}"),
                    None => why,
                });
            }
            self.hidden_lower_children(rel, &[])?;
        }
        Ok(descend)
    }

    /// Lists the change at `rel` (not a whiteout), found at `path` in the layers with `meta`,
    /// against what the host has there (`lower`); as [`Self::entry`].
    #[allow(clippy::too_many_arguments)]
    fn compare(
        &mut self,
        rel: &Path,
        name: &OsStr,
        path: &Path,
        meta: &rustix::fs::Stat,
        lower: Option<LowerEntry>,
        lower_dir: Option<&Dir>,
        shown: String,
    ) -> Result<Option<bool>, WorkspaceError> {
        let file_type = rustix::fs::FileType::from_raw_mode(meta.st_mode);
        let kind = if lower.is_some() {
            ChangeKind::Modified
        } else {
            ChangeKind::Added
        };
        let old_mode = lower.as_ref().map(|l| l.mode);
        let same_type = lower.as_ref().is_some_and(|l| l.kind == kind_of(meta));
        let mut change = Change::new(shown.clone(), kind, kind_of(meta));
        change.old_mode = old_mode;
        change.new_mode = Some(mode(meta.st_mode));
        if file_type == rustix::fs::FileType::Directory {
            let lower_is_dir = lower.as_ref().is_some_and(|l| l.kind == EntryKind::Dir);
            if !same_type || old_mode != change.new_mode {
                self.push(change);
            }
            return Ok(Some(lower_is_dir));
        }
        if file_type == rustix::fs::FileType::Symlink {
            let target = fs::read_link(path).map_err(Self::read_err(path))?;
            let before = if same_type {
                self.lower.read_link(rel).ok()
            } else {
                None
            };
            if before.as_deref() == Some(target.as_path()) {
                return Ok(None);
            }
            change.sensitive =
                sensitive::of_link(&shown, &target).or_else(|| self.leads_out(&shown, &target));
            change.link_target = Some(escaped(target.as_os_str().as_bytes()));
            // Written with its bad bytes replaced, the target would be another name (U+FFFD,
            // or `\xNN` as shown): the host's link would lead elsewhere than the cell's.
            if target.to_str().is_none() {
                change.refused = Some(
                    "the link's target is not valid UTF-8 (its other bytes shown as \\xNN): \
                     it cannot be applied; make the link again in the cell"
                        .to_owned(),
                );
            }
            change.old_mode = old_mode.filter(|_| !same_type);
            change.new_mode = None;
            self.push(change);
            return Ok(None);
        }
        if file_type != rustix::fs::FileType::RegularFile {
            change.refused = Some(format!("{} cannot be applied", special_name(file_type)));
            change.entry = EntryKind::Special;
            self.push(change);
            return Ok(None);
        }
        let len = u64::try_from(meta.st_size).unwrap_or(0);
        change.size = Some(len);
        if len > self.options.max_file_bytes {
            change.refused = Some(format!(
                "{} bytes is more than apply's limit of {} bytes",
                len, self.options.max_file_bytes
            ));
            self.push(change);
            return Ok(None);
        }
        let limit = self.options.max_patch_bytes;
        let old_size = lower.as_ref().filter(|_| same_type).map(|l| l.len);
        // Its lookup alone shows that it changed: the host has no file there, or one of
        // another size.
        let sized_apart = old_size.is_none_or(|old| old != len);
        if self.options.hash_changed || (!sized_apart && self.options.tell_copies) {
            if len > limit {
                // No patch is made of it: hashed in a stream, and compared with a host file of
                // its size by hash.
                let inode = (meta.st_dev, meta.st_ino);
                let hash = match self.hashed.get(&inode) {
                    Some(hash) => hash.clone(),
                    None => {
                        if !self.may_read(len) {
                            self.push_unread(change);
                            return Ok(None);
                        }
                        let hash = hash_upper(path, self.options.max_file_bytes)?;
                        self.hashed.insert(inode, hash.clone());
                        hash
                    }
                };
                if same_type
                    && old_size == Some(len)
                    && old_mode == change.new_mode
                    && self.lower_hash(lower_dir, rel, name).as_ref() == Some(&hash)
                {
                    return Ok(None); // copied up, but nothing changed
                }
                change.hash = Some(hash);
                self.push_file(change, old_mode);
                return Ok(None);
            }
            if !self.may_read(len) {
                self.push_unread(change);
                return Ok(None);
            }
            let new = read_upper(path, len)?;
            // The host's copy is read only where it could be the same or a patch could be made
            // of it: a file of another size changed, and a patch needs both sides under the
            // limit.
            let unread = old_size.is_some_and(|old| old != len && (old > limit || len > limit));
            let old = if same_type && !unread {
                self.lower_read(lower_dir, rel, name, old_size.unwrap_or(0))
            } else {
                None
            };
            if old.as_deref() == Some(new.as_slice()) && old_mode == change.new_mode {
                return Ok(None); // copied up, but nothing changed
            }
            change.hash = Some(blake3::hash(&new).to_hex().to_string());
            if !unread
                && self.patches > 0
                && let Some(patch) = self.patch(&shown, old.as_deref(), &new)
            {
                // The first patch that does not fit ends this walker's patches: none is made
                // after it only to be dropped.
                match self.patches.checked_sub(patch.len() as u64) {
                    Some(left) => {
                        self.patches = left;
                        change.patch = Some(patch);
                    }
                    None => self.patches = 0,
                }
            }
        }
        self.push_file(change, old_mode);
        Ok(None)
    }

    /// Takes `len` bytes of what this walker may still read, if that many are left.
    fn may_read(&mut self, len: u64) -> bool {
        match self.budget.checked_sub(len) {
            Some(left) => {
                self.budget = left;
                true
            }
            None => false,
        }
    }

    /// Lists a file past the diff's bound on what it reads: with its size, not read, refused.
    fn push_unread(&mut self, mut change: Change) {
        change.refused = Some(format!(
            "not read: the diff has read its bound of {} bytes of the cell's files",
            self.options.max_read_bytes
        ));
        self.push(change);
    }

    /// Lists a changed file, sensitive where it becomes executable or was so.
    fn push_file(&mut self, mut change: Change, old_mode: Option<u32>) {
        let gains_exec = change.new_mode.is_some_and(|m| m & 0o111 != 0)
            && old_mode.is_none_or(|m| m & 0o111 == 0);
        let was_exec = old_mode.is_some_and(|m| m & 0o111 != 0);
        if gains_exec {
            change.sensitive = Some("becomes executable".to_owned());
        } else if was_exec && change.new_mode.is_some_and(|m| m & 0o111 != 0) {
            change.sensitive = Some("changes the content of an executable file".to_owned());
        }
        self.push(change);
    }

    /// Why the link at `path` to `target` leads out of the workspace once the links it goes
    /// through are followed in the merged tree (`a -> ..` makes `a/..` the parent of the root,
    /// which no lexical check sees).
    fn leads_out(&self, path: &str, target: &Path) -> Option<String> {
        const MAX_HOPS: usize = 40;
        let mut at: Vec<String> = Path::new(path)
            .parent()
            .map(|p| {
                p.components()
                    .filter_map(|c| c.as_os_str().to_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let mut pending: std::collections::VecDeque<String> = components(target);
        let mut hops = 0;
        while let Some(part) = pending.pop_front() {
            match part.as_str() {
                "." => {}
                ".." => {
                    if at.pop().is_none() {
                        return Some(
                            "symlink that leads outside the workspace through the links on its way"
                                .to_owned(),
                        );
                    }
                }
                name => {
                    at.push(name.to_owned());
                    let rel = at.join("/");
                    if let Some(next) = self.merged_link(Path::new(&rel)) {
                        hops += 1;
                        if hops > MAX_HOPS {
                            return Some(
                                "symlink through a chain of more than 40 links".to_owned(),
                            );
                        }
                        if next.is_absolute() {
                            return Some("symlink through a link to an absolute path".to_owned());
                        }
                        at.pop();
                        let mut spliced = components(&next);
                        spliced.extend(pending);
                        pending = spliced;
                    }
                }
            }
        }
        None
    }

    /// The target of `rel` where it is a symlink in the merged tree (the topmost layer that
    /// has it, else the host directory).
    fn merged_link(&self, rel: &Path) -> Option<PathBuf> {
        match locate(self.layers, rel) {
            Some(path) => {
                let meta = fs::symlink_metadata(&path).ok()?;
                meta.file_type()
                    .is_symlink()
                    .then(|| fs::read_link(&path).ok())
                    .flatten()
            }
            None => self.lower.read_link(rel).ok(),
        }
    }

    fn patch(&self, shown: &str, old: Option<&[u8]>, new: &[u8]) -> Option<String> {
        let limit = self.options.max_patch_bytes as usize;
        if new.len() > limit || old.is_some_and(|o| o.len() > limit) {
            return None;
        }
        let new = text(new)?;
        let old = match old {
            Some(bytes) => text(bytes)?,
            None => "",
        };
        let diff = similar::TextDiff::from_lines(old, new);
        let from = if old.is_empty() {
            "/dev/null".to_owned()
        } else {
            format!("a/{shown}")
        };
        Some(
            diff.unified_diff()
                .context_radius(3)
                .header(&from, &format!("b/{shown}"))
                .to_string(),
        )
    }
}

fn text(bytes: &[u8]) -> Option<&str> {
    if bytes.contains(&0) {
        None
    } else {
        std::str::from_utf8(bytes).ok()
    }
}

/// What the host directory has at a path (never followed).
struct LowerEntry {
    kind: EntryKind,
    mode: u32,
    len: u64,
}

/// A file of `size` bytes when it was looked up, read through `Read` alone: `File`'s own
/// `read_to_end` first asks the kernel for the file's size and position (a `statx` and an
/// `lseek`), which the caller knows already. A read that returns less than it was asked for,
/// having reached `size`, is the file's end: a regular file's read comes back short only there,
/// so the read of nothing that would say so is not made (one read a small file, not two).
struct Plain<'a> {
    file: &'a fs::File,
    size: u64,
    read: u64,
    ended: bool,
}

impl Read for Plain<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.ended {
            return Ok(0);
        }
        let n = (&mut &*self.file).read(buf)?;
        self.read += n as u64;
        self.ended = n < buf.len() && self.read == self.size;
        Ok(n)
    }
}

/// All of `file`, of `size` bytes when it was looked up (read to its end whatever its size now:
/// only the buffer is sized from it, and a short read at that size ends it).
fn read_sized(file: &fs::File, size: u64) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(usize::try_from(size).unwrap_or(0).saturating_add(1));
    Plain {
        file,
        size,
        read: 0,
        ended: false,
    }
    .read_to_end(&mut out)?;
    Ok(out)
}

/// The BLAKE3 hash of the upper layer's file at `path`, read in a stream through a buffer of a
/// fixed size, whatever the file's: a file of more than `max` bytes (it grew since it was
/// looked up) is an error, not read to its end.
fn hash_upper(path: &Path, max: u64) -> Result<String, WorkspaceError> {
    open_upper(path)
        .and_then(|file| hash_stream(&file, max))
        .map_err(|source| WorkspaceError::Read {
            path: path.to_path_buf(),
            source,
        })
}

/// The BLAKE3 hash of `file` from its position to its end, read through a fixed buffer; an
/// error past `max` bytes.
fn hash_stream(file: &fs::File, max: u64) -> io::Result<String> {
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; HASH_BUFFER];
    let mut read = 0u64;
    loop {
        let n = match (&mut &*file).read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        read += n as u64;
        if read > max {
            return Err(io::Error::other(format!(
                "it grew past {max} bytes while it was read"
            )));
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().to_hex().to_string())
}

/// The regular file at `path` in a layer, which was one when it was looked up: never followed,
/// never waited on. A cell read live can put a FIFO in its place between the lookup and the
/// open; opened without `O_NONBLOCK` it held the diff (and the layer's lock) until the cell
/// opened it for writing, and read, it would have given the diff what the cell wrote into it.
fn open_upper(path: &Path) -> io::Result<fs::File> {
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::other(
            "it is no longer a regular file (the cell changed it while it was read)",
        ));
    }
    Ok(file)
}

/// The upper layer's file at `path`, of `size` bytes when it was looked up.
fn read_upper(path: &Path, size: u64) -> Result<Vec<u8>, WorkspaceError> {
    open_upper(path)
        .and_then(|file| read_sized(&file, size))
        .map_err(|source| WorkspaceError::Read {
            path: path.to_path_buf(),
            source,
        })
}

fn is_opaque(dir: &Path) -> bool {
    OPAQUE_XATTRS
        .iter()
        .any(|name| matches!(xattr::get(dir, name), Ok(Some(v)) if v == b"y"))
}

fn kind_of(stat: &rustix::fs::Stat) -> EntryKind {
    let t = rustix::fs::FileType::from_raw_mode(stat.st_mode);
    entry_kind(
        t == rustix::fs::FileType::Directory,
        t == rustix::fs::FileType::Symlink,
        t == rustix::fs::FileType::RegularFile,
    )
}

fn lower_kind(meta: &cap_std::fs::Metadata) -> EntryKind {
    let t = meta.file_type();
    entry_kind(t.is_dir(), t.is_symlink(), t.is_file())
}

fn entry_kind(dir: bool, symlink: bool, file: bool) -> EntryKind {
    match (dir, symlink, file) {
        (true, _, _) => EntryKind::Dir,
        (_, true, _) => EntryKind::Symlink,
        (_, _, true) => EntryKind::File,
        _ => EntryKind::Special,
    }
}

fn special_name(t: rustix::fs::FileType) -> &'static str {
    match t {
        rustix::fs::FileType::Fifo => "a FIFO",
        rustix::fs::FileType::Socket => "a socket",
        _ => "a device node",
    }
}

/// A directory of the merged tree, read: its entries in name order (those before `next` walked
/// already), and its copies in the layers and the host directory, opened for their lookups.
struct Listed<'a> {
    /// What its entries see below them.
    below: Above,
    rel: PathBuf,
    /// Whether the host has a directory here (`lower_dir`, where it could be opened).
    lower_is_dir: bool,
    names: Vec<std::ffi::OsString>,
    next: usize,
    dirs: Layers<'a>,
    lower_dir: Option<Dir>,
}

/// What a directory's entries may see below them: the layers above the first one where an
/// ancestor (or the directory itself) was opaque, or not a directory, and whether the host is
/// hidden so.
#[derive(Debug, Clone, Copy)]
struct Above {
    layers: usize,
    hides_lower: bool,
}

impl Above {
    const ROOT: Self = Self {
        layers: usize::MAX,
        hides_lower: false,
    };
}

/// The layers' copies of the directory being walked, opened, for lookups of its entries by
/// name: one `statx` each, where a lookup from the layer's root walks the whole path again.
struct Layers<'a> {
    paths: &'a [PathBuf],
    /// Beside `paths`, as far as the walk read them.
    dirs: Vec<Option<rustix::fs::Dir>>,
}

impl Layers<'_> {
    /// The topmost layer's copy of `rel` (whose last component is `name`), never followed,
    /// with the error where a layer could not be looked at (not only lacked it).
    fn locate(&self, rel: &Path, name: &OsStr) -> io::Result<Option<(PathBuf, rustix::fs::Stat)>> {
        for (i, path) in self.paths.iter().enumerate() {
            // A path the host cannot name is refused as the host would refuse its lookup:
            // whatever is done with it later goes by that path.
            let full = path.join(rel);
            if full.as_os_str().len() >= libc::PATH_MAX as usize {
                return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
            }
            let Some(Some(dir)) = self.dirs.get(i) else {
                continue;
            };
            match rustix::fs::statat(dir.fd()?, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) => return Ok(Some((full, stat))),
                Err(rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(None)
    }
}

/// A path's components as text (`..` kept).
fn components(path: &Path) -> std::collections::VecDeque<String> {
    path.components()
        .filter_map(|c| match c {
            std::path::Component::Normal(n) => n.to_str().map(str::to_owned),
            std::path::Component::ParentDir => Some("..".to_owned()),
            _ => None,
        })
        .collect()
}

fn display(rel: &Path) -> String {
    escaped(rel.as_os_str().as_bytes())
}

/// What a name that is not UTF-8 is refused with (its bytes shown as `\xNN`, see [`escaped`]).
pub const NOT_UTF8: &str = "the name is not valid UTF-8 (its other bytes shown as \\xNN): it \
                            cannot be applied; rename it in the cell";

/// A name or path as text: UTF-8 as it is, each byte of it that is not as `\xNN` (as `ls -b`
/// shows it). Two names that differ are never shown alike for their bad bytes (U+FFFD, which
/// a lossy conversion gives each, is also a name of its own); a name that holds `\x` itself can
/// still look like one that is not UTF-8, which is why such names are only ever refused, never
/// written or looked up by this text.
pub fn escaped(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    out
}

/// The topmost layer's copy of `rel`, if any layer has it.
pub(crate) fn locate(layers: &[PathBuf], rel: &Path) -> Option<PathBuf> {
    locate_checked(layers, rel)
        .ok()
        .flatten()
        .map(|(path, _)| path)
}

/// Like [`locate`], with what it found there (never followed), and the error when a layer
/// could not be looked at (not only lacked it).
fn locate_checked(layers: &[PathBuf], rel: &Path) -> io::Result<Option<(PathBuf, fs::Metadata)>> {
    for layer in layers {
        let path = layer.join(rel);
        match fs::symlink_metadata(&path) {
            Ok(meta) => return Ok(Some((path, meta))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}
