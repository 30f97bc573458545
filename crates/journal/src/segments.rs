//! The journal's files: the active segment and the closed ones, named by their first entry.

/// The active segment inside the journal directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";

/// The name of a closed segment whose first entry is `first_seq`.
pub(crate) fn segment_name(first_seq: u64) -> String {
    format!("journal-{first_seq:020}.jsonl")
}

/// The first sequence number a closed segment's path names (`journal-<seq>.jsonl`); none for
/// the active segment or a file that is not a segment.
pub fn segment_first_seq(path: &std::path::Path) -> Option<u64> {
    path.file_name()?
        .to_str()?
        .strip_prefix("journal-")?
        .strip_suffix(".jsonl")?
        .parse()
        .ok()
}

/// The journal's segments in chain order: the closed ones, oldest first, then the active one
/// (when it exists).
pub fn segments(dir: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut closed: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("journal-"))
                .and_then(|n| n.strip_suffix(".jsonl"))
                .is_some_and(|seq| seq.len() == 20 && seq.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    closed.sort();
    let active = dir.join(JOURNAL_FILE);
    if active.exists() {
        closed.push(active);
    }
    Ok(closed)
}

/// Opens (making it, mode 0600, where it is not there) one of the journal's own files for
/// reading and writing, without cutting it.
pub(crate) fn open_own(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
}

/// A journal file's inode number and length, asked of the kernel without its times.
///
/// A look at a file's change time has the kernel give that file's next write a fine-grained
/// time stamp (multigrain time stamps, Linux 6.13) where the coarse clock would show no change
/// (the file was written within this tick, as the segment is by back-to-back entries); and a
/// fine-grained stamp moves the clock that every file written after it sees, where it would
/// otherwise move once a tick. On an ext4 without a journal, a write that moves a file's time
/// ties its inode's block to it, which the `fdatasync` of the ring then writes as well: a
/// third request to the disk, one after the other, on most rounds. A `metadata()` asks for
/// every field, the times included.
pub(crate) fn shape(file: &impl std::os::fd::AsFd) -> std::io::Result<(u64, u64)> {
    shape_of(file.as_fd(), "".as_ref(), rustix::fs::AtFlags::EMPTY_PATH)
}

/// As `shape`, of the file at `path` (its symbolic link followed).
pub(crate) fn shape_at(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    shape_of(rustix::fs::CWD, path, rustix::fs::AtFlags::empty())
}

fn shape_of(
    dir: std::os::fd::BorrowedFd<'_>,
    path: &std::path::Path,
    flags: rustix::fs::AtFlags,
) -> std::io::Result<(u64, u64)> {
    use rustix::fs::StatxFlags;
    let stat = rustix::fs::statx(dir, path, flags, StatxFlags::INO | StatxFlags::SIZE)?;
    Ok((stat.stx_ino, stat.stx_size))
}
