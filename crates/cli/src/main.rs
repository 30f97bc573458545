//! `warden`: run commands in cells and control them from outside.
//!
//! Every subcommand turns its arguments into a typed request and calls the same core functions
//! (`warden_cell`, `warden_policy`); no confinement logic lives here.

// (The unit tests keep the test harness's own `main`.)
#![cfg_attr(not(test), no_main)]

mod cli;
mod commands;
mod core;
mod daemon;
mod policy;
mod render;

/// The process's entry, in place of the Rust runtime's: it does what that one does at start
/// for this program (stdio that is open, SIGPIPE ignored) but not the main thread's stack
/// guard lookup, which reads `/proc/self/maps` through glibc: `warden --version` 1.96 against
/// 2.13 ms, `warden run -- true` 10.08 against 10.23 ms (400 interleaved runs each). A stack
/// overflow still ends the process (SIGSEGV), without the runtime's message. After `run`: the
/// runtime's cleanup (stdout flushed) and the exit, as it would.
#[cfg(not(test))]
#[allow(unsafe_code)]
#[unsafe(no_mangle)]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    runtime_start();
    // A panic's message is out already (the hook's); the status is the runtime's.
    let code = std::panic::catch_unwind(run).unwrap_or(101);
    // (`exit` runs the runtime's cleanup too; the flush says so here.)
    let _ = std::io::Write::flush(&mut std::io::stdout());
    std::process::exit(code)
}

/// What the runtime would do before `main`: a closed stdin, stdout or stderr is opened on
/// `/dev/null` (so that no file this process opens takes its number), and SIGPIPE is ignored.
#[cfg(not(test))]
#[allow(unsafe_code)]
fn runtime_start() {
    let mut fds = [0, 1, 2].map(|fd| libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    });
    // SAFETY: three valid pollfd entries; a number that is not open comes back POLLNVAL.
    let polled = unsafe { libc::poll(fds.as_mut_ptr(), 3, 0) };
    if polled >= 0 {
        for fd in fds.iter().filter(|fd| fd.revents & libc::POLLNVAL != 0) {
            // The lowest free number is the closed one: the ones below it are open.
            // SAFETY: a NUL-terminated path; the descriptor is kept for the process's life.
            let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) };
            if null != fd.fd {
                std::process::abort();
            }
        }
    }
    // SAFETY: SIG_IGN installs no handler; no other thread exists yet.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

#[cfg_attr(test, allow(dead_code))]
fn run() -> i32 {
    let args = cli::parse();
    // Commands that only read and print end quietly, as other tools do, when their reader
    // goes (`warden ps | head`). The others keep SIGPIPE ignored: they hold a cell, serve, or
    // talk to the daemon, and must see a failed write as an error they can report or clean
    // up after.
    use cli::Command as C;
    if matches!(
        args.command,
        C::Ps { .. }
            | C::Diff { .. }
            | C::Snapshots { .. }
            | C::Net { .. }
            | C::Approvals { .. }
            | C::Policy { .. }
            | C::Completions { .. }
            | C::Man
            | C::Doctor { .. }
            | C::Logs { .. }
            | C::Audit { .. }
            | C::Replay { .. }
    ) {
        default_sigpipe();
    }
    match commands::dispatch(args) {
        Ok(code) => code.clamp(0, 255),
        // The reader of our output went away (`warden ... | head`): nothing is wrong to say, and
        // the status is the one a shell gives a writer ended by SIGPIPE.
        Err(err) if reader_left(&err) => 128 + 13,
        Err(err) => {
            eprintln!("warden: {err:#}");
            warden_protocol::exit::WARDEN_ERROR
        }
    }
}

/// Whether `err` is a write to stdout that found its reader gone.
fn reader_left(err: &anyhow::Error) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let broken = err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    });
    // Only when our own stdout is the pipe whose reader went (not a socket or a cell's pipe):
    // the write end of such a pipe polls as an error.
    let stdout = std::io::stdout();
    let mut fds = [PollFd::new(&stdout, PollFlags::OUT)];
    let now = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    broken && poll(&mut fds, Some(&now)).is_ok() && fds[0].revents().contains(PollFlags::ERR)
}

/// Gives SIGPIPE its default action (the Rust runtime ignores it at start).
#[allow(unsafe_code)]
fn default_sigpipe() {
    // SAFETY: SIG_DFL installs no handler; nothing else in the process changes SIGPIPE's
    // disposition concurrently (this runs before any thread is started).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
