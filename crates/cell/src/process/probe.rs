//! What the process tier needs of this host (for `warden doctor`), whether it has it, and what to
//! do when it does not.

use std::fs;
use std::path::Path;

use nix::sys::wait::waitpid;
use nix::unistd::Pid;

use super::cgroup::{self, Version};
use super::sys;
use crate::check::{Check, Status};

fn check(
    tier: &'static str,
    feature: &'static str,
    status: Status,
    detail: String,
    fix: Option<&str>,
) -> Check {
    Check {
        tier,
        feature,
        status,
        detail,
        fix: fix.map(str::to_owned),
    }
}

/// The process tier's prerequisites on this host.
pub fn checks() -> Vec<Check> {
    let mut out = vec![
        user_namespaces(),
        landlock(),
        seccomp(),
        pidfd(),
        overlayfs(),
    ];
    out.extend(cgroups());
    out.push(cgroup_attach());
    out.push(workspace_disk());
    out.push(redirect());
    out
}

fn user_namespaces() -> Check {
    let result = sys::clone_process(
        libc::CLONE_NEWUSER | libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWNET,
    );
    match result {
        Ok(0) => sys::exit_now(0),
        Ok(pid) => {
            let _ = waitpid(Pid::from_raw(pid), None);
            let max = read_trim("/proc/sys/user/max_user_namespaces").unwrap_or_default();
            check(
                "process",
                "user namespaces",
                Status::Ok,
                format!("available (max_user_namespaces={max})"),
                None,
            )
        }
        Err(err) => check(
            "process",
            "user namespaces",
            Status::Missing,
            format!("cannot create a user namespace: {err}"),
            Some(
                "enable them: sysctl -w user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1 \
                  (and on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0)",
            ),
        ),
    }
}

fn landlock() -> Check {
    match sys::landlock_abi_version() {
        Ok(abi) if abi >= 6 => check(
            "process",
            "landlock",
            Status::Ok,
            format!("ABI {abi} (file system rules, signal and abstract socket scoping)"),
            None,
        ),
        Ok(abi) => check(
            "process",
            "landlock",
            Status::Warn,
            format!(
                "ABI {abi}: file rules enforced, signal and abstract socket scoping need ABI 6"
            ),
            Some("use Linux 6.12 or newer for full Landlock coverage"),
        ),
        Err(err) => check(
            "process",
            "landlock",
            Status::Missing,
            format!("not available: {err}"),
            Some("boot a kernel with CONFIG_SECURITY_LANDLOCK=y and `landlock` in the lsm= list"),
        ),
    }
}

fn seccomp() -> Check {
    match read_trim("/proc/sys/kernel/seccomp/actions_avail") {
        Some(actions) if actions.contains("errno") => check(
            "process",
            "seccomp",
            Status::Ok,
            format!("filter mode (actions: {actions})"),
            None,
        ),
        _ => check(
            "process",
            "seccomp",
            Status::Missing,
            "seccomp filters are not available".to_owned(),
            Some("boot a kernel with CONFIG_SECCOMP_FILTER=y"),
        ),
    }
}

fn pidfd() -> Check {
    match sys::pidfd_open(std::process::id() as i32) {
        Ok(_) => check("process", "pidfd", Status::Ok, "available".to_owned(), None),
        Err(err) => check(
            "process",
            "pidfd",
            Status::Missing,
            format!("pidfd_open failed: {err}"),
            Some("use Linux 5.3 or newer"),
        ),
    }
}

fn overlayfs() -> Check {
    let has = fs::read_to_string("/proc/filesystems")
        .is_ok_and(|t| t.lines().any(|l| l.trim_end().ends_with("overlay")));
    if has {
        check(
            "process",
            "overlayfs",
            Status::Ok,
            "available (for copy-on-write workspaces)".to_owned(),
            None,
        )
    } else {
        check(
            "process",
            "overlayfs",
            Status::Warn,
            "the overlay file system is not loaded".to_owned(),
            Some("modprobe overlay"),
        )
    }
}

fn cgroups() -> Vec<Check> {
    let found = cgroup::discover();
    let mut out = Vec::new();
    for controller in cgroup::Controller::ALL {
        let name = controller.name();
        let feature: &'static str = match controller {
            cgroup::Controller::Memory => "cgroup memory",
            cgroup::Controller::Pids => "cgroup pids",
            cgroup::Controller::Cpu => "cgroup cpu",
            cgroup::Controller::Freezer => "cgroup freezer",
        };
        match found.iter().find(|h| h.controller == controller) {
            Some(h) => {
                let version = match h.version {
                    Version::V1 => "v1",
                    Version::V2 => "v2",
                };
                let writable = writable(&h.own);
                let status = if writable { Status::Ok } else { Status::Warn };
                let fix = (!writable).then_some(
                    "run as root, or start warden inside a delegated cgroup v2 subtree \
                     (systemd-run --user --scope -p Delegate=yes warden ...)",
                );
                out.push(check(
                    "process",
                    feature,
                    status,
                    format!(
                        "{version} at {}{}",
                        h.own.display(),
                        if writable {
                            ""
                        } else {
                            " (not writable by this user)"
                        }
                    ),
                    fix,
                ));
            }
            None => out.push(check(
                "process",
                feature,
                Status::Missing,
                format!("no hierarchy offers the {name} controller"),
                Some("mount cgroup2 (or the v1 controller) and enable the controller"),
            )),
        }
    }
    out
}

/// Moving a whole process into a cgroup (`cgroup.procs`) takes the kernel's
/// `cgroup_threadgroup_rwsem` for writing, which waits for an RCU grace period unless the
/// hierarchy is mounted with `favordynmods`. A cell's init joins its v1 directories itself by
/// writing `0` into each `tasks` file (one thread moves without that lock); v2 has no such file,
/// so a v2 directory is joined through `cgroup.procs`.
fn cgroup_attach() -> Check {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let favordynmods = mountinfo
        .lines()
        .filter_map(|line| line.split_once(" - ").map(|(_, right)| right))
        .any(|right| right.starts_with("cgroup2 ") && right.contains("favordynmods"));
    let hierarchies = cgroup::discover();
    let v2 = hierarchies.iter().any(|h| h.version == Version::V2);
    match (v2, favordynmods) {
        (false, _) if !hierarchies.is_empty() => check(
            "process",
            "cgroup attach",
            Status::Ok,
            "v1 only: a cell's init joins its cgroups itself (a write to each `tasks` file), with no RCU grace period to wait for"
                .to_owned(),
            None,
        ),
        (true, true) => check(
            "process",
            "cgroup attach",
            Status::Ok,
            "cgroup v2 mounted with favordynmods: placing a cell in its cgroups is fast".to_owned(),
            None,
        ),
        _ => check(
            "process",
            "cgroup attach",
            Status::Warn,
            "placing each new cell in its cgroup v2 directory waits for an RCU grace period (often 10-20 ms)"
                .to_owned(),
            Some(
                "for faster cell starts, mount cgroup2 with the favordynmods option (Linux 6.1+)",
            ),
        ),
    }
}

/// The file system a root cell's workspace disk gets (`limits.disk`), and what its snapshots
/// cost there.
fn workspace_disk() -> Check {
    let chosen = std::env::var_os("WARDEN_LAYER_FS").is_some();
    let (status, detail, fix) = if !nix::unistd::geteuid().is_root() {
        (
            Status::Ok,
            "rootless: a cell's disk limit is kept per file by the kernel and for the whole workspace by the warden's watch (loop devices are root's)".to_owned(),
            None,
        )
    } else {
        match (super::disk::unavailable(), super::disk::Kind::chosen()) {
            (_, Err(why)) => (
                Status::Warn,
                why,
                Some("set WARDEN_LAYER_FS to btrfs or ext4, or unset it"),
            ),
            (None, Ok(super::disk::Kind::Btrfs)) => (
                Status::Ok,
                "btrfs: a snapshot is a clone of the cell's tree, whether its processes run or not"
                    .to_owned(),
                None,
            ),
            (None, Ok(super::disk::Kind::Ext4)) => (
                Status::Ok,
                format!(
                    "ext4{}: a snapshot of a cell whose processes run copies what it changed",
                    if chosen { " (WARDEN_LAYER_FS)" } else { "" }
                ),
                (!chosen).then_some("for snapshots that never copy: apt-get install btrfs-progs"),
            ),
            (Some(why), _) => (
                Status::Warn,
                format!(
                    "{why}: a cell's disk limit is kept per file by the kernel and for the whole workspace by the warden's watch"
                ),
                Some("apt-get install btrfs-progs (or e2fsprogs), and load the loop module"),
            ),
        }
    };
    check("process", "workspace disk", status, detail, fix)
}

fn writable(dir: &Path) -> bool {
    nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK).is_ok()
}

fn redirect() -> Check {
    let present = |paths: &[&str]| paths.iter().any(|p| std::path::Path::new(p).exists());
    match (present(&["/usr/sbin/nft", "/sbin/nft"]), present(&["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"])) {
        (true, true) => check(
            "process",
            "egress redirect",
            Status::Ok,
            "nft and ip present: clients that ignore the proxy variables are redirected to the gateway".to_owned(),
            None,
        ),
        _ => check(
            "process",
            "egress redirect",
            Status::Warn,
            "without nft and ip, clients that ignore the proxy variables have no route out at all".to_owned(),
            Some("apt-get install nftables iproute2"),
        ),
    }
}

fn read_trim(path: &str) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}
