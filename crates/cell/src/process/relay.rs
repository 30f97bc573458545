//! The warden's side of a running cell: relays its stdio, enforces the limits that need a clock
//! or a counter (wall time, output, OOM), forwards signals, and applies network policy updates,
//! until the cell's init has exited and its output is drained.

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;
use nix::sys::signalfd::SignalFd;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use super::cgroup::CellCgroup;
use super::init;
use super::outcome::{Ending, RunError, nix_os};
use super::sys;
use crate::gateway::PolicyWatch;

const STDIO_CHUNK: usize = 64 * 1024;
/// How often the warden checks the cell's OOM counter while a memory limit is set.
const OOM_POLL: Duration = Duration::from_millis(100);
/// How long stdout/stderr may stay open after the cell's init has exited.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

pub(crate) enum Stop {
    Exited(Ending),
    Limit(Ending),
}

/// How a relay ended.
pub(crate) struct Relayed {
    pub(crate) stop: Stop,
    /// Whether the relay reaped the init (and so its pid is free for reuse). Not where the
    /// init told the command's end on its status pipe: the relay returns then, while the
    /// kernel tears the init down, and the caller reaps it.
    pub(crate) init_reaped: bool,
    /// The cell's OOM counter, held open by the relay (where the cell has a cgroup): the
    /// caller's last look at it reads it again without opening it.
    pub(crate) oom: Option<super::cgroup::Watched>,
}

const POLICY_POLL: Duration = Duration::from_millis(100);

/// How often the relay reads the disk watch's last look.
const DISK_POLL: Duration = Duration::from_millis(250);

pub(crate) struct Relay<'a> {
    pub(crate) policy_watch: Option<PolicyWatch>,
    pub(crate) pid: Pid,
    pub(crate) pidfd: &'a OwnedFd,
    pub(crate) cgroup: Option<&'a CellCgroup>,
    pub(crate) stdout: Option<OwnedFd>,
    pub(crate) stderr: Option<OwnedFd>,
    pub(crate) signals: SignalFd,
    /// Only signals from this process are forwarded (`RunRequest::signals_from`).
    pub(crate) signals_from: Option<i32>,
    /// How a signal is passed on to the cell; none: sent to `pid`.
    pub(crate) forward: Option<&'a dyn Fn(Signal)>,
    pub(crate) deadline: Option<(Instant, Duration)>,
    pub(crate) output_cap: Option<u64>,
    pub(crate) memory_limit: Option<u64>,
    /// The disk limit, where the warden's watch keeps it.
    pub(crate) disk: Option<super::disk::Watch>,
    /// The init's status pipe, past its "ok": its last line tells how the command ended
    /// (`init::parse_end`), once nothing else of the cell runs.
    pub(crate) status: Option<&'a mut io::BufReader<fs::File>>,
}

impl Relay<'_> {
    fn kill(&self) {
        let _ = sys::pidfd_send_signal(self.pidfd, libc::SIGKILL);
        if let Some(cg) = self.cgroup {
            let _ = cg.kill_all();
        }
    }

    pub(crate) fn run(mut self) -> Result<Relayed, RunError> {
        // Each stream is dropped (closing our end) at EOF, or when the caller stops reading it:
        // the cell's writer then gets EPIPE, as in a shell pipeline.
        let mut sources = [self.stdout.take(), self.stderr.take()];
        // Held open for the looks (the loop's under a memory limit, the caller's last one),
        // each one read instead of an open, a stat, three reads and a close.
        let oom = self.cgroup.map(CellCgroup::oom_watch);
        let mut exited: Option<(Ending, Instant)> = None;
        let mut init_reaped = false;
        let mut status = self.status.take();
        let mut limit: Option<Ending> = None;
        let mut relayed: u64 = 0;
        // Read into spare capacity: a zeroed buffer had its 16 pages written at every start,
        // for a command that may print nothing.
        let mut buf: Vec<u8> = Vec::with_capacity(STDIO_CHUNK);
        let mut stdout = io::stdout().lock();
        let mut stderr = io::stderr().lock();
        loop {
            if let Some((_, at)) = &exited
                && (sources.iter().all(Option::is_none) || at.elapsed() > DRAIN_GRACE)
            {
                break;
            }
            let now = Instant::now();
            if limit.is_none() {
                if let Some((deadline, wall)) = self.deadline
                    && now >= deadline
                {
                    limit = Some(Ending::WallLimit { limit: wall });
                    self.kill();
                }
                if let (Some(watch), Some(bytes)) = (&oom, self.memory_limit)
                    && watch.oom_kills() > 0
                {
                    limit = Some(Ending::MemoryLimit { limit: bytes });
                    self.kill();
                }
                if let Some(watch) = self.disk.as_ref().filter(|w| w.over()) {
                    limit = Some(Ending::DiskLimit { limit: watch.limit });
                    self.kill();
                }
            }
            let mut wait = Duration::from_secs(3600);
            if let (None, Some((deadline, _))) = (&limit, self.deadline) {
                wait = wait.min(deadline.saturating_duration_since(now));
            }
            if self.memory_limit.is_some() && self.cgroup.is_some() {
                wait = wait.min(OOM_POLL);
            }
            if self.disk.is_some() {
                wait = wait.min(DISK_POLL);
            }
            if exited.is_some() {
                wait = wait.min(Duration::from_millis(50));
            }
            if let Some(watch) = self.policy_watch.as_mut() {
                watch.check();
                wait = wait.min(POLICY_POLL);
            }
            // A line the status pipe's reader holds already is not seen by `poll`.
            let status_held = status
                .as_ref()
                .is_some_and(|reader| reader.buffer().contains(&b'\n'));
            let timeout = match status_held {
                true => PollTimeout::ZERO,
                false => PollTimeout::try_from(wait.as_millis().min(60_000) as i32 + 1)
                    .unwrap_or(PollTimeout::MAX),
            };

            let mut fds = Vec::with_capacity(4);
            fds.push(PollFd::new(self.signals.as_fd(), PollFlags::POLLIN));
            let pid_slot = exited.is_none().then(|| {
                fds.push(PollFd::new(self.pidfd.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let status_slot = match (&status, exited.is_none()) {
                (Some(reader), true) => {
                    fds.push(PollFd::new(reader.get_ref().as_fd(), PollFlags::POLLIN));
                    Some(fds.len() - 1)
                }
                _ => None,
            };
            let slots: Vec<Option<usize>> = sources
                .iter()
                .map(|source| {
                    source.as_ref().map(|fd| {
                        fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                        fds.len() - 1
                    })
                })
                .collect();
            match poll(&mut fds, timeout) {
                Ok(_) => {}
                Err(nix::Error::EINTR) => continue,
                Err(err) => return Err(nix_os("waiting on the cell")(err)),
            }
            let ready = |slot: Option<usize>| {
                slot.and_then(|i| fds[i].revents())
                    .is_some_and(|r| !r.is_empty())
            };
            let signal_ready = ready(Some(0));
            let pid_ready = ready(pid_slot);
            let status_ready = status_held || ready(status_slot);
            let readable: Vec<bool> = slots.iter().map(|slot| ready(*slot)).collect();
            drop(fds);

            let read = match signal_ready {
                true => self.signals.read_signal(),
                false => Ok(None),
            };
            let passed = match read {
                Ok(Some(info)) => match self.signals_from {
                    None => Some(info.ssi_signo as i32),
                    // Only what the caller passes on (a signal to the caller's process
                    // group reaches this process too: that one is dropped).
                    Some(from) => (info.ssi_signo as i32 == sys::forwarding_signal()
                        && info.ssi_pid == from as u32)
                        .then_some(info.ssi_int),
                },
                _ => None,
            };
            // The caller's parent-death signal carries no number: it is gone (killed), and
            // the cell goes with it, as a cell of the process tier goes with its `warden run`.
            if passed == Some(0) && limit.is_none() {
                self.kill();
                limit = Some(Ending::Killed);
            }
            if let Some(number) = passed {
                match (self.forward, Signal::try_from(number).ok()) {
                    (Some(forward), Some(signal)) => forward(signal),
                    (_, signal) => {
                        let _ = nix::sys::signal::kill(self.pid, signal);
                    }
                }
            }
            let sinks: [&mut dyn Write; 2] = [&mut stdout, &mut stderr];
            for ((source, sink), readable) in sources.iter_mut().zip(sinks).zip(readable) {
                let Some(fd) = source.as_ref().filter(|_| readable) else {
                    continue;
                };
                buf.clear();
                let n = match rustix::io::read(fd, rustix::buffer::spare_capacity(&mut buf)) {
                    Ok(0) | Err(_) => {
                        *source = None;
                        continue;
                    }
                    Ok(n) => n,
                };
                let allowed = match (self.output_cap, &limit) {
                    (_, Some(_)) => 0,
                    (Some(cap), None) => (cap.saturating_sub(relayed) as usize).min(n),
                    (None, None) => n,
                };
                if sink
                    .write_all(&buf[..allowed])
                    .and_then(|()| sink.flush())
                    .is_err()
                {
                    *source = None;
                }
                relayed += n as u64;
                if let (Some(cap), None) = (self.output_cap, &limit)
                    && relayed > cap
                {
                    limit = Some(Ending::OutputLimit { limit: cap });
                    self.kill();
                }
            }
            // The init's word first: when it has told the end, it is on its way out with
            // nothing else of the cell left, and its teardown is not waited for here.
            if status_ready
                && exited.is_none()
                && let Some(reader) = status.as_mut()
            {
                let mut line = String::new();
                match io::BufRead::read_line(*reader, &mut line) {
                    Ok(0) | Err(_) => status = None,
                    Ok(_) => {
                        if let Some(ending) = init::parse_end(&line) {
                            exited = Some((ending, Instant::now()));
                        }
                    }
                }
            }
            if pid_ready && exited.is_none() {
                let ending = match waitpid(self.pid, None) {
                    Ok(WaitStatus::Exited(_, code)) => Ending::Exited(code),
                    Ok(WaitStatus::Signaled(_, signal, _)) => Ending::Signaled(signal as i32),
                    _ => Ending::Exited(init::SETUP_FAILED),
                };
                init_reaped = true;
                exited = Some((ending, Instant::now()));
            }
        }
        if let Some(watch) = &self.policy_watch {
            watch.close_record();
        }
        if let Some(watch) = self.disk.as_ref().filter(|_| limit.is_none())
            && watch.over_at_end()
        {
            limit = Some(Ending::DiskLimit { limit: watch.limit });
        }
        let ending = exited.map_or(Ending::Exited(init::SETUP_FAILED), |(e, _)| e);
        Ok(Relayed {
            stop: match limit {
                Some(limit) => Stop::Limit(limit),
                None => Stop::Exited(ending),
            },
            init_reaped,
            oom,
        })
    }
}

/// Copies the warden's stdin into the cell until either side closes. A thread, because a read
/// from a terminal cannot be abandoned; it ends with the process.
pub(crate) fn spawn_stdin_pump(pipe: OwnedFd) {
    std::thread::spawn(move || {
        let mut sink = fs::File::from(pipe);
        let _ = io::copy(&mut io::stdin().lock(), &mut sink);
    });
}
