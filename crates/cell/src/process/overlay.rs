//! The copy-on-write workspace mount. The cell's setup stacks it once from detached mounts of
//! its layers (see `rootfs`); it stays mounted for the cell's life, a reset changing it through
//! itself (see `reset`).

use std::path::{Path, PathBuf};

use nix::mount::{MsFlags, mount};

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
