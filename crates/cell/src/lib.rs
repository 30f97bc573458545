//! Cells: the sandboxes that hold an agent's hands.
//!
//! This crate creates, confines, observes and ends cells. The warden controls a cell only
//! through kernel mechanisms held from outside (namespaces, cgroups, pidfds); nothing here may
//! rely on the cooperation of a process inside the cell.
//!
//! Its face is the tier boundary ([`tier`]: a `Backend` makes cells, a `Cell` is the handle
//! of one) and the workspace machinery every tier shares (layers, snapshots, changes, the
//! registry of running cells). The tiers themselves are private modules: nothing outside this
//! crate names one (a test in `tests/boundary.rs` holds every crate to that).

pub mod check;
pub mod gateway;
#[cfg(target_os = "linux")]
mod gvisor;
#[cfg(target_os = "linux")]
mod keeper;
mod microvm;
#[cfg(target_os = "linux")]
mod netns;
#[cfg(target_os = "linux")]
pub use netns::{let_go_of_early as let_go_of_early_network, start_early as start_network_early};
pub mod probe;
#[cfg(target_os = "linux")]
mod process;
pub mod tier;
#[cfg(target_os = "linux")]
pub mod tiers;

#[cfg(feature = "fake")]
pub mod fake;

#[cfg(target_os = "linux")]
pub use keeper::{KeepError, keep, serve_forks};
#[cfg(target_os = "linux")]
pub use process::{
    backend::KEEP_REQUEST,
    background::{finish as finish_background, outlive_requests},
    changes, control,
    exec::{leave_namespaces_to_exit, left_to_exit, resize as resize_terminal},
    outcome::{Ending, RunError, RunOutcome},
    plan::{Identity, check_name, check_paths, identity},
    registry::{CellRecord, Registry, RegistryError},
    run::RunRequest,
    snapshot,
    snapshot::SnapshotInfo,
    store::{Store, StoreError},
};
pub use tier::{
    Attached, Backend, Cell, CellError, CellSpec, ProcessConfig, Session, StartError, Status,
};
#[cfg(target_os = "linux")]
pub use tiers::Tiers;

/// Blocks, in the calling thread and the threads it starts from now on, the signals a cell run
/// in this process takes for its own (SIGINT, SIGTERM, SIGHUP, SIGQUIT: forwarded to the cell
/// from a signalfd): call it before any other thread starts, or a signal may end the warden.
#[cfg(target_os = "linux")]
pub fn block_forwarded_signals() -> std::io::Result<()> {
    process::run::forwarded_signals()
        .thread_block()
        .map_err(std::io::Error::from)
}

/// Runs a cell to its end in this process (`warden run` without a daemon), in the tier its
/// policy names.
#[cfg(target_os = "linux")]
pub fn run(
    registry: &Registry,
    store: &Store,
    request: RunRequest,
) -> Result<RunOutcome, RunError> {
    process::run::run(registry, store, request)
}
