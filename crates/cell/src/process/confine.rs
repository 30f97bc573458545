//! The last steps before the cell's command runs: leave root, drop every capability, forbid
//! privilege gain, then lock the file system (Landlock) and the system call surface (seccomp).

use std::io;
use std::path::PathBuf;

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

/// Applies every restriction to the calling process; its children inherit them all. Without a
/// cgroup, `rlimit_fallback` approximates the memory and process limits with rlimits.
pub fn confine(plan: &CellPlan, rlimit_fallback: bool) -> Result<(), ConfineError> {
    let uid = plan.ids.inside_uid;
    let gid = plan.ids.inside_gid;
    // The bounding set can only be cleared while CAP_SETPCAP is still held.
    caps::clear(None, CapSet::Bounding)?;
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

    let mut read_write: Vec<PathBuf> =
        vec!["/tmp".into(), "/dev".into(), plan.workspace_mount.clone()];
    read_write.extend(plan.entries.iter().filter_map(|e| match e {
        super::plan::Entry::Bind {
            path,
            writable: true,
            ..
        } => Some(path.clone()),
        _ => None,
    }));
    landlock::restrict(&landlock::FsRules {
        read_only: vec!["/".into()],
        read_write,
    })?;

    sys::install_seccomp(&seccomp::deny_filter()?).map_err(ConfineError::SeccompInstall)?;
    Ok(())
}
