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
/// overflow still ends the process (SIGSEGV), without the runtime's message. After `run`:
/// stdout flushed (the runtime's cleanup), then the exit itself (`_exit`), without the C
/// library's exit handlers: this program registers none, and what they did (the linked
/// libraries' destructors, libgcc's among them, unregistering frame tables; faulting in the
/// code that does it) freed memory the exit frees anyway. (Under `perf record`, a tenth of a
/// millisecond of a `warden run`'s end; timed by scheduler events, within their noise.)
#[cfg(not(test))]
#[allow(unsafe_code)]
#[unsafe(no_mangle)]
extern "C" fn main(argc: libc::c_int, argv: *const *const libc::c_char) -> libc::c_int {
    runtime_start();
    // A panic's message is out already (the hook's); the status is the runtime's.
    let (code, hand_over_memory) = std::panic::catch_unwind(run).unwrap_or((101, false));
    let _ = std::io::Write::flush(&mut std::io::stdout());
    if hand_over_memory && leave_memory_behind() {
        blank_arguments(argc, argv);
    }
    // SAFETY: ends the process; stdout is flushed, and stderr has no buffer.
    unsafe { libc::_exit(code) }
}

/// The one function of the C library's maths library (`libm.so.6`) this program calls (tokio's
/// scheduler weighs its tasks' poll times with it), given here from the `libm` crate
/// (rust-lang's port of musl's), so that the loader maps no second library at every start for
/// it (`build.rs`). The linker binds the program's calls to this definition.
#[cfg(not(test))]
#[allow(unsafe_code)]
#[unsafe(no_mangle)]
extern "C" fn pow(x: f64, y: f64) -> f64 {
    libm::pow(x, y)
}

/// What the runtime would do before `main`: a closed stdin, stdout or stderr is opened on
/// `/dev/null` (so that no file this process opens takes its number), and SIGPIPE is ignored.
#[cfg(not(test))]
#[allow(unsafe_code)]
fn runtime_start() {
    populate_stack();
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

/// Makes the stack's next 96 KiB below this frame at once (`MADV_POPULATE_WRITE`), where a
/// `warden run` faulted its pages in one by one as its calls went deeper (27 to 29 page
/// faults of the run's thread before the cell's clone, 2 now; each fault a trap of
/// microseconds on this VM): `coldstart --runs 300 --baseline`, 8.19 against 8.54 ms as root
/// and 9.52 against 9.74 rootless (builds without LTO). The kernel maps 128 KiB of stack below
/// the arguments at the exec, so the range is mapped; where it is not (a stack limit under 128
/// KiB), nothing is made and nothing fails. (The heap's first 132 KiB made so too, with it:
/// no gain beyond the stack's that the benchmark could show.)
#[cfg(not(test))]
#[allow(unsafe_code)]
fn populate_stack() {
    const STACK: usize = 96 * 1024;
    let here = 0u8;
    let top = std::hint::black_box(std::ptr::addr_of!(here)) as usize & !4095;
    // SAFETY: asks the kernel to make pages of this thread's own stack mapping below the live
    // frames; it changes no byte of memory, and an address outside the mapping is refused.
    unsafe {
        libc::madvise(
            top.saturating_sub(STACK) as *mut libc::c_void,
            STACK,
            libc::MADV_POPULATE_WRITE,
        );
    }
}

#[cfg_attr(test, allow(dead_code))]
/// The exit status, and whether the memory's teardown is handed over (`leave_memory_behind`):
/// for `warden run`, whose end a script or a harness waits for between steps, where a holder
/// can be had.
fn run() -> (i32, bool) {
    // A run's network namespace is begun before its arguments are parsed (`run` is the first
    // of them where `cli::parse` takes it as a run: `parse_run`), and made beside the parse,
    // the reading of its policy and its journal's opening.
    if std::env::args_os().nth(1).is_some_and(|word| word == "run") {
        warden_cell::start_network_early();
    }
    let args = cli::parse();
    let hand_over_memory = matches!(args.command, cli::Command::Run(_)) && holder_possible();
    // The holder of the memory keeps the run's last holds on its cell's namespaces too: their
    // teardown then comes after the caller has been woken, with the memory's.
    if hand_over_memory {
        warden_cell::leave_namespaces_to_exit();
    }
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
    let code = match commands::dispatch(args) {
        Ok(code) => code.clamp(0, 255),
        // The reader of our output went away (`warden ... | head`): nothing is wrong to say, and
        // the status is the one a shell gives a writer ended by SIGPIPE.
        Err(err) if reader_left(&err) => 128 + 13,
        Err(err) => {
            // Errors can quote what a cell chose (the paths of an apply that was refused or
            // rolled back): escaped, line by line, before they reach a terminal.
            eprintln!("warden: {}", render::safe_lines(&render::error_text(&err)));
            warden_protocol::exit::WARDEN_ERROR
        }
    };
    (code, hand_over_memory)
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

/// Hands the teardown of this process's memory to a process that shares it (`CLONE_VM`) and
/// ends a moment after this one: the kernel takes an address space down when its last user
/// exits, and this process's parent waits for that exit, not for the teardown. Freeing a
/// `warden run`'s memory (its heap, its threads' stacks, the mappings of a 24 MiB binary) took
/// 0.41 ms from its `exit_group` to its caller's wake-up, 0.04 ms with the holder. The holder
/// runs with every signal blocked. It closes its copies of this process's descriptors before
/// this process goes on to exit (a pipe to the caller must end with this process: a caller
/// that has waited for it reads the pipe's end), but those the run left to its end
/// (`warden_cell::left_to_exit`: the last holds on its cell's namespaces, whose teardown is
/// then the holder's too), then waits for this process's end on a pidfd and exits; the init,
/// or the caller's reaper, reaps it. It touches no thread-local data (it shares this thread's,
/// and a failed libc call sets `errno` there): rustix's raw calls, and `close_range`s that
/// cannot fail. Called only where `holder_possible` said so.
#[cfg(not(test))]
#[allow(unsafe_code)]
fn leave_memory_behind() -> bool {
    use rustix::process::{PidfdFlags, getpid, pidfd_open};
    use rustix::thread::futex;
    use std::sync::atomic::{AtomicU32, Ordering};
    const STACK: usize = 64 * 1024;
    let Ok(pidfd) = pidfd_open(getpid(), PidfdFlags::empty()) else {
        return false;
    };
    let pidfd = std::os::fd::IntoRawFd::into_raw_fd(pidfd);
    // What it keeps open until this process has ended: the pidfd, and the holds on the cell's
    // namespaces that the run left to its end.
    let mut kept: Vec<u32> = std::iter::once(pidfd)
        .chain(warden_cell::left_to_exit())
        .filter_map(|fd| u32::try_from(fd).ok())
        .collect();
    kept.sort_unstable();
    kept.dedup();
    // Never freed: the holder reads it after this process has stopped running.
    let holder: &'static mut Holder = Box::leak(Box::new(Holder {
        pidfd,
        kept: kept.leak(),
        closed: AtomicU32::new(0),
    }));
    // SAFETY: a fresh anonymous mapping for the holder's stack, never unmapped; `clone` with
    // `CLONE_VM` runs `hold` on it with a pointer to the leaked `Holder`; the signal masks are
    // whole sets. Nothing of this process is changed but its mask, which is put back.
    let started = unsafe {
        let stack = libc::mmap(
            std::ptr::null_mut(),
            STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        );
        if stack == libc::MAP_FAILED {
            return false;
        }
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut before: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&raw mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const all, &raw mut before);
        let pid = libc::clone(
            hold,
            stack.cast::<u8>().add(STACK).cast(),
            libc::CLONE_VM | libc::SIGCHLD,
            std::ptr::from_mut(holder).cast(),
        );
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const before, std::ptr::null_mut());
        pid > 0
    };
    while started && holder.closed.load(Ordering::Acquire) == 0 {
        let _ = futex::wait(&holder.closed, futex::Flags::PRIVATE, 0, None);
    }
    started
}

/// Whether a holder of the memory can be had: it closes with `close_range` (Linux 5.9), which
/// must not fail there; a kernel without it gets no holder. (Asked to close one number that no
/// descriptor has.)
#[cfg_attr(test, allow(dead_code))]
#[allow(unsafe_code)]
fn holder_possible() -> bool {
    // SAFETY: closes nothing; the arguments are integers.
    unsafe { libc::close_range(u32::MAX, u32::MAX, 0) == 0 }
}

/// Blanks this process's arguments but its program's name where the kernel keeps them (what
/// `/proc/PID/cmdline` shows), once the holder of its memory is started: the holder shares that
/// memory, so it showed the run's arguments until it ended, a moment after the run. A look for
/// a process that shows a run's arguments (a name, a command), made once the run has ended,
/// found the holder in three runs of three, within 20 runs each.
#[cfg(not(test))]
#[allow(unsafe_code)]
fn blank_arguments(argc: libc::c_int, argv: *const *const libc::c_char) {
    if argv.is_null() {
        return;
    }
    for i in 1..usize::try_from(argc).unwrap_or(0) {
        // SAFETY: `argv` holds `argc` pointers to the NUL-terminated strings the kernel laid
        // out in this process's memory; each is written over with NULs, its length unchanged,
        // and nothing reads the arguments any more.
        unsafe {
            let arg = (*argv.add(i)).cast_mut();
            if !arg.is_null() {
                std::ptr::write_bytes(arg, 0, libc::strlen(arg));
            }
        }
    }
}

/// What the holder of this process's memory is given: the pidfd of this process to wait on,
/// the descriptors it keeps (that one, and those the run left to its end), in order, and where
/// it says that it has closed the others.
#[cfg(not(test))]
struct Holder {
    pidfd: i32,
    kept: &'static [u32],
    closed: std::sync::atomic::AtomicU32,
}

/// The holder (see `leave_memory_behind`): system calls that cannot fail (`errno` is the
/// thread-local data of the thread that cloned it) and rustix's raw ones. Its return ends it.
#[cfg(not(test))]
#[allow(unsafe_code)]
extern "C" fn hold(holder: *mut libc::c_void) -> libc::c_int {
    use rustix::event::{PollFd, PollFlags, poll};
    use rustix::thread::futex;
    // SAFETY: the leaked `Holder` that `leave_memory_behind` passed, only read but for its
    // atomic flag.
    let holder = unsafe { &*holder.cast::<Holder>() };
    // SAFETY: this process's own copies of the descriptors, not used again; `close_range` is
    // there (the caller asked) and each range is valid (its first number no greater than its
    // last), so that it sets no `errno`.
    unsafe {
        let mut from = 0u32;
        for &kept in holder.kept {
            if kept > from {
                libc::close_range(from, kept - 1, 0);
            }
            from = kept.saturating_add(1);
        }
        libc::close_range(from, u32::MAX, 0);
    }
    holder.closed.store(1, std::sync::atomic::Ordering::Release);
    let _ = futex::wake(&holder.closed, futex::Flags::PRIVATE, 1);
    // SAFETY: the pidfd stays open in this process until it exits.
    let pidfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(holder.pidfd) };
    let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
    // (Another error than an interruption ends it at once: the caller's exit, the last, then
    // takes the memory down, as it did without a holder.)
    while let Err(rustix::io::Errno::INTR) = poll(&mut fds, None) {}
    0
}
