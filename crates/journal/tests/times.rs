//! The journal and the clock other files' writes see. In a test binary of its own: the lib's
//! tests, running beside it, look at files' times and write them all the while.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::{self, File};
use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use serde_json::json;
use warden_journal::{Journal, Segments};

/// An append asks the kernel for no file's times. On a kernel with multigrain time stamps
/// (Linux 6.13) a look at a file's change time has its next write take a fine-grained stamp
/// where the coarse clock would not show a change (the file was written within this tick),
/// and that stamp moves the clock that every file written after it sees: on an ext4 without
/// a journal, each such move has the `fdatasync` of the journal's ring write its inode as
/// well. File `b`, written after the append, would then have a later time than `a`, written
/// before it, even within one tick of the clock. Within one tick and with nothing else on the
/// host asking, the two are equal; the rounds allow for a tick between them, or another
/// process's stamp.
#[test]
fn an_append_moves_no_other_files_time() {
    let dir = tempfile::tempdir().unwrap();
    let segments = Segments {
        ring: 64 * 1024,
        ..Default::default()
    };
    let journal = Journal::open_deferred(dir.path(), segments).unwrap();
    journal.append(None, "t.first", json!({})).unwrap();
    // A pair of files for each round, made before: a file whose times were looked at takes a
    // fine-grained stamp at its next write itself, so none is written again once looked at.
    let probes = tempfile::tempdir().unwrap();
    let rounds_at_most = 200;
    let mut pairs: Vec<_> = (0..rounds_at_most)
        .map(|n| {
            let (a, b) = (
                probes.path().join(format!("a{n}")),
                probes.path().join(format!("b{n}")),
            );
            let files = (File::create(&a).unwrap(), File::create(&b).unwrap());
            (a, b, files)
        })
        .collect();
    let time = |path: &Path| {
        let meta = fs::metadata(path).unwrap();
        (meta.mtime(), meta.mtime_nsec())
    };
    let mut rounds = Vec::new();
    for (n, (a, b, (a_file, b_file))) in pairs.iter_mut().enumerate() {
        // The segment written within this tick, then again after `a`: a look at its times
        // between the two would have that second write take a fine-grained stamp.
        journal.append(None, "t.before", json!({ "n": n })).unwrap();
        a_file.write_all(b"a").unwrap();
        journal.append(None, "t.probe", json!({ "n": n })).unwrap();
        b_file.write_all(b"b").unwrap();
        // Asked only now, after both writes.
        let (a_time, b_time) = (time(a), time(b));
        if a_time == b_time {
            return;
        }
        rounds.push((a_time, b_time));
    }
    panic!("every round's append moved the clock that other files' writes see: {rounds:?}");
}
