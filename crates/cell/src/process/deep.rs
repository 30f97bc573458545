//! For tests of the walks over a cell's tree: trees deeper than a path can name, and a thread
//! with the stack of a daemon's worker.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

/// Makes a chain of `levels` directories `d` below `top`, one level at a time (a path from
/// the top would pass PATH_MAX), with a file at its bottom.
pub(crate) fn deep_chain(top: &Path, levels: usize) {
    use rustix::fs::{Mode, OFlags, mkdirat, openat};
    let flags = OFlags::DIRECTORY | OFlags::RDONLY;
    let mut dir = openat(rustix::fs::CWD, top, flags, Mode::empty()).unwrap();
    for _ in 0..levels {
        mkdirat(&dir, "d", Mode::from_raw_mode(0o755)).unwrap();
        dir = openat(&dir, "d", flags, Mode::empty()).unwrap();
    }
    let file = openat(
        &dir,
        "deep.txt",
        OFlags::CREATE | OFlags::WRONLY,
        Mode::from_raw_mode(0o644),
    );
    drop(file.unwrap());
}

/// Runs `f` on a thread with a 2 MiB stack, a daemon's worker thread's.
pub(crate) fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}
