//! Control groups of a cell: limits, freezing, killing and OOM accounting.
//!
//! Each controller is used from whichever hierarchy has it: cgroup v2 where the controller is
//! enabled in the unified hierarchy, else its cgroup v1 hierarchy (hybrid hosts have memory, pids,
//! freezer and cpu on v1). Cells live only under `warden/` inside the warden's own cgroup, never
//! anywhere else.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The controllers a cell uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Controller {
    Memory,
    Pids,
    Cpu,
    Freezer,
}

impl Controller {
    pub const ALL: [Controller; 4] = [Self::Memory, Self::Pids, Self::Cpu, Self::Freezer];

    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Pids => "pids",
            Self::Cpu => "cpu",
            Self::Freezer => "freezer",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Version {
    V1,
    V2,
}

/// Where one controller of the host lives, for the warden's own process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub controller: Controller,
    pub version: Version,
    /// The warden's own cgroup directory in that hierarchy.
    pub own: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup hierarchy offers the {0} controller on this host (see `warden doctor`)")]
    Missing(&'static str),
    #[error(
        "cannot create cgroup {path}: {source} (the warden needs a cgroup subtree it may write; \
             as an ordinary user that means a delegated cgroup v2 subtree, see `warden doctor`)"
    )]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot write {value:?} to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("the cell's {controller} cgroup did not reach state {state} within {waited:?}")]
    Timeout {
        controller: &'static str,
        state: &'static str,
        waited: Duration,
    },
}

/// Finds the hierarchy of each controller a cell needs. Controllers the host lacks are absent.
pub fn discover() -> Vec<Hierarchy> {
    let Ok(mountinfo) = super::sys::read_kernel_file("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let Ok(own) = super::sys::read_kernel_file("/proc/self/cgroup") else {
        return Vec::new();
    };
    discover_from(&mountinfo, &own)
}

/// `discover`, with the cgroup file systems' mounts taken from `cache` (a file of the runtime
/// directory) while the mount namespace has the cgroup mounts it had when the file was written,
/// else read from `/proc/self/mountinfo` and the file written anew. The kernel writes the mount
/// table's text for every read, under the lock of all mount namespaces: 0.3 ms of a cold start
/// on this host (62 mounts), and more on a host with hundreds. A kernel without `listmount`
/// (before 6.8) reads the table every time.
///
/// The namespace's mounts are told by their unique ids (one `listmount`; the kernel never gives
/// an id again until the next boot). The same ids as the file's: the file holds. Other ids (a
/// cell's workspace disk mounted since, say): it holds while none of the cgroup mounts it names
/// is gone and none of the mounts since is a cgroup file system (a `statmount` of each), and is
/// not written again (each cell with a disk of its own changes the mounts: rewritten every
/// time, the old file's block was freed, and on a disk mounted with `discard` waited for).
pub fn discover_cached(cache: &Path) -> Vec<Hierarchy> {
    let Ok(own) = super::sys::read_kernel_file("/proc/self/cgroup") else {
        return Vec::new();
    };
    let ids = super::sys::mount_ids();
    let namespace = ids.as_deref().map(namespace_key);
    let cached = ids
        .as_deref()
        .zip(namespace.as_ref())
        .and_then(|(ids, key)| {
            let text = fs::read(cache).ok()?;
            let cached: MountsCache = serde_json::from_slice(&text).ok()?;
            if &cached.namespace != key && !cached.same_cgroup_mounts(ids) {
                return None;
            }
            // A mount moved elsewhere keeps its id: each is checked to be a cgroup file system
            // of its kind still (a `statfs` each).
            let still = cached.mounts.iter().all(|mount| {
                let magic = match mount.v1_options {
                    Some(_) => CGROUP_SUPER_MAGIC,
                    None => CGROUP2_SUPER_MAGIC,
                };
                rustix::fs::statfs(&mount.path).is_ok_and(|fs| fs.f_type as u64 == magic)
            });
            still.then_some(cached.mounts)
        });
    if let Some(mounts) = cached {
        return discover_from_mounts(&mounts, &own);
    }
    let Ok(mountinfo) = super::sys::read_kernel_file("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mounts = cgroup_mounts(&mountinfo);
    // Written only where the namespace did not change while it was read (else the next run
    // reads the table again).
    if let Some((ids, namespace)) = ids.zip(namespace)
        && super::sys::mount_ids().is_some_and(|now| namespace_key(&now) == namespace)
    {
        // Which of them are cgroup file systems, where the kernel can say (else only the same
        // ids will do).
        let cgroup_ids = ids
            .iter()
            .map(|id| super::sys::mount_fs_magic(*id).map(|magic| (*id, magic)))
            .collect::<Option<Vec<_>>>()
            .map(|magics| {
                magics
                    .into_iter()
                    .filter(|(_, magic)| is_cgroup_magic(*magic))
                    .map(|(id, _)| id)
                    .collect()
            });
        let entry = MountsCache {
            namespace,
            ids: cgroup_ids.as_ref().map(|_| ids.clone()).unwrap_or_default(),
            cgroup_ids: cgroup_ids.unwrap_or_default(),
            mounts: mounts.clone(),
        };
        if let Ok(text) = serde_json::to_vec(&entry) {
            let tmp = cache.with_extension(format!("tmp-{}", std::process::id()));
            if fs::write(&tmp, text)
                .and_then(|()| fs::rename(&tmp, cache))
                .is_err()
            {
                let _ = fs::remove_file(&tmp);
            }
        }
    }
    discover_from_mounts(&mounts, &own)
}

/// The name of `discover_cached`'s file in the runtime directory.
pub const MOUNTS_CACHE: &str = "cgroup-mounts.json";

const CGROUP_SUPER_MAGIC: u64 = 0x0027_e0eb;
const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;

fn is_cgroup_magic(magic: u64) -> bool {
    magic == CGROUP_SUPER_MAGIC || magic == CGROUP2_SUPER_MAGIC
}

/// What `discover_cached` keeps: the cgroup mounts of a mount namespace, with the namespace's
/// mounts' ids (hashed, and listed with those of its cgroup file systems, where the kernel could
/// tell them) when they were read.
#[derive(Debug, Serialize, Deserialize)]
struct MountsCache {
    namespace: String,
    #[serde(default)]
    ids: Vec<u64>,
    #[serde(default)]
    cgroup_ids: Vec<u64>,
    mounts: Vec<CgroupMount>,
}

/// The most mounts made since the file was written that are looked at one by one (a
/// `statmount` each) before the mount table is read again and the file written anew.
const MOST_NEW_MOUNTS: usize = 64;

impl MountsCache {
    /// Whether the namespace, whose mounts' ids are now `ids`, has the cgroup mounts it had
    /// when this was written: none of them is gone, and none of the mounts made since is a
    /// cgroup file system. False where the ids were not kept, or too many are new.
    fn same_cgroup_mounts(&self, ids: &[u64]) -> bool {
        if self.ids.is_empty() {
            return false;
        }
        let now: std::collections::HashSet<u64> = ids.iter().copied().collect();
        if !self.cgroup_ids.iter().all(|id| now.contains(id)) {
            return false;
        }
        let then: std::collections::HashSet<u64> = self.ids.iter().copied().collect();
        let new: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|id| !then.contains(id))
            .collect();
        new.len() <= MOST_NEW_MOUNTS
            && new.iter().all(|id| {
                super::sys::mount_fs_magic(*id).is_some_and(|magic| !is_cgroup_magic(magic))
            })
    }
}

fn namespace_key(ids: &[u64]) -> String {
    let mut hasher = blake3::Hasher::new();
    for id in ids {
        hasher.update(&id.to_le_bytes());
    }
    format!("{}:{}", ids.len(), hasher.finalize().to_hex())
}

/// A cgroup file system's mount: where, and for a v1 hierarchy, its super options (its
/// controllers among them); none for the unified (v2) hierarchy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct CgroupMount {
    path: PathBuf,
    v1_options: Option<Vec<String>>,
}

fn cgroup_mounts(mountinfo: &str) -> Vec<CgroupMount> {
    let mut mounts = Vec::new();
    for line in mountinfo.lines() {
        // Fields: id parent maj:min root mountpoint opts [optional...] - fstype source superopts
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(mountpoint), Some(fstype), Some(superopts)) =
            (left.get(4), right.first(), right.get(2))
        else {
            continue;
        };
        let v1_options = match *fstype {
            "cgroup2" => None,
            "cgroup" => Some(superopts.split(',').map(str::to_owned).collect()),
            _ => continue,
        };
        mounts.push(CgroupMount {
            path: PathBuf::from(unescape(mountpoint)),
            v1_options,
        });
    }
    mounts
}

fn discover_from(mountinfo: &str, own_cgroups: &str) -> Vec<Hierarchy> {
    discover_from_mounts(&cgroup_mounts(mountinfo), own_cgroups)
}

fn discover_from_mounts(mounts: &[CgroupMount], own_cgroups: &str) -> Vec<Hierarchy> {
    let mut v1_mounts: Vec<(PathBuf, Vec<String>)> = Vec::new();
    let mut v2_mount: Option<PathBuf> = None;
    for mount in mounts {
        match &mount.v1_options {
            None => v2_mount = Some(mount.path.clone()),
            Some(options) => v1_mounts.push((mount.path.clone(), options.clone())),
        }
    }
    let mut v1_paths: Vec<(Vec<String>, String)> = Vec::new();
    let mut v2_path: Option<String> = None;
    for line in own_cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if ctrls.is_empty() {
            v2_path = Some(path.to_owned());
        } else {
            v1_paths.push((
                ctrls.split(',').map(str::to_owned).collect(),
                path.to_owned(),
            ));
        }
    }
    let v2_own = match (&v2_mount, &v2_path) {
        (Some(mount), Some(path)) => Some(mount.join(path.trim_start_matches('/'))),
        _ => None,
    };
    let v2_controllers: Vec<String> = v2_own
        .as_ref()
        .and_then(|own| fs::read_to_string(own.join("cgroup.controllers")).ok())
        .map(|text| text.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();

    let mut found = Vec::new();
    for controller in Controller::ALL {
        let name = controller.name();
        let v1 = v1_mounts
            .iter()
            .find(|(_, opts)| opts.iter().any(|o| o == name))
            .and_then(|(mount, _)| {
                let (_, path) = v1_paths
                    .iter()
                    .find(|(ctrls, _)| ctrls.iter().any(|c| c == name))?;
                Some(mount.join(path.trim_start_matches('/')))
            });
        // The v2 freezer is built in (cgroup.freeze), not a listed controller.
        let in_v2 = if controller == Controller::Freezer {
            v2_own.is_some()
        } else {
            v2_controllers.iter().any(|c| c == name)
        };
        if let (true, Some(own)) = (in_v2 && v1.is_none(), &v2_own) {
            found.push(Hierarchy {
                controller,
                version: Version::V2,
                own: own.clone(),
            });
        } else if let Some(own) = v1 {
            found.push(Hierarchy {
                controller,
                version: Version::V1,
                own,
            });
        }
    }
    found
}

fn unescape(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// One directory of a cell's cgroup, in one hierarchy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupDir {
    pub controller: Controller,
    pub version: Version,
    pub path: PathBuf,
}

impl CgroupDir {
    fn join_file(&self) -> PathBuf {
        self.path.join(match self.version {
            Version::V1 => "tasks",
            Version::V2 => "cgroup.procs",
        })
    }
}

/// A cell's cgroups. Serializable, so that other warden processes can pause or kill the cell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellCgroup {
    pub dirs: Vec<CgroupDir>,
}

/// The resource limits to write, already in kernel units.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub pids: Option<u64>,
    pub cpus: Option<f64>,
}

const CPU_PERIOD_US: u64 = 100_000;

impl CellCgroup {
    /// Creates `warden/<id>.<instance>` in every hierarchy that has one of the controllers, and
    /// writes the limits. On error, whatever was created is removed again. `instance` keeps
    /// the cells of one registry apart from another's of the same name (`Registry::instance`;
    /// a cell's name has no `.`). A suffix, not a level of its own: each level is one more
    /// cgroup the kernel makes and ends with every one-shot cell.
    pub fn create(
        hierarchies: &[Hierarchy],
        instance: &str,
        id: &str,
        limits: &Limits,
    ) -> Result<Self, CgroupError> {
        let mut cgroup = Self::default();
        let result = cgroup
            .create_dirs(hierarchies, instance, id)
            .and_then(|()| cgroup.apply(limits));
        if let Err(err) = result {
            cgroup.remove();
            return Err(err);
        }
        Ok(cgroup)
    }

    fn create_dirs(
        &mut self,
        hierarchies: &[Hierarchy],
        instance: &str,
        id: &str,
    ) -> Result<(), CgroupError> {
        let mut v2_prepared: Vec<PathBuf> = Vec::new();
        for h in hierarchies {
            let base = h.own.join("warden");
            let path = base.join(format!("{id}.{instance}"));
            // Several v2 controllers share one directory.
            if !self.dirs.iter().any(|d| d.path == path) {
                create_leaf(&path)?;
            }
            self.dirs.push(CgroupDir {
                controller: h.controller,
                version: h.version,
                path,
            });
            // After the cell's directory, not before: nothing can remove the shared
            // `warden/` under it (it is not empty), as something could between the two,
            // leaving a `warden/` made again without the controllers; and a controller
            // enabled in a parent reaches the children it has.
            if h.version == Version::V2 && !v2_prepared.contains(&h.own) {
                let wanted: Vec<&str> = hierarchies
                    .iter()
                    .filter(|o| o.version == Version::V2 && o.controller != Controller::Freezer)
                    .map(|o| o.controller.name())
                    .collect();
                enable_v2(&h.own, &base, &wanted)?;
                v2_prepared.push(h.own.clone());
            }
        }
        Ok(())
    }

    fn dir(&self, controller: Controller) -> Option<&CgroupDir> {
        self.dirs.iter().find(|d| d.controller == controller)
    }

    fn apply(&self, limits: &Limits) -> Result<(), CgroupError> {
        if let Some(bytes) = limits.memory_bytes {
            let dir = self
                .dir(Controller::Memory)
                .ok_or(CgroupError::Missing("memory"))?;
            match dir.version {
                Version::V2 => {
                    write(&dir.path.join("memory.max"), &bytes.to_string())?;
                    write_if_present(&dir.path.join("memory.swap.max"), "0")?;
                    write(&dir.path.join("memory.oom.group"), "1")?;
                }
                Version::V1 => {
                    write(&dir.path.join("memory.limit_in_bytes"), &bytes.to_string())?;
                    write_if_present(
                        &dir.path.join("memory.memsw.limit_in_bytes"),
                        &bytes.to_string(),
                    )?;
                    write_if_present(&dir.path.join("memory.swappiness"), "0")?;
                    // v1 charges the buffers of a cell's sockets (TCP, UDP) to no counter of
                    // its group until a TCP limit is written, and then to that counter alone:
                    // unbounded, one cell held 2.3 GB of TCP buffers under a 64 MiB limit,
                    // the host's whole TCP allowance, and the host's own connections stalled.
                    write_if_present(
                        &dir.path.join("memory.kmem.tcp.limit_in_bytes"),
                        &bytes.to_string(),
                    )?;
                }
            }
        }
        if let Some(pids) = limits.pids {
            let dir = self
                .dir(Controller::Pids)
                .ok_or(CgroupError::Missing("pids"))?;
            write(&dir.path.join("pids.max"), &pids.to_string())?;
        }
        if let Some(cpus) = limits.cpus {
            let dir = self
                .dir(Controller::Cpu)
                .ok_or(CgroupError::Missing("cpu"))?;
            let quota = ((cpus * CPU_PERIOD_US as f64).round() as u64).max(1000);
            match dir.version {
                Version::V2 => write(
                    &dir.path.join("cpu.max"),
                    &format!("{quota} {CPU_PERIOD_US}"),
                )?,
                Version::V1 => {
                    write(
                        &dir.path.join("cpu.cfs_period_us"),
                        &CPU_PERIOD_US.to_string(),
                    )?;
                    write(&dir.path.join("cpu.cfs_quota_us"), &quota.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// The files through which a single-threaded process moves itself (and so its future
    /// children) into the cell, by writing `0` into each: `tasks` in a v1 directory,
    /// `cgroup.procs` in a v2 one.
    ///
    /// A v1 `tasks` file moves the writing thread alone, which the kernel does without taking
    /// the global lock that moving a whole process takes; the write side of that lock waits for
    /// an RCU grace period, 10-15 ms on a host that made no such move in the last few
    /// milliseconds. For a process of one thread the two moves are the same. v2 has no such
    /// file (its `cgroup.threads` is for threaded subtrees only).
    pub fn join_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(CgroupDir::join_file).collect()
    }

    /// The `tasks` files of the v1 directories alone (see `join_files`): the cell's init opens
    /// them ahead and moves itself through them; `add_to_v2` places it in the others.
    pub fn v1_join_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .filter(|d| d.version == Version::V1)
            .map(CgroupDir::join_file)
            .collect()
    }

    /// Moves process `pid` (and so its future children) into every v2 directory of the cell.
    pub fn add_to_v2(&self, pid: i32) -> Result<(), CgroupError> {
        for dir in self.dirs.iter().filter(|d| d.version == Version::V2) {
            write(&dir.path.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// Whether the cell is frozen (paused).
    pub fn is_frozen(&self) -> bool {
        let Some(dir) = self.dir(Controller::Freezer) else {
            return false;
        };
        fs::read_to_string(dir.path.join(freezer_file(dir.version)))
            .is_ok_and(|text| frozen_in(&text, dir.version))
    }

    /// The files a cell's handle reads again and again (whether it is frozen, its count of OOM
    /// kills), held open.
    pub fn watched(&self) -> Watched {
        Watched {
            freezer: self.held(Controller::Freezer, freezer_file),
            oom: self.held(Controller::Memory, oom_file),
        }
    }

    /// The cell's OOM counter alone, held open (`Watched::oom_kills`).
    pub fn oom_watch(&self) -> Watched {
        Watched {
            freezer: None,
            oom: self.held(Controller::Memory, oom_file),
        }
    }

    /// One of the controller's files, opened to be read again at each look.
    fn held(
        &self,
        controller: Controller,
        file: fn(Version) -> &'static str,
    ) -> Option<(fs::File, Version)> {
        let dir = self.dir(controller)?;
        let opened = fs::File::open(dir.path.join(file(dir.version))).ok()?;
        Some((opened, dir.version))
    }

    /// Whether the cell's freezer is thawed, neither frozen nor freezing (true without a
    /// freezer, or when its state cannot be read).
    pub fn is_thawed(&self) -> bool {
        let Some(dir) = self.dir(Controller::Freezer) else {
            return true;
        };
        match dir.version {
            Version::V1 => fs::read_to_string(dir.path.join("freezer.state"))
                .map_or(true, |s| s.trim() == "THAWED"),
            Version::V2 => {
                fs::read_to_string(dir.path.join("cgroup.freeze")).map_or(true, |s| s.trim() == "0")
            }
        }
    }

    /// Whether `kill_all` is one write (cgroup v2's `cgroup.kill`), not a freeze, a kill of
    /// each process and a thaw.
    pub fn kill_is_cheap(&self) -> bool {
        self.kill_file().is_some()
    }

    /// Cgroup v2's `cgroup.kill`, where the cell has one.
    fn kill_file(&self) -> Option<PathBuf> {
        self.dirs
            .iter()
            .filter(|d| d.version == Version::V2)
            .map(|d| d.path.join("cgroup.kill"))
            .find(|path| path.exists())
    }

    /// Freezes every process of the cell and waits until the kernel reports them frozen.
    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.set_frozen(true)
    }

    /// Thaws a frozen cell.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_frozen(false)
    }

    fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        let dir = self
            .dir(Controller::Freezer)
            .ok_or(CgroupError::Missing("freezer"))?;
        match dir.version {
            Version::V1 => write(
                &dir.path.join("freezer.state"),
                if frozen { "FROZEN" } else { "THAWED" },
            )?,
            Version::V2 => write(
                &dir.path.join("cgroup.freeze"),
                if frozen { "1" } else { "0" },
            )?,
        }
        let state = if frozen { "frozen" } else { "thawed" };
        let deadline = Duration::from_secs(5);
        let start = Instant::now();
        // The kernel usually finishes within tens of microseconds: the first looks come
        // at once (a sleep costs the timer's slack, 50 us), then less and less often (a 1 ms
        // sleep from the start cost a whole ms each time).
        let mut looks = 0u32;
        let mut pause = Duration::from_micros(20);
        while self.is_frozen() != frozen {
            if start.elapsed() > deadline {
                return Err(CgroupError::Timeout {
                    controller: "freezer",
                    state,
                    waited: deadline,
                });
            }
            if dir.version == Version::V1 && frozen {
                // A v1 freeze that raced with a fork stays FREEZING; asking again finishes it.
                write(&dir.path.join("freezer.state"), "FROZEN")?;
            }
            looks += 1;
            if looks <= 20 {
                std::thread::yield_now();
                continue;
            }
            sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }

    /// The processes of the cell, from the first hierarchy that lists them.
    pub fn pids(&self) -> Vec<i32> {
        for dir in &self.dirs {
            if let Ok(text) = fs::read_to_string(dir.path.join("cgroup.procs")) {
                return text.lines().filter_map(|l| l.trim().parse().ok()).collect();
            }
        }
        Vec::new()
    }

    /// SIGKILLs every process of the cell. Works on frozen cells and on processes that ignore
    /// signals or keep forking: v2 uses `cgroup.kill`; v1 freezes, kills each listed process by
    /// id, then thaws so the kills take effect.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        if let Some(file) = self.kill_file() {
            return write(&file, "1");
        }
        let freezable = self.dir(Controller::Freezer).is_some();
        if freezable {
            self.freeze()?;
        }
        for pid in self.pids() {
            // The pid is listed in this cell's cgroup, which only the warden creates processes in.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if freezable {
            self.thaw()?;
        }
        Ok(())
    }

    /// How many times the kernel's OOM killer acted inside the cell.
    pub fn oom_kills(&self) -> u64 {
        let Some(dir) = self.dir(Controller::Memory) else {
            return 0;
        };
        fs::read_to_string(dir.path.join(oom_file(dir.version)))
            .map_or(0, |text| oom_kills_in(&text))
    }

    /// What the cell uses now: memory charged to it and its task count from the memory and
    /// pids controllers; CPU time from cgroup v2's `cpu.stat`, v1's `cpuacct.usage` where the
    /// cpu hierarchy has it, or else the sum of its processes' own and reaped children's times.
    pub fn usage(&self) -> warden_protocol::CellUsage {
        let read = |dir: &CgroupDir, file: &str| fs::read_to_string(dir.path.join(file)).ok();
        let number = |text: Option<String>| text.and_then(|t| t.trim().parse::<u64>().ok());
        let memory_bytes = self.dir(Controller::Memory).and_then(|dir| {
            number(read(
                dir,
                match dir.version {
                    Version::V2 => "memory.current",
                    Version::V1 => "memory.usage_in_bytes",
                },
            ))
        });
        let pids = self
            .dir(Controller::Pids)
            .and_then(|dir| number(read(dir, "pids.current")));
        let v2_cpu = self
            .dirs
            .iter()
            .find(|d| d.version == Version::V2)
            .and_then(|dir| read(dir, "cpu.stat"))
            .and_then(|text| {
                text.lines().find_map(|l| {
                    l.strip_prefix("usage_usec ")
                        .and_then(|n| n.trim().parse().ok())
                })
            });
        let v1_cpu = || {
            self.dir(Controller::Cpu)
                .filter(|d| d.version == Version::V1)
                .and_then(|dir| number(read(dir, "cpuacct.usage")))
                .map(|ns| ns / 1000)
        };
        let cpu_usec = v2_cpu.or_else(v1_cpu).or_else(|| {
            let pids = self.pids();
            (!pids.is_empty()).then(|| pids.iter().filter_map(|&pid| process_cpu_usec(pid)).sum())
        });
        warden_protocol::CellUsage {
            time_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            cpu_usec,
            memory_bytes,
            pids: pids.or_else(|| Some(self.pids().len() as u64)),
        }
    }

    /// Peak memory use in bytes, when the kernel reports it.
    pub fn memory_peak(&self) -> Option<u64> {
        let dir = self.dir(Controller::Memory)?;
        let file = match dir.version {
            Version::V2 => "memory.peak",
            Version::V1 => "memory.max_usage_in_bytes",
        };
        fs::read_to_string(dir.path.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Removes the cell's directories, waiting briefly for dying processes to leave them. The
    /// shared `warden/` parent stays for the next cell, as a service manager's slices do: in
    /// a cgroup v1 hierarchy a directory's removal and making are the costliest steps of a
    /// cell's cgroups (the parent's removal at every `warden run`'s end and its making again
    /// at the next start took 0.15-0.25 ms of each run, interleaved runs with and without it
    /// kept).
    pub fn remove(&self) {
        // (Removed without a look first: one that is gone already says so.)
        for dir in self.dirs.iter().rev() {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match fs::remove_dir(&dir.path) {
                    Ok(()) => break,
                    Err(err) if err.kind() == io::ErrorKind::NotFound => break,
                    Err(_) if Instant::now() < deadline => sleep(Duration::from_millis(2)),
                    Err(_) => break,
                }
            }
        }
    }
}

/// Makes a cgroup directory and its parents. The shared `warden/`, if something removed it
/// between the two (an operator, or a warden of an earlier version whose last cell had gone),
/// is made again.
fn create_leaf(path: &Path) -> Result<(), CgroupError> {
    let mut tries = 0;
    loop {
        match fs::create_dir_all(path) {
            Err(source) if source.kind() == io::ErrorKind::NotFound && tries < 5 => tries += 1,
            result => {
                return result.map_err(|source| CgroupError::Create {
                    path: path.to_path_buf(),
                    source,
                });
            }
        }
    }
}

/// Gives the cgroups below `own` the v2 `controllers`, in `own` and in `base` (made already:
/// the cell's directory is in it).
fn enable_v2(own: &Path, base: &Path, controllers: &[&str]) -> Result<(), CgroupError> {
    let value = controllers
        .iter()
        .map(|c| format!("+{c}"))
        .collect::<Vec<_>>()
        .join(" ");
    if value.is_empty() {
        return Ok(());
    }
    for dir in [own, base] {
        let path = dir.join("cgroup.subtree_control");
        let current = fs::read_to_string(&path).unwrap_or_default();
        if controllers
            .iter()
            .all(|c| current.split_whitespace().any(|have| have == *c))
        {
            continue;
        }
        fs::write(&path, &value).map_err(|source| CgroupError::Write {
            path: path.clone(),
            value: value.clone(),
            source,
        })?;
    }
    Ok(())
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_path_buf(),
        value: value.to_owned(),
        source,
    })
}

fn write_if_present(path: &Path, value: &str) -> Result<(), CgroupError> {
    if path.exists() {
        write(path, value)
    } else {
        Ok(())
    }
}

/// A process's CPU time with that of the children it has reaped (`/proc/PID/stat` fields 14
/// to 17), in microseconds.
fn process_cpu_usec(pid: i32) -> Option<u64> {
    let text = super::sys::read_kernel_file(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields count from after it.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Field 3 (state) is fields[0]: utime, stime, cutime, cstime are fields 14-17.
    let ticks: u64 = fields
        .get(11..15)?
        .iter()
        .filter_map(|f| f.parse::<i64>().ok())
        .map(|t| t.max(0) as u64)
        .sum();
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    let per_second = u64::try_from(per_second).ok().filter(|&n| n > 0)?;
    Some(ticks * 1_000_000 / per_second)
}

/// The file that says whether a cgroup is frozen.
fn freezer_file(version: Version) -> &'static str {
    match version {
        Version::V1 => "freezer.state",
        Version::V2 => "cgroup.events",
    }
}

fn frozen_in(text: &str, version: Version) -> bool {
    match version {
        Version::V1 => text.trim() == "FROZEN",
        Version::V2 => text.lines().any(|l| l == "frozen 1"),
    }
}

/// The file that counts a cgroup's OOM kills.
fn oom_file(version: Version) -> &'static str {
    match version {
        Version::V1 => "memory.oom_control",
        Version::V2 => "memory.events",
    }
}

fn oom_kills_in(text: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("oom_kill ")
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// A cell's freezer and OOM files held open (`CellCgroup::watched`): each look is one `pread`
/// from the start of the file, where a look by path opens, `statx`es, reads and closes it. A
/// file whose cgroup was removed reads as nothing: not frozen, no OOM kills, as by path.
#[derive(Debug, Default)]
pub struct Watched {
    freezer: Option<(fs::File, Version)>,
    oom: Option<(fs::File, Version)>,
}

impl Watched {
    /// `parse` of the file's text now, read into a buffer on the stack.
    fn read<T>(
        held: &Option<(fs::File, Version)>,
        parse: impl FnOnce(&str, Version) -> T,
    ) -> Option<T> {
        use std::os::unix::fs::FileExt as _;
        let (file, version) = held.as_ref()?;
        // Both files are a few short lines (`memory.events` is the longest, ~60 bytes).
        let mut buf = [0u8; 256];
        let len = file.read_at(&mut buf, 0).ok()?;
        Some(parse(std::str::from_utf8(&buf[..len]).ok()?, *version))
    }

    /// Whether the cell is frozen, as `CellCgroup::is_frozen` says.
    pub fn is_frozen(&self) -> bool {
        Self::read(&self.freezer, frozen_in).unwrap_or(false)
    }

    /// The cell's count of OOM kills, as `CellCgroup::oom_kills` says.
    pub fn oom_kills(&self) -> u64 {
        Self::read(&self.oom, |text, _| oom_kills_in(text)).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held open, each look reads the file again from its start: a state that changed after
    /// the open (a pause, an OOM kill) is seen, in both versions' formats.
    #[test]
    fn watched_files_are_read_again_at_each_look() {
        let dir = tempfile::tempdir().unwrap();
        for version in [Version::V1, Version::V2] {
            let freezer = dir.path().join(format!("freezer-{version:?}"));
            let oom = dir.path().join(format!("oom-{version:?}"));
            let (thawed, frozen) = match version {
                Version::V1 => ("THAWED\n", "FROZEN\n"),
                Version::V2 => ("populated 1\nfrozen 0\n", "populated 1\nfrozen 1\n"),
            };
            let (none, two) = match version {
                Version::V1 => (
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
                ),
                Version::V2 => (
                    "low 0\nhigh 0\nmax 3\noom 2\noom_kill 0\noom_group_kill 0\n",
                    "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n",
                ),
            };
            fs::write(&freezer, thawed).unwrap();
            fs::write(&oom, none).unwrap();
            let watched = Watched {
                freezer: Some((fs::File::open(&freezer).unwrap(), version)),
                oom: Some((fs::File::open(&oom).unwrap(), version)),
            };
            assert!(!watched.is_frozen(), "{version:?}");
            assert_eq!(watched.oom_kills(), 0, "{version:?}");
            // Rewritten in place, as the kernel's files are: the same open files.
            fs::OpenOptions::new()
                .write(true)
                .open(&freezer)
                .and_then(|mut f| std::io::Write::write_all(&mut f, frozen.as_bytes()))
                .unwrap();
            fs::OpenOptions::new()
                .write(true)
                .open(&oom)
                .and_then(|mut f| std::io::Write::write_all(&mut f, two.as_bytes()))
                .unwrap();
            assert!(watched.is_frozen(), "{version:?}");
            assert_eq!(watched.oom_kills(), 2, "{version:?}");
        }
        // Nothing held (no such controller): never frozen, no kills.
        let none = Watched::default();
        assert!(!none.is_frozen());
        assert_eq!(none.oom_kills(), 0);
    }

    /// The cache answers as the mount table does while the namespace's mounts are the same,
    /// is what is answered from then (shown by a cache made to say otherwise), and is read
    /// again from the table once it is another namespace's, or names a path that is no cgroup
    /// file system.
    #[test]
    fn the_mounts_cache_is_used_only_for_the_mounts_it_was_made_of() {
        let Some(_) = super::super::sys::mount_ids() else {
            eprintln!("skipped: no listmount(2) on this kernel");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join(MOUNTS_CACHE);
        let truth = discover();
        assert_eq!(discover_cached(&cache), truth);
        let made: MountsCache = serde_json::from_slice(&fs::read(&cache).unwrap()).unwrap();
        assert!(!made.mounts.is_empty(), "this host has cgroup file systems");
        assert_eq!(discover_cached(&cache), truth, "from the cache");

        // A cache whose v1 mounts offer no controller (the same paths): it is believed.
        let stripped = MountsCache {
            namespace: made.namespace.clone(),
            ids: made.ids.clone(),
            cgroup_ids: made.cgroup_ids.clone(),
            mounts: made
                .mounts
                .iter()
                .map(|m| CgroupMount {
                    path: m.path.clone(),
                    v1_options: m.v1_options.as_ref().map(|_| vec!["rw".to_owned()]),
                })
                .collect(),
        };
        fs::write(&cache, serde_json::to_vec(&stripped).unwrap()).unwrap();
        let believed = discover_cached(&cache);
        assert!(
            believed.iter().all(|h| h.version == Version::V2),
            "{believed:?}"
        );
        if truth.iter().any(|h| h.version == Version::V1) {
            assert_ne!(believed, truth);
        }

        // Mounts made since that are no cgroup file systems (here: the ids of such mounts of
        // this namespace, taken out of the file's list), with another key: still believed.
        // (Other tests may mount meanwhile: the file's own list is the one taken apart.)
        let ids = made.ids.clone();
        let magic = |id: &u64| super::super::sys::mount_fs_magic(*id);
        assert!(
            !ids.is_empty() && !made.cgroup_ids.is_empty(),
            "the file lists the mounts and the cgroup mounts among them: {made:?}"
        );
        assert!(
            made.cgroup_ids
                .iter()
                .all(|id| magic(id).is_some_and(is_cgroup_magic))
        );
        let plain: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|id| magic(id).is_some_and(|m| !is_cgroup_magic(m)))
            .take(3)
            .collect();
        assert!(
            !plain.is_empty(),
            "this host has mounts of other file systems"
        );
        let since = MountsCache {
            namespace: "1:0".to_owned(),
            ids: ids
                .iter()
                .copied()
                .filter(|id| !plain.contains(id))
                .collect(),
            cgroup_ids: stripped.cgroup_ids.clone(),
            mounts: stripped.mounts.clone(),
        };
        fs::write(&cache, serde_json::to_vec(&since).unwrap()).unwrap();
        assert_eq!(discover_cached(&cache), believed, "other mounts made since");
        let kept: MountsCache = serde_json::from_slice(&fs::read(&cache).unwrap()).unwrap();
        assert_eq!(kept.namespace, "1:0", "the file was written again");

        // A cgroup file system among the mounts made since: read from the table again.
        let cgroup_since = MountsCache {
            namespace: "1:0".to_owned(),
            ids: ids
                .iter()
                .copied()
                .filter(|id| !made.cgroup_ids[..1].contains(id))
                .collect(),
            cgroup_ids: stripped.cgroup_ids[1..].to_vec(),
            mounts: stripped.mounts.clone(),
        };
        fs::write(&cache, serde_json::to_vec(&cgroup_since).unwrap()).unwrap();
        assert_eq!(discover_cached(&cache), truth, "a cgroup mount made since");

        // A cgroup mount it names that is gone (an id no mount has): read again.
        let gone = MountsCache {
            namespace: "1:0".to_owned(),
            ids: ids.clone(),
            cgroup_ids: vec![u64::MAX - 1],
            mounts: stripped.mounts.clone(),
        };
        fs::write(&cache, serde_json::to_vec(&gone).unwrap()).unwrap();
        assert_eq!(discover_cached(&cache), truth, "a cgroup mount gone");

        // Another namespace's, without its ids (as an earlier build wrote it): read from the
        // table again, and written anew.
        let other = MountsCache {
            namespace: "1:0".to_owned(),
            ids: Vec::new(),
            cgroup_ids: Vec::new(),
            ..stripped
        };
        fs::write(&cache, serde_json::to_vec(&other).unwrap()).unwrap();
        assert_eq!(discover_cached(&cache), truth);
        let rewritten: MountsCache = serde_json::from_slice(&fs::read(&cache).unwrap()).unwrap();
        assert_eq!(rewritten.namespace, made.namespace);

        // A path that is no longer a cgroup file system (a mount moved away keeps its id).
        let moved = MountsCache {
            namespace: made.namespace.clone(),
            ids: made.ids.clone(),
            cgroup_ids: made.cgroup_ids.clone(),
            mounts: vec![CgroupMount {
                path: dir.path().to_owned(),
                v1_options: Some(vec!["memory".to_owned()]),
            }],
        };
        fs::write(&cache, serde_json::to_vec(&moved).unwrap()).unwrap();
        assert_eq!(discover_cached(&cache), truth);
        // Garbage: read from the table.
        fs::write(&cache, b"{not json").unwrap();
        assert_eq!(discover_cached(&cache), truth);
    }

    #[test]
    fn hybrid_host_uses_v1_for_controllers_missing_from_v2() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
31 25 0:27 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
32 25 0:28 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
33 25 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 25 0:30 / /nonexistent/unified rw,relatime - cgroup2 cgroup2 rw
";
        let own = "8:pids:/\n6:freezer:/\n4:memory:/jobs/x\n1:cpu:/\n0::/\n";
        let found = discover_from(mountinfo, own);
        let memory = found
            .iter()
            .find(|h| h.controller == Controller::Memory)
            .unwrap();
        assert_eq!(memory.version, Version::V1);
        assert_eq!(memory.own, PathBuf::from("/sys/fs/cgroup/memory/jobs/x"));
        assert_eq!(found.len(), 4);
        assert!(found.iter().all(|h| h.version == Version::V1));
    }
}
