//! The tier boundary: what the harness asks of an isolation tier, and nothing more.
//!
//! A [`Backend`] makes cells from a typed [`CellSpec`] and takes back the ones that still run
//! after a daemon restart; a [`Cell`] is the handle of one of them: exec and file operations
//! (each a [`Session`] that yields typed [`ExecEvent`]s), freeze, thaw and kill from outside,
//! its status, and its egress gateway's questions and rules. The process tier
//! (`crates/cell/src/process`) is one implementation; the `fake` feature gives another, for
//! tests of the harness without root and without the kernel's isolation. A new tier plugs in
//! here: it implements these three traits and gets a case in [`backend`].
//!
//! Everything here is blocking: the harness calls control on threads of its own (it never
//! waits behind work a cell can stall), a start on the runtime's blocking pool, and what
//! answers at once (status, an exec's request) where it is.

use std::fmt::Debug;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use warden_policy::{Policy, Tier};

pub use crate::process::exec::{ExecEvent, ExecRequest};
pub use crate::process::files::{FileEntry, FileError, FileErrorKind, FileOp};
pub use crate::process::outcome::{Ending, Release};
pub use warden_egress::Question;

/// Everything a tier needs to make one cell: a serialized request, the same for every tier
/// (the process tier hands it to the cell's keeper as JSON on its stdin).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CellSpec {
    pub name: String,
    /// The policy in force, resolved (presets and `extends:` already applied).
    pub policy: Policy,
    /// Host directory at the policy's workspace mount (copy-on-write).
    #[serde(default)]
    pub workspace: Option<PathBuf>,
    /// Start from this snapshot (`CELL@SNAP`) instead of a workspace.
    #[serde(default)]
    pub from: Option<String>,
    /// Added to the environment of every process of the cell.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Where the tier writes how the cell ended (JSON), before its name is released.
    #[serde(default)]
    pub report: Option<PathBuf>,
    /// Where the tier writes what it has to say while it keeps the cell.
    #[serde(default)]
    pub log: Option<PathBuf>,
    /// Bring the cell back from this memory image (a checkpoint's, see
    /// [`Backend::checkpoint`]) instead of starting it afresh; its workspace is `from`.
    #[serde(default)]
    pub restore: Option<PathBuf>,
    /// The variables its credentials read (`from_env`), with their values. Never serialized:
    /// the process tier passes them in its keeper's environment, never in a file or argv.
    #[serde(skip)]
    pub secrets: Vec<(String, String)>,
}

/// A cell's state as its tier sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Running,
    Paused,
    Ended,
}

/// Why a tier could not do what it was asked; each carries the whole message.
#[derive(Debug, thiserror::Error)]
pub enum CellError {
    /// The cell does not run (any more).
    #[error("{0}")]
    Ended(String),
    /// The cell runs, but cannot do this now (paused, no freezer, no gateway, its keeper is
    /// busy or refused).
    #[error("{0}")]
    Refused(String),
    /// This tier cannot do this at all.
    #[error("{0}")]
    Unsupported(String),
    /// A request that could never succeed (a bad name, a rule file that does not parse).
    #[error("{0}")]
    Invalid(String),
    /// The host is short of something, or failed: trying again later may work.
    #[error("{0}")]
    Host(String),
}

/// A cell could not be made.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// What the tier said, in its words (the policy cannot be met here, the name is taken...).
    #[error("{0}")]
    Refused(String),
    /// It did not come up in time.
    #[error("{0}")]
    TimedOut(String),
    #[error("{0}")]
    Host(String),
}

/// One process (or file operation) started in a cell, seen from outside: its events arrive on
/// a descriptor that polls readable when one is there (`AsRawFd`), so that a caller can await
/// them on an event loop; signals reach it through here.
pub trait Session: AsRawFd + Send + Sync + Debug {
    /// The next event, if one has arrived, with the descriptors that came with it (a
    /// terminal's master comes with `started`); `None` when none has yet. `Ended` when the
    /// cell went away first.
    fn try_next_event(&self) -> Result<Option<(ExecEvent, Vec<OwnedFd>)>, CellError>;
    /// Sends a signal to the process's group.
    fn signal(&self, signal: i32) -> Result<(), CellError>;
}

/// The handle of one running cell.
pub trait Cell: Send + Sync + Debug {
    fn name(&self) -> &str;
    /// The host pid of the cell's first process, where the tier has one.
    fn pid(&self) -> Option<i32>;
    /// Whether it runs; `Err` when that cannot be told now (never taken for an end).
    fn status(&self) -> Result<Status, CellError>;
    /// How many processes its memory limit has killed so far, where the tier counts them.
    fn oom_kills(&self) -> Option<u64>;
    /// What it uses now (CPU time, memory, tasks), where the tier accounts for it.
    fn usage(&self) -> Option<warden_protocol::CellUsage>;
    fn freeze(&self) -> Result<(), CellError>;
    fn thaw(&self) -> Result<(), CellError>;
    /// Ends every process of the cell, frozen or not. `Ended` when it had ended already.
    fn kill(&self) -> Result<(), CellError>;
    /// Waits (bounded, 10 s) until no process of a killed cell can run any more (for a tier
    /// whose cell ends with one process, its pid namespace's init, that process's end); its
    /// keeper may still be taking down its cgroups and files ([`Cell::wait_ended`] waits for
    /// that too, which is this by default); whether it did.
    fn wait_stopped(&self) -> bool {
        self.wait_ended()
    }
    /// Waits (bounded, 10 s) until a killed cell's tier has let go of it, its keeper included:
    /// looked at often at first (a cell with little in it is gone within a millisecond or two),
    /// then every 5 ms, and at once when its `end_waker` wakes; whether it did.
    fn wait_ended(&self) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut pause = std::time::Duration::from_micros(200);
        let mut waker = self.end_waker();
        loop {
            if matches!(self.status(), Ok(Status::Ended)) {
                return true;
            }
            if std::time::Instant::now() > deadline {
                return false;
            }
            match &waker {
                // Readable once for good: from then on, plain sleeps.
                Some(fd) if readable_within(fd, pause) => waker = None,
                Some(_) => {}
                None => std::thread::sleep(pause),
            }
            pause = (pause * 2).min(std::time::Duration::from_millis(5));
        }
    }
    /// Whether an exec asked for as the cell's last (`ExecRequest::last`) ends the cell: its end
    /// is told only once every other process of the cell has been killed and reaped, and the
    /// cell then ends (the process tier: the init ends the others, tells the end, and exits);
    /// `false`: the flag is ignored, and the cell runs on until it is killed.
    fn ends_with_last_process(&self) -> bool {
        false
    }
    /// Holds the tier's teardown of the cell once it is killed, until the returned descriptor
    /// is closed (for as long as the tier allows), where the tier can: a delete takes it before
    /// its kill and lets go once it has answered, so that the teardown does not share the CPUs
    /// with the answer.
    fn hold_teardown(&self) -> Option<OwnedFd> {
        None
    }
    /// A descriptor that becomes readable when the tier is about to let go of the cell (the
    /// process tier: a pidfd of its keeper), so that `wait_ended` need not sleep past it. The
    /// status still decides: a waker that wakes early only makes the wait look again.
    fn end_waker(&self) -> Option<OwnedFd> {
        None
    }
    /// Starts a process: with these descriptors as its stdin, stdout and stderr, or, where the
    /// request asks for a terminal, on one of the cell's own (its master comes back).
    fn exec(
        &self,
        request: &ExecRequest,
        stdio: Option<[&OwnedFd; 3]>,
    ) -> Result<Arc<dyn Session>, CellError>;
    /// Runs one file operation inside the cell, relative to `root` (a directory of the cell):
    /// stdin, stdout and stderr carry its data, its answer and its error (a [`FileError`]).
    fn file_op(
        &self,
        root: &str,
        op: &FileOp,
        stdio: [&OwnedFd; 3],
    ) -> Result<Arc<dyn Session>, CellError>;
    /// The questions its gateway's `ask` rules are waiting on, oldest first.
    fn questions(&self) -> Vec<Question>;
    /// Answers question `id` of its gateway.
    fn answer(&self, id: u64, allow: bool) -> Result<(), CellError>;
    /// Replaces its gateway's network rules with those of the policy in `file`; how many open
    /// connections the new rules closed.
    fn set_network_rules(&self, file: &std::path::Path) -> Result<u64, CellError>;
}

/// How a cell run with one command in the caller's process ended.
#[derive(Debug, Clone)]
pub struct Attached {
    pub name: String,
    pub ending: Ending,
    /// Where limits could only be approximated on this host.
    pub notices: Vec<String>,
    /// The cell changed its copy-on-write workspace, and the layer was kept for review.
    pub kept_changes: bool,
    /// The release of the cell's name, where it goes on meanwhile: waited for before its layer
    /// is touched, and at the latest when dropped.
    pub release: Release,
}

/// Where a tier keeps its cells' workspace layers (the registry of running cells, which says
/// whether a cell runs and how to hold it still, and the store of layers and snapshots).
#[derive(Debug, Clone)]
pub struct Layers {
    pub registry: crate::Registry,
    pub store: crate::Store,
}

pub use crate::process::changes::ChangesError;
pub use crate::process::snapshot::SnapshotError;

/// What a doctor's check found.
pub use crate::check::{Check, Status as CheckStatus};

/// An isolation tier.
pub trait Backend: Send + Sync + Debug {
    /// The tier's name, as policies name it.
    fn tier(&self) -> Tier;
    /// Whether `name` can name a cell of this tier.
    fn check_name(&self, name: &str) -> Result<(), CellError>;
    /// Checks, before anything is made or journaled, what only the tier and this host can tell
    /// of a request: that the tier runs here, that the paths its policy shows and its
    /// workspace can be given to a cell (none of Warden's own).
    fn check(&self, policy: &Policy, workspace: Option<&std::path::Path>) -> Result<(), CellError>;
    /// Makes a cell and returns once it takes execs.
    fn start(&self, spec: CellSpec) -> Result<Arc<dyn Cell>, StartError>;
    /// Makes a cell that runs `argv` in the caller's own process, with the caller's stdin,
    /// stdout and stderr, and returns once it ended (`warden run` without a daemon: no keeper
    /// to start, so it costs no more than the cell). `discard_changes`: its workspace layer and
    /// egress record go with it. The request has passed `check` (the caller's duty: it is not
    /// repeated here). The process tier clones the cell from the calling thread, whose clone
    /// goes on without the others: call it while the process has no other thread (a lock one
    /// of them held at that moment would be held in the cell's init for ever). `before_start`
    /// is called once the cell is made and before its command may run (after the clone: it
    /// may start threads; perhaps on a thread of its own, so it is `Send`); when it fails, the
    /// cell ends with nothing run and the call fails with `StartError::Host` and its message.
    fn run_attached(
        &self,
        spec: CellSpec,
        argv: Vec<std::ffi::OsString>,
        discard_changes: bool,
        before_start: &mut (dyn FnMut() -> Result<(), String> + Send),
    ) -> Result<Attached, StartError>;
    /// Starts making ahead what a `run_attached` of a cell of `policy`, to come in this
    /// process, can use (the process tier, as root: the cell's network namespace), on threads
    /// of its own that are gone before anything is cloned: call it once the signals the run
    /// forwards are blocked (threads take their maker's mask). By default, nothing, and a
    /// network namespace begun at the run's start (`start_network_early`) is let go of.
    fn prepare_run(&self, policy: &Policy) {
        let _ = policy;
        #[cfg(target_os = "linux")]
        crate::netns::let_go_of_early();
    }
    /// Waits for the starts a killed process left under way (a keeper told its cell's request,
    /// its starter gone before the cell was ready) to publish their cell or end, so that
    /// `adopt` then tells a cell that runs from one that is not there. Called by a daemon as it
    /// starts, before it looks for the cells a killed daemon was making. By default, nothing.
    fn settle_starts(&self) {}
    /// Takes back a cell started earlier (by this process or another): `None` once it has
    /// ended; `Err` when that cannot be told now.
    fn adopt(&self, name: &str) -> Result<Option<Arc<dyn Cell>>, CellError>;
    /// Whether a cell of this name runs now (made by anyone: a daemon, a `warden run`).
    fn exists(&self, name: &str) -> bool {
        matches!(self.adopt(name), Ok(Some(_)))
    }
    /// What the host offers this tier (for `warden doctor`).
    fn probe(&self) -> Vec<Check>;
    /// Where the tier keeps its cells' copy-on-write workspace layers, for the workspace
    /// machinery every tier shares (`None`: it has none). The workspace operations below read
    /// and change the layers there; a tier that keeps them otherwise overrides those.
    fn layers(&self) -> Option<Layers>;

    /// Undoes what applies to the host directories of this tier's kept layers left half done
    /// when a warden was killed during them (`warden_workspace::recover`, which the next diff or
    /// apply of a directory runs too): a daemon calls it as it starts, so that a host directory
    /// does not stay half applied until then. Each directory it could not undo, with why.
    fn recover_applies(&self) -> Vec<(std::path::PathBuf, String)> {
        let Some(layers) = self.layers() else {
            return Vec::new();
        };
        let key = layers.store.apply_key();
        let mut lowers: Vec<std::path::PathBuf> = layers
            .store
            .layers()
            .into_iter()
            .map(|(_, meta)| meta.lower)
            .collect();
        lowers.sort();
        lowers.dedup();
        lowers
            .into_iter()
            .filter_map(|lower| {
                let failed = warden_workspace::recover(&lower, key.as_ref()).err()?;
                Some((lower, failed.to_string()))
            })
            .collect()
    }

    /// What cell `name` changed in its workspace, running or stopped (a running cell is held
    /// still while its layer is read).
    fn diff(
        &self,
        name: &str,
    ) -> Result<(warden_workspace::Diff, warden_workspace::LayerMeta), ChangesError> {
        let layers = self.no_layers(name)?;
        crate::changes::diff(&layers.registry, &layers.store, name)
    }

    /// Writes chosen changes of cell `name`'s workspace into its host directory.
    fn apply(
        &self,
        name: &str,
        options: warden_workspace::ApplyOptions,
    ) -> Result<warden_workspace::ApplyReport, ChangesError> {
        let layers = self.no_layers(name)?;
        crate::changes::apply(&layers.registry, &layers.store, name, options)
    }

    /// Saves cell `name`'s workspace as the immutable snapshot `NAME@AS`.
    fn snapshot(
        &self,
        name: &str,
        as_name: Option<&str>,
    ) -> Result<crate::SnapshotInfo, SnapshotError> {
        let layers = self.no_layers(name)?;
        crate::snapshot::take(&layers.registry, &layers.store, name, as_name)
    }

    /// Returns cell `name`'s workspace to snapshot `to` (`CELL@SNAP`), or to its start; a
    /// running cell sees the change at once.
    fn reset(&self, name: &str, to: Option<&str>) -> Result<(), SnapshotError> {
        let layers = self.no_layers(name)?;
        crate::snapshot::reset(&layers.registry, &layers.store, name, to)
    }

    /// Removes a stopped cell's workspace layer (its unapplied changes are lost).
    fn remove_layer(&self, name: &str) -> Result<(), ChangesError> {
        let layers = self.no_layers(name)?;
        crate::snapshot::remove_layer(&layers.registry, &layers.store, name)
    }

    #[doc(hidden)]
    fn no_layers(&self, name: &str) -> Result<Layers, ChangesError> {
        self.layers()
            .ok_or_else(|| ChangesError::NoLayer(name.to_owned()))
    }

    /// Saves the memory of cell `name` (every process, where it was) into the directory
    /// `image`, and ends the cell. `while_held` is called while the cell is held still, before
    /// its memory is saved (the caller snapshots the workspace there, so that both are of one
    /// moment); when it fails, the cell goes on as it was. A cell made with `restore` of the
    /// image comes back from it.
    fn checkpoint(
        &self,
        name: &str,
        image: &std::path::Path,
        while_held: &mut dyn FnMut() -> Result<(), String>,
    ) -> Result<(), CellError> {
        let _ = (name, image, while_held);
        Err(CellError::Unsupported(format!(
            "the {} tier has no memory snapshots; a cell of `tier: gvisor` has (`warden checkpoint`)",
            self.tier().name()
        )))
    }
}

/// Where the process tier keeps things, and how it starts keepers.
#[derive(Debug, Clone)]
pub struct ProcessConfig {
    /// The runtime directory (the cells' registry).
    pub runtime: PathBuf,
    /// The state directory (layers, egress records).
    pub state: PathBuf,
    /// The `warden` binary, started as each cell's keeper (`warden keep`).
    pub warden_exe: PathBuf,
    /// The soft limit of open files to give keepers (and so cells) back, where the caller
    /// raised its own.
    pub keeper_open_files: Option<u64>,
    /// Environment the keepers get besides the secrets (where they find the directories).
    pub keeper_env: Vec<(String, String)>,
    /// Keepers to start ahead of the cells they will keep (a daemon's: a cell made then
    /// does not wait for the `warden` binary to start); 0: each when its cell is made.
    pub keepers_ahead: usize,
}

/// Waits at most `wait` (to the microsecond, unlike `poll`'s milliseconds) for `fd` to be
/// readable: whether it is.
fn readable_within(fd: &OwnedFd, wait: std::time::Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let timeout = Timespec {
        tv_sec: wait.as_secs() as _,
        tv_nsec: wait.subsec_nanos() as _,
    };
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    matches!(poll(&mut fds, Some(&timeout)), Ok(n) if n > 0)
}
