//! Reading what `warden image import` is given: an OCI image layout (a directory, or a tar of
//! one, gzipped or not) or a classic `docker save` archive. An archive is first copied into a
//! staging folder entry by entry (regular files and directories only, under names of normal
//! components; the links `docker save` writes for a layer two images share become hard links to
//! a file of the archive), so that its documents and blobs can then be read by name.

use std::io::{BufRead as _, BufReader, Read};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};

use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest, MediaType};
use serde::Deserialize;

use crate::{HashingReader, Image, ImageError, Store, extract, now_ms, sha256_hex};

/// The documents of an image (index, manifests, configuration) are small; a bigger one is
/// refused rather than read into memory.
const DOCUMENT_LIMIT: u64 = 4 << 20;

pub(crate) fn import(
    store: &Store,
    source: &Path,
    name: Option<&str>,
    staging: &Path,
) -> Result<Image, ImageError> {
    let meta = std::fs::metadata(source).map_err(|e| ImageError::io("reading", source, e))?;
    let dir = if meta.is_dir() {
        source.to_path_buf()
    } else {
        stage(source, staging, store.limits.bytes)?;
        staging.to_path_buf()
    };
    if dir.join("index.json").is_file() && dir.join("oci-layout").is_file() {
        from_oci(store, &dir, name)
    } else if dir.join("manifest.json").is_file() {
        from_docker(store, &dir, name)
    } else {
        Err(ImageError::Format(format!(
            "{} is neither an OCI image layout (oci-layout, index.json and blobs/) nor a `docker save` archive (manifest.json)",
            source.display()
        )))
    }
}

/// Copies the archive's files into `staging`.
fn stage(archive: &Path, staging: &Path, limit: u64) -> Result<(), ImageError> {
    let file = std::fs::File::open(archive).map_err(|e| ImageError::io("opening", archive, e))?;
    let mut input = BufReader::new(file);
    let magic = input
        .fill_buf()
        .map_err(|e| ImageError::io("reading", archive, e))?;
    let reader: Box<dyn Read> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::GzDecoder::new(input))
    } else {
        Box::new(input)
    };
    let (reader, meter) = extract::Metered::new(reader);
    let mut tar = tar::Archive::new(reader);
    let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut total = 0u64;
    let mut entries = tar.entries().map_err(|e| {
        ImageError::Format(format!("{} is not a tar archive: {e}", archive.display()))
    })?;
    let not_tar = |e: std::io::Error| {
        ImageError::Format(format!(
            "{} is not a tar archive of an image (an OCI layout or `docker save`): {e}",
            archive.display()
        ))
    };
    loop {
        meter.start();
        let next = entries.next();
        meter.stop();
        let Some(entry) = next else { break };
        let mut entry = entry.map_err(not_tar)?;
        let raw = entry.path_bytes().into_owned();
        let shown = extract::shown(&raw);
        let refuse = |why: String| ImageError::Refused {
            entry: shown.clone(),
            why,
        };
        let Some(rel) =
            extract::relative(&raw).map_err(|why| refuse(format!("{why} in the archive")))?
        else {
            continue;
        };
        let path = staging.join(&rel);
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                std::fs::create_dir_all(&path).map_err(|e| ImageError::io("making", &path, e))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                total = total.saturating_add(entry.size());
                if total > limit {
                    return Err(refuse(format!(
                        "past {limit} bytes, the limit of an archive"
                    )));
                }
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(|e| ImageError::io("making", parent, e))?;
                }
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(|e| refuse(format!("a second file of the same name ({e})")))?;
                std::io::copy(&mut entry, &mut out)
                    .map_err(|e| ImageError::io("writing", &path, e))?;
            }
            tar::EntryType::Symlink | tar::EntryType::Link => {
                let hard = entry.header().entry_type() == tar::EntryType::Link;
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                let target = Path::new(std::ffi::OsStr::from_bytes(&target));
                let base = if hard {
                    PathBuf::new()
                } else {
                    rel.parent().map(Path::to_path_buf).unwrap_or_default()
                };
                let resolved = lexical(&base.join(target)).ok_or_else(|| {
                    refuse(format!(
                        "a link out of the archive (to {})",
                        target.display()
                    ))
                })?;
                links.push((rel, resolved));
            }
            other => {
                return Err(refuse(format!("an entry of type {other:?} in the archive")));
            }
        }
    }
    // Each link becomes a second name of a file of the archive.
    for (alias, target) in links {
        let from = staging.join(&target);
        let meta = std::fs::symlink_metadata(&from).map_err(|_| ImageError::Refused {
            entry: alias.display().to_string(),
            why: format!(
                "a link to {}, which the archive does not hold",
                target.display()
            ),
        })?;
        if !meta.is_file() {
            return Err(ImageError::Refused {
                entry: alias.display().to_string(),
                why: format!("a link to {}, which is not a file", target.display()),
            });
        }
        let to = staging.join(&alias);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(|e| ImageError::io("making", parent, e))?;
        }
        std::fs::hard_link(&from, &to).map_err(|e| ImageError::io("linking", &to, e))?;
    }
    Ok(())
}

/// `path` with `.` and `..` worked out, if it stays inside (relative, never above its start).
fn lexical(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// A file of the image opened for reading, if it is a regular file: a layout or archive
/// folder may hold links to anything, and a device (`/dev/zero`) or a FIFO would be read, or
/// waited on, without end while the store is locked.
fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    // Not blocked by a FIFO with no writer.
    let fd = rustix::fs::open(
        path,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let file = std::fs::File::from(fd);
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(
            "it is not a regular file (a device, FIFO or folder, or a link to one)",
        ));
    }
    Ok(file)
}

/// A small document of the image (`index.json`, `manifest.json`, a configuration), read whole
/// if it is a regular file of at most [`DOCUMENT_LIMIT`] bytes.
fn read_document(path: &Path) -> Result<Vec<u8>, ImageError> {
    let file = open_regular(path).map_err(|e| ImageError::io("reading", path, e))?;
    let mut bytes = Vec::new();
    file.take(DOCUMENT_LIMIT + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ImageError::io("reading", path, e))?;
    if bytes.len() as u64 > DOCUMENT_LIMIT {
        return Err(ImageError::Format(format!(
            "{} is larger than {DOCUMENT_LIMIT} bytes, far more than an image's document needs; the archive is hostile or damaged",
            path.display()
        )));
    }
    Ok(bytes)
}

/// A blob of an OCI layout by its digest (`sha256:HEX` only), opened.
fn blob(dir: &Path, digest: &str) -> Result<(PathBuf, std::fs::File), ImageError> {
    let hex = sha256_hex(digest)
        .ok_or_else(|| ImageError::Format(format!("{digest}: only sha256 digests are read")))?;
    let path = dir.join("blobs").join("sha256").join(hex);
    let file = open_regular(&path).map_err(|e| {
        ImageError::Format(format!(
            "the layout names blob {digest}, which it does not hold as a file ({e})"
        ))
    })?;
    Ok((path, file))
}

/// A small document, checked against its digest.
fn document(dir: &Path, digest: &str, what: &str) -> Result<Vec<u8>, ImageError> {
    let (path, file) = blob(dir, digest)?;
    let mut hashing = HashingReader::new(file.take(DOCUMENT_LIMIT + 1));
    let mut bytes = Vec::new();
    hashing
        .read_to_end(&mut bytes)
        .map_err(|e| ImageError::io("reading", &path, e))?;
    if bytes.len() as u64 > DOCUMENT_LIMIT {
        return Err(ImageError::Format(format!(
            "{what} ({digest}) is larger than {DOCUMENT_LIMIT} bytes"
        )));
    }
    hashing.check(digest, what)?;
    Ok(bytes)
}

pub(crate) fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The manifest for this machine: the index's entry for linux on this architecture (through
/// nested indexes), or its only one.
fn pick_manifest(
    dir: &Path,
    index: &ImageIndex,
    depth: u8,
) -> Result<(String, ImageManifest), ImageError> {
    if depth > 3 {
        return Err(ImageError::Format(
            "the image's indexes nest too deep".to_owned(),
        ));
    }
    let candidates: Vec<_> = index
        .manifests()
        .iter()
        .filter(|d| {
            d.platform().as_ref().is_none_or(|p| {
                p.os().to_string() == "linux" && p.architecture().to_string() == host_arch()
            })
        })
        .collect();
    let chosen = match candidates.as_slice() {
        [one, ..] => *one,
        [] => {
            return Err(ImageError::Format(format!(
                "the image has no manifest for linux/{} (it has {})",
                host_arch(),
                index
                    .manifests()
                    .iter()
                    .filter_map(|d| d.platform().as_ref().map(|p| format!(
                        "{}/{}",
                        p.os(),
                        p.architecture()
                    )))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    };
    let digest = chosen.digest().to_string();
    let bytes = document(dir, &digest, "the image's manifest")?;
    if *chosen.media_type() == MediaType::ImageIndex {
        let nested = ImageIndex::from_reader(bytes.as_slice())
            .map_err(|e| ImageError::Format(format!("the index {digest} does not parse: {e}")))?;
        return pick_manifest(dir, &nested, depth + 1);
    }
    let manifest = ImageManifest::from_reader(bytes.as_slice())
        .map_err(|e| ImageError::Format(format!("the manifest {digest} does not parse: {e}")))?;
    Ok((digest, manifest))
}

fn from_oci(store: &Store, dir: &Path, name: Option<&str>) -> Result<Image, ImageError> {
    let index_path = dir.join("index.json");
    let index = ImageIndex::from_reader(read_document(&index_path)?.as_slice())
        .map_err(|e| ImageError::Format(format!("{} does not parse: {e}", index_path.display())))?;
    let (digest, manifest) = pick_manifest(dir, &index, 0)?;
    let config_digest = manifest.config().digest().to_string();
    let config_bytes = document(dir, &config_digest, "the image's configuration")?;
    let config = ImageConfiguration::from_reader(config_bytes.as_slice()).map_err(|e| {
        ImageError::Format(format!(
            "the configuration {config_digest} does not parse: {e}"
        ))
    })?;
    let diff_ids = config.rootfs().diff_ids();
    if diff_ids.len() != manifest.layers().len() {
        return Err(ImageError::Format(format!(
            "the manifest has {} layers but the configuration names {} diff ids",
            manifest.layers().len(),
            diff_ids.len()
        )));
    }
    let mut size = 0;
    for (i, (layer, diff_id)) in manifest.layers().iter().zip(diff_ids).enumerate() {
        let layer_digest = layer.digest().to_string();
        let (_, file) = blob(dir, &layer_digest)?;
        let what = format!("layer {} ({layer_digest})", i + 1);
        size += unpack_compressed(store, file, &layer_digest, diff_id, &what)?;
    }
    // The name: as asked, else as `docker save` tagged it, else the index's annotations.
    let from_docker = read_docker_manifest(dir)
        .ok()
        .and_then(|m| m.into_iter().next())
        .and_then(|m| m.repo_tags.into_iter().next());
    let annotated = index.manifests().iter().find_map(|d| {
        let notes = d.annotations().as_ref()?;
        notes
            .get("io.containerd.image.name")
            .or_else(|| notes.get("org.opencontainers.image.ref.name"))
            .cloned()
    });
    let name = name
        .map(str::to_owned)
        .or(from_docker)
        .or(annotated)
        .unwrap_or_else(|| digest.clone());
    Ok(image(name, digest, diff_ids.clone(), &config, size))
}

/// Unpacks a layer blob, gzipped or not, checking the blob's digest and the layer's diff id.
fn unpack_compressed(
    store: &Store,
    file: std::fs::File,
    blob_digest: &str,
    diff_id: &str,
    what: &str,
) -> Result<u64, ImageError> {
    let mut outer = HashingReader::new(file);
    let size = {
        let mut buffered = BufReader::new(&mut outer);
        let magic = buffered
            .fill_buf()
            .map_err(|e| ImageError::Format(format!("reading {what}: {e}")))?
            .to_vec();
        let size = if magic.starts_with(&[0x1f, 0x8b]) {
            store.unpack_layer(flate2::read::GzDecoder::new(&mut buffered), diff_id, what)?
        } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            return Err(ImageError::Format(format!(
                "{what} is compressed with zstd, which this warden does not read yet: re-save the image with gzip layers (e.g. `skopeo copy --dest-compress-format gzip`)"
            )));
        } else {
            store.unpack_layer(&mut buffered, diff_id, what)?
        };
        std::io::copy(&mut buffered, &mut std::io::sink())
            .map_err(|e| ImageError::Format(format!("reading {what}: {e}")))?;
        size
    };
    outer.check(blob_digest, what)?;
    Ok(size)
}

#[derive(Debug, Deserialize)]
struct DockerManifest {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Vec<String>,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

fn read_docker_manifest(dir: &Path) -> Result<Vec<DockerManifest>, ImageError> {
    let path = dir.join("manifest.json");
    let bytes = read_document(&path)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ImageError::Format(format!("{} does not parse: {e}", path.display())))
}

/// A file the archive's `manifest.json` names, by a relative path that stays inside.
fn named_file(dir: &Path, name: &str) -> Result<PathBuf, ImageError> {
    let rel = extract::relative(name.as_bytes())
        .ok()
        .flatten()
        .ok_or_else(|| ImageError::Refused {
            entry: name.to_owned(),
            why: "a path out of the archive in manifest.json".to_owned(),
        })?;
    Ok(dir.join(rel))
}

fn from_docker(store: &Store, dir: &Path, name: Option<&str>) -> Result<Image, ImageError> {
    let manifests = read_docker_manifest(dir)?;
    let [manifest] = manifests.as_slice() else {
        return Err(ImageError::Format(format!(
            "the archive holds {} images; save one image per archive",
            manifests.len()
        )));
    };
    let config_path = named_file(dir, &manifest.config)?;
    let config_bytes = read_document(&config_path)?;
    use sha2::Digest as _;
    let digest = format!(
        "sha256:{}",
        hex::encode(sha2::Sha256::digest(&config_bytes))
    );
    // The configuration is named by its digest (`HEX.json`, or `blobs/sha256/HEX`).
    let stem = config_path
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.trim_end_matches(".json").to_owned())
        .unwrap_or_default();
    if stem.len() == 64 && format!("sha256:{stem}") != digest {
        return Err(ImageError::Digest {
            what: "the image's configuration".to_owned(),
            expected: format!("sha256:{stem}"),
            got: digest,
        });
    }
    let config = ImageConfiguration::from_reader(config_bytes.as_slice()).map_err(|e| {
        ImageError::Format(format!("{} does not parse: {e}", config_path.display()))
    })?;
    let diff_ids = config.rootfs().diff_ids();
    if diff_ids.len() != manifest.layers.len() {
        return Err(ImageError::Format(format!(
            "manifest.json lists {} layers but the configuration names {} diff ids",
            manifest.layers.len(),
            diff_ids.len()
        )));
    }
    let mut size = 0;
    for (i, (layer, diff_id)) in manifest.layers.iter().zip(diff_ids).enumerate() {
        let path = named_file(dir, layer)?;
        let file = open_regular(&path).map_err(|e| ImageError::io("opening", &path, e))?;
        let what = format!("layer {} ({layer})", i + 1);
        let mut buffered = BufReader::new(file);
        let magic = buffered
            .fill_buf()
            .map_err(|e| ImageError::io("reading", &path, e))?
            .to_vec();
        size += if magic.starts_with(&[0x1f, 0x8b]) {
            store.unpack_layer(flate2::read::GzDecoder::new(buffered), diff_id, &what)?
        } else {
            store.unpack_layer(buffered, diff_id, &what)?
        };
    }
    let name = name
        .map(str::to_owned)
        .or_else(|| manifest.repo_tags.first().cloned())
        .unwrap_or_else(|| digest.clone());
    Ok(image(name, digest, diff_ids.clone(), &config, size))
}

fn image(
    name: String,
    digest: String,
    layers: Vec<String>,
    config: &ImageConfiguration,
    size: u64,
) -> Image {
    let defaults = config.config().as_ref();
    Image {
        name,
        digest,
        layers,
        env: defaults.and_then(|c| c.env().clone()).unwrap_or_default(),
        workdir: defaults
            .and_then(|c| c.working_dir().clone())
            .filter(|w| !w.is_empty()),
        user: defaults
            .and_then(|c| c.user().clone())
            .filter(|u| !u.is_empty()),
        entrypoint: defaults
            .and_then(|c| c.entrypoint().clone())
            .unwrap_or_default(),
        cmd: defaults.and_then(|c| c.cmd().clone()).unwrap_or_default(),
        size,
        imported_ms: now_ms(),
    }
}
