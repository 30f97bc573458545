//! The first process of a gVisor cell, and its helper for signals to a process group.
//!
//! Built by `build.rs` as a static binary (it must run in any root: the host's directories or an
//! image without the host's C library) and bound read-only into every gVisor cell at
//! `/.warden/init`. It holds no power over the cell: the warden controls the sandbox from
//! outside (runsc, the cgroup); this process only keeps the container alive.
//!
//! - no arguments: pid 1 of the sandbox's container. Says `ready` on its stdout (a pipe the
//!   keeper reads: the cell is up), then reaps orphans for ever. Signals without a handler do
//!   nothing to a pid 1, so only SIGKILL from outside ends it.
//! - `kill SIGNAL PGID`: sends SIGNAL to the process group PGID (runsc signals single
//!   processes; an exec's group is its own session in gVisor), then exits.
//! - `run ARGV...`: pid 1 of a sandbox that runs one command (`warden run`): says `ready`,
//!   starts ARGV in a process group of its own, passes the signals it is sent on to that group,
//!   reaps orphans, and exits with the command's status (128 + N when a signal N ended it).
//! - `release`: before a checkpoint, ends every process (but pid 1) that holds a descriptor of
//!   the host (`host:[N]` in its `/proc/PID/fd`: the pipes and terminals of the warden's execs),
//!   which runsc could not bring back; says how many on its stdout.

#![no_main]

use std::ffi::{CStr, CString, OsString, c_char, c_int, c_void};
use std::io::Write;
use std::os::unix::ffi::OsStringExt as _;
use std::sync::atomic::{AtomicI32, Ordering};

unsafe extern "C" {
    fn wait(status: *mut c_int) -> c_int;
    fn pause() -> c_int;
    fn kill(pid: c_int, signal: c_int) -> c_int;
    fn signal(signal: c_int, handler: extern "C" fn(c_int)) -> usize;
    fn clone(
        child: extern "C" fn(*mut c_void) -> c_int,
        stack: *mut c_void,
        flags: c_int,
        arg: *mut c_void,
    ) -> c_int;
    fn setpgid(pid: c_int, group: c_int) -> c_int;
    fn execve(path: *const c_char, argv: *const *const c_char, env: *const *const c_char)
    -> c_int;
    fn _exit(code: c_int) -> !;
    fn __errno_location() -> *mut c_int;
    static environ: *const *const c_char;
}

const CLONE_VM: c_int = 0x100;
const CLONE_VFORK: c_int = 0x4000;
const SIGCHLD: c_int = 17;
const ENOENT: c_int = 2;
const EACCES: c_int = 13;

/// The command's process group, for the signal handler.
static GROUP: AtomicI32 = AtomicI32::new(0);

/// Passes a signal on to the command's group (async-signal-safe: an atomic load and kill).
extern "C" fn forward(sig: c_int) {
    let group = GROUP.load(Ordering::Relaxed);
    if group > 1 {
        // SAFETY: kill(2) with plain integers.
        unsafe { kill(-group, sig) };
    }
}

/// What the command's child needs, prepared before the clone (the child allocates nothing):
/// the paths to try in order (the program, or each PATH entry joined with it), the argument
/// vector, and where the child leaves the errno of its failure.
struct Start {
    candidates: Vec<CString>,
    argv: Vec<*const c_char>,
    failed: AtomicI32,
}

/// The child of the clone: its own process group, then the first candidate that executes. It
/// runs on its own stack in the init's memory (`CLONE_VM | CLONE_VFORK`: the init waits until
/// it execs or exits) and makes only async-signal-safe calls.
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Start` the init keeps alive, unchanged, until this child has exec'd
    // or exited; its only write is the atomic `failed`.
    let start = unsafe { &*(arg as *const Start) };
    // SAFETY: plain system calls on valid, NUL-terminated strings and pointer arrays.
    unsafe {
        setpgid(0, 0);
        let mut errno = ENOENT;
        let mut denied = false;
        for path in &start.candidates {
            execve(path.as_ptr(), start.argv.as_ptr(), environ);
            errno = *__errno_location();
            denied |= errno == EACCES;
        }
        start
            .failed
            .store(if denied { EACCES } else { errno }, Ordering::SeqCst);
        _exit(127)
    }
}

/// The paths `program` is tried at: itself when it names a path, else each entry of PATH (as
/// the shell searches it; an empty entry is the working directory).
fn candidates(program: &[u8]) -> Vec<CString> {
    let path = |bytes: Vec<u8>| CString::new(bytes).ok();
    if program.contains(&b'/') {
        return path(program.to_vec()).into_iter().collect();
    }
    let search = std::env::var_os("PATH")
        .unwrap_or_else(|| OsString::from("/usr/local/bin:/usr/bin:/bin"))
        .into_vec();
    search
        .split(|&b| b == b':')
        .filter_map(|dir| match dir {
            [] => path(program.to_vec()),
            dir => path([dir, b"/", program].concat()),
        })
        .collect()
}

/// Starts `argv` in a process group of its own with the init's environment; the errno of its
/// failure if it did not start. A clone with `CLONE_VM | CLONE_VFORK` (what `posix_spawn`
/// does, without its reset of every signal's disposition, one system call each: this init
/// changes none before the command starts, so the command gets the defaults it got itself).
fn spawn(argv: &[CString]) -> Result<c_int, c_int> {
    let mut pointers: Vec<*const c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    pointers.push(std::ptr::null());
    let start = Start {
        candidates: candidates(argv[0].as_bytes()),
        argv: pointers,
        failed: AtomicI32::new(0),
    };
    let mut stack = vec![0u8; 64 * 1024];
    // SAFETY: the child runs on `stack` (its top, 16-byte aligned as the ABI wants) and reads
    // `start`, both alive until clone returns: CLONE_VFORK suspends this thread until the child
    // has exec'd or exited.
    let pid = unsafe {
        let top = stack.as_mut_ptr().add(stack.len()) as usize & !15;
        clone(
            child,
            top as *mut c_void,
            CLONE_VM | CLONE_VFORK | SIGCHLD,
            &start as *const Start as *mut c_void,
        )
    };
    if pid < 0 {
        // SAFETY: reads this thread's errno.
        return Err(unsafe { *__errno_location() });
    }
    match start.failed.load(Ordering::SeqCst) {
        0 => Ok(pid),
        errno => {
            let mut status = 0;
            // SAFETY: wait(2) writes one int through a valid pointer; the child has exited.
            unsafe { wait(&mut status) };
            Err(errno)
        }
    }
}

/// Runs one command as described above; never returns.
fn run(argv: &[CString]) -> ! {
    let _ = std::io::stdout().write_all(b"ready\n");
    let _ = std::io::stdout().flush();
    if argv.is_empty() {
        eprintln!("warden: no command");
        std::process::exit(126);
    }
    let pid = match spawn(argv) {
        Ok(pid) => pid,
        Err(errno) => {
            let (code, why) = match errno {
                ENOENT => (127, "command not found"),
                EACCES => (126, "permission denied"),
                _ => (126, "cannot execute"),
            };
            eprintln!("warden: {why}: {}", argv[0].to_string_lossy());
            std::process::exit(code);
        }
    };
    GROUP.store(pid, Ordering::Relaxed);
    for sig in [1, 2, 3, 10, 12, 15, 28] {
        // SAFETY: installs `forward`, which is async-signal-safe, for a catchable signal.
        unsafe { signal(sig, forward) };
    }
    loop {
        let mut status = 0;
        // SAFETY: wait(2) writes one int through a valid pointer.
        let reaped = unsafe { wait(&mut status) };
        if reaped == pid {
            // The command's exit code, or 128 + the signal that ended it.
            std::process::exit(match (status & 0x7f, (status >> 8) & 0xff) {
                (0, code) => code,
                (sig, _) => 128 + sig,
            });
        }
        if reaped < 0 && std::io::Error::last_os_error().raw_os_error() != Some(4) {
            std::process::exit(125);
        }
    }
}

/// Whether process `pid` holds a descriptor of the host.
fn holds_host_fd(pid: &str) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| target.to_string_lossy().starts_with("host:["))
    })
}

/// Ends the processes that hold a descriptor of the host, until none is left (or a while has
/// passed); how many were ended.
fn release() -> usize {
    let me = std::process::id().to_string();
    let mut ended = std::collections::BTreeSet::new();
    for _ in 0..100 {
        let Ok(procs) = std::fs::read_dir("/proc") else {
            break;
        };
        let holding: Vec<String> = procs
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()) && pid != "1" && *pid != me)
            .filter(|pid| holds_host_fd(pid))
            .collect();
        if holding.is_empty() {
            break;
        }
        for pid in holding {
            if let Ok(number) = pid.parse::<i32>() {
                // SAFETY: kill(2) with plain integers.
                unsafe { kill(number, 9) };
                ended.insert(number);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    ended.len()
}

/// The C entry point: no Rust runtime start (`no_main`), so that nothing changes a signal's
/// disposition (the runtime would ignore SIGPIPE, which the command would then have to be given
/// back) and nothing reads `/proc/self/maps` for a guard page: every system call costs a trip
/// through gVisor's platform.
#[unsafe(no_mangle)]
pub extern "C" fn main(argc: c_int, argv: *const *const c_char) -> c_int {
    let args: Vec<CString> = (0..usize::try_from(argc).unwrap_or(0))
        // SAFETY: the C runtime passes `argc` valid NUL-terminated strings in `argv`.
        .map(|i| unsafe { CStr::from_ptr(*argv.add(i)) }.to_owned())
        .collect();
    let word = |i: usize| args.get(i).map(|a| a.as_bytes());
    if word(1) == Some(b"run") {
        run(&args[2..]);
    }
    if args.len() == 2 && word(1) == Some(b"release") {
        println!("{}", release());
        return 0;
    }
    if args.len() == 4 && word(1) == Some(b"kill") {
        let number = |i: usize| args[i].to_str().ok().and_then(|s| s.parse::<c_int>().ok());
        let (Some(signal), Some(group)) = (number(2), number(3)) else {
            return 2;
        };
        if group <= 1 {
            return 2;
        }
        // SAFETY: kill(2) with plain integers.
        let sent = unsafe { kill(-group, signal) };
        return if sent == 0 { 0 } else { 1 };
    }
    let _ = std::io::stdout().write_all(b"ready\n");
    let _ = std::io::stdout().flush();
    loop {
        let mut status = 0;
        // SAFETY: wait(2) writes one int through a valid pointer.
        if unsafe { wait(&mut status) } < 0 {
            // No child now: sleep until a signal (SIGCHLD of an orphan) comes.
            // SAFETY: pause(2) takes nothing.
            unsafe { pause() };
        }
    }
}
