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
