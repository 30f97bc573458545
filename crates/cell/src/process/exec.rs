//! Exec into a running cell.
//!
//! A cell started to serve execs (`RunRequest::serve_exec`) keeps a datagram-sequence channel
//! between its keeper (the warden process that started it, outside the cell) and its init. A
//! client connects to the keeper's owner-only socket `exec.sock` in the cell's runtime folder,
//! sends one request with three descriptors (stdin, stdout, stderr), and reads events until the
//! process ends. The keeper checks the request and passes it to the init together with the
//! client's socket, then lets go of it: the init sends the process's events to the client and
//! takes its signals (and its hang-up, which kills the process) directly. The init, already
//! inside every namespace, cgroup, Landlock domain and seccomp filter of the cell, starts the
//! process, so it is confined exactly like the cell's first command, and starts without paying
//! for a cgroup move.
//!
//! The process's output goes straight into the client's pipes: the warden sees every byte
//! itself. Its exit status is the one fact the init reports; the init is not dumpable, so no
//! other process of the cell can ptrace it or write its memory.

use std::io;
use std::os::fd::{AsFd as _, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::registry::{Registry, RegistryError};
use super::sys;

/// The keeper's socket in a cell's runtime folder.
pub const EXEC_SOCKET: &str = "exec.sock";

/// What a client asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    /// Added to (and overriding) the cell's environment.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Working directory inside the cell (default: the cell's).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Run on a new pseudo-terminal of the cell's own devpts, of this size; the terminal's
    /// master comes back with the `started` event, and no stdio descriptors are sent.
    #[serde(default)]
    pub tty: Option<TtySize>,
    /// The cell's last process: every other process of the cell is ended before its end is
    /// told, and the cell ends (its init exits), where the tier can (see
    /// `Cell::ends_with_last_process`); a cell that cannot is left running.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last: bool,
}

/// A terminal's size, and what an exec'd process used (from `wait4` in the cell's init; its
/// children included once they were waited for): the wire's own types.
pub use warden_protocol::{TtySize, Usage};

/// Messages to the init (and, without `id`, from clients to the keeper).
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub(crate) enum Request {
    Exec {
        #[serde(default)]
        id: u64,
        #[serde(flatten)]
        request: ExecRequest,
    },
    Signal {
        #[serde(default)]
        id: u64,
        signal: i32,
    },
    /// A client asks for a line of its own to the init (see [`Line`]); the keeper passes one
    /// end of a new pair to the init with this request, and the other to the client.
    Line,
    /// A client asks the keeper for the cell's user and mount namespaces (the keeper answers
    /// with them, two descriptors), to act inside the cell from outside (a reset).
    Namespaces,
    /// A file operation, run by a fork of the init (see `files`), with stdin, stdout and stderr
    /// like an exec's; its events are an exec's too.
    Files {
        #[serde(default)]
        id: u64,
        /// The files root, a directory of the cell.
        root: String,
        file: super::files::FileOp,
    },
}

/// What happens to an exec'd process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum ExecEvent {
    /// Running, with this pid inside the cell.
    Started {
        #[serde(default)]
        id: u64,
        pid: i32,
    },
    /// Could not start (127: not found, 126: not executable or bad request).
    Failed {
        #[serde(default)]
        id: u64,
        code: i32,
        message: String,
    },
    Exited {
        #[serde(default)]
        id: u64,
        code: i32,
        #[serde(default)]
        usage: Option<Usage>,
    },
    Signaled {
        #[serde(default)]
        id: u64,
        signal: i32,
        #[serde(default)]
        usage: Option<Usage>,
    },
}

impl ExecEvent {
    /// Whether this is the last event of its process.
    pub fn is_final(&self) -> bool {
        !matches!(self, Self::Started { .. })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(
        "cell `{0}` does not take exec requests (only cells made with `warden create` or the API do)"
    )]
    NotServing(String),
    #[error("{what} for cell `{cell}`: {source}")]
    Io {
        what: &'static str,
        cell: String,
        source: io::Error,
    },
    #[error("cell `{0}` ended")]
    CellEnded(String),
    #[error("the line to cell `{0}` is closed")]
    LineClosed(String),
    #[error("cell `{cell}` sent a message that is not an exec event: {reason}")]
    Protocol { cell: String, reason: String },
}

/// One exec'd process, seen from the client.
#[derive(Debug)]
pub struct ExecSession {
    cell: String,
    socket: OwnedFd,
    /// The cell's starts lock, held shared until the init answers the request (`starts`).
    starting: std::sync::Mutex<Option<OwnedFd>>,
}

impl ExecSession {
    /// Like `start`, over a line straight to the cell's init: no keeper in between.
    /// `LineClosed` when the line no longer leads anywhere (open a new one).
    pub fn start_on(
        line: &Line,
        request: &ExecRequest,
        stdio: Option<[&OwnedFd; 3]>,
    ) -> Result<Self, ExecError> {
        let message = Request::Exec {
            id: 0,
            request: request.clone(),
        };
        Self::send_on(line, &message, stdio)
    }

    /// Starts a file operation in the cell, over a line to its init: `root` is the directory
    /// paths are relative to; stdin, stdout and stderr carry its data, answer and error.
    pub fn files_on(
        line: &Line,
        root: &str,
        op: &super::files::FileOp,
        stdio: [&OwnedFd; 3],
    ) -> Result<Self, ExecError> {
        let message = Request::Files {
            id: 0,
            root: root.to_owned(),
            file: op.clone(),
        };
        Self::send_on(line, &message, Some(stdio))
    }

    fn send_on(
        line: &Line,
        message: &Request,
        stdio: Option<[&OwnedFd; 3]>,
    ) -> Result<Self, ExecError> {
        let (ours, theirs) = sys::seqpacket_pair().map_err(|source| ExecError::Io {
            what: "making an exec socket",
            cell: line.cell.clone(),
            source,
        })?;
        let starting = super::starts::starting(&line.starts).map_err(|source| {
            match source.kind() {
                // The cell's folder is gone: it ended (a delete under way removed it).
                io::ErrorKind::NotFound => ExecError::LineClosed(line.cell.clone()),
                _ => ExecError::Io {
                    what: "taking the cell's starts lock",
                    cell: line.cell.clone(),
                    source,
                },
            }
        })?;
        match send_request(&line.cell, &line.socket, message, Some(&theirs), stdio) {
            Err(ExecError::Io { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)
                ) =>
            {
                Err(ExecError::LineClosed(line.cell.clone()))
            }
            Err(err) => Err(err),
            Ok(()) => Ok(Self {
                cell: line.cell.clone(),
                socket: ours,
                starting: std::sync::Mutex::new(Some(starting)),
            }),
        }
    }

    /// The next event if one has arrived, without waiting (`None` when none has): for callers
    /// that wait for the socket (`AsRawFd`) to be readable themselves.
    pub fn try_next_event_with_fds(&self) -> Result<Option<(ExecEvent, Vec<OwnedFd>)>, ExecError> {
        match sys::try_receive_message(self.socket.as_fd()) {
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(None),
            received => self.decode(received).map(Some),
        }
    }

    fn decode(
        &self,
        received: io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>>,
    ) -> Result<(ExecEvent, Vec<OwnedFd>), ExecError> {
        let received = received.map_err(|source| ExecError::Io {
            what: "reading exec events",
            cell: self.cell.clone(),
            source,
        })?;
        // The init answered (or went): the start is over, and with it its hold on the lock.
        if let Ok(mut starting) = self.starting.lock() {
            starting.take();
        }
        let Some((payload, fds)) = received else {
            return Err(ExecError::CellEnded(self.cell.clone()));
        };
        let event = serde_json::from_slice(&payload).map_err(|e| ExecError::Protocol {
            cell: self.cell.clone(),
            reason: e.to_string(),
        })?;
        Ok((event, fds))
    }

    /// Sends a signal to the process's group.
    pub fn signal(&self, signal: i32) -> Result<(), ExecError> {
        let payload = serde_json::to_vec(&Request::Signal { id: 0, signal }).unwrap_or_default();
        sys::send_message(self.socket.as_fd(), &payload, &[]).map_err(|source| ExecError::Io {
            what: "sending a signal",
            cell: self.cell.clone(),
            source,
        })
    }
}

/// Connects to the keeper of cell `name`. Connecting proves the cell is served (the registry is
/// read only to explain a failure).
fn connect_keeper(registry: &Registry, name: &str) -> Result<OwnedFd, ExecError> {
    super::plan::check_name(name).map_err(|_| RegistryError::NotFound(name.to_owned()))?;
    let path = registry.cell_file(name, EXEC_SOCKET);
    sys::seqpacket_connect(&path).map_err(|source| {
        if let Err(gone) = registry.get(name) {
            ExecError::Registry(gone)
        } else if matches!(
            source.kind(),
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
        ) {
            ExecError::NotServing(name.to_owned())
        } else if source.kind() == io::ErrorKind::WouldBlock {
            ExecError::Io {
                what: "the cell's keeper takes no more requests (its queue is full)",
                cell: name.to_owned(),
                source,
            }
        } else {
            ExecError::Io {
                what: "connecting to the cell's keeper",
                cell: name.to_owned(),
                source,
            }
        }
    })
}

/// Sends an exec (or file) request on `socket`: with the socket the process's events go to,
/// when the request goes straight to the init, then its stdio.
fn send_request(
    cell: &str,
    socket: &OwnedFd,
    message: &Request,
    client: Option<&OwnedFd>,
    stdio: Option<[&OwnedFd; 3]>,
) -> Result<(), ExecError> {
    let payload = serde_json::to_vec(message).unwrap_or_default();
    let fds: Vec<_> = client
        .into_iter()
        .chain(stdio.into_iter().flatten())
        .map(AsRawFd::as_raw_fd)
        .collect();
    sys::send_message(socket.as_fd(), &payload, &fds).map_err(|source| ExecError::Io {
        what: "sending the exec request",
        cell: cell.to_owned(),
        source,
    })
}

/// A line straight to a cell's init, for a client that starts many processes: an exec on it
/// (`ExecSession::start_on`) reaches the init without a keeper in between. The keeper hands it
/// out once; it lasts as long as both the client and the cell.
#[derive(Debug)]
pub struct Line {
    cell: String,
    socket: OwnedFd,
    /// The cell's starts lock (`starts`).
    starts: PathBuf,
}

impl Line {
    /// Asks the keeper of cell `name` for a line to its init.
    pub fn open(registry: &Registry, name: &str) -> Result<Self, ExecError> {
        let mut fds = ask_keeper(registry, name, &Request::Line, &[1], "a line")?;
        let socket = fds
            .pop()
            .ok_or_else(|| ExecError::CellEnded(name.to_owned()))?;
        Ok(Self {
            cell: name.to_owned(),
            socket,
            starts: registry.starts_lock(name),
        })
    }
}

/// The user and mount namespaces of cell `name`, from its keeper: the way to join the cell
/// from outside without reading its init's `/proc` entries (which its init, not dumpable,
/// keeps from an unprivileged warden).
pub fn namespaces(registry: &Registry, name: &str) -> Result<Namespaces, ExecError> {
    let mut fds = ask_keeper(
        registry,
        name,
        &Request::Namespaces,
        &[2, 3],
        "the namespaces",
    )?;
    let ended = || ExecError::CellEnded(name.to_owned());
    let root = (fds.len() == 3).then(|| fds.pop()).flatten();
    let mnt = fds.pop().ok_or_else(ended)?;
    let user = fds.pop().ok_or_else(ended)?;
    Ok(Namespaces { user, mnt, root })
}

/// The user and mount namespaces of the cell whose init is `pid`, started at `start` (clock
/// ticks after boot, as its record says), opened here from the init's own: `None` where this
/// process may not open them (a rootless warden, the init being undumpable), where `pid` is
/// not such an init (a gVisor cell's record names `runsc`, which is not pid 1 of a namespace
/// of its own), or where it ended meanwhile; the keeper is asked then ([`namespaces`]).
pub(crate) fn init_namespaces(pid: i32, start: u64) -> Option<Namespaces> {
    use std::os::fd::AsFd as _;
    // Held throughout: a pid that was reused would have let this pidfd's process end first.
    let pidfd = sys::pidfd_open(pid).ok()?;
    if sys::process_start_ticks(pid) != Some(start) {
        return None;
    }
    // Pid 1 of a pid namespace of its own, as a cell's init is (and `runsc run` is not).
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let ns_pids = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let ns_pids: Vec<&str> = ns_pids.split_whitespace().collect();
    if ns_pids.len() < 2 || ns_pids.last() != Some(&"1") {
        return None;
    }
    let open = |kind: &str| -> Option<OwnedFd> {
        rustix::fs::open(
            format!("/proc/{pid}/ns/{kind}").as_str(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok()
    };
    let (user, mnt) = (open("user")?, open("mnt")?);
    // Still running (its pidfd not readable yet): what was opened is that process's.
    let mut fds = [nix::poll::PollFd::new(
        pidfd.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO) {
        Ok(0) => Some(Namespaces {
            user,
            mnt,
            root: None,
        }),
        _ => None,
    }
}

/// Sends the keeper of cell `name` a request it answers itself (with the same request and
/// `count` descriptors), and returns the descriptors. The keeper answers at once; one that
/// does not is not waited for without end.
fn ask_keeper(
    registry: &Registry,
    name: &str,
    request: &Request,
    counts: &[usize],
    what: &'static str,
) -> Result<Vec<OwnedFd>, ExecError> {
    let keeper = connect_keeper(registry, name)?;
    let _ = nix::sys::socket::setsockopt(
        &keeper,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &nix::sys::time::TimeVal::new(5, 0),
    );
    let io_error = |what| {
        move |source| ExecError::Io {
            what,
            cell: name.to_owned(),
            source,
        }
    };
    let payload = serde_json::to_vec(request).unwrap_or_default();
    sys::send_message(keeper.as_fd(), &payload, &[]).map_err(io_error("asking the keeper"))?;
    let Some((answer, fds)) =
        sys::receive_message(keeper.as_fd()).map_err(io_error("receiving the keeper's answer"))?
    else {
        return Err(ExecError::CellEnded(name.to_owned()));
    };
    let same = serde_json::from_slice::<Request>(&answer)
        .is_ok_and(|a| std::mem::discriminant(&a) == std::mem::discriminant(request));
    if same && counts.contains(&fds.len()) {
        return Ok(fds);
    }
    Err(ExecError::Protocol {
        cell: name.to_owned(),
        reason: format!(
            "the keeper answered a request for {what} with {}",
            String::from_utf8_lossy(&answer)
        ),
    })
}

impl std::os::fd::AsRawFd for ExecSession {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.socket.as_raw_fd()
    }
}

/// Sets the size of an exec'd process's terminal, through the master the warden holds.
pub fn resize(master: std::os::fd::BorrowedFd<'_>, size: TtySize) -> io::Result<()> {
    sys::set_window_size(master, size.rows, size.cols)
}

/// A cell's user and mount namespaces, held by its keeper for the cell's life, and where the
/// mount namespace is not the cell's own (a sandbox's root assembled on the host), the cell's
/// root in it.
#[derive(Debug)]
pub struct Namespaces {
    pub user: OwnedFd,
    pub mnt: OwnedFd,
    pub root: Option<OwnedFd>,
}

impl Namespaces {
    /// Joins the cell's user namespace, unless the caller is in it already (a sandbox's keeper
    /// is in the host's, which a process may not join again).
    pub(crate) fn join_user(&self) -> nix::Result<()> {
        let same = rustix::fs::fstat(&self.user)
            .ok()
            .zip(std::fs::metadata("/proc/self/ns/user").ok())
            .is_some_and(|(theirs, ours)| {
                use std::os::unix::fs::MetadataExt as _;
                theirs.st_ino == ours.ino() && theirs.st_dev == ours.dev()
            });
        match same {
            true => Ok(()),
            false => nix::sched::setns(&self.user, nix::sched::CloneFlags::CLONE_NEWUSER),
        }
    }
}

/// The keeper's router: accepts clients on `path` and passes each one's request, with the
/// client's own socket, to the init's `channel` (a cell that takes no execs has none: it
/// answers only for its namespaces), on a thread of its own until the returned [`Router`] is
/// dropped. From then on the init and the client talk directly (events out, signals and the
/// hang-up in), so no event waits on a relay.
/// `leave`: once stopped, the router leaves its listener and the namespaces to this process's
/// end where it said it ends with this cell (see [`leave_namespaces_to_exit`]).
pub(crate) fn serve(
    path: &Path,
    channel: Option<OwnedFd>,
    namespaces: Option<Namespaces>,
    leave: bool,
) -> io::Result<Router> {
    let listener = sys::seqpacket_listen(path)?;
    let (stop_r, stop_w) = sys::pipe()?;
    let path: PathBuf = path.to_path_buf();
    let tid = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let its_tid = tid.clone();
    let after: std::sync::Arc<std::sync::Mutex<Option<OwnedFd>>> = Default::default();
    let its_after = after.clone();
    let thread = std::thread::Builder::new()
        .name("exec-clients".to_owned())
        .spawn(move || {
            its_tid.store(
                nix::unistd::gettid().as_raw(),
                std::sync::atomic::Ordering::Release,
            );
            let keeper = Keeper {
                channel,
                namespaces,
            };
            // Told to stop, the router leaves its socket's file to the removal of the cell's
            // folder (which may be under way); ended on its own, it takes the file away.
            let stopped = serve_clients(&listener, &stop_r, &keeper);
            if !stopped {
                let _ = std::fs::remove_file(&path);
            }
            if stopped && leave {
                let Keeper {
                    channel,
                    namespaces,
                } = keeper;
                let held = [Some(listener), channel]
                    .into_iter()
                    .chain(
                        namespaces
                            .into_iter()
                            .flat_map(|ns| [Some(ns.user), Some(ns.mnt), ns.root]),
                    )
                    .flatten()
                    .collect();
                // Left to the process's end, which the holder of its memory keeps them past:
                // the mount namespace's teardown then comes after the run's caller has been
                // woken. (Where they cannot be left, they go here and now.)
                let _ = leave_to_exit(held);
                its_tid.store(0, std::sync::atomic::Ordering::Release);
                return;
            }
            // The listener and the namespaces go here, off the caller's way: the last hold on
            // the cell's mount namespace tears its mounts down (an expedited RCU grace period
            // and a quarter of a millisecond of the CPU), and the listener, holding its
            // socket's file, is the last hold on the cell's folder once that is removed (its
            // blocks are freed, and discarded, at the close). Stopped with the init's pidfd
            // (`stop_after`), it holds the namespaces until the init is gone, so that this
            // thread, not the init's exit, tears the mounts down (the init's end is waited for
            // before the cell's cgroup goes), at the normal priority: the run's end waits for
            // it. Otherwise at the least priority: woken by the stop while the run goes on to
            // its end, this thread took the CPU from it (traced: 0.25 ms of `warden run --
            // true`'s end); `stop` lowers it before it wakes it, and this is for a router that
            // ended on its own.
            let init = its_after.lock().ok().and_then(|mut slot| slot.take());
            match init {
                Some(init) => {
                    let mut fds = [nix::poll::PollFd::new(
                        init.as_fd(),
                        nix::poll::PollFlags::POLLIN,
                    )];
                    let _ = nix::poll::poll(&mut fds, INIT_END_WAIT_MS);
                }
                None => super::sys::lower_priority(0),
            }
            drop((listener, keeper));
            // Its id is no longer this thread's to lower once it ends.
            its_tid.store(0, std::sync::atomic::Ordering::Release);
        })?;
    Ok(Router {
        stop: Some(stop_w),
        thread: Some(thread),
        tid,
        after,
    })
}

/// What this process leaves to its end (see [`leave_namespaces_to_exit`]): the pid that said
/// so (a fork of it, such as a gVisor keeper, lets go of its own holds) and the holds.
static LEFT_TO_EXIT: std::sync::Mutex<(u32, Vec<OwnedFd>)> = std::sync::Mutex::new((0, Vec::new()));

/// Says that this process ends as soon as its one cell's run has (`warden run`), and that
/// whoever takes its memory's teardown over after its exit (the run's holder of its memory)
/// keeps the descriptors [`left_to_exit`] lists until then. A stopped router of a cell without
/// a workspace or an image then leaves its last holds on the cell's namespaces to the
/// process's end, where they go after the run's caller has been woken: the last hold on a
/// mount namespace tears its mounts down (an expedited RCU grace period and a quarter of a
/// millisecond of the CPU), which the run's end waited for. A cell with a workspace or an
/// image is let go of before the run ends: a mount of its layer or its image kept a moment
/// longer would be in the way of the next run of that workspace, or of the image's removal.
pub fn leave_namespaces_to_exit() {
    if let Ok(mut left) = LEFT_TO_EXIT.lock() {
        left.0 = std::process::id();
    }
}

/// The descriptors this process leaves to its end (see [`leave_namespaces_to_exit`]).
pub fn left_to_exit() -> Vec<RawFd> {
    LEFT_TO_EXIT
        .lock()
        .map(|left| left.1.iter().map(AsRawFd::as_raw_fd).collect())
        .unwrap_or_default()
}

/// Whether this process leaves a cell's namespaces to its end.
pub(crate) fn leaves_to_exit() -> bool {
    LEFT_TO_EXIT
        .lock()
        .is_ok_and(|left| left.0 == std::process::id())
}

/// Keeps `held` open until this process ends, where it said so: `Err(held)` otherwise.
fn leave_to_exit(held: Vec<OwnedFd>) -> Result<(), Vec<OwnedFd>> {
    match LEFT_TO_EXIT.lock() {
        Ok(mut left) if left.0 == std::process::id() => {
            left.1.extend(held);
            Ok(())
        }
        _ => Err(held),
    }
}

/// How long a stopped router waits for the init's end before it lets go of the namespaces
/// (milliseconds).
const INIT_END_WAIT_MS: u16 = 5000;

/// A running router: `stop` tells it to stop, and dropping it also waits until its listener
/// and the cell's namespaces it held are gone. A cell's run stops it as soon as the
/// cell has ended, so that this goes on beside the run's own end, and drops it on the thread
/// that releases the cell's name (see `Release`).
#[derive(Debug)]
#[must_use = "the router stops when dropped"]
pub(crate) struct Router {
    stop: Option<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The router thread's id, once it runs (0 before).
    tid: std::sync::Arc<std::sync::atomic::AtomicI32>,
    /// The init's pidfd, for a router stopped before the init is gone (see `stop_after`).
    after: std::sync::Arc<std::sync::Mutex<Option<OwnedFd>>>,
}

impl Router {
    /// Tells the router to stop, and to hold the cell's namespaces until the process behind
    /// `init` (a pidfd) has exited: the last hold on the cell's mount namespace tears its
    /// mounts down, which is then this thread's work beside the run's end, not the init's
    /// exit that the run waits for (an expedited RCU grace period and a quarter of a
    /// millisecond of the CPU).
    pub(crate) fn stop_after(&mut self, init: &OwnedFd) {
        let held = match (init.try_clone(), self.after.lock()) {
            (Ok(copy), Ok(mut slot)) => {
                *slot = Some(copy);
                true
            }
            _ => false,
        };
        match held {
            // Woken at the normal priority: it only waits until the init is gone.
            true => drop(self.stop.take()),
            false => self.stop(),
        }
    }

    /// Tells the router to stop, without waiting for it.
    pub(crate) fn stop(&mut self) {
        if self.stop.is_none() {
            return;
        }
        // Lowered before it is woken: a thread woken at the normal priority takes the CPU
        // from its waker at once, here the run on its way to its end.
        let tid = self.tid.load(std::sync::atomic::Ordering::Acquire);
        let running = self.thread.as_ref().is_some_and(|t| !t.is_finished());
        if tid > 0 && running {
            super::sys::lower_priority(tid);
        }
        // The pipe's hang-up wakes the router's poll.
        drop(self.stop.take());
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        self.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the keeper's router holds.
struct Keeper {
    channel: Option<OwnedFd>,
    namespaces: Option<Namespaces>,
}

/// The keeper's one thread for every client: accepts them and passes each one's request to the
/// init (a client sends it as it connects, so it is usually there at once), until `stop` hangs
/// up (true) or the listener fails (false).
fn serve_clients(listener: &OwnedFd, stop: &OwnedFd, keeper: &Keeper) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    // Clients whose request has not come yet.
    let mut waiting: Vec<OwnedFd> = Vec::new();
    let mut next_id = 1u64;
    loop {
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = [listener.as_fd(), stop.as_fd()]
                .into_iter()
                .chain(waiting.iter().map(OwnedFd::as_fd))
                .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
                .collect();
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::Error::EINTR) => continue,
                Err(_) => return false,
            }
            fds.iter()
                .map(|fd| fd.revents().is_some_and(|r| !r.is_empty()))
                .collect()
        };
        if ready[1] {
            return true;
        }
        let mut index = 1;
        waiting.retain(|client| {
            index += 1;
            if !ready[index] {
                return true;
            }
            let received = sys::receive_message(client.as_fd());
            forward_request(next_id, client, received, keeper);
            next_id += 1;
            false
        });
        if ready[0] {
            let Ok(client) = sys::accept(listener.as_fd()) else {
                return false;
            };
            match sys::try_receive_message(client.as_fd()) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => waiting.push(client),
                received => {
                    forward_request(next_id, &client, received, keeper);
                    next_id += 1;
                }
            }
        }
    }
}

type Message = (Vec<u8>, Vec<OwnedFd>);

/// Checks a client's request and passes it, with the client's socket, to the init; a request
/// that cannot be served is answered with `failed` here.
fn forward_request(
    id: u64,
    client: &OwnedFd,
    received: io::Result<Option<Message>>,
    keeper: &Keeper,
) {
    let refuse = |message: String| {
        let event = ExecEvent::Failed {
            id: 0,
            code: 126,
            message,
        };
        let _ = sys::send_message(
            client.as_fd(),
            &serde_json::to_vec(&event).unwrap_or_default(),
            &[],
        );
    };
    let (payload, fds) = match received {
        Ok(Some(message)) => message,
        Ok(None) => return,
        Err(err) => return refuse(format!("unreadable exec request: {err}")),
    };
    let parsed = serde_json::from_slice::<Request>(&payload);
    if let Ok(Request::Namespaces) = parsed {
        return hand_out_namespaces(client, keeper.namespaces.as_ref());
    }
    let Some(channel) = &keeper.channel else {
        return refuse(
            "this cell takes no exec requests (only cells made with `warden create` or the API do)"
                .to_owned(),
        );
    };
    let forward = match parsed {
        Ok(Request::Exec { request, .. }) => Request::Exec { id, request },
        Ok(Request::Files { root, file, .. }) => Request::Files { id, root, file },
        Ok(Request::Signal { .. }) => return refuse("a signal before any exec".to_owned()),
        Ok(Request::Line) => return hand_out_line(client, channel),
        Ok(Request::Namespaces) => return,
        Err(err) => return refuse(format!("unreadable exec request: {err}")),
    };
    let wanted = match &forward {
        Request::Exec { request, .. } if request.tty.is_some() => 0,
        _ => 3,
    };
    if fds.len() != wanted {
        return refuse(format!(
            "an exec request needs {wanted} descriptors (stdin, stdout, stderr; none on a terminal), got {}",
            fds.len()
        ));
    }
    let raw: Vec<_> = std::iter::once(client.as_raw_fd())
        .chain(fds.iter().map(AsRawFd::as_raw_fd))
        .collect();
    // A failed send means the init is gone: the client hears the end of the cell when this
    // copy of its socket closes.
    let _ = sys::send_message(
        channel.as_fd(),
        &serde_json::to_vec(&forward).unwrap_or_default(),
        &raw,
    );
}

/// Gives a client the cell's namespaces (nothing, when the keeper could not open them).
fn hand_out_namespaces(client: &OwnedFd, namespaces: Option<&Namespaces>) {
    let payload = serde_json::to_vec(&Request::Namespaces).unwrap_or_default();
    let fds: Vec<_> = namespaces
        .map(|ns| {
            [Some(&ns.user), Some(&ns.mnt), ns.root.as_ref()]
                .into_iter()
                .flatten()
                .map(AsRawFd::as_raw_fd)
                .collect()
        })
        .unwrap_or_default();
    let _ = sys::send_message(client.as_fd(), &payload, &fds);
}

/// Makes a line between a client and the init: one end goes to the init, the other back to the
/// client, each with a `line` message.
fn hand_out_line(client: &OwnedFd, channel: &OwnedFd) {
    let Ok((for_client, for_init)) = sys::seqpacket_pair() else {
        return;
    };
    let payload = serde_json::to_vec(&Request::Line).unwrap_or_default();
    if sys::send_message(channel.as_fd(), &payload, &[for_init.as_raw_fd()]).is_ok() {
        let _ = sys::send_message(client.as_fd(), &payload, &[for_client.as_raw_fd()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The namespaces are opened from a process only where it is pid 1 of a pid namespace of
    /// its own and still the one its record names: a plain process (`runsc run` stands so in
    /// a gVisor cell's record), a start time that is not its own (a pid taken again) and an
    /// ended process get none, and the keeper is asked instead.
    #[test]
    fn namespaces_are_opened_only_from_the_init_the_record_names() {
        use std::os::unix::fs::MetadataExt as _;
        if !nix::unistd::geteuid().is_root() {
            return; // a pid namespace of its own, made by root
        }
        let mut unshare = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--mount", "sleep", "30"])
            .spawn()
            .unwrap();
        let parent = unshare.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let init = loop {
            let children =
                std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
                    .unwrap_or_default();
            if let Some(pid) = children.split_whitespace().next() {
                break pid.parse::<i32>().unwrap();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no init under unshare"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        // (Its mount namespace is its own once it runs `sleep`.)
        let start = loop {
            let exe = std::fs::read_link(format!("/proc/{init}/exe")).unwrap_or_default();
            if exe.file_name().is_some_and(|n| n == "sleep") {
                break sys::process_start_ticks(init).unwrap();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the init did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let ns = init_namespaces(init, start).expect("the init's namespaces");
        let theirs = std::fs::metadata(format!("/proc/{init}/ns/mnt")).unwrap();
        let opened = rustix::fs::fstat(&ns.mnt).unwrap();
        assert_eq!(opened.st_ino, theirs.ino());
        let ours = std::fs::metadata("/proc/self/ns/mnt").unwrap();
        assert_ne!(
            opened.st_ino,
            ours.ino(),
            "the host's mount namespace was opened"
        );
        assert!(
            init_namespaces(init, start + 1).is_none(),
            "another start time"
        );
        assert!(init_namespaces(parent, sys::process_start_ticks(parent).unwrap()).is_none());
        let own = std::process::id() as i32;
        assert!(init_namespaces(own, sys::process_start_ticks(own).unwrap()).is_none());
        unshare.kill().unwrap();
        unshare.wait().unwrap();
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(init), nix::sys::signal::SIGKILL);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(init_namespaces(init, start).is_none(), "an ended init");
    }

    /// A request over a line whose cell's folder is gone (a delete under way removed it) is
    /// told as the line closed (the caller opens a new one, and hears the cell ended), not as
    /// a host error about a lock file.
    #[test]
    fn a_request_on_a_line_whose_cell_is_gone_is_told_as_closed() {
        let dir = tempfile::tempdir().unwrap();
        let (socket, _peer) = sys::seqpacket_pair().unwrap();
        let line = Line {
            cell: "gone".to_owned(),
            socket,
            starts: dir
                .path()
                .join("cells/gone")
                .join(super::super::starts::LOCK_FILE),
        };
        let op = super::super::files::FileOp::Read {
            path: "a".to_owned(),
            limit: 1,
        };
        let stdio = [0, 1, 2].map(|_| OwnedFd::from(std::fs::File::open("/dev/null").unwrap()));
        let err = ExecSession::files_on(&line, "/", &op, [&stdio[0], &stdio[1], &stdio[2]])
            .expect_err("no session on a gone cell's line");
        assert!(
            matches!(err, ExecError::LineClosed(ref c) if c == "gone"),
            "{err}"
        );
    }

    /// A stopped router lets go of everything it held by the time its drop returns: its
    /// listener (a client is refused) and the namespaces handed to it.
    #[test]
    fn a_dropped_router_has_let_go_of_its_socket_and_namespaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(EXEC_SOCKET);
        // Stand-ins for the namespaces: a pipe whose other end shows when they are dropped.
        let (user_peer, user) = sys::pipe().unwrap();
        let (mnt_peer, mnt) = sys::pipe().unwrap();
        let namespaces = Namespaces {
            user,
            mnt,
            root: None,
        };
        let mut router = serve(&path, None, Some(namespaces), false).unwrap();
        // It serves while it runs: a client is accepted and answered.
        let client = sys::seqpacket_connect(&path).unwrap();
        sys::send_message(client.as_fd(), br#"{"exec":{}}"#, &[]).unwrap();
        let answer = sys::receive_message(client.as_fd()).unwrap();
        assert!(answer.is_some(), "the router did not answer a client");
        router.stop();
        drop(router);
        // Its file is left to the folder's removal, but nothing listens there any more.
        let refused = sys::seqpacket_connect(&path).unwrap_err();
        assert_eq!(
            refused.kind(),
            io::ErrorKind::ConnectionRefused,
            "{refused}"
        );
        for (peer, what) in [(user_peer, "user"), (mnt_peer, "mount")] {
            let mut byte = [0u8; 1];
            // The write ends were the router's only: once it dropped them, a read sees the end.
            let read = rustix::io::read(&peer, &mut byte);
            assert!(
                matches!(read, Ok(0)),
                "the {what} namespace is still held: {read:?}"
            );
        }
    }
}
