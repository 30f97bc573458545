//! Cells: the sandboxes that hold an agent's hands.
//!
//! This crate creates, confines, observes and ends cells. The warden controls a cell only
//! through kernel mechanisms held from outside (namespaces, cgroups, pidfds); nothing here may
//! rely on the cooperation of a process inside the cell.

#[cfg(target_os = "linux")]
pub mod linux;

#[cfg(target_os = "linux")]
pub use linux::{
    changes, control, probe,
    registry::{CellRecord, Registry, RegistryError},
    run::{Ending, RunError, RunOutcome, RunRequest, run},
    snapshot,
    snapshot::SnapshotInfo,
    store::{Store, StoreError},
};
