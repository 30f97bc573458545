//! The persistent state directory: what outlives a cell's processes, today its copy-on-write
//! workspace layer, kept until the user applies or removes it.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use warden_workspace::{Layer, LayerMeta};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state directory {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// The per-user state directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    /// `$WARDEN_STATE_DIR`, else `/var/lib/warden` for root, else `$XDG_DATA_HOME/warden`, else
    /// `~/.local/share/warden`.
    pub fn default_root() -> PathBuf {
        if let Some(dir) = std::env::var_os("WARDEN_STATE_DIR") {
            return PathBuf::from(dir);
        }
        let uid = nix::unistd::geteuid();
        if uid.is_root() {
            return PathBuf::from("/var/lib/warden");
        }
        if let Some(dir) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
            return PathBuf::from(dir).join("warden");
        }
        match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            Some(home) => PathBuf::from(home).join(".local/share/warden"),
            None => PathBuf::from(format!("/tmp/warden-state-{uid}")),
        }
    }

    /// The state directory at `root`. Nothing is created until something is stored: a cell
    /// without a workspace layer or an egress record needs no state directory at all.
    pub fn open(root: PathBuf) -> Result<Self, StoreError> {
        Ok(Self { root })
    }

    /// Creates the directories that hold layers, before the first is stored.
    pub fn prepare(&self) -> Result<(), StoreError> {
        let layers = self.root.join("layers");
        for dir in [&self.root, &layers] {
            let io = |source| StoreError::Io {
                path: dir.clone(),
                source,
            };
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o711)
                .create(dir)
                .map_err(io)?;
            // Search-only for others: a root-started cell mounts its layer as an unprivileged id.
            fs::set_permissions(dir, fs::Permissions::from_mode(0o711)).map_err(io)?;
        }
        Ok(())
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The key applies mark their undo logs with (`ApplyOptions::key`), made once (32 random
    /// bytes, owner-only) in the state directory, which no cell sees. `None` where it can be
    /// neither read nor made: then no killed apply is undone.
    pub fn apply_key(&self) -> Option<[u8; 32]> {
        use std::io::{Read as _, Write as _};
        use std::os::unix::fs::OpenOptionsExt as _;
        let path = self.root.join("apply.key");
        let read = |path: &Path| -> Option<[u8; 32]> {
            let mut key = [0u8; 32];
            fs::File::open(path).ok()?.read_exact(&mut key).ok()?;
            Some(key)
        };
        if let Some(key) = read(&path) {
            return Some(key);
        }
        let mut key = [0u8; 32];
        fs::File::open("/dev/urandom")
            .and_then(|mut random| random.read_exact(&mut key))
            .ok()?;
        // Written whole aside, then linked into place: of two wardens that make it at once,
        // one's is kept and both read it.
        fs::create_dir_all(&self.root).ok()?;
        let aside = self.root.join(format!("apply.key.{}", std::process::id()));
        let written = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&aside)
            .and_then(|mut file| file.write_all(&key).and_then(|()| file.sync_all()));
        let linked = written.and_then(|()| fs::hard_link(&aside, &path));
        let _ = fs::remove_file(&aside);
        match linked {
            Ok(()) => Some(key),
            Err(_) => read(&path),
        }
    }

    /// The layer of the cell `name` (which may not exist).
    pub fn layer(&self, name: &str) -> Layer {
        Layer::at(self.root.join("layers").join(name))
    }

    /// The egress decisions of cell `name`, kept after it stops.
    pub fn net_log_path(&self, name: &str) -> PathBuf {
        self.root.join("net").join(format!("{name}.jsonl"))
    }

    /// A fresh egress log for a new cell `name` (an older cell's log of that name is dropped).
    pub fn net_log(&self, name: &str) -> io::Result<PathBuf> {
        self.prepare()
            .map_err(|e| io::Error::other(e.to_string()))?;
        let dir = self.root.join("net");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let path = self.net_log_path(name);
        match fs::remove_file(&path) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
            _ => {}
        }
        Ok(path)
    }

    /// Every kept layer, by cell name.
    pub fn layers(&self) -> Vec<(String, LayerMeta)> {
        let Ok(entries) = fs::read_dir(self.root.join("layers")) else {
            return Vec::new();
        };
        let mut out: Vec<(String, LayerMeta)> = entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_str()?.to_owned();
                // Layers on their way out (`.gone-*`) are no cell's.
                if name.starts_with('.') {
                    return None;
                }
                let meta = Layer::at(entry.path()).meta().ok()?;
                Some((name, meta))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}
