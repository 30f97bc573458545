//! Squashing a deep stack of snapshot layers. Every snapshot that turns a cell's upper layer
//! over puts one more layer under the cell's workspace; once the layers of the cell's own
//! snapshots are many, they are merged into one, in the background (hard links: the layers are
//! immutable, so the merged one shares their files and copies no data), and the next turn-over
//! mounts the merged layer in their place. The snapshots keep their own stacks.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{
    FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use warden_workspace::{Layer, LayerMeta};

/// How many layers of its own snapshots a cell's stack may have before they are merged.
pub const SQUASH_AT: usize = 12;

/// A merged layer, ready: the layers it stands for (topmost first), and where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Squashed {
    pub covers: Vec<PathBuf>,
    pub merged: PathBuf,
}

fn note_path(layer: &Layer) -> PathBuf {
    layer.dir().join("squashed.json")
}

/// The merged layer ready for `layer`, if any.
pub fn ready(layer: &Layer) -> Option<Squashed> {
    let text = fs::read(note_path(layer)).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Forgets the merged layer ready for `layer` (it was mounted, or stands for layers the cell
/// no longer has).
pub fn forget(layer: &Layer) {
    let _ = fs::remove_file(note_path(layer));
}

/// The layers of the cell's own snapshots: those its stack has above the ones it started on.
fn own(meta: &LayerMeta) -> &[PathBuf] {
    let start = Layer::start(meta);
    match meta.base.ends_with(start) {
        true => &meta.base[..meta.base.len() - start.len()],
        false => &[],
    }
}

/// The stack to mount under a turned-over layer: the cell's, with a ready merged layer in place
/// of the layers it stands for (when they are the cell's own layers still).
pub fn base_for(layer: &Layer, meta: &LayerMeta) -> Vec<PathBuf> {
    let Some(ready) = ready(layer) else {
        return meta.base.clone();
    };
    let own = own(meta);
    if own.ends_with(&ready.covers) && ready.merged.is_dir() {
        let mut base: Vec<PathBuf> = own[..own.len() - ready.covers.len()].to_vec();
        base.push(ready.merged);
        base.extend(Layer::start(meta).iter().cloned());
        return base;
    }
    forget(layer);
    meta.base.clone()
}

/// After a turn-over: when the cell's own layers are `SQUASH_AT` or more and none is being
/// merged, merges them aside on a thread of its own, into `merged` (on their file system, where
/// an unreferenced entry is removed in time), and notes it for the next turn-over.
pub fn start(layer: &Layer, meta: &LayerMeta, merged: PathBuf) {
    let covers = own(meta).to_vec();
    if covers.len() < SQUASH_AT || ready(layer).is_some_and(|r| r.covers == covers) {
        return;
    }
    // One merge per cell at a time: a turn-over while one is under way leaves it be (the next
    // turn-over after it merges again, from the deeper stack), rather than building a second
    // beside it.
    let Some(merging) = Merging::claim(layer.dir()) else {
        return;
    };
    let layer = Layer::at(layer.dir().to_path_buf());
    std::thread::spawn(move || {
        let _merging = merging;
        // Below the requests that come meanwhile (nothing waits for it), as background work.
        super::sys::lower_priority(0);
        if let Some(parent) = merged.parent() {
            let _ = fs::create_dir_all(parent);
        }
        match merge(&covers, &merged) {
            Ok(()) => {
                let note = Squashed { covers, merged };
                let path = note_path(&layer);
                let aside = path.with_extension("json.new");
                let written = serde_json::to_vec(&note)
                    .map_err(io::Error::other)
                    .and_then(|text| fs::write(&aside, text))
                    .and_then(|()| fs::rename(&aside, &path));
                if written.is_err() {
                    let _ = Layer::at(note.merged).remove_tree();
                }
            }
            Err(_) => {
                let _ = Layer::at(merged).remove_tree();
            }
        }
    });
}

/// The cells whose stack this process is merging now (by their layer's directory).
static MERGING: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// A cell's claim on merging its stack, given up when dropped.
struct Merging(PathBuf);

impl Merging {
    /// The claim for the layer at `dir`; `None` while another merge of it is under way.
    fn claim(dir: &Path) -> Option<Merging> {
        let mut merging = MERGING.lock().unwrap_or_else(|e| e.into_inner());
        if merging.iter().any(|d| d == dir) {
            return None;
        }
        merging.push(dir.to_path_buf());
        Some(Merging(dir.to_path_buf()))
    }
}

impl Drop for Merging {
    fn drop(&mut self) {
        let mut merging = MERGING.lock().unwrap_or_else(|e| e.into_inner());
        merging.retain(|d| *d != self.0);
    }
}

/// `source` (a file, link or FIFO of a layer no hard link reaches) made again at `target`: a
/// regular file as a clone of its extents where the file system can (no data is copied), else
/// a copy; its mode, owner (as root), times and overlay marks kept.
fn copy_across(source: &Path, target: &Path, meta: &fs::Metadata) -> io::Result<()> {
    if !meta.file_type().is_file() {
        return super::snapshot::copy_tree(source, target)
            .map(drop)
            .map_err(io::Error::other);
    }
    let from = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(source)?;
    let to = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(target)?;
    if rustix::fs::ioctl_ficlone(&to, &from).is_err() {
        super::sys::copy_data(&from, &to, meta.len(), Some(meta.blocks() * 512))?;
    }
    to.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::fchown(&to, Some(meta.uid()), Some(meta.gid()))?;
    }
    super::snapshot::copy_overlay_xattrs(source, target)?;
    to.set_times(
        fs::FileTimes::new()
            .set_accessed(meta.accessed()?)
            .set_modified(meta.modified()?),
    )
}

/// Builds at `into` the one layer that `layers` (topmost first, one file system) stack to:
/// each applied over the ones below it as overlayfs reads them (a whiteout hides, an opaque
/// directory replaces, any other directory merges), files hard-linked.
pub fn merge(layers: &[PathBuf], into: &Path) -> io::Result<()> {
    let Some(top) = layers.first() else {
        return Err(io::Error::other("no layers to merge"));
    };
    // Named by its process: what a killed one left (a daemon killed while it merged, a merge
    // started again at each turn-over after) is removed here, not left beside the layers,
    // holding links to their files, until the next collection.
    let building = into.with_extension(format!("{}{}", &BUILDING[1..], std::process::id()));
    let _ = Layer::at(building.clone()).remove_tree();
    if let Some(parent) = into.parent() {
        for entry in fs::read_dir(parent).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let Some((_, pid)) = name.to_str().and_then(|n| n.rsplit_once(BUILDING)) else {
                continue;
            };
            let gone = pid
                .parse::<u32>()
                .is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
            if gone {
                let _ = Layer::at(entry.path()).remove_tree();
            }
        }
    }
    let built = make_dir_like(top, &building)
        .and_then(|()| {
            layers
                .iter()
                .rev()
                // Hard links never reach from one layer into another: what was linked in a
                // layer copied across is linked again, within that layer's application.
                .try_for_each(|layer| apply(layer, &building, &mut HashMap::new()))
        })
        .and_then(|()| fs::rename(&building, into));
    if built.is_err() {
        // Nothing half-built is left in the cell's disk.
        let _ = Layer::at(building).remove_tree();
    }
    built
}

/// What a merged layer's name gets while it is built, followed by the builder's process id
/// (`with_extension` adds the dot).
const BUILDING: &str = ".building-";

fn is_whiteout(meta: &fs::Metadata) -> bool {
    meta.file_type().is_char_device() && meta.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    ["user.overlay.opaque", "trusted.overlay.opaque"]
        .iter()
        .any(|name| {
            xattr::get(dir, name)
                .ok()
                .flatten()
                .is_some_and(|v| v == b"y")
        })
}

fn make_dir_like(like: &Path, dir: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(like)?;
    fs::create_dir(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    std::os::unix::fs::lchown(dir, Some(meta.uid()), Some(meta.gid()))
}

fn remove_entry(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(meta) if meta.is_dir() => Layer::at(path.to_path_buf()).remove_tree(),
        Ok(_) => fs::remove_file(path),
    }
}

/// Applies the layer directory `from` over the merged directory `to`. `across`: the entries of
/// this layer made again at a path of the merged layer, by inode (`copy_across`), so that
/// another name of one of them is a hard link to it there, as it is in the layer. The walk
/// keeps a stack of its own, never recursing (the layers are the cell's, as deep as it made
/// them), and a directory more than [`warden_workspace::MAX_DEPTH`] levels down fails the
/// merge, which removes what it built: the snapshots then stay as they are.
fn apply(from: &Path, to: &Path, across: &mut HashMap<(u64, u64), PathBuf>) -> io::Result<()> {
    let mut pending = vec![(from.to_path_buf(), to.to_path_buf(), 0)];
    while let Some((from, to, depth)) = pending.pop() {
        if depth > warden_workspace::MAX_DEPTH {
            return Err(io::Error::other(format!(
                "{} is deeper than {} levels, more than a merge of layers goes",
                from.display(),
                warden_workspace::MAX_DEPTH
            )));
        }
        apply_dir(&from, &to, across, |source, target| {
            pending.push((source, target, depth + 1));
        })?;
    }
    Ok(())
}

/// Applies the entries of the layer directory `from` over the merged directory `to`, each
/// directory made or merged, and handed to `descend` for its own entries.
fn apply_dir(
    from: &Path,
    to: &Path,
    across: &mut HashMap<(u64, u64), PathBuf>,
    mut descend: impl FnMut(PathBuf, PathBuf),
) -> io::Result<()> {
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        let meta = entry.metadata()?; // lstat
        if meta.is_dir() {
            let below = fs::symlink_metadata(&target).ok();
            let merges = below.as_ref().is_some_and(|b| b.is_dir()) && !is_opaque(&source);
            if merges {
                // Its mode and owner are the upper one's.
                fs::set_permissions(&target, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
                std::os::unix::fs::lchown(&target, Some(meta.uid()), Some(meta.gid()))?;
            } else {
                // Replaces what was there; hides what the layers under the merged ones hold
                // when something in the merged ones hid it already (a whiteout, a file).
                let hides = below.is_some() || is_opaque(&source);
                remove_entry(&target)?;
                make_dir_like(&source, &target)?;
                if hides {
                    let name = match xattr::get(&source, "trusted.overlay.opaque") {
                        Ok(Some(_)) => "trusted.overlay.opaque",
                        _ => "user.overlay.opaque",
                    };
                    xattr::set(&target, name, b"y")?;
                }
            }
            descend(source, target);
            continue;
        }
        remove_entry(&target)?;
        if is_whiteout(&meta) {
            nix::sys::stat::mknod(
                &target,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o600),
                0,
            )
            .map_err(io::Error::from)?;
            let _ = std::os::unix::fs::lchown(&target, Some(meta.uid()), Some(meta.gid()));
        } else if let Err(err) = fs::hard_link(&source, &target) {
            // A file, a link or a FIFO: the same inode (the layers never change); one of a
            // layer in another btrfs subvolume (a clone's, which a reset to it put in the
            // stack) cannot be linked from here, and is made again instead.
            if err.raw_os_error() != Some(libc::EXDEV) {
                return Err(err);
            }
            let inode = (meta.dev(), meta.ino());
            match across.get(&inode) {
                Some(first) if meta.nlink() > 1 => fs::hard_link(first, &target)?,
                _ => {
                    copy_across(&source, &target, &meta)?;
                    if meta.nlink() > 1 {
                        across.insert(inode, target);
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for entry in walkdir(dir) {
            let rel = entry.strip_prefix(dir).unwrap().display().to_string();
            let meta = fs::symlink_metadata(&entry).unwrap();
            let what = if is_whiteout(&meta) {
                "whiteout".to_owned()
            } else if meta.is_dir() {
                format!("dir{}", if is_opaque(&entry) { " opaque" } else { "" })
            } else {
                fs::read_to_string(&entry).unwrap()
            };
            out.push(format!("{rel}: {what}"));
        }
        out.sort();
        out
    }

    fn walkdir(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for entry in fs::read_dir(dir).unwrap().flatten() {
            out.push(entry.path());
            if entry.file_type().unwrap().is_dir() {
                out.extend(walkdir(&entry.path()));
            }
        }
        out
    }

    #[test]
    fn one_merge_of_a_cells_stack_runs_at_a_time() {
        let (a, b) = (Path::new("/cells/a"), Path::new("/cells/b"));
        let first = Merging::claim(a).expect("nothing merges a yet");
        assert!(
            Merging::claim(a).is_none(),
            "a second merge of a was let start"
        );
        let other = Merging::claim(b).expect("another cell merges beside it");
        drop(first);
        assert!(
            Merging::claim(a).is_some(),
            "a stays claimed after its merge ended"
        );
        drop(other);
    }

    #[test]
    fn merged_layers_read_as_the_stack_they_stand_for() {
        let tmp = tempfile::tempdir().unwrap();
        let (low, mid, top) = (
            tmp.path().join("1"),
            tmp.path().join("2"),
            tmp.path().join("3"),
        );
        for dir in [&low, &mid, &top] {
            fs::create_dir(dir).unwrap();
        }
        let whiteout = |path: &Path| {
            nix::sys::stat::mknod(
                path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o600),
                0,
            )
            .unwrap();
        };
        // The oldest layer.
        fs::create_dir_all(low.join("src/old")).unwrap();
        fs::write(low.join("src/a"), "a1").unwrap();
        fs::write(low.join("src/old/x"), "x").unwrap();
        fs::write(low.join("gone"), "g").unwrap();
        fs::write(low.join("kept"), "k").unwrap();
        // Then: src/a changed, src/old deleted, `gone` deleted, a file that hid something
        // from below the merged layers.
        fs::create_dir(mid.join("src")).unwrap();
        fs::write(mid.join("src/a"), "a2").unwrap();
        whiteout(&mid.join("src/old"));
        whiteout(&mid.join("gone"));
        fs::write(mid.join("was-dir"), "now a file").unwrap();
        // Then: src/old made again (it must hide what the first layer had), `gone` made a
        // directory, `was-dir` a directory again, and an opaque directory.
        fs::create_dir_all(top.join("src/old")).unwrap();
        fs::write(top.join("src/old/y"), "y").unwrap();
        fs::create_dir(top.join("gone")).unwrap();
        fs::create_dir(top.join("was-dir")).unwrap();
        fs::create_dir(top.join("fresh")).unwrap();
        xattr::set(top.join("fresh"), "user.overlay.opaque", b"y").unwrap();
        fs::write(top.join("fresh/f"), "f").unwrap();

        let merged = tmp.path().join("merged");
        merge(&[top.clone(), mid.clone(), low.clone()], &merged).unwrap();
        assert_eq!(
            read(&merged),
            [
                "fresh/f: f",
                "fresh: dir opaque",
                "gone: dir opaque",
                "kept: k",
                "src/a: a2",
                "src/old/y: y",
                "src/old: dir opaque",
                "src: dir",
                "was-dir: dir opaque",
            ]
        );
        // Files are the layers' own (nothing copied).
        assert_eq!(
            fs::metadata(merged.join("src/a")).unwrap().ino(),
            fs::metadata(mid.join("src/a")).unwrap().ino()
        );
    }
}
