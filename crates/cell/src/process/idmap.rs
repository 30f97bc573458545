//! Id-mapped workspace mounts for root-started cells.
//!
//! A root-started cell runs as unprivileged host ids, so it could not write a workspace owned by
//! the caller. Instead of handing the cell the caller's id, the workspace is attached through an
//! id-mapped mount: inside that mount the directory's owner is shown as the cell's user, and
//! files the cell creates are stored as owned by the directory's owner.

use std::fs;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::sys::wait::waitpid;
use nix::unistd::Pid;

use super::ids::IdMapping;
use super::outcome::RunError;
use super::sys;

/// Clones the mount tree of `host` with the owner of `host` mapped to the cell's user.
pub fn workspace_tree(host: &Path, ids: &IdMapping) -> Result<OwnedFd, RunError> {
    workspace_tree_for(
        host,
        ids.host_uid_of_cell_user(),
        ids.host_gid_of_cell_group(),
    )
}

/// Clones the mount tree of `host` with its owner mapped to the host ids `uid` and `gid` (those
/// a cell's user and group run as).
pub fn workspace_tree_for(host: &Path, uid: u32, gid: u32) -> Result<OwnedFd, RunError> {
    let os = |what| move |source| RunError::Os { what, source };
    let meta = fs::metadata(host).map_err(os("reading the workspace owner"))?;
    let userns = mapping((meta.uid(), meta.gid(), uid, gid))
        .map_err(os("creating the workspace id mapping"))?;
    sys::idmapped_clone(host, &userns).map_err(os("creating the id-mapped workspace mount (needs kernel 5.12+ and a file system that supports id-mapped mounts)"))
}

/// The user namespace that maps a workspace's owner (`owner_uid`, `owner_gid`) to a cell's
/// user and group: made once per such pair in a process (each costs a child process, ~1 ms),
/// then kept (a descriptor each: the mapping never changes, and an id-mapped mount only reads
/// it when it is made).
fn mapping(key: (u32, u32, u32, u32)) -> io::Result<OwnedFd> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    /// The workspace owner's uid and gid, the cell's user's and group's host ids.
    type Pair = (u32, u32, u32, u32);
    static MADE: Mutex<Option<HashMap<Pair, OwnedFd>>> = Mutex::new(None);
    let mut made = MADE
        .lock()
        .map_err(|_| io::Error::other("a thread panicked"))?;
    let made = made.get_or_insert_with(HashMap::new);
    if let Some(userns) = made.get(&key) {
        return userns.try_clone();
    }
    let (owner_uid, owner_gid, uid, gid) = key;
    let userns = mapping_namespace(
        &format!("{owner_uid} {uid} 1\n"),
        &format!("{owner_gid} {gid} 1\n"),
    )?;
    made.insert(key, userns.try_clone()?);
    Ok(userns)
}

/// Creates a user namespace with the given maps and returns a descriptor to it. The namespace
/// is held by a short-lived child that exits as soon as the descriptor is open.
fn mapping_namespace(uid_map: &str, gid_map: &str) -> io::Result<OwnedFd> {
    let (hold_r, hold_w) = sys::pipe()?;
    let pid = sys::clone_process(libc::CLONE_NEWUSER)?;
    if pid == 0 {
        drop(hold_w);
        let mut byte = [0u8; 1];
        let _ = fs::File::from(hold_r).read(&mut byte);
        sys::exit_now(0);
    }
    drop(hold_r);
    let proc = format!("/proc/{pid}");
    let result = (|| {
        fs::write(format!("{proc}/uid_map"), uid_map)?;
        fs::write(format!("{proc}/gid_map"), gid_map)?;
        fs::File::open(format!("{proc}/ns/user")).map(OwnedFd::from)
    })();
    drop(hold_w);
    let _ = waitpid(Pid::from_raw(pid), None);
    result
}
