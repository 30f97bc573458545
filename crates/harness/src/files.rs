//! Files of a running cell, through the API.
//!
//! Every operation runs *inside* the cell, in a fork of its init (the tier's file service):
//! as the cell's user, under its mount namespace, Landlock domain and seccomp filter, so the API
//! can read or change nothing the cell itself could not. Paths are relative to the cell's files
//! root (its workspace mount: the project, or the scratch directory of a cell without one,
//! which is also where its commands start); `..` and absolute paths are refused, and the walk
//! inside the cell refuses a symlink that leads out of the root where it meets it.
//!
//! Nothing a cell controls can hold the harness: only regular files are read or written, each
//! operation has a deadline ([`FILE_DEADLINE`]) after which it is killed, and one whose caller
//! goes away is killed with it (the init kills a process whose client hangs up). At most
//! [`FILE_SLOTS`] operations of one cell run at once; the others wait their turn (within the
//! same deadline), so a flood of requests for one cell is not a flood of processes in it, and
//! the daemon's time goes on serving the rest (another cell's pause or kill lands at once).

use std::sync::Arc;
use std::time::Duration;

use crate::FileInfo;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use warden_cell::Status;
use warden_cell::tier::{ExecEvent, FileEntry, FileError, FileErrorKind, FileOp};

use crate::exec::Events;
use crate::{CellFailure, FilesError, Harness, HarnessError, WorkspaceError};

/// Largest file read or archive made through the API.
pub const READ_LIMIT: u64 = 64 * 1024 * 1024;
/// Largest file written through the API (the faces' upload limit): what a face hands the
/// harness is held in the daemon's memory whole.
pub const WRITE_LIMIT: u64 = 64 * 1024 * 1024;
/// Longest a file operation may take before it is killed (its wait for a place included).
pub const FILE_DEADLINE: Duration = Duration::from_secs(60);
/// File operations of one cell that run at once.
pub const FILE_SLOTS: usize = 8;
/// The longest path the files API takes (the kernel's `PATH_MAX`).
const PATH_LIMIT: usize = 4096;

/// The API's view of an entry (its mode in octal).
fn file_info(entry: FileEntry) -> FileInfo {
    FileInfo {
        name: entry.name,
        kind: entry.kind,
        size: entry.size,
        mode: format!("{:o}", entry.mode),
        modified_s: entry.modified_s,
        target: entry.target,
    }
}

impl Harness {
    /// The directory that file paths of this cell are relative to: its workspace mount, with
    /// or without a host workspace behind it.
    fn files_root(&self, name: &str) -> Result<String, HarnessError> {
        self.entry(name)?;
        let policy = self
            .live
            .lock()
            .ok()
            .and_then(|l| l.get(name).map(|l| l.policy.clone()))
            .ok_or_else(|| {
                HarnessError::from(CellFailure::Ended(format!("cell `{name}` has ended")))
            })?;
        Ok(policy.filesystem.workspace.mount.display().to_string())
    }

    /// Checks a relative path; returns the root and the path as the cell sees it.
    fn cell_path(&self, name: &str, path: &str) -> Result<(String, String), HarnessError> {
        let root = self.files_root(name)?;
        if path.contains('\0') {
            return Err(HarnessError::from(FilesError::Invalid(
                "a path may not contain NUL bytes".into(),
            )));
        }
        if path.len() > PATH_LIMIT {
            // Longer than any path the cell's kernel takes; the request carrying it was refused
            // by the socket to the cell, as if the cell were in the wrong state.
            return Err(HarnessError::from(FilesError::Invalid(format!(
                "a path of {} bytes is longer than the {PATH_LIMIT} a path may be",
                path.len()
            ))));
        }
        if path.starts_with('/') {
            return Err(HarnessError::from(FilesError::Invalid(format!(
                "path `{path}` is absolute; file paths are relative to the cell's files root {root}"
            ))));
        }
        if path.split('/').any(|part| part == "..") {
            return Err(HarnessError::from(FilesError::Invalid(format!(
                "path `{path}` contains `..`; file paths stay inside the cell's files root {root}"
            ))));
        }
        let trimmed = path.trim_matches('/');
        let full = if trimmed.is_empty() || trimmed == "." {
            root.clone()
        } else {
            format!("{}/{trimmed}", root.trim_end_matches('/'))
        };
        Ok((root, full))
    }

    /// Every one of the cell's file slots, so that no operation of the files API runs while
    /// they are held (an apply's copy). Waits for those under way, up to [`FILE_DEADLINE`].
    /// `None` for a cell that is not live: it runs no file operation.
    pub(crate) async fn hold_file_slots(
        &self,
        name: &str,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, HarnessError> {
        let Some(slots) = self
            .live
            .lock()
            .ok()
            .and_then(|l| l.get(name).map(|l| Arc::clone(&l.file_slots)))
        else {
            return Ok(None);
        };
        let all = u32::try_from(FILE_SLOTS).unwrap_or(u32::MAX);
        match tokio::time::timeout(FILE_DEADLINE, slots.acquire_many_owned(all)).await {
            Ok(Ok(held)) => Ok(Some(held)),
            _ => Err(HarnessError::from(WorkspaceError::Conflict(format!(
                "cell `{name}` had file operations under way for {} s; try again when they have ended",
                FILE_DEADLINE.as_secs()
            )))),
        }
    }

    /// Runs one file operation inside the cell: `stdin` is fed to it, its answer (at most
    /// `limit` bytes) returned. It is killed at [`FILE_DEADLINE`], past `limit`, or when the
    /// future is dropped.
    async fn file_op(
        &self,
        name: &str,
        op: FileOp,
        stdin: Option<Vec<u8>>,
        limit: u64,
    ) -> Result<Vec<u8>, HarnessError> {
        let deadline = tokio::time::Instant::now() + FILE_DEADLINE;
        let root = self.files_root(name)?;
        let slots = self
            .live
            .lock()
            .ok()
            .and_then(|l| l.get(name).map(|l| Arc::clone(&l.file_slots)))
            .ok_or_else(|| {
                HarnessError::from(CellFailure::Ended(format!("cell `{name}` has ended")))
            })?;
        let Ok(Ok(_slot)) = tokio::time::timeout_at(deadline, slots.acquire_owned()).await else {
            return Err(HarnessError::from(FilesError::TimedOut(format!(
                "cell `{name}` had {FILE_SLOTS} file operations under way for {} s, and this one did not get its turn; try again when they have ended",
                FILE_DEADLINE.as_secs()
            ))));
        };
        let (cell, status) = self.live_with_status(name)?;
        if status == Status::Paused {
            return Err(HarnessError::from(CellFailure::Paused(format!(
                "cell `{name}` is paused; resume it first"
            ))));
        }
        let pipe = || {
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(|e| HarnessError::from(FilesError::Failed(format!("creating pipes: {e}"))))
        };
        let (stdin_r, stdin_w) = pipe()?;
        let (stdout_r, stdout_w) = pipe()?;
        let (stderr_r, stderr_w) = pipe()?;
        let session = cell
            .file_op(&root, &op, [&stdin_r, &stdout_w, &stderr_w])
            .map_err(|e| HarnessError::from(FilesError::State(e.to_string())))?;
        drop((stdin_r, stdout_w, stderr_w));
        let events = Events::new(Arc::clone(&session), name);
        let io_error = |e: std::io::Error| {
            HarnessError::from(FilesError::Failed(format!("file operation: {e}")))
        };
        let mut input = tokio::net::unix::pipe::Sender::from_owned_fd(stdin_w).map_err(io_error)?;
        let mut output =
            tokio::net::unix::pipe::Receiver::from_owned_fd(stdout_r).map_err(io_error)?;
        let mut errors =
            tokio::net::unix::pipe::Receiver::from_owned_fd(stderr_r).map_err(io_error)?;
        let feed = async move {
            if let Some(data) = stdin {
                let _ = input.write_all(&data).await;
            }
            // Dropped: the end of the input.
        };
        let killer = Arc::clone(&session);
        let collect = async move {
            let mut out = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match output.read(&mut buf).await {
                    Ok(0) | Err(_) => return Some(out),
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                }
                if out.len() as u64 > limit {
                    let _ = killer.signal(libc::SIGKILL);
                    return None;
                }
            }
        };
        let complaints = async move {
            let mut text = Vec::new();
            let _ = (&mut errors).take(64 * 1024).read_to_end(&mut text).await;
            text
        };
        let all = async { tokio::join!(feed, collect, complaints, events.last()) };
        let Ok(((), out, complaint, end)) = tokio::time::timeout_at(deadline, all).await else {
            let _ = session.signal(libc::SIGKILL);
            return Err(HarnessError::from(FilesError::TimedOut(format!(
                "the file operation in cell `{name}` did not finish within {} s and was killed (the cell may hold the file, or its disk is slow)",
                FILE_DEADLINE.as_secs()
            ))));
        };
        let Some(out) = out else {
            return Err(HarnessError::from(FilesError::Invalid(format!(
                "more than {limit} bytes: too large to transfer through the API"
            ))));
        };
        match end {
            Ok(ExecEvent::Exited { code: 0, .. }) => Ok(out),
            Ok(ExecEvent::Exited { .. }) => {
                Err(match serde_json::from_slice::<FileError>(&complaint) {
                    Ok(err) => file_error(err),
                    Err(_) => HarnessError::from(FilesError::Failed(format!(
                        "the file operation failed: {}",
                        String::from_utf8_lossy(&complaint).trim()
                    ))),
                })
            }
            Ok(ExecEvent::Failed { message, .. }) => Err(HarnessError::from(FilesError::State(
                format!("the cell could not run the file operation: {message}"),
            ))),
            Ok(other) => Err(HarnessError::from(FilesError::State(format!(
                "the file operation ended with {other:?} (the cell's memory limit, or a kill)"
            )))),
            Err(err) => Err(HarnessError::from(FilesError::State(err.to_string()))),
        }
    }

    /// The answer of an operation that prints JSON.
    async fn file_json<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        op: FileOp,
    ) -> Result<T, HarnessError> {
        let out = self.file_op(name, op, None, READ_LIMIT).await?;
        serde_json::from_slice(&out).map_err(|e| {
            HarnessError::from(FilesError::Failed(format!(
                "the cell's file service answered: {e}"
            )))
        })
    }

    pub async fn read_file(&self, name: &str, path: &str) -> Result<Vec<u8>, HarnessError> {
        let (_, full) = self.cell_path(name, path)?;
        let data = self
            .file_op(
                name,
                FileOp::Read {
                    path: path.to_owned(),
                    limit: READ_LIMIT,
                },
                None,
                READ_LIMIT,
            )
            .await?;
        self.record(
            Some(name),
            "file.read",
            json!({ "path": full, "bytes": data.len() }),
        )
        .await?;
        Ok(data)
    }

    pub async fn write_file(
        &self,
        name: &str,
        path: &str,
        data: Vec<u8>,
    ) -> Result<(), HarnessError> {
        self.write_file_if(name, path, data, None).await
    }

    /// Replaces `old` with `new` in the text file `path` of the cell (every occurrence with
    /// `all`, else the one there must be; see `tools::edit_text`): read, changed, and written
    /// back only while the file still holds what was read, so that nothing the cell wrote in
    /// between is lost (the edit is refused instead, saying to read the file again). How many
    /// occurrences were replaced.
    pub async fn edit_file(
        &self,
        name: &str,
        path: &str,
        old: &str,
        new: &str,
        all: bool,
    ) -> Result<usize, HarnessError> {
        if old.is_empty() {
            return Err(HarnessError::from(FilesError::Invalid(
                "the text to replace may not be empty".into(),
            )));
        }
        let data = self.read_file(name, path).await?;
        let read = blake3_hex(&data);
        let Ok(text) = String::from_utf8(data) else {
            return Err(HarnessError::from(FilesError::Invalid(format!(
                "{path} is not UTF-8 text; it cannot be edited by text"
            ))));
        };
        let (edited, count) = crate::tools::edit_text(path, &text, old, new, all)?;
        self.write_file_if(name, path, edited.into_bytes(), Some(read))
            .await?;
        Ok(count)
    }

    /// `write_file`, done only while the file still holds what hashes (BLAKE3, hex) to
    /// `unchanged_since`, where that is given: an edit (read, changed, written back) refused
    /// rather than lose what the cell wrote between its read and its write.
    pub async fn write_file_if(
        &self,
        name: &str,
        path: &str,
        data: Vec<u8>,
        unchanged_since: Option<String>,
    ) -> Result<(), HarnessError> {
        let (_, full) = self.cell_path(name, path)?;
        if data.len() as u64 > WRITE_LIMIT {
            return Err(HarnessError::from(FilesError::Invalid(format!(
                "{full}: {} bytes is more than the {WRITE_LIMIT} a file written through the warden may have; write it in smaller parts and join them with a command",
                data.len()
            ))));
        }
        let digest = blake3_hex(&data);
        self.record(
            Some(name),
            "file.write",
            json!({ "path": full, "bytes": data.len(), "blake3": digest }),
        )
        .await?;
        self.file_op(
            name,
            FileOp::Write {
                path: path.to_owned(),
                unchanged_since,
            },
            Some(data),
            1 << 16,
        )
        .await
        .map(drop)
    }

    pub async fn list_files(&self, name: &str, path: &str) -> Result<Vec<FileInfo>, HarnessError> {
        self.cell_path(name, path)?;
        let entries: Vec<FileEntry> = self
            .file_json(
                name,
                FileOp::List {
                    path: path.to_owned(),
                },
            )
            .await?;
        Ok(entries.into_iter().map(file_info).collect())
    }

    pub async fn stat_file(&self, name: &str, path: &str) -> Result<FileInfo, HarnessError> {
        self.cell_path(name, path)?;
        let entry: FileEntry = self
            .file_json(
                name,
                FileOp::Stat {
                    path: path.to_owned(),
                },
            )
            .await?;
        Ok(file_info(entry))
    }

    pub async fn mkdir(&self, name: &str, path: &str) -> Result<(), HarnessError> {
        let (_, full) = self.cell_path(name, path)?;
        self.record(Some(name), "file.mkdir", json!({ "path": full }))
            .await?;
        self.file_op(
            name,
            FileOp::Mkdir {
                path: path.to_owned(),
            },
            None,
            1 << 16,
        )
        .await
        .map(drop)
    }

    pub async fn remove(
        &self,
        name: &str,
        path: &str,
        recursive: bool,
    ) -> Result<(), HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        if full.trim_end_matches('/') == root.trim_end_matches('/') {
            return Err(HarnessError::from(FilesError::Invalid(
                "refusing to remove the files root itself".into(),
            )));
        }
        self.record(
            Some(name),
            "file.remove",
            json!({ "path": full, "recursive": recursive }),
        )
        .await?;
        self.file_op(
            name,
            FileOp::Remove {
                path: path.to_owned(),
                recursive,
            },
            None,
            1 << 16,
        )
        .await
        .map(drop)
    }

    pub async fn rename(&self, name: &str, from: &str, to: &str) -> Result<(), HarnessError> {
        let (_, from_full) = self.cell_path(name, from)?;
        let (_, to_full) = self.cell_path(name, to)?;
        self.record(
            Some(name),
            "file.move",
            json!({ "from": from_full, "to": to_full }),
        )
        .await?;
        self.file_op(
            name,
            FileOp::Rename {
                from: from.to_owned(),
                to: to.to_owned(),
            },
            None,
            1 << 16,
        )
        .await
        .map(drop)
    }

    /// Unpacks a tar archive into a directory of the cell (made if missing): members with `..`
    /// are refused, leading `/` stripped, owners and set-id bits not kept, device nodes and
    /// FIFOs refused, and no member is written through a symlink that leads out of the root.
    /// What the archive alone decides is checked before anything is written (see
    /// [`crate::archive`]): an archive refused for it leaves the cell as it was.
    pub async fn upload(
        &self,
        name: &str,
        path: &str,
        archive: Vec<u8>,
    ) -> Result<(), HarnessError> {
        let (_, full) = self.cell_path(name, path)?;
        crate::archive::check(&archive).map_err(|refused| {
            HarnessError::from(FilesError::Invalid(format!(
                "unpacking into {full}: {refused}; nothing was written"
            )))
        })?;
        self.record(
            Some(name),
            "file.upload",
            json!({ "path": full, "bytes": archive.len(), "blake3": blake3_hex(&archive) }),
        )
        .await?;
        self.file_op(
            name,
            FileOp::Unpack {
                path: path.to_owned(),
            },
            Some(archive),
            1 << 16,
        )
        .await
        .map(drop)
    }

    /// A tar archive of a directory of the cell (regular files, directories and symlinks).
    pub async fn download(&self, name: &str, path: &str) -> Result<Vec<u8>, HarnessError> {
        let (_, full) = self.cell_path(name, path)?;
        let archive = self
            .file_op(
                name,
                FileOp::Pack {
                    path: path.to_owned(),
                    limit: READ_LIMIT,
                },
                None,
                READ_LIMIT + (16 << 20),
            )
            .await?;
        self.record(
            Some(name),
            "file.download",
            json!({ "path": full, "bytes": archive.len() }),
        )
        .await?;
        Ok(archive)
    }
}

/// A file service's error as the harness reports it.
fn file_error(err: FileError) -> HarnessError {
    let failure = match err.kind {
        FileErrorKind::NotFound => FilesError::Missing,
        FileErrorKind::ReadOnly
        | FileErrorKind::Denied
        | FileErrorKind::Exists
        | FileErrorKind::Changed => FilesError::State,
        FileErrorKind::Io => FilesError::Failed,
        FileErrorKind::Outside
        | FileErrorKind::NotRegular
        | FileErrorKind::NotDirectory
        | FileErrorKind::TooLarge
        | FileErrorKind::Invalid => FilesError::Invalid,
    };
    failure(err.message).into()
}

fn blake3_hex(data: &[u8]) -> String {
    blake3::hash(data).to_hex().to_string()
}
