//! The first process of a gVisor cell, and its helper for signals to a process group.
//!
//! Built by `build.rs` as a static binary (it must run in any root: the host's directories or an
//! image without the host's C library) and bound read-only into every gVisor cell at
//! `/.warden/init`. It holds no power over the cell: the warden controls the sandbox from
//! outside (runsc, the cgroup); this process only keeps the container alive.
//!
//! - no arguments: pid 1 of the sandbox's container, which starts the cell's processes. Its
//!   stdin is the host side's socket (`SOCK_SEQPACKET`, a descriptor of the host): each request
//!   is one message, a process to start with its stdin, stdout and stderr passed along
//!   (SCM_RIGHTS), or a signal for a process group; it answers with the process's pid (or the
//!   errno of its failure) and, when it reaps it, its wait status. It says `h` on the socket
//!   once it serves, then `ready` on its stdout (a pipe the keeper reads: the cell is up), and
//!   answers `p` with `p` (a restored init, past its `h`). It reaps orphans too. Signals
//!   without a handler do nothing to a pid 1, so only SIGKILL from outside ends it; it is not
//!   dumpable, so no process of the cell can trace it or open its descriptors.
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
    fn waitpid(pid: c_int, status: *mut c_int, options: c_int) -> c_int;
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
    fn setsid() -> c_int;
    fn dup2(fd: c_int, target: c_int) -> c_int;
    fn fcntl(fd: c_int, command: c_int, ...) -> c_int;
    fn chdir(path: *const c_char) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn read(fd: c_int, buf: *mut c_void, len: usize) -> isize;
    fn poll(fds: *mut PollFd, count: u64, timeout: c_int) -> c_int;
    fn sigprocmask(how: c_int, set: *const SigSet, old: *mut SigSet) -> c_int;
    fn signalfd(fd: c_int, set: *const SigSet, flags: c_int) -> c_int;
    fn prctl(option: c_int, ...) -> c_int;
    fn recvmsg(socket: c_int, message: *mut MsgHdr, flags: c_int) -> isize;
    fn send(socket: c_int, buf: *const c_void, len: usize, flags: c_int) -> isize;
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
const EINTR: c_int = 4;
const EINVAL: c_int = 22;
const WNOHANG: c_int = 1;
const F_SETFD: c_int = 2;
const SIG_BLOCK: c_int = 0;
const SIG_SETMASK: c_int = 2;
const SFD_CLOEXEC: c_int = 0o2000000;
const SFD_NONBLOCK: c_int = 0o4000;
const PR_SET_DUMPABLE: c_int = 4;
const POLLIN: i16 = 1;
const MSG_CMSG_CLOEXEC: c_int = 0x4000_0000;
const MSG_NOSIGNAL: c_int = 0x4000;
const MSG_TRUNC: c_int = 0x20;
const MSG_CTRUNC: c_int = 0x8;
const SOL_SOCKET: c_int = 1;
const SCM_RIGHTS: c_int = 1;

/// The C library's `sigset_t` (1,024 bits).
#[repr(C)]
struct SigSet([u64; 16]);

#[repr(C)]
struct PollFd {
    fd: c_int,
    events: i16,
    revents: i16,
}

#[repr(C)]
struct IoVec {
    base: *mut c_void,
    len: usize,
}

#[repr(C)]
struct MsgHdr {
    name: *mut c_void,
    name_len: u32,
    iov: *mut IoVec,
    iov_len: usize,
    control: *mut c_void,
    control_len: usize,
    flags: c_int,
}

/// The header of a control message (`struct cmsghdr`), followed by its data.
#[repr(C)]
struct CmsgHdr {
    len: usize,
    level: c_int,
    kind: c_int,
}

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

/// The errno of the last failed call.
fn errno() -> c_int {
    // SAFETY: reads this thread's errno.
    unsafe { *__errno_location() }
}

/// What a process to start needs, prepared before the clone (the child allocates nothing): the
/// paths to try in order (the program, or each PATH entry joined with it), the argument and
/// environment vectors, its stdio (the init's own when `None`), its directory, whether it leads
/// a session of its own (an exec) or only a process group (`run`'s command), and where the
/// child leaves the errno of its failure.
struct Start {
    candidates: Vec<CString>,
    argv: Vec<*const c_char>,
    env: *const *const c_char,
    stdio: Option<[c_int; 3]>,
    cwd: Option<CString>,
    session: bool,
    failed: AtomicI32,
}

/// The child of the clone: its session or process group, its stdio and directory, every signal
/// unblocked, then the first candidate that executes. It runs on its own stack in the init's
/// memory (`CLONE_VM | CLONE_VFORK`: the init waits until it execs or exits) and makes only
/// async-signal-safe calls.
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Start` the init keeps alive, unchanged, until this child has exec'd
    // or exited; its only write is the atomic `failed`.
    let start = unsafe { &*(arg as *const Start) };
    let fail = |errno: c_int| -> ! {
        start.failed.store(errno.max(1), Ordering::SeqCst);
        // SAFETY: ends this child without touching the memory it shares.
        unsafe { _exit(127) }
    };
    // SAFETY: plain system calls on valid descriptors, NUL-terminated strings and pointer
    // arrays.
    unsafe {
        if start.session {
            setsid();
        } else {
            setpgid(0, 0);
        }
        if let Some(fds) = start.stdio {
            for (target, fd) in (0..).zip(fds) {
                // A descriptor already in its place keeps it, without close-on-exec.
                let placed = if fd == target {
                    fcntl(fd, F_SETFD, 0)
                } else {
                    dup2(fd, target)
                };
                if placed < 0 {
                    fail(errno());
                }
            }
        }
        if let Some(cwd) = &start.cwd
            && chdir(cwd.as_ptr()) != 0
        {
            fail(errno());
        }
        let none = SigSet([0; 16]);
        sigprocmask(SIG_SETMASK, &none, std::ptr::null_mut());
        let mut last = ENOENT;
        let mut denied = false;
        for path in &start.candidates {
            execve(path.as_ptr(), start.argv.as_ptr(), start.env);
            last = errno();
            denied |= last == EACCES;
        }
        fail(if denied { EACCES } else { last })
    }
}

/// The paths `program` is tried at: itself when it names a path, else each entry of `search`
/// (a PATH; an empty entry is the working directory).
fn candidates(program: &[u8], search: &[u8]) -> Vec<CString> {
    let path = |bytes: Vec<u8>| CString::new(bytes).ok();
    if program.contains(&b'/') {
        return path(program.to_vec()).into_iter().collect();
    }
    search
        .split(|&b| b == b':')
        .filter_map(|dir| match dir {
            [] => path(program.to_vec()),
            dir => path([dir, b"/", program].concat()),
        })
        .collect()
}

/// The PATH of this process's environment, or the usual one.
fn own_path() -> Vec<u8> {
    std::env::var_os("PATH")
        .unwrap_or_else(|| OsString::from("/usr/local/bin:/usr/bin:/bin"))
        .into_vec()
}

/// Starts a process as `start` says; its pid, or the errno of its failure. A clone with
/// `CLONE_VM | CLONE_VFORK` (what `posix_spawn` does, without its reset of every signal's
/// disposition, one system call each: this init ignores none, and its only handlers, `run`'s,
/// are installed after its command starts and reset by any exec).
fn spawn(start: &Start) -> Result<c_int, c_int> {
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
            start as *const Start as *mut c_void,
        )
    };
    if pid < 0 {
        return Err(errno());
    }
    match start.failed.load(Ordering::SeqCst) {
        0 => Ok(pid),
        errno => {
            let mut status = 0;
            // SAFETY: waitpid(2) writes one int through a valid pointer; the child has exited.
            unsafe { waitpid(pid, &mut status, 0) };
            Err(errno)
        }
    }
}

/// A pointer array for `execve`, ending in null.
fn pointers(strings: &[CString]) -> Vec<*const c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// Sends one message on the host side's socket (a host side that went away is not waited for).
fn say(text: &[u8]) {
    // SAFETY: send(2) reads `text.len()` bytes of a live slice.
    unsafe { send(0, text.as_ptr().cast(), text.len(), MSG_NOSIGNAL) };
}

/// One message from the host side: its bytes and the descriptors that came with it (close on
/// exec). `None` once the socket closed or failed.
fn receive(buf: &mut [u8]) -> Option<(usize, Vec<c_int>)> {
    let mut control = [0u64; 8];
    let mut iov = IoVec {
        base: buf.as_mut_ptr().cast(),
        len: buf.len(),
    };
    let mut message = MsgHdr {
        name: std::ptr::null_mut(),
        name_len: 0,
        iov: &mut iov,
        iov_len: 1,
        control: control.as_mut_ptr().cast(),
        control_len: std::mem::size_of_val(&control),
        flags: 0,
    };
    let n = loop {
        // SAFETY: every pointer in `message` points at live buffers of the lengths given.
        let n = unsafe { recvmsg(0, &mut message, MSG_CMSG_CLOEXEC) };
        if n >= 0 || errno() != EINTR {
            break n;
        }
    };
    let n = usize::try_from(n).ok().filter(|&n| n > 0)?;
    let mut fds = Vec::new();
    let header = std::mem::size_of::<CmsgHdr>();
    if message.control_len >= header {
        // SAFETY: the kernel wrote at least one header at the start of `control`, which is
        // aligned for it; its data follows within `control_len` bytes.
        unsafe {
            let cmsg = &*(control.as_ptr() as *const CmsgHdr);
            if cmsg.level == SOL_SOCKET && cmsg.kind == SCM_RIGHTS {
                let count = (cmsg.len.min(message.control_len) - header) / 4;
                let data = (control.as_ptr() as *const u8).add(header) as *const c_int;
                fds.extend((0..count).map(|i| *data.add(i)));
            }
        }
    }
    if message.flags & (MSG_TRUNC | MSG_CTRUNC) != 0 {
        for fd in fds.drain(..) {
            // SAFETY: closes a descriptor that came with a message too large to take.
            unsafe { close(fd) };
        }
        return Some((0, fds));
    }
    Some((n, fds))
}

/// Starts the process a request describes (`token`, directory, argument count, the arguments
/// and the environment, NUL-separated) with `fds` as its stdin, stdout and stderr; what the
/// host side is told.
fn exec_request(fields: &[&[u8]], fds: &[c_int]) -> Result<(Vec<u8>, c_int), (Vec<u8>, c_int)> {
    let token = fields.first().copied().unwrap_or_default().to_vec();
    let parsed = (|| {
        let stdio: [c_int; 3] = fds.try_into().ok()?;
        let cwd = CString::new(*fields.get(1)?).ok()?;
        let argc: usize = std::str::from_utf8(fields.get(2)?).ok()?.parse().ok()?;
        let argv: Vec<CString> = fields
            .get(3..3 + argc)?
            .iter()
            .map(|a| CString::new(*a).ok())
            .collect::<Option<_>>()?;
        let env: Vec<CString> = fields[3 + argc..]
            .iter()
            .map(|e| CString::new(*e).ok())
            .collect::<Option<_>>()?;
        Some((stdio, cwd, argv, env))
    })();
    let Some((stdio, cwd, argv, env)) = parsed else {
        return Err((token, EINVAL));
    };
    let Some(program) = argv.first() else {
        return Err((token, ENOENT));
    };
    let search = env
        .iter()
        .rev()
        .find_map(|e| e.as_bytes().strip_prefix(b"PATH="))
        .map_or_else(|| b"/bin:/usr/bin".to_vec(), <[u8]>::to_vec);
    let env_pointers = pointers(&env);
    let start = Start {
        candidates: candidates(program.as_bytes(), &search),
        argv: pointers(&argv),
        env: env_pointers.as_ptr(),
        stdio: Some(stdio),
        cwd: Some(cwd),
        session: true,
        failed: AtomicI32::new(0),
    };
    match spawn(&start) {
        Ok(pid) => Ok((token, pid)),
        Err(errno) => Err((token, errno)),
    }
}

/// Serves the host side's requests on stdin and reaps every child, for ever (see the top).
fn serve() -> ! {
    // SAFETY: plain system calls with valid pointers.
    let signals = unsafe {
        prctl(PR_SET_DUMPABLE, 0 as std::ffi::c_ulong);
        let mut chld = SigSet([0; 16]);
        chld.0[0] = 1 << (SIGCHLD - 1);
        sigprocmask(SIG_BLOCK, &chld, std::ptr::null_mut());
        signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK)
    };
    let mut serving = signals >= 0;
    if serving {
        say(b"h");
    }
    let _ = std::io::stdout().write_all(b"ready\n");
    let _ = std::io::stdout().flush();
    if !serving {
        reap_forever();
    }
    let mut started: Vec<c_int> = Vec::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let mut fds = [
            PollFd {
                fd: signals,
                events: POLLIN,
                revents: 0,
            },
            PollFd {
                fd: if serving { 0 } else { -1 },
                events: POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll(2) on an array of two live entries.
        if unsafe { poll(fds.as_mut_ptr(), 2, -1) } < 0 {
            continue;
        }
        if fds[0].revents != 0 {
            let mut drained = [0u8; 128];
            // SAFETY: reads into a live buffer of its length (the signalfd does not block).
            while unsafe { read(signals, drained.as_mut_ptr().cast(), drained.len()) } > 0 {}
            loop {
                let mut status = 0;
                // SAFETY: waitpid(2) writes one int through a valid pointer.
                let reaped = unsafe { waitpid(-1, &mut status, WNOHANG) };
                if reaped <= 0 {
                    break;
                }
                if let Some(at) = started.iter().position(|&p| p == reaped) {
                    started.swap_remove(at);
                    say(format!("e {reaped} {status}").as_bytes());
                }
            }
        }
        if fds[1].revents == 0 {
            continue;
        }
        let Some((n, received)) = receive(&mut buf) else {
            // The host side is gone (the sandbox goes with its keeper): only reap from now on.
            serving = false;
            continue;
        };
        let fields: Vec<&[u8]> = buf[..n].split(|&b| b == 0).collect();
        match fields.first().copied() {
            Some(b"x") => match exec_request(&fields[1..], &received) {
                Ok((token, pid)) => {
                    started.push(pid);
                    say(&[b"s ", &token[..], format!(" {pid}").as_bytes()].concat());
                }
                Err((token, errno)) => {
                    say(&[b"f ", &token[..], format!(" {errno}").as_bytes()].concat());
                }
            },
            Some(b"k") => {
                let number = |i: usize| {
                    fields
                        .get(i)
                        .and_then(|f| std::str::from_utf8(f).ok())
                        .and_then(|f| f.parse::<c_int>().ok())
                };
                if let (Some(signal), Some(group)) = (number(1), number(2))
                    && group > 1
                {
                    // SAFETY: kill(2) with plain integers.
                    unsafe { kill(-group, signal) };
                }
            }
            Some(b"p") => say(b"p"),
            _ => {}
        }
        for fd in received {
            // SAFETY: the descriptors that came with the message are this process's; the
            // started process has its own copies.
            unsafe { close(fd) };
        }
    }
}

/// Reaps orphans for ever.
fn reap_forever() -> ! {
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

/// Runs one command as described above; never returns.
fn run(argv: &[CString]) -> ! {
    let _ = std::io::stdout().write_all(b"ready\n");
    let _ = std::io::stdout().flush();
    if argv.is_empty() {
        eprintln!("warden: no command");
        std::process::exit(126);
    }
    let start = Start {
        candidates: candidates(argv[0].as_bytes(), &own_path()),
        argv: pointers(argv),
        // SAFETY: the C library's environment, unchanged by this process.
        env: unsafe { environ },
        stdio: None,
        cwd: None,
        session: false,
        failed: AtomicI32::new(0),
    };
    let pid = match spawn(&start) {
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
    serve()
}
