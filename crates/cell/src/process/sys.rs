//! The raw system calls of the process tier. Everything else in the tier is safe Rust on top of
//! these few functions; each `unsafe` block says why it is sound.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Forks into new namespaces, like `fork()` with `flags` added. Returns 0 in the child.
///
/// The caller must be single-threaded: the child continues with a copy of this thread only.
pub fn clone_process(flags: libc::c_int) -> io::Result<libc::pid_t> {
    if flags == 0 {
        return fork_process();
    }
    let flags = (flags | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a NULL stack makes clone behave like fork (the child runs on a copy of the
    // caller's stack); no parent/child tid pointers or TLS are passed.
    let ret = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    check(ret).map(|pid| pid as libc::pid_t)
}

/// `struct mnt_id_req`, version 0, of `listmount(2)` and `statmount(2)`: the size, a spare
/// word, the mount (listed from, or looked at) and the call's parameter.
#[repr(C)]
struct Request {
    size: u32,
    spare: u32,
    mnt_id: u64,
    param: u64,
}

/// Like [`clone_process`] with `CLONE_NEWUSER` in `flags`, the new user namespace owned by host
/// uid `owner` rather than by the caller (root): this thread takes `owner` as its effective uid
/// for the clone alone, keeping its capabilities (`SECBIT_NO_SETUID_FIXUP`, so that a host that
/// restricts user namespaces made without them treats the clone as before), and both sides put
/// back the secure bits, the dumpable flag and the parent-death signal the change of uid
/// touched. Where a step is refused, the clone is a plain one (owned by the caller).
///
/// The caller must be single-threaded and its effective uid 0 (the raw calls change this thread
/// alone).
pub fn clone_process_owned_by(flags: libc::c_int, owner: u32) -> io::Result<libc::pid_t> {
    const SECBIT_NO_SETUID_FIXUP: libc::c_long = 1 << 2;
    const KEEP: libc::c_long = -1;
    // SAFETY: prctl queries and sets of this process's flags; setresuid of this thread alone
    // (the raw call, not the C library's, which would signal every thread); no memory is passed.
    unsafe {
        let bits = libc::prctl(libc::PR_GET_SECUREBITS) as libc::c_long;
        let dumpable = libc::prctl(libc::PR_GET_DUMPABLE) as libc::c_long;
        // A change of effective uid also clears the parent-death signal.
        let mut death: libc::c_int = 0;
        if bits < 0
            || dumpable < 0
            || libc::prctl(libc::PR_GET_PDEATHSIG, &mut death as *mut libc::c_int) != 0
            || libc::prctl(libc::PR_SET_SECUREBITS, bits | SECBIT_NO_SETUID_FIXUP) != 0
        {
            return clone_process(flags);
        }
        let restore = || {
            libc::prctl(libc::PR_SET_SECUREBITS, bits);
            libc::prctl(libc::PR_SET_DUMPABLE, dumpable);
            libc::prctl(libc::PR_SET_PDEATHSIG, death as libc::c_ulong);
        };
        if libc::syscall(libc::SYS_setresuid, KEEP, libc::c_long::from(owner), KEEP) != 0 {
            restore();
            return clone_process(flags);
        }
        let cloned = clone_process(flags);
        if matches!(cloned, Ok(0)) {
            // The child: root of its new namespace, with every capability there and the
            // default secure bits (the kernel's); its uids become the cell's when the warden
            // has written its maps.
            libc::prctl(libc::PR_SET_DUMPABLE, dumpable);
            return cloned;
        }
        let back = libc::syscall(libc::SYS_setresuid, KEEP, 0 as libc::c_long, KEEP);
        restore();
        if back != 0 {
            // Not reachable with a saved uid of 0; never go on as another user.
            let err = io::Error::last_os_error();
            if let Ok(pid) = cloned {
                libc::kill(pid, libc::SIGKILL);
            }
            return Err(err);
        }
        cloned
    }
}

/// The unique ids of every mount of this process's mount namespace (`listmount(2)`, Linux 6.8;
/// an id is never given to another mount until the next boot), in the kernel's order; `None`
/// where the kernel lacks the call or refuses it.
pub fn mount_ids() -> Option<Vec<u64>> {
    // `listmount`'s number, the same on every architecture of the kernel's common table.
    const SYS_LISTMOUNT: libc::c_long = 458;
    // The mount whose children are listed: the whole namespace. The request's `param` is the
    // last id already had.
    const LSMT_ROOT: u64 = u64::MAX;
    let mut ids: Vec<u64> = Vec::with_capacity(256);
    loop {
        let request = Request {
            size: std::mem::size_of::<Request>() as u32,
            spare: 0,
            mnt_id: LSMT_ROOT,
            param: ids.last().copied().unwrap_or(0),
        };
        let room = ids.capacity() - ids.len();
        // SAFETY: the request is a valid `mnt_id_req` of the size it says; the kernel writes at
        // most `room` ids into the vector's spare capacity, and returns how many it wrote.
        let ret = unsafe {
            libc::syscall(
                SYS_LISTMOUNT,
                &request as *const Request,
                ids.as_mut_ptr().add(ids.len()),
                room,
                0u32,
            )
        };
        let got = usize::try_from(check(ret).ok()?).ok()?.min(room);
        // SAFETY: the kernel initialized `got` more ids (no more than there was room for).
        unsafe { ids.set_len(ids.len() + got) };
        if got < room {
            return Some(ids);
        }
        ids.reserve(ids.len());
    }
}

/// The magic number of the file system of the mount whose unique id is `id` (`statmount(2)`,
/// Linux 6.8, its super block's basics only); `None` where the kernel lacks the call, or the
/// mount is gone.
pub fn mount_fs_magic(id: u64) -> Option<u64> {
    // `statmount`'s number, the same on every architecture of the kernel's common table.
    const SYS_STATMOUNT: libc::c_long = 457;
    const STATMOUNT_SB_BASIC: u64 = 1;
    let request = Request {
        size: std::mem::size_of::<Request>() as u32,
        spare: 0,
        mnt_id: id,
        param: STATMOUNT_SB_BASIC,
    };
    // Room for `struct statmount`'s fixed part (512 bytes), as 64-bit words: its `mask` is the
    // second, its `sb_magic` the fourth (after the size and options words, the mask, and the
    // device's major and minor numbers).
    let mut out = [0u64; 64];
    // SAFETY: the request is a valid `mnt_id_req` of the size it says; the kernel writes at most
    // the buffer's size into it, and asks for no strings.
    let ret = unsafe {
        libc::syscall(
            SYS_STATMOUNT,
            &request as *const Request,
            out.as_mut_ptr(),
            std::mem::size_of_val(&out),
            0u32,
        )
    };
    check(ret).ok()?;
    (out[1] & STATMOUNT_SB_BASIC != 0).then_some(out[3])
}

/// Removes `name` in the directory `dir` (a descriptor), a whole tree if it is a directory,
/// following no link and never leaving the tree `dir` opened (nothing there: no error).
pub fn remove_tree_at(dir: BorrowedFd<'_>, name: &std::ffi::CStr) -> io::Result<()> {
    use rustix::fs::{AtFlags, FileType, Mode, OFlags};
    let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(stat.st_mode) != FileType::Directory {
        return rustix::fs::unlinkat(dir, name, AtFlags::empty()).map_err(Into::into);
    }
    let inner = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    remove_entries_at(std::os::fd::AsFd::as_fd(&inner))?;
    rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(Into::into)
}

/// Removes everything in the directory `dir` (a descriptor), as `remove_tree_at` does each entry.
pub fn remove_entries_at(dir: BorrowedFd<'_>) -> io::Result<()> {
    for name in entry_names(dir)? {
        remove_tree_at(dir, &name)?;
    }
    Ok(())
}

/// The names of the entries of the directory `dir` (a descriptor), `.` and `..` left out,
/// listed whole before the caller changes any.
pub fn entry_names(dir: BorrowedFd<'_>) -> io::Result<Vec<std::ffi::CString>> {
    Ok(rustix::fs::Dir::read_from(dir)?
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_owned())
        .filter(|name| name.as_bytes() != b"." && name.as_bytes() != b"..")
        .collect())
}

/// Reads a file of the kernel's (`/proc`, `/sys`) whole, in one read where it fits 16 KiB: such
/// a file says its size is 0, and `fs::read_to_string` would read it in growing steps from 32
/// bytes (nine reads for this host's `/proc/self/mountinfo`).
pub fn read_kernel_file(path: impl AsRef<std::path::Path>) -> io::Result<String> {
    use std::io::Read as _;
    let mut text = String::with_capacity(16 * 1024);
    std::fs::File::open(path)?.read_to_string(&mut text)?;
    Ok(text)
}

/// Makes `/proc/self/cmdline` of the calling process read `title`: the memory that held its
/// command line (the warden's, in a forked child) is overwritten in place, as setproctitle
/// does. A cell's init calls it first, so that no process in the cell can read the host paths
/// the warden was started with (its binary, the workspace, the policy file).
pub fn replace_cmdline(title: &str) -> io::Result<()> {
    let stat = read_kernel_file("/proc/self/stat")?;
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "unreadable /proc/self/stat");
    let after_comm = stat.rfind(')').ok_or_else(bad)?;
    let fields: Vec<&str> = stat
        .get(after_comm + 2..)
        .unwrap_or("")
        .split(' ')
        .collect();
    // arg_start and arg_end are fields 48 and 49 of proc_pid_stat(5); `fields[0]` is field 3.
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|f| f.trim().parse::<usize>().ok())
            .ok_or_else(bad)
    };
    let (start, end) = (field(48)?, field(49)?);
    if end <= start || start == 0 {
        return Err(bad());
    }
    let title = title.as_bytes();
    let shown = title.len().min(end - start - 1);
    // SAFETY: [start, end) holds this process's argument strings, placed by the kernel at exec
    // at the top of the initial stack: mapped, writable and this process's own (a forked copy:
    // the parent's are untouched). Nothing else writes there, and whatever reads the arguments
    // later (the standard library keeps pointers to them) reads the title and empty strings.
    unsafe {
        std::ptr::write_bytes(start as *mut u8, 0, end - start);
        std::ptr::copy_nonoverlapping(title.as_ptr(), start as *mut u8, shown);
    }
    Ok(())
}

/// Returns a pidfd for `pid`, which stays valid (and refers to that process) even if the pid is
/// later reused.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = check(ret)? as RawFd;
    // SAFETY: the kernel returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `signal` to the process behind `pidfd`.
pub fn pidfd_send_signal(pidfd: &OwnedFd, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall; a NULL siginfo means "as kill() would send it".
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            0usize,
            0u32,
        )
    };
    check(ret).map(drop)
}

/// Puts the calling thread in the `SCHED_IDLE` class: it runs only when nothing else wants the
/// CPU, and any other thread that wakes takes the CPU from it at once. For the warden's work
/// after an answer that only reads or lets go of memory (an old workspace's teardown, a
/// snapshot's size), so that it does not delay the next request on a machine of two cores.
/// Not for work that writes a file system: a starved thread holding a journal handle would
/// hold up every other writer's commit (measured: copies of 10,000 files 2-3x slower).
/// Best effort: a failure leaves the thread as it was.
pub fn run_when_idle() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(2) on the calling thread (0) reads a live sched_param.
    let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
}

/// Lowers thread `tid` of this process (0: the calling thread) to the least priority of the
/// normal class (nice 19): when it wakes it does not take the CPU from a thread of the normal
/// priority, and a busy CPU still gives it a share. For teardown beside a caller that is still
/// at work on a machine of two cores (a cell's mount namespace, whose end is a quarter of a
/// millisecond of the CPU): in
/// the idle class (`run_when_idle`) a thread preempted while it holds the kernel's mount lock,
/// which that end takes for a moment, would hold up every mount on the host for as long as the
/// machine stays busy. Best effort: a failure leaves the thread as it was.
pub fn lower_priority(tid: libc::pid_t) {
    // SAFETY: setpriority(2) on a thread id (0: the caller) changes only that thread's nice
    // value; raising it needs no privilege, and an id that is gone fails with ESRCH.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid.max(0) as libc::id_t, 19) };
}

/// The CPUs the calling thread may run on, where it may run on more than one.
pub fn spread_affinity() -> Option<nix::sched::CpuSet> {
    use nix::sched::CpuSet;
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok()?;
    let count = (0..CpuSet::count())
        .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
        .take(2)
        .count();
    (count > 1).then_some(set)
}

/// Lets `pid` run on any of `allowed` but the CPU the calling thread is on, until it takes
/// them back (`take_back_cpus`): for a process woken to work beside the caller, which goes on
/// working. A wake-up through a socket or a pipe marks the waker as about to sleep, and the
/// scheduler may queue the woken process behind it on its CPU even with the other idle: traced
/// here, a cell's init woken to assemble its root waited 0.69 ms for the warden's CPU while
/// the other was idle (one wake-up in ten waits so, by a test program). Best effort: false
/// where nothing was changed.
pub fn keep_off_this_cpu(pid: libc::pid_t, allowed: &nix::sched::CpuSet) -> bool {
    let Ok(here) = nix::sched::sched_getcpu() else {
        return false;
    };
    let mut others = *allowed;
    if others.unset(here).is_err() {
        return false;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(pid), &others).is_ok()
}

/// Takes back every CPU of `cpus` for the calling process (see `keep_off_this_cpu`), so that
/// nothing it starts inherits the narrower set. Best effort.
pub fn take_back_cpus(cpus: &nix::sched::CpuSet) {
    let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), cpus);
}

/// Points stdin, stdout and stderr at /dev/null (a background child lets go of its caller's
/// stdio, so that nobody waits on it for their end).
pub fn stdio_to_null() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            let _ = dup_onto(null.as_raw_fd(), fd);
        }
    }
}

/// Closes every descriptor from 3 on but those in `keep` (which nothing else of the caller's
/// may own either).
pub fn close_except(keep: &[RawFd]) -> io::Result<()> {
    let mut keep: Vec<RawFd> = keep.iter().copied().filter(|fd| *fd >= 3).collect();
    keep.sort_unstable();
    let mut first = 3;
    for fd in keep {
        if fd > first {
            // SAFETY: closes a range the caller has no live object in (see above).
            check(unsafe {
                libc::syscall(libc::SYS_close_range, first as u32, (fd - 1) as u32, 0u32)
            })?;
        }
        first = fd + 1;
    }
    close_from(first)
}

/// Closes every descriptor from `first` upwards.
pub fn close_from(first: RawFd) -> io::Result<()> {
    // SAFETY: closing descriptors the caller no longer needs; the caller guarantees no live
    // Rust object owns a descriptor in that range.
    let ret = unsafe { libc::syscall(libc::SYS_close_range, first as u32, u32::MAX, 0u32) };
    check(ret).map(drop)
}

/// Asks the kernel to send `signal` to this process when its parent dies.
pub fn set_parent_death_signal(signal: libc::c_int) -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong) }.into()).map(drop)
}

/// Makes this process the reaper of its descendants' orphans (instead of the host's init, which
/// in a container may reap nothing).
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }.into()).map(drop)
}

/// Sets `no_new_privs`: execve can never grant privileges again (setuid bits, file caps).
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }.into()).map(drop)
}

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Makes the mount at `path` and every mount below it nosuid and nodev, and read-only when
/// `read_only` is set.
///
/// `mount_setattr` (unlike a `MS_REMOUNT`) applies to the whole subtree and keeps the flags the
/// kernel locked on mounts inherited from a more privileged namespace.
pub fn restrict_mount(path: &Path, read_only: bool) -> io::Result<()> {
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_NOSUID
            | MOUNT_ATTR_NODEV
            | if read_only { MOUNT_ATTR_RDONLY } else { 0 },
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let path = cstring(path)?;
    // SAFETY: `path` is a valid NUL-terminated string and `attr` a correctly laid out
    // `struct mount_attr` whose size we pass; both outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_RECURSIVE as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check(ret).map(drop)
}

/// Clones the mount at `path` into a detached (anonymous) mount: a descriptor of a mount that
/// is in no mount tree, so that nothing in the cell sees it, and that an overlay can take as a
/// layer (`/proc/self/fd/N`).
pub fn detached_clone(path: &Path) -> io::Result<OwnedFd> {
    open_tree_clone(path, 0)
}

/// A detached copy of the mount tree at `path`, its submounts included.
pub fn detached_clone_recursive(path: &Path) -> io::Result<OwnedFd> {
    open_tree_clone(path, libc::AT_RECURSIVE as libc::c_uint)
}

fn open_tree_clone(path: &Path, flags: libc::c_uint) -> io::Result<OwnedFd> {
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let cpath = cstring(path)?;
    // SAFETY: valid NUL-terminated path; flags are plain integers.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            cpath.as_ptr(),
            OPEN_TREE_CLONE | flags | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    // SAFETY: the kernel returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(check(ret)? as RawFd) })
}

/// Makes a detached mount (from [`detached_clone`]) read-only, nosuid and nodev.
pub fn restrict_detached(tree: &OwnedFd) -> io::Result<()> {
    set_detached_attr(
        tree,
        &MountAttr {
            attr_set: 0x1 | 0x2 | 0x4, // MOUNT_ATTR_RDONLY | NOSUID | NODEV
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        },
    )
}

fn set_detached_attr(tree: &OwnedFd, attr: &MountAttr) -> io::Result<()> {
    let empty = c"";
    // SAFETY: `tree` is an open mount descriptor, the empty path with AT_EMPTY_PATH names it, and
    // `attr` is a correctly laid out `struct mount_attr` that outlives the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    check(ret).map(drop)
}

/// Clones the mount tree at `path` into a detached mount whose owners are translated through the
/// user namespace `userns` (an idmapped mount).
pub fn idmapped_clone(path: &Path, userns: &OwnedFd) -> io::Result<OwnedFd> {
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    let tree = detached_clone(path)?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    set_detached_attr(&tree, &attr)?;
    Ok(tree)
}

/// Attaches a detached mount (from [`idmapped_clone`]) at `target`.
pub fn move_mount_to(tree: &OwnedFd, target: &Path) -> io::Result<()> {
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    let target = cstring(target)?;
    let empty = c"";
    // SAFETY: `tree` is an open mount descriptor; both strings are valid and outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    check(ret).map(drop)
}

/// Brings the loopback interface of the current network namespace up.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: plain socket() call.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    let sock = check(sock.into())? as RawFd;
    // SAFETY: the kernel returned a fresh descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads and fills `req`, which is a valid ifreq for the whole call.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) }.into())?;
    // SAFETY: after SIOCGIFFLAGS the flags member of the union is the initialised one.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads `req`, valid for the whole call.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) }.into()).map(drop)
}

/// Installs a classic BPF seccomp program on the calling thread (no_new_privs must be set).
pub fn install_seccomp(program: &[seccompiler::sock_filter]) -> io::Result<()> {
    seccompiler::apply_filter(program).map_err(io::Error::other)
}

/// Sets a resource limit (soft and hard) for this process and its future children.
pub fn set_rlimit(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: `limit` is a valid rlimit for the duration of the call.
    check(unsafe { libc::setrlimit(resource, &limit) }.into()).map(drop)
}

/// Duplicates `fd` onto `target` (closing what was there); the copy is inheritable.
pub fn dup_onto(fd: RawFd, target: RawFd) -> io::Result<()> {
    // SAFETY: dup2 on descriptors the caller owns; `target` is replaced on purpose.
    check(unsafe { libc::dup2(fd, target) }.into()).map(drop)
}

/// Waits until `fd` can be read (or its peer hung up); `false` when `wait` passed first.
pub fn wait_readable(fd: BorrowedFd<'_>, wait: std::time::Duration) -> io::Result<bool> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let until = std::time::Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let timeout = PollTimeout::try_from(left.as_millis().min(10_000) as i32 + 1)
            .unwrap_or(PollTimeout::NONE);
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => return Ok(true),
            Err(e) => return Err(io::Error::from_raw_os_error(e as i32)),
        }
    }
}

/// A file lease on `fd` (`F_SETLEASE`: `libc::F_WRLCK`, `F_RDLCK` or `F_UNLCK`).
pub fn set_lease(fd: RawFd, kind: libc::c_int) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments on a descriptor the caller owns.
    check(unsafe { libc::fcntl(fd, libc::F_SETLEASE, kind) }.into()).map(drop)
}

/// Leaves `fd` with no owner (`F_SETOWN` 0): nothing is sent `SIGIO` for it, nor for a lease
/// on it that an open waits on.
pub fn clear_owner(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments on a descriptor the caller owns.
    check(unsafe { libc::fcntl(fd, libc::F_SETOWN, 0) }.into()).map(drop)
}

/// Marks `fd` close-on-exec.
pub fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments on a descriptor the caller owns.
    check(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) }.into()).map(drop)
}

/// Creates a pipe whose both ends are close-on-exec: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }.into())?;
    // SAFETY: the kernel returned two fresh descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The Landlock ABI version of the running kernel, or the errno that says why there is none.
pub fn landlock_abi_version() -> io::Result<i64> {
    const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
    // SAFETY: with a NULL attribute pointer and size 0 this call only queries the version.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            0usize,
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    check(ret)
}

/// Duplicates `fd` to a free descriptor numbered at least `min`, close-on-exec.
pub fn dup_above(fd: RawFd, min: RawFd) -> io::Result<RawFd> {
    // SAFETY: fcntl with integer arguments on a descriptor the caller owns.
    check(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, min) }.into()).map(|fd| fd as RawFd)
}

/// Closes the calling process's stdin, stdout and stderr. For a cell's init about to exit: the
/// warden that reads the command's pipes sees their end once the init lets go of its copies,
/// not at the end of the kernel's teardown of the init.
pub fn close_stdio() {
    // SAFETY: close_range(2) of descriptors 0-2, which this process does not use again.
    unsafe { libc::syscall(libc::SYS_close_range, 0u32, 2u32, 0u32) };
}

/// Ends the calling process at once, without running exit handlers or flushing stdio buffers
/// (which in a forked child still hold the parent's unwritten data).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and touches no user-space state.
    unsafe { libc::_exit(code) }
}

extern "C" fn ignore_signal(_: libc::c_int) {}

/// Gives `signals` a handler that does nothing. A pid-namespace init drops signals whose
/// disposition is the default, so the cell's init needs handlers for the signals it reads from
/// a signalfd.
pub fn install_noop_handlers(signals: &[libc::c_int]) -> io::Result<()> {
    for &signal in signals {
        // SAFETY: sigaction is plain data; all-zero is a valid starting value.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        // SAFETY: the handler is async-signal-safe (it does nothing) and `action` is valid.
        check(unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) }.into())?;
    }
    Ok(())
}

/// Takes ownership of a descriptor number that the cell's init arranged itself.
pub fn own_fd(fd: RawFd) -> OwnedFd {
    // SAFETY: only called by the cell's init for the fixed descriptor numbers it placed with
    // `dup_onto` and owns exclusively; each number is taken at most once.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Makes `command` start with an empty signal mask, whatever the spawning thread blocks.
pub fn unblock_signals_on_exec(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs in the forked child before exec and only calls sigemptyset and
    // pthread_sigmask on a local set, both async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            match libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut()) {
                0 => Ok(()),
                err => Err(io::Error::from_raw_os_error(err)),
            }
        });
    }
}

/// What `spawn` starts.
pub struct Spawn<'a> {
    /// A path (not searched for in PATH).
    pub program: &'a Path,
    pub argv: &'a [std::ffi::OsString],
    pub env: &'a [(std::ffi::OsString, std::ffi::OsString)],
    /// Its directory; the caller's when `None`.
    pub cwd: Option<&'a Path>,
    /// Its stdin, stdout and stderr; the caller's own when `None`.
    pub stdio: Option<[BorrowedFd<'a>; 3]>,
    /// A Landlock ruleset the process is restricted by before its program starts (on top of
    /// the caller's own domain).
    pub landlock: Option<BorrowedFd<'a>>,
    /// More descriptors for the process, each at the number given (above its stdio).
    pub fds: &'a [(BorrowedFd<'a>, RawFd)],
    /// Cgroup membership files (`cgroup.procs`, or `tasks` of a v1 hierarchy), opened for
    /// writing: the process joins each before its program starts, so that it and every process
    /// it makes count against the cell's limits from their first instruction.
    pub cgroups: &'a [BorrowedFd<'a>],
    /// The signal the process gets should the calling thread end (`PR_SET_PDEATHSIG`).
    pub parent_death: Option<libc::c_int>,
    /// A process group of its own (otherwise the caller's).
    pub own_group: bool,
    /// The signals the caller ignores, where it knows them (`ignored_signals`, asked once by
    /// a caller whose dispositions no longer change): only these are set back to their
    /// default in the child. `None`: `spawn` asks for each of the 64 (a system call each).
    pub ignored: Option<&'a [libc::c_int]>,
}

/// The signals this process ignores now (`SIG_IGN`), which would stay ignored across an exec:
/// read from the kernel's mask of them (`SigIgn` in `/proc/self/status`: an open, a read and a
/// close), or where that cannot be read, asked for each of the 64 (a system call each, which
/// a cell's init made before its first command).
pub fn ignored_signals() -> Vec<libc::c_int> {
    ignored_by_status().unwrap_or_else(ignored_by_asking)
}

/// The ignored signals as `/proc/self/status` lists them.
fn ignored_by_status() -> Option<Vec<libc::c_int>> {
    let status = read_kernel_file("/proc/self/status").ok()?;
    let mask = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())?;
    // The C library keeps the signals below its `SIGRTMIN` past the kernel's first real-time
    // one (32 and 33, its threads') to itself: its `sigaction` neither shows nor sets them.
    let own = 32..libc::SIGRTMIN();
    Some(
        (1..=libc::SIGRTMAX().min(64))
            .filter(|&signal| mask & (1u64 << (signal - 1)) != 0 && !own.contains(&signal))
            .collect(),
    )
}

/// The ignored signals, asked for one by one.
fn ignored_by_asking() -> Vec<libc::c_int> {
    (1..=libc::SIGRTMAX())
        .filter(|&signal| signal != libc::SIGKILL && signal != libc::SIGSTOP)
        .filter(|&signal| {
            // SAFETY: sigaction(2) only reads the disposition into a zeroed, plain struct.
            unsafe {
                let mut current: libc::sigaction = std::mem::zeroed();
                libc::sigaction(signal, std::ptr::null(), &mut current) == 0
                    && current.sa_sigaction == libc::SIG_IGN
            }
        })
        .collect()
}

/// Puts the process `command` starts under the Landlock ruleset `fd` just before its program
/// runs.
pub fn landlock_on_exec(command: &mut std::process::Command, fd: BorrowedFd<'_>) {
    use std::os::unix::process::CommandExt as _;
    let raw = fd.as_raw_fd();
    // SAFETY: the hook makes one raw system call on a descriptor the caller keeps open for as
    // long as the command is spawned (it is borrowed for the spawn); nothing is allocated.
    unsafe {
        command.pre_exec(move || restrict_raw(raw));
    }
}

/// Restricts the calling thread by the Landlock ruleset `fd` (a layer on top of its domain).
pub fn landlock_restrict_self(fd: BorrowedFd<'_>) -> io::Result<()> {
    restrict_raw(fd.as_raw_fd())
}

/// `landlock_restrict_self(fd, 0)`: one system call, nothing allocated (a forked child or an
/// exec hook may make it).
fn restrict_raw(fd: RawFd) -> io::Result<()> {
    // SAFETY: a plain syscall on a descriptor number; no memory is passed. A closed or wrong
    // descriptor is an error the kernel reports.
    let ret = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Starts a process the way posix_spawn does (a vfork: neither the caller's memory is copied
/// nor its pages faulted in again, nor the copy torn down again at exec, which for a process
/// of the warden's size costs milliseconds), with the steps posix_spawn has no room for: the
/// Landlock layer of `what.landlock`, the cgroups to join and the parent-death signal. The
/// process runs in `cwd` (or the caller's directory), in a process group of its own where
/// `own_group`, with an empty signal mask and every signal at its default action (but an
/// ignored SIGXFSZ). Fails with the errno of the failed step (ENOENT, EACCES, ...): the process
/// exists only if its program started.
pub fn spawn(what: &Spawn<'_>) -> io::Result<libc::pid_t> {
    use std::sync::atomic::{AtomicI32, Ordering};
    let c = |bytes: &[u8]| {
        CString::new(bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let program = c(what.program.as_os_str().as_bytes())?;
    let cwd = what
        .cwd
        .map(|dir| c(dir.as_os_str().as_bytes()))
        .transpose()?;
    let argv = what
        .argv
        .iter()
        .map(|a| c(a.as_bytes()))
        .collect::<io::Result<Vec<_>>>()?;
    let env = what
        .env
        .iter()
        .map(|(k, v)| c(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect::<io::Result<Vec<_>>>()?;
    let pointers = |strings: &[CString]| {
        let mut list: Vec<*const libc::c_char> = strings.iter().map(|s| s.as_ptr()).collect();
        list.push(std::ptr::null());
        list
    };
    let (argv_p, env_p) = (pointers(&argv), pointers(&env));
    let stdio: Option<[RawFd; 3]> = what.stdio.map(|fds| fds.map(|fd| fd.as_raw_fd()));
    let landlock: Option<RawFd> = what.landlock.map(|fd| fd.as_raw_fd());
    // The extra descriptors' copies are closed here once the child has execed.
    let (copies, moves) = copies_to_place(what.fds)?;
    let cgroups: Vec<RawFd> = what.cgroups.iter().map(|fd| fd.as_raw_fd()).collect();
    let (own_group, parent_death) = (what.own_group, what.parent_death);
    // Asked here where the caller does not name them: the child shares these dispositions.
    let asked;
    let ignored = match what.ignored {
        Some(named) => named,
        None => {
            asked = ignored_signals();
            &asked
        }
    };
    // What the child failed at, if it did: it shares this memory until it execs or exits.
    let failed = AtomicI32::new(0);
    let mut stack = match SPARE_STACK
        .try_lock()
        .ok()
        .and_then(|mut spare| spare.take())
    {
        Some(stack) => stack,
        None => ChildStack::map(CHILD_STACK)?,
    };

    // SAFETY: the child runs on `stack`, in this process's memory (CLONE_VM) while this thread
    // is suspended (CLONE_VFORK) until it execs or exits, so everything it reads (the C strings,
    // their pointer arrays, the descriptors) stays alive and unchanged. It allocates nothing,
    // takes no lock and makes only async-signal-safe calls; its one write to shared memory is
    // the atomic `failed`. Every signal is blocked in this thread around the clone, so no
    // handler of the caller's runs on the child's side; the child sets its own mask before it
    // execs. The saved mask is restored whatever the clone did.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut saved: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        let child = || -> isize {
            let fail = |step: i32| -> isize {
                let errno = *libc::__errno_location();
                failed.store(if errno == 0 { step } else { errno }, Ordering::SeqCst);
                libc::_exit(127)
            };
            // Signals the caller ignores would stay ignored across exec: back to default (a
            // handled one is reset by exec itself), but for an ignored SIGXFSZ, kept.
            for &signal in ignored {
                if signal != libc::SIGXFSZ {
                    let mut default: libc::sigaction = std::mem::zeroed();
                    default.sa_sigaction = libc::SIG_DFL;
                    libc::sigaction(signal, &default, std::ptr::null_mut());
                }
            }
            if own_group && libc::setpgid(0, 0) != 0 {
                return fail(libc::EPERM);
            }
            // "0": the writing process itself.
            for fd in &cgroups {
                if libc::write(*fd, c"0".as_ptr().cast(), 1) != 1 {
                    return fail(libc::EIO);
                }
            }
            if let Some(fds) = stdio {
                for (target, fd) in fds.iter().enumerate() {
                    if *fd == target as RawFd {
                        // dup2 onto itself keeps close-on-exec: clear it instead.
                        let flags = libc::fcntl(*fd, libc::F_GETFD);
                        if flags < 0
                            || libc::fcntl(*fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0
                        {
                            return fail(libc::EBADF);
                        }
                    } else if libc::dup2(*fd, target as RawFd) < 0 {
                        return fail(libc::EBADF);
                    }
                }
            }
            for (from, to) in &moves {
                if libc::dup2(*from, *to) < 0 {
                    return fail(libc::EBADF);
                }
            }
            if let Some(cwd) = &cwd
                && libc::chdir(cwd.as_ptr()) != 0
            {
                return fail(libc::ENOENT);
            }
            if let Some(signal) = parent_death
                && libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong) < 0
            {
                return fail(libc::EPERM);
            }
            if let Some(fd) = landlock
                && restrict_raw(fd).is_err()
            {
                return fail(libc::EPERM);
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            libc::execve(program.as_ptr(), argv_p.as_ptr(), env_p.as_ptr());
            fail(libc::ENOEXEC)
        };
        let cloned = nix::sched::clone(
            Box::new(child),
            stack.as_mut_slice(),
            nix::sched::CloneFlags::CLONE_VM | nix::sched::CloneFlags::CLONE_VFORK,
            Some(libc::SIGCHLD),
        );
        libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut());
        drop(copies);
        // The child is done with its stack (it execed or exited): kept for the next spawn.
        if let Ok(mut spare) = SPARE_STACK.try_lock() {
            *spare = Some(stack);
        }
        let pid = cloned.map_err(|e| io::Error::from_raw_os_error(e as i32))?;
        match failed.load(Ordering::SeqCst) {
            0 => Ok(pid.as_raw()),
            errno => {
                // The child exited without starting its program: reap it here.
                let _ = nix::sys::wait::waitpid(pid, None);
                Err(io::Error::from_raw_os_error(errno))
            }
        }
    }
}

/// Maps the stack the next [`spawn`] runs its child on, where none is kept yet: for a process
/// that spawns later and has nothing to do until then (a cell's init made ahead of its first
/// exec), so that the spawn does not map it then.
pub fn ready_spawn_stack() {
    if let Ok(mut spare) = SPARE_STACK.try_lock()
        && spare.is_none()
    {
        *spare = ChildStack::map(CHILD_STACK).ok();
    }
}

/// The stack a [`spawn`] child runs on until it execs.
const CHILD_STACK: usize = 64 * 1024;

/// The stack of the last spawn, kept for the next one (a cell's init spawns every exec'd
/// process): its mapping and the pages a child touched are made once, not at every spawn.
/// Taken and put back with `try_lock` only, so that a process forked while another thread
/// held it never waits on it (that spawn maps a stack of its own).
static SPARE_STACK: std::sync::Mutex<Option<ChildStack>> = std::sync::Mutex::new(None);

/// A stack for a vfork child, mapped for it: its pages become resident only where the child
/// touches them (two or three), and below it lies no memory of the caller's. A zeroed
/// buffer from the heap had all its 16 pages written (and, in a freshly forked init, copied)
/// before every clone.
struct ChildStack {
    base: *mut u8,
    len: usize,
}

impl ChildStack {
    fn map(len: usize) -> io::Result<Self> {
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            base: base.cast(),
            len,
        })
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes at `base` are mapped readable and writable (zero until written)
        // for this value's life, and only reached through this borrow.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }
}

// SAFETY: the mapping is owned by the one `ChildStack` value that refers to it (nothing else
// holds its address once a spawn's clone returned), so it may move to another thread.
unsafe impl Send for ChildStack {}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once: the child that ran on it has
        // execed or exited (CLONE_VFORK returns only then).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// A lazy unmount (`umount2(MNT_DETACH)`) of the mount at `path` (the topmost mount there),
/// made by a child of this process that shares its memory and descriptors, while this process
/// goes on. The mounts leave the mount namespace at the call's start; the call then waits for
/// an expedited RCU grace period before it returns (every unmount does), 0.15-0.2 ms here,
/// which the child waits out instead of the caller. [`Detaching::wait`] says whether it
/// succeeded; nothing that relies on the mount being gone may run before.
#[derive(Debug)]
pub struct Detaching {
    pid: libc::pid_t,
    /// Read by the child: kept until it has exited.
    _path: CString,
    stack: Option<ChildStack>,
}

impl std::fmt::Debug for ChildStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildStack")
            .field("len", &self.len)
            .finish()
    }
}

/// The child of [`Detaching::start`]: the unmount, and its errno as the exit status. It makes
/// raw system calls only (rustix's): it shares the caller's thread-local data, `errno` among
/// them, which a C library call that fails would write.
extern "C" fn detach_child(path: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `path` is the NUL-terminated string of the `Detaching` that started this child,
    // which keeps it (unmoved: a `CString`'s bytes are on the heap) until this child has exited.
    let path = unsafe { std::ffi::CStr::from_ptr(path.cast::<libc::c_char>()) };
    match rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH) {
        Ok(()) => 0,
        Err(errno) => errno.raw_os_error(),
    }
}

impl Detaching {
    /// Starts the unmount of `path` (relative to this process's directory, as the child has a
    /// copy of it) in a child. The caller must be single-threaded, with no signal handler of
    /// its own installed (every signal is blocked around the clone, so none runs in the child).
    pub fn start(path: &Path) -> io::Result<Self> {
        let path = cstring(path)?;
        let mut stack = ChildStack::map(CHILD_STACK)?;
        // SAFETY: the child runs `detach_child` on `stack` (a mapping of its own, kept by the
        // returned value until the child has exited: `wait`, or the drop) with a pointer to
        // `path`'s bytes, kept as long. It shares this memory (CLONE_VM) and descriptor table
        // (CLONE_FILES) and touches neither but its stack; no exit signal is sent, and it is
        // reaped by `wait`. Every signal is blocked in this thread around the clone (the child
        // keeps that mask); the saved mask is restored whatever the clone did.
        let pid = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut saved: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
            let slice = stack.as_mut_slice();
            let top = slice.as_mut_ptr().add(slice.len());
            let pid = libc::clone(
                detach_child,
                top.cast(),
                libc::CLONE_VM | libc::CLONE_FILES,
                path.as_ptr().cast_mut().cast(),
            );
            let error = io::Error::last_os_error();
            libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut());
            if pid < 0 {
                return Err(error);
            }
            pid
        };
        Ok(Self {
            pid,
            _path: path,
            stack: Some(stack),
        })
    }

    /// Waits for the child's end: whether the unmount succeeded.
    pub fn wait(mut self) -> io::Result<()> {
        self.reap()
    }

    fn reap(&mut self) -> io::Result<()> {
        let Some(stack) = self.stack.take() else {
            return Ok(());
        };
        let status = loop {
            match nix::sys::wait::waitpid(
                nix::unistd::Pid::from_raw(self.pid),
                Some(nix::sys::wait::WaitPidFlag::__WALL),
            ) {
                Err(nix::errno::Errno::EINTR) => continue,
                other => break other,
            }
        };
        let result = match status {
            Ok(nix::sys::wait::WaitStatus::Exited(_, 0)) => Ok(()),
            Ok(nix::sys::wait::WaitStatus::Exited(_, errno)) => {
                Err(io::Error::from_raw_os_error(errno))
            }
            Ok(other) => Err(io::Error::other(format!(
                "the unmount's process ended otherwise: {other:?}"
            ))),
            Err(errno) => Err(io::Error::from_raw_os_error(errno as i32)),
        };
        // Only once the child has ended (or cannot be waited for: it was never ours) is its
        // stack let go of. An error of `waitpid` other than EINTR leaves it mapped.
        if status.is_ok() {
            drop(stack);
        } else {
            std::mem::forget(stack);
        }
        result
    }
}

impl Drop for Detaching {
    fn drop(&mut self) {
        let _ = self.reap();
    }
}

/// What a `Command` built elsewhere starts, for [`spawn`]: its program (a path), arguments,
/// environment (this process's with the command's changes; a command's `env_clear` is not
/// seen) and directory (`None`: this process's). Its stdio settings are not read.
#[derive(Debug)]
pub struct Described {
    pub program: std::path::PathBuf,
    pub argv: Vec<std::ffi::OsString>,
    pub env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    pub cwd: Option<std::path::PathBuf>,
}

impl Described {
    /// What [`spawn`] starts for this, with `stdio`; nothing else set (the caller's group, no
    /// extra descriptors, cgroups, Landlock layer or parent-death signal).
    pub fn spawn_with<'a>(&'a self, stdio: [BorrowedFd<'a>; 3]) -> Spawn<'a> {
        Spawn {
            program: &self.program,
            argv: &self.argv,
            env: &self.env,
            cwd: self.cwd.as_deref(),
            stdio: Some(stdio),
            landlock: None,
            fds: &[],
            cgroups: &[],
            parent_death: None,
            own_group: false,
            ignored: None,
        }
    }

    pub fn of(command: &std::process::Command) -> Self {
        let program = std::path::PathBuf::from(command.get_program());
        let argv = std::iter::once(command.get_program().to_owned())
            .chain(command.get_args().map(ToOwned::to_owned))
            .collect();
        let mut env: std::collections::BTreeMap<_, _> = std::env::vars_os().collect();
        for (key, value) in command.get_envs() {
            match value {
                Some(value) => env.insert(key.to_owned(), value.to_owned()),
                None => env.remove(key),
            };
        }
        let cwd = command.get_current_dir().map(ToOwned::to_owned);
        Self {
            program,
            argv,
            env: env.into_iter().collect(),
            cwd,
        }
    }
}

/// Writes `bytes` to `fd` with one `write(2)` (a cgroup file takes one value per write).
pub fn write_raw(fd: RawFd, bytes: &[u8]) -> io::Result<()> {
    // SAFETY: write(2) reads `bytes.len()` bytes of a live slice; a bad `fd` is an error.
    let written = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    match usize::try_from(written) {
        Ok(n) if n == bytes.len() => Ok(()),
        Ok(_) => Err(io::Error::new(io::ErrorKind::WriteZero, "a short write")),
        Err(_) => Err(io::Error::last_os_error()),
    }
}

/// Closes `fd` if it is open; a descriptor slot the caller knows nothing else uses.
pub fn close_quietly(fd: RawFd) {
    // SAFETY: only called by the cell's init for its own fixed descriptor slots and the
    // descriptors it inherited from the warden's forked memory, which no Rust object of the
    // init will drop; EBADF for a slot that is already closed is ignored.
    unsafe {
        libc::close(fd);
    }
}

/// A connected pair of unix datagram-sequence sockets, both close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    let kind = libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC;
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let ret = unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) };
    check(ret.into())?;
    // SAFETY: the kernel returned two fresh descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Receives the descriptors sent with SCM_RIGHTS on `channel`, with the one-byte message.
pub fn receive_fds(channel: BorrowedFd<'_>) -> io::Result<(u8, Vec<OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut byte = [0u8; 1];
    let mut iov = [io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 8]);
    let msg = recvmsg::<()>(
        channel.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    let mut out = Vec::new();
    for cmsg in msg
        .cmsgs()
        .map_err(|e| io::Error::from_raw_os_error(e as i32))?
    {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for fd in fds {
                // SAFETY: the kernel installed these descriptors in our table for us alone.
                out.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Ok((byte[0], out))
}

/// The largest message on a cell's exec channel.
pub const MESSAGE_MAX: usize = 256 * 1024;

/// Sends one message, with descriptors, on a datagram-sequence socket.
pub fn send_message(socket: BorrowedFd<'_>, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    send(socket, payload, fds, nix::sys::socket::MsgFlags::empty())
}

/// Like `send_message`, without waiting: `WouldBlock` when the peer's queue is full.
pub fn send_message_nowait(
    socket: BorrowedFd<'_>,
    payload: &[u8],
    fds: &[RawFd],
) -> io::Result<()> {
    send(
        socket,
        payload,
        fds,
        nix::sys::socket::MsgFlags::MSG_DONTWAIT,
    )
}

fn send(
    socket: BorrowedFd<'_>,
    payload: &[u8],
    fds: &[RawFd],
    flags: nix::sys::socket::MsgFlags,
) -> io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let iov = [io::IoSlice::new(payload)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    sendmsg::<()>(
        socket.as_raw_fd(),
        &iov,
        cmsgs,
        MsgFlags::MSG_NOSIGNAL | flags,
        None,
    )
    .map(|_| ())
    .map_err(|e| io::Error::from_raw_os_error(e as i32))
}

/// Receives one message and its descriptors; `None` when the peer hung up.
pub fn receive_message(socket: BorrowedFd<'_>) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    receive(socket, nix::sys::socket::MsgFlags::empty())
}

/// Like `receive_message`, without waiting: `WouldBlock` when no message is there.
pub fn try_receive_message(socket: BorrowedFd<'_>) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    receive(socket, nix::sys::socket::MsgFlags::MSG_DONTWAIT)
}

fn receive(
    socket: BorrowedFd<'_>,
    flags: nix::sys::socket::MsgFlags,
) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    thread_local! {
        // One buffer per thread for the largest message, allocated zeroed (fresh pages from
        // the kernel, made resident only as messages fill them): a new one per message would
        // be zeroed again each time, and one zeroed here would be resident in every thread.
        static BUFFER: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; MESSAGE_MAX]);
    }
    BUFFER.with_borrow_mut(|buf| receive_into(socket, flags, buf))
}

fn receive_into(
    socket: BorrowedFd<'_>,
    flags: nix::sys::socket::MsgFlags,
    buf: &mut [u8],
) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut space = nix::cmsg_space!([RawFd; 8]);
    let (len, flags, fds) = loop {
        let mut iov = [io::IoSliceMut::new(buf)];
        let msg = match recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC | flags,
        ) {
            Ok(msg) => msg,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(io::Error::from_raw_os_error(e as i32)),
        };
        let mut fds = Vec::new();
        for cmsg in msg
            .cmsgs()
            .map_err(|e| io::Error::from_raw_os_error(e as i32))?
        {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                for fd in received {
                    // SAFETY: the kernel installed these descriptors in our table for us alone.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        break (msg.bytes, msg.flags, fds);
    };
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    if flags.contains(MsgFlags::MSG_TRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a message larger than {MESSAGE_MAX} bytes"),
        ));
    }
    Ok(Some((buf[..len].to_vec(), fds)))
}

/// A new unix datagram-sequence socket, close-on-exec.
fn seqpacket_socket() -> io::Result<OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| io::Error::from_raw_os_error(e as i32))
}

/// A listening datagram-sequence unix socket at `path`, reachable by its owner only.
pub fn seqpacket_listen(path: &Path) -> io::Result<OwnedFd> {
    use nix::sys::socket::{Backlog, UnixAddr, bind, listen};
    let nix_err = |e: nix::Error| io::Error::from_raw_os_error(e as i32);
    let socket = seqpacket_socket()?;
    let _ = std::fs::remove_file(path);
    let addr = UnixAddr::new(path).map_err(nix_err)?;
    // Bound with a umask-independent mode: the file is made owner-only before anyone listens.
    bind(socket.as_raw_fd(), &addr).map_err(nix_err)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    listen(&socket, Backlog::new(128).map_err(nix_err)?).map_err(nix_err)?;
    Ok(socket)
}

/// Accepts one connection on a listening socket.
pub fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    loop {
        match nix::sys::socket::accept4(
            listener.as_raw_fd(),
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        ) {
            // SAFETY: accept4 returned a fresh descriptor that nothing else owns.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(nix::Error::EINTR | nix::Error::ECONNABORTED) => continue,
            Err(e) => return Err(io::Error::from_raw_os_error(e as i32)),
        }
    }
}

/// Connects to a datagram-sequence unix socket without waiting: a listener whose backlog is
/// full (one that stopped accepting) gives `WouldBlock` at once. The socket is blocking after.
pub fn seqpacket_connect(path: &Path) -> io::Result<OwnedFd> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    use nix::sys::socket::{UnixAddr, connect};
    let nix_err = |e: nix::Error| io::Error::from_raw_os_error(e as i32);
    let socket = seqpacket_socket()?;
    let flags = OFlag::from_bits_truncate(fcntl(&socket, FcntlArg::F_GETFL).map_err(nix_err)?);
    fcntl(&socket, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map_err(nix_err)?;
    let addr = UnixAddr::new(path).map_err(nix_err)?;
    connect(socket.as_raw_fd(), &addr).map_err(nix_err)?;
    fcntl(&socket, FcntlArg::F_SETFL(flags)).map_err(nix_err)?;
    Ok(socket)
}

/// Makes this process non-dumpable: other processes of the same user can neither ptrace it nor
/// read its memory through /proc.
pub fn set_not_dumpable() -> io::Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(|e| io::Error::from_raw_os_error(e as i32))
}

/// Makes the command a session leader whose controlling terminal is its stdin (a pty slave).
pub fn controlling_terminal_on_exec(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs in the forked child before exec and only calls setsid and ioctl,
    // both async-signal-safe, on the child's own stdin.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Sets the window size of a terminal (master or slave side).
pub fn set_window_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> io::Result<()> {
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the pointer, which points at a live local.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    check(ret.into()).map(|_| ())
}

/// A new pseudo-terminal from this mount namespace's `/dev/ptmx`: (master, slave), both
/// close-on-exec.
pub fn open_pty() -> io::Result<(OwnedFd, OwnedFd)> {
    use nix::fcntl::OFlag;
    let nix_err = |e: nix::Error| io::Error::from_raw_os_error(e as i32);
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)
        .map_err(nix_err)?;
    nix::pty::grantpt(&master).map_err(nix_err)?;
    nix::pty::unlockpt(&master).map_err(nix_err)?;
    let name = nix::pty::ptsname_r(&master).map_err(nix_err)?;
    use std::os::unix::fs::OpenOptionsExt as _;
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(name)?;
    // SAFETY: `master` owns the descriptor posix_openpt returned; into_raw_fd gives it up.
    let master = unsafe { OwnedFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(master)) };
    Ok((master, OwnedFd::from(slave)))
}

/// A child that ended, with what it used.
#[derive(Debug, Clone, Copy)]
pub struct Reaped {
    pub pid: i32,
    /// `Ok(code)` when it exited, `Err(signal)` when a signal ended it.
    pub status: Result<i32, i32>,
    pub user_us: u64,
    pub system_us: u64,
    pub max_rss_kib: u64,
}

/// From a pid namespace's init: SIGKILL to every other process of the namespace (none of them
/// runs another instruction of its own after this: a killed process only leaves the kernel to
/// die, and one in the middle of a fork has its child undone), then reaps them, for at most
/// `bound` (one stuck in the kernel is left to die there).
pub fn end_all_others(bound: std::time::Duration) {
    // SAFETY: kill takes plain integers; -1 from a namespace's init means every process of
    // the namespace but itself.
    unsafe {
        libc::kill(-1, libc::SIGKILL);
    }
    let deadline = std::time::Instant::now() + bound;
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: waitpid writes the status through a pointer to a live local.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        match pid {
            0 if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
            p if p > 0 => {}
            -1 if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => {}
            _ => return,
        }
    }
}

/// Reaps one ended child without waiting (`None` when no child has ended).
pub fn reap_any() -> io::Result<Option<Reaped>> {
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: wait4 writes the status and the rusage through pointers to live locals.
        let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut usage) };
        if pid == 0 {
            return Ok(None);
        }
        if pid < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ECHILD) => return Ok(None),
                _ => return Err(err),
            }
        }
        let status = if libc::WIFEXITED(status) {
            Ok(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            Err(libc::WTERMSIG(status))
        } else {
            continue;
        };
        let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        return Ok(Some(Reaped {
            pid,
            status,
            user_us: micros(usage.ru_utime),
            system_us: micros(usage.ru_stime),
            max_rss_kib: usage.ru_maxrss as u64,
        }));
    }
}

/// The real-time signal a `warden run` passes a signal it got on to its keeper with (the
/// signal's number as the value): real-time signals queue, so one forwarded while the keeper
/// has the same signal pending from the caller's process group is not merged into that one.
pub fn forwarding_signal() -> libc::c_int {
    libc::SIGRTMIN() + 3
}

/// Sends `forwarding_signal()` to `pid` with `signal` as its value.
pub fn forward_signal(pid: libc::pid_t, signal: libc::c_int) -> io::Result<()> {
    let value = libc::sigval {
        sival_ptr: signal as usize as *mut libc::c_void,
    };
    // SAFETY: sigqueue(3) reads only its arguments.
    check(unsafe { libc::sigqueue(pid, forwarding_signal(), value) }.into()).map(drop)
}

/// `set` and `forwarding_signal()`.
pub fn with_forwarding(set: &nix::sys::signal::SigSet) -> nix::sys::signal::SigSet {
    let mut raw: libc::sigset_t = *set.as_ref();
    // SAFETY: sigaddset(3) writes the live set it is given; the signal is a valid one.
    unsafe {
        libc::sigaddset(&mut raw, forwarding_signal());
        nix::sys::signal::SigSet::from_sigset_t_unchecked(raw)
    }
}

/// `fork()`: the C library's, so that its locks (the allocator's among them) are taken around
/// the fork and usable in the child even when other threads held them. Returns 0 in the child.
pub fn fork_process() -> io::Result<libc::pid_t> {
    // SAFETY: fork has no memory-safety preconditions; the child continues with a copy of this
    // thread only, and the C library's fork handlers leave its own locks usable there.
    let ret = unsafe { libc::fork() };
    check(ret.into()).map(|pid| pid as libc::pid_t)
}

/// Attaches `file` to a free loop device (detached again when its last user, the mount that
/// follows, goes) and returns the device, opened.
pub fn attach_loop(file: BorrowedFd<'_>) -> io::Result<(OwnedFd, std::path::PathBuf)> {
    use linux_raw_sys::loop_device::{
        LO_FLAGS_AUTOCLEAR, LOOP_CONFIGURE, LOOP_CTL_GET_FREE, loop_config,
    };
    let control = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")?;
    // Another process may take the free device first: then ask again.
    let mut last = io::Error::other("no loop device could be configured");
    for _ in 0..32 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let number = check(
            unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE as libc::c_ulong) }.into(),
        )?;
        let path = std::path::PathBuf::from(format!("/dev/loop{number}"));
        let device = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        {
            Ok(device) => device,
            Err(err) => {
                last = err;
                continue;
            }
        };
        // SAFETY: an all-zero loop_config is its documented "no options" value.
        let mut config: loop_config = unsafe { std::mem::zeroed() };
        config.fd = file.as_raw_fd() as u32;
        config.info.lo_flags = LO_FLAGS_AUTOCLEAR as u32;
        // SAFETY: `config` is a valid loop_config for the duration of the call; the kernel
        // only reads it.
        let ret = unsafe {
            libc::ioctl(
                device.as_raw_fd(),
                LOOP_CONFIGURE as libc::c_ulong,
                &config as *const loop_config,
            )
        };
        match check(ret.into()) {
            Ok(_) => return Ok((OwnedFd::from(device), path)),
            Err(err) if err.raw_os_error() == Some(libc::EBUSY) => last = err,
            Err(err) => return Err(err),
        }
    }
    Err(last)
}

/// The arguments of a btrfs subvolume ioctl that names a subvolume `name` in the directory it
/// is called on.
fn btrfs_args(name: &str) -> io::Result<linux_raw_sys::btrfs::btrfs_ioctl_vol_args_v2> {
    // SAFETY: all zeros is a valid btrfs_ioctl_vol_args_v2 (no flags, an empty name).
    let mut args: linux_raw_sys::btrfs::btrfs_ioctl_vol_args_v2 = unsafe { std::mem::zeroed() };
    // SAFETY: `name` is the union's member for calls that name a subvolume; writing it is
    // writing bytes into the struct.
    let field = unsafe { &mut args.__bindgen_anon_2.name };
    if name.is_empty() || name.len() >= field.len() || name.contains(['/', '\0']) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("`{name}` cannot name a subvolume"),
        ));
    }
    for (slot, byte) in field.iter_mut().zip(name.bytes()) {
        *slot = byte as libc::c_char;
    }
    Ok(args)
}

/// Calls the btrfs subvolume ioctl `request` on directory `dir` with `args`.
fn btrfs_ioctl(
    dir: BorrowedFd<'_>,
    request: u32,
    args: &linux_raw_sys::btrfs::btrfs_ioctl_vol_args_v2,
) -> io::Result<()> {
    // SAFETY: `args` is a valid btrfs_ioctl_vol_args_v2 for the duration of the call.
    let ret = unsafe {
        libc::ioctl(
            dir.as_raw_fd(),
            request as libc::c_ulong,
            args as *const linux_raw_sys::btrfs::btrfs_ioctl_vol_args_v2,
        )
    };
    check(ret.into()).map(drop)
}

/// Makes `name` in directory `into` a writable snapshot of the btrfs subvolume whose root
/// `source` is: the same tree, its extents shared, whatever it holds (the kernel writes out what
/// is still in memory first).
pub fn btrfs_snapshot(source: BorrowedFd<'_>, into: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    let mut args = btrfs_args(name)?;
    args.fd = i64::from(source.as_raw_fd());
    btrfs_ioctl(into, linux_raw_sys::ioctl::BTRFS_IOC_SNAP_CREATE_V2, &args)
}

/// Removes the btrfs subvolume `name` of directory `parent` with all it holds (its blocks are
/// freed by the file system's cleaner afterwards).
pub fn btrfs_destroy(parent: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    let args = btrfs_args(name)?;
    btrfs_ioctl(
        parent,
        linux_raw_sys::ioctl::BTRFS_IOC_SNAP_DESTROY_V2,
        &args,
    )
}

/// Lets go of what a long-lived helper (a keeper, its host side) needed only to start, once it
/// is set up: the heap's free memory goes back to the system, and the pages of the warden's own
/// code and constants that it touched while starting leave its page tables. Those stay in the
/// page cache, shared with every process that runs them, and come back on the next touch as
/// minor faults; what nothing else maps becomes clean cache the kernel may reclaim. A mapping
/// that holds pages of the process's own (relocated data, anything written) is left as it is.
pub fn let_go_of_startup() {
    drop_startup_code();
    // Last: what reading the mappings allocated (`/proc/self/smaps` is ~100 KiB of text, at the
    // heap's top) is free by now, and goes back with the rest.
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe { libc::malloc_trim(0) };
}

/// The pages of the warden's own code and constants out of this process's page tables (see
/// [`let_go_of_startup`]).
fn drop_startup_code() {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return;
    };
    // The warden's binary: the file of the mapping this function's code is in (by device and
    // inode: a cell's mount namespace may show the path otherwise).
    let here = drop_startup_code as *const () as usize;
    let mut mappings: Vec<(usize, usize, bool, String, u64)> = Vec::new();
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or_default();
        if let Some((start, end)) = first.split_once('-')
            && let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            )
        {
            let perms = fields.next().unwrap_or_default();
            let _offset = fields.next();
            let file = format!(
                "{} {}",
                fields.next().unwrap_or_default(),
                fields.next().unwrap_or_default()
            );
            mappings.push((start, end, !perms.contains('w'), file, u64::MAX));
        } else if let Some(kib) = line.strip_prefix("Anonymous:")
            && let Some(last) = mappings.last_mut()
        {
            last.4 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(u64::MAX);
        }
    }
    let Some(binary) = mappings
        .iter()
        .find(|(start, end, ..)| (*start..*end).contains(&here))
        .map(|m| m.3.clone())
    else {
        return;
    };
    if binary.ends_with(" 0") {
        return; // not a file's
    }
    for (start, end, read_only, file, anonymous) in mappings {
        if read_only && anonymous == 0 && file == binary {
            // SAFETY: the range is a whole mapping of this process, read-only and holding no
            // page of its own: MADV_DONTNEED only drops its page-table entries, and the file's
            // pages come back unchanged on the next touch.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
            }
        }
    }
}

/// How long a helper waits, once set up, before it lets go of its start's pages: a cell is
/// usually used at once (its first exec), and the work should not compete with that.
pub const STARTUP_LINGER: std::time::Duration = std::time::Duration::from_secs(1);

/// When a single-threaded loop (a cell's init, a gVisor cell's host side) lets go of its
/// start: [`STARTUP_LINGER`] after it was made, at a poll's timeout (such a process forks, so no
/// thread of its own does it).
#[derive(Debug)]
pub struct LetGo(Option<std::time::Instant>);

impl LetGo {
    /// Due after [`STARTUP_LINGER`] when `wanted`, else never.
    pub fn after_linger(wanted: bool) -> Self {
        Self(wanted.then(|| std::time::Instant::now() + STARTUP_LINGER))
    }

    /// Lets go of the start, once, when its time has come.
    pub fn when_due(&mut self) {
        if self.0.is_some_and(|at| std::time::Instant::now() >= at) {
            let_go_of_startup();
            self.0 = None;
        }
    }

    /// How long a poll may wait before [`LetGo::when_due`] has work.
    pub fn poll_timeout(&self) -> nix::poll::PollTimeout {
        self.0.map_or(nix::poll::PollTimeout::NONE, |at| {
            let left = at.saturating_duration_since(std::time::Instant::now());
            nix::poll::PollTimeout::try_from(left.as_millis().min(1000) as i32 + 1)
                .unwrap_or(nix::poll::PollTimeout::NONE)
        })
    }
}

/// [`let_go_of_startup`] after [`STARTUP_LINGER`], on a thread of its own in the idle class, for
/// a process that may have threads (a keeper).
pub fn let_go_of_startup_soon() {
    let _ = std::thread::Builder::new().name("let-go".into()).spawn(|| {
        run_when_idle();
        std::thread::sleep(STARTUP_LINGER);
        let_go_of_startup();
    });
}

/// Whether `dir` is on a btrfs file system.
pub fn on_btrfs(dir: &std::path::Path) -> bool {
    const BTRFS_SUPER_MAGIC: i64 = 0x9123_683E;
    rustix::fs::statfs(dir).is_ok_and(|s| s.f_type == BTRFS_SUPER_MAGIC)
}

/// Lets go of a loop device's file (for a device whose mount failed: autoclear needs a mount).
pub fn detach_loop(device: BorrowedFd<'_>) -> io::Result<()> {
    use linux_raw_sys::loop_device::LOOP_CLR_FD;
    // SAFETY: LOOP_CLR_FD takes no argument.
    check(unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CLR_FD as libc::c_ulong) }.into()).map(drop)
}

/// Sets `signal`'s disposition to ignored (kept across exec).
pub fn set_signal_ignored(signal: libc::c_int) -> io::Result<()> {
    // SAFETY: SIG_IGN installs no handler, so nothing runs in signal context.
    let previous = unsafe { libc::signal(signal, libc::SIG_IGN) };
    if previous == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Descriptor moves a child makes with dup2: `(source, number)`.
type Moves = Vec<(RawFd, RawFd)>;

/// Copies of `fds` (`(descriptor, number)`) above every number wanted (and above stdio), so
/// that placing one at its number in a child never overwrites another's source; and the
/// `(copy, number)` moves the child makes with dup2. Keep the copies until the child has
/// started its program.
fn copies_to_place(fds: &[(BorrowedFd<'_>, RawFd)]) -> io::Result<(Vec<OwnedFd>, Moves)> {
    let floor = fds.iter().map(|(_, n)| *n).max().unwrap_or(2).max(2) + 64;
    let mut copies = Vec::with_capacity(fds.len());
    let mut moves = Vec::with_capacity(fds.len());
    for (fd, number) in fds {
        let copy = dup_above(fd.as_raw_fd(), floor)?;
        // SAFETY: `dup_above` made this descriptor; nothing else owns it.
        copies.push(unsafe { OwnedFd::from_raw_fd(copy) });
        moves.push((copy, *number));
    }
    Ok((copies, moves))
}

/// Makes `command` find each descriptor of `fds` at its number (`(descriptor, number)`), and
/// end with the signal `parent_death` when the thread that spawned it goes. Returns the copies
/// the child takes them from: keep them until the command is spawned, then drop them.
pub fn arrange_on_exec(
    command: &mut std::process::Command,
    fds: &[(BorrowedFd<'_>, RawFd)],
    parent_death: Option<libc::c_int>,
) -> io::Result<Vec<OwnedFd>> {
    use std::os::unix::process::CommandExt as _;
    let (copies, moves) = copies_to_place(fds)?;
    // SAFETY: the closure runs in the forked child before exec and calls only dup2 and prctl
    // with integers, both async-signal-safe; it reads a vector allocated before the fork.
    unsafe {
        command.pre_exec(move || {
            for (from, to) in &moves {
                if libc::dup2(*from, *to) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(signal) = parent_death
                && libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong) < 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(copies)
}

/// `chroot(2)` into `dir`, then to its root.
pub fn enter_root(dir: &Path) -> io::Result<()> {
    let path = cstring(dir)?;
    // SAFETY: chroot and chdir read NUL-terminated strings that live across the calls.
    check(unsafe { libc::chroot(path.as_ptr()) }.into())?;
    // SAFETY: as above.
    check(unsafe { libc::chdir(c"/".as_ptr()) }.into()).map(drop)
}

/// Copies the data of a file of `length` bytes, extent by extent: holes are skipped (and stay
/// holes, the target being set to the full length). Returns the bytes of data copied.
/// `allocated`: the bytes the file system holds for the source, where the caller knows them
/// (its `st_blocks` times 512): a file with as many as its length has no hole worth looking
/// for, and is copied without asking where its data is (two `lseek`s, a lookup each in the
/// file system's extent tree; most of a small file's copy).
pub(crate) fn copy_data(
    source: &std::fs::File,
    target: &std::fs::File,
    length: u64,
    allocated: Option<u64>,
) -> std::io::Result<u64> {
    copy_data_over(source, target, length, allocated, 0)
}

/// [`copy_data`] onto a target that holds `old` bytes already, written over in place: the
/// source's holes are punched where the target held data, and the target is truncated only where
/// its size would not come out right (a truncation to zero would have the file system write the
/// file out when it is closed). A target longer than the source is cut before the writes: cut
/// after them, btrfs writes the file out first (its `btrfs_truncate` waits for the written
/// range), which made each such file of a reset a write to the disk.
pub(crate) fn copy_data_over(
    source: &std::fs::File,
    target: &std::fs::File,
    length: u64,
    allocated: Option<u64>,
    old: u64,
) -> std::io::Result<u64> {
    use rustix::fs::FallocateFlags;
    let old = match old > length {
        true => {
            rustix::fs::ftruncate(target, length)?;
            length
        }
        false => old,
    };
    let punch = |from: u64, to: u64| -> std::io::Result<()> {
        let to = to.min(old);
        if from < to {
            rustix::fs::fallocate(
                target,
                FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
                from,
                to - from,
            )?;
        }
        Ok(())
    };
    let mut copied = 0u64;
    // No bigger than the file: a zeroed megabyte for each small file was most of its copy.
    let mut buf = vec![0u8; length.clamp(1, 1 << 20) as usize];
    let mut reached = 0u64;
    // Blocks held past the end (kept by `fallocate`) can make a file with a hole look whole:
    // its hole is then copied as the zeros it reads as, the same content.
    let whole = allocated.is_some_and(|bytes| bytes >= length);
    let extents: Box<dyn Iterator<Item = std::io::Result<(u64, u64)>>> = match whole {
        true => Box::new(std::iter::once(Ok((0, length)))),
        false => Box::new(data_extents(source, length)),
    };
    for extent in extents {
        let (start, end) = extent?;
        punch(reached, start)?;
        let mut offset = start;
        while offset < end {
            let want = buf.len().min((end - offset) as usize);
            let n = rustix::io::pread(source, &mut buf[..want], offset)?;
            if n == 0 {
                break; // shrank meanwhile
            }
            let mut written = 0;
            while written < n {
                written += rustix::io::pwrite(target, &buf[written..n], offset + written as u64)?;
            }
            offset += n as u64;
            copied += n as u64;
        }
        reached = reached.max(offset);
    }
    punch(reached, length)?;
    if old.max(reached) != length {
        rustix::fs::ftruncate(target, length)?;
    }
    Ok(copied)
}

/// The data extents of the first bytes of a file (`SEEK_DATA`/`SEEK_HOLE`), each as
/// `(start, end)`: what is between them are holes. The workspace's apply reads them alike.
pub(crate) use warden_workspace::data_extents;

/// The ids of this process's threads (none where `/proc` cannot be read).
fn thread_ids() -> Vec<libc::pid_t> {
    std::fs::read_dir("/proc/self/task").map_or_else(
        |_| Vec::new(),
        |tasks| {
            tasks
                .flatten()
                .filter_map(|task| task.file_name().to_str()?.parse().ok())
                .collect()
        },
    )
}

/// How many threads this process has, one joined a moment ago not counted: the kernel wakes
/// a thread's joiner (the clear of its id, as it lets go of the memory) before it takes the
/// thread out of the process's list, so the list is looked at again, for 50 ms at most.
pub(crate) fn thread_count_once_joined() -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(50);
    loop {
        let threads = thread_ids().len().max(1);
        if threads == 1 || std::time::Instant::now() >= deadline {
            return threads;
        }
        std::thread::yield_now();
    }
}

/// The thread of this process other than the calling one, where there is exactly one.
pub(crate) fn only_other_thread() -> Option<libc::pid_t> {
    let me = rustix::thread::gettid().as_raw_nonzero().get();
    match thread_ids()
        .into_iter()
        .filter(|&tid| tid != me)
        .collect::<Vec<_>>()[..]
    {
        [other] => Some(other),
        _ => None,
    }
}

/// Keeps the one other thread of this process, just started to work beside the caller, off
/// the caller's CPU (`keep_off_this_cpu`): the scheduler queued a new thread behind its maker
/// on the maker's CPU now and then, while the other idled (traced: 0.4-1.1 ms before it ran,
/// in 17 starts of 40), and the caller goes on working. Best effort.
pub(crate) fn keep_only_other_thread_off_this_cpu() {
    if let (Some(cpus), Some(tid)) = (spread_affinity(), only_other_thread()) {
        keep_off_this_cpu(tid, &cpus);
    }
}

/// The network namespace the calling thread is in.
pub(crate) fn network_namespace_of_this_thread() -> io::Result<OwnedFd> {
    rustix::fs::open(
        "/proc/thread-self/ns/net",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(io::Error::from)
}

/// Moves the calling thread into the network namespace `ns`.
pub(crate) fn enter_network_namespace(ns: BorrowedFd<'_>) -> io::Result<()> {
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)
}

/// Field 22 of /proc/PID/stat: start time in clock ticks after boot.
pub fn process_start_ticks(pid: i32) -> Option<u64> {
    stat_field(pid, 22)
}

/// Field 4 of /proc/PID/stat: the parent's pid.
pub fn parent_of(pid: i32) -> Option<i32> {
    stat_field(pid, 4)
}

/// Field `field` (numbered as in proc_pid_stat(5), from 3) of /proc/PID/stat.
fn stat_field<T: std::str::FromStr>(pid: i32, field: usize) -> Option<T> {
    let stat = read_kernel_file(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; count from its end.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(field.checked_sub(3)?)?.parse().ok()
}

/// The version of the C library this process runs with, where it is glibc ("2.36").
pub fn glibc_version() -> Option<String> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: glibc returns a pointer to a static, NUL-terminated string.
        let version = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
        Some(version.to_string_lossy().into_owned())
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::fd::AsFd as _;

    /// The child's unmount says when it fails: a directory that is no mount point (or, without
    /// the capability, any directory) is an error from `wait`, with the call's errno.
    #[test]
    fn a_detach_in_a_child_that_fails_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let err = Detaching::start(dir.path()).unwrap().wait().unwrap_err();
        assert!(
            matches!(err.raw_os_error(), Some(libc::EINVAL | libc::EPERM)),
            "{err}"
        );
    }

    /// Resident KiB of this process's read-only mappings of the file its code is in.
    fn resident_code_kib() -> u64 {
        let exe = std::fs::metadata("/proc/self/exe").unwrap();
        let id = format!("{}", std::os::unix::fs::MetadataExt::ino(&exe));
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut total = 0;
        let mut ours = false;
        for line in smaps.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields
                .first()
                .is_some_and(|f| f.contains('-') && !f.ends_with(':'))
            {
                ours = fields.get(4) == Some(&id.as_str()) && !fields[1].contains('w');
            } else if ours && fields.first() == Some(&"Rss:") {
                total += fields[1].parse::<u64>().unwrap();
            }
        }
        total
    }

    #[test]
    fn letting_go_of_startup_drops_the_code_pages_and_keeps_everything_working() {
        // Touch a good part of the binary's code and constants first, as a keeper's start does
        // (policies, their rules, serde).
        let text = format!("{:?}", (1..200).map(|i| i.to_string()).collect::<Vec<_>>());
        for name in ["default", "python", "node", "rust"] {
            let policy = warden_policy::preset(name).unwrap();
            let compiled = warden_egress::Rules::compile(&policy.network);
            assert!(compiled.is_ok(), "{name}");
            assert!(!serde_json::to_string(&policy).unwrap().is_empty());
        }
        let before = resident_code_kib();
        let_go_of_startup();
        let after = resident_code_kib();
        // What is back is what the look itself ran (with the kernel's fault-around).
        assert!(
            after + 1024 < before,
            "{before} KiB resident before, {after} after"
        );
        // Relocated data (vtables, formatting) and code are whole: they come back as they were.
        let again = format!("{:?}", (1..200).map(|i| i.to_string()).collect::<Vec<_>>());
        assert_eq!(text, again);
        let error: Box<dyn std::error::Error> = Box::new(io::Error::other("still here"));
        assert_eq!(error.to_string(), "still here");
    }

    /// The process group of process `pid` (field 5 of /proc/PID/stat).
    fn group_of(pid: libc::pid_t) -> libc::pid_t {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.split(' ').nth(2).unwrap().parse().unwrap()
    }

    #[test]
    fn spawn_places_descriptors_groups_and_the_parent_death_signal() {
        use std::io::Read as _;
        let (to_read, to_write) = pipe().unwrap();
        let (out_r, out_w) = pipe().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        let argv = ["sh", "-c", "echo placed >&3; exec sleep 30"].map(std::ffi::OsString::from);
        let start = |own_group: bool, parent_death: Option<libc::c_int>| {
            spawn(&Spawn {
                program: Path::new("/bin/sh"),
                argv: &argv,
                env: &[],
                cwd: None,
                stdio: Some([null.as_fd(), out_w.as_fd(), out_w.as_fd()]),
                landlock: None,
                fds: &[(to_write.as_fd(), 3)],
                cgroups: &[],
                parent_death,
                own_group,
                ignored: None,
            })
            .unwrap()
        };
        // Descriptor 3 is the pipe; the process stays in the caller's group.
        let pid = start(false, None);
        let mut said = [0u8; 7];
        let came = wait_readable(to_read.as_fd(), std::time::Duration::from_secs(10)).unwrap();
        assert!(came, "nothing came on descriptor 3");
        std::fs::File::from(to_read.try_clone().unwrap())
            .read_exact(&mut said)
            .unwrap();
        assert_eq!(&said, b"placed\n");
        assert_eq!(group_of(pid), group_of(std::process::id() as i32));
        let pid_fd = pidfd_open(pid).unwrap();
        pidfd_send_signal(&pid_fd, libc::SIGKILL).unwrap();
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        // A group of its own; and the signal comes when the thread that started it ends.
        let started = std::thread::scope(|scope| {
            scope
                .spawn(|| start(true, Some(libc::SIGTERM)))
                .join()
                .unwrap()
        });
        assert_eq!(group_of(started), started);
        let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(started), None).unwrap();
        assert_eq!(
            status,
            nix::sys::wait::WaitStatus::Signaled(
                nix::unistd::Pid::from_raw(started),
                nix::sys::signal::Signal::SIGTERM,
                false
            )
        );
        drop((out_r, to_read));
    }

    /// The child's ignored signals (`SigIgn` of its status) when spawned with `ignored`.
    fn ignored_in_child(ignored: Option<&[libc::c_int]>) -> u64 {
        use std::io::Read as _;
        let (out_r, out_w) = pipe().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        let shell = Described {
            program: "/bin/sh".into(),
            argv: ["sh", "-c", "grep SigIgn /proc/self/status"]
                .map(Into::into)
                .to_vec(),
            env: Vec::new(),
            cwd: None,
        };
        let pid = spawn(&Spawn {
            ignored,
            ..shell.spawn_with([null.as_fd(), out_w.as_fd(), out_w.as_fd()])
        })
        .unwrap();
        drop(out_w);
        let mut said = String::new();
        std::fs::File::from(out_r)
            .read_to_string(&mut said)
            .unwrap();
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        let hex = said.trim().strip_prefix("SigIgn:").unwrap().trim();
        u64::from_str_radix(hex, 16).unwrap()
    }

    #[test]
    fn the_kernels_mask_of_ignored_signals_says_what_asking_says() {
        // The test harness ignores SIGPIPE; one more is ignored here for the comparison, and
        // put back after (no test of this binary relies on SIGURG's disposition).
        // SAFETY: SIG_IGN installs no handler; the previous disposition is put back.
        let before = unsafe { libc::signal(libc::SIGURG, libc::SIG_IGN) };
        let (read, asked) = (ignored_by_status(), ignored_by_asking());
        // SAFETY: the disposition that was there, put back.
        unsafe { libc::signal(libc::SIGURG, before) };
        assert_eq!(read.as_deref(), Some(asked.as_slice()));
        assert!(
            asked.contains(&libc::SIGPIPE) && asked.contains(&libc::SIGURG),
            "{asked:?}"
        );
    }

    #[test]
    fn a_spawned_program_ignores_no_signal_the_caller_ignored() {
        // The test harness, like every Rust program, ignores SIGPIPE.
        let pipe_bit = 1u64 << (libc::SIGPIPE - 1);
        let ignored = ignored_signals();
        assert!(ignored.contains(&libc::SIGPIPE), "{ignored:?}");
        // Asked in the child, or named by the caller: SIGPIPE is at its default again (the
        // shell itself ignores none of bits 0-14 unless told to).
        assert_eq!(ignored_in_child(None) & pipe_bit, 0);
        assert_eq!(ignored_in_child(Some(&ignored)) & pipe_bit, 0);
        // Only the named ones are reset: an empty list leaves SIGPIPE ignored.
        assert_ne!(ignored_in_child(Some(&[])) & pipe_bit, 0);
    }

    #[test]
    fn a_listener_that_stopped_accepting_is_reported_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stuck.sock");
        let _listener = seqpacket_listen(&path).unwrap();
        // Nobody accepts: the queue fills, and the next connect fails instead of waiting.
        let mut kept = Vec::new();
        let refused = loop {
            match seqpacket_connect(&path) {
                Ok(socket) => kept.push(socket),
                Err(err) => break err,
            }
            assert!(kept.len() < 10_000, "connect never refused");
        };
        assert_eq!(refused.kind(), io::ErrorKind::WouldBlock, "{refused}");
        assert!(kept.len() >= 128, "{}", kept.len());
        // A connected socket is blocking again.
        let flags = nix::fcntl::fcntl(&kept[0], nix::fcntl::FcntlArg::F_GETFL).unwrap();
        assert_eq!(flags & libc::O_NONBLOCK, 0);
    }

    /// A copy keeps a source's holes as holes, whether or not the caller says how much the
    /// source holds (a sparse file holds less than its length), and a fully written source is
    /// copied whole without looking for holes; written over a longer file with data where the
    /// source has a hole, the result reads as the source does.
    #[test]
    fn copies_keep_holes_and_come_out_as_the_source_reads() {
        use std::io::Write as _;
        use std::os::unix::fs::{FileExt as _, MetadataExt as _};
        let dir = tempfile::tempdir().unwrap();
        let sparse = dir.path().join("sparse");
        let file = std::fs::File::create(&sparse).unwrap();
        file.write_all_at(b"A", 0).unwrap();
        file.write_all_at(b"B", 4 << 20).unwrap();
        drop(file);
        let dense = dir.path().join("dense");
        std::fs::File::create(&dense)
            .unwrap()
            .write_all(&vec![b'd'; 10_000])
            .unwrap();
        for (source, name) in [(&sparse, "sparse"), (&dense, "dense")] {
            let from = std::fs::File::open(source).unwrap();
            let meta = from.metadata().unwrap();
            for allocated in [None, Some(meta.blocks() * 512)] {
                let to_path = dir.path().join(format!("{name}-copy"));
                // Something longer, all data, to be written over.
                std::fs::write(&to_path, vec![b'x'; (5 << 20) + 7]).unwrap();
                let to = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&to_path)
                    .unwrap();
                let old = to.metadata().unwrap().len();
                copy_data_over(&from, &to, meta.len(), allocated, old).unwrap();
                drop(to);
                assert_eq!(
                    std::fs::read(&to_path).unwrap(),
                    std::fs::read(source).unwrap(),
                    "{name}, {allocated:?}"
                );
                if name == "sparse" {
                    let held = std::fs::metadata(&to_path).unwrap().blocks() * 512;
                    assert!(
                        held < 1 << 20,
                        "the copy of a sparse file holds {held} bytes"
                    );
                }
                std::fs::remove_file(&to_path).unwrap();
            }
        }
    }
}
