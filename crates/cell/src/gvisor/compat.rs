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
const STATX_RO: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/warden-gvisor-statx-ro.so"));

/// Where each appears in the cell.
pub const INIT_IN_CELL: &str = "/.warden/init";
pub const STATX_IN_CELL: &str = "/.warden/statx.so";

/// What the cell's `/etc/ld.so.preload` holds: the shim's path, without a line's end. glibc's
/// loader maps the file writable and puts a NUL over its last separator, which copies the
/// file's page; a file that is one name with nothing after it is read as it is (the loader
/// copies the name to its stack instead), and a page of a file a process only reads is one
/// fault less in a gVisor sandbox than one it writes (see ARCHITECTURE, "The statx shim").
pub const PRELOAD: &str = STATX_IN_CELL;

/// The files on the host.
#[derive(Debug, Clone)]
pub struct Compat {
    pub init: PathBuf,
    /// The shim as any glibc loads it.
    pub statx: PathBuf,
    /// The shim with nothing of its file written when it is loaded (`gvisor-compat/statx.ld`),
    /// for glibc 2.35 and later.
    pub statx_read_only: PathBuf,
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
            statx_read_only: write_once(dir, "statx-ro.so", STATX_RO, 0o444)?,
        })
    }

    /// The shim for a cell whose root is the host's own directories (`host_root`) or an
    /// image's. The read-only layout needs a loader that leaves a read-only dynamic section
    /// alone (glibc 2.35 and later; an older one writes into it and every program would fault):
    /// the host's directories have the host's loader, whose version is this process's C
    /// library's; an image's loader is its own, so an image gets the layout every glibc loads.
    pub fn statx_for(&self, host_root: bool) -> &Path {
        if host_root && host_glibc_at_least(2, 35) {
            &self.statx_read_only
        } else {
            &self.statx
        }
    }
}

/// Whether the C library this process runs with (the host's) is glibc `major.minor` or later.
fn host_glibc_at_least(major: u32, minor: u32) -> bool {
    crate::process::sys::glibc_version().is_some_and(|v| glibc_version_at_least(&v, major, minor))
}

/// `version` ("2.36", "2.35.1") is `major.minor` or later; anything else is not.
fn glibc_version_at_least(version: &str, major: u32, minor: u32) -> bool {
    let mut parts = version.trim().split('.').map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(a)), Some(Ok(b))) => (a, b) >= (major, minor),
        _ => false,
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

    /// A program header: type, flags, size in the file.
    #[derive(Debug, Clone, Copy)]
    struct Header {
        kind: u32,
        flags: u32,
        in_file: u64,
    }

    const PT_LOAD: u32 = 1;
    const PT_DYNAMIC: u32 = 2;
    const PT_GNU_STACK: u32 = 0x6474_e551;
    const PF_X: u32 = 1;
    const PF_W: u32 = 2;

    /// The type of a 64-bit little-endian ELF file, and its program headers.
    fn program_headers(bytes: &[u8]) -> (u16, Vec<Header>) {
        assert_eq!(&bytes[..4], b"\x7fELF", "not an ELF file");
        assert_eq!(bytes[4], 2, "not a 64-bit ELF file");
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let phoff = u64_at(0x20) as usize;
        let (size, count) = (u16_at(0x36) as usize, u16_at(0x38) as usize);
        let headers = (0..count)
            .map(|i| phoff + i * size)
            .map(|at| Header {
                kind: u32_at(at),
                flags: u32_at(at + 4),
                in_file: u64_at(at + 0x20),
            })
            .collect();
        (u16_at(0x10), headers)
    }

    /// The program headers' types of a 64-bit little-endian ELF file, and its type.
    fn elf_shape(bytes: &[u8]) -> (u16, Vec<u32>) {
        let (kind, headers) = program_headers(bytes);
        (kind, headers.iter().map(|h| h.kind).collect())
    }

    /// The flags of the one header of type `kind`.
    fn flags_of(headers: &[Header], kind: u32) -> u32 {
        headers
            .iter()
            .find(|h| h.kind == kind)
            .unwrap_or_else(|| panic!("no program header of type {kind:#x}: {headers:?}"))
            .flags
    }

    #[test]
    fn the_read_only_shim_maps_no_byte_of_its_file_writable() {
        let (_, all) = program_headers(STATX_RO);
        let loads: Vec<Header> = all.iter().copied().filter(|h| h.kind == PT_LOAD).collect();
        let from_file: Vec<&Header> = loads.iter().filter(|h| h.in_file > 0).collect();
        assert_eq!(
            from_file.len(),
            1,
            "segments with bytes in the file: {all:?}"
        );
        assert_eq!(
            from_file[0].flags & PF_W,
            0,
            "its one segment is writable: {all:?}"
        );
        for load in loads.iter().filter(|h| h.flags & PF_W != 0) {
            assert_eq!(load.in_file, 0, "a writable segment maps the file: {all:?}");
        }
        let dynamic = flags_of(&all, PT_DYNAMIC);
        assert_eq!(dynamic & PF_W, 0, "the dynamic section says it is writable");
        // Without a PT_GNU_STACK, glibc would make the stack of every program executable.
        let stack = flags_of(&all, PT_GNU_STACK);
        assert_eq!(stack & PF_X, 0, "the shim asks for an executable stack");
        // The plain shim keeps its dynamic section writable: glibc before 2.35 writes into it.
        let (_, plain) = program_headers(STATX);
        let dynamic = flags_of(&plain, PT_DYNAMIC);
        assert_ne!(
            dynamic & PF_W,
            0,
            "the plain shim's dynamic section is read-only"
        );
        let stack = flags_of(&plain, PT_GNU_STACK);
        assert_eq!(
            stack & PF_X,
            0,
            "the plain shim asks for an executable stack"
        );
    }

    #[test]
    fn glibc_versions_are_compared_by_number() {
        assert!(glibc_version_at_least("2.35", 2, 35));
        assert!(glibc_version_at_least("2.36", 2, 35));
        assert!(glibc_version_at_least("2.40.1", 2, 35));
        assert!(glibc_version_at_least("3.0", 2, 35));
        assert!(!glibc_version_at_least("2.34", 2, 35));
        assert!(!glibc_version_at_least("2.9", 2, 35));
        assert!(!glibc_version_at_least("", 2, 35));
        assert!(!glibc_version_at_least("2", 2, 35));
        assert!(!glibc_version_at_least("two.35", 2, 35));
    }

    #[test]
    fn the_preload_file_is_one_name_with_nothing_after_it() {
        assert_eq!(PRELOAD, STATX_IN_CELL);
        assert!(
            !PRELOAD.contains(|c: char| c.is_whitespace() || c == ':' || c == '#'),
            "{PRELOAD:?}"
        );
    }

    /// Each shim, loaded by this host's glibc into a program that asks `statx` with
    /// `AT_NO_AUTOMOUNT` (GNU `stat`): the answer and the error are the C library's, and the
    /// read-only shim's file is never copied on write (`Anonymous` of each of its mappings).
    #[test]
    fn each_shim_loads_into_a_host_program_and_the_read_only_one_copies_no_page() {
        if !host_glibc_at_least(2, 35) {
            eprintln!("skipped: this host's glibc is older than 2.35");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let compat = Compat::install(dir.path()).unwrap();
        for shim in [&compat.statx, &compat.statx_read_only] {
            let out = Command::new("stat")
                .args(["-c", "%F", "/", "/no/such/path"])
                .env("LD_PRELOAD", shim)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{shim:?}: {stdout} {stderr}");
            assert_eq!(stdout, "directory\n", "{shim:?}: {stderr}");
            assert!(
                stderr.contains("No such file or directory"),
                "{shim:?}: {stderr}"
            );
            assert!(!stderr.contains("ld.so"), "{shim:?}: {stderr}");
        }
        let out = Command::new("cat")
            .arg("/proc/self/smaps")
            .env("LD_PRELOAD", &compat.statx_read_only)
            .output()
            .unwrap();
        let smaps = String::from_utf8_lossy(&out.stdout);
        // Each mapping is a line `START-END PERMS OFFSET DEV INODE PATH` and its fields after it.
        let is_mapping = |line: &str| {
            line.split_whitespace()
                .next()
                .is_some_and(|range| range.contains('-') && !range.ends_with(':'))
        };
        let name = compat.statx_read_only.to_string_lossy().into_owned();
        let mut mappings = 0;
        let mut lines = smaps.lines().peekable();
        while let Some(line) = lines.next() {
            let fields: Vec<&str> =
                std::iter::from_fn(|| lines.next_if(|l| !is_mapping(l))).collect();
            if !line.ends_with(name.as_str()) {
                continue;
            }
            mappings += 1;
            let perms = line.split_whitespace().nth(1).unwrap();
            assert!(
                !perms.contains('w'),
                "a writable mapping of the file: {line}"
            );
            let anonymous = fields.iter().find(|l| l.starts_with("Anonymous:")).unwrap();
            assert_eq!(
                anonymous.split_whitespace().nth(1),
                Some("0"),
                "{line}: {anonymous}"
            );
        }
        assert_eq!(mappings, 1, "{smaps}");
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

    /// `start` (a spawn of the init just written), again while the kernel says the program is
    /// busy: a thread of another test that forks while this one writes the file holds a copy
    /// of its descriptor until that child execs (ETXTBSY), a race of the test binary's threads.
    fn unbusy<T>(mut start: impl FnMut() -> std::io::Result<T>) -> T {
        for _ in 0..200 {
            match start() {
                Err(err) if err.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                other => return other.unwrap(),
            }
        }
        start().unwrap()
    }

    fn run(init: &Path, args: &[&str]) -> (Option<i32>, String, String) {
        let out = unbusy(|| Command::new(init).arg("run").args(args).output());
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
        let mut child = unbusy(|| {
            Command::new(&init)
                .args(["run", "sh", "-c", "sleep 30 & wait"])
                .stdout(Stdio::piped())
                .spawn()
        });
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
