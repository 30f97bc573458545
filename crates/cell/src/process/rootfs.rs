//! Builds the cell's root file system inside its new mount namespace and pivots into it.
//!
//! Runs in the cell's first process, which still holds every capability of the cell's user
//! namespace; nothing here is visible to the host, because `/` was made private first.

use std::fs;
use std::io;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};

use super::overlay;
use super::plan::{CellPlan, Entry, OverlayPlan, WorkspacePlan};
use super::sys;

/// A failed setup step, named so that the user sees which one.
#[derive(Debug, thiserror::Error)]
#[error("{step} {path}: {source}")]
pub struct SetupError {
    pub step: &'static str,
    pub path: PathBuf,
    pub source: io::Error,
}

fn at(step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SetupError {
    let path = path.to_path_buf();
    move |source| SetupError { step, path, source }
}

fn errno(err: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(err as i32)
}

/// Device nodes bound from the host.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];
/// `/proc` files that leak host information or control the host; hidden behind /dev/null.
const PROC_MASKED_FILES: &[&str] = &[
    "kcore",
    "keys",
    "timer_list",
    "sched_debug",
    "sysrq-trigger",
    "latency_stats",
    "kallsyms",
    "kmsg",
    "config.gz",
];
/// `/proc` directories hidden behind an empty read-only tmpfs.
const PROC_MASKED_DIRS: &[&str] = &["acpi", "scsi", "asound", "firmware", "driver"];
/// `/proc` directories kept visible but read-only.
const PROC_READ_ONLY: &[&str] = &["sys", "irq", "bus", "fs"];

/// Assembles the root described by `plan` on `plan.root` and pivots into it; the host's root
/// is still being detached when this returns.
pub fn build(
    plan: &CellPlan,
    workspace_tree: Option<&std::os::fd::OwnedFd>,
) -> Result<HostRootDetaching, SetupError> {
    assemble(plan, workspace_tree, None)?;
    let root = plan.root.as_path();
    mount_dev(root, plan.shm_size)?;
    mount_proc(root)?;
    pivot(root)
}

/// What a root assembled on the host for a sandbox (the gVisor tier) has besides the plan:
/// files of Warden's own, bound read-only at their path in the cell (its init, its shim).
#[derive(Debug)]
pub struct Sandbox<'a> {
    pub files: &'a [(PathBuf, PathBuf)],
}

/// Assembles the root described by `plan` on `plan.root`, in this process's mount namespace
/// (made private first): the tree, its `/etc`, the writable paths, `/tmp`, the workspace and the
/// hidden paths. For a sandbox (`Some`), the mount points of what the sandbox provides itself
/// (`/dev`, `/proc`, `/sys`) are made, and the sandbox's own files bound in.
pub fn assemble(
    plan: &CellPlan,
    workspace_tree: Option<&std::os::fd::OwnedFd>,
    sandbox: Option<Sandbox<'_>>,
) -> Result<(), SetupError> {
    let root = plan.root.as_path();
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(errno)
    .map_err(at("making mounts private at", Path::new("/")))?;
    mount_fs(
        "mounting the cell root on",
        "tmpfs",
        root,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755,size=16m"),
    )?;
    if !plan.image.is_empty() {
        mount_image(root, &plan.image)?;
    }

    // Read-only entries first; the whole tree is then made read-only, nosuid and nodev in one
    // recursive step, and the writable mounts go on top of their (already created) mount points.
    let sources = sources(plan);
    let mut made = Made::default();
    for (entry, source) in plan.entries.iter().zip(&sources) {
        place(root, entry, *source, &mut made)?;
    }
    if let Some(sandbox) = &sandbox {
        for (path, host) in sandbox.files {
            let dst = inside(root, path);
            mountpoint(&dst, false, &mut made)?;
            bind("bind-mounting", host, &dst, false)?;
        }
    }
    write_etc(plan, &mut made)?;
    let workspace = inside(root, &plan.workspace_mount);
    let mut dirs = vec![
        root.join("tmp"),
        workspace,
        root.join("dev"),
        root.join("proc"),
    ];
    if sandbox.is_some() {
        dirs.push(root.join("sys"));
    }
    for dir in &dirs {
        fs::create_dir_all(dir).map_err(at("creating directory", dir))?;
    }
    sys::restrict_mount(root, true).map_err(at("making the cell root read-only", root))?;
    for (entry, source) in plan.entries.iter().zip(&sources) {
        if let Entry::Bind {
            path,
            writable: true,
            ..
        } = entry
        {
            let dst = inside(root, path);
            bind_from("bind-mounting", path, *source, &dst)?;
            sys::restrict_mount(&dst, false).map_err(at("restricting mount", &dst))?;
        }
    }
    mount_tmp(root, plan.tmp_size)?;
    mount_workspace(plan, workspace_tree)?;
    for hidden in &plan.hidden {
        hide(&inside(root, hidden))?;
    }
    Ok(())
}

/// An image's layers as the root: an overlay of detached clones of them (no host path shows in
/// the cell's mountinfo), over an upper in the tmpfs beneath, which holds the mount points and
/// the files the warden writes into `/etc`; the whole is made read-only with the rest.
fn mount_image(root: &Path, layers: &[PathBuf]) -> Result<(), SetupError> {
    use std::os::fd::AsRawFd as _;
    let mut clones = Vec::new();
    for layer in layers {
        let fd = sys::detached_clone(layer).map_err(at("taking a detached mount of", layer))?;
        sys::restrict_detached(&fd).map_err(at("making read-only", layer))?;
        clones.push(fd);
    }
    let lowers: Vec<PathBuf> = clones
        .iter()
        .map(|fd| PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())))
        .collect();
    let upper = root.join(".warden-upper");
    let work = root.join(".warden-work");
    // `/etc` in the upper layer is the setup's own, so that the warden can write its files
    // there whoever owns the image's `/etc` (its files belong to ids the cell does not map).
    for dir in [&upper, &work, &upper.join("etc")] {
        fs::create_dir(dir).map_err(at("creating directory", dir))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
            .map_err(at("setting mode of", dir))?;
    }
    overlay::mount_overlay(root, &lowers, &upper, &work)
        .map_err(errno)
        .map_err(at("mounting the image's layers on", root))
}

/// Mounts a file system of type `fstype` on `target`; the error names `step`.
fn mount_fs(
    step: &'static str,
    fstype: &str,
    target: &Path,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), SetupError> {
    mount(Some(fstype), target, Some(fstype), flags, data)
        .map_err(errno)
        .map_err(at(step, target))
}

/// Bind-mounts `source` on `target` (with the mounts below it when `recursive`).
fn bind(
    step: &'static str,
    source: &Path,
    target: &Path,
    recursive: bool,
) -> Result<(), SetupError> {
    let flags = if recursive {
        MsFlags::MS_BIND | MsFlags::MS_REC
    } else {
        MsFlags::MS_BIND
    };
    mount(Some(source), target, None::<&str>, flags, None::<&str>)
        .map_err(errno)
        .map_err(at(step, source))
}

/// Changes the flags of the mount at `target` (a bind remount: this mount only).
fn remount(step: &'static str, target: &Path, flags: MsFlags) -> Result<(), SetupError> {
    mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_BIND | flags,
        None::<&str>,
    )
    .map_err(errno)
    .map_err(at(step, target))
}

fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// How the setup reaches an entry's host side: by its path, or (below a directory the setup
/// may not search) through what the warden opened for it, in the slot `Source` names.
#[derive(Debug, Clone, Copy)]
enum Source {
    Path,
    Slot(std::os::fd::RawFd),
}

fn sources(plan: &CellPlan) -> Vec<Source> {
    (0..plan.entries.len())
        .map(|i| match plan.sources.get(i).copied().flatten() {
            Some(slot) => Source::Slot(slot),
            None => Source::Path,
        })
        .collect()
}

/// Bind-mounts `path` of the host on `target`: a recursive bind of the path, or the attachment
/// of the detached tree the warden cloned of it.
fn bind_from(
    step: &'static str,
    path: &Path,
    source: Source,
    target: &Path,
) -> Result<(), SetupError> {
    match source {
        Source::Path => bind(step, path, target, true),
        Source::Slot(slot) => {
            let tree = sys::own_fd(slot);
            sys::move_mount_to(&tree, target).map_err(at(step, path))
        }
    }
}

fn place(root: &Path, entry: &Entry, source: Source, made: &mut Made) -> Result<(), SetupError> {
    match entry {
        Entry::Symlink { path, target } => {
            let link = inside(root, path);
            made.parent_of(&link)?;
            symlink(target, &link).map_err(at("creating symlink", &link))
        }
        Entry::Copy { path } => {
            let dst = inside(root, path);
            made.parent_of(&dst)?;
            let from = match source {
                Source::Path => path.clone(),
                Source::Slot(slot) => PathBuf::from(format!("/proc/self/fd/{slot}")),
            };
            copy_file(&from, &dst).map_err(at("copying", path))
        }
        Entry::Bind {
            path,
            dir,
            writable,
        } => {
            let dst = inside(root, path);
            mountpoint(&dst, *dir, made)?;
            if *writable {
                return Ok(()); // mounted after the tree is made read-only
            }
            bind_from("bind-mounting", path, source, &dst)
        }
    }
}

/// A host file copied into the tree being assembled: its bytes and its permission bits. Seven system calls, where `fs::copy` makes ten: it tries
/// `copy_file_range` first, which a copy from the host's disk into the cell's tmpfs is refused,
/// looks at the new file again, and reads on to the end past the size it was told.
fn copy_file(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let source = fs::File::open(from)?;
    let meta = source.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let mode = meta.mode() & 0o7777;
    let target = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(to)?;
    // The mode as the host has it, whatever the umask took from it.
    target.set_permissions(fs::Permissions::from_mode(mode))?;
    let mut left = meta.len();
    while left > 0 {
        let count = usize::try_from(left).unwrap_or(usize::MAX).min(1 << 30);
        match rustix::fs::sendfile(&target, &source, None, count)? {
            0 => break, // shrank meanwhile
            sent => left = left.saturating_sub(sent as u64),
        }
    }
    Ok(())
}

/// The directories of the tree being assembled that are known to exist, so that the entries
/// placed in one (most of `/etc`) make it once: a `create_dir_all` of a directory that is there
/// is a `mkdir` and a `statx` each time, two of the eleven system calls of each copied file.
/// Nothing of the tree is removed while it is assembled.
#[derive(Default)]
struct Made(std::collections::HashSet<PathBuf>);

impl Made {
    /// Makes `dir` and what is missing above it, unless it is known to exist.
    fn dir(&mut self, dir: &Path) -> Result<(), SetupError> {
        if self.0.contains(dir) {
            return Ok(());
        }
        fs::create_dir_all(dir).map_err(at("creating directory", dir))?;
        self.0.extend(dir.ancestors().map(Path::to_path_buf));
        Ok(())
    }

    /// Makes the directory `path` is in.
    fn parent_of(&mut self, path: &Path) -> Result<(), SetupError> {
        match path.parent() {
            Some(parent) => self.dir(parent),
            None => Ok(()),
        }
    }
}

fn mountpoint(dst: &Path, dir: bool, made: &mut Made) -> Result<(), SetupError> {
    if dir {
        made.dir(dst)
    } else {
        made.parent_of(dst)?;
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dst)
            .map(drop)
            .map_err(at("creating file", dst))
    }
}

fn write_etc(plan: &CellPlan, made: &mut Made) -> Result<(), SetupError> {
    let etc = plan.root.join("etc");
    made.dir(&etc)?;
    for (name, content) in plan.etc_files() {
        let path = etc.join(&name);
        // Looked at, not followed: an image's link here, even one that leads nowhere, is
        // replaced (written through, it would make or fill its target on the host).
        if fs::symlink_metadata(&path).is_ok() {
            if plan.image.is_empty() {
                continue; // bound from the host by the policy
            }
            // An image's own file gives way to the warden's (its hosts, resolver, users):
            // removed through the overlay, which leaves a whiteout in the upper layer.
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                return Err(at("replacing the image's", &path)(e));
            }
        }
        made.parent_of(&path)?;
        fs::write(&path, content).map_err(at("writing", &path))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644))
            .map_err(at("setting mode of", &path))?;
    }
    Ok(())
}

fn mount_tmp(root: &Path, size: u64) -> Result<(), SetupError> {
    let tmp = root.join("tmp");
    let options = format!("mode=1777,size={size}");
    mount_fs(
        "mounting tmpfs on",
        "tmpfs",
        &tmp,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(options.as_str()),
    )
}

fn mount_workspace(plan: &CellPlan, tree: Option<&std::os::fd::OwnedFd>) -> Result<(), SetupError> {
    let dst = inside(&plan.root, &plan.workspace_mount);
    let Some(workspace) = &plan.workspace else {
        let options = format!(
            "mode=0755,uid={},gid={},size={}",
            plan.ids.inside_uid, plan.ids.inside_gid, plan.tmp_size
        );
        return mount_fs(
            "mounting the scratch workspace on",
            "tmpfs",
            &dst,
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(options.as_str()),
        );
    };
    if let Some(overlay) = &workspace.overlay {
        return mount_copy_on_write(&plan.root, &dst, workspace, overlay, tree);
    }
    match tree {
        Some(tree) => sys::move_mount_to(tree, &dst)
            .map_err(at("attaching the id-mapped workspace on", &dst))?,
        None => bind("bind-mounting the workspace", &workspace.host, &dst, true)?,
    }
    sys::restrict_mount(&dst, false).map_err(at("restricting mount", &dst))?;
    for rel in &workspace.protect {
        let path = dst.join(rel);
        bind("protecting", &path, &path, true)?;
        sys::restrict_mount(&path, true).map_err(at("protecting", &path))?;
    }
    Ok(())
}

/// The copy-on-write workspace, stacked from detached mounts of its layers (the host directory,
/// or in root mode its id-mapped clone; the cell's layer directory; the snapshots it was forked
/// from). They are in no mount tree, so no process of the cell can reach them or read a host
/// path in `/proc/self/mountinfo`; the overlay keeps its own hold on them.
fn mount_copy_on_write(
    root: &Path,
    dst: &Path,
    workspace: &WorkspacePlan,
    overlay: &OverlayPlan,
    tree: Option<&std::os::fd::OwnedFd>,
) -> Result<(), SetupError> {
    let detached = |path: &Path, read_only: bool| -> Result<std::os::fd::OwnedFd, SetupError> {
        let fd = sys::detached_clone(path).map_err(at("taking a detached mount of", path))?;
        if read_only {
            sys::restrict_detached(&fd).map_err(at("making read-only", path))?;
        }
        Ok(fd)
    };
    let lower = match tree {
        // Root mode: the id-mapped clone of the host directory. The warden made it, so it
        // belongs to the host's namespaces, which the cell's overlay may not take a layer
        // from: attached for a moment in the cell's own tree (under its fresh /tmp), it is
        // cloned from there, and detached again.
        Some(tree) => {
            let scratch = root.join("tmp").join(".warden-lower");
            fs::create_dir(&scratch).map_err(at("creating directory", &scratch))?;
            sys::move_mount_to(tree, &scratch)
                .map_err(at("attaching the id-mapped workspace on", &scratch))?;
            let clone = detached(&scratch, true);
            nix::mount::umount2(&scratch, nix::mount::MntFlags::MNT_DETACH)
                .map_err(errno)
                .map_err(at("detaching", &scratch))?;
            fs::remove_dir(&scratch).map_err(at("removing", &scratch))?;
            clone?
        }
        None => detached(&workspace.host, true)?,
    };
    let lower_fd = Some(std::os::fd::AsRawFd::as_raw_fd(&lower));
    let layer = detached(&overlay.layer_dir, false)?;
    let snapshots = if overlay.base.is_empty() {
        None
    } else {
        Some(detached(&overlay.snapshots_dir, true)?)
    };
    let fd_path =
        |fd: std::os::fd::RawFd, rel: &Path| PathBuf::from(format!("/proc/self/fd/{fd}")).join(rel);
    let mut lowers: Vec<PathBuf> = Vec::new();
    // A base layer kept elsewhere than the snapshots directory (in the file system of its own of
    // the cell whose snapshot it is) is cloned alone.
    let mut apart = Vec::new();
    if let Some(snapshots) = &snapshots {
        use std::os::fd::AsRawFd as _;
        for base in &overlay.base {
            match base.strip_prefix(&overlay.snapshots_dir) {
                Ok(rel) => lowers.push(fd_path(snapshots.as_raw_fd(), rel)),
                Err(_) => {
                    let clone = detached(base, true)?;
                    lowers.push(fd_path(clone.as_raw_fd(), Path::new("")));
                    apart.push(clone);
                }
            }
        }
    }
    if let Some(fd) = lower_fd {
        lowers.push(fd_path(fd, Path::new("")));
    }
    use std::os::fd::AsRawFd as _;
    let layer_fd = layer.as_raw_fd();
    overlay::mount_overlay(
        dst,
        &lowers,
        &fd_path(layer_fd, Path::new("upper")),
        &fd_path(layer_fd, Path::new("work")),
    )
    .map_err(errno)
    .map_err(at("mounting the copy-on-write workspace on", dst))
}

fn mount_dev(root: &Path, shm_size: u64) -> Result<(), SetupError> {
    let dev = root.join("dev");
    mount_fs(
        "mounting tmpfs on",
        "tmpfs",
        &dev,
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0755,size=64k"),
    )?;
    let mut made = Made::default();
    for name in DEVICES {
        let src = Path::new("/dev").join(name);
        let dst = dev.join(name);
        mountpoint(&dst, false, &mut made)?;
        bind("bind-mounting", &src, &dst, false)?;
    }
    let pts = dev.join("pts");
    fs::create_dir_all(&pts).map_err(at("creating directory", &pts))?;
    // Every devpts but the host's own draws on one pool of the kernel's (kernel.pty.max less
    // kernel.pty.reserve, 3,072 by default): without a bound of its own, one cell took them all
    // and no other cell could open a terminal.
    mount_fs(
        "mounting devpts on",
        "devpts",
        &pts,
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,max=128"),
    )?;
    let shm = dev.join("shm");
    fs::create_dir_all(&shm).map_err(at("creating directory", &shm))?;
    mount_fs(
        "mounting tmpfs on",
        "tmpfs",
        &shm,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(format!("mode=1777,size={shm_size}").as_str()),
    )?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let path = dev.join(link);
        symlink(target, &path).map_err(at("creating symlink", &path))?;
    }
    remount(
        "making read-only",
        &dev,
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
    )
}

fn mount_proc(root: &Path) -> Result<(), SetupError> {
    let proc = root.join("proc");
    mount_fs(
        "mounting proc on",
        "proc",
        &proc,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    for name in PROC_READ_ONLY {
        let path = proc.join(name);
        if path.exists() {
            bind("bind-mounting", &path, &path, true)?;
            sys::restrict_mount(&path, true).map_err(at("making read-only", &path))?;
        }
    }
    for name in PROC_MASKED_FILES.iter().chain(PROC_MASKED_DIRS) {
        let path = proc.join(name);
        if path.exists() {
            hide(&path)?;
        }
    }
    Ok(())
}

/// Covers `path` with nothing: an empty read-only tmpfs for a directory, /dev/null for a file.
fn hide(path: &Path) -> Result<(), SetupError> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    if meta.is_dir() {
        mount_fs(
            "masking",
            "tmpfs",
            path,
            MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("size=0,mode=0555"),
        )
    } else {
        bind("masking", Path::new("/dev/null"), path, false)?;
        sys::restrict_mount(path, true).map_err(at("masking", path))
    }
}

fn pivot(root: &Path) -> Result<HostRootDetaching, SetupError> {
    std::env::set_current_dir(root).map_err(at("entering", root))?;
    nix::unistd::pivot_root(".", ".")
        .map_err(errno)
        .map_err(at("pivot_root into", root))?;
    // The old root is now stacked on top of the new one at "/"; detached by a child while the
    // init goes on with its setup (this process's paths start below it, at its new root).
    let detaching = sys::Detaching::start(Path::new("."))
        .map_err(at("detaching the host root", Path::new("/")))?;
    std::env::set_current_dir("/").map_err(at("entering", Path::new("/")))?;
    Ok(HostRootDetaching(detaching))
}

/// The host's root, stacked on the cell's by `pivot_root` and being detached from the cell's
/// mount namespace by a child of the init (`sys::Detaching`): the mounts leave the namespace at
/// once, and the unmount's wait for the kernel's grace period (0.15-0.2 ms, every unmount ends
/// with one) is the child's, beside the init's next steps, rather than on the way to the
/// command. `done` must say so before anything of the cell's runs.
#[derive(Debug)]
#[must_use = "the command may start only once the host's root is detached"]
pub struct HostRootDetaching(sys::Detaching);

impl HostRootDetaching {
    /// Waits until the host's root is detached; an error if it could not be.
    pub fn done(self) -> Result<(), SetupError> {
        self.0
            .wait()
            .map_err(at("detaching the host root", Path::new("/")))
    }
}
