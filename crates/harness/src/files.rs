//! Files of a running cell, through the API.
//!
//! Every operation runs *inside* the cell, as the cell's user, under the cell's mount namespace,
//! Landlock domain and seccomp filter, using the cell's own read-only tools (`cat`, `find`,
//! `tar`, ...): the API can read or change nothing that the cell itself could not. On top of
//! that, paths are relative to the cell's files root (its workspace, else its private /tmp), `..` and absolute paths are refused, and a path whose real location (symlinks
//! resolved inside the cell) leaves the root is refused before anything is done.

use std::sync::Arc;

use serde::Serialize;
use serde_json::json;
use warden_cell::linux::exec::{ExecEvent, ExecRequest, ExecSession};

use crate::{ErrorKind, Harness, HarnessError};

/// Largest file read or archive made through the API.
pub const READ_LIMIT: u64 = 64 * 1024 * 1024;

/// One directory entry.
#[derive(Debug, Clone, Serialize)]
pub struct FileInfo {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    pub size: u64,
    pub mode: String,
    pub modified_s: u64,
    /// Where a symlink points (as written in it).
    pub target: Option<String>,
}

/// What a helper process did.
struct Captured {
    code: Option<i32>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl Harness {
    /// The directory that file paths of this cell are relative to.
    fn files_root(&self, name: &str) -> Result<String, HarnessError> {
        let entry = self.entry(name)?;
        let policy = self
            .live
            .lock()
            .ok()
            .and_then(|l| l.get(name).map(|l| l.policy.clone()))
            .ok_or_else(|| {
                HarnessError::new(ErrorKind::Conflict, format!("cell `{name}` has ended"))
            })?;
        // A cell without a workspace has no work area but its private /tmp.
        let root = if entry.workspace.is_some() {
            policy.filesystem.workspace.mount.display().to_string()
        } else {
            "/tmp".to_owned()
        };
        Ok(root)
    }

    /// Checks a relative path and returns it joined to the root.
    fn cell_path(&self, name: &str, path: &str) -> Result<(String, String), HarnessError> {
        let root = self.files_root(name)?;
        if path.contains('\0') {
            return Err(HarnessError::bad("a path may not contain NUL bytes"));
        }
        if path.starts_with('/') {
            return Err(HarnessError::bad(format!(
                "path `{path}` is absolute; file paths are relative to the cell's files root {root}"
            )));
        }
        if path.split('/').any(|part| part == "..") {
            return Err(HarnessError::bad(format!(
                "path `{path}` contains `..`; file paths stay inside the cell's files root {root}"
            )));
        }
        let trimmed = path.trim_matches('/');
        let full = if trimmed.is_empty() || trimmed == "." {
            root.clone()
        } else {
            format!("{}/{trimmed}", root.trim_end_matches('/'))
        };
        Ok((root, full))
    }

    /// Runs a helper inside the cell and collects what it printed (stdout up to `limit`).
    async fn helper(
        &self,
        name: &str,
        argv: &[&str],
        stdin: Option<Vec<u8>>,
        limit: u64,
    ) -> Result<Captured, HarnessError> {
        let record = self.live(name)?;
        if warden_cell::control::is_paused(&record) {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!("cell `{name}` is paused; resume it first"),
            ));
        }
        let registry = self.registry.clone();
        let cell = name.to_owned();
        let request = ExecRequest {
            argv: argv.iter().map(|s| (*s).to_owned()).collect(),
            env: vec![("LC_ALL".to_owned(), "C".to_owned())],
            cwd: Some("/".to_owned()),
            tty: None,
        };
        tokio::task::spawn_blocking(move || run_helper(&registry, &cell, &request, stdin, limit))
            .await
            .map_err(|e| HarnessError::internal(e.to_string()))?
    }

    /// Resolves `full` inside the cell (symlinks included) and refuses it if it leaves `root`.
    async fn confined(
        &self,
        name: &str,
        root: &str,
        full: &str,
        must_exist: bool,
    ) -> Result<(), HarnessError> {
        let flag = if must_exist { "-e" } else { "-m" };
        let out = self
            .helper(name, &["realpath", flag, "--", root, full], None, 1 << 16)
            .await?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut lines = text.lines();
        let (Some(real_root), Some(real)) = (lines.next(), lines.next()) else {
            return Err(HarnessError::new(
                ErrorKind::NotFound,
                format!("{full}: no such file or directory in the cell"),
            ));
        };
        if out.code != Some(0) {
            return Err(HarnessError::new(
                ErrorKind::NotFound,
                format!("{full}: no such file or directory in the cell"),
            ));
        }
        if real != real_root && !real.starts_with(&format!("{}/", real_root.trim_end_matches('/')))
        {
            return Err(HarnessError::bad(format!(
                "{full} resolves to {real}, outside the cell's files root {root} (a symlink points out); refused"
            )));
        }
        Ok(())
    }

    fn failed(what: &str, out: &Captured) -> HarnessError {
        let message = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        let kind = if message.contains("No such file") {
            ErrorKind::NotFound
        } else if message.contains("Permission denied") || message.contains("Read-only") {
            ErrorKind::Conflict
        } else {
            ErrorKind::BadRequest
        };
        HarnessError::new(kind, format!("{what}: {message}"))
    }

    pub async fn read_file(&self, name: &str, path: &str) -> Result<Vec<u8>, HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        self.confined(name, &root, &full, true).await?;
        let out = self
            .helper(name, &["cat", "--", &full], None, READ_LIMIT)
            .await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("reading {full}"), &out));
        }
        self.record(
            Some(name),
            "file.read",
            json!({ "path": full, "bytes": out.stdout.len() }),
        )
        .await?;
        Ok(out.stdout)
    }

    pub async fn write_file(
        &self,
        name: &str,
        path: &str,
        data: Vec<u8>,
    ) -> Result<(), HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        self.confined(name, &root, &full, false).await?;
        let digest = blake3_hex(&data);
        self.record(
            Some(name),
            "file.write",
            json!({ "path": full, "bytes": data.len(), "blake3": digest }),
        )
        .await?;
        let out = self
            .helper(
                name,
                &["sh", "-c", "cat > \"$1\"", "sh", &full],
                Some(data),
                1 << 16,
            )
            .await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("writing {full}"), &out));
        }
        Ok(())
    }

    pub async fn list_files(&self, name: &str, path: &str) -> Result<Vec<FileInfo>, HarnessError> {
        self.find(name, path, "1").await
    }

    pub async fn stat_file(&self, name: &str, path: &str) -> Result<FileInfo, HarnessError> {
        self.find(name, path, "0")
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| HarnessError::new(ErrorKind::NotFound, format!("{path}: not found")))
    }

    async fn find(
        &self,
        name: &str,
        path: &str,
        depth: &str,
    ) -> Result<Vec<FileInfo>, HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        self.confined(name, &root, &full, true).await?;
        let min = if depth == "0" { "0" } else { "1" };
        let out = self
            .helper(
                name,
                &[
                    "find",
                    &full,
                    "-mindepth",
                    min,
                    "-maxdepth",
                    depth,
                    "-printf",
                    "%y\\t%s\\t%m\\t%T@\\t%l\\t%f\\0",
                ],
                None,
                READ_LIMIT,
            )
            .await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("listing {full}"), &out));
        }
        let mut entries: Vec<FileInfo> = out
            .stdout
            .split(|b| *b == 0)
            .filter(|r| !r.is_empty())
            .filter_map(|record| {
                let text = String::from_utf8_lossy(record);
                let mut f = text.splitn(6, '\t');
                let kind = match f.next()? {
                    "f" => "file",
                    "d" => "dir",
                    "l" => "symlink",
                    _ => "other",
                };
                let size = f.next()?.parse().unwrap_or(0);
                let mode = f.next()?.to_owned();
                let modified_s = f
                    .next()?
                    .split('.')
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let target = Some(f.next()?.to_owned()).filter(|t| !t.is_empty());
                let name = f.next()?.to_owned();
                Some(FileInfo {
                    name,
                    kind: kind.to_owned(),
                    size,
                    mode,
                    modified_s,
                    target,
                })
            })
            .collect();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    pub async fn mkdir(&self, name: &str, path: &str) -> Result<(), HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        self.confined(name, &root, &full, false).await?;
        self.record(Some(name), "file.mkdir", json!({ "path": full }))
            .await?;
        let out = self
            .helper(name, &["mkdir", "-p", "--", &full], None, 1 << 16)
            .await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("making {full}"), &out));
        }
        Ok(())
    }

    pub async fn remove(
        &self,
        name: &str,
        path: &str,
        recursive: bool,
    ) -> Result<(), HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        if full.trim_end_matches('/') == root.trim_end_matches('/') {
            return Err(HarnessError::bad(
                "refusing to remove the files root itself",
            ));
        }
        self.confined(name, &root, &full, true).await?;
        self.record(
            Some(name),
            "file.remove",
            json!({ "path": full, "recursive": recursive }),
        )
        .await?;
        let flag = if recursive { "-rf" } else { "-f" };
        let argv: Vec<&str> = if recursive {
            vec!["rm", flag, "--", &full]
        } else {
            vec![
                "sh",
                "-c",
                "if [ -d \"$1\" ] && [ ! -L \"$1\" ]; then rmdir -- \"$1\"; else rm -f -- \"$1\"; fi",
                "sh",
                &full,
            ]
        };
        let out = self.helper(name, &argv, None, 1 << 16).await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("removing {full}"), &out));
        }
        Ok(())
    }

    pub async fn rename(&self, name: &str, from: &str, to: &str) -> Result<(), HarnessError> {
        let (root, from_full) = self.cell_path(name, from)?;
        let (_, to_full) = self.cell_path(name, to)?;
        self.confined(name, &root, &from_full, true).await?;
        self.confined(name, &root, &to_full, false).await?;
        self.record(
            Some(name),
            "file.move",
            json!({ "from": from_full, "to": to_full }),
        )
        .await?;
        let out = self
            .helper(
                name,
                &["mv", "-T", "--", &from_full, &to_full],
                None,
                1 << 16,
            )
            .await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("moving {from_full}"), &out));
        }
        Ok(())
    }

    /// Unpacks a tar archive into a directory of the cell (made if missing). GNU tar inside the
    /// cell refuses members with `..` and strips leading `/`; owners are not kept.
    pub async fn upload(
        &self,
        name: &str,
        path: &str,
        archive: Vec<u8>,
    ) -> Result<(), HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        self.confined(name, &root, &full, false).await?;
        self.record(
            Some(name),
            "file.upload",
            json!({ "path": full, "bytes": archive.len(), "blake3": blake3_hex(&archive) }),
        )
        .await?;
        let out = self
            .helper(
                name,
                &[
                    "sh", "-c",
                    "mkdir -p -- \"$1\" && tar -x --no-same-owner --no-same-permissions -C \"$1\" -f -",
                    "sh", &full,
                ],
                Some(archive),
                1 << 16,
            )
            .await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("unpacking into {full}"), &out));
        }
        Ok(())
    }

    /// A tar archive of a directory of the cell.
    pub async fn download(&self, name: &str, path: &str) -> Result<Vec<u8>, HarnessError> {
        let (root, full) = self.cell_path(name, path)?;
        self.confined(name, &root, &full, true).await?;
        let out = self
            .helper(
                name,
                &["tar", "-c", "-C", &full, "-f", "-", "."],
                None,
                READ_LIMIT,
            )
            .await?;
        if out.code != Some(0) {
            return Err(Self::failed(&format!("archiving {full}"), &out));
        }
        self.record(
            Some(name),
            "file.download",
            json!({ "path": full, "bytes": out.stdout.len() }),
        )
        .await?;
        Ok(out.stdout)
    }
}

fn blake3_hex(data: &[u8]) -> String {
    blake3::hash(data).to_hex().to_string()
}

/// Starts the helper, feeds stdin, collects output (stdout up to `limit`), waits for its end.
fn run_helper(
    registry: &warden_cell::Registry,
    cell: &str,
    request: &ExecRequest,
    stdin: Option<Vec<u8>>,
    limit: u64,
) -> Result<Captured, HarnessError> {
    use std::io::{Read as _, Write as _};
    let pipe = || {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| HarnessError::internal(format!("creating pipes: {e}")))
    };
    let (stdin_r, stdin_w) = pipe()?;
    let (stdout_r, stdout_w) = pipe()?;
    let (stderr_r, stderr_w) = pipe()?;
    let session = ExecSession::start(
        registry,
        cell,
        request,
        Some([&stdin_r, &stdout_w, &stderr_w]),
    )
    .map_err(|e| HarnessError::new(ErrorKind::Conflict, e.to_string()))?;
    drop((stdin_r, stdout_w, stderr_w));
    let session = Arc::new(session);
    let feeder = std::thread::spawn(move || {
        let mut file = std::fs::File::from(stdin_w);
        if let Some(data) = stdin {
            let _ = file.write_all(&data);
        }
    });
    let err_reader = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = std::fs::File::from(stderr_r)
            .take(1 << 16)
            .read_to_end(&mut text);
        text
    });
    let mut stdout = Vec::new();
    let mut reader = std::fs::File::from(stdout_r).take(limit + 1);
    let _ = reader.read_to_end(&mut stdout);
    let too_big = stdout.len() as u64 > limit;
    if too_big {
        let _ = session.signal(libc::SIGKILL);
    }
    drop(reader);
    let end = loop {
        match session.next_event() {
            Ok(event) if event.is_final() => break Ok(event),
            Ok(_) => continue,
            Err(err) => break Err(err),
        }
    };
    let _ = feeder.join();
    let stderr = err_reader.join().unwrap_or_default();
    if too_big {
        return Err(HarnessError::new(
            ErrorKind::BadRequest,
            format!("more than {limit} bytes: too large to transfer through the API"),
        ));
    }
    let code = match end {
        Ok(ExecEvent::Exited { code, .. }) => Some(code),
        Ok(ExecEvent::Failed { message, .. }) => {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!("the cell cannot run {}: {message}", request.argv[0]),
            ));
        }
        Ok(_) => None,
        Err(err) => return Err(HarnessError::new(ErrorKind::Conflict, err.to_string())),
    };
    Ok(Captured {
        code,
        stdout,
        stderr,
    })
}
