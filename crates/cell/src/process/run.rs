//! The warden's side of `warden run`: plan the cell, create it, relay its stdio, enforce the
//! limits that need a clock or a counter, and leave nothing behind.

use std::ffi::OsString;
use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::{AsFd as _, AsRawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;
use warden_policy::{Policy, Tier, WorkspaceMode};
use warden_workspace::{Layer, LayerMeta};

use super::cgroup::{self, CellCgroup};
use super::ids::IdMapping;
use super::init::{self, InitFds};
use super::outcome::{Ending, RunError, RunOutcome, nix_os, os};
use super::plan::{self, CellPlan, OverlayPlan, PlanError, WorkspacePlan};
use super::registry::{CellRecord, Registry};
use super::relay::{Relay, Stop, spawn_stdin_pump};
use super::snapshot::SnapshotInfo;
use super::store::Store;
use super::{idmap, sys};

/// What the caller asks for.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub policy: Policy,
    pub name: Option<String>,
    pub workspace: Option<PathBuf>,
    pub argv: Vec<OsString>,
    /// `--env K=V` additions, on top of what the policy sets and passes.
    pub env: Vec<(String, String)>,
    /// Remove what the cell leaves behind when it ends (`--rm`): its workspace layer and its
    /// egress record.
    pub discard_changes: bool,
    /// Start from this snapshot (a fork): its layers go under the cell's own, copying nothing.
    pub from: Option<SnapshotInfo>,
    /// Take exec requests on `exec.sock` in the cell's runtime folder (see `exec`); with this,
    /// `argv` may be empty: the cell then runs until it is killed.
    pub serve_exec: bool,
    /// Where the ending is written (JSON, see [`Ending::report`]) before the cell's name is
    /// released: a supervisor that learns of the end from the name's lock finds why there.
    pub report: Option<PathBuf>,
    /// The caller checked the policy's host paths already (`Backend::check`, just before):
    /// they are not walked twice.
    pub checked: bool,
    /// Told `ready` once the cell takes execs (its exec socket is there and its record
    /// published): how whoever started the keeper learns it without looking again and again.
    pub ready: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    /// Only signals this process passes on (`sys::forward_signal`) go on to the cell (see
    /// `KeeperRequest::signals_from`); none: every signal the keeper gets.
    pub signals_from: Option<i32>,
    /// The cell's name is released on a thread of its own after the run (see `Release`): the
    /// caller has work to do meanwhile, and waits for it before it ends.
    pub release_later: bool,
    /// A keeper forked by `warden run` (the gVisor tier): its lines to the process that forked
    /// it, which journals the start while the keeper makes the cell, and the end while the
    /// keeper takes it down.
    pub lines: Option<std::sync::Arc<RunLines>>,
}

/// The two pipes between a keeper forked by `warden run` and `warden run`.
#[derive(Debug)]
pub struct RunLines {
    /// Read before the command may start: one byte once its start is in the journal, the end
    /// of the pipe when it is not to start (the start could not be journaled).
    pub go: std::os::fd::OwnedFd,
    /// Where the ending goes (one line: the report's JSON, with `kept_changes`) as soon as it
    /// is known, before the cell is taken down.
    pub ended: std::os::fd::OwnedFd,
}

impl RunLines {
    /// Waits for the word to start; whether it came.
    pub(crate) fn wait_for_go(&self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            match rustix::io::read(&self.go, &mut byte) {
                Ok(1) => return byte[0] == GO,
                Err(rustix::io::Errno::INTR) => {}
                _ => return false,
            }
        }
    }

    /// Says how the cell ended, and whether its workspace changes are kept.
    fn say_ended(&self, ending: &Ending, kept_changes: bool) {
        let mut report = ending.report();
        report["kept_changes"] = serde_json::Value::Bool(kept_changes);
        let mut line = report.to_string().into_bytes();
        line.push(b'\n');
        let _ = rustix::io::write(&self.ended, &line);
    }
}

/// Tells the `warden run` that forked this keeper, if one did, how its cell ended and whether
/// the changes of its workspace `layer` are kept, before the cell is taken down.
pub(crate) fn tell_ending(request: &RunRequest, layer: Option<&LayerGuard>, ending: &Ending) {
    if let Some(lines) = &request.lines {
        let kept = layer.is_some_and(|layer| layer.keeps(request.discard_changes));
        lines.say_ended(ending, kept);
    }
}

/// The byte `RunLines::go` carries.
pub(crate) const GO: u8 = b'g';

/// Says `ready` on the line of whoever waits for the cell (the keeper's starter).
pub(crate) fn say_ready(ready: Option<&std::os::fd::OwnedFd>) {
    if let Some(fd) = ready {
        let _ = rustix::io::write(fd, b"ready\n");
    }
}

/// The size of a cell's `/dev/shm` (no larger than its memory limit).
pub const SHM_SIZE: u64 = 64 << 20;

/// The signals that would end the warden, read from a signalfd and forwarded to the cell.
pub(crate) fn forwarded_signals() -> SigSet {
    let mut set = SigSet::empty();
    for signal in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        set.add(signal);
    }
    set
}

/// Runs a command in a fresh cell and returns once the cell is gone.
///
/// Must be called while the process is single-threaded: the cell starts as a clone of the
/// calling thread, which goes on in the child without the others (a lock one of them held, of
/// the allocator or of stdio, would stay held in the cell's init).
pub fn run(
    registry: &Registry,
    store: &Store,
    request: RunRequest,
) -> Result<RunOutcome, RunError> {
    let network = NetworkAhead::for_policy(&request.policy);
    run_with(registry, store, request, network, &mut || Ok(()))
}

/// Like [`run`], calling `before_start` once the cell is made, on a thread of its own while its
/// init assembles the cell's root and this thread makes its cgroup, and before its command may
/// start: work of the caller's that must be done before the command runs overlaps the cell's
/// own setup there. When it fails, the cell ends without running anything and the run fails
/// with its message. `network`: the cell's network namespace, under way since the caller had
/// the policy (see `NetworkAhead`; one of another policy's is let go of).
pub fn run_with(
    registry: &Registry,
    store: &Store,
    request: RunRequest,
    mut network: NetworkAhead,
    before_start: &mut (dyn FnMut() -> Result<(), String> + Send),
) -> Result<RunOutcome, RunError> {
    let policy = &request.policy;
    if policy.tier != Tier::Process {
        return Err(PlanError::Tier(policy.tier.name()).into());
    }
    if request.argv.is_empty() && !request.serve_exec {
        return Err(PlanError::NoCommand.into());
    }
    let privileged = nix::unistd::geteuid().is_root();
    let identity = plan::identity(policy, store.root())?;
    let ids = IdMapping {
        privileged,
        inside_uid: identity.uid,
        inside_gid: identity.gid,
        host_uid: nix::unistd::geteuid().as_raw(),
        host_gid: nix::unistd::getegid().as_raw(),
    };
    let Prepared {
        name,
        reservation,
        layer,
        mut plan,
        gateway: gateway_rules,
        mut notices,
        watched_disk,
    } = prepare(registry, store, &request, &ids, privileged.then_some(&ids))?;

    // In root mode the workspace is attached through an id-mapped mount: its owner appears as the
    // cell's user, and files the cell creates belong to that owner on the host.
    let tree = match (&plan.workspace, privileged) {
        (Some(ws), true) => Some(idmap::workspace_tree(&ws.host, &ids)?),
        _ => None,
    };

    let (stdin_r, stdin_w) = sys::pipe().map_err(os("creating pipes"))?;
    let (stdout_r, stdout_w) = sys::pipe().map_err(os("creating pipes"))?;
    let (stderr_r, stderr_w) = sys::pipe().map_err(os("creating pipes"))?;
    // A socket rather than a pipe: the last go-ahead carries the cgroup's `tasks` files.
    let (sync, sync_r) = sys::seqpacket_pair().map_err(os("creating the sync channel"))?;
    let (status_r, status_w) = sys::pipe().map_err(os("creating pipes"))?;
    let gateway_channel = match &gateway_rules {
        Some(_) => Some(sys::seqpacket_pair().map_err(os("creating the gateway channel"))?),
        None => None,
    };
    let exec_channel = if request.serve_exec {
        Some(sys::seqpacket_pair().map_err(os("creating the exec channel"))?)
    } else {
        None
    };
    // Host paths the policy shows the cell below a directory its setup may not search (a home
    // directory of mode 0700, as root's is): a root warden opens them here, for the setup to
    // attach (a detached clone) or copy (an O_PATH descriptor). Everything else is bound by its
    // path, from mounts the kernel keeps locked in the cell.
    let mut sources = Vec::new();
    if privileged {
        let mut reach = plan::Reach::new();
        let mut resolver = plan::Resolver::default();
        for (i, entry) in plan.entries.iter().enumerate() {
            let (path, bind) = match entry {
                plan::Entry::Bind { path, .. } => (path, true),
                plan::Entry::Copy { path } => (path, false),
                plan::Entry::Symlink { .. } => continue,
            };
            let canonical = resolver.canonicalize(path).unwrap_or_else(|_| path.clone());
            if reach.check("", &canonical).is_ok() {
                continue;
            }
            let opened = if bind {
                sys::detached_clone_recursive(path)
            } else {
                rustix::fs::open(
                    path,
                    rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .map_err(io::Error::from)
            };
            let fd = opened.map_err(|e| RunError::Os {
                what: "opening a path the policy shows the cell",
                source: io::Error::other(format!("{}: {e}", path.display())),
            })?;
            sources.push((i, fd));
        }
    }
    plan.sources = vec![None; plan.entries.len()];
    for (k, (i, _)) in sources.iter().enumerate() {
        plan.sources[*i] = Some(init::SOURCES_FD + k as i32);
    }
    // The owner of the cell's user namespace (root-started), held until the cell is gone;
    // declared before the guard, so that on a way out it goes after the guard ended the init.
    let mut owner_held = None;
    let mut guard = CellGuard {
        cgroup: None,
        pid: None,
    };
    let mut fds = InitFds {
        sources: sources.iter().map(|(_, fd)| fd.as_raw_fd()).collect(),
        exec: exec_channel.as_ref().map(|(_, child)| child.as_raw_fd()),
        gateway: gateway_channel.as_ref().map(|(_, child)| child.as_raw_fd()),
        stdin: stdin_r.as_raw_fd(),
        stdout: stdout_w.as_raw_fd(),
        stderr: stderr_w.as_raw_fd(),
        sync: sync_r.as_raw_fd(),
        status: status_w.as_raw_fd(),
        tree: tree.as_ref().map(|t| t.as_raw_fd()),
        affinity: sys::spread_affinity(),
        network_ready: false,
    };

    // Signals that would end the warden are read from a signalfd and forwarded instead; the
    // child unblocks them before anything else.
    let forwarded = forwarded_signals();
    let old_mask = forwarded
        .thread_swap_mask(nix::sys::signal::SigmaskHow::SIG_BLOCK)
        .map_err(nix_os("blocking signals"))?;

    let mut flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS;
    // The network namespace made ahead, its thread gone (or none: the clone makes one, and
    // the init opens the gateway's sockets in it), with the gateway's sockets where the cell
    // has a gateway (then the init has none to open: its channel is not handed to it).
    let (ready_network, mut gateway_ahead) =
        match network.take().filter(|_| NetworkAhead::wanted(policy)) {
            Some(made) => match (made.sockets, gateway_rules.is_some()) {
                (Some(sockets), true) => (Some(made.fd), Some(sockets)),
                (None, false) => (Some(made.fd), None),
                // Made for another policy: let go of.
                _ => (None, None),
            },
            None => (None, None),
        };
    // The child goes on as a copy of this thread alone: a lock another thread holds now
    // would stay held in the init for ever. Refused instead of risked.
    let threads = sys::thread_count_once_joined();
    if threads > 1 {
        let _ = old_mask.thread_set_mask();
        return Err(RunError::Os {
            what: "starting a cell from a process with other threads (the process tier clones the cell from the calling thread, and must be called single-threaded)",
            source: io::Error::other(format!("{threads} threads")),
        });
    }
    // An owner of its own for a root-started cell's user namespace: no other live cell's (see
    // `ids::reserve_owner`). Taken in the warden's network namespace, where every warden
    // process of the host takes them, before this thread enters the cell's.
    if privileged {
        let owner = super::ids::reserve_owner(&name).map_err(|source| {
            let _ = old_mask.thread_set_mask();
            RunError::Os {
                what: "taking an owner uid for the cell's user namespace",
                source,
            }
        })?;
        owner_held = Some(owner);
    }
    // The cell is cloned inside the namespace made ahead, and this thread goes back to its own
    // right after. (Where that cannot be, the clone makes the cell's network namespace.)
    let back_to = ready_network.as_ref().and_then(|ready| {
        let own = sys::network_namespace_of_this_thread().ok()?;
        sys::enter_network_namespace(ready.as_fd()).ok()?;
        Some(own)
    });
    // The gateway's sockets are the ones made ahead only where the cell is cloned in their
    // namespace (else its init opens them in its own, as without one made ahead).
    match back_to {
        Some(_) => {
            fds.network_ready = true;
            if gateway_ahead.is_some() {
                fds.gateway = None;
            }
        }
        None => {
            flags |= libc::CLONE_NEWNET;
            gateway_ahead = None;
        }
    }
    let cloned = match &owner_held {
        Some(owner) => sys::clone_process_owned_by(flags, owner.uid),
        None => sys::clone_process(flags),
    };
    if matches!(cloned, Ok(0)) {
        let _ = old_mask.thread_set_mask();
        init::run(&plan, &fds)
    }
    let back = back_to.map(|own| sys::enter_network_namespace(own.as_fd()));
    // A gateway's namespace made ahead is redirected by a thread of its own, started once the
    // init has its go-ahead (below).
    let redirect_netns = ready_network.filter(|_| gateway_ahead.is_some());
    let pid = match cloned {
        Ok(pid) => Pid::from_raw(pid),
        Err(source) => {
            let _ = old_mask.thread_set_mask();
            return Err(RunError::Namespaces { source });
        }
    };
    guard.pid = Some(pid);
    if let Some(Err(source)) = back {
        let _ = old_mask.thread_set_mask();
        return Err(RunError::Os {
            what: "going back to the warden's network namespace after the cell's clone",
            source,
        });
    }
    drop((stdin_r, stdout_w, stderr_w, sync_r, status_w, tree, sources));
    let gateway_channel = gateway_channel.map(|(warden_end, _child_end)| warden_end);
    let exec_channel = exec_channel.map(|(warden_end, _child_end)| warden_end);

    let started = Instant::now();
    let pidfd = sys::pidfd_open(pid.as_raw()).map_err(os("opening a pidfd for the cell"))?;
    write_id_maps(pid, &ids).map_err(os("writing the cell's id maps"))?;
    // The cell's namespaces, taken while its init may still be looked at (it makes itself
    // undumpable at the end of its setup): the keeper hands them to whoever acts inside the
    // cell from outside later (a reset), which an unprivileged warden could not open then.
    let namespaces = ["user", "mnt"].map(|ns| {
        fs::File::open(format!("/proc/{}/ns/{ns}", pid.as_raw())).map(std::os::fd::OwnedFd::from)
    });
    let namespaces = match namespaces {
        [Ok(user), Ok(mnt)] => Some(super::exec::Namespaces {
            user,
            mnt,
            root: None,
        }),
        _ => None,
    };
    // The init assembles the root beside what this thread does next (the cgroup, the
    // record): off this thread's CPU, where the wake-up could queue it behind this thread.
    if let Some(cpus) = &fds.affinity {
        sys::keep_off_this_cpu(pid.as_raw(), cpus);
    }
    // A failed go-ahead means the init ended already: why is on the status pipe (read below).
    let mut go_ahead = sys::send_message(sync.as_fd(), &[init::GO_MAPPED], &[]);
    // The redirection's programs (`nft` 2-3 ms here) run beside the init's setup; the last
    // go-ahead waits for them. One that cannot be started leaves the namespace unredirected
    // (said in a notice, as where the host lacks the programs).
    let redirecting = redirect_netns.and_then(|netns| crate::gateway::redirect_in(netns).ok());

    // The caller's work before the command may start (`warden run` journals the start, with
    // its fdatasync) runs on a thread of its own from here, beside the cgroup and the record
    // below, while the init assembles its root: the fdatasync alone took 0.4-2.8 ms here, most
    // of it after the record before.
    let (cell_cgroup, cgroup_joins) = std::thread::scope(|scope| {
        let caller = match go_ahead.is_ok() {
            true => Some(
                std::thread::Builder::new()
                    .name("before-start".to_owned())
                    .spawn_scoped(scope, before_start)
                    .map_err(os("starting a thread for the work before the start"))?,
            ),
            false => None,
        };
        // The cell's cgroup, made while the init assembles its root. The init moves itself
        // into the v1 directories through their `tasks` files, opened here and handed over
        // with the last go-ahead, before it starts anything (see `CellCgroup::v1_join_files`:
        // a move of a whole process from out here would wait for an RCU grace period, 10-15
        // ms on an idle host); the v2 ones, which have no quick way in, take it from here,
        // overlapped with the mounts too.
        let limits = cgroup::Limits {
            memory_bytes: policy.limits.memory.map(|m| m.0),
            pids: policy.limits.pids,
            cpus: policy.limits.cpus,
        };
        // Where the cgroup controllers are, found here, beside the init's mounts, from the
        // runtime directory's copy of what `/proc/self/mountinfo` said about them, checked
        // against the mounts' ids (`discover_cached`): 0.15 ms, which was on the way to the
        // clone where no network namespace was being made ahead (rootless). Where that copy
        // does not hold (the first run after a boot, a cgroup file system mounted since), the
        // table is read here, and its read holds the kernel's lock of all mount namespaces,
        // which the init's mounts then wait for, once.
        let hierarchies = cgroup::discover_cached(&registry.root().join(cgroup::MOUNTS_CACHE));
        let cell_cgroup = match CellCgroup::create(
            &hierarchies,
            &registry.instance(),
            &name,
            &limits,
        ) {
            Ok(cg) => Some(cg),
            Err(err) if !privileged => {
                notices.push(format!(
                        "no writable cgroup for this user ({err}); memory and process limits fall back to \
                         per-process rlimits, cpu is not limited, and pause is unavailable"
                    ));
                None
            }
            Err(err) => return Err(err.into()),
        };
        guard.cgroup = cell_cgroup.clone();
        let cgroup_joins = cell_cgroup
            .as_ref()
            .map_or_else(Vec::new, CellCgroup::v1_join_files)
            .iter()
            .map(|path| {
                fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map(std::os::fd::OwnedFd::from)
                    .map_err(|e| RunError::Os {
                        what: "opening the cell's cgroup",
                        source: io::Error::other(format!("{}: {e}", path.display())),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(cg) = &cell_cgroup {
            cg.add_to_v2(pid.as_raw())?;
        }
        reservation.publish(&CellRecord {
            name: name.clone(),
            pid: pid.as_raw(),
            pid_start: super::sys::process_start_ticks(pid.as_raw()).unwrap_or(0),
            warden_pid: std::process::id() as i32,
            started_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            argv: request
                .argv
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
            workspace: plan.workspace.as_ref().map(|w| w.host.clone()),
            cgroup: cell_cgroup.clone(),
            gateway: gateway_channel.is_some(),
            image: policy.image.clone(),
        })?;
        // Here the init is busy with its mounts, and waits for the go-ahead to start the
        // command. (On an error above, the scope waits for the caller's work all the same.)
        if let Some(thread) = caller {
            thread
                .join()
                .unwrap_or_else(|_| Err("the work before the start failed".to_owned()))
                .map_err(RunError::BeforeStart)?;
        }
        Ok::<_, RunError>((cell_cgroup, cgroup_joins))
    })?;
    // The gateway's redirection of a namespace made ahead is in place before anything of the
    // cell runs.
    if let Some(sockets) = &mut gateway_ahead {
        sockets.redirected = redirecting.is_some_and(|thread| thread.join().unwrap_or(false));
    }
    let go = if cell_cgroup.is_some() {
        init::GO_IN_CGROUP
    } else {
        init::GO_RLIMITS
    };
    if go_ahead.is_ok() {
        let joins: Vec<_> = cgroup_joins.iter().map(AsRawFd::as_raw_fd).collect();
        go_ahead = sys::send_message(sync.as_fd(), &[go], &joins);
    }
    drop(cgroup_joins);

    // The cell's exec socket and its router, made while the init starts the command (its
    // answer came after the command's start; a command that cannot start takes the router
    // down with the run's early end below). Requests that come before the init serves wait
    // in the init's channel.
    // (A rootless disk watch looks from inside the cell's user namespace: held from here.)
    let watches_disk = watched_disk.is_some()
        && plan
            .workspace
            .as_ref()
            .is_some_and(|ws| ws.overlay.is_some());
    let disk_userns = match (&namespaces, privileged) {
        (Some(ns), false) if watches_disk => Some(
            ns.user
                .try_clone()
                .map_err(os("holding the cell's user namespace"))?,
        ),
        _ => None,
    };
    let mut router = super::exec::serve(
        &reservation.file(super::exec::EXEC_SOCKET),
        exec_channel,
        namespaces,
        plan.workspace.is_none() && policy.image.is_none() && super::exec::leaves_to_exit(),
    )
    .map_err(os("opening the cell's exec socket"))?;

    // The init answers "ok" once the command runs, or "err CODE MESSAGE".
    let mut line = String::new();
    let mut status_reader = BufReader::new(fs::File::from(status_r));
    let _ = status_reader.read_line(&mut line);
    let line = line.trim_end();
    if line != "ok" {
        let _ = waitpid(pid, None);
        guard.pid = None;
        let unexplained = match &go_ahead {
            Err(err) => {
                format!("the cell's init ended during its setup without saying why ({err})")
            }
            Ok(()) => "the cell's init exited during setup".to_owned(),
        };
        let (code, message) = line
            .strip_prefix("err ")
            .and_then(|rest| rest.split_once(' '))
            .unwrap_or(("125", unexplained.as_str()));
        return match code.parse::<i32>() {
            Ok(init::NOT_FOUND) => Ok(RunOutcome {
                name,
                ending: Ending::CommandNotFound(message.to_owned()),
                notices,
                kept_changes: false,
                release: Default::default(),
            }),
            Ok(init::NOT_EXECUTABLE) => Ok(RunOutcome {
                name,
                ending: Ending::CannotExecute(message.to_owned()),
                notices,
                kept_changes: false,
                release: Default::default(),
            }),
            _ => Err(RunError::Setup(message.to_owned())),
        };
    }

    let mut policy_watch = None;
    if let (Some(planned), Some(channel)) = (gateway_rules, &gateway_channel) {
        let sockets = match gateway_ahead.take() {
            Some(sockets) => sockets,
            None => {
                let (flag, sockets) = sys::receive_fds(channel.as_fd())
                    .map_err(os("receiving the gateway sockets"))?;
                crate::gateway::Sockets::from_ordered(sockets, flag == b't').ok_or_else(|| {
                    RunError::Setup("the cell did not hand over the gateway's sockets".to_owned())
                })?
            }
        };
        if !sockets.redirected {
            notices.push(crate::gateway::NOT_REDIRECTED.to_owned());
        }
        let places = crate::gateway::Places {
            log: store
                .net_log(&name)
                .map_err(os("creating the egress log"))?,
            folder: reservation.dir().to_path_buf(),
        };
        policy_watch = Some(crate::gateway::start(
            &name, policy, planned, sockets, places,
        )?);
    }
    let disk_watch = match (watched_disk, &plan.workspace) {
        (Some(limit), Some(ws)) => match &ws.overlay {
            Some(overlay) => {
                // Rootless, the watch looks from inside the cell's user namespace.
                Some(
                    super::disk::Watch::start(overlay.upper.clone(), limit, disk_userns)
                        .map_err(os("starting the disk watch"))?,
                )
            }
            None => None,
        },
        _ => None,
    };
    say_ready(request.ready.as_deref());
    if request.ready.is_some() {
        // A daemon's keeper: it now watches its cell for as long as it lives.
        super::sys::let_go_of_startup_soon();
    }
    let signals = SignalFd::with_flags(&forwarded, SfdFlags::SFD_CLOEXEC)
        .map_err(nix_os("creating a signalfd"))?;
    spawn_stdin_pump(stdin_w);
    let relay = Relay {
        policy_watch,
        pid,
        pidfd: &pidfd,
        cgroup: cell_cgroup.as_ref(),
        stdout: Some(stdout_r),
        stderr: Some(stderr_r),
        signals,
        signals_from: request.signals_from,
        forward: None,
        deadline: policy.limits.wall.map(|w| (started + w.0, w.0)),
        output_cap: policy.limits.output.map(|o| o.0),
        // A cell that serves execs outlives an OOM: the kernel kills the process that went
        // over, and the daemon reports that exec's ending; a `warden run` cell ends with it.
        memory_limit: if request.serve_exec {
            None
        } else {
            policy.limits.memory.map(|m| m.0)
        },
        disk: disk_watch,
        status: Some(&mut status_reader),
    };
    let relayed = relay.run();
    if request.ready.is_some() && relayed.is_ok() && reservation.kill_requested() {
        // Killed for a delete, whose answer comes first (`Registry::hold_teardown`); the init
        // has ended (a relay that failed leaves it to the guard below, which nothing holds).
        reservation.wait_for_teardown_hold(TEARDOWN_HOLD_AT_MOST);
    }
    drop(sync); // the cell's lifeline: held until the cell is gone
    match &relayed {
        // The init has told the end (and exits), or was reaped.
        Ok(_) => router.stop_after(&pidfd),
        // It may live on until the guard kills it, after the router's end is waited for.
        Err(_) => router.stop(),
    }
    let _ = old_mask.thread_set_mask();
    let relayed = relayed?;
    if relayed.init_reaped {
        guard.pid = None;
    }
    let ending = match relayed.stop {
        Stop::Limit(ending) => ending,
        Stop::Exited(status) => {
            // Reaped without its word read (it came with the exit): the init exits with 128
            // + the signal that killed the first command, and its line tells which.
            let mut said = String::new();
            if relayed.init_reaped {
                let _ = status_reader.read_line(&mut said);
            }
            let status = init::parse_end(&said).unwrap_or(status);
            let oom = relayed
                .oom
                .as_ref()
                .is_some_and(|watch| watch.oom_kills() > 0);
            match (oom, policy.limits.memory) {
                (true, Some(limit)) => Ending::MemoryLimit { limit: limit.0 },
                _ if reservation.kill_requested() => Ending::Killed,
                _ => status,
            }
        }
    };
    // The cgroups go with the name, on the release's thread where there is one, and the
    // router's end is waited for there after; what is left of the cell (a process that joined
    // it from outside its pid namespace) is killed here, before its layer is looked at.
    let leftovers = match request.release_later {
        true => {
            // The init that told the command's end is reaped on the release's thread (the
            // kernel's teardown of it overlaps the end's record), unless a layer is looked at
            // next: nothing of the cell may run by then.
            if layer.is_some() {
                guard.end_stragglers();
            }
            Some(guard)
        }
        false => {
            drop(guard);
            None
        }
    };
    Ok(finish(
        store,
        &request,
        name,
        EndOfCell {
            guard: leftovers,
            reservation,
            _router: router,
            _owner: owner_held,
        },
        layer,
        ending,
        notices,
    ))
}

/// The longest a killed cell's keeper waits for the hold on its teardown to go (a delete
/// lets go of it once it has answered, within milliseconds).
const TEARDOWN_HOLD_AT_MOST: std::time::Duration = std::time::Duration::from_secs(3);

/// A network namespace made for a cell on a thread of its own (as root), while the run's
/// thread plans the cell; the cell is cloned inside it. The clone made it before: 0.6-0.8 ms of
/// the kernel's (the namespace's devices, its sysctl tables, its loopback) on the run's one
/// thread, while the other core idled. For a cell with a gateway, the thread also binds the
/// gateway's sockets in it, and once the cell is cloned another thread runs the programs that
/// redirect its other traffic to them (`gateway::redirect_in`), which the cell's init ran after
/// its mounts: they now run beside the init's setup, and are waited for before the init's last
/// go-ahead (nothing of the cell runs before). The namespace belongs to the warden's own user
/// namespace rather than to the cell's: nothing in the cell may change it (its init has
/// nothing to set up there), not even while its setup holds capabilities, where the cell's
/// init could change a namespace of its own (its routes, its rules) until it dropped them. One is made for each cell, and used by
/// none other. Its thread is joined before the clone (which is made with no other thread), or
/// when this is dropped. (The namespace is made as the gVisor keeper makes its cell's:
/// `netns::Namespace`.)
#[derive(Debug)]
pub(crate) struct NetworkAhead(Option<crate::netns::Making>);

impl NetworkAhead {
    /// Starts making one for a cell of `policy` where it takes one (and a thread can be had).
    pub(crate) fn for_policy(policy: &Policy) -> Self {
        let early = crate::netns::take_early();
        if !Self::wanted(policy) {
            return Self(None);
        }
        let gateway = policy.network.has_gateway();
        if let Some(mut making) = early {
            making.decide(gateway);
            return Self(Some(making));
        }
        let making = crate::netns::Namespace::start_unredirected(gateway).ok();
        if making.is_some() {
            sys::keep_only_other_thread_off_this_cpu();
        }
        Self(making)
    }

    /// Whether a cell of `policy` takes one: as root, in the process tier.
    fn wanted(policy: &Policy) -> bool {
        policy.tier == Tier::Process && nix::unistd::geteuid().is_root()
    }

    /// The namespace (with the gateway's sockets, unredirected, where it was made for a
    /// gateway), once its thread is gone: `None` where none was made.
    fn take(&mut self) -> Option<crate::netns::Namespace> {
        self.0.take()?.finish().ok()
    }
}

impl Drop for NetworkAhead {
    fn drop(&mut self) {
        drop(self.take());
    }
}

/// The end of a run, the same on every tier: how the cell ended written where the caller
/// looks for it, before the name is released (whoever sees the lock go finds it already); the
/// layer kept for review or moved out of its place to be removed; the name released; the
/// egress record removed where asked.
/// `reservation`: whatever the name's release is (its drop), with what goes before and after
/// it (a process cell's cgroups, a tuple's first part, and its router's end, the last): on a
/// thread of its own where the caller releases later (see `Release`), while it journals the
/// end.
pub(crate) fn finish(
    store: &Store,
    request: &RunRequest,
    name: String,
    reservation: impl Send + 'static,
    layer: Option<LayerGuard>,
    ending: Ending,
    notices: Vec<String>,
) -> RunOutcome {
    if let Some(path) = &request.report {
        let tmp = path.with_extension("tmp");
        if fs::write(&tmp, ending.report().to_string()).is_ok() {
            let _ = fs::rename(&tmp, path);
        }
    }
    // The layer is kept or moved out of its place before the name is released: whoever sees
    // the name free may make a cell of it at once, and its layer at the same path, which a
    // removal decided after (by the path: the new layer's empty upper looked unchanged) took
    // away from under the new cell's setup. Only the move comes first; the removal after.
    let (kept_changes, moved) = match layer {
        Some(layer) => layer.finish(request.discard_changes),
        None => (false, None),
    };
    let release = match request.release_later {
        true => super::outcome::Release::dropping(reservation),
        false => {
            drop(reservation);
            super::outcome::Release::default()
        }
    };
    // Its removal, in the background, once the name's release is under way.
    drop(moved);
    if request.discard_changes {
        let _ = fs::remove_file(store.net_log_path(&name));
    }
    RunOutcome {
        name,
        ending,
        notices,
        kept_changes,
        release,
    }
}

/// What a cell is made of, decided by the warden before anything of it exists: the same for
/// every tier that builds the cell's root from a plan.
pub(crate) struct Prepared {
    pub(crate) name: String,
    /// The cell's name in the registry, held until the cell is gone.
    pub(crate) reservation: super::registry::Reservation,
    /// Its copy-on-write workspace layer.
    pub(crate) layer: Option<LayerGuard>,
    pub(crate) plan: CellPlan,
    pub(crate) gateway: Option<crate::gateway::GatewayPlan>,
    pub(crate) notices: Vec<String>,
    /// The disk limit, when the warden's watch keeps it (the layer has no file system of its
    /// own).
    pub(crate) watched_disk: Option<u64>,
}

/// Checks a request, reserves the cell's name and makes its workspace layer and plan. `ids`:
/// the cell's ids; `layer_owner`: whose the layer's upper directory is made (root mode), so
/// that the merged workspace root is the cell user's.
pub(crate) fn prepare(
    registry: &Registry,
    store: &Store,
    request: &RunRequest,
    ids: &IdMapping,
    layer_owner: Option<&IdMapping>,
) -> Result<Prepared, RunError> {
    let policy = &request.policy;
    let name = request.name.clone().unwrap_or_else(generate_name);
    plan::check_name(&name)?;
    if !request.checked {
        plan::check_paths(policy, store.root(), registry.root())?;
    }
    let own = [
        ("state directory", store.root()),
        ("runtime directory", registry.root()),
    ];
    let workspace = match &request.workspace {
        Some(dir) => {
            let host = fs::canonicalize(dir)
                .ok()
                .filter(|p| p.is_dir())
                .ok_or_else(|| PlanError::Workspace { path: dir.clone() })?;
            plan::check_not_wardens("workspace", &host, &own)?;
            let protect = plan::protected(policy, &host);
            Some(WorkspacePlan {
                host,
                mount: policy.filesystem.workspace.mount.clone(),
                protect,
                overlay: None,
            })
        }
        None => None,
    };
    let (workspace, base) = match &request.from {
        Some(snapshot) => {
            if request
                .workspace
                .as_ref()
                .and_then(|w| fs::canonicalize(w).ok())
                .is_some_and(|w| w != snapshot.lower)
            {
                return Err(PlanError::ForkWorkspace {
                    snapshot: snapshot.id.clone(),
                    lower: snapshot.lower.clone(),
                }
                .into());
            }
            let host = snapshot.lower.clone();
            if !host.is_dir() {
                return Err(PlanError::Workspace { path: host }.into());
            }
            let ws = WorkspacePlan {
                protect: plan::protected(policy, &host),
                host,
                mount: policy.filesystem.workspace.mount.clone(),
                overlay: None,
            };
            (Some(ws), snapshot.stack())
        }
        None => (workspace, Vec::new()),
    };
    let overlay = (workspace.is_some()
        && policy.filesystem.workspace.mode == WorkspaceMode::Overlay)
        || !base.is_empty();

    // A cell that takes execs has its starts lock made with its folder (see `Registry`).
    let reservation = registry.reserve_with(&name, request.serve_exec)?;
    let mut notices = Vec::new();
    let mut workspace = workspace;
    let layer = match (&mut workspace, overlay) {
        (Some(ws), true) => {
            let layer = LayerGuard::create(
                store,
                &name,
                &ws.host,
                &base,
                policy,
                layer_owner,
                &mut notices,
            )?;
            let upper = layer.layer.upper();
            ws.overlay = Some(OverlayPlan {
                layer_dir: upper
                    .parent()
                    .unwrap_or_else(|| layer.layer.dir())
                    .to_path_buf(),
                upper,
                work: layer.layer.work(),
                base: layer.base.clone(),
                snapshots_dir: store.root().join("snapshots"),
            });
            ws.protect.clear(); // reviewed at apply time instead
            Some(layer)
        }
        _ => None,
    };
    // A disk limit the kernel cannot keep whole (rootless, or no loop devices): RLIMIT_FSIZE
    // for each file, and the warden's watch for the layer (see `disk`).
    let watched_disk = layer.as_ref().and_then(|l| l.watched);

    // An image as the root: its layers from the store, its environment first (the policy's
    // own variables win; the built-in PATH, HOME and LANG fill what neither sets).
    let mut env: Vec<(OsString, OsString)> = Vec::new();
    let image_lowers = match &policy.image {
        Some(image) => {
            let (image, lowers) = warden_image::Store::new(store.root()).lower_dirs(image)?;
            for pair in &image.env {
                if let Some((key, value)) = pair.split_once('=') {
                    env.retain(|(k, _)| k != key);
                    env.push((key.into(), value.into()));
                }
            }
            for (key, value) in warden_policy::EnvPolicy::default().set {
                if !env.iter().any(|(k, _)| k.as_os_str() == key.as_str())
                    && !policy.process.env.set.contains_key(&key)
                {
                    env.push((key.into(), value.into()));
                }
            }
            lowers
        }
        None => Vec::new(),
    };
    for (key, value) in &policy.process.env.set {
        env.retain(|(k, _)| k.as_os_str() != key.as_str());
        env.push((key.into(), value.into()));
    }
    for key in &policy.process.env.pass {
        if let Some(value) = std::env::var_os(key) {
            env.retain(|(k, _)| k != key.as_str());
            env.push((key.into(), value));
        }
    }
    // The egress gateway, when the policy lets anything out (see `gateway`).
    let mut extra_etc: Vec<(String, String)> = Vec::new();
    let gateway = crate::gateway::plan(policy, &name, &mut env, &mut extra_etc)?;
    for (key, value) in &request.env {
        env.retain(|(k, _)| k != key.as_str());
        env.push((key.into(), value.into()));
    }
    let plan = CellPlan {
        sources: Vec::new(),
        hostname: policy
            .process
            .hostname
            .clone()
            .unwrap_or_else(|| name.replace('_', "-")),
        root: registry.mount_point(),
        image: image_lowers,
        entries: plan::entries(policy),
        hidden: policy.filesystem.hidden.clone(),
        // In memory, so no larger than the memory limit (their pages count towards it).
        tmp_size: policy
            .limits
            .memory
            .map_or(policy.filesystem.tmp_size.0, |m| {
                m.0.min(policy.filesystem.tmp_size.0)
            }),
        shm_size: policy.limits.memory.map_or(SHM_SIZE, |m| m.0.min(SHM_SIZE)),
        workspace,
        workspace_mount: policy.filesystem.workspace.mount.clone(),
        ids: ids.clone(),
        argv: request.argv.clone(),
        env,
        cwd: plan::identity(policy, store.root())?.cwd,
        rlimit_nproc: policy.limits.pids,
        rlimit_as: policy.limits.memory.map(|m| m.0),
        rlimit_nofile: policy.limits.open_files,
        rlimit_fsize: watched_disk,
        extra_etc,
    };
    if let Some(image) = &policy.image
        && let Some((path, target)) = plan.image_link()
    {
        return Err(PlanError::ImageLink {
            image: image.clone(),
            path,
            target,
        }
        .into());
    }
    Ok(Prepared {
        name,
        reservation,
        layer,
        plan,
        gateway,
        notices,
        watched_disk,
    })
}

/// A cell's copy-on-write layer while the cell runs: removed on every way out of `run` unless
/// the cell ran and changed something worth reviewing.
pub(crate) struct LayerGuard {
    layer: Layer,
    store: Store,
    armed: bool,
    /// The disk limit, when the warden's watch keeps it (the layer has no file system of its
    /// own).
    watched: Option<u64>,
    /// The layers it stacks, where they are now (as its record says).
    base: Vec<PathBuf>,
}

impl LayerGuard {
    fn create(
        store: &Store,
        name: &str,
        host: &Path,
        base: &[PathBuf],
        policy: &Policy,
        privileged: Option<&IdMapping>,
        notices: &mut Vec<String>,
    ) -> Result<Self, RunError> {
        for text in [host.as_os_str(), store.root().as_os_str()] {
            if text.as_bytes().iter().any(|b| *b == b',' || *b == b':') {
                return Err(PlanError::OverlayPath(PathBuf::from(text)).into());
            }
        }
        let layer = store.layer(name);
        if layer.exists() {
            return Err(PlanError::LayerKept(name.to_owned()).into());
        }
        store.prepare()?;
        let meta = LayerMeta {
            lower: host.to_path_buf(),
            started: SystemTime::now(),
            protected: policy.filesystem.workspace.protect.clone(),
            base: base.to_vec(),
            start: None,
            mount: policy.filesystem.workspace.mount.clone(),
        };
        let mut guard = Self {
            layer,
            store: store.clone(),
            armed: true,
            watched: None,
            base: Vec::new(),
        };
        if let Some(disk) = policy.limits.disk {
            let why_not = match privileged {
                None => Some(None),
                Some(_) => super::disk::unavailable().map(Some),
            };
            match why_not {
                None => {
                    fs::create_dir_all(guard.layer.dir())
                        .map_err(os("creating the workspace layer"))?;
                    super::disk::create(
                        &guard.layer,
                        &store.root().join("disk-templates"),
                        disk.0,
                    )?;
                }
                Some(reason) => {
                    if let Some(reason) = reason {
                        notices.push(format!(
                            "{reason}: the disk limit ({disk}) is kept per file by the kernel and for the whole workspace by the warden's watch"
                        ));
                    }
                    guard.watched = Some(disk.0);
                }
            }
        }
        // Where its layers are now, should a removal have moved one since they were read.
        guard.base = super::snapshot::create_layer(store, &guard.layer, &meta)
            .map_err(|e| RunError::Setup(format!("creating the workspace layer: {e}")))?;
        // The merged workspace root takes its owner and mode from the upper directory: make
        // them those of the host directory as the cell sees it.
        let host_meta = fs::metadata(host).map_err(os("reading the workspace"))?;
        fs::set_permissions(
            guard.layer.upper(),
            fs::Permissions::from_mode(host_meta.mode() & 0o777),
        )
        .map_err(os("preparing the workspace layer"))?;
        if let Some(ids) = privileged {
            // In root mode the overlay is mounted by the cell's root, an unprivileged host id.
            let chown = |dir: PathBuf, uid, gid| {
                std::os::unix::fs::chown(dir, Some(uid), Some(gid))
                    .map_err(os("handing the workspace layer to the cell"))
            };
            chown(
                guard.layer.upper(),
                ids.host_uid_of_cell_user(),
                ids.host_gid_of_cell_group(),
            )?;
            chown(
                guard.layer.work(),
                super::ids::ROOT_MODE_BASE,
                super::ids::ROOT_MODE_BASE,
            )?;
        }
        Ok(guard)
    }

    /// Keeps the layer when the cell changed something (and changes are not discarded), or
    /// moves it out of its place; whether it was kept, and what was moved out (removed in the
    /// background once dropped: after the caller has released the cell's name).
    pub(crate) fn finish(mut self, discard: bool) -> (bool, Option<Moved>) {
        self.armed = !self.keeps(discard);
        let kept = !self.armed;
        (kept, self.move_out())
    }

    /// Whether `finish` would keep the layer: it changed, and is not to be discarded.
    pub(crate) fn keeps(&self, discard: bool) -> bool {
        // What it changed is in its upper layer, and in the layers its snapshots turned over
        // (when its stack is no longer the one it started on).
        let turned = self
            .layer
            .meta()
            .is_ok_and(|meta| meta.start.as_ref().is_some_and(|start| *start != meta.base));
        let changed = turned
            || fs::read_dir(self.layer.upper()).is_ok_and(|mut entries| entries.next().is_some());
        !discard && changed
    }
}

impl LayerGuard {
    /// Moves an armed layer out of its place (`.gone-NAME-TIME`, its file system detached),
    /// so that its name may go to a new cell's layer at once; what is moved out is removed
    /// when the returned `Moved` is dropped, in the background. `None` for a layer that is
    /// kept, or was removed here (its move failed).
    fn move_out(&mut self) -> Option<Moved> {
        if !std::mem::take(&mut self.armed) {
            return None;
        }
        // A layer that was made over (a snapshot turned it over, a reset mounted it again) may
        // keep snapshots in its file system of its own, and stack kept layers: those are moved
        // out first, and let go of after. Any other (the usual `run --rm`) has neither, and
        // nothing of the store is read for it.
        let made_over = self.layer.meta().is_ok_and(|meta| meta.start.is_some());
        let name = self
            .layer
            .dir()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if made_over && super::snapshot::release(&self.store, &self.layer, &name).is_err() {
            // Their layers stay where they are, and the cell's layer with them.
            return None;
        }
        // Out of the way at once (the name is free for the next cell), removed in the
        // background: freeing a layer's file system image takes the host a few milliseconds.
        // No look at the layer mounts its file system again between the unmount and the move.
        let attaching = super::disk::hold_off_attach(&self.layer);
        // A hold on its file system, taken before it is detached, for the remover.
        let mount = self.layer.is_attached().then(|| {
            rustix::fs::open(
                self.layer.fs_dir(),
                rustix::fs::OFlags::PATH
                    | rustix::fs::OFlags::DIRECTORY
                    | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .ok()
        });
        let _ = self.layer.detach();
        let dir = self.layer.dir();
        let gone = super::background::gone_path(dir);
        let renamed = fs::rename(dir, &gone);
        drop(attaching);
        let moved = match renamed {
            Ok(()) => Some(Moved {
                gone: Some(gone),
                mount: mount.flatten(),
            }),
            Err(_) => {
                let _ = self.layer.remove();
                None
            }
        };
        if made_over {
            super::snapshot::released(&self.store);
        }
        moved
    }
}

impl Drop for LayerGuard {
    fn drop(&mut self) {
        drop(self.move_out());
    }
}

/// A layer moved out of its place, removed in the background when dropped.
pub(crate) struct Moved {
    gone: Option<PathBuf>,
    mount: Option<std::os::fd::OwnedFd>,
}

impl Drop for Moved {
    fn drop(&mut self) {
        if let Some(gone) = self.gone.take() {
            super::snapshot::remove_in_background_holding(gone, self.mount.take());
        }
    }
}

/// What is let go of at a cell's end, in this order: its folder but the lock (while the
/// kernel tears the init down), the init and the cgroups (the guard waits for the first, then
/// removes the second), the name (the folder, with its lock), the router (its end waited for).
struct EndOfCell {
    guard: Option<CellGuard>,
    reservation: super::registry::Reservation,
    _router: super::exec::Router,
    /// The owner of the cell's user namespace: free for another cell once this one is gone.
    _owner: Option<super::ids::Owner>,
}

impl Drop for EndOfCell {
    fn drop(&mut self) {
        self.reservation.clear_all_but_the_lock();
        drop(self.guard.take());
    }
}

/// Kills whatever is left of the cell and removes its cgroups, on every way out of `run`.
pub(crate) struct CellGuard {
    pub(crate) cgroup: Option<CellCgroup>,
    pub(crate) pid: Option<Pid>,
}

impl CellGuard {
    /// Kills the cell's init, if it is not reaped yet, and every process its cgroup lists.
    pub(crate) fn end_stragglers(&mut self) {
        if let Some(pid) = self.pid.take() {
            let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            let _ = waitpid(pid, None);
        }
        if let Some(cg) = &self.cgroup
            && !cg.pids().is_empty()
        {
            let _ = cg.kill_all();
        }
    }
}

impl Drop for CellGuard {
    fn drop(&mut self) {
        self.end_stragglers();
        if let Some(cg) = &self.cgroup {
            cg.remove();
        }
    }
}

fn write_id_maps(pid: Pid, ids: &IdMapping) -> io::Result<()> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    if !ids.privileged {
        fs::write(proc.join("setgroups"), "deny")?;
    }
    fs::write(proc.join("uid_map"), ids.uid_map())?;
    fs::write(proc.join("gid_map"), ids.gid_map())
}

pub(crate) fn generate_name() -> String {
    let mut bytes = [0u8; 3];
    let _ = fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    format!("cell-{:02x}{:02x}{:02x}", bytes[0], bytes[1], bytes[2])
}
