//! How a cell ended, what a run reports beside it, and what may stop a run: shared by the
//! process tier's run, its relay and keeper, and the gVisor tier's keeper.

use std::io;
use std::time::Duration;

use super::cgroup::CgroupError;
use super::plan::PlanError;
use super::registry::RegistryError;

/// How a cell ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// The command exited with this code.
    Exited(i32),
    /// The command was killed by this signal.
    Signaled(i32),
    MemoryLimit {
        limit: u64,
    },
    WallLimit {
        limit: Duration,
    },
    OutputLimit {
        limit: u64,
    },
    /// The workspace layer passed `limits.disk` where only the warden's watch keeps it.
    DiskLimit {
        limit: u64,
    },
    /// `warden kill` ended it.
    Killed,
    CommandNotFound(String),
    CannotExecute(String),
}

impl Ending {
    /// The ending as JSON: `reason` (`exited`, `signaled`, `memory-limit`, `wall-limit`,
    /// `output-limit`, `disk-limit`, `killed`, `not-found`, `not-executable`), with `code`, `signal`,
    /// `limit` and `message` where they apply.
    pub fn report(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Self::Exited(code) => json!({ "reason": "exited", "code": code }),
            Self::Signaled(signal) => json!({ "reason": "signaled", "signal": signal }),
            Self::MemoryLimit { limit } => json!({
                "reason": "memory-limit",
                "limit": limit,
                "message": format!(
                    "the cell's memory limit ({}) was reached and the kernel ended it (files in its /tmp and /dev/shm count towards the limit)",
                    warden_policy::ByteSize(*limit)
                ),
            }),
            Self::WallLimit { limit } => {
                json!({ "reason": "wall-limit", "limit_ms": limit.as_millis() as u64 })
            }
            Self::OutputLimit { limit } => json!({ "reason": "output-limit", "limit": limit }),
            Self::DiskLimit { limit } => json!({
                "reason": "disk-limit",
                "limit": limit,
                "message": format!(
                    "the cell's workspace passed its disk limit ({}) and the warden ended it",
                    warden_policy::ByteSize(*limit)
                ),
            }),
            Self::Killed => json!({ "reason": "killed" }),
            Self::CommandNotFound(message) => json!({ "reason": "not-found", "message": message }),
            Self::CannotExecute(message) => {
                json!({ "reason": "not-executable", "message": message })
            }
        }
    }
}

impl Ending {
    /// The ending a report (see [`Ending::report`]) says.
    pub fn from_report(report: &serde_json::Value) -> Option<Self> {
        let number = |key: &str| report[key].as_i64();
        let message = || report["message"].as_str().unwrap_or_default().to_owned();
        Some(match report["reason"].as_str()? {
            "exited" => Self::Exited(number("code")? as i32),
            "signaled" => Self::Signaled(number("signal")? as i32),
            "memory-limit" => Self::MemoryLimit {
                limit: report["limit"].as_u64()?,
            },
            "wall-limit" => Self::WallLimit {
                limit: Duration::from_millis(report["limit_ms"].as_u64()?),
            },
            "output-limit" => Self::OutputLimit {
                limit: report["limit"].as_u64()?,
            },
            "disk-limit" => Self::DiskLimit {
                limit: report["limit"].as_u64()?,
            },
            "killed" => Self::Killed,
            "not-found" => Self::CommandNotFound(message()),
            "not-executable" => Self::CannotExecute(message()),
            _ => return None,
        })
    }
}

/// What `run` reports beside the ending.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub name: String,
    pub ending: Ending,
    /// Set when limits could only be approximated (no writable cgroup).
    pub notices: Vec<String>,
    /// The cell changed its copy-on-write workspace, and the layer was kept for review.
    pub kept_changes: bool,
    /// The release of the cell's name, where it goes on after the run returns.
    pub release: Release,
}

/// The release of an ended cell's name (its runtime folder removed, its lock let go of) going
/// on on a thread of its own, where the caller has other work meanwhile: `warden run` journals
/// the end while the folder goes (on a disk mounted with `discard`, a directory's removal
/// waits for the device, 0.5-2 ms). Waited for by `wait`, or when the last copy is dropped;
/// the default is a release already done.
#[derive(Debug, Clone, Default)]
pub struct Release(Option<std::sync::Arc<Pending>>);

#[derive(Debug)]
struct Pending(std::sync::Mutex<Option<std::thread::JoinHandle<()>>>);

impl Release {
    /// Drops `what`, whose drop is the release, on a thread of its own (a thread that cannot
    /// be started drops it at once, here).
    pub(crate) fn dropping(what: impl Send + 'static) -> Self {
        match std::thread::Builder::new()
            .name("cell-release".to_owned())
            .spawn(move || drop(what))
        {
            Ok(handle) => Self(Some(std::sync::Arc::new(Pending(std::sync::Mutex::new(
                Some(handle),
            ))))),
            Err(_) => Self::default(),
        }
    }

    /// Waits until the name is released.
    pub fn wait(&self) {
        if let Some(pending) = &self.0 {
            pending.wait();
        }
    }
}

impl Pending {
    fn wait(&self) {
        let handle = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.wait();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error("{what}: {source}")]
    Os {
        what: &'static str,
        source: io::Error,
    },
    #[error("cell setup failed: {0}")]
    Setup(String),
    #[error("giving the workspace its disk limit: {0}")]
    Disk(#[from] super::disk::DiskError),
    #[error(transparent)]
    Gateway(#[from] crate::gateway::GatewayError),
    #[error(transparent)]
    Store(#[from] super::store::StoreError),
    #[error("the policy's image: {0}")]
    Image(#[from] warden_image::ImageError),
    /// The caller's `before_start` refused to let the command start.
    #[error("{0}")]
    BeforeStart(String),
    #[error(
        "creating the cell's namespaces failed: {source}; this kernel or user may lack user namespaces (run `warden doctor`)"
    )]
    Namespaces { source: io::Error },
}

pub(crate) fn os(what: &'static str) -> impl FnOnce(io::Error) -> RunError {
    move |source| RunError::Os { what, source }
}

pub(crate) fn nix_os(what: &'static str) -> impl FnOnce(nix::Error) -> RunError {
    move |err| RunError::Os {
        what,
        source: io::Error::from_raw_os_error(err as i32),
    }
}
