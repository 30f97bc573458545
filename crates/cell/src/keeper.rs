//! `warden keep`: the keeper of one cell, whatever its tier. It reads its request (the cell's
//! spec and what to run) from stdin, keeps the cell of the tier its policy names until it ends,
//! and leaves with the command's exit status.

use warden_policy::Tier;

use crate::process::backend::KeeperRequest;
use crate::process::outcome::{Ending, RunError};
use crate::process::registry::{Registry, RegistryError};
use crate::process::run::RunRequest;
use crate::process::store::Store;

/// `warden keepers`: the keepers' fork server of a daemon (see `process::forks`).
pub use crate::process::forks::serve as serve_forks;

/// Why a keeper could not keep its cell.
#[derive(Debug, thiserror::Error)]
pub enum KeepError {
    #[error("reading the keeper's request from stdin: {0}")]
    Request(String),
    #[error("setting the soft limit of open files: {0}")]
    OpenFiles(std::io::Error),
    #[error("the keeper's log {0}: {1}")]
    Log(std::path::PathBuf, std::io::Error),
    #[error(transparent)]
    Store(#[from] crate::process::store::StoreError),
    #[error(transparent)]
    Snapshot(#[from] crate::process::snapshot::SnapshotError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Run(#[from] RunError),
    #[error(transparent)]
    Gvisor(#[from] crate::gvisor::keeper::GvisorError),
}

/// The keeper of one cell (`warden keep`): reads its [`KeeperRequest`] from `input`, runs the
/// cell to serve execs until it ends, and returns the exit status to leave with.
///
/// `ready`: where to say `ready` once the cell takes execs (the line the request came on, when
/// it is a socket). A keeper started ahead whose line closes with no request ends at once,
/// quietly (its daemon went away).
pub fn keep(
    input: impl std::io::Read,
    ready: Option<std::os::fd::OwnedFd>,
) -> Result<(i32, Vec<String>), KeepError> {
    keep_with(input, ready, None)
}

/// [`keep`], for a keeper forked by `warden run`, with its lines to it: the request is the
/// one `warden run` made, in the memory the fork copied (not written out and read back: the
/// parse's allocations were the keeper's first writes, each page of them copied).
pub(crate) fn keep_forked(
    request: KeeperRequest,
    lines: crate::process::run::RunLines,
) -> Result<(i32, Vec<String>), KeepError> {
    keep_request(request, None, Some(lines))
}

fn keep_with(
    input: impl std::io::Read,
    ready: Option<std::os::fd::OwnedFd>,
    lines: Option<crate::process::run::RunLines>,
) -> Result<(i32, Vec<String>), KeepError> {
    // Read, and let go of, before anything else: `input` may hold the lock of this process's
    // stdin, which the cell's init (a copy of this process) and the helpers it forks would
    // then find held for ever.
    let text = read_all(input).map_err(|e| KeepError::Request(e.to_string()))?;
    if text.is_empty() && ready.is_some() {
        return Ok((0, Vec::new()));
    }
    let request: KeeperRequest =
        serde_json::from_slice(&text).map_err(|e| KeepError::Request(e.to_string()))?;
    keep_request(request, ready, lines)
}

fn keep_request(
    request: KeeperRequest,
    ready: Option<std::os::fd::OwnedFd>,
    lines: Option<crate::process::run::RunLines>,
) -> Result<(i32, Vec<String>), KeepError> {
    if let Some(log) = &request.log_to {
        log_to(log).map_err(|e| KeepError::Log(log.clone(), e))?;
    }
    if let Some(soft) = request.open_files {
        restore_open_files_limit(soft).map_err(KeepError::OpenFiles)?;
    }
    let spec = request.spec;
    let restore = spec.restore.clone();
    let store = Store::open(Store::default_root())?;
    let from = match &spec.from {
        Some(id) => Some(crate::process::snapshot::get(&store, id)?),
        None => None,
    };
    let run = RunRequest {
        policy: spec.policy,
        name: Some(spec.name),
        workspace: if from.is_some() { None } else { spec.workspace },
        serve_exec: request.argv.is_empty(),
        argv: request.argv,
        env: spec.env,
        discard_changes: request.discard_changes,
        from,
        report: spec.report,
        checked: request.checked,
        ready: ready.map(std::sync::Arc::new),
        signals_from: request.signals_from,
        release_later: false,
        lines: lines.map(std::sync::Arc::new),
    };
    let registry = Registry::open(Registry::default_root())?;
    // The keeper keeps a cell of the tier its policy names.
    let outcome = match run.policy.tier {
        Tier::Gvisor => crate::gvisor::keeper::keep(&registry, &store, run, restore.as_deref())?,
        _ if restore.is_some() => {
            return Err(KeepError::Request(
                "the process tier has no memory snapshots to restore".to_owned(),
            ));
        }
        _ => crate::process::run::run(&registry, &store, run)?,
    };
    let status = match outcome.ending {
        Ending::Exited(code) => code,
        Ending::Signaled(signal) => 128 + signal,
        _ => warden_protocol::exit::KILLED,
    };
    Ok((status, outcome.notices))
}

/// Takes back the soft limit of open files the daemon had before it raised its own.
fn restore_open_files_limit(soft: u64) -> std::io::Result<()> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let maximum = getrlimit(Resource::Nofile).maximum;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(maximum.map_or(soft, |hard| soft.min(hard))),
            maximum,
        },
    )
    .map_err(std::io::Error::from)
}

/// Sends this process's stdout and stderr to `path` (a keeper started ahead had none yet).
fn log_to(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    crate::process::sys::dup_onto(file.as_raw_fd(), 1)?;
    crate::process::sys::dup_onto(file.as_raw_fd(), 2)
}

/// Everything `input` gives, `input` dropped when done.
fn read_all(mut input: impl std::io::Read) -> std::io::Result<Vec<u8>> {
    let mut text = Vec::new();
    input.read_to_end(&mut text)?;
    Ok(text)
}
