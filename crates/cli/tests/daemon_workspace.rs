//! Files and workspaces of the daemon's cells: the files API, snapshots, reset, fork, diff and
//! apply (held for a person, bound to what was reviewed).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

#[test]
fn files_round_trip_and_paths_cannot_leave_the_cell() {
    if !cgroups_available("daemon_files") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("readme.txt"), "from the host\n").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", host.path().join("escape")).unwrap();
    let workspace = host.path().display().to_string();
    let cell = daemon.create(&unique("files"), json!({ "workspace": workspace }));
    let files = |op: &str, query: &str| format!("/v1/cells/{cell}/files/{op}?path={query}");

    // Read what the host put there; write, list, stat, move, remove.
    let read = daemon.request("GET", &files("content", "readme.txt"), None);
    assert_eq!(
        (read.status, read.body.as_slice()),
        (200, &b"from the host\n"[..])
    );
    assert_eq!(
        daemon
            .call(
                "POST",
                &format!("/v1/cells/{cell}/files/mkdir"),
                Some(json!({"path": "notes/deep"}))
            )
            .status,
        204
    );
    let write = daemon.request(
        "PUT",
        &files("content", "notes/a.txt"),
        Some("hello\u{0}bytes"),
    );
    assert_eq!(
        write.status,
        204,
        "{}",
        String::from_utf8_lossy(&write.body)
    );
    assert_eq!(
        daemon
            .request("GET", &files("content", "notes/a.txt"), None)
            .body,
        b"hello\0bytes"
    );
    let list = daemon.call("GET", &files("list", "notes"), None).json();
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a.txt", "deep"]);
    let stat = daemon
        .call("GET", &files("stat", "notes/a.txt"), None)
        .json();
    assert_eq!(
        (stat["kind"].as_str(), stat["size"].as_u64()),
        (Some("file"), Some(11))
    );
    let moved = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/files/move"),
        Some(json!({"from": "notes/a.txt", "to": "notes/b.txt"})),
    );
    assert_eq!(
        moved.status,
        204,
        "{}",
        String::from_utf8_lossy(&moved.body)
    );
    assert_eq!(
        daemon
            .request("GET", &files("content", "notes/a.txt"), None)
            .status,
        404
    );
    assert_eq!(
        daemon
            .call(
                "POST",
                &format!("/v1/cells/{cell}/files/remove"),
                Some(json!({"path": "notes", "recursive": true}))
            )
            .status,
        204
    );
    assert_eq!(
        daemon.call("GET", &files("stat", "notes"), None).status,
        404
    );

    // The cell sees what the API wrote, and the host directory is untouched (copy-on-write).
    daemon.request("PUT", &files("content", "made-by-api"), Some("x"));
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "/workspace/made-by-api"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"x");
    assert!(!host.path().join("made-by-api").exists());

    // Escapes: `..`, absolute paths, and symlinks (from the host or made in the cell) that
    // point out of the files root are refused with 400 before anything is done.
    daemon.exec(
        &cell,
        json!({ "argv": ["ln", "-s", "/etc", "/workspace/etc-link"] }),
    );
    let passwd_before = std::fs::read("/etc/passwd").unwrap();
    for (method, url, body) in [
        ("GET", files("content", "../../etc/passwd"), None),
        ("GET", files("content", "/etc/passwd"), None),
        ("GET", files("content", "escape"), None),
        ("PUT", files("content", "etc-link/passwd"), Some("owned")),
        ("PUT", files("content", "escape"), Some("owned")),
        ("GET", files("archive", "etc-link"), None),
    ] {
        let answer = daemon.request(method, &url, body);
        assert_eq!(
            answer.status,
            400,
            "{method} {url}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        let message = answer.json()["error"].as_str().unwrap().to_owned();
        assert!(
            message.contains("outside") || message.contains("..") || message.contains("absolute"),
            "{message}"
        );
    }
    assert_eq!(std::fs::read("/etc/passwd").unwrap(), passwd_before);

    // Archives: upload unpacks (members with `..` are refused by tar in the cell), download packs.
    let staging = tempdir();
    std::fs::create_dir(staging.path().join("sub")).unwrap();
    std::fs::write(staging.path().join("sub/ok.txt"), "fine\n").unwrap();
    std::fs::write(staging.path().join("evil"), "evil\n").unwrap();
    let tar = staging.path().join("x.tar");
    let made = std::process::Command::new("tar")
        .args([
            "-C",
            &staging.path().join("sub").display().to_string(),
            "-cPf",
            &tar.display().to_string(),
            "ok.txt",
            "../evil",
        ])
        .status()
        .unwrap();
    assert!(made.success());
    let bytes = std::fs::read(&tar).unwrap();
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    use std::io::Write as _;
    let head = format!(
        "PUT {} HTTP/1.1\r\nHost: w\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        files("archive", "unpacked"),
        bytes.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&bytes).unwrap();
    let mut raw = Vec::new();
    use std::io::Read as _;
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(
        text.starts_with("HTTP/1.1 400") && text.contains("../evil"),
        "the `..` member is refused: {text}"
    );
    // Refused before anything was written: the directory was not even made. The same archive
    // without its bad member unpacks.
    assert_eq!(
        daemon.call("GET", &files("stat", "unpacked"), None).status,
        404
    );
    let good = put_bytes(
        &daemon,
        &files("archive", "unpacked"),
        &tar_of(&[("ok.txt", Member::File(b"fine\n"))]),
    );
    assert_eq!(good.status, 204, "{}", good.text());
    let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", "cat /workspace/unpacked/ok.txt; ls /workspace/evil /evil 2>&1 | wc -l"] }));
    let out = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(out.starts_with("fine\n"), "{out}");
    assert!(!host.path().join("evil").exists() && !staging.path().join("sub/evil").exists());
    let archive = daemon.request("GET", &files("archive", "unpacked"), None);
    assert_eq!(archive.status, 200);
    let listed = std::process::Command::new("tar")
        .arg("-t")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    listed
        .stdin
        .as_ref()
        .unwrap()
        .write_all(&archive.body)
        .unwrap();
    let listed = listed.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&listed.stdout).contains("./ok.txt"));

    // Deleting the cell journals what it changed in its workspace, then every change is there.
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{cell}"), None)
            .status,
        204
    );
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let changes: Value = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["kind"] == "workspace.changes")
        .expect("workspace.changes journaled");
    let paths: Vec<&str> = changes["data"]["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"made-by-api") && paths.contains(&"unpacked/ok.txt"),
        "{paths:?}"
    );
    assert_has_kinds(
        &journal,
        &[
            "file.write",
            "file.mkdir",
            "file.move",
            "file.remove",
            "file.upload",
            "file.read",
        ],
    );
}

/// What a member of a test archive is.
enum Member<'a> {
    File(&'a [u8]),
    Symlink(&'a str),
}

/// A tar archive whose members' names are written as they are (`..` included, which the
/// `tar` crate's builder would refuse to write).
fn tar_of(members: &[(&str, Member)]) -> Vec<u8> {
    let mut out = tar::Builder::new(Vec::new());
    for (name, member) in members {
        let mut header = tar::Header::new_gnu();
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_mode(0o644);
        let data: &[u8] = match member {
            Member::File(data) => {
                header.set_entry_type(tar::EntryType::Regular);
                data
            }
            Member::Symlink(target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.as_old_mut().linkname[..target.len()].copy_from_slice(target.as_bytes());
                b""
            }
        };
        header.set_size(data.len() as u64);
        header.set_cksum();
        out.append(&header, data).unwrap();
    }
    out.into_inner().unwrap()
}

/// A PUT of raw bytes over the daemon's socket.
fn put_bytes(daemon: &Daemon, url: &str, body: &[u8]) -> Answer {
    use std::io::{Read as _, Write as _};
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    let head = format!(
        "PUT {url} HTTP/1.1\r\nHost: w\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    // A body refused before it is all read may meet a closed socket; the answer is still there.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP answer");
    let headers = String::from_utf8_lossy(&raw[..split]).into_owned();
    Answer {
        status: headers.split(' ').nth(1).unwrap().parse().unwrap(),
        headers,
        body: raw[split + 4..].to_vec(),
    }
}

#[test]
fn a_refused_archive_leaves_the_cell_as_it_was() {
    if !cgroups_available("daemon_archive_refused") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("archive"), json!({}));
    let files = |op: &str, query: &str| format!("/v1/cells/{cell}/files/{op}?path={query}");
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "mkdir dest && echo before > dest/kept.txt"] }),
    );
    let tree = || {
        let events = daemon.exec(
            &cell,
            json!({ "argv": ["sh", "-c", "find . -mindepth 1 -printf '%p %y %s %l\\n' | sort"] }),
        );
        String::from_utf8(stream_bytes(&events, "stdout")).unwrap()
    };
    let before = tree();
    let listed_before = daemon.call("GET", &files("list", "dest"), None).json();
    assert!(before.contains("./dest/kept.txt f 7"), "{before}");
    // A file, then a symlink out of the cell's files, then a member through that symlink.
    let through = tar_of(&[
        ("ok.txt", Member::File(b"ok\n")),
        ("lnk", Member::Symlink("/somewhere/outside")),
        ("lnk/escape.txt", Member::File(b"escaped\n")),
    ]);
    let refused = put_bytes(&daemon, &files("archive", "dest"), &through);
    assert_eq!(refused.status, 400, "{}", refused.text());
    let message = refused.json()["error"].as_str().unwrap().to_owned();
    assert!(message.contains("lnk/escape.txt"), "{message}");
    assert_eq!(tree(), before, "the refused archive left something behind");
    assert_eq!(
        daemon.call("GET", &files("list", "dest"), None).json(),
        listed_before
    );
    // A first member that climbs out: the directory it was to go to is not made.
    let climbing = tar_of(&[
        ("../x", Member::File(b"x\n")),
        ("ok.txt", Member::File(b"ok\n")),
    ]);
    let refused = put_bytes(&daemon, &files("archive", "fresh"), &climbing);
    assert_eq!(refused.status, 400, "{}", refused.text());
    let message = refused.json()["error"].as_str().unwrap().to_owned();
    assert!(message.contains("../x"), "{message}");
    assert_eq!(tree(), before, "the refused archive left something behind");
    assert_eq!(
        daemon.call("GET", &files("stat", "fresh"), None).status,
        404
    );
}

#[test]
fn an_upload_over_the_limit_is_a_json_error_that_says_what_to_do() {
    if !cgroups_available("daemon_upload_limit") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("upload-limit"), json!({}));
    let over = vec![b'x'; 64 * 1024 * 1024 + 1];
    for (op, says) in [
        ("content", "write a larger file in parts"),
        ("archive", "split the files into several archives"),
    ] {
        let answer = put_bytes(
            &daemon,
            &format!("/v1/cells/{cell}/files/{op}?path=big"),
            &over,
        );
        assert_eq!(answer.status, 413, "{op}: {}", answer.text());
        assert!(
            answer
                .headers
                .to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{op}: {}",
            answer.headers
        );
        let body = answer.json();
        assert_eq!(body["code"], "too-large", "{op}: {body}");
        let message = body["error"].as_str().unwrap();
        assert!(
            message.contains("64 MiB") && message.contains(says),
            "{op}: {message}"
        );
    }
    assert_eq!(
        daemon
            .call(
                "GET",
                &format!("/v1/cells/{cell}/files/stat?path=big"),
                None
            )
            .status,
        404
    );
}

#[test]
fn snapshot_reset_fork_policy_and_events_over_the_api() {
    if !cgroups_available("daemon_workspace") {
        return;
    }
    let (port, _hits) = upstream();
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("a.txt"), "v1\n").unwrap();
    let allow =
        format!("version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n");
    let cell = daemon.create(
        &unique("ws"),
        json!({ "workspace": host.path().display().to_string(), "policy": allow }),
    );
    // The events stream: journal entries as they are written.
    let socket = daemon.socket();
    let watched = cell.clone();
    let stream_thread = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        write!(
            stream,
            "GET /v1/events?cell={watched} HTTP/1.1\r\nHost: w\r\n\r\n"
        )
        .unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 4096];
        while !seen.contains("workspace.reset") {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        seen
    });
    std::thread::sleep(Duration::from_millis(300));
    let sh = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        String::from_utf8(stream_bytes(&events, "stdout")).unwrap()
    };
    sh("echo v2 > /workspace/a.txt");
    let snap = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({ "as": "s1" })),
    );
    assert_eq!(snap.status, 201, "{}", String::from_utf8_lossy(&snap.body));
    assert_eq!(snap.json()["id"], format!("{cell}@s1"));
    sh("echo v3 > /workspace/a.txt");
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": "s1" })),
    );
    assert_eq!(
        reset.status,
        200,
        "{}",
        String::from_utf8_lossy(&reset.body)
    );
    assert_eq!(sh("cat /workspace/a.txt"), "v2\n");
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/reset"), Some(json!({})))
            .status,
        200
    );
    assert_eq!(sh("cat /workspace/a.txt"), "v1\n");
    assert_eq!(
        std::fs::read_to_string(host.path().join("a.txt")).unwrap(),
        "v1\n"
    );
    let listed = daemon
        .call("GET", &format!("/v1/cells/{cell}/snapshots"), None)
        .json();
    assert_eq!(listed[0]["id"], format!("{cell}@s1"));

    // A fork from the snapshot sees the snapshot, not the parent's present.
    let fork = daemon.create(&unique("fork"), json!({ "from": format!("{cell}@s1") }));
    let events = daemon.exec(&fork, json!({ "argv": ["cat", "/workspace/a.txt"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"v2\n");

    // Policy: read it back, then replace the network rules of the running cell.
    let policy = daemon
        .call("GET", &format!("/v1/cells/{cell}/policy"), None)
        .json();
    assert!(policy["policy"].as_str().unwrap().contains("127.0.0.2"));
    let fetch = format!(
        "import urllib.request, urllib.error\n\
         try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/').status)\n\
         except urllib.error.HTTPError as e:\n    print(e.code)"
    );
    let run = |d: &Daemon| {
        let events = d.exec(&cell, json!({ "argv": ["python3", "-c", fetch] }));
        String::from_utf8(stream_bytes(&events, "stdout"))
            .unwrap()
            .trim()
            .to_owned()
    };
    assert_eq!(run(&daemon), "200");
    let replaced = daemon.call(
        "PUT",
        &format!("/v1/cells/{cell}/policy"),
        Some(json!({ "policy": "version: 1\nnetwork:\n  default: deny\n  allow:\n    - host: example.invalid\n" })),
    );
    assert_eq!(
        replaced.status,
        200,
        "{}",
        String::from_utf8_lossy(&replaced.body)
    );
    assert_eq!(run(&daemon), "403");

    let seen = stream_thread.join().unwrap();
    assert_has_kinds(
        &seen,
        &[
            "workspace.snapshot",
            "exec.start",
            "exec.exit",
            "workspace.reset",
        ],
    );
}

#[test]
fn diff_and_apply_over_the_api_with_apply_held_for_a_person() {
    if !cgroups_available("daemon_apply") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    std::fs::write(host.path().join("kept.txt"), "old\n").unwrap();
    let cell = daemon.create(
        &unique("apply"),
        json!({ "workspace": host.path().display().to_string(), "policy": "version: 1\napprovals:\n  timeout: 10s\n  apply: ask\n" }),
    );
    daemon.exec(&cell, json!({ "argv": ["sh", "-c", "echo new > /workspace/kept.txt; echo made > /workspace/made.txt"] }));
    let paths = daemon.changed_paths(&cell);
    assert_eq!(paths, ["kept.txt", "made.txt"]);
    // A dry run says what would happen and needs nobody.
    let dry = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/apply"),
        Some(json!({ "dry_run": true, "paths": ["made.txt"] })),
    );
    assert_eq!(dry.status, 200, "{}", String::from_utf8_lossy(&dry.body));
    assert_eq!(dry.json()["applied"], json!(["made.txt"]));
    assert!(!host.path().join("made.txt").exists());
    // The real apply waits for a person.
    let applying = {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/apply"),
                Some(json!({ "paths": ["made.txt"] })),
            )
        })
    };
    let mut id = None;
    for _ in 0..200 {
        let list = daemon.call("GET", "/v1/approvals", None).json();
        if let Some(q) = list
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["request"].as_str().unwrap().starts_with("apply made.txt"))
        {
            id = q["id"].as_u64();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let id = id.expect("the apply asks");
    assert!(
        !host.path().join("made.txt").exists(),
        "nothing is applied before the answer"
    );
    daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "approve" })),
    );
    let applied = applying.join().unwrap();
    assert_eq!(
        applied.status,
        200,
        "{}",
        String::from_utf8_lossy(&applied.body)
    );
    assert_eq!(
        std::fs::read_to_string(host.path().join("made.txt")).unwrap(),
        "made\n"
    );
    assert_eq!(
        std::fs::read_to_string(host.path().join("kept.txt")).unwrap(),
        "old\n",
        "only the chosen path"
    );
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert_has_kinds(
        &journal,
        &["workspace.apply", "approval.answer", "workspace.applied"],
    );

    // An apply with `include_sensitive` or `force` says what they add, and a grant for the
    // plain apply of the same changes does not cover it: the cell makes a Makefile (which the
    // host executes) while the host edits a file the cell changed.
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "printf 'all:\\n\\ttrue\\n' > /workspace/Makefile"] }),
    );
    std::fs::write(host.path().join("kept.txt"), "edited on the host\n").unwrap();
    let ask = |body: Value| {
        let applying = {
            let daemon = std::sync::Arc::clone(&daemon);
            let cell = cell.clone();
            std::thread::spawn(move || {
                daemon.call("POST", &format!("/v1/cells/{cell}/apply"), Some(body))
            })
        };
        let mut question = None;
        for _ in 0..200 {
            let list = daemon.call("GET", "/v1/approvals", None).json();
            if let Some(q) = list.as_array().unwrap().iter().find(|q| q["cell"] == cell) {
                question = Some((
                    q["id"].as_u64().unwrap(),
                    q["request"].as_str().unwrap().to_owned(),
                ));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        (applying, question)
    };
    let answer = |id: u64, body: Value| {
        let answered = daemon.call("POST", &format!("/v1/approvals/{cell}/{id}"), Some(body));
        assert_eq!(answered.status, 204, "{}", answered.text());
    };
    // The plain apply, granted for the cell: it leaves the Makefile out, and stops at the
    // host's edit.
    let (applying, question) = ask(json!({}));
    let (id, plain) = question.expect("the plain apply asks");
    assert!(
        !plain.contains("Makefile") && !plain.contains("force"),
        "{plain}"
    );
    answer(id, json!({ "decision": "approve", "scope": "cell" }));
    let applied = applying.join().unwrap();
    assert_eq!(applied.status, 409, "{}", applied.text());
    assert!(applied.text().contains("kept.txt"), "{}", applied.text());
    // Each flag asks again, naming what it adds; refused, nothing is written.
    for (body, says) in [
        (
            json!({ "include_sensitive": true }),
            "including sensitive changes it leaves out without --include-sensitive: Makefile",
        ),
        (
            json!({ "force": true }),
            "with --force: overwriting what the host changed since the cell started at kept.txt",
        ),
    ] {
        let (applying, question) = ask(body.clone());
        let Some((id, request)) = question else {
            let applied = applying.join().unwrap();
            panic!(
                "{body}: the grant for the plain apply covered it: {} {}",
                applied.status,
                applied.text()
            );
        };
        assert!(request.starts_with(&plain), "{request}");
        assert!(
            request.contains(says),
            "{body}: `{request}` should say `{says}`"
        );
        answer(id, json!({ "decision": "deny" }));
        let refused = applying.join().unwrap();
        assert_eq!(refused.status, 403, "{body}: {}", refused.text());
    }
    assert!(!host.path().join("Makefile").exists());
    assert_eq!(
        std::fs::read_to_string(host.path().join("kept.txt")).unwrap(),
        "edited on the host\n"
    );
}

#[test]
fn an_apply_writes_what_was_reviewed_and_approved_or_nothing() {
    if !cgroups_available("daemon_apply_digest") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    let cell = daemon.create(
        &unique("digest"),
        json!({ "workspace": host.path().display().to_string(), "policy": "version: 1\napprovals:\n  timeout: 10s\n  apply: ask\n" }),
    );
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo reviewed > /workspace/a.txt"] }),
    );
    // Asked while the change is the reviewed one...
    let applying = {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            daemon.call("POST", &format!("/v1/cells/{cell}/apply"), Some(json!({})))
        })
    };
    let mut id = None;
    for _ in 0..200 {
        let list = daemon.call("GET", "/v1/approvals", None).json();
        if let Some(q) = list.as_array().unwrap().iter().find(|q| q["cell"] == cell) {
            id = q["id"].as_u64();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let id = id.expect("the apply asks");
    // ...then the cell swaps the content while the person reads the question.
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo EVIL > /workspace/a.txt"] }),
    );
    daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "approve" })),
    );
    let applied = applying.join().unwrap();
    assert_eq!(
        applied.status,
        409,
        "{}",
        String::from_utf8_lossy(&applied.body)
    );
    assert!(
        applied.json()["error"]
            .as_str()
            .unwrap()
            .contains("changed since it was reviewed"),
        "{}",
        String::from_utf8_lossy(&applied.body)
    );
    assert!(
        !host.path().join("a.txt").exists(),
        "the swapped content reached the host"
    );

    // The same from the CLI: `warden diff` prints the digest, `warden apply --digest` holds to
    // it, while the cell goes on writing.
    let project = tempdir();
    let name = unique("digest-cli");
    let mut running = warden()
        .args([
            "run",
            "--name",
            &name,
            "--workspace",
            &project.path().display().to_string(),
        ])
        .args([
            "--",
            "sh",
            "-c",
            "echo reviewed > b.txt; sleep 8; echo other > b.txt; sleep 60",
        ])
        .spawn()
        .unwrap();
    let mut diff = Ran::from(warden().args(["diff", &name]).output().unwrap());
    for _ in 0..100 {
        if diff.stdout.contains("digest ") {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        diff = Ran::from(warden().args(["diff", &name]).output().unwrap());
    }
    assert!(diff.stdout.contains("+reviewed"), "{diff:?}");
    let digest = diff
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("digest "))
        .and_then(|l| l.split(':').next())
        .unwrap_or_else(|| panic!("{diff:?}"))
        .to_owned();
    let json = Ran::from(warden().args(["diff", &name, "--json"]).output().unwrap());
    assert_eq!(
        serde_json::from_str::<Value>(&json.stdout).unwrap()["digest"],
        digest
    );
    // (The cell's change comes 8 s after its start: time enough, on a loaded machine, for the
    // review above to see the first content.)
    std::thread::sleep(Duration::from_secs(9));
    let refused = Ran::from(
        warden()
            .args(["apply", &name, "--digest", &digest])
            .output()
            .unwrap(),
    );
    assert_eq!(refused.code, 125, "{refused:?}");
    assert!(
        refused.stderr.contains("changed since it was reviewed"),
        "{refused:?}"
    );
    assert!(!project.path().join("b.txt").exists());
    assert!(warden().args(["kill", &name]).status().unwrap().success());
    let _ = running.wait();
    assert!(warden().args(["rm", &name]).status().unwrap().success());
}

#[test]
fn a_daemon_cell_writes_after_its_workspace_is_reset() {
    if !cgroups_available("daemon_reset_writes") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("readme.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("resetw"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo cell > readme.txt"] }),
    );
    let snap = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({"as": "s"})),
    );
    assert_eq!(snap.status, 201, "{}", String::from_utf8_lossy(&snap.body));
    for to in [json!({}), json!({ "to": "s" })] {
        let reset = daemon.call("POST", &format!("/v1/cells/{cell}/reset"), Some(to.clone()));
        assert!(
            reset.status < 300,
            "{to}: {}",
            String::from_utf8_lossy(&reset.body)
        );
        let events = daemon.exec(
            &cell,
            json!({ "argv": ["sh", "-c", "echo x >> readme.txt && echo y > new.txt && rm new.txt && mkdir d && rmdir d && cat readme.txt"] }),
        );
        let exit = exit_of(&events);
        assert_eq!(exit["code"], 0, "after a reset to {to}: {events:?}");
    }
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "readme.txt"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"cell\nx\n");
}

/// A diff freezes the cell for the moment it reads the layer; an exec that arrives then is
/// not refused as if a person had paused the cell (a dashboard or an agent's diff polls while
/// commands run).
#[test]
fn execs_beside_a_stream_of_diffs_all_run() {
    let daemon = Daemon::start(&[]);
    let workspace = tempfile::tempdir().unwrap();
    let cell = daemon.create(
        &unique("diffexec"),
        json!({ "workspace": workspace.path() }),
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looker = {
        let (stop, socket, cell) = (stop.clone(), daemon.socket(), cell.clone());
        std::thread::spawn(move || {
            let mut diffs = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
                let answer = exchange(stream, "GET", &format!("/v1/cells/{cell}/diff"), None, &[]);
                assert_eq!(answer.status, 200);
                diffs += 1;
            }
            diffs
        })
    };
    for n in 0..60 {
        let events = daemon.exec(
            &cell,
            json!({ "argv": ["sh", "-c", format!("echo {n} >> log")] }),
        );
        let exit = exit_of(&events);
        assert_eq!(exit["code"], 0, "exec {n}: {events:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(looker.join().unwrap() > 10);
    std::thread::sleep(Duration::from_millis(10));
}

#[test]
fn the_clis_workspace_commands_on_a_daemon_cell_go_through_the_daemon() {
    // `warden apply` of a cell the daemon keeps must not go around it: the daemon asks the
    // person its policy names, and journals what was done.
    if !cgroups_available("cli_through_daemon") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    let cell = daemon.create(
        &unique("clid"),
        json!({ "workspace": host.path().display().to_string(), "policy": "version: 1\napprovals:\n  timeout: 1s\n  on_timeout: deny\n  apply: ask\n" }),
    );
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo made > /workspace/made.txt"] }),
    );
    let cli = |args: &[&str]| daemon.warden().args(args).output().unwrap();
    // Nobody answers: the apply is refused, and nothing reaches the host.
    let applied = cli(&["apply", &cell]);
    let said = String::from_utf8_lossy(&applied.stderr);
    assert!(!applied.status.success(), "{said}");
    assert!(said.contains("apply"), "{said}");
    assert!(
        !host.path().join("made.txt").exists(),
        "nothing was applied without the person"
    );
    let diff = cli(&["diff", &cell, "--stat"]);
    assert!(String::from_utf8_lossy(&diff.stdout).contains("A made.txt"));
    let snap = cli(&["snapshot", &cell, "--as", "s1"]);
    assert!(
        snap.status.success(),
        "{}",
        String::from_utf8_lossy(&snap.stderr)
    );
    let reset = cli(&["reset", &cell]);
    assert!(
        reset.status.success(),
        "{}",
        String::from_utf8_lossy(&reset.stderr)
    );
    assert!(daemon.changed_paths(&cell).is_empty());
    let paused = cli(&["pause", &cell]);
    assert!(paused.status.success());
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .json()["state"],
        "paused"
    );
    assert!(cli(&["resume", &cell]).status.success());
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert_has_kinds(
        &journal,
        &[
            "workspace.apply",
            "approval.ask",
            "workspace.snapshot",
            "workspace.reset",
            "cell.pause",
            "cell.resume",
        ],
    );
}

/// Unnamed snapshots are numbered on (past a name taken by hand), without counting the cell's
/// snapshots again each time; a cell removed and made again under its name starts at `s1`.
#[test]
fn unnamed_snapshots_count_on_and_start_over_for_a_cell_made_again() {
    if !cgroups_available("daemon_snapshot_names") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("a.txt"), "v1\n").unwrap();
    let workspace = host.path().display().to_string();
    let name = unique("names");
    let snapshot = |body: Value| {
        let answer = daemon.call("POST", &format!("/v1/cells/{name}/snapshot"), Some(body));
        assert_eq!(answer.status, 201, "{}", answer.text());
        answer.json()["id"].as_str().unwrap().to_owned()
    };
    daemon.create(&name, json!({ "workspace": workspace }));
    assert_eq!(snapshot(json!({})), format!("{name}@s1"));
    assert_eq!(snapshot(json!({})), format!("{name}@s2"));
    assert_eq!(snapshot(json!({ "as": "s3" })), format!("{name}@s3"));
    assert_eq!(snapshot(json!({})), format!("{name}@s4"));
    // A name that is taken is refused, whoever took it.
    let taken = daemon.call(
        "POST",
        &format!("/v1/cells/{name}/snapshot"),
        Some(json!({ "as": "s2" })),
    );
    assert_eq!(taken.status, 409, "{}", taken.text());
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{name}"), None)
            .status,
        204
    );
    for n in 1..=4 {
        let rm = daemon
            .warden()
            .args(["rm", &format!("{name}@s{n}")])
            .output()
            .unwrap();
        assert!(rm.status.success(), "{rm:?}");
    }
    daemon.create(
        &name,
        json!({ "workspace": host.path().display().to_string() }),
    );
    assert_eq!(snapshot(json!({})), format!("{name}@s1"));
}

/// A snapshot of a cell whose init runs alone copies nothing: the cell's upper layer becomes the
/// snapshot's layer (the very files, by inode), the cell goes on on a fresh one, and what it
/// writes next never reaches the snapshot. A reset mounts the target's layers again under a
/// fresh upper. A process started after either is fenced as before; a cell with a process
/// running gets a copy instead.
#[test]
fn a_quiet_cells_snapshot_and_reset_turn_layers_over_without_copies() {
    use std::os::unix::fs::MetadataExt as _;
    if !cgroups_available("daemon_turn_over") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("a.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("turn"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let run = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        let code = exit_of(&events)["code"].as_i64();
        (
            code,
            String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned(),
            String::from_utf8_lossy(&stream_bytes(&events, "stderr")).into_owned(),
        )
    };
    // More than a copy is quicker for (a hundred small files).
    let made = run(
        "echo one > a.txt && mkdir d && i=1; while [ $i -le 150 ]; do echo $i > d/f$i; i=$((i+1)); done",
    );
    assert_eq!(made.0, Some(0), "{made:?}");
    // The layer's upper directory: in its file system of its own (the default disk limit), or
    // beside its record.
    let layer = daemon.state().join("layers").join(&cell);
    let layer = match layer.join("fs/upper").exists() {
        true => layer.join("fs"),
        false => layer,
    };
    let snapshot_layer = |snap: &str| daemon.snapshot_layer(&cell, snap);
    let ino = |path: &std::path::Path| std::fs::symlink_metadata(path).unwrap().ino();
    let written = ino(&layer.join("upper/a.txt"));

    let snap = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({"as": "one"})),
    );
    assert_eq!(snap.status, 201, "{}", String::from_utf8_lossy(&snap.body));
    let own = snapshot_layer("one");
    assert_eq!(
        ino(&own.join("a.txt")),
        written,
        "the snapshot's layer is the file the cell wrote, not a copy of it"
    );
    assert_eq!(std::fs::read_dir(layer.join("upper")).unwrap().count(), 0);

    // The cell goes on, on its fresh layer; the snapshot keeps what it had.
    let next = run("echo two > a.txt && rm d/f1 && echo new > b.txt && cat a.txt");
    assert_eq!((next.0, next.1.as_str()), (Some(0), "two\n"), "{next:?}");
    assert_eq!(std::fs::read_to_string(own.join("a.txt")).unwrap(), "one\n");
    assert!(own.join("d/f1").exists());
    let changed = daemon.changed_paths(&cell);
    assert_eq!(changed.len(), 1 + 1 + 1 + 149, "{changed:?}");
    assert!(changed.contains(&"b.txt".to_owned()) && !changed.contains(&"d/f1".to_owned()));
    // Fenced as before the swap: the workspace and /tmp are writable, nothing else is.
    let fenced = run("echo x > /proc/self/comm");
    assert_ne!(fenced.0, Some(0), "{fenced:?}");
    assert!(fenced.2.contains("Permission denied"), "{fenced:?}");

    // Back to the snapshot: its layers mounted again under a fresh upper layer.
    let upper = ino(&layer.join("upper"));
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": "one" })),
    );
    assert!(
        reset.status < 300,
        "{}",
        String::from_utf8_lossy(&reset.body)
    );
    assert_ne!(
        ino(&layer.join("upper")),
        upper,
        "the reset mounted a fresh upper layer"
    );
    let back = run("cat a.txt d/f1; test -e b.txt || echo no-b; echo three > a.txt; cat a.txt");
    assert_eq!(
        (back.0, back.1.as_str()),
        (Some(0), "one\n1\nno-b\nthree\n"),
        "{back:?}"
    );
    let reset = daemon.call("POST", &format!("/v1/cells/{cell}/reset"), Some(json!({})));
    assert!(
        reset.status < 300,
        "{}",
        String::from_utf8_lossy(&reset.body)
    );
    let start = run("cat a.txt; test -e d || echo no-d; echo four > a.txt");
    assert_eq!(
        (start.0, start.1.as_str()),
        (Some(0), "host\nno-d\n"),
        "{start:?}"
    );
    assert!(daemon.changed_paths(&cell) == ["a.txt"]);

    // A process running holds the workspace: the snapshot is a copy, of the same content.
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "30"], "background": true })),
    );
    assert_eq!(started.status, 201);
    let written = ino(&layer.join("upper/a.txt"));
    let snap = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({"as": "busy"})),
    );
    assert_eq!(snap.status, 201, "{}", String::from_utf8_lossy(&snap.body));
    let copied = snapshot_layer("busy").join("a.txt");
    assert_ne!(ino(&copied), written);
    assert_eq!(std::fs::read_to_string(copied).unwrap(), "four\n");
    assert_eq!(ino(&layer.join("upper/a.txt")), written);
}

/// A quiet cell that wrote many entries at the top of its workspace: the turn-over stacks its
/// upper layer as it is (a few entries are moved into a fresh directory; many are not, each move
/// being a rename). The snapshot's layer is that very directory, with the files the cell wrote
/// (by inode); the cell goes on, on a fresh upper layer; a second snapshot of the same kind
/// stacks on the first; a reset, a fork and a diff see each snapshot whole. The helpers that
/// mounted the workspace again are reaped, though the answers did not wait for their end.
#[test]
fn a_quiet_cells_snapshot_of_many_top_entries_stacks_its_upper_layer_as_it_is() {
    use std::os::unix::fs::MetadataExt as _;
    if !cgroups_available("daemon_turn_over_whole") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("kept.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("whole"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let run = |script: &str| daemon.sh_ok(&cell, script);
    // 150 files at the top, and a folder of 10.
    run(
        "i=1; while [ $i -le 150 ]; do echo one-$i > t$i; i=$((i+1)); done; \
         mkdir d && for i in 1 2 3 4 5 6 7 8 9 10; do echo $i > d/f$i; done; rm kept.txt",
    );
    let layer = daemon.state().join("layers").join(&cell);
    let layer = match layer.join("fs/upper").exists() {
        true => layer.join("fs"),
        false => layer,
    };
    let ino = |path: &std::path::Path| std::fs::symlink_metadata(path).unwrap().ino();
    let upper_before = ino(&layer.join("upper"));
    let written = ino(&layer.join("upper/t7"));
    let snapshot = |name: &str| {
        let snap = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/snapshot"),
            Some(json!({ "as": name })),
        );
        assert_eq!(snap.status, 201, "{}", snap.text());
        daemon.snapshot_layer(&cell, name)
    };
    let one = snapshot("one");
    assert_eq!(
        ino(&one),
        upper_before,
        "the snapshot's layer is the cell's upper layer"
    );
    assert_eq!(ino(&one.join("t7")), written);
    assert_ne!(ino(&layer.join("upper")), upper_before);
    assert_eq!(std::fs::read_dir(layer.join("upper")).unwrap().count(), 0);
    // The daemon forks the next turn-over's helper ahead, behind this one: a spare that waits,
    // called `helper` once the daemon holds it ready for a job.
    let daemon_pid = daemon.pid().unwrap();
    let mut spares = Vec::new();
    wait_for("a spare helper of the daemon's", || {
        spares = children_called(daemon_pid, "helper");
        spares.len() == 1
    });

    // The cell goes on; the snapshot keeps what it had, the removal of a host file with it.
    run(
        "i=1; while [ $i -le 150 ]; do echo two-$i > t$i; i=$((i+1)); done; \
         echo new > n1 && rm d/f1 && rm t150",
    );
    assert_eq!(std::fs::read_to_string(one.join("t7")).unwrap(), "one-7\n");
    assert_eq!(
        run("cat t7 d/f2; test -e t150 || echo no-t150; test -e kept.txt || echo no-kept"),
        "two-7\n2\nno-t150\nno-kept\n"
    );
    let upper_two = ino(&layer.join("upper"));
    let two = snapshot("two");
    assert_eq!(ino(&two), upper_two, "the second snapshot turned over too");
    assert_eq!(std::fs::read_to_string(two.join("t7")).unwrap(), "two-7\n");
    // The spare did this turn-over (and ended): another waits for the next.
    wait_for(
        "the spare to do the turn-over and a new one to wait",
        || {
            let now = children_called(daemon_pid, "helper");
            now.len() == 1 && now != spares
        },
    );
    let changed = daemon.changed_paths(&cell);
    assert_eq!(changed.len(), 149 + 9 + 1 + 1 + 1, "{changed:?}");
    assert!(!changed.contains(&"t150".to_owned()) && changed.contains(&"kept.txt".to_owned()));

    // Back to the first: its layer under a fresh upper, the second's changes gone.
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": "one" })),
    );
    assert!(reset.status < 300, "{}", reset.text());
    assert_eq!(
        run("cat t7 t150 d/f1; test -e n1 || echo no-n1; ls | wc -l"),
        "one-7\none-150\n1\nno-n1\n151\n"
    );
    // A fork from the second sees it whole.
    let fork = daemon.create(
        &unique("whole-fork"),
        json!({ "from": format!("{cell}@two") }),
    );
    assert_eq!(
        daemon.sh_ok(&fork, "cat t7 n1; test -e t150 || echo no-t150; ls | wc -l"),
        "two-7\nnew\nno-t150\n151\n"
    );
    // The helpers that mounted the workspace again (two turn-overs and a reset) are reaped,
    // though no answer waited for their end.
    wait_for("the swaps' helpers to be reaped", || {
        zombies_of(daemon_pid).is_empty()
    });
}

/// In a btrfs disk of the cell's own, a snapshot of a cell whose processes run (one writes a
/// file a hundred times a second throughout) is a clone of the disk's tree taken while the cell
/// is frozen: the snapshot's files are the cell's by inode (a copy would have made new ones),
/// hold what they held at that moment, and nothing the cell writes afterwards reaches them. The
/// writer goes on. A fork sees the moment; when the cell is deleted, the clone the fork stacks
/// is moved out and the fork still reads it; removing the snapshot then lets go of it.
#[test]
fn a_running_cells_snapshot_in_a_btrfs_disk_is_a_clone_not_a_copy() {
    use std::os::unix::fs::MetadataExt as _;
    let Some((daemon, _host, cell)) = btrfs_cell("daemon_btrfs_clone", "clone") else {
        return;
    };
    let fs_dir = daemon.state().join("layers").join(&cell).join("fs");
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        mounts
            .lines()
            .any(|l| l.contains(&format!("{} btrfs ", fs_dir.display()))),
        "the cell's disk is no btrfs: {mounts}"
    );
    let run = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        assert_eq!(exit_of(&events)["code"], 0, "{script}: {events:?}");
        String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned()
    };
    // Three hundred files (more than a copy is quicker for).
    run("mkdir d && i=1; while [ $i -le 300 ]; do echo $i > d/f$i; i=$((i+1)); done");
    let ino = |path: &std::path::Path| std::fs::symlink_metadata(path).unwrap().ino();
    // The cell cannot make files share extents (a reflink, a dedupe, a copy_file_range, which
    // btrfs would turn into one): its files' data stays within its disk, and so does any copy
    // of them. cp falls back to reading and writing.
    let shared = run(r#"python3 -c '
import errno, fcntl, os
open("big", "wb").write(os.urandom(1 << 20))
src = os.open("big", os.O_RDONLY)
dst = os.open("twin", os.O_WRONLY | os.O_CREAT)
def tried(call):
    try:
        call()
        return "made"
    except OSError as e:
        return errno.errorcode[e.errno]
print(tried(lambda: fcntl.ioctl(dst, 0x40049409, src)))
rng = bytearray(32)
rng[0:4] = src.to_bytes(4, "little")
print(tried(lambda: fcntl.ioctl(dst, 0x4020940d, rng)))
print(tried(lambda: os.copy_file_range(src, dst, 1 << 20)))
' && cp big copy && cmp big copy && echo copied"#);
    assert_eq!(
        shared,
        "EPERM
EPERM
ENOSYS
copied
",
        "{shared}"
    );
    // And a writer that never stops.
    let writer = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({
            "argv": ["sh", "-c", "i=0; while :; do echo $i > live; i=$((i+1)); sleep 0.01; done"],
            "background": true,
        })),
    );
    assert_eq!(writer.status, 201, "{}", writer.text());
    let live = || run("cat live").trim().parse::<u64>().unwrap_or(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while live() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    snapshot_as(&daemon, &cell, "busy");
    let own = daemon.snapshot_layer(&cell, "busy");
    assert!(
        own.starts_with(fs_dir.join("snapshots")) && own.ends_with("upper"),
        "{own:?}"
    );
    // A clone's root is a subvolume's (inode 256), and its files keep their inode numbers.
    assert_eq!(ino(own.parent().unwrap()), 256, "the snapshot is no clone");
    for file in ["d/f1", "d/f150", "d/f300"] {
        assert_eq!(
            ino(&own.join(file)),
            ino(&fs_dir.join("upper").join(file)),
            "{file} was copied"
        );
    }
    let seen: u64 = std::fs::read_to_string(own.join("live"))
        .unwrap()
        .trim()
        .parse()
        .expect("the snapshot holds a whole line of the writer's");
    // The writer goes on, and nothing it writes reaches the snapshot.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while live() < seen + 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer stopped at the snapshot"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    run("echo after > d/f1 && rm d/f2 && echo new > e");
    assert_eq!(
        std::fs::read_to_string(own.join("live")).unwrap().trim(),
        seen.to_string()
    );
    assert_eq!(std::fs::read_to_string(own.join("d/f1")).unwrap(), "1\n");
    assert!(own.join("d/f2").exists() && !own.join("e").exists());

    // A fork sees the moment; the cell's deletion moves the clone out, and the fork reads on.
    let fork = daemon.create(
        &unique("clonefork"),
        json!({ "from": format!("{cell}@busy") }),
    );
    let read_fork = |script: &str| {
        let events = daemon.exec(&fork, json!({ "argv": ["sh", "-c", script] }));
        assert_eq!(exit_of(&events)["code"], 0, "{events:?}");
        String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned()
    };
    let expected = format!("1\n2\n{seen}\n");
    assert_eq!(read_fork("cat d/f1 d/f2 live"), expected);
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert!(deleted.status < 300, "{}", deleted.text());
    let moved = daemon.snapshot_layer(&cell, "busy");
    assert!(
        !moved.starts_with(daemon.state().join("layers")),
        "{moved:?}"
    );
    assert_eq!(
        std::fs::read_to_string(moved.join("d/f300")).unwrap(),
        "300\n"
    );
    assert_eq!(read_fork("cat d/f1 d/f2 live"), expected);
    let gone = daemon.call("DELETE", &format!("/v1/cells/{fork}"), None);
    assert!(gone.status < 300, "{}", gone.text());
    let removed = daemon.call("DELETE", &format!("/v1/snapshots/{cell}@busy"), None);
    assert!(removed.status < 300, "{}", removed.text());
    assert!(!moved.exists());
}

/// Snapshots of a quiet cell stack on each other: removing an older one takes its name, and
/// its layer stays as long as a later snapshot (or the cell) stacks it. When the cell is
/// deleted, the snapshot layers kept in its file system of its own are moved out: a fork from
/// them after the cell is gone sees everything they held.
#[test]
fn stacked_snapshots_outlive_their_names_and_their_cell() {
    if !cgroups_available("daemon_stacked") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("a.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("stack"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let run = |cell: &str, script: &str| sh_ok(&daemon, cell, script);
    let snapshot = |name: &str| snapshot_as(&daemon, &cell, name);
    // Each step changes more than a copy is quicker for.
    let many = many_files;
    run(&cell, &format!("echo one > one.txt && {}", many("m1")));
    snapshot("k1");
    run(
        &cell,
        &format!("echo two > two.txt && rm a.txt && {}", many("m2")),
    );
    snapshot("k2");
    let layer = daemon.state().join("layers").join(&cell).join("layer.json");
    let stacked: Value = serde_json::from_str(&read_file(&layer)).unwrap();
    assert_eq!(stacked["base"].as_array().unwrap().len(), 2, "{stacked}");
    run(&cell, "echo three > three.txt");
    // k1's name goes; k2, built on its layer, keeps all it had.
    let rm = daemon
        .warden()
        .args(["rm", &format!("{cell}@k1")])
        .output()
        .unwrap();
    assert!(rm.status.success(), "{rm:?}");
    let listed =
        String::from_utf8_lossy(&daemon.warden().arg("snapshots").output().unwrap().stdout)
            .into_owned();
    assert!(!listed.contains(&format!("{cell}@k1")), "{listed}");
    assert!(listed.contains(&format!("{cell}@k2")), "{listed}");
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": "k2" })),
    );
    assert!(reset.status < 300, "{}", reset.text());
    assert_eq!(
        run(&cell, "cat one.txt two.txt m1/7 m2/119; ls"),
        "one\ntwo\n7\n119\nm1\nm2\none.txt\ntwo.txt\n"
    );
    // The cell goes; its snapshot stays whole, and a fork from it sees it all.
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{cell}"), None)
            .status,
        204
    );
    let fork = daemon.create(
        &unique("stackfork"),
        json!({ "from": format!("{cell}@k2") }),
    );
    assert_eq!(
        run(&fork, "cat one.txt two.txt m1/7 m2/119; ls"),
        "one\ntwo\n7\n119\nm1\nm2\none.txt\ntwo.txt\n"
    );
    // Nothing is kept once nothing stacks it: the fork and the snapshot removed, no layer is
    // left behind.
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{fork}"), None)
            .status,
        204
    );
    let rm = daemon
        .warden()
        .args(["rm", &format!("{cell}@k2")])
        .output()
        .unwrap();
    assert!(rm.status.success(), "{rm:?}");
    let kept: Vec<_> = std::fs::read_dir(daemon.state().join("snapshots"))
        .unwrap()
        .flatten()
        .flat_map(|e| {
            let path = e.path();
            match std::fs::read_dir(&path) {
                Ok(inner) if e.file_name() == ".kept" => {
                    inner.flatten().map(|i| i.path()).collect::<Vec<_>>()
                }
                _ => vec![path],
            }
        })
        .collect();
    assert!(kept.is_empty(), "left behind: {kept:?}");
}

/// The same stack, reset while a process of the cell runs (so the reset is made in place, file
/// by file, through the cell's own mount): after the older snapshot's name is removed, a reset
/// to the later one still reads the older one's layer where its removal moved it, and the
/// process that ran throughout sees the reset tree.
#[test]
fn a_busy_cell_resets_to_a_snapshot_stacked_on_a_removed_one() {
    if !cgroups_available("daemon_stacked_busy") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("a.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("stackbusy"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let run = |script: &str| sh_ok(&daemon, &cell, script);
    let many = many_files;
    run(&format!("echo one > one.txt && {}", many("m1")));
    snapshot_as(&daemon, &cell, "k1");
    run(&format!("echo two > two.txt && rm a.txt && {}", many("m2")));
    snapshot_as(&daemon, &cell, "k2");
    run("echo three > three.txt");
    // A process holds the workspace from here on: no reset can mount it again.
    let busy = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "600"], "background": true })),
    );
    assert_eq!(busy.status, 201, "{}", busy.text());
    let rm = daemon
        .warden()
        .args(["rm", &format!("{cell}@k1")])
        .output()
        .unwrap();
    assert!(rm.status.success(), "{rm:?}");
    for round in 0..3 {
        let reset = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/reset"),
            Some(json!({ "to": "k2" })),
        );
        assert!(reset.status < 300, "round {round}: {}", reset.text());
        assert_eq!(
            run("cat one.txt two.txt m1/7 m2/119; ls; echo more > three.txt"),
            "one\ntwo\n7\n119\nm1\nm2\none.txt\ntwo.txt\n",
            "round {round}"
        );
    }
    let listed = run(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c '^sleep 600'",
    );
    assert_eq!(listed.trim(), "1", "the busy process ended");
}

/// As root, a cell's layer is a file system of the disk limit's size, and the snapshots taken
/// without a copy keep their layers in it while the cell runs: only while it is at most half
/// full. Past that, a snapshot copies (out of it), so that a session's snapshots never fill the
/// cell's disk.
#[test]
fn snapshots_kept_in_a_cells_disk_stop_at_half_of_it() {
    use std::os::unix::fs::MetadataExt as _;
    if !cgroups_available("daemon_half_disk") || !is_root() {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    let cell = daemon.create(
        &unique("halfdisk"),
        json!({
            "workspace": host.path().display().to_string(),
            "policy": "version: 1\nlimits:\n  disk: 64MiB\n",
        }),
    );
    let layer = daemon.state().join("layers").join(&cell).join("fs");
    assert!(layer.join("upper").exists(), "no file system of its own");
    let write = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        assert_eq!(exit_of(&events)["code"], 0, "{script}: {events:?}");
    };
    let many = "mkdir -p m && i=0; while [ $i -lt 120 ]; do echo $i > m/$i; i=$((i+1)); done";
    let snapshot = |name: &str| {
        snapshot_as(&daemon, &cell, name);
        daemon.snapshot_layer(&cell, name)
    };
    // A quarter of the disk: kept in it, not copied.
    write(&format!("head -c 16777216 /dev/urandom > big && {many}"));
    let ino = std::fs::metadata(layer.join("upper/big")).unwrap().ino();
    let first = snapshot("quarter");
    assert!(first.starts_with(&layer), "{first:?}");
    assert_eq!(std::fs::metadata(first.join("big")).unwrap().ino(), ino);
    // Past half of it: copied out. (A file system counts the blocks of data only once written
    // out: btrfs allocates them then. The `sync` makes that happen now, not whenever the
    // file system chooses to, which it did before the snapshot in most runs.)
    write(&format!(
        "head -c 20971520 /dev/urandom > bigger && rm -r m && {many} && sync"
    ));
    let second = snapshot("half");
    assert!(!second.starts_with(&layer), "{second:?}");
    assert_eq!(
        std::fs::metadata(second.join("bigger")).unwrap().len(),
        20 << 20
    );
}

/// The same bound counts files, not only bytes: a disk whose inodes are half used keeps no
/// more snapshots, although its blocks are nearly all free (a session of many small files would
/// otherwise run the cell out of inodes with snapshots it cannot see).
#[test]
fn snapshots_kept_in_a_cells_disk_stop_at_half_of_its_files() {
    if !cgroups_available("daemon_half_inodes") || !is_root() {
        return;
    }
    // ext4's inodes are fixed when it is made (btrfs makes them as it goes: no such bound).
    let daemon = Daemon::start_with(&[], &[("WARDEN_LAYER_FS", "ext4")]);
    let host = tempdir();
    let cell = daemon.create(
        &unique("halfinodes"),
        json!({
            "workspace": host.path().display().to_string(),
            "policy": "version: 1\nlimits:\n  disk: 64MiB\n",
        }),
    );
    let layer = daemon.state().join("layers").join(&cell).join("fs");
    let df = std::process::Command::new("df")
        .args(["--output=itotal", "-B1"])
        .arg(&layer)
        .output()
        .unwrap();
    let inodes: u64 = String::from_utf8_lossy(&df.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df gives the layer's inodes");
    let snapshot = |name: &str| {
        snapshot_as(&daemon, &cell, name);
        daemon.snapshot_layer(&cell, name)
    };
    let files = |dir: &str, n: u64| {
        let script = format!("mkdir -p {dir} && cd {dir} && seq {n} | xargs touch");
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        assert_eq!(exit_of(&events)["code"], 0, "{events:?}");
    };
    // A tenth of its files, no data: kept in it.
    files("a", inodes / 10);
    let first = snapshot("tenth");
    assert!(first.starts_with(&layer), "{first:?}");
    // Past half of its files (still hardly a block of data): copied out.
    files("b", inodes / 2);
    let second = snapshot("half");
    assert!(!second.starts_with(&layer), "{second:?}");
    assert!(second.join("b").join("1").exists());
}

/// A snapshot is removed through the API (and `warden rm CELL@SNAP` goes through it when a
/// daemon runs), journaled; a name that is none, or no snapshot's, is refused as such.
#[test]
fn snapshots_are_removed_through_the_daemon_and_journaled() {
    if !cgroups_available("daemon_snapshot_rm") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    let cell = daemon.create(
        &unique("snaprm"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    for (file, snap) in [("one", "first"), ("two", "second")] {
        let events = daemon.exec(
            &cell,
            json!({ "argv": ["sh", "-c", format!("echo {file} > {file}")] }),
        );
        assert_eq!(exit_of(&events)["code"], 0, "{events:?}");
        snapshot_as(&daemon, &cell, snap);
    }
    let listed = |daemon: &Daemon| -> Vec<String> {
        let answer = daemon.call("GET", &format!("/v1/cells/{cell}/snapshots"), None);
        answer
            .json()
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        listed(&daemon),
        [format!("{cell}@first"), format!("{cell}@second")]
    );
    let removed = daemon.call("DELETE", &format!("/v1/snapshots/{cell}@first"), None);
    assert_eq!(removed.status, 204, "{}", removed.text());
    assert_eq!(listed(&daemon), [format!("{cell}@second")]);
    let again = daemon.call("DELETE", &format!("/v1/snapshots/{cell}@first"), None);
    assert_eq!(again.status, 404, "{}", again.text());
    assert_eq!(again.json()["reason"], "no-such-snapshot");
    let nonsense = daemon.call("DELETE", "/v1/snapshots/no-at-sign", None);
    assert_eq!(nonsense.status, 400, "{}", nonsense.text());
    // The CLI goes through the daemon.
    let rm = daemon
        .warden()
        .args(["rm", &format!("{cell}@second")])
        .output()
        .unwrap();
    assert!(
        rm.status.success(),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    assert!(listed(&daemon).is_empty());
    let journal = read_file(&daemon.journal());
    let removals: Vec<&str> = journal
        .lines()
        .filter(|l| l.contains("\"workspace.snapshot.remove\""))
        .collect();
    assert_eq!(removals.len(), 2, "{journal}");
    assert!(
        removals[0].contains(&format!("{cell}@first"))
            && removals[1].contains(&format!("{cell}@second"))
    );
    // The cell reads on as before: the first snapshot's layer is still under it.
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "one", "two"] }));
    let out = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert_eq!(out, "one\ntwo\n", "{events:?}");
}

/// A cell's stack of its own snapshots' layers is merged into one once it is deep: the next
/// snapshot mounts the merged layer in their place, and the cell, its snapshots and a reset to
/// an old one all read as before.
#[test]
fn a_deep_stack_of_snapshots_is_squashed() {
    if !cgroups_available("daemon_squash") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("host.txt"), "host\n").unwrap();
    let cell = daemon.create(
        &unique("squash"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let run = |script: &str| daemon.sh_ok(&cell, script);
    let record = daemon.state().join("layers").join(&cell).join("layer.json");
    let depth = || {
        let meta: Value = serde_json::from_str(&read_file(&record)).unwrap();
        meta["base"].as_array().unwrap().len()
    };
    let turn = |i: usize| {
        // More than a copy is quicker for; a file changed every time; one turn's directory
        // removed by the next, the host's file removed once.
        let mut script = format!(
            "mkdir t{i} && j=0; while [ $j -lt 110 ]; do echo {i} > t{i}/$j; j=$((j+1)); done; echo {i} > f"
        );
        if i > 0 && i.is_multiple_of(3) {
            script.push_str(&format!(" && rm -r t{}", i - 1));
        }
        if i == 5 {
            script.push_str(" && rm host.txt");
        }
        // Every fourth turn from the second writes more entries at the top than a turn-over
        // moves: its layer is the cell's upper layer itself, stacked whole.
        if i % 4 == 1 {
            script.push_str(&format!(
                " && for k in 0 1 2 3 4 5 6 7 8; do echo {i} > w{i}-$k; done"
            ));
        }
        run(&script);
        snapshot_as(&daemon, &cell, &format!("s{i}"));
    };
    for i in 0..12 {
        turn(i);
        assert_eq!(depth(), i + 1);
    }
    // Twelve of its own: merged aside, then mounted by the next snapshot.
    wait_for_squash(&daemon, &cell);
    turn(12);
    assert_eq!(depth(), 2, "{}", read_file(&record));
    let listed = |dir: &str| run(&format!("ls {dir} | grep -v '^w' | tr '\\n' ' '"));
    assert_eq!(listed("."), "f t0 t1 t10 t12 t3 t4 t6 t7 t9 ");
    assert_eq!(run("cat f t0/0 t12/109"), "12\n0\n12\n");
    assert_eq!(run("ls -d w* | wc -l; cat w1-0 w5-4 w9-8"), "27\n1\n5\n9\n");
    // An old snapshot reads as it did.
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": "s4" })),
    );
    assert!(reset.status < 300, "{}", reset.text());
    assert_eq!(listed("."), "f host.txt t0 t1 t3 t4 ");
    assert_eq!(run("cat f host.txt"), "4\nhost\n");
    assert_eq!(run("ls -d w* | wc -l; cat w1-8"), "9\n1\n");
}

/// A deep stack whose bottom layer is a btrfs clone's (a reset to a snapshot taken while a
/// process ran) is squashed as well. No hard link reaches a file in another subvolume: the
/// clone's files are cloned into the merged layer instead, with their times and owners, and a
/// merge that failed leaves nothing half-built in the cell's disk. (Each failed merge used to
/// leave a `.building` directory there, and the stack grew without bound.)
#[test]
fn a_deep_stack_over_a_clone_is_squashed() {
    let Some((daemon, _host, cell)) = btrfs_cell("daemon_squash_clone", "squashclone") else {
        return;
    };
    let run = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        assert_eq!(exit_of(&events)["code"], 0, "{script}: {events:?}");
        String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned()
    };
    run(
        "mkdir c && j=0; while [ $j -lt 150 ]; do echo c$j > c/$j; j=$((j+1)); done; \
         touch -d '2001-02-03 04:05:06 UTC' c/7; \
         mkdir h && echo linked > h/a && ln h/a h/b && ln h/a c/a",
    );
    // A process runs while the snapshot is taken: a clone.
    let sleeper = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "1"], "background": true })),
    );
    assert_eq!(sleeper.status, 201, "{}", sleeper.text());
    snapshot_as(&daemon, &cell, "clone");
    let clone = daemon.snapshot_layer(&cell, "clone");
    assert!(
        clone.ends_with("upper") && clone.to_string_lossy().contains("/.sv-"),
        "{clone:?}"
    );
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let running = || {
        let listed = daemon.call("GET", &format!("/v1/cells/{cell}/processes"), None);
        let listed = listed.json();
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["running"] == true)
    };
    while running() {
        assert!(std::time::Instant::now() < until, "the sleep did not end");
        std::thread::sleep(Duration::from_millis(50));
    }
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/reset"),
        Some(json!({ "to": format!("{cell}@clone") })),
    );
    assert!(reset.status < 300, "{}", reset.text());
    let record = daemon.state().join("layers").join(&cell).join("layer.json");
    let depth = || {
        let meta: Value = serde_json::from_str(&read_file(&record)).unwrap();
        meta["base"].as_array().unwrap().len()
    };
    assert_eq!(depth(), 1, "{}", read_file(&record));
    let turn = |i: usize| {
        run(&format!(
            "mkdir t{i} && j=0; while [ $j -lt 110 ]; do echo {i} > t{i}/$j; j=$((j+1)); done"
        ));
        snapshot_as(&daemon, &cell, &format!("s{i}"));
    };
    for i in 0..11 {
        turn(i);
        assert_eq!(depth(), i + 2);
    }
    wait_for_squash(&daemon, &cell);
    turn(11);
    assert_eq!(depth(), 2, "{}", read_file(&record));
    assert_eq!(run("cat c/0 c/149 t0/0 t11/109"), "c0\nc149\n0\n11\n");
    assert_eq!(
        run("stat -c %Y c/7"),
        "981173106\n",
        "the clone's file kept its time"
    );
    // Three names of one file in the clone are one file in the merged layer.
    let inodes = run("stat -c '%h %i' h/a h/b c/a");
    let inodes: Vec<&str> = inodes.lines().collect();
    assert!(
        inodes.len() == 3
            && inodes
                .iter()
                .all(|l| *l == inodes[0] && l.starts_with("3 ")),
        "{inodes:?}"
    );
    let snapshots = daemon
        .state()
        .join("layers")
        .join(&cell)
        .join("fs/snapshots");
    let building: Vec<_> = std::fs::read_dir(&snapshots)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".building"))
        .collect();
    assert!(building.is_empty(), "{building:?}");
}

/// A daemon whose cells' disks are btrfs, and a cell of it (named from `prefix`) on a fresh
/// host directory; none where this host cannot make one (not root, no cgroups, no
/// `mkfs.btrfs`).
fn btrfs_cell(test: &str, prefix: &str) -> Option<(Daemon, TestDir, String)> {
    if !cgroups_available(test) || !is_root() {
        return None;
    }
    if !std::path::Path::new("/usr/sbin/mkfs.btrfs").exists()
        && !std::path::Path::new("/sbin/mkfs.btrfs").exists()
    {
        eprintln!("skipped: mkfs.btrfs (btrfs-progs) is not installed");
        return None;
    }
    let daemon = Daemon::start_with(&[], &[("WARDEN_LAYER_FS", "btrfs")]);
    let host = tempdir();
    let cell = daemon.create(
        &unique(prefix),
        json!({ "workspace": host.path().display().to_string() }),
    );
    Some((daemon, host, cell))
}

/// Waits (20 s at most) until the merged layer of `cell`'s own snapshot layers is ready.
fn wait_for_squash(daemon: &Daemon, cell: &str) {
    let note = daemon
        .state()
        .join("layers")
        .join(cell)
        .join("squashed.json");
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !note.exists() {
        assert!(std::time::Instant::now() < until, "no squash was made");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Takes snapshot `name` of `cell` through the API.
/// Runs `script` with `sh -c` in `cell`, which must end with 0; its output.
fn sh_ok(daemon: &Daemon, cell: &str, script: &str) -> String {
    let events = daemon.exec(cell, json!({ "argv": ["sh", "-c", script] }));
    assert_eq!(exit_of(&events)["code"], 0, "{script}: {events:?}");
    String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned()
}

/// A script that makes directory `dir` with 120 small files (more than a copy is quicker for).
fn many_files(dir: &str) -> String {
    format!("mkdir {dir} && i=0; while [ $i -lt 120 ]; do echo $i > {dir}/$i; i=$((i+1)); done")
}

fn snapshot_as(daemon: &Daemon, cell: &str, name: &str) {
    let answer = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/snapshot"),
        Some(json!({ "as": name })),
    );
    assert_eq!(answer.status, 201, "{}", answer.text());
}

/// A cell's workspace changes cost the daemon memory per change listed, and a cell makes
/// changes for nothing (60,000 empty files in a few seconds). The daemon made each diff a JSON
/// document whole before it wrote it out or journaled the first 1,000 changes at the cell's
/// end or delete: ~1.6 KiB a change, 97 MiB for these (317 MiB for 200,000 files). It keeps
/// the diff's own records now (~0.4 KiB a change).
#[test]
fn a_diff_of_many_changes_costs_the_daemon_little_memory_per_change() {
    if !cgroups_available("diff_memory") {
        return;
    }
    const DIRS: usize = 60;
    let daemon = Daemon::start(&[]);
    let pid = daemon.pid().unwrap();
    let host = tempdir();
    let cell = daemon.create(
        &unique("many"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let script = format!(
        "cd /workspace && for d in $(seq 1 {DIRS}); do mkdir d$d && (cd d$d && seq 1 1000 | xargs touch); done"
    );
    let made = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
    assert_eq!(exit_of(&made)["code"], 0, "{made:?}");
    let changes = DIRS * 1001;

    if !reset_peak(pid) {
        eprintln!("skipped: the peak of a process's memory cannot be reset here");
        return;
    }
    let before = resident_kib(pid);
    let diff = daemon.call("GET", &format!("/v1/cells/{cell}/diff"), None);
    assert_eq!(diff.status, 200, "{}", diff.text());
    assert_eq!(diff.json()["changes"].as_array().unwrap().len(), changes);
    let diffed = peak_kib(pid).saturating_sub(before);

    assert!(reset_peak(pid));
    let before = resident_kib(pid);
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert!(deleted.status < 300, "{}", deleted.text());
    let deleting = peak_kib(pid).saturating_sub(before);
    let journaled = daemon
        .entries_of(&cell)
        .into_iter()
        .find(|e| e["kind"] == "workspace.changes")
        .unwrap();
    assert_eq!(journaled["data"]["count"], changes);
    assert_eq!(journaled["data"]["changes"].as_array().unwrap().len(), 1000);

    eprintln!("the daemon's peak grew {diffed} KiB for the diff, {deleting} KiB for the delete");
    // Measured: 35 MiB for the diff (its records and the answer's text), 22 MiB for the
    // delete; 97 and 94 MiB before.
    assert!(
        diffed < 64 << 10,
        "a diff of {changes} changes: +{diffed} KiB"
    );
    assert!(
        deleting < 48 << 10,
        "a delete of {changes} changes: +{deleting} KiB"
    );
}

/// Applies beside uploads of the files API into the same workspace. An upload writes its file
/// under a temporary name (`.NAME.warden-N`) and renames it; an apply that ran beside it copied
/// the half-written temporary file to the host, where it stayed (every later apply then
/// conflicted with it) or failed with a 500. The apply now waits for the cell's file operations.
#[test]
fn an_apply_beside_an_upload_copies_no_half_written_file() {
    if !cgroups_available("daemon_apply_race") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    let cell = daemon.create(
        &unique("applyrace"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let body = "x".repeat(3 << 20);
    for round in 0..16u64 {
        let upload = upload_beside(&daemon, &cell, &format!("big{round}"), &body, round);
        let apply = daemon.call("POST", &format!("/v1/cells/{cell}/apply"), Some(json!({})));
        assert_eq!(apply.status, 200, "round {round}: {}", apply.text());
        let uploaded = upload.join().unwrap();
        assert!(uploaded.status < 300, "{}", uploaded.text());
        let stray: Vec<_> = std::fs::read_dir(host.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".warden-"))
            .collect();
        assert!(stray.is_empty(), "round {round}: on the host: {stray:?}");
    }
    let apply = daemon.call("POST", &format!("/v1/cells/{cell}/apply"), Some(json!({})));
    assert_eq!(apply.status, 200, "{}", apply.text());
    for round in 0..16 {
        let copied = std::fs::metadata(host.path().join(format!("big{round}"))).unwrap();
        assert_eq!(copied.len(), 3 << 20, "big{round}");
    }
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
}

/// Resets beside uploads of the files API: each upload is whole in the cell or waits for the
/// reset. Before, an upload that a reset met wrote into the overlay the reset replaced, and its
/// rename failed with a 404 `no-such-file` for the file it was writing.
#[test]
fn a_reset_beside_an_upload_leaves_the_upload_whole() {
    if !cgroups_available("daemon_reset_race") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    let cell = daemon.create(
        &unique("resetrace"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let body = "x".repeat(3 << 20);
    for round in 0..16u64 {
        let upload = upload_beside(&daemon, &cell, &format!("up{round}"), &body, round);
        let reset = daemon.call("POST", &format!("/v1/cells/{cell}/reset"), Some(json!({})));
        assert_eq!(reset.status, 200, "round {round}: {}", reset.text());
        let uploaded = upload.join().unwrap();
        assert!(
            uploaded.status < 300,
            "round {round}: {} {}",
            uploaded.status,
            uploaded.text()
        );
    }
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
}

/// Names that are not UTF-8, made by a cell beside a host file named U+FFFD: `\xff` and `\xfe`
/// (two names a lossy conversion shows alike, and as that host file), a directory `d\xff`,
/// and a link `lnk` to `\xff`. Before, the diff listed both files as `\u{fffd}` and the link
/// as leading to `\u{fffd}`, unrefused: an apply wrote the host a link to the host's own
/// U+FFFD file (the cell's led to `\xff`); the files API listed the host's U+FFFD file three
/// times (its size each time) and left out `d\xff`, an archive held the host's bytes three
/// times and none of the cell's, and reading `lnk` read the host's file. Now each such name is
/// shown escaped (`\xff`), listed refused and never applied; the files API refuses to name it
/// (a 400 that names it), and a recursive removal takes it by its own bytes.
#[test]
fn names_that_are_not_utf8_are_shown_escaped_refused_and_never_taken_for_another() {
    if !cgroups_available("daemon_not_utf8") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("\u{fffd}"), "host's own\n").unwrap();
    let cell = daemon.create(
        &unique("notutf8"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let made = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", r#"cd /workspace && printf one > "$(printf '\377')" \
            && printf two > "$(printf '\376')" && ln -s "$(printf '\377')" lnk \
            && mkdir "$(printf 'd\377')" "t" && echo x > "$(printf 'd\377')/in" \
            && echo y > "$(printf 't/\377')" && cat lnk"#] }),
    );
    assert_eq!(stream_bytes(&made, "stdout"), b"one");

    let diff = daemon
        .call("GET", &format!("/v1/cells/{cell}/diff"), None)
        .json();
    let changes = diff["changes"].as_array().unwrap();
    let paths: Vec<&str> = changes
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    for expected in [r"\xff", r"\xfe", r"d\xff", r"t/\xff", "lnk"] {
        let change = changes
            .iter()
            .find(|c| c["path"] == expected)
            .unwrap_or_else(|| panic!("{expected} listed: {paths:?}"));
        assert!(
            change["refused"]
                .as_str()
                .is_some_and(|r| r.contains("UTF-8")),
            "{change}"
        );
    }
    let lnk = changes.iter().find(|c| c["path"] == "lnk").unwrap();
    assert_eq!(lnk["link_target"], r"\xff");
    let mut unique_paths = paths.clone();
    unique_paths.sort_unstable();
    unique_paths.dedup();
    assert_eq!(unique_paths.len(), paths.len(), "{paths:?}");

    // Named, each is refused; applied whole, each is left out with its reason.
    for named in ["lnk", r"\xff", r"d\xff"] {
        let apply = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/apply"),
            Some(json!({ "paths": [named] })),
        );
        assert_eq!(apply.status, 409, "{named}: {}", apply.text());
        assert!(apply.text().contains("UTF-8"), "{}", apply.text());
    }
    let apply = daemon.call("POST", &format!("/v1/cells/{cell}/apply"), Some(json!({})));
    assert_eq!(apply.status, 200, "{}", apply.text());
    let mut on_host: Vec<String> = std::fs::read_dir(host.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_host.sort();
    // `t` itself is a new directory the cell made (applied empty); nothing else came.
    assert_eq!(on_host, ["t", "\u{fffd}"], "{}", apply.text());
    assert_eq!(
        std::fs::read_to_string(host.path().join("\u{fffd}")).unwrap(),
        "host's own\n"
    );
    assert_eq!(std::fs::read_dir(host.path().join("t")).unwrap().count(), 0);

    // The files API: a listing, an archive, a read through the link are refused, naming it.
    let files = |op: &str, query: &str| format!("/v1/cells/{cell}/files/{op}?path={query}");
    for url in [
        files("list", "."),
        files("archive", "."),
        files("content", "lnk"),
        files("stat", "lnk"),
    ] {
        let answer = daemon.request("GET", &url, None);
        assert_eq!(answer.status, 400, "{url}: {}", answer.text());
        assert!(answer.text().contains(r"\\xff"), "{url}: {}", answer.text());
    }
    // What names only UTF-8 works as before; a recursive removal takes the name by its bytes.
    let read = daemon.request("GET", &files("content", "%EF%BF%BD"), None);
    assert_eq!(read.body, b"host's own\n");
    let removed = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/files/remove"),
        Some(json!({"path": "t", "recursive": true})),
    );
    assert_eq!(removed.status, 204, "{}", removed.text());
    assert_eq!(daemon.call("GET", &files("stat", "t"), None).status, 404);
}

/// Snapshots beside uploads of the files API. An upload writes `.NAME.warden-N` and renames it;
/// a snapshot taken in between held the temporary file, and a reset to it left the file in the
/// workspace for good. The snapshot now waits for the cell's file operations, as an apply does.
#[test]
fn a_snapshot_beside_an_upload_holds_no_temporary_file() {
    if !cgroups_available("daemon_snapshot_race") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    let cell = daemon.create(
        &unique("snaprace"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let body = "x".repeat(3 << 20);
    let mut strays = Vec::new();
    for round in 0..16u64 {
        let upload = upload_beside(&daemon, &cell, &format!("up{round}"), &body, round);
        let snap = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/snapshot"),
            Some(json!({ "as": format!("s{round}") })),
        );
        assert!(snap.status < 300, "round {round}: {}", snap.text());
        let uploaded = upload.join().unwrap();
        assert!(uploaded.status < 300, "round {round}: {}", uploaded.text());
        let reset = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/reset"),
            Some(json!({ "to": format!("s{round}") })),
        );
        assert_eq!(reset.status, 200, "round {round}: {}", reset.text());
        let list = daemon
            .call("GET", &format!("/v1/cells/{cell}/files/list?path=."), None)
            .json();
        strays.extend(
            list.as_array()
                .unwrap()
                .iter()
                .filter_map(|e| e["name"].as_str())
                .filter(|n| n.contains(".warden-"))
                .map(|n| format!("round {round}: {n}")),
        );
    }
    assert!(
        strays.is_empty(),
        "left by a reset to a snapshot: {strays:?}"
    );
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
}

/// A fork from a snapshot that is removed at the same moment: made, or a 404 that says the
/// snapshot went. Before, a removal between the create's check and the tier's start made the
/// fork a 400 `tier-refused` ("could not start: no snapshot ...").
#[test]
fn a_fork_from_a_snapshot_removed_meanwhile_is_told_as_the_snapshot_gone() {
    if !cgroups_available("daemon_fork_race") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let host = tempdir();
    let cell = daemon.create(
        &unique("forkrace"),
        json!({ "workspace": host.path().display().to_string() }),
    );
    let mut told = Vec::new();
    for round in 0..24u64 {
        let snap = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/snapshot"),
            Some(json!({ "as": format!("s{round}") })),
        );
        assert!(snap.status < 300, "{}", snap.text());
        let removal = {
            let daemon = std::sync::Arc::clone(&daemon);
            let path = format!("/v1/snapshots/{cell}@s{round}");
            std::thread::spawn(move || daemon.call("DELETE", &path, None))
        };
        std::thread::sleep(Duration::from_micros(500 * (round % 6)));
        let fork = format!("{cell}-f{round}");
        let forked = daemon.call(
            "POST",
            "/v1/cells",
            Some(json!({ "name": fork, "from": format!("{cell}@s{round}") })),
        );
        let removed = removal.join().unwrap();
        match forked.status {
            200 | 201 => {
                let _ = daemon.call("DELETE", &format!("/v1/cells/{fork}"), None);
            }
            404 => assert_eq!(forked.json()["reason"], "no-such-snapshot"),
            other => panic!("round {round}: fork {other}: {}", forked.text()),
        }
        told.push((forked.status, removed.status));
    }
    eprintln!("(fork, removal) per round: {told:?}");
}

/// An upload of `body` to `path` in `cell` on a thread of its own, and a moment (0 to 14 ms,
/// by `round`) for it to get under way before what the caller does beside it.
fn upload_beside(
    daemon: &std::sync::Arc<Daemon>,
    cell: &str,
    path: &str,
    body: &str,
    round: u64,
) -> std::thread::JoinHandle<Answer> {
    let daemon = std::sync::Arc::clone(daemon);
    let (url, body) = (
        format!("/v1/cells/{cell}/files/content?path={path}"),
        body.to_owned(),
    );
    let upload = std::thread::spawn(move || daemon.request("PUT", &url, Some(&body)));
    std::thread::sleep(Duration::from_millis(2 * (round % 8)));
    upload
}
