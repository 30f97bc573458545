//! The two files of Warden's own in every gVisor cell, built with the crate (`build.rs`) and
//! written once into the state directory, where the keeper binds them read-only into the
//! cell's root: the static init (`/.warden/init`) and the `statx` shim preloaded into the
//! cell's processes (`/.warden/statx.so`, named in the cell's `/etc/ld.so.preload`).

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

const INIT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/warden-gvisor-init"));
const STATX: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/warden-gvisor-statx.so"));

/// Where each appears in the cell.
pub const INIT_IN_CELL: &str = "/.warden/init";
pub const STATX_IN_CELL: &str = "/.warden/statx.so";

/// The files on the host.
#[derive(Debug, Clone)]
pub struct Compat {
    pub init: PathBuf,
    pub statx: PathBuf,
}

impl Compat {
    /// Writes the files into `dir` (once per build: their names carry their hash, so a newer
    /// warden never runs an older one's) and returns where they are.
    pub fn install(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o711))?;
        Ok(Self {
            init: write_once(dir, "init", INIT, 0o555)?,
            statx: write_once(dir, "statx.so", STATX, 0o444)?,
        })
    }
}

fn write_once(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> io::Result<PathBuf> {
    if bytes.is_empty() {
        return Err(io::Error::other(format!(
            "this build of warden has no gVisor {name} (built for another system)"
        )));
    }
    let hash = blake3::hash(bytes).to_hex();
    let path = dir.join(format!("{name}-{}", &hash[..16]));
    if fs::metadata(&path).is_ok_and(|m| m.len() == bytes.len() as u64) {
        return Ok(path);
    }
    // Written beside and renamed into place: another keeper may be reading it.
    let tmp = dir.join(format!(".{name}-{}-{}", std::process::id(), &hash[..16]));
    fs::write(&tmp, bytes)?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))?;
    fs::rename(&tmp, &path)?;
    Ok(path)
}
