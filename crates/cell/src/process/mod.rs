//! The process tier: Linux namespaces, pivot_root, seccomp, Landlock and cgroups.

pub mod backend;
pub mod cgroup;
pub mod changes;
mod confine;
pub mod control;
pub mod disk;
pub mod exec;
pub mod files;
mod idmap;
pub mod ids;
mod init;
pub mod landlock;
mod overlay;
pub mod plan;
pub mod probe;
pub mod registry;
mod relay;
mod reset;
mod rootfs;
pub mod run;
pub mod seccomp;
pub mod snapshot;
pub mod store;
mod sys;
