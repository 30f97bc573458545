//! The copy-on-write workspace mount, shared by the cell's setup and by the warden's later
//! remounts (reset). Its layers are also reachable inside the cell's mount namespace under
//! `/.warden`, a directory only the cell's root may enter (and that Landlock keeps the command
//! from writing), so that the warden can mount a new overlay there without any path of the host.

use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};

/// Inside the cell: the hidden directory and what it holds.
pub const HIDDEN: &str = "/.warden";
pub const LOWER: &str = "/.warden/lower";
pub const LAYER: &str = "/.warden/layer";
pub const SNAPSHOTS: &str = "/.warden/snapshots";

/// Where a host path of a snapshot layer appears inside the cell.
pub fn inside_snapshot(host_snapshots: &Path, layer: &Path) -> PathBuf {
    match layer.strip_prefix(host_snapshots) {
        Ok(rel) => Path::new(SNAPSHOTS).join(rel),
        Err(_) => layer.to_path_buf(),
    }
}

/// Mounts an overlay on `target` from layer paths as seen by the caller, topmost lower first.
pub fn mount_overlay(
    target: &Path,
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
) -> nix::Result<()> {
    let lowers: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
    let options = format!(
        "lowerdir={},upperdir={},workdir={},userxattr",
        lowers.join(":"),
        upper.display(),
        work.display()
    );
    mount(
        Some("overlay"),
        target,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(options.as_str()),
    )
}
