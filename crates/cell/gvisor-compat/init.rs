//! The first process of a gVisor cell, and its helper for signals to a process group.
//!
//! Built by `build.rs` as a static binary without a C library (it must run in any root: the
//! host's directories or an image without the host's C library). It is bound read-only into
//! every gVisor cell at `/.warden/init`. It holds no power over the cell: the warden controls
//! the sandbox from outside (runsc, the cgroup); this process only keeps the container alive.
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
//!
//! Why no C library: the static C library's start costs a gVisor sandbox on the ptrace platform
//! about 4-5 ms (its self-relocation's page faults and its CPU-feature probes, each a `cpuid`
//! that gVisor traps and emulates), paid by every cell's start. So this program has its own
//! entry point (`_start`), makes its system calls itself (x86-64 only), allocates nothing (its
//! buffers are static) and is linked at a fixed address (nothing to relocate). Its start is then
//! a handful of page faults.

#![no_std]
#![no_main]

use core::arch::global_asm;
use core::sync::atomic::{AtomicI32, Ordering};

#[cfg(not(target_arch = "x86_64"))]
compile_error!("the gVisor tier's init makes its own system calls: x86-64 only");

mod sys {
    //! The system calls this program makes, each a `syscall` instruction; a failure comes back
    //! as `Err(errno)`.

    use core::arch::asm;

    pub const READ: usize = 0;
    pub const WRITE: usize = 1;
    pub const CLOSE: usize = 3;
    pub const POLL: usize = 7;
    pub const RT_SIGACTION: usize = 13;
    pub const RT_SIGPROCMASK: usize = 14;
    pub const DUP2: usize = 33;
    pub const PAUSE: usize = 34;
    pub const NANOSLEEP: usize = 35;
    pub const GETPID: usize = 39;
    pub const SENDTO: usize = 44;
    pub const RECVMSG: usize = 47;
    pub const EXECVE: usize = 59;
    pub const EXIT: usize = 60;
    pub const WAIT4: usize = 61;
    pub const KILL: usize = 62;
    pub const FCNTL: usize = 72;
    pub const CHDIR: usize = 80;
    pub const SETPGID: usize = 109;
    pub const SETSID: usize = 112;
    pub const PRCTL: usize = 157;
    pub const GETDENTS64: usize = 217;
    pub const EXIT_GROUP: usize = 231;
    pub const OPENAT: usize = 257;
    pub const READLINKAT: usize = 267;
    pub const SIGNALFD4: usize = 289;

    /// A system call with up to six arguments.
    ///
    /// # Safety
    /// The arguments must be what system call `number` takes (pointers to live memory of the
    /// sizes it reads or writes).
    pub unsafe fn call(number: usize, args: [usize; 6]) -> Result<usize, i32> {
        let ret: isize;
        // SAFETY: the caller's word; `syscall` clobbers rcx and r11 only.
        unsafe {
            asm!(
                "syscall",
                inlateout("rax") number as isize => ret,
                in("rdi") args[0],
                in("rsi") args[1],
                in("rdx") args[2],
                in("r10") args[3],
                in("r8") args[4],
                in("r9") args[5],
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        if (-4095..0).contains(&ret) {
            Err(-ret as i32)
        } else {
            Ok(ret as usize)
        }
    }

    /// A system call with plain-integer arguments, that touches no memory of this process.
    pub fn plain(number: usize, args: [usize; 6]) -> Result<usize, i32> {
        // SAFETY: only used for calls whose arguments are all integers (kill, close, setsid,
        // setpgid, dup2, fcntl's F_SETFD, prctl's PR_SET_DUMPABLE, exit, pause).
        unsafe { call(number, args) }
    }

    /// Ends this process with `code`.
    pub fn exit_group(code: i32) -> ! {
        let _ = plain(EXIT_GROUP, [code as usize, 0, 0, 0, 0, 0]);
        loop {}
    }
}

const CLONE_VM: usize = 0x100;
const CLONE_VFORK: usize = 0x4000;
const SIGCHLD: i32 = 17;
const ENOENT: i32 = 2;
const EACCES: i32 = 13;
const EINTR: i32 = 4;
const EINVAL: i32 = 22;
const ENAMETOOLONG: i32 = 36;
const WNOHANG: usize = 1;
const F_SETFD: usize = 2;
const SIG_BLOCK: usize = 0;
const SIG_SETMASK: usize = 2;
const SFD_CLOEXEC: usize = 0o2000000;
const SFD_NONBLOCK: usize = 0o4000;
const PR_SET_DUMPABLE: usize = 4;
const POLLIN: i16 = 1;
const MSG_CMSG_CLOEXEC: usize = 0x4000_0000;
const MSG_NOSIGNAL: usize = 0x4000;
const MSG_TRUNC: i32 = 0x20;
const MSG_CTRUNC: i32 = 0x8;
const SOL_SOCKET: i32 = 1;
const SCM_RIGHTS: i32 = 1;
const SA_RESTORER: u64 = 0x0400_0000;
const SA_RESTART: u64 = 0x1000_0000;
const AT_FDCWD: usize = -100isize as usize;
const O_DIRECTORY_CLOEXEC: usize = 0o200000 | 0o2000000;

/// The largest request the host side sends is 60,000 bytes (`host.rs`); one byte more is room
/// for the NUL that ends its last field.
const REQUEST_MAX: usize = 64 * 1024;
/// Fields of a request: at most one per byte, and one more.
const FIELDS_MAX: usize = REQUEST_MAX + 2;
/// Process ids in a pid namespace stay below 2^22 (the kernel's PID_MAX_LIMIT).
const PIDS: usize = 1 << 22;

#[repr(C)]
struct PollFd {
    fd: i32,
    events: i16,
    revents: i16,
}

#[repr(C)]
struct IoVec {
    base: *mut u8,
    len: usize,
}

#[repr(C)]
struct MsgHdr {
    name: *mut u8,
    name_len: u32,
    iov: *mut IoVec,
    iov_len: usize,
    control: *mut u8,
    control_len: usize,
    flags: i32,
}

/// The header of a control message (`struct cmsghdr`), followed by its data.
#[repr(C)]
struct CmsgHdr {
    len: usize,
    level: i32,
    kind: i32,
}

/// The kernel's `struct sigaction` (x86-64).
#[repr(C)]
struct SigAction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// A set of process ids, one bit each (static, so only the pages of the ids used are ever
/// touched).
struct PidSet([u64; PIDS / 64]);

impl PidSet {
    fn slot(pid: i32) -> Option<(usize, u64)> {
        let pid = usize::try_from(pid).ok().filter(|&p| p < PIDS)?;
        Some((pid / 64, 1 << (pid % 64)))
    }

    fn insert(&mut self, pid: i32) -> bool {
        let Some((word, bit)) = Self::slot(pid) else {
            return false;
        };
        let fresh = self.0[word] & bit == 0;
        self.0[word] |= bit;
        fresh
    }

    /// Whether `pid` was in the set (it no longer is).
    fn remove(&mut self, pid: i32) -> bool {
        let Some((word, bit)) = Self::slot(pid) else {
            return false;
        };
        let was = self.0[word] & bit != 0;
        self.0[word] &= !bit;
        was
    }
}

/// This program's memory, static (it allocates nothing). One thread uses it: while a clone
/// runs, the init is suspended, and the child writes only its own stack and `Start::failed`.
/// A request from the host side, and the NUL after it.
static mut REQUEST: [u8; REQUEST_MAX + 1] = [0; REQUEST_MAX + 1];
/// Where each field of the request starts.
static mut FIELDS: [*const u8; FIELDS_MAX] = [core::ptr::null(); FIELDS_MAX];
/// A process's argument and environment vectors, each ending in null.
static mut VECTORS: [*const u8; FIELDS_MAX + 2] = [core::ptr::null(); FIELDS_MAX + 2];
/// The processes started for the host side and not reaped yet.
static mut STARTED: PidSet = PidSet([0; PIDS / 64]);
/// The processes `release` ended.
static mut ENDED: PidSet = PidSet([0; PIDS / 64]);
/// The stack of the clone that becomes a new process.
static mut CHILD_STACK: ChildStack = ChildStack([0; 64 * 1024]);

#[repr(C, align(16))]
struct ChildStack([u8; 64 * 1024]);

// The entry point: the kernel leaves argc, the argument vector and the environment on the
// stack. `start` gets a pointer to them, on a stack aligned as the ABI wants.
global_asm!(
    ".globl _start",
    "_start:",
    "xor ebp, ebp",
    "mov rdi, rsp",
    "and rsp, -16",
    "call {start}",
    "ud2",
    start = sym start,
);

// `clone(CLONE_VM | CLONE_VFORK | SIGCHLD)` onto a stack of its own, the child running
// `child(start)`: rdi flags, rsi the stack's top, rdx `child`, rcx its argument. The child gets
// the registers as they are, so it finds `child` and its argument in r12 and r13 (saved for the
// caller and put back once the child has exec'd or exited). Returns the pid, or -errno.
global_asm!(
    ".globl warden_spawn",
    "warden_spawn:",
    "push r12",
    "push r13",
    "mov r12, rdx",
    "mov r13, rcx",
    "xor edx, edx",
    "xor r10d, r10d",
    "xor r8d, r8d",
    "mov eax, 56",
    "syscall",
    "test rax, rax",
    "jnz 2f",
    "mov rdi, r13",
    "call r12",
    "mov edi, 127",
    "mov eax, 60",
    "syscall",
    "ud2",
    "2:",
    "pop r13",
    "pop r12",
    "ret",
    // A signal handler's return: rt_sigreturn.
    ".globl warden_restore",
    "warden_restore:",
    "mov eax, 15",
    "syscall",
    "ud2",
);

unsafe extern "C" {
    fn warden_spawn(
        flags: usize,
        stack_top: *mut u8,
        child: extern "C" fn(*const u8) -> i32,
        start: *const u8,
    ) -> isize;
    fn warden_restore();
}

/// What the compiler's code may call for copies and fills (there is no C library to have
/// them). Written with string instructions, so that they cannot be compiled into calls of
/// themselves.
mod mem {
    use core::arch::asm;

    /// # Safety
    /// As C's `memcpy`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
        // SAFETY: the caller's ranges.
        unsafe {
            asm!("rep movsb", inout("rdi") dest => _, inout("rsi") src => _,
                 inout("rcx") n => _, options(nostack, preserves_flags));
        }
        dest
    }

    /// # Safety
    /// As C's `memmove`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
        if (dest as usize) <= (src as usize) || (dest as usize) >= (src as usize) + n {
            // SAFETY: a forward copy is right when the destination starts before the source
            // or after its end.
            return unsafe { memcpy(dest, src, n) };
        }
        // SAFETY: the caller's ranges, copied from the end down.
        unsafe {
            asm!("std", "rep movsb", "cld",
                 inout("rdi") dest.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
                 inout("rcx") n => _, options(nostack));
        }
        dest
    }

    /// # Safety
    /// As C's `memset`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memset(dest: *mut u8, c: i32, n: usize) -> *mut u8 {
        // SAFETY: the caller's range.
        unsafe {
            asm!("rep stosb", inout("rdi") dest => _, inout("rcx") n => _, in("al") c as u8,
                 options(nostack, preserves_flags));
        }
        dest
    }

    /// # Safety
    /// As C's `memcmp`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
        let mut i = 0;
        while i < n {
            // SAFETY: the caller's ranges; volatile reads keep this loop a loop.
            let (x, y) = unsafe {
                (
                    core::ptr::read_volatile(a.add(i)),
                    core::ptr::read_volatile(b.add(i)),
                )
            };
            if x != y {
                return i32::from(x) - i32::from(y);
            }
            i += 1;
        }
        0
    }

    /// # Safety
    /// As C's `strlen`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn strlen(s: *const u8) -> usize {
        let mut n = 0;
        // SAFETY: the caller's string, read up to its NUL; volatile reads keep this loop a loop.
        while unsafe { core::ptr::read_volatile(s.add(n)) } != 0 {
            n += 1;
        }
        n
    }

    /// # Safety
    /// As C's `bcmp`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
        // SAFETY: the caller's ranges.
        unsafe { memcmp(a, b, n) }
    }
}

/// The precompiled `core` names an unwinding personality; nothing unwinds here (panics abort),
/// so it is never called.
#[unsafe(no_mangle)]
pub extern "C" fn rust_eh_personality() {}

#[panic_handler]
fn panicked(_: &core::panic::PanicInfo) -> ! {
    write_all(2, b"warden: the cell's init failed\n");
    sys::exit_group(125)
}

/// Writes all of `bytes` to `fd` (what does not go is dropped: nobody reads any more).
fn write_all(fd: i32, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: write(2) reads `bytes.len()` bytes of a live slice.
        match unsafe {
            sys::call(
                sys::WRITE,
                [fd as usize, bytes.as_ptr() as usize, bytes.len(), 0, 0, 0],
            )
        } {
            Ok(0) => return,
            Ok(n) => bytes = &bytes[n..],
            Err(EINTR) => {}
            Err(_) => return,
        }
    }
}

/// Text of up to a few numbers, built without allocating.
struct Line {
    bytes: [u8; 96],
    len: usize,
}

impl Line {
    fn new() -> Self {
        Self {
            bytes: [0; 96],
            len: 0,
        }
    }

    fn text(mut self, text: &[u8]) -> Self {
        let n = text.len().min(self.bytes.len() - self.len);
        self.bytes[self.len..self.len + n].copy_from_slice(&text[..n]);
        self.len += n;
        self
    }

    fn number(self, value: i64) -> Self {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut rest = value.unsigned_abs();
        loop {
            at -= 1;
            digits[at] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        let line = if value < 0 { self.text(b"-") } else { self };
        line.text(&digits[at..])
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// A decimal number (an optional sign, then digits).
fn parse(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        rest => (false, rest),
    };
    if digits.is_empty() || digits.len() > 18 {
        return None;
    }
    let mut value: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value * 10 + i64::from(d - b'0');
    }
    Some(if negative { -value } else { value })
}

/// The bytes of the NUL-terminated string at `p`.
///
/// # Safety
/// `p` points at a NUL-terminated string that lives as long as the result is used.
unsafe fn c_bytes<'a>(p: *const u8) -> &'a [u8] {
    // SAFETY: the caller's word.
    unsafe { core::slice::from_raw_parts(p, mem::strlen(p)) }
}

/// A null-terminated vector of C strings (argv, envp) as a slice, without its null.
///
/// # Safety
/// `v` points at such a vector, alive while the result is used.
unsafe fn vector<'a>(v: *const *const u8) -> &'a [*const u8] {
    let mut n = 0;
    // SAFETY: the caller's word: the vector ends in null.
    while !unsafe { *v.add(n) }.is_null() {
        n += 1;
    }
    // SAFETY: `n` entries were just read.
    unsafe { core::slice::from_raw_parts(v, n) }
}

/// The value of variable `name` in an environment vector (its last setting).
fn variable<'a>(env: &[*const u8], name: &[u8]) -> Option<&'a [u8]> {
    env.iter().rev().find_map(|&e| {
        // SAFETY: the environment's strings are NUL-terminated and live for the process.
        let entry = unsafe { c_bytes(e) };
        entry
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(b"="))
    })
}

/// The command's process group, for the signal handler.
static GROUP: AtomicI32 = AtomicI32::new(0);

/// Passes a signal on to the command's group (async-signal-safe: an atomic load and kill).
extern "C" fn forward(sig: i32) {
    let group = GROUP.load(Ordering::Relaxed);
    if group > 1 {
        let _ = sys::plain(sys::KILL, [(-group) as usize, sig as usize, 0, 0, 0, 0]);
    }
}

/// What a process to start needs, prepared before the clone (the child allocates nothing):
/// the program and the PATH to look it up in (`None`: it names a path), the argument and
/// environment vectors, its stdio (the init's own when `None`), its directory, whether it leads
/// a session of its own (an exec) or only a process group (`run`'s command), and where the
/// child leaves the errno of its failure.
struct Start<'a> {
    program: &'a [u8],
    search: Option<&'a [u8]>,
    argv: *const *const u8,
    env: *const *const u8,
    stdio: Option<[i32; 3]>,
    cwd: Option<*const u8>,
    session: bool,
    failed: AtomicI32,
}

/// Tries to execute `parts` joined (a path built on the child's stack); the errno of the
/// failure.
fn try_exec(start: &Start, parts: &[&[u8]]) -> i32 {
    let mut path = [0u8; 4096];
    let mut len = 0;
    for part in parts {
        if len + part.len() >= path.len() {
            return ENAMETOOLONG;
        }
        path[len..len + part.len()].copy_from_slice(part);
        len += part.len();
    }
    path[len] = 0;
    // SAFETY: execve(2) with a NUL-terminated path and the null-terminated vectors of `start`.
    match unsafe {
        sys::call(
            sys::EXECVE,
            [
                path.as_ptr() as usize,
                start.argv as usize,
                start.env as usize,
                0,
                0,
                0,
            ],
        )
    } {
        Err(errno) => errno,
        Ok(_) => EINVAL,
    }
}

/// The child of the clone: its session or process group, its stdio and directory, every signal
/// unblocked, then the first candidate path that executes (the program, or each PATH entry
/// joined with it; an empty entry is the working directory). It runs on its own stack in the
/// init's memory (`CLONE_VM | CLONE_VFORK`: the init waits until it execs or exits), and writes
/// only its stack and `failed`.
extern "C" fn child(start: *const u8) -> i32 {
    // SAFETY: `start` is the `Start` the init keeps alive, unchanged, until this child has
    // exec'd or exited.
    let start = unsafe { &*(start as *const Start) };
    let fail = |errno: i32| -> ! {
        start.failed.store(errno.max(1), Ordering::SeqCst);
        let _ = sys::plain(sys::EXIT, [127, 0, 0, 0, 0, 0]);
        loop {}
    };
    let _ = if start.session {
        sys::plain(sys::SETSID, [0; 6])
    } else {
        sys::plain(sys::SETPGID, [0; 6])
    };
    if let Some(fds) = start.stdio {
        for (target, fd) in (0..).zip(fds) {
            // A descriptor already in its place keeps it, without close-on-exec.
            let placed = if fd == target {
                sys::plain(sys::FCNTL, [fd as usize, F_SETFD, 0, 0, 0, 0])
            } else {
                sys::plain(sys::DUP2, [fd as usize, target as usize, 0, 0, 0, 0])
            };
            if let Err(errno) = placed {
                fail(errno);
            }
        }
    }
    if let Some(cwd) = start.cwd {
        // SAFETY: chdir(2) with a NUL-terminated path.
        if let Err(errno) = unsafe { sys::call(sys::CHDIR, [cwd as usize, 0, 0, 0, 0, 0]) } {
            fail(errno);
        }
    }
    let none: u64 = 0;
    // SAFETY: rt_sigprocmask(2) reads one 8-byte set.
    let _ = unsafe {
        sys::call(
            sys::RT_SIGPROCMASK,
            [SIG_SETMASK, &raw const none as usize, 0, 8, 0, 0],
        )
    };
    let Some(search) = start.search else {
        fail(try_exec(start, &[start.program]));
    };
    let mut last = ENOENT;
    let mut denied = false;
    for dir in search.split(|&b| b == b':') {
        last = match dir {
            [] => try_exec(start, &[start.program]),
            dir => try_exec(start, &[dir, b"/", start.program]),
        };
        denied |= last == EACCES;
    }
    fail(if denied { EACCES } else { last })
}

/// Starts a process as `start` says; its pid, or the errno of its failure. A clone with
/// `CLONE_VM | CLONE_VFORK` (what `posix_spawn` does, without its reset of every signal's
/// disposition, one system call each: this init ignores none, and its only handlers, `run`'s,
/// are installed after its command starts and reset by any exec).
fn spawn(start: &Start) -> Result<i32, i32> {
    let stack = &raw mut CHILD_STACK;
    // SAFETY: the child runs on the static stack (its top is 16-byte aligned) and reads
    // `start`, both alive until the clone returns: CLONE_VFORK suspends this thread until the
    // child has exec'd or exited, and no other clone runs meanwhile.
    let pid = unsafe {
        let top = (stack as *mut u8).add(core::mem::size_of::<ChildStack>());
        warden_spawn(
            CLONE_VM | CLONE_VFORK | SIGCHLD as usize,
            top,
            child,
            start as *const Start as *const u8,
        )
    };
    if pid < 0 {
        return Err(-pid as i32);
    }
    let pid = pid as i32;
    match start.failed.load(Ordering::SeqCst) {
        0 => Ok(pid),
        errno => {
            let _ = wait(pid, 0);
            Err(errno)
        }
    }
}

/// wait4(2) for `pid` (-1: any child): the pid reaped (0 with WNOHANG and none) and its status.
fn wait(pid: i32, options: usize) -> Result<(i32, i32), i32> {
    let mut status: i32 = 0;
    // SAFETY: wait4(2) writes one int through a valid pointer.
    let reaped = unsafe {
        sys::call(
            sys::WAIT4,
            [pid as usize, &raw mut status as usize, options, 0, 0, 0],
        )
    }?;
    Ok((reaped as i32, status))
}

/// Sends one message on the host side's socket (a host side that went away is not waited for).
fn say(text: &[u8]) {
    // SAFETY: sendto(2) reads `text.len()` bytes of a live slice; no address.
    let _ = unsafe {
        sys::call(
            sys::SENDTO,
            [0, text.as_ptr() as usize, text.len(), MSG_NOSIGNAL, 0, 0],
        )
    };
}

/// One message from the host side, into `buf`: its length and the descriptors that came with
/// it (close on exec; at most 8, the rest closed). `None` once the socket closed or failed. A
/// message too large to take is dropped, its descriptors closed (length 0).
fn receive(buf: &mut [u8]) -> Option<(usize, [i32; 8], usize)> {
    let mut control = [0u64; 8];
    let mut iov = IoVec {
        base: buf.as_mut_ptr(),
        len: buf.len(),
    };
    let mut message = MsgHdr {
        name: core::ptr::null_mut(),
        name_len: 0,
        iov: &mut iov,
        iov_len: 1,
        control: control.as_mut_ptr().cast(),
        control_len: core::mem::size_of_val(&control),
        flags: 0,
    };
    let n = loop {
        // SAFETY: every pointer in `message` points at live buffers of the lengths given.
        match unsafe {
            sys::call(
                sys::RECVMSG,
                [0, &raw mut message as usize, MSG_CMSG_CLOEXEC, 0, 0, 0],
            )
        } {
            Err(EINTR) => {}
            Err(_) | Ok(0) => return None,
            Ok(n) => break n,
        }
    };
    let mut fds = [-1i32; 8];
    let mut count = 0;
    let header = core::mem::size_of::<CmsgHdr>();
    if message.control_len >= header {
        // SAFETY: the kernel wrote at least one header at the start of `control`, which is
        // aligned for it; its data follows within `control_len` bytes.
        unsafe {
            let cmsg = &*(control.as_ptr() as *const CmsgHdr);
            if cmsg.level == SOL_SOCKET && cmsg.kind == SCM_RIGHTS {
                let given = cmsg.len.min(message.control_len).saturating_sub(header) / 4;
                let data = (control.as_ptr() as *const u8).add(header) as *const i32;
                for i in 0..given {
                    let fd = *data.add(i);
                    if count < fds.len() {
                        fds[count] = fd;
                        count += 1;
                    } else {
                        let _ = sys::plain(sys::CLOSE, [fd as usize, 0, 0, 0, 0, 0]);
                    }
                }
            }
        }
    }
    if message.flags & (MSG_TRUNC | MSG_CTRUNC) != 0 {
        close_all(&fds[..count]);
        return Some((0, fds, 0));
    }
    Some((n, fds, count))
}

fn close_all(fds: &[i32]) {
    for &fd in fds {
        let _ = sys::plain(sys::CLOSE, [fd as usize, 0, 0, 0, 0, 0]);
    }
}

/// Starts the process a request describes (`token`, directory, argument count, the arguments
/// and the environment: `fields`, each NUL-terminated in place) with `fds` as its stdin, stdout
/// and stderr; the token and the pid, or the token and the errno of the failure.
fn exec_request<'a>(
    fields: &[*const u8],
    fds: &[i32],
    vectors: &mut [*const u8],
) -> Result<(&'a [u8], i32), (&'a [u8], i32)> {
    // SAFETY: each field is a NUL-terminated string in the request buffer, which lives until
    // the next request.
    let field = |i: usize| fields.get(i).map(|&f| unsafe { c_bytes(f) });
    let token = field(0).unwrap_or_default();
    let parsed = (|| {
        let stdio: [i32; 3] = fds.try_into().ok()?;
        let cwd = *fields.get(1)?;
        let argc = usize::try_from(parse(field(2)?)?).ok()?;
        let argv = fields.get(3..3 + argc)?;
        let env = &fields[3 + argc..];
        Some((stdio, cwd, argv, env))
    })();
    let Some((stdio, cwd, argv, env)) = parsed else {
        return Err((token, EINVAL));
    };
    let Some(&program) = argv.first() else {
        return Err((token, ENOENT));
    };
    // The two vectors, each ending in null, one after the other.
    vectors[..argv.len()].copy_from_slice(argv);
    vectors[argv.len()] = core::ptr::null();
    let env_at = argv.len() + 1;
    vectors[env_at..env_at + env.len()].copy_from_slice(env);
    vectors[env_at + env.len()] = core::ptr::null();
    // SAFETY: a field of the request, NUL-terminated.
    let program = unsafe { c_bytes(program) };
    let search = variable(env, b"PATH").unwrap_or(b"/bin:/usr/bin");
    let start = Start {
        program,
        search: (!program.contains(&b'/')).then_some(search),
        argv: vectors.as_ptr(),
        // SAFETY: within `vectors`.
        env: unsafe { vectors.as_ptr().add(env_at) },
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
    let _ = sys::plain(sys::PRCTL, [PR_SET_DUMPABLE, 0, 0, 0, 0, 0]);
    let chld: u64 = 1 << (SIGCHLD - 1);
    // SAFETY: rt_sigprocmask(2) and signalfd4(2) read one 8-byte set.
    let signals = unsafe {
        let _ = sys::call(
            sys::RT_SIGPROCMASK,
            [SIG_BLOCK, &raw const chld as usize, 0, 8, 0, 0],
        );
        sys::call(
            sys::SIGNALFD4,
            [
                -1isize as usize,
                &raw const chld as usize,
                8,
                SFD_CLOEXEC | SFD_NONBLOCK,
                0,
                0,
            ],
        )
    };
    let Ok(signals) = signals.map(|fd| fd as i32) else {
        write_all(1, b"ready\n");
        reap_forever();
    };
    let mut serving = true;
    say(b"h");
    write_all(1, b"ready\n");
    // SAFETY: this process's only users of these statics (see their comment).
    let (request, fields_at, vectors, started) = unsafe {
        (
            &mut *(&raw mut REQUEST),
            &mut *(&raw mut FIELDS),
            &mut *(&raw mut VECTORS),
            &mut *(&raw mut STARTED),
        )
    };
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
        if unsafe {
            sys::call(
                sys::POLL,
                [fds.as_mut_ptr() as usize, 2, -1isize as usize, 0, 0, 0],
            )
        }
        .is_err()
        {
            continue;
        }
        if fds[0].revents != 0 {
            let mut drained = [0u8; 128];
            // SAFETY: reads into a live buffer of its length (the signalfd does not block).
            while unsafe {
                sys::call(
                    sys::READ,
                    [
                        signals as usize,
                        drained.as_mut_ptr() as usize,
                        drained.len(),
                        0,
                        0,
                        0,
                    ],
                )
            }
            .is_ok_and(|n| n > 0)
            {}
            while let Ok((reaped, status)) = wait(-1, WNOHANG) {
                if reaped <= 0 {
                    break;
                }
                // A pid the set cannot hold (none on Linux, whose pids stay below 2^22) is
                // reported whatever it was: the host side ignores pids it did not start.
                if started.remove(reaped) || PidSet::slot(reaped).is_none() {
                    say(Line::new()
                        .text(b"e ")
                        .number(reaped.into())
                        .text(b" ")
                        .number(status.into())
                        .as_bytes());
                }
            }
        }
        if fds[1].revents == 0 {
            continue;
        }
        let Some((n, received, count)) = receive(&mut request[..REQUEST_MAX]) else {
            // The host side is gone (the sandbox goes with its keeper): only reap from now on.
            serving = false;
            continue;
        };
        let received = &received[..count];
        request[n] = 0;
        // Each field NUL-terminated in place, where it starts noted.
        let mut fields = 0;
        let mut at = 0;
        while fields < FIELDS_MAX {
            fields_at[fields] = request[at..].as_ptr();
            fields += 1;
            match request[at..n].iter().position(|&b| b == 0) {
                Some(end) => at += end + 1,
                None => break,
            }
        }
        let fields = &fields_at[..fields];
        // SAFETY: the first field, NUL-terminated in the buffer.
        let kind = unsafe { c_bytes(fields[0]) };
        match kind {
            b"x" => {
                let (word, token, value): (&[u8], _, i32) =
                    match exec_request(&fields[1..], received, vectors) {
                        Ok((token, pid)) => {
                            started.insert(pid);
                            (b"s ", token, pid)
                        }
                        Err((token, errno)) => (b"f ", token, errno),
                    };
                say(Line::new()
                    .text(word)
                    .text(token)
                    .text(b" ")
                    .number(value.into())
                    .as_bytes());
            }
            b"k" => {
                // SAFETY: fields of the request, NUL-terminated.
                let number = |i: usize| {
                    fields
                        .get(i)
                        .and_then(|&f| parse(unsafe { c_bytes(f) }))
                        .and_then(|v| i32::try_from(v).ok())
                };
                if let (Some(signal), Some(group)) = (number(1), number(2))
                    && group > 1
                {
                    let _ = sys::plain(sys::KILL, [(-group) as usize, signal as usize, 0, 0, 0, 0]);
                }
            }
            b"p" => say(b"p"),
            _ => {}
        }
        // The descriptors that came with the message are this process's; a started process
        // has its own copies.
        close_all(received);
    }
}

/// Reaps orphans for ever.
fn reap_forever() -> ! {
    loop {
        if wait(-1, 0).is_err() {
            // No child now: sleep until a signal (SIGCHLD of an orphan) comes.
            let _ = sys::plain(sys::PAUSE, [0; 6]);
        }
    }
}

/// Runs one command as described above; never returns. `argv` and `env` are tails of the
/// kernel's vectors, so each is followed by the null that ends it: their pointers are what
/// `execve` takes.
fn run(argv: &[*const u8], env: &[*const u8]) -> ! {
    write_all(1, b"ready\n");
    let Some(&program) = argv.first() else {
        write_all(2, b"warden: no command\n");
        sys::exit_group(126);
    };
    // SAFETY: an argument of this process, NUL-terminated.
    let program = unsafe { c_bytes(program) };
    let start = Start {
        program,
        search: (!program.contains(&b'/'))
            .then(|| variable(env, b"PATH").unwrap_or(b"/usr/local/bin:/usr/bin:/bin")),
        argv: argv.as_ptr(),
        env: env.as_ptr(),
        stdio: None,
        cwd: None,
        session: false,
        failed: AtomicI32::new(0),
    };
    let pid = match spawn(&start) {
        Ok(pid) => pid,
        Err(errno) => {
            let (code, why): (i32, &[u8]) = match errno {
                ENOENT => (127, b"command not found"),
                EACCES => (126, b"permission denied"),
                _ => (126, b"cannot execute"),
            };
            write_all(2, b"warden: ");
            write_all(2, why);
            write_all(2, b": ");
            write_all(2, program);
            write_all(2, b"\n");
            sys::exit_group(code);
        }
    };
    GROUP.store(pid, Ordering::Relaxed);
    for sig in [1usize, 2, 3, 10, 12, 15, 28] {
        let action = SigAction {
            handler: forward as extern "C" fn(i32) as usize,
            flags: SA_RESTORER | SA_RESTART,
            restorer: warden_restore as unsafe extern "C" fn() as usize,
            mask: 0,
        };
        // SAFETY: installs `forward`, which is async-signal-safe, for a catchable signal, with
        // the return through rt_sigreturn.
        let _ = unsafe {
            sys::call(
                sys::RT_SIGACTION,
                [sig, &raw const action as usize, 0, 8, 0, 0],
            )
        };
    }
    loop {
        match wait(-1, 0) {
            // The command's exit code, or 128 + the signal that ended it.
            Ok((reaped, status)) if reaped == pid => {
                sys::exit_group(match (status & 0x7f, (status >> 8) & 0xff) {
                    (0, code) => code,
                    (sig, _) => 128 + sig,
                })
            }
            Ok(_) | Err(EINTR) => {}
            Err(_) => sys::exit_group(125),
        }
    }
}

/// Calls `each` with the name of every entry of the directory `path` names (relative to
/// `dir`), but `.` and `..`. False when it cannot be read.
fn each_entry(dir: usize, path: &[u8], each: &mut dyn FnMut(i32, &[u8]) -> bool) -> bool {
    let mut name = [0u8; 64];
    if path.len() >= name.len() {
        return false;
    }
    name[..path.len()].copy_from_slice(path);
    // SAFETY: openat(2) with a NUL-terminated path (the rest of `name` is zero).
    let Ok(fd) = (unsafe {
        sys::call(
            sys::OPENAT,
            [dir, name.as_ptr() as usize, O_DIRECTORY_CLOEXEC, 0, 0, 0],
        )
    }) else {
        return false;
    };
    let fd = fd as i32;
    let mut buf = [0u64; 512];
    'read: loop {
        // SAFETY: getdents64(2) writes at most the buffer's size.
        let n = match unsafe {
            sys::call(
                sys::GETDENTS64,
                [fd as usize, buf.as_mut_ptr() as usize, 4096, 0, 0, 0],
            )
        } {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let bytes = buf.as_ptr() as *const u8;
        let mut at = 0;
        while at + 19 < n {
            // SAFETY: a `linux_dirent64` the kernel wrote: its 2-byte length at 16, its name,
            // NUL-terminated, at 19.
            let (len, entry) = unsafe {
                (
                    usize::from(core::ptr::read_unaligned(bytes.add(at + 16) as *const u16)),
                    c_bytes(bytes.add(at + 19)),
                )
            };
            if len == 0 {
                break;
            }
            if entry != b"." && entry != b".." && !each(fd, entry) {
                break 'read;
            }
            at += len;
        }
    }
    let _ = sys::plain(sys::CLOSE, [fd as usize, 0, 0, 0, 0, 0]);
    true
}

/// Whether process `pid` holds a descriptor of the host.
fn holds_host_fd(pid: &[u8]) -> bool {
    let mut path = Line::new().text(b"/proc/").text(pid).text(b"/fd");
    if path.len >= path.bytes.len() {
        return false;
    }
    path.bytes[path.len] = 0;
    let mut holds = false;
    each_entry(AT_FDCWD, path.as_bytes(), &mut |dir, fd| {
        let mut name = [0u8; 32];
        if fd.len() >= name.len() {
            return true;
        }
        name[..fd.len()].copy_from_slice(fd);
        let mut target = [0u8; 64];
        // SAFETY: readlinkat(2) writes at most the buffer's size; the name is NUL-terminated.
        if let Ok(n) = unsafe {
            sys::call(
                sys::READLINKAT,
                [
                    dir as usize,
                    name.as_ptr() as usize,
                    target.as_mut_ptr() as usize,
                    target.len(),
                    0,
                    0,
                ],
            )
        } {
            holds |= target[..n].starts_with(b"host:[");
        }
        !holds
    });
    holds
}

/// Ends the processes that hold a descriptor of the host, until none is left (or a while has
/// passed); how many were ended.
fn release() -> u64 {
    let me = sys::plain(sys::GETPID, [0; 6]).unwrap_or(0) as i64;
    // SAFETY: this process's only user of it (see its comment).
    let ended_set = unsafe { &mut *(&raw mut ENDED) };
    let mut ended = 0;
    for _ in 0..100 {
        let mut any = false;
        let readable = each_entry(AT_FDCWD, b"/proc", &mut |_, name| {
            let Some(pid) = parse(name).filter(|&p| p > 1 && p != me && name[0] != b'+') else {
                return true;
            };
            if holds_host_fd(name) {
                any = true;
                let _ = sys::plain(sys::KILL, [pid as usize, 9, 0, 0, 0, 0]);
                if ended_set.insert(pid as i32) {
                    ended += 1;
                }
            }
            true
        });
        if !readable || !any {
            break;
        }
        let pause: [i64; 2] = [0, 20_000_000];
        // SAFETY: nanosleep(2) reads one timespec.
        let _ = unsafe { sys::call(sys::NANOSLEEP, [pause.as_ptr() as usize, 0, 0, 0, 0, 0]) };
    }
    ended
}

/// Where the kernel's entry leaves: argc, then the argument vector and the environment, each
/// ending in null.
extern "C" fn start(stack: *const usize) -> ! {
    // SAFETY: the layout the kernel gives a new program.
    let (argv_vector, envp) = unsafe {
        let argc = *stack;
        let argv = stack.add(1) as *const *const u8;
        (argv, argv.add(argc + 1))
    };
    // SAFETY: the kernel's vectors, alive for the whole process.
    let (args, env) = unsafe { (vector(argv_vector), vector(envp)) };
    // SAFETY: this process's arguments, NUL-terminated.
    let word = |i: usize| args.get(i).map(|&a| unsafe { c_bytes(a) });
    if word(1) == Some(b"run") {
        run(&args[2..], env);
    }
    if args.len() == 2 && word(1) == Some(b"release") {
        write_all(
            1,
            Line::new().number(release() as i64).text(b"\n").as_bytes(),
        );
        sys::exit_group(0);
    }
    if args.len() == 4 && word(1) == Some(b"kill") {
        let number = |i: usize| word(i).and_then(parse).and_then(|v| i32::try_from(v).ok());
        let (Some(signal), Some(group)) = (number(2), number(3)) else {
            sys::exit_group(2);
        };
        if group <= 1 {
            sys::exit_group(2);
        }
        let sent = sys::plain(sys::KILL, [(-group) as usize, signal as usize, 0, 0, 0, 0]);
        sys::exit_group(if sent.is_ok() { 0 } else { 1 });
    }
    serve()
}
