//! `warden cp` and `warden logs` of daemon cells.

use anyhow::{Context, Result, bail};
use hyper::Method;
use serde_json::Value;
use std::io::Write as _;

use super::*;

/// What a file that is neither a regular file nor a directory is, in words.
fn special_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    let kind = meta.file_type();
    if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

/// `CELL:PATH`, when the text names a cell side.
fn cell_side(text: &str) -> Option<(&str, &str)> {
    let (cell, path) = text.split_once(':')?;
    warden_cell::check_name(cell).ok()?;
    Some((cell, path))
}

pub fn copy(source: &str, dest: &str) -> Result<i32> {
    let client = client()?;
    let rt = current_thread()?;
    match (cell_side(source), cell_side(dest)) {
        (None, Some((cell, path))) => {
            let host = std::path::Path::new(source);
            let meta = std::fs::metadata(host)
                .with_context(|| format!("{source} (on the host) cannot be copied"))?;
            // A device or a FIFO would be read without end (`/dev/zero`), or wait for a writer
            // that never comes, before anything reached the daemon.
            if !meta.is_dir() && !meta.is_file() {
                bail!(
                    "{source} (on the host) is {}, not a regular file or a directory: `warden cp` \
                     copies those; send a stream through a command in the cell instead \
                     (`warden exec {cell} -- sh -c 'cat > FILE' < {source}`)",
                    special_kind(&meta)
                );
            }
            if meta.is_dir() {
                let mut builder = tar::Builder::new(Vec::new());
                builder.follow_symlinks(false);
                builder
                    .append_dir_all(".", host)
                    .with_context(|| format!("packing {source}"))?;
                let archive = builder.into_inner().context("packing")?;
                let url = format!("/v1/cells/{cell}/files/archive?path={}", query(path));
                rt.block_on(client.bytes(Method::PUT, &url, archive))?;
            } else {
                let data = std::fs::read(host).with_context(|| format!("reading {source}"))?;
                // Into a directory of the cell (`cell:dir/`, or one that exists), as cp does.
                let into_dir = path.is_empty()
                    || path.ends_with('/')
                    || rt
                        .block_on(client.json(
                            Method::GET,
                            &format!("/v1/cells/{cell}/files/stat?path={}", query(path)),
                            None,
                        ))
                        .is_ok_and(|info| info["kind"] == "dir");
                let path = if into_dir {
                    let name = host
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    format!("{}/{name}", path.trim_end_matches('/'))
                        .trim_start_matches('/')
                        .to_owned()
                } else {
                    path.to_owned()
                };
                let url = format!("/v1/cells/{cell}/files/content?path={}", query(&path));
                rt.block_on(client.bytes(Method::PUT, &url, data))?;
            }
        }
        (Some((cell, path)), None) => {
            let stat = format!("/v1/cells/{cell}/files/stat?path={}", query(path));
            let info = rt.block_on(client.json(Method::GET, &stat, None))?;
            if info["kind"] == "dir" {
                let url = format!("/v1/cells/{cell}/files/archive?path={}", query(path));
                let archive = rt.block_on(client.bytes(Method::GET, &url, Vec::new()))?;
                std::fs::create_dir_all(dest).with_context(|| format!("making {dest}"))?;
                // `unpack` keeps every member inside `dest` (no `..`, no absolute paths), and
                // gives each the mode the cell set less set-id and sticky bits: the caller's
                // umask is taken off it too, as `cp -r` and `tar` do, so that what the cell made
                // 777 does not land writable by every user of the host.
                let mut unpacked = tar::Archive::new(archive.as_slice());
                unpacked.set_mask(umask());
                unpacked
                    .unpack(dest)
                    .with_context(|| format!("unpacking into {dest}"))?;
            } else {
                let url = format!("/v1/cells/{cell}/files/content?path={}", query(path));
                let data = rt.block_on(client.bytes(Method::GET, &url, Vec::new()))?;
                let target = std::path::Path::new(dest);
                let target = if target.is_dir() {
                    target.join(path.rsplit('/').next().unwrap_or(path))
                } else {
                    target.to_path_buf()
                };
                std::fs::write(&target, data)
                    .with_context(|| format!("writing {}", target.display()))?;
            }
        }
        _ => bail!("one side of `warden cp` must be CELL:PATH and the other a host path"),
    }
    Ok(0)
}

/// This process's umask (read, not set: setting it to read it would race other threads), or
/// 022 where it cannot be told.
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Umask:"))
                .and_then(|mask| u32::from_str_radix(mask.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

pub fn logs(name: &str, follow: bool, only: Option<u64>) -> Result<i32> {
    let client = client()?;
    let rt = current_thread()?;
    let mut stdout = std::io::stdout();
    let mut stderr = std::io::stderr();
    let mut shown = std::collections::HashSet::new();
    loop {
        let processes: Vec<warden_protocol::ProcessInfo> = rt.block_on(client.call::<(), _>(
            Method::GET,
            &format!("/v1/cells/{name}/processes"),
            None,
        ))?;
        for process in processes {
            let id = process.id;
            if only.is_some_and(|o| o != id) || !shown.insert(id) {
                continue;
            }
            eprintln!(
                "==> process {id}: {} <==",
                crate::render::safe(&process.argv.join(" "))
            );
            let path = format!("/v1/cells/{name}/processes/{id}/output?follow={follow}");
            rt.block_on(client.events(Method::GET, &path, None, |event, data| {
                let Ok(value) = serde_json::from_str::<Value>(data) else {
                    return;
                };
                let bytes = chunk_bytes(&value);
                match event {
                    "stdout" => {
                        let _ = stdout.write_all(&bytes);
                        let _ = stdout.flush();
                    }
                    "stderr" => {
                        let _ = stderr.write_all(&bytes);
                    }
                    "dropped" => {
                        eprintln!("warden: ({} earlier bytes were dropped)", value["bytes"]);
                    }
                    _ => {}
                }
            }))?;
        }
        if !follow {
            return Ok(0);
        }
        // Following: processes started later are shown as they come, until the cell ends.
        let cell: warden_protocol::CellInfo =
            rt.block_on(client.call::<(), _>(Method::GET, &format!("/v1/cells/{name}"), None))?;
        if cell.state == warden_protocol::CellState::Ended {
            return Ok(0);
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}
