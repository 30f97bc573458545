//! The last steps before the cell's command runs: leave root, drop every capability, forbid
//! privilege gain, then lock the file system (Landlock) and the system call surface (seccomp).

use std::io;
use std::os::fd::{AsFd as _, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use caps::CapSet;
use nix::unistd::{Gid, Uid, setgroups, setresgid, setresuid};

use super::plan::CellPlan;
use super::{landlock, seccomp, sys};

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("dropping capabilities: {0}")]
    Caps(#[from] caps::errors::CapsError),
    #[error("switching to uid {uid} gid {gid}: {source}")]
    Ids {
        uid: u32,
        gid: u32,
        source: io::Error,
    },
    #[error("setting {what}: {source}")]
    Prctl {
        what: &'static str,
        source: io::Error,
    },
    #[error(transparent)]
    Landlock(#[from] landlock::LandlockError),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    #[error("installing the seccomp filter: {0}")]
    SeccompInstall(io::Error),
}

/// Empties the calling thread's bounding set: every capability the kernel has is dropped, one
/// `prctl` each, up to the first one it does not know (`EINVAL`). (`caps::clear` asks whether
/// each is there before it drops it, two calls a capability, and drops only those it knows of.)
fn clear_bounding_set() -> Result<(), ConfineError> {
    for index in 0..u64::BITS {
        let capability = rustix::thread::CapabilitySet::from_bits_retain(1 << index);
        match rustix::thread::remove_capability_from_bounding_set(capability) {
            Ok(()) => {}
            Err(rustix::io::Errno::INVAL) if index > 0 => break,
            Err(e) => {
                return Err(ConfineError::Prctl {
                    what: "PR_CAPBSET_DROP",
                    source: e.into(),
                });
            }
        }
    }
    Ok(())
}

/// Applies every restriction to the calling process; its children inherit them all. Without a
/// cgroup, `rlimit_fallback` approximates the memory and process limits with rlimits.
pub fn confine(plan: &CellPlan, rlimit_fallback: bool) -> Result<(), ConfineError> {
    let uid = plan.ids.inside_uid;
    let gid = plan.ids.inside_gid;
    // The bounding set can only be cleared while CAP_SETPCAP is still held.
    clear_bounding_set()?;
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    let ids_error = |source: nix::Error| ConfineError::Ids {
        uid,
        gid,
        source: io::Error::from_raw_os_error(source as i32),
    };
    if plan.ids.privileged {
        // Supplementary groups from the host would otherwise still grant host group access.
        setgroups(&[]).map_err(ids_error)?;
    }
    setresgid(Gid::from_raw(gid), Gid::from_raw(gid), Gid::from_raw(gid)).map_err(ids_error)?;
    setresuid(Uid::from_raw(uid), Uid::from_raw(uid), Uid::from_raw(uid)).map_err(ids_error)?;
    caps::clear(None, CapSet::Effective)?;
    caps::clear(None, CapSet::Permitted)?;

    let limit = |what, resource, value| {
        sys::set_rlimit(resource, value).map_err(|source| ConfineError::Prctl { what, source })
    };
    limit("RLIMIT_CORE", libc::RLIMIT_CORE, 0)?;
    // Not above the hard limit the warden has: raising it needs a privilege the cell lacks.
    let nofile = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(plan.rlimit_nofile, |(_, hard)| plan.rlimit_nofile.min(hard));
    limit("RLIMIT_NOFILE", libc::RLIMIT_NOFILE, nofile)?;
    if let Some(bytes) = plan.rlimit_fsize {
        limit("RLIMIT_FSIZE", libc::RLIMIT_FSIZE, bytes)?;
        // An ignored SIGXFSZ stays ignored across exec: the write past the limit fails with
        // EFBIG instead of killing the writer.
        sys::set_signal_ignored(libc::SIGXFSZ).map_err(|source| ConfineError::Prctl {
            what: "ignoring SIGXFSZ",
            source,
        })?;
    }
    if rlimit_fallback {
        if let Some(n) = plan.rlimit_nproc {
            limit("RLIMIT_NPROC", libc::RLIMIT_NPROC, n)?;
        }
        if let Some(bytes) = plan.rlimit_as {
            limit("RLIMIT_AS", libc::RLIMIT_AS, bytes)?;
        }
    }
    sys::set_no_new_privs().map_err(|source| ConfineError::Prctl {
        what: "no_new_privs",
        source,
    })?;

    landlock::restrict(&init_rules(plan))?;

    sys::install_seccomp(&seccomp::deny_filter()?).map_err(ConfineError::SeccompInstall)?;
    Ok(())
}

/// Whether the cell's workspace may be mounted again while the cell runs: a copy-on-write
/// workspace, whose layers a snapshot or a reset turns over.
fn swappable(plan: &CellPlan) -> bool {
    plan.workspace.as_ref().is_some_and(|w| w.overlay.is_some())
}

/// What every process of the cell may write: its /tmp, /dev, the workspace, and the binds the
/// policy made writable; everything else is read-only.
pub fn process_rules(plan: &CellPlan) -> landlock::FsRules {
    rules(plan, plan.workspace_mount.clone())
}

/// The init's own rules: those of its processes, but for a workspace that a snapshot may mount
/// again (a new mount has a new root, which no rule made now could name), the directory the
/// workspace is mounted in. Nothing but the init runs under these: every process it starts is
/// put under `process_rules` as well (see [`Narrowing`]), and Landlock keeps a process of that
/// nested domain from tracing or signalling its way into the init's.
fn init_rules(plan: &CellPlan) -> landlock::FsRules {
    let workspace = if swappable(plan) {
        plan.workspace_mount
            .parent()
            .unwrap_or(Path::new("/"))
            .to_path_buf()
    } else {
        plan.workspace_mount.clone()
    };
    rules(plan, workspace)
}

fn rules(plan: &CellPlan, workspace: PathBuf) -> landlock::FsRules {
    let mut read_write: Vec<PathBuf> = vec!["/tmp".into(), "/dev".into(), workspace];
    read_write.extend(plan.entries.iter().filter_map(|e| match e {
        super::plan::Entry::Bind {
            path,
            writable: true,
            ..
        } => Some(path.clone()),
        _ => None,
    }));
    landlock::FsRules {
        read_only: vec!["/".into()],
        read_write,
    }
}

/// The Landlock layer the init puts every process it starts under: `process_rules`, made for
/// the workspace mounted now, and made again when a snapshot or a reset mounted another.
pub struct Narrowing {
    workspace: PathBuf,
    rules: Option<landlock::FsRules>,
    made: Option<((u64, u64), OwnedFd)>,
}

impl Narrowing {
    /// For a cell whose workspace can be mounted again; a cell whose init is confined by its
    /// processes' own rules needs no second layer.
    pub fn new(plan: &CellPlan) -> Self {
        Self {
            workspace: plan.workspace_mount.clone(),
            rules: swappable(plan).then(|| process_rules(plan)),
            made: None,
        }
    }

    /// The ruleset for a process started now, or `None` when none is needed.
    pub fn current(&mut self) -> Result<Option<BorrowedFd<'_>>, landlock::LandlockError> {
        let Some(rules) = &self.rules else {
            return Ok(None);
        };
        // The mount's id tells one mount from the next (a device number and an inode number
        // do not: an unmounted overlay's device is given to the next, and a root's inode number
        // can be the same). The unique id (Linux 6.8) is never given again; on an older kernel
        // the warden swaps no workspace (see `swap`), so the id never changes.
        let statx = rustix::fs::statx(
            rustix::fs::CWD,
            &self.workspace,
            rustix::fs::AtFlags::empty(),
            rustix::fs::StatxFlags::MNT_ID
                | rustix::fs::StatxFlags::from_bits_retain(super::swap::STATX_MNT_ID_UNIQUE),
        )
        .map_err(|e| landlock::LandlockError::Workspace(io::Error::from(e)))?;
        let key = (
            statx.stx_mnt_id,
            u64::from(statx.stx_mask & super::swap::STATX_MNT_ID_UNIQUE),
        );
        if self.made.as_ref().is_none_or(|(made, _)| *made != key) {
            self.made = Some((key, landlock::prepare(rules)?));
        }
        Ok(self.made.as_ref().map(|(_, fd)| fd.as_fd()))
    }
}
