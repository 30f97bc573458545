//! The CLI with a daemon: `warden create`, `exec`, `cp`, `logs`, `rm`, `run` through it, and
//! runs without one leaving the same journal.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::daemon::*;
use support::*;

#[test]
fn cli_create_exec_and_the_exit_status() {
    if !cgroups_available("cli_create_exec") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let name = unique("cli");
    let out = daemon.warden().args(["create", &name]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = daemon
        .warden()
        .args([
            "exec",
            &name,
            "--",
            "sh",
            "-c",
            "echo hi; echo there >&2; exit 4",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.stderr, b"there\n");
    let out = daemon
        .warden()
        .args(["exec", &name, "--", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    // -i passes stdin as it comes.
    let mut child = daemon
        .warden()
        .args([
            "exec",
            "-i",
            &name,
            "--",
            "sh",
            "-c",
            "read a; echo first:$a; read b; echo second:$b",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"one\n").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        stdin.write_all(b"two\n").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "first:one\nsecond:two\n"
    );
    // -t gives the process a terminal of the cell, sized like the client's (the size is set
    // before the client starts: one set while it starts races its first look).
    let script = format!(
        "import os, pty, struct, fcntl, termios, sys\n\
         pid, fd = pty.fork()\n\
         if pid == 0:\n    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack('HHHH', 33, 99, 0, 0))\n    os.execv({BIN:?}, ['warden', 'exec', '-t', {name:?}, '--', 'sh', '-c', 'tty; stty size'])\n\
         out = b''\n\
         while True:\n    try:\n        chunk = os.read(fd, 4096)\n    except OSError:\n        break\n    if not chunk:\n        break\n    out += chunk\n\
         _, status = os.waitpid(pid, 0)\n\
         sys.stdout.write(out.decode(errors='replace'))\n\
         sys.stdout.write('status=%d' % os.waitstatus_to_exitcode(status))"
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .env("WARDEN_RUNTIME_DIR", &daemon.runtime)
        .env("WARDEN_STATE_DIR", &daemon.state)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("/dev/pts/") && text.contains("33 99") && text.contains("status=0"),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // `warden logs`: what the processes printed, without waiting for running ones.
    let bg = daemon.call(
        "POST",
        &format!("/v1/cells/{name}/exec"),
        Some(json!({ "argv": ["sh", "-c", "echo still-running; sleep 30"], "background": true })),
    );
    assert_eq!(bg.status, 201);
    std::thread::sleep(Duration::from_millis(300));
    let logs = daemon.warden().args(["logs", &name]).output().unwrap();
    assert!(
        logs.status.success(),
        "{}",
        String::from_utf8_lossy(&logs.stderr)
    );
    let text = String::from_utf8_lossy(&logs.stdout);
    assert!(
        text.contains("hi\n") && text.contains("still-running\n"),
        "{text}"
    );
    // `warden kill` goes through the daemon, so the journal has it.
    let out = daemon.warden().args(["kill", &name]).output().unwrap();
    assert!(out.status.success());
    let replay = daemon.warden().args(["replay", &name]).output().unwrap();
    let text = String::from_utf8_lossy(&replay.stdout);
    assert!(
        text.contains("cell.kill") && text.contains("exec.exit"),
        "{text}"
    );
    let out = daemon
        .warden()
        .args(["exec", &name, "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ended"));
}

#[test]
fn warden_run_goes_through_a_running_daemon_with_the_same_behaviour() {
    if !cgroups_available("daemon_run") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let dir = tempdir();
    let run = |extra: &[&str], input: Option<&str>| {
        let mut cmd = daemon.warden();
        cmd.arg("run").args(extra);
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if input.is_some() {
            cmd.stdin(std::process::Stdio::piped());
        }
        let mut child = cmd.spawn().unwrap();
        if let Some(text) = input {
            use std::io::Write as _;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
        }
        Ran::from(child.wait_with_output().unwrap())
    };
    let ran = run(&["--", "sh", "-c", "echo out; echo err >&2; exit 3"], None);
    assert_eq!(
        (ran.code, ran.stdout.as_str(), ran.stderr.as_str()),
        (3, "out\n", "err\n"),
        "{ran:?}"
    );
    let ran = run(&["--", "tr", "a-z", "A-Z"], Some("through the daemon\n"));
    assert_eq!(ran.stdout, "THROUGH THE DAEMON\n", "{ran:?}");
    let ran = run(&["--", "no-such-command"], None);
    assert_eq!(ran.code, 127, "{ran:?}");
    assert!(ran.stderr.contains("command not found"), "{ran:?}");

    // Ctrl-C reaches the command, not the client.
    let mut child = daemon
        .warden()
        .args([
            "run",
            "--",
            "sh",
            "-c",
            "trap 'echo got-int; exit 9' INT; echo ready; sleep 30 & wait",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line, "ready\n");
    std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert_eq!(rest, "got-int\n");
    assert_eq!(child.wait().unwrap().code(), Some(9));

    // The limits end the command with the same statuses and messages.
    let limits = policy(
        dir.path(),
        "version: 1\nlimits:\n  wall: 1s\n  output: 1KiB\n  memory: 64MiB\n",
    );
    let limits = limits.to_str().unwrap();
    let ran = run(&["--policy", limits, "--", "sleep", "30"], None);
    assert_eq!(ran.code, 124, "{ran:?}");
    assert!(
        ran.stderr.contains("wall-clock limit 1s exceeded: killed"),
        "{ran:?}"
    );
    let ran = run(
        &[
            "--policy",
            limits,
            "--",
            "sh",
            "-c",
            "while true; do echo xxxxxxxxxxxxxxxx; done",
        ],
        None,
    );
    assert_eq!(ran.code, 252, "{ran:?}");
    let ran = run(
        &[
            "--policy",
            limits,
            "--",
            "python3",
            "-c",
            "x = []\nwhile True: x.append(bytearray(8 << 20))",
        ],
        None,
    );
    assert_eq!(ran.code, 251, "{ran:?}");
    assert!(
        ran.stderr.contains("memory limit 64 MiB exceeded: killed"),
        "{ran:?}"
    );

    // Workspace changes wait for review, as with an in-process run.
    let host = tempdir();
    let name = unique("viad");
    let ran = run(
        &[
            "--name",
            &name,
            "-w",
            host.path().to_str().unwrap(),
            "--",
            "sh",
            "-c",
            "echo new > /workspace/f",
        ],
        None,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(
        ran.stderr.contains(&format!("warden diff {name}")),
        "{ran:?}"
    );
    assert!(!host.path().join("f").exists());
    let diff = daemon
        .warden()
        .args(["diff", &name, "--stat"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&diff.stdout).contains("A f"));
    // The runs are in the daemon's journal; the cells without changes are gone from its list.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(journal.contains(r#""argv":["tr","a-z","A-Z"]"#));
    let cells = daemon.call("GET", "/v1/cells", None).json();
    let names: Vec<&str> = cells
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [name.as_str()],
        "only the cell with changes to review is kept"
    );
    let rm = daemon.warden().args(["rm", &name]).output().unwrap();
    assert!(rm.status.success());
    assert_eq!(daemon.call("GET", "/v1/cells", None).json(), json!([]));
}

#[test]
fn copies_removals_logs_events_signals_and_refusals_say_what_they_mean() {
    if !cgroups_available("daemon_small_things") {
        return;
    }
    let (port, _) = upstream();
    let daemon = Daemon::start(&[]);
    let policy = format!(
        "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      methods: [GET]\n      paths: [\"/api/**\"]\n"
    );
    let cell = daemon.create(&unique("small"), json!({ "policy": policy }));
    let cli = |args: &[&str]| daemon.warden().args(args).output().unwrap();
    let sh = |script: &str| {
        let events = daemon.exec(&cell, json!({ "argv": ["sh", "-c", script] }));
        String::from_utf8(stream_bytes(&events, "stdout")).unwrap()
    };
    let dir = tempdir();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "hello\n").unwrap();
    let file = file.to_str().unwrap();

    // cp into a directory of the cell, named with a slash or existing, keeps the file's name.
    sh("mkdir -p /workspace/inbox");
    assert!(cli(&["cp", file, &format!("{cell}:new/")]).status.success());
    assert!(
        cli(&["cp", file, &format!("{cell}:inbox")])
            .status
            .success()
    );
    assert_eq!(
        sh("cat /workspace/new/notes.txt /workspace/inbox/notes.txt"),
        "hello\nhello\n"
    );
    // A missing host file is named, with the reason.
    let missing = cli(&["cp", "./no-such-file", &format!("{cell}:x")]);
    assert_eq!(missing.status.code(), Some(125));
    let words = String::from_utf8_lossy(&missing.stderr);
    assert!(
        words.contains("no-such-file") && words.contains("No such file"),
        "{words}"
    );

    // A 403 for a wrong method on an allowed host names the rule and what it needs.
    let post = format!(
        "import urllib.request, urllib.error\n\
         try:\n    urllib.request.urlopen(urllib.request.Request('http://127.0.0.2:{port}/api/x', data=b'1'))\n\
         except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())"
    );
    let events = daemon.exec(&cell, json!({ "argv": ["python3", "-c", post] }));
    let refusal = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(refusal.starts_with("403"), "{refusal}");
    assert!(
        refusal.contains("covers the host")
            && refusal.contains("only GET")
            && refusal.contains("/api/**"),
        "{refusal}"
    );

    // A command that is not found ends with 127 and never says it started.
    let events = daemon.exec(&cell, json!({ "argv": ["no-such-program"] }));
    assert!(!events.iter().any(|(e, _)| e == "started"), "{events:?}");
    assert_eq!(exit_of(&events)["code"], 127);

    // Signals by name.
    let started = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/exec"),
        Some(json!({ "argv": ["sleep", "30"], "background": true })),
    );
    let id = started.json()["id"].as_u64().unwrap();
    for bad in [json!("SIGNOPE"), json!(0), json!(99), json!("")] {
        let answer = daemon.call(
            "POST",
            &format!("/v1/cells/{cell}/processes/{id}/signal"),
            Some(json!({ "signal": bad })),
        );
        assert_eq!(
            answer.status,
            400,
            "{bad}: {}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    let sent = daemon.call(
        "POST",
        &format!("/v1/cells/{cell}/processes/{id}/signal"),
        Some(json!({ "signal": "term" })),
    );
    assert!(sent.status < 300, "{}", String::from_utf8_lossy(&sent.body));
    let waited = daemon.call(
        "GET",
        &format!("/v1/cells/{cell}/processes/{id}/wait"),
        None,
    );
    assert_eq!(
        waited.json()["signal"],
        15,
        "{}",
        String::from_utf8_lossy(&waited.body)
    );

    // The events stream resumes after a cursor: exactly what came after it.
    let journal: Vec<Value> = std::fs::read_to_string(daemon.journal())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mine: Vec<&Value> = journal
        .iter()
        .filter(|e| e["cell"] == cell.as_str())
        .collect();
    let cursor = mine[mine.len() / 2]["seq"].as_u64().unwrap();
    let expected: Vec<u64> = mine
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .filter(|s| *s > cursor)
        .collect();
    let resumed = |request: String| -> Vec<u64> {
        use std::io::{Read as _, Write as _};
        let mut stream = std::os::unix::net::UnixStream::connect(daemon.socket()).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(1500)))
            .unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 8192];
        while let Ok(n) = stream.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        seen.lines()
            .filter_map(|l| l.strip_prefix("id: "))
            .map(|id| id.trim().parse().unwrap())
            .collect()
    };
    // What was journaled before the cursor never comes again; what came after comes in order
    // (entries journaled since the read above may follow).
    for request in [
        format!("GET /v1/events?cell={cell}&after={cursor} HTTP/1.1\r\nHost: w\r\n\r\n"),
        format!(
            "GET /v1/events?cell={cell} HTTP/1.1\r\nHost: w\r\nLast-Event-ID: {cursor}\r\n\r\n"
        ),
    ] {
        let got = resumed(request);
        assert!(got.len() >= expected.len(), "{got:?} {expected:?}");
        assert_eq!(got[..expected.len()], expected[..]);
        assert!(got.windows(2).all(|w| w[0] < w[1]), "{got:?}");
    }

    // `logs -f` with nothing running waits, shows a process started later, and ends with the cell.
    let mut follow = daemon
        .warden()
        .args(["logs", "-f", &cell])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        follow.try_wait().unwrap().is_none(),
        "logs -f returned with the cell running"
    );
    sh("echo came-later");

    // `rm` of a running cell is refused without --force; nothing is lost by the refusal.
    let refused = cli(&["rm", &cell]);
    assert_ne!(refused.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"));
    assert_eq!(sh("cat /workspace/new/notes.txt"), "hello\n");
    std::thread::sleep(Duration::from_millis(700));
    let forced = cli(&["rm", "--force", &cell]);
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
    assert_eq!(
        daemon
            .call("GET", &format!("/v1/cells/{cell}"), None)
            .status,
        404
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while follow.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let followed = follow.wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&followed.stdout).contains("came-later"));
}

/// A directory copied out of a cell lands with the caller's umask taken off each mode, as `cp -r`
/// gives: what the cell made 777 and 666 had landed writable by every user of the host.
#[test]
fn a_directory_copied_out_of_a_cell_takes_the_callers_umask() {
    use std::os::unix::fs::PermissionsExt as _;
    if !cgroups_available("daemon_cp_modes") {
        return;
    }
    let daemon = Daemon::start(&[]);
    let cell = daemon.create(&unique("cpmodes"), json!({}));
    let made = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "mkdir -p /workspace/o/pub && chmod 777 /workspace/o/pub \
            && echo x > /workspace/o/pub/f && chmod 666 /workspace/o/pub/f"] }),
    );
    assert_eq!(exit_of(&made)["code"], 0, "{made:?}");
    let dir = tempdir();
    let out = dir.path().join("out");
    let copied = daemon
        .warden()
        .args(["cp", &format!("{cell}:o"), out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(copied.status.success(), "{copied:?}");
    // The umask the command inherited: this process's.
    let umask = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .map(|m| u32::from_str_radix(m.trim(), 8).unwrap())
        .unwrap();
    let mode = |path: &str| {
        std::fs::metadata(out.join(path))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode("pub"), 0o777 & !umask);
    assert_eq!(mode("pub/f"), 0o666 & !umask);
    assert_eq!(std::fs::read_to_string(out.join("pub/f")).unwrap(), "x\n");
    let rm = daemon
        .warden()
        .args(["rm", "--force", &cell])
        .output()
        .unwrap();
    assert!(rm.status.success(), "{rm:?}");
}

#[test]
fn credentials_come_from_the_callers_environment_through_the_daemon_too() {
    if !cgroups_available("daemon_callers_secrets") {
        return;
    }
    use std::io::{Read as _, Write as _};
    // An upstream that says whether it got the caller's secret (it may not echo it: the
    // gateway scrubs a secret out of what comes back).
    let secret = format!("callers-{}-token", std::process::id());
    let expected = format!("Bearer {secret}");
    let listener = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = vec![0u8; 8192];
            let n = conn.read(&mut buf).unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]).to_string();
            let got = head.lines().any(|l| {
                l.split_once(':').is_some_and(|(k, v)| {
                    k.eq_ignore_ascii_case("authorization") && v.trim() == expected
                })
            });
            let answer = if got { "got it" } else { "not it" };
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    // The daemon's environment has no such variable; the caller's has.
    let daemon = Daemon::start(&[]);
    let dir = tempdir();
    let file = support::policy(
        dir.path(),
        &format!(
            "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [{port}]\n      credential: api\n\
             credentials:\n  api: {{ from_env: WARDEN_TEST_CALLERS_TOKEN, format: \"Bearer {{}}\" }}\n"
        ),
    );
    let code = format!(
        "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.2:{port}/').read().decode())"
    );
    let ran = daemon
        .warden()
        .env("WARDEN_TEST_CALLERS_TOKEN", &secret)
        .args([
            "run",
            "--rm",
            "--policy",
            file.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            &code,
        ])
        .output()
        .unwrap();
    assert_eq!(
        ran.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&ran.stdout).trim(), "got it");
    // `warden create` the same; without the variable, the caller is told before anything starts.
    let made = daemon
        .warden()
        .env("WARDEN_TEST_CALLERS_TOKEN", &secret)
        .args(["create", &unique("sec"), "--policy", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let missing = daemon
        .warden()
        .args([
            "create",
            &unique("nosec"),
            "--policy",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(125));
    assert!(
        String::from_utf8_lossy(&missing.stderr)
            .contains("the caller's environment has no WARDEN_TEST_CALLERS_TOKEN")
    );
    // A secret the policy does not read is refused.
    let extra = daemon.call(
        "POST",
        "/v1/cells",
        Some(json!({ "name": unique("extra"), "secrets": { "HOME": "x" } })),
    );
    assert_eq!(
        extra.status,
        400,
        "{}",
        String::from_utf8_lossy(&extra.body)
    );
    // And the journal never holds it.
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(!journal.contains(&secret), "the secret is in the journal");
}

#[test]
fn credential_secrets_never_reach_the_journal() {
    if !cgroups_available("daemon_redaction") {
        return;
    }
    let secret = format!("s3cr3t-{}-value", std::process::id());
    let daemon = Daemon::start_with(&[], &[("WARDEN_TEST_JOURNAL_TOKEN", secret.as_str())]);
    let policy = "version: 1\nnetwork:\n  allow:\n    - host: 127.0.0.2\n      ports: [9]\n      credential: api\ncredentials:\n  api: { from_env: WARDEN_TEST_JOURNAL_TOKEN }\n";
    let cell = daemon.create(&unique("redact"), json!({ "policy": policy }));
    // The cell sees a placeholder, not the secret.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["sh", "-c", "printf %s \"$WARDEN_TEST_JOURNAL_TOKEN\""] }),
    );
    let seen = String::from_utf8(stream_bytes(&events, "stdout")).unwrap();
    assert!(
        !seen.is_empty() && seen != secret,
        "the cell has a placeholder: {seen}"
    );
    // A client that passes the secret itself (in argv, so in the output too) is answered, but
    // the journal never holds it.
    let events = daemon.exec(
        &cell,
        json!({ "argv": ["echo", format!("token={secret}")] }),
    );
    assert_eq!(
        stream_bytes(&events, "stdout"),
        format!("token={secret}\n").as_bytes()
    );
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    assert!(!journal.contains(&secret), "the secret is in the journal");
    assert!(journal.contains("token=[redacted]"));
    daemon.assert_journal_verifies();
}

/// One path: `warden run` without a daemon goes through the same harness (an ephemeral one in
/// the CLI's process) as with one, so the same commands leave the same result and the same
/// kinds of journal entries, command rules included, in the one journal both append to. The
/// only differences are how the daemon carries a run (it starts the cell before it is given
/// the command, relays stdin, and kills the cell after): `cell.start`, `exec.stdin` and
/// `cell.kill`.
#[test]
fn a_run_leaves_the_same_journal_and_result_with_and_without_a_daemon() {
    if !cgroups_available("one_path") {
        return;
    }
    let mut daemon = Daemon::start(&[]);
    let dir = tempdir();
    let policy = support::policy(
        dir.path(),
        "version: 1\ncommands:\n  deny: ['rm *']\n  ask: ['curl *']\n",
    );
    let policy = policy.to_str().unwrap();
    let runs: [(&str, &[&str]); 4] = [
        ("exits", &["sh", "-c", "echo out; echo err >&2; exit 4"]),
        ("denied", &["rm", "-rf", "/tmp/x"]),
        ("missing", &["no-such-command"]),
        ("killed", &["sh", "-c", "kill -9 $$"]),
    ];
    let run_all = |daemon: &Daemon, suffix: &str| -> Vec<(String, Ran)> {
        runs.iter()
            .map(|(name, argv)| {
                let name = format!("{name}-{suffix}-{}", std::process::id());
                let out = daemon
                    .warden()
                    .args(["run", "--policy", policy, "--name", &name, "--"])
                    .args(*argv)
                    .output()
                    .unwrap();
                (name, Ran::from(out))
            })
            .collect()
    };
    let through = run_all(&daemon, "daemon");
    daemon.crash();
    let without = run_all(&daemon, "alone");
    // An asked command has nobody to answer it without a daemon: refused, and said so.
    let asked = daemon
        .warden()
        .args(["run", "--policy", policy, "--", "curl", "--version"])
        .output()
        .unwrap();
    let asked = Ran::from(asked);
    assert_eq!(asked.code, 250, "{asked:?}");
    assert!(
        asked.stderr.contains("without a daemon nobody can answer"),
        "{asked:?}"
    );

    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    let entries: Vec<Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds_of = |cell: &str| -> Vec<String> {
        entries
            .iter()
            .filter(|e| e["cell"] == cell)
            .map(|e| e["kind"].as_str().unwrap().to_owned())
            .filter(|k| !["cell.start", "exec.stdin", "cell.kill"].contains(&k.as_str()))
            .collect()
    };
    for ((a_name, a), (b_name, b)) in through.iter().zip(&without) {
        assert_eq!(
            (a.code, &a.stdout, &a.stderr.replace(a_name, "NAME")),
            (b.code, &b.stdout, &b.stderr.replace(b_name, "NAME")),
            "the same result:\n{a:?}\n{b:?}"
        );
        let (a_kinds, b_kinds) = (kinds_of(a_name), kinds_of(b_name));
        assert!(!a_kinds.is_empty(), "{a_name} is journaled");
        assert_eq!(
            a_kinds, b_kinds,
            "the same entries for {a_name} and {b_name}"
        );
        let exit_of = |cell: &str| {
            entries
                .iter()
                .find(|e| e["cell"] == cell && e["kind"] == "exec.exit")
                .map(|e| (e["data"]["reason"].clone(), e["data"]["code"].clone()))
        };
        assert_eq!(exit_of(a_name), exit_of(b_name), "{a_name}");
    }
    let codes: Vec<i32> = without.iter().map(|(_, r)| r.code).collect();
    assert_eq!(codes, [4, 250, 127, 137], "{without:?}");
    let denied = entries
        .iter()
        .find(|e| e["cell"] == without[1].0.as_str() && e["kind"] == "exec.denied")
        .expect("the refused command is journaled");
    assert_eq!(denied["data"]["rule"], "deny: rm *");
    daemon.assert_journal_verifies();
}

/// Several runs without a daemon append to one journal at once: each takes the journal's lock
/// in turn, and the chain they leave is one that verifies, with every run in it.
#[test]
fn runs_without_a_daemon_at_once_leave_one_chain() {
    let mut daemon = Daemon::start(&[]);
    daemon.crash();
    let children: Vec<_> = (0..6)
        .map(|i| {
            daemon
                .warden()
                .args(["run", "--name", &format!("many-{i}-{}", std::process::id())])
                .args(["--", "sh", "-c", &format!("exit {i}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(i as i32),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let journal = std::fs::read_to_string(daemon.journal()).unwrap();
    for i in 0..6 {
        let cell = format!("many-{i}-{}", std::process::id());
        let kinds: Vec<String> = journal
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["cell"] == cell.as_str())
            .map(|e| e["kind"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            kinds,
            [
                "cell.create",
                "exec.start",
                "exec.exit",
                "cell.end",
                "cell.delete"
            ],
            "{cell}"
        );
    }
    daemon.assert_journal_verifies();
}

/// Another user may make a runtime directory before its owner does (the default
/// `/tmp/warden-UID` where `XDG_RUNTIME_DIR` is unset) and serve a socket of its own there: the
/// CLI then sent that process what it sends a daemon, a cell's environment and secrets
/// included. A client talks only to a socket served by its own user or root (the kernel's word,
/// `SO_PEERCRED`), and `warden serve` says whose socket it found.
#[test]
fn the_cli_sends_nothing_to_a_socket_another_user_serves() {
    use std::os::unix::fs::PermissionsExt as _;
    let have = |p: &str| std::path::Path::new(p).is_file();
    if !is_root() || !have("/usr/bin/setpriv") || !have("/usr/bin/python3") {
        eprintln!("skipped: needs root, setpriv and python3 to serve a socket as another user");
        return;
    }
    let dir = tempdir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    // The owner's runtime directory, left open to every user (one another user made is
    // refused before any socket is tried: `a_runtime_directory_another_user_made_is_refused`).
    let runtime = dir.path().join("run");
    std::fs::create_dir(&runtime).unwrap();
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o777)).unwrap();
    let socket = runtime.join("daemon.sock");
    let ear = dir.path().join("ear");
    std::fs::create_dir(&ear).unwrap();
    std::fs::set_permissions(&ear, std::fs::Permissions::from_mode(0o777)).unwrap();
    let heard = ear.join("heard");
    // A stranger's "daemon": it keeps what it is sent and answers every request with a cell.
    let code = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)
body = b'{"name":"x","state":"running","pid":1,"created_ms":0,"workspace":null,"labels":{},"ended":null,"processes":0,"tier":"process","preset":"default"}'
while True:
    c, _ = s.accept()
    try:
        data = c.recv(65536)
        if data:
            open(sys.argv[2], 'ab').write(data)
            c.sendall(b'HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n' % len(body) + body)
    except Exception:
        pass
    c.close()
"#;
    let mut stranger = std::process::Command::new("/usr/bin/setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .args(["/usr/bin/python3", "-c", code])
        .arg(&socket)
        .arg(&heard)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !socket.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let warden = |args: &[&str]| {
        std::process::Command::new(bin())
            .env("WARDEN_RUNTIME_DIR", &runtime)
            .env("WARDEN_STATE_DIR", dir.path().join("state"))
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let create = warden(&["create", "secretive", "--env", "API_KEY=s3cret-value"]);
    let serve = warden(&["serve"]);
    let _ = stranger.kill();
    let _ = stranger.wait();
    let said = String::from_utf8_lossy(&create.stderr).into_owned();
    let sent = std::fs::read_to_string(&heard).unwrap_or_default();
    assert!(
        !sent.contains("s3cret-value"),
        "the CLI sent the cell's secret to another user's socket:\n{sent}"
    );
    assert!(!create.status.success(), "{said}");
    assert!(
        said.contains("is served by uid 65534") && said.contains("WARDEN_RUNTIME_DIR"),
        "{said}"
    );
    let said = String::from_utf8_lossy(&serve.stderr);
    assert!(!serve.status.success(), "{said}");
    assert!(
        said.contains("is served by uid 65534, another user"),
        "{said}"
    );
}
