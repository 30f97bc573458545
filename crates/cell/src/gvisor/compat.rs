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

#[cfg(all(test, target_os = "linux", target_arch = "x86_64"))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::io::Read as _;
    use std::os::unix::process::ExitStatusExt as _;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    /// The program headers' types of a 64-bit little-endian ELF file, and its type.
    fn elf_shape(bytes: &[u8]) -> (u16, Vec<u32>) {
        assert_eq!(&bytes[..4], b"\x7fELF", "not an ELF file");
        assert_eq!(bytes[4], 2, "not a 64-bit ELF file");
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let phoff = u64_at(0x20) as usize;
        let (size, count) = (u16_at(0x36) as usize, u16_at(0x38) as usize);
        let types = (0..count).map(|i| u32_at(phoff + i * size)).collect();
        (u16_at(0x10), types)
    }

    #[test]
    fn the_init_is_a_fixed_address_program_with_nothing_to_load_or_relocate() {
        let (kind, headers) = elf_shape(INIT);
        // ET_EXEC: linked at a fixed address (a static-pie would be ET_DYN and relocate itself).
        assert_eq!(kind, 2, "the init is not a fixed-address executable");
        // No PT_INTERP (3): no dynamic loader; no PT_DYNAMIC (2): nothing to relocate.
        assert!(!headers.contains(&3), "the init names a dynamic loader");
        assert!(!headers.contains(&2), "the init has a dynamic section");
        // Without the C library it is a few pages, not the static C library's megabyte.
        assert!(INIT.len() < 128 * 1024, "the init is {} bytes", INIT.len());
    }

    /// The init written where it can run, on this host (it is a static x86-64 program).
    fn installed() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let compat = Compat::install(dir.path()).unwrap();
        (dir, compat.init)
    }

    fn run(init: &Path, args: &[&str]) -> (Option<i32>, String, String) {
        let out = Command::new(init).arg("run").args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn the_init_runs_a_command_and_ends_with_its_status() {
        let (dir, init) = installed();
        let (code, out, _) = run(&init, &["sh", "-c", "echo out; exit 3"]);
        assert_eq!(code, Some(3));
        assert_eq!(out, "ready\nout\n");
        // The command is the init's child, in a process group of its own.
        let group = "read -r _ _ _ _ group _ < /proc/$$/stat; echo $group $$";
        let (code, out, _) = run(&init, &["sh", "-c", group]);
        assert_eq!(code, Some(0));
        let words: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(
            words[1], words[2],
            "the command leads no group of its own: {out}"
        );
        // A signal that ends the command comes back as 128 + N.
        let (code, _, _) = run(&init, &["sh", "-c", "kill -KILL $$"]);
        assert_eq!(code, Some(128 + 9));
        // The PATH is searched entry by entry; what is not there, or not executable, says so.
        let (code, _, err) = run(&init, &["no-such-program-here"]);
        assert_eq!(code, Some(127));
        assert!(
            err.contains("command not found: no-such-program-here"),
            "{err}"
        );
        let plain = dir.path().join("plain");
        fs::write(&plain, "not a program\n").unwrap();
        fs::set_permissions(&plain, fs::Permissions::from_mode(0o644)).unwrap();
        let (code, _, err) = run(&init, &[plain.to_str().unwrap()]);
        assert_eq!(code, Some(126));
        assert!(err.contains("permission denied"), "{err}");
        fs::set_permissions(&plain, fs::Permissions::from_mode(0o755)).unwrap();
        let (code, _, err) = run(&init, &[plain.to_str().unwrap()]);
        assert_eq!(code, Some(126));
        assert!(err.contains("cannot execute"), "{err}");
        let (code, _, err) = run(&init, &[]);
        assert_eq!(code, Some(126));
        assert!(err.contains("no command"), "{err}");
    }

    #[test]
    fn the_init_passes_the_signals_it_is_sent_on_to_the_commands_group() {
        let (_dir, init) = installed();
        // The command and a child of its own, both in the group the init made.
        let mut child = Command::new(&init)
            .args(["run", "sh", "-c", "sleep 30 & wait"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = [0u8; 6];
        child.stdout.take().unwrap().read_exact(&mut ready).unwrap();
        assert_eq!(&ready, b"ready\n");
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = child.wait().unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}");
        assert_eq!(status.signal(), None);
    }
}
