//! The harness: the core that every face (CLI, HTTP API, MCP, SDKs) calls.
//!
//! It owns the cells a daemon made, routes every request through the same steps (validate, record
//! in the journal, carry out through the cell crate, record the outcome) and remembers enough in
//! its embedded database to take its cells back after a crash.
//!
//! Cells are made and controlled through the tier boundary (`warden_cell::tier`): a `Backend`
//! makes them, and the harness keeps one `Cell` handle for each live one. The process tier's
//! cells are kept by their own small warden processes, outside the cell, which do not depend on
//! the daemon: `kill -9` of the daemon leaves every cell running, and the next daemon adopts
//! them through the backend.

mod attached;
mod exec;
mod files;
mod process;
mod state;
mod supervise;
mod workspace;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use warden_cell::{Backend, Cell, CellError, CellSpec, Registry, StartError, Status, Store};
use warden_journal::{Journal, Receipt};
pub use warden_protocol::{
    ApplyRequest, Approval, CellInfo, CellState, ControlAction, CreateCell, ExecSpec, ExitInfo,
    ExitReason, FileInfo, FileKind, ProcessInfo, Scope, Snapshot, Stream, TtySize, Usage,
};

pub use attached::{AttachedEnd, AttachedRun};
pub use files::READ_LIMIT;
pub use process::{Item, KillOnDrop, Process};
use state::State;
pub use state::{CellEntry, Grant, PolicySource};
use supervise::Live;

/// What kind of failure: the protocol's one vocabulary, which each face maps once onto its own
/// codes (HTTP status, exit status).
pub use warden_protocol::ErrorCode as ErrorKind;

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

/// Who sent a request, as the face that carried it identified them (the peer of the daemon's
/// unix socket, the bearer of its token): the journal records it with what was done.
#[derive(Debug, Clone)]
pub struct Caller(pub String);

/// Where the harness keeps things.
#[derive(Debug, Clone)]
pub struct Config {
    /// The runtime directory (cells' registry, the daemon's socket).
    pub runtime: PathBuf,
    /// The state directory (layers, egress records, the journal, the daemon's database).
    pub state: PathBuf,
    /// How the journal closes and keeps its segments.
    pub journal_segments: warden_journal::Segments,
    /// The tier cells are made in.
    pub backend: Arc<dyn Backend>,
    /// A harness for the life of one command (`warden run` without a daemon): its database is
    /// in memory, it takes back no cells and writes no `daemon.*` entries, and nobody can answer
    /// its questions (a command rule that asks a person refuses instead). The journal is the
    /// daemon's, appended to beside it.
    pub ephemeral: bool,
}

/// The core.
#[derive(Debug)]
pub struct Harness {
    ephemeral: bool,
    backend: Arc<dyn Backend>,
    /// The registry of running cells and the store of layers and snapshots: the workspace
    /// machinery every tier shares (diff, apply, snapshot, reset).
    registry: Registry,
    store: Store,
    journal: Journal,
    state: State,
    /// Notes of running processes (see `RunningLog`).
    running: state::RunningLog,
    daemon_dir: PathBuf,
    processes: Mutex<HashMap<String, Vec<Arc<Process>>>>,
    next_process: AtomicU64,
    /// The live cells this daemon supervises.
    live: Mutex<HashMap<String, Live>>,
    grants: Mutex<Vec<state::Grant>>,
    exec_questions: Mutex<HashMap<(String, u64), supervise::ExecQuestion>>,
    /// Cells killed by their wall-clock limit.
    walled: Mutex<std::collections::HashSet<String>>,
    /// The handle of every live cell, from its tier.
    cells: Mutex<HashMap<String, Arc<dyn Cell>>>,
    /// Per cell, how far its egress record is copied into the journal (one copier at a time).
    copiers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<u64>>>>,
    /// How far the journal's newest entries say each record was copied, as found at open.
    journaled_ends: HashMap<String, u64>,
    /// Every journaled entry, for the events stream, once it is on disk.
    events: tokio::sync::broadcast::Sender<Arc<Value>>,
}

/// Where a cell's keeper writes how the cell ended, in the daemon's folder of the cell.
const ENDING_FILE: &str = "ending.json";

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Harness {
    /// Opens the journal and the database and reconciles with the cells that exist now.
    pub async fn open(config: Config) -> Result<Arc<Self>, HarnessError> {
        let daemon_dir = match config.ephemeral {
            false => config.state.join("daemon"),
            // Keeper logs and endings of this process's cells only.
            true => config
                .state
                .join("runs")
                .join(std::process::id().to_string()),
        };
        if !config.ephemeral {
            std::fs::create_dir_all(daemon_dir.join("cells")).map_err(|e| {
                HarnessError::internal(format!("creating {}: {e}", daemon_dir.display()))
            })?;
        }
        let _ = std::fs::set_permissions(
            &daemon_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        );
        let registry = Registry::open(config.runtime.clone())
            .map_err(|e| HarnessError::internal(e.to_string()))?;
        let store =
            Store::open(config.state.clone()).map_err(|e| HarnessError::internal(e.to_string()))?;
        let state = match config.ephemeral {
            false => State::open(&daemon_dir.join("state.redb"))?,
            true => State::in_memory(),
        };
        let journal_dir = config.state.join("journal");
        // A harness for one command clones its cell from its own thread: the journal starts
        // no thread of its own before that (see `Backend::run_attached`).
        let journal = match config.ephemeral {
            false => Journal::open_with(&journal_dir, config.journal_segments),
            true => Journal::open_deferred(&journal_dir, config.journal_segments),
        }
        .map_err(|e| HarnessError::internal(e.to_string()))?;
        let grants = state.grants()?;
        let (running, cut, journaled_ends) = match config.ephemeral {
            false => {
                let (running, cut) = state::RunningLog::open(&daemon_dir.join("running.log"))?;
                let ends = state::journaled_record_ends(journal.dir(), 16 << 20);
                (running, cut, ends)
            }
            true => (state::RunningLog::none(), Vec::new(), HashMap::new()),
        };
        let harness = Arc::new(Self {
            ephemeral: config.ephemeral,
            copiers: Mutex::new(HashMap::new()),
            journaled_ends,
            running,
            live: Mutex::new(HashMap::new()),
            grants: Mutex::new(grants),
            exec_questions: Mutex::new(HashMap::new()),
            walled: Mutex::new(std::collections::HashSet::new()),
            cells: Mutex::new(HashMap::new()),
            events: tokio::sync::broadcast::channel(1024).0,
            backend: config.backend,
            registry,
            store,
            journal,
            state,
            daemon_dir,
            processes: Mutex::new(HashMap::new()),
            next_process: AtomicU64::new(1),
        });
        if harness.ephemeral {
            // Ids unique enough for one command's entries (no process outlives this harness).
            harness
                .next_process
                .store(u64::from(std::process::id()) * 1000 + 1, Ordering::Relaxed);
            return Ok(harness);
        }
        let start = harness
            .record(None, "daemon.start", json!({ "pid": std::process::id() }))
            .await?;
        // Process ids stay unique across restarts: they start above the journal's last entry.
        harness
            .next_process
            .store(start.seq * 1000 + 1, Ordering::Relaxed);
        harness.reconcile(cut).await?;
        Ok(harness)
    }

    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Entries as they are journaled, for the events stream (only the daemon's owner can
    /// connect to it).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Arc<Value>> {
        self.events.subscribe()
    }

    /// Journal entries after `after` (their sequence number), of `cell` only when given, as the
    /// events stream shows them: what a client that reconnects missed. Only the segments that
    /// can hold them are read.
    pub async fn entries_after(
        &self,
        after: u64,
        cell: Option<String>,
    ) -> Result<Vec<Value>, HarnessError> {
        let dir = self.journal.dir().to_path_buf();
        tokio::task::spawn_blocking(move || {
            let segments = warden_journal::segments(&dir)
                .map_err(|e| HarnessError::internal(format!("listing the journal: {e}")))?;
            // Closed segments are named by their first entry: skip those wholly at or before
            // `after`.
            let first_seq = |path: &Path| -> Option<u64> {
                path.file_name()?
                    .to_str()?
                    .strip_prefix("journal-")?
                    .strip_suffix(".jsonl")?
                    .parse()
                    .ok()
            };
            let mut start = 0;
            for (i, path) in segments.iter().enumerate() {
                if first_seq(path).is_some_and(|first| first <= after + 1) {
                    start = i;
                }
            }
            let mut out = Vec::new();
            for path in &segments[start..] {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    HarnessError::internal(format!("reading {}: {e}", path.display()))
                })?;
                for line in text.lines() {
                    let Ok(entry) = serde_json::from_str::<warden_journal::Entry>(line) else {
                        continue;
                    };
                    if entry.seq <= after
                        || cell
                            .as_deref()
                            .is_some_and(|c| entry.cell.as_deref() != Some(c))
                    {
                        continue;
                    }
                    out.push(json!({
                        "seq": entry.seq,
                        "cell": entry.cell,
                        "kind": entry.kind,
                        "data": entry.data,
                    }));
                }
            }
            Ok(out)
        })
        .await
        .map_err(|e| HarnessError::internal(e.to_string()))?
    }

    /// Appends to the journal and waits until it is on disk. Every entry goes to the events
    /// stream once it is on disk (whether or not anyone listens as it is made: a client that
    /// subscribes, then reads what it missed from the journal, must find each entry in one of
    /// the two).
    pub async fn record(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
    ) -> Result<Receipt, HarnessError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let event = Some(data.clone());
        self.journal
            .submit_leading(cell, kind, data, move |result| {
                let _ = tx.send(result);
            });
        let receipt = journaled(rx.await)?;
        self.announce(&receipt, cell, kind, event);
        Ok(receipt)
    }

    /// Appends entries about one cell in one group commit, and a signed checkpoint after them
    /// with `sign` (so that closing the journal then needs no write of its own), and waits
    /// until all are on disk.
    pub(crate) async fn record_all(
        &self,
        cell: &str,
        entries: Vec<(&str, Value)>,
        sign: bool,
    ) -> Result<Vec<Receipt>, HarnessError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let events = self.submit_all(cell, entries, sign, move |result| {
            let _ = tx.send(result);
        });
        let receipts = rx.await.unwrap_or_else(|_| Err(writer_gone()));
        self.announce_all(cell, receipts, events)
    }

    /// Like `record_all`, blocking the calling thread until the entries are on disk: for a
    /// caller that cannot await (a tier's `before_start`). A round no other thread has under
    /// way is run by this thread, so an ephemeral harness's blocks no longer than its write.
    pub(crate) fn record_all_blocking(
        &self,
        cell: &str,
        entries: Vec<(&str, Value)>,
        sign: bool,
    ) -> Result<Vec<Receipt>, HarnessError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let events = self.submit_all(cell, entries, sign, move |result| {
            let _ = tx.send(result);
        });
        let receipts = rx.recv().unwrap_or_else(|_| Err(writer_gone()));
        self.announce_all(cell, receipts, events)
    }

    /// Submits entries as one batch; returns them again, for the events stream.
    fn submit_all(
        &self,
        cell: &str,
        entries: Vec<(&str, Value)>,
        sign: bool,
        ack: impl FnOnce(Result<Vec<Receipt>, warden_journal::JournalError>) + Send + 'static,
    ) -> Vec<(String, Value)> {
        let entries: Vec<(String, Value)> = entries
            .into_iter()
            .map(|(kind, data)| (kind.to_owned(), data))
            .collect();
        self.journal
            .submit_batch(Some(cell), entries.clone(), sign, ack);
        entries
    }

    fn announce_all(
        &self,
        cell: &str,
        receipts: Result<Vec<Receipt>, warden_journal::JournalError>,
        events: Vec<(String, Value)>,
    ) -> Result<Vec<Receipt>, HarnessError> {
        let receipts =
            receipts.map_err(|err| HarnessError::new(ErrorKind::Unavailable, err.to_string()))?;
        for (receipt, (kind, data)) in receipts.iter().zip(events) {
            self.announce(receipt, Some(cell), &kind, Some(data));
        }
        Ok(receipts)
    }

    /// Appends entries of one kind about one cell (one group commit) and waits until all are
    /// on disk.
    pub(crate) async fn record_many(
        &self,
        cell: &str,
        kind: &str,
        entries: Vec<Value>,
    ) -> Result<(), HarnessError> {
        let mut waiting = Vec::with_capacity(entries.len());
        for data in entries {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let event = Some(data.clone());
            self.journal.submit(Some(cell), kind, data, move |result| {
                let _ = tx.send(result);
            });
            waiting.push((rx, event));
        }
        for (rx, event) in waiting {
            let receipt = journaled(rx.await)?;
            self.announce(&receipt, Some(cell), kind, event);
        }
        Ok(())
    }

    /// Appends to the journal and waits until the entry is in the file (a crash of the warden
    /// cannot lose it); the returned `Durable` resolves once it is on disk. For an effect that
    /// may start while the disk catches up, but must not be acknowledged before.
    pub(crate) async fn record_ahead(
        &self,
        cell: Option<&str>,
        kind: &str,
        data: Value,
    ) -> Result<Durable, HarnessError> {
        let (written_tx, written_rx) = tokio::sync::oneshot::channel();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let event = Some(data.clone());
        self.journal.submit_ahead(
            cell,
            kind,
            data,
            move |result| {
                let _ = written_tx.send(result);
            },
            move |result| {
                let _ = tx.send(result);
            },
        );
        let receipt = journaled(written_rx.await)?;
        Ok(Durable {
            receipt,
            synced: rx,
            event: event.map(|data| (cell.map(str::to_owned), kind.to_owned(), data)),
        })
    }

    /// Sends a journaled entry to the events stream.
    fn announce(&self, receipt: &Receipt, cell: Option<&str>, kind: &str, data: Option<Value>) {
        if let Some(data) = data {
            let _ = self.events.send(Arc::new(json!({
                "seq": receipt.seq,
                "cell": cell,
                "kind": kind,
                "data": data,
            })));
        }
    }

    /// Takes back the cells of an earlier daemon: live ones are watched again, dead ones are
    /// marked ended (their keepers already removed what they held).
    async fn reconcile(self: &Arc<Self>, cut: Vec<(u64, Value)>) -> Result<(), HarnessError> {
        // Processes the old daemon was relaying: their output pipes went with it, so the
        // keeper killed them when the daemon's end of their exec connection closed.
        for (id, note) in cut {
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
            let adopted = self.backend.adopt(&entry.name).map_err(|e| {
                HarnessError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "cannot tell whether cell `{}` still runs ({e}); start the daemon again once the host has descriptors and memory to spare",
                        entry.name,
                    ),
                )
            })?;
            if let Some(cell) = adopted {
                if let Ok(mut cells) = self.cells.lock() {
                    cells.insert(entry.name.clone(), cell);
                }
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
        if let Some(policy) = entry.policy_in_force() {
            self.adopt_with(entry, policy);
        }
    }

    /// Supervises a live cell whose policy in force is `policy`.
    fn adopt_with(&self, entry: &CellEntry, policy: warden_policy::Policy) {
        if let Ok(secrets) = warden_egress::Secrets::load(&policy.credentials) {
            self.journal
                .add_redactions(secrets.all.iter().map(|s| s.value.clone()));
        }
        if let Ok(mut live) = self.live.lock() {
            live.insert(entry.name.clone(), Live::new(policy));
        }
    }

    /// How the cell ended, as its keeper wrote it before letting go of the cell (`None` while
    /// it runs, or when the keeper died first).
    pub(crate) fn ending_of(&self, name: &str) -> Option<Value> {
        let path = self.daemon_dir.join("cells").join(name).join(ENDING_FILE);
        std::fs::read(path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
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

    /// The handle of a live cell of this daemon's.
    pub(crate) fn cell(&self, name: &str) -> Option<Arc<dyn Cell>> {
        self.cells.lock().ok()?.get(name).cloned()
    }

    fn info(&self, entry: &CellEntry) -> CellInfo {
        let cell = if entry.ended.is_none() {
            self.cell(&entry.name)
        } else {
            None
        };
        let state = match cell.as_ref().map(|c| c.status()) {
            Some(Ok(Status::Paused)) => CellState::Paused,
            Some(Ok(Status::Running) | Err(_)) => CellState::Running,
            Some(Ok(Status::Ended)) | None => CellState::Ended,
        };
        let processes = self
            .processes
            .lock()
            .map(|p| p.get(&entry.name).map_or(0, Vec::len))
            .unwrap_or(0);
        CellInfo {
            name: entry.name.clone(),
            state,
            pid: cell
                .as_ref()
                .filter(|_| state != CellState::Ended)
                .and_then(|c| c.pid()),
            created_ms: entry.created_ms,
            workspace: entry.workspace.clone(),
            labels: entry.labels.clone(),
            ended: entry
                .ended
                .clone()
                .or_else(|| (state == CellState::Ended).then(|| "its processes ended".to_owned())),
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
        let Prepared {
            name,
            parsed,
            from,
            entry,
        } = self.prepare(&request, None).await?;
        self.record(
            Some(&name),
            "cell.create",
            create_entry(&entry, &request, &from),
        )
        .await?;
        let cell_dir = self.daemon_dir.join("cells").join(&name);
        let _ = std::fs::remove_dir_all(&cell_dir);
        std::fs::create_dir_all(&cell_dir)
            .map_err(|e| HarnessError::internal(format!("creating {}: {e}", cell_dir.display())))?;
        let mut spec_policy = parsed.clone();
        // The daemon applies the wall-clock limit itself (with the policy's `on_wall`).
        spec_policy.limits.wall = None;
        let spec = CellSpec {
            name: name.clone(),
            policy: spec_policy,
            workspace: if from.is_some() {
                None
            } else {
                request.workspace.as_ref().map(PathBuf::from)
            },
            from: from.clone(),
            env: request.env.clone().into_iter().collect(),
            report: Some(cell_dir.join(ENDING_FILE)),
            log: Some(cell_dir.join("keeper.log")),
            secrets: request.secrets.clone().into_iter().collect(),
        };
        let backend = Arc::clone(&self.backend);
        let started = tokio::task::spawn_blocking(move || backend.start(spec))
            .await
            .map_err(|e| HarnessError::internal(format!("starting the cell: {e}")))?;
        let cell = match started {
            Ok(cell) => cell,
            Err(StartError::Refused(message)) => {
                self.record(Some(&name), "cell.fail", json!({ "error": message }))
                    .await?;
                return Err(HarnessError::bad(format!(
                    "cell `{name}` could not start: {message}"
                )));
            }
            Err(err @ StartError::TimedOut(_)) => {
                return Err(HarnessError::internal(err.to_string()));
            }
            Err(StartError::Host(message)) => {
                self.record(Some(&name), "cell.fail", json!({ "error": message }))
                    .await?;
                return Err(HarnessError::new(
                    ErrorKind::Unavailable,
                    format!("cell `{name}` could not start: {message}"),
                ));
            }
        };
        let pid = cell.pid();
        if let Ok(mut cells) = self.cells.lock() {
            cells.insert(name.clone(), cell);
        }
        self.state.put(&entry)?;
        // A record of an earlier cell of this name is gone with it: copying starts over.
        self.state.set_record_offset(&name, None)?;
        if let Ok(mut copiers) = self.copiers.lock() {
            copiers.insert(name.clone(), Arc::new(tokio::sync::Mutex::new(0)));
        }
        self.adopt_with(&entry, parsed);
        self.record(Some(&name), "cell.start", json!({ "pid": pid }))
            .await?;
        self.watch(name.clone());
        Ok(self.info(&entry))
    }

    /// Checks a request for a cell (name, policy, environment, secrets, workspace, that no cell
    /// has its name), and takes the snapshot it forks from: everything before the journal's
    /// `cell.create`, the same for a cell of the daemon and for `warden run` without one.
    /// Checks a create request and makes its entry. `parsed`: the request's policy text, parsed
    /// already by an in-process caller (not parsed twice).
    async fn prepare(
        self: &Arc<Self>,
        request: &CreateCell,
        parsed: Option<warden_policy::Policy>,
    ) -> Result<Prepared, HarnessError> {
        let name = match &request.name {
            Some(name) => name.clone(),
            None => generate_name(),
        };
        self.backend
            .check_name(&name)
            .map_err(|e| HarnessError::bad(e.to_string()))?;
        let (policy, parsed) = match (&request.policy, &request.preset) {
            (Some(_), Some(_)) => {
                return Err(HarnessError::bad(
                    "give either `policy` (YAML text) or `preset`, not both",
                ));
            }
            (Some(yaml), None) => (
                PolicySource::Yaml(yaml.clone()),
                match parsed {
                    Some(parsed) => parsed,
                    None => warden_policy::from_yaml("policy", yaml)
                        .map_err(|e| HarnessError::bad(e.to_string()))?,
                },
            ),
            (None, preset) => {
                let preset = preset.clone().unwrap_or_else(|| "default".to_owned());
                let parsed =
                    warden_policy::preset(&preset).map_err(|e| HarnessError::bad(e.to_string()))?;
                (PolicySource::Preset(preset), parsed)
            }
        };
        for key in request.env.keys() {
            if key.is_empty() || key.contains(['=', '\0']) {
                return Err(HarnessError::bad(format!(
                    "environment variable name `{key}` is empty or contains `=` or NUL"
                )));
            }
        }
        // Secrets only for the variables the policy's credentials read.
        let wanted: Vec<&str> = parsed
            .credentials
            .values()
            .filter_map(|c| c.from_env.as_deref())
            .collect();
        if let Some(extra) = request
            .secrets
            .keys()
            .find(|k| !wanted.contains(&k.as_str()))
        {
            return Err(HarnessError::bad(format!(
                "secrets: `{extra}` is not read by any credential of the policy (their from_env: {})",
                if wanted.is_empty() {
                    "none".to_owned()
                } else {
                    wanted.join(", ")
                }
            )));
        }
        self.journal
            .add_redactions(request.secrets.values().cloned());
        if let Some(dir) = &request.workspace
            && !Path::new(dir).is_dir()
        {
            return Err(HarnessError::bad(format!(
                "workspace {dir} does not exist or is not a directory on the host; create it or pass another"
            )));
        }
        let exists = self.backend.exists(&name);
        if let Some(old) = self.state.get(&name)?
            && (old.ended.is_none() || exists)
        {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!("a cell named `{name}` exists; delete it first or pick another name"),
            ));
        }
        if exists {
            return Err(HarnessError::new(
                ErrorKind::Conflict,
                format!(
                    "a cell named `{name}` is already running; pick another name or stop it with `warden kill {name}`"
                ),
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
            replaced: None,
        };
        Ok(Prepared {
            name,
            parsed,
            from,
            entry,
        })
    }

    fn live(&self, name: &str) -> Result<Arc<dyn Cell>, HarnessError> {
        self.live_with_status(name).map(|(cell, _)| cell)
    }

    /// The handle of a live cell, with its status as its tier says it now (running or paused;
    /// running when that cannot be told).
    pub(crate) fn live_with_status(
        &self,
        name: &str,
    ) -> Result<(Arc<dyn Cell>, Status), HarnessError> {
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
        let ended = || HarnessError::new(ErrorKind::Conflict, format!("cell `{name}` has ended"));
        let cell = self.cell(name).ok_or_else(ended)?;
        match cell.status() {
            Ok(Status::Ended) => Err(ended()),
            Ok(status) => Ok((cell, status)),
            Err(_) => Ok((cell, Status::Running)),
        }
    }

    /// Freezes, thaws or kills a cell, from outside.
    pub async fn control(
        &self,
        name: &str,
        action: ControlAction,
        by: &str,
    ) -> Result<CellInfo, HarnessError> {
        let cell = self.live(name)?;
        self.record(
            Some(name),
            &format!("cell.{}", action.name()),
            json!({ "by": by }),
        )
        .await?;
        if action == ControlAction::Resume
            && let Ok(mut live) = self.live.lock()
            && let Some(l) = live.get_mut(name)
        {
            l.idle_paused = false;
            l.last_activity = Instant::now();
        }
        if action == ControlAction::Kill {
            let _ = std::fs::write(self.daemon_dir.join("cells").join(name).join("killed"), "");
        }
        let handle = Arc::clone(&cell);
        let result = on_own_thread("cell-control", move || match action {
            ControlAction::Pause => handle.freeze(),
            ControlAction::Resume => handle.thaw(),
            ControlAction::Kill => handle.kill(),
        })
        .await?;
        match result {
            Ok(()) => {}
            // A cell that ended on its own between the check and the kill is what a kill wants.
            Err(CellError::Ended(_)) if action == ControlAction::Kill => {}
            Err(err) => return Err(HarnessError::new(ErrorKind::Conflict, err.to_string())),
        }
        if action == ControlAction::Kill {
            // Wait (bounded) until the tier has let go of the cell.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !matches!(cell.status(), Ok(Status::Ended)) && Instant::now() < deadline {
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
        if entry.ended.is_none() && self.live(name).is_ok() {
            self.control(name, ControlAction::Kill, by).await?;
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
        if let Ok(mut cells) = self.cells.lock() {
            cells.remove(name);
        }
        let _ = warden_cell::changes::remove(&self.registry, &self.store, name);
        let _ = std::fs::remove_file(self.store.net_log_path(name));
        if let Ok(mut copiers) = self.copiers.lock() {
            copiers.remove(name);
        }
        let _ = self.state.set_record_offset(name, None);
        let _ = self.state.forget_questions(name);
        let _ = self.state.forget_grants_of(name);
        if let Ok(mut grants) = self.grants.lock() {
            grants.retain(|g| g.cell.as_deref() != Some(name));
        }
        let _ = std::fs::remove_dir_all(self.daemon_dir.join("cells").join(name));
        self.state.remove(name)
    }

    /// Writes the daemon's last journal entry (an ephemeral harness removes its folder).
    pub async fn shutdown(&self) {
        if self.ephemeral {
            let _ = std::fs::remove_dir_all(&self.daemon_dir);
            return;
        }
        let _ = self.record(None, "daemon.stop", json!({})).await;
    }
}

/// Runs blocking control work on a thread of its own: freezing, thawing and killing a cell never
/// wait behind other blocking work (whatever a cell makes slow), and never behind each other.
pub(crate) async fn on_own_thread<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, HarnessError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(work());
        })
        .map_err(|e| {
            HarnessError::new(ErrorKind::Unavailable, format!("starting a thread: {e}"))
        })?;
    rx.await
        .map_err(|_| HarnessError::internal("the control thread ended without an answer"))
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

/// A checked request for a cell.
pub(crate) struct Prepared {
    name: String,
    /// Its policy, resolved.
    parsed: warden_policy::Policy,
    /// The snapshot it starts from.
    from: Option<String>,
    entry: CellEntry,
}

/// What the journal's `cell.create` says.
pub(crate) fn create_entry(
    entry: &CellEntry,
    request: &CreateCell,
    from: &Option<String>,
) -> Value {
    json!({
        "policy": match &entry.policy {
            PolicySource::Preset(p) => json!({ "preset": p }),
            PolicySource::Yaml(y) => json!({ "yaml": y }),
        },
        "workspace": request.workspace,
        "from": from,
        "labels": request.labels,
        "env": request.env.keys().collect::<Vec<_>>(),
    })
}

/// An entry in the journal's file that is still on its way to the disk.
pub(crate) struct Durable {
    pub(crate) receipt: Receipt,
    synced: tokio::sync::oneshot::Receiver<Result<Receipt, warden_journal::JournalError>>,
    event: Option<(Option<String>, String, Value)>,
}

impl Durable {
    /// Waits until the entry is on disk.
    pub(crate) async fn wait(self, harness: &Harness) -> Result<Receipt, HarnessError> {
        let receipt = journaled(self.synced.await)?;
        if let Some((cell, kind, data)) = self.event {
            harness.announce(&receipt, cell.as_deref(), &kind, Some(data));
        }
        Ok(receipt)
    }
}

fn journaled(
    answer: Result<
        Result<Receipt, warden_journal::JournalError>,
        tokio::sync::oneshot::error::RecvError,
    >,
) -> Result<Receipt, HarnessError> {
    answer
        .unwrap_or_else(|_| Err(writer_gone()))
        .map_err(|err| HarnessError::new(ErrorKind::Unavailable, err.to_string()))
}

fn writer_gone() -> warden_journal::JournalError {
    warden_journal::JournalError::Stopped("its writer is gone".to_owned())
}
