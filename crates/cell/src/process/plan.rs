//! Everything a cell's setup needs, decided by the warden before the cell exists, so that the
//! code running in the new namespaces only carries out a fixed list of steps.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use warden_policy::Policy;

use super::ids::IdMapping;

/// One host path that appears in the cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Bind-mount a directory or file; `writable` keeps it read-write.
    Bind {
        path: PathBuf,
        dir: bool,
        writable: bool,
    },
    /// Recreate a symlink (e.g. `/bin -> usr/bin` on merged-/usr systems).
    Symlink { path: PathBuf, target: PathBuf },
    /// Copy a small read-only file (most of `/etc`): cheaper than a mount to set up and tear down,
    /// and the cell gets a snapshot it cannot change.
    Copy { path: PathBuf },
}

/// The workspace directory of the host, as the cell will see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkspacePlan {
    pub host: PathBuf,
    pub mount: PathBuf,
    /// Protected paths that exist, relative to the workspace (made read-only in direct mode).
    pub protect: Vec<PathBuf>,
    /// Copy-on-write: the cell's writes go to this layer, never to `host`.
    pub overlay: Option<OverlayPlan>,
}

/// The directories of a copy-on-write workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayPlan {
    pub upper: PathBuf,
    pub work: PathBuf,
    /// The host directory holding `upper` and `work`.
    pub layer_dir: PathBuf,
    /// The host directory of all snapshots (bound read-only under `/.warden` when `base` is used).
    pub snapshots_dir: PathBuf,
    /// Snapshot layers between the upper layer and the host directory, topmost first.
    pub base: Vec<PathBuf>,
}

/// A cell, ready to be built.
#[derive(Debug, Clone)]
pub struct CellPlan {
    pub hostname: String,
    /// Empty host directory the new root is assembled on (in the cell's own mount namespace).
    pub root: PathBuf,
    /// An image's unpacked layers as the root, topmost first (empty: the root is a tmpfs
    /// holding the host paths of `entries`).
    pub image: Vec<PathBuf>,
    pub entries: Vec<Entry>,
    pub hidden: Vec<PathBuf>,
    pub tmp_size: u64,
    /// Size of `/dev/shm`.
    pub shm_size: u64,
    /// For each of `entries`, the descriptor slot of what the warden opened of its host side
    /// (a detached tree for a bind, an `O_PATH` descriptor for a copy), where the cell's setup
    /// could not reach it by its path; `None` where it can.
    pub sources: Vec<Option<std::os::fd::RawFd>>,
    pub workspace: Option<WorkspacePlan>,
    /// Where the workspace (or, without one, a scratch directory) appears.
    pub workspace_mount: PathBuf,
    pub ids: IdMapping,
    pub argv: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub cwd: PathBuf,
    /// rlimits that stand in for the cgroup limits when no cgroup can be made (rootless without
    /// a delegated subtree).
    pub rlimit_nproc: Option<u64>,
    pub rlimit_as: Option<u64>,
    /// Open files per process (soft and hard; no more than the warden's own hard limit).
    pub rlimit_nofile: u64,
    /// Largest file a process may write (the per-file part of a disk limit the kernel cannot
    /// keep whole); SIGXFSZ is ignored, so that a write past it fails with EFBIG.
    pub rlimit_fsize: Option<u64>,
    /// More generated files under `/etc` (path relative to it, content): the egress CA.
    pub extra_etc: Vec<(String, String)>,
}

/// Where every tier's setup makes something in a cell's root besides the plan's own paths.
const SETUP_MAKES: &[&str] = &["/.warden", "/tmp", "/dev", "/proc", "/sys"];

impl CellPlan {
    /// The first symbolic link that a layer of the cell's image has on the way to something the
    /// cell's setup makes, writes or mounts on in its root (the plan's entries, the workspace's
    /// mount point, the folders of the generated `/etc` files and [`SETUP_MAKES`]), with
    /// its target. The setup works by path on the image's merged tree before the cell's root is
    /// its own, so the host's kernel would follow such a link (absolute, or climbing out with
    /// `..`) into the host's files. Every layer is looked at, a link a layer above hides
    /// included (a refusal, never a miss). `/etc` itself is the setup's own directory, above the
    /// image's; the last component of an `/etc` file or of a policy's link is replaced, not
    /// followed.
    pub fn image_link(&self) -> Option<(PathBuf, PathBuf)> {
        // Each path, and whether its last component is looked at too.
        let mut paths: Vec<(PathBuf, bool)> = self
            .entries
            .iter()
            .map(|entry| match entry {
                Entry::Symlink { path, .. } => (path.clone(), false),
                Entry::Copy { path } | Entry::Bind { path, .. } => (path.clone(), true),
            })
            .collect();
        paths.extend(SETUP_MAKES.iter().map(|p| (PathBuf::from(p), true)));
        paths.push((self.workspace_mount.clone(), true));
        paths.extend(
            self.etc_files()
                .into_iter()
                .map(|(name, _)| (Path::new("/etc").join(name), false)),
        );
        self.first_image_link(&paths)
    }

    /// [`Self::image_link`] of `paths` alone, each looked at whole (what a tier's setup makes
    /// in the root besides what every tier's does).
    pub fn image_link_at(&self, paths: &[&str]) -> Option<(PathBuf, PathBuf)> {
        let paths: Vec<(PathBuf, bool)> = paths.iter().map(|p| (PathBuf::from(p), true)).collect();
        self.first_image_link(&paths)
    }

    /// The first link of the image's layers on the way to `paths` (and at a path's last
    /// component where its flag says so), with its target.
    fn first_image_link(&self, paths: &[(PathBuf, bool)]) -> Option<(PathBuf, PathBuf)> {
        for (path, whole) in paths {
            let relative = path.strip_prefix("/").unwrap_or(path);
            let components: Vec<_> = relative.components().collect();
            let looked = if *whole {
                components.len()
            } else {
                components.len().saturating_sub(1)
            };
            let mut prefix = PathBuf::new();
            for component in &components[..looked] {
                prefix.push(component);
                if prefix == Path::new("etc") {
                    continue;
                }
                for layer in &self.image {
                    let at = layer.join(&prefix);
                    if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
                        let target = std::fs::read_link(&at).unwrap_or_default();
                        return Some((Path::new("/").join(&prefix), target));
                    }
                }
            }
        }
        None
    }

    /// Files generated for the cell's `/etc`.
    pub fn etc_files(&self) -> Vec<(String, String)> {
        let uid = self.ids.inside_uid;
        let gid = self.ids.inside_gid;
        let mut passwd = String::from("root:x:0:0:root:/root:/bin/sh\n");
        let mut group = String::from("root:x:0:\n");
        if uid != 0 {
            passwd.push_str(&format!("cell:x:{uid}:{gid}:cell user:/tmp:/bin/sh\n"));
        }
        if gid != 0 {
            group.push_str(&format!("cell:x:{gid}:\n"));
        }
        passwd.push_str("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n");
        group.push_str("nogroup:x:65534:\n");
        // Files the warden adds come first: a later file of the same name is then skipped.
        let mut files = self.extra_etc.clone();
        files.extend(vec![
            ("passwd".to_owned(), passwd),
            ("group".to_owned(), group),
            ("hostname".to_owned(), format!("{}\n", self.hostname)),
            (
                "hosts".to_owned(),
                format!(
                    "127.0.0.1\tlocalhost {0}\n::1\tlocalhost {0}\n",
                    self.hostname
                ),
            ),
            (
                "nsswitch.conf".to_owned(),
                "passwd: files\ngroup: files\nhosts: files\n".to_owned(),
            ),
            (
                "resolv.conf".to_owned(),
                "# this cell has no network beyond loopback\n".to_owned(),
            ),
        ]);
        files
    }
}

/// Why a plan could not be made from a policy and the caller's options.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "workspace {path} does not exist or is not a directory; create it or pass another --workspace"
    )]
    Workspace { path: PathBuf },
    #[error("no command given; write it after `--`, e.g. `warden run -- sh -c 'echo hi'`")]
    NoCommand,
    #[error(
        "cell name `{0}` is not valid: use 1-63 letters, digits, `-` or `_`, starting with a letter or digit"
    )]
    Name(String),
    #[error(
        "the {0} tier is not implemented in this version of warden (it is planned); use `tier: process` or `tier: gvisor`, the tiers this warden runs (`warden doctor` lists each tier: implemented, prerequisites present, usable here)"
    )]
    Tier(&'static str),
    #[error(
        "workspace path {0} contains `,` or `:`, which overlayfs cannot take; rename it or use `mode: direct`"
    )]
    OverlayPath(PathBuf),
    #[error(
        "cell `{0}` has kept workspace changes; review them with `warden diff {0}`, then `warden apply {0}` or `warden rm {0}`"
    )]
    LayerKept(String),
    #[error("snapshot `{snapshot}` is of the workspace {}; a fork keeps that workspace (leave out --workspace)", lower.display())]
    ForkWorkspace { snapshot: String, lower: PathBuf },
    #[error(
        "{what} {} {how} Warden's own {dir} {}, which holds the journal's signing key and other cells' layers; a cell may not see it: choose another directory (or move Warden's with WARDEN_STATE_DIR / WARDEN_RUNTIME_DIR)",
        path.display(), own.display()
    )]
    WardensOwn {
        what: &'static str,
        path: PathBuf,
        how: &'static str,
        dir: &'static str,
        own: PathBuf,
    },
    #[error(
        "{what} {} cannot be reached by the cell's setup: {} is mode {mode:03o} (owner uid {owner}), and the setup runs as host uid {uid}{why}; make it searchable (`chmod o+x {}`) or use a path outside it",
        path.display(), blocker.display(), blocker.display()
    )]
    Unreachable {
        what: &'static str,
        path: PathBuf,
        blocker: PathBuf,
        mode: u32,
        owner: u32,
        uid: u32,
        why: &'static str,
    },
    #[error(
        "{what} {} is under {under}, which is the cell's own (a fresh {under} is mounted over it, so the host's would be hidden); put it elsewhere, or bring files in through the workspace",
        path.display()
    )]
    UnderCellsOwn {
        what: &'static str,
        path: PathBuf,
        under: &'static str,
    },
    #[error(
        "read_write path {} is under /sys, the kernel's own controls (cgroups, devices, power, modules' settings): a cell that writes there could undo the limits the warden set on it (its own cgroup's memory.max, where the caller's cgroups are delegated) or change the host's settings; show it with `read_only`, or not at all",
        path.display()
    )]
    KernelControls { path: PathBuf },
    #[error(
        "the image `{image}` has a symbolic link at {} (to {}), where the cell's setup makes a file, directory or mount point of its root: the setup works on the host, where the link would lead it to the host's own files, so the cell is not made; use an image with a directory (or nothing) there, or a policy that puts nothing there",
        path.display(), target.display()
    )]
    ImageLink {
        image: String,
        path: PathBuf,
        target: PathBuf,
    },
}

/// The host ids a cell's setup runs as (before it takes the cell user's): in root mode the
/// first of the cell's block (inside root), rootless the caller.
pub fn setup_host_ids() -> ((u32, u32), bool) {
    let root_mode = nix::unistd::geteuid().is_root();
    if root_mode {
        (
            (super::ids::ROOT_MODE_BASE, super::ids::ROOT_MODE_BASE),
            true,
        )
    } else {
        (
            (
                nix::unistd::geteuid().as_raw(),
                nix::unistd::getegid().as_raw(),
            ),
            false,
        )
    }
}

/// Who a cell's processes run as and where they start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    pub cwd: PathBuf,
}

/// The highest user or group id a cell's user may have (as `process.user`).
const MAX_INSIDE_ID: u32 = 65535;

/// A cell's user, group and working directory: what its policy names, else what its image's
/// configuration does (`image:`; names looked up in the image's own tables), else uid 1000 and
/// `/workspace`. A group the policy does not name is its user's: the image's user's group when
/// the user comes from the image.
pub fn identity(policy: &Policy, state: &Path) -> Result<Identity, warden_image::ImageError> {
    let image = match &policy.image {
        Some(name) => {
            let (image, lowers) = warden_image::Store::new(state).lower_dirs(name)?;
            image.defaults(&lowers)?
        }
        None => warden_image::Defaults::default(),
    };
    let process = &policy.process;
    let (uid, image_gid) = match (process.user, image.user) {
        (Some(uid), _) => (uid, None),
        (None, Some((uid, gid))) => (uid, Some(gid)),
        (None, None) => (process.user(), None),
    };
    let gid = process.group.or(image_gid).unwrap_or(uid);
    if uid > MAX_INSIDE_ID || gid > MAX_INSIDE_ID {
        return Err(warden_image::ImageError::Format(format!(
            "image {}: its user is uid {uid} gid {gid}, and a cell's ids are at most {MAX_INSIDE_ID}; set process.user (and process.group) in the policy",
            policy.image.as_deref().unwrap_or_default()
        )));
    }
    let cwd = process
        .cwd
        .clone()
        .or(image.workdir)
        .unwrap_or_else(|| process.cwd());
    Ok(Identity { uid, gid, cwd })
}

/// Checks what of a policy only this host can tell, before a cell is made from it: the tier must
/// be one this warden implements, and of the host paths it shows the cell (and Warden's own
/// directories) none may be Warden's own, lie under the cell's own `/tmp`, `/dev` or `/proc`,
/// or be out of reach of the cell's setup. `warden policy check` runs the same checks.
pub fn check_paths(policy: &Policy, state: &Path, runtime: &Path) -> Result<(), PlanError> {
    let tier = policy.tier;
    if !matches!(
        tier,
        warden_policy::Tier::Process | warden_policy::Tier::Gvisor
    ) {
        return Err(PlanError::Tier(tier.name()));
    }
    // A gVisor cell's keeper assembles its root as root: nothing to reach for an unprivileged
    // setup.
    let setup_reaches = tier == warden_policy::Tier::Process;
    let mut resolver = Resolver::default();
    let own = canonical_own_with(
        &mut resolver,
        &[("state directory", state), ("runtime directory", runtime)],
    );
    let mut reach = Reach::new();
    for (path, rw) in policy
        .filesystem
        .read_only
        .iter()
        .map(|p| (p, false))
        .chain(policy.filesystem.read_write.iter().map(|p| (p, true)))
    {
        let what = if rw {
            "read_write path"
        } else {
            "read_only path"
        };
        // Only what the cell will see (missing paths are left out).
        let canonical = resolver.canonicalize(path).ok();
        if let Some(canonical) = &canonical {
            check_not_wardens_canonical(what, canonical, &own)?;
        }
        check_not_under_cells_own(what, path)?;
        if rw && canonical.as_deref().unwrap_or(path).starts_with("/sys") {
            return Err(PlanError::KernelControls { path: path.clone() });
        }
        let Some(canonical) = canonical else {
            continue;
        };
        // A root warden opens these for the setup (see `InitFds::sources`); an unprivileged
        // one can open only what its user reaches.
        if !reach.root_mode && setup_reaches {
            reach.check(what, &canonical)?;
        }
    }
    if !setup_reaches {
        return Ok(());
    }
    // The cell's root is assembled under the runtime directory, its layers are in the state
    // directory: the setup must reach both.
    for (what, dir) in [
        ("the runtime directory", runtime),
        ("the state directory", state),
    ] {
        let canonical = resolver
            .canonicalize(dir)
            .unwrap_or_else(|_| dir.to_path_buf());
        reach.check(what, &canonical)?;
    }
    Ok(())
}

/// Warden's own directories, resolved once for many checks.
pub fn canonical_own(own: &[(&'static str, &Path)]) -> Vec<(&'static str, PathBuf)> {
    canonical_own_with(&mut Resolver::default(), own)
}

fn canonical_own_with(
    resolver: &mut Resolver,
    own: &[(&'static str, &Path)],
) -> Vec<(&'static str, PathBuf)> {
    own.iter()
        .map(|(what, dir)| {
            (
                *what,
                resolver
                    .canonicalize(dir)
                    .unwrap_or_else(|_| dir.to_path_buf()),
            )
        })
        .collect()
}

/// Resolves host paths as `realpath(3)` does (every symbolic link followed, `..` taken after
/// it), many paths at a time: each entry of a directory is asked about once, however many of
/// the paths pass through it. `fs::canonicalize` asks the kernel about every component of
/// every path: a plain `warden run` resolved `/etc` 50 times, 119 `readlink`s before its cell
/// was cloned. For one moment's checks: nothing is asked again, so a resolver is not kept.
#[derive(Debug, Default)]
pub struct Resolver {
    /// A path whose parent is canonical, and what it resolves to.
    known: std::collections::HashMap<PathBuf, PathBuf>,
}

/// How many symbolic links one resolution follows before it says `ELOOP` (Linux's limit).
const MAX_LINKS: u32 = 40;

impl Resolver {
    /// The canonical form of `path`, or the error `realpath(3)` gives. A relative path, and
    /// one that ends in a separator (which must name a directory), go to `fs::canonicalize`.
    pub fn canonicalize(&mut self, path: &Path) -> std::io::Result<PathBuf> {
        use std::os::unix::ffi::OsStrExt as _;
        let bytes = path.as_os_str().as_bytes();
        if !path.is_absolute() || (bytes.len() > 1 && bytes.ends_with(b"/")) {
            return std::fs::canonicalize(path);
        }
        let mut links = 0;
        self.resolve(path, PathBuf::from("/"), &mut links)
    }

    /// Resolves `path` from `from` (canonical, a directory).
    fn resolve(&mut self, path: &Path, from: PathBuf, links: &mut u32) -> std::io::Result<PathBuf> {
        use std::path::Component;
        let mut resolved = from;
        // Whether `resolved` may be something other than a directory: a `..` after it must
        // then fail as realpath's does.
        let mut unchecked = false;
        for component in path.components() {
            match component {
                Component::RootDir => {
                    resolved = PathBuf::from("/");
                    unchecked = false;
                }
                Component::CurDir | Component::Prefix(_) => {}
                Component::ParentDir => {
                    if unchecked && !std::fs::metadata(&resolved)?.is_dir() {
                        return Err(std::io::Error::from_raw_os_error(libc::ENOTDIR));
                    }
                    resolved.pop();
                    unchecked = false;
                }
                Component::Normal(name) => {
                    let candidate = resolved.join(name);
                    let next = match self.known.get(&candidate) {
                        Some(known) => known.clone(),
                        None => {
                            let next = match std::fs::read_link(&candidate) {
                                Ok(target) => {
                                    *links += 1;
                                    if *links > MAX_LINKS {
                                        return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
                                    }
                                    self.resolve(&target, resolved.clone(), links)?
                                }
                                // There, and not a link.
                                Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                                    candidate.clone()
                                }
                                Err(err) => return Err(err),
                            };
                            self.known.insert(candidate, next.clone());
                            next
                        }
                    };
                    resolved = next;
                    unchecked = true;
                }
            }
        }
        Ok(resolved)
    }
}

/// What the cell's setup, running as its host ids, may search on the way to host paths: each
/// directory is looked at once, however many paths pass through it.
#[derive(Debug)]
pub struct Reach {
    ids: (u32, u32),
    root_mode: bool,
    /// A directory the setup may not search: its mode and owner; `None`: it may.
    seen: std::collections::HashMap<PathBuf, Option<(u32, u32)>>,
}

impl Default for Reach {
    fn default() -> Self {
        Self::new()
    }
}

impl Reach {
    pub fn new() -> Self {
        let (ids, root_mode) = setup_host_ids();
        Self {
            ids,
            root_mode,
            seen: std::collections::HashMap::new(),
        }
    }

    /// Refuses a host path (canonical) that the setup cannot reach (a directory above it it
    /// may not search): said before the cell starts, instead of a failed mount.
    pub fn check(&mut self, what: &'static str, path: &Path) -> Result<(), PlanError> {
        use std::os::unix::fs::MetadataExt as _;
        let (uid, gid) = self.ids;
        let mut above: Vec<&Path> = path.ancestors().skip(1).collect();
        above.reverse();
        for dir in above {
            let closed = *self.seen.entry(dir.to_path_buf()).or_insert_with(|| {
                let meta = std::fs::metadata(dir).ok()?;
                let mode = meta.mode() & 0o777;
                let search = if meta.uid() == uid {
                    mode & 0o100
                } else if meta.gid() == gid {
                    mode & 0o010
                } else {
                    mode & 0o001
                };
                (search == 0).then_some((mode, meta.uid()))
            });
            if let Some((mode, owner)) = closed {
                return Err(PlanError::Unreachable {
                    what,
                    path: path.to_path_buf(),
                    blocker: dir.to_path_buf(),
                    mode,
                    owner,
                    uid,
                    why: if self.root_mode {
                        " (root-started cells never act as host root)"
                    } else {
                        ""
                    },
                });
            }
        }
        Ok(())
    }
}

/// The directories every cell gets its own of, mounted over whatever the host has there.
const CELLS_OWN: [&str; 3] = ["/tmp", "/dev", "/proc"];

/// Refuses a host path the policy shows the cell that lies under one of the cell's own
/// directories (where a fresh one would hide it).
pub fn check_not_under_cells_own(what: &'static str, path: &Path) -> Result<(), PlanError> {
    match CELLS_OWN.iter().find(|own| path.starts_with(own)) {
        Some(under) => Err(PlanError::UnderCellsOwn {
            what,
            path: path.to_path_buf(),
            under,
        }),
        None => Ok(()),
    }
}

/// Refuses a host path a cell would see (`what`) that is, holds or lies inside one of Warden's
/// own directories: through it a cell would read the journal's signing key, other cells'
/// layers and records, or the daemon's socket.
pub fn check_not_wardens(
    what: &'static str,
    path: &Path,
    own: &[(&'static str, &Path)],
) -> Result<(), PlanError> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    check_not_wardens_canonical(what, &path, &canonical_own(own))
}

/// [`check_not_wardens`] of a canonical path against canonical own directories.
pub fn check_not_wardens_canonical(
    what: &'static str,
    path: &Path,
    own: &[(&'static str, PathBuf)],
) -> Result<(), PlanError> {
    for (dir, own) in own {
        let how = if path == own {
            "is"
        } else if own.starts_with(path) {
            "holds"
        } else if path.starts_with(own) {
            "is inside"
        } else {
            continue;
        };
        return Err(PlanError::WardensOwn {
            what,
            path: path.to_path_buf(),
            how,
            dir,
            own: own.clone(),
        });
    }
    Ok(())
}

/// Checks a request before anything is made for it: what `check_paths` checks, and that the
/// workspace is a directory and none of Warden's own.
pub fn check_request(
    policy: &Policy,
    workspace: Option<&Path>,
    state: &Path,
    runtime: &Path,
) -> Result<(), PlanError> {
    check_paths(policy, state, runtime)?;
    if let Some(dir) = workspace {
        let host = std::fs::canonicalize(dir)
            .ok()
            .filter(|p| p.is_dir())
            .ok_or_else(|| PlanError::Workspace {
                path: dir.to_path_buf(),
            })?;
        let own = [("state directory", state), ("runtime directory", runtime)];
        check_not_wardens("workspace", &host, &own)?;
    }
    Ok(())
}

/// Checks a cell name (it becomes a file name, a cgroup name and the default host name).
pub fn check_name(name: &str) -> Result<(), PlanError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(PlanError::Name(
            warden_protocol::text::clipped(name).into_owned(),
        ))
    }
}

/// Read-only files up to this size are copied into the cell rather than bind-mounted.
const COPY_LIMIT: u64 = 256 * 1024;

/// Resolves the host paths a policy names into the entries of the cell's root.
pub fn entries(policy: &Policy) -> Vec<Entry> {
    let mut out = Vec::new();
    let fs = &policy.filesystem;
    let both = fs
        .read_only
        .iter()
        .map(|p| (p, false))
        .chain(fs.read_write.iter().map(|p| (p, true)));
    for (path, writable) in both {
        let Ok(meta) = std::fs::symlink_metadata(path) else {
            continue;
        };
        if meta.file_type().is_symlink() {
            if let Ok(target) = std::fs::read_link(path) {
                out.push(Entry::Symlink {
                    path: path.clone(),
                    target,
                });
            }
        } else if meta.is_file() && !writable && meta.len() <= COPY_LIMIT {
            out.push(Entry::Copy { path: path.clone() });
        } else if meta.is_dir() || meta.is_file() {
            out.push(Entry::Bind {
                path: path.clone(),
                dir: meta.is_dir(),
                writable,
            });
        }
    }
    // The policy's own links, made after what they may lead to.
    for (path, target) in &fs.links {
        out.push(Entry::Symlink {
            path: path.clone(),
            target: target.clone(),
        });
    }
    out
}

/// The protected paths of a policy that exist in `workspace`.
pub fn protected(policy: &Policy, workspace: &Path) -> Vec<PathBuf> {
    policy
        .filesystem
        .workspace
        .protect
        .iter()
        .map(PathBuf::from)
        .filter(|rel| {
            std::fs::symlink_metadata(workspace.join(rel))
                .is_ok_and(|m| !m.file_type().is_symlink())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::Resolver;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    /// The resolver answers as `realpath(3)` (`fs::canonicalize`) does, path for path, with
    /// one resolver for all (so that later paths go through what earlier ones left known):
    /// relative, absolute and chained links, `..` in a link and in a path, loops, dangling
    /// links, files in the middle of a path and trailing separators.
    #[test]
    fn the_resolver_answers_as_realpath_does() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("t");
        let name = "t";
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/f"), "x").unwrap();
        symlink("a", root.join("rel")).unwrap();
        symlink(root.join("a"), root.join("abs")).unwrap();
        symlink("rel", root.join("chain")).unwrap();
        symlink(format!("../{name}/a/f"), root.join("up")).unwrap();
        symlink("b/..", root.join("a/back")).unwrap();
        symlink("loop2", root.join("loop1")).unwrap();
        symlink("loop1", root.join("loop2")).unwrap();
        symlink("missing", root.join("dangling")).unwrap();
        symlink("f", root.join("a/tofile")).unwrap();
        let paths = [
            "",
            "a",
            "a/f",
            "a/b",
            "rel",
            "rel/f",
            "rel/b/../f",
            "abs/f",
            "chain/b",
            "chain/../a/f",
            "up",
            "up/..",
            "a/back/f",
            "a/f/..",
            "a/f/x",
            "a/tofile/..",
            "a/tofile/x",
            "a/f/",
            "a/",
            "rel/",
            "loop1",
            "loop1/x",
            "dangling",
            "missing/x",
            "./a/./f",
            "a//b",
        ];
        let mut resolver = Resolver::default();
        for round in 0..2 {
            for path in paths {
                let full: PathBuf = match path {
                    "" => root.clone(),
                    _ => PathBuf::from(format!("{}/{path}", root.display())),
                };
                let want = std::fs::canonicalize(&full).map_err(|e| e.raw_os_error());
                let got = resolver.canonicalize(&full).map_err(|e| e.raw_os_error());
                assert_eq!(got, want, "{} (round {round})", full.display());
            }
        }
        // Whole host paths too, with their links (`/bin` on a merged-/usr host).
        for path in [
            "/",
            "/bin/sh",
            "/etc/os-release",
            "/proc/self/exe",
            "/etc/../usr",
        ] {
            let want = std::fs::canonicalize(path).map_err(|e| e.raw_os_error());
            let got = resolver
                .canonicalize(std::path::Path::new(path))
                .map_err(|e| e.raw_os_error());
            assert_eq!(got, want, "{path}");
        }
    }
}
