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
//! - `release`: before a checkpoint, ends every process (but pid 1) that holds a descriptor of
//!   the host (`host:[N]` in its `/proc/PID/fd`: the pipes and terminals of the warden's execs),
//!   which runsc could not bring back; says how many on its stdout.

use std::io::Write;

unsafe extern "C" {
    fn wait(status: *mut i32) -> i32;
    fn pause() -> i32;
    fn kill(pid: i32, signal: i32) -> i32;
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
