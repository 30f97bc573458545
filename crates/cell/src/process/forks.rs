//! The keepers' fork server (`warden keepers`): one process per daemon, started once, that
//! forks each keeper the daemon asks for.
//!
//! A keeper started as a new `warden keep` runs the dynamic loader over the whole binary: about
//! 2.5 ms, and ~600 KiB of relocated data written into pages of its own, which it and its cell's
//! init then hold as long as the cell lives. A keeper forked from the server shares those pages
//! with the server and with every other keeper, and starts in a fraction of a millisecond.
//!
//! The fork is `CLONE_PARENT`: the keeper is the daemon's child, exactly as one the daemon
//! started itself, so the daemon reaps it, reads its exit status, and its keepers outlive it in
//! the same way. The server itself holds nothing of any cell: it is single-threaded, reads one
//! request at a time, and ends when the daemon's end of its socket closes.
//!
//! Every keeper forked from one server has the server's address-space layout, as a zygote's
//! children do. The daemon, which parses what clients send, keeps a layout of its own; each
//! cell's init is made undumpable, so no cell reads its keeper's layout from `/proc`.
//!
//! Only keepers without secrets are forked: a keeper given secrets is started as `warden keep`
//! with them in its environment, so that they never pass through the server's memory, which
//! every keeper it forks later would copy.
//!
//! The protocol: the server's stdin is a `SOCK_SEQPACKET` socket. A request is one message, one
//! byte, with three descriptors: the keeper's line (its stdin), its stdout and its stderr. The
//! answer is one message, a [`ForkAnswer`] as JSON.

use std::io;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::sys;
use crate::tier::ProcessConfig;

/// A request: this one byte, with the keeper's three descriptors.
const FORK: &[u8] = b"k";

/// A request for a helper (a workspace's swap, `swap::helper`): this byte, then the helper's
/// job as JSON, with its descriptors.
const HELPER: u8 = b'h';

/// A request for a spare helper: this byte alone. The server forks a helper that waits for
/// its job on a socket of its own (its stdin), and answers with the other end of that socket,
/// on which the daemon later sends the job and its descriptors as it would send them here.
const SPARE: &[u8] = b"s";

/// What the daemon sends a spare helper once it holds it ready (while no job can be sent to it
/// yet): from then on the spare reads `helper` in `ps`, a helper that waits for its job or
/// does it. Before, it reads `spare`: forked, and not yet the daemon's to hand a job to.
const HELD: &[u8] = b"k";

/// The server's answer: the keeper's pid, or why it could not fork one.
#[derive(Serialize, Deserialize)]
enum ForkAnswer {
    Forked { pid: i32 },
    Failed { error: String },
}

/// How long the daemon waits for the server's answer before it starts keepers itself.
const ANSWER_DEADLINE: Duration = Duration::from_secs(10);

/// Serves forks on stdin until the daemon closes it. Each forked keeper runs `keep` and exits
/// with the status it returns.
pub fn serve(keep: fn() -> i32) -> io::Result<()> {
    let stdin = std::io::stdin();
    let socket = stdin.as_fd();
    use nix::sys::socket::{SockType, getsockopt, sockopt};
    let kind = getsockopt(&socket, sockopt::SockType).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "`warden keepers` is started by the daemon, with a socket as its stdin",
        )
    })?;
    if kind != SockType::SeqPacket {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "`warden keepers` needs a datagram-sequence socket as its stdin",
        ));
    }
    // What it ran only to start (the command line's parser, mostly) is not the keepers'.
    sys::let_go_of_startup();
    loop {
        let Some((payload, fds)) = sys::receive_message(socket)? else {
            return Ok(());
        };
        let (answer, passed) = match fork_one(&payload, fds, keep) {
            Ok((pid, passed)) => (ForkAnswer::Forked { pid }, passed),
            Err(error) => (ForkAnswer::Failed { error }, None),
        };
        let answer = serde_json::to_vec(&answer).map_err(io::Error::other)?;
        let passed: Vec<_> = passed.iter().map(|fd| fd.as_raw_fd()).collect();
        sys::send_message(socket, &answer, &passed)?;
    }
}

/// Forks one keeper or helper as the request asks; its pid, and the descriptor that goes back
/// with the answer (a spare helper's socket). Runs `keep` (or the helper) in the child, which
/// never returns from here.
fn fork_one(
    payload: &[u8],
    fds: Vec<OwnedFd>,
    keep: fn() -> i32,
) -> Result<(i32, Option<OwnedFd>), String> {
    if payload == SPARE {
        return fork_spare().map(|(pid, socket)| (pid, Some(socket)));
    }
    if let Some((&HELPER, job)) = payload.split_first() {
        return fork_helper(job, fds).map(|pid| (pid, None));
    }
    if payload != FORK {
        return Err(format!("{} bytes that are not a request", payload.len()));
    }
    let [line, out, err]: [OwnedFd; 3] = fds
        .try_into()
        .map_err(|fds: Vec<OwnedFd>| format!("{} descriptors sent, not 3", fds.len()))?;
    // The server is single-threaded: the child is a whole copy of it.
    match sys::clone_process(libc::CLONE_PARENT).map_err(|e| format!("forking a keeper: {e}"))? {
        0 => {
            let code = match become_keeper(line, out, err) {
                Ok(()) => keep(),
                Err(e) => {
                    eprintln!("warden: setting up a forked keeper: {e}");
                    warden_protocol::exit::WARDEN_ERROR
                }
            };
            std::process::exit(code)
        }
        // The descriptors are the keeper's now; the server's copies close here.
        pid => Ok((pid, None)),
    }
}

/// Forks a spare helper (the daemon's child, as `fork_helper`'s), which waits for its job on
/// its stdin, a socket whose other end is returned: the daemon sends the job there when it
/// needs a helper, rather than asking here and waiting for a fork (`Forks::helper`).
fn fork_spare() -> Result<(i32, OwnedFd), String> {
    let (ours, theirs) =
        sys::seqpacket_pair().map_err(|e| format!("a spare helper's socket: {e}"))?;
    match sys::clone_process(libc::CLONE_PARENT)
        .map_err(|e| format!("forking a spare helper: {e}"))?
    {
        0 => {
            drop(ours);
            // Its stdin, the server's socket until now, becomes its own.
            if sys::dup_onto(theirs.as_raw_fd(), 0).is_err() {
                sys::exit_now(warden_protocol::exit::WARDEN_ERROR);
            }
            drop(theirs);
            // Not to be taken for the fork server in `ps` while it waits.
            let exe = std::env::args_os().next().unwrap_or_default();
            let exe = exe.to_string_lossy();
            let _ = sys::replace_cmdline(&format!("{exe}\0spare"));
            let code = loop {
                match sys::receive_message(std::io::stdin().as_fd()) {
                    Ok(Some((message, _))) if message == HELD => {
                        let _ = sys::replace_cmdline(&format!("{exe}\0helper"));
                    }
                    Ok(Some((job, fds))) => break super::swap::helper(&job, fds),
                    // Let go of unused (the daemon ends, or had one spare too many).
                    _ => break 0,
                }
            };
            sys::exit_now(code)
        }
        pid => Ok((pid, ours)),
    }
}

/// Forks a helper that does `job` with `fds` (see `swap::helper`) and exits with its code: the
/// daemon's child (`CLONE_PARENT`), which the daemon waits for. A fork of this small process
/// costs a fraction of a fork of the daemon (about a millisecond there: the page tables of its
/// tens of MiB copied, and each page it writes afterwards copied again).
fn fork_helper(job: &[u8], fds: Vec<OwnedFd>) -> Result<i32, String> {
    match sys::clone_process(libc::CLONE_PARENT).map_err(|e| format!("forking a helper: {e}"))? {
        0 => sys::exit_now(super::swap::helper(job, fds)),
        // The descriptors are the helper's now; the server's copies close here.
        pid => Ok(pid),
    }
}

/// In the forked child: takes the keeper's stdio, process group and name.
fn become_keeper(line: OwnedFd, out: OwnedFd, err: OwnedFd) -> io::Result<()> {
    // Its stdin, the server's socket until now, becomes the line.
    sys::dup_onto(line.as_raw_fd(), 0)?;
    sys::dup_onto(out.as_raw_fd(), 1)?;
    sys::dup_onto(err.as_raw_fd(), 2)?;
    drop((line, out, err));
    // Its own process group: signals meant for the daemon's terminal are not its.
    rustix::process::setpgid(None, None)?;
    // `warden keep`, as a keeper started on its own reads in `ps`.
    let exe = std::env::args_os().next().unwrap_or_default();
    let _ = sys::replace_cmdline(&format!("{}\0keep", exe.to_string_lossy()));
    Ok(())
}

/// The fork server of one configuration (binary, directories, environment), shared by every
/// tier's backend of this process that starts keepers ahead with it; ended when the last
/// of them goes.
#[derive(Debug)]
pub(crate) struct Forks {
    config: ProcessConfig,
    server: Mutex<Option<ForkServer>>,
    /// A helper forked ahead, waiting for its job.
    spare: Mutex<Option<Spare>>,
}

/// A spare helper: the daemon's child, and the socket it waits on for its job.
#[derive(Debug)]
struct Spare {
    pid: i32,
    socket: OwnedFd,
}

impl Spare {
    /// Lets go of it unused: it ends once its socket closes, and is reaped behind the caller.
    fn let_go(self) {
        drop(self.socket);
        super::background::reap(self.pid);
    }
}

impl Drop for Forks {
    fn drop(&mut self) {
        if let Some(spare) = self.spare.get_mut().ok().and_then(Option::take) {
            spare.let_go();
        }
    }
}

/// The fork servers of this process, one per configuration in use.
static SHARED: Mutex<Vec<Weak<Forks>>> = Mutex::new(Vec::new());

impl Forks {
    /// The fork server for `config`: the one in use, or one started at its first fork.
    pub(crate) fn shared(config: &ProcessConfig) -> Arc<Self> {
        let same = |other: &ProcessConfig| {
            other.warden_exe == config.warden_exe
                && other.runtime == config.runtime
                && other.state == config.state
                && other.keeper_env == config.keeper_env
        };
        let mut shared = SHARED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        shared.retain(|weak| weak.strong_count() > 0);
        if let Some(forks) = shared
            .iter()
            .filter_map(Weak::upgrade)
            .find(|forks| same(&forks.config))
        {
            return forks;
        }
        let forks = Arc::new(Self {
            config: config.clone(),
            server: Mutex::new(None),
            spare: Mutex::new(None),
        });
        shared.push(Arc::downgrade(&forks));
        forks
    }

    /// Forks a keeper with `line` as its stdin and `out`, `err` as its stdout and stderr. A
    /// server that is gone or fails is replaced at the next fork.
    pub(crate) fn fork(
        &self,
        line: OwnedFd,
        out: OwnedFd,
        err: OwnedFd,
    ) -> io::Result<ForkedKeeper> {
        self.with_server(|running| running.fork(line, out, err))
    }

    /// A helper that does `job` (JSON) with `fds` (see `swap::helper`): its pid, a child of
    /// this process's to wait for. The spare forked ahead takes it where there is one (no
    /// round trip to the server and its fork on the caller's way: 0.26 ms of a quiet cell's
    /// turn-over of 2.5 here); the next spare is forked behind the caller, on the background
    /// thread.
    pub(crate) fn helper(
        self: &Arc<Self>,
        job: &[u8],
        fds: &[std::os::fd::RawFd],
    ) -> io::Result<i32> {
        let spare = self.spare.lock().ok().and_then(|mut spare| spare.take());
        let handed = spare.and_then(|spare| {
            match sys::send_message(spare.socket.as_fd(), job, fds) {
                Ok(()) => Some(spare.pid),
                // It ended (killed): reaped, and a helper is forked as where there is none.
                Err(_) => {
                    spare.let_go();
                    None
                }
            }
        });
        let pid = match handed {
            Some(pid) => pid,
            None => self.with_server(|running| running.helper(job, fds))?,
        };
        let forks = Arc::clone(self);
        super::background::later(move || forks.fork_spare());
        Ok(pid)
    }

    /// Has the server fork a spare helper, where none waits.
    fn fork_spare(&self) {
        if self.spare.lock().map_or(true, |spare| spare.is_some()) {
            return;
        }
        let Ok(spare) = self.with_server(ForkServer::spare) else {
            return;
        };
        match self.spare.lock() {
            // Told while the slot is held: a job, sent once it is taken from there, comes
            // after on its socket.
            Ok(mut slot) if slot.is_none() => {
                match sys::send_message(spare.socket.as_fd(), HELD, &[]) {
                    Ok(()) => *slot = Some(spare),
                    Err(_) => spare.let_go(),
                }
            }
            _ => spare.let_go(),
        }
    }

    /// `ask` of the running server (started where none runs); a server that fails it is
    /// replaced at the next request.
    fn with_server<T>(&self, ask: impl FnOnce(&mut ForkServer) -> io::Result<T>) -> io::Result<T> {
        let mut server = self
            .server
            .lock()
            .map_err(|_| io::Error::other("the fork server's lock is poisoned"))?;
        let alive = server.as_mut().is_some_and(ForkServer::alive);
        let running = match server.take() {
            Some(running) if alive => server.insert(running),
            _ => server.insert(ForkServer::start(&self.config)?),
        };
        let answer = ask(running);
        if answer.is_err() {
            *server = None;
        }
        answer
    }
}

/// A fork server of this process's (a daemon's), for helpers: `None` where none is in use (a
/// command without a daemon forks its helpers itself).
pub(crate) fn helper_server() -> Option<Arc<Forks>> {
    let shared = SHARED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    shared.iter().find_map(Weak::upgrade)
}

/// The daemon's side: the server process and its socket.
#[derive(Debug)]
struct ForkServer {
    child: Child,
    socket: OwnedFd,
}

impl ForkServer {
    /// Starts `warden keepers` with the environment every keeper gets.
    fn start(config: &ProcessConfig) -> io::Result<Self> {
        let (socket, theirs) = sys::seqpacket_pair()?;
        let child = Command::new(&config.warden_exe)
            .arg("keepers")
            .envs(config.keeper_env.iter().map(|(k, v)| (k, v)))
            .env("WARDEN_RUNTIME_DIR", &config.runtime)
            .env("WARDEN_STATE_DIR", &config.state)
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        Ok(Self { child, socket })
    }

    /// Has the server fork a keeper with `line` as its stdin and `out`, `err` as its stdout and
    /// stderr.
    fn fork(&mut self, line: OwnedFd, out: OwnedFd, err: OwnedFd) -> io::Result<ForkedKeeper> {
        let fds = [line.as_raw_fd(), out.as_raw_fd(), err.as_raw_fd()];
        let pid = self.ask(FORK, &fds)?;
        drop((line, out, err));
        Ok(ForkedKeeper {
            pid,
            // Our child (CLONE_PARENT): its pid is not reused before we reap it.
            pidfd: sys::pidfd_open(pid)?,
            status: None,
        })
    }

    /// Has the server fork a helper: its pid.
    fn helper(&mut self, job: &[u8], fds: &[std::os::fd::RawFd]) -> io::Result<i32> {
        let mut payload = Vec::with_capacity(job.len() + 1);
        payload.push(HELPER);
        payload.extend_from_slice(job);
        self.ask(&payload, fds)
    }

    /// Has the server fork a spare helper.
    fn spare(&mut self) -> io::Result<Spare> {
        let (pid, passed) = self.ask_for(SPARE, &[])?;
        match passed.into_iter().next() {
            Some(socket) => Ok(Spare { pid, socket }),
            None => {
                super::background::reap(pid);
                Err(io::Error::other(
                    "the keepers' fork server sent no socket with its spare helper",
                ))
            }
        }
    }

    /// Sends one request with `fds`: the pid of the process the server forked.
    fn ask(&mut self, payload: &[u8], fds: &[std::os::fd::RawFd]) -> io::Result<i32> {
        self.ask_for(payload, fds).map(|(pid, _)| pid)
    }

    /// `ask`, and the descriptors that came with the answer.
    fn ask_for(
        &mut self,
        payload: &[u8],
        fds: &[std::os::fd::RawFd],
    ) -> io::Result<(i32, Vec<OwnedFd>)> {
        sys::send_message(self.socket.as_fd(), payload, fds)?;
        if !sys::wait_readable(self.socket.as_fd(), ANSWER_DEADLINE)? {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the keepers' fork server did not answer",
            ));
        }
        let Some((answer, passed)) = sys::receive_message(self.socket.as_fd())? else {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the keepers' fork server ended",
            ));
        };
        match serde_json::from_slice(&answer).map_err(io::Error::other)? {
            ForkAnswer::Forked { pid } => Ok((pid, passed)),
            ForkAnswer::Failed { error } => Err(io::Error::other(error)),
        }
    }

    /// Whether the server still runs.
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ForkServer {
    /// The server holds nothing: it is ended and reaped (its keepers are the daemon's).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A keeper the server forked: the daemon's child, known by a pidfd.
#[derive(Debug)]
pub(crate) struct ForkedKeeper {
    pid: i32,
    pidfd: OwnedFd,
    status: Option<ExitStatus>,
}

impl ForkedKeeper {
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// Its exit status, reaping it, once it ended.
    pub(crate) fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.wait_with(rustix::process::WaitIdOptions::NOHANG)
    }

    pub(crate) fn wait(&mut self) -> io::Result<ExitStatus> {
        self.wait_with(rustix::process::WaitIdOptions::empty())?
            .ok_or_else(|| io::Error::other("the keeper was reaped elsewhere"))
    }

    pub(crate) fn kill(&mut self) -> io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        rustix::process::pidfd_send_signal(self.pidfd.as_fd(), rustix::process::Signal::KILL)
            .map_err(io::Error::from)
    }

    fn wait_with(
        &mut self,
        extra: rustix::process::WaitIdOptions,
    ) -> io::Result<Option<ExitStatus>> {
        use std::os::unix::process::ExitStatusExt as _;
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        let options = rustix::process::WaitIdOptions::EXITED | extra;
        let found = loop {
            match rustix::process::waitid(
                rustix::process::WaitId::PidFd(self.pidfd.as_fd()),
                options,
            ) {
                Err(rustix::io::Errno::INTR) => continue,
                found => break found?,
            }
        };
        let Some(found) = found else {
            return Ok(None);
        };
        // As a wait status: the code in the second byte, or the signal (0x80: a core dumped).
        let raw = match (found.exit_status(), found.terminating_signal()) {
            (Some(code), _) => (code & 0xff) << 8,
            (None, Some(signal)) if found.dumped() => signal | 0x80,
            (None, Some(signal)) => signal,
            (None, None) => 0,
        };
        let status = ExitStatus::from_raw(raw);
        self.status = Some(status);
        Ok(Some(status))
    }
}
