//! A gVisor cell that runs one command with the caller's stdio (`warden run` without a
//! daemon): its keeper is started as for any cell, the command is exec'd into it over pipes
//! this process relays (counting the output against the policy's limit), the wall-clock limit
//! and the forwarded signals are kept here, and the cell is ended with its command.

use std::io::{Read as _, Write as _};
use std::os::fd::{AsFd as _, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use crate::process::backend::ProcessBackend;
use crate::process::exec::{ExecEvent, ExecRequest};
use crate::process::init::{NOT_EXECUTABLE, NOT_FOUND};
use crate::process::run::Ending;
use crate::process::store::Store;
use crate::process::sys;
use crate::tier::{Attached, Backend as _, Cell, CellSpec, Session, StartError, Status};

const CHUNK: usize = 64 * 1024;

pub fn run(
    keepers: &ProcessBackend,
    mut spec: CellSpec,
    argv: Vec<std::ffi::OsString>,
    discard_changes: bool,
    before_start: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Attached, StartError> {
    let host = |what: &str| {
        let what = what.to_owned();
        move |e: std::io::Error| StartError::Host(format!("{what}: {e}"))
    };
    // The wall-clock and output limits are this process's to keep: the command's end is the
    // cell's.
    let wall = spec.policy.limits.wall.take().map(|w| w.0);
    let output_cap = spec.policy.limits.output.map(|o| o.0);
    let memory = spec.policy.limits.memory.map(|m| m.0);
    let name = spec.name.clone();
    let state = keepers.config().state.clone();
    // The keeper's words, for a start that fails (removed with the run).
    let log = keepers
        .config()
        .runtime
        .join(format!(".keeper-{name}-{}.log", std::process::id()));
    spec.log.get_or_insert_with(|| log.clone());
    let started = keepers.start(spec);
    let _ = std::fs::remove_file(&log);
    let cell = started?;
    let end_cell = |cell: &Arc<dyn Cell>| {
        let _ = cell.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !matches!(cell.status(), Ok(Status::Ended)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    if let Err(message) = before_start() {
        end_cell(&cell);
        return Err(StartError::Host(message));
    }
    let (stdin_r, stdin_w) = sys::pipe().map_err(host("creating pipes"))?;
    let (stdout_r, stdout_w) = sys::pipe().map_err(host("creating pipes"))?;
    let (stderr_r, stderr_w) = sys::pipe().map_err(host("creating pipes"))?;
    let request = ExecRequest {
        argv: argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        ..ExecRequest::default()
    };
    let session = match cell.exec(&request, Some([&stdin_r, &stdout_w, &stderr_w])) {
        Ok(session) => session,
        Err(err) => {
            end_cell(&cell);
            return Err(StartError::Host(err.to_string()));
        }
    };
    drop((stdin_r, stdout_w, stderr_w));
    pump_stdin(stdin_w);
    let signals = SignalFd::with_flags(
        &crate::process::run::forwarded_signals(),
        SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK,
    )
    .map_err(|e| StartError::Host(format!("creating a signalfd: {e}")))?;
    let started = Instant::now();
    let ending = relay(
        &*session,
        [Some(stdout_r), Some(stderr_r)],
        &signals,
        wall.map(|w| (started + w, w)),
        output_cap,
    );
    end_cell(&cell);
    let ending = match (ending, memory) {
        (Ending::Exited(_) | Ending::Signaled(_), Some(limit))
            if cell.oom_kills().is_some_and(|n| n > 0) =>
        {
            Ending::MemoryLimit { limit }
        }
        (other, _) => other,
    };
    // The keeper kept the layer if the cell changed something.
    let store = Store::open(state).map_err(|e| StartError::Host(e.to_string()))?;
    let layer = store.layer(&name);
    let mut kept_changes = layer.exists();
    if discard_changes {
        if kept_changes {
            let _ = layer.detach();
            let _ = layer.remove();
        }
        let _ = std::fs::remove_file(store.net_log_path(&name));
        kept_changes = false;
    }
    Ok(Attached {
        name,
        ending,
        notices: Vec::new(),
        kept_changes,
    })
}

/// Copies this process's stdin into the command's, on a thread of its own.
fn pump_stdin(pipe: OwnedFd) {
    let _ = std::thread::Builder::new()
        .name("stdin".to_owned())
        .spawn(move || {
            let mut sink = std::fs::File::from(pipe);
            let mut source = std::io::stdin().lock();
            let mut buf = vec![0u8; CHUNK];
            loop {
                match source.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if sink.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        });
}

/// Relays the command's output until it ended and its streams are drained; keeps the limits;
/// passes on the forwarded signals.
fn relay(
    session: &dyn Session,
    mut sources: [Option<OwnedFd>; 2],
    signals: &SignalFd,
    deadline: Option<(Instant, Duration)>,
    output_cap: Option<u64>,
) -> Ending {
    let mut ended: Option<(Ending, Instant)> = None;
    let mut limit: Option<Ending> = None;
    let mut relayed = 0u64;
    let mut buf = vec![0u8; CHUNK];
    loop {
        if let Some((ending, at)) = &ended
            && (sources.iter().all(Option::is_none) || at.elapsed() > Duration::from_secs(2))
        {
            return limit.unwrap_or_else(|| ending.clone());
        }
        if limit.is_none()
            && let Some((at, wall)) = deadline
            && Instant::now() >= at
        {
            let _ = session.signal(libc::SIGKILL);
            limit = Some(Ending::WallLimit { limit: wall });
        }
        // The session is listened to until its last event (its socket then only says EOF).
        let events = match ended {
            None => PollFlags::POLLIN,
            Some(_) => PollFlags::empty(),
        };
        let mut fds = vec![
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(sys::borrow_of(session), events),
        ];
        let streams: Vec<usize> = (0..2).filter(|i| sources[*i].is_some()).collect();
        for i in &streams {
            if let Some(fd) = &sources[*i] {
                fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
            }
        }
        let timeout = deadline
            .filter(|_| limit.is_none())
            .map(|(at, _)| at.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_millis(500))
            .min(Duration::from_millis(500));
        let _ = poll(
            &mut fds,
            PollTimeout::try_from(timeout.as_millis() as i32).unwrap_or(PollTimeout::NONE),
        );
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        if ready[0] {
            while let Ok(Some(info)) = signals.read_signal() {
                let _ = session.signal(info.ssi_signo as i32);
            }
        }
        if ready[1] {
            loop {
                let event = match session.try_next_event() {
                    Ok(Some((event, _))) => event,
                    Ok(None) => break,
                    Err(_) => {
                        // The cell went before the command's end was told.
                        ended.get_or_insert((Ending::Killed, Instant::now()));
                        break;
                    }
                };
                let ending = match event {
                    ExecEvent::Started { .. } => continue,
                    ExecEvent::Exited { code, .. } => Ending::Exited(code),
                    ExecEvent::Signaled { signal, .. } => Ending::Signaled(signal),
                    ExecEvent::Failed { code, message, .. } if code == NOT_FOUND => {
                        Ending::CommandNotFound(message)
                    }
                    ExecEvent::Failed { code, message, .. } if code == NOT_EXECUTABLE => {
                        Ending::CannotExecute(message)
                    }
                    ExecEvent::Failed { message, .. } => Ending::CannotExecute(message),
                };
                ended.get_or_insert((ending, Instant::now()));
            }
        }
        for (k, i) in streams.iter().enumerate() {
            if !ready[2 + k] {
                continue;
            }
            let Some(fd) = &sources[*i] else { continue };
            let n = nix::unistd::read(fd, &mut buf).unwrap_or(0);
            if n == 0 {
                sources[*i] = None;
                continue;
            }
            relayed += n as u64;
            let out = if *i == 0 {
                std::io::stdout()
                    .write_all(&buf[..n])
                    .and_then(|()| std::io::stdout().flush())
            } else {
                std::io::stderr().write_all(&buf[..n])
            };
            if out.is_err() {
                // The reader went: the command's writes fail from now on, as in a pipeline.
                sources[*i] = None;
            }
            if let Some(cap) = output_cap
                && relayed > cap
                && limit.is_none()
            {
                let _ = session.signal(libc::SIGKILL);
                limit = Some(Ending::OutputLimit { limit: cap });
            }
        }
    }
}
