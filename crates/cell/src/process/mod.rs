//! The process tier: Linux namespaces, pivot_root, seccomp, Landlock and cgroups.

mod ahead;
pub mod backend;
pub mod background;
pub mod cgroup;
pub mod changes;
mod confine;
pub mod control;
#[cfg(test)]
pub(crate) mod deep;
pub mod disk;
pub mod exec;
pub mod files;
pub(crate) mod forks;
pub(crate) mod idmap;
pub mod ids;
pub(crate) mod init;
pub mod landlock;
pub mod outcome;
mod overlay;
pub mod plan;
pub mod probe;
pub mod registry;
pub(crate) mod relay;
pub(crate) mod reset;
pub(crate) mod rootfs;
pub mod run;
pub mod seccomp;
pub mod snapshot;
pub(crate) mod squash;
pub(crate) mod starts;
pub mod store;
pub(crate) mod swap;
pub(crate) mod sys;
