//! Images as a cell's root. `warden image import FILE` reads an OCI image layout (a directory,
//! or a tar of one: what `docker save` writes since Docker 25, and `skopeo copy ... oci-archive:`)
//! or a classic `docker save` archive (`manifest.json` beside `ID/layer.tar`), verifies every
//! blob against its digest and every layer against the diff id its configuration names, and
//! unpacks each layer once into a content-addressed store (`STATE/images/layers/<sha256 of the
//! layer's tar>`), in the form overlayfs stacks read-only (see `extract`). An image is a record:
//! its name, its manifest's digest, its layers bottom first, and the defaults of its
//! configuration (environment, working directory, user, command).
//!
//! Only `warden image pull` reaches a registry (`pull`: into a staging layout, then imported
//! as above). The store is plain files, written through a staging folder and renamed into
//! place, so an import or a pull that fails leaves nothing behind.

mod archive;
mod defaults;
pub mod extract;
mod pull;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use defaults::Defaults;
pub use extract::{Limits, Unpacked};
pub use pull::{PullOptions, Pulled};

/// One imported image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// As given to `--name`, or from the archive (`RepoTags`, `org.opencontainers.image.ref.name`).
    pub name: String,
    /// The digest of its manifest (`sha256:...`), or of the archive's `manifest.json` entry for
    /// a classic `docker save`.
    pub digest: String,
    /// Its layers' diff ids (`sha256:...` of each uncompressed layer), bottom first.
    pub layers: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
    /// Bytes of file content over all its layers.
    pub size: u64,
    pub imported_ms: u64,
}

/// Why an image could not be imported, found or removed; each carries the whole message.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// An entry of a layer or of the archive that is refused (nothing of the layer is kept).
    #[error("refused {}: it is {why}", if entry.is_empty() { "the layer".to_owned() } else { format!("entry `{entry}`") })]
    Refused { entry: String, why: String },
    #[error(
        "{what} does not match its digest: expected {expected}, got {got} (the archive was changed or is damaged)"
    )]
    Digest {
        what: String,
        expected: String,
        got: String,
    },
    /// Not an image archive this warden reads, or one whose documents do not parse.
    #[error("{0}")]
    Format(String),
    #[error("no image named {0} (`warden image ls` lists them)")]
    NotFound(String),
    #[error(
        "an image named {0} exists already: remove it first (`warden image rm {0}`) or import under another --name"
    )]
    Exists(String),
    #[error("{0}")]
    BadName(String),
}

impl ImageError {
    pub(crate) fn io(what: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The store of images and their unpacked layers under a state directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
    limits: Limits,
}

impl Store {
    /// The store under `state` (`STATE/images`); made on first use.
    pub fn new(state: &Path) -> Self {
        Self {
            root: state.join("images"),
            limits: Limits::default(),
        }
    }

    /// The same store with other limits for one layer.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn records(&self) -> PathBuf {
        self.root.join("records")
    }

    fn layers(&self) -> PathBuf {
        self.root.join("layers")
    }

    /// The directory of an unpacked layer, by its diff id.
    pub fn layer_dir(&self, diff_id: &str) -> Result<PathBuf, ImageError> {
        let hex = sha256_hex(diff_id)
            .ok_or_else(|| ImageError::Format(format!("{diff_id} is not a sha256 digest")))?;
        Ok(self.layers().join(hex))
    }

    fn record_path(&self, name: &str) -> PathBuf {
        use sha2::Digest as _;
        let id = hex::encode(sha2::Sha256::digest(name.as_bytes()));
        self.records().join(format!("{}.json", &id[..32]))
    }

    /// Every image, by name.
    pub fn list(&self) -> Result<Vec<Image>, ImageError> {
        let dir = self.records();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(ImageError::io("listing", &dir, e)),
        };
        let mut out = Vec::new();
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "json")
                && let Ok(text) = std::fs::read(&path)
                && let Ok(image) = serde_json::from_slice::<Image>(&text)
            {
                out.push(image);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    pub fn get(&self, name: &str) -> Result<Image, ImageError> {
        let path = self.record_path(name);
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ImageError::NotFound(name.to_owned()));
            }
            Err(e) => return Err(ImageError::io("reading", &path, e)),
        };
        let image: Image = serde_json::from_slice(&text)
            .map_err(|e| ImageError::Format(format!("{}: {e}", path.display())))?;
        if image.name != name {
            return Err(ImageError::NotFound(name.to_owned()));
        }
        Ok(image)
    }

    /// The unpacked layers of `name`, topmost first (overlayfs's `lowerdir` order), each
    /// checked to be there.
    pub fn lower_dirs(&self, name: &str) -> Result<(Image, Vec<PathBuf>), ImageError> {
        let image = self.get(name)?;
        let mut dirs = Vec::new();
        for layer in image.layers.iter().rev() {
            let dir = self.layer_dir(layer)?;
            if !dir.is_dir() {
                return Err(ImageError::Format(format!(
                    "layer {layer} of image {name} is missing from {}; import the image again",
                    self.layers().display()
                )));
            }
            dirs.push(dir);
        }
        Ok((image, dirs))
    }

    /// Imports the image in `source` (a directory or an archive). `name` overrides the name
    /// the archive gives.
    pub fn import(&self, source: &Path, name: Option<&str>) -> Result<Image, ImageError> {
        if let Some(name) = name {
            check_name(name)?;
        }
        for dir in [
            self.root.clone(),
            self.records(),
            self.layers(),
            self.root.join("staging"),
        ] {
            std::fs::create_dir_all(&dir).map_err(|e| ImageError::io("making", &dir, e))?;
        }
        let _lock = self.lock()?;
        // What an import that was killed left in `staging/` (one import at a time: none runs),
        // and the layers it had unpacked and stored before its record was written, which no
        // record names (an import killed so and not asked again left them for good, unless an
        // image was removed or an import failed), and its record's temporary file.
        if let Ok(entries) = std::fs::read_dir(self.root.join("staging")) {
            for entry in entries.flatten() {
                let _ = remove_tree(&entry.path());
            }
        }
        if let Ok(entries) = std::fs::read_dir(self.records()) {
            for entry in entries.flatten() {
                if entry.path().to_string_lossy().ends_with(".json.tmp") {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        self.sweep()?;
        let staging = tempdir_in(&self.root.join("staging"))?;
        let result = archive::import(self, source, name, staging.path()).and_then(|image| {
            check_name(&image.name)?;
            match self.record_path(&image.name).exists() {
                true => Err(ImageError::Exists(image.name)),
                false => Ok(image),
            }
        });
        drop(staging);
        let image = match result {
            Ok(image) => image,
            Err(e) => {
                // The layers this import unpacked go with it (no record uses them).
                let _ = self.sweep();
                return Err(e);
            }
        };
        let path = self.record_path(&image.name);
        let text = serde_json::to_vec_pretty(&image)
            .map_err(|e| ImageError::Format(format!("writing the record: {e}")))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text).map_err(|e| ImageError::io("writing", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| ImageError::io("writing", &path, e))?;
        Ok(image)
    }

    /// Unpacks one layer from `input` unless the store has it; checks its diff id either way.
    pub(crate) fn unpack_layer(
        &self,
        input: impl std::io::Read,
        diff_id: &str,
        what: &str,
    ) -> Result<u64, ImageError> {
        let dir = self.layer_dir(diff_id)?;
        let mut hashing = HashingReader::new(input);
        if dir.is_dir() {
            std::io::copy(&mut hashing, &mut std::io::sink())
                .map_err(|e| ImageError::Format(format!("reading {what}: {e}")))?;
            hashing.check(diff_id, what)?;
            return Ok(dir_size(&dir));
        }
        let staging = tempdir_in(&self.root.join("staging"))?;
        let unpacked = extract::unpack(&mut hashing, staging.path(), self.limits)?;
        // What follows the tar's end (its padding) counts for the digest too.
        std::io::copy(&mut hashing, &mut std::io::sink())
            .map_err(|e| ImageError::Format(format!("reading {what}: {e}")))?;
        hashing.check(diff_id, what)?;
        let kept = staging.keep();
        if let Err(e) = std::fs::rename(&kept, &dir) {
            let _ = remove_tree(&kept);
            if !dir.is_dir() {
                return Err(ImageError::io("storing the layer in", &dir, e));
            }
        }
        Ok(unpacked.bytes)
    }

    /// Removes an image, and the layers no other image uses.
    pub fn remove(&self, name: &str) -> Result<Image, ImageError> {
        let _lock = self.lock()?;
        let image = self.get(name)?;
        let path = self.record_path(name);
        std::fs::remove_file(&path).map_err(|e| ImageError::io("removing", &path, e))?;
        self.sweep()?;
        Ok(image)
    }

    /// Removes every layer no image record names (with the store's lock held).
    fn sweep(&self) -> Result<(), ImageError> {
        let used: std::collections::HashSet<String> = self
            .list()?
            .into_iter()
            .flat_map(|i| i.layers)
            .filter_map(|l| sha256_hex(&l).map(str::to_owned))
            .collect();
        let dir = self.layers();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Ok(());
        };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !used.contains(&name) {
                let path = entry.path();
                remove_tree(&path).map_err(|e| ImageError::io("removing", &path, e))?;
            }
        }
        Ok(())
    }

    /// The store's lock: one import or removal at a time, across processes.
    fn lock(&self) -> Result<std::fs::File, ImageError> {
        std::fs::create_dir_all(&self.root).map_err(|e| ImageError::io("making", &self.root, e))?;
        let path = self.root.join("lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| ImageError::io("opening", &path, e))?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| ImageError::io("locking", &path, e.into()))?;
        Ok(file)
    }
}

/// A name as images are named: `python:3.12-slim`, `localhost/tools/build:1`, at most 255
/// characters of letters, digits and `._-:/@`.
pub fn check_name(name: &str) -> Result<(), ImageError> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:/@".contains(&b))
        && !name.starts_with(['.', '-', '/'])
        && !name.split('/').any(|part| part == ".." || part == ".");
    if ok {
        Ok(())
    } else {
        Err(ImageError::BadName(format!(
            "{name:?} is not an image name: use letters, digits and `._-:/@` (like python:3.12-slim), at most 255 characters"
        )))
    }
}

/// The hex of a `sha256:HEX` digest, checked.
pub(crate) fn sha256_hex(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then_some(hex)
}

/// Reads through, hashing what passes.
pub(crate) struct HashingReader<R> {
    inner: R,
    hash: sha2::Sha256,
}

impl<R: std::io::Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        use sha2::Digest as _;
        Self {
            inner,
            hash: sha2::Sha256::new(),
        }
    }

    /// Compares what was read with `digest` (`sha256:HEX`).
    pub(crate) fn check(self, digest: &str, what: &str) -> Result<(), ImageError> {
        use sha2::Digest as _;
        let got = format!("sha256:{}", hex::encode(self.hash.finalize()));
        if got == digest {
            Ok(())
        } else {
            Err(ImageError::Digest {
                what: what.to_owned(),
                expected: digest.to_owned(),
                got,
            })
        }
    }
}

impl<R: std::io::Read> std::io::Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use sha2::Digest as _;
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// A folder that is removed when dropped, unless kept.
pub(crate) struct Staging(Option<PathBuf>);

impl Staging {
    pub(crate) fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }

    fn keep(mut self) -> PathBuf {
        self.0.take().unwrap_or_default()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = remove_tree(&path);
        }
    }
}

fn tempdir_in(parent: &Path) -> Result<Staging, ImageError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let path = parent.join(format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::create_dir(&path) {
            Ok(()) => return Ok(Staging(Some(path))),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(ImageError::io("making", &path, e)),
        }
    }
}

/// Removes a tree that may hold read-only directories (layers keep their images' modes).
pub(crate) fn remove_tree(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(first) => {
            // Give the owner back write access to every directory, then try again.
            let mut stack = vec![path.to_path_buf()];
            while let Some(dir) = stack.pop() {
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
                if let Ok(entries) = std::fs::read_dir(&dir) {
                    for entry in entries.filter_map(Result::ok) {
                        if entry.file_type().is_ok_and(|t| t.is_dir()) {
                            stack.push(entry.path());
                        }
                    }
                }
            }
            std::fs::remove_dir_all(path).map_err(|_| first)
        }
    }
}

fn dir_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(entry.path()),
                Ok(t) if t.is_file() => total += entry.metadata().map_or(0, |m| m.len()),
                _ => {}
            }
        }
    }
    total
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
