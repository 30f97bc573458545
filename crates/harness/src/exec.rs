//! Processes exec'd into cells: start them (after the command rules and the journal), relay
//! their output into their logs, notice how they end, and journal that.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::unix::AsyncFd;
use warden_cell::tier::{ExecEvent, ExecRequest};
use warden_cell::{CellError, Session, Status};

use crate::process::{self, Process};
use crate::{CellFailure, ExecError, ExecSpec, Harness, HarnessError, TtySize};
use crate::{ExitInfo, ExitReason, ProcessInfo};

/// What the task that started a process watches until its end.
struct Watch {
    process: Arc<Process>,
    events: Events,
    outputs: process::Outputs,
    begun: Instant,
    timeout_ms: Option<u64>,
    start_seq: u64,
    oom_before: Option<u64>,
}

impl Harness {
    /// Starts a process in a running cell. Its output and ending are read through the returned
    /// process; the journal has its start before it runs and its end once it ended.
    pub async fn exec(
        self: &Arc<Self>,
        name: &str,
        spec: ExecSpec,
    ) -> Result<Arc<Process>, HarnessError> {
        self.exec_then(name, spec, None).await
    }

    /// `exec`, with what follows the process's end (a run's delete of its cell).
    pub(crate) async fn exec_then(
        self: &Arc<Self>,
        name: &str,
        spec: ExecSpec,
        then: Option<crate::once::Then>,
    ) -> Result<Arc<Process>, HarnessError> {
        self.exec_checked(name, spec, then, true).await
    }

    /// Ends every process of a running cell but its init, and waits until that is done: a
    /// rewound agent session's cut turns may have left a command in the background (`cmd &`,
    /// `setsid`), which went on changing the workspace the rewind had just reset. `kill -KILL
    /// -1` from inside the cell's pid namespace reaches every process there but the init and
    /// the caller. It is the warden's own command, journaled like any exec; the cell's command
    /// rules are not asked (a rule that held or refused it would hold or refuse the rewind).
    pub async fn end_processes(self: &Arc<Self>, name: &str) -> Result<(), HarnessError> {
        if self.live_with_status(name).is_err() {
            // Ended (or never there): no process runs in it, and what follows says the rest.
            return Ok(());
        }
        let spec = ExecSpec {
            argv: vec![
                "sh".to_owned(),
                "-c".to_owned(),
                "kill -KILL -1 2>/dev/null; exit 0".to_owned(),
            ],
            timeout_ms: Some(30_000),
            ..Default::default()
        };
        let process = self.exec_checked(name, spec, None, false).await?;
        let ran = crate::tools::run_to_end(process, 4096, std::future::pending(), |_, _| async {})
            .await?;
        if ran.status != 0 {
            return Err(ExecError::Failed(format!(
                "ending the processes of cell `{name}` (`kill -KILL -1` in it) failed: {}",
                ran.text()
            ))
            .into());
        }
        Ok(())
    }

    async fn exec_checked(
        self: &Arc<Self>,
        name: &str,
        spec: ExecSpec,
        then: Option<crate::once::Then>,
        checked: bool,
    ) -> Result<Arc<Process>, HarnessError> {
        // The start runs to its end on a task of its own, so that a caller that goes away
        // half-way (a client hanging up) cannot leave a process started but unwatched, with no
        // end in the journal; such a process, unless it was asked for in the background, has
        // nobody to stream to and is killed.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let harness = Arc::clone(self);
        let name = name.to_owned();
        let background = spec.background;
        // The same task then watches the process to its end (one task per exec, not two).
        tokio::spawn(async move {
            let (started, watch) = match harness.start(&name, spec, then, &tx, checked).await {
                Ok((process, watch)) => (Ok(process), watch),
                Err(err) => (Err(err), None),
            };
            if let Err(Ok(process)) = tx.send(started)
                && !background
            {
                process.signal(libc::SIGKILL).await;
            }
            if let Some(watch) = watch {
                harness.monitor(watch).await;
            }
        });
        rx.await
            .unwrap_or_else(|_| Err(ExecError::Failed("the exec was cut short".to_owned()).into()))
    }

    async fn start(
        self: &Arc<Self>,
        name: &str,
        spec: ExecSpec,
        then: Option<crate::once::Then>,
        caller: &tokio::sync::oneshot::Sender<Result<Arc<Process>, HarnessError>>,
        checked: bool,
    ) -> Result<(Arc<Process>, Option<Watch>), HarnessError> {
        let (cell, mut status) = self.live_with_status(name)?;
        let (idle_paused, controlled) = self
            .live
            .lock()
            .ok()
            .and_then(|l| l.get(name).map(|l| (l.idle_paused, l.paused)))
            .unwrap_or((false, true));
        if status == Status::Paused && !idle_paused && !controlled {
            // Frozen by the warden's own look at the cell's layer (a diff or a snapshot under
            // way), or by a pause from before this daemon: wait out the former.
            let deadline = Instant::now() + Duration::from_secs(10);
            while status == Status::Paused && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
                status = cell.status().unwrap_or(Status::Running);
            }
        }
        let paused = status == Status::Paused;
        if idle_paused && paused {
            // Paused for being idle: an exec is activity, so it wakes the cell.
            self.control(
                name,
                crate::ControlAction::Resume,
                "exec after an idle pause",
            )
            .await?;
        } else if paused {
            return Err(
                CellFailure::Paused(format!("cell `{name}` is paused; resume it first")).into(),
            );
        }
        if spec.argv.is_empty() || spec.argv[0].is_empty() {
            return Err(ExecError::Invalid("`argv` needs at least the program".to_owned()).into());
        }
        if spec.argv.iter().any(|a| a.contains('\0')) {
            return Err(ExecError::Invalid("`argv` may not contain NUL bytes".to_owned()).into());
        }
        if spec.cwd.as_deref().is_some_and(|cwd| cwd.contains('\0')) {
            return Err(ExecError::Invalid(
                "`cwd` may not contain NUL bytes; give the working directory's path as it is"
                    .to_owned(),
            )
            .into());
        }
        if spec.cwd.as_deref() == Some("") {
            return Err(ExecError::Invalid(
                "`cwd` is empty; give the working directory's path, or leave `cwd` out for \
                 the cell's default"
                    .to_owned(),
            )
            .into());
        }
        check_env(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
        check_request_size(&spec)?;
        if let Some(user) = spec.user {
            let policy = self
                .live
                .lock()
                .ok()
                .and_then(|l| l.get(name).map(|l| l.policy.clone()));
            // Its policy's user, else its image's (read from the image only when asked).
            let cell_user = policy.map(|p| {
                warden_cell::identity(&p, self.store.root())
                    .map_or(p.process.user(), |identity| identity.uid)
            });
            if cell_user.is_some_and(|u| u != user) {
                return Err(ExecError::Invalid(format!(
                    "user {user}: cell `{name}` runs every process as uid {} (its policy's process.user, or its image's user); no process in a cell can change ids. Make a cell with another process.user instead",
                    cell_user.unwrap_or_default()
                ))
                .into());
            }
        }
        self.touch(name);
        if checked {
            self.check_command(name, &spec.argv).await?;
        }
        // A person's answer can come after the cell asked for ended and another took its name:
        // the command starts only in the cell it was asked for (the handle's line to its init
        // is asked for by name, and would reach the new cell).
        let same = self
            .cell(name)
            .is_some_and(|now| std::ptr::addr_eq(Arc::as_ptr(&now), Arc::as_ptr(&cell)));
        if !same {
            return Err(CellFailure::Ended(format!(
                "cell `{name}` ended while `{}` waited for approval; nothing ran",
                spec.argv.join(" ")
            ))
            .into());
        }
        self.touch(name);
        if caller.is_closed() {
            // Gone while the command rules held the exec: nothing starts.
            return Err(
                ExecError::State("the caller went away before the start".to_owned()).into(),
            );
        }
        let oom_before = cell.oom_kills();
        let id = self.next_process.fetch_add(1, Ordering::Relaxed);
        let pipe = || {
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(|e| ExecError::Failed(format!("creating pipes: {e}")))
        };
        // Pipes, or nothing when the cell makes a terminal (its master comes back).
        let pipes = if spec.tty.is_none() {
            Some((pipe()?, pipe()?, pipe()?))
        } else {
            None
        };
        // The start is in the journal's file before the process starts; the fdatasync that makes
        // it durable runs here once the request is on its way to the cell (overlapping the
        // process's start), and nothing is acknowledged before it is done.
        let mut durable = self
            .record_written(
                Some(name),
                "exec.start",
                json!({
                    "process": id,
                    "argv": spec.argv,
                    "cwd": spec.cwd,
                    // Names only: values may be secrets.
                    "env": spec.env.keys().collect::<Vec<_>>(),
                    "background": spec.background,
                    "timeout_ms": spec.timeout_ms,
                }),
                warden_journal::Urgency::Led,
            )
            .await?;
        let started = durable.receipt.clone();
        self.running.put(
            id,
            &json!({ "cell": name, "argv": spec.argv, "start_seq": started.seq }),
        );
        let (ours, theirs) = match pipes {
            Some(((stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w))) => (
                Some((stdin_w, stdout_r, stderr_r)),
                Some([stdin_r, stdout_w, stderr_w]),
            ),
            None => (None, None),
        };
        let request = ExecRequest {
            argv: spec.argv.clone(),
            env: spec.env.clone().into_iter().collect(),
            cwd: spec.cwd.clone(),
            tty: spec.tty,
            // A run's: its cell ends with it, where its tier can.
            last: then.as_ref().is_some_and(|then| then.ends_itself),
        };
        let begun = Instant::now();
        // Sending the request on the line to the init does not wait on the cell (nor does the
        // first exec's request for a line, which the keeper answers from its own thread); the
        // answer is awaited on the runtime.
        let opened = async {
            let stdio = theirs.as_ref().map(|[a, b, c]| [a, b, c]);
            let session = cell.exec(&request, stdio);
            drop(theirs);
            durable.lead(self);
            let session = session?;
            let events = Events::new(Arc::clone(&session), name);
            let (first, fds) = events.next().await?;
            Ok::<_, CellError>((session, events, first, fds))
        }
        .await;
        if let Err(err) = durable.wait(self).await {
            // Not on disk: the start cannot be acknowledged, so the process does not go on.
            if let Ok((session, ..)) = &opened {
                let _ = session.signal(libc::SIGKILL);
            }
            self.running.remove(id);
            return Err(err);
        }
        let (session, events, first, mut fds) = match opened {
            Ok(opened) => opened,
            Err(err) => {
                let message = err.to_string();
                self.record(
                    Some(name),
                    "exec.exit",
                    json!({ "process": id, "reason": "failed", "message": message }),
                )
                .await?;
                self.running.remove(id);
                return Err(ExecError::StartFailed(message).into());
            }
        };
        let pid = match first {
            ExecEvent::Started { pid, .. } => pid,
            ExecEvent::Failed { code, message, .. } => {
                let exit = self
                    .record(
                        Some(name),
                        "exec.exit",
                        json!({ "process": id, "reason": "failed", "code": code, "message": message }),
                    )
                    .await?;
                self.running.remove(id);
                // A run's cell goes before the end is told, as after a process that ran.
                if let Some(then) = then {
                    then.delete(self, name, false).await;
                }
                let process = Arc::new(Process::new(
                    id,
                    name.to_owned(),
                    spec.argv.clone(),
                    spec.background,
                    0,
                    session,
                    None,
                ));
                process.finish(ExitInfo {
                    reason: ExitReason::Failed,
                    code: Some(code),
                    signal: None,
                    message: Some(message),
                    duration_ms: begun.elapsed().as_millis() as u64,
                    usage: None,
                    stdout_bytes: 0,
                    stderr_bytes: 0,
                    journal_seq: Some(exit.seq),
                });
                // Listed like any other: its id can be looked up, waited for and read.
                self.remember(name, &process);
                self.forget_old(name);
                return Ok((process, None));
            }
            other => {
                return Err(
                    ExecError::Failed(format!("the cell answered an exec with {other:?}")).into(),
                );
            }
        };
        let (input, outputs) = match ours {
            // A foreground process given no input reads its end at once: the pipe's end is
            // closed here rather than handed to the runtime only to be closed after the start.
            Some((stdin_w, stdout_r, stderr_r)) if spec.stdin.is_none() && !spec.background => {
                drop(stdin_w);
                (None, process::Outputs::Pipes([stdout_r, stderr_r]))
            }
            Some((stdin_w, stdout_r, stderr_r)) => {
                let stdin = tokio::net::unix::pipe::Sender::from_owned_fd(stdin_w)
                    .map_err(|e| ExecError::Failed(format!("stdin pipe: {e}")))?;
                (
                    Some(process::Input::Pipe(stdin)),
                    process::Outputs::Pipes([stdout_r, stderr_r]),
                )
            }
            None => {
                let Some(master) = fds.pop() else {
                    return Err(ExecError::Failed(
                        "the cell started a terminal process without its terminal".to_owned(),
                    )
                    .into());
                };
                let master = Arc::new(master);
                (
                    Some(process::Input::Tty(Arc::clone(&master))),
                    process::Outputs::Tty(master),
                )
            }
        };
        let process = Arc::new(
            Process::new(
                id,
                name.to_owned(),
                spec.argv.clone(),
                spec.background,
                pid,
                session,
                input,
            )
            .with_output_limit(spec.output_limit)
            .with_then(then),
        );
        self.remember(name, &process);
        if let Some(input) = &spec.stdin {
            let writer = Arc::clone(&process);
            let input = input.clone().into_bytes();
            tokio::spawn(async move {
                let _ = writer.write_stdin(&input, true).await;
            });
        } else if !spec.background && spec.tty.is_some() {
            // A foreground terminal given no input: its end of input (a pipe's was closed).
            let _ = process.write_stdin(&[], true).await;
        }
        let watch = Watch {
            process: Arc::clone(&process),
            events,
            outputs,
            begun,
            timeout_ms: spec.timeout_ms,
            start_seq: started.seq,
            oom_before,
        };
        Ok((process, Some(watch)))
    }

    /// Relays a process's output into its log, waits for its end, and journals it.
    async fn monitor(self: Arc<Self>, watch: Watch) {
        let Watch {
            process,
            events,
            outputs,
            begun,
            timeout_ms,
            start_seq,
            oom_before,
        } = watch;
        // The output is read in this task too: the process's end closes its pipes as the
        // init learns of it, and the two wake this one task.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reading = outputs.read(&process, &stop);
        tokio::pin!(reading);
        let mut read_all = false;
        let last = events.last();
        tokio::pin!(last);
        let deadline = timeout_ms.map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
        let mut timed_out = false;
        let ended = loop {
            tokio::select! {
                ended = &mut last => break ended,
                () = &mut reading, if !read_all => read_all = true,
                () = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)),
                    if deadline.is_some() && !timed_out =>
                {
                    timed_out = true;
                    process.signal(libc::SIGKILL).await;
                }
            }
        };
        // Output written just before the end is still in the pipes: drain it (bounded, since
        // a process the exec started in the background may hold them open; a terminal's
        // reader is then told to stop).
        if !read_all
            && tokio::time::timeout(Duration::from_secs(2), &mut reading)
                .await
                .is_err()
        {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        // The init told the process's end (and a cell that ends with it is ending).
        let told_end = matches!(
            &ended,
            Ok(ExecEvent::Exited { .. } | ExecEvent::Signaled { .. })
        );
        let usage = match &ended {
            Ok(ExecEvent::Exited { usage, .. } | ExecEvent::Signaled { usage, .. }) => *usage,
            _ => None,
        };
        let (reason, code, signal, message) = match ended {
            Ok(ExecEvent::Signaled { signal, .. }) if process.over_output_limit() => (
                ExitReason::OutputLimit,
                None,
                Some(signal),
                Some(format!(
                    "the output limit of {} bytes was exceeded; the process was killed",
                    spec_limit(&process)
                )),
            ),
            Ok(ExecEvent::Exited { code, .. }) => (ExitReason::Exited, Some(code), None, None),
            Ok(ExecEvent::Signaled { signal, .. }) if timed_out => {
                (ExitReason::Timeout, None, Some(signal), None)
            }
            Ok(ExecEvent::Signaled { signal, .. })
                if signal == libc::SIGKILL && self.oom_since(&process.cell, oom_before) =>
            {
                (
                    ExitReason::MemoryLimit,
                    None,
                    Some(signal),
                    Some("the cell's memory limit was reached and the kernel killed it".to_owned()),
                )
            }
            Ok(ExecEvent::Signaled { signal, .. }) => {
                (ExitReason::Signaled, None, Some(signal), None)
            }
            Ok(ExecEvent::Failed { code, message, .. }) => {
                (ExitReason::Failed, Some(code), None, Some(message))
            }
            Ok(ExecEvent::Started { .. }) => (ExitReason::Failed, None, None, None),
            _ if self.walled.lock().is_ok_and(|w| w.contains(&process.cell)) => (
                ExitReason::Timeout,
                None,
                None,
                Some("the cell's wall-clock limit ended it".to_owned()),
            ),
            // The whole cell ended under the process: its keeper says why (the memory limit,
            // when files in /tmp filled it and the kernel took the init).
            Err(err) => match self.ending_after_end(&process.cell).await {
                Some(ending)
                    if ending["reason"] == "memory-limit" || ending["reason"] == "disk-limit" =>
                {
                    (
                        if ending["reason"] == "memory-limit" {
                            ExitReason::MemoryLimit
                        } else {
                            ExitReason::DiskLimit
                        },
                        None,
                        Some(libc::SIGKILL),
                        ending["message"].as_str().map(str::to_owned),
                    )
                }
                _ => (ExitReason::CellEnded, None, None, Some(err.to_string())),
            },
        };
        self.touch(&process.cell);
        let (counts, captured) = process.totals();
        let duration_ms = begun.elapsed().as_millis() as u64;
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let exit = json!({
            "process": process.id,
            "start_seq": start_seq,
            "reason": reason.name(),
            "code": code,
            "signal": signal,
            "message": message,
            "duration_ms": duration_ms,
            "usage": usage,
            "stdout_bytes": counts[0],
            "stderr_bytes": counts[1],
            "stdout": text(&captured[0]),
            "stderr": text(&captured[1]),
            "output_truncated": counts[0] as usize > process::JOURNALED_OUTPUT || counts[1] as usize > process::JOURNALED_OUTPUT,
        });
        let receipt = match process.take_then() {
            None => self.record(Some(&process.cell), "exec.exit", exit).await,
            // A run's: its cell is deleted first, and the exit goes to the disk with the
            // delete's entries (it takes no round of its own, and wakes no thread: the
            // delete's entries wake the journal's syncer, or the wait below leads the round
            // where the delete wrote none); the process is told ended once both are durable.
            Some(then) => {
                let written = self
                    .record_written(
                        Some(&process.cell),
                        "exec.exit",
                        exit,
                        warden_journal::Urgency::Led,
                    )
                    .await;
                then.delete(&self, &process.cell, told_end).await;
                match written {
                    Ok(durable) => durable.wait(&self).await,
                    Err(err) => Err(err),
                }
            }
        };
        if receipt.is_ok() {
            self.running.remove(process.id);
        }
        self.forget_old(&process.cell);
        process.finish(ExitInfo {
            reason,
            code,
            signal,
            message,
            duration_ms,
            usage,
            stdout_bytes: counts[0],
            stderr_bytes: counts[1],
            journal_seq: receipt.ok().map(|r| r.seq),
        });
    }

    /// How the cell ended, once its keeper let go of it (waited for a little: the process's
    /// line closes as the init dies, before the keeper is done).
    async fn ending_after_end(&self, name: &str) -> Option<serde_json::Value> {
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Some(ending) = self.ending_of(name) {
                return Some(ending);
            }
            if self.alive(name) == Some(false) {
                return self.ending_of(name);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }

    /// Whether the cell's memory cgroup killed something since `before` was read.
    fn oom_since(&self, name: &str, before: Option<u64>) -> bool {
        let now = self.cell(name).and_then(|c| c.oom_kills());
        matches!((before, now), (Some(b), Some(n)) if n > b)
    }

    fn remember(&self, name: &str, process: &Arc<Process>) {
        if let Ok(mut processes) = self.processes.lock() {
            processes
                .entry(name.to_owned())
                .or_default()
                .push(Arc::clone(process));
        }
    }

    /// Keeps the daemon's memory bounded: running processes stay, and the most recent ended
    /// ones (their output is in the journal, up to its limit, in any case).
    fn forget_old(&self, name: &str) {
        if let Ok(mut processes) = self.processes.lock()
            && let Some(list) = processes.get_mut(name)
        {
            let ended = list.iter().filter(|p| p.exit().is_some()).count();
            let mut drop_count = ended.saturating_sub(process::KEPT_ENDED);
            list.retain(|p| {
                if drop_count > 0 && p.exit().is_some() {
                    drop_count -= 1;
                    false
                } else {
                    true
                }
            });
        }
    }

    fn touch(&self, name: &str) {
        if let Ok(mut live) = self.live.lock()
            && let Some(l) = live.get_mut(name)
        {
            l.last_activity = Instant::now();
        }
    }

    /// The processes exec'd into a cell by this daemon.
    pub fn processes(&self, name: &str) -> Result<Vec<ProcessInfo>, HarnessError> {
        self.entry(name)?;
        Ok(self
            .processes
            .lock()
            .map(|p| {
                p.get(name)
                    .map(|list| list.iter().map(|p| p.info()).collect())
                    .unwrap_or_default()
            })
            .unwrap_or_default())
    }

    pub fn process(&self, name: &str, id: u64) -> Result<Arc<Process>, HarnessError> {
        self.entry(name)?;
        self.processes
            .lock()
            .ok()
            .and_then(|p| p.get(name).and_then(|l| l.iter().find(|p| p.id == id).cloned()))
            .ok_or_else(|| {
                ExecError::NoProcess(format!("cell `{name}` has no process {id} (processes do not outlive the daemon that started them)")).into()
            })
    }

    /// Sends a signal to a process, journaled.
    pub async fn signal(&self, name: &str, id: u64, signal: i32) -> Result<(), HarnessError> {
        let process = self.process(name, id)?;
        if !(1..=64).contains(&signal) {
            return Err(ExecError::Invalid(format!("{signal} is not a signal number")).into());
        }
        self.record(
            Some(name),
            "exec.signal",
            json!({ "process": id, "signal": signal }),
        )
        .await?;
        process.signal(signal).await;
        Ok(())
    }

    /// Resizes a process's terminal.
    pub async fn resize(&self, name: &str, id: u64, size: TtySize) -> Result<(), HarnessError> {
        let process = self.process(name, id)?;
        if size.rows == 0 || size.cols == 0 {
            return Err(ExecError::Invalid(
                "a terminal needs at least one row and one column".to_owned(),
            )
            .into());
        }
        self.record(
            Some(name),
            "exec.resize",
            json!({ "process": id, "rows": size.rows, "cols": size.cols }),
        )
        .await?;
        process
            .resize(size)
            .map_err(|e| ExecError::State(e.to_string()).into())
    }

    /// Writes to a process's stdin.
    pub async fn stdin(
        &self,
        name: &str,
        id: u64,
        data: &[u8],
        close: bool,
    ) -> Result<(), HarnessError> {
        let process = self.process(name, id)?;
        self.record(
            Some(name),
            "exec.stdin",
            json!({ "process": id, "bytes": data.len(), "close": close }),
        )
        .await?;
        process
            .write_stdin(data, close)
            .await
            .map_err(|e| ExecError::State(e.to_string()).into())
    }
}

/// Checks the variables an exec adds to the cell's environment.
pub(crate) fn check_env<'a>(
    pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), HarnessError> {
    for (key, value) in pairs {
        if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
            return Err(ExecError::Invalid(format!(
                "environment variable `{key}`: the name must be non-empty without `=`, and neither part may contain NUL"
            ))
            .into());
        }
    }
    Ok(())
}

/// The most bytes an exec's command line, environment and working directory may take (as the
/// JSON that carries them to the cell). The request goes to the cell as one socket message,
/// and the kernel takes no longer argument than 128 KiB (`MAX_ARG_STRLEN`): a longer one was
/// refused by the socket, as if the cell were in the wrong state ("Message too long").
const EXEC_REQUEST_LIMIT: usize = 128 * 1024;

fn check_request_size(spec: &ExecSpec) -> Result<(), HarnessError> {
    let size =
        serde_json::to_vec(&(&spec.argv, &spec.env, &spec.cwd)).map_or(usize::MAX, |v| v.len());
    if size > EXEC_REQUEST_LIMIT {
        return Err(ExecError::Invalid(format!(
            "the command line, environment and working directory take {size} bytes, more than \
             the {EXEC_REQUEST_LIMIT} an exec takes; pass large data on the command's standard \
             input or in a file of the cell"
        ))
        .into());
    }
    Ok(())
}

pub(crate) fn spec_limit(process: &Process) -> u64 {
    process.output_limit().unwrap_or(0)
}

/// The events of one exec'd process, awaited on the runtime: no thread waits for a process.
pub(crate) struct Events {
    session: Arc<dyn Session>,
    cell: String,
    /// Registered with the runtime's reactor the first time an event is not there yet: the
    /// `started` that came while the start's journal entry was synced is read without it (a
    /// socket registered with a message waiting wakes the thread that waits on the reactor).
    socket: tokio::sync::OnceCell<AsyncFd<Watched>>,
}

/// A session, watched by the runtime's reactor through its descriptor.
struct Watched(Arc<dyn Session>);

impl std::os::fd::AsRawFd for Watched {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

impl Events {
    pub(crate) fn new(session: Arc<dyn Session>, cell: &str) -> Self {
        Self {
            session,
            cell: cell.to_owned(),
            socket: tokio::sync::OnceCell::new(),
        }
    }

    // The one `unsafe` outside the cell tier's `sys.rs`: registering a descriptor with the
    // runtime's reactor.
    #[allow(unsafe_code)]
    async fn registered(&self) -> Result<&AsyncFd<Watched>, CellError> {
        self.socket
            .get_or_try_init(|| async {
                // SAFETY: the session owns its descriptor and closes it only when dropped; the
                // `Arc` given to the registration keeps the session alive, so the descriptor
                // stays open (and the same) until the registration is dropped.
                let registered = unsafe {
                    AsyncFd::register_with_interest(
                        Watched(Arc::clone(&self.session)),
                        tokio::io::Interest::READABLE,
                    )
                };
                registered.map_err(|err| {
                    CellError::Host(format!(
                        "watching the exec channel of cell `{}`: {}",
                        self.cell,
                        err.into_parts().1
                    ))
                })
            })
            .await
    }

    /// The next event and the descriptors that came with it.
    async fn next(&self) -> Result<(ExecEvent, Vec<std::os::fd::OwnedFd>), CellError> {
        if !self.socket.initialized() {
            // One that comes between this look and the registration is not missed: a socket
            // registered while readable is reported ready at once.
            if let Some(event) = self.session.try_next_event()? {
                return Ok(event);
            }
        }
        let socket = self.registered().await?;
        loop {
            let mut ready = socket
                .readable()
                .await
                .map_err(|e| CellError::Host(format!("waiting for exec events: {e}")))?;
            match ready.get_inner().0.try_next_event()? {
                Some(event) => return Ok(event),
                None => ready.clear_ready(),
            }
        }
    }

    /// The process's final event.
    pub(crate) async fn last(&self) -> Result<ExecEvent, CellError> {
        loop {
            // What comes with the end (the init's copies of the process's output pipes) is
            // closed here at once: the pipes then end where no other process holds them.
            let (event, _) = self.next().await?;
            if event.is_final() {
                return Ok(event);
            }
        }
    }
}
