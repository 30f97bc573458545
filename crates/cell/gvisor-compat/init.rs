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

use std::io::Write;

use std::sync::atomic::{AtomicI32, Ordering};

unsafe extern "C" {
    fn wait(status: *mut i32) -> i32;
    fn pause() -> i32;
    fn kill(pid: i32, signal: i32) -> i32;
    fn signal(signal: i32, handler: extern "C" fn(i32)) -> usize;
}

/// The command's process group, for the signal handler.
static GROUP: AtomicI32 = AtomicI32::new(0);

/// Passes a signal on to the command's group (async-signal-safe: an atomic load and kill).
extern "C" fn forward(sig: i32) {
    let group = GROUP.load(Ordering::Relaxed);
    if group > 1 {
        // SAFETY: kill(2) with plain integers.
        unsafe { kill(-group, sig) };
    }
}

/// Runs one command as described above; never returns.
fn run(argv: &[String]) -> ! {
    use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
    let _ = std::io::stdout().write_all(b"ready\n");
    let _ = std::io::stdout().flush();
    let Some((program, args)) = argv.split_first() else {
        eprintln!("warden: no command");
        std::process::exit(126);
    };
    let child = std::process::Command::new(program)
        .args(args)
        .process_group(0)
        .spawn();
    let child = match child {
        Ok(child) => child,
        Err(e) => {
            let (code, why) = match e.kind() {
                std::io::ErrorKind::NotFound => (127, "command not found"),
                std::io::ErrorKind::PermissionDenied => (126, "permission denied"),
                _ => (126, "cannot execute"),
            };
            eprintln!("warden: {why}: {program}");
            std::process::exit(code);
        }
    };
    let pid = child.id() as i32;
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
            let status = std::process::ExitStatus::from_raw(status);
            std::process::exit(match (status.code(), status.signal()) {
                (Some(code), _) => code,
                (None, Some(sig)) => 128 + sig,
                _ => 125,
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() >= 2 && args[1] == "run" {
        run(&args[2..]);
    }
    if args.len() == 2 && args[1] == "release" {
        println!("{}", release());
        return;
    }
    if args.len() == 4 && args[1] == "kill" {
        let (Ok(signal), Ok(group)) = (args[2].parse::<i32>(), args[3].parse::<i32>()) else {
            std::process::exit(2);
        };
        if group <= 1 {
            std::process::exit(2);
        }
        // SAFETY: kill(2) with plain integers.
        let sent = unsafe { kill(-group, signal) };
        std::process::exit(if sent == 0 { 0 } else { 1 });
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
