//! The cell's first process. It finishes the setup from inside the new namespaces, starts the
//! command, then stays as the cell's pid 1: it reaps orphans, passes on the signals the warden
//! forwards, and exits with the command's status. It holds no power over the cell: it is confined
//! exactly like the command, and the warden controls the cell through the kernel, not through it.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::process::Command;

use nix::sched::{CloneFlags, unshare};
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::{Gid, Pid, Uid, sethostname, setresgid, setresuid, setsid};

use super::exec::{ExecEvent, Request, Usage};
use super::plan::CellPlan;
use super::{confine, rootfs, sys};

/// Descriptor numbers inside the cell's first process.
const SYNC_FD: RawFd = 3;
const STATUS_FD: RawFd = 4;
const TREE_FD: RawFd = 5;
const GATEWAY_FD: RawFd = 6;
const EXEC_FD: RawFd = 7;
/// The first of the host paths the policy shows the cell, opened by the warden (see
/// `InitFds::sources`), one after another in the order of the plan's entries.
pub(super) const SOURCES_FD: RawFd = 8;

/// Signals the init passes on to the command's process group.
const FORWARDED: [Signal; 6] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// The status pipe's last line, once the command has ended and nothing else of the cell is
/// left: `exited CODE` or `signaled NUMBER`.
pub const END_EXITED: &str = "exited ";
pub const END_SIGNALED: &str = "signaled ";

/// How the command ended, from the status pipe's last line.
pub fn parse_end(line: &str) -> Option<super::outcome::Ending> {
    use super::outcome::Ending;
    let line = line.trim_end();
    if let Some(code) = line.strip_prefix(END_EXITED) {
        return code.parse().ok().map(Ending::Exited);
    }
    line.strip_prefix(END_SIGNALED)?
        .parse()
        .ok()
        .map(Ending::Signaled)
}

/// The descriptors the warden hands to the cell's first process.
#[derive(Debug)]
pub struct InitFds {
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
    /// The sync channel (a unix datagram-sequence socket): the warden's go-ahead bytes, the
    /// last one with the `tasks` file of each v1 directory of the cell's cgroup, and the
    /// cell's lifeline.
    pub sync: RawFd,
    pub status: RawFd,
    pub tree: Option<RawFd>,
    /// A unix socket on which the init sends back the egress gateway's listening socket.
    pub gateway: Option<RawFd>,
    /// The exec channel to the cell's keeper (see `exec`).
    pub exec: Option<RawFd>,
    /// The host side of each bind and copy entry of the plan, in order, opened `O_PATH` by the
    /// warden: the cell's setup reaches them through these even below a directory it may not
    /// search (a home directory of mode 0700, as root's is).
    pub sources: Vec<RawFd>,
    /// The CPUs the warden's thread may run on, where more than one: the warden keeps the
    /// init off its own CPU while the init assembles the root (see `sys::keep_off_this_cpu`),
    /// and the init takes them all back once it runs.
    pub affinity: Option<nix::sched::CpuSet>,
    /// The cell was started in a network namespace made for it ahead, whose loopback is up
    /// (see `run::NetworkAhead`): the init has no network to set up.
    pub network_ready: bool,
}

/// Outcome codes sent on the status pipe.
pub const SETUP_FAILED: i32 = 125;
pub const NOT_EXECUTABLE: i32 = 126;
pub const NOT_FOUND: i32 = 127;

/// Go-ahead bytes from the warden: first after the id maps are written, then once the cell is in
/// its cgroup (or, when no cgroup could be made, with the order to use rlimits instead).
pub const GO_MAPPED: u8 = b'm';
pub const GO_IN_CGROUP: u8 = b'c';
pub const GO_RLIMITS: u8 = b'r';

/// Entry point of the cloned child. Never returns.
pub fn run(plan: &CellPlan, fds: &InitFds) -> ! {
    // The warden's command line names host paths; the cell sees only this. (Best effort: a
    // kernel that hides the argument area leaves nothing to read either.)
    let _ = sys::replace_cmdline("warden-init");
    // A panic must not unwind into the warden's code in this forked copy of it.
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| setup_and_start(plan, fds)));
    match result {
        Ok(Ok(started)) => supervise(started, plan),
        Ok(Err((code, message))) => report(code, &message),
        Err(_) => report(SETUP_FAILED, "internal error during cell setup"),
    }
}

fn report(code: i32, message: &str) -> ! {
    // STATUS_FD was placed by `arrange_fds`; if it is gone there is no one to tell.
    let mut status = status_file();
    let _ = writeln!(status, "err {code} {message}");
    sys::exit_now(code)
}

fn status_file() -> std::fs::File {
    std::fs::File::from(owned(STATUS_FD))
}

fn owned(fd: RawFd) -> OwnedFd {
    sys::own_fd(fd)
}

type SetupResult<T> = Result<T, (i32, String)>;

fn failed<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> (i32, String) + '_ {
    move |err| (SETUP_FAILED, format!("{what}: {err}"))
}

fn arrange_fds(fds: &InitFds) -> SetupResult<()> {
    // Move everything above the range we are about to fill, then place each at its number.
    let floor = 64.max(SOURCES_FD + fds.sources.len() as RawFd + 1);
    let high = |fd| sys::dup_above(fd, floor).map_err(failed("arranging descriptors"));
    let stdin = high(fds.stdin)?;
    let stdout = high(fds.stdout)?;
    let stderr = high(fds.stderr)?;
    let sync = high(fds.sync)?;
    let status = high(fds.status)?;
    let tree = fds.tree.map(high).transpose()?;
    let gateway = fds.gateway.map(high).transpose()?;
    let exec = fds.exec.map(high).transpose()?;
    let sources: Vec<RawFd> = fds
        .sources
        .iter()
        .map(|fd| high(*fd))
        .collect::<SetupResult<_>>()?;
    let place = |from, to| sys::dup_onto(from, to).map_err(failed("arranging descriptors"));
    place(stdin, 0)?;
    place(stdout, 1)?;
    place(stderr, 2)?;
    place(sync, SYNC_FD)?;
    place(status, STATUS_FD)?;
    if let Some(tree) = tree {
        place(tree, TREE_FD)?;
    }
    if let Some(gateway) = gateway {
        place(gateway, GATEWAY_FD)?;
    }
    if let Some(exec) = exec {
        place(exec, EXEC_FD)?;
    }
    // `high` placed every descriptor above the last source slot, so none is overwritten here.
    for (i, source) in sources.iter().enumerate() {
        place(*source, SOURCES_FD + i as RawFd)?;
    }
    // Every other inherited descriptor goes (the optional slots too, when unused).
    sys::close_from(SOURCES_FD + sources.len() as RawFd)
        .map_err(failed("closing inherited descriptors"))?;
    if tree.is_none() {
        sys::close_quietly(TREE_FD);
    }
    if gateway.is_none() {
        sys::close_quietly(GATEWAY_FD);
    }
    if exec.is_none() {
        sys::close_quietly(EXEC_FD);
    }
    for fd in [SYNC_FD, STATUS_FD, TREE_FD, GATEWAY_FD, EXEC_FD] {
        let _ = sys::set_cloexec(fd);
    }
    Ok(())
}

fn setup_and_start(plan: &CellPlan, fds: &InitFds) -> SetupResult<Started> {
    let _ = sys::set_parent_death_signal(libc::SIGKILL);
    arrange_fds(fds)?;
    // The warden writes our id maps, then makes the cell's cgroup while we assemble the root.
    // Each step is acknowledged with a go-ahead; nothing of the command runs before the last.
    let mut sync = std::fs::File::from(owned(SYNC_FD));
    wait_for_warden(&mut sync);
    if let Some(cpus) = &fds.affinity {
        sys::take_back_cpus(cpus);
    }
    let (sgid, suid) = (
        Gid::from_raw(plan.ids.setup_gid()),
        Uid::from_raw(plan.ids.setup_uid()),
    );
    setresgid(sgid, sgid, sgid).map_err(failed("taking the setup group id"))?;
    setresuid(suid, suid, suid).map_err(failed("taking the setup user id"))?;
    let tree = fds.tree.map(|_| owned(TREE_FD));
    let host_root =
        rootfs::build(plan, tree.as_ref()).map_err(|e| (SETUP_FAILED, e.to_string()))?;
    drop(tree);
    // The host's sources are mounted or copied: nothing of the cell may inherit them.
    sys::close_from(SOURCES_FD).map_err(failed("closing the host's sources"))?;
    let in_cgroup = join_cgroup(&sync)?;
    if in_cgroup {
        unshare(CloneFlags::CLONE_NEWCGROUP).map_err(failed("creating the cgroup namespace"))?;
    }
    sethostname(&plan.hostname).map_err(failed("setting the host name"))?;
    if !fds.network_ready {
        sys::loopback_up().map_err(failed("bringing up loopback"))?;
    }
    if fds.gateway.is_some() {
        hand_over_gateway_socket()?;
    }
    confine::confine(plan, !in_cgroup).map_err(|e| (SETUP_FAILED, e.to_string()))?;
    // No other process of the cell may ptrace the init or write its memory: it starts execs.
    sys::set_not_dumpable().map_err(failed("making the init undumpable"))?;
    setsid().map_err(failed("starting a new session"))?;

    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    for signal in FORWARDED {
        mask.add(signal);
    }
    let numbers: Vec<i32> = mask.iter().map(|s| s as i32).collect();
    sys::install_noop_handlers(&numbers).map_err(failed("installing signal handlers"))?;
    mask.thread_block().map_err(failed("blocking signals"))?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC)
        .map_err(failed("creating a signalfd"))?;

    // Nothing of the cell runs before the host's root is gone from its mount namespace.
    host_root
        .done()
        .map_err(|e| (SETUP_FAILED, e.to_string()))?;
    let exec = fds.exec.map(|_| owned(EXEC_FD));
    let mut narrowing = confine::Narrowing::new(plan);
    // A cell that serves execs may start without a command of its own.
    let main = if plan.argv.is_empty() && exec.is_some() {
        None
    } else {
        let env: Vec<(OsString, OsString)> = plan.env.clone();
        let layer = narrowing
            .current()
            .map_err(|e| (SETUP_FAILED, e.to_string()))?;
        Some(spawn(&plan.argv, &env, &plan.cwd, None, false, layer)?)
    };
    let mut status = status_file();
    let _ = writeln!(status, "ok");
    Ok(Started {
        main,
        narrowing,
        signals,
        lifeline: sync,
        exec,
        status,
    })
}

/// The signals the init ignores (those it was born ignoring, SIGPIPE among them), asked once:
/// after its setup the init changes no signal's disposition (it reads the signals it takes on
/// a signalfd, with handlers that do nothing set before its first command). Each start then
/// sets back to default only these, not asks for each of the 64 in the child.
fn ignored_signals() -> &'static [libc::c_int] {
    static IGNORED: std::sync::OnceLock<Vec<libc::c_int>> = std::sync::OnceLock::new();
    IGNORED.get_or_init(sys::ignored_signals)
}

/// Starts a command of the cell (its first, or an exec) in its own process group, or on a
/// terminal as the leader of a session of its own.
fn spawn(
    argv: &[OsString],
    env: &[(OsString, OsString)],
    cwd: &std::path::Path,
    stdio: Option<&[OwnedFd; 3]>,
    terminal: bool,
    landlock: Option<std::os::fd::BorrowedFd<'_>>,
) -> SetupResult<Pid> {
    let Some((program, args)) = argv.split_first() else {
        return Err((NOT_EXECUTABLE, "no command".to_owned()));
    };
    let shown = program.to_string_lossy();
    let no_directory = || {
        (
            NOT_EXECUTABLE,
            format!("cannot start {shown}: no directory {}", cwd.display()),
        )
    };
    let path = find_program(program, env, cwd).ok_or_else(|| {
        if cwd.is_dir() {
            (NOT_FOUND, format!("command not found: {shown}"))
        } else {
            no_directory()
        }
    })?;
    let started = if terminal {
        // A terminal needs setsid and TIOCSCTTY between fork and exec: the one fork left.
        let mut command = Command::new(&path);
        command
            .arg0(program)
            .args(args)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd);
        if let Some([stdin, stdout, stderr]) = stdio {
            let copy = |fd: &OwnedFd| fd.try_clone().map(std::process::Stdio::from);
            match (copy(stdin), copy(stdout), copy(stderr)) {
                (Ok(stdin), Ok(stdout), Ok(stderr)) => {
                    command.stdin(stdin).stdout(stdout).stderr(stderr);
                }
                (Err(err), ..) | (_, Err(err), _) | (.., Err(err)) => {
                    return Err((NOT_EXECUTABLE, format!("cannot start {shown}: {err}")));
                }
            }
        }
        sys::controlling_terminal_on_exec(&mut command);
        sys::unblock_signals_on_exec(&mut command);
        if let Some(fd) = landlock {
            sys::landlock_on_exec(&mut command, fd);
        }
        command.spawn().map(|child| child.id() as i32)
    } else {
        use std::os::fd::AsFd as _;
        sys::spawn(&sys::Spawn {
            program: &path,
            argv,
            env,
            cwd: Some(cwd),
            stdio: stdio.map(|[a, b, c]| [a.as_fd(), b.as_fd(), c.as_fd()]),
            landlock,
            fds: &[],
            cgroups: &[],
            parent_death: None,
            own_group: true,
            ignored: Some(ignored_signals()),
        })
    };
    started.map(Pid::from_raw).map_err(|err| match err.kind() {
        std::io::ErrorKind::NotFound if !cwd.is_dir() => no_directory(),
        std::io::ErrorKind::NotFound => (NOT_FOUND, format!("command not found: {shown}")),
        std::io::ErrorKind::PermissionDenied => (
            NOT_EXECUTABLE,
            format!("cannot execute {shown}: permission denied"),
        ),
        _ => (NOT_EXECUTABLE, format!("cannot execute {shown}: {err}")),
    })
}

/// Where `program` is, as execvp would find it in the PATH of `env` (a name with a slash is a
/// path already): the first regular file with an execute bit, else the first entry that exists
/// (so that starting it reports why it cannot run).
fn find_program(
    program: &std::ffi::OsStr,
    env: &[(OsString, OsString)],
    cwd: &std::path::Path,
) -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::fs::PermissionsExt as _;
    if program.as_bytes().contains(&b'/') {
        return Some(program.into());
    }
    if program.is_empty() {
        return None;
    }
    let search = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map_or_else(|| OsString::from("/bin:/usr/bin"), |(_, v)| v.clone());
    let mut existing = None;
    for dir in search.as_bytes().split(|b| *b == b':') {
        let dir = std::path::Path::new(std::ffi::OsStr::from_bytes(dir));
        // Relative entries are relative to `cwd`, where the process is when it execs.
        let candidate = if dir.as_os_str().is_empty() {
            std::path::Path::new(".").join(program)
        } else {
            dir.join(program)
        };
        match std::fs::metadata(cwd.join(&candidate)) {
            Ok(meta) if meta.is_file() && meta.permissions().mode() & 0o111 != 0 => {
                return Some(candidate);
            }
            Ok(_) => {
                existing.get_or_insert(candidate);
            }
            Err(_) => {}
        }
    }
    existing
}

/// Opens the egress gateway's listening sockets in the cell's network namespace and hands them
/// to the warden, which serves them from outside. No process of the cell keeps them: the init
/// closes its copies, and the ports stay taken, so nothing in the cell can listen there instead.
fn hand_over_gateway_socket() -> SetupResult<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    use std::os::fd::AsRawFd as _;
    let sockets =
        crate::gateway::Sockets::open().map_err(failed("opening the egress gateway's ports"))?;
    let (sockets, redirected) = sockets.into_ordered();
    let channel = owned(GATEWAY_FD);
    let fds: Vec<RawFd> = sockets.iter().map(|s| s.as_raw_fd()).collect();
    let flag: &[u8] = if redirected { b"t" } else { b"p" };
    let iov = [std::io::IoSlice::new(flag)];
    sendmsg::<()>(
        channel.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .map_err(failed("handing the gateway socket to the warden"))?;
    Ok(())
}

/// Waits for the last go-ahead, and with it the `tasks` file of each v1 directory of the
/// cell's cgroup, opened by the warden: writing `0` into each moves this init, single-threaded
/// and with nothing started yet, into the cell's cgroup (see `CellCgroup::v1_join_files`; the
/// kernel checks the opener's credentials, the warden's). Whether the cell has a cgroup, or
/// keeps its limits by rlimits instead.
fn join_cgroup(sync: &std::fs::File) -> SetupResult<bool> {
    let (go, joins) = match sys::receive_fds(sync.as_fd()) {
        Ok((go @ (GO_IN_CGROUP | GO_RLIMITS), joins)) => (go, joins),
        // The warden gave up on this cell (or said something it never says).
        _ => sys::exit_now(SETUP_FAILED),
    };
    for join in &joins {
        sys::write_raw(join.as_raw_fd(), b"0").map_err(failed("joining the cell's cgroup"))?;
    }
    Ok(go == GO_IN_CGROUP)
}

/// Blocks until the warden sends the next go-ahead byte; a hang-up means the warden gave up on
/// this cell.
fn wait_for_warden(sync: &mut std::fs::File) -> u8 {
    let mut go = [0u8; 1];
    if !matches!(sync.read(&mut go), Ok(1)) {
        sys::exit_now(SETUP_FAILED);
    }
    go[0]
}

/// What the init holds once the command runs.
struct Started {
    /// The cell's first command; `None` for a cell that only serves execs.
    main: Option<Pid>,
    /// The Landlock layer of every process started from here on.
    narrowing: confine::Narrowing,
    signals: SignalFd,
    /// The sync pipe: the warden keeps its end open for the cell's whole life, so a hang-up means
    /// the warden died (a parent-death signal would not do: credential changes clear it).
    lifeline: std::fs::File,
    /// The exec channel to the keeper, for cells that serve execs.
    exec: Option<OwnedFd>,
    /// The status pipe: after "ok", the one more thing the warden is told is how the first
    /// command ended (`END_EXITED`, `END_SIGNALED`: pid 1 cannot die of a signal, so its exit
    /// code alone would not tell `exit 137` from SIGKILL), once nothing else of the cell runs.
    status: std::fs::File,
}

/// A process exec'd into the cell, and the client it answers to (gone once it hung up).
struct Exec {
    id: u64,
    client: Option<OwnedFd>,
    /// The cell's last process (`ExecRequest::last`): the init exits once its end is told.
    last: bool,
    /// The init's copies of the process's stdout and stderr, handed to the client with the
    /// process's end (`tell_end`): the pipes do not end as the process exits, before the init
    /// has told it, so the warden hears both at once.
    output: Option<[OwnedFd; 2]>,
}

/// Reaps every process until the command exits, then exits with its status; forwards signals;
/// starts execs and talks to their clients directly; ends the cell if the warden dies.
fn supervise(
    Started {
        main,
        mut narrowing,
        signals,
        lifeline,
        exec,
        mut status,
    }: Started,
    plan: &CellPlan,
) -> ! {
    use nix::poll::{PollFd, PollFlags, poll};
    use std::collections::HashMap;
    use std::os::fd::AsFd as _;
    let mut execs: HashMap<Pid, Exec> = HashMap::new();
    // Lines straight from clients (see `exec::Line`), handed out through the keeper.
    let mut lines: Vec<OwnedFd> = Vec::new();
    // A cell that serves execs: its init waits for them for as long as the cell lives, and
    // lets go of its start's pages once it has been set up a while (single-threaded: at a
    // poll's timeout, not on a thread).
    let mut let_go = sys::LetGo::after_linger(main.is_none());
    if main.is_none() {
        // What the first exec would do first, done while nothing is asked of the cell (a cell
        // made ahead waits here for its first exec): the signals it ignores read from the
        // kernel, and the stack its children start on mapped.
        ignored_signals();
        sys::ready_spawn_stack();
    }
    loop {
        let_go.when_due();
        // Clients still connected, watched for their signals and their hang-up.
        let watched: Vec<Pid> = execs
            .iter()
            .filter(|(_, e)| e.client.is_some())
            .map(|(pid, _)| *pid)
            .collect();
        let mut fds = vec![
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
        ];
        if let Some(exec) = &exec {
            fds.push(PollFd::new(exec.as_fd(), PollFlags::POLLIN));
        }
        let first_line = fds.len();
        fds.extend(
            lines
                .iter()
                .map(|line| PollFd::new(line.as_fd(), PollFlags::POLLIN)),
        );
        let first_client = fds.len();
        fds.extend(
            watched
                .iter()
                .filter_map(|pid| execs.get(pid).and_then(|e| e.client.as_ref()))
                .map(|client| PollFd::new(client.as_fd(), PollFlags::POLLIN)),
        );
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
            // The warden is gone: exiting makes the kernel kill everything in the pid namespace.
            sys::exit_now(SETUP_FAILED);
        }
        let (exec_ready, signal_ready) = (exec.is_some() && ready(2), ready(0));
        let lines_ready: Vec<bool> = (0..lines.len()).map(|i| ready(first_line + i)).collect();
        let clients_ready: Vec<Pid> = watched
            .iter()
            .enumerate()
            .filter(|(i, _)| ready(first_client + i))
            .map(|(_, pid)| *pid)
            .collect();
        drop(fds);
        if let (true, Some(channel)) = (exec_ready, &exec) {
            match sys::receive_message(channel.as_fd()) {
                Ok(Some((payload, mut received))) => {
                    if matches!(serde_json::from_slice(&payload), Ok(Request::Line)) {
                        if let (Some(line), true) = (received.pop(), received.is_empty()) {
                            lines.push(line);
                        }
                    } else {
                        start_exec(&payload, received, plan, &mut narrowing, &mut execs);
                    }
                }
                // The keeper is gone: so is the cell.
                Ok(None) | Err(_) => sys::exit_now(SETUP_FAILED),
            }
        }
        let mut index = 0;
        lines.retain(|line| {
            index += 1;
            // (A line that came in this round was not polled yet.)
            if !lines_ready.get(index - 1).copied().unwrap_or(false) {
                return true;
            }
            match sys::try_receive_message(line.as_fd()) {
                Ok(Some((payload, received))) => {
                    start_exec(&payload, received, plan, &mut narrowing, &mut execs);
                    true
                }
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => true,
                // The client let go of its line.
                Ok(None) | Err(_) => false,
            }
        });
        for pid in clients_ready {
            if let Some(exec) = execs.get_mut(&pid) {
                serve_client(pid, exec);
            }
        }
        if !signal_ready {
            continue;
        }
        let info = match signals.read_signal() {
            Ok(Some(info)) => info,
            Ok(None) => continue,
            Err(_) => sys::exit_now(SETUP_FAILED),
        };
        if info.ssi_signo == Signal::SIGCHLD as u32 {
            while let Ok(Some(reaped)) = sys::reap_any() {
                let pid = Pid::from_raw(reaped.pid);
                if Some(pid) == main {
                    // Whatever else of the cell runs is ended and reaped before the end is
                    // told, as for a cell's last exec below: the warden that reads it knows
                    // that nothing of the cell is left but this process, which exits right
                    // after, and goes on without waiting for the kernel's teardown of it.
                    sys::end_all_others(std::time::Duration::from_secs(1));
                    // The command's pipes end with its last holder: the warden drains them
                    // to their end before it goes on.
                    sys::close_stdio();
                    // One write: the warden never reads half a line.
                    let end = match reaped.status {
                        Ok(code) => format!("{END_EXITED}{code}\n"),
                        Err(signal) => format!("{END_SIGNALED}{signal}\n"),
                    };
                    let _ = status.write_all(end.as_bytes());
                    sys::exit_now(reaped.status.unwrap_or_else(|signal| 128 + signal));
                }
                if let Some(Exec {
                    id,
                    client: Some(client),
                    last,
                    output,
                }) = execs.remove(&pid)
                {
                    let usage = Some(Usage {
                        cpu_user_ms: reaped.user_us / 1000,
                        cpu_system_ms: reaped.system_us / 1000,
                        max_rss_kib: reaped.max_rss_kib,
                    });
                    let event = match reaped.status {
                        Ok(code) => ExecEvent::Exited { id, code, usage },
                        Err(signal) => ExecEvent::Signaled { id, signal, usage },
                    };
                    if last {
                        // The cell ends with its last process: whatever else of it runs is
                        // ended and reaped before its end is told, so the warden that hears
                        // it knows no process of the cell is left (but this one, which exits
                        // right after: the kernel's teardown of a pid namespace's init is not
                        // waited for). One whose client went away leaves the cell to its
                        // warden.
                        sys::end_all_others(std::time::Duration::from_secs(1));
                        // Let go of here, not by the exit: the kernel takes the init's memory
                        // down before its files, and the warden drains the pipes to their end.
                        tell_end(&client, &event, output);
                        // The cell's teardown (this exit, then its keeper's) waits for the
                        // client's hang-up: a daemon's run lets go once it has answered, so
                        // the teardown's work (the kernel's, and its workers' and grace
                        // periods') does not take the two CPUs from the journal's round and
                        // the answer. At the least priority past that: nothing waits for it.
                        linger_until_hang_up(&client, &lifeline);
                        sys::lower_priority(0);
                        sys::exit_now(reaped.status.unwrap_or_else(|signal| 128 + signal));
                    }
                    tell_end(&client, &event, output);
                }
            }
        } else if let (Ok(signal), Some(main)) = (Signal::try_from(info.ssi_signo as i32), main) {
            let _ = kill(Pid::from_raw(-main.as_raw()), signal);
        }
    }
}

/// Sends an event to an exec's client. Never waits: the client reads as it goes, and one
/// that does not must not hold the cell's init.
fn send_event(client: &OwnedFd, event: &ExecEvent, fds: &[RawFd]) {
    use std::os::fd::AsFd as _;
    let _ = sys::send_message_nowait(
        client.as_fd(),
        &serde_json::to_vec(event).unwrap_or_default(),
        fds,
    );
}

/// Tells an exec's client how its process ended, and lets go of the init's copies of the
/// process's stdout and stderr by handing them over with the event: the client closes them as
/// it reads it, so the pipes end (where no other process holds them) while the client runs,
/// and the end wakes it once. Closed here after the event, each copy's close woke the client
/// on its own, its thread running before the init's next step: three wake-ups.
fn tell_end(client: &OwnedFd, event: &ExecEvent, output: Option<[OwnedFd; 2]>) {
    let fds: Vec<RawFd> = output.iter().flatten().map(|fd| fd.as_raw_fd()).collect();
    let payload = serde_json::to_vec(event).unwrap_or_default();
    if sys::send_message_nowait(client.as_fd(), &payload, &fds).is_err() && !fds.is_empty() {
        // A client that cannot take descriptors still hears the end; the pipes end with the
        // init's copies, closed below.
        let _ = sys::send_message_nowait(client.as_fd(), &payload, &[]);
    }
    drop(output);
}

/// The longest a cell's last process's end keeps its init once told (a client that never
/// hangs up, such as a daemon stuck elsewhere, holds no cell longer).
const LINGER_AT_MOST_MS: u16 = 3000;

/// Waits until the client of the cell's last process hangs up (or says anything more), the
/// warden goes, or `LINGER_AT_MOST_MS` passes.
fn linger_until_hang_up(client: &OwnedFd, lifeline: &std::fs::File) {
    use nix::poll::{PollFd, PollFlags, poll};
    let mut fds = [
        PollFd::new(client.as_fd(), PollFlags::POLLIN),
        PollFd::new(lifeline.as_fd(), PollFlags::POLLIN),
    ];
    let _ = poll(&mut fds, LINGER_AT_MOST_MS);
}

/// A message from an exec's client: a signal for its process's group; or its hang-up, which
/// kills the process (nobody is left to hear how it ends).
fn serve_client(pid: Pid, exec: &mut Exec) {
    use std::os::fd::AsFd as _;
    let Some(client) = &exec.client else { return };
    let signal = match sys::try_receive_message(client.as_fd()) {
        Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return,
        Ok(Some((payload, _))) => match serde_json::from_slice::<Request>(&payload) {
            Ok(Request::Signal { signal, .. }) => Signal::try_from(signal).ok(),
            _ => None,
        },
        Ok(None) | Err(_) => {
            exec.client = None;
            Some(Signal::SIGKILL)
        }
    };
    if let Some(signal) = signal {
        let _ = kill(Pid::from_raw(-pid.as_raw()), signal);
    }
}

/// Starts a process asked for by the keeper (or on a line): the descriptors are the client's
/// socket (where its events go, and its signals come from), then its stdin, stdout and stderr
/// (none for a terminal, which is made here). A file operation is a process too: a fork of this
/// init that runs it (see `files`).
fn start_exec(
    payload: &[u8],
    mut received: Vec<OwnedFd>,
    plan: &CellPlan,
    narrowing: &mut confine::Narrowing,
    execs: &mut std::collections::HashMap<Pid, Exec>,
) {
    let (id, request) = match serde_json::from_slice::<Request>(payload) {
        Ok(Request::Exec { id, request }) => (id, Some(request)),
        Ok(Request::Files { id, .. }) => (id, None),
        _ => return,
    };
    if received.is_empty() {
        // No client to answer to: nothing to start.
        return;
    }
    let client = received.remove(0);
    let fail = |message: String| {
        send_event(
            &client,
            &ExecEvent::Failed {
                id,
                code: NOT_EXECUTABLE,
                message,
            },
            &[],
        );
    };
    // Every process started from here is put under the processes' Landlock layer; none starts
    // without it.
    let layer = match narrowing.current() {
        Ok(layer) => layer,
        Err(err) => return fail(format!("starting a process: {err}")),
    };
    let Some(request) = request else {
        let Ok(Request::Files { root, file, .. }) = serde_json::from_slice::<Request>(payload)
        else {
            return;
        };
        let Ok(stdio) = <[OwnedFd; 3]>::try_from(received) else {
            return fail("a file operation needs stdin, stdout and stderr".to_owned());
        };
        return match start_file_operation(&root, file, stdio, layer) {
            Ok(pid) => {
                send_event(
                    &client,
                    &ExecEvent::Started {
                        id,
                        pid: pid.as_raw(),
                    },
                    &[],
                );
                execs.insert(
                    pid,
                    Exec {
                        id,
                        client: Some(client),
                        last: false,
                        output: None,
                    },
                );
            }
            Err(err) => fail(format!("starting the file operation: {err}")),
        };
    };
    // A terminal is made here, in the cell's own devpts; its master goes back to the client
    // with the `started` event.
    let (stdio, master) = match request.tty {
        Some(size) => {
            let made = sys::open_pty().and_then(|(master, slave)| {
                use std::os::fd::AsFd as _;
                sys::set_window_size(slave.as_fd(), size.rows, size.cols)?;
                let (a, b) = (slave.try_clone()?, slave.try_clone()?);
                Ok(([a, b, slave], master))
            });
            match made {
                Ok((stdio, master)) => (stdio, Some(master)),
                Err(err) => return fail(format!("making a terminal: {err}")),
            }
        }
        None => match <[OwnedFd; 3]>::try_from(received) {
            Ok(stdio) => (stdio, None),
            Err(_) => {
                return fail("an exec request needs stdin, stdout and stderr".to_owned());
            }
        },
    };
    let mut env = plan.env.clone();
    for (key, value) in request.env {
        env.retain(|(k, _)| k.as_os_str() != key.as_str());
        env.push((key.into(), value.into()));
    }
    let cwd = request.cwd.map_or_else(|| plan.cwd.clone(), Into::into);
    let last = request.last;
    let argv: Vec<OsString> = request.argv.into_iter().map(Into::into).collect();
    match spawn(&argv, &env, &cwd, Some(&stdio), master.is_some(), layer) {
        Ok(pid) => {
            // A terminal's slave is let go of at once (its master reads to the end of its
            // last holder); a pipe's stdout and stderr are kept until the end is told.
            let [_stdin, stdout, stderr] = stdio;
            let output = master.is_none().then_some([stdout, stderr]);
            use std::os::fd::AsRawFd as _;
            let fds: Vec<RawFd> = master.iter().map(|m| m.as_raw_fd()).collect();
            send_event(
                &client,
                &ExecEvent::Started {
                    id,
                    pid: pid.as_raw(),
                },
                &fds,
            );
            execs.insert(
                pid,
                Exec {
                    id,
                    client: Some(client),
                    last,
                    output,
                },
            );
        }
        Err((code, message)) => send_event(&client, &ExecEvent::Failed { id, code, message }, &[]),
    }
}

/// Forks a child of the init that runs one file operation with `stdio` and exits with its
/// status. The init is single-threaded, so the fork is a plain copy of it: confined alike.
fn start_file_operation(
    root: &str,
    op: super::files::FileOp,
    stdio: [OwnedFd; 3],
    landlock: Option<std::os::fd::BorrowedFd<'_>>,
) -> std::io::Result<Pid> {
    use std::os::fd::AsRawFd as _;
    let pid = sys::clone_process(0)?;
    if pid != 0 {
        return Ok(Pid::from_raw(pid));
    }
    // The child: its own process group (signals go to the group), its stdio, nothing else of
    // the init's, and no signal blocked.
    let _ = nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0));
    for (fd, target) in stdio.iter().zip([0, 1, 2]) {
        if sys::dup_onto(fd.as_raw_fd(), target).is_err() {
            sys::exit_now(SETUP_FAILED);
        }
    }
    std::mem::forget(stdio);
    if let Some(fd) = landlock
        && sys::landlock_restrict_self(fd).is_err()
    {
        sys::exit_now(SETUP_FAILED);
    }
    let _ = sys::close_from(3);
    let _ = SigSet::empty().thread_set_mask();
    sys::exit_now(super::files::serve(root, op))
}
