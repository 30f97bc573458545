//! The files of a running cell, served from inside it. A file operation runs in a fork of the
//! cell's init: inside every namespace, cgroup, Landlock domain and seccomp filter of the cell,
//! as its user, so it can reach nothing the cell could not. It needs no program of the cell's
//! (an image without coreutils is served alike).
//!
//! Paths are relative to the cell's files root and walked one component at a time with
//! `openat` and `O_NOFOLLOW` from a descriptor of the root: a symlink on the way is read and
//! followed by the walk itself, and one that leads out of the root is refused where it is met,
//! so no check can be raced by a cell that swaps a directory for a link. Only regular files are
//! read or written (a FIFO, socket or device the cell made is refused, never opened for
//! blocking I/O).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use warden_protocol::FileKind;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use serde::{Deserialize, Serialize};

/// One file operation, with paths relative to the files root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum FileOp {
    /// A regular file's bytes on stdout (at most `limit`).
    Read {
        path: String,
        limit: u64,
    },
    /// Stdin becomes the file (replaced whole: a reader sees the old or the new one).
    /// `unchanged_since`: the BLAKE3 (hex) of what the file held when its writer read it; the
    /// file is replaced only while it still holds that, looked at just before the replacement
    /// (an edit's read, change and write must not lose what the cell wrote in between).
    Write {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unchanged_since: Option<String>,
    },
    /// The entries of a directory, as a JSON array of [`FileEntry`] on stdout.
    List {
        path: String,
    },
    /// One [`FileEntry`] as JSON on stdout (a symlink is described, not followed).
    Stat {
        path: String,
    },
    /// A directory, with the missing ones above it.
    Mkdir {
        path: String,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Rename {
        from: String,
        to: String,
    },
    /// A tar archive on stdin, unpacked into a directory (made if missing).
    Unpack {
        path: String,
    },
    /// A tar archive of a directory on stdout (at most `limit` bytes of file content).
    Pack {
        path: String,
        limit: u64,
    },
}

/// One entry of a directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    pub modified_s: u64,
    /// Where a symlink points (as written in it).
    pub target: Option<String>,
}

/// Why a file operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileErrorKind {
    NotFound,
    /// The path (through a symlink) leads out of the files root.
    Outside,
    /// Not a regular file (a FIFO, socket, device, or a directory where a file was meant).
    NotRegular,
    NotDirectory,
    Exists,
    ReadOnly,
    Denied,
    TooLarge,
    Invalid,
    /// The file no longer holds what its writer read (`FileOp::Write::unchanged_since`).
    Changed,
    Io,
}

/// A failed file operation: its kind, and a message that names the path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct FileError {
    pub kind: FileErrorKind,
    pub message: String,
}

fn error(kind: FileErrorKind, message: impl Into<String>) -> FileError {
    FileError {
        kind,
        message: message.into(),
    }
}

/// Most symlinks one walk follows.
const MAX_LINKS: u32 = 40;

/// Runs `op` with stdio 0, 1 and 2 and returns the process's exit status: 0, or 1 with the
/// error as JSON on stderr. Called in the forked child.
pub(crate) fn serve(root: &str, op: FileOp) -> i32 {
    let result = Walker::open(root).and_then(|walker| walker.run(op));
    match result {
        Ok(()) => {
            let _ = io::stdout().flush();
            0
        }
        Err(err) => {
            let _ = io::stdout().flush();
            let _ = io::stderr().write_all(&serde_json::to_vec(&err).unwrap_or_default());
            1
        }
    }
}

/// Whether the regular file `name` in `dir` still holds what hashes (BLAKE3, hex) to `read`:
/// `Changed` where it holds other bytes, or is gone.
fn still_holds(dir: &OwnedFd, name: &str, shown: &str, read: &str) -> Result<(), FileError> {
    let changed = || {
        error(
            FileErrorKind::Changed,
            format!(
                "{shown} changed since it was read (the cell wrote it meanwhile); read it again and make the change anew"
            ),
        )
    };
    let fd = match rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Err(changed()),
        Err(e) => return Err(io_error(shown, e)),
    };
    let stat = rustix::fs::fstat(&fd).map_err(|e| io_error(shown, e))?;
    regular(shown, stat.st_mode)?;
    let mut hasher = blake3::Hasher::new();
    io::copy(&mut std::fs::File::from(fd), &mut hasher).map_err(|e| std_error(shown, &e))?;
    match hasher.finalize().to_hex().as_str() == read {
        true => Ok(()),
        false => Err(changed()),
    }
}

/// Where a path leads: the directory holding its last component, and that component (`None`
/// when the path is the root, or a directory reached through `..` of a link).
struct Place {
    dir: OwnedFd,
    name: Option<String>,
}

struct Walker {
    root: OwnedFd,
    root_path: String,
}

impl Walker {
    fn open(root: &str) -> Result<Self, FileError> {
        let fd = rustix::fs::open(
            root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_error(&format!("opening the files root {root}"), e))?;
        Ok(Self {
            root: fd,
            root_path: root.trim_end_matches('/').to_owned(),
        })
    }

    fn shown(&self, path: &str) -> String {
        let path = path.trim_matches('/');
        if path.is_empty() {
            self.root_path.clone()
        } else {
            format!("{}/{path}", self.root_path)
        }
    }

    fn run(&self, op: FileOp) -> Result<(), FileError> {
        match op {
            FileOp::Read { path, limit } => self.read(&path, limit),
            FileOp::Write {
                path,
                unchanged_since,
            } => self.write(&path, &mut io::stdin().lock(), unchanged_since.as_deref()),
            FileOp::List { path } => {
                let entries = self.list(&path)?;
                print_json(&entries)
            }
            FileOp::Stat { path } => {
                let entry = self.stat(&path)?;
                print_json(&entry)
            }
            FileOp::Mkdir { path } => self.mkdir(&path).map(drop),
            FileOp::Remove { path, recursive } => self.remove(&path, recursive),
            FileOp::Rename { from, to } => self.rename(&from, &to),
            FileOp::Unpack { path } => self.unpack(&path, io::stdin().lock()),
            FileOp::Pack { path, limit } => self.pack(&path, limit, io::stdout().lock()),
        }
    }

    /// Walks `path` from the root. `follow_last`: a symlink as the last component is followed
    /// (else the link itself is the place). `make_dirs`: missing directories on the way are
    /// made.
    fn resolve(&self, path: &str, follow_last: bool, make_dirs: bool) -> Result<Place, FileError> {
        let shown = self.shown(path);
        let mut pending: VecDeque<String> = components(path)?;
        let mut stack: Vec<OwnedFd> = vec![dup(&self.root, &shown)?];
        let mut links = 0;
        while let Some(component) = pending.pop_front() {
            let top = stack
                .last()
                .ok_or_else(|| error(FileErrorKind::Io, "the walk lost its root"))?;
            if component == ".." {
                // Only link targets bring these; the root has no way up.
                if stack.len() == 1 {
                    return Err(error(
                        FileErrorKind::Outside,
                        format!(
                            "{shown} leads out of the files root {} (a symlink points above it); refused",
                            self.root_path
                        ),
                    ));
                }
                stack.pop();
                continue;
            }
            let last = pending.is_empty();
            if last && !follow_last {
                return Ok(Place {
                    dir: dup(top, &shown)?,
                    name: Some(component),
                });
            }
            let stat = match rustix::fs::statat(top, component.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            {
                Ok(stat) => stat,
                Err(rustix::io::Errno::NOENT) if last => {
                    return Ok(Place {
                        dir: dup(top, &shown)?,
                        name: Some(component),
                    });
                }
                Err(rustix::io::Errno::NOENT) if make_dirs => {
                    match rustix::fs::mkdirat(top, component.as_str(), Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => {
                            return Err(io_error(
                                &format!("making a directory on the way to {shown}"),
                                e,
                            ));
                        }
                    }
                    stack.push(open_dir(top, &component, &shown)?);
                    continue;
                }
                Err(e) => return Err(io_error(&shown, e)),
            };
            match FileType::from_raw_mode(stat.st_mode) {
                FileType::Symlink => {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(error(
                            FileErrorKind::Invalid,
                            format!("{shown}: more than {MAX_LINKS} symlinks on the way"),
                        ));
                    }
                    let target = rustix::fs::readlinkat(top, component.as_str(), Vec::new())
                        .map_err(|e| io_error(&shown, e))?;
                    // With its bad bytes replaced the target would be another path, which
                    // the walk would then follow instead.
                    let target = utf8_target(&shown, target)?;
                    let relative = match target.strip_prefix('/') {
                        Some(absolute) => {
                            // An absolute target is the cell's own path: it must be in the root.
                            let root = self.root_path.trim_start_matches('/');
                            let inside = if root.is_empty() {
                                Some(absolute)
                            } else {
                                absolute
                                    .strip_prefix(root)
                                    .filter(|rest| rest.is_empty() || rest.starts_with('/'))
                            };
                            let Some(inside) = inside else {
                                return Err(error(
                                    FileErrorKind::Outside,
                                    format!(
                                        "{shown} leads to {target}, outside the files root {} (a symlink points out); refused",
                                        self.root_path
                                    ),
                                ));
                            };
                            stack.truncate(1);
                            inside.to_owned()
                        }
                        None => target,
                    };
                    let mut spliced = components_of_link(&relative);
                    spliced.extend(pending);
                    pending = spliced;
                }
                FileType::Directory if !last => stack.push(open_dir(top, &component, &shown)?),
                _ if last => {
                    return Ok(Place {
                        dir: dup(top, &shown)?,
                        name: Some(component),
                    });
                }
                _ => {
                    return Err(error(
                        FileErrorKind::NotDirectory,
                        format!("{shown}: `{component}` on the way is not a directory"),
                    ));
                }
            }
        }
        let top = stack
            .pop()
            .ok_or_else(|| error(FileErrorKind::Io, "the walk lost its root"))?;
        Ok(Place {
            dir: top,
            name: None,
        })
    }

    fn read(&self, path: &str, limit: u64) -> Result<(), FileError> {
        let shown = self.shown(path);
        let place = self.resolve(path, true, false)?;
        let Some(name) = &place.name else {
            return Err(error(
                FileErrorKind::NotRegular,
                format!("{shown} is a directory; only regular files are read"),
            ));
        };
        let fd = rustix::fs::openat(
            &place.dir,
            name.as_str(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_error(&shown, e))?;
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_error(&shown, e))?;
        regular(&shown, stat.st_mode)?;
        if stat.st_size as u64 > limit {
            return Err(error(
                FileErrorKind::TooLarge,
                format!(
                    "{shown} has {} bytes, more than the {limit} a read takes",
                    stat.st_size
                ),
            ));
        }
        let mut file = std::fs::File::from(fd);
        let mut out = io::stdout().lock();
        let copied = io::copy(&mut (&mut file).take(limit + 1), &mut out)
            .map_err(|e| std_error(&shown, &e))?;
        if copied > limit {
            return Err(error(
                FileErrorKind::TooLarge,
                format!("{shown} grew past the {limit} bytes a read takes"),
            ));
        }
        Ok(())
    }

    /// Writes a regular file whole (through a temporary, renamed over it), making missing
    /// directories on the way.
    fn write(
        &self,
        path: &str,
        data: &mut impl Read,
        unchanged_since: Option<&str>,
    ) -> Result<(), FileError> {
        let shown = self.shown(path);
        let place = self.resolve(path, true, true)?;
        let Some(name) = &place.name else {
            return Err(error(
                FileErrorKind::NotRegular,
                format!("{shown} is a directory"),
            ));
        };
        let mode = match rustix::fs::statat(&place.dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => {
                regular(&shown, stat.st_mode)?;
                stat.st_mode & 0o777
            }
            Err(rustix::io::Errno::NOENT) => 0o644,
            Err(e) => return Err(io_error(&shown, e)),
        };
        let temporary = format!(".{name}.warden-{}", std::process::id());
        let fd = rustix::fs::openat(
            &place.dir,
            temporary.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )
        .map_err(|e| io_error(&shown, e))?;
        let mut file = std::fs::File::from(fd);
        let written = io::copy(data, &mut file)
            .map_err(|e| std_error(&shown, &e))
            .and_then(|_| match unchanged_since {
                Some(read) => still_holds(&place.dir, name, &shown, read),
                None => Ok(()),
            })
            .and_then(|()| {
                rustix::fs::renameat(&place.dir, temporary.as_str(), &place.dir, name.as_str())
                    .map_err(|e| io_error(&shown, e))
            });
        if written.is_err() {
            let _ = rustix::fs::unlinkat(&place.dir, temporary.as_str(), AtFlags::empty());
        }
        written
    }

    fn list(&self, path: &str) -> Result<Vec<FileEntry>, FileError> {
        let shown = self.shown(path);
        let dir = self.open_directory(path, &shown)?;
        let mut entries = Vec::new();
        let listing = rustix::fs::Dir::read_from(&dir).map_err(|e| io_error(&shown, e))?;
        for entry in listing {
            let entry = entry.map_err(|e| io_error(&shown, e))?;
            let name = utf8_name(&shown, entry.file_name())?;
            if name == "." || name == ".." {
                continue;
            }
            match describe(&dir, &name) {
                Ok(described) => entries.push(described),
                // Gone since the directory was read.
                Err(e) if e.kind == FileErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    /// The directory `path` leads to, opened for reading.
    fn open_directory(&self, path: &str, shown: &str) -> Result<OwnedFd, FileError> {
        let place = self.resolve(path, true, false)?;
        let name = place.name.as_deref().unwrap_or(".");
        rustix::fs::openat(
            &place.dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            rustix::io::Errno::NOTDIR => error(
                FileErrorKind::NotDirectory,
                format!("{shown} is not a directory"),
            ),
            other => io_error(shown, other),
        })
    }

    fn stat(&self, path: &str) -> Result<FileEntry, FileError> {
        let place = self.resolve(path, false, false)?;
        let mut entry = describe(&place.dir, place.name.as_deref().unwrap_or("."))?;
        if place.name.is_none() {
            entry.name = ".".to_owned();
        }
        Ok(entry)
    }

    fn mkdir(&self, path: &str) -> Result<OwnedFd, FileError> {
        let shown = self.shown(path);
        let place = self.resolve(path, true, true)?;
        let Some(name) = &place.name else {
            return dup(&place.dir, &shown);
        };
        match rustix::fs::mkdirat(&place.dir, name.as_str(), Mode::from_raw_mode(0o755)) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(io_error(&shown, e)),
        }
        open_dir(&place.dir, name, &shown).map_err(|e| match e.kind {
            FileErrorKind::NotDirectory | FileErrorKind::Invalid => error(
                FileErrorKind::Exists,
                format!("{shown} exists and is not a directory"),
            ),
            _ => e,
        })
    }

    fn remove(&self, path: &str, recursive: bool) -> Result<(), FileError> {
        let shown = self.shown(path);
        let place = self.resolve(path, false, false)?;
        let Some(name) = &place.name else {
            return Err(error(
                FileErrorKind::Invalid,
                "refusing to remove the files root itself",
            ));
        };
        let stat = rustix::fs::statat(&place.dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_error(&shown, e))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
            return rustix::fs::unlinkat(&place.dir, name.as_str(), AtFlags::empty())
                .map_err(|e| io_error(&shown, e));
        }
        if recursive {
            remove_tree(&place.dir, name, &shown)
        } else {
            rustix::fs::unlinkat(&place.dir, name.as_str(), AtFlags::REMOVEDIR).map_err(|e| match e
            {
                rustix::io::Errno::NOTEMPTY => error(
                    FileErrorKind::Invalid,
                    format!("{shown} is a directory that is not empty; remove it recursively"),
                ),
                other => io_error(&shown, other),
            })
        }
    }

    fn rename(&self, from: &str, to: &str) -> Result<(), FileError> {
        let (shown_from, shown_to) = (self.shown(from), self.shown(to));
        let source = self.resolve(from, false, false)?;
        let target = self.resolve(to, false, false)?;
        let (Some(source_name), Some(target_name)) = (&source.name, &target.name) else {
            return Err(error(
                FileErrorKind::Invalid,
                "the files root itself cannot be moved or replaced",
            ));
        };
        rustix::fs::statat(&source.dir, source_name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_error(&shown_from, e))?;
        rustix::fs::renameat(
            &source.dir,
            source_name.as_str(),
            &target.dir,
            target_name.as_str(),
        )
        .map_err(|e| io_error(&format!("moving {shown_from} to {shown_to}"), e))
    }

    fn unpack(&self, path: &str, archive: impl Read) -> Result<(), FileError> {
        let shown = self.shown(path);
        self.mkdir(path)?;
        let mut archive = tar::Archive::new(archive);
        let entries = archive
            .entries()
            .map_err(|e| std_error(&format!("reading the archive for {shown}"), &e))?;
        for entry in entries {
            let mut entry =
                entry.map_err(|e| std_error(&format!("reading the archive for {shown}"), &e))?;
            let raw = entry.path_bytes().into_owned();
            let member = String::from_utf8(raw).map_err(|_| {
                error(
                    FileErrorKind::Invalid,
                    "an archive member's name is not UTF-8",
                )
            })?;
            let member = member.trim_start_matches('/');
            if member.split('/').any(|part| part == "..") {
                return Err(error(
                    FileErrorKind::Invalid,
                    format!("the archive member `{member}` climbs out with `..`; refused"),
                ));
            }
            if components(member)?.is_empty() {
                continue; // `./`
            }
            let full = format!("{}/{member}", path.trim_end_matches('/'));
            let shown_member = self.shown(&full);
            let header = entry.header();
            let mode = header.mode().unwrap_or(0o644) & 0o777;
            match header.entry_type() {
                tar::EntryType::Directory => {
                    self.mkdir(&full)?;
                }
                tar::EntryType::Regular
                | tar::EntryType::Continuous
                | tar::EntryType::GNUSparse => {
                    let place = self.resolve(&full, false, true)?;
                    let Some(name) = &place.name else { continue };
                    // A link left where the file goes is replaced, never written through.
                    let _ = rustix::fs::unlinkat(&place.dir, name.as_str(), AtFlags::empty());
                    let fd = rustix::fs::openat(
                        &place.dir,
                        name.as_str(),
                        OFlags::WRONLY
                            | OFlags::CREATE
                            | OFlags::EXCL
                            | OFlags::NOFOLLOW
                            | OFlags::CLOEXEC,
                        Mode::from_raw_mode(mode),
                    )
                    .map_err(|e| io_error(&shown_member, e))?;
                    io::copy(&mut entry, &mut std::fs::File::from(fd))
                        .map_err(|e| std_error(&shown_member, &e))?;
                }
                tar::EntryType::Symlink => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| String::from_utf8_lossy(&t).into_owned())
                        .ok_or_else(|| {
                            error(
                                FileErrorKind::Invalid,
                                format!("the symlink {member} has no target"),
                            )
                        })?;
                    let place = self.resolve(&full, false, true)?;
                    let Some(name) = &place.name else { continue };
                    let _ = rustix::fs::unlinkat(&place.dir, name.as_str(), AtFlags::empty());
                    rustix::fs::symlinkat(target.as_str(), &place.dir, name.as_str())
                        .map_err(|e| io_error(&shown_member, e))?;
                }
                tar::EntryType::Link => {
                    let target = entry
                        .link_name_bytes()
                        .map(|t| String::from_utf8_lossy(&t).into_owned())
                        .ok_or_else(|| {
                            error(
                                FileErrorKind::Invalid,
                                format!("the hard link {member} has no target"),
                            )
                        })?;
                    let target = target.trim_start_matches('/');
                    if target.split('/').any(|part| part == "..") {
                        return Err(error(
                            FileErrorKind::Invalid,
                            format!("the hard link {member} climbs out with `..`; refused"),
                        ));
                    }
                    let source = self.resolve(
                        &format!("{}/{target}", path.trim_end_matches('/')),
                        false,
                        false,
                    )?;
                    let place = self.resolve(&full, false, true)?;
                    let (Some(source_name), Some(name)) = (&source.name, &place.name) else {
                        continue;
                    };
                    rustix::fs::linkat(
                        &source.dir,
                        source_name.as_str(),
                        &place.dir,
                        name.as_str(),
                        AtFlags::empty(),
                    )
                    .map_err(|e| io_error(&shown_member, e))?;
                }
                other => {
                    return Err(error(
                        FileErrorKind::Invalid,
                        format!(
                            "the archive member {member} is a {other:?}; only files, directories and links are unpacked"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn pack(&self, path: &str, limit: u64, out: impl Write) -> Result<(), FileError> {
        let shown = self.shown(path);
        let top = self.open_directory(path, &shown)?;
        let mut builder = tar::Builder::new(out);
        let mut content = 0u64;
        // As `tar -C DIR -c .` writes it: `./` first, every member under it.
        let mut top_header = tar::Header::new_gnu();
        top_header.set_entry_type(tar::EntryType::Directory);
        top_header.set_mode(0o755);
        top_header.set_size(0);
        append(&mut builder, &mut top_header, "./", None, io::empty())
            .map_err(|e| std_error(&shown, &e))?;
        // Directories still to be walked: their descriptor and their name in the archive.
        let mut todo: Vec<(OwnedFd, String)> = vec![(top, ".".to_owned())];
        while let Some((dir, prefix)) = todo.pop() {
            let listing = rustix::fs::Dir::read_from(&dir).map_err(|e| io_error(&shown, e))?;
            let mut names: Vec<String> = Vec::new();
            for entry in listing {
                let entry = entry.map_err(|e| io_error(&shown, e))?;
                let name = match prefix.strip_prefix("./") {
                    Some(rel) => utf8_name(&format!("{shown}/{rel}"), entry.file_name())?,
                    None => utf8_name(&shown, entry.file_name())?,
                };
                if name != "." && name != ".." {
                    names.push(name);
                }
            }
            names.sort();
            for name in names {
                let member = format!("{prefix}/{name}");
                let shown_member = format!("{shown}/{}", member.trim_start_matches("./"));
                let Ok(stat) = rustix::fs::statat(&dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                else {
                    continue; // gone since it was listed
                };
                let mut header = tar::Header::new_gnu();
                header.set_mode(stat.st_mode & 0o777);
                header.set_mtime(stat.st_mtime.max(0) as u64);
                match FileType::from_raw_mode(stat.st_mode) {
                    FileType::Directory => {
                        header.set_entry_type(tar::EntryType::Directory);
                        header.set_size(0);
                        append(
                            &mut builder,
                            &mut header,
                            &format!("{member}/"),
                            None,
                            io::empty(),
                        )
                        .map_err(|e| std_error(&shown_member, &e))?;
                        todo.push((open_dir(&dir, &name, &shown_member)?, member));
                    }
                    FileType::RegularFile => {
                        let fd = rustix::fs::openat(
                            &dir,
                            name.as_str(),
                            OFlags::RDONLY
                                | OFlags::NOFOLLOW
                                | OFlags::NONBLOCK
                                | OFlags::NOCTTY
                                | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(|e| io_error(&shown_member, e))?;
                        let stat =
                            rustix::fs::fstat(&fd).map_err(|e| io_error(&shown_member, e))?;
                        regular(&shown_member, stat.st_mode)?;
                        content += stat.st_size as u64;
                        if content > limit {
                            return Err(error(
                                FileErrorKind::TooLarge,
                                format!(
                                    "{shown} holds more than the {limit} bytes an archive takes"
                                ),
                            ));
                        }
                        header.set_entry_type(tar::EntryType::Regular);
                        header.set_size(stat.st_size as u64);
                        // Exactly the size announced, even if the file changes meanwhile.
                        let file = std::fs::File::from(fd);
                        let data = file
                            .take(stat.st_size as u64)
                            .chain(io::repeat(0))
                            .take(stat.st_size as u64);
                        append(&mut builder, &mut header, &member, None, data)
                            .map_err(|e| std_error(&shown_member, &e))?;
                    }
                    FileType::Symlink => {
                        let target = rustix::fs::readlinkat(&dir, name.as_str(), Vec::new())
                            .map_err(|e| io_error(&shown_member, e))?;
                        header.set_entry_type(tar::EntryType::Symlink);
                        header.set_size(0);
                        let target = utf8_target(&shown_member, target)?;
                        append(
                            &mut builder,
                            &mut header,
                            &member,
                            Some(&target),
                            io::empty(),
                        )
                        .map_err(|e| std_error(&shown_member, &e))?;
                    }
                    // FIFOs, sockets and devices have no content to archive.
                    _ => {}
                }
            }
        }
        builder.finish().map_err(|e| std_error(&shown, &e))
    }
}

/// Appends a member named exactly `name` (its `./` kept, as GNU tar writes it) where name and
/// link target fit the header; longer ones go through the GNU long-name records, which name
/// them without the `./`.
fn append<W: Write>(
    builder: &mut tar::Builder<W>,
    header: &mut tar::Header,
    name: &str,
    link: Option<&str>,
    data: impl Read,
) -> io::Result<()> {
    let fits = |text: &str| text.len() < 100;
    if fits(name) && link.is_none_or(fits) {
        let old = header.as_old_mut();
        old.name = [0; 100];
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(link) = link {
            old.linkname = [0; 100];
            old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_cksum();
        return builder.append(header, data);
    }
    match link {
        Some(link) => builder.append_link(header, name, link),
        None => builder.append_data(header, name, data),
    }
}

/// The components of a relative path; `..` and absolute paths are refused.
fn components(path: &str) -> Result<VecDeque<String>, FileError> {
    if path.starts_with('/') {
        return Err(error(
            FileErrorKind::Invalid,
            format!("path `{path}` is absolute; paths are relative to the files root"),
        ));
    }
    if path.contains('\0') {
        return Err(error(
            FileErrorKind::Invalid,
            "a path may not contain NUL bytes",
        ));
    }
    let mut out = VecDeque::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                return Err(error(
                    FileErrorKind::Invalid,
                    format!("path `{path}` contains `..`; paths stay inside the files root"),
                ));
            }
            other => out.push_back(other.to_owned()),
        }
    }
    Ok(out)
}

/// The components of a symlink's target (relative to the link's directory), `..` kept.
fn components_of_link(target: &str) -> VecDeque<String> {
    target
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .map(str::to_owned)
        .collect()
}

fn dup(fd: &OwnedFd, shown: &str) -> Result<OwnedFd, FileError> {
    fd.as_fd()
        .try_clone_to_owned()
        .map_err(|e| std_error(shown, &e))
}

/// Opens directory `name` in `dir` for the walk, refusing a link put there meanwhile.
fn open_dir(dir: &OwnedFd, name: &str, shown: &str) -> Result<OwnedFd, FileError> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::NOTDIR => error(
            FileErrorKind::NotDirectory,
            format!("{shown}: `{name}` on the way is not a directory"),
        ),
        rustix::io::Errno::LOOP => error(
            FileErrorKind::Invalid,
            format!("{shown}: `{name}` became a symlink while it was walked; try again"),
        ),
        other => io_error(shown, other),
    })
}

/// Refuses anything but a regular file.
fn regular(shown: &str, mode: u32) -> Result<(), FileError> {
    let what = match FileType::from_raw_mode(mode) {
        FileType::RegularFile => return Ok(()),
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice | FileType::BlockDevice => "a device",
        FileType::Symlink => "a symlink",
        FileType::Unknown => "not a regular file",
    };
    Err(error(
        FileErrorKind::NotRegular,
        format!("{shown} is {what}; only regular files are read or written"),
    ))
}

/// One directory entry, described without following it.
fn describe(dir: &OwnedFd, name: &str) -> Result<FileEntry, FileError> {
    let stat =
        rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| io_error(name, e))?;
    let kind = match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => FileKind::File,
        FileType::Directory => FileKind::Dir,
        FileType::Symlink => FileKind::Symlink,
        _ => FileKind::Other,
    };
    let target = (kind == FileKind::Symlink)
        .then(|| rustix::fs::readlinkat(dir, name, Vec::new()).ok())
        .flatten()
        .map(|t| utf8_target(name, t))
        .transpose()?;
    Ok(FileEntry {
        name: name.to_owned(),
        kind,
        size: stat.st_size as u64,
        mode: stat.st_mode & 0o7777,
        modified_s: stat.st_mtime.max(0) as u64,
        target,
    })
}

/// Removes a directory tree without following any link in it (deep trees included: the walk
/// keeps descriptors, not paths).
fn remove_tree(parent: &OwnedFd, name: &str, shown: &str) -> Result<(), FileError> {
    // Each level: the directory's descriptor, its parent's, and its name there.
    // Names as bytes: one that is not UTF-8 is removed by its own name, not by a lossy text
    // of it (which named nothing, or another file).
    let mut stack: Vec<(OwnedFd, OwnedFd, Vec<u8>)> = vec![(
        open_dir(parent, name, shown)?,
        dup(parent, shown)?,
        name.as_bytes().to_vec(),
    )];
    while let Some((dir, up, dir_name)) = stack.pop() {
        let mut subdirs = Vec::new();
        let listing = rustix::fs::Dir::read_from(&dir).map_err(|e| io_error(shown, e))?;
        for entry in listing {
            let entry = entry.map_err(|e| io_error(shown, e))?;
            let child = entry.file_name().to_bytes().to_vec();
            if child == b"." || child == b".." {
                continue;
            }
            let is_dir = rustix::fs::statat(&dir, child.as_slice(), AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|s| FileType::from_raw_mode(s.st_mode) == FileType::Directory);
            if is_dir {
                subdirs.push(child);
            } else {
                match rustix::fs::unlinkat(&dir, child.as_slice(), AtFlags::empty()) {
                    Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                    Err(e) => return Err(io_error(shown, e)),
                }
            }
        }
        if subdirs.is_empty() {
            match rustix::fs::unlinkat(&up, dir_name.as_slice(), AtFlags::REMOVEDIR) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(io_error(shown, e)),
            }
            continue;
        }
        // This directory again once its subdirectories are gone.
        let again = (dup(&dir, shown)?, up, dir_name);
        stack.push(again);
        for child in subdirs {
            let opened = rustix::fs::openat(
                &dir,
                child.as_slice(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| io_error(shown, e))?;
            stack.push((opened, dup(&dir, shown)?, child));
        }
    }
    Ok(())
}

/// A name read from a directory, as text; refused (naming it, its other bytes as `\xNN`) where
/// it is not UTF-8. Shown with its bad bytes replaced it would be another name: U+FFFD is a
/// name of its own, which a listing then showed (and an archive then held) for each such file,
/// with that file's size and bytes, and the files themselves not at all.
fn utf8_name(dir: &str, name: &std::ffi::CStr) -> Result<String, FileError> {
    let bytes = name.to_bytes();
    std::str::from_utf8(bytes).map(str::to_owned).map_err(|_| {
        error(
            FileErrorKind::Invalid,
            format!(
                "{dir}/{}: the name is not valid UTF-8 (its other bytes shown as \\xNN), and the files API names files by UTF-8 text only; rename it in the cell (`warden exec`)",
                warden_workspace::escaped(bytes),
            ),
        )
    })
}

/// A symlink's target, as text; refused where it is not UTF-8 (as [`utf8_name`]).
fn utf8_target(link: &str, target: std::ffi::CString) -> Result<String, FileError> {
    target.into_string().map_err(|e| {
        error(
            FileErrorKind::Invalid,
            format!(
                "{link}: the link's target `{}` is not valid UTF-8 (its other bytes shown as \\xNN); the files API follows and shows UTF-8 targets only",
                warden_workspace::escaped(e.into_cstring().as_bytes()),
            ),
        )
    })
}

fn print_json(value: &impl Serialize) -> Result<(), FileError> {
    let bytes = serde_json::to_vec(value).map_err(|e| error(FileErrorKind::Io, e.to_string()))?;
    io::stdout()
        .lock()
        .write_all(&bytes)
        .map_err(|e| std_error("writing the answer", &e))
}

fn io_error(what: &str, errno: rustix::io::Errno) -> FileError {
    let kind = match errno {
        rustix::io::Errno::NOENT => FileErrorKind::NotFound,
        rustix::io::Errno::ROFS => FileErrorKind::ReadOnly,
        rustix::io::Errno::ACCESS | rustix::io::Errno::PERM => FileErrorKind::Denied,
        rustix::io::Errno::EXIST => FileErrorKind::Exists,
        rustix::io::Errno::NOTDIR => FileErrorKind::NotDirectory,
        rustix::io::Errno::ISDIR => FileErrorKind::NotRegular,
        rustix::io::Errno::LOOP | rustix::io::Errno::NAMETOOLONG => FileErrorKind::Invalid,
        // Opening a socket (or a FIFO without a reader, or a device without its driver).
        rustix::io::Errno::NXIO => FileErrorKind::NotRegular,
        rustix::io::Errno::FBIG | rustix::io::Errno::NOSPC | rustix::io::Errno::DQUOT => {
            FileErrorKind::TooLarge
        }
        _ => FileErrorKind::Io,
    };
    let reason = match errno {
        rustix::io::Errno::NOENT => "no such file or directory in the cell".to_owned(),
        rustix::io::Errno::ROFS => "read-only in the cell".to_owned(),
        rustix::io::Errno::NOSPC | rustix::io::Errno::DQUOT => {
            "the cell's disk is full (limits.disk)".to_owned()
        }
        other => io::Error::from(other).to_string(),
    };
    error(kind, format!("{what}: {reason}"))
}

fn std_error(what: &str, err: &io::Error) -> FileError {
    match err.raw_os_error() {
        Some(code) => io_error(what, rustix::io::Errno::from_raw_os_error(code)),
        None => error(FileErrorKind::Io, format!("{what}: {err}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the caller asked wrongly (a name too long, a socket to read) is told as such, not
    /// as the warden's failure (an API 500 where a 400 is due).
    #[test]
    fn errors_of_what_was_asked_are_not_the_wardens() {
        use rustix::io::Errno;
        assert_eq!(
            io_error("x", Errno::NAMETOOLONG).kind,
            FileErrorKind::Invalid
        );
        assert_eq!(io_error("x", Errno::NXIO).kind, FileErrorKind::NotRegular);
        assert_eq!(io_error("x", Errno::IO).kind, FileErrorKind::Io);
    }

    /// A write given what the file held when it was read replaces it only while it still
    /// holds that: an edit whose file the cell wrote (or removed) since its read is refused,
    /// and the cell's bytes stay.
    #[test]
    fn a_write_made_from_a_read_replaces_only_what_was_read() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_str().unwrap();
        let files = Walker::open(root).unwrap();
        let file = dir.path().join("notes.txt");
        std::fs::write(&file, "as read\n").unwrap();
        let read = blake3::hash(b"as read\n").to_hex().to_string();
        // The cell writes the file after the edit's read.
        std::fs::write(&file, "the cell's own\n").unwrap();
        let err = files
            .write("notes.txt", &mut &b"edited\n"[..], Some(&read))
            .unwrap_err();
        assert_eq!(err.kind, FileErrorKind::Changed, "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "the cell's own\n");
        // Nothing of the refused write is left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // Unchanged since the read: replaced.
        let read = blake3::hash(b"the cell's own\n").to_hex().to_string();
        files
            .write("notes.txt", &mut &b"edited\n"[..], Some(&read))
            .unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "edited\n");
        // Removed since the read: refused, and not made again.
        std::fs::remove_file(&file).unwrap();
        let err = files
            .write("notes.txt", &mut &b"again\n"[..], Some(&read))
            .unwrap_err();
        assert_eq!(err.kind, FileErrorKind::Changed, "{err}");
        assert!(!file.exists());
        // A plain write asks nothing of what was there.
        files
            .write("notes.txt", &mut &b"plain\n"[..], None)
            .unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "plain\n");
    }
}
