//! The life of the daemon and its cells: crashes and restarts, idle and memory limits,
//! terminals (and over a WebSocket), the journal's segments.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

#[test]
fn a_crashed_daemon_leaves_cells_controllable_and_the_journal_whole() {
    if !cgroups_available("daemon_crash") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("crash"), json!({}));
    // Acknowledged work before the crash.
    let mut acknowledged = Vec::new();
    for i in 0..5 {
        let events = daemon.exec(&cell, json!({ "argv": ["echo", format!("run {i}")] }));
        acknowledged.push(exit_of(&events)["journal_seq"].as_u64().unwrap());
    }
    // A client streams output while the daemon dies.
    let socket = daemon.socket();
    let path = format!("/v1/cells/{cell}/exec");
    let streaming = std::thread::spawn(move || {
        let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        let body = json!({ "argv": ["sh", "-c", "while true; do echo tick; sleep 0.05; done"] })
            .to_string();
        exchange(stream, "POST", &path, Some(&body), &[])
    });
    let quiet_socket = daemon.socket();
    let quiet_path = format!("/v1/cells/{cell}/exec");
    let quiet = std::thread::spawn(move || {
        let stream = std::os::unix::net::UnixStream::connect(quiet_socket).unwrap();
        let body = json!({ "argv": ["sleep", "1000"] }).to_string();
        exchange(stream, "POST", &quiet_path, Some(&body), &[])
    });
    std::thread::sleep(Duration::from_millis(500));
    daemon.restart();
    let cut = streaming.join().unwrap();
    quiet.join().unwrap();
    assert!(
        String::from_utf8_lossy(&cut.body).contains("tick"),
        "output streamed before the crash"
    );

    // The cell survived and is controllable by the new daemon.
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .json()["state"],
        "running"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "after"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"after\n");
    // A quiet process whose client was the dead daemon lost that client (its pipes may stay
    // quiet forever), so the cell's init killed it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let events = daemon.exec(&cell, json!({ "argv": ["ps", "-eo", "args"] }));
        let listing = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
        assert!(listing.contains("ps -eo args"), "{listing}");
        if !listing.contains("while true") && !listing.contains("sleep 1000") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the process of the lost client still runs: {listing}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/pause"), None)
            .json()["state"],
        "paused"
    );
    assert_eq!(
        daemon
            .call("POST", &format!("/v1/cells/{cell}/resume"), None)
            .json()["state"],
        "running"
    );

    // Every acknowledged entry is there, and the journal verifies.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let entries: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for seq in &acknowledged {
        let entry = entries
            .iter()
            .find(|e| e["seq"] == *seq)
            .expect("acknowledged entry kept");
        assert_eq!(entry["kind"], "exec.exit");
    }
    assert!(
        entries
            .iter()
            .any(|e| e["kind"] == "cell.reattach" && e["cell"] == cell.as_str())
    );
    daemon.assert_journal_verifies();

    // Kill the cell with the new daemon; nothing of it is left.
    daemon.call("POST", &format!("/v1/cells/{cell}/kill"), None);
    assert!(host_processes_with(&cell).is_empty());
    assert!(cgroup_dirs_of(&cell).is_empty());

    // One changed byte in an entry in the middle: verify fails and names that entry.
    let mut lines: Vec<String> = journal.lines().map(str::to_owned).collect();
    let target = acknowledged[2] as usize;
    let index = lines
        .iter()
        .position(|l| l.starts_with(&format!("{{\"seq\":{target},")))
        .unwrap();
    lines[index] = lines[index].replacen("run 2", "run X", 1);
    std::fs::write(daemon.journal(), lines.join("\n") + "\n").unwrap();
    let verify = daemon.warden().args(["audit", "verify"]).output().unwrap();
    let text = String::from_utf8_lossy(&verify.stdout);
    assert_eq!(verify.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "entry {target} (journal.jsonl line {})",
            index + 1
        )),
        "{text}"
    );
}

#[test]
fn an_idle_cell_is_paused_and_the_next_exec_wakes_it() {
    if !cgroups_available("daemon_idle") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(
        &unique("idle"),
        json!({ "policy": "version: 1\nlimits:\n  idle: 1s\n  on_idle: pause\n" }),
    );
    let mut state = String::new();
    for _ in 0..60 {
        state = daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .json()["state"]
            .as_str()
            .unwrap()
            .to_owned();
        if state == "paused" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(state, "paused", "idle for 1 s: paused");
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "awake"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"awake\n");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(journal.contains("\"kind\":\"cell.idle\""));
    assert!(journal.contains("exec after an idle pause"));
}

#[test]
fn a_terminal_in_the_cell_with_input_and_resize_from_outside() {
    if !cgroups_available("daemon_pty") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("pty"), json!({}));
    // A foreground process on a terminal of the cell's own devpts.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "tty; stty size; test -t 0 && echo interactive"], "tty": { "rows": 24, "cols": 80 } }),
    );
    let out = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(out.contains("/dev/pts/0"), "{out}");
    assert!(
        out.contains("24 80") && out.contains("interactive"),
        "{out}"
    );

    // In the background: typed input reaches it, and a resize from outside is seen inside.
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "read line; echo got:$line; stty size"], "tty": { "rows": 10, "cols": 20 }, "background": true })),
    );
    assert_eq!(
        started.status,
        201,
        "{}",
        String::from_utf8_lossy(&started.body)
    );
    let id = started.json()["id"].as_u64().unwrap();
    let resized = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/resize"),
        Some(json!({ "rows": 40, "cols": 100 })),
    );
    assert_eq!(
        resized.status,
        204,
        "{}",
        String::from_utf8_lossy(&resized.body)
    );
    daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/stdin"),
        Some(json!({ "data": "hello\n" })),
    );
    let exit = daemon
        .call(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/wait"),
            None,
        )
        .json();
    assert_eq!(exit["code"], 0, "{exit}");
    let out = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/output"),
        None,
    );
    let text = String::from_utf8(stream_bytes(&out.events(), "stdout")).unwrap();
    assert!(text.contains("got:hello"), "{text}");
    assert!(text.contains("40 100"), "{text}");
    // A process without a terminal cannot be resized.
    let plain = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "5"], "background": true })),
    );
    let plain_id = plain.json()["id"].as_u64().unwrap();
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{plain_id}/resize"),
        Some(json!({ "rows": 1, "cols": 1 })),
    );
    assert_eq!(refused.status, 409);
}

#[test]
fn a_process_attached_over_a_websocket_takes_input_resize_and_streams_its_terminal() {
    if !cgroups_available("daemon_websocket") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("ws"), json!({}));
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo ready; read line; echo got:$line; stty size"], "tty": { "rows": 24, "cols": 80 }, "background": true })),
    );
    assert_eq!(started.status, 201);
    let id = started.json()["id"].as_u64().unwrap();
    let stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let url = format!("ws://warden/v1/cells/{cell}/processes/{id}/attach");
    let (mut socket, _) =
        tungstenite::client::client(url.as_str(), stream).expect("the upgrade succeeds");
    let mut output = String::new();
    let mut sent = false;
    let exit = loop {
        let message = socket.read().expect("a message before the end");
        let tungstenite::Message::Text(text) = message else {
            continue;
        };
        let event: Value = serde_json::from_str(text.as_str()).unwrap();
        match event["event"].as_str().unwrap() {
            "stdout" => output.push_str(event["text"].as_str().unwrap_or_default()),
            "exit" => break event,
            other => panic!("unexpected {other}: {event}"),
        }
        if !sent && output.contains("ready") {
            sent = true;
            for message in [
                json!({ "resize": { "rows": 50, "cols": 132 } }),
                json!({ "stdin": "over the socket\n" }),
            ] {
                socket
                    .send(tungstenite::Message::Text(message.to_string().into()))
                    .unwrap();
            }
        }
    };
    assert_eq!(exit["code"], 0, "{exit}");
    assert!(output.contains("got:over the socket"), "{output}");
    assert!(output.contains("50 132"), "{output}");
    // Input and the resize went through the journal like any other request.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        journal.contains("\"kind\":\"exec.resize\"") && journal.contains("\"kind\":\"exec.stdin\"")
    );
}

#[test]
fn the_journal_rotates_into_segments_that_verify_replay_and_export_read_as_one() {
    if !cgroups_available("daemon_rotate") {
        return;
    }
    let mut daemon = Daemon::start(&["--journal-segment-mib", "1"]);
    let cell = daemon.create(&unique("rotate"), json!({}));
    // Kept output goes into the journal (64 KiB of each stream per exec): 2.5 MiB in 20 execs.
    for i in 0..20 {
        let events = daemon.exec(
            &cell,
            json!({ "argv": ["sh", "-c", format!("echo start {i}; head -c 98304 /dev/zero | base64 -w 0; head -c 98304 /dev/zero | base64 -w 0 >&2")] }),
        );
        assert_eq!(exit_of(&events)["code"], 0);
    }
    // A crash and a restart on the way do not break the chain across segments.
    daemon.crash();
    daemon.restart();
    daemon.exec(&cell, json!({ "argv": ["echo", "after"] }));
    let dir = daemon.journal().parent().unwrap().to_path_buf();
    let closed: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.starts_with("journal-").then_some(name)
        })
        .collect();
    assert!(closed.len() >= 2, "no rotation: {closed:?}");
    let verify = daemon.warden().args(["audit", "verify"]).output().unwrap();
    let said = String::from_utf8_lossy(&verify.stdout);
    assert!(verify.status.success(), "{said}");
    assert!(
        said.contains(&format!("in {} segment(s)", closed.len() + 1)),
        "{said}"
    );
    // The timeline of the cell spans every segment, in order.
    let replay = daemon
        .warden()
        .args(["replay", &cell, "--json"])
        .output()
        .unwrap();
    let lines = String::from_utf8_lossy(&replay.stdout);
    let seqs: Vec<u64> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let starts = lines
        .lines()
        .filter(|l| l.contains("\"exec.start\""))
        .count();
    assert_eq!(starts, 21, "{lines}");
    // A closed segment changed by one byte is caught and named.
    let first = dir.join(closed.iter().min().unwrap());
    let mut bytes = std::fs::read(&first).unwrap();
    let at = bytes.len() / 2;
    bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
    std::fs::write(&first, bytes).unwrap();
    let verify = daemon.warden().args(["audit", "verify"]).output().unwrap();
    let said = String::from_utf8_lossy(&verify.stdout);
    assert!(!verify.status.success(), "{said}");
    assert!(
        said.contains(closed.iter().min().unwrap().as_str()),
        "{said}"
    );
}

#[test]
fn a_cell_whose_tmp_fills_its_memory_ends_by_the_memory_limit() {
    if !cgroups_available("daemon_tmp_oom") {
        return;
    }
    let dir = tempdir();
    let daemon = Daemon::start(&[]);
    let policy = policy(
        dir.path(),
        "version: 1\nfilesystem:\n  tmp_size: 512MiB\nlimits:\n  memory: 64MiB\n",
    );
    // Through the daemon, as a `warden run`: files in /tmp are memory, and filling it past the
    // limit is the memory limit, not a kill by someone.
    let ran = Ran::from(
        daemon
            .warden()
            .args(["run", "--policy", policy.to_str().unwrap(), "--"])
            .args([
                "sh",
                "-c",
                "head -c 300000000 /dev/zero > /tmp/fill; echo survived",
            ])
            .output()
            .unwrap(),
    );
    assert_eq!(ran.code, 251, "{ran:?}");
    assert!(
        ran.stderr.contains("memory limit 64 MiB exceeded"),
        "{ran:?}"
    );
    assert!(!ran.stderr.contains("warden kill"), "{ran:?}");
    // Over the API, the exec and the cell say so too.
    let cell = daemon.create(&unique("tmpoom"), json!({ "policy": "version: 1\nfilesystem:\n  tmp_size: 512MiB\nlimits:\n  memory: 64MiB\n" }));
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "head -c 300000000 /dev/zero > /tmp/fill; sleep 5"] }),
    );
    let exit = exit_of(&events);
    assert_eq!(exit["reason"], "memory-limit", "{exit}");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let end = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|e| e["kind"] == "cell.end" && e["cell"] == cell.as_str());
    if let Some(end) = end {
        assert!(
            end["data"]["reason"]
                .as_str()
                .unwrap()
                .contains("memory limit"),
            "{end}"
        );
    }
}

/// A cell a person paused stays paused across a daemon crash (and its execs are refused until
/// it is resumed); the next daemon thaws only what the warden itself held frozen.
#[test]
fn a_paused_cell_stays_paused_across_a_daemon_crash() {
    let mut daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("pausecrash"), json!({}));
    let paused = daemon.call("POST", &format!("/v1/cells/{cell}/pause"), Some(json!({})));
    assert_eq!(paused.status, 200);
    daemon.restart();
    let info = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json();
    assert_eq!(info["state"], "paused", "{info}");
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({"argv": ["true"]})),
    );
    assert_eq!(
        refused.status,
        409,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    let resumed = daemon.call("POST", &format!("/v1/cells/{cell}/resume"), Some(json!({})));
    assert_eq!(resumed.status, 200);
    let events = daemon.exec(&cell, json!({"argv": ["true"]}));
    assert_eq!(exit_of(&events)["code"], 0);
}

/// A cell frozen when the daemon stopped, but not by a pause (the warden's own hold while it
/// read the layer, cut by the crash: simulated here by freezing its cgroup while no daemon
/// runs), is thawed by the next daemon, and journaled so.
#[test]
fn a_cell_frozen_by_a_cut_hold_is_thawed_by_the_next_daemon() {
    let mut daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("holdcrash"), json!({}));
    let pid = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json()["pid"]
        .as_i64()
        .unwrap();
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let freezer = cgroups.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        match controllers {
            c if c.split(',').any(|c| c == "freezer") => Some((
                format!("/sys/fs/cgroup/freezer{path}/freezer.state"),
                "FROZEN",
                "THAWED",
            )),
            "" => Some((format!("/sys/fs/cgroup{path}/cgroup.freeze"), "1", "0")),
            _ => None,
        }
    });
    let Some((file, frozen, _thawed)) =
        freezer.filter(|(f, _, _)| std::path::Path::new(f).exists())
    else {
        eprintln!("no freezer for the cell here: {cgroups}");
        return;
    };
    daemon.crash();
    std::fs::write(&file, frozen).unwrap();
    daemon.restart();
    let info = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json();
    assert_eq!(info["state"], "running", "{info}");
    let events = daemon.exec(&cell, json!({"argv": ["true"]}));
    assert_eq!(exit_of(&events)["code"], 0);
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        journal
            .lines()
            .any(|l| l.contains("\"cell.resume\"") && l.contains("a hold of its own")),
        "not journaled"
    );
}

/// The `warden keep` processes whose runtime directory is `runtime`.
fn keepers_of(runtime: &std::path::Path) -> Vec<u32> {
    let mut found = processes_of(runtime, "keep");
    found.sort_unstable();
    found
}

/// A daemon starts cell keepers ahead: a cell made is kept by one started before it was asked
/// for, another is started in its place, and the idle ones end with the daemon (its cells'
/// keepers do not).
#[test]
fn keepers_started_ahead_keep_the_next_cells_and_go_with_the_daemon() {
    if !is_root() || !cgroups_available("keepers_ahead") {
        return; // the keepers' environment is read from /proc: root only
    }
    let mut daemon = Daemon::start(&[]);
    let runtime = daemon.runtime().to_path_buf();
    wait_for("two keepers started ahead", || {
        keepers_of(&runtime).len() == 2
    });
    let ahead = keepers_of(&runtime);
    let cell = daemon.create(&unique("ahead"), json!({}));
    let keeper = record_of(&runtime, &cell)["warden_pid"].as_u64().unwrap() as u32;
    assert!(
        ahead.contains(&keeper),
        "the cell's keeper {keeper} is not one of those started ahead {ahead:?}"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "kept"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"kept\n");
    wait_for("another keeper started in its place", || {
        keepers_of(&runtime).len() == 3
    });
    daemon.crash();
    wait_for("the idle keepers to end with the daemon", || {
        keepers_of(&runtime) == [keeper]
    });
    daemon.restart();
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{cell}"), None)
            .status,
        204
    );
}

/// The processes of `runtime`'s daemon whose command line is `warden WHAT`.
fn processes_of(runtime: &std::path::Path, what: &str) -> Vec<u32> {
    let wanted = format!("WARDEN_RUNTIME_DIR={}", runtime.display());
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if cmdline.split(|b| *b == 0).nth(1) == Some(what.as_bytes())
            && environ.split(|b| *b == 0).any(|v| v == wanted.as_bytes())
        {
            found.push(pid);
        }
    }
    found
}

/// Cell `cell`'s registry record (`pid`: its init's; `warden_pid`: its keeper's).
fn record_of(runtime: &std::path::Path, cell: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(runtime.join("cells").join(cell).join("cell.json")).unwrap(),
    )
    .unwrap()
}

/// The parent of process `pid`.
fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split(' ').nth(1).unwrap().parse().unwrap()
}

/// One mapping of the warden's binary in a process, from its `/proc/PID/smaps`.
struct Mapping {
    from: u64,
    to: u64,
    perms: String,
    rss_kib: u64,
    anonymous_kib: u64,
}

/// The mappings of the warden's binary in process `pid`.
fn binary_mappings(pid: u32) -> Vec<Mapping> {
    let exe = std::fs::metadata(env!("CARGO_BIN_EXE_warden")).unwrap();
    let inode = std::os::unix::fs::MetadataExt::ino(&exe).to_string();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut mappings = Vec::new();
    let mut ours = false;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let kib = || fields[1].parse::<u64>().unwrap();
        if fields
            .first()
            .is_some_and(|f| f.contains('-') && !f.ends_with(':'))
        {
            ours = fields.get(4) == Some(&inode.as_str());
            if ours {
                let (from, to) = fields[0].split_once('-').unwrap();
                mappings.push(Mapping {
                    from: u64::from_str_radix(from, 16).unwrap(),
                    to: u64::from_str_radix(to, 16).unwrap(),
                    perms: fields[1].to_owned(),
                    rss_kib: 0,
                    anonymous_kib: 0,
                });
            }
        } else if let (true, Some(last)) = (ours, mappings.last_mut()) {
            match fields.first() {
                Some(&"Rss:") => last.rss_kib = kib(),
                Some(&"Anonymous:") => last.anonymous_kib = kib(),
                _ => {}
            }
        }
    }
    mappings
}

/// The pages of `[from, to)` in process `pid`'s page tables: their addresses and page frames
/// (`/proc/PID/pagemap`, whose frame numbers root reads).
fn present_pages(pid: u32, from: u64, to: u64) -> Vec<(u64, u64)> {
    use std::os::unix::fs::FileExt as _;
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap")).unwrap();
    let mut pages = Vec::new();
    for address in (from..to).step_by(4096) {
        let mut entry = [0u8; 8];
        pagemap
            .read_exact_at(&mut entry, address / 4096 * 8)
            .unwrap();
        let entry = u64::from_le_bytes(entry);
        // Present (bit 63), and the frame number (bits 0-54).
        if entry >> 63 == 1 {
            pages.push((address, entry & ((1 << 55) - 1)));
        }
    }
    pages
}

/// The pages of process `pid`'s relocated data (the warden binary's mapping that is read-only
/// now, and was written at the start: its anonymous pages): their addresses and page frames.
fn relocated_pages(pid: u32) -> Vec<(u64, u64)> {
    binary_mappings(pid)
        .iter()
        .filter(|m| m.perms == "r--p" && m.anonymous_kib > 0)
        .flat_map(|m| present_pages(pid, m.from, m.to))
        .collect()
}

/// A daemon's keepers are forked by one fork server (`warden keepers`), whatever the tier:
/// each is the daemon's child, and its relocated data is the very memory of the server's (the
/// same page frames), not a copy written by the dynamic loader of a process of its own. A
/// server killed from outside is replaced at the next keeper, and it ends with the daemon.
#[test]
fn keepers_are_forked_by_one_server_and_share_its_relocated_data() {
    if !is_root() || !cgroups_available("keeper_forks") {
        return; // page frames in /proc/PID/pagemap are root's to read
    }
    let mut daemon = Daemon::start(&[]);
    let runtime = daemon.runtime().to_path_buf();
    let daemon_pid = daemon.pid().unwrap();
    wait_for("keepers started ahead", || keepers_of(&runtime).len() >= 2);
    let servers = processes_of(&runtime, "keepers");
    assert_eq!(servers.len(), 1, "fork servers: {servers:?}");
    let server = servers[0];
    let keeper_of =
        |cell: &str| -> u32 { record_of(&runtime, cell)["warden_pid"].as_u64().unwrap() as u32 };
    let shared_with = |keeper: u32, server: u32| -> (usize, usize) {
        let theirs: std::collections::HashMap<u64, u64> =
            relocated_pages(server).into_iter().collect();
        let ours = relocated_pages(keeper);
        let same = ours
            .iter()
            .filter(|(address, frame)| theirs.get(address) == Some(frame))
            .count();
        (same, ours.len())
    };
    let cell = daemon.create(&unique("forked"), json!({}));
    let keeper = keeper_of(&cell);
    assert_eq!(
        parent_of(keeper),
        daemon_pid,
        "the keeper is not the daemon's child"
    );
    let (same, all) = shared_with(keeper, server);
    assert!(
        all >= 16 && same * 10 >= all * 9,
        "{same} of the keeper's {all} pages of relocated data are the server's"
    );
    // The server's socket (its stdin) stays the server's: a keeper holds no way to ask it
    // for more keepers.
    let server_socket = std::fs::read_link(format!("/proc/{server}/fd/0")).unwrap();
    assert!(
        server_socket.to_string_lossy().starts_with("socket:"),
        "{server_socket:?}"
    );
    for pid in [
        keeper,
        record_of(&runtime, &cell)["pid"].as_u64().unwrap() as u32,
    ] {
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
        {
            assert_ne!(
                std::fs::read_link(fd.path()).ok().as_ref(),
                Some(&server_socket),
                "process {pid} of the cell holds the fork server's socket as fd {:?}",
                fd.file_name()
            );
        }
    }
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "forked"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"forked\n");
    // Killed from outside: the next keeper comes from a new server.
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &server.to_string()])
            .status()
            .unwrap()
            .success()
    );
    wait_for("the killed server to be gone", || {
        !processes_of(&runtime, "keepers").contains(&server)
    });
    let mut next = None;
    for i in 0..4 {
        // The keepers started ahead by the old server are taken first.
        let cell = daemon.create(&unique(&format!("reforked{i}")), json!({}));
        let servers = processes_of(&runtime, "keepers");
        if let [new] = servers[..]
            && new != server
            && shared_with(keeper_of(&cell), new).0 > 0
        {
            next = Some((cell, new));
            break;
        }
    }
    let (cell, new) = next.expect("no keeper came from a new fork server");
    let (same, all) = shared_with(keeper_of(&cell), new);
    assert!(same * 10 >= all * 9, "{same} of {all} pages shared");
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "again"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"again\n");
    daemon.crash();
    wait_for("the fork server to end with the daemon", || {
        processes_of(&runtime, "keepers").is_empty()
    });
    daemon.restart();
}

/// KiB of process `pid`'s read-only mappings of the warden's binary that are in its page tables,
/// of those straight from the file (code and constants; relocated constants, the process's own
/// copies, cannot be let go of and are left out).
fn resident_code_kib(pid: u32) -> u64 {
    binary_mappings(pid)
        .iter()
        .filter(|m| !m.perms.contains('w') && m.anonymous_kib == 0)
        .map(|m| m.rss_kib)
        .sum()
}

/// A daemon cell's keeper and init, once set up a while, let go of the pages of code they ran
/// only to start (most of what they mapped): measured from the host, a second later their
/// resident code is under half of what it was, and the cell still takes execs at once.
#[test]
fn an_idle_cells_keeper_and_init_let_go_of_their_start() {
    if !is_root() || !cgroups_available("let_go") {
        return; // another user's /proc/PID/smaps is root's to read
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("letgo"), json!({}));
    let record = record_of(daemon.runtime(), &cell);
    let keeper = record["warden_pid"].as_u64().unwrap() as u32;
    let init = record["pid"].as_u64().unwrap() as u32;
    let started = [resident_code_kib(keeper), resident_code_kib(init)];
    std::thread::sleep(Duration::from_millis(2500));
    let idle = [resident_code_kib(keeper), resident_code_kib(init)];
    eprintln!("resident code (keeper, init): {started:?} KiB after the start, {idle:?} KiB idle");
    for (who, (then, now)) in ["keeper", "init"].iter().zip(started.iter().zip(idle)) {
        assert!(
            now * 2 < *then,
            "the {who} holds {now} KiB of code idle, {then} KiB just after its start"
        );
    }
    // What the init read to let go (its `/proc/self/smaps`, ~100 KiB of text, one
    // `MMUPageSize:` line per mapping) went back with the heap's free memory: at most scraps at
    // the edges of free chunks are left resident (80 lines in 168 KiB when the heap was trimmed
    // before the read, 18 in 112 KiB after).
    let left = resident_heap(init);
    let copies = left.windows(12).filter(|w| w == b"MMUPageSize:").count();
    assert!(
        copies < 40,
        "{copies} lines of smaps text left in the init's {} KiB of resident heap",
        left.len() / 1024
    );
    let events = daemon.exec(&cell, json!({ "argv": ["echo", "still"] }));
    assert_eq!(stream_bytes(&events, "stdout"), b"still\n");
}

/// The resident pages of process `pid`'s heap, read from its memory.
fn resident_heap(pid: u32) -> Vec<u8> {
    use std::os::unix::fs::FileExt as _;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let Some((from, to)) = maps
        .lines()
        .find(|l| l.ends_with("[heap]"))
        .and_then(|l| l.split_whitespace().next()?.split_once('-'))
        .map(|(a, b)| {
            (
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            )
        })
    else {
        return Vec::new();
    };
    let memory = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut resident = Vec::new();
    for (address, _) in present_pages(pid, from, to) {
        let mut page = vec![0u8; 4096];
        memory.read_exact_at(&mut page, address).unwrap();
        resident.extend(page);
    }
    resident
}

/// The entry of `kind` whose data names `cell` (as `name`) or that is about `cell`.
fn journal_entries_of(daemon: &Daemon, kind: &str, cell: &str) -> Vec<Value> {
    std::fs::read_to_string(daemon.journal())
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["kind"] == kind && (e["cell"] == cell || e["data"]["name"] == cell))
        .collect()
}

fn pools(daemon: &Daemon) -> Vec<Value> {
    match daemon.call("GET", "/v1/pools", None).json() {
        Value::Array(pools) => pools,
        other => panic!("{other}"),
    }
}

/// The pids a cell's process sees in its /proc, its own left out, with their command lines.
fn others_seen(daemon: &Daemon, cell: &str) -> String {
    let script = "for p in /proc/[0-9]*; do n=${p#/proc/}; [ \"$n\" = \"$$\" ] || echo \"$n $(tr '\\0' ' ' < $p/cmdline)\"; done";
    let events = daemon.exec(cell, json!({ "argv": ["sh", "-c", script] }));
    String::from_utf8(stream_bytes(&events, "stdout")).unwrap()
}

/// What is in the places a cell with no workspace can write to.
fn written(daemon: &Daemon, cell: &str) -> String {
    let events = daemon.exec(
        cell,
        json!({ "argv": ["sh", "-c", "find /tmp /dev/shm /var/tmp -mindepth 1 2>/dev/null; true"] }),
    );
    String::from_utf8(stream_bytes(&events, "stdout")).unwrap()
}

#[test]
fn a_warm_pool_hands_out_cells_that_saw_nothing_and_goes_with_the_daemon() {
    if !is_root() || !cgroups_available("warm_pool") {
        return; // keepers are found through /proc's environ: root only
    }
    let mut daemon = Daemon::start(&["--pool", "default=1"]);
    let runtime = daemon.runtime().to_path_buf();
    wait_for("the pool's cell", || pools(&daemon)[0]["ready"] == 1);
    let pool = &pools(&daemon)[0];
    assert_eq!(
        (pool["policy"].as_str(), pool["size"].as_u64()),
        (Some("default"), Some(1))
    );
    assert!(pool["memory_bytes"].as_u64().unwrap() > 0, "{pool}");
    // Made ahead: no cell of anyone's; `warden ps` shows it as the pool's, with its memory.
    assert_eq!(daemon.call("GET", "/v1/cells", None).json(), json!([]));
    let ps = daemon.warden().arg("ps").output().unwrap();
    let ps = String::from_utf8(ps.stdout).unwrap();
    let row = ps
        .lines()
        .find(|l| l.starts_with("default "))
        .unwrap_or_else(|| panic!("no pool row in:\n{ps}"));
    assert!(row.contains("1/1") && row.contains("MiB"), "{ps}");
    assert!(!ps.contains("(takes `warden exec`)"), "{ps}");

    // An unnamed create of the pool's policy takes it.
    let made = daemon.call("POST", "/v1/cells", Some(json!({})));
    assert_eq!(made.status, 201, "{}", made.text());
    let first = made.json()["name"].as_str().unwrap().to_owned();
    assert_eq!(
        journal_entries_of(&daemon, "pool.made", &first).len(),
        1,
        "it was made ahead"
    );
    let created = journal_entries_of(&daemon, "cell.create", &first);
    assert_eq!(created[0]["data"]["pooled"], true, "{created:?}");
    // It saw nothing before it was handed out: no process but its init, no file changed, no
    // connection.
    let seen = others_seen(&daemon, &first);
    assert_eq!(seen.lines().count(), 1, "{seen}");
    assert!(seen.starts_with("1 "), "{seen}");
    assert_eq!(
        written(&daemon, &first),
        "",
        "nothing written where a cell can write"
    );
    assert!(
        std::fs::read_to_string(daemon.journal())
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .all(
                |e| e["cell"] != first.as_str() || !e["kind"].as_str().unwrap().starts_with("net.")
            ),
        "no connection of its own"
    );
    // What its user leaves in it goes with it: the next cell is another one, fresh.
    daemon.exec(
        &first,
        json!({ "argv": ["sh", "-c", "echo secret > /tmp/left; echo secret > left.txt; sleep 300 &"] }),
    );
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{first}"), None)
            .status,
        204
    );
    wait_for("the pool's next cell", || pools(&daemon)[0]["ready"] == 1);
    let second = daemon.call("POST", "/v1/cells", Some(json!({}))).json()["name"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(second, first);
    assert_eq!(others_seen(&daemon, &second).lines().count(), 1);
    let events = daemon.exec(
        &second,
        json!({ "argv": ["sh", "-c", "cat /tmp/left left.txt 2>&1; true"] }),
    );
    assert!(
        !String::from_utf8_lossy(&stream_bytes(&events, "stdout")).contains("secret"),
        "{events:?}"
    );
    assert_eq!(written(&daemon, &second), "");
    // A named create, or another policy, is not the pool's.
    let named = daemon.create(&unique("named"), json!({}));
    assert_eq!(
        journal_entries_of(&daemon, "cell.create", &named)[0]["data"]["pooled"],
        false
    );
    assert_eq!(pools(&daemon)[0]["taken"], 2);
    // `warden run` through the daemon is such a create: it takes one too.
    wait_for("the pool's next cell", || pools(&daemon)[0]["ready"] == 1);
    let run = daemon
        .warden()
        .args(["run", "--", "sh", "-c", "echo ran; exit 3"])
        .output()
        .unwrap();
    assert_eq!(
        (
            run.status.code(),
            String::from_utf8_lossy(&run.stdout).as_ref()
        ),
        (Some(3), "ran\n"),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let runs: Vec<Value> = std::fs::read_to_string(daemon.journal())
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["kind"] == "cell.create" && e["data"]["labels"]["made-by"] == "warden run")
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["data"]["pooled"], true, "{runs:?}");
    assert_eq!(pools(&daemon)[0]["taken"], 3);

    // A daemon that crashes leaves its cell made ahead; the next one ends it.
    wait_for("the pool's next cell", || pools(&daemon)[0]["ready"] == 1);
    // (A handed-out cell's marker, which says so, goes on a thread of the daemon's own.)
    let ahead: Vec<String> = std::fs::read_dir(daemon.state().join("daemon").join("pool"))
        .unwrap()
        .flatten()
        .filter(|e| !std::fs::read_to_string(e.path()).is_ok_and(|m| m.ends_with("\nhanding out")))
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    assert_eq!(ahead.len(), 1, "{ahead:?}");
    let record = |name: &str| runtime.join("cells").join(name).join("cell.json");
    assert!(record(&ahead[0]).exists());
    daemon.crash();
    assert!(record(&ahead[0]).exists(), "a crash leaves it running");
    daemon.restart();
    wait_for("the earlier daemon's cell made ahead to end", || {
        !record(&ahead[0]).exists()
    });
    assert_eq!(journal_entries_of(&daemon, "pool.drop", &ahead[0]).len(), 1);
    wait_for("the new daemon's cell made ahead", || {
        pools(&daemon)[0]["ready"] == 1
    });
    // The cells handed out are the daemon's as before.
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{second}"), None)
            .json()["state"],
        "running"
    );
    // A daemon that stops ends its cells made ahead (the ones handed out are the test's to
    // delete); then no keeper of this runtime is left.
    for cell in [&second, &named] {
        daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    }
    drop(daemon);
    wait_for("every keeper to end", || keepers_of(&runtime).is_empty());
}

/// The kinds of the journal's entries about `cell`, in order.
fn kinds_of(daemon: &Daemon, cell: &str) -> Vec<String> {
    daemon
        .entries_of(cell)
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect()
}

/// Whether a process of this host has `marker` in its command line.
fn host_runs(marker: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
    })
}

#[test]
fn a_run_makes_its_cell_runs_one_command_and_deletes_the_cell_before_it_answers() {
    if !cgroups_available("run_once") {
        return;
    }
    let mut daemon = Daemon::start(&["--pool", "default=1"]);
    wait_for("the pool's cell", || pools(&daemon)[0]["ready"] == 1);
    let run = |body: Value| daemon.call("POST", "/v1/run", Some(body));
    let cells = || daemon.call("GET", "/v1/cells", None).json();

    // From the pool: the command's streams and status, a process it left behind ended with
    // the cell (which ends with its command: no kill), and the cell gone (and journaled so)
    // before the last event.
    let marker = format!("sleep 31{}", std::process::id() % 1000 + 1000);
    let answer = run(json!({
        "cell": {},
        "exec": { "argv": ["sh", "-c", format!("{marker} & echo out; echo err >&2; exit 3")] }
    }));
    assert_eq!(answer.status, 200, "{}", answer.text());
    // Looked at first: no process of the cell is left once the run has answered.
    assert!(
        !host_runs(&marker),
        "what the command left running ended with its cell"
    );
    let events = answer.events();
    let cell = events[0].1["cell"].as_str().unwrap().to_owned();
    assert_eq!(events[0].0, "started", "{events:?}");
    assert!(
        cell.starts_with("cell-"),
        "a cell of the pool's: {events:?}"
    );
    assert_eq!(stream_bytes(&events, "stdout"), b"out\n");
    assert_eq!(stream_bytes(&events, "stderr"), b"err\n");
    let (last, exit) = events.last().unwrap();
    assert_eq!(
        (last.as_str(), exit["code"].as_i64()),
        ("exit", Some(3)),
        "{events:?}"
    );
    assert!(!events.iter().any(|(e, _)| e == "error"), "{events:?}");
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .status,
        404
    );
    assert_eq!(
        kinds_of(&daemon, &cell),
        [
            "cell.create",
            "cell.start",
            "exec.start",
            "exec.exit",
            "cell.end",
            "cell.delete"
        ],
    );
    assert_eq!(
        journal_entries_of(&daemon, "cell.end", &cell)[0]["data"]["reason"],
        "its run's command ended"
    );
    assert_eq!(
        journal_entries_of(&daemon, "cell.create", &cell)[0]["data"]["pooled"],
        true
    );

    // A named cell is made for it (not the pool's), and goes the same way.
    let named = unique("once");
    let answer = run(json!({ "cell": { "name": named }, "exec": { "argv": ["true"] } }));
    let events = answer.events();
    assert_eq!(events.last().unwrap().1["code"], 0, "{events:?}");
    assert_eq!(
        journal_entries_of(&daemon, "cell.create", &named)[0]["data"]["pooled"],
        false
    );
    assert_eq!(
        kinds_of(&daemon, &named).last().map(String::as_str),
        Some("cell.delete")
    );

    // A program that is not there: its failure is the run's exit, and the cell is deleted.
    wait_for("the pool's next cell", || pools(&daemon)[0]["ready"] == 1);
    let answer = run(json!({ "cell": {}, "exec": { "argv": ["/no/such/program"] } }));
    let events = answer.events();
    let exit = &events.last().unwrap().1;
    assert_eq!(exit["reason"], "failed", "{events:?}");
    assert_eq!(cells(), json!([]));

    // Refused: a background process (it would outlive its cell), before any cell is made; a
    // command the cell's rules deny, with the cell made for it deleted before the answer.
    let taken = pools(&daemon)[0]["taken"].clone();
    let answer = run(json!({ "cell": {}, "exec": { "argv": ["true"], "background": true } }));
    assert_eq!(answer.status, 400, "{}", answer.text());
    assert!(answer.text().contains("background"), "{}", answer.text());
    assert_eq!(pools(&daemon)[0]["taken"], taken, "no cell taken for it");
    let denied = unique("denied");
    let answer = run(json!({
        "cell": { "name": denied, "policy": "version: 1\ncommands:\n  deny: [\"rm *\"]\n" },
        "exec": { "argv": ["rm", "-rf", "/tmp/x"] }
    }));
    assert_eq!(answer.status, 403, "{}", answer.text());
    assert_eq!(
        kinds_of(&daemon, &denied).last().map(String::as_str),
        Some("cell.delete")
    );
    // Bad input: a clear error and nothing made.
    let answer = run(json!({ "cell": {}, "exec": { "argv": ["true"], "bogus": 1 } }));
    assert_eq!(answer.status, 422, "{}", answer.text());
    assert!(answer.text().contains("bogus"), "{}", answer.text());
    assert_eq!(cells(), json!([]));

    // A client that goes away: its command is killed and its cell deleted all the same.
    wait_for("the pool's next cell", || pools(&daemon)[0]["ready"] == 1);
    let (cell, stream) = run_started(&daemon, "sleep 300");
    drop(stream);
    wait_for("the abandoned run's cell to be deleted", || {
        kinds_of(&daemon, &cell).last().map(String::as_str) == Some("cell.delete")
    });
    assert_eq!(cells(), json!([]));

    // A daemon killed during a run: the next one takes the run's cell back and deletes it.
    // (Its command goes with the daemon's end of the exec; the cell stays.)
    let (cell, _stream) = run_started(&daemon, "sleep 301");
    let record = daemon.runtime().join("cells").join(&cell).join("cell.json");
    daemon.crash();
    assert!(record.exists(), "a crash leaves the cell running");
    daemon.restart();
    wait_for("the cell of the cut run to be deleted", || {
        kinds_of(&daemon, &cell).last().map(String::as_str) == Some("cell.delete")
    });
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .status,
        404
    );
    wait_for("the cut run's cell to go", || !record.exists());
    daemon.assert_journal_verifies();
}

/// A cell's last process (`ExecRequest::last`, what a run asks for): told its end, the cell's
/// init stays until the client hangs up, and goes then, so that a run's answer goes out before
/// the cell's teardown takes the CPUs (the daemon lets go once it has answered). Asked here on
/// the cell's own line, as the daemon asks, so that the hang-up is the test's to time.
#[test]
fn a_cells_last_process_keeps_its_init_until_the_client_hangs_up() {
    use warden_cell::tier::{ExecEvent, ExecRequest};
    if !cgroups_available("last_linger") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let name = daemon.create(&unique("last"), json!({}));
    let init = daemon
        .call("GET", &format!("/v1/cells/{name}"), None)
        .json()["pid"]
        .as_i64()
        .unwrap();
    assert!(alive(init), "the cell's init {init} runs");
    let cell = adopted(&daemon, &name);
    let null = |write: bool| -> std::os::fd::OwnedFd {
        std::fs::OpenOptions::new()
            .read(!write)
            .write(write)
            .open("/dev/null")
            .unwrap()
            .into()
    };
    let stdio = [null(false), null(true), null(true)];
    let request = ExecRequest {
        argv: vec!["true".to_owned()],
        last: true,
        ..Default::default()
    };
    let session = cell
        .exec(&request, Some([&stdio[0], &stdio[1], &stdio[2]]))
        .unwrap();
    let mut end = None;
    wait_for("the last process's end", || {
        match session.try_next_event().unwrap() {
            Some((event, _)) if event.is_final() => end = Some(event),
            _ => {}
        }
        end.is_some()
    });
    assert!(
        matches!(end, Some(ExecEvent::Exited { code: 0, .. })),
        "{end:?}"
    );
    // Its end told, the init waits for the hang-up (longer than a teardown takes).
    std::thread::sleep(Duration::from_millis(400));
    assert!(alive(init), "the init went before its client hung up");
    let hung_up = std::time::Instant::now();
    drop(session);
    wait_for("the init to go at the hang-up", || !alive(init));
    // Well within the time an init waits for a client that never hangs up (3 s).
    assert!(
        hung_up.elapsed() < Duration::from_millis(1500),
        "the init went {:?} after the hang-up",
        hung_up.elapsed()
    );
    wait_for("the daemon to see the cell end", || {
        daemon
            .call("GET", &format!("/v1/cells/{name}"), None)
            .json()["state"]
            != "running"
    });
    assert_eq!(
        daemon
            .call("DELETE", &format!("/v1/cells/{name}"), None)
            .status,
        204
    );
    daemon.assert_journal_verifies();
}

/// A killed cell's keeper takes the cell down only once the hold on its teardown goes (what a
/// delete takes before its kill and lets go of once it has answered), and at once where nobody
/// holds it. Held and killed here, through the tier, so that the test times the release.
#[test]
fn a_killed_cells_teardown_waits_for_its_hold_and_only_for_it() {
    if !cgroups_available("teardown_hold") {
        return;
    }
    let daemon = Daemon::start(&[]);
    for held in [true, false] {
        let name = daemon.create(&unique("hold"), json!({}));
        let record = daemon.runtime().join("cells").join(&name);
        let keeper = serde_json::from_str::<Value>(
            &std::fs::read_to_string(record.join("cell.json")).unwrap(),
        )
        .unwrap()["warden_pid"]
            .as_i64()
            .unwrap();
        assert!(alive(keeper), "the cell's keeper {keeper} runs");
        let cell = adopted(&daemon, &name);
        let hold = held.then(|| cell.hold_teardown().expect("a process cell's hold"));
        cell.kill().unwrap();
        assert!(cell.wait_stopped(), "the killed cell's init ended");
        let killed = std::time::Instant::now();
        if held {
            // Longer than a keeper's teardown takes: it waits.
            std::thread::sleep(Duration::from_millis(400));
            assert!(
                alive(keeper),
                "the keeper took its cell down under the hold"
            );
            assert!(record.exists(), "the cell's folder went under the hold");
            let released = std::time::Instant::now();
            drop(hold);
            wait_for("the keeper to end once the hold went", || !alive(keeper));
            // Well within the time a keeper waits for a hold that stays (3 s).
            assert!(
                released.elapsed() < Duration::from_millis(1500),
                "the keeper ended {:?} after the hold went",
                released.elapsed()
            );
        } else {
            wait_for("the keeper to end", || !alive(keeper));
            assert!(
                killed.elapsed() < Duration::from_millis(1500),
                "the keeper of a cell nobody held ended {:?} after the kill",
                killed.elapsed()
            );
        }
        wait_for("the cell's folder to go", || !record.exists());
        let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
        assert!(
            deleted.status == 204 || deleted.status == 404,
            "{}",
            deleted.text()
        );
    }
    daemon.assert_journal_verifies();
}

/// The daemon's process cell `name`, adopted through the process tier as the daemon's keepers
/// see it (its runtime and state folders), to act on it from the test as the daemon does.
fn adopted(daemon: &Daemon, name: &str) -> std::sync::Arc<dyn warden_cell::Cell> {
    warden_cell::Tiers::built_in(warden_cell::ProcessConfig {
        runtime: daemon.runtime().to_owned(),
        state: daemon.state().to_owned(),
        warden_exe: bin().to_owned(),
        keeper_open_files: None,
        keeper_env: Vec::new(),
        keepers_ahead: 0,
    })
    .get(warden_policy::Tier::Process)
    .unwrap()
    .adopt(name)
    .unwrap()
    .expect("the daemon's cell, adopted")
}

/// Starts a run of `command` (a shell's) from the pool and reads its answer up to its
/// `started`: the cell's name, and the connection, open.
fn run_started(daemon: &Daemon, command: &str) -> (String, std::os::unix::net::UnixStream) {
    use std::io::{Read as _, Write as _};
    let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
    let body = json!({ "cell": {}, "exec": { "argv": ["sh", "-c", command] } }).to_string();
    write!(
        stream,
        "POST /v1/run HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"cell\":") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let seen = String::from_utf8_lossy(&seen).into_owned();
    let cell = seen
        .split("\"cell\":\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    (cell.to_owned(), stream)
}

/// A daemon that serves its API on one thread (the default on a machine of two cores) answers
/// every other request while a command streams, another floods its output, and the journal's
/// rounds are run by the requests themselves: creates (one of them the pool's), execs, a run,
/// a list, deletes, and the exec that lets the streaming command end.
#[test]
fn one_api_thread_serves_every_request_while_a_command_streams() {
    if !cgroups_available("one_api_thread") {
        return;
    }
    let mut daemon = Daemon::start(&["--api-threads", "1", "--pool", "default=1"]);
    let held = daemon.create(&unique("held"), json!({}));
    // A process that writes as fast as the daemon reads, all along.
    let flood = daemon.call(
        "POST",
        &format!("/v1/cells/{held}/exec"),
        Some(json!({ "argv": ["sh", "-c",
            "for i in 1 2 3 4; do cat /dev/zero & done; while [ ! -e /tmp/go ]; do sleep 0.02; done; kill $(jobs -p)"],
            "background": true })),
    );
    assert_eq!(flood.status, 201, "{}", flood.text());
    let socket = daemon.socket();
    let path = format!("/v1/cells/{held}/exec");
    let streaming = std::thread::spawn(move || {
        let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        let body = json!({ "argv": ["sh", "-c",
            "echo waiting; while [ ! -e /tmp/go ]; do sleep 0.02; done; echo went"] })
        .to_string();
        exchange(stream, "POST", &path, Some(&body), &[])
    });
    let socket = daemon.socket();
    let (done, finished) = std::sync::mpsc::channel();
    let other = unique("other");
    let held_name = held.clone();
    std::thread::spawn(move || {
        let call = |method: &str, path: &str, body: Option<Value>| {
            let stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
            exchange(
                stream,
                method,
                path,
                body.map(|b| b.to_string()).as_deref(),
                &[],
            )
        };
        let mut seen = Vec::new();
        for round in 0..3 {
            let name = format!("{other}-{round}");
            seen.push(call("POST", "/v1/cells", Some(json!({ "name": name }))).status);
            let exec = call(
                "POST",
                &format!("/v1/cells/{name}/exec"),
                Some(json!({ "argv": ["true"] })),
            );
            seen.push(exec.status);
            seen.push(u16::from(exit_of(&exec.events())["code"] == 0));
            seen.push(call("DELETE", &format!("/v1/cells/{name}"), None).status);
        }
        // The pool's cell, and a run.
        let pooled = call("POST", "/v1/cells", Some(json!({})));
        seen.push(pooled.status);
        let pooled = pooled.json()["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        seen.push(call("DELETE", &format!("/v1/cells/{pooled}"), None).status);
        let run = call(
            "POST",
            "/v1/run",
            Some(json!({ "cell": {}, "exec": { "argv": ["true"] } })),
        );
        seen.push(run.status);
        seen.push(u16::from(run.text().contains("\"code\":0")));
        let listed = call("GET", "/v1/cells", None).json();
        let streaming_still = listed
            .as_array()
            .is_some_and(|cells| cells.iter().any(|c| c["name"] == held_name.as_str()));
        seen.push(u16::from(streaming_still));
        let go = call(
            "POST",
            &format!("/v1/cells/{held_name}/exec"),
            Some(json!({ "argv": ["touch", "/tmp/go"] })),
        );
        seen.push(u16::from(exit_of(&go.events())["code"] == 0));
        let _ = done.send(seen);
    });
    let Ok(seen) = finished.recv_timeout(Duration::from_secs(60)) else {
        daemon.crash();
        panic!(
            "a daemon on one API thread did not answer the other requests within 60 s while a command streamed"
        );
    };
    let expected: Vec<u16> = [201, 200, 1, 204]
        .repeat(3)
        .into_iter()
        .chain([201, 204, 200, 1, 1, 1])
        .collect();
    assert_eq!(
        seen, expected,
        "statuses and outcomes (1: as expected) of the other requests"
    );
    let streamed = streaming.join().unwrap();
    let events = streamed.events();
    assert_eq!(
        String::from_utf8_lossy(&stream_bytes(&events, "stdout")),
        "waiting\nwent\n",
        "the streaming command ran to its end once let go"
    );
    assert_eq!(exit_of(&events)["code"], 0);
}

#[test]
fn a_deleted_cells_name_can_be_taken_again_at_once() {
    if !cgroups_available("name_again") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let name = unique("again");
    for round in 0..5 {
        // A delete answers once the cell is gone; the next create of the name is a new cell,
        // which no watch of the old one may end.
        daemon.create(&name, json!({}));
        daemon.exec(
            &name,
            json!({ "argv": ["sh", "-c", "sleep 300 & echo $$ > /tmp/mine"] }),
        );
        let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
        assert_eq!(deleted.status, 204, "round {round}: {}", deleted.text());
        let gone = daemon.call("GET", &format!("/v1/cells/{name}"), None);
        assert_eq!(gone.status, 404, "round {round}: {}", gone.text());
    }
    let made = daemon.create(&name, json!({}));
    let events = daemon.exec(
        &made,
        json!({ "argv": ["sh", "-c", "cat /tmp/mine 2>&1; pgrep -c sleep || true"] }),
    );
    let out = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(
        out.ends_with("0\n") && out.contains("No such file"),
        "a fresh cell: {out}"
    );
}

/// A deleted cell's folder in the daemon's state leaves its place at once and is removed
/// behind the delete's answer; what a killed daemon left on its way out goes at the next start.
/// A cell killed (not deleted) is journaled as killed.
#[test]
fn a_deleted_cells_folder_goes_and_a_crash_leaves_none_behind() {
    if !cgroups_available("folder_gone") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let cells = daemon.state().join("daemon").join("cells");
    let gone = daemon.state().join("daemon").join("gone");
    let name = unique("folder");
    daemon.create(&name, json!({}));
    assert!(cells.join(&name).is_dir(), "no folder of the cell");
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
    assert!(
        !cells.join(&name).exists(),
        "the folder is still in its place"
    );
    wait_for("the deleted cell's folder to go", || {
        std::fs::read_dir(&gone).map_or(true, |mut d| d.next().is_none())
    });
    // A kill journals its reason, whichever of the kill and the watch sees the end first.
    let killed = unique("killed");
    daemon.create(&killed, json!({}));
    let answer = daemon.call("POST", &format!("/v1/cells/{killed}/kill"), None);
    assert!(answer.status < 300, "{}", answer.text());
    wait_for("the kill's end in the journal", || {
        !journal_entries_of(&daemon, "cell.end", &killed).is_empty()
    });
    let ends = journal_entries_of(&daemon, "cell.end", &killed);
    assert_eq!(ends.len(), 1, "{ends:?}");
    assert_eq!(ends[0]["data"]["reason"], "killed", "{ends:?}");
    // Left behind by a daemon killed before its remover was done.
    let left = gone.join("cell-left-1");
    std::fs::create_dir_all(left.join("deep")).unwrap();
    std::fs::write(left.join("deep").join("keeper.log"), "x").unwrap();
    daemon.restart();
    wait_for("what a killed daemon left to go", || !left.exists());
}

/// A delete answers once no process of the cell runs (its keeper may still be taking down its
/// cgroups then), and the name is the cell's until its keeper is gone: a create of the same
/// name at once waits for it and makes a new cell, with none of the old one's processes.
#[test]
fn a_deleted_cell_runs_nothing_once_deleted_and_its_name_is_free_after() {
    if !cgroups_available("deleted_runs_nothing") {
        return;
    }
    let daemon = Daemon::start(&[]);
    for round in 0..5 {
        let name = unique("stopped");
        daemon.create(&name, json!({}));
        // Processes of the cell, found on the host by a word of their command lines.
        // (A second interval of sleep's, so a number.)
        let word = format!("0.{}{round:02}", std::process::id());
        // Many, so that their end takes the kernel a while.
        for argv in [
            json!(["sleep", "1000", word]),
            json!([
                "sh",
                "-c",
                format!("for i in $(seq 200); do sleep 1001 {word} & done; sleep 1002 {word}")
            ]),
        ] {
            let started = daemon.call(
                "POST",
                &format!("/v1/cells/{name}/exec"),
                Some(json!({ "argv": argv, "background": true })),
            );
            assert!(started.status < 300, "{}", started.text());
        }
        // The sleeps, and the shell unless it ran the last one itself.
        wait_for("the cell's processes to run", || {
            running_with(&word, &[]).len() >= 202
        });
        // The cell's session: a zombie of it has no command line to find it by.
        let sessions: Vec<String> = running_with(&word, &[])
            .iter()
            .filter_map(|p| session_of(p))
            .collect();
        let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
        assert_eq!(deleted.status, 204, "{}", deleted.text());
        let left = running_with(&word, &sessions);
        assert!(
            left.is_empty(),
            "running after the delete answered: {left:?}"
        );
        // The same name at once: a new cell, which runs.
        daemon.create(&name, json!({}));
        let ran = daemon.exec(&name, json!({ "argv": ["sh", "-c", "echo again"] }));
        assert_eq!(stream_bytes(&ran, "stdout"), b"again\n", "{ran:?}");
        let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
        assert_eq!(deleted.status, 204, "{}", deleted.text());
    }
}

/// A delete is answered once its entries are in the journal, before the daemon's database has
/// forgotten the cell (that commit waits for the cell's keeper to be gone): a daemon killed in
/// between leaves the cell in its database, and the next daemon goes by the journal. Here the
/// keeper is held stopped past the answer, so the daemon dies before its database forgets.
#[test]
fn a_delete_answered_before_a_crash_stays_done_for_the_next_daemon() {
    if !is_root() || !cgroups_available("delete_before_crash") {
        return; // the keeper is stopped by pid: root only
    }
    let mut daemon = Daemon::start(&[]);
    let runtime = daemon.runtime().to_path_buf();
    let cell = daemon.create(&unique("undone"), json!({}));
    let keeper = record_of(&runtime, &cell)["warden_pid"].as_u64().unwrap() as i32;
    let signal = |sig| {
        let pid = rustix::process::Pid::from_raw(keeper).unwrap();
        rustix::process::kill_process(pid, sig).unwrap();
    };
    signal(rustix::process::Signal::STOP);
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
    daemon.crash();
    signal(rustix::process::Signal::CONT);
    daemon.restart();

    let gone = daemon.call("GET", &format!("/v1/cells/{cell}"), None);
    assert_eq!(
        gone.status,
        404,
        "the deleted cell is back: {}",
        gone.text()
    );
    let listed = daemon.call("GET", "/v1/cells", None).text();
    assert!(!listed.contains(&cell), "listed again: {listed}");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let after_delete: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .skip_while(|e| !(e["kind"] == "cell.delete" && e["cell"] == cell.as_str()))
        .skip(1)
        .filter(|e| e["cell"] == cell.as_str())
        .collect();
    assert!(
        after_delete.is_empty(),
        "the next daemon journaled the deleted cell again: {after_delete:?}"
    );
    daemon.assert_journal_verifies();
    // What it left goes, and its name is free.
    wait_for("the deleted cell's keeper to end", || {
        std::fs::metadata(format!("/proc/{keeper}")).is_err()
    });
    waited(|| cgroup_dirs_of(&cell).is_empty());
    // (What is left is described: which hierarchies, what each still holds.)
    let left: Vec<String> = cgroup_dirs_of(&cell)
        .iter()
        .map(|dir| {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            let children = std::fs::read_dir(dir)
                .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
                .unwrap_or(0);
            format!(
                "{} (processes: [{}], child groups: {children})",
                dir.display(),
                procs.trim()
            )
        })
        .collect();
    assert!(
        left.is_empty(),
        "the deleted cell's cgroups are left 15 s after its keeper ended: {left:#?}; its folder: {:?}",
        std::fs::read_dir(runtime.join("cells"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    daemon.create(&cell, json!({}));
    let ran = daemon.exec(&cell, json!({ "argv": ["sh", "-c", "echo again"] }));
    assert_eq!(stream_bytes(&ran, "stdout"), b"again\n", "{ran:?}");
}

/// Processes of the host whose command lines have `word`, and the zombies named like them in
/// one of `sessions` (a zombie's command line is empty: its name is `sleep`; a zombie left by a
/// killed cell is one its init has not reaped; other tests' cells, running beside, have their
/// own sessions and their own passing zombies).
fn running_with(word: &str, sessions: &[String]) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| {
            let line = std::fs::read(e.path().join("cmdline")).ok()?;
            let line = String::from_utf8_lossy(&line).replace('\0', " ");
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let shown = format!("{line} [{stat}]");
            let zombie_sleep = stat.contains("(sleep) Z")
                && session_of(&shown).is_some_and(|s| sessions.contains(&s));
            (line.contains(word) || zombie_sleep).then_some(shown)
        })
        .collect()
}

/// The session of a process as `running_with` shows it (the sixth field of its `stat`).
fn session_of(shown: &str) -> Option<String> {
    let (_, after_name) = shown.rsplit_once(") ")?;
    after_name.split_whitespace().nth(3).map(str::to_owned)
}

/// Every process the daemon starts is reaped when it ends: a deleted cell's keeper (the
/// daemon's child) and the remover of a reset cell's old layer are not left zombies, one per
/// cell or per reset, in a daemon that runs for months.
#[test]
fn a_daemon_leaves_no_zombie_of_deleted_cells_or_resets() {
    if !cgroups_available("no_zombies") {
        return;
    }
    let daemon = Daemon::start(&[]);
    for _ in 0..3 {
        let cell = daemon.create(&unique("reaped"), json!({}));
        daemon.exec(&cell, json!({ "argv": ["true"] }));
        let deleted = daemon.call("DELETE", &format!("/v1/cells/{cell}"), None);
        assert_eq!(deleted.status, 204, "{}", deleted.text());
    }
    // A reset removes the cell's old layer in the background.
    let host = tempdir();
    let workspace = host.path().display().to_string();
    let kept = daemon.create(&unique("reset"), json!({ "workspace": workspace }));
    for _ in 0..3 {
        daemon.exec(&kept, json!({ "argv": ["sh", "-c", "echo x > written"] }));
        let reset = daemon.call("POST", &format!("/v1/cells/{kept}/reset"), Some(json!({})));
        assert_eq!(reset.status, 200, "{}", reset.text());
    }
    let deleted = daemon.call("DELETE", &format!("/v1/cells/{kept}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
    // Each deleted cell's keeper was the daemon's child, and so was each remover of an old
    // layer: all are reaped, none is left a zombie of the daemon.
    let daemon_pid = daemon.pid().unwrap();
    wait_for("the daemon's ended children to be reaped", || {
        zombies_of(daemon_pid).is_empty()
    });
}

/// Two wardens on one host (two daemons, or a `warden run` beside a daemon) may each have a
/// cell of one name. Their cgroups are apart: the end of one, or its pause, does not reach the
/// other. (They once shared `warden/NAME`: a `warden run --name` of a daemon cell's name ended
/// that cell with its own, and a pause of one froze both.)
#[test]
fn cells_of_one_name_in_two_wardens_share_no_cgroup() {
    if !is_root() || !cgroups_available("two_wardens") {
        return; // rootless cgroups are the user's own subtree, one per user
    }
    let first = Daemon::start(&[]);
    let second = Daemon::start(&[]);
    let name = unique("twin");
    first.create(&name, json!({}));
    second.create(&name, json!({}));
    let dirs = |daemon: &Daemon| record_of(daemon.runtime(), &name)["cgroup"]["dirs"].clone();
    assert_ne!(dirs(&first), dirs(&second), "one cgroup for two cells");
    let alive = |daemon: &Daemon, what: &str| {
        let events = daemon.exec(&name, json!({ "argv": ["echo", "alive"] }));
        assert_eq!(
            stream_bytes(&events, "stdout"),
            b"alive\n",
            "{what}: {events:?}"
        );
    };
    // A one-shot cell of the same name, in a runtime directory of its own, comes and goes.
    let apart = tempdir();
    let ran = std::process::Command::new(bin())
        .env("WARDEN_RUNTIME_DIR", apart.path().join("run"))
        .env("WARDEN_STATE_DIR", apart.path().join("state"))
        .args(["run", "--name", &name, "--", "true"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(ran.status.success(), "{ran:?}");
    alive(&first, "after a one-shot cell of its name ended");
    alive(&second, "after a one-shot cell of its name ended");
    // The second's pause does not freeze the first; its delete does not end it.
    let paused = second.call("POST", &format!("/v1/cells/{name}/pause"), None);
    assert_eq!(paused.status, 200, "{}", paused.text());
    alive(&first, "while the other daemon's cell is paused");
    let deleted = second.call("DELETE", &format!("/v1/cells/{name}"), None);
    assert_eq!(deleted.status, 204, "{}", deleted.text());
    alive(&first, "after the other daemon's cell was deleted");
    let state = first.call("GET", &format!("/v1/cells/{name}"), None).json();
    assert_eq!(state["state"], "running", "{state}");
}

/// Creates of one name at once: one makes the cell, the others are told the name is taken
/// (409), and the cell made is whole. Before, each passed the name's checks, the later ones
/// emptied the first one's folder and failed in their keeper with a 400 `tier-refused`.
#[test]
fn creates_of_one_name_at_once_make_one_cell_and_refuse_the_rest() {
    if !cgroups_available("daemon_create_race") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    for round in 0..4 {
        let name = unique("same");
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(5));
        let racers: Vec<_> = (0..5)
            .map(|_| {
                let daemon = std::sync::Arc::clone(&daemon);
                let barrier = std::sync::Arc::clone(&barrier);
                let body = json!({ "name": name });
                std::thread::spawn(move || {
                    barrier.wait();
                    daemon.call("POST", "/v1/cells", Some(body))
                })
            })
            .collect();
        let answers: Vec<Answer> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        let made = answers.iter().filter(|a| a.status == 201).count();
        for answer in answers.iter().filter(|a| a.status != 201) {
            assert_eq!(answer.status, 409, "round {round}: {}", answer.text());
            assert_eq!(answer.json()["reason"], "name-taken", "{}", answer.text());
        }
        assert_eq!(made, 1, "round {round}: one create makes the cell");
        let events = daemon.exec(&name, json!({ "argv": ["echo", "whole"] }));
        assert_eq!(stream_bytes(&events, "stdout"), b"whole\n", "round {round}");
        let deleted = daemon.call("DELETE", &format!("/v1/cells/{name}"), None);
        assert_eq!(deleted.status, 204, "{}", deleted.text());
    }
}
