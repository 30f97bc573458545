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

    /// Records `meta` in place of what was recorded (written aside, then renamed over).
    pub fn write_meta(&self, meta: &LayerMeta) -> io::Result<()> {
        let text = serde_json::to_string_pretty(meta).map_err(io::Error::other)?;
        let aside = self.dir.join("layer.json.new");
        fs::write(&aside, text)?;
        fs::rename(&aside, self.dir.join("layer.json"))
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

/// Gives the owner access to every directory below `dir` (not following symlinks).
fn open_up(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    for entry in fs::read_dir(dir)?.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = open_up(&entry.path());
        }
    }
    Ok(())
}
