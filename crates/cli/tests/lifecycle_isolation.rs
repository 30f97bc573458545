//! A cell's name outlives the cell: what a new cell of an earlier one's name may reach of it.
//! Nothing: not its commands held for approval, its standing grants, its processes, nor (by a
//! reset) its snapshots.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

/// The open question of `cell` whose request holds `part`, within a few seconds.
fn question(daemon: &Daemon, cell: &str, part: &str, within: Duration) -> Option<u64> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let list = daemon.call("GET", "/v1/approvals", None).json();
        if let Some(q) =
            list.as_array().unwrap().iter().find(|q| {
                q["cell"] == cell && q["request"].as_str().is_some_and(|r| r.contains(part))
            })
        {
            return q["id"].as_u64();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// An exec on its own connection (it is held while a person is asked): its status and body.
fn exec_held(daemon: &Daemon, cell: &str, argv: Value) -> std::thread::JoinHandle<(u16, String)> {
    let socket = daemon.socket();
    let path = format!("/v1/cells/{cell}/exec");
    let body = json!({ "argv": argv }).to_string();
    std::thread::spawn(move || {
        let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        let answer = exchange(stream, "POST", &path, Some(&body), &[]);
        (answer.status, answer.text())
    })
}

fn stdout_of(daemon: &Daemon, cell: &str, script: &str) -> String {
    String::from_utf8(stream_bytes(
        &daemon.exec(cell, json!({ "argv": ["sh", "-c", script] })),
        "stdout",
    ))
    .unwrap()
}

#[test]
fn a_command_held_for_a_deleted_cell_never_runs_in_a_new_cell_of_its_name() {
    if !cgroups_available("lifecycle_isolation") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let name = unique("held");
    let asks = "version: 1\nextends: default\ncommands:\n  default: allow\n  ask: [\"sh *\"]\n";
    daemon.create(&name, json!({ "policy": asks }));
    let held = exec_held(
        &daemon,
        &name,
        json!(["sh", "-c", "echo planted > /tmp/planted"]),
    );
    let id = question(&daemon, &name, "/tmp/planted", Duration::from_secs(10))
        .expect("the command is held for a person");
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
    // A new cell of the name, whose policy asks about nothing.
    daemon.create(&name, json!({ "preset": "default" }));
    let listed = daemon.call("GET", "/v1/approvals", None).json();
    let stale = listed
        .as_array()
        .unwrap()
        .iter()
        .any(|q| q["id"].as_u64() == Some(id));
    let answer = daemon.call(
        "POST",
        &format!("/v1/approvals/{name}/{id}"),
        Some(json!({ "decision": "approve" })),
    );
    let (status, body) = held.join().unwrap();
    let planted = stdout_of(&daemon, &name, "cat /tmp/planted 2>/dev/null || echo none");
    assert_eq!(
        planted.trim(),
        "none",
        "the command held for the deleted cell ran in the new one (approval answered {}, exec {status}: {body})",
        answer.status
    );
    assert!(
        !stale,
        "the deleted cell's question is listed for the new one: {listed}"
    );
    assert_ne!(
        answer.status, 204,
        "an answer reached the deleted cell's question"
    );
    assert_ne!(status, 200, "the held exec was not refused: {body}");
}

#[test]
fn a_new_cell_of_an_ended_cells_name_has_none_of_its_grants_or_processes() {
    if !cgroups_available("lifecycle_isolation") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let name = unique("grant");
    let asks = "version: 1\nextends: default\ncommands:\n  default: allow\n  ask: [\"touch *\"]\n";
    daemon.create(&name, json!({ "policy": asks }));
    let held = exec_held(&daemon, &name, json!(["touch", "/tmp/x"]));
    let id = question(&daemon, &name, "touch /tmp/x", Duration::from_secs(10))
        .expect("the command is held for a person");
    let answer = daemon.call(
        "POST",
        &format!("/v1/approvals/{name}/{id}"),
        Some(json!({ "decision": "approve", "scope": "cell" })),
    );
    assert_eq!(answer.status, 204, "{}", answer.text());
    assert_eq!(held.join().unwrap().0, 200);
    // Ended, not deleted: its name may be taken by a new cell.
    let killed = daemon.call("POST", &format!("/v1/cells/{name}/kill"), None);
    assert_eq!(killed.status, 200, "{}", killed.text());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let created = daemon.call(
            "POST",
            "/v1/cells",
            Some(json!({ "name": name, "policy": asks })),
        );
        if created.status == 201 {
            break;
        }
        assert!(Instant::now() < deadline, "create: {}", created.text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let processes = daemon
        .call("GET", &format!("/v1/cells/{name}/processes"), None)
        .json();
    assert_eq!(
        processes,
        json!([]),
        "the new cell lists the ended cell's processes"
    );
    // The grant was the ended cell's: the new cell's command is asked about again.
    let held = exec_held(&daemon, &name, json!(["touch", "/tmp/x"]));
    let asked = question(&daemon, &name, "touch /tmp/x", Duration::from_secs(5));
    if let Some(id) = asked {
        let denied = daemon.call(
            "POST",
            &format!("/v1/approvals/{name}/{id}"),
            Some(json!({ "decision": "deny" })),
        );
        assert_eq!(denied.status, 204, "{}", denied.text());
    }
    let (status, body) = held.join().unwrap();
    assert!(
        asked.is_some(),
        "the ended cell's grant of scope `cell` answered the new cell's command (exec {status}: {body})"
    );
    assert_eq!(status, 403, "{body}");
}

#[test]
fn a_reset_takes_no_snapshot_of_an_earlier_cell_of_its_name() {
    if !cgroups_available("lifecycle_isolation") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let first = tempdir();
    let second = tempdir();
    std::fs::write(first.path().join("one"), "1\n").unwrap();
    std::fs::write(second.path().join("two"), "2\n").unwrap();
    let name = unique("reused");
    daemon.create(
        &name,
        json!({ "preset": "default", "workspace": first.path() }),
    );
    stdout_of(&daemon, &name, "echo earlier > /workspace/secret");
    let taken = daemon.call(
        "POST",
        &format!("/v1/cells/{name}/snapshot"),
        Some(json!({ "as": "s1" })),
    );
    assert!(taken.status < 300, "{}", taken.text());
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
    // Another cell of the name, on another workspace, made at once.
    let created = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "name": name, "preset": "default", "workspace": second.path() })),
    );
    assert_eq!(created.status, 201, "create: {}", created.text());
    let listed = daemon
        .call("GET", &format!("/v1/cells/{name}/snapshots"), None)
        .json();
    let reset = daemon.call(
        "POST",
        &format!("/v1/cells/{name}/reset"),
        Some(json!({ "to": "s1" })),
    );
    let seen = stdout_of(
        &daemon,
        &name,
        "cat /workspace/secret 2>/dev/null || echo none",
    );
    assert_eq!(
        seen.trim(),
        "none",
        "a reset put the earlier cell's files in the new cell (reset {}: {})",
        reset.status,
        reset.text()
    );
    assert_eq!(reset.status, 400, "{}", reset.text());
    assert_eq!(
        listed,
        json!([]),
        "the earlier cell's snapshots are listed as the new one's"
    );
    // The snapshot itself is kept: a new cell may still start from it.
    let fork = unique("fork");
    daemon.create(&fork, json!({ "from": format!("{name}@s1") }));
    assert_eq!(
        stdout_of(&daemon, &fork, "cat /workspace/secret").trim(),
        "earlier"
    );
    let _ = daemon.call("DELETE", &format!("/v1/cells/{fork}"), None);
    let _ = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
    let _ = daemon.call("DELETE", &format!("/v1/snapshots/{name}@s1"), None);
}

#[test]
fn a_cell_whose_create_a_crash_cut_is_ended_by_the_next_daemon() {
    if !cgroups_available("lifecycle_isolation") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let workspace = tempdir();
    // The daemon is killed as soon as the cell's keeper has it running, before the daemon
    // keeps it (its database entry): a few rounds, until one lands in that window.
    for round in 0..20 {
        let name = unique("cut");
        let socket = daemon.socket();
        let body =
            json!({ "name": name, "preset": "default", "workspace": workspace.path() }).to_string();
        let create = std::thread::spawn(move || {
            let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
            let mut stream = stream;
            use std::io::{Read as _, Write as _};
            let head = format!(
                "POST /v1/cells HTTP/1.1\r\nHost: warden\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(head.as_bytes()).unwrap();
            let mut raw = Vec::new();
            let _ = stream.read_to_end(&mut raw);
            raw
        });
        let record = daemon.runtime().join("cells").join(&name).join("cell.json");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !record.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        daemon.crash();
        let answered = !create.join().unwrap().is_empty();
        daemon.restart();
        let listed = daemon
            .call("GET", &format!("/v1/cells/{name}"), None)
            .status
            == 200;
        if answered || listed {
            // Kept before the crash: the next daemon took it back like any cell.
            let _ = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
            continue;
        }
        // Cut: nothing of it may run on, unlisted, holding its name.
        let again = daemon.call(
            "POST",
            "/v1/cells",
            Some(json!({ "name": name, "preset": "default" })),
        );
        assert_eq!(
            again.status,
            201,
            "round {round}: the cell whose create the crash cut runs on, listed by no daemon: {}",
            again.text()
        );
        let kinds: Vec<String> = daemon
            .entries_of(&name)
            .iter()
            .map(|e| e["kind"].as_str().unwrap().to_owned())
            .collect();
        let delete = kinds.iter().position(|k| k == "cell.delete");
        let second = kinds.iter().rposition(|k| k == "cell.create");
        assert!(
            delete.is_some() && delete < second,
            "round {round}: the cut cell's end is not journaled before the name is made again: {kinds:?}"
        );
        return;
    }
    eprintln!("lifecycle_isolation: no round cut a create between its start and its keeping");
}

#[test]
fn a_cell_made_at_once_in_a_deleted_ones_name_keeps_its_own_layer() {
    if !cgroups_available("lifecycle_isolation") {
        return;
    }
    // The earlier cell's keeper released the name before it decided its layer's fate, and
    // then, finding at the layer's path the new cell's (whose upper was still empty), moved
    // it away for removal: the new cell's start failed with ENOENT (in 2 to 4 rounds of 30).
    let daemon = Daemon::start(&[]);
    let workspace = tempdir();
    std::fs::write(workspace.path().join("one"), "1\n").unwrap();
    let name = unique("again");
    for round in 0..30 {
        let created = daemon.call(
            "POST",
            "/v1/cells",
            Some(json!({ "name": name, "preset": "default", "workspace": workspace.path() })),
        );
        assert_eq!(created.status, 201, "round {round}: {}", created.text());
        stdout_of(&daemon, &name, "echo x > /workspace/changed");
        let taken = daemon.call(
            "POST",
            &format!("/v1/cells/{name}/snapshot"),
            Some(json!({ "as": format!("s{round}") })),
        );
        assert!(taken.status < 300, "round {round}: {}", taken.text());
        let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
        assert_eq!(deleted.status, 204, "round {round}: {}", deleted.text());
    }
}
