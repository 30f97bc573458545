//! The keeper of a gVisor cell (`warden keep` for a policy with `tier: gvisor`): what the
//! process tier's keeper and init do for their cell, done around a sandbox.
//!
//! In order: a mount namespace of its own; the host side of the cell's processes, forked while
//! the keeper is still single-threaded; the cell's cgroup, with its limits; then `runsc run` in
//! the foreground (attached: the sandbox goes when runsc does, and runsc goes when the keeper
//! does), born in the cell's cgroup, its spec held back ([`SpecGate`]) while the keeper
//! assembles the cell's root in its mount namespace from the same plan as a process-tier
//! cell's (the policy's host paths or an image's layers, the copy-on-write workspace, Warden's
//! `/etc` files), makes the network namespace with the gateway's sockets, writes the bundle's
//! spec and waits for the start to be journaled. Once the cell's init says it is up, the cell
//! is published in the registry and served like any other: the daemon finds the keeper's
//! `exec.sock`, freezes and kills the cell through its cgroup, diffs and resets its workspace
//! layer.

use std::fs;
use std::io::Read as _;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;
use oci_spec::OciSpecError;

use super::compat::{Compat, INIT_IN_CELL, STATX_IN_CELL};
use super::runsc::Runsc;
use crate::process::cgroup::{self, CellCgroup};
use crate::process::exec::{EXEC_SOCKET, Namespaces};
use crate::process::ids::IdMapping;
use crate::process::outcome::{Ending, RunError, RunOutcome, nix_os, os};
use crate::process::registry::{CellRecord, Registry};
use crate::process::relay::{Relay, Stop};
use crate::process::run::{CellGuard, Prepared, RunRequest};
use crate::process::store::Store;
use crate::process::sys::process_start_ticks;
use crate::process::{idmap, rootfs, sys};

/// How long a sandbox may take to come up.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// The host tasks a sandbox is made of before its cell runs anything but its first process:
/// runsc, its gofer and its sentry's Go threads, and the first ptrace stubs (57 measured here for
/// a shell alone on the ptrace platform).
const SANDBOX_TASKS: u64 = 64;
/// The host tasks each of the cell's own processes or threads adds on the ptrace platform: a
/// stub process of its address space with its threads, and the sentry's threads that run it
/// (measured: 57, 136, 292 and 534 host tasks for a shell with 0, 10, 30 and 60 `sleep`s, 8 each).
const HOST_TASKS_PER_CELL_TASK: u64 = 8;

/// The host cgroup's bound for a cell whose policy allows it `pids` processes and threads. The
/// host's pids controller counts runsc's own tasks, not the cell's: given `pids` itself, the
/// sentry reached it at about 50 of the cell's processes and died (`failed to create new OS
/// thread`). This runsc bounds nothing inside (its cgroupfs has no pids controller, and an
/// `RLIMIT_NPROC` in the spec is checked against the host user's count of tasks), so the cell is
/// held to about `pids` of its own by a bound sized from what each costs on the host, and a fork
/// bomb is still bounded.
fn host_tasks(pids: u64) -> u64 {
    pids.saturating_mul(HOST_TASKS_PER_CELL_TASK)
        .saturating_add(SANDBOX_TASKS)
}

/// Why a gVisor cell could not be kept.
#[derive(Debug, thiserror::Error)]
pub enum GvisorError {
    #[error(
        "the gvisor tier needs runsc, which is not installed: install it (`apt-get install runsc` on Debian) or set WARDEN_RUNSC to its path; `warden doctor` lists the tiers this host can run"
    )]
    NoRunsc,
    #[error(
        "the gvisor tier needs root on this host (runsc makes its sandbox as root); run the daemon or `warden run` as root, or use `tier: process`, which runs rootless"
    )]
    NotRoot,
    #[error("the gvisor tier: {0}")]
    Sandbox(String),
    /// A disk limit where the layer cannot have a disk of its own.
    #[error(
        "the gvisor tier keeps a disk limit ({limit}) only with a disk of the workspace's own, which this host cannot give it ({why}): install what is missing, or run without the limit (`--disk none`, `limits.disk: null`), or on the process tier, which keeps it per file and by a watch"
    )]
    DiskLimit {
        limit: warden_policy::ByteSize,
        why: String,
    },
    /// `warden run` said the command was not to start (it could not journal its start, and
    /// says why itself).
    #[error("the cell's start was called off")]
    CalledOff,
    #[error(transparent)]
    Run(#[from] RunError),
}

fn sandbox(what: &str) -> impl FnOnce(std::io::Error) -> GvisorError + '_ {
    move |e| GvisorError::Sandbox(format!("{what}: {e}"))
}

/// Keeps a gVisor cell until it ends; with `restore`, the cell comes back from that memory
/// image instead of starting afresh. The caller must be single-threaded (the keeper's mount
/// namespace and the host side's fork need it).
pub fn keep(
    registry: &Registry,
    store: &Store,
    request: RunRequest,
    restore: Option<&Path>,
) -> Result<RunOutcome, GvisorError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(GvisorError::NotRoot);
    }
    let mut runsc = Runsc::find(store.root()).ok_or(GvisorError::NoRunsc)?;
    // The signals that would end the keeper are read from a signalfd (the relay's), for every
    // thread started from here on.
    let forwarded = match request.signals_from {
        // The caller's signals come as the forwarding signal (`sys::forward_signal`).
        Some(_) => sys::with_forwarding(&crate::process::run::forwarded_signals()),
        None => crate::process::run::forwarded_signals(),
    };
    forwarded
        .thread_block()
        .map_err(nix_os("blocking signals"))?;
    // runsc's sandbox and gofer outlive `runsc run` for a moment when it is killed: the keeper
    // reaps them, so that they are gone (not zombies) when runsc cleans up after them.
    sys::set_child_subreaper().map_err(os("becoming the cell's reaper"))?;
    let policy = request.policy.clone();
    // No user namespace: the sandbox's user is the host id of the same number (gVisor is the
    // boundary); the workspace is id-mapped to it, and its layer made its.
    let identity = crate::process::plan::identity(&policy, store.root()).map_err(RunError::from)?;
    let ids = IdMapping {
        privileged: false,
        inside_uid: identity.uid,
        inside_gid: identity.gid,
        host_uid: identity.uid,
        host_gid: identity.gid,
    };
    let Prepared {
        name,
        reservation,
        layer,
        mut plan,
        gateway,
        mut notices,
        watched_disk,
    } = crate::process::run::prepare(registry, store, &request, &ids, Some(&ids))?;
    // The process tier keeps such a limit with an rlimit of its processes and a watch of the
    // layer; the sandbox's files are written by runsc's gofer, which has neither: the limit
    // would not hold (a cell wrote 100 MiB against 32).
    if let Some(limit) = watched_disk {
        let why = crate::process::disk::unavailable()
            .unwrap_or_else(|| "no loop device or file system for it".to_owned());
        return Err(GvisorError::DiskLimit {
            limit: warden_policy::ByteSize(limit),
            why,
        });
    }
    // A cell that lets nothing out has gVisor's own network stack with loopback only; one
    // with a gateway uses the sockets of the namespace the keeper makes below.
    if gateway.is_some() {
        runsc.network = super::runsc::Network::Host;
    }
    let serves = request.serve_exec;
    // The keeper's own mount namespace: the cell's root is assembled here, and runsc (its
    // child) serves it from here. Nothing of it is seen by the host. (Made after the layer:
    // a layer's own file system is mounted where every warden process sees it, as the
    // process tier's keeper does.)
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| GvisorError::Sandbox(format!("making the keeper's mount namespace: {e}")))?;
    // Debian 12's runsc refuses a statx flag that GNU tools always pass: the shim asks again
    // without it (see `gvisor-compat/statx.rs`).
    plan.extra_etc.push((
        "ld.so.preload".to_owned(),
        super::compat::PRELOAD.to_owned(),
    ));
    // `prepare` looked for an image's links where every tier's setup works; the keeper also
    // binds its own files in (see `CellPlan::image_link`).
    if let Some(image) = &policy.image
        && let Some((path, target)) = plan.image_link_at(&[INIT_IN_CELL, STATX_IN_CELL])
    {
        return Err(RunError::from(crate::process::plan::PlanError::ImageLink {
            image: image.clone(),
            path,
            target,
        })
        .into());
    }
    let first: Vec<String> = request
        .argv
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();

    // The host side of the cell's processes, forked now, while this process has one thread
    // (a cell that serves execs only).
    let mut host_guard = HostGuard(None);
    let mut channel = None;
    // The init's stdin, in a cell that serves execs: the host side's socket to it.
    let mut init_socket = None;
    if serves {
        let (ours, served) = sys::seqpacket_pair().map_err(os("creating the exec channel"))?;
        let (to_init, init_end) =
            sys::seqpacket_pair().map_err(os("creating the init's socket"))?;
        let (lifeline_r, lifeline_w) = sys::pipe().map_err(os("creating pipes"))?;
        let host = super::host::Cell {
            runsc: runsc.clone(),
            id: name.clone(),
            plan: plan.clone(),
            execs_marker: reservation.file(super::checkpoint::EXECS_MARKER),
        };
        let host_pid = match sys::clone_process(0).map_err(os("starting the cell's host side"))? {
            0 => {
                drop((ours, lifeline_w, init_end));
                // A restored init has said hello before it was saved: it is asked instead.
                super::host::serve(&host, served, lifeline_r, to_init, restore.is_some())
            }
            pid => pid,
        };
        drop((served, lifeline_r, to_init));
        init_socket = Some(init_end);
        // The host side watches the lifeline for the keeper's end; it is held here.
        std::mem::forget(lifeline_w);
        host_guard = HostGuard(Some(Pid::from_raw(host_pid)));
        channel = Some(ours);
    }

    let limits = cgroup::Limits {
        memory_bytes: policy.limits.memory.map(|m| m.0),
        pids: policy.limits.pids.map(host_tasks),
        cpus: policy.limits.cpus,
    };
    let cell_cgroup = CellCgroup::create(&cgroup::discover(), &registry.instance(), &name, &limits)
        .map_err(RunError::from)?;
    let mut guard = CellGuard {
        cgroup: Some(cell_cgroup.clone()),
        pid: None,
    };

    let bundle = reservation.file("bundle");
    fs::create_dir_all(&bundle).map_err(os("creating the cell's bundle"))?;
    // What an earlier keeper of this name may have left in runsc's state (it was killed).
    if runsc.has_state(&name) {
        let _ = quiet(runsc.command("delete").args(["--force", &name])).status();
    }
    let spec_path = bundle.join("config.json");
    let gate = SpecGate::take(&spec_path);

    let (stdin_r, stdin_w) = sys::pipe().map_err(os("creating pipes"))?;
    let init_stdin = match init_socket {
        Some(socket) => {
            drop(stdin_r);
            socket
        }
        None => stdin_r,
    };
    let (stdout_r, stdout_w) = sys::pipe().map_err(os("creating pipes"))?;
    let (stderr_r, stderr_w) = sys::pipe().map_err(os("creating pipes"))?;
    let mut command = match restore {
        Some(image) => {
            let mut command = runsc.command("restore");
            command.arg("--image-path").arg(image);
            command
        }
        None => runsc.command("run"),
    };
    command.arg("--bundle").arg(&bundle).arg(&name);
    // runsc joins the cell's cgroups before it runs, so that its sandbox and gofer are the
    // cell's from their first instruction.
    let joins = cell_cgroup
        .join_files()
        .iter()
        .map(|path| {
            fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map(OwnedFd::from)
                .map_err(|e| {
                    GvisorError::Sandbox(format!("opening {} for runsc: {e}", path.display()))
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let described = sys::Described::of(&command);
    // runsc, and every process it starts (its gofer writes the cell's files onto the host's),
    // may never set a set-id bit: the filter is this thread's from here on, and each process
    // spawned from it has it (see `setid`).
    let setid = super::setid::filter()
        .map_err(|e| GvisorError::Sandbox(format!("building the set-id filter: {e}")))?;
    super::setid::confine_calling_thread(&setid)
        .map_err(sandbox("refusing set-id bits to the sandbox"))?;
    let start_runsc = || {
        let joins: Vec<_> = joins.iter().map(|fd| fd.as_fd()).collect();
        start(
            &runsc,
            &described,
            &joins,
            [init_stdin.as_fd(), stdout_w.as_fd(), stderr_w.as_fd()],
        )
    };
    // runsc's own start (a Go program's, and a `membarrier` registration that waits for an
    // RCU grace period) takes 10-15 ms here before it reads its spec: where the spec can be
    // held back (`SpecGate`), runsc starts now, and the cell's root, network and journaled
    // start are made meanwhile.
    if gate.is_some() {
        guard.pid = Some(start_runsc()?);
    }
    // What runsc does not need before it reads its spec is made once it runs. A cell that runs
    // one command forks no host side: its network namespace is made on a thread of its own
    // meanwhile, while the root is assembled. A cell that serves execs makes it below, after
    // the host side's fork, with one thread.
    let early_network = match serves {
        true => None,
        false => Some(
            crate::netns::Namespace::start(gateway.is_some())
                .map_err(sandbox("making the cell's network namespace"))?,
        ),
    };
    let compat = Compat::install(&store.root().join("gvisor").join("compat"))
        .map_err(sandbox("installing the cell's init"))?;

    let tree = plan
        .workspace
        .as_ref()
        .map(|ws| idmap::workspace_tree(&ws.host, &ids))
        .transpose()?;
    let files = [
        (PathBuf::from(INIT_IN_CELL), compat.init.clone()),
        (
            PathBuf::from(STATX_IN_CELL),
            compat.statx_for(plan.image.is_empty()).to_path_buf(),
        ),
    ];
    // Let go of before the cell's folder is removed, whichever way this ends.
    let root_mount = RootMount(plan.root.clone());
    rootfs::assemble(
        &plan,
        tree.as_ref(),
        Some(rootfs::Sandbox { files: &files }),
    )
    .map_err(|e| RunError::Setup(e.to_string()))?;
    drop(tree);

    // A cell that runs one command (`warden run`): a program that cannot start is said so
    // before the command's sandbox starts, as the process tier says it (runsc, if started, is
    // still waiting for its spec: the guards end it).
    if !serves {
        let program = first.first().map(String::as_str).unwrap_or_default();
        match super::host::resolve(&plan.root, program, &plan.env, &plan.cwd) {
            Ok(()) => {}
            Err((code, message)) => {
                let ending = match code {
                    crate::process::init::NOT_FOUND => Ending::CommandNotFound(message),
                    _ => Ending::CannotExecute(message),
                };
                crate::process::run::tell_ending(&request, layer.as_ref(), &ending);
                drop((gate, guard, root_mount));
                return Ok(crate::process::run::finish(
                    store,
                    &request,
                    name,
                    reservation,
                    layer,
                    ending,
                    notices,
                ));
            }
        }
    }

    let network = match early_network {
        Some(making) => making.finish(),
        None => crate::netns::Namespace::make(gateway.is_some()),
    }
    .map_err(sandbox("making the cell's network namespace"))?;
    let netns = PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        network.fd.as_raw_fd()
    ));
    // The sandbox's first process: Warden's init, alone (it then takes execs) or running the
    // one command.
    let init_args: Vec<String> = match serves {
        true => vec![INIT_IN_CELL.to_owned()],
        false => [INIT_IN_CELL.to_owned(), "run".to_owned()]
            .into_iter()
            .chain(first.iter().cloned())
            .collect(),
    };
    let spec = super::bundle::spec(&plan, &netns, init_args)
        .and_then(|spec| serde_json::to_vec(&spec).map_err(OciSpecError::from))
        .map_err(|e| GvisorError::Sandbox(format!("writing the cell's bundle: {e}")))?;
    let written = match &gate {
        Some(gate) => gate.write(&spec),
        None => write_spec(&spec_path, &spec),
    };
    written.map_err(|e| GvisorError::Sandbox(format!("writing the cell's bundle: {e}")))?;
    // Forked by `warden run`, which journals the start meanwhile: the command starts once it
    // is in the journal (what was made so far is taken down by the guards).
    if let Some(lines) = &request.lines
        && !lines.wait_for_go()
    {
        // runsc, started ahead and held back by its spec, may have made its state's lock
        // already: it is ended (and its sandbox reaped), and what it made removed, before the
        // keeper ends (a later keeper of the name would remove it, but none may come).
        drop(guard);
        remove_runsc_leftovers(&runsc, &name);
        return Err(GvisorError::CalledOff);
    }
    match gate {
        Some(gate) => gate
            .open()
            .map_err(|e| GvisorError::Sandbox(format!("handing runsc its spec: {e}")))?,
        None => guard.pid = Some(start_runsc()?),
    }
    drop((command, joins, init_stdin, stdout_w, stderr_w));
    let Some(pid) = guard.pid else {
        return Err(GvisorError::Sandbox("runsc was not started".to_owned()));
    };
    let started = Instant::now();
    let pidfd = sys::pidfd_open(pid.as_raw()).map_err(os("opening a pidfd for runsc"))?;
    let ready = match restore {
        // A restored init said `ready` before it was saved: runsc says when it runs again.
        Some(_) => wait_restored(&runsc, &name, pid, &stderr_r),
        None => wait_ready(&stdout_r, &stderr_r),
    };
    if let Err(message) = ready {
        return Err(GvisorError::Sandbox(format!(
            "runsc could not start the sandbox: {message}"
        )));
    }
    reservation
        .publish(&CellRecord {
            name: name.clone(),
            pid: pid.as_raw(),
            pid_start: process_start_ticks(pid.as_raw()).unwrap_or(0),
            warden_pid: std::process::id() as i32,
            started_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            argv: Vec::new(),
            workspace: plan.workspace.as_ref().map(|w| w.host.clone()),
            cgroup: Some(cell_cgroup.clone()),
            gateway: gateway.is_some(),
            image: policy.image.clone(),
        })
        .map_err(RunError::from)?;

    let mut policy_watch = None;
    if let (Some(planned), Some(sockets)) = (gateway, network.sockets) {
        if !sockets.redirected {
            notices.push(crate::gateway::NOT_REDIRECTED.to_owned());
        }
        let places = crate::gateway::Places {
            log: store
                .net_log(&name)
                .map_err(os("creating the egress log"))?,
            folder: reservation.dir().to_path_buf(),
        };
        policy_watch = Some(
            crate::gateway::start(&name, &policy, planned, sockets, places)
                .map_err(RunError::from)?,
        );
    }
    // Joining the cell from outside (a reset of its workspace): the keeper's namespaces, and
    // the cell's root in them.
    let namespaces = namespaces(&plan.root).map_err(os("holding the cell's namespaces"))?;
    let mut router = crate::process::exec::serve(
        &reservation.file(EXEC_SOCKET),
        channel,
        Some(namespaces),
        false,
    )
    .map_err(os("opening the cell's exec socket"))?;
    crate::process::run::say_ready(request.ready.as_deref());
    if request.ready.is_some() {
        // A daemon's keeper: it now watches its cell for as long as it lives.
        sys::let_go_of_startup_soon();
    }
    // The one command's stdin is this process's (a cell that serves execs has none).
    match serves {
        true => drop(stdin_w),
        false => crate::process::relay::spawn_stdin_pump(stdin_w),
    }
    let signals = SignalFd::with_flags(&forwarded, SfdFlags::SFD_CLOEXEC)
        .map_err(nix_os("creating a signalfd"))?;
    // A cell that runs one command: a signal goes to the sandbox's first process, Warden's
    // init, which passes it on to the command's process group (runsc itself, sent one, would
    // not pass it on: a SIGTERM ended the sandbox under the command, a SIGINT did nothing).
    let through_init = |signal: Signal| {
        let number = (signal as i32).to_string();
        let _ = quiet(runsc.command("kill").args([name.as_str(), number.as_str()])).status();
    };
    let relay = Relay {
        policy_watch,
        pid,
        pidfd: &pidfd,
        cgroup: Some(&cell_cgroup),
        stdout: Some(stdout_r),
        stderr: Some(stderr_r),
        signals,
        signals_from: request.signals_from,
        forward: (!serves).then_some(&through_init as &dyn Fn(Signal)),
        deadline: policy.limits.wall.map(|w| (started + w.0, w.0)),
        output_cap: policy.limits.output.map(|o| o.0),
        // A cell that serves execs outlives an OOM (the kernel kills the process that went
        // over, and the daemon reports that exec's ending); one that runs a command ends.
        memory_limit: match serves {
            true => None,
            false => policy.limits.memory.map(|m| m.0),
        },
        disk: None,
        status: None,
    };
    let relayed = relay.run();
    router.stop();
    let relayed = relayed?;
    if relayed.init_reaped {
        guard.pid = None; // the relay reaped runsc
    }
    let ending = match relayed.stop {
        Stop::Limit(ending) => ending,
        Stop::Exited(status) => {
            let oom = cell_cgroup.oom_kills() > 0;
            match (oom, policy.limits.memory, status) {
                (true, Some(limit), _) => Ending::MemoryLimit { limit: limit.0 },
                _ if reservation.kill_requested() => Ending::Killed,
                // runsc exits with its first process's status, 128 + N for a signal N (the
                // init reports its command's so).
                (_, _, Ending::Exited(code)) if !serves && (129..=128 + 64).contains(&code) => {
                    Ending::Signaled(code - 128)
                }
                (_, _, status) => status,
            }
        }
    };
    // The host's bound on the sandbox's tasks, when reached, may have ended runsc itself (its
    // sentry cannot start a thread, and dies saying so on its own log): said, with the limit.
    if let Some(pids) = policy.limits.pids
        && host_bound_was_reached(&cell_cgroup)
    {
        notices.push(format!(
            "the cell's sandbox reached its host bound of {} tasks (limits.pids: {pids}; runsc's own threads and ptrace stubs count, about {HOST_TASKS_PER_CELL_TASK} for each of the cell's processes): a process could not start, and if runsc ended, that is why",
            host_tasks(pids)
        ));
    }
    // `warden run` journals the end while the cell is taken down.
    crate::process::run::tell_ending(&request, layer.as_ref(), &ending);
    // The root's unmount waits for an RCU grace period: it runs on a thread of its own while
    // the cgroups go and runsc's leftovers are reaped (where no thread can start, the closure
    // is dropped, and the root unmounted, at once).
    std::thread::scope(|scope| {
        let unmounting = std::thread::Builder::new()
            .name("cell-root".to_owned())
            .spawn_scoped(scope, move || drop(root_mount));
        drop(guard);
        host_guard.end();
        remove_runsc_leftovers(&runsc, &name);
        if let Ok(unmounting) = unmounting {
            let _ = unmounting.join();
        }
    });
    let outcome =
        crate::process::run::finish(store, &request, name, reservation, layer, ending, notices);
    // Stopped since the relay ended, the router is long gone by now: this waits for nothing.
    drop(router);
    Ok(outcome)
}

/// Whether the cell's pids cgroup ever refused a task (its `pids.events`, v1 or v2).
fn host_bound_was_reached(cgroup: &CellCgroup) -> bool {
    cgroup
        .join_files()
        .iter()
        .filter_map(|file| fs::read_to_string(file.parent()?.join("pids.events")).ok())
        .any(|events| {
            events
                .lines()
                .filter_map(|line| line.strip_prefix("max "))
                .any(|count| count.trim() != "0")
        })
}

/// The cell's root, assembled on its folder in the keeper's mount namespace, where it is a
/// mount point that the folder's removal could not take (the folder was left behind until the
/// next warden command swept it): unmounted when dropped, before the folder goes, on every way
/// out (a setup that failed half way, a start called off, an end).
struct RootMount(PathBuf);

impl Drop for RootMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A command with no stdio of the caller's (runsc would take them over).
fn quiet(command: &mut std::process::Command) -> &mut std::process::Command {
    command
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
}

/// The keeper's namespaces and the cell's root in its mount namespace.
fn namespaces(root: &std::path::Path) -> std::io::Result<Namespaces> {
    let open = |path: &str| fs::File::open(path).map(OwnedFd::from);
    Ok(Namespaces {
        user: open("/proc/self/ns/user")?,
        mnt: open("/proc/self/ns/mnt")?,
        root: Some(rustix::fs::open(
            root,
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?),
    })
}

/// Waits for the cell's init to say `ready` on its stdout; until then, what runsc says on its
/// stderr is why it did not come up.
fn wait_ready(stdout: &OwnedFd, stderr: &OwnedFd) -> Result<(), String> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let deadline = Instant::now() + START_DEADLINE;
    let mut said = Vec::new();
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "it did not come up within {} s",
                START_DEADLINE.as_secs()
            ));
        }
        let mut fds = [
            PollFd::new(stdout.as_fd(), PollFlags::POLLIN),
            PollFd::new(stderr.as_fd(), PollFlags::POLLIN),
        ];
        let timeout =
            PollTimeout::try_from(left.as_millis().min(10_000) as i32).unwrap_or(PollTimeout::NONE);
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
        let out = fds[0].revents().is_some_and(|r| !r.is_empty());
        let err = fds[1].revents().is_some_and(|r| !r.is_empty());
        if out {
            // One byte at a time: what the command writes right after `ready` is in the same
            // pipe, and is the caller's.
            let mut byte = [0u8; 1];
            let n = nix::unistd::read(stdout, &mut byte).unwrap_or(0);
            if n == 1 {
                if byte[0] != b'\n' {
                    line.push(byte[0]);
                    continue;
                }
                if line == b"ready" {
                    return Ok(());
                }
                line.clear();
            }
            if n == 0 {
                // runsc ended: what it said on stderr is why.
                let mut rest = Vec::new();
                let _ = fs::File::from(stderr.try_clone().map_err(|e| e.to_string())?)
                    .read_to_end(&mut rest);
                said.extend(rest);
                let text = String::from_utf8_lossy(&said);
                let text = text.trim();
                return Err(if text.is_empty() {
                    "runsc ended without saying why".to_owned()
                } else {
                    text.lines().last().unwrap_or(text).to_owned()
                });
            }
        }
        if err {
            let mut buf = [0u8; 4096];
            let n = nix::unistd::read(stderr, &mut buf).unwrap_or(0);
            said.extend_from_slice(&buf[..n]);
        }
    }
}

/// How often a restore's wait asks runsc itself (`runsc state`) whether the container runs,
/// beside the reads of its state file: for a runsc whose state file does not read as this one
/// expects (a restore here takes 120-140 ms, so the usual one is not asked at all).
const ASK_RUNSC_EVERY: Duration = Duration::from_millis(250);

/// Waits until runsc says the restored container runs; until then, what runsc says on its
/// stderr is why it did not come back. Looked for in runsc's state file every 2 ms (see
/// `Runsc::recorded_status`), and asked of runsc only now and then: a `runsc state` every 10
/// ms, each a start of runsc, found the container running 0-30 ms late and took a CPU from
/// the restore meanwhile.
fn wait_restored(
    runsc: &Runsc,
    name: &str,
    runsc_pid: Pid,
    stderr: &OwnedFd,
) -> Result<(), String> {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let deadline = Instant::now() + START_DEADLINE;
    let mut asked = Instant::now();
    while Instant::now() < deadline {
        let ended = match waitpid(runsc_pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => Some(format!("exit status: {code}")),
            Ok(WaitStatus::Signaled(_, signal, _)) => Some(format!("signal: {signal}")),
            _ => None,
        };
        if let Some(status) = ended {
            let mut said = String::new();
            let _ = fs::File::from(stderr.try_clone().map_err(|e| e.to_string())?)
                .read_to_string(&mut said);
            return Err(format!(
                "runsc ended ({status}): {}",
                said.lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("it said nothing")
            ));
        }
        if runsc.recorded_status(name).as_deref() == Some("running") {
            return Ok(());
        }
        if asked.elapsed() >= ASK_RUNSC_EVERY {
            asked = Instant::now();
            let state = quiet(runsc.command("state").arg(name)).output();
            if let Ok(out) = state
                && let Ok(state) = serde_json::from_slice::<serde_json::Value>(&out.stdout)
                && state["status"] == "running"
            {
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Err(format!(
        "it did not come back within {} s",
        START_DEADLINE.as_secs()
    ))
}

/// Reaps the keeper's children as they end (the sandbox's processes, orphaned and killed with
/// the cell) until `awaited` is reaped (with none: until none is left) or `grace` has passed;
/// whether that came before the grace ran out.
fn reap_children(grace: Duration, awaited: Option<Pid>) -> bool {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let deadline = Instant::now() + grace;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok(WaitStatus::StillAlive) => return false,
            Ok(status) if awaited.is_some() && status.pid() == awaited => return true,
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            // No child is left.
            Err(_) => return true,
        }
    }
}

/// `runsc delete --force` of a container whose runsc was killed, reaping meanwhile every
/// orphan of the sandbox that ends: the keeper is their reaper, and runsc waits for a sandbox
/// process it killed to be gone, which a zombie never is (should one be slower to die than
/// the first reaping's grace). Gives up after a minute, killing runsc.
/// Once runsc is ended: its sandbox and gofer reaped, and whatever it kept of container `name`
/// removed.
fn remove_runsc_leftovers(runsc: &Runsc, name: &str) {
    reap_children(Duration::from_secs(2), None);
    if runsc.has_state(name) {
        delete_reaping(runsc, name);
    }
}

fn delete_reaping(runsc: &Runsc, name: &str) {
    let null = std::process::Stdio::null;
    let Ok(child) = runsc
        .command("delete")
        .args(["--force", name])
        .stdin(null())
        .stdout(null())
        .stderr(null())
        .spawn()
    else {
        return;
    };
    let pid = Pid::from_raw(child.id() as i32);
    if !reap_children(Duration::from_secs(60), Some(pid)) {
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(pid, None);
    }
}

/// Starts runsc as posix_spawn starts a process (a vfork: a fork of the keeper, a process of
/// the warden's size, and that copy's teardown at exec took 1-5 ms before runsc ran), born in
/// the cell's cgroups (`joins`); it dies with the keeper (SIGKILL). It has a process group of
/// its own: a signal to the caller's group (a terminal's Ctrl-C) reached runsc too, which a
/// SIGINT or SIGTERM could end under the command; the keeper passes signals on through the
/// cell's init instead. (runsc reads no terminal: its stdio are the keeper's pipes and the
/// init's socket.)
fn start(
    runsc: &Runsc,
    described: &sys::Described,
    joins: &[std::os::fd::BorrowedFd<'_>],
    stdio: [std::os::fd::BorrowedFd<'_>; 3],
) -> Result<Pid, GvisorError> {
    sys::spawn(&sys::Spawn {
        cgroups: joins,
        parent_death: Some(libc::SIGKILL),
        own_group: true,
        ..described.spawn_with(stdio)
    })
    .map(Pid::from_raw)
    .map_err(|e| GvisorError::Sandbox(format!("starting {}: {e}", runsc.binary.display())))
}

/// The bundle's spec, held back from runsc by a write lease on its file: runsc is started
/// before the cell is assembled, and its open of the spec waits until the keeper has written
/// it and lets go of the lease ([`SpecGate::open`]). Only the keeper has the file open when it
/// takes the lease, and nothing is told of runsc's wait (no `SIGIO`: the file has no owner);
/// should the keeper end first, the lease goes with it and runsc finds no spec, and ends.
struct SpecGate(fs::File);

impl SpecGate {
    /// The spec's file, made empty and leased; `None` where this host grants no lease (leases
    /// turned off, a file system without them): the spec is then written before runsc starts.
    fn take(path: &Path) -> Option<SpecGate> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let _ = fs::remove_file(path);
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .ok()?;
        let fd = file.as_raw_fd();
        // Taking a lease makes this process the file's owner, to be sent `SIGIO` (which would
        // end it) when an open waits on the lease: no owner, no signal.
        let leased = sys::set_lease(fd, libc::F_WRLCK)
            .and_then(|()| sys::clear_owner(fd))
            .inspect_err(|_| {
                let _ = sys::set_lease(fd, libc::F_UNLCK);
            });
        if leased.is_err() {
            drop(file);
            let _ = fs::remove_file(path);
            return None;
        }
        Some(SpecGate(file))
    }

    fn write(&self, spec: &[u8]) -> std::io::Result<()> {
        use std::io::Write as _;
        (&self.0).write_all(spec)
    }

    /// Lets runsc read the spec.
    fn open(self) -> std::io::Result<()> {
        sys::set_lease(self.0.as_raw_fd(), libc::F_UNLCK)
    }
}

/// The bundle's spec written whole, where no lease holds it back (runsc starts after this).
fn write_spec(path: &Path, spec: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?
        .write_all(spec)
}

/// Ends the host side with the keeper.
struct HostGuard(Option<Pid>);

impl HostGuard {
    fn end(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, None);
        }
    }
}

impl Drop for HostGuard {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn what_follows_ready_in_the_pipe_is_left_for_the_caller() {
        let (out_r, out_w) = sys::pipe().unwrap();
        let (err_r, _err_w) = sys::pipe().unwrap();
        let said = b"ready\nthe command's first words, written at once\n";
        nix::unistd::write(&out_w, said).unwrap();
        drop(out_w);
        wait_ready(&out_r, &err_r).unwrap();
        let mut rest = Vec::new();
        fs::File::from(out_r).read_to_end(&mut rest).unwrap();
        assert_eq!(rest, said[6..]);
    }

    #[test]
    fn a_sandbox_that_ends_before_ready_says_why() {
        let (out_r, out_w) = sys::pipe().unwrap();
        let (err_r, err_w) = sys::pipe().unwrap();
        nix::unistd::write(&err_w, b"some detail\nrunsc: the last word\n").unwrap();
        drop((out_w, err_w));
        let err = wait_ready(&out_r, &err_r).unwrap_err();
        assert_eq!(err, "runsc: the last word");
    }

    /// A reader that opens the spec while the keeper holds it back waits, and then reads it
    /// whole; the keeper is sent nothing meanwhile (a `SIGIO` would end this test's process).
    #[test]
    fn a_held_back_spec_is_read_whole_once_let_go_of() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let gate = SpecGate::take(&path).expect("this host grants leases");
        let mut reader = std::process::Command::new("cat")
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            reader.try_wait().unwrap().is_none(),
            "the reader read the spec before it was let go of"
        );
        let spec = br#"{"ociVersion":"1.0.2","written":"in two parts"}"#;
        gate.write(&spec[..20]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(reader.try_wait().unwrap().is_none());
        gate.write(&spec[20..]).unwrap();
        gate.open().unwrap();
        let out = reader.wait_with_output().unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(out.stdout, spec);
        // Taken again (a keeper of the same name after a crash): the old file goes.
        let again = SpecGate::take(&path).unwrap();
        again.write(b"{}").unwrap();
        again.open().unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"{}");
    }
}
