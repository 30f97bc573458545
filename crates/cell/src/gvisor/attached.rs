//! A gVisor cell that runs one command with the caller's stdio (`warden run` without a
//! daemon): a keeper started for it, in the caller's process group and with the caller's stdio,
//! runs the command as the sandbox's first process and relays its output (counting it against
//! the policy's limit), keeps the wall-clock limit and passes the caller's signals on; how the
//! cell ended comes back in its report.

use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt as _;
use std::process::Command;

use super::keeper::GvisorError;
use crate::process::backend::{KeeperRequest, ProcessBackend};
use crate::process::outcome::{Ending, Release};
use crate::process::store::Store;
use crate::tier::{Attached, CellSpec, StartError};

pub fn run(
    keepers: &ProcessBackend,
    mut spec: CellSpec,
    argv: Vec<std::ffi::OsString>,
    discard_changes: bool,
    before_start: &mut (dyn FnMut() -> Result<(), String> + Send),
) -> Result<Attached, StartError> {
    let config = keepers.config();
    let name = spec.name.clone();
    let forked = forkable(config);
    // Where the keeper is started from here (`warden keep`), the start is journaled before
    // anything of the cell exists; a forked keeper makes the cell meanwhile, and starts the
    // command once told (see `fork_keeper`).
    if !forked {
        before_start().map_err(StartError::Host)?;
    }
    // A forked keeper says the ending on its line instead (no file that a killed `warden run`
    // would leave behind).
    let report = (!forked).then(|| {
        config
            .runtime
            .join(format!(".run-{name}-{}.json", std::process::id()))
    });
    spec.report = report.clone();
    let request = KeeperRequest {
        spec,
        open_files: config.keeper_open_files,
        argv,
        discard_changes,
        log_to: None,
        // This process forwards the signals it gets (its caller's) to the keeper.
        signals_from: Some(std::process::id() as i32),
        // A run's cell is checked by the tier before its start is journaled (`warden run`,
        // or the harness's `run_attached`).
        checked: true,
    };
    // A process of one thread forks the keeper (it runs what `warden keep` would, at once): a
    // new `warden keep` would first run the dynamic loader over the whole binary (~2.5 ms).
    if forked {
        return match fork_keeper(request, before_start)? {
            Forked::EndedEarly {
                ending,
                kept_changes,
                keeper,
            } => Ok(Attached {
                name,
                ending,
                kept_changes,
                notices: Vec::new(),
                // The keeper takes the cell down meanwhile; its end is waited for before the
                // layer is touched, and before this returns.
                release: Release::dropping(Reaped(keeper)),
            }),
            // It ended before it said anything: it said why on the caller's stderr.
            Forked::Exited(status) => Err(keeper_ended(status)),
        };
    }
    let request = serde_json::to_vec(&request)
        .map_err(|e| StartError::Host(format!("writing the keeper's request: {e}")))?;
    // The request in a file of this user's alone (the command's stdin is the caller's).
    let request_file = config
        .runtime
        .join(format!(".keep-{name}-{}.json", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&request_file)
        .and_then(|mut file| file.write_all(&request));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&request_file);
        return Err(StartError::Host(format!(
            "writing the keeper's request {}: {e}",
            request_file.display()
        )));
    }
    let mut command = Command::new(&config.warden_exe);
    command
        .arg("keep")
        .envs(config.keeper_env.iter().map(|(k, v)| (k, v)))
        .env("WARDEN_RUNTIME_DIR", &config.runtime)
        .env("WARDEN_STATE_DIR", &config.state)
        .env(crate::process::backend::KEEP_REQUEST, &request_file);
    // Should `warden run` go, the keeper hears it (see `fork_keeper`).
    let _copies = crate::process::sys::arrange_on_exec(
        &mut command,
        &[],
        Some(crate::process::sys::forwarding_signal()),
    )
    .map_err(|e| StartError::Host(format!("preparing the keeper: {e}")))?;
    let spawned = command.spawn();
    let child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let _ = std::fs::remove_file(&request_file);
            return Err(StartError::Host(format!(
                "starting the keeper {}: {e}",
                config.warden_exe.display()
            )));
        }
    };
    let waited = wait_forwarding(child.id() as i32, None);
    let _ = std::fs::remove_file(&request_file);
    match waited? {
        Forked::Exited(status) => ended(config, name, report.as_deref(), status),
        Forked::EndedEarly { .. } => Err(StartError::Host(
            "the keeper said its cell's end on a line it was not given".to_owned(),
        )),
    }
}

/// Whether the keeper may be forked from this process: it has one thread (the child is a copy
/// of the calling thread, and would find a lock another thread held for ever held), and the
/// keeper's directories and environment are this process's own.
fn forkable(config: &crate::tier::ProcessConfig) -> bool {
    let one_thread =
        crate::process::sys::read_kernel_file("/proc/self/status").is_ok_and(|status| {
            status
                .lines()
                .any(|l| l.split_whitespace().eq(["Threads:", "1"]))
        });
    one_thread
        && config.keeper_env.is_empty()
        && config.runtime == crate::process::registry::Registry::default_root()
        && config.state == Store::default_root()
}

/// How a forked keeper's cell ended: said on the line before the keeper took the cell down, or
/// (a keeper that ended before its cell ran, or that said nothing) its exit status.
enum Forked {
    EndedEarly {
        ending: Ending,
        kept_changes: bool,
        keeper: i32,
    },
    Exited(std::process::ExitStatus),
}

/// A forked keeper still taking its cell down: reaped when dropped.
struct Reaped(i32);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.0), None);
    }
}

/// Forks the keeper, which keeps the cell of `request` as `warden keep` would. The start is
/// journaled (`before_start`) while the keeper makes the cell, which starts the command once
/// that is done (and not at all when it failed); the keeper says how the cell ended before it
/// takes it down, or leaves with its status.
fn fork_keeper(
    request: KeeperRequest,
    before_start: &mut (dyn FnMut() -> Result<(), String> + Send),
) -> Result<Forked, StartError> {
    let pipes = |what| {
        crate::process::sys::pipe()
            .map_err(|e| StartError::Host(format!("creating the keeper's {what} line: {e}")))
    };
    let (go_r, go_w) = pipes("start")?;
    let (ended_r, ended_w) = pipes("end")?;
    // The keeper is born with the signal it is passed signals with blocked (its default
    // action would end it before it reads them).
    let passing = crate::process::sys::with_forwarding(&crate::process::run::forwarded_signals());
    passing
        .thread_block()
        .map_err(|e| StartError::Host(format!("blocking signals: {e}")))?;
    let caller = std::process::id() as i32;
    match crate::process::sys::fork_process() {
        Ok(0) => {
            // Should `warden run` go (a SIGKILL), the keeper hears it (a forwarding signal
            // without a number) and ends the cell, as the process tier's cell ends with it.
            let heard = crate::process::sys::set_parent_death_signal(
                crate::process::sys::forwarding_signal(),
            );
            if heard.is_err() || nix::unistd::getppid().as_raw() != caller {
                crate::process::sys::exit_now(warden_protocol::exit::WARDEN_ERROR);
            }
            drop((go_w, ended_r));
            let lines = crate::process::run::RunLines {
                go: go_r,
                ended: ended_w,
            };
            let code = match crate::keeper::keep_forked(request, lines) {
                Ok((status, notices)) => {
                    for notice in &notices {
                        eprintln!("warden: note: {notice}");
                    }
                    status
                }
                // `warden run` says why.
                Err(crate::keeper::KeepError::Gvisor(GvisorError::CalledOff)) => {
                    warden_protocol::exit::WARDEN_ERROR
                }
                Err(err) => {
                    eprintln!("warden: {err}");
                    warden_protocol::exit::WARDEN_ERROR
                }
            };
            crate::process::sys::exit_now(code)
        }
        Ok(pid) => {
            drop((go_r, ended_w));
            let started = before_start();
            if started.is_ok() {
                // A keeper that ended already (its command was not found) reads nothing.
                let _ = rustix::io::write(&go_w, &[crate::process::run::GO]);
            }
            // Without the byte, the end of the pipe: the keeper takes down what it made.
            drop(go_w);
            let waited = wait_forwarding(pid, started.is_ok().then_some(&ended_r));
            // Without the line (the start failed), only the keeper's exit ends the wait.
            started.map_err(StartError::Host).and(waited)
        }
        Err(e) => Err(StartError::Host(format!("forking the keeper: {e}"))),
    }
}

/// Waits for the keeper `pid` to end, or to say on `ended` how its cell ended, forwarding to it
/// the signals that would end this process (a `kill` of `warden run`'s pid, a terminal's
/// Ctrl-C): the keeper passes on only those this process sends, so a signal to the whole
/// process group reaches the cell once.
fn wait_forwarding(pid: i32, mut ended: Option<&OwnedFd>) -> Result<Forked, StartError> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use nix::sys::signalfd::{SfdFlags, SignalFd};
    use std::os::fd::AsFd as _;
    use std::os::unix::process::ExitStatusExt as _;
    let host = |what: &str, e: &dyn std::fmt::Display| {
        StartError::Host(format!("waiting for the keeper ({what}): {e}"))
    };
    let forwarded = crate::process::run::forwarded_signals();
    forwarded
        .thread_block()
        .map_err(|e| host("blocking signals", &e))?;
    let signals = SignalFd::with_flags(&forwarded, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(|e| host("a signalfd", &e))?;
    let keeper = nix::unistd::Pid::from_raw(pid);
    let pidfd = crate::process::sys::pidfd_open(pid).map_err(|e| host("its pidfd", &e))?;
    let mut said = Vec::new();
    loop {
        let (signalled, exited, telling) = {
            let mut fds = vec![
                PollFd::new(signals.as_fd(), PollFlags::POLLIN),
                PollFd::new(pidfd.as_fd(), PollFlags::POLLIN),
            ];
            if let Some(line) = ended {
                fds.push(PollFd::new(line.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(host("polling", &e)),
            }
            let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
            (
                ready(&fds[0]),
                ready(&fds[1]),
                fds.get(2).is_some_and(ready),
            )
        };
        if signalled && let Ok(Some(info)) = signals.read_signal() {
            let _ = crate::process::sys::forward_signal(pid, info.ssi_signo as i32);
        }
        if telling && let Some(line) = ended {
            let mut buf = [0u8; 512];
            match rustix::io::read(line, &mut buf) {
                Ok(0) | Err(_) => ended = None,
                Ok(n) => said.extend_from_slice(&buf[..n]),
            }
            if let Some(end) = said.iter().position(|&b| b == b'\n') {
                if let Some((ending, kept_changes)) = early_ending(&said[..end]) {
                    return Ok(Forked::EndedEarly {
                        ending,
                        kept_changes,
                        keeper: pid,
                    });
                }
                // Not a report: the keeper's exit tells instead.
                ended = None;
            }
        }
        if exited {
            return match nix::sys::wait::waitpid(keeper, None) {
                Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => Ok(Forked::Exited(
                    std::process::ExitStatus::from_raw(code << 8),
                )),
                Ok(nix::sys::wait::WaitStatus::Signaled(_, signal, _)) => Ok(Forked::Exited(
                    std::process::ExitStatus::from_raw(signal as i32),
                )),
                Ok(other) => Err(host("its status", &format!("{other:?}"))),
                Err(e) => Err(host("its status", &e)),
            };
        }
    }
}

/// A keeper that ended, with `status`, before its cell did.
fn keeper_ended(status: std::process::ExitStatus) -> StartError {
    StartError::Refused(format!(
        "the cell's keeper ended ({status}) before the cell did"
    ))
}

/// The ending a forked keeper said (`RunLines::say_ended`), and whether the cell's workspace
/// changes are kept.
fn early_ending(line: &[u8]) -> Option<(Ending, bool)> {
    let report: serde_json::Value = serde_json::from_slice(line).ok()?;
    let kept_changes = report["kept_changes"].as_bool()?;
    Some((Ending::from_report(&report)?, kept_changes))
}

/// How the cell of a keeper that ended with `status` ended, from its `report`.
fn ended(
    config: &crate::tier::ProcessConfig,
    name: String,
    report: Option<&std::path::Path>,
    status: std::process::ExitStatus,
) -> Result<Attached, StartError> {
    let ended = report.and_then(|report| {
        let bytes = std::fs::read(report).ok();
        let _ = std::fs::remove_file(report);
        serde_json::from_slice::<serde_json::Value>(&bytes?).ok()
    });
    let Some(ended) = ended else {
        // The keeper said why on the caller's stderr.
        return Err(keeper_ended(status));
    };
    let ending = Ending::from_report(&ended)
        .ok_or_else(|| StartError::Host(format!("the keeper's report is not one: {ended}")))?;
    let store = Store::open(config.state.clone()).map_err(|e| StartError::Host(e.to_string()))?;
    Ok(Attached {
        kept_changes: store.layer(&name).exists(),
        name,
        ending,
        notices: Vec::new(),
        release: Default::default(),
    })
}
