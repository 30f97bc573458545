//! The host side of a gVisor cell's processes: what the process tier's init does inside its
//! cell, done outside the sandbox. It speaks the same protocol (`process::exec`): the keeper's
//! router passes it exec, file and line requests with the client's socket and stdio, and it
//! answers the client directly (`started`, then how the process ended), takes the client's
//! signals, and kills the process when the client hangs up.
//!
//! It is a single-threaded process the keeper forks before starting any thread (a fork per file
//! operation is then a plain copy of it), in the keeper's mount namespace, where the cell's
//! root is assembled. Each exec is started by Warden's init in the sandbox (pid 1), asked on
//! its socket (the init's stdin) with the client's pipes passed along as the process's stdio:
//! the process writes straight into them, and the init says its pid and, when it reaps it, its
//! wait status. An exec on a terminal (one made here) is a `runsc exec` of its own, and so is
//! every exec while the init has not said it serves (a sandbox restored from an older init's
//! image). Each
//! file operation is a fork that enters the cell's root (`chroot`) as the cell's user and runs
//! the same file service as the process tier's.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use nix::poll::{PollFd, PollFlags, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::compat::INIT_IN_CELL;
use super::runsc::Runsc;
use crate::process::exec::{ExecEvent, ExecRequest, Request};
use crate::process::init::{NOT_EXECUTABLE, NOT_FOUND, SETUP_FAILED};
use crate::process::plan::CellPlan;
use crate::process::sys;

/// What the host side knows of its cell.
#[derive(Debug, Clone)]
pub struct Cell {
    pub runsc: Runsc,
    /// The container's id in runsc (the cell's name).
    pub id: String,
    /// The cell's plan: its root as assembled on the host, its user, environment, directory.
    pub plan: CellPlan,
    /// Made before the first `runsc exec` into the sandbox: until then no process of the cell
    /// holds a descriptor of the host, and a checkpoint has none to end (see `checkpoint`).
    pub execs_marker: PathBuf,
}

/// Makes the cell's mark of execs, once.
fn mark_execs(cell: &Cell) {
    static MARKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !MARKED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        let _ = std::fs::File::create(&cell.execs_marker);
    }
}

/// One process started for a client.
struct Exec {
    id: u64,
    client: Option<OwnedFd>,
    /// Where runsc writes the process's pid in the sandbox; read once.
    pid_pipe: Option<OwnedFd>,
    /// The process's pid in the sandbox (its process group's too: each exec leads a session
    /// of its own there), once runsc has said it.
    inside: Option<i32>,
    /// A terminal's master, sent with `started`.
    master: Option<OwnedFd>,
    /// Signals asked for before the pid was known.
    pending: Vec<i32>,
    /// A file operation (a fork of this process) rather than a `runsc exec`.
    file: bool,
}

/// The host side's socket to the init, and the execs it started or is starting.
struct InitLink {
    socket: OwnedFd,
    /// Whether the init said it serves (`h`, or `p` to a restored one's ping).
    serves: bool,
    next_token: u64,
    /// Asked for, not yet started (by token).
    starting: HashMap<u64, Exec>,
    /// Started, not yet reaped (by pid in the sandbox).
    running: HashMap<i32, Exec>,
}

impl InitLink {
    /// Sends one request, without waiting: an init that does not read (its sandbox paused, or
    /// stuck) must not hold the host side, which serves every client of the cell.
    fn say(&self, message: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        sys::send_message_nowait(self.socket.as_fd(), message, fds)
    }

    /// Sends `signal` to the process group `group` of the sandbox.
    fn signal_group(&self, group: i32, signal: i32) {
        let _ = self.say(format!("k\0{signal}\0{group}").as_bytes(), &[]);
    }

    /// Reads what the init said; `false` once its socket closed (the sandbox is going).
    fn read(&mut self) -> bool {
        loop {
            let message = match sys::try_receive_message(self.socket.as_fd()) {
                Ok(Some((payload, _))) => payload,
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return true,
                Ok(None) | Err(_) => return false,
            };
            let text = String::from_utf8_lossy(&message);
            let mut words = text.split(' ');
            let (kind, a, b) = (words.next(), words.next(), words.next());
            let number = |w: Option<&str>| w.and_then(|w| w.parse::<i64>().ok());
            match (kind, number(a), number(b)) {
                (Some("h" | "p"), _, _) => self.serves = true,
                (Some("s"), Some(token), Some(pid)) => {
                    let Some(mut exec) = self.starting.remove(&(token as u64)) else {
                        continue;
                    };
                    let pid = pid as i32;
                    exec.inside = Some(pid);
                    if let Some(client) = &exec.client {
                        send(client, &ExecEvent::Started { id: exec.id, pid }, &[]);
                    }
                    for signal in std::mem::take(&mut exec.pending) {
                        self.signal_group(pid, signal);
                    }
                    self.running.insert(pid, exec);
                }
                (Some("f"), Some(token), Some(errno)) => {
                    let Some(exec) = self.starting.remove(&(token as u64)) else {
                        continue;
                    };
                    let errno = errno as i32;
                    let code = if errno == libc::ENOENT {
                        NOT_FOUND
                    } else {
                        NOT_EXECUTABLE
                    };
                    if let Some(client) = &exec.client {
                        let message = format!(
                            "the sandbox could not start the process: {}",
                            std::io::Error::from_raw_os_error(errno)
                        );
                        send(
                            client,
                            &ExecEvent::Failed {
                                id: exec.id,
                                code,
                                message,
                            },
                            &[],
                        );
                    }
                }
                (Some("e"), Some(pid), Some(status)) => {
                    if let Some(mut exec) = self.running.remove(&(pid as i32)) {
                        let status = status as i32;
                        let ended = match status & 0x7f {
                            0 => Ok((status >> 8) & 0xff),
                            signal => Err(signal),
                        };
                        finish_reaped(&mut exec, ended);
                    }
                }
                _ => {}
            }
        }
    }

    /// The init is gone (and the sandbox with it): what it was starting failed, what it ran
    /// was killed.
    fn lost(&mut self) {
        for (_, exec) in self.starting.drain() {
            if let Some(client) = &exec.client {
                let message = "the sandbox ended before the process started".to_owned();
                let event = ExecEvent::Failed {
                    id: exec.id,
                    code: NOT_EXECUTABLE,
                    message,
                };
                send(client, &event, &[]);
            }
        }
        for (_, mut exec) in self.running.drain() {
            finish_reaped(&mut exec, Err(libc::SIGKILL));
        }
    }
}

/// Runs the host side until the keeper goes (`lifeline` hangs up). Never returns. `init`: the
/// socket to the init (its stdin); `restored`: the init is asked whether it serves, as a
/// restored one said so before it was saved.
pub fn serve(cell: &Cell, channel: OwnedFd, lifeline: OwnedFd, init: OwnedFd, restored: bool) -> ! {
    let _ = sys::set_parent_death_signal(libc::SIGKILL);
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    if mask.thread_block().is_err() {
        sys::exit_now(SETUP_FAILED);
    }
    let Ok(signals) = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
    else {
        sys::exit_now(SETUP_FAILED);
    };
    let mut execs: HashMap<i32, Exec> = HashMap::new();
    let mut lines: Vec<OwnedFd> = Vec::new();
    let mut init = Some(InitLink {
        socket: init,
        serves: false,
        next_token: 1,
        starting: HashMap::new(),
        running: HashMap::new(),
    });
    if restored && let Some(link) = &init {
        let _ = link.say(b"p", &[]);
    }
    // Once set up a while, the start's pages go (at a poll's timeout: this process has one
    // thread, and forks).
    let mut let_go = sys::LetGo::after_linger(true);
    loop {
        let_go.when_due();
        // The sources polled this round: fixed ones, lines, pid pipes, clients.
        let starting: Vec<i32> = execs
            .iter()
            .filter(|(_, e)| e.pid_pipe.is_some())
            .map(|(pid, _)| *pid)
            .collect();
        let watched: Vec<i32> = execs
            .iter()
            .filter(|(_, e)| e.client.is_some())
            .map(|(pid, _)| *pid)
            .collect();
        // The clients of the init's processes (by pid in the sandbox).
        let watched_inside: Vec<i32> = init.as_ref().map_or_else(Vec::new, |link| {
            link.running
                .iter()
                .filter(|(_, e)| e.client.is_some())
                .map(|(pid, _)| *pid)
                .collect()
        });
        let mut fds = vec![
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
            PollFd::new(channel.as_fd(), PollFlags::POLLIN),
        ];
        if let Some(link) = &init {
            fds.push(PollFd::new(link.socket.as_fd(), PollFlags::POLLIN));
        }
        let init_index = init.as_ref().map(|_| fds.len() - 1);
        let first_line = fds.len();
        fds.extend(
            lines
                .iter()
                .map(|l| PollFd::new(l.as_fd(), PollFlags::POLLIN)),
        );
        let first_start = fds.len();
        fds.extend(starting.iter().filter_map(|pid| {
            let pipe = execs.get(pid)?.pid_pipe.as_ref()?;
            Some(PollFd::new(pipe.as_fd(), PollFlags::POLLIN))
        }));
        let first_client = fds.len();
        fds.extend(watched.iter().filter_map(|pid| {
            let client = execs.get(pid)?.client.as_ref()?;
            Some(PollFd::new(client.as_fd(), PollFlags::POLLIN))
        }));
        let first_inside = fds.len();
        if let Some(link) = &init {
            fds.extend(watched_inside.iter().filter_map(|pid| {
                let client = link.running.get(pid)?.client.as_ref()?;
                Some(PollFd::new(client.as_fd(), PollFlags::POLLIN))
            }));
        }
        match poll(&mut fds, let_go.poll_timeout()) {
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(_) => sys::exit_now(SETUP_FAILED),
        }
        let ready = |i: usize| {
            fds.get(i)
                .and_then(|f| f.revents())
                .is_some_and(|r| !r.is_empty())
        };
        if ready(1) {
            // The keeper is gone; the sandbox goes with it, and so does everything started here.
            sys::exit_now(SETUP_FAILED);
        }
        let (signal_ready, channel_ready) = (ready(0), ready(2));
        let lines_ready: Vec<bool> = (0..lines.len()).map(|i| ready(first_line + i)).collect();
        let started_ready: Vec<i32> = starting
            .iter()
            .enumerate()
            .filter(|(i, _)| ready(first_start + i))
            .map(|(_, pid)| *pid)
            .collect();
        let clients_ready: Vec<i32> = watched
            .iter()
            .enumerate()
            .filter(|(i, _)| ready(first_client + i))
            .map(|(_, pid)| *pid)
            .collect();
        let inside_ready: Vec<i32> = watched_inside
            .iter()
            .enumerate()
            .filter(|(i, _)| ready(first_inside + i))
            .map(|(_, pid)| *pid)
            .collect();
        let init_ready = init_index.is_some_and(ready);
        drop(fds);
        // The init first: its hello comes before the cell is said to be ready, so no exec
        // asked for after that goes to runsc while the init serves.
        if init_ready
            && let Some(link) = init.as_mut()
            && !link.read()
        {
            link.lost();
            init = None;
        }
        if channel_ready {
            match sys::receive_message(channel.as_fd()) {
                Ok(Some((payload, mut received))) => {
                    if matches!(serde_json::from_slice(&payload), Ok(Request::Line)) {
                        if let (Some(line), true) = (received.pop(), received.is_empty()) {
                            lines.push(line);
                        }
                    } else {
                        start(cell, &payload, received, &mut execs, init.as_mut());
                    }
                }
                Ok(None) | Err(_) => sys::exit_now(SETUP_FAILED),
            }
        }
        let mut index = 0;
        lines.retain(|line| {
            index += 1;
            if !lines_ready.get(index - 1).copied().unwrap_or(false) {
                return true;
            }
            match sys::try_receive_message(line.as_fd()) {
                Ok(Some((payload, received))) => {
                    start(cell, &payload, received, &mut execs, init.as_mut());
                    true
                }
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => true,
                Ok(None) | Err(_) => false,
            }
        });
        for pid in started_ready {
            if let Some(exec) = execs.get_mut(&pid) {
                read_inside_pid(cell, init.as_ref(), exec);
            }
        }
        for pid in clients_ready {
            if let Some(exec) = execs.get_mut(&pid) {
                serve_client(cell, init.as_ref(), pid, exec);
            }
        }
        if let Some(link) = init.as_mut() {
            for pid in inside_ready {
                if let Some(mut exec) = link.running.remove(&pid) {
                    serve_client(cell, Some(link), pid, &mut exec);
                    link.running.insert(pid, exec);
                }
            }
        }
        if signal_ready {
            while let Ok(Some(_)) = signals.read_signal() {}
            while let Ok(Some(reaped)) = sys::reap_any() {
                if let Some(mut exec) = execs.remove(&reaped.pid) {
                    finish(cell, init.as_ref(), &mut exec, reaped.status);
                }
            }
        }
    }
}

fn send(client: &OwnedFd, event: &ExecEvent, fds: &[RawFd]) {
    let _ = sys::send_message_nowait(
        client.as_fd(),
        &serde_json::to_vec(event).unwrap_or_default(),
        fds,
    );
}

/// Starts what a request asks for; a request that cannot be started is answered `failed`.
fn start(
    cell: &Cell,
    payload: &[u8],
    mut received: Vec<OwnedFd>,
    execs: &mut HashMap<i32, Exec>,
    init: Option<&mut InitLink>,
) {
    let (id, request, file) = match serde_json::from_slice::<Request>(payload) {
        Ok(Request::Exec { id, request }) => (id, Some(request), None),
        Ok(Request::Files { id, root, file }) => (id, None, Some((root, file))),
        _ => return,
    };
    if received.is_empty() {
        return;
    }
    let client = received.remove(0);
    let fail = |code: i32, message: String| {
        send(&client, &ExecEvent::Failed { id, code, message }, &[]);
    };
    if let Some((root, op)) = file {
        let Ok(stdio) = <[OwnedFd; 3]>::try_from(received) else {
            return fail(
                NOT_EXECUTABLE,
                "a file operation needs stdin, stdout and stderr".to_owned(),
            );
        };
        return match start_file_operation(cell, &root, op, stdio) {
            Ok(pid) => {
                send(&client, &ExecEvent::Started { id, pid }, &[]);
                execs.insert(
                    pid,
                    Exec {
                        id,
                        client: Some(client),
                        pid_pipe: None,
                        inside: Some(pid),
                        master: None,
                        pending: Vec::new(),
                        file: true,
                    },
                );
            }
            Err(err) => fail(
                NOT_EXECUTABLE,
                format!("starting the file operation: {err}"),
            ),
        };
    }
    let Some(request) = request else { return };
    let (stdio, master) = match request.tty {
        Some(size) => {
            let made = sys::open_pty().and_then(|(master, slave)| {
                sys::set_window_size(slave.as_fd(), size.rows, size.cols)?;
                let (a, b) = (slave.try_clone()?, slave.try_clone()?);
                Ok(([a, b, slave], master))
            });
            match made {
                Ok((stdio, master)) => (stdio, Some(master)),
                Err(err) => return fail(NOT_EXECUTABLE, format!("making a terminal: {err}")),
            }
        }
        None => match <[OwnedFd; 3]>::try_from(received) {
            Ok(stdio) => (stdio, None),
            Err(_) => {
                return fail(
                    NOT_EXECUTABLE,
                    "an exec request needs stdin, stdout and stderr".to_owned(),
                );
            }
        },
    };
    if let (Some(link), None) = (init.filter(|link| link.serves), &master) {
        return match start_in_init(cell, link, &request, &stdio) {
            Ok(token) => {
                link.starting.insert(
                    token,
                    Exec {
                        id,
                        client: Some(client),
                        pid_pipe: None,
                        inside: None,
                        master: None,
                        pending: Vec::new(),
                        file: false,
                    },
                );
            }
            Err((code, message)) => fail(code, message),
        };
    }
    match spawn_exec(cell, &request, &stdio) {
        Ok((pid, pid_pipe)) => {
            execs.insert(
                pid,
                Exec {
                    id,
                    client: Some(client),
                    pid_pipe: Some(pid_pipe),
                    inside: None,
                    master,
                    pending: Vec::new(),
                    file: false,
                },
            );
        }
        Err((code, message)) => fail(code, message),
    }
}

/// The environment and directory of an exec, as the process tier's init makes them.
fn exec_env(cell: &Cell, request: &ExecRequest) -> (Vec<(OsString, OsString)>, PathBuf) {
    let mut env = cell.plan.env.clone();
    for (key, value) in &request.env {
        env.retain(|(k, _)| k.as_os_str() != key.as_str());
        env.push((key.into(), value.into()));
    }
    let cwd = request
        .cwd
        .as_ref()
        .map_or_else(|| cell.plan.cwd.clone(), PathBuf::from);
    (env, cwd)
}

/// Asks the init to start a request's process with `stdio` as its stdin, stdout and stderr;
/// the token its answer will name.
fn start_in_init(
    cell: &Cell,
    link: &mut InitLink,
    request: &ExecRequest,
    stdio: &[OwnedFd; 3],
) -> Result<u64, (i32, String)> {
    let (env, cwd) = exec_env(cell, request);
    let Some(program) = request.argv.first() else {
        return Err((NOT_EXECUTABLE, "no command".to_owned()));
    };
    resolve(&cell.plan.root, program, &env, &cwd)?;
    let token = link.next_token;
    link.next_token += 1;
    let mut fields: Vec<Vec<u8>> = vec![
        b"x".to_vec(),
        token.to_string().into_bytes(),
        cwd.as_os_str().as_bytes().to_vec(),
        request.argv.len().to_string().into_bytes(),
    ];
    fields.extend(request.argv.iter().map(|a| a.as_bytes().to_vec()));
    fields.extend(
        env.iter()
            .map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes()].concat()),
    );
    if fields.iter().any(|f| f.contains(&0)) {
        return Err((
            NOT_EXECUTABLE,
            "an argument, variable or directory contains a NUL byte".to_owned(),
        ));
    }
    let message = fields.join(&0u8);
    if message.len() > 60_000 {
        return Err((
            NOT_EXECUTABLE,
            "the process's environment and arguments are too large for gVisor's exec (60 kB)"
                .to_owned(),
        ));
    }
    mark_execs(cell);
    let fds: Vec<RawFd> = stdio.iter().map(|fd| fd.as_raw_fd()).collect();
    link.say(&message, &fds).map_err(|e| {
        let why = match e.kind() {
            std::io::ErrorKind::WouldBlock => {
                "it takes no requests now (is the cell paused?); try again once it runs".to_owned()
            }
            _ => e.to_string(),
        };
        (
            SETUP_FAILED,
            format!("asking the sandbox's init to start the process: {why}"),
        )
    })?;
    Ok(token)
}

/// Starts `runsc exec` for a request, with `stdio` as the process's; returns its host pid and
/// the pipe on which runsc says the process's pid in the sandbox.
fn spawn_exec(
    cell: &Cell,
    request: &ExecRequest,
    stdio: &[OwnedFd; 3],
) -> Result<(i32, OwnedFd), (i32, String)> {
    let (env, cwd) = exec_env(cell, request);
    let Some(program) = request.argv.first() else {
        return Err((NOT_EXECUTABLE, "no command".to_owned()));
    };
    resolve(&cell.plan.root, program, &env, &cwd)?;
    let process = super::bundle::process(
        &cell.plan,
        request.argv.clone(),
        &env,
        &cwd,
        request.tty.is_some(),
    )
    .and_then(|p| serde_json::to_vec(&p).map_err(Into::into))
    .map_err(|e| (NOT_EXECUTABLE, format!("the process's description: {e}")))?;
    let failed = |what: &str| {
        let what = what.to_owned();
        move |e: std::io::Error| (SETUP_FAILED, format!("{what}: {e}"))
    };
    // The process's description goes in through a pipe (runsc reads it whole from
    // /proc/self/fd/3), its pid in the sandbox comes back through another.
    let (spec_r, spec_w) = sys::pipe().map_err(failed("making a pipe"))?;
    let (pid_r, pid_w) = sys::pipe().map_err(failed("making a pipe"))?;
    if process.len() > 60_000 {
        return Err((
            NOT_EXECUTABLE,
            "the process's environment and arguments are too large for gVisor's exec (60 kB)"
                .to_owned(),
        ));
    }
    std::io::Write::write_all(&mut std::fs::File::from(spec_w), &process)
        .map_err(failed("writing the process's description"))?;
    mark_execs(cell);
    let mut command = cell.runsc.command("exec");
    command
        .args([
            "--process",
            "/proc/self/fd/3",
            "--internal-pid-file",
            "/proc/self/fd/4",
        ])
        .arg(&cell.id);
    // Started as posix_spawn starts a process (a vfork), not forked: see `sys::spawn`.
    let described = sys::Described::of(&command);
    let pid = sys::spawn(&sys::Spawn {
        fds: &[(spec_r.as_fd(), 3), (pid_w.as_fd(), 4)],
        parent_death: Some(libc::SIGKILL),
        ..described.spawn_with([stdio[0].as_fd(), stdio[1].as_fd(), stdio[2].as_fd()])
    })
    .map_err(|e| (SETUP_FAILED, format!("starting runsc exec: {e}")))?;
    drop((spec_r, pid_w));
    Ok((pid, pid_r))
}

/// Whether the program of an exec can be started, looked for in the cell's root as the
/// sandbox will (`PATH`, or a path), so that a missing or unrunnable program is told apart
/// from a program's own exit status. Paths on the sandbox's own file systems (`/tmp`, `/dev`,
/// `/proc`, `/sys`: gVisor's, not on the host) cannot be looked at from here and are left to
/// the sandbox.
pub(crate) fn resolve(
    root: &Path,
    program: &str,
    env: &[(OsString, OsString)],
    cwd: &Path,
) -> Result<(), (i32, String)> {
    let sandbox_own = |p: &Path| {
        ["/tmp", "/dev", "/proc", "/sys"]
            .iter()
            .any(|own| p.starts_with(own))
    };
    let candidates: Vec<PathBuf> = if program.contains('/') {
        vec![cwd.join(program)]
    } else if program.is_empty() {
        return Err((NOT_FOUND, "command not found: (empty)".to_owned()));
    } else {
        let search = env
            .iter()
            .rev()
            .find(|(k, _)| k == "PATH")
            .map_or_else(|| OsString::from("/bin:/usr/bin"), |(_, v)| v.clone());
        search
            .as_bytes()
            .split(|b| *b == b':')
            .map(|dir| {
                let dir = Path::new(std::ffi::OsStr::from_bytes(dir));
                if dir.as_os_str().is_empty() {
                    cwd.join(program)
                } else {
                    cwd.join(dir).join(program)
                }
            })
            .collect()
    };
    let mut not_executable = None;
    for candidate in &candidates {
        if sandbox_own(candidate) {
            return Ok(());
        }
        match metadata_in_root(root, candidate) {
            Some((true, true)) => return Ok(()),
            Some((true, false)) | Some((false, _)) => {
                not_executable.get_or_insert(candidate.clone());
            }
            None => {}
        }
    }
    match not_executable {
        Some(path) => Err((
            NOT_EXECUTABLE,
            format!(
                "cannot execute {program}: {} is not an executable file",
                path.display()
            ),
        )),
        None if program.contains('/') => Err((
            NOT_FOUND,
            format!("command not found: {program} (no such file in the cell)"),
        )),
        None => Err((NOT_FOUND, format!("command not found: {program}"))),
    }
}

/// Whether `path` of the cell (absolute) is a regular file, and whether some execute bit is
/// set, looked up beneath `root` with the cell's own symlinks resolved inside it.
fn metadata_in_root(root: &Path, path: &Path) -> Option<(bool, bool)> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let relative = path.strip_prefix("/").unwrap_or(path);
    let relative = if relative.as_os_str().is_empty() {
        Path::new(".")
    } else {
        relative
    };
    let fd = rustix::fs::openat2(
        &dir,
        relative,
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()?;
    let stat = rustix::fs::fstat(&fd).ok()?;
    let file =
        rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::RegularFile;
    Some((file, stat.st_mode & 0o111 != 0))
}

/// Reads the process's pid in the sandbox once runsc wrote it, and tells the client it started.
fn read_inside_pid(cell: &Cell, init: Option<&InitLink>, exec: &mut Exec) {
    let Some(pipe) = exec.pid_pipe.take() else {
        return;
    };
    // runsc writes the pid in one write and keeps its end open until the process ends: one
    // read returns it (an empty one means runsc ended without starting anything).
    let mut buf = [0u8; 32];
    let n = nix::unistd::read(&pipe, &mut buf).unwrap_or(0);
    let Some(pid) = std::str::from_utf8(&buf[..n])
        .ok()
        .and_then(|t| t.trim().parse::<i32>().ok())
    else {
        return;
    };
    exec.inside = Some(pid);
    if let Some(client) = &exec.client {
        let fds: Vec<RawFd> = exec.master.iter().map(|m| m.as_raw_fd()).collect();
        send(client, &ExecEvent::Started { id: exec.id, pid }, &fds);
    }
    exec.master = None;
    for signal in std::mem::take(&mut exec.pending) {
        signal_group(cell, init, pid, signal);
    }
}

/// A client's message: a signal for its process's group, or its hang-up, which kills the
/// process's group (nobody is left to hear how it ends).
fn serve_client(cell: &Cell, init: Option<&InitLink>, pid: i32, exec: &mut Exec) {
    let Some(client) = &exec.client else { return };
    let signal = match sys::try_receive_message(client.as_fd()) {
        Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return,
        Ok(Some((payload, _))) => match serde_json::from_slice::<Request>(&payload) {
            Ok(Request::Signal { signal, .. }) => Some(signal),
            _ => None,
        },
        Ok(None) | Err(_) => {
            exec.client = None;
            Some(libc::SIGKILL)
        }
    };
    let Some(signal) = signal else { return };
    if exec.file {
        // A file operation is a process of this host side.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(-pid),
            Signal::try_from(signal).ok(),
        );
        return;
    }
    match exec.inside {
        Some(inside) => signal_group(cell, init, inside, signal),
        None => exec.pending.push(signal),
    }
}

/// Sends `signal` to the process group `group` of the sandbox, through the cell's own init
/// (runsc signals single processes only): asked on its socket where it serves, else a `runsc
/// exec` of it as a helper (a process of the sandbox like any exec, run as the cell's user;
/// it is reaped with the others and nobody waits for it).
fn signal_group(cell: &Cell, init: Option<&InitLink>, group: i32, signal: i32) {
    if let Some(link) = init.filter(|link| link.serves) {
        return link.signal_group(group, signal);
    }
    let Ok((quiet_r, quiet_w)) = sys::pipe() else {
        return;
    };
    mark_execs(cell);
    let mut command = cell.runsc.command("exec");
    command
        .arg("--user")
        .arg(format!(
            "{}:{}",
            cell.plan.ids.inside_uid, cell.plan.ids.inside_gid
        ))
        .arg(&cell.id)
        .args([
            INIT_IN_CELL,
            "kill",
            &signal.to_string(),
            &group.to_string(),
        ]);
    // Started as posix_spawn starts a process (a vfork), as every runsc here: see `sys::spawn`.
    let described = sys::Described::of(&command);
    let _ = sys::spawn(&described.spawn_with([quiet_r.as_fd(), quiet_w.as_fd(), quiet_w.as_fd()]));
}

/// Says how a process ended: a `runsc exec` exits with the process's status, 128 + N for a
/// process a signal N ended (the one way it tells); a file operation is a process of ours.
fn finish(cell: &Cell, init: Option<&InitLink>, exec: &mut Exec, status: Result<i32, i32>) {
    if exec.pid_pipe.is_some() {
        // Ended before its pid was read: it may still be there.
        read_inside_pid(cell, init, exec);
    }
    if exec.inside.is_none() {
        if let Some(client) = exec.client.take() {
            let message = "gVisor could not start the process (runsc said why on its stderr)";
            let event = ExecEvent::Failed {
                id: exec.id,
                code: NOT_EXECUTABLE,
                message: message.to_owned(),
            };
            send(&client, &event, &[]);
        }
        return;
    }
    let ended = match status {
        Ok(code) if !exec.file && (129..=128 + 64).contains(&code) => Err(code - 128),
        ended => ended,
    };
    finish_reaped(exec, ended);
}

/// Says how a process ended: its exit code, or the signal that ended it.
fn finish_reaped(exec: &mut Exec, ended: Result<i32, i32>) {
    let Some(client) = exec.client.take() else {
        return;
    };
    let id = exec.id;
    let event = match ended {
        Ok(code) => ExecEvent::Exited {
            id,
            code,
            usage: None,
        },
        Err(signal) => ExecEvent::Signaled {
            id,
            signal,
            usage: None,
        },
    };
    send(&client, &event, &[]);
}

/// Forks a child that runs one file operation in the cell's root, as the cell's user, with
/// `stdio`. This process is single-threaded, so the fork is a plain copy of it.
fn start_file_operation(
    cell: &Cell,
    root: &str,
    op: crate::process::files::FileOp,
    stdio: [OwnedFd; 3],
) -> std::io::Result<i32> {
    let pid = sys::clone_process(0)?;
    if pid != 0 {
        return Ok(pid);
    }
    let _ = nix::unistd::setpgid(nix::unistd::Pid::from_raw(0), nix::unistd::Pid::from_raw(0));
    for (fd, target) in stdio.iter().zip([0, 1, 2]) {
        if sys::dup_onto(fd.as_raw_fd(), target).is_err() {
            sys::exit_now(SETUP_FAILED);
        }
    }
    std::mem::forget(stdio);
    let _ = sys::close_from(3);
    let _ = SigSet::empty().thread_set_mask();
    let (uid, gid) = (
        nix::unistd::Uid::from_raw(cell.plan.ids.inside_uid),
        nix::unistd::Gid::from_raw(cell.plan.ids.inside_gid),
    );
    let entered = sys::enter_root(&cell.plan.root)
        .and_then(|()| nix::unistd::setgroups(&[]).map_err(std::io::Error::from))
        .and_then(|()| nix::unistd::setresgid(gid, gid, gid).map_err(std::io::Error::from))
        .and_then(|()| nix::unistd::setresuid(uid, uid, uid).map_err(std::io::Error::from))
        // A cell whose user is 0 has its file operations run as the host's uid 0, which keeps
        // every capability through `setresuid`: without them they may do what the cell's own
        // root, which has none, may not (read a file of mode 000, make a device node).
        .and_then(|()| {
            let none = rustix::thread::CapabilitySet::empty();
            rustix::thread::set_capabilities(
                None,
                rustix::thread::CapabilitySets {
                    effective: none,
                    permitted: none,
                    inheritable: none,
                },
            )
            .map_err(std::io::Error::from)
        })
        .and_then(|()| sys::set_no_new_privs());
    if entered.is_err() {
        sys::exit_now(SETUP_FAILED);
    }
    sys::exit_now(crate::process::files::serve(root, op))
}
