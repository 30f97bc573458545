//! The runtime directory: one folder per live cell, so that other warden processes (`ps`,
//! `pause`, `kill`) can find and control it. A cell's folder holds its record and a lock that
//! the owning `warden run` holds for the cell's whole life; a folder whose lock is free belongs
//! to a warden that died, and is cleaned up by whoever finds it. An ended cell's folder is
//! emptied and kept for the next cell (`.spare-N`, at most `SPARES`), so that no cell's end frees
//! a directory's block, which a disk mounted with `discard` makes a wait for the device.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use super::cgroup::CellCgroup;

/// What other processes need to know about a running cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellRecord {
    pub name: String,
    /// Host pid of the cell's init (pid 1 inside).
    pub pid: i32,
    /// Its start time in clock ticks since boot, to tell it from a later process with the same pid.
    pub pid_start: u64,
    /// Host pid of the `warden run` that owns the cell.
    pub warden_pid: i32,
    pub started_unix_ms: u64,
    pub argv: Vec<String>,
    pub workspace: Option<PathBuf>,
    pub cgroup: Option<CellCgroup>,
    /// Whether the cell has an egress gateway (whose rules may change while it runs).
    #[serde(default)]
    pub gateway: bool,
    /// The image its root is made of, if any (its layers must stay while it runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

impl CellRecord {
    /// A pidfd of the record's init while its pid is still that process: opened first, then
    /// its start time checked, so that a pid a later process took is never taken for it (the
    /// pidfd pins the process from then on). `None` once the init is gone.
    pub fn init_pidfd(&self) -> Option<std::os::fd::OwnedFd> {
        let pidfd = super::sys::pidfd_open(self.pid).ok()?;
        (super::sys::process_start_ticks(self.pid) == Some(self.pid_start)).then_some(pidfd)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("runtime directory {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "a cell named `{0}` is already running; pick another --name or stop it with `warden kill {0}`"
    )]
    Taken(String),
    #[error("no running cell named `{0}` (see `warden ps`)")]
    NotFound(String),
    #[error("cell record {path} is unreadable: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error(
        "runtime directory {path} belongs to uid {owner}, not to this user (uid {me}): another user may have made it to watch or steer this user's cells; remove it, or set WARDEN_RUNTIME_DIR to a directory of your own"
    )]
    NotOwned { path: PathBuf, owner: u32, me: u32 },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> RegistryError {
    let path = path.to_path_buf();
    move |source| RegistryError::Io { path, source }
}

/// The per-user runtime directory.
#[derive(Debug, Clone)]
pub struct Registry {
    root: PathBuf,
}

/// The file in a cell's folder whose lock, held for the cell's whole life, keeps its name.
const LOCK: &str = "lock";

/// The cells' mount point, in the runtime directory (see `Registry::mount_point`).
const CELL_ROOT: &str = "cell-root";

/// How many emptied folders of ended cells the runtime directory keeps for the next cells
/// (`cells/.spare-0` ...): a folder removed frees its directory's block, and on a disk mounted
/// with `discard` (an ext4 without a journal discards at once) the removal's last close waits
/// for the device, 0.15-0.5 ms at the end of every `warden run`; one taken over from an
/// ended cell frees nothing and is made no more.
const SPARES: usize = 4;

/// The folder of the notes of cells whose keeper was told its request and whose starter waits
/// for its `ready` (see `Registry::note_start`).
const STARTS: &str = "starts";

/// The names an ending cell's folder has while it is emptied (`.ending-PID-N`, a name no cell
/// can have); one left by a warden that died there is swept.
const ENDING: &str = ".ending-";

/// A folder name of this process's own that no cell can have: `prefix`, the pid, a count.
fn private_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The name of spare folder `k` (a name no cell can have: it starts with a dot).
fn spare_name(k: usize) -> String {
    format!(".spare-{k}")
}

/// A reserved cell folder; dropping it releases the name and empties the folder, which is kept
/// as a spare for the next cell (or removed, where `SPARES` are kept already).
#[derive(Debug)]
pub struct Reservation {
    dir: PathBuf,
    _lock: Flock<File>,
}

impl Registry {
    /// `$WARDEN_RUNTIME_DIR`, else `/run/warden` for root, else `$XDG_RUNTIME_DIR/warden`, else
    /// `/tmp/warden-UID`.
    pub fn default_root() -> PathBuf {
        if let Some(dir) = std::env::var_os("WARDEN_RUNTIME_DIR") {
            return PathBuf::from(dir);
        }
        let uid = nix::unistd::geteuid();
        if uid.is_root() {
            return PathBuf::from("/run/warden");
        }
        if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR") {
            let dir = PathBuf::from(dir);
            if dir.is_dir() {
                return dir.join("warden");
            }
        }
        PathBuf::from(format!("/tmp/warden-{uid}"))
    }

    pub fn open(root: PathBuf) -> Result<Self, RegistryError> {
        let cells = root.join("cells");
        let mount_point = root.join(CELL_ROOT);
        // Search-only for others: a root-started cell's setup runs as an unprivileged host id
        // and must be able to reach its mount point, but may list nothing. (The folder of
        // start notes is made by the first note: a `warden run` has none.)
        for (dir, mode) in [(&root, 0o711), (&cells, 0o711), (&mount_point, 0o711)] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(mode)
                .create(dir)
                .map_err(io_at(dir))?;
            let meta = fs::symlink_metadata(dir).map_err(io_at(dir))?;
            if meta.file_type().is_symlink() || !meta.is_dir() {
                return Err(RegistryError::Io {
                    path: dir.clone(),
                    source: io::Error::other("not a directory"),
                });
            }
            // One another user made first (the default `/tmp/warden-UID`, where no
            // `XDG_RUNTIME_DIR` is set, is anyone's to make) is theirs to fill with records,
            // locks and notes that this warden would act on.
            let me = rustix::process::geteuid().as_raw();
            if std::os::unix::fs::MetadataExt::uid(&meta) != me {
                return Err(RegistryError::NotOwned {
                    path: dir.clone(),
                    owner: std::os::unix::fs::MetadataExt::uid(&meta),
                    me,
                });
            }
            if meta.permissions().mode() & 0o7777 != mode {
                fs::set_permissions(dir, fs::Permissions::from_mode(mode)).map_err(io_at(dir))?;
            }
        }
        Ok(Self { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The empty directory every cell's root is assembled on, each in its own private mount
    /// namespace (where the mount stays, and is gone with the namespace): one for all, so that
    /// no cell makes and removes a directory of its own for it (on an ext4 disk mounted with
    /// `discard`, a removed directory's block waits for the device, 70 us).
    pub fn mount_point(&self) -> PathBuf {
        self.root.join(CELL_ROOT)
    }

    /// What tells this registry's cells from those of another warden on the host (another
    /// runtime directory: another daemon, or a `warden run` beside it), where both keep cells
    /// under one name: a short hash of the registry's directory. The cells' cgroups are kept
    /// apart by it, so that no cell of one can share another's limits, or be frozen or killed
    /// with it.
    pub fn instance(&self) -> String {
        let root = fs::canonicalize(&self.root).unwrap_or_else(|_| self.root.clone());
        let hash = blake3::hash(root.as_os_str().as_encoded_bytes()).to_hex();
        hash[..12].to_owned()
    }

    fn cell_dir(&self, name: &str) -> PathBuf {
        self.root.join("cells").join(name)
    }

    /// The lock that keeps a cell's process starts and a look at its workspace without a
    /// freeze apart (see `starts`).
    pub(crate) fn starts_lock(&self, name: &str) -> PathBuf {
        self.cell_dir(name).join(super::starts::LOCK_FILE)
    }

    /// Claims `name` for a new cell (reclaiming a folder left by a dead warden). The folder is
    /// made under a name no cell can have, with its lock taken, and renamed into place only if
    /// the name is free: a sweep by another warden (`list`) never finds it unlocked half-made.
    pub fn reserve(&self, name: &str) -> Result<Reservation, RegistryError> {
        self.reserve_with(name, false)
    }

    /// `reserve`; `takes_execs`: the folder gets the cell's starts lock too (made here, not at
    /// the cell's first exec: a file's creation costs that exec 50-120 us on an ext4 disk, its
    /// open 2 us; a cell that runs one command and takes no execs has no need of it).
    pub fn reserve_with(
        &self,
        name: &str,
        takes_execs: bool,
    ) -> Result<Reservation, RegistryError> {
        let dir = self.cell_dir(name);
        let new = self.root.join("cells").join(private_name(".new-"));
        if !self.claim_spare(&new) {
            fs::DirBuilder::new()
                .mode(0o711)
                .create(&new)
                .map_err(io_at(&new))?;
        }
        let made = (|| {
            let lock_path = new.join(LOCK);
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&lock_path)
                .map_err(io_at(&lock_path))?;
            let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
                RegistryError::Io {
                    path: lock_path.clone(),
                    source: e.into(),
                }
            })?;
            if takes_execs {
                let starts = new.join(super::starts::LOCK_FILE);
                super::starts::create(&starts).map_err(io_at(&starts))?;
            }
            Ok(lock)
        })();
        let lock = match made {
            Ok(lock) => lock,
            Err(err) => {
                let _ = fs::remove_dir_all(&new);
                return Err(err);
            }
        };
        let place = || {
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                &new,
                rustix::fs::CWD,
                &dir,
                rustix::fs::RenameFlags::NOREPLACE,
            )
        };
        let placed = match place() {
            Err(rustix::io::Errno::EXIST) => match self.is_live(name) {
                Ok(true) => Err(RegistryError::Taken(name.to_owned())),
                Ok(false) => {
                    clean_stale(&dir);
                    place().map_err(|e| match e {
                        rustix::io::Errno::EXIST => RegistryError::Taken(name.to_owned()),
                        e => RegistryError::Io {
                            path: dir.clone(),
                            source: e.into(),
                        },
                    })
                }
                Err(err) => Err(err),
            },
            other => other.map_err(|e| RegistryError::Io {
                path: dir.clone(),
                source: e.into(),
            }),
        };
        if let Err(err) = placed {
            let _ = fs::remove_dir_all(&new);
            return Err(err);
        }
        Ok(Reservation { dir, _lock: lock })
    }

    /// Takes a spare folder (an ended cell's, emptied) as the new folder `new`: true when one
    /// was there to take. Each is taken by a rename, so that two wardens never take the same.
    fn claim_spare(&self, new: &Path) -> bool {
        let cells = self.root.join("cells");
        (0..SPARES).any(|k| {
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                cells.join(spare_name(k)),
                rustix::fs::CWD,
                new,
                rustix::fs::RenameFlags::NOREPLACE,
            )
            .is_ok()
        })
    }

    /// Whether a warden still holds the cell's lock. Only a lock file that is missing, or that
    /// nobody holds, says the cell is gone; a check that fails for another reason (out of
    /// descriptors, say) is an error, never taken for the cell's end.
    fn is_live(&self, name: &str) -> Result<bool, RegistryError> {
        let path = self.cell_dir(name).join(LOCK);
        locked(&path).map_err(|source| RegistryError::Io { path, source })
    }

    /// The lock of the live cell `name` with its record, the lock held open: while someone
    /// holds it (`Lock::held`), the record is still this cell's, since a name goes to another
    /// cell only with a new folder and lock, once the lock is free.
    pub fn get_locked(&self, name: &str) -> Result<(CellRecord, Lock), RegistryError> {
        let path = self.cell_dir(name).join(LOCK);
        let file = File::open(&path).map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => RegistryError::NotFound(name.to_owned()),
            _ => RegistryError::Io {
                path: path.clone(),
                source,
            },
        })?;
        // Opened first: a record read after is the one of this lock's cell.
        let lock = Lock(file);
        let record = self.get(name)?;
        if !lock
            .held()
            .map_err(|source| RegistryError::Io { path, source })?
        {
            return Err(RegistryError::NotFound(name.to_owned()));
        }
        Ok((record, lock))
    }

    /// Reads the record of a live cell: `NotFound` only when the cell is gone.
    pub fn get(&self, name: &str) -> Result<CellRecord, RegistryError> {
        if super::plan::check_name(name).is_err() || !self.is_live(name)? {
            return Err(RegistryError::NotFound(name.to_owned()));
        }
        let path = self.cell_dir(name).join("cell.json");
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            // Reserved, but not published yet (or just removed): not a running cell.
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(RegistryError::NotFound(name.to_owned()));
            }
            Err(source) => return Err(RegistryError::Io { path, source }),
        };
        serde_json::from_str(&text).map_err(|e| RegistryError::Corrupt {
            path,
            message: e.to_string(),
        })
    }

    /// Every live cell, by name; folders of dead wardens are removed on the way.
    pub fn list(&self) -> Result<Vec<CellRecord>, RegistryError> {
        let mut out = Vec::new();
        for name in self.sweep()? {
            if let Ok(record) = self.get(&name) {
                out.push(record);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes the folders (and cgroups) of cells whose wardens died, and names the live ones,
    /// whose records are not read: what every warden does as it starts, a lock's look (four
    /// system calls) for each live cell where a listing reads its record too (thirteen).
    pub fn sweep(&self) -> Result<Vec<String>, RegistryError> {
        let cells = self.root.join("cells");
        let mut out = Vec::new();
        for entry in fs::read_dir(&cells).map_err(io_at(&cells))? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".spare-") {
                // An ended cell's folder, emptied, kept for the next cell.
                continue;
            }
            if name.starts_with(".new-") || name.starts_with(ENDING) {
                // A folder being made (see `reserve`) or emptied at its cell's end, or one a
                // warden that died left so: swept once nobody holds its lock, and only when it
                // is old enough that its maker cannot be between making it and taking the lock,
                // nor its owner between letting go of the lock and keeping it as a spare (a
                // removal under way goes on in the folder it opened, whatever name the folder
                // has by then: a spare's, or the next cell's). Its age is its status change's,
                // which a rename sets too (a spare's modification time can be of any age).
                let old = entry.metadata().is_ok_and(|m| {
                    use std::os::unix::fs::MetadataExt as _;
                    changed_long_ago(m.ctime())
                });
                // (A lock that cannot be told is left alone, as a live one.)
                if old && matches!(locked(&entry.path().join(LOCK)), Ok(false)) {
                    let _ = fs::remove_dir_all(entry.path());
                }
                continue;
            }
            match self.is_live(&name) {
                Ok(true) => {}
                Ok(false) => {
                    clean_stale(&entry.path());
                    continue;
                }
                // Unknown for now: neither listed nor swept.
                Err(_) => continue,
            }
            out.push(name);
        }
        Ok(out)
    }

    /// A file in the folder of the running cell `name` (for requests to its warden).
    pub fn cell_file(&self, name: &str, file: &str) -> PathBuf {
        self.cell_dir(name).join(file)
    }

    /// Notes that the keeper `keeper` (a pid) is about to be told the request of cell `name`,
    /// until the returned note is dropped (once the keeper said `ready`, or ended): between the
    /// two, the name may be neither reserved nor published yet while the keeper goes on to start
    /// the cell, outliving its starter. A starter killed there (a daemon) leaves the note, and
    /// the next one waits for that keeper (`settle_starts`) before it takes a cell that is not
    /// listed for one that is not there.
    pub fn note_start(&self, name: &str, keeper: i32) -> Result<StartNote, RegistryError> {
        let ticks = super::sys::process_start_ticks(keeper).ok_or_else(|| RegistryError::Io {
            path: PathBuf::from(format!("/proc/{keeper}/stat")),
            source: io::Error::other("the keeper is not there to be noted"),
        })?;
        let dir = self.root.join(STARTS);
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Err(err) if err.kind() != io::ErrorKind::AlreadyExists => {
                return Err(RegistryError::Io {
                    path: dir,
                    source: err,
                });
            }
            _ => {}
        }
        let path = dir.join(name);
        fs::write(&path, format!("{keeper} {ticks}\n")).map_err(io_at(&path))?;
        Ok(StartNote(path))
    }

    /// Waits for each keeper a killed starter left noted (`note_start`) until its cell is
    /// published (a running cell, for `get` and its starter's successor to take back) or the
    /// keeper ended; one still starting after `deadline` (which its starter would have given
    /// it) is killed. The notes go; a note that names no live keeper goes at once.
    pub fn settle_starts(&self, deadline: std::time::Duration) {
        let dir = self.root.join(STARTS);
        let Ok(entries) = fs::read_dir(&dir) else {
            return;
        };
        let until = std::time::Instant::now() + deadline;
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(keeper) = fs::read_to_string(&path)
                .ok()
                .and_then(|text| noted_keeper(&text))
            {
                self.wait_for_start(&name, &keeper, until);
            }
            let _ = fs::remove_file(&path);
        }
    }

    /// Waits until cell `name` is published or its keeper (a pidfd) ended; past `until`, kills
    /// the keeper and waits (a little) for its end.
    fn wait_for_start(&self, name: &str, keeper: &std::os::fd::OwnedFd, until: std::time::Instant) {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd as _;
        let ended = |ms: u16| {
            let mut fds = [PollFd::new(keeper.as_fd(), PollFlags::POLLIN)];
            matches!(poll(&mut fds, PollTimeout::from(ms)), Ok(n) if n > 0)
        };
        loop {
            if self.get(name).is_ok() || ended(2) {
                return;
            }
            if std::time::Instant::now() > until {
                let _ = super::sys::pidfd_send_signal(keeper, libc::SIGKILL);
                let _ = ended(5000);
                return;
            }
        }
    }

    /// Leaves a note that the cell was killed on request, for its owner to report: a second
    /// name for the folder's lock file (`warden_workspace::note`: no new inode).
    pub fn mark_killed(&self, name: &str) -> Result<(), RegistryError> {
        let dir = self.cell_dir(name);
        let path = dir.join("killed");
        warden_workspace::note(&path, &dir.join(LOCK)).map_err(io_at(&path))
    }

    /// Holds the teardown of cell `name` by its keeper, once the cell is killed, until the
    /// returned descriptor is closed: a lock on the cell's folder (nothing else locks the folder
    /// itself), which the keeper of a killed cell waits for before it takes the cell down
    /// (`Reservation::wait_for_teardown_hold`, bounded). A delete takes it before its kill and
    /// lets go once it has answered, so that the teardown (the mount namespace's end, with an
    /// RCU grace period; the cgroups; the folder) does not share the CPUs with its answer.
    pub fn hold_teardown(&self, name: &str) -> Result<std::os::fd::OwnedFd, RegistryError> {
        use rustix::fs::{FlockOperation, flock};
        let dir = self.cell_dir(name);
        let fd = open_folder(&dir).map_err(|e| io_at(&dir)(e.into()))?;
        flock(&fd, FlockOperation::NonBlockingLockExclusive).map_err(|e| io_at(&dir)(e.into()))?;
        Ok(fd)
    }
}

/// A note of a start under way (`Registry::note_start`), removed when dropped.
#[derive(Debug)]
pub struct StartNote(PathBuf);

impl Drop for StartNote {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// The keeper a start note names, as a pidfd, while that process lives (its start time as
/// noted: a pid a later process took is not it).
fn noted_keeper(text: &str) -> Option<std::os::fd::OwnedFd> {
    let (pid, ticks) = text.trim().split_once(' ')?;
    let (pid, ticks): (i32, u64) = (pid.parse().ok()?, ticks.parse().ok()?);
    let pidfd = super::sys::pidfd_open(pid).ok()?;
    (super::sys::process_start_ticks(pid) == Some(ticks)).then_some(pidfd)
}

/// A cell's lock file, held open to be asked whether its cell still lives.
#[derive(Debug)]
pub struct Lock(File);

impl Lock {
    /// Whether it is still in its folder and someone holds it (as `Registry::get` would say:
    /// a lock file removed, the cell's folder on its way out, is nobody's): a `fstat` and a
    /// `flock` that does not wait.
    pub fn held(&self) -> io::Result<bool> {
        use rustix::fs::{FlockOperation, flock};
        if rustix::fs::fstat(&self.0)?.st_nlink == 0 {
            return Ok(false);
        }
        match flock(&self.0, FlockOperation::NonBlockingLockShared) {
            Ok(()) => {
                flock(&self.0, FlockOperation::Unlock)?;
                Ok(false)
            }
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(true),
            Err(err) => Err(err.into()),
        }
    }
}

/// A cell's folder, opened for its teardown's hold (`Registry::hold_teardown`), a lock of the
/// folder itself.
fn open_folder(dir: &Path) -> rustix::io::Result<std::os::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Whether someone holds the lock at `path` (a missing file is nobody's).
fn locked(path: &Path) -> io::Result<bool> {
    match File::open(path) {
        Ok(file) => Lock(file).held(),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err),
    }
}

/// Whether a status change at `ctime` (seconds since the epoch) is over a minute old: long
/// enough that whoever made or moved the folder cannot still be between that and taking its
/// lock (or keeping it as a spare).
fn changed_long_ago(ctime: i64) -> bool {
    u64::try_from(ctime)
        .ok()
        .and_then(|secs| std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(secs)))
        .and_then(|changed| changed.elapsed().ok())
        .is_some_and(|age| age > std::time::Duration::from_secs(60))
}

/// Removes what a warden that died (SIGKILL, power cut) left of its cell: the cell's processes
/// died with it (the init has a parent-death signal), but its cgroup directories and runtime
/// folder remain until someone finds them. Only the folder found at `dir` when it is opened is
/// touched, through that descriptor, and only while this process holds its lock: the lock is
/// taken (one that is someone's is left alone) and then seen to be the one at `dir`, so that
/// nobody moves the folder or gives it to another cell meanwhile; its record is read and its
/// entries removed; the name goes last. A lock only looked at was not enough: a folder opened
/// here could meanwhile be emptied by its cell's end, kept as a spare and taken for another
/// cell, whose new lock file, not yet held, looked stale, and went with the entries (three
/// wardens on one name, `reservations_survive_sweeps_running_beside_them`, about 1 run in 40).
/// A folder at `dir` with no lock file at all (no cell's folder takes a name without one) is
/// removed only once it has not changed for a minute.
fn clean_stale(dir: &Path) {
    use rustix::fs::{AtFlags, FlockOperation, Mode, OFlags};
    let folder_at_dir = || {
        rustix::fs::open(
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()
    };
    // The lock at `dir` now, by its path (a folder on its way to being another cell's has its
    // new lock elsewhere until that cell holds it), taken and held until the folder is gone.
    let (folder, _lock) = match rustix::fs::open(
        dir.join(LOCK),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(lock) => {
            if rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive).is_err() {
                return;
            }
            let Some(folder) = folder_at_dir() else {
                return;
            };
            // The folder opened holds this very lock (not one removed meanwhile): nobody moves
            // it while the lock is held here.
            let here = rustix::fs::statat(&folder, LOCK, AtFlags::SYMLINK_NOFOLLOW).ok();
            let held = rustix::fs::fstat(&lock).ok();
            if !here
                .zip(held)
                .is_some_and(|(h, l)| h.st_dev == l.st_dev && h.st_ino == l.st_ino)
            {
                return;
            }
            (folder, Some(lock))
        }
        Err(rustix::io::Errno::NOENT) => {
            let Some(folder) = folder_at_dir() else {
                return;
            };
            let lockless = matches!(
                rustix::fs::statat(&folder, LOCK, AtFlags::SYMLINK_NOFOLLOW),
                Err(rustix::io::Errno::NOENT)
            );
            if !lockless || !rustix::fs::fstat(&folder).is_ok_and(|m| changed_long_ago(m.st_ctime))
            {
                return;
            }
            (folder, None)
        }
        Err(_) => return,
    };
    let record = rustix::fs::openat(
        &folder,
        "cell.json",
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()
    .and_then(|fd| io::read_to_string(File::from(fd)).ok())
    .and_then(|text| serde_json::from_str::<CellRecord>(&text).ok());
    if let Some(cgroup) = record.and_then(|r| r.cgroup) {
        if !cgroup.pids().is_empty() {
            let _ = cgroup.kill_all();
        }
        cgroup.remove();
    }
    let _ = super::sys::remove_entries_at(std::os::fd::AsFd::as_fd(&folder));
    let _ = rustix::fs::unlinkat(rustix::fs::CWD, dir, AtFlags::REMOVEDIR);
}

impl Reservation {
    /// The cell's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Waits, `within` at most, until nobody holds the cell's teardown
    /// (`Registry::hold_teardown`): at once where nobody does.
    pub(crate) fn wait_for_teardown_hold(&self, within: std::time::Duration) {
        use rustix::fs::{FlockOperation, flock};
        let Ok(dir) = open_folder(&self.dir) else {
            return;
        };
        let until = std::time::Instant::now() + within;
        // Looked at every 250 us: the hold is let go of once a reply is on its way, and the
        // teardown may begin a little after it.
        while flock(&dir, FlockOperation::NonBlockingLockShared)
            == Err(rustix::io::Errno::WOULDBLOCK)
            && std::time::Instant::now() < until
        {
            std::thread::sleep(std::time::Duration::from_micros(250));
        }
    }

    /// A file in the cell's folder.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Publishes the record, atomically.
    pub fn publish(&self, record: &CellRecord) -> Result<(), RegistryError> {
        let tmp = self.dir.join("cell.json.tmp");
        let path = self.dir.join("cell.json");
        let text = serde_json::to_vec_pretty(record).map_err(|e| RegistryError::Corrupt {
            path: path.clone(),
            message: e.to_string(),
        })?;
        fs::write(&tmp, text).map_err(io_at(&tmp))?;
        fs::rename(&tmp, &path).map_err(io_at(&path))
    }

    /// Whether someone asked for the cell to be killed.
    pub fn kill_requested(&self) -> bool {
        self.dir.join("killed").exists()
    }

    /// Removes everything in the cell's folder but its lock, which keeps the name: what a
    /// removal waits for (the discard of each freed block, on a disk mounted with `discard`)
    /// is then done while the cell's last process is torn down, not after it.
    pub(crate) fn clear_all_but_the_lock(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.file_name() == LOCK {
                continue;
            }
            let path = entry.path();
            let _ = match entry.file_type() {
                Ok(kind) if kind.is_dir() => fs::remove_dir_all(&path),
                _ => fs::remove_file(&path),
            };
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // Out of the name first, its lock still held (nobody else may take the folder for a dead
        // warden's while it is held, so the rename moves this folder and no other), under a
        // name no cell can have; emptied there, the lock last; then kept as a spare where one of
        // the spares' names is free, else removed. (Removed by its path once its lock was gone,
        // a folder could meanwhile have been swept and another cell's put in its place.)
        self.clear_all_but_the_lock();
        let Some(cells) = self.dir.parent() else {
            return;
        };
        let ending = cells.join(private_name(ENDING));
        let dir = match fs::rename(&self.dir, &ending) {
            Ok(()) => ending,
            Err(_) => {
                let _ = fs::remove_dir_all(&self.dir);
                return;
            }
        };
        let _ = fs::remove_file(dir.join(LOCK));
        // Kept only empty: what could not be removed (a mount left in it, say) must not meet
        // the next cell (a `killed` mark would end it).
        let empty = fs::read_dir(&dir).is_ok_and(|mut entries| entries.next().is_none());
        let kept = empty
            && (0..SPARES).any(|k| {
                rustix::fs::renameat_with(
                    rustix::fs::CWD,
                    &dir,
                    rustix::fs::CWD,
                    cells.join(spare_name(k)),
                    rustix::fs::RenameFlags::NOREPLACE,
                )
                .is_ok()
            });
        if !kept {
            let _ = fs::remove_dir_all(&dir);
        }
    }
}
