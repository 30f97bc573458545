//! Where a cell's copy-on-write layer lives on disk, and what the warden records about it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// A cell's layer: `upper/` (what the cell changed), `work/` (overlayfs scratch), `layer.json`.
///
/// A layer with a disk limit of its own (see the process tier's `disk`) keeps `upper/` and
/// `work/` in a file system of that size: the image `disk.img`, mounted on `fs/`.
#[derive(Debug, Clone)]
pub struct Layer {
    dir: PathBuf,
}

/// What the warden records when the layer is created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerMeta {
    /// The host directory the layer is on top of.
    pub lower: PathBuf,
    /// When the cell started; host entries changed later are conflicts for apply.
    pub started: SystemTime,
    /// Paths relative to the workspace whose changes need explicit naming.
    pub protected: Vec<String>,
    /// Snapshot layers under this one (topmost first): those the cell was forked from, and the
    /// snapshots of its own that were taken by turning its upper layer into one.
    #[serde(default)]
    pub base: Vec<PathBuf>,
    /// The layers the cell started on, once `base` is no longer them (what a reset to the start
    /// goes back to); `None` while `base` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<Vec<PathBuf>>,
    /// Where the workspace appears inside the cell.
    #[serde(default = "default_mount")]
    pub mount: PathBuf,
}

fn default_mount() -> PathBuf {
    PathBuf::from("/workspace")
}

impl Layer {
    pub fn at(dir: PathBuf) -> Self {
        Self { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn upper(&self) -> PathBuf {
        self.base().join("upper")
    }

    pub fn work(&self) -> PathBuf {
        self.base().join("work")
    }

    /// The image of the layer's own file system, when it has one.
    pub fn image(&self) -> PathBuf {
        self.dir.join("disk.img")
    }

    /// Where the layer's own file system is mounted.
    pub fn fs_dir(&self) -> PathBuf {
        self.dir.join("fs")
    }

    /// Whether the layer keeps its changes in a file system of its own.
    pub fn has_image(&self) -> bool {
        self.image().exists()
    }

    /// Whether the layer's own file system is mounted on `fs/`.
    pub fn is_attached(&self) -> bool {
        use std::os::unix::fs::MetadataExt as _;
        match (fs::metadata(&self.dir), fs::metadata(self.fs_dir())) {
            (Ok(dir), Ok(mount)) => dir.dev() != mount.dev(),
            _ => false,
        }
    }

    /// Unmounts the layer's own file system (lazily: a cell still using it keeps it until it
    /// ends; its loop device goes with the last user).
    pub fn detach(&self) -> io::Result<()> {
        if !self.is_attached() {
            return Ok(());
        }
        rustix::mount::unmount(self.fs_dir(), rustix::mount::UnmountFlags::DETACH)
            .map_err(io::Error::from)
    }

    /// The directory that holds `upper/` and `work/`.
    fn base(&self) -> PathBuf {
        if self.has_image() {
            self.fs_dir()
        } else {
            self.dir.clone()
        }
    }

    /// Creates the layer's directories and records `meta`.
    pub fn create(&self, meta: &LayerMeta) -> io::Result<()> {
        fs::create_dir_all(self.upper())?;
        fs::create_dir_all(self.work())?;
        let text = serde_json::to_string_pretty(meta).map_err(io::Error::other)?;
        fs::write(self.dir.join("layer.json"), text)
    }

    /// Records `meta` in place of what was recorded: written aside, then its name exchanged
    /// with the record's (`RENAME_EXCHANGE`), so that the record read is always whole, and the
    /// record replaced stays as the file the next one is written over. No block is freed: a
    /// record renamed over the last one freed that one's block, whose discard the rename waited
    /// for on a disk mounted with `discard` (0.17-0.46 ms of a quiet reset, traced). A first
    /// record, or a file system without exchanges, is renamed into place.
    pub fn write_meta(&self, meta: &LayerMeta) -> io::Result<()> {
        let text = serde_json::to_string_pretty(meta).map_err(io::Error::other)?;
        let aside = self.dir.join("layer.json.new");
        let record = self.dir.join("layer.json");
        write_over(&aside, text.as_bytes())?;
        match rustix::fs::renameat_with(
            rustix::fs::CWD,
            &aside,
            rustix::fs::CWD,
            &record,
            rustix::fs::RenameFlags::EXCHANGE,
        ) {
            Ok(()) => Ok(()),
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::INVAL) => fs::rename(&aside, &record),
            Err(e) => Err(e.into()),
        }
    }

    pub fn meta(&self) -> io::Result<LayerMeta> {
        let text = fs::read_to_string(self.dir.join("layer.json"))?;
        serde_json::from_str(&text).map_err(io::Error::other)
    }

    /// The layers the cell started on (topmost first).
    pub fn start(meta: &LayerMeta) -> &[PathBuf] {
        meta.start.as_deref().unwrap_or(&meta.base)
    }

    /// Every layer of the cell's workspace, topmost first (the host directory excluded).
    pub fn stack(&self, meta: &LayerMeta) -> Vec<PathBuf> {
        let mut layers = vec![self.upper()];
        layers.extend(meta.base.iter().cloned());
        layers
    }

    pub fn exists(&self) -> bool {
        self.dir.join("layer.json").exists()
    }

    /// Removes a directory tree that overlayfs used (as upper or work directory).
    pub fn remove_tree(&self) -> io::Result<()> {
        let _ = open_up(&self.dir);
        fs::remove_dir_all(&self.dir)
    }

    /// Removes the layer and everything in it.
    pub fn remove(&self) -> io::Result<()> {
        // The layer's own file system goes with its image; nothing of it is read again.
        self.detach()?;
        // overlayfs leaves `work/work` with mode 000; its owner may open it up again.
        let _ = open_up(&self.work());
        match fs::remove_dir_all(&self.dir) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        }
    }
}

/// Makes the file at `path` (made where missing) hold `bytes`: written over from its start and
/// cut to their length, so that a file of a block or less keeps its block (a file truncated to
/// nothing, or removed, frees it, which a disk mounted with `discard` waits for).
pub fn write_over(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    file.write_all_at(bytes, 0)?;
    file.set_len(bytes.len() as u64)
}

/// Leaves a note at `path`, a name only ever looked at for whether it is there: a second name
/// (`link`) for the file `beside` where there is one, made without a new inode, else an empty
/// file. On an ext4 without a journal a file made where many were removed in the last minutes
/// costs 0.3-0.4 ms, as the allocator passes over recently freed inodes (a link 10-20 us), and
/// a link's removal frees none. A note already there is kept.
pub fn note(path: &Path, beside: &Path) -> io::Result<()> {
    match fs::hard_link(beside, path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(_) if path.exists() => Ok(()),
        Err(_) => fs::write(path, b""),
    }
}

/// Gives the owner access to every directory below `dir` (not following symlinks). With a stack
/// of its own, not by recursion: the tree is the cell's, as deep as it made it.
fn open_up(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let path = entry.path();
                if fs::set_permissions(&path, fs::Permissions::from_mode(0o700)).is_ok() {
                    pending.push(path);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::MetadataExt as _;

    /// A note is a second name for the file beside it where there is one (no new inode), an
    /// empty file where there is none, and a note made twice is one note.
    #[test]
    fn a_note_names_the_file_beside_it_or_is_an_empty_file() {
        let dir = tempfile::tempdir().unwrap();
        let (note_at, log) = (dir.path().join("killed"), dir.path().join("keeper.log"));
        note(&note_at, &log).unwrap();
        assert_eq!(
            fs::read(&note_at).unwrap(),
            b"",
            "nothing beside: an empty file"
        );
        fs::remove_file(&note_at).unwrap();

        fs::write(&log, "warden: started\n").unwrap();
        note(&note_at, &log).unwrap();
        note(&note_at, &log).unwrap();
        let (log_meta, note_meta) = (fs::metadata(&log).unwrap(), fs::metadata(&note_at).unwrap());
        assert_eq!(
            note_meta.ino(),
            log_meta.ino(),
            "the note is the log's inode"
        );
        assert_eq!(log_meta.nlink(), 2);
    }

    /// Each record replaces the last whole, by an exchange of names: the file the last one was
    /// in is the one the next is written over (no file is removed, no block freed), cut to the
    /// new record's length where that is shorter.
    #[test]
    fn a_record_is_replaced_whole_and_the_replaced_file_is_written_over_next() {
        let tmp = tempfile::tempdir().unwrap();
        let layer = Layer::at(tmp.path().join("layer"));
        let meta = |lower: &str| LayerMeta {
            lower: PathBuf::from(lower),
            started: SystemTime::UNIX_EPOCH,
            protected: Vec::new(),
            base: Vec::new(),
            start: None,
            mount: default_mount(),
        };
        let long = meta(&"/a-long-host-directory".repeat(20));
        let short = meta("/short");
        layer.create(&long).unwrap();
        let ino = |name: &str| fs::metadata(layer.dir().join(name)).unwrap().ino();
        let first = ino("layer.json");
        layer.write_meta(&short).unwrap();
        assert_eq!(layer.meta().unwrap().lower, short.lower);
        assert_eq!(
            ino("layer.json.new"),
            first,
            "the replaced record's file was not kept"
        );
        let second = ino("layer.json");
        layer.write_meta(&long).unwrap();
        assert_eq!(layer.meta().unwrap().lower, long.lower);
        assert_eq!(
            ino("layer.json"),
            first,
            "the kept file was not written over"
        );
        assert_eq!(ino("layer.json.new"), second);
        // Shorter than what the file held: nothing of the longer record is left at its end.
        layer.write_meta(&short).unwrap();
        assert_eq!(layer.meta().unwrap().lower, short.lower);
        assert_eq!(
            fs::read(layer.dir().join("layer.json")).unwrap(),
            serde_json::to_string_pretty(&short).unwrap().into_bytes()
        );
    }
}
