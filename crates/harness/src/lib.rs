//! The harness: the core that every face (CLI, HTTP API, MCP, SDKs) calls.
//!
//! It owns the cells a daemon made, routes every request through the same steps (validate, record
//! in the journal, carry out through the cell crate, record the outcome) and remembers enough in
//! its embedded database to take its cells back after a crash.
//!
//! A cell made here is kept by its own small warden process (`warden keep`), outside the cell:
//! it holds the cell's lifeline and egress gateway and routes execs to the cell's init. Keepers
//! do not depend on the daemon, so `kill -9` of the daemon leaves every cell running; the next
//! daemon finds them through the runtime registry and reattaches.

mod files;
mod process;
mod state;
mod supervise;
mod workspace;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use warden_cell::linux::exec::{ExecEvent, ExecRequest, ExecSession};
pub use warden_cell::linux::exec::{TtySize, Usage};
use warden_cell::{Registry, Store, control};
use warden_journal::{Journal, Receipt};

pub use files::{FileInfo, READ_LIMIT};
pub use process::{ExitInfo, Item, KillOnDrop, Process, ProcessInfo, Stream};
use state::State;
pub use state::{CellEntry, Grant, PolicySource};
use supervise::Live;
pub use supervise::{Approval, Scope};
pub use workspace::{ApplyRequest, Snapshot};

/// What kind of failure, for the faces to map onto their own codes (HTTP status, exit code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    BadRequest,
    /// The policy, or a person, refused it.
    Forbidden,
    NotFound,
    Conflict,
    Unavailable,
    Internal,
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct HarnessError {
    pub kind: ErrorKind,
    pub message: String,
}

impl HarnessError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
    fn not_found(name: &str) -> Self {
        Self::new(
            ErrorKind::NotFound,
            format!("no cell `{name}` (list them with GET /v1/cells or `warden ps`)"),
        )
    }
}

/// Where the harness keeps things.
#[derive(Debug, Clone)]
pub struct Config {
    /// The runtime directory (cells' registry, the daemon's socket).
    pub runtime: PathBuf,
    /// The state directory (layers, egress records, the journal, the daemon's database).
    pub state: PathBuf,
    /// The `warden` binary, started as each cell's keeper.
    pub warden_exe: PathBuf,
}

/// A request to make a cell.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateCell {
    pub name: Option<String>,
    /// A policy document (YAML, as `warden run --policy` takes it).
    pub policy: Option<String>,
    /// A built-in preset, instead of `policy`.
    pub preset: Option<String>,
    /// Host directory that appears at the policy's workspace mount.
    pub workspace: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Start from this snapshot (`CELL@SNAP`), or from a snapshot taken now of a cell (`CELL`):
    /// a fork. Its workspace is the snapshot's.
    pub from: Option<String>,
}

/// A request to start a process in a cell.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    /// Bytes for stdin, then end of input; without it stdin stays open for later writes
    /// (background processes) or is closed at once (foreground).
    pub stdin: Option<String>,
    /// Kill the process after this many milliseconds.
    pub timeout_ms: Option<u64>,
    /// Keep running when the client that started it goes away; read it again by its id.
    #[serde(default)]
    pub background: bool,
    /// Run on a terminal of this size (one output stream; resize it later).
    pub tty: Option<TtySize>,
    /// Kill the process once it has written more than this many bytes (stdout and stderr).
    pub output_limit: Option<u64>,
    /// The user to run as: a cell runs every process as its one user (`process.user` of its
    /// policy; no process in it can change ids), so only that uid is accepted.
    pub user: Option<u32>,
}

/// A cell as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct CellInfo {
    pub name: String,
    /// `running`, `paused` or `ended`.
    pub state: String,
    pub pid: Option<i32>,
    pub created_ms: u64,
    pub workspace: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub ended: Option<String>,
    pub processes: usize,
}

/// The core.
#[derive(Debug)]
pub struct Harness {
    config: Config,
    registry: Registry,
    store: Store,
    journal: Journal,
    state: Arc<State>,
    /// Notes of running processes, written in order off the exec path (see `State::put_running`).
    notes: Mutex<std::sync::mpsc::Sender<RunningNote>>,
    daemon_dir: PathBuf,
    processes: Mutex<HashMap<String, Vec<Arc<Process>>>>,
    next_process: AtomicU64,
    /// The live cells this daemon supervises.
    live: Mutex<HashMap<String, Live>>,
    grants: Mutex<Vec<state::Grant>>,
    exec_questions: Mutex<HashMap<(String, u64), supervise::ExecQuestion>>,
    /// Cells killed by their wall-clock limit.
    walled: Mutex<std::collections::HashSet<String>>,
    next_question: AtomicU64,
    /// Every journaled entry, for the events stream, once it is on disk.
    events: tokio::sync::broadcast::Sender<Arc<Value>>,
}

fn spec_limit(process: &Process) -> u64 {
    process.output_limit().unwrap_or(0)
}

/// A change to the notes of running processes.
#[derive(Debug)]
enum RunningNote {
    Put(u64, Value),
    Remove(u64),
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Harness {
    /// Opens the journal and the database and reconciles with the cells that exist now.
    pub async fn open(config: Config) -> Result<Arc<Self>, HarnessError> {
        let daemon_dir = config.state.join("daemon");
        std::fs::create_dir_all(daemon_dir.join("cells")).map_err(|e| {
            HarnessError::internal(format!("creating {}: {e}", daemon_dir.display()))
        })?;
        let _ = std::fs::set_permissions(
            &daemon_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        );
        let registry = Registry::open(config.runtime.clone())
            .map_err(|e| HarnessError::internal(e.to_string()))?;
        let store =
            Store::open(config.state.clone()).map_err(|e| HarnessError::internal(e.to_string()))?;
        let state = State::open(&daemon_dir.join("state.redb"))?;
        let journal = Journal::open(&config.state.join("journal"))
            .map_err(|e| HarnessError::internal(e.to_string()))?;
        let grants = state.grants()?;
        let state = Arc::new(state);
        let (notes, pending_notes) = std::sync::mpsc::channel::<RunningNote>();
        {
            let state = Arc::clone(&state);
            std::thread::Builder::new()
                .name("running-notes".to_owned())
                .spawn(move || {
                    for note in pending_notes {
                        let _ = match note {
                            RunningNote::Put(id, value) => state.put_running(id, &value),
                            RunningNote::Remove(id) => state.remove_running(id),
                        };
                    }
                })
                .map_err(|e| HarnessError::internal(format!("starting a thread: {e}")))?;
        }
        let harness = Arc::new(Self {
            notes: Mutex::new(notes),
            live: Mutex::new(HashMap::new()),
            grants: Mutex::new(grants),
            exec_questions: Mutex::new(HashMap::new()),
            walled: Mutex::new(std::collections::HashSet::new()),
            next_question: AtomicU64::new(1),
            events: tokio::sync::broadcast::channel(1024).0,
            config,
            registry,
            store,
            journal,
            state,
            daemon_dir,
            processes: Mutex::new(HashMap::new()),
            next_process: AtomicU64::new(1),
        });
        let start = harness
            .record(None, "daemon.start", json!({ "pid": std::process::id() }))
            .await?;
        // Process ids stay unique across restarts: they start above the journal's last entry.
        harness
            .next_process
            .store(start.seq * 1000 + 1, Ordering::Relaxed);
        harness.reconcile().await?;
        Ok(harness)
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Entries as they are journaled, for the events stream (only the daemon's owner can
    /// connect to it).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Arc<Value>> {
        self.events.subscribe()
    }

    /// Appends to the journal and waits until it is on disk.
    pub async fn record(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
    ) -> Result<Receipt, HarnessError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let event = (self.events.receiver_count() > 0).then(|| data.clone());
        self.journal.submit(cell, kind, data, move |result| {
            let _ = tx.send(result);
        });
        match rx.await {
            Ok(Ok(receipt)) => {
                if let Some(data) = event {
                    let _ = self.events.send(Arc::new(json!({
                        "seq": receipt.seq,
                        "cell": cell,
                        "kind": kind,
                        "data": data,
                    })));
                }
                Ok(receipt)
            }
            Ok(Err(err)) => Err(HarnessError::new(ErrorKind::Unavailable, err.to_string())),
            Err(_) => Err(HarnessError::new(
                ErrorKind::Unavailable,
                "the journal writer is gone",
            )),
        }
    }

    /// Takes back the cells of an earlier daemon: live ones are watched again, dead ones are
    /// marked ended (their keepers already removed what they held).
    async fn reconcile(self: &Arc<Self>) -> Result<(), HarnessError> {
        // Listing also removes the runtime folders and cgroups of dead cells.
        let _ = self.registry.list();
        // Processes the old daemon was relaying: their output pipes went with it, so the
        // keeper killed them when the daemon's end of their exec connection closed.
        for (id, note) in self.state.take_running()? {
            let cell = note["cell"].as_str().map(str::to_owned);
            self.record(
                cell.as_deref(),
                "exec.lost",
                json!({
                    "process": id,
                    "argv": note["argv"],
                    "start_seq": note["start_seq"],
                    "reason": "the daemon stopped while it ran; it was ended with the daemon's connection",
                }),
            )
            .await?;
        }
        for mut entry in self.state.all()? {
            if entry.ended.is_some() {
                continue;
            }
            if self.registry.get(&entry.name).is_ok() {
                self.record(Some(&entry.name), "cell.reattach", json!({}))
                    .await?;
                self.adopt(&entry);
                self.watch(entry.name.clone());
            } else {
                let reason = "ended while no daemon was running".to_owned();
                entry.ended = Some(reason.clone());
                self.state.put(&entry)?;
                self.record(Some(&entry.name), "cell.lost", json!({ "reason": reason }))
                    .await?;
            }
        }
        Ok(())
    }

    /// Starts supervising a live cell: its policy (for limits and approvals), and the secrets
    /// of its credentials, which must never reach the journal.
    fn adopt(&self, entry: &CellEntry) {
        let policy = match &entry.policy {
            PolicySource::Preset(p) => warden_policy::preset(p).ok(),
            PolicySource::Yaml(y) => warden_policy::from_yaml("policy", y).ok(),
        };
        let Some(policy) = policy else {
            return;
        };
        if let Ok(secrets) = warden_egress::Secrets::load(&policy.credentials) {
            self.journal
                .add_redactions(secrets.all.iter().map(|s| s.value.clone()));
        }
        if let Ok(mut live) = self.live.lock() {
            live.insert(entry.name.clone(), Live::new(policy));
        }
    }

    fn kill_requested(&self, name: &str) -> bool {
        self.daemon_dir
            .join("cells")
            .join(name)
            .join("killed")
            .exists()
    }

    fn entry(&self, name: &str) -> Result<CellEntry, HarnessError> {
        self.state
            .get(name)?
            .ok_or_else(|| HarnessError::not_found(name))
    }

    fn info(&self, entry: &CellEntry) -> CellInfo {
        let record = if entry.ended.is_none() {
            self.registry.get(&entry.name).ok()
        } else {
            None
        };
        let state = match &record {
            Some(r) if control::is_paused(r) => "paused",
            Some(_) => "running",
            None => "ended",
        };
        let processes = self
            .processes
            .lock()
            .map(|p| p.get(&entry.name).map_or(0, Vec::len))
            .unwrap_or(0);
        CellInfo {
            name: entry.name.clone(),
            state: state.to_owned(),
            pid: record.map(|r| r.pid),
            created_ms: entry.created_ms,
            workspace: entry.workspace.clone(),
            labels: entry.labels.clone(),
            ended: entry
                .ended
                .clone()
                .or_else(|| (state == "ended").then(|| "its processes ended".to_owned())),
            processes,
        }
    }

    pub fn list(&self) -> Result<Vec<CellInfo>, HarnessError> {
        Ok(self.state.all()?.iter().map(|e| self.info(e)).collect())
    }

    pub fn get(&self, name: &str) -> Result<CellInfo, HarnessError> {
        Ok(self.info(&self.entry(name)?))
    }

    /// Makes a cell and waits until it takes execs.
    pub async fn create(self: &Arc<Self>, request: CreateCell) -> Result<CellInfo, HarnessError> {
        let name = match &request.name {
            Some(name) => name.clone(),
            None => generate_name(),
        };
        warden_cell::linux::plan::check_name(&name)
            .map_err(|e| HarnessError::bad(e.to_string()))?;
        let policy = match (&request.policy, &request.preset) {
            (Some(_), Some(_)) => {
                return Err(HarnessError::bad(
                    "give either `policy` (YAML text) or `preset`, not both",
                ));
            }
            (Some(yaml), None) => {
                warden_policy::from_yaml("policy", yaml)
                    .map_err(|e| HarnessError::bad(e.to_string()))?;
                PolicySource::Yaml(yaml.clone())
            }
            (None, preset) => {
                let preset = preset.clone().unwrap_or_else(|| "default".to_owned());
                warden_policy::preset(&preset).map_err(|e| HarnessError::bad(e.to_string()))?;
                PolicySource::Preset(preset)
            }
        };
        for key in request.env.keys() {
            if key.is_empty() || key.contains(['=', '\0']) {
                return Err(HarnessError::bad(format!(
                    "environment variable name `{key}` is empty or contains `=` or NUL"
                )));
            }
        }
        if let Some(dir) = &request.workspace
            && !Path::new(dir).is_dir()
        {
            return Err(HarnessError::bad(format!(
                "workspace {dir} is not a directory on the host"
            )));
        }
        if let Some(old) = self.state.get(&name)? {
            if old.ended.is_none() || self.registry.get(&name).is_ok() {
                return Err(HarnessError::new(
                    ErrorKind::Conflict,
                    format!("a cell named `{name}` exists; delete it first or pick another name"),
                ));
            }
        }
        if self.registry.get(&name).is_ok() {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!("a cell named `{name}` runs already (started by `warden run`)"),
            ));
        }
        // A fork starts from a snapshot; of a cell, one is taken now.
        let from = match &request.from {
            Some(source) if source.contains('@') => Some(source.clone()),
            Some(source) => Some(self.snapshot(source, None).await?.id),
            None => None,
        };
        let workspace = match &from {
            Some(id) => Some(
                warden_cell::snapshot::get(&self.store, id)
                    .map_err(|e| HarnessError::new(ErrorKind::NotFound, e.to_string()))?
                    .lower
                    .display()
                    .to_string(),
            ),
            None => request.workspace.clone(),
        };
        let entry = CellEntry {
            name: name.clone(),
            created_ms: now_ms(),
            policy: policy.clone(),
            workspace,
            labels: request.labels.clone(),
            env: request.env.clone(),
            ended: None,
        };
        self.record(
            Some(&name),
            "cell.create",
            json!({
                "policy": match &policy { PolicySource::Preset(p) => json!({"preset": p}), PolicySource::Yaml(y) => json!({"yaml": y}) },
                "workspace": request.workspace,
                "from": from,
                "labels": request.labels,
                "env": request.env.keys().collect::<Vec<_>>(),
            }),
        )
        .await?;
        let cell_dir = self.daemon_dir.join("cells").join(&name);
        let _ = std::fs::remove_dir_all(&cell_dir);
        std::fs::create_dir_all(&cell_dir)
            .map_err(|e| HarnessError::internal(format!("creating {}: {e}", cell_dir.display())))?;
        let mut command = tokio::process::Command::new(&self.config.warden_exe);
        // The daemon applies the wall-clock limit itself (with the policy's `on_wall`).
        command
            .arg("keep")
            .arg("--no-wall")
            .arg("--name")
            .arg(&name);
        match &policy {
            PolicySource::Preset(preset) => {
                command.arg("--preset").arg(preset);
            }
            PolicySource::Yaml(yaml) => {
                let file = cell_dir.join("policy.yaml");
                std::fs::write(&file, yaml)
                    .map_err(|e| HarnessError::internal(format!("writing the policy: {e}")))?;
                command.arg("--policy").arg(file);
            }
        }
        if let Some(dir) = &request.workspace {
            command.arg("--workspace").arg(dir);
        }
        if let Some(from) = &from {
            command.arg("--from").arg(from);
        }
        for (key, value) in &request.env {
            command.arg("--env").arg(format!("{key}={value}"));
        }
        let log_path = cell_dir.join("keeper.log");
        let log = std::fs::File::create(&log_path)
            .map_err(|e| HarnessError::internal(format!("creating the keeper log: {e}")))?;
        let log2 = log
            .try_clone()
            .map_err(|e| HarnessError::internal(e.to_string()))?;
        command
            .env("WARDEN_RUNTIME_DIR", &self.config.runtime)
            .env("WARDEN_STATE_DIR", &self.config.state)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2)
            // Its own process group: signals meant for the daemon's terminal are not its.
            .process_group(0)
            .kill_on_drop(false);
        let mut child = command.spawn().map_err(|e| {
            HarnessError::internal(format!(
                "starting the keeper {}: {e}",
                self.config.warden_exe.display()
            ))
        })?;
        let socket = self
            .registry
            .cell_file(&name, warden_cell::linux::exec::EXEC_SOCKET);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if socket.exists() && self.registry.get(&name).is_ok() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let message = log
                    .lines()
                    .filter_map(|l| l.strip_prefix("warden: "))
                    .collect::<Vec<_>>()
                    .join("; ");
                let message = if message.is_empty() {
                    format!("the cell's keeper exited with {status}")
                } else {
                    message
                };
                self.record(Some(&name), "cell.fail", json!({ "error": message }))
                    .await?;
                return Err(HarnessError::bad(format!(
                    "cell `{name}` could not start: {message}"
                )));
            }
            if Instant::now() > deadline {
                let _ = child.start_kill();
                return Err(HarnessError::internal(format!(
                    "cell `{name}` did not come up within 30 s (see {})",
                    log_path.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // The keeper is our child while this daemon lives: reap it.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        self.state.put(&entry)?;
        self.adopt(&entry);
        self.record(
            Some(&name),
            "cell.start",
            json!({ "pid": self.registry.get(&name).ok().map(|r| r.pid) }),
        )
        .await?;
        self.watch(name.clone());
        Ok(self.info(&entry))
    }

    fn live(&self, name: &str) -> Result<warden_cell::CellRecord, HarnessError> {
        let entry = self.entry(name)?;
        if entry.ended.is_some() {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!(
                    "cell `{name}` has ended ({}); delete it and create a new one",
                    entry.ended.unwrap_or_default()
                ),
            ));
        }
        self.registry
            .get(name)
            .map_err(|_| HarnessError::new(ErrorKind::Conflict, format!("cell `{name}` has ended")))
    }

    /// Freezes, thaws or kills a cell, from outside.
    pub async fn control(
        &self,
        name: &str,
        action: &str,
        by: &str,
    ) -> Result<CellInfo, HarnessError> {
        self.live(name)?;
        self.record(Some(name), &format!("cell.{action}"), json!({ "by": by }))
            .await?;
        if action == "resume"
            && let Ok(mut live) = self.live.lock()
            && let Some(l) = live.get_mut(name)
        {
            l.idle_paused = false;
            l.last_activity = Instant::now();
        }
        let registry = self.registry.clone();
        let owned = name.to_owned();
        let action_owned = action.to_owned();
        if action == "kill" {
            let _ = std::fs::write(self.daemon_dir.join("cells").join(name).join("killed"), "");
        }
        let result = tokio::task::spawn_blocking(move || match action_owned.as_str() {
            "pause" => control::pause(&registry, &owned).map(|_| ()),
            "resume" => control::resume(&registry, &owned).map(|_| ()),
            _ => control::kill(&registry, &owned).map(|_| ()),
        })
        .await
        .map_err(|e| HarnessError::internal(e.to_string()))?;
        match result {
            Ok(()) => {}
            // A cell that ended on its own between the check and the kill is what a kill wants.
            Err(
                control::ControlError::Gone(_)
                | control::ControlError::Registry(warden_cell::RegistryError::NotFound(_)),
            ) if action == "kill" => {}
            Err(err) => return Err(HarnessError::new(ErrorKind::Conflict, err.to_string())),
        }
        if action == "kill" {
            // Wait (bounded) until the keeper has let go of the cell.
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.registry.get(name).is_ok() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if let Ok(Some(mut entry)) = self.state.get(name)
                && entry.ended.is_none()
            {
                entry.ended = Some("killed".to_owned());
                self.state.put(&entry)?;
                self.record(Some(name), "cell.end", json!({ "reason": "killed" }))
                    .await?;
            }
        }
        self.get(name)
    }

    /// Kills the cell if it runs and forgets it: its workspace layer and egress record go too.
    pub async fn delete(&self, name: &str, by: &str) -> Result<(), HarnessError> {
        let entry = self.entry(name)?;
        if entry.ended.is_none() && self.registry.get(name).is_ok() {
            self.control(name, "kill", by).await?;
        }
        self.journal_changes(name, "deleted, changes discarded")
            .await;
        self.record(Some(name), "cell.delete", json!({ "by": by }))
            .await?;
        if let Ok(mut processes) = self.processes.lock() {
            processes.remove(name);
        }
        if let Ok(mut walled) = self.walled.lock() {
            walled.remove(name);
        }
        let _ = warden_cell::changes::remove(&self.registry, &self.store, name);
        let _ = std::fs::remove_file(self.store.net_log_path(name));
        let _ = std::fs::remove_dir_all(self.daemon_dir.join("cells").join(name));
        self.state.remove(name)
    }

    /// Starts a process in a running cell. Its output and ending are read through the returned
    /// process; the journal has its start before it runs and its end once it ended.
    pub async fn exec(
        self: &Arc<Self>,
        name: &str,
        spec: ExecSpec,
    ) -> Result<Arc<Process>, HarnessError> {
        let record = self.live(name)?;
        let idle_paused = self
            .live
            .lock()
            .map(|l| l.get(name).is_some_and(|l| l.idle_paused))
            .unwrap_or(false);
        if idle_paused && control::is_paused(&record) {
            // Paused for being idle: an exec is activity, so it wakes the cell.
            self.control(name, "resume", "exec after an idle pause")
                .await?;
        } else if control::is_paused(&record) {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!("cell `{name}` is paused; resume it first"),
            ));
        }
        if spec.argv.is_empty() || spec.argv[0].is_empty() {
            return Err(HarnessError::bad("`argv` needs at least the program"));
        }
        if spec.argv.iter().any(|a| a.contains('\0')) {
            return Err(HarnessError::bad("`argv` may not contain NUL bytes"));
        }
        for (key, value) in &spec.env {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return Err(HarnessError::bad(format!(
                    "environment variable `{key}`: the name must be non-empty without `=`, and neither part may contain NUL"
                )));
            }
        }
        if let Some(user) = spec.user {
            let cell_user = self
                .live
                .lock()
                .ok()
                .and_then(|l| l.get(name).map(|l| l.policy.process.user));
            if cell_user.is_some_and(|u| u != user) {
                return Err(HarnessError::bad(format!(
                    "user {user}: cell `{name}` runs every process as uid {} (its policy's process.user); no process in a cell can change ids. Make a cell with another process.user instead",
                    cell_user.unwrap_or_default()
                )));
            }
        }
        self.touch(name);
        self.check_command(name, &spec.argv).await?;
        self.touch(name);
        let oom_before = record.cgroup.as_ref().map(|cg| cg.oom_kills());
        let id = self.next_process.fetch_add(1, Ordering::Relaxed);
        let started = self
            .record(
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
            )
            .await?;
        self.note(RunningNote::Put(
            id,
            json!({ "cell": name, "argv": spec.argv, "start_seq": started.seq }),
        ));
        let pipe = || {
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
                .map_err(|e| HarnessError::internal(format!("creating pipes: {e}")))
        };
        // Pipes, or nothing when the cell makes a terminal (its master comes back).
        let pipes = if spec.tty.is_none() {
            Some((pipe()?, pipe()?, pipe()?))
        } else {
            None
        };
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
        };
        let registry = self.registry.clone();
        let cell = name.to_owned();
        let begun = Instant::now();
        let opened = tokio::task::spawn_blocking(move || {
            let stdio = theirs.as_ref().map(|[a, b, c]| [a, b, c]);
            let session = ExecSession::start(&registry, &cell, &request, stdio)?;
            drop(theirs);
            let (first, fds) = session.next_event_with_fds()?;
            Ok::<_, warden_cell::linux::exec::ExecError>((session, first, fds))
        })
        .await
        .map_err(|e| HarnessError::internal(e.to_string()))?;
        let (session, first, mut fds) = match opened {
            Ok(opened) => opened,
            Err(err) => {
                let message = err.to_string();
                self.record(
                    Some(name),
                    "exec.exit",
                    json!({ "process": id, "reason": "failed", "message": message }),
                )
                .await?;
                self.note(RunningNote::Remove(id));
                return Err(HarnessError::new(ErrorKind::Conflict, message));
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
                self.note(RunningNote::Remove(id));
                let process = Arc::new(Process::new(
                    id,
                    name.to_owned(),
                    spec.argv.clone(),
                    spec.background,
                    0,
                    Arc::new(session),
                    None,
                ));
                process.finish(ExitInfo {
                    reason: "failed".to_owned(),
                    code: Some(code),
                    signal: None,
                    message: Some(message),
                    duration_ms: begun.elapsed().as_millis() as u64,
                    usage: None,
                    stdout_bytes: 0,
                    stderr_bytes: 0,
                    journal_seq: Some(exit.seq),
                });
                return Ok(process);
            }
            other => {
                return Err(HarnessError::internal(format!(
                    "the cell answered an exec with {other:?}"
                )));
            }
        };
        let (input, outputs) = match ours {
            Some((stdin_w, stdout_r, stderr_r)) => {
                let stdin = tokio::net::unix::pipe::Sender::from_owned_fd(stdin_w)
                    .map_err(|e| HarnessError::internal(format!("stdin pipe: {e}")))?;
                (
                    process::Input::Pipe(stdin),
                    process::Outputs::Pipes([stdout_r, stderr_r]),
                )
            }
            None => {
                let Some(master) = fds.pop() else {
                    return Err(HarnessError::internal(
                        "the cell started a terminal process without its terminal",
                    ));
                };
                let master = Arc::new(master);
                (
                    process::Input::Tty(Arc::clone(&master)),
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
                Arc::new(session),
                Some(input),
            )
            .with_output_limit(spec.output_limit),
        );
        if let Ok(mut processes) = self.processes.lock() {
            processes
                .entry(name.to_owned())
                .or_default()
                .push(Arc::clone(&process));
        }
        if let Some(input) = &spec.stdin {
            let writer = Arc::clone(&process);
            let input = input.clone().into_bytes();
            tokio::spawn(async move {
                let _ = writer.write_stdin(&input, true).await;
            });
        } else if !spec.background {
            let _ = process.write_stdin(&[], true).await;
        }
        let harness = Arc::clone(self);
        let monitored = Arc::clone(&process);
        tokio::spawn(async move {
            harness
                .monitor(
                    monitored,
                    outputs,
                    begun,
                    spec.timeout_ms,
                    (started.seq, oom_before),
                )
                .await;
        });
        Ok(process)
    }

    /// Relays a process's output into its log, waits for its end, and journals it.
    async fn monitor(
        self: Arc<Self>,
        process: Arc<Process>,
        outputs: process::Outputs,
        begun: Instant,
        timeout_ms: Option<u64>,
        (start_seq, oom_before): (u64, Option<u64>),
    ) {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers = outputs.start(&process, &stop);
        let session = Arc::clone(&process.session);
        let mut events = tokio::task::spawn_blocking(move || {
            loop {
                match session.next_event() {
                    Ok(event) if event.is_final() => return Ok(event),
                    Ok(_) => continue,
                    Err(err) => return Err(err),
                }
            }
        });
        let mut timed_out = false;
        let ended = match timeout_ms {
            Some(ms) => {
                tokio::select! {
                    ended = &mut events => ended,
                    () = tokio::time::sleep(Duration::from_millis(ms)) => {
                        timed_out = true;
                        process.signal(libc::SIGKILL).await;
                        events.await
                    }
                }
            }
            None => events.await,
        };
        // Output written just before the end is still in the pipes: drain it (bounded, since
        // a process the exec started in the background may hold them open).
        let drained_by = tokio::time::Instant::now() + Duration::from_secs(2);
        for reader in readers {
            let abort = reader.abort_handle();
            if tokio::time::timeout_at(drained_by, reader).await.is_err() {
                abort.abort();
            }
        }
        let usage = match &ended {
            Ok(Ok(ExecEvent::Exited { usage, .. } | ExecEvent::Signaled { usage, .. })) => *usage,
            _ => None,
        };
        let (reason, code, signal, message) = match ended {
            Ok(Ok(ExecEvent::Signaled { signal, .. })) if process.over_output_limit() => (
                "output-limit",
                None,
                Some(signal),
                Some(format!(
                    "the output limit of {} bytes was exceeded; the process was killed",
                    spec_limit(&process)
                )),
            ),
            Ok(Ok(ExecEvent::Exited { code, .. })) => ("exited", Some(code), None, None),
            Ok(Ok(ExecEvent::Signaled { signal, .. })) if timed_out => {
                ("timeout", None, Some(signal), None)
            }
            Ok(Ok(ExecEvent::Signaled { signal, .. }))
                if signal == libc::SIGKILL && self.oom_since(&process.cell, oom_before) =>
            {
                (
                    "memory-limit",
                    None,
                    Some(signal),
                    Some("the cell's memory limit was reached and the kernel killed it".to_owned()),
                )
            }
            Ok(Ok(ExecEvent::Signaled { signal, .. })) => ("signaled", None, Some(signal), None),
            Ok(Ok(ExecEvent::Failed { code, message, .. })) => {
                ("failed", Some(code), None, Some(message))
            }
            Ok(Ok(ExecEvent::Started { .. })) => ("failed", None, None, None),
            _ if self.walled.lock().is_ok_and(|w| w.contains(&process.cell)) => (
                "timeout",
                None,
                None,
                Some("the cell's wall-clock limit ended it".to_owned()),
            ),
            Ok(Err(err)) => ("cell-ended", None, None, Some(err.to_string())),
            Err(err) => ("cell-ended", None, None, Some(err.to_string())),
        };
        self.touch(&process.cell);
        let (counts, captured) = process.totals();
        let duration_ms = begun.elapsed().as_millis() as u64;
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let receipt = self
            .record(
                Some(&process.cell),
                "exec.exit",
                json!({
                    "process": process.id,
                    "start_seq": start_seq,
                    "reason": reason,
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
                }),
            )
            .await;
        if receipt.is_ok() {
            self.note(RunningNote::Remove(process.id));
        }
        self.forget_old(&process.cell);
        process.finish(ExitInfo {
            reason: reason.to_owned(),
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

    /// Whether the cell's memory cgroup killed something since `before` was read.
    fn oom_since(&self, name: &str, before: Option<u64>) -> bool {
        let now = self
            .registry
            .get(name)
            .ok()
            .and_then(|r| r.cgroup.map(|cg| cg.oom_kills()));
        matches!((before, now), (Some(b), Some(n)) if n > b)
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

    fn note(&self, note: RunningNote) {
        if let Ok(notes) = self.notes.lock() {
            let _ = notes.send(note);
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
                HarnessError::new(
                    ErrorKind::NotFound,
                    format!("cell `{name}` has no process {id} (processes do not outlive the daemon that started them)"),
                )
            })
    }

    /// Sends a signal to a process, journaled.
    pub async fn signal(&self, name: &str, id: u64, signal: i32) -> Result<(), HarnessError> {
        let process = self.process(name, id)?;
        if !(1..=64).contains(&signal) {
            return Err(HarnessError::bad(format!(
                "{signal} is not a signal number"
            )));
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
            return Err(HarnessError::bad(
                "a terminal needs at least one row and one column",
            ));
        }
        self.record(
            Some(name),
            "exec.resize",
            json!({ "process": id, "rows": size.rows, "cols": size.cols }),
        )
        .await?;
        process
            .resize(size)
            .map_err(|e| HarnessError::new(ErrorKind::Conflict, e.to_string()))
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
            .map_err(|e| HarnessError::new(ErrorKind::Conflict, e.to_string()))
    }

    /// Writes the daemon's last journal entry.
    pub async fn shutdown(&self) {
        let _ = self.record(None, "daemon.stop", json!({})).await;
    }
}

fn generate_name() -> String {
    let mut bytes = [0u8; 4];
    let _ = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    format!(
        "cell-{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}
