//! Resetting a running cell's workspace in place. The cell's overlay stays mounted: with the cell
//! frozen, a short-lived helper of the warden joins the cell's user and mount namespaces and
//! makes the merged tree at the workspace mount equal to the target (the start, or a snapshot),
//! through the overlay itself, changing only the paths that differ.
//!
//! Why not a new overlay: the Landlock domain of every process of the cell grants write access
//! on the workspace's root *inode*; a new overlay has a new root, and the processes (the cell's
//! init, and so every process started later) could never write the workspace again. Landlock
//! ignores mount points on its walk, so no rule could cover whatever is mounted there later.
//! Writing through the mounted overlay is also the one way of changing it that overlayfs
//! defines: the layers underneath are never touched while it is mounted.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use warden_workspace::{Change, ChangeKind, DiffOptions, EntryKind, LayerMeta, Sensitivity};

use super::sys;

/// What resetting a running cell's workspace in place may meet.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// The layers could not be compared.
    #[error(transparent)]
    Plan(#[from] warden_workspace::WorkspaceError),
    #[error("remounting the workspace of cell `{cell}`: {source}")]
    Remount { cell: String, source: io::Error },
}

/// What a path must become.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Want {
    Absent,
    Dir {
        mode: u32,
    },
    /// A file with this content hash (when known) and length (when known); read from target
    /// layer `from` (an index into the target stack), or from the host directory (`None`).
    File {
        mode: u32,
        hash: Option<String>,
        len: Option<u64>,
        from: Option<usize>,
    },
    Link {
        target: String,
    },
}

/// One step of a reset, run inside the cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    Remove(String),
    Dir {
        path: String,
        mode: u32,
    },
    /// `over`: a file is there now, to be written over where it can be (one inode of its own).
    File {
        path: String,
        mode: u32,
        from: Option<usize>,
        over: bool,
    },
    Link {
        path: String,
        target: String,
    },
}

/// The most threads a reset writes files with, and the fewest files each thread is given (a
/// thread's start costs about as much as a few files' writes).
const MAX_THREADS: usize = 4;
const SPREAD_AT: usize = 32;

/// A file's layer, where it is never read (the current tree's): not looked up.
const SOME_LAYER: usize = usize::MAX;

/// A tree the plan looks things up in, by paths relative to its root: a walk of a few
/// components from a descriptor of the root, where an absolute path under the state folder is
/// eight to ten (three lookups a file, most of the plan's own time at 1,000 files).
struct Root(Option<OwnedFd>);

impl Root {
    /// A descriptor of the tree at `path`; one that is not there has nothing.
    fn open(path: &Path) -> io::Result<Self> {
        match rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(Self(Some(fd))),
            Err(rustix::io::Errno::NOENT) => Ok(Self(None)),
            Err(e) => Err(e.into()),
        }
    }

    /// What is at `rel` (not followed), if anything is.
    fn stat(&self, rel: &str) -> Option<rustix::fs::Stat> {
        rustix::fs::statat(self.0.as_ref()?, rel, AtFlags::SYMLINK_NOFOLLOW).ok()
    }

    fn has(&self, rel: &str) -> bool {
        self.stat(rel).is_some()
    }

    /// The regular file at `rel` (not followed, never waited on), with its length.
    fn file(&self, rel: &str) -> Option<(fs::File, u64)> {
        let fd = rustix::fs::openat(
            self.0.as_ref()?,
            rel,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()?;
        let stat = rustix::fs::fstat(&fd).ok()?;
        (FileType::from_raw_mode(stat.st_mode) == FileType::RegularFile)
            .then(|| (fs::File::from(fd), u64::try_from(stat.st_size).unwrap_or(0)))
    }

    /// The target of the link at `rel`.
    fn link(&self, rel: &str) -> Option<String> {
        let target = rustix::fs::readlinkat(self.0.as_ref()?, rel, Vec::new()).ok()?;
        Some(target.to_string_lossy().into_owned())
    }
}

/// Whether the files at `rel` of `a` and of `b` hold the same bytes (false where either cannot
/// be read: the reset then writes the target's over the current one).
fn same_content(a: &Root, b: &Root, rel: &str) -> bool {
    let (Some((mut a, a_len)), Some((mut b, b_len))) = (a.file(rel), b.file(rel)) else {
        return false;
    };
    if a_len != b_len {
        return false;
    }
    // In pieces: the files may be of any size.
    let (mut x, mut y) = (vec![0u8; 64 << 10], vec![0u8; 64 << 10]);
    loop {
        let n = match a.read(&mut x) {
            Ok(0) => return matches!(b.read(&mut y[..1]), Ok(0)),
            Ok(n) => n,
            Err(_) => return false,
        };
        if b.read_exact(&mut y[..n]).is_err() || x[..n] != y[..n] {
            return false;
        }
    }
}

/// What `change` makes the path; `stack`: where a file's content is then read from (the
/// topmost of these layers that has it), `None` where it is never read.
fn want(change: &Change, stack: Option<&[Root]>) -> Want {
    if change.kind == ChangeKind::Deleted {
        return Want::Absent;
    }
    match change.entry {
        EntryKind::Dir => Want::Dir {
            mode: change.new_mode.unwrap_or(0o755),
        },
        EntryKind::Symlink => Want::Link {
            target: change.link_target.clone().unwrap_or_default(),
        },
        // A FIFO or socket of a snapshot is not made again (nothing can be applied from it).
        EntryKind::Special => Want::Absent,
        EntryKind::File => Want::File {
            mode: change.new_mode.unwrap_or(0o644),
            hash: change.hash.clone(),
            len: change.size,
            from: match stack {
                Some(stack) => stack.iter().position(|layer| layer.has(&change.path)),
                None => Some(SOME_LAYER),
            },
        },
    }
}

/// The steps that turn the current tree (host directory under `current` layers) into the
/// target (host directory under `target` layers): removals deepest first, then what is made,
/// parents first. A path the two trees agree on is left alone.
pub(super) fn plan(
    lower: &Path,
    current: &[PathBuf],
    target: &[PathBuf],
) -> Result<Vec<Step>, warden_workspace::WorkspaceError> {
    // A file that the host has at another size, or not at all, is not read by the diffs: it
    // changed, and where both trees hold such a file it is compared here, from the two layers.
    let target_options = DiffOptions {
        sensitivity: Sensitivity::default(),
        max_patch_bytes: 0,
        max_patches_bytes: 0,
        max_file_bytes: u64::MAX,
        hash_changed: false,
        tell_copies: true,
        // A reset reads what it must to put the target back, whatever its size.
        max_read_bytes: u64::MAX,
        // And all of both trees, or it changes nothing: a part of either it could not read (a
        // directory deeper than the diff goes) would be left as the cell made it, and the reset
        // said to be done.
        unread_fails: true,
        // A reset's plan reads the host directory as it is (a killed apply is undone by the
        // next diff or apply of the cell, which hold the key).
        apply_key: None,
    };
    // Nor does the current tree's diff read a file of the host's size (a copy of the host's, or
    // a change of the same size): the plan compares it with the version the target has there
    // (a target layer's or the host's), by length, and byte by byte only where the lengths
    // agree. Told apart by the diff, it was read and compared with the host's first.
    let current_options = DiffOptions {
        tell_copies: false,
        ..target_options.clone()
    };
    // The two trees are read side by side (the cell is frozen meanwhile); one after the other
    // where no thread is to be had.
    let (now, then) = std::thread::scope(|scope| {
        let then = std::thread::Builder::new().spawn_scoped(scope, || {
            warden_workspace::diff(lower, target, &target_options)
        });
        let now = warden_workspace::diff(lower, current, &current_options);
        let then = match then {
            Ok(then) => then.join().unwrap_or_else(|_| {
                Err(warden_workspace::WorkspaceError::Read {
                    path: lower.to_path_buf(),
                    source: io::Error::other("the thread reading the target panicked"),
                })
            }),
            Err(_) => warden_workspace::diff(lower, target, &target_options),
        };
        (now, then)
    });
    let (now, then) = (now?, then?);
    let open = |path: &Path| {
        Root::open(path).map_err(|source| warden_workspace::WorkspaceError::Read {
            path: path.to_path_buf(),
            source,
        })
    };
    let host = open(lower)?;
    let current_roots = current
        .iter()
        .map(|p| open(p))
        .collect::<Result<Vec<_>, _>>()?;
    let target_roots = target
        .iter()
        .map(|p| open(p))
        .collect::<Result<Vec<_>, _>>()?;
    let now: BTreeMap<&str, &Change> = now.changes.iter().map(|c| (c.path.as_str(), c)).collect();
    let then: BTreeMap<&str, &Change> = then.changes.iter().map(|c| (c.path.as_str(), c)).collect();
    let host_state = |path: &str| -> Want {
        let Some(stat) = host.stat(path) else {
            return Want::Absent;
        };
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Directory => Want::Dir {
                mode: stat.st_mode & 0o7777,
            },
            FileType::Symlink => Want::Link {
                target: host.link(path).unwrap_or_default(),
            },
            _ => Want::File {
                mode: stat.st_mode & 0o7777,
                hash: None,
                len: u64::try_from(stat.st_size).ok(),
                from: None,
            },
        }
    };
    let mut removals = Vec::new();
    let mut makes = Vec::new();
    let paths: std::collections::BTreeSet<&str> = now.keys().chain(then.keys()).copied().collect();
    for path in paths {
        let is = now
            .get(path)
            .map_or_else(|| host_state(path), |c| want(c, None));
        let should = then
            .get(path)
            .map_or_else(|| host_state(path), |c| want(c, Some(&target_roots)));
        let same = match (&is, &should) {
            // Both read from the host directory, unchanged: the same file.
            (
                Want::File {
                    from: None,
                    hash: None,
                    mode: a,
                    ..
                },
                Want::File {
                    from: None,
                    hash: None,
                    mode: b,
                    ..
                },
            ) => a == b,
            (
                Want::File {
                    hash: Some(a),
                    mode: m,
                    ..
                },
                Want::File {
                    hash: Some(b),
                    mode: n,
                    ..
                },
            ) => a == b && m == n,
            // The cell's file, unread (its diff reads none): of another length than the
            // target's version, it differs; of the same, its bytes are compared with that
            // version's (a target layer's, or the host's).
            (
                Want::File {
                    from: Some(SOME_LAYER),
                    mode: m,
                    len: a,
                    ..
                },
                Want::File {
                    from,
                    mode: n,
                    len: b,
                    ..
                },
            ) => {
                m == n
                    && !matches!((a, b), (Some(a), Some(b)) if a != b)
                    && current_roots
                        .iter()
                        .find(|root| root.has(path))
                        .is_some_and(|now| {
                            let then = match from {
                                Some(layer) => target_roots.get(*layer),
                                None => Some(&host),
                            };
                            then.is_some_and(|then| same_content(now, then, path))
                        })
            }
            (Want::File { .. }, Want::File { .. }) => false,
            (a, b) => a == b,
        };
        if same {
            continue;
        }
        // A file of the cell's layers that stays a file is written over: a new file in its place
        // costs a create and a rename (and, had the name been removed first, a whiteout through
        // the overlay). That includes a copy of the host's file (copied up, or written back to
        // it by a reset), which the diff does not list. A host file the cell never touched is
        // replaced: written over, it would be copied up first.
        let over = match (&is, &should) {
            (Want::File { from: Some(_), .. }, Want::File { .. }) => true,
            (Want::File { from: None, .. }, Want::File { .. }) => {
                current_roots.iter().any(|layer| layer.has(path))
            }
            _ => false,
        };
        // A file that stays a file is never removed first: a new one is renamed over it.
        let replaced = !matches!(
            (&is, &should),
            (Want::Dir { .. }, Want::Dir { .. })
                | (Want::File { .. }, Want::File { .. })
                | (Want::Absent, _)
        );
        if replaced {
            removals.push(path.to_owned());
        }
        match should {
            Want::Absent => {}
            Want::Dir { mode } => makes.push(Step::Dir {
                path: path.to_owned(),
                mode,
            }),
            Want::File { mode, from, .. } => makes.push(Step::File {
                path: path.to_owned(),
                mode,
                from,
                over,
            }),
            Want::Link { target } => makes.push(Step::Link {
                path: path.to_owned(),
                target,
            }),
        }
    }
    // Deepest first, so that a directory goes after what it held.
    removals.sort_by(|a, b| b.cmp(a));
    let mut steps: Vec<Step> = removals.into_iter().map(Step::Remove).collect();
    steps.extend(makes);
    Ok(steps)
}

/// Resets the workspace of the running (frozen) cell whose init is `pid`, mounted at
/// `meta.mount` inside it, from its `current` layers to the `target` ones.
pub(super) fn in_place(
    registry: &super::registry::Registry,
    meta: &LayerMeta,
    cell: &str,
    pid: i32,
    current: &[PathBuf],
    target: &[PathBuf],
) -> Result<(), ResetError> {
    let steps = plan(&meta.lower, current, target)?;
    if steps.is_empty() {
        return Ok(());
    }
    let remount_err = |source: io::Error| ResetError::Remount {
        cell: cell.to_owned(),
        source,
    };
    // The sources, opened here: inside the cell's mount namespace no host path is reachable,
    // but these descriptors still lead where they were opened.
    let open_dir = |path: &Path| -> io::Result<OwnedFd> {
        rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(io::Error::from)
    };
    // A root-started cell sees the host directory through an id-mapped mount (its owner shown as
    // the cell's user): the helper, in the cell's user namespace, reads the host's files through
    // one like it, so that it may read what the cell may (a file of the owner's mode 600, say),
    // and no more.
    let lower = if nix::unistd::geteuid().is_root() {
        let (uid, gid) = super::swap::cell_ids(pid).map_err(remount_err)?;
        super::idmap::workspace_tree_for(&meta.lower, uid, gid)
            .map_err(|e| remount_err(io::Error::other(e.to_string())))?
    } else {
        open_dir(&meta.lower).map_err(remount_err)?
    };
    let layers: Vec<OwnedFd> = target
        .iter()
        .map(|l| open_dir(l))
        .collect::<io::Result<_>>()
        .map_err(remount_err)?;
    let ns = namespaces(registry, cell, pid).map_err(remount_err)?;
    // Asked out here: inside the cell, the helper would read the cell's own view of the machine.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_THREADS));
    let (report_r, report_w) = sys::pipe().map_err(remount_err)?;
    let child = sys::clone_process(0).map_err(remount_err)?;
    if child == 0 {
        drop(report_r);
        // None of the caller's other descriptors: forked by a daemon, the helper outlives a
        // daemon that is killed, and with its listening socket it took connections that nobody
        // answered (and with its database, the next daemon's lock).
        let mut keep = vec![
            report_w.as_raw_fd(),
            lower.as_raw_fd(),
            ns.user.as_raw_fd(),
            ns.mnt.as_raw_fd(),
        ];
        keep.extend(ns.root.as_ref().map(AsRawFd::as_raw_fd));
        keep.extend(layers.iter().map(AsRawFd::as_raw_fd));
        let _ = sys::close_except(&keep);
        let result = run_inside(&ns, &meta.mount, &lower, &layers, &steps, threads);
        let mut report = fs::File::from(report_w);
        if let Err(err) = result {
            let _ = write!(report, "{err}");
            sys::exit_now(1);
        }
        sys::exit_now(0);
    }
    drop(report_w);
    let mut message = String::new();
    let _ = fs::File::from(report_r).read_to_string(&mut message);
    let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child), None);
    match status {
        Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
        _ if !message.is_empty() => Err(remount_err(io::Error::other(message))),
        other => Err(remount_err(io::Error::other(format!(
            "the reset helper ended with {other:?}"
        )))),
    }
}

/// The cell's user and mount namespaces: from its keeper, or (a cell whose keeper holds none)
/// from its init's `/proc` entries, which only a privileged warden may open.
fn namespaces(
    registry: &super::registry::Registry,
    cell: &str,
    pid: i32,
) -> io::Result<super::exec::Namespaces> {
    match super::exec::namespaces(registry, cell) {
        Ok(all) => Ok(all),
        Err(_) => {
            let open = |ns: &str| fs::File::open(format!("/proc/{pid}/ns/{ns}")).map(OwnedFd::from);
            Ok(super::exec::Namespaces {
                user: open("user")?,
                mnt: open("mnt")?,
                root: None,
            })
        }
    }
}

/// In the helper: joins the cell (as its root) and carries out the steps under `mount`.
fn run_inside(
    ns: &super::exec::Namespaces,
    mount: &Path,
    lower: &OwnedFd,
    layers: &[OwnedFd],
    steps: &[Step],
    threads: usize,
) -> Result<(), String> {
    use nix::sched::{CloneFlags, setns};
    ns.join_user()
        .map_err(|e| format!("joining the cell's user namespace: {e}"))?;
    setns(&ns.mnt, CloneFlags::CLONE_NEWNS)
        .map_err(|e| format!("joining the cell's mount namespace: {e}"))?;
    if let Some(root) = &ns.root {
        nix::unistd::fchdir(root).map_err(|e| format!("entering the cell's root: {e}"))?;
        nix::unistd::chroot(".").map_err(|e| format!("entering the cell's root: {e}"))?;
    }
    let _ = nix::unistd::setresgid(0.into(), 0.into(), 0.into());
    let _ = nix::unistd::setresuid(0.into(), 0.into(), 0.into());
    let root = rustix::fs::open(
        mount,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("opening the workspace at {}: {e}", mount.display()))?;
    // What the cell sees as the workspace's owner owns what the reset makes.
    let owner = rustix::fs::fstat(&root).map_err(|e| format!("reading the workspace: {e}"))?;
    let owner = (owner.st_uid, owner.st_gid);
    // Removals and directories first, in their order (a directory goes after what it held, a
    // parent before what it holds); then the files and links, each of which changes its own
    // path only, in runs of neighbouring paths side by side.
    let (ordered, spread): (Vec<&Step>, Vec<&Step>) = steps
        .iter()
        .partition(|step| matches!(step, Step::Remove(_) | Step::Dir { .. }));
    let run = |steps: &[&Step], stop: &AtomicBool| -> Result<(), String> {
        let mut parents = Parents {
            root: &root,
            last: None,
        };
        for step in steps {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            carry_out(&mut parents, lower, layers, step, owner).map_err(|e| {
                stop.store(true, Ordering::Relaxed);
                format!("{}: {e}", step_path(step))
            })?;
        }
        Ok(())
    };
    let stop = AtomicBool::new(false);
    run(&ordered, &stop)?;
    let threads = threads.clamp(1, spread.len().div_ceil(SPREAD_AT).max(1));
    let runs: Vec<&[&Step]> = spread
        .chunks(spread.len().div_ceil(threads).max(1))
        .collect();
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let started: Vec<_> = runs
            .iter()
            .skip(1)
            .map(|steps| {
                let (run, stop) = (&run, &stop);
                std::thread::Builder::new()
                    .spawn_scoped(scope, move || run(steps, stop))
                    .map_err(|_| *steps)
            })
            .collect();
        // The first run here; a run no thread could be had for, here after it.
        let mut results = vec![runs.first().map_or(Ok(()), |steps| run(steps, &stop))];
        for started in started {
            results.push(match started {
                Ok(thread) => thread
                    .join()
                    .unwrap_or_else(|_| Err("a thread of the reset failed".to_owned())),
                Err(steps) => run(steps, &stop),
            });
        }
        results
    });
    results.into_iter().collect()
}

fn step_path(step: &Step) -> &str {
    match step {
        Step::Remove(path)
        | Step::Dir { path, .. }
        | Step::File { path, .. }
        | Step::Link { path, .. } => path,
    }
}

/// The directories the steps work in, opened beneath the workspace's root, never through a link.
/// The last one stays open for the next step: the steps are in path order, so a directory's
/// files come one after another. A step changes only its own path, never its directory, and the
/// step that removes a directory opens that directory's parent first: the one kept open is
/// never one a step removed.
struct Parents<'r> {
    root: &'r OwnedFd,
    last: Option<(String, OwnedFd)>,
}

impl Parents<'_> {
    /// Splits a workspace path into its directory (opened) and its last component.
    fn of<'p>(&mut self, path: &'p str) -> io::Result<(std::os::fd::BorrowedFd<'_>, &'p str)> {
        let (dir, name) = match path.rsplit_once('/') {
            Some((dir, name)) => (dir, name),
            None => ("", path),
        };
        if self.last.as_ref().is_none_or(|(open, _)| open != dir) {
            let mut fd = self.root.as_fd().try_clone_to_owned()?;
            for part in dir.split('/').filter(|p| !p.is_empty()) {
                fd = rustix::fs::openat(
                    &fd,
                    part,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
            }
            self.last = Some((dir.to_owned(), fd));
        }
        let (_, fd) = self
            .last
            .as_ref()
            .ok_or_else(|| io::Error::other("no directory"))?;
        Ok((fd.as_fd(), name))
    }
}

fn carry_out(
    parents: &mut Parents<'_>,
    lower: &OwnedFd,
    layers: &[OwnedFd],
    step: &Step,
    (uid, gid): (u32, u32),
) -> io::Result<()> {
    let chown = |dir: std::os::fd::BorrowedFd<'_>, name: &str| {
        rustix::fs::chownat(
            dir,
            name,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
    };
    match step {
        Step::Remove(path) => {
            let (dir, name) = parents.of(path)?;
            let name = std::ffi::CString::new(name).map_err(io::Error::other)?;
            sys::remove_tree_at(dir, &name)
        }
        Step::Dir { path, mode } => {
            let (dir, name) = parents.of(path)?;
            match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(mode & 0o777)) {
                Ok(()) => chown(dir, name)?,
                Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            // Its mode set through the directory itself, opened without following a symlink
            // (by name, a symlink put there meanwhile would lead the change elsewhere).
            let made = rustix::fs::openat(
                dir,
                name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            rustix::fs::fchmod(&made, Mode::from_raw_mode(mode & 0o777))?;
            Ok(())
        }
        Step::File {
            path,
            mode,
            from,
            over,
        } => {
            let source_dir = match from {
                Some(i) => layers
                    .get(*i)
                    .ok_or_else(|| io::Error::other("no such target layer"))?,
                None => lower,
            };
            // Without waiting: a FIFO found there (the plan names files only) is refused below,
            // not waited on for a writer with the cell frozen.
            let source = rustix::fs::openat(
                source_dir,
                path.as_str(),
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let source = fs::File::from(source);
            let meta = source.metadata()?;
            if !meta.is_file() {
                return Err(io::Error::other(format!(
                    "{path} is no longer a file in the layer the reset reads; the reset stops there"
                )));
            }
            let (length, allocated) = (meta.len(), Some(meta.blocks() * 512));
            let (dir, name) = parents.of(path)?;
            if *over
                && overwrite(dir, name, &source, (length, allocated), *mode, (uid, gid)).is_ok()
            {
                return Ok(());
            }
            let temporary = format!(".warden-reset-{}-{name}", std::process::id());
            let target = rustix::fs::openat(
                dir,
                temporary.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(mode & 0o777),
            )?;
            let target = fs::File::from(target);
            // Owner and mode through the new file itself, not its name.
            let copied = sys::copy_data(&source, &target, length, allocated)
                .and_then(|_| {
                    rustix::fs::fchown(
                        &target,
                        Some(rustix::fs::Uid::from_raw(uid)),
                        Some(rustix::fs::Gid::from_raw(gid)),
                    )
                    .map_err(io::Error::from)
                })
                .and_then(|()| {
                    rustix::fs::fchmod(&target, Mode::from_raw_mode(mode & 0o777))
                        .map_err(io::Error::from)
                })
                .and_then(|()| {
                    rustix::fs::renameat(dir, temporary.as_str(), dir, name)
                        .map_err(io::Error::from)
                });
            if copied.is_err() {
                let _ = rustix::fs::unlinkat(dir, temporary.as_str(), AtFlags::empty());
            }
            copied
        }
        Step::Link { path, target } => {
            let (dir, name) = parents.of(path)?;
            rustix::fs::symlinkat(target.as_str(), dir, name)?;
            let _ = chown(dir, name);
            Ok(())
        }
    }
}

/// Writes `source` over the regular file `name` in `dir`, which no other name links to (so that
/// nothing but this path changes), and gives it `mode` and the workspace's owner: an open, the
/// data and a close, where a new file in its place costs a create, a chown, a chmod and a
/// rename. An error leaves it to the caller to put a new file in its place.
fn overwrite(
    dir: std::os::fd::BorrowedFd<'_>,
    name: &str,
    source: &fs::File,
    (length, allocated): (u64, Option<u64>),
    mode: u32,
    (uid, gid): (u32, u32),
) -> io::Result<()> {
    // Never blocks: a FIFO put there would be refused below, not waited on.
    let target = rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let stat = rustix::fs::fstat(&target)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile || stat.st_nlink != 1 {
        return Err(io::Error::other("not a file of one name"));
    }
    let target = fs::File::from(target);
    sys::copy_data_over(source, &target, length, allocated, stat.st_size as u64)?;
    if (stat.st_uid, stat.st_gid) != (uid, gid) {
        rustix::fs::fchown(
            &target,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        )?;
    }
    // A mode with set-id bits differs from any `mode & 0o777`: the write and the chown, which
    // clear those bits, change nothing else of it.
    if stat.st_mode & 0o7777 != mode & 0o777 {
        rustix::fs::fchmod(&target, Mode::from_raw_mode(mode & 0o777))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::process::deep::{deep_chain, on_small_stack};

    /// A tree deeper than a diff goes, in the cell's layer or in the target's: the plan fails,
    /// naming the directory, rather than leave that part as the cell made it (or overflow the
    /// thread's stack, as the recursive walk of a tree 1,900 deep did).
    #[test]
    fn a_plan_of_a_tree_deeper_than_the_diff_goes_fails_and_names_it() {
        let tmp = tempfile::tempdir().unwrap();
        let (lower, now, then) = (
            tmp.path().join("lower"),
            tmp.path().join("now"),
            tmp.path().join("then"),
        );
        for dir in [&lower, &now, &then] {
            fs::create_dir_all(dir).unwrap();
        }
        fs::write(then.join("snap-only"), "s\n").unwrap();
        deep_chain(&now, 3000);
        let deepest = vec!["d"; warden_workspace::MAX_DEPTH + 1].join("/");
        for (current, target) in [(&now, &then), (&then, &now)] {
            let (lower, current, target) = (lower.clone(), current.clone(), target.clone());
            let err = on_small_stack(move || plan(&lower, &[current], &[target])).unwrap_err();
            assert!(
                matches!(&err, warden_workspace::WorkspaceError::Unread { path, .. } if *path == deepest),
                "{err}"
            );
            let text = err.to_string();
            assert!(text.contains("deeper than 256 levels"), "{text}");
            assert!(text.contains("nothing was changed"), "{text}");
        }
    }

    #[test]
    fn only_what_differs_is_touched_and_removals_come_first() {
        let tmp = tempfile::tempdir().unwrap();
        let lower = tmp.path().join("lower");
        let now = tmp.path().join("now");
        let then = tmp.path().join("then");
        for dir in [&lower, &now, &then] {
            fs::create_dir_all(dir).unwrap();
        }
        fs::write(lower.join("kept"), "same\n").unwrap();
        fs::write(lower.join("edited"), "old\n").unwrap();
        fs::create_dir_all(now.join("newdir/deep")).unwrap();
        fs::write(now.join("newdir/deep/x"), "x").unwrap();
        fs::write(now.join("edited"), "new\n").unwrap();
        fs::write(now.join("both"), "same in both\n").unwrap();
        fs::write(then.join("both"), "same in both\n").unwrap();
        // Changed alike in both trees (the host's of another size): read by neither diff, their
        // bytes compared, and left alone.
        fs::write(lower.join("changed-alike"), "old\n").unwrap();
        fs::write(now.join("changed-alike"), "newer\n").unwrap();
        fs::write(then.join("changed-alike"), "newer\n").unwrap();
        // Of one size in both trees, the host has none: compared byte by byte, and they differ.
        fs::write(now.join("same-size"), "aaaa\n").unwrap();
        fs::write(then.join("same-size"), "bbbb\n").unwrap();
        fs::write(then.join("snap-only"), "s\n").unwrap();
        // In the cell's layer as the host has it (copied up): not a change, but written over.
        fs::write(lower.join("copied"), "host\n").unwrap();
        fs::write(now.join("copied"), "host\n").unwrap();
        fs::write(then.join("copied"), "snapshot\n").unwrap();
        // The cell's diff reads no file of the host's size: the plan tells these apart. A copy
        // of the host's where the target has the host's: left alone.
        fs::write(lower.join("copy-kept"), "host\n").unwrap();
        fs::write(now.join("copy-kept"), "host\n").unwrap();
        // Changed alike in both trees at the host's size: left alone.
        fs::write(lower.join("alike-at-size"), "aaa\n").unwrap();
        fs::write(now.join("alike-at-size"), "bbb\n").unwrap();
        fs::write(then.join("alike-at-size"), "bbb\n").unwrap();
        // A copy of the host's where the target changed it at the same size: written over.
        fs::write(lower.join("copy-then-changed"), "hhhh\n").unwrap();
        fs::write(now.join("copy-then-changed"), "hhhh\n").unwrap();
        fs::write(then.join("copy-then-changed"), "tttt\n").unwrap();
        // The host's alone: a new file renamed over it, never written over (that would copy it up
        // first), nor removed first.
        fs::write(lower.join("untouched"), "host\n").unwrap();
        fs::write(then.join("untouched"), "snapshot\n").unwrap();
        let steps = plan(
            &lower,
            std::slice::from_ref(&now),
            std::slice::from_ref(&then),
        )
        .unwrap();
        assert_eq!(
            steps,
            vec![
                Step::Remove("newdir/deep/x".into()),
                Step::Remove("newdir/deep".into()),
                Step::Remove("newdir".into()),
                Step::File {
                    path: "copied".into(),
                    mode: 0o644,
                    from: Some(0),
                    over: true,
                },
                Step::File {
                    path: "copy-then-changed".into(),
                    mode: 0o644,
                    from: Some(0),
                    over: true,
                },
                Step::File {
                    path: "edited".into(),
                    mode: 0o644,
                    from: None,
                    over: true,
                },
                Step::File {
                    path: "same-size".into(),
                    mode: 0o644,
                    from: Some(0),
                    over: true,
                },
                Step::File {
                    path: "snap-only".into(),
                    mode: 0o644,
                    from: Some(0),
                    over: false,
                },
                Step::File {
                    path: "untouched".into(),
                    mode: 0o644,
                    from: Some(0),
                    over: false,
                },
            ]
        );
    }
}
