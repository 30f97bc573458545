//! No set-id bits from a gVisor cell onto the host. Inside the sandbox a `chmod 4755` succeeds
//! (gVisor's kernel allows it, as Linux does), and runsc's gofer, a root process of the host,
//! writes the mode onto the real file: in the cell's layer (on the host's root file system with
//! `--disk none`, reachable by anyone) or in a writable host path of the policy, owned by the
//! host id equal to the cell's user (1000 by default, 0 with `process: {user: 0}`). Any host
//! user could then run it as that id. The process tier refuses these modes with its seccomp
//! filter in the cell; a gVisor cell's processes make no host system calls, so the same
//! refusal is put on runsc instead: a filter that every process runsc starts inherits (the
//! sandbox, the gofer, the ptrace stubs), under which a mode with a set-id bit is refused with
//! EPERM, whatever the file and wherever it lies, and the cell's `chmod` fails as it does on the
//! process tier.
// Installing a seccomp filter is a raw system call (seccompiler's own sets `no_new_privs`).
#![allow(unsafe_code)]

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op,
    SeccompCondition as Cond, SeccompFilter, SeccompRule, TargetArch,
};

const SETUID: u64 = libc::S_ISUID as u64;
const SETGID: u64 = libc::S_ISGID as u64;
/// `fchmodat2` (Linux 6.6), which libc does not name yet.
const FCHMODAT2: i64 = 452;
const BPF_RET_K: u16 = 0x06;
/// seccompiler's program starts with its architecture check, whose third instruction ends a
/// process of another architecture.
const ARCH_MISMATCH: usize = 2;

/// The filter: every call that sets a mode (`chmod` family; `open`, `openat`, `creat`,
/// `mknod` and `mknodat` by their mode argument) is refused with EPERM where the mode has a
/// set-id bit, and everything else is allowed. (`openat2` takes its mode in a structure a
/// filter cannot read; this runsc, Debian 12's, never calls it.)
pub fn filter() -> Result<BpfProgram, String> {
    let cond = |arg: u8, bit: u64| {
        Cond::new(arg, Len::Dword, Op::MaskedEq(bit), bit).map_err(|e| e.to_string())
    };
    let mode_rules = |arg: u8| -> Result<Vec<SeccompRule>, String> {
        [SETUID, SETGID]
            .into_iter()
            .map(|bit| SeccompRule::new(vec![cond(arg, bit)?]).map_err(|e| e.to_string()))
            .collect()
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (nr, mode_arg) in [
        (libc::SYS_chmod, 1),
        (libc::SYS_fchmod, 1),
        (libc::SYS_fchmodat, 2),
        (FCHMODAT2, 2),
        (libc::SYS_creat, 1),
        (libc::SYS_open, 2),
        (libc::SYS_openat, 3),
        (libc::SYS_mknod, 1),
        (libc::SYS_mknodat, 2),
    ] {
        rules.insert(nr, mode_rules(mode_arg)?);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| e.to_string())?;
    let mut program: BpfProgram = filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
    // A call of another architecture is let through rather than ending its process: none of
    // runsc's own calls is one, and an `int 0x80` of the cell's, made in a ptrace stub, is
    // emulated by gVisor, not run by the host (where this filter would have killed the stub).
    match program.get_mut(ARCH_MISMATCH) {
        Some(ret) if ret.code == BPF_RET_K && ret.k == libc::SECCOMP_RET_KILL_PROCESS => {
            ret.k = libc::SECCOMP_RET_ALLOW;
        }
        _ => return Err("seccompiler's architecture check has changed".to_owned()),
    }
    Ok(program)
}

/// Puts the filter on the calling thread, for good: the threads it starts and the processes it
/// spawns from here on (runsc) have it too. The keeper is root, which may install a filter
/// without `no_new_privs` (runsc's start is then exactly as before, privileges and all).
pub fn confine_calling_thread(program: &BpfProgram) -> std::io::Result<()> {
    let fprog = libc::sock_fprog {
        len: u16::try_from(program.len()).map_err(|_| std::io::Error::other("filter too long"))?,
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `fprog` points at `program`, alive for the call; the kernel copies it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &fprog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// In a child under the filter: a set-id mode is refused on every path (a new file's, a
    /// `chmod`'s, a `mknod`'s), and plain modes work.
    #[test]
    fn set_id_modes_are_refused_under_the_filter_and_plain_ones_are_not() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("program");
        std::fs::write(&file, b"#!/bin/sh\n").unwrap();
        let program = filter().unwrap();
        let c = |path: &std::path::Path| {
            std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap()
        };
        let (file_c, new_c, node_c) = (
            c(&file),
            c(&dir.path().join("new")),
            c(&dir.path().join("node")),
        );
        // SAFETY: the child makes system calls only (no allocation, no lock) and `_exit`s.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            // SAFETY: plain system calls on valid C strings.
            let code = unsafe {
                // `no_new_privs`, so that the test needs no root.
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                if confine_calling_thread(&program).is_err() {
                    libc::_exit(10);
                }
                let refused = |rc: libc::c_int| rc == -1 && errno() == libc::EPERM;
                if !refused(libc::chmod(file_c.as_ptr(), 0o4755)) {
                    libc::_exit(11);
                }
                if !refused(libc::chmod(file_c.as_ptr(), 0o2755)) {
                    libc::_exit(12);
                }
                let fd = libc::open(file_c.as_ptr(), libc::O_RDONLY);
                if !refused(libc::fchmod(fd, 0o6755)) {
                    libc::_exit(13);
                }
                if !refused(libc::open(
                    new_c.as_ptr(),
                    libc::O_CREAT | libc::O_WRONLY,
                    0o4755,
                )) {
                    libc::_exit(14);
                }
                if !refused(libc::mknod(node_c.as_ptr(), libc::S_IFREG | 0o4755, 0)) {
                    libc::_exit(15);
                }
                if libc::fchmod(fd, 0o755) != 0 {
                    libc::_exit(16);
                }
                0
            };
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "{status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "the check that failed");
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o755);
        assert!(!dir.path().join("new").exists() && !dir.path().join("node").exists());
    }
}
