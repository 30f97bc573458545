//! The disk limit of a cell's workspace layer (`limits.disk`).
//!
//! **As root** the layer's `upper/` and `work/` live in a file system of exactly the limit: a
//! sparse image in the layer's directory (`disk.img`; it takes on the host only what the cell
//! wrote, never more than the limit), attached to a loop device and mounted on the layer's `fs/`
//! (`nosuid`, `nodev`) for as long as the layer exists. The file system is btrfs where
//! `mkfs.btrfs` is installed (a snapshot of a running cell is then a clone of the file system's
//! tree, whatever the cell changed: see `snapshot::clone_tree`), else ext4;
//! `WARDEN_LAYER_FS=ext4` (or `btrfs`) chooses. The kernel refuses a write past it with
//! ENOSPC; nothing else on the host is touched, and the cell goes on. A layer whose mount is gone
//! (after a reboot) is attached again when it is next read. One image is never attached twice
//! (two file systems over one image would corrupt it): attaching takes a lock on the image and
//! looks first.
//!
//! **Rootless** (loop devices are for root only, and no file system an unprivileged user may
//! mount is both persistent and bounded), and as root where the host has no loop devices or no
//! `mke2fs`, the limit is kept in two parts: `RLIMIT_FSIZE` makes the kernel refuse to grow any
//! one file past it (EFBIG), and a [`Watch`] sums the blocks of the layer every few seconds and
//! ends the cell when they pass it (many files together can run ahead of it by what the cell
//! writes between two looks).

use std::collections::HashSet;
use std::fs;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use warden_workspace::Layer;

use super::sys;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{what}: {source}")]
    Os {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("making the workspace's file system failed: {0}")]
    Mkfs(String),
}

/// The file system of a layer's image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Ext4,
    Btrfs,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Ext4 => "ext4",
            Self::Btrfs => "btrfs",
        }
    }

    /// The name of its templates: another for each change of how they are made, so that a
    /// template made by an earlier build is not used for new disks.
    fn template_name(self) -> &'static str {
        match self {
            Self::Ext4 => "ext4",
            Self::Btrfs => "btrfs-4k",
        }
    }

    /// The program that makes it, where it is installed.
    fn mkfs(self) -> Option<PathBuf> {
        let names: &[&str] = match self {
            Self::Ext4 => &["/usr/sbin/mke2fs", "/sbin/mke2fs", "/usr/bin/mke2fs"],
            Self::Btrfs => &[
                "/usr/sbin/mkfs.btrfs",
                "/sbin/mkfs.btrfs",
                "/usr/bin/mkfs.btrfs",
            ],
        };
        names.iter().map(PathBuf::from).find(|p| p.exists())
    }

    /// What to install for it, when `mkfs` finds nothing.
    fn missing(self) -> String {
        match self {
            Self::Ext4 => "mke2fs (e2fsprogs) is not installed".to_owned(),
            Self::Btrfs => "mkfs.btrfs (btrfs-progs) is not installed".to_owned(),
        }
    }

    /// The kind new layers get: `WARDEN_LAYER_FS` when set, else btrfs where `mkfs.btrfs` is
    /// installed and the kernel has it, else ext4.
    pub fn chosen() -> Result<Self, String> {
        match std::env::var("WARDEN_LAYER_FS").ok().as_deref() {
            Some("ext4") => return Ok(Self::Ext4),
            Some("btrfs") => return Ok(Self::Btrfs),
            Some("") | None => {}
            Some(other) => {
                return Err(format!(
                    "WARDEN_LAYER_FS={other}: the workspace's file system is `btrfs` or `ext4`"
                ));
            }
        }
        // What this host offers does not change while the warden runs: looked at once.
        static FOUND: std::sync::OnceLock<Kind> = std::sync::OnceLock::new();
        Ok(*FOUND.get_or_init(|| {
            let kernel_has_btrfs = fs::read_to_string("/proc/filesystems").is_ok_and(|all| {
                all.lines()
                    .any(|l| l.split_whitespace().last() == Some("btrfs"))
            });
            match Self::Btrfs.mkfs().is_some() && kernel_has_btrfs {
                true => Self::Btrfs,
                false => Self::Ext4,
            }
        }))
    }

    /// The kind of the file system in `image`, by its superblock's magic number.
    pub fn of_image(image: &Path) -> io::Result<Self> {
        use std::os::unix::fs::FileExt as _;
        let file = fs::File::open(image)?;
        let mut magic = [0u8; 8];
        // btrfs: "_BHRfS_M" 64 bytes into the superblock at 64 KiB.
        if file.read_exact_at(&mut magic, 0x10040).is_ok() && &magic == b"_BHRfS_M" {
            return Ok(Self::Btrfs);
        }
        // ext2/3/4: 0xEF53 56 bytes into the superblock at 1 KiB.
        let mut ext = [0u8; 2];
        file.read_exact_at(&mut ext, 1024 + 56)?;
        match u16::from_le_bytes(ext) {
            0xEF53 => Ok(Self::Ext4),
            _ => Err(io::Error::other(format!(
                "{} holds no file system a layer is made with (btrfs or ext4)",
                image.display()
            ))),
        }
    }
}

fn os(what: impl Into<String>) -> impl FnOnce(io::Error) -> DiskError {
    let what = what.into();
    move |source| DiskError::Os { what, source }
}

/// Why a root warden cannot give a layer a file system of its own on this host, if it cannot.
pub fn unavailable() -> Option<String> {
    if !Path::new("/dev/loop-control").exists() {
        return Some("the host has no /dev/loop-control (the loop module is not loaded)".into());
    }
    // A choice that names no file system fails the layer's creation, where it is said.
    let Ok(kind) = Kind::chosen() else {
        return None;
    };
    kind.mkfs().is_none().then(|| kind.missing())
}

/// Gives `layer` (whose directory exists, with nothing in it yet) a file system of `size` bytes
/// and mounts it. Root only. The file system is made once per size, as a template in the
/// state directory (`disk-templates/`), and each layer gets a sparse copy of it: the few
/// hundred KiB `mke2fs` wrote, not a new run of it.
pub fn create(layer: &Layer, templates: &Path, size: u64) -> Result<(), DiskError> {
    let kind = Kind::chosen().map_err(DiskError::Mkfs)?;
    let template = template(templates, kind, size)?;
    let image = layer.image();
    let copied = (|| -> io::Result<()> {
        let source = fs::File::open(&template)?;
        let target = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&image)?;
        // A sparse template: its holes are found and kept.
        super::sys::copy_data(&source, &target, size, None)?;
        Ok(())
    })();
    if let Err(source) = copied {
        let _ = fs::remove_file(&image);
        return Err(DiskError::Os {
            what: format!("copying the file system template to {}", image.display()),
            source,
        });
    }
    attach(layer).inspect_err(|_| {
        let _ = fs::remove_file(&image);
    })
}

/// The template file system of `kind` and `size` bytes, made now if there is none yet.
fn template(templates: &Path, kind: Kind, size: u64) -> Result<PathBuf, DiskError> {
    let path = templates.join(format!("{}-{size}.img", kind.template_name()));
    if path.exists() {
        return Ok(path);
    }
    let mkfs = kind.mkfs().ok_or_else(|| DiskError::Mkfs(kind.missing()))?;
    fs::create_dir_all(templates).map_err(os(format!("creating {}", templates.display())))?;
    // Made under another name and renamed into place: a template is whole or absent.
    let partial = templates.join(format!(
        ".{}-{size}.img.{}",
        kind.template_name(),
        std::process::id()
    ));
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&partial)
        .map_err(os(format!("creating {}", partial.display())))?;
    file.set_len(size)
        .map_err(os(format!("sizing {}", partial.display())))?;
    let mut command = Command::new(&mkfs);
    match kind {
        // No reserved blocks (the cell is the only user); the inode tables and the journal are
        // initialised lazily, so that the template holds a few hundred KiB of data.
        Kind::Ext4 => command
            .args([
                "-q",
                "-F",
                "-t",
                "ext4",
                "-m",
                "0",
                "-L",
                "warden-layer",
                "-E",
            ])
            .arg("lazy_itable_init=1,lazy_journal_init=1,nodiscard"),
        // One copy of the metadata (the image is a cell's scratch space, on the host's own
        // disk); below 1 GiB data and metadata share their space, as mkfs.btrfs advises for
        // small file systems (it cannot make a plain one under 114 MiB). Tree nodes of 4 KiB,
        // not 16: each write of a file reserves room for its metadata in proportion to the
        // node size, and on a disk of a few GiB the reservations of a thousand small writes
        // outgrow what btrfs lets them take ahead, so that writers wait for the data to be
        // written out first (1,000 small files written over on a 2 GiB disk: 28 ms with 16
        // KiB nodes, 10 ms with 4 KiB, as on an 8 GiB disk with either).
        Kind::Btrfs => command
            .args(["-q", "-f", "-L", "warden-layer", "--nodiscard"])
            .args(["--nodesize", "4096"])
            .args(match size < 1 << 30 {
                true => &["--mixed"][..],
                false => &["-m", "single", "-d", "single"][..],
            }),
    };
    let made = command
        .arg(&partial)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(os(format!("running {}", mkfs.display())))?;
    if !made.status.success() {
        let _ = fs::remove_file(&partial);
        return Err(DiskError::Mkfs(
            String::from_utf8_lossy(&made.stderr).trim().to_owned(),
        ));
    }
    // mkfs.btrfs writes zeros over the first and last MiBs of the device (to wipe what an old
    // file system left there): as holes they cost each layer's copy nothing.
    punch_zeros(&file).map_err(os(format!("thinning {}", partial.display())))?;
    drop(file);
    fs::rename(&partial, &path).map_err(os(format!("placing {}", path.display())))?;
    Ok(path)
}

/// Turns every block of zeros in `file` into a hole.
fn punch_zeros(file: &fs::File) -> io::Result<()> {
    use rustix::fs::{FallocateFlags, fallocate};
    use std::os::unix::fs::FileExt as _;
    const BLOCK: u64 = 4096;
    let mut block = [0u8; BLOCK as usize];
    for extent in sys::data_extents(file, file.metadata()?.len()) {
        let (start, end) = extent?;
        for offset in (start - start % BLOCK..end).step_by(BLOCK as usize) {
            let n = file.read_at(&mut block, offset)?;
            if n == block.len() && block.iter().all(|b| *b == 0) {
                let holed = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
                fallocate(file, holed, offset, BLOCK)?;
            }
        }
    }
    Ok(())
}

/// Holds off `attach` of `layer` (its `disk.lock`, exclusive) while the caller unmounts the
/// layer's file system and moves the layer out of the way: an `attach` under way (a look at the
/// layer's changes, from another process) has either mounted it before (and the unmount takes
/// that mount) or finds the layer gone from its path after (and mounts nothing). Without it,
/// such a look's mount, whose path was looked up before the move and which ended after the
/// unmount (a btrfs mount takes milliseconds), stayed on the host over the removed image.
/// `None`: the layer has no file system of its own.
pub fn hold_off_attach(layer: &Layer) -> Option<fs::File> {
    if !layer.has_image() {
        return None;
    }
    attachments_lock(&layer.dir().join("disk.lock")).ok()
}

/// `disk.lock` at `path`, opened (made where missing) and locked exclusive: whoever holds it
/// attaches the layer's image, or keeps others from attaching it.
fn attachments_lock(path: &Path) -> Result<fs::File, DiskError> {
    let lock = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(os(format!("opening {}", path.display())))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).map_err(|e| {
        DiskError::Os {
            what: format!("locking {}", path.display()),
            source: e.into(),
        }
    })?;
    Ok(lock)
}

/// Mounts the layer's file system on its `fs/` unless it is mounted already; a layer without
/// one needs nothing.
pub fn attach(layer: &Layer) -> Result<(), DiskError> {
    if !layer.has_image() {
        return Ok(());
    }
    let image = layer.image();
    // One attachment per image, whoever asks at once. (The lock is on a file of its own: the
    // loop device keeps the image's open file, and a lock on it, for as long as it is attached.)
    let lock_path = layer.dir().join("disk.lock");
    let lock = attachments_lock(&lock_path)?;
    if layer.is_attached() {
        return Ok(());
    }
    // Moved out of the way (to be removed) while this waited for the lock: the lock's path no
    // longer leads to the file locked, and nothing is mounted (the image and the mount point
    // are found by their paths below).
    let same = |a: &fs::Metadata, b: &fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
    let moved = match (lock.metadata(), fs::metadata(&lock_path)) {
        (Ok(held), Ok(here)) => !same(&held, &here),
        _ => true,
    };
    if moved {
        return Err(DiskError::Os {
            what: format!("mounting {}: the layer was moved away", image.display()),
            source: io::Error::from(io::ErrorKind::NotFound),
        });
    }
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&image)
        .map_err(os(format!("opening {}", image.display())))?;
    let mount_point = layer.fs_dir();
    fs::create_dir_all(&mount_point).map_err(os(format!("creating {}", mount_point.display())))?;
    let kind = Kind::of_image(&image).map_err(os(format!("reading {}", image.display())))?;
    let (device, path) = sys::attach_loop(file.as_fd()).map_err(os(format!(
        "attaching {} to a loop device",
        image.display()
    )))?;
    let mounted = nix::mount::mount(
        Some(&path),
        &mount_point,
        Some(kind.name()),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        None::<&str>,
    );
    if let Err(err) = mounted {
        let _ = sys::detach_loop(device.as_fd());
        return Err(DiskError::Os {
            what: format!("mounting {} on {}", image.display(), mount_point.display()),
            source: io::Error::from_raw_os_error(err as i32),
        });
    }
    Ok(())
}

/// The bytes `dir` takes on disk (its blocks, each inode once), counting no further than
/// `stop_at`.
pub fn usage(dir: &Path, stop_at: u64) -> io::Result<u64> {
    let mut total = 0u64;
    let mut seen = HashSet::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            // Removed meanwhile: the cell is writing.
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
                continue;
            }
            total += meta.blocks() * 512;
            if total > stop_at {
                return Ok(total);
            }
            if meta.is_dir() {
                pending.push(entry.path());
            }
        }
    }
    Ok(total)
}

/// Keeps the size of a layer in view for a limit the kernel cannot keep (see the module's
/// words): a thread looks every few seconds, from a helper that joins the cell's user namespace
/// (there it may read whatever the cell made, even a directory it closed to its owner).
#[derive(Debug)]
pub struct Watch {
    used: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    pub limit: u64,
    /// What the thread looks at, kept for the last look when the cell ends
    /// ([`Watch::over_at_end`]).
    upper: PathBuf,
    userns: Option<Arc<OwnedFd>>,
}

/// The least time between two looks; a look that takes long makes the next one wait longer
/// (ten times its cost), so that the watch never costs more than a tenth of a core.
const LEAST_INTERVAL: Duration = Duration::from_secs(2);

impl Watch {
    /// Starts watching `upper` for `limit`, looking from inside `userns` when given.
    pub fn start(upper: PathBuf, limit: u64, userns: Option<OwnedFd>) -> io::Result<Self> {
        let used = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen, done) = (Arc::clone(&used), Arc::clone(&stop));
        let userns = userns.map(Arc::new);
        let watch = Self {
            used,
            stop,
            limit,
            upper: upper.clone(),
            userns: userns.clone(),
        };
        std::thread::Builder::new()
            .name("disk-watch".into())
            .spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    let began = Instant::now();
                    if let Ok(bytes) = look(&upper, limit, userns.as_deref()) {
                        seen.store(bytes, Ordering::Relaxed);
                    }
                    let wait = LEAST_INTERVAL.max(began.elapsed() * 10);
                    let until = Instant::now() + wait;
                    while !done.load(Ordering::Relaxed) && Instant::now() < until {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })?;
        Ok(watch)
    }

    /// Whether the layer was over the limit at the last look.
    pub fn over(&self) -> bool {
        self.used.load(Ordering::Relaxed) > self.limit
    }

    /// Whether the layer is over the limit now, looked at once more: a cell that wrote past it
    /// and ended between two looks (a few seconds: 26 times a 64 MiB limit was written and
    /// kept that way) is told as one the watch ended.
    pub fn over_at_end(&self) -> bool {
        self.over()
            || look(&self.upper, self.limit, self.userns.as_deref())
                .is_ok_and(|bytes| bytes > self.limit)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One look: in a forked helper when it must join the cell's user namespace.
fn look(upper: &Path, limit: u64, userns: Option<&OwnedFd>) -> io::Result<u64> {
    let Some(userns) = userns else {
        return usage(upper, limit);
    };
    let (read, write) = sys::pipe()?;
    let child = sys::fork_process()?;
    if child == 0 {
        drop(read);
        let joined = nix::sched::setns(userns, nix::sched::CloneFlags::CLONE_NEWUSER);
        let answer = match (joined, usage(upper, limit)) {
            (Ok(()), Ok(bytes)) => bytes,
            _ => u64::MAX,
        };
        let _ = fs::File::from(write).write_all(&answer.to_le_bytes());
        sys::exit_now(0);
    }
    drop(write);
    let mut bytes = [0u8; 8];
    let read = fs::File::from(read).read_exact(&mut bytes);
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child), None);
    read?;
    match u64::from_le_bytes(bytes) {
        u64::MAX => Err(io::Error::other("the disk watch could not look")),
        bytes => Ok(bytes),
    }
}

/// Mounts the file system of its own of the cell's layer that `path` is in (a snapshot's layer
/// may be kept there), if it has one and it is not mounted (after a reboot).
pub fn attach_holding(store: &super::store::Store, path: &std::path::Path) {
    let Ok(rel) = path.strip_prefix(store.root().join("layers")) else {
        return;
    };
    let Some(std::path::Component::Normal(name)) = rel.components().next() else {
        return;
    };
    let layer = store.layer(&name.to_string_lossy());
    if layer.has_image() && !layer.is_attached() {
        let _ = attach(&layer);
    }
}
