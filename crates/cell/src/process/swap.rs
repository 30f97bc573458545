//! Snapshots and resets without copies: the running cell's workspace mounted again over other
//! layers. A snapshot turns the cell's upper layer into a read-only snapshot layer and gives the
//! cell a fresh upper on top of it; a reset mounts the target's layers under a fresh upper. Each
//! costs the same whatever the cell changed.
//!
//! A mount can only be swapped while nothing of the cell holds it: the init runs alone (no
//! process, no start under way: the caller holds the starts lock) and keeps nothing open in the
//! workspace. Then a short-lived helper of the warden joins the cell's user namespace, builds the
//! new overlay from detached clones of the layers (in a private copy of the warden's mount tree,
//! so that no host path shows in the cell), joins the cell's mount namespace, unmounts the old
//! overlay (refused if anything holds it) and attaches the new one in its place. If the new one
//! cannot be attached, the old one is attached again; either way the cell has a workspace.
//!
//! Landlock: a new mount has a new root, which no rule made before could name. The init is
//! therefore confined by a rule on the directory the workspace is mounted in, and every process
//! it starts is put under a rule on the workspace mounted at that moment (`confine::Narrowing`).

use std::fs;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags, MoveMountFlags, UnmountFlags};
use serde::{Deserialize, Serialize};

use super::registry::Registry;
use super::sys;

/// The deepest stack of snapshot layers a swap builds; a snapshot of a deeper one is copied.
/// (The overlay's options take one page, and each layer costs a diff a directory walk.)
pub const MAX_DEPTH: usize = 48;

/// `statx`'s mask bit for the mount's unique id (Linux 6.8), which tells the init that the
/// workspace was mounted again.
pub const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// Whether this kernel gives mounts ids that are never used again (else the init could not tell
/// a new workspace mount from the old one, and none is swapped).
fn unique_mount_ids() -> bool {
    static UNIQUE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNIQUE.get_or_init(|| {
        rustix::fs::statx(
            rustix::fs::CWD,
            "/",
            rustix::fs::AtFlags::empty(),
            rustix::fs::StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
        )
        .is_ok_and(|s| s.stx_mask & STATX_MNT_ID_UNIQUE != 0)
    })
}

/// What a swap could not do.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// Something of the cell holds the workspace (a process, an open file): nothing changed.
    #[error("the workspace of cell `{0}` is in use")]
    Busy(String),
    /// The swap could not be made; the cell's workspace is as it was.
    #[error("mounting the workspace of cell `{cell}` again: {message}")]
    Failed { cell: String, message: String },
    /// The old overlay was unmounted and neither overlay could be attached again: the cell has
    /// no workspace mounted.
    #[error(
        "mounting the workspace of cell `{cell}` again: {message}; the cell has no workspace now (end it and fork it from a snapshot)"
    )]
    Broken { cell: String, message: String },
}

/// One overlay: its lower layers (topmost first, each under the layer directory or the
/// snapshots directory), its upper and work directories (under the layer directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stack {
    pub lowers: Vec<PathBuf>,
    pub upper: PathBuf,
    pub work: PathBuf,
}

/// A snapshot's turn-over of a few entries: the entries of the old upper layer `from` are moved
/// into `into` (a fresh directory beside it) once the old overlay is unmounted, and `into` is
/// the new overlay's top lower layer. (The old upper itself can be one, as a turn-over of many
/// entries has it, but the kernel logs a warning for it: the old overlay, whose teardown is
/// left to the background, still holds it as its upper.)
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Turn {
    pub from: PathBuf,
    pub into: PathBuf,
}

/// Where the layers are and how the cell sees them.
pub struct Place<'a> {
    pub cell: &'a str,
    /// The cell's init, and when it started (clock ticks after boot, as its record says).
    pub pid: i32,
    pub pid_start: u64,
    /// The host directory under every layer.
    pub host: &'a Path,
    pub layer_dir: PathBuf,
    pub snapshots_dir: PathBuf,
    /// Where the workspace is mounted inside the cell.
    pub mount: &'a Path,
}

/// Replaces the overlay at `place.mount` in the running cell (built from `old`) by one built
/// from `new`. The caller holds the cell's starts lock and has seen its init alone.
///
/// `new.work` must be a fresh directory: the old overlay keeps its own until it is torn down.
/// `hold`: a lock the caller holds (its open file), which the helper holds with it until it
/// ends: should the caller be killed, whoever finishes its making over waits for the helper,
/// which goes on, rather than undoing what the helper is about to do.
pub fn swap(
    registry: &Registry,
    place: &Place<'_>,
    [old, new]: [&Stack; 2],
    turn: Option<&Turn>,
    hold: std::os::fd::BorrowedFd<'_>,
) -> Result<(), SwapError> {
    let failed = |message: String| SwapError::Failed {
        cell: place.cell.to_owned(),
        message,
    };
    if !unique_mount_ids() {
        return Err(failed(
            "this kernel gives mounts no unique ids (Linux 6.8)".to_owned(),
        ));
    }
    // Opened here from the init's own where this process may (the keeper's round trip, its
    // thread woken to answer, was 0.2 ms of a quiet turn-over), else asked of the keeper.
    let ns = match super::exec::init_namespaces(place.pid, place.pid_start) {
        Some(ns) => ns,
        None => super::exec::namespaces(registry, place.cell)
            .map_err(|e| failed(format!("the cell's namespaces: {e}")))?,
    };
    if ns.root.is_some() {
        return Err(failed("the cell is not of the process tier".to_owned()));
    }
    // A root-started cell sees the host directory through an id-mapped mount, which only the
    // warden (as host root) can make.
    let tree = if nix::unistd::geteuid().is_root() {
        let (uid, gid) = cell_ids(place.pid).map_err(|e| failed(format!("the cell's ids: {e}")))?;
        Some(
            super::idmap::workspace_tree_for(place.host, uid, gid)
                .map_err(|e| failed(e.to_string()))?,
        )
    } else {
        None
    };
    let job = Job {
        host: place.host.to_path_buf(),
        layer_dir: place.layer_dir.clone(),
        snapshots_dir: place.snapshots_dir.clone(),
        mount: place.mount.to_path_buf(),
        old: old.clone(),
        new: new.clone(),
        turn: turn.cloned(),
    };
    let job = serde_json::to_vec(&job).map_err(|e| failed(e.to_string()))?;
    let (report_r, report_w) = sys::pipe().map_err(|e| failed(e.to_string()))?;
    // The old overlay's last mount comes back on this, to be let go of in the background.
    let (held_r, held_w) = sys::seqpacket_pair().map_err(|e| failed(e.to_string()))?;
    let hold = hold
        .try_clone_to_owned()
        .map_err(|e| failed(e.to_string()))?;
    let mut fds = vec![report_w, held_w, ns.user, ns.mnt, hold];
    fds.extend(tree);
    // Forked by the daemon's keepers' fork server where it has one (a server that did not
    // answer may have forked it all the same: no second one is made here), else from here.
    let raw: Vec<_> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let child = match super::forks::helper_server() {
        Some(server) => server
            .helper(&job, &raw)
            .map_err(|e| failed(format!("the keepers' fork server: {e}")))?,
        None => match sys::clone_process(0).map_err(|e| failed(e.to_string()))? {
            0 => {
                drop((report_r, held_r));
                // None of the daemon's other descriptors (its listening socket, its database),
                // which a helper that outlives a killed daemon would hold.
                let _ = sys::close_except(&raw);
                sys::exit_now(helper(&job, fds));
            }
            pid => pid,
        },
    };
    drop(fds);
    let mut message = String::new();
    let _ = fs::File::from(report_r).read_to_string(&mut message);
    // Sent before the helper's end, if it swapped.
    if let Ok(Some((_, held))) = sys::try_receive_message(held_r.as_fd()) {
        super::background::let_go(held);
    }
    if message == SWAPPED && super::background::outlives_requests() {
        // Swapped, said once the new overlay was the cell's: what the helper has left to do is
        // let go of its clones of the layers and end, each clone's release a wait for an RCU
        // grace period, which the request does not wait for. (It holds the caller's hold until
        // it has ended, as before: a warden killed now is finished after by whoever waits for
        // that.) Reaped by the background thread.
        super::background::reap(child);
        return Ok(());
    }
    match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child), None) {
        Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
        Ok(nix::sys::wait::WaitStatus::Exited(_, 2)) => Err(SwapError::Busy(place.cell.to_owned())),
        Ok(nix::sys::wait::WaitStatus::Exited(_, 3)) => Err(SwapError::Broken {
            cell: place.cell.to_owned(),
            message,
        }),
        _ if !message.is_empty() => Err(failed(message)),
        other => Err(failed(format!("the helper ended with {other:?}"))),
    }
}

/// The host uid and gid the cell's init runs as.
pub(super) fn cell_ids(pid: i32) -> io::Result<(u32, u32)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> io::Result<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| io::Error::other(format!("no {name} line")))
    };
    Ok((field("Uid:")?, field("Gid:")?))
}

/// What the helper is asked, but for its descriptors: it crosses to the keepers' fork server
/// as JSON.
#[derive(Serialize, Deserialize)]
struct Job {
    /// The host directory under every layer.
    host: PathBuf,
    layer_dir: PathBuf,
    snapshots_dir: PathBuf,
    /// Where the workspace is mounted inside the cell.
    mount: PathBuf,
    old: Stack,
    new: Stack,
    turn: Option<Turn>,
}

/// The helper, in a child process of its own: does the swap of `job` (JSON) and returns its
/// exit code (0 done, 2 busy, 1 failed, 3 broken; the message of the last two written to the
/// report). `fds`: the report's pipe, the socket the old overlay's mount goes back on, the
/// cell's user and mount namespaces, the caller's hold (kept until the helper ends, see
/// `Place::hold`), and for a root-started cell the id-mapped host tree.
pub(crate) fn helper(job: &[u8], fds: Vec<OwnedFd>) -> i32 {
    let mut fds = fds.into_iter();
    let (Some(report), Some(hand_back), Some(user), Some(mnt), Some(_hold)) =
        (fds.next(), fds.next(), fds.next(), fds.next(), fds.next())
    else {
        return 1;
    };
    let tree = fds.next();
    let mut report = Some(fs::File::from(report));
    let job: Job = match serde_json::from_slice(job) {
        Ok(job) => job,
        Err(e) => {
            if let Some(report) = &mut report {
                let _ = write!(report, "the helper's job: {e}");
            }
            return 1;
        }
    };
    let ns = super::exec::Namespaces {
        user,
        mnt,
        root: None,
    };
    let outcome = inside(&ns, tree, &job, hand_back, &mut report);
    let mut tell = |message: &str| {
        if let Some(report) = &mut report {
            let _ = report.write_all(message.as_bytes());
        }
    };
    match outcome {
        Ok(()) => 0,
        Err(Outcome::Busy) => 2,
        Err(Outcome::Failed(message)) => {
            tell(&message);
            1
        }
        Err(Outcome::Broken(message)) => {
            tell(&message);
            3
        }
    }
}

/// What a helper reports, and closes its report with, once the new overlay is the cell's
/// (before it lets go of its clones and ends): no message of a failure reads so.
const SWAPPED: &str = "\0swapped";

enum Outcome {
    Busy,
    Failed(String),
    Broken(String),
}

impl<E: std::fmt::Display> From<(&'static str, E)> for Outcome {
    fn from((what, err): (&'static str, E)) -> Self {
        Self::Failed(format!("{what}: {err}"))
    }
}

/// The helper's work (a forked child of the warden; it exits after).
fn inside(
    ns: &super::exec::Namespaces,
    tree: Option<OwnedFd>,
    place: &Job,
    hand_back: OwnedFd,
    report: &mut Option<fs::File>,
) -> Result<(), Outcome> {
    let (old, new, turn) = (&place.old, &place.new, place.turn.as_ref());
    use nix::sched::{CloneFlags, setns, unshare};
    ns.join_user()
        .map_err(|e| ("joining the cell's user namespace", e))?;
    // A private copy of the warden's mount tree, owned by the cell's user namespace: the layers
    // are cloned from here, as the cell's own setup cloned them.
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| ("making a private mount namespace", e))?;
    nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| ("making the private mount namespace private", e))?;
    let _ = nix::unistd::setresgid(0.into(), 0.into(), 0.into());
    let _ = nix::unistd::setresuid(0.into(), 0.into(), 0.into());
    let layer =
        sys::detached_clone(&place.layer_dir).map_err(|e| ("cloning the layer directory", e))?;
    let snapshots = sys::detached_clone(&place.snapshots_dir)
        .map_err(|e| ("cloning the snapshots directory", e))?;
    sys::restrict_detached(&snapshots).map_err(|e| ("making the snapshots read-only", e))?;
    // A layer elsewhere (a snapshot kept in another cell's own file system) is cloned alone.
    let mut apart = std::collections::HashMap::new();
    for path in old.lowers.iter().chain(&new.lowers) {
        if !path.starts_with(&place.layer_dir)
            && !path.starts_with(&place.snapshots_dir)
            && !apart.contains_key(path)
        {
            let clone = sys::detached_clone(path).map_err(|e| ("cloning a snapshot's layer", e))?;
            sys::restrict_detached(&clone)
                .map_err(|e| ("making a snapshot's layer read-only", e))?;
            apart.insert(path.clone(), clone);
        }
    }
    let lower = match tree {
        Some(tree) => {
            // The id-mapped tree belongs to the host's namespaces: attached for a moment in
            // this private tree and cloned from there (on a scratch file system over /tmp,
            // once every host path has been cloned).
            let scratch = Path::new("/tmp");
            nix::mount::mount(
                Some("tmpfs"),
                scratch,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("size=64k"),
            )
            .map_err(|e| ("mounting a scratch directory", e))?;
            let spot = scratch.join("lower");
            fs::create_dir(&spot).map_err(|e| ("making a scratch directory", e))?;
            sys::move_mount_to(&tree, &spot)
                .map_err(|e| ("attaching the id-mapped workspace", e))?;
            sys::detached_clone(&spot).map_err(|e| ("cloning the id-mapped workspace", e))?
        }
        None => sys::detached_clone(&place.host).map_err(|e| ("cloning the workspace", e))?,
    };
    sys::restrict_detached(&lower).map_err(|e| ("making the workspace read-only", e))?;
    let translate = |path: &Path| -> Result<String, Outcome> {
        let (fd, rel) = if let Some(fd) = apart.get(path) {
            (fd, Path::new(""))
        } else if let Ok(rel) = path.strip_prefix(&place.layer_dir) {
            (&layer, rel)
        } else if let Ok(rel) = path.strip_prefix(&place.snapshots_dir) {
            (&snapshots, rel)
        } else {
            return Err(Outcome::Failed(format!(
                "no clone of the layer {}",
                path.display()
            )));
        };
        Ok(PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .join(rel)
            .display()
            .to_string())
    };
    // Both overlays are configured here, where the paths resolve; each is made only once the
    // mount before it is gone (an upper layer is never a lower one of a live overlay).
    let configure = |stack: &Stack| -> Result<OwnedFd, Outcome> {
        let mut lowers = stack
            .lowers
            .iter()
            .map(|l| translate(l))
            .collect::<Result<Vec<_>, _>>()?;
        lowers.push(format!("/proc/self/fd/{}", lower.as_raw_fd()));
        let fs = rustix::mount::fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC)
            .map_err(|e| ("opening an overlay", e))?;
        // One layer at a time (`lowerdir+`, Linux 6.8, which a swap needs anyway): a string
        // given to `fsconfig` may be 256 bytes at most.
        for lower in &lowers {
            rustix::mount::fsconfig_set_string(fs.as_fd(), "lowerdir+", lower.as_str())
                .map_err(|e| ("the overlay's lower layers", e))?;
        }
        rustix::mount::fsconfig_set_string(fs.as_fd(), "upperdir", translate(&stack.upper)?)
            .map_err(|e| ("the overlay's upper layer", e))?;
        rustix::mount::fsconfig_set_string(fs.as_fd(), "workdir", translate(&stack.work)?)
            .map_err(|e| ("the overlay's work directory", e))?;
        rustix::mount::fsconfig_set_flag(fs.as_fd(), "userxattr")
            .map_err(|e| ("the overlay's xattrs", e))?;
        Ok(fs)
    };
    // The turn's directories, opened here (inside the cell, /proc/self is not this process):
    // nothing that can fail for a mistake of ours is left for after the unmount.
    let open_dir = |path: &Path| -> Result<OwnedFd, Outcome> {
        let path = translate(path)?;
        rustix::fs::open(
            path.as_str(),
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::NOFOLLOW
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| Outcome::Failed(format!("opening {path}: {e}")))
    };
    let turn = match turn {
        Some(turn) => Some((open_dir(&turn.from)?, open_dir(&turn.into)?)),
        None => None,
    };
    let fresh = configure(new)?;
    let again = configure(old)?;
    setns(&ns.mnt, CloneFlags::CLONE_NEWNS)
        .map_err(|e| ("joining the cell's mount namespace", e))?;
    let is_overlay = rustix::fs::statfs(&place.mount)
        .map(|s| s.f_type == libc::OVERLAYFS_SUPER_MAGIC)
        .unwrap_or(false);
    if !is_overlay {
        return Err(Outcome::Failed(format!(
            "{} in the cell is not the workspace's overlay",
            place.mount.display()
        )));
    }
    // A clone of the old overlay's mount keeps its file system alive past the unmount, so that
    // its teardown (every inode it cached is let go: a walk as long as what the cell touched)
    // happens after, in the background (the caller's, `hand_back`). It does not make the
    // unmount busy: only what the cell holds does.
    let held = sys::detached_clone(&place.mount).map_err(|e| ("holding the old workspace", e))?;
    match rustix::mount::unmount(&place.mount, UnmountFlags::empty()) {
        Ok(()) => {}
        Err(rustix::io::Errno::BUSY) => return Err(Outcome::Busy),
        Err(e) => return Err(("unmounting the workspace", e).into()),
    }
    let moved = match turn {
        Some((from, into)) => match move_entries(&from, &into) {
            Ok(()) => Ok(Some((from, into))),
            Err(e) => {
                // What was moved goes back before the old overlay is mounted again.
                let _ = move_entries(&into, &from);
                Err(format!("moving the upper layer's entries: {e}"))
            }
        },
        None => Ok(None),
    };
    let attach = |fs: &OwnedFd| -> rustix::io::Result<()> {
        rustix::mount::fsconfig_create(fs.as_fd())?;
        let mount = rustix::mount::fsmount(
            fs.as_fd(),
            FsMountFlags::FSMOUNT_CLOEXEC,
            MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NODEV,
        )?;
        rustix::mount::move_mount(
            mount.as_fd(),
            "",
            rustix::fs::CWD,
            &place.mount,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    let err = match moved {
        Ok(moved) => match attach(&fresh) {
            Ok(()) => {
                let _ = (&again, &moved);
                // Where it cannot be sent, the teardown happens here, before the helper ends.
                let _ = sys::send_message(hand_back.as_fd(), b"h", &[held.as_raw_fd()]);
                // Told, and the report closed (its end of file is what the caller waits
                // for): the clones above are let go of after.
                if let Some(mut report) = report.take() {
                    let _ = report.write_all(SWAPPED.as_bytes());
                }
                return Ok(());
            }
            Err(err) => {
                // Back as it was: the entries in their layer, the old overlay torn down now
                // (its upper would otherwise be in use), then mounted again.
                if let Some((from, into)) = moved {
                    let _ = move_entries(&into, &from);
                }
                err.to_string()
            }
        },
        Err(err) => err,
    };
    drop(held);
    match attach(&again) {
        Ok(()) => Err(Outcome::Failed(format!(
            "mounting the new workspace (the old one is back): {err}"
        ))),
        Err(again) => Err(Outcome::Broken(format!(
            "mounting the new workspace: {err}; mounting the old one again: {again}"
        ))),
    }
}

/// Moves every entry of the directory `source` into the directory `target` (both on one file
/// system), and the overlay's marks on `source` itself with them.
fn move_entries(source: &OwnedFd, target: &OwnedFd) -> io::Result<()> {
    let names = sys::entry_names(source.as_fd())?;
    for name in &names {
        rustix::fs::renameat(source, name.as_c_str(), target, name.as_c_str())?;
    }
    let mut list = vec![0u8; 4096];
    let length = rustix::fs::flistxattr(source, &mut list).unwrap_or(0);
    for attr in list[..length].split(|b| *b == 0).filter(|a| !a.is_empty()) {
        if !attr.starts_with(b"user.overlay.") && !attr.starts_with(b"trusted.overlay.") {
            continue;
        }
        let Ok(attr) = std::ffi::CString::new(attr) else {
            continue;
        };
        let mut value = vec![0u8; 4096];
        if let Ok(n) = rustix::fs::fgetxattr(source, attr.as_c_str(), &mut value) {
            rustix::fs::fsetxattr(
                target,
                attr.as_c_str(),
                &value[..n],
                rustix::fs::XattrFlags::empty(),
            )?;
        }
    }
    Ok(())
}
