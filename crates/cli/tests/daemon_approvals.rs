//! Approvals and policies of the daemon's cells: network and command questions held, answered,
//! timed out and announced; replaced policies; gateway decisions journaled once.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

#[test]
fn approvals_held_by_the_daemon_proceed_on_approve_and_fail_on_deny_or_timeout() {
    if !cgroups_available("daemon_approvals") {
        return;
    }
    let (port, hits) = upstream();
    let daemon = Daemon::start(&[]);
    let policy = format!(
        "version: 1\nnetwork:\n  ask:\n    - host: 127.0.0.2\n      ports: [{port}]\napprovals:\n  timeout: 2s\n  on_timeout: deny\n"
    );
    let cell = daemon.create(&unique("approve"), json!({ "policy": policy }));
    let fetch = |path: &str| -> u64 {
        let code = format!(
            "import urllib.request, urllib.error\n\
             try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/{path}').status)\n\
             except urllib.error.HTTPError as e:\n    print(e.code)"
        );
        let started = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": ["python3", "-c", code], "background": true })),
        );
        assert_eq!(started.status, 201);
        started.json()["id"].as_u64().unwrap()
    };
    let question = |path: &str| -> u64 {
        for _ in 0..200 {
            let list = daemon.call("GET", "/v1/approvals", None).json();
            if let Some(q) = list.as_array().unwrap().iter().find(|q| {
                q["request"]
                    .as_str()
                    .unwrap()
                    .ends_with(&format!("/{path}"))
            }) {
                assert_eq!(q["cell"], cell.as_str());
                return q["id"].as_u64().unwrap();
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("no approval appeared for /{path}");
    };
    let result = |id: u64| -> String {
        daemon.call(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/wait"),
            None,
        );
        let out = daemon.call(
            "GET",
            &format!("/v1/cells/{cell}/processes/{id}/output"),
            None,
        );
        String::from_utf8(stream_bytes(&out.events(), "stdout"))
            .unwrap()
            .trim()
            .to_owned()
    };
    let answer = |id: u64, decision: &str, scope: &str| {
        let answer = daemon.call(
            "POST",
            &format!("/v1/approvals/{cell}/{id}"),
            Some(json!({ "decision": decision, "scope": scope })),
        );
        assert_eq!(
            answer.status,
            204,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    };

    // Approved: the request goes through, and only then reaches the upstream.
    let p = fetch("a");
    let q = question("a");
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "held until answered"
    );
    answer(q, "approve", "once");
    assert_eq!(result(p), "200");

    // Denied: a 403, and the upstream never sees it.
    let before = hits.load(std::sync::atomic::Ordering::SeqCst);
    let p = fetch("b");
    answer(question("b"), "deny", "once");
    assert_eq!(result(p), "403");
    // Unanswered: the policy's timeout decides (deny).
    let p = fetch("c");
    question("c");
    assert_eq!(result(p), "403");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), before);

    // Scope `cell`: the same request from this cell is approved from now on without asking.
    let p = fetch("d");
    answer(question("d"), "approve", "cell");
    assert_eq!(result(p), "200");
    let p = fetch("d");
    assert_eq!(result(p), "200");

    // The journal says who answered what, and that the timeout decided one; the gateway's
    // decisions reach it within a tick of the daemon's watch.
    let mut entries: Vec<Value> = Vec::new();
    for _ in 0..40 {
        let journal = std::fs::read_to_string(daemon.journal()).unwrap();
        entries = journal
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if entries
            .iter()
            .filter(|e| e["kind"] == "net.decision")
            .count()
            >= 5
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let answers: Vec<&Value> = entries
        .iter()
        .filter(|e| e["kind"] == "approval.answer")
        .collect();
    assert_eq!(answers.len(), 4, "{answers:?}");
    assert!(
        answers[0]["data"]["by"]
            .as_str()
            .unwrap()
            .contains("on the unix socket"),
        "{}",
        answers[0]
    );
    assert_eq!(answers[1]["data"]["decision"], "deny");
    assert!(
        answers[3]["data"]["by"]
            .as_str()
            .unwrap()
            .starts_with("grant:"),
        "{}",
        answers[3]
    );
    assert!(entries.iter().any(|e| e["kind"] == "approval.timeout"
        && e["data"]["request"].as_str().unwrap().ends_with("/c")));
    let decisions = entries
        .iter()
        .filter(|e| e["kind"] == "net.decision")
        .count();
    assert!(
        decisions >= 5,
        "gateway decisions are journaled ({decisions})"
    );
}

#[test]
fn commands_held_by_an_ask_rule_run_after_approve_and_are_refused_after_deny_or_timeout() {
    if !cgroups_available("daemon_exec_ask") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let policy = "version: 1\ncommands:\n  deny: [\"rm -rf *\"]\n  ask: [\"echo push*\"]\napprovals:\n  timeout: 2s\n";
    let cell = daemon.create(&unique("cmdask"), json!({ "policy": policy }));
    // Refused outright by a deny rule.
    let refused = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["rm", "-rf", "/tmp/x"] })),
    );
    assert_eq!(refused.status, 403);
    assert!(
        refused.json()["error"]
            .as_str()
            .unwrap()
            .contains("rm -rf *")
    );
    // Held: the request waits for the answer.
    let ask = |words: &'static str| {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            let argv: Vec<&str> = words.split(' ').collect();
            daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/exec"),
                Some(json!({ "argv": argv })),
            )
        })
    };
    let question = |request: &str| -> u64 {
        for _ in 0..200 {
            let list = daemon.call("GET", "/v1/approvals", None).json();
            if let Some(q) = list
                .as_array()
                .unwrap()
                .iter()
                .find(|q| q["request"] == request)
            {
                return q["id"].as_u64().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("no question `{request}`");
    };
    let held = ask("echo push one");
    let id = question("exec echo push one");
    std::thread::sleep(Duration::from_millis(200));
    assert!(!held.is_finished(), "the exec waits for its answer");
    let answered = daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "approve" })),
    );
    assert_eq!(answered.status, 204);
    let ran = held.join().unwrap();
    assert_eq!(ran.status, 200);
    assert_eq!(stream_bytes(&ran.events(), "stdout"), b"push one\n");

    let held = ask("echo push two");
    let id = question("exec echo push two");
    daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "deny" })),
    );
    let ran = held.join().unwrap();
    assert_eq!(ran.status, 403);
    assert!(ran.json()["error"].as_str().unwrap().contains("refused"));

    let held = ask("echo push three");
    question("exec echo push three");
    let ran = held.join().unwrap();
    assert_eq!(ran.status, 403, "the policy's timeout (2 s) denies");
    assert!(
        ran.json()["error"]
            .as_str()
            .unwrap()
            .contains("nobody answered")
    );

    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let entries: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds = |kind: &str| entries.iter().filter(|e| e["kind"] == kind).count();
    assert_eq!(
        (
            kinds("approval.ask"),
            kinds("approval.answer"),
            kinds("approval.timeout"),
            kinds("exec.denied")
        ),
        (3, 2, 1, 1)
    );
    let answer = entries
        .iter()
        .find(|e| e["kind"] == "approval.answer")
        .unwrap();
    assert!(
        answer["data"]["by"]
            .as_str()
            .unwrap()
            .contains("unix socket"),
        "{answer}"
    );
    // Only the approved command ran.
    assert_eq!(
        entries.iter().filter(|e| e["kind"] == "exec.start").count(),
        1
    );
}

#[test]
fn questions_are_announced_on_the_waiting_terminal_listed_for_all_cells_and_answered_by_id() {
    if !cgroups_available("daemon_questions_cli") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let policy = "version: 1\ncommands:\n  deny: [\"rm *\"]\n  ask: [\"echo push*\"]\napprovals:\n  timeout: 30s\n";
    let cell = daemon.create(&unique("qcli"), json!({ "policy": policy }));
    let exec = |words: &[&str]| {
        daemon
            .warden()
            .arg("exec")
            .arg(&cell)
            .arg("--")
            .args(words)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let cli = |args: &[&str]| daemon.warden().args(args).output().unwrap();

    // Held: `warden exec` says so, with the id and how to answer.
    let mut held = exec(&["echo", "push", "one"]);
    let lines = stderr_lines(&mut held);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &cell, &mut seen);
    assert!(seen.last().unwrap().contains("echo push one"), "{seen:?}");
    // `warden approvals` with no name lists every cell's questions, with that id.
    let all = cli(&["approvals"]);
    let listed = String::from_utf8_lossy(&all.stdout);
    assert!(all.status.success());
    assert!(
        listed.lines().any(|l| l.starts_with(cell.as_str())
            && l.split_whitespace().nth(1) == Some(id.to_string().as_str())
            && l.contains("exec echo push one")),
        "{listed}"
    );
    let one: Value = serde_json::from_slice(&cli(&["approvals", &cell, "--json"]).stdout).unwrap();
    assert_eq!(one.as_array().unwrap().len(), 1, "{one}");
    assert_eq!(one[0]["id"], id);
    let approve = cli(&["approve", &cell, &id.to_string()]);
    assert!(
        approve.status.success(),
        "{}",
        String::from_utf8_lossy(&approve.stderr)
    );
    let out = held.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, b"push one\n");

    // Denied by a person: its own exit status, and the words say so.
    let mut held = exec(&["echo", "push", "two"]);
    let lines = stderr_lines(&mut held);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &cell, &mut seen);
    let deny = cli(&["deny", &cell, &id.to_string()]);
    assert!(
        deny.status.success(),
        "{}",
        String::from_utf8_lossy(&deny.stderr)
    );
    let status = held.wait().unwrap();
    seen.extend(lines.iter());
    assert_eq!(
        status.code(),
        Some(warden_protocol::exit::REFUSED),
        "{seen:?}"
    );
    assert!(seen.iter().any(|l| l.contains("refused")), "{seen:?}");
    assert!(held.stdout.take().is_none_or(|mut o| {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut o, &mut text).unwrap();
        text.is_empty()
    }));
    // Refused by a rule: the same status, the rule named.
    let ruled = cli(&["exec", &cell, "--", "rm", "/tmp/x"]);
    assert_eq!(ruled.status.code(), Some(warden_protocol::exit::REFUSED));
    assert!(String::from_utf8_lossy(&ruled.stderr).contains("rm *"));
    // Nothing is left open.
    let empty: Value = serde_json::from_slice(&cli(&["approvals", "--json"]).stdout).unwrap();
    assert_eq!(empty, json!([]));
}

#[test]
fn a_network_question_keeps_its_id_across_a_restart_and_scope_cell_covers_the_host() {
    if !cgroups_available("daemon_questions_restart") {
        return;
    }
    let (port, hits) = upstream();
    let mut daemon = Daemon::start(&[]);
    let policy = format!(
        "version: 1\nnetwork:\n  ask:\n    - host: 127.0.0.2\n      ports: [{port}]\napprovals:\n  timeout: 60s\n"
    );
    let cell = daemon.create(&unique("qrestart"), json!({ "policy": policy }));
    let fetch = |daemon: &Daemon, path: &str| {
        let code = format!(
            "import urllib.request, urllib.error\n\
             try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/{path}').status)\n\
             except urllib.error.HTTPError as e:\n    print(e.code)"
        );
        daemon
            .warden()
            .args(["exec", &cell, "--", "python3", "-c", &code])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let open = |daemon: &Daemon| -> Vec<u64> {
        daemon
            .call("GET", "/v1/approvals", None)
            .json()
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["id"].as_u64().unwrap())
            .collect()
    };
    // Announced on the terminal that waits, for a connection as for a command.
    let mut held = fetch(&daemon, "zero");
    let lines = stderr_lines(&mut held);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &cell, &mut seen);
    assert!(
        seen.last()
            .unwrap()
            .contains(&format!("127.0.0.2:{port}/zero")),
        "{seen:?}"
    );
    assert_eq!(open(&daemon), vec![id]);
    assert!(
        daemon
            .warden()
            .args(["approve", &cell, &id.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let zero = held.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&zero.stdout).trim(), "200");
    // A question open while the daemon dies and comes back is the same question, by the same
    // id. (The process that waits is the daemon's background one: a terminal's stream ends with
    // the daemon.)
    let code =
        format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.2:{port}/first')");
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["python3", "-c", code], "background": true })),
    );
    assert_eq!(started.status, 201);
    let mut before = Vec::new();
    for _ in 0..200 {
        before = open(&daemon);
        if !before.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(before.len(), 1, "no question for /first");
    let id = before[0];
    daemon.restart();
    let mut after = Vec::new();
    for _ in 0..100 {
        after = open(&daemon);
        if !after.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        after,
        vec![id],
        "the question's id changed across the restart"
    );
    let journal_path = daemon.journal();
    let asks = || {
        std::fs::read_to_string(&journal_path)
            .unwrap()
            .lines()
            .filter(|l| l.contains("\"approval.ask\""))
            .count()
    };
    assert_eq!(asks(), 2, "the question was asked again after the restart");
    // Scope cell: the person means the host, so another path on it goes through unasked.
    let approve = daemon
        .warden()
        .args(["approve", &cell, &id.to_string(), "--scope", "cell"])
        .output()
        .unwrap();
    assert!(
        approve.status.success(),
        "{}",
        String::from_utf8_lossy(&approve.stderr)
    );
    for _ in 0..200 {
        if hits.load(std::sync::atomic::Ordering::SeqCst) == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "/first went through"
    );
    // The grant is kept across a restart.
    daemon.restart();
    let second = fetch(&daemon, "second/path?q=1")
        .wait_with_output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&second.stdout).trim(), "200");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(
        asks(),
        3,
        "the second request was asked and answered by the grant"
    );
    // `warden run` through the daemon tells its terminal too.
    let dir = tempdir();
    let file = support::policy(dir.path(), &policy);
    let ran_name = unique("qrun");
    let code = format!(
        "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.2:{port}/run').status)"
    );
    let mut ran = daemon
        .warden()
        .args([
            "run",
            "--name",
            &ran_name,
            "--policy",
            file.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            &code,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = stderr_lines(&mut ran);
    let mut seen = Vec::new();
    let id = announced_id(&lines, &ran_name, &mut seen);
    assert!(
        daemon
            .warden()
            .args(["approve", &ran_name, &id.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let ran = ran.wait_with_output().unwrap();
    assert_eq!(ran.status.code(), Some(0), "{seen:?}");
    assert_eq!(String::from_utf8_lossy(&ran.stdout).trim(), "200");
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(
        journal
            .lines()
            .any(|l| l.contains("\"approval.answer\"") && l.contains("grant:")),
        "the grant answered the second request"
    );
}

#[test]
fn a_replaced_policy_changes_the_command_rules_and_nothing_fixed() {
    if !cgroups_available("daemon_policy_commands") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let made =
        "version: 1\nlimits:\n  memory: 256MiB\n  pids: 64\ncommands:\n  deny: [\"rm -rf *\"]\n";
    let cell = daemon.create(&unique("cmdswap"), json!({ "policy": made }));
    let exec_status = |d: &Daemon, argv: &[&str]| {
        d.call(
            "POST",
            &format!("/v1/cells/{cell}/exec"),
            Some(json!({ "argv": argv })),
        )
        .status
    };
    // A replacement, answered with its status (the body shown when it is not the one expected).
    let put = |d: &Daemon, policy: &str, expected: u16| {
        let answer = d.call(
            "PUT",
            &format!("/v1/cells/{cell}/policy"),
            Some(json!({ "policy": policy })),
        );
        assert_eq!(
            answer.status,
            expected,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        answer
    };
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/x"]), 200);
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 403);

    // Only the command rules: in force for the very next exec.
    let commands = "version: 1\ncommands:\n  deny: [\"touch *\"]\n";
    put(&daemon, commands, 200);
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/y"]), 403);
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 200);

    // A section fixed when the cell was made may be repeated as it is, not changed: the
    // refusal names it, and nothing of the document takes effect.
    let same_limits =
        "version: 1\nlimits:\n  memory: 256MiB\n  pids: 64\ncommands:\n  deny: [\"touch *\"]\n";
    put(&daemon, same_limits, 200);
    let changing =
        "version: 1\nlimits:\n  memory: 2GiB\nprocess:\n  user: 0\ncommands:\n  default: allow\n";
    let refused = put(&daemon, changing, 409);
    let message = refused.json()["error"].as_str().unwrap().to_owned();
    assert!(
        message.contains("this policy also changes `limits`, `process`, which are fixed"),
        "{message}"
    );
    assert_eq!(
        exec_status(&daemon, &["touch", "/tmp/y"]),
        403,
        "the refused document changed nothing"
    );

    // The record: the policy as made, and the replacement in force.
    let record = daemon
        .call("GET", &format!("/v1/cells/{cell}/policy"), None)
        .json();
    assert_eq!(record["policy"], made);
    assert_eq!(record["replaced"], same_limits);

    // A daemon that starts again finds the same rules in force.
    daemon.restart();
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/y"]), 403);
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 200);

    // `warden policy set` goes through the daemon that keeps the cell, so it is journaled and
    // the daemon's own decisions follow it.
    let dir = tempdir();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, "version: 1\ncommands:\n  deny: [\"rm *\"]\n").unwrap();
    let set = Ran::from(
        daemon
            .warden()
            .args(["policy", "set", &cell, file.to_str().unwrap()])
            .output()
            .unwrap(),
    );
    assert_eq!(set.code, 0, "{set:?}");
    assert!(set.stdout.contains("network and command rules"), "{set:?}");
    assert_eq!(exec_status(&daemon, &["rm", "-rf", "/tmp/x"]), 403);
    assert_eq!(exec_status(&daemon, &["touch", "/tmp/y"]), 200);
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert_eq!(journal.matches("\"kind\":\"policy.replaced\"").count(), 3);
    assert_eq!(journal.matches("\"kind\":\"policy.refused\"").count(), 1);
    let replay = Ran::from(daemon.warden().args(["replay", &cell]).output().unwrap());
    assert!(
        replay
            .stdout
            .contains("network and command rules replaced, 0 open connection(s) closed")
            && replay
                .stdout
                .contains("this policy also changes `limits`, `process`"),
        "{replay:?}"
    );
    daemon.assert_journal_verifies();
}

#[test]
fn a_cell_made_with_a_gateway_and_no_rules_can_be_given_network_later() {
    if !cgroups_available("daemon_network_later") {
        return;
    }
    let (port, hits) = upstream();
    let daemon = Daemon::start(&[]);
    // Without a gateway a cell has none for life, and says how to ask for one.
    let without = daemon.create(&unique("nonet"), json!({ "preset": "default" }));
    let refused = daemon.call(
        "PUT",
        &format!("/v1/cells/{without}/policy"),
        Some(json!({ "policy": "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n" })),
    );
    assert_eq!(
        refused.status,
        409,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    assert!(String::from_utf8_lossy(&refused.body).contains("gateway: true"));
    let cell = daemon.create(
        &unique("netlater"),
        json!({ "policy": "version: 1\nnetwork:\n  gateway: true\n" }),
    );
    let fetch = || {
        let code = format!(
            "import urllib.request, urllib.error\n\
             try:\n    print(urllib.request.urlopen('http://127.0.0.2:{port}/', timeout=10).status)\n\
             except urllib.error.HTTPError as e:\n    print(e.code)\n\
             except OSError as e:\n    print('unreachable')"
        );
        let events = daemon.exec(&cell, json!({ "argv": ["python3", "-c", code] }));
        String::from_utf8(stream_bytes(&events, "stdout"))
            .unwrap()
            .trim()
            .to_owned()
    };
    // Nothing gets out, and what was tried is on record.
    assert_eq!(fetch(), "403");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    // A replacement of its network rules lets the host out, from the next connection on.
    let answer = daemon.call(
        "PUT",
        &format!("/v1/cells/{cell}/policy"),
        Some(json!({ "policy": format!("version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n") })),
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(fetch(), "200");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    // And taken away again.
    let answer = daemon.call(
        "PUT",
        &format!("/v1/cells/{cell}/policy"),
        Some(json!({ "policy": "version: 1\n" })),
    );
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_eq!(fetch(), "403");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[test]
fn each_gateway_decision_is_journaled_once_across_restarts() {
    if !cgroups_available("daemon_decisions_once") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let upstream = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = upstream.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in upstream.incoming().flatten() {
            use std::io::Write as _;
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
        }
    });
    let policy =
        format!("version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n");
    let cell = daemon.create(&unique("once"), json!({ "policy": policy }));
    let journaled = |daemon: &Daemon| {
        std::fs::read_to_string(daemon.journal())
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["kind"] == "net.decision" && e["cell"] == cell.as_str())
            .count()
    };
    let wait_for = |daemon: &Daemon, count: usize| {
        for _ in 0..200 {
            if journaled(daemon) >= count {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        journaled(daemon)
    };
    // Distinct requests, each a decision of its own.
    let request = |daemon: &Daemon, path: &str| {
        let script = format!(
            "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.2:{port}/{path}').read())"
        );
        daemon.exec(&cell, json!({ "argv": ["python3", "-c", script] }));
    };
    request(&daemon, "one");
    request(&daemon, "two");
    assert_eq!(wait_for(&daemon, 2), 2);
    // Restart twice (a crash, then a clean stop): nothing is journaled a second time, and what
    // comes after is journaled once.
    daemon.restart();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        journaled(&daemon),
        2,
        "decisions were journaled again after a crash"
    );
    request(&daemon, "three");
    assert_eq!(wait_for(&daemon, 3), 3);
    daemon.restart();
    std::thread::sleep(Duration::from_millis(500));
    request(&daemon, "four");
    assert_eq!(wait_for(&daemon, 4), 4);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(journaled(&daemon), 4, "a decision was journaled twice");
}

/// A command held for a person's answer comes from the cell's caller (an agent, through MCP or
/// the API): its question shows where each argument ends, and nothing in it that would reorder
/// or hide text where a person reads it (the dashboard puts it in the page as text, where a
/// bidirectional override reverses what follows it and line breaks push the rest away).
#[test]
fn a_command_question_shows_each_argument_and_nothing_that_hides_or_reorders_text() {
    if !cgroups_available("daemon_exec_ask_shown") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let policy = "version: 1\ncommands:\n  ask: [\"echo*\"]\napprovals:\n  timeout: 20s\n";
    let cell = daemon.create(&unique("cmdshown"), json!({ "policy": policy }));
    let held = {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/exec"),
                Some(json!({ "argv": ["echo", "-rf /", "it's", "ok\u{202e}exe.txt\n\n\u{1b}[2K\u{200b}"] })),
            )
        })
    };
    let mut asked = None;
    for _ in 0..250 {
        let list = daemon.call("GET", "/v1/approvals", None).json();
        if let Some(q) = list.as_array().unwrap().iter().find(|q| q["cell"] == cell) {
            asked = Some(q.clone());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let asked = asked.expect("the command is held for a person");
    let request = asked["request"].as_str().unwrap();
    assert_eq!(
        request,
        r"exec echo '-rf /' 'it'\''s' 'ok\u{202e}exe.txt\u{a}\u{a}\u{1b}[2K\u{200b}'",
    );
    let journal = daemon.call("GET", "/v1/journal", None).text();
    assert!(!journal.contains('\u{202e}'), "{journal}");
    let answered = daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{}", asked["id"]),
        Some(json!({ "decision": "deny" })),
    );
    assert_eq!(answered.status, 204);
    assert_eq!(held.join().unwrap().status, 403);
}

/// A question a standing grant answers is still asked, and told as a line (up to ~2.2 KiB) on
/// the keeper's stderr, which is the cell's `keeper.log` on the host's disk: a cell that asked
/// 1,600 times in 15 s wrote 3.3 MB there, and went on for as long as it ran. The lines stop at
/// 1 MiB, with one that says so; the questions are still answered. Their journal entries (an
/// ask and an answer, each with the request) count against `limits.records`, as the egress
/// record does: past it, each is answered with no entry of its own, and counted (10.6 MB of
/// journal for 1,600 such requests before).
#[test]
fn questions_a_cell_asks_in_bulk_fill_its_keeper_log_only_so_far() {
    if !cgroups_available("daemon_questions_log") {
        return;
    }
    let (port, _) = upstream();
    let daemon = Daemon::start(&[]);
    let policy = format!(
        "version: 1\nnetwork:\n  ask:\n    - host: 127.0.0.2\n      ports: [{port}]\napprovals:\n  timeout: 30s\nlimits:\n  records: 256KiB\n"
    );
    let cell = daemon.create(&unique("qlog"), json!({ "policy": policy }));
    // The first question, answered for the cell's life: the rest are answered by the grant.
    let code =
        format!("import urllib.request\nurllib.request.urlopen('http://127.0.0.2:{port}/first')");
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["python3", "-c", code], "background": true })),
    );
    assert_eq!(started.status, 201, "{}", started.text());
    let mut id = None;
    for _ in 0..400 {
        let open = daemon.call("GET", "/v1/approvals", None).json();
        id = open
            .as_array()
            .unwrap()
            .first()
            .map(|q| q["id"].as_u64().unwrap());
        if id.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let id = id.expect("the first question");
    let answered = daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{id}"),
        Some(json!({ "decision": "approve", "scope": "cell" })),
    );
    assert!(answered.status < 300, "{}", answered.text());
    // 640 questions of ~2.1 KiB each (the path is most of it): 1.3 MiB of lines unbounded.
    let flood = format!(
        "import urllib.request, threading\n\
         ok = []\n\
         def ask(t):\n    for i in range(20):\n        \
         ok.append(urllib.request.urlopen('http://127.0.0.2:{port}/%s%d_%d' % ('a' * 1900, t, i)).status)\n\
         threads = [threading.Thread(target=ask, args=(t,)) for t in range(32)]\n\
         [t.start() for t in threads]\n[t.join() for t in threads]\n\
         print(ok.count(200))"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["python3", "-c", flood] }));
    let out = String::from_utf8_lossy(&stream_bytes(&events, "stdout")).into_owned();
    assert_eq!(
        out.trim(),
        "640",
        "every question answered by the grant: {events:?}"
    );

    let log = daemon
        .state()
        .join("daemon")
        .join("cells")
        .join(&cell)
        .join("keeper.log");
    let told = std::fs::read_to_string(&log).unwrap();
    eprintln!("keeper.log: {} bytes", told.len());
    assert!(
        told.len() < (1 << 20) + 4096,
        "{} bytes of questions in {}",
        told.len(),
        log.display()
    );
    assert!(
        told.contains("no more are told here"),
        "{}",
        &told[told.len().saturating_sub(400)..]
    );

    let entries = daemon.entries_of(&cell);
    let asked = entries
        .iter()
        .filter(|e| e["kind"] == "approval.ask")
        .count();
    let counted: Vec<u64> = entries
        .iter()
        .filter(|e| e["kind"] == "approval.unrecorded")
        .map(|e| e["data"]["count"].as_u64().unwrap())
        .collect();
    // 256 KiB holds about 55 questions of ~2.1 KiB (an ask and an answer each).
    assert!(
        (2..100).contains(&asked),
        "{asked} questions journaled one by one"
    );
    let past = 640 + 1 - asked as u64;
    assert_eq!(
        counted.last().copied(),
        Some(1 << past.ilog2()),
        "the count of those past the bound: {counted:?}"
    );
}

/// A standing grant of a command covers that command, argument by argument: the same words
/// split otherwise (`sh -c 'echo granted'` against `sh -c echo granted`, which joined by blanks
/// read alike) are another command, asked about again; the granted one runs unasked.
#[test]
fn a_commands_grant_covers_its_arguments_as_they_were_split() {
    if !cgroups_available("daemon_grant_split") {
        return;
    }
    let daemon = std::sync::Arc::new(Daemon::start(&[]));
    let policy = "version: 1\ncommands:\n  ask: [\"sh *\"]\napprovals:\n  timeout: 30s\n";
    let cell = daemon.create(&unique("grantsplit"), json!({ "policy": policy }));
    let exec = |argv: Value| {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || daemon.exec(&cell, json!({ "argv": argv })))
    };
    let question = || {
        for _ in 0..250 {
            let list = daemon.call("GET", "/v1/approvals", None).json();
            if let Some(q) = list.as_array().unwrap().iter().find(|q| q["cell"] == cell) {
                return Some(q.clone());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    };
    let granted = json!(["sh", "-c", "echo granted"]);
    let first = exec(granted.clone());
    let asked = question().expect("the first command is held for a person");
    let answered = daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{}", asked["id"]),
        Some(json!({ "decision": "approve", "scope": "cell" })),
    );
    assert!(answered.status < 300, "{}", answered.text());
    let events = first.join().unwrap();
    assert_eq!(stream_bytes(&events, "stdout"), b"granted\n", "{events:?}");

    // The same words, split otherwise: asked about again, not covered by the grant.
    let split = {
        let daemon = std::sync::Arc::clone(&daemon);
        let cell = cell.clone();
        std::thread::spawn(move || {
            daemon.call(
                "POST",
                &format!("/v1/cells/{cell}/exec"),
                Some(json!({ "argv": ["sh", "-c", "echo", "granted"] })),
            )
        })
    };
    let asked = question().expect("a command split otherwise is held for a person again");
    assert_eq!(asked["request"], "exec sh -c echo granted");
    let answered = daemon.call(
        "POST",
        &format!("/v1/approvals/{cell}/{}", asked["id"]),
        Some(json!({ "decision": "deny" })),
    );
    assert_eq!(answered.status, 204);
    assert_eq!(split.join().unwrap().status, 403);

    // The granted command itself runs unasked.
    let again = exec(granted);
    let events = again.join().unwrap();
    assert_eq!(stream_bytes(&events, "stdout"), b"granted\n", "{events:?}");
}
