//! Images as a cell's root, end to end: an image built here from the host's own `sh` and the
//! libraries it loads (two layers, the second with a whiteout), imported with `warden image
//! import`, run as a cell with `image: NAME`; and hostile archives refused by the CLI with
//! nothing written outside the store.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;
use support::*;

/// `/bin/sh` of the host and what `ldd` says it loads, at their paths, with the image's own
/// `/etc` files.
fn shell_layer() -> Vec<u8> {
    host_shell_layer(&[
        ("etc/hello", 0o644, b"hello from the image\n"),
        // The user the configuration names, by name.
        (
            "etc/passwd",
            0o644,
            b"root:x:0:0::/root:/bin/sh\napp:x:2345:2346::/srv:/bin/sh\n",
        ),
        ("etc/group", 0o644, b"root:x:0:\napp:x:2346:\n"),
        ("etc/gone", 0o644, b"the second layer removes this\n"),
    ])
}

fn second_layer() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    tar_file(&mut b, "etc/.wh.gone", 0o644, b"");
    tar_file(&mut b, "srv/data", 0o644, b"layer two\n");
    b.into_inner().unwrap()
}

/// A `docker save` archive of these layers with the configuration the tests read back.
fn docker_archive(dir: &Path, layers: &[Vec<u8>], tag: &str) -> PathBuf {
    support::docker_archive(
        dir,
        layers,
        tag,
        json!({ "Env": ["GREETING=from-the-image", "PATH=/bin"], "WorkingDir": "/srv", "User": "app" }),
    )
}

fn warden_in(state: &Path) -> Command {
    let mut cmd = warden();
    cmd.env("WARDEN_STATE_DIR", state);
    cmd
}

#[test]
fn an_image_built_from_host_files_runs_as_a_cell() {
    if !cgroups_available("image_root") {
        return;
    }
    let dir = tempdir();
    // A root-started cell's setup runs as an unprivileged id: it must reach the layers.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let state = dir.path().join("state");
    let archive = docker_archive(dir.path(), &[shell_layer(), second_layer()], "mini:1");
    let import = warden_in(&state)
        .args(["image", "import"])
        .arg(&archive)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&import.stdout);
    assert!(
        import.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&import.stderr)
    );
    assert!(
        said.contains("imported mini:1") && said.contains("2 layers"),
        "{said}"
    );
    let ls = warden_in(&state)
        .args(["image", "ls", "--json"])
        .output()
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert_eq!(listed[0]["name"], "mini:1");

    let workspace = tempdir();
    let policy = policy(
        dir.path(),
        "version: 1\nimage: mini:1\nprocess:\n  env:\n    set:\n      MINE: from-the-policy\n",
    );
    let script = "while read -r line; do echo \"$line\"; done < /etc/hello; \
                  echo \"greeting=$GREETING mine=$MINE path=$PATH\"; \
                  test -e /etc/gone && echo GONE-IS-THERE; \
                  test -e /usr/bin/python3 && echo HOST-USR-SEEN; \
                  while read -r line; do echo \"$line\"; done < /srv/data; \
                  echo made > /workspace/out.txt && echo wrote";
    // Who it runs as and where it starts, as the kernel says.
    let identity = "while read -r k v rest; do case $k in Uid:|Gid:) echo \"$k$v\";; esac; \
                    done < /proc/self/status; echo \"cwd=$(pwd)\"";
    let ran = warden_in(&state)
        .arg("run")
        .arg("--policy")
        .arg(&policy)
        .arg("-w")
        .arg(workspace.path())
        .args(["--", "/bin/sh", "-c", script])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    let err = String::from_utf8_lossy(&ran.stderr);
    assert!(ran.status.success(), "{out}{err}");
    assert!(out.contains("hello from the image"), "{out}");
    assert!(
        out.contains("greeting=from-the-image mine=from-the-policy path=/bin"),
        "{out}"
    );
    assert!(
        !out.contains("GONE-IS-THERE"),
        "the whiteout was not honoured: {out}"
    );
    assert!(
        !out.contains("HOST-USR-SEEN"),
        "the host's /usr is in the image's root: {out}"
    );
    assert!(out.contains("layer two") && out.contains("wrote"), "{out}");

    // The image's user (by name, from its own /etc/passwd and /etc/group) and working
    // directory are the cell's; the policy's own win over them.
    let run_identity = |policy: &Path| {
        let ran = warden_in(&state)
            .arg("run")
            .arg("--policy")
            .arg(policy)
            .arg("-w")
            .arg(workspace.path())
            .args(["--", "/bin/sh", "-c", identity])
            .output()
            .unwrap();
        assert!(ran.status.success(), "{ran:?}");
        String::from_utf8_lossy(&ran.stdout).into_owned()
    };
    assert_eq!(run_identity(&policy), "Uid:2345\nGid:2346\ncwd=/srv\n");
    let own = policy_text(
        dir.path(),
        "version: 1\nimage: mini:1\nprocess:\n  user: 3000\n  cwd: /workspace\n",
    );
    assert_eq!(run_identity(&own), "Uid:3000\nGid:3000\ncwd=/workspace\n");
    let explained = warden_in(&state)
        .args(["policy", "explain"])
        .arg(&policy)
        .output()
        .unwrap();
    let explained = String::from_utf8_lossy(&explained.stdout);
    assert!(
        explained.contains("the image's user")
            && explained.contains("the image's working directory"),
        "{explained}"
    );

    // The image cannot be changed from inside.
    let ran = warden_in(&state)
        .arg("run")
        .arg("--policy")
        .arg(&policy)
        .args([
            "--",
            "/bin/sh",
            "-c",
            "echo x > /etc/hello && echo CHANGED; echo x > /bin/new && echo ADDED; echo done",
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    assert!(
        out.contains("done") && !out.contains("CHANGED") && !out.contains("ADDED"),
        "{out}"
    );

    // An unknown image is a clear error; removing the image removes its layers.
    let missing = policy_with(dir.path(), "no-such:1");
    let ran = warden_in(&state)
        .arg("run")
        .arg("--policy")
        .arg(&missing)
        .args(["--", "/bin/sh", "-c", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&ran.stderr);
    assert_eq!(ran.status.code(), Some(125), "{err}");
    assert!(err.contains("no image named no-such:1"), "{err}");
    let rm = warden_in(&state)
        .args(["image", "rm", "mini:1"])
        .output()
        .unwrap();
    assert!(rm.status.success());
    let left: Vec<_> = std::fs::read_dir(state.join("images/layers"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

fn policy_text(dir: &Path, yaml: &str) -> PathBuf {
    let path = support::policy(dir, yaml);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

fn policy_with(dir: &Path, image: &str) -> PathBuf {
    policy(dir, &format!("version: 1\nimage: {image}\n"))
}

#[test]
fn hostile_archives_are_refused_by_the_cli_and_write_nothing_outside() {
    let dir = tempdir();
    let state = dir.path().join("state");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    // Entries written with raw header fields, so that hostile names get through.
    let raw_entry =
        |b: &mut tar::Builder<Vec<u8>>, path: &str, kind: tar::EntryType, link: &str| {
            let mut h = tar::Header::new_gnu();
            h.as_gnu_mut().unwrap().name[..path.len()].copy_from_slice(path.as_bytes());
            h.as_gnu_mut().unwrap().linkname[..link.len()].copy_from_slice(link.as_bytes());
            h.set_entry_type(kind);
            h.set_mode(0o644);
            let data: &[u8] = if kind == tar::EntryType::Regular {
                b"x"
            } else {
                b""
            };
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, data).unwrap();
        };
    let raw_layer = |path: &str, kind: tar::EntryType, link: &str| {
        let mut b = tar::Builder::new(Vec::new());
        raw_entry(&mut b, path, kind, link);
        b.into_inner().unwrap()
    };
    let escape = format!(
        "../../../../{}",
        outside.file_name().unwrap().to_str().unwrap()
    );
    let mut through_link = tar::Builder::new(Vec::new());
    raw_entry(&mut through_link, "esc", tar::EntryType::Symlink, &escape);
    raw_entry(&mut through_link, "esc/pwned", tar::EntryType::Regular, "");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            raw_layer("/etc/passwd", tar::EntryType::Regular, ""),
            "an absolute path",
        ),
        (
            raw_layer(&format!("{escape}/pwned"), tar::EntryType::Regular, ""),
            "a path with `..`",
        ),
        (through_link.into_inner().unwrap(), "which is a symlink"),
        (
            raw_layer("hl", tar::EntryType::Link, "/etc/shadow"),
            "a hard link whose target is an absolute path",
        ),
        (raw_layer("null", tar::EntryType::Char, ""), "a device node"),
    ];
    for (layer, expect) in cases {
        let archive = docker_archive(dir.path(), &[layer], "hostile:1");
        let out = warden_in(&state)
            .args(["image", "import"])
            .arg(&archive)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{expect}: {err}");
        assert!(
            err.contains(expect) && err.contains("nothing was kept"),
            "{expect}: {err}"
        );
        let written: Vec<_> = std::fs::read_dir(&outside).unwrap().collect();
        assert!(written.is_empty(), "{expect}: written outside: {written:?}");
        let layers: Vec<_> = std::fs::read_dir(state.join("images/layers"))
            .unwrap()
            .collect();
        assert!(layers.is_empty(), "{expect}: a layer was kept: {layers:?}");
    }
    // A layer that is not what the configuration's digest says.
    let archive = docker_archive(dir.path(), &[shell_layer()], "changed:1");
    let changed = dir.path().join("changed");
    std::fs::create_dir_all(&changed).unwrap();
    let status = Command::new("tar")
        .arg("-xf")
        .arg(&archive)
        .arg("-C")
        .arg(&changed)
        .status()
        .unwrap();
    assert!(status.success());
    let layer = changed.join("l0/layer.tar");
    let mut bytes = std::fs::read(&layer).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&layer, bytes).unwrap();
    let out = warden_in(&state)
        .args(["image", "import"])
        .arg(&changed)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert!(err.contains("does not match its digest"), "{err}");
    let ls = warden_in(&state).args(["image", "ls"]).output().unwrap();
    assert!(String::from_utf8_lossy(&ls.stdout).contains("no images"));
}

#[test]
fn a_daemon_cell_runs_from_an_image_and_execs_in_it() {
    if !cgroups_available("image_daemon") {
        return;
    }
    let daemon = support::daemon::Daemon::start(&[]);
    let dir = tempdir();
    let archive = docker_archive(dir.path(), &[shell_layer(), second_layer()], "mini:2");
    let import = daemon
        .warden()
        .args(["image", "import"])
        .arg(&archive)
        .output()
        .unwrap();
    assert!(
        import.status.success(),
        "{}",
        String::from_utf8_lossy(&import.stderr)
    );
    let cell = daemon.create(
        &unique("img"),
        json!({ "policy": "version: 1\nimage: mini:2\n" }),
    );
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["/bin/sh", "-c", "while read -r l; do echo \"$l\"; done < /etc/hello; echo \"$GREETING\"; test -e /usr/bin/python3 || echo no-host-usr"] }),
    );
    let out = String::from_utf8(support::daemon::stream_bytes(&events, "stdout")).unwrap();
    assert_eq!(out, "hello from the image\nfrom-the-image\nno-host-usr\n");
    // An exec may name the cell's user, which is the image's; no other.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["/bin/sh", "-c", "pwd"], "user": 2345 }),
    );
    let out = String::from_utf8(support::daemon::stream_bytes(&events, "stdout")).unwrap();
    assert_eq!(out, "/srv\n");
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["true"], "user": 1000 })),
    );
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert!(refused.text().contains("uid 2345"), "{}", refused.text());
    // The journal records which image the cell was made from.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        journal.contains("image: mini:2"),
        "the cell.create entry names no image"
    );
    // Its layers stay while the cell runs; once it is gone the image can go.
    let rm = daemon
        .warden()
        .args(["image", "rm", "mini:2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&rm.stderr);
    assert_eq!(rm.status.code(), Some(125), "{err}");
    assert!(
        err.contains(&format!("root of running cells: {cell}")),
        "{err}"
    );
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{cell}"), None)
            .status,
        204
    );
    let rm = daemon
        .warden()
        .args(["image", "rm", "mini:2"])
        .output()
        .unwrap();
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
}

/// Without root: an unprivileged user imports the image into its own state directory and runs
/// a cell from it (as root, the test drops to `nobody`).
#[test]
fn an_unprivileged_user_imports_and_runs_an_image() {
    const NOBODY: u32 = 65534;
    let dir = tempdir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.path().join("warden");
    copy_program(BIN, &bin);
    let (runtime, state) = (dir.path().join("run"), dir.path().join("state"));
    for path in [&runtime, &state] {
        std::fs::create_dir(path).unwrap();
        if is_root() {
            std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY)).unwrap();
        }
    }
    let archive = docker_archive(dir.path(), &[shell_layer(), second_layer()], "mini:3");
    std::fs::set_permissions(&archive, std::fs::Permissions::from_mode(0o644)).unwrap();
    let policy = policy(dir.path(), "version: 1\nimage: mini:3\n");
    std::fs::set_permissions(&policy, std::fs::Permissions::from_mode(0o644)).unwrap();
    let as_user = |args: &[&std::ffi::OsStr]| {
        let mut cmd = if is_root() {
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                .arg(&bin);
            c
        } else {
            Command::new(&bin)
        };
        cmd.args(args)
            .env("WARDEN_RUNTIME_DIR", &runtime)
            .env("WARDEN_STATE_DIR", &state)
            .env("HOME", dir.path())
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let import = as_user(&["image".as_ref(), "import".as_ref(), archive.as_os_str()]);
    assert!(
        import.status.success(),
        "{}",
        String::from_utf8_lossy(&import.stderr)
    );
    let ran = as_user(&[
        "run".as_ref(),
        "--policy".as_ref(),
        policy.as_os_str(),
        "--".as_ref(),
        "/bin/sh".as_ref(),
        "-c".as_ref(),
        "while read -r l; do echo \"$l\"; done < /etc/hello; test -e /etc/gone || echo whiteout-ok; test -e /usr/bin/python3 || echo no-host-usr".as_ref(),
    ]);
    let out = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_eq!(out, "hello from the image\nwhiteout-ok\nno-host-usr\n");
}

/// A layer of symbolic links (path in the image, target).
fn links_layer(links: &[(&Path, &Path)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, target) in links {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        header.set_mode(0o777);
        b.append_link(&mut header, path.strip_prefix("/").unwrap(), target)
            .unwrap();
    }
    b.into_inner().unwrap()
}

/// A process cell's setup assembles an image's root by path before the root is its own: an
/// image's link where it writes led it into the host's files. As root the setup runs as an
/// unprivileged id, so what it reached was what anyone may write (rootless, the caller's own
/// files). Seen without the checks: a world-writable host file outside every granted path
/// written over with the bytes of a file the policy copies in, and a dangling link at
/// `/etc/hostname` made a host file of the cell's name. The first image is refused, saying
/// where its link is; the second runs with the warden's own `/etc/hostname` in place of the
/// link; the host's files are untouched either way.
#[test]
fn an_images_links_do_not_lead_a_cells_setup_into_the_hosts_files() {
    if !is_root() {
        eprintln!("skipped: a root-started cell's setup writes as an unprivileged id");
        return;
    }
    // Outside /tmp, which is the cell's own.
    let dirs = run_dirs();
    let dir = &dirs.dir;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let state = dir.path().join("state");
    let victim = dir.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o777)).unwrap();
    let target = victim.join("target");
    std::fs::write(&target, "the host's own\n").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o666)).unwrap();
    let copied = dir.path().join("copied.txt");
    std::fs::write(&copied, "copied in by the policy\n").unwrap();
    std::fs::set_permissions(&copied, std::fs::Permissions::from_mode(0o644)).unwrap();
    let made = victim.join("made");
    for (layers, tag) in [
        (
            vec![
                shell_layer(),
                second_layer(),
                links_layer(&[(&copied, &target)]),
            ],
            "copy-link:1",
        ),
        (
            vec![
                shell_layer(),
                second_layer(),
                links_layer(&[(Path::new("/etc/hostname"), &made)]),
            ],
            "etc-link:1",
        ),
    ] {
        let import = warden_in(&state)
            .args(["image", "import"])
            .arg(docker_archive(dir.path(), &layers, tag))
            .output()
            .unwrap();
        assert!(import.status.success(), "{import:?}");
    }
    let run = |image: &str| {
        let policy = policy_text(
            dir.path(),
            &format!(
                "version: 1\nimage: {image}\nfilesystem:\n  read_only: [{}]\n",
                copied.display()
            ),
        );
        let ran = warden_in(&state)
            .args(["run", "--name", "linked", "--policy"])
            .arg(&policy)
            .args(["--", "/bin/sh", "-c"])
            .arg(format!(
                "read -r a < {}; read -r b < /etc/hostname; echo \"$a|$b\"",
                copied.display()
            ))
            .output()
            .unwrap();
        (
            ran.status.code(),
            String::from_utf8_lossy(&ran.stdout).into_owned(),
            String::from_utf8_lossy(&ran.stderr).into_owned(),
        )
    };
    let (code, out, err) = run("copy-link:1");
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        "the host's own\n",
        "the host's file was written over: {out}{err}"
    );
    assert_ne!(code, Some(0), "{out}{err}");
    assert!(
        err.contains(&format!(
            "has a symbolic link at {} (to {})",
            copied.display(),
            target.display()
        )),
        "{err}"
    );
    let (code, out, err) = run("etc-link:1");
    assert!(!made.exists(), "the setup made a host file: {out}{err}");
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out, "copied in by the policy|linked\n");
}

#[test]
fn an_image_runs_as_a_gvisor_cell_too() {
    if let Some(why) = gvisor_unavailable() {
        eprintln!("skipped an_image_runs_as_a_gvisor_cell_too: {why}");
        return;
    }
    let dir = tempdir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let state = dir.path().join("state");
    let archive = docker_archive(dir.path(), &[shell_layer(), second_layer()], "mini:1");
    let import = warden_in(&state)
        .args(["image", "import"])
        .arg(&archive)
        .output()
        .unwrap();
    assert!(import.status.success(), "{import:?}");
    let workspace = tempdir();
    let policy = policy(
        dir.path(),
        "version: 1\ntier: gvisor\nimage: mini:1\nprocess:\n  env:\n    set:\n      MINE: from-the-policy\n",
    );
    let script = "while read -r line; do echo \"$line\"; done < /etc/hello; \
                  echo \"greeting=$GREETING mine=$MINE\"; \
                  test -e /etc/gone && echo GONE-IS-THERE; \
                  test -e /usr/bin/python3 && echo HOST-USR-SEEN; \
                  echo x > /etc/hello 2>/dev/null && echo CHANGED; \
                  while read -r line; do echo \"$line\"; done < /proc/version; \
                  while read -r k v rest; do case $k in Uid:|Gid:) echo \"$k$v\";; esac; \
                  done < /proc/self/status; echo \"cwd=$(pwd)\"; \
                  echo made > /workspace/out.txt && echo wrote";
    let ran = warden_in(&state)
        .arg("run")
        .arg("--policy")
        .arg(&policy)
        .arg("-w")
        .arg(workspace.path())
        .args(["--", "/bin/sh", "-c", script])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    let err = String::from_utf8_lossy(&ran.stderr);
    assert!(ran.status.success(), "{out}{err}");
    assert!(out.contains("hello from the image"), "{out}");
    assert!(
        out.contains("greeting=from-the-image mine=from-the-policy"),
        "{out}"
    );
    assert!(
        !out.contains("GONE-IS-THERE"),
        "the whiteout was not honoured: {out}"
    );
    assert!(
        !out.contains("HOST-USR-SEEN"),
        "the host's /usr is in the image's root: {out}"
    );
    assert!(!out.contains("CHANGED"), "the image was changed: {out}");
    // gVisor's own kernel answers, not the host's.
    let host_version = std::fs::read_to_string("/proc/version").unwrap();
    assert!(!out.contains(host_version.trim()), "{out}");
    // The image's user and working directory, as on the process tier.
    assert!(out.contains("Uid:2345\nGid:2346\ncwd=/srv\n"), "{out}");
    assert!(out.contains("wrote"), "{out}");
}

/// Why the gVisor tier cannot run here, if it cannot.
fn gvisor_unavailable() -> Option<&'static str> {
    if !is_root() {
        return Some("the gvisor tier needs root");
    }
    installed_runsc()
        .is_none()
        .then_some("runsc is not installed")
}
