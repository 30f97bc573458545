//! Control of a running cell from any warden process: pause, resume, kill. Every action goes
//! through the kernel (cgroup freezer, pidfd signals, cgroup kill), never through the cell.

use nix::sys::signal::Signal;

use super::cgroup::CgroupError;
use super::registry::{CellRecord, Registry, RegistryError};
use super::sys;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(
        "cell `{0}` has no cgroup freezer (it was started without a writable cgroup); pause needs one, see `warden doctor`"
    )]
    NoFreezer(String),
    #[error("cell `{0}` is already gone")]
    Gone(String),
    #[error("signalling cell `{name}`: {source}")]
    Signal {
        name: String,
        source: std::io::Error,
    },
}

/// Freezes every process of the cell.
pub fn pause(registry: &Registry, name: &str) -> Result<CellRecord, ControlError> {
    let record = registry.get(name)?;
    let cgroup = record
        .cgroup
        .as_ref()
        .ok_or_else(|| ControlError::NoFreezer(name.to_owned()))?;
    cgroup.freeze()?;
    Ok(record)
}

/// Thaws a paused cell.
pub fn resume(registry: &Registry, name: &str) -> Result<CellRecord, ControlError> {
    let record = registry.get(name)?;
    let cgroup = record
        .cgroup
        .as_ref()
        .ok_or_else(|| ControlError::NoFreezer(name.to_owned()))?;
    cgroup.thaw()?;
    Ok(record)
}

/// Whether the cell is paused.
pub fn is_paused(record: &CellRecord) -> bool {
    record.cgroup.as_ref().is_some_and(|cg| cg.is_frozen())
}

/// Ends every process of the cell. SIGKILL to the cell's pid-namespace init makes the kernel
/// kill every other process in the namespace, whatever they ignore and however fast they fork;
/// the cgroup kill covers a frozen cell too.
pub fn kill(registry: &Registry, name: &str) -> Result<CellRecord, ControlError> {
    let record = registry.get(name)?;
    kill_record(registry, &record)?;
    Ok(record)
}

/// `kill` of the cell `record` describes, where the caller knows the record is current (it
/// holds the cell's lock file open and sees it held).
pub fn kill_record(registry: &Registry, record: &CellRecord) -> Result<(), ControlError> {
    let name = record.name.as_str();
    registry.mark_killed(name)?;
    // The signal cannot reach a later process that reused the pid.
    let pidfd = record
        .init_pidfd()
        .ok_or_else(|| ControlError::Gone(name.to_owned()))?;
    sys::pidfd_send_signal(&pidfd, Signal::SIGKILL as i32).map_err(|source| {
        ControlError::Signal {
            name: name.to_owned(),
            source,
        }
    })?;
    // The init's death takes every process of its pid namespace with it; the keeper kills what
    // its cgroup lists after that (a process that joined the cell from outside its namespace)
    // before it removes the cgroup. A frozen cell needs the cgroup's kill now: a v1 freezer
    // holds a SIGKILL'd init until it is thawed.
    if let Some(cgroup) = record
        .cgroup
        .as_ref()
        .filter(|cg| cg.kill_is_cheap() || !cg.is_thawed())
        && let Err(err) = cgroup.kill_all()
        && !cgroup.pids().is_empty()
    {
        return Err(err.into());
    }
    Ok(())
}

/// How long `runsc run` is given to follow its killed sandbox (it does within milliseconds)
/// before it is killed itself.
const RUNSC_FOLLOWS_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);

/// `kill` of a gVisor cell (its record names `runsc run`, not an init of Warden's), by its
/// sandbox: runsc follows its sandbox's end within milliseconds, having ended the rest of the
/// container (its gofer) and removed the state it keeps of it. Killed itself, it left that
/// state behind, which the keeper then removed with `runsc delete --force`, a start of runsc
/// (20-25 ms here) on the way to the cell's end. Whether runsc ended so: where it did not (no
/// sandbox found, a frozen cell, whose processes a signal does not move, a runsc that did not
/// follow in time), nothing but the sandbox was signalled, and the caller kills as for any
/// cell (`kill_record`).
pub fn kill_through_sandbox(
    registry: &Registry,
    record: &CellRecord,
) -> Result<bool, ControlError> {
    if record.cgroup.as_ref().is_some_and(|cg| !cg.is_thawed()) {
        return Ok(false);
    }
    let Some(runsc) = record.init_pidfd() else {
        return Ok(false);
    };
    let Some(sandbox) = sandbox_of(record.pid) else {
        return Ok(false);
    };
    registry.mark_killed(&record.name)?;
    if sys::pidfd_send_signal(&sandbox, Signal::SIGKILL as i32).is_err() {
        return Ok(false);
    }
    use std::os::fd::AsFd as _;
    Ok(sys::wait_readable(runsc.as_fd(), RUNSC_FOLLOWS_WITHIN).unwrap_or(false))
}

/// A pidfd of the sandbox process `runsc run` (`runsc`) started: its child whose program is
/// `runsc-sandbox`, checked to be runsc's child once its pidfd is open (a pid reused meanwhile
/// is not runsc's child).
fn sandbox_of(runsc: libc::pid_t) -> Option<std::os::fd::OwnedFd> {
    let tasks = std::fs::read_dir(format!("/proc/{runsc}/task")).ok()?;
    let children = tasks.flatten().flat_map(|task| {
        std::fs::read_to_string(task.path().join("children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|pid| pid.parse::<libc::pid_t>().ok())
            .collect::<Vec<_>>()
    });
    children.into_iter().find_map(|child| {
        let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).ok()?;
        let program = cmdline.split(|b| *b == 0).next()?;
        if program != b"runsc-sandbox" {
            return None;
        }
        let pidfd = sys::pidfd_open(child).ok()?;
        (sys::parent_of(child) == Some(runsc)).then_some(pidfd)
    })
}

#[derive(Debug, thiserror::Error)]
pub enum PolicySetError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Policy(#[from] warden_policy::PolicyError),
    #[error(transparent)]
    Rules(#[from] warden_egress::RulesError),
    #[error(
        "cell `{0}` has no egress gateway: its policy let nothing out when it was made (a gateway's sockets, redirect and proxy variables are set up then); make the cell with network rules, or with `network: {{gateway: true}}` to let something out later"
    )]
    NoGateway(String),
    #[error("handing the policy to cell `{name}`: {source}")]
    Io {
        name: String,
        source: std::io::Error,
    },
    #[error("the warden of cell `{0}` did not take the new policy within 5 s")]
    NoAnswer(String),
    #[error("cell `{name}` refused the new policy: {message}")]
    Refused { name: String, message: String },
}

/// Replaces the network rules of a running cell; returns how many open connections the new rules
/// closed. Only the `network` section takes effect on a running cell.
pub fn set_network_policy(
    registry: &Registry,
    name: &str,
    file: &std::path::Path,
) -> Result<u64, PolicySetError> {
    use crate::gateway::{POLICY_ACK, POLICY_UPDATE};
    let policy = warden_policy::from_file(file)?;
    warden_egress::Rules::compile(&policy.network)?;
    let record = registry.get(name)?;
    if !record.gateway {
        return Err(PolicySetError::NoGateway(name.to_owned()));
    }
    let io = |source| PolicySetError::Io {
        name: name.to_owned(),
        source,
    };
    let text = std::fs::read(file).map_err(io)?;
    let target = registry.cell_file(name, POLICY_UPDATE);
    let ack = registry.cell_file(name, POLICY_ACK);
    let _ = std::fs::remove_file(&ack);
    let tmp = target.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, &target).map_err(io)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if let Ok(answer) = std::fs::read_to_string(&ack) {
            let value: serde_json::Value = serde_json::from_str(&answer).unwrap_or_default();
            if value["ok"] == true {
                return Ok(value["closed"].as_u64().unwrap_or(0));
            }
            let message = value["error"]
                .as_str()
                .unwrap_or("unknown error")
                .to_owned();
            return Err(PolicySetError::Refused {
                name: name.to_owned(),
                message,
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Err(PolicySetError::NoAnswer(name.to_owned()))
}

#[derive(Debug, thiserror::Error)]
pub enum ApprovalError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Answer(#[from] warden_egress::AnswerError),
}

/// The questions that `ask` rules of a running cell are waiting on, oldest first.
pub fn pending_questions(
    registry: &Registry,
    name: &str,
) -> Result<Vec<warden_egress::Question>, ApprovalError> {
    registry.get(name)?;
    Ok(warden_egress::pending(
        &registry.cell_file(name, crate::gateway::APPROVALS),
    ))
}

/// Answers question `id` of a running cell: the held connection goes on, or gets its 403.
pub fn answer_question(
    registry: &Registry,
    name: &str,
    id: u64,
    allow: bool,
) -> Result<(), ApprovalError> {
    registry.get(name)?;
    let dir = registry.cell_file(name, crate::gateway::APPROVALS);
    Ok(warden_egress::answer(&dir, name, id, allow)?)
}
