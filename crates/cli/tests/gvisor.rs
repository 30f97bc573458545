//! What only the gVisor tier has or needs: memory snapshots (checkpoint and restore), its
//! cells outliving a daemon that crashed, its refusals (no root, no runsc, a checkpoint it cannot
//! make), and `warden doctor`'s word on it. The behaviour every tier shares is `tiers.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::daemon::{Daemon, exit_of, stream_bytes};
use support::*;

/// Why the gVisor tier cannot run here, if it cannot (printed by the tests that skip).
fn unavailable() -> Option<&'static str> {
    if !is_root() {
        return Some("the gvisor tier needs root");
    }
    installed_runsc()
        .is_none()
        .then_some("runsc is not installed")
}

macro_rules! needs_gvisor {
    ($test:literal) => {
        if let Some(why) = unavailable() {
            eprintln!("skipped {}: {why}", $test);
            return;
        }
    };
}

const GVISOR: &str = "version: 1\nextends: default\ntier: gvisor\n";

fn stdout(events: &[(String, Value)]) -> String {
    String::from_utf8(stream_bytes(events, "stdout")).unwrap()
}

/// The counter a cell's loop keeps in `path`; the loop replaces the file whole (a rename), so a
/// read sees a number or, before the loop's first write, no file: that is waited out, briefly.
fn read_count(daemon: &Daemon, cell: &str, path: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let events = daemon.exec(cell, json!({ "argv": ["cat", path] }));
        match stdout(&events).trim().parse() {
            Ok(count) => return count,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => panic!("no count in {path}: {events:?}"),
        }
    }
}

#[test]
fn a_restored_checkpoint_goes_on_from_where_it_stopped() {
    needs_gvisor!("a_restored_checkpoint_goes_on_from_where_it_stopped");
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    std::fs::write(host.path().join("kept.txt"), "from the host\n").unwrap();
    let cell = daemon.create(
        &unique("ckpt"),
        json!({ "policy": GVISOR, "workspace": host.path().display().to_string() }),
    );
    // A counter in memory (a shell variable), written out where the warden can read it, run on
    // its own (its stdio inside the cell), and files of the workspace made before the
    // checkpoint. A process whose output the warden relays ends at the checkpoint.
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' </dev/null >/dev/null 2>&1 &"] }),
    );
    let relayed = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo relayed; exec sleep 301"], "background": true })),
    );
    assert_eq!(relayed.status, 201, "{}", relayed.text());
    let relayed = relayed.json()["id"].as_u64().unwrap();
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "printf 'bin\\000ary\\377' > made.bin; echo changed > kept.txt"] }),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while read_count(&daemon, &cell, "/tmp/count") < 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = read_count(&daemon, &cell, "/tmp/count");
    assert!(before >= 20, "the counter runs: {before}");

    let saved = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/checkpoint"),
        Some(json!({ "as": "c1" })),
    );
    assert_eq!(saved.status, 201, "{}", saved.text());
    let saved = saved.json();
    let id = format!("{cell}@c1");
    assert_eq!(saved["id"], id);
    assert!(saved["memory_bytes"].as_u64().unwrap() > 0, "{saved}");
    let info = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json();
    assert_eq!(info["state"], "ended", "{info}");
    assert_eq!(info["ended"], format!("checkpointed as {id}"), "{info}");
    let waited = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{relayed}/wait"),
        None,
    );
    assert_eq!(
        waited.json()["reason"],
        "signaled",
        "the relayed exec ended: {}",
        waited.text()
    );

    // Some time passes; a restored cell goes on counting from the value it had, not from one.
    std::thread::sleep(Duration::from_millis(500));
    let restored = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "name": unique("restored"), "restore": id })),
    );
    assert_eq!(restored.status, 201, "{}", restored.text());
    let new = restored.json()["name"].as_str().unwrap().to_owned();
    assert_eq!(restored.json()["tier"], "gvisor");
    let first = read_count(&daemon, &new, "/tmp/count");
    assert!(
        first >= before,
        "it went on from {before}, not from the start: {first}"
    );
    assert!(
        first < before + 200,
        "it did not run while saved: {before} then {first}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        read_count(&daemon, &new, "/tmp/count") > first,
        "and it keeps counting"
    );
    let events = daemon.exec(
        &new,
        json!({ "argv": ["sh", "-c", "pgrep -c -f ^sleep.301 || true"] }),
    );
    assert_eq!(
        stdout(&events),
        "0\n",
        "the relayed exec was not brought back"
    );
    // Its workspace is as it was, byte for byte; the host directory is untouched.
    let blob = daemon.call(
        "GET",
        &format!("/v1/cells/{new}/files/content?path=made.bin"),
        None,
    );
    assert_eq!(blob.body, b"bin\x00ary\xff");
    let kept = daemon.call(
        "GET",
        &format!("/v1/cells/{new}/files/content?path=kept.txt"),
        None,
    );
    assert_eq!(kept.text(), "changed\n");
    assert_eq!(
        std::fs::read_to_string(host.path().join("kept.txt")).unwrap(),
        "from the host\n"
    );
    // New processes start in it as in any cell.
    let events = daemon.exec(&new, json!({ "argv": ["sh", "-c", "echo fresh; exit 4"] }));
    assert_eq!(
        (stdout(&events).as_str(), exit_of(&events)["code"].as_i64()),
        ("fresh\n", Some(4))
    );

    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    support::daemon::assert_has_kinds(&journal, &["cell.checkpoint", "cell.checkpoint.done"]);
    assert!(
        journal.contains(&format!("\"restore\":\"{id}\"")),
        "the restore is journaled"
    );
    daemon.assert_journal_verifies();

    // A cell no exec was ever started in (its files written through the files API) has no
    // execs of the warden's to end: it is saved as it is, and comes back whole.
    let quiet = daemon.create(
        &unique("ckptquiet"),
        json!({ "policy": GVISOR, "workspace": host.path().display().to_string() }),
    );
    let put = daemon.request(
        "PUT",
        &format!("/v1/cells/{quiet}/files/content?path=note.txt"),
        Some("written, not exec'd\n"),
    );
    assert!(put.status < 300, "{}", put.text());
    let marker = |cell: &str| daemon.runtime().join("cells").join(cell).join("execs");
    assert!(
        !marker(&quiet).exists(),
        "an exec is marked in a cell that had none"
    );
    assert!(marker(&new).exists(), "the execs of a cell are not marked");
    let saved = daemon.call(
        "POST",
        &format!("/v1/cells/{quiet}/checkpoint"),
        Some(json!({ "as": "q" })),
    );
    assert_eq!(saved.status, 201, "{}", saved.text());
    let back = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "name": unique("quietback"), "restore": format!("{quiet}@q") })),
    );
    assert_eq!(back.status, 201, "{}", back.text());
    let back = back.json()["name"].as_str().unwrap().to_owned();
    let events = daemon.exec(&back, json!({ "argv": ["cat", "note.txt"] }));
    assert_eq!(stdout(&events), "written, not exec'd\n");

    // An unknown checkpoint, and a restore that also names a policy, are refused.
    let unknown = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "restore": format!("{cell}@nope") })),
    );
    assert_eq!(unknown.status, 404, "{}", unknown.text());
    let both = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "restore": id, "preset": "default" })),
    );
    assert_eq!(both.status, 400, "{}", both.text());
}

#[test]
fn checkpoints_a_cell_cannot_have_are_refused_and_it_goes_on() {
    needs_gvisor!("checkpoints_a_cell_cannot_have_are_refused_and_it_goes_on");
    let daemon = Daemon::start(&[]);
    let host = tempdir();
    let ws = host.path().display().to_string();
    // The process tier has no memory snapshots.
    let process = daemon.create(
        &unique("proc"),
        json!({ "preset": "default", "workspace": ws }),
    );
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{process}/checkpoint"),
        Some(json!({})),
    );
    assert_eq!(refused.status, 409, "{}", refused.text());
    assert!(refused.text().contains("gvisor"), "{}", refused.text());
    // A gVisor cell with a gateway lives on the namespace's network stack.
    let networked = daemon.create(
        &unique("net"),
        json!({ "policy": format!("{GVISOR}network:\n  allow:\n    - host: 127.0.0.2\n"), "workspace": ws }),
    );
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{networked}/checkpoint"),
        Some(json!({})),
    );
    assert_eq!(refused.status, 409, "{}", refused.text());
    assert!(refused.text().contains("network"), "{}", refused.text());
    // Without a workspace there is nothing to keep the files in.
    let bare = daemon.create(&unique("bare"), json!({ "policy": GVISOR }));
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{bare}/checkpoint"),
        Some(json!({})),
    );
    assert_eq!(refused.status, 409, "{}", refused.text());
    // Each goes on as it was.
    for cell in [&process, &networked, &bare] {
        let events = daemon.exec(cell, json!({ "argv": ["echo", "alive"] }));
        assert_eq!(stdout(&events), "alive\n", "{cell}");
    }
}

/// A gVisor cell is ended through its sandbox: `runsc run` follows the sandbox's end within
/// milliseconds, ending the rest of the container and removing the state runsc keeps of it, so
/// nothing of runsc's is left for the keeper to remove with a `runsc delete` of its own (a start
/// of runsc that was on the way to every kill's, delete's and checkpoint's answer while runsc
/// itself was killed). The runsc here is a wrapper that writes down each call's arguments.
#[test]
fn a_gvisor_cell_is_ended_through_its_sandbox_and_runsc_cleans_up_after_itself() {
    needs_gvisor!("a_gvisor_cell_is_ended_through_its_sandbox_and_runsc_cleans_up_after_itself");
    let real = installed_runsc().unwrap();
    let dir = tempdir();
    let calls = dir.path().join("calls");
    let wrapper = dir.path().join("runsc");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"$*\" >> {}\nexec {} \"$@\"\n",
            calls.display(),
            real.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let daemon = Daemon::start_with(&[], &[("WARDEN_RUNSC", wrapper.to_str().unwrap())]);
    let host = tempdir();
    let ws = host.path().display().to_string();
    let [killed, deleted, saved] = ["kill", "del", "save"]
        .map(|p| daemon.create(&unique(p), json!({ "policy": GVISOR, "workspace": ws })));
    for cell in [&killed, &deleted, &saved] {
        let events = daemon.exec(cell, json!({ "argv": ["echo", "up"] }));
        assert_eq!(stdout(&events), "up\n", "{cell}");
    }
    let answer = daemon.call("POST", &format!("/v1/cells/{killed}/kill"), None);
    assert_eq!(answer.json()["ended"], "killed", "{}", answer.text());
    let answer = daemon.call("DELETE", &format!("/v1/cells/{deleted}"), None);
    assert_eq!(answer.status, 204, "{}", answer.text());
    let answer = daemon.call(
        "POST",
        &format!("/v1/cells/{saved}/checkpoint"),
        Some(json!({ "as": "c" })),
    );
    assert_eq!(answer.status, 201, "{}", answer.text());
    let info = daemon
        .call("GET", &format!("/v1/cells/{saved}"), None)
        .json();
    assert_eq!(info["state"], "ended", "{info}");
    // Restored, it runs again; that it does is read from runsc's own record of it, where a
    // `runsc state` (a start of runsc) every 10 ms asked before: runsc is asked at most once a
    // quarter of a second, for a record that does not read as expected.
    let began = Instant::now();
    let answer = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "name": unique("back"), "restore": format!("{saved}@c") })),
    );
    let restoring = began.elapsed();
    assert_eq!(answer.status, 201, "{}", answer.text());
    let back = answer.json()["name"].as_str().unwrap().to_owned();
    let events = daemon.exec(&back, json!({ "argv": ["echo", "again"] }));
    assert_eq!(stdout(&events), "again\n", "{back}");
    let asked = std::fs::read_to_string(&calls)
        .unwrap()
        .lines()
        .filter(|l| l.contains(" state ") && l.ends_with(back.as_str()))
        .count();
    assert!(
        asked as u128 <= restoring.as_millis() / 250 + 1,
        "runsc was asked {asked} times whether {back} runs, in a restore of {restoring:?}"
    );
    let answer = daemon.call("DELETE", &format!("/v1/cells/{back}"), None);
    assert_eq!(answer.status, 204, "{}", answer.text());
    // runsc ran each cell and saved one, and was never asked to remove what it kept.
    let before_paused = std::fs::read_to_string(&calls).unwrap();
    // A paused cell's processes a signal does not move: it is killed as before (runsc with
    // it, and what runsc kept removed by the keeper), and ends all the same.
    let paused = daemon.create(&unique("paused"), json!({ "policy": GVISOR }));
    let answer = daemon.call("POST", &format!("/v1/cells/{paused}/pause"), None);
    assert_eq!(answer.json()["state"], "paused", "{}", answer.text());
    let answer = daemon.call("DELETE", &format!("/v1/cells/{paused}"), None);
    assert_eq!(answer.status, 204, "{}", answer.text());
    let deadline = Instant::now() + Duration::from_secs(2);
    while !host_processes_with(&paused).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        host_processes_with(&paused),
        Vec::<i32>::new(),
        "a process of the paused cell outlived its delete"
    );
    let calls = before_paused;
    for cell in [&killed, &deleted, &saved] {
        assert!(
            calls
                .lines()
                .any(|l| l.contains(" run ") && l.ends_with(cell.as_str())),
            "{cell} was not run through the wrapper:\n{calls}"
        );
    }
    assert!(calls.contains(" checkpoint "), "{calls}");
    assert!(
        !calls.lines().any(|l| l.contains(" delete ")),
        "runsc was left state to delete:\n{calls}"
    );
    // Nor is anything of theirs left in runsc's own folder, and the ends are journaled.
    let kept: Vec<String> = std::fs::read_dir(daemon.state().join("gvisor").join("runsc"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    for cell in [&killed, &deleted, &saved, &paused, &back] {
        assert!(
            !kept
                .iter()
                .any(|name| name.starts_with(&format!("{cell}_sandbox:"))),
            "runsc kept state of {cell}: {kept:?}"
        );
    }
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        journal
            .lines()
            .any(|l| l.contains(&format!("\"cell\":\"{killed}\""))
                && l.contains("\"reason\":\"killed\"")),
        "the kill's end is journaled"
    );
}

#[test]
fn a_gvisor_cell_outlives_a_crashed_daemon() {
    needs_gvisor!("a_gvisor_cell_outlives_a_crashed_daemon");
    let mut daemon = Daemon::start(&[]);
    let host = tempdir();
    let cell = daemon.create(
        &unique("survive"),
        json!({ "policy": GVISOR, "workspace": host.path().display().to_string() }),
    );
    daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo before > note.txt; echo mem > /tmp/mem"] }),
    );
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "300"], "background": true })),
    );
    assert_eq!(started.status, 201);
    daemon.crash();
    // While no daemon runs, the sandbox goes on.
    assert!(
        !host_processes_with(&cell).is_empty(),
        "the sandbox runs without the daemon"
    );
    daemon.restart();
    let info = daemon
        .call("GET", &format!("/v1/cells/{cell}"), None)
        .json();
    assert_eq!(info["state"], "running", "{info}");
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "cat note.txt /tmp/mem; pgrep -c -x sleep"] }),
    );
    // Files and memory are as they were; the process whose output only the old daemon was
    // reading was ended with its connection, as in every tier, and the journal says so.
    assert_eq!(stdout(&events), "before\nmem\n0\n");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    support::daemon::assert_has_kinds(&journal, &["cell.reattach", "exec.lost"]);
    let killed = daemon.call("POST", &format!("/v1/cells/{cell}/kill"), None);
    assert_eq!(killed.json()["state"], "ended");
}

/// What a process of the cell tries against the init (pid 1), which starts the cell's
/// processes and holds the host side's socket: trace it, read its memory, open its socket,
/// copy its descriptor.
const TAKE_OVER_THE_INIT: &str = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, f):
    try:
        print(name, "REACHED", f())
    except OSError as e:
        print(name, "refused")
def ptrace():
    if libc.ptrace(16, 1, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "ptrace")
def getfd():
    pidfd = libc.syscall(434, 1, 0)
    if pidfd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_open")
    if libc.syscall(438, pidfd, 0, 0) < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
attempt("ptrace", ptrace)
attempt("mem", lambda: open("/proc/1/mem", "rb").read(1))
attempt("socket", lambda: os.open("/proc/1/fd/0", os.O_RDWR))
attempt("getfd", getfd)
"#;

#[test]
fn a_gvisor_cells_processes_are_started_by_its_init_which_no_process_takes_over() {
    needs_gvisor!("a_gvisor_cells_processes_are_started_by_its_init_which_no_process_takes_over");
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("init"), json!({ "policy": GVISOR }));
    // Started by the init (a `runsc exec` would have no parent in the sandbox), with its own
    // session, the cell's user and nothing of the init's open but its stdio.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo $PPID; ps -o sid= -p $$; id -u; ls /proc/self/fd | wc -l"] }),
    );
    assert_eq!(exit_of(&events)["code"].as_i64(), Some(0), "{events:?}");
    let out = stdout(&events);
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    assert_eq!(lines.first(), Some(&"1"), "{out}");
    assert_ne!(lines.get(1), Some(&"1"), "its own session: {out}");
    assert_eq!(lines.get(2), Some(&"1000"), "{out}");
    // 0, 1, 2 and the directory `ls` reads.
    assert_eq!(lines.get(3), Some(&"4"), "{out}");
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["python3", "-c", TAKE_OVER_THE_INIT] }),
    );
    assert_eq!(
        stdout(&events),
        "ptrace refused\nmem refused\nsocket refused\ngetfd refused\n",
        "{events:?}"
    );
    // Exit statuses come from the init's own wait: exact, where runsc's exec said 128 + N for
    // a signal and so could not tell an `exit 130` from SIGINT.
    let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", "exit 130"] }));
    let exit = exit_of(&events);
    assert_eq!(
        (exit["reason"].as_str(), exit["code"].as_i64()),
        (Some("exited"), Some(130)),
        "{exit}"
    );
}

#[test]
fn a_run_on_gvisor_kills_its_cell_once_its_command_has_ended() {
    needs_gvisor!("a_run_on_gvisor_kills_its_cell_once_its_command_has_ended");
    let daemon = Daemon::start(&[]);
    let answer = daemon.call(
        "POST",
        "/v1/run",
        Some(json!({ "cell": { "policy": GVISOR }, "exec": { "argv": ["sh", "-c", "exit 4"] } })),
    );
    assert_eq!(answer.status, 200, "{}", answer.text());
    let events = answer.events();
    assert_eq!(exit_of(&events)["code"].as_i64(), Some(4), "{events:?}");
    let cell = events[0].1["cell"].as_str().unwrap().to_owned();
    // Its init does not end the cell with its last process (the process tier's does): the
    // delete kills it, as any, before the answer ends.
    let entries = daemon.entries_of(&cell);
    let kinds: Vec<&str> = entries
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "cell.create",
            "cell.start",
            "exec.start",
            "exec.exit",
            "cell.kill",
            "cell.end",
            "cell.delete"
        ],
        "{entries:?}"
    );
    assert_eq!(entries[5]["data"]["reason"], "killed");
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .status,
        404
    );
}

#[test]
fn the_gvisor_tier_is_refused_where_it_cannot_run_and_doctor_says_why() {
    // As root with runsc, doctor says the tier is usable here; as an unprivileged user, a
    // gVisor cell is refused with the reason, and nothing falls back to another tier.
    if is_root() && unavailable().is_none() {
        let doctor = warden().args(["doctor", "--json"]).output().unwrap();
        let checks: Value = serde_json::from_slice(&doctor.stdout).unwrap();
        let tier = checks
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["tier"] == "gvisor" && c["feature"] == "tier")
            .cloned()
            .unwrap();
        assert_eq!(tier["status"], "ok", "{tier}");
        assert!(
            tier["detail"].as_str().unwrap().contains("usable here"),
            "{tier}"
        );
        let sandbox = checks
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["tier"] == "gvisor" && c["feature"] == "sandbox")
            .cloned()
            .unwrap();
        assert_eq!(
            sandbox["status"], "ok",
            "a sandbox really started: {sandbox}"
        );
    }
    if !is_root() {
        eprintln!("skipped the unprivileged half: it drops from root to nobody");
        return;
    }
    let dir = tempdir();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let policy = policy(dir.path(), GVISOR);
    std::fs::set_permissions(&policy, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(BIN)
        .args(["run", "--policy"])
        .arg(&policy)
        .args(["--", "echo", "ran"])
        .env("HOME", dir.path())
        .env("XDG_RUNTIME_DIR", dir.path())
        .env_remove("WARDEN_STATE_DIR")
        .env_remove("WARDEN_RUNTIME_DIR")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert!(
        err.contains("needs root") && err.contains("tier: process"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "nothing ran: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // A tier this warden does not implement names the ones it does.
    let microvm = policy_text_run("version: 1\ntier: microvm\n");
    assert_eq!(microvm.code, 125, "{microvm:?}");
    assert!(
        microvm.stderr.contains("tier: process") && microvm.stderr.contains("tier: gvisor"),
        "{microvm:?}"
    );
}

fn policy_text_run(yaml: &str) -> Ran {
    let dir = tempdir();
    let policy = policy(dir.path(), yaml);
    run_sh(&["--policy", &policy.display().to_string()], "echo ran")
}

/// A `warden run` killed with SIGKILL (nothing of it runs to clean up) takes its gVisor cell
/// with it, as a process-tier cell goes with its `warden run`: the keeper hears of it and ends
/// the sandbox, and the cell's folder goes.
#[test]
fn a_killed_warden_run_takes_its_gvisor_cell_with_it() {
    needs_gvisor!("a_killed_warden_run_takes_its_gvisor_cell_with_it");
    use std::io::BufRead as _;
    let dir = tempdir();
    let policy = policy(dir.path(), GVISOR);
    let name = unique("gv-killed");
    let mut child = warden()
        .args(["run", "--policy"])
        .arg(&policy)
        .args(["--name", &name, "--", "sh", "-c", "echo ready; sleep 60"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert_eq!(ready, "ready\n");
    // The sandbox runs under the cell's name.
    let sandboxes = || -> Vec<String> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains("runsc") && c.trim_end().ends_with(&name))
            .collect()
    };
    assert!(!sandboxes().is_empty(), "no sandbox of {name} runs");
    child.kill().unwrap();
    child.wait().unwrap();
    // One look decides: the keeper's cleanup may start a `runsc delete --force` of the name
    // just after a look found nothing left (a second look would take it for the sandbox).
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut left = sandboxes();
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        left = sandboxes();
    }
    assert!(left.is_empty(), "left running: {left:?}");
    let runtime = std::env::var_os("WARDEN_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/run/warden".into());
    let folder = runtime.join("cells").join(&name);
    while folder.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!folder.exists(), "{folder:?} is left behind");
}

/// GNU coreutils pass `AT_NO_AUTOMOUNT` to every `statx`, which this runsc refuses: the shim
/// Warden preloads in its cells asks again without it, so listing, `stat` and copying work
/// (without the shim, `ls` and `stat` fail here with EINVAL).
#[test]
fn gnu_tools_work_in_a_gvisor_cell() {
    needs_gvisor!("gnu_tools_work_in_a_gvisor_cell");
    let dir = tempdir();
    let policy = policy(dir.path(), GVISOR);
    let ran = run_sh(
        &["--rm", "--policy", &policy.display().to_string()],
        "ls -l /etc/hostname >/dev/null && stat -c %F /etc/hostname && cp /etc/hostname /tmp/copy \
         && cmp /etc/hostname /tmp/copy && echo copied",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(ran.stdout, "regular file\ncopied\n", "{ran:?}");
    // In a cell of the host's directories (glibc 2.36 here) the shim is the read-only layout:
    // one mapping of its file, not writable (its two loader-filled words are in zeroed memory
    // of no file), and the preload file is its name with nothing after it, so the loader
    // writes no page of either file.
    let ran = run_sh(
        &["--rm", "--policy", &policy.display().to_string()],
        "grep statx.so /proc/self/maps; printf '[%s]' \"$(od -An -c /etc/ld.so.preload | tr -d ' \n')\"",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let (maps, preload) = ran.stdout.rsplit_once('\n').unwrap_or(("", &ran.stdout));
    let mapped: Vec<&str> = maps.lines().collect();
    assert_eq!(mapped.len(), 1, "{ran:?}");
    let perms = mapped[0].split_whitespace().nth(1).unwrap_or_default();
    assert!(perms.starts_with("r-x"), "{ran:?}");
    assert_eq!(preload, "[/.warden/statx.so]", "{ran:?}");
}

/// runsc's gofer, a root process of the host, writes the modes a gVisor cell sets onto the real
/// files: a `chmod 4755` in the cell made a set-id program in the cell's layer, owned by the
/// host id of the cell's user (0 with `process: {user: 0}`), which any host user could run as
/// that id (with `--disk none` the layer is on the host's own file system, reachable by all).
/// Under Warden's filter on runsc no set-id bit reaches the host: the layer's copy has none, and
/// `nobody`, running it, stays `nobody`.
#[test]
fn a_gvisor_cell_cannot_leave_a_set_id_program_on_the_host() {
    needs_gvisor!("a_gvisor_cell_cannot_leave_a_set_id_program_on_the_host");
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let dirs = run_dirs();
    // Every folder on the way to the layer is open to `nobody`, as a state folder is.
    std::fs::set_permissions(dirs.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for (user, uid) in [("", 1000), ("process:\n  user: 0\n", 0)] {
        let policy = policy(dirs.dir.path(), &format!("{GVISOR}{user}"));
        let name = unique("gv-setid");
        let ran: Ran = warden()
            .env("WARDEN_STATE_DIR", &dirs.state)
            .env("WARDEN_RUNTIME_DIR", &dirs.runtime)
            .args(["run", "--disk", "none", "--policy"])
            .arg(&policy)
            .args(["--name", &name, "-w"])
            .arg(&dirs.host)
            .args([
                "--",
                "sh",
                "-c",
                "cd /workspace && cp /bin/id setid && chmod 6755 setid; id -u",
            ])
            .output()
            .unwrap()
            .into();
        assert_eq!(ran.code, 0, "{ran:?}");
        assert_eq!(ran.stdout.lines().last(), Some(uid.to_string().as_str()));
        let copy = dirs.state.join("layers").join(&name).join("upper/setid");
        let meta = std::fs::metadata(&copy).unwrap();
        assert_eq!(meta.uid(), uid, "the layer's copy is the cell's user's");
        let out = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(&copy)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            !said.contains("euid=") && !said.contains("egid="),
            "nobody ran the cell's program with its owner's ids: {said}"
        );
        assert_eq!(meta.mode() & 0o6000, 0, "a set-id bit reached the host");
        let _ = warden()
            .env("WARDEN_STATE_DIR", &dirs.state)
            .env("WARDEN_RUNTIME_DIR", &dirs.runtime)
            .args(["rm", &name])
            .output();
    }
}

/// The host's pids controller counts runsc's own tasks (its threads, its ptrace stubs: about
/// 8 for each of the cell's processes), not the cell's: given `limits.pids` itself, a sandbox
/// died at about 50 processes of the default 512. The host bound is sized from that cost, so
/// 100 processes run; and a fork bomb under `--pids 32` is still bounded, and said.
#[test]
fn a_gvisor_cells_processes_are_bounded_by_its_limit_not_by_runscs_threads() {
    needs_gvisor!("a_gvisor_cells_processes_are_bounded_by_its_limit_not_by_runscs_threads");
    let dir = tempdir();
    let policy = policy(dir.path(), GVISOR);
    let policy = policy.display().to_string();
    let ran = run_sh(
        &["--rm", "--policy", &policy],
        "for i in $(seq 1 100); do sleep 5 & done; echo spawned; ps -e | wc -l; wait",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    let count: u32 = ran.stdout.lines().nth(1).unwrap().trim().parse().unwrap();
    assert!(count > 100, "{ran:?}");
    // The bomb: the cell's processes stay near 32, and the host's tasks under the bound.
    let name = unique("gv-bomb");
    let started = Instant::now();
    let mut bomb = warden()
        .args([
            "run",
            "--rm",
            "--pids",
            "32",
            "--timeout",
            "20s",
            "--policy",
            &policy,
        ])
        .args(["--name", &name, "--", "sh", "-c"])
        .arg("n=0; while [ $n -lt 300 ]; do sleep 10 & n=$((n+1)); done 2>/dev/null; ps -e | wc -l")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut most = 0u64;
    while bomb.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(30) {
        for dir in cgroup_dirs_of(&name) {
            if let Ok(text) = std::fs::read_to_string(dir.join("pids.current")) {
                most = most.max(text.trim().parse().unwrap_or(0));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let ran: Ran = bomb.wait_with_output().unwrap().into();
    assert!(most <= 32 * 8 + 64, "{most} host tasks: {ran:?}");
    match ran.code {
        // The cell's own fork failed first: it counted its processes.
        0 => {
            let count: u32 = ran.stdout.trim().parse().unwrap();
            assert!(count <= 40, "{ran:?}");
        }
        // runsc could not start a thread, and ended: said.
        _ => assert!(ran.stderr.contains("host bound of 320 tasks"), "{ran:?}"),
    }
}

/// `filesystem.tmp_size` holds on the gVisor tier as on the process tier: gVisor's tmpfs keeps
/// to the `size=` of the bundle's `/tmp`, and a write past it fails with ENOSPC (without it,
/// 600 MiB were written into a `/tmp` of 256).
#[test]
fn a_gvisor_cells_tmp_is_no_larger_than_its_policy_says() {
    needs_gvisor!("a_gvisor_cells_tmp_is_no_larger_than_its_policy_says");
    let dir = tempdir();
    let policy = policy(
        dir.path(),
        &format!("{GVISOR}filesystem:\n  tmp_size: 4MiB\n"),
    );
    let ran = run_sh(
        &["--rm", "--policy", &policy.display().to_string()],
        "dd if=/dev/zero of=/tmp/big bs=1M count=8 2>&1; echo status=$?",
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stdout.contains("No space left on device"), "{ran:?}");
    assert!(ran.stdout.contains("status=1"), "{ran:?}");
}

/// The keeper assembles a gVisor cell's root on the host as root, by path, on the image's
/// merged tree: an image's symbolic link where it makes something led it into the host's own
/// files. Without the check, an image whose `/.warden` led to a host folder had empty files
/// `init` and `statx.so` made there, and one with a link at a file the policy copies in had a
/// host file outside every granted path written over with that file's bytes (the cell then ran
/// as if nothing happened). The cell is refused, saying where the link is, and nothing of the
/// host is touched; the same policy with an image without the links runs, the file copied in.
#[test]
fn an_images_links_do_not_lead_the_keeper_into_the_hosts_files() {
    needs_gvisor!("an_images_links_do_not_lead_the_keeper_into_the_hosts_files");
    let dirs = run_dirs();
    let base = dirs.dir.path();
    let victim = base.join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("target"), "the host's own\n").unwrap();
    let copied = base.join("copied.txt");
    std::fs::write(&copied, "copied in by the policy\n").unwrap();
    let mut links = tar::Builder::new(Vec::new());
    for (path, target) in [
        (std::path::Path::new("/.warden"), victim.clone()),
        (copied.as_path(), victim.join("target")),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        header.set_mode(0o777);
        links
            .append_link(&mut header, path.strip_prefix("/").unwrap(), &target)
            .unwrap();
    }
    let shell = host_shell_layer(&[]);
    let import = |layers: &[Vec<u8>], tag: &str| {
        let out = warden()
            .env("WARDEN_STATE_DIR", &dirs.state)
            .args(["image", "import"])
            .arg(docker_archive(
                base,
                layers,
                tag,
                json!({ "Env": ["PATH=/bin"] }),
            ))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    };
    import(&[shell.clone(), links.into_inner().unwrap()], "linked:1");
    import(&[shell], "plain:1");
    let run = |image: &str| -> Ran {
        let policy = policy(
            base,
            &format!(
                "version: 1\ntier: gvisor\nimage: {image}\nfilesystem:\n  read_only: [{}]\n",
                copied.display()
            ),
        );
        warden()
            .env("WARDEN_STATE_DIR", &dirs.state)
            .env("WARDEN_RUNTIME_DIR", &dirs.runtime)
            .args(["run", "--rm", "--policy"])
            .arg(&policy)
            .args(["--", "/bin/sh", "-c"])
            .arg(format!(
                "read -r line < {}; echo \"$line\"",
                copied.display()
            ))
            .output()
            .unwrap()
            .into()
    };
    let ran = run("linked:1");
    assert_eq!(
        std::fs::read_to_string(victim.join("target")).unwrap(),
        "the host's own\n",
        "the host's file was written over: {ran:?}"
    );
    let made: Vec<_> = std::fs::read_dir(&victim)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(made, ["target"], "files made in the host's folder: {ran:?}");
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(ran.stderr.contains("has a symbolic link at /"), "{ran:?}");
    assert!(cell_folders_left(&dirs.runtime).is_empty());
    // Without the links the same policy runs, the host's file copied in.
    let ran = run("plain:1");
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(ran.stdout, "copied in by the policy\n", "{ran:?}");
}

/// A gVisor cell whose user is 0 has its file operations (the files API, `warden cp`) run as
/// the host's uid 0, which kept every capability: they read a file of mode 000 that the cell's
/// own root, which has none, may not, and wrote into a directory of mode 555. They now have
/// what the cell's user has, and no more.
#[test]
fn a_gvisor_cells_file_operations_have_no_capability_its_user_lacks() {
    needs_gvisor!("a_gvisor_cells_file_operations_have_no_capability_its_user_lacks");
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(
        &unique("rootfiles"),
        json!({ "policy": format!("{GVISOR}process:\n  user: 0\n") }),
    );
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "echo secret > locked; chmod 000 locked; mkdir ro; chmod 555 ro; id -u; cat locked 2>/dev/null || echo refused; touch ro/in 2>/dev/null || echo refused"] }),
    );
    assert_eq!(stdout(&events), "0\nrefused\nrefused\n", "{events:?}");
    let read = daemon.request(
        "GET",
        &format!("/v1/cells/{cell}/files/content?path=locked"),
        None,
    );
    assert!(
        read.status >= 400 && !read.text().contains("secret"),
        "the files API read what the cell's root may not: {} {}",
        read.status,
        read.text()
    );
    assert!(read.text().contains("Permission denied"), "{}", read.text());
    let write = daemon.request(
        "PUT",
        &format!("/v1/cells/{cell}/files/content?path=ro/in"),
        Some("x"),
    );
    assert!(write.status >= 400, "{} {}", write.status, write.text());
    let events = daemon.exec(&cell, json!({ "argv": ["ls", "ro"] }));
    assert_eq!(stdout(&events), "", "{events:?}");
    // What the cell's user may do, the files API does.
    let put = daemon.request(
        "PUT",
        &format!("/v1/cells/{cell}/files/content?path=mine.txt"),
        Some("mine\n"),
    );
    assert!(put.status < 300, "{}", put.text());
    let events = daemon.exec(&cell, json!({ "argv": ["cat", "mine.txt"] }));
    assert_eq!(stdout(&events), "mine\n", "{events:?}");
}

/// A disk limit where the workspace cannot have a disk of its own (no loop devices, no mkfs:
/// here `mkfs` hidden in a mount namespace of the test's own): the process tier keeps it per
/// file and by a watch, but the sandbox's files are written by runsc's gofer, which has
/// neither, and a gVisor cell wrote 100 MiB against 32 and ended with status 0. It is refused
/// before it starts, saying why and what to do.
#[test]
fn a_gvisor_cell_whose_disk_limit_cannot_be_kept_is_refused() {
    needs_gvisor!("a_gvisor_cell_whose_disk_limit_cannot_be_kept_is_refused");
    let dirs = run_dirs();
    let policy = policy(
        dirs.dir.path(),
        &format!("{GVISOR}limits:\n  disk: 32MiB\n"),
    );
    let out = std::process::Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            "mount -t tmpfs tmpfs /usr/sbin && exec \"$0\" \"$@\"",
        ])
        .arg(bin())
        .args(["run", "--policy"])
        .arg(&policy)
        .arg("-w")
        .arg(&dirs.host)
        .args([
            "--",
            "sh",
            "-c",
            "head -c 50000000 /dev/zero > big; echo wrote",
        ])
        .env("WARDEN_STATE_DIR", &dirs.state)
        .env("WARDEN_RUNTIME_DIR", &dirs.runtime)
        .output()
        .unwrap();
    let ran: Ran = out.into();
    assert_eq!(ran.code, 125, "{ran:?}");
    assert!(!ran.stdout.contains("wrote"), "{ran:?}");
    assert!(
        ran.stderr
            .contains("keeps a disk limit (32 MiB) only with a disk of the workspace's own")
            && ran.stderr.contains("is not installed"),
        "{ran:?}"
    );
    assert!(cell_folders_left(&dirs.runtime).is_empty());
    let ps = warden()
        .env("WARDEN_STATE_DIR", &dirs.state)
        .env("WARDEN_RUNTIME_DIR", &dirs.runtime)
        .args(["ps", "--all"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&ps.stdout).lines().count(),
        1,
        "a cell or layer was left: {}",
        String::from_utf8_lossy(&ps.stdout)
    );
}
