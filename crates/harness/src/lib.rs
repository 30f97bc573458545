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

mod archive;
mod attached;
mod cells;
mod checkpoint;
mod error;
mod exec;
mod files;
mod history;
mod once;
mod pool;
mod process;
mod record;
mod state;
mod supervise;
pub mod tools;
mod usage;
mod workspace;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use warden_cell::{Backend, Cell, CellError, CellSpec, StartError, Status, Store};

impl Harness {
    /// The backend of the tier a policy names; a tier this warden cannot run is refused with
    /// the reason.
    pub(crate) fn backend(
        &self,
        tier: warden_policy::Tier,
    ) -> Result<Arc<dyn Backend>, HarnessError> {
        self.tiers
            .get(tier)
            .map_err(|e| HarnessError::from(CreateError::Refused(e.to_string())))
    }

    /// Undoes what applies left half done in the host directories of the kept layers, when a
    /// warden was killed during them (the tiers share one store: the default tier's answers for
    /// all). On a thread of its own, before the daemon answers; what could not be undone is
    /// said, and is undone at the next diff or apply of the directory or refused there.
    async fn recover_applies(&self) {
        let Ok(backend) = self.names() else {
            return;
        };
        let failed = tokio::task::spawn_blocking(move || backend.recover_applies())
            .await
            .unwrap_or_default();
        for (lower, why) in failed {
            eprintln!(
                "warden: note: an apply to {} was killed before it finished and could not be undone now: {why}",
                lower.display()
            );
        }
    }

    /// The backend that answers for any cell's name (every tier's cells share one registry).
    pub(crate) fn names(&self) -> Result<Arc<dyn Backend>, HarnessError> {
        self.tiers
            .default_tier()
            .map_err(|e| HarnessError::from(CellFailure::Unavailable(e.to_string())))
    }
}
use warden_journal::{Journal, Receipt};
pub use warden_protocol::{
    ApplyRequest, Approval, CellInfo, CellState, ControlAction, CreateCell, ExecSpec, ExitInfo,
    ExitReason, FileInfo, FileKind, ProcessInfo, RunOnce, Scope, Snapshot, Stream, TtySize, Usage,
};

pub use attached::{AttachedEnd, AttachedRun};
pub(crate) use cells::{Prepared, create_entry};
pub use files::{READ_LIMIT, WRITE_LIMIT};
pub use once::RunningOnce;
pub use pool::{PoolSpec, made_ahead};
pub use process::{Cursor, Item, KillOnDrop, LineHold, Process};
use state::State;
pub use state::{CellEntry, Grant, PolicySource};
use supervise::Live;
pub use usage::{USAGE_EVERY, USAGE_KEPT};

/// What kind of failure: the protocol's one vocabulary, which each face maps once onto its own
/// codes (HTTP status, exit status).
pub use warden_protocol::ErrorCode as ErrorKind;

pub use error::{
    ApprovalError, CellFailure, ControlError, CreateError, ExecError, Failure, FilesError,
    HarnessError, HistoryError, WorkspaceError,
};

impl HarnessError {
    fn not_found(name: &str) -> Self {
        CellFailure::NoCell(format!(
            "no cell `{name}` (list them with GET /v1/cells or `warden ps`)"
        ))
        .into()
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
    /// The tiers cells are made in (each cell in the one its policy names).
    pub tiers: Arc<warden_cell::Tiers>,
    /// A harness for the life of one command (`warden run` without a daemon): its database is
    /// in memory, it takes back no cells and writes no `daemon.*` entries, and nobody can answer
    /// its questions (a command rule that asks a person refuses instead). The journal is the
    /// daemon's, appended to beside it.
    pub ephemeral: bool,
    /// Cells made ahead, per policy (none for an ephemeral harness).
    pub pools: Vec<PoolSpec>,
}

/// The core.
#[derive(Debug)]
pub struct Harness {
    ephemeral: bool,
    tiers: Arc<warden_cell::Tiers>,
    /// The store of layers, snapshots and egress records (the tiers change the layers; the
    /// harness lists snapshots and reads records there).
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
    /// Cells being deleted: the delete journals their end itself.
    killing: Mutex<std::collections::HashSet<String>>,
    /// Names of cells a create is making now (from its checks to its answer): a second
    /// create of the name is refused while one is under way (see `cells::Creating`).
    creating: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Entries of run's cells from a pool, kept here for the run's life and never in the
    /// database (see `keep_behind`): what `entry` reads for them.
    handing: Mutex<std::collections::HashMap<String, CellEntry>>,
    /// Held while a cell's end is checked and marked (see `mark_ended`).
    ends: Mutex<()>,
    /// The handle of every live cell, from its tier.
    cells: Mutex<HashMap<String, Arc<dyn Cell>>>,
    /// Per cell, how far its egress record is copied into the journal (one copier at a time).
    copiers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<u64>>>>,
    /// What the journal's newest entries said at open: how far each record was copied, and
    /// which cells were deleted (see `state::JournalTail`).
    journaled: state::JournalTail,
    /// Every journaled entry, for the events stream, once it is on disk.
    events: tokio::sync::broadcast::Sender<Arc<Value>>,
    /// What the live cells used lately.
    usage: usage::UsageBook,
    /// Cells made ahead, per policy.
    pools: Vec<pool::Pool>,
    /// When this harness opened, and how long after that its latest entry (of anything but
    /// its pools) was journaled, in microseconds: pools make their cells when the daemon is
    /// quiet.
    opened: Instant,
    last_entry_us: AtomicU64,
    /// The thread that removes folders the daemon is done with (see `discard_folder`), once
    /// started; `None` where it could not be.
    remover: std::sync::OnceLock<Option<std::sync::mpsc::Sender<PathBuf>>>,
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
        let pools = match config.ephemeral {
            false => config
                .pools
                .iter()
                .cloned()
                .map(pool::Pool::new)
                .collect::<Result<Vec<_>, _>>()
                .and_then(pool::distinct)?,
            true => Vec::new(),
        };
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
                HarnessError::from(CellFailure::Core(format!(
                    "creating {}: {e}",
                    daemon_dir.display()
                )))
            })?;
        }
        let _ = std::fs::set_permissions(
            &daemon_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        );
        let store = Store::open(config.state.clone())
            .map_err(|e| HarnessError::from(CellFailure::Core(e.to_string())))?;
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
        .map_err(|e| {
            // A user whose home cannot be written (`nobody`'s is /nonexistent) is told where
            // Warden keeps its state and how to move it.
            let denied = matches!(&e, warden_journal::JournalError::Io { source, .. }
                if source.kind() == std::io::ErrorKind::PermissionDenied);
            HarnessError::from(CellFailure::Core(match denied {
                true => format!(
                    "{e}: Warden keeps its journal and layers in its state directory {}; set WARDEN_STATE_DIR to a directory this user may write",
                    config.state.display()
                ),
                false => e.to_string(),
            }))
        })?;
        let grants = state.grants()?;
        let (running, cut, journaled) = match config.ephemeral {
            false => {
                let (running, cut) = state::RunningLog::open(&daemon_dir.join("running.log"))?;
                let tail = state::journal_tail(journal.dir(), 16 << 20);
                (running, cut, tail)
            }
            true => (state::RunningLog::none(), Vec::new(), Default::default()),
        };
        let harness = Arc::new(Self {
            ephemeral: config.ephemeral,
            copiers: Mutex::new(HashMap::new()),
            journaled,
            running,
            live: Mutex::new(HashMap::new()),
            grants: Mutex::new(grants),
            exec_questions: Mutex::new(HashMap::new()),
            walled: Mutex::new(std::collections::HashSet::new()),
            killing: Mutex::new(std::collections::HashSet::new()),
            creating: Arc::new(Mutex::new(std::collections::HashSet::new())),
            handing: Mutex::new(std::collections::HashMap::new()),
            ends: Mutex::new(()),
            cells: Mutex::new(HashMap::new()),
            // Nothing subscribes to an ephemeral harness's entries (no face serves it): a
            // ring of one, not 1,024 slots made and written at every `warden run`.
            events: tokio::sync::broadcast::channel(match config.ephemeral {
                true => 1,
                false => 1024,
            })
            .0,
            usage: usage::UsageBook::new(),
            pools,
            opened: Instant::now(),
            last_entry_us: AtomicU64::new(0),
            remover: std::sync::OnceLock::new(),
            tiers: config.tiers,
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
        harness.sweep_gone();
        harness.end_cut_creates().await?;
        harness.recover_applies().await;
        harness.reconcile(cut).await?;
        harness.start_pools().await?;
        harness.sample_usage();
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

    /// Writes the daemon's last journal entry (an ephemeral harness removes its folder).
    /// The cells made ahead and never handed out are ended first.
    pub async fn shutdown(self: &Arc<Self>) {
        if self.ephemeral {
            let _ = std::fs::remove_dir_all(&self.daemon_dir);
            return;
        }
        self.drain_pools().await;
        // Deletes that answered while their keepers still took their cells down: what those
        // cells left is removed once each keeper has gone (see `delete`).
        let until = Instant::now() + Duration::from_secs(5);
        while self.killing.lock().is_ok_and(|k| !k.is_empty()) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Those whose keepers outlast that wait: the database forgets them now all the same.
        let _ = self.state.forget_all_pending();
        let _ = self.record(None, "daemon.stop", json!({})).await;
    }
}

/// Runs blocking control work on a thread that does nothing else meanwhile: freezing, thawing
/// and killing a cell never wait behind other blocking work (whatever a cell makes slow), nor
/// behind each other. The thread is one that waits for such work where one does (the
/// gateway's `Workers`: a thread's start and end were on every delete's way to its answer).
pub(crate) async fn on_own_thread<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, HarnessError> {
    static CONTROL: std::sync::LazyLock<Arc<warden_egress::Workers>> =
        std::sync::LazyLock::new(|| warden_egress::Workers::new("cell-control"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    CONTROL
        .run(move || {
            let _ = tx.send(work());
        })
        .map_err(|e| {
            HarnessError::from(CellFailure::Unavailable(format!("starting a thread: {e}")))
        })?;
    rx.await.map_err(|_| {
        HarnessError::from(CellFailure::Core(
            "the control thread ended without an answer".into(),
        ))
    })
}
