//! Unpacks one layer (a tar stream) into a directory that can never be left: every path is
//! resolved one component at a time beneath the layer's root with the kernel refusing symlinks
//! on the way (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), the last component is
//! created with `O_EXCL | O_NOFOLLOW`, and what an image has no business carrying is refused
//! with the entry's name: absolute paths, `..`, hard links to anything but a file of the same
//! layer, device nodes and FIFOs, sparse files, more bytes than the limit, paths more than
//! [`MAX_DEPTH`] directories deep, and an entry's headers (GNU long names, PAX records) past
//! [`HEADER_LIMIT`] bytes, which the tar reader would otherwise hold in memory whole. Set-id
//! bits are dropped (no process of a cell can use them). Whiteouts become what overlayfs reads: a
//! character device 0:0 for `.wh.NAME`, `user.overlay.opaque=y` for `.wh..wh..opq` (the cells
//! mount their layers with `userxattr`).

use std::ffi::{OsStr, OsString};
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};

use crate::ImageError;

/// What one layer may hold at most.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes of file content.
    pub bytes: u64,
    /// Entries of any kind.
    pub entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            bytes: 16 << 30,
            entries: 2_000_000,
        }
    }
}

/// What an unpacked layer holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unpacked {
    pub entries: u64,
    pub bytes: u64,
    /// Files whose set-user-id or set-group-id bit was dropped.
    pub setid_dropped: u64,
    pub whiteouts: u64,
}

/// The most bytes the tar reader may read by itself for one entry: its header blocks, its GNU
/// long name and long link and its PAX records (which it keeps in memory whole), and what it
/// skips of an entry that is not a file. Go's `archive/tar` allows the same 1 MiB.
pub(crate) const HEADER_LIMIT: u64 = 1 << 20;

/// The most directories an entry's path may go down. Far past any real image; a deeper tree
/// could not be removed again (the standard library's `remove_dir_all` holds a descriptor for
/// each level, and runs out of them).
pub(crate) const MAX_DEPTH: usize = 256;
const _: () = assert!(
    MAX_DEPTH == 256,
    "`relative` names the depth in its message"
);

/// An entry's name as an error shows it: lossy UTF-8, cut short (a name may be a megabyte).
pub(crate) fn shown(raw: &[u8]) -> String {
    const SHOWN: usize = 200;
    let mut text = String::from_utf8_lossy(&raw[..raw.len().min(SHOWN)]).into_owned();
    if raw.len() > SHOWN {
        text.push_str(&format!("... ({} bytes)", raw.len()));
    }
    text
}

/// A reader under a tar reader that counts what the tar reader reads by itself (between the
/// [`Metered::start`] and [`Metered::stop`] around each `next()` of its entries) and fails it
/// past [`HEADER_LIMIT`]; what the caller then reads of an entry's data is not counted.
pub(crate) struct Metered<R> {
    inner: R,
    meter: std::rc::Rc<std::cell::Cell<Option<u64>>>,
}

/// The switch of a [`Metered`] reader, held by the one who iterates the entries.
#[derive(Clone)]
pub(crate) struct Meter(std::rc::Rc<std::cell::Cell<Option<u64>>>);

impl Meter {
    pub(crate) fn start(&self) {
        self.0.set(Some(0));
    }

    pub(crate) fn stop(&self) {
        self.0.set(None);
    }
}

impl<R> Metered<R> {
    pub(crate) fn new(inner: R) -> (Self, Meter) {
        let meter = std::rc::Rc::new(std::cell::Cell::new(None));
        (
            Self {
                inner,
                meter: meter.clone(),
            },
            Meter(meter),
        )
    }
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(used) = self.meter.get() else {
            return self.inner.read(buf);
        };
        // Never more than one byte past the limit, so that passing it is seen.
        let room = usize::try_from(HEADER_LIMIT + 1 - used.min(HEADER_LIMIT)).unwrap_or(usize::MAX);
        let take = buf.len().min(room);
        let n = self.inner.read(&mut buf[..take])?;
        let used = used + n as u64;
        self.meter.set(Some(used));
        if used > HEADER_LIMIT {
            return Err(io::Error::other(format!(
                "an entry's headers (its GNU long name or PAX records, or data skipped after an entry that is not a file) pass {HEADER_LIMIT} bytes, which no image needs; the archive is hostile or damaged"
            )));
        }
        Ok(n)
    }
}

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

fn resolve() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
}

/// Unpacks the tar stream `input` into `root` (an empty directory).
pub fn unpack(input: impl Read, root: &Path, limits: Limits) -> Result<Unpacked, ImageError> {
    let root_fd = rustix::fs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| ImageError::io("opening", root, e.into()))?;
    let (input, meter) = Metered::new(input);
    let mut archive = tar::Archive::new(input);
    let mut done = Unpacked::default();
    // Directories get their own modes last (a read-only one would refuse what goes in it).
    let mut dir_modes: Vec<(PathBuf, u32)> = Vec::new();
    let mut entries = archive
        .entries()
        .map_err(|e| ImageError::Format(format!("reading the layer: {e}")))?;
    loop {
        meter.start();
        let next = entries.next();
        meter.stop();
        let Some(entry) = next else { break };
        let mut entry = entry.map_err(|e| ImageError::Format(format!("reading the layer: {e}")))?;
        done.entries += 1;
        if done.entries > limits.entries {
            return Err(ImageError::Refused {
                entry: String::new(),
                why: format!("the layer has more than {} entries", limits.entries),
            });
        }
        let raw = entry.path_bytes().into_owned();
        let shown = shown(&raw);
        let refuse = |why: String| ImageError::Refused {
            entry: shown.clone(),
            why,
        };
        let rel = relative(&raw).map_err(|why| refuse(why.to_owned()))?;
        let Some(rel) = rel else {
            // The layer's root itself (`./`).
            continue;
        };
        let header = entry.header();
        let kind = header.entry_type();
        let mode = header.mode().unwrap_or(0o644);
        let (parent_path, name) = split(&rel);
        // Whiteouts name what a lower layer had.
        if let Some(hidden) = name.to_str().and_then(|n| n.strip_prefix(WHITEOUT)) {
            let parent = make_dirs(&root_fd, &parent_path).map_err(|e| refuse(e.to_string()))?;
            if name == OPAQUE {
                let dir = rustix::fs::openat2(
                    &root_fd,
                    dot_if_empty(&parent_path),
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                    resolve(),
                )
                .map_err(|e| refuse(format!("opening its directory: {e}")))?;
                rustix::fs::fsetxattr(
                    &dir,
                    "user.overlay.opaque",
                    b"y",
                    rustix::fs::XattrFlags::empty(),
                )
                .map_err(|e| refuse(format!("marking its directory opaque: {e}")))?;
            } else {
                if hidden.is_empty() || hidden == "." || hidden == ".." || hidden.contains('/') {
                    return Err(refuse("a whiteout of no name".to_owned()));
                }
                remove_existing(&parent, OsStr::new(hidden)).map_err(|e| refuse(e.to_string()))?;
                rustix::fs::mknodat(
                    &parent,
                    hidden,
                    FileType::CharacterDevice,
                    Mode::empty(),
                    rustix::fs::makedev(0, 0),
                )
                .map_err(|e| refuse(format!("making its whiteout: {e}")))?;
            }
            done.whiteouts += 1;
            continue;
        }
        match kind {
            tar::EntryType::Directory => {
                let parent =
                    make_dirs(&root_fd, &parent_path).map_err(|e| refuse(e.to_string()))?;
                match rustix::fs::mkdirat(&parent, &name, Mode::from_raw_mode(0o700)) {
                    Ok(()) => {}
                    Err(rustix::io::Errno::EXIST) => {
                        let stat = rustix::fs::statat(&parent, &name, AtFlags::SYMLINK_NOFOLLOW)
                            .map_err(|e| refuse(e.to_string()))?;
                        if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
                            remove_existing(&parent, &name).map_err(|e| refuse(e.to_string()))?;
                            rustix::fs::mkdirat(&parent, &name, Mode::from_raw_mode(0o700))
                                .map_err(|e| refuse(format!("making the directory: {e}")))?;
                        }
                    }
                    Err(e) => return Err(refuse(format!("making the directory: {e}"))),
                }
                dir_modes.push((rel.clone(), mode));
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.size();
                if done.bytes.saturating_add(size) > limits.bytes {
                    return Err(refuse(format!(
                        "the layer's files would pass {} bytes, the limit of one layer",
                        limits.bytes
                    )));
                }
                let parent =
                    make_dirs(&root_fd, &parent_path).map_err(|e| refuse(e.to_string()))?;
                remove_existing(&parent, &name).map_err(|e| refuse(e.to_string()))?;
                let file = rustix::fs::openat(
                    &parent,
                    &name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| refuse(format!("creating the file: {e}")))?;
                let mut file = std::fs::File::from(file);
                let copied = io::copy(&mut (&mut entry).take(size), &mut file)
                    .map_err(|e| refuse(format!("writing the file: {e}")))?;
                if copied != size {
                    return Err(refuse(format!(
                        "the layer ends inside this file ({copied} of {size} bytes)"
                    )));
                }
                done.bytes += size;
                let (kept, dropped) = file_mode(mode);
                done.setid_dropped += u64::from(dropped);
                rustix::fs::fchmod(&file, Mode::from_raw_mode(kept))
                    .map_err(|e| refuse(format!("setting its mode: {e}")))?;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                if target.is_empty() || target.contains(&0) {
                    return Err(refuse("a symlink to nothing".to_owned()));
                }
                let parent =
                    make_dirs(&root_fd, &parent_path).map_err(|e| refuse(e.to_string()))?;
                remove_existing(&parent, &name).map_err(|e| refuse(e.to_string()))?;
                // The target is only text: it is read inside the cell, where `/` is the image.
                rustix::fs::symlinkat(OsStr::from_bytes(&target), &parent, &name)
                    .map_err(|e| refuse(format!("making the symlink: {e}")))?;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                let target_rel = relative(&target)
                    .map_err(|why| refuse(format!("a hard link whose target is {why}")))?
                    .ok_or_else(|| refuse("a hard link to the layer's root".to_owned()))?;
                let source = rustix::fs::openat2(
                    &root_fd,
                    &target_rel,
                    OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                    resolve(),
                )
                .map_err(|e| {
                    refuse(format!(
                        "a hard link to {} (not a file of this layer: {e})",
                        target_rel.display()
                    ))
                })?;
                let stat = rustix::fs::fstat(&source).map_err(|e| refuse(e.to_string()))?;
                if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
                    return Err(refuse(format!(
                        "a hard link to {}, which is not a regular file",
                        target_rel.display()
                    )));
                }
                let parent =
                    make_dirs(&root_fd, &parent_path).map_err(|e| refuse(e.to_string()))?;
                remove_existing(&parent, &name).map_err(|e| refuse(e.to_string()))?;
                // Linked by the descriptor resolved beneath the root, never by its name again.
                let by_fd = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&source));
                rustix::fs::linkat(
                    rustix::fs::CWD,
                    by_fd.as_str(),
                    &parent,
                    &name,
                    AtFlags::SYMLINK_FOLLOW,
                )
                .map_err(|e| refuse(format!("making the hard link: {e}")))?;
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                let (major, minor) = (
                    header.device_major().ok().flatten().unwrap_or(0),
                    header.device_minor().ok().flatten().unwrap_or(0),
                );
                return Err(refuse(format!(
                    "a device node ({major}:{minor}): images may not carry devices (a cell gets its own /dev)"
                )));
            }
            tar::EntryType::Fifo => {
                return Err(refuse("a FIFO: images may not carry them".to_owned()));
            }
            tar::EntryType::GNUSparse => {
                let claimed = header
                    .as_gnu()
                    .and_then(|g| g.real_size().ok())
                    .unwrap_or(0);
                return Err(refuse(format!(
                    "a sparse file of {claimed} bytes: sparse entries are not accepted"
                )));
            }
            other => {
                return Err(refuse(format!(
                    "an entry of type {other:?}, which no image needs"
                )));
            }
        }
    }
    // Deepest first, so that a parent's mode never stops its child's.
    dir_modes.sort_by_key(|(path, _)| std::cmp::Reverse(path.components().count()));
    for (path, mode) in dir_modes {
        let dir = rustix::fs::openat2(
            &root_fd,
            &path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            resolve(),
        )
        .map_err(|e| ImageError::Refused {
            entry: path.display().to_string(),
            why: format!("opening the directory to set its mode: {e}"),
        })?;
        let (kept, dropped) = file_mode(mode);
        done.setid_dropped += u64::from(dropped);
        // The owner keeps what it needs to remove the layer again.
        rustix::fs::fchmod(&dir, Mode::from_raw_mode(kept | 0o700)).map_err(|e| {
            ImageError::Refused {
                entry: path.display().to_string(),
                why: format!("setting its mode: {e}"),
            }
        })?;
    }
    Ok(done)
}

/// The permission bits kept (set-id bits dropped), and whether any were.
fn file_mode(mode: u32) -> (u32, bool) {
    let kept = mode & 0o1777;
    (kept, mode & 0o6000 != 0)
}

/// An entry's path as a relative path of normal components; `None` for the root itself.
pub(crate) fn relative(raw: &[u8]) -> Result<Option<PathBuf>, &'static str> {
    if raw.contains(&0) {
        return Err("a path with a NUL byte");
    }
    let path = Path::new(OsStr::from_bytes(raw));
    let mut out = PathBuf::new();
    let mut depth = 0;
    for component in path.components() {
        match component {
            Component::Normal(part) => {
                depth += 1;
                if depth > MAX_DEPTH + 1 {
                    return Err("a path more than 256 directories deep (no image needs one)");
                }
                out.push(part)
            }
            Component::CurDir => {}
            Component::ParentDir => return Err("a path with `..`"),
            Component::RootDir | Component::Prefix(_) => return Err("an absolute path"),
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

fn split(rel: &Path) -> (PathBuf, OsString) {
    let name = rel.file_name().map(OsStr::to_owned).unwrap_or_default();
    let parent = rel.parent().map(Path::to_path_buf).unwrap_or_default();
    (parent, name)
}

fn dot_if_empty(path: &Path) -> &Path {
    if path.as_os_str().is_empty() {
        Path::new(".")
    } else {
        path
    }
}

/// Opens (making what is missing) each directory of `path` beneath `root`, refusing symlinks.
fn make_dirs(root: &OwnedFd, path: &Path) -> io::Result<OwnedFd> {
    let mut current = rustix::fs::openat(
        root,
        ".",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    for part in path.components() {
        let Component::Normal(part) = part else {
            return Err(io::Error::other("not a relative path"));
        };
        let open = |at: &OwnedFd| {
            rustix::fs::openat2(
                at,
                part,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                resolve(),
            )
        };
        current = match open(&current) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => {
                match rustix::fs::mkdirat(&current, part, Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                open(&current)?
            }
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
                return Err(io::Error::other(format!(
                    "its path goes through {}, which is a symlink or not a directory (the layer cannot be left through a link)",
                    part.to_string_lossy()
                )));
            }
            Err(e) => return Err(e.into()),
        };
    }
    Ok(current)
}

/// Removes what an earlier entry of the same layer put at `name` (a directory only if empty).
fn remove_existing(parent: &impl AsFd, name: &OsStr) -> io::Result<()> {
    match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => {
            let flags = if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
                AtFlags::REMOVEDIR
            } else {
                AtFlags::empty()
            };
            rustix::fs::unlinkat(parent, name, flags).map_err(|e| {
                io::Error::other(format!(
                    "replacing what an earlier entry made at {}: {e}",
                    name.to_string_lossy()
                ))
            })
        }
        Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
