//! `warden`: run commands in cells and control them from outside.
//!
//! Every subcommand turns its arguments into a typed request and calls the same core functions
//! (`warden_cell`, `warden_policy`); no confinement logic lives here.

mod cli;
mod commands;
mod core;
mod daemon;
mod policy;
mod render;

use std::process::ExitCode;

fn main() -> ExitCode {
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
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        // The reader of our output went away (`warden ... | head`): nothing is wrong to say, and
        // the status is the one a shell gives a writer ended by SIGPIPE.
        Err(err) if reader_left(&err) => ExitCode::from(128 + 13),
        Err(err) => {
            eprintln!("warden: {err:#}");
            ExitCode::from(warden_protocol::exit::WARDEN_ERROR as u8)
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
