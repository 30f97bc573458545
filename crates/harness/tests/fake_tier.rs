//! The harness driven through the tier boundary's second implementation, the fake tier: create,
//! exec, pause, resume, kill, approvals and journaling, as an ordinary user, with no root and no
//! kernel isolation. What these prove is the harness's own work (what it checks, journals,
//! refuses and hands to the tier), whatever the tier.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use warden_cell::fake::FakeBackend;
use warden_harness::{
    AttachedRun, CellState, Config, ControlAction, CreateCell, ErrorKind, ExecSpec, ExitReason,
    Harness, Item, Scope, Stream,
};

struct Setup {
    dir: tempfile::TempDir,
    harness: Arc<Harness>,
    fake: Arc<FakeBackend>,
}

async fn setup() -> Setup {
    setup_as(false).await
}

async fn setup_as(ephemeral: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    let harness = Harness::open(Config {
        runtime: dir.path().join("run"),
        state: dir.path().join("state"),
        journal_segments: Default::default(),
        tiers: Arc::new(warden_cell::Tiers::only(fake.clone())),
        ephemeral,
        pools: Vec::new(),
    })
    .await
    .unwrap();
    Setup { dir, harness, fake }
}

fn create(name: &str, policy: Option<&str>) -> CreateCell {
    CreateCell {
        name: Some(name.to_owned()),
        policy: policy.map(str::to_owned),
        ..Default::default()
    }
}

fn exec(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Kinds of the journal's entries about `cell`, in order.
async fn kinds(harness: &Harness, cell: &str) -> Vec<String> {
    kinds_in(&entries(harness, cell).await)
        .into_iter()
        .map(str::to_owned)
        .collect()
}

/// The kinds of `entries`, in order.
fn kinds_in(entries: &[Value]) -> Vec<&str> {
    entries
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or_default())
        .collect()
}

async fn entries(harness: &Harness, cell: &str) -> Vec<Value> {
    harness
        .entries_after(0, Some(cell.to_owned()))
        .await
        .unwrap()
}

/// Reads a process to its end: (stdout, stderr, exit).
async fn finish(process: &warden_harness::Process) -> (String, String, warden_harness::ExitInfo) {
    let mut cursor = warden_harness::Cursor::start();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        let item = tokio::time::timeout(Duration::from_secs(20), process.next(&mut cursor))
            .await
            .expect("the process ended in time");
        match item {
            Item::Output(Stream::Stdout, data) => out.extend_from_slice(&data),
            Item::Output(Stream::Stderr, data) => err.extend_from_slice(&data),
            Item::Dropped(_) => {}
            Item::Exit(exit) => {
                return (
                    String::from_utf8_lossy(&out).into_owned(),
                    String::from_utf8_lossy(&err).into_owned(),
                    exit,
                );
            }
        }
    }
}

async fn wait_for(what: &str, mut check: impl AsyncFnMut() -> bool) {
    for _ in 0..400 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn a_cell_is_made_from_a_typed_spec_and_an_exec_is_journaled_from_start_to_end() {
    let s = setup().await;
    let info = s
        .harness
        .create(CreateCell {
            env: [("GREETING".to_owned(), "hello".to_owned())].into(),
            ..create("one", None)
        })
        .await
        .unwrap();
    assert_eq!(info.state, CellState::Running);
    let cell = s.fake.cell("one").expect("the tier was asked for the cell");
    // The tier got the resolved policy and the environment; the wall clock stays the harness's.
    assert_eq!(cell.spec().policy.limits.wall, None);
    assert_eq!(
        cell.spec().env,
        vec![("GREETING".to_owned(), "hello".to_owned())]
    );
    let process = s
        .harness
        .exec(
            "one",
            exec(&["sh", "-c", "echo \"$GREETING\"; echo oops >&2; exit 3"]),
        )
        .await
        .unwrap();
    let (out, err, exit) = finish(&process).await;
    assert_eq!((out.as_str(), err.as_str()), ("hello\n", "oops\n"));
    assert_eq!((exit.reason, exit.code), (ExitReason::Exited, Some(3)));
    let journal = entries(&s.harness, "one").await;
    let kinds = kinds_in(&journal);
    assert_eq!(
        kinds,
        ["cell.create", "cell.start", "exec.start", "exec.exit"]
    );
    assert_eq!(journal[3]["data"]["code"], 3);
    assert_eq!(journal[3]["data"]["stdout"], "hello\n");
    assert_eq!(exit.journal_seq, journal[3]["seq"].as_u64());
}

#[tokio::test]
async fn a_missing_program_is_a_failed_exec_with_its_end_in_the_journal() {
    let s = setup().await;
    s.harness.create(create("two", None)).await.unwrap();
    let process = s
        .harness
        .exec("two", exec(&["/no/such/program"]))
        .await
        .unwrap();
    let (_, _, exit) = finish(&process).await;
    assert_eq!((exit.reason, exit.code), (ExitReason::Failed, Some(127)));
    assert_eq!(
        kinds(&s.harness, "two").await,
        ["cell.create", "cell.start", "exec.start", "exec.exit"]
    );
}

#[tokio::test]
async fn bad_requests_are_refused_before_the_tier_sees_them() {
    let s = setup().await;
    let bad_name = s
        .harness
        .create(create("no/slash", None))
        .await
        .unwrap_err();
    assert_eq!(bad_name.kind, ErrorKind::BadRequest, "{bad_name}");
    let bad_policy = s
        .harness
        .create(create("p", Some("version: 1\nlimits: {memory: lots}\n")))
        .await
        .unwrap_err();
    assert_eq!(bad_policy.kind, ErrorKind::BadRequest, "{bad_policy}");
    let secret = s
        .harness
        .create(CreateCell {
            secrets: [("TOKEN".to_owned(), "s3cret".to_owned())].into(),
            ..create("q", None)
        })
        .await
        .unwrap_err();
    assert!(
        secret.message.contains("not read by any credential"),
        "{secret}"
    );
    assert!(s.fake.cell("no/slash").is_none() && s.fake.cell("p").is_none());
    assert!(s.fake.cell("q").is_none());
    s.harness.create(create("r", None)).await.unwrap();
    let empty = s.harness.exec("r", exec(&[])).await.unwrap_err();
    assert_eq!(empty.kind, ErrorKind::BadRequest);
    let nul = s.harness.exec("r", exec(&["a\0b"])).await.unwrap_err();
    assert_eq!(nul.kind, ErrorKind::BadRequest);
    let twice = s.harness.create(create("r", None)).await.unwrap_err();
    assert_eq!(twice.kind, ErrorKind::Conflict, "{twice}");
    // Nothing of the refused execs reached the journal.
    assert_eq!(kinds(&s.harness, "r").await, ["cell.create", "cell.start"]);
}

#[tokio::test]
async fn a_start_the_tier_refuses_is_journaled_as_a_failure() {
    let s = setup().await;
    s.fake.refuse_start("nope", "the host has no such thing");
    let err = s.harness.create(create("nope", None)).await.unwrap_err();
    assert_eq!(err.kind, ErrorKind::BadRequest);
    assert!(err.message.contains("the host has no such thing"), "{err}");
    let journal = entries(&s.harness, "nope").await;
    assert_eq!(journal.last().unwrap()["kind"], "cell.fail");
    assert_eq!(
        journal.last().unwrap()["data"]["error"],
        "the host has no such thing"
    );
}

#[tokio::test]
async fn pause_refuses_execs_until_resume_and_kill_ends_the_cell_and_its_processes() {
    let s = setup().await;
    s.harness.create(create("three", None)).await.unwrap();
    let sleeper = s
        .harness
        .exec(
            "three",
            ExecSpec {
                background: true,
                ..exec(&["sleep", "60"])
            },
        )
        .await
        .unwrap();
    let paused = s
        .harness
        .control("three", ControlAction::Pause, "test")
        .await
        .unwrap();
    assert_eq!(paused.state, CellState::Paused);
    assert!(s.fake.cell("three").unwrap().is_paused());
    let refused = s.harness.exec("three", exec(&["true"])).await.unwrap_err();
    assert_eq!(refused.kind, ErrorKind::Conflict);
    assert!(refused.message.contains("paused"), "{refused}");
    let resumed = s
        .harness
        .control("three", ControlAction::Resume, "test")
        .await
        .unwrap();
    assert_eq!(resumed.state, CellState::Running);
    let (_, _, exit) = finish(&s.harness.exec("three", exec(&["true"])).await.unwrap()).await;
    assert_eq!(exit.code, Some(0));
    let killed = s
        .harness
        .control("three", ControlAction::Kill, "test")
        .await
        .unwrap();
    assert_eq!(killed.state, CellState::Ended);
    let (_, _, exit) = finish(&sleeper).await;
    assert_eq!(exit.signal, Some(libc::SIGKILL), "{exit:?}");
    let after = s.harness.exec("three", exec(&["true"])).await.unwrap_err();
    assert_eq!(after.kind, ErrorKind::Conflict);
    let kinds = kinds(&s.harness, "three").await;
    for kind in ["cell.pause", "cell.resume", "cell.kill", "cell.end"] {
        assert!(kinds.contains(&kind.to_owned()), "{kind} in {kinds:?}");
    }
    assert_eq!(kinds.iter().filter(|k| *k == "exec.exit").count(), 2);
    // A second kill finds nothing to kill.
    let again = s
        .harness
        .control("three", ControlAction::Kill, "test")
        .await
        .unwrap_err();
    assert_eq!(again.kind, ErrorKind::Conflict);
}

#[tokio::test]
async fn command_rules_refuse_hold_and_release_execs_through_approvals() {
    let s = setup().await;
    let policy = "version: 1\ncommands:\n  deny: ['rm *']\n  ask: ['sh -c echo *']\n";
    s.harness
        .create(create("four", Some(policy)))
        .await
        .unwrap();
    let denied = s
        .harness
        .exec("four", exec(&["rm", "-rf", "x"]))
        .await
        .unwrap_err();
    assert_eq!(denied.kind, ErrorKind::Forbidden, "{denied}");
    // An asked command waits for a person; the question is listed with its id.
    let harness = Arc::clone(&s.harness);
    let held = tokio::spawn(async move {
        harness
            .exec("four", exec(&["sh", "-c", "echo released"]))
            .await
    });
    let mut id = 0;
    wait_for("the question", async || {
        match s.harness.approvals().into_iter().find(|a| a.cell == "four") {
            Some(a) => {
                id = a.id;
                true
            }
            None => false,
        }
    })
    .await;
    assert!(!held.is_finished(), "the exec waits for the answer");
    s.harness
        .answer("four", id, true, Scope::Cell, "tester")
        .await
        .unwrap();
    let process = held.await.unwrap().unwrap();
    let (out, _, exit) = finish(&process).await;
    assert_eq!((out.as_str(), exit.code), ("released\n", Some(0)));
    // Scope `cell` covers the same command line from now on: no second question.
    let again = s
        .harness
        .exec("four", exec(&["sh", "-c", "echo released"]))
        .await
        .unwrap();
    finish(&again).await;
    let kinds = kinds(&s.harness, "four").await;
    assert_eq!(
        kinds.iter().filter(|k| *k == "approval.ask").count(),
        1,
        "{kinds:?}"
    );
    assert!(kinds.contains(&"exec.denied".to_owned()), "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| *k == "exec.start").count(),
        2,
        "{kinds:?}"
    );
}

#[tokio::test]
async fn a_question_of_the_cells_gateway_is_listed_journaled_and_answered_through_the_tier() {
    let s = setup().await;
    s.harness.create(create("five", None)).await.unwrap();
    let cell = s.fake.cell("five").unwrap();
    let gateway_id = cell.ask(
        "connect example.org:443",
        "example.org:443",
        "ask: example.org",
    );
    let mut id = 0;
    wait_for("the gateway's question", async || {
        match s.harness.approvals().into_iter().find(|a| a.cell == "five") {
            Some(a) => {
                id = a.id;
                a.request == "connect example.org:443"
            }
            None => false,
        }
    })
    .await;
    s.harness
        .answer("five", id, false, Scope::Once, "tester")
        .await
        .unwrap();
    assert_eq!(cell.answers(), vec![(gateway_id, false)]);
    let journal = entries(&s.harness, "five").await;
    let ask = journal
        .iter()
        .find(|e| e["kind"] == "approval.ask")
        .unwrap();
    assert_eq!(
        ask["seq"].as_u64(),
        Some(id),
        "the id is the question's journal entry"
    );
    let answer = journal
        .iter()
        .find(|e| e["kind"] == "approval.answer")
        .unwrap();
    assert_eq!(answer["data"]["by"], "tester");
    // Answered once: a second answer finds no question.
    let twice = s
        .harness
        .answer("five", id, true, Scope::Once, "tester")
        .await
        .unwrap_err();
    assert_eq!(twice.kind, ErrorKind::NotFound);
}

#[tokio::test]
async fn a_cell_that_ends_under_the_harness_is_noticed_and_journaled_once() {
    let s = setup().await;
    s.harness.create(create("six", None)).await.unwrap();
    // The tier ends the cell without the harness asking (its processes died, a host kill).
    use warden_cell::Cell as _;
    s.fake.cell("six").unwrap().kill().unwrap();
    wait_for("the end", async || {
        s.harness.get("six").unwrap().state == CellState::Ended
    })
    .await;
    wait_for("the journal's end", async || {
        kinds(&s.harness, "six")
            .await
            .contains(&"cell.end".to_owned())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let kinds = kinds(&s.harness, "six").await;
    assert_eq!(
        kinds.iter().filter(|k| *k == "cell.end").count(),
        1,
        "{kinds:?}"
    );
    s.harness.delete("six", "test").await.unwrap();
    assert_eq!(s.harness.get("six").unwrap_err().kind, ErrorKind::NotFound);
}

#[tokio::test]
async fn a_cell_deleted_right_after_it_ended_by_itself_has_its_end_journaled_before_its_delete() {
    let s = setup().await;
    s.harness.create(create("seven", None)).await.unwrap();
    // Ended by the tier, and deleted before the cell's watch has looked at it.
    use warden_cell::Cell as _;
    s.fake.cell("seven").unwrap().kill().unwrap();
    s.harness.delete("seven", "test").await.unwrap();
    let entries = entries(&s.harness, "seven").await;
    let kinds = kinds_in(&entries);
    assert_eq!(
        kinds,
        ["cell.create", "cell.start", "cell.end", "cell.delete"]
    );
    assert_eq!(entries[2]["data"]["reason"], "its processes ended");
    // The watch, looking later, journals nothing more.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(self::kinds(&s.harness, "seven").await.len(), 4);
}

#[tokio::test]
async fn a_cell_with_a_workspace_deleted_right_after_it_ended_by_itself_has_its_end_journaled() {
    let s = setup().await;
    let workspace = tempfile::tempdir().unwrap();
    let request = CreateCell {
        workspace: Some(workspace.path().to_string_lossy().into_owned()),
        ..create("eight", None)
    };
    s.harness.create(request).await.unwrap();
    use warden_cell::Cell as _;
    s.fake.cell("eight").unwrap().kill().unwrap();
    s.harness.delete("eight", "test").await.unwrap();
    let entries = entries(&s.harness, "eight").await;
    let kinds = kinds_in(&entries);
    // Its end, then what its delete says of its changes, then the delete.
    assert_eq!(kinds.first(), Some(&"cell.create"));
    let end = kinds.iter().position(|k| *k == "cell.end");
    let delete = kinds.iter().position(|k| *k == "cell.delete");
    assert!(
        matches!((end, delete), (Some(e), Some(d)) if e < d),
        "entries: {kinds:?}"
    );
    assert_eq!(kinds.iter().filter(|k| **k == "cell.end").count(), 1);
    assert_eq!(
        entries[end.unwrap()]["data"]["reason"],
        "its processes ended"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(self::kinds(&s.harness, "eight").await.len(), kinds.len());
}

fn attached(argv: &[&str]) -> AttachedRun {
    AttachedRun {
        argv: argv.iter().map(Into::into).collect(),
        env: vec![("ADDED".to_owned(), "yes".to_owned())],
        discard_changes: false,
        by: "test".to_owned(),
        checked: false,
        parsed: None,
    }
}

#[tokio::test]
async fn a_run_to_its_end_is_journaled_like_a_cell_and_an_exec_and_follows_the_command_rules() {
    let s = setup_as(true).await;
    let policy = "version: 1\ncommands:\n  deny: ['rm *']\n  ask: ['curl *']\n";
    let end = s
        .harness
        .run_attached(
            create("seven", Some(policy)),
            attached(&["sh", "-c", "test \"$ADDED\" = yes && exit 5"]),
        )
        .await
        .unwrap();
    assert_eq!(
        (end.exit.reason, end.exit.code),
        (ExitReason::Exited, Some(5))
    );
    assert_eq!(end.attached.name, "seven");
    assert_eq!(
        kinds(&s.harness, "seven").await,
        [
            "cell.create",
            "exec.start",
            "exec.exit",
            "cell.end",
            "cell.delete"
        ]
    );
    // A refused command never reaches the tier.
    let denied = s
        .harness
        .run_attached(create("eight", Some(policy)), attached(&["rm", "-rf", "/"]))
        .await
        .unwrap_err();
    assert_eq!(denied.kind, ErrorKind::Forbidden);
    assert!(s.fake.cell("eight").is_none());
    assert_eq!(
        kinds(&s.harness, "eight").await,
        ["cell.create", "exec.denied", "cell.end", "cell.delete"]
    );
    // Nobody can answer a harness that lives for one command: an asked one is refused.
    let asked = s
        .harness
        .run_attached(create("nine", Some(policy)), attached(&["curl", "x"]))
        .await
        .unwrap_err();
    assert_eq!(asked.kind, ErrorKind::Forbidden);
    assert!(asked.message.contains("nobody can answer"), "{asked}");
    // Nothing of them stays in the harness.
    assert!(s.harness.list().unwrap().is_empty());
    // A tier that refuses the start: the start's end and the failure are journaled.
    s.fake.refuse_start("ten", "no such host feature");
    let refused = s
        .harness
        .run_attached(create("ten", None), attached(&["true"]))
        .await
        .unwrap_err();
    assert!(
        refused.message.contains("no such host feature"),
        "{refused}"
    );
    assert_eq!(
        kinds(&s.harness, "ten").await,
        ["cell.create", "exec.start", "exec.exit", "cell.fail"]
    );
}

#[tokio::test]
async fn a_run_to_its_end_is_journaled_as_started_before_its_command_runs() {
    let s = setup_as(true).await;
    let journal = s.dir.path().join("state/journal/journal.jsonl");
    // The command itself looks in the journal for its own start.
    let look = format!(
        "grep '\"kind\":\"exec.start\"' {} | grep -q '\"cell\":\"eleven\"'",
        journal.display()
    );
    let end = s
        .harness
        .run_attached(create("eleven", None), attached(&["sh", "-c", &look]))
        .await
        .unwrap();
    assert_eq!(
        (end.exit.reason, end.exit.code),
        (ExitReason::Exited, Some(0)),
        "the command did not find its start in the journal"
    );
    // The same look, for a cell whose start is not in it, fails: the look can fail.
    let other = look.replace("eleven", "twelve-not-this-one");
    let end = s
        .harness
        .run_attached(create("twelve", None), attached(&["sh", "-c", &other]))
        .await
        .unwrap();
    assert_eq!(end.exit.code, Some(1));
}

#[tokio::test]
async fn a_deleted_cell_ends_once_in_the_journal_whatever_its_watch_sees() {
    let s = setup().await;
    let names: Vec<String> = (0..20).map(|i| format!("gone{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        s.harness.create(create(name, None)).await.unwrap();
        // Its watch looks every 100 ms: deletes at many points of that period.
        tokio::time::sleep(Duration::from_millis(i as u64 * 7)).await;
        s.harness.delete(name, "test").await.unwrap();
    }
    // Time for any watch that saw an end to journal one.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for name in &names {
        assert_eq!(
            kinds(&s.harness, name).await,
            [
                "cell.create",
                "cell.start",
                "cell.kill",
                "cell.end",
                "cell.delete"
            ],
            "{name}"
        );
        assert_eq!(s.harness.get(name).unwrap_err().kind, ErrorKind::NotFound);
    }
}

/// A cell killed, and a new cell made under its name while the old cell's watch is still
/// looking at the old one (a look that takes long, as on a busy host): once that look says the
/// old cell ended, the watch leaves the new cell be. It ran, its end was not journaled, and its
/// commands ran. (The watch took the new cell's handle and supervision away and journaled its
/// end as "its processes ended": its first exec was refused as of an ended cell.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_cell_of_a_killed_cells_name_is_left_be_by_the_old_cells_watch() {
    let s = setup().await;
    s.harness.create(create("again", None)).await.unwrap();
    s.harness
        .control("again", ControlAction::Kill, "test")
        .await
        .unwrap();
    let old = s.fake.cell("again").unwrap();
    old.delay_next_look(Duration::from_millis(400));
    wait_for("the old cell's watch to look at it", async || {
        old.slow_look_begun()
    })
    .await;
    // Another millisecond: the new cell's entry is not made in the same one.
    tokio::time::sleep(Duration::from_millis(2)).await;
    s.harness.create(create("again", None)).await.unwrap();
    // Past the watch's look, and a tick after it.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let info = s.harness.get("again").unwrap();
    assert_eq!(info.state, CellState::Running, "{info:?}");
    assert_eq!(info.ended, None, "{info:?}");
    let process = s.harness.exec("again", exec(&["true"])).await.unwrap();
    let (_, _, exit) = finish(&process).await;
    assert_eq!((exit.reason, exit.code), (ExitReason::Exited, Some(0)));
    let kinds = kinds(&s.harness, "again").await;
    assert_eq!(
        kinds.iter().filter(|k| *k == "cell.end").count(),
        1,
        "only the killed cell's end: {kinds:?}"
    );
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("exec.exit"),
        "{kinds:?}"
    );
}

/// A control that comes once a delete of the cell has begun is refused and leaves no entry:
/// its entry could otherwise land after the cell's delete in the journal.
#[tokio::test]
async fn a_control_that_comes_while_a_delete_is_under_way_is_refused_and_not_journaled() {
    let s = setup().await;
    // The delete's kill takes a while: the kill below comes while it is under way, the cell
    // not yet ended (so only the delete's mark can refuse it).
    s.fake.delay_kills(Duration::from_millis(400));
    s.harness.create(create("during", None)).await.unwrap();
    let harness = Arc::clone(&s.harness);
    let delete = tokio::spawn(async move { harness.delete("during", "the-delete").await });
    let fake = s.fake.cell("during").unwrap();
    wait_for("the delete's kill", async || fake.kill_begun()).await;
    let refused = s
        .harness
        .control(
            "during",
            warden_harness::ControlAction::Kill,
            "the-late-kill",
        )
        .await;
    delete.await.unwrap().unwrap();
    let err = refused.expect_err("a kill during the delete was taken");
    assert!(err.message.contains("being deleted"), "{err:?}");
    let entries = entries(&s.harness, "during").await;
    assert!(
        !entries.iter().any(|e| e["data"]["by"] == "the-late-kill"),
        "{entries:?}"
    );
    assert_eq!(
        kinds_in(&entries).last(),
        Some(&"cell.delete"),
        "{entries:?}"
    );
}

#[tokio::test]
async fn a_cell_killed_and_deleted_at_once_ends_once_in_the_journal() {
    let s = setup().await;
    let names: Vec<String> = (0..12).map(|i| format!("both{i}")).collect();
    for name in &names {
        s.harness.create(create(name, None)).await.unwrap();
    }
    for (i, name) in names.iter().enumerate() {
        // The kill at many points of the delete's way, and before it.
        let kill = async {
            tokio::time::sleep(Duration::from_micros(i as u64 * 100)).await;
            s.harness
                .control(name, warden_harness::ControlAction::Kill, "test")
                .await
        };
        let delete = async {
            tokio::time::sleep(Duration::from_micros(300)).await;
            s.harness.delete(name, "test").await
        };
        let (_, deleted) = tokio::join!(kill, delete);
        deleted.unwrap();
    }
    // Time for a kill's or a watch's late entry.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for name in &names {
        let kinds = kinds(&s.harness, name).await;
        let ends = kinds.iter().filter(|k| *k == "cell.end").count();
        assert_eq!(ends, 1, "{name}: {kinds:?}");
        assert_eq!(
            kinds.last().map(String::as_str),
            Some("cell.delete"),
            "{name}: {kinds:?}"
        );
    }
}
