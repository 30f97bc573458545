//! A compatibility shim preloaded into the processes of gVisor cells (`/etc/ld.so.preload`).
//!
//! The runsc of Debian 12 (2022) refuses `statx` with `AT_NO_AUTOMOUNT` (EINVAL), a flag
//! nothing in a cell needs (it has no automounts) and GNU coreutils always passes: `ls`,
//! `stat`, `cp`... would fail on every path. glibc's `statx` wrapper is replaced here by one
//! that asks again without the flag when the sandbox refuses it. Built by `build.rs` as a
//! shared object without the standard library; it needs only the C library it is loaded into.

#![no_std]

use core::ffi::{c_char, c_int, c_long, c_uint, c_void};

unsafe extern "C" {
    fn syscall(number: c_long, ...) -> c_long;
    fn __errno_location() -> *mut c_int;
}

const SYS_STATX: c_long = 332;
const AT_NO_AUTOMOUNT: c_int = 0x800;
const EINVAL: c_int = 22;

/// `statx(2)` as glibc declares it.
///
/// # Safety
/// The caller's pointers, as for the system call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut c_void,
) -> c_int {
    // SAFETY: the system call with the caller's own arguments; errno is the thread's.
    unsafe {
        let mut result = syscall(SYS_STATX, dirfd as c_long, path, flags as c_long, mask as c_long, buf);
        if result < 0 && *__errno_location() == EINVAL && flags & AT_NO_AUTOMOUNT != 0 {
            let flags = flags & !AT_NO_AUTOMOUNT;
            result = syscall(SYS_STATX, dirfd as c_long, path, flags as c_long, mask as c_long, buf);
        }
        result as c_int
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}
