//! The process tier behind the tier boundary: a cell is kept by its own small warden process
//! (the keeper, `warden keep`), which takes a [`KeeperRequest`] as JSON on its stdin, holds the
//! cell's lifeline and gateway, and routes execs to the cell's init. Keepers do not depend on
//! whoever started them, so a daemon that dies leaves its cells running; the next one adopts
//! them through the registry.

use std::os::fd::{AsFd as _, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use warden_policy::Tier;

use super::ahead::KeeperProcess;
use super::control::{self, ApprovalError, ControlError, PolicySetError};
use super::exec::{ExecError, ExecSession, Line};
use super::registry::{CellRecord, Registry, RegistryError};
use super::run::RunRequest;
use super::store::Store;
use crate::tier::{
    Attached, Backend, Cell, CellError, CellSpec, Check, ExecEvent, ExecRequest, FileOp,
    ProcessConfig, Question, Session, StartError, Status,
};

/// What a keeper is asked to keep.
#[derive(Debug, Serialize, Deserialize)]
pub struct KeeperRequest {
    pub spec: CellSpec,
    /// The soft limit of open files to take back (the daemon raised its own).
    #[serde(default)]
    pub open_files: Option<u64>,
    /// The one command the cell runs, with the keeper's stdio, and then ends (`warden run`);
    /// none: the cell takes execs until it is killed.
    #[serde(default)]
    pub argv: Vec<std::ffi::OsString>,
    /// With a command: its workspace layer and egress record go with it.
    #[serde(default)]
    pub discard_changes: bool,
    /// Where the keeper's own stdout and stderr go (a keeper started ahead of its cell had
    /// none); none: where they went when it was started.
    #[serde(default)]
    pub log_to: Option<std::path::PathBuf>,
    /// The process that passes the caller's signals on (a `warden run` that waits for this
    /// keeper, with `sys::forward_signal`): only those go on to the cell. A terminal's or a
    /// group's signal reaches both processes, and the cell then gets it once.
    #[serde(default)]
    pub signals_from: Option<i32>,
    /// The caller has had the tier check this cell's policy and workspace (`Backend::check`)
    /// just before, as `warden run` does: the keeper does not walk the host's paths again.
    #[serde(default)]
    pub checked: bool,
}

/// The environment variable that names a file holding the keeper's request, where its stdin
/// is the command's.
pub const KEEP_REQUEST: &str = "WARDEN_KEEP_REQUEST";

/// How long a keeper may take to bring its cell up.
const START_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct ProcessBackend {
    config: ProcessConfig,
    registry: Registry,
    store: Store,
    /// Keepers started ahead of their cells (`ProcessConfig::keepers_ahead`).
    ahead: Arc<super::ahead::Ahead>,
    /// Whether a cell's record names its init, the process whose end takes every process of
    /// the cell with it (its pid namespace's): so for this tier's cells, not for the gVisor
    /// tier's (the record names `runsc run`, which its sandbox outlives a moment).
    pid_is_init: bool,
    /// A network namespace under way for the `run_attached` to come (`prepare_run`).
    network_ahead: Mutex<Option<super::run::NetworkAhead>>,
}

impl ProcessBackend {
    /// The keepers of another tier's cells (gVisor's), whose records name a process that is
    /// not the cell's init.
    pub fn keeping_sandboxes(mut self) -> Self {
        self.pid_is_init = false;
        self
    }

    /// Where the tier keeps things.
    pub fn config(&self) -> &ProcessConfig {
        &self.config
    }

    pub fn open(config: ProcessConfig) -> Result<Self, CellError> {
        let registry =
            Registry::open(config.runtime.clone()).map_err(|e| CellError::Host(e.to_string()))?;
        let store =
            Store::open(config.state.clone()).map_err(|e| CellError::Host(e.to_string()))?;
        // The runtime folders and cgroups of cells whose keepers died go.
        let _ = registry.sweep();
        // A snapshot or reset cut short by a killed warden is finished before anything reads
        // the layer.
        super::snapshot::finish_all_interrupted(&store);
        if super::background::outlives_requests() {
            super::background::sweep_gone_layers(&store.root().join("layers"));
        }
        Ok(Self {
            ahead: super::ahead::Ahead::new(config.clone()),
            config,
            registry,
            store,
            pid_is_init: true,
            network_ahead: Mutex::new(None),
        })
    }

    /// The handle of a running cell; `line`: one to its init opened already (else the first
    /// exec opens one).
    fn handle(
        &self,
        record: CellRecord,
        keeper: Option<KeeperProcess>,
        line: Option<Line>,
    ) -> Arc<dyn Cell> {
        // The lock held open, if it is still the record's once open (else the registry
        // decides each time, as it would have).
        let lock = match self.registry.get_locked(&record.name) {
            Ok((now, lock)) if now.pid == record.pid && now.pid_start == record.pid_start => {
                Some(lock)
            }
            _ => None,
        };
        Arc::new(ProcessCell {
            registry: self.registry.clone(),
            watched: record
                .cgroup
                .as_ref()
                .map(|cg| cg.watched())
                .unwrap_or_default(),
            record,
            line: Mutex::new(line.map(Arc::new)),
            keeper: Mutex::new(keeper),
            lock,
            pid_is_init: self.pid_is_init,
        })
    }
}

impl Backend for ProcessBackend {
    fn tier(&self) -> Tier {
        Tier::Process
    }

    fn check_name(&self, name: &str) -> Result<(), CellError> {
        super::plan::check_name(name).map_err(|e| CellError::Invalid(e.to_string()))
    }

    fn check(
        &self,
        policy: &warden_policy::Policy,
        workspace: Option<&Path>,
    ) -> Result<(), CellError> {
        super::plan::check_request(policy, workspace, &self.config.state, &self.config.runtime)
            .map_err(|e| CellError::Invalid(e.to_string()))
    }

    fn start(&self, spec: CellSpec) -> Result<Arc<dyn Cell>, StartError> {
        let name = spec.name.clone();
        let log_path = spec.log.clone();
        // A keeper started ahead, unless the cell's secrets must be in its keeper's environment.
        let ahead = match spec.secrets.is_empty() {
            true => self.ahead.take(),
            false => None,
        };
        let log_to = ahead.as_ref().and(log_path.clone());
        let mut keeper = match ahead {
            Some(keeper) => keeper,
            None => {
                let log = match &log_path {
                    Some(path) => Some(std::fs::File::create(path).map_err(|e| {
                        StartError::Host(format!("creating {}: {e}", path.display()))
                    })?),
                    None => None,
                };
                self.ahead.start(&spec.secrets, log).map_err(|e| {
                    StartError::Host(format!(
                        "starting the keeper {}: {e}",
                        self.config.warden_exe.display()
                    ))
                })?
            }
        };
        let request = serde_json::to_vec(&KeeperRequest {
            spec,
            open_files: self.config.keeper_open_files,
            argv: Vec::new(),
            discard_changes: false,
            log_to,
            signals_from: None,
            checked: false,
        })
        .map_err(|e| StartError::Host(format!("writing the keeper's request: {e}")))?;
        // Noted until the keeper is ready or ended: a daemon killed from here on leaves a
        // keeper starting a cell that nothing lists yet, which the next waits for.
        let _noted = self
            .registry
            .note_start(&name, keeper.child.pid())
            .map_err(|e| StartError::Host(e.to_string()))?;
        keeper.send(&request);
        match keeper.wait_ready(Instant::now() + START_DEADLINE) {
            Ok(()) => {
                let record = self
                    .registry
                    .get(&name)
                    .map_err(|e| StartError::Host(e.to_string()))?;
                // Its line to the init now, not at its first exec (a cell made ahead of its
                // create has it ready; 1 ms of a first exec here).
                let line = Line::open(&self.registry, &name).ok();
                Ok(self.handle(record, Some(keeper.child), line))
            }
            Err(Some(status)) => {
                let said = log_path
                    .as_ref()
                    .and_then(|p| std::fs::read_to_string(p).ok())
                    .unwrap_or_default();
                let message = said
                    .lines()
                    .filter_map(|l| l.strip_prefix("warden: "))
                    .collect::<Vec<_>>()
                    .join("; ");
                Err(StartError::Refused(if message.is_empty() {
                    format!("the cell's keeper exited with {status}")
                } else {
                    message
                }))
            }
            Err(None) => {
                let _ = keeper.child.kill();
                let _ = keeper.child.wait();
                Err(StartError::TimedOut(format!(
                    "cell `{name}` did not come up within {} s{}",
                    START_DEADLINE.as_secs(),
                    log_path
                        .map(|p| format!(" (see {})", p.display()))
                        .unwrap_or_default()
                )))
            }
        }
    }

    fn prepare_run(&self, policy: &warden_policy::Policy) {
        if let Ok(mut ahead) = self.network_ahead.lock() {
            *ahead = Some(super::run::NetworkAhead::for_policy(policy));
        }
    }

    fn run_attached(
        &self,
        spec: CellSpec,
        argv: Vec<std::ffi::OsString>,
        discard_changes: bool,
        before_start: &mut (dyn FnMut() -> Result<(), String> + Send),
    ) -> Result<Attached, StartError> {
        let store =
            Store::open(self.config.state.clone()).map_err(|e| StartError::Host(e.to_string()))?;
        let from = match &spec.from {
            Some(id) => Some(
                super::snapshot::get(&store, id).map_err(|e| StartError::Refused(e.to_string()))?,
            ),
            None => None,
        };
        let request = RunRequest {
            policy: spec.policy,
            name: Some(spec.name),
            workspace: if from.is_some() { None } else { spec.workspace },
            argv,
            env: spec.env,
            discard_changes,
            from,
            serve_exec: false,
            report: spec.report,
            // `warden run` checks before it opens the journal (`Backend::check`).
            checked: true,
            ready: None,
            signals_from: None,
            release_later: true,
            lines: None,
        };
        let network = self
            .network_ahead
            .lock()
            .ok()
            .and_then(|mut ahead| ahead.take())
            .unwrap_or_else(|| super::run::NetworkAhead::for_policy(&request.policy));
        let outcome = super::run::run_with(&self.registry, &store, request, network, before_start)
            .map_err(|e| match e {
                super::outcome::RunError::BeforeStart(message) => StartError::Host(message),
                e => StartError::Refused(e.to_string()),
            })?;
        Ok(Attached {
            name: outcome.name,
            ending: outcome.ending,
            notices: outcome.notices,
            kept_changes: outcome.kept_changes,
            release: outcome.release,
        })
    }

    fn settle_starts(&self) {
        self.registry.settle_starts(START_DEADLINE);
    }

    fn adopt(&self, name: &str) -> Result<Option<Arc<dyn Cell>>, CellError> {
        match self.registry.get(name) {
            Ok(record) => Ok(Some(self.handle(record, None, None))),
            Err(RegistryError::NotFound(_)) => Ok(None),
            Err(err) => Err(CellError::Host(err.to_string())),
        }
    }

    fn exists(&self, name: &str) -> bool {
        self.registry.get(name).is_ok()
    }

    fn layers(&self) -> Option<crate::tier::Layers> {
        Some(crate::tier::Layers {
            registry: self.registry.clone(),
            store: self.store.clone(),
        })
    }

    fn probe(&self) -> Vec<Check> {
        super::probe::checks()
    }
}

/// One cell of the process tier: its record (pid, cgroup) as its keeper published it, the line
/// to its init once one is open, and its keeper where this process started it (to be reaped).
#[derive(Debug)]
pub struct ProcessCell {
    registry: Registry,
    record: CellRecord,
    line: Mutex<Option<Arc<Line>>>,
    keeper: Mutex<Option<KeeperProcess>>,
    /// The cell's lock file, opened while the record was current: while it is held the record
    /// is still this cell's, so a status asks it (one `flock`) rather than the registry (its
    /// lock and record files opened and read again, eight system calls, on every exec).
    lock: Option<super::registry::Lock>,
    /// Its cgroup's freezer and OOM files, held open (a status and each exec read them).
    watched: super::cgroup::Watched,
    /// See `ProcessBackend::pid_is_init`.
    pid_is_init: bool,
}

impl ProcessCell {
    fn ended(&self) -> CellError {
        CellError::Ended(format!("cell `{}` has ended", self.record.name))
    }

    /// Whether the handle's record is still the cell's: the held lock tells (a `fstat` and a
    /// `flock`), else the registry by path.
    fn is_current(&self) -> Result<bool, CellError> {
        match &self.lock {
            Some(lock) => lock
                .held()
                .map_err(|e| CellError::Host(format!("the lock of cell `{}`: {e}", self.name()))),
            None => Ok(self.current()?.is_some()),
        }
    }

    /// The registry's record, if it is still this cell's (not a later one of the same name).
    fn current(&self) -> Result<Option<CellRecord>, CellError> {
        match self.registry.get(&self.record.name) {
            Ok(record)
                if record.pid == self.record.pid && record.pid_start == self.record.pid_start =>
            {
                Ok(Some(record))
            }
            Ok(_) | Err(RegistryError::NotFound(_)) => Ok(None),
            Err(err) => Err(CellError::Host(err.to_string())),
        }
    }

    fn reap(&self) {
        if let Ok(mut keeper) = self.keeper.lock()
            && let Some(child) = keeper.as_mut()
            && matches!(child.try_wait(), Ok(Some(_)))
        {
            *keeper = None;
        }
    }

    /// Sends something over the line to the cell's init, opening a line first where there is
    /// none (or the last one closed: the keeper hands out a new one).
    fn with_line<T>(&self, send: impl Fn(&Line) -> Result<T, ExecError>) -> Result<T, CellError> {
        let cached = self.line.lock().ok().and_then(|l| l.clone());
        if let Some(line) = cached {
            match send(&line) {
                Err(ExecError::LineClosed(_)) => {
                    if let Ok(mut l) = self.line.lock() {
                        *l = None;
                    }
                }
                sent => return sent.map_err(exec_error),
            }
        }
        let line = Arc::new(Line::open(&self.registry, &self.record.name).map_err(exec_error)?);
        if let Ok(mut l) = self.line.lock() {
            *l = Some(Arc::clone(&line));
        }
        send(&line).map_err(exec_error)
    }
}

impl Drop for ProcessCell {
    /// A keeper this process started is its child and must be reaped, or it stays a zombie of a
    /// long-lived daemon (one per cell ever deleted). Reaped here if it has ended; otherwise (a
    /// cell deleted a moment ago has a keeper still tearing its cell down) by a small thread
    /// that waits for its end.
    fn drop(&mut self) {
        let Some(mut keeper) = self.keeper.get_mut().ok().and_then(Option::take) else {
            return;
        };
        if matches!(keeper.try_wait(), Ok(None)) {
            let _ = std::thread::Builder::new()
                .name("keeper-reaper".to_owned())
                .stack_size(64 * 1024)
                .spawn(move || {
                    let _ = keeper.wait();
                });
        }
    }
}

impl Cell for ProcessCell {
    fn name(&self) -> &str {
        &self.record.name
    }

    fn pid(&self) -> Option<i32> {
        Some(self.record.pid)
    }

    fn status(&self) -> Result<Status, CellError> {
        self.reap();
        Ok(match self.is_current()? {
            true if self.watched.is_frozen() => Status::Paused,
            true => Status::Running,
            false => Status::Ended,
        })
    }

    /// The init's end, where the record names it: its pid namespace's processes are gone
    /// before it ends (the kernel kills and reaps them first). A process that joined the cell
    /// from outside (a helper of the warden's) is the keeper's to kill, after.
    fn wait_stopped(&self) -> bool {
        if !self.pid_is_init {
            return self.wait_ended();
        }
        let Some(pidfd) = self.record.init_pidfd() else {
            return true; // gone, and reaped
        };
        super::sys::wait_readable(pidfd.as_fd(), Duration::from_secs(10)).unwrap_or(false)
    }

    /// Where the cell's pid 1 is Warden's init (not gVisor's `runsc`, whose sandbox's init
    /// speaks a protocol of its own).
    fn ends_with_last_process(&self) -> bool {
        self.pid_is_init
    }

    /// Its keeper's, where the cell's pid 1 is Warden's init (`Registry::hold_teardown`).
    fn hold_teardown(&self) -> Option<OwnedFd> {
        self.pid_is_init
            .then(|| self.registry.hold_teardown(&self.record.name).ok())
            .flatten()
    }

    /// The keeper's pidfd: it ends once its cell is gone. (A later process that took a gone
    /// keeper's pid only makes the wait look again.)
    fn end_waker(&self) -> Option<OwnedFd> {
        super::sys::pidfd_open(self.record.warden_pid).ok()
    }

    fn oom_kills(&self) -> Option<u64> {
        self.record
            .cgroup
            .as_ref()
            .map(|_| self.watched.oom_kills())
    }

    fn usage(&self) -> Option<warden_protocol::CellUsage> {
        self.record.cgroup.as_ref().map(|cg| cg.usage())
    }

    fn freeze(&self) -> Result<(), CellError> {
        control::pause(&self.registry, &self.record.name)
            .map(|_| ())
            .map_err(control_error)
    }

    fn thaw(&self) -> Result<(), CellError> {
        control::resume(&self.registry, &self.record.name)
            .map(|_| ())
            .map_err(control_error)
    }

    fn kill(&self) -> Result<(), CellError> {
        if !self.is_current()? {
            return Err(self.ended());
        }
        // A gVisor cell's record names `runsc run`: its sandbox is ended first, and runsc
        // follows, cleaning up after itself.
        if !self.pid_is_init
            && control::kill_through_sandbox(&self.registry, &self.record).map_err(control_error)?
        {
            return Ok(());
        }
        control::kill_record(&self.registry, &self.record).map_err(control_error)
    }

    fn exec(
        &self,
        request: &ExecRequest,
        stdio: Option<[&OwnedFd; 3]>,
    ) -> Result<Arc<dyn Session>, CellError> {
        let session = self.with_line(|line| ExecSession::start_on(line, request, stdio))?;
        Ok(Arc::new(session))
    }

    fn file_op(
        &self,
        root: &str,
        op: &FileOp,
        stdio: [&OwnedFd; 3],
    ) -> Result<Arc<dyn Session>, CellError> {
        let session = self.with_line(|line| ExecSession::files_on(line, root, op, stdio))?;
        Ok(Arc::new(session))
    }

    fn questions(&self) -> Vec<Question> {
        control::pending_questions(&self.registry, &self.record.name).unwrap_or_default()
    }

    fn answer(&self, id: u64, allow: bool) -> Result<(), CellError> {
        control::answer_question(&self.registry, &self.record.name, id, allow).map_err(
            |e| match e {
                ApprovalError::Registry(RegistryError::NotFound(_)) => self.ended(),
                ApprovalError::Registry(other) => CellError::Host(other.to_string()),
                ApprovalError::Answer(answer) => CellError::Invalid(answer.to_string()),
            },
        )
    }

    fn set_network_rules(&self, file: &Path) -> Result<u64, CellError> {
        control::set_network_policy(&self.registry, &self.record.name, file).map_err(|e| match e {
            PolicySetError::Registry(RegistryError::NotFound(_)) => self.ended(),
            PolicySetError::Policy(_) | PolicySetError::Rules(_) => {
                CellError::Invalid(e.to_string())
            }
            PolicySetError::Io { .. } | PolicySetError::Registry(_) => {
                CellError::Host(e.to_string())
            }
            PolicySetError::NoGateway(_)
            | PolicySetError::NoAnswer(_)
            | PolicySetError::Refused { .. } => CellError::Refused(e.to_string()),
        })
    }
}

impl Session for ExecSession {
    fn try_next_event(&self) -> Result<Option<(ExecEvent, Vec<OwnedFd>)>, CellError> {
        self.try_next_event_with_fds().map_err(exec_error)
    }

    fn signal(&self, signal: i32) -> Result<(), CellError> {
        ExecSession::signal(self, signal).map_err(exec_error)
    }
}

fn exec_error(err: ExecError) -> CellError {
    match &err {
        ExecError::Registry(RegistryError::NotFound(_))
        | ExecError::CellEnded(_)
        | ExecError::LineClosed(_) => CellError::Ended(err.to_string()),
        ExecError::NotServing(_) => CellError::Refused(err.to_string()),
        ExecError::Registry(_) | ExecError::Io { .. } | ExecError::Protocol { .. } => {
            CellError::Host(err.to_string())
        }
    }
}

fn control_error(err: ControlError) -> CellError {
    match &err {
        ControlError::Registry(RegistryError::NotFound(_)) | ControlError::Gone(_) => {
            CellError::Ended(err.to_string())
        }
        ControlError::NoFreezer(_) => CellError::Refused(err.to_string()),
        ControlError::Registry(_) | ControlError::Cgroup(_) | ControlError::Signal { .. } => {
            CellError::Host(err.to_string())
        }
    }
}
