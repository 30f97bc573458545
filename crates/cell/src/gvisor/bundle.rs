//! The OCI bundle of a gVisor cell (`oci-spec`'s runtime types), written by its keeper from the
//! same plan the process tier builds its cells from: the root the keeper assembled (read-only),
//! the workspace and the policy's writable paths as mounts of their own (so that changes made
//! from outside, a reset or the files API, are seen at once: runsc revalidates mounts, and
//! caches the root), the cell's user without capabilities, its environment and limits, and the
//! network namespace the keeper made.

use std::path::{Path, PathBuf};

use oci_spec::OciSpecError;
use oci_spec::runtime::{
    LinuxBuilder, LinuxCapabilitiesBuilder, LinuxNamespaceBuilder, LinuxNamespaceType, Mount,
    MountBuilder, PosixRlimitBuilder, PosixRlimitType, Process, ProcessBuilder, RootBuilder, Spec,
    SpecBuilder, UserBuilder,
};

use crate::process::plan::{CellPlan, Entry};

/// The OCI runtime spec version runsc of 2022 reads.
const OCI_VERSION: &str = "1.0.2";

/// A process of the cell: its user, with no capability and no way to gain one (`no_new_privs`),
/// its environment, directory and open-files limit.
pub fn process(
    plan: &CellPlan,
    args: Vec<String>,
    env: &[(std::ffi::OsString, std::ffi::OsString)],
    cwd: &Path,
    terminal: bool,
) -> Result<Process, OciSpecError> {
    let none = std::collections::HashSet::new();
    ProcessBuilder::default()
        .terminal(terminal)
        .user(
            UserBuilder::default()
                .uid(plan.ids.inside_uid)
                .gid(plan.ids.inside_gid)
                .additional_gids(Vec::<u32>::new())
                .build()?,
        )
        .args(args)
        .env(
            env.iter()
                .map(|(k, v)| format!("{}={}", k.to_string_lossy(), v.to_string_lossy()))
                .collect::<Vec<_>>(),
        )
        .cwd(cwd)
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(none.clone())
                .effective(none.clone())
                .inheritable(none.clone())
                .permitted(none.clone())
                .ambient(none)
                .build()?,
        )
        .rlimits(vec![
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNofile)
                .hard(plan.rlimit_nofile)
                .soft(plan.rlimit_nofile)
                .build()?,
        ])
        .no_new_privileges(true)
        .build()
}

fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

fn mount(destination: &str, typ: &str, options: &[&str]) -> Result<Mount, OciSpecError> {
    MountBuilder::default()
        .destination(destination)
        .typ(typ)
        .source(typ)
        .options(options.iter().map(|o| (*o).to_owned()).collect::<Vec<_>>())
        .build()
}

/// A bind of what the keeper assembled at `path` of the cell's root, writable.
fn writable(plan: &CellPlan, path: &Path) -> Result<Mount, OciSpecError> {
    MountBuilder::default()
        .destination(path)
        .typ("bind")
        .source(inside(&plan.root, path))
        .options(vec!["rbind".to_owned(), "rw".to_owned()])
        .build()
}

/// The cell's bundle: `args`, its first process; `netns`, the path of the network namespace the
/// sandbox joins.
pub fn spec(plan: &CellPlan, netns: &Path, args: Vec<String>) -> Result<Spec, OciSpecError> {
    // `/tmp` and `/dev/shm` are as large as the process tier's (`filesystem.tmp_size`, and
    // `/dev/shm` no larger than the memory limit): gVisor's tmpfs keeps to `size=`, and a
    // write past it fails with ENOSPC inside the cell.
    let tmp_size = format!("size={}", plan.tmp_size);
    let shm_size = format!("size={}", plan.shm_size);
    let mut mounts = vec![
        mount("/proc", "proc", &[])?,
        mount("/dev", "tmpfs", &["nosuid", "strictatime", "mode=755"])?,
        mount("/dev/pts", "devpts", &["nosuid", "noexec", "newinstance"])?,
        mount(
            "/dev/shm",
            "tmpfs",
            &["nosuid", "nodev", "mode=1777", &shm_size],
        )?,
        mount(
            "/tmp",
            "tmpfs",
            &["nosuid", "nodev", "mode=1777", &tmp_size],
        )?,
        mount("/sys", "sysfs", &["nosuid", "noexec", "nodev", "ro"])?,
    ];
    for entry in &plan.entries {
        if let Entry::Bind {
            path,
            writable: true,
            ..
        } = entry
        {
            mounts.push(writable(plan, path)?);
        }
    }
    mounts.push(writable(plan, &plan.workspace_mount)?);
    let namespaces = [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
    ]
    .into_iter()
    .map(|typ| LinuxNamespaceBuilder::default().typ(typ).build())
    .chain(std::iter::once(
        LinuxNamespaceBuilder::default()
            .typ(LinuxNamespaceType::Network)
            .path(netns)
            .build(),
    ))
    .collect::<Result<Vec<_>, _>>()?;
    SpecBuilder::default()
        .version(OCI_VERSION)
        .root(
            RootBuilder::default()
                .path(&plan.root)
                .readonly(true)
                .build()?,
        )
        .process(process(plan, args, &plan.env, &plan.cwd, false)?)
        .hostname(plan.hostname.clone())
        .mounts(mounts)
        .linux(LinuxBuilder::default().namespaces(namespaces).build()?)
        .build()
}
