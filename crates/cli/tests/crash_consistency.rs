//! Killing the warden (SIGKILL) in the middle of what changes the host directory or the
//! warden's state: what was acknowledged stays, nothing half done is left visible as done.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::*;

/// The record of host entries a recovery put back (which the conflict check then knows).
const RESTORED: &str = ".warden-apply-restored.json";

/// Every entry under `root` with what it is: a directory and its mode, a file's mode and
/// content, a symlink's target.
fn host_tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            if rel == RESTORED {
                continue;
            }
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let mode = meta.permissions().mode() & 0o7777;
            let what = if meta.is_dir() {
                stack.push(path);
                format!("dir {mode:o}")
            } else if meta.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(&path).unwrap().display())
            } else {
                format!(
                    "file {mode:o} {}",
                    String::from_utf8_lossy(&std::fs::read(&path).unwrap())
                )
            };
            out.insert(rel, what);
        }
    }
    out
}

/// Makes `dir` hold exactly `tree` (as `host_tree` gives it).
fn make_tree(dir: &Path, tree: &BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if std::fs::symlink_metadata(&path).unwrap().is_dir() {
            std::fs::remove_dir_all(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }
    // Sorted by name: a directory comes before what it holds.
    for (rel, what) in tree {
        let path = dir.join(rel);
        if let Some(mode) = what.strip_prefix("dir ") {
            std::fs::create_dir(&path).unwrap();
            let mode = u32::from_str_radix(mode, 8).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        } else if let Some(target) = what.strip_prefix("-> ") {
            std::os::unix::fs::symlink(target, &path).unwrap();
        } else {
            let rest = what.strip_prefix("file ").unwrap();
            let (mode, content) = rest.split_once(' ').unwrap();
            std::fs::write(&path, content).unwrap();
            let mode = u32::from_str_radix(mode, 8).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
    }
}

/// Removes the cell `0` however the test ends.
struct Removed(String);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = warden().args(["rm", "--force", &self.0]).output();
    }
}

fn staging_left(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".warden-apply") && n != RESTORED)
        .collect()
}

/// How many of the entries the apply changes differ from what they were (by inode, or by
/// being there at all), the staging folder left out.
fn changed_count(dir: &Path, before: &BTreeMap<String, Option<(u64, u32)>>) -> usize {
    before
        .iter()
        .filter(|(rel, was)| {
            let now = std::fs::symlink_metadata(dir.join(rel))
                .ok()
                .map(|m| (m.ino(), m.mode()));
            now != **was
        })
        .count()
}

/// An apply of many changes (files replaced, deleted and added, a directory replaced by a file
/// and a file by a directory, a directory made, modes changed), killed with SIGKILL at many
/// points from its first step to its last: the next `warden diff` finds the host directory
/// exactly as it was before (rolled back) or exactly as the apply leaves it (committed), never
/// a mix, and no staging folder left; the next apply then applies it all.
#[test]
fn an_apply_killed_at_any_point_is_rolled_back_whole_or_was_done_whole() {
    let ws = tempdir();
    let dir = ws.path();
    for i in 0..40 {
        std::fs::write(dir.join(format!("r{i:02}")), format!("old {i}\n")).unwrap();
        std::fs::write(dir.join(format!("x{i:02}")), format!("doomed {i}\n")).unwrap();
    }
    std::fs::create_dir_all(dir.join("tree/deep")).unwrap();
    for i in 0..5 {
        std::fs::write(dir.join(format!("tree/deep/t{i}")), "in the tree\n").unwrap();
    }
    std::fs::write(dir.join("plain"), "a file that becomes a directory\n").unwrap();
    std::fs::write(dir.join("mode.sh"), "echo\n").unwrap();
    let old = host_tree(dir);
    let name = unique("killapply");
    let _removed = Removed(name.clone());
    let script = "cd /workspace && \
        for i in $(seq -w 0 39); do echo \"new $i\" > r$i; rm x$i; echo added > n$i; done && \
        rm -r tree && echo 'now a file' > tree && rm plain && mkdir -p plain/sub && \
        echo inside > plain/sub/f && mkdir -p fresh/a/b && echo b > fresh/a/b/f && \
        ln -s r00 link && chmod 700 mode.sh";
    let ran = run_sh(
        &["--name", &name, "--workspace", dir.to_str().unwrap()],
        script,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let apply = || {
        warden()
            .args(["apply", "--force", "--include-sensitive", &name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    // What every change touches, to see how far an apply has come.
    let watched: Vec<String> = (0..40)
        .flat_map(|i| [format!("r{i:02}"), format!("x{i:02}"), format!("n{i:02}")])
        .chain(["tree", "plain", "fresh", "link", "mode.sh"].map(str::to_owned))
        .collect();
    let stat = |rel: &String| {
        std::fs::symlink_metadata(dir.join(rel))
            .ok()
            .map(|m| (m.ino(), m.mode()))
    };
    let (mut rolled_back, mut committed, mut midway) = (0, 0, 0);
    let mut new = None;
    let kills = 8;
    for attempt in 0..kills {
        let before: BTreeMap<String, Option<(u64, u32)>> =
            watched.iter().map(|rel| (rel.clone(), stat(rel))).collect();
        // The kill lands once the apply made its staging folder and then changed `target` of
        // the entries it changes: from none (before its first step) to all of them (before it
        // cleans up).
        let target = attempt * watched.len() / (kills - 1);
        let mut child = apply();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut staged = false;
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            staged = staged || !staging_left(dir).is_empty();
            if staged && changed_count(dir, &before) >= target {
                break;
            }
            std::thread::yield_now();
        }
        let _ = child.kill();
        let status = child.wait().unwrap();
        let reached = changed_count(dir, &before);
        if status.code().is_none() && reached > 0 && reached < watched.len() {
            midway += 1;
        }
        // The recovery: any warden command that reads the host directory.
        let ran = Ran::from(warden().args(["diff", &name]).output().unwrap());
        assert_eq!(ran.code, 0, "{ran:?}");
        let now = host_tree(dir);
        let left = staging_left(dir);
        let no_staging = || {
            assert_eq!(
                left,
                Vec::<String>::new(),
                "staging left after the apply killed at {target} (attempt {attempt}, {status})"
            );
        };
        if now == old {
            no_staging();
            rolled_back += 1;
            continue;
        }
        match &new {
            None => new = Some(now.clone()),
            Some(new) => assert_eq!(&now, new, "attempt {attempt}"),
        }
        let mixed: Vec<_> = now
            .iter()
            .filter(|(rel, what)| old.get(*rel) == Some(what))
            .filter(|(rel, _)| watched.contains(rel))
            .map(|(rel, _)| rel.clone())
            .collect();
        assert!(
            mixed.is_empty() && !now.contains_key("x00") && now.contains_key("fresh/a/b/f"),
            "a mix after the apply killed at {target} (attempt {attempt}, {status}): \
             old still: {mixed:?}"
        );
        no_staging();
        committed += 1;
        // Back to the start for the next kill.
        make_tree(dir, &old);
    }
    assert!(midway >= kills / 2, "{midway} kills landed midway");
    assert!(rolled_back >= kills / 2, "{rolled_back} rolled back");
    // The next apply finds nothing of the killed ones in its way.
    let ran = Ran::from(
        warden()
            .args(["apply", "--force", "--include-sensitive", &name])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let done = host_tree(dir);
    if let Some(new) = &new {
        assert_eq!(&done, new);
    }
    assert_eq!(
        done.get("r07").map(String::as_str),
        Some("file 644 new 07\n")
    );
    assert_eq!(
        done.get("mode.sh").map(String::as_str),
        Some("file 700 echo\n")
    );
    assert!(!done.contains_key("x13") && done.contains_key("plain/sub/f"));
    assert!(staging_left(dir).is_empty());
    eprintln!("{rolled_back} kills rolled back ({midway} midway), {committed} found committed");
}

/// A daemon killed during an apply of one of its cells undoes it as it starts again: the host
/// directory is all old, with no staging folder, before any diff or apply of it (until then
/// it had stayed half applied).
#[test]
fn a_daemon_killed_during_an_apply_undoes_it_as_it_starts() {
    let mut daemon = support::daemon::Daemon::start(&[]);
    let ws = tempdir();
    let dir = ws.path();
    for i in 0..60 {
        std::fs::write(dir.join(format!("r{i:02}")), format!("old {i}\n")).unwrap();
    }
    let old = host_tree(dir);
    let name = unique("killdaemonapply");
    let ran = Ran::from(
        daemon
            .warden()
            .args(["run", "--name", &name, "--workspace", dir.to_str().unwrap()])
            .args([
                "--",
                "sh",
                "-c",
                "cd /workspace && for i in $(seq -w 0 59); do echo \"new $i\" > r$i; rm -f x; done",
            ])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let watched: Vec<String> = (0..60).map(|i| format!("r{i:02}")).collect();
    let before: BTreeMap<String, Option<(u64, u32)>> = watched
        .iter()
        .map(|rel| {
            let meta = std::fs::symlink_metadata(dir.join(rel)).ok();
            (rel.clone(), meta.map(|m| (m.ino(), m.mode())))
        })
        .collect();
    let mut apply = daemon
        .warden()
        .args(["apply", "--force", &name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed once its staging folder is there and it has changed some of the files.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let reached = changed_count(dir, &before);
        if !staging_left(dir).is_empty() && reached > 0 && reached < watched.len() {
            break;
        }
        std::thread::yield_now();
    }
    daemon.crash();
    let _ = apply.wait();
    let reached = changed_count(dir, &before);
    assert!(
        reached > 0 && reached < watched.len() && !staging_left(dir).is_empty(),
        "the kill did not land midway ({reached} of {} changed)",
        watched.len()
    );
    daemon.restart();
    assert_eq!(
        host_tree(dir),
        old,
        "the host directory stayed half applied"
    );
    assert_eq!(staging_left(dir), Vec::<String>::new());
    let ran = Ran::from(
        daemon
            .warden()
            .args(["rm", "--force", &name])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 0, "{ran:?}");
}
