//! Cells made ahead, through the fake tier: which creates a pool serves and which it leaves to
//! a fresh start, that it makes a new cell for each one it hands out, that its cells end with
//! the daemon, and that a daemon ends the ones an earlier daemon left made ahead. The same
//! through the process tier, with what a cell made ahead saw, is in
//! `crates/cli/tests/daemon_lifecycle.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use warden_cell::Backend as _;
use warden_cell::fake::FakeBackend;
use warden_harness::{Config, CreateCell, Harness, PolicySource, PoolSpec};

fn pool(policy: PolicySource, size: usize) -> PoolSpec {
    PoolSpec {
        label: match &policy {
            PolicySource::Preset(p) => p.clone(),
            PolicySource::Yaml(_) => "policy.yaml".to_owned(),
        },
        policy,
        size,
    }
}

fn config(dir: &Path, fake: &Arc<FakeBackend>, pools: Vec<PoolSpec>) -> Config {
    Config {
        runtime: dir.join("run"),
        state: dir.join("state"),
        journal_segments: Default::default(),
        tiers: Arc::new(warden_cell::Tiers::only(fake.clone())),
        ephemeral: false,
        pools,
    }
}

async fn open(dir: &Path, fake: &Arc<FakeBackend>, pools: Vec<PoolSpec>) -> Arc<Harness> {
    Harness::open(config(dir, fake, pools)).await.unwrap()
}

/// Whether the fake tier still has `name` running.
fn alive(fake: &Arc<FakeBackend>, name: &str) -> bool {
    fake.adopt(name).unwrap().is_some()
}

async fn ready(harness: &Harness, want: usize) {
    for _ in 0..400 {
        if harness.pools()[0].ready == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the pool never had {want} ready: {:?}", harness.pools());
}

async fn all_entries(harness: &Harness) -> Vec<Value> {
    harness.entries_after(0, None).await.unwrap()
}

/// The names of the cells the journal says the pool made, in order.
async fn made(harness: &Harness) -> Vec<String> {
    all_entries(harness)
        .await
        .iter()
        .filter(|e| e["kind"] == "pool.made")
        .map(|e| e["data"]["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The kinds of journal entries, in order.
fn kinds(entries: &[Value]) -> Vec<&str> {
    entries
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect()
}

/// Whether the journal's `cell.create` of `name` says it came from a pool.
async fn pooled(harness: &Harness, name: &str) -> bool {
    let entries = harness
        .entries_after(0, Some(name.to_owned()))
        .await
        .unwrap();
    let create = entries
        .iter()
        .find(|e| e["kind"] == "cell.create")
        .expect("a cell.create entry");
    create["data"]["pooled"].as_bool().unwrap()
}

#[tokio::test]
async fn a_pool_serves_only_creates_that_ask_for_its_policy_and_nothing_a_cell_starts_with() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    let harness = open(
        dir.path(),
        &fake,
        vec![pool(PolicySource::Preset("default".into()), 2)],
    )
    .await;
    ready(&harness, 2).await;
    let ahead = made(&harness).await;
    assert_eq!(ahead.len(), 2, "{ahead:?}");
    // Made ahead: not cells of anyone's yet.
    assert!(harness.list().unwrap().is_empty());
    let info = harness.pools();
    assert_eq!(
        (info[0].size, info[0].taken, info[0].tier.as_str()),
        (2, 0, "process")
    );

    // A create of the pool's policy, as a preset or as the same policy written out, takes one.
    let first = harness.create(CreateCell::default()).await.unwrap();
    assert_eq!(first.name, ahead[0]);
    assert!(pooled(&harness, &first.name).await);
    let second = harness
        .create(CreateCell {
            policy: Some("version: 1\nextends: default\n".into()),
            labels: [("who".to_owned(), "me".to_owned())].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(ahead.contains(&second.name), "{} of {ahead:?}", second.name);
    assert_eq!(second.labels["who"], "me");
    assert!(pooled(&harness, &second.name).await);
    // It makes new ones in their place, never the same cell again.
    ready(&harness, 2).await;
    let now = made(&harness).await;
    assert_eq!(now.len(), 4, "{now:?}");
    assert!(!ahead.contains(&now[2]) && !ahead.contains(&now[3]));
    assert_eq!(harness.pools()[0].taken, 2);

    // Anything a cell is started with, or another policy, gets a cell started for it.
    let ws = tempfile::tempdir().unwrap();
    let others = [
        CreateCell {
            name: Some("named".into()),
            ..Default::default()
        },
        CreateCell {
            env: [("A".to_owned(), "1".to_owned())].into(),
            ..Default::default()
        },
        CreateCell {
            workspace: Some(ws.path().display().to_string()),
            ..Default::default()
        },
        CreateCell {
            policy: Some("version: 1\nextends: default\nlimits:\n  pids: 77\n".into()),
            ..Default::default()
        },
        CreateCell {
            preset: Some("minimal".into()),
            ..Default::default()
        },
    ];
    for request in others {
        let made = harness.create(request.clone()).await.unwrap();
        assert!(!pooled(&harness, &made.name).await, "{request:?}");
        assert!(!now.contains(&made.name));
        let spec = fake.cell(&made.name).unwrap().spec().clone();
        assert_eq!(
            spec.env,
            request.env.clone().into_iter().collect::<Vec<_>>()
        );
    }
    assert_eq!(harness.pools()[0].taken, 2);

    // The daemon stops: the cells made ahead end; the ones handed out stay.
    harness.shutdown().await;
    for name in &now[2..] {
        assert!(!alive(&fake, name), "{name} ended with the daemon");
    }
    assert!(alive(&fake, &first.name), "a cell handed out stays");
}

#[test]
fn a_cell_being_made_when_the_daemon_stops_ends_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (taken, harness) = runtime.block_on(async {
        let harness = open(
            dir.path(),
            &fake,
            vec![pool(PolicySource::Preset("default".into()), 1)],
        )
        .await;
        ready(&harness, 1).await;
        // The next cell takes a while to come up: the daemon stops while it does.
        fake.delay_starts(Duration::from_millis(400));
        let taken = harness.create(CreateCell::default()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        harness.shutdown().await;
        (taken, harness)
    });
    // As a daemon's process does next: its runtime goes, with every task of it.
    runtime.shutdown_timeout(Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(500));
    drop(harness);
    // Every cell the tier started: the one handed out runs, none other does.
    let started: Vec<String> = std::fs::read_dir(dir.path().join("cells"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(started.len(), 2, "{started:?}");
    for name in &started {
        assert_eq!(
            alive(&fake, name),
            *name == taken.name,
            "{name} of {started:?}"
        );
    }
}

#[test]
fn a_daemon_ends_the_cells_an_earlier_one_left_made_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    let spec = vec![pool(PolicySource::Preset("default".into()), 1)];
    // A daemon that dies: its runtime goes with every task of its, and no shutdown runs.
    let crashed = tokio::runtime::Runtime::new().unwrap();
    let (taken, left) = crashed.block_on(async {
        let harness = open(dir.path(), &fake, spec.clone()).await;
        ready(&harness, 1).await;
        let taken = harness.create(CreateCell::default()).await.unwrap();
        ready(&harness, 1).await;
        let left: Vec<String> = made(&harness)
            .await
            .into_iter()
            .filter(|n| *n != taken.name)
            .collect();
        (taken, left)
    });
    crashed.shutdown_timeout(Duration::from_secs(10));
    assert_eq!(left.len(), 1);
    assert!(alive(&fake, &left[0]));

    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let next = open(dir.path(), &fake, spec).await;
        assert!(!alive(&fake, &left[0]), "the cell left ahead was ended");
        assert!(alive(&fake, &taken.name), "the cell handed out was kept");
        let dropped: Vec<Value> = all_entries(&next)
            .await
            .into_iter()
            .filter(|e| e["kind"] == "pool.drop")
            .collect();
        assert_eq!(dropped.len(), 1, "{dropped:?}");
        assert_eq!(dropped[0]["data"]["name"], left[0]);
        assert_eq!(next.get(&taken.name).unwrap().name, taken.name);
        assert!(
            next.get(&left[0]).is_err(),
            "a cell made ahead is no cell of the daemon's"
        );
        ready(&next, 1).await;
        next.shutdown().await;
    });
}

#[test]
fn a_daemon_ends_and_deletes_a_cell_an_earlier_one_stopped_with_while_handing_it_out() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    let spec = vec![pool(PolicySource::Preset("default".into()), 1)];
    let crashed = tokio::runtime::Runtime::new().unwrap();
    let left = crashed.block_on(async {
        let harness = open(dir.path(), &fake, spec.clone()).await;
        ready(&harness, 1).await;
        made(&harness).await.remove(0)
    });
    crashed.shutdown_timeout(Duration::from_secs(10));
    assert!(alive(&fake, &left));
    // Where a hand-out stops when the daemon dies after its mark and before the database's
    // commit (a run's create may be in the journal by then, its command started).
    let marker = dir.path().join("state/daemon/pool").join(&left);
    let tier = std::fs::read_to_string(&marker).unwrap();
    assert!(
        !tier.contains('\n'),
        "a marker of a cell not handed out: {tier:?}"
    );
    std::fs::write(&marker, format!("{tier}\nhanding out")).unwrap();

    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let next = open(dir.path(), &fake, spec).await;
        assert!(!alive(&fake, &left), "the cell being handed out was ended");
        let entries = next.entries_after(0, Some(left.clone())).await.unwrap();
        let kinds = kinds(&entries);
        assert_eq!(kinds, ["cell.end", "cell.delete"], "{entries:?}");
        assert!(
            !all_entries(&next)
                .await
                .iter()
                .any(|e| e["kind"] == "pool.drop" && e["data"]["name"] == left),
            "a cell handed out is no pool's to drop"
        );
        assert!(next.get(&left).is_err());
        assert!(!marker.exists());
        ready(&next, 1).await;
        next.shutdown().await;
    });
}

#[tokio::test]
async fn a_pool_whose_cells_would_need_a_callers_secrets_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    let yaml = "version: 1\nnetwork:\n  allow:\n    - host: 10.9.8.7\n      credential: api\ncredentials:\n  api: { from_env: API_KEY }\n";
    let refused = Harness::open(config(
        dir.path(),
        &fake,
        vec![pool(PolicySource::Yaml(yaml.into()), 1)],
    ))
    .await;
    let message = refused.expect_err("refused").to_string();
    assert!(
        message.contains("API_KEY") && message.contains("from_env"),
        "{message}"
    );
}

/// Two pools of one policy, however it is named: the second would make cells that no create
/// takes (a create takes from the first that matches), so the daemon refuses to start.
#[tokio::test]
async fn two_pools_of_one_policy_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    // The default preset's own text: the same policy under another name.
    let same = "version: 1\n".to_owned();
    let refused = Harness::open(config(
        dir.path(),
        &fake,
        vec![
            pool(PolicySource::Preset("default".into()), 2),
            pool(PolicySource::Yaml(same), 3),
        ],
    ))
    .await;
    let message = refused.expect_err("refused").to_string();
    assert!(
        message.contains("same policy") && message.contains("--pool default=5"),
        "{message}"
    );
    // Two pools of different policies are fine.
    let harness = open(
        dir.path(),
        &fake,
        vec![
            pool(PolicySource::Preset("default".into()), 1),
            pool(PolicySource::Preset("minimal".into()), 1),
        ],
    )
    .await;
    assert_eq!(harness.pools().len(), 2);
}

/// Waits (bounded) until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what} did not happen");
}

/// A run's cell from a pool lives for its call: listed while its command runs, its pool
/// marker saying it is being handed out (no database commit is made for it), and the marker
/// gone once its delete is durable; a daemon that stopped before the marker went says no more
/// about a cell whose delete its journal has.
#[test]
fn a_runs_cell_from_a_pool_lives_for_its_call_and_leaves_nothing_once_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeBackend::new(&dir.path().join("cells"));
    let spec = vec![pool(PolicySource::Preset("default".into()), 1)];
    let markers = dir.path().join("state/daemon/pool");
    let go = dir.path().join("go");
    let first = tokio::runtime::Runtime::new().unwrap();
    let name = first.block_on(async {
        let harness = open(dir.path(), &fake, spec.clone()).await;
        ready(&harness, 1).await;
        let wait = format!("while [ ! -e {} ]; do sleep 0.01; done", go.display());
        let request = warden_harness::RunOnce {
            cell: CreateCell::default(),
            exec: warden_harness::ExecSpec {
                argv: vec!["sh".into(), "-c".into(), wait],
                ..Default::default()
            },
        };
        let database = dir.path().join("state/daemon/state.redb");
        let written = || {
            let meta = std::fs::metadata(&database).unwrap();
            (meta.len(), meta.modified().unwrap())
        };
        let before = written();
        let running = harness.run_once(request, "test").await.unwrap();
        let name = running.cell.clone();
        assert!(pooled(&harness, &name).await, "not the pool's cell");
        // While it runs: a cell like any to those who look, its marker says so.
        let listed: Vec<String> = harness
            .list()
            .unwrap()
            .into_iter()
            .map(|c| c.name)
            .collect();
        assert!(listed.contains(&name), "{listed:?}");
        assert_eq!(harness.get(&name).unwrap().name, name);
        let marker = std::fs::read_to_string(markers.join(&name)).unwrap();
        assert!(marker.ends_with("\nhanding out"), "{marker:?}");
        // `warden ps` lists it as a cell, not as one of the pool's made ahead.
        let ahead = warden_harness::made_ahead(&dir.path().join("state"));
        assert!(!ahead.contains(&name), "{ahead:?}");
        std::fs::write(&go, "").unwrap();
        running.deleted.await.unwrap().unwrap();
        until("the run's exit", || running.process.exit().is_some()).await;
        assert_eq!(running.process.exit().unwrap().code, Some(0));
        assert!(harness.get(&name).is_err(), "the run's cell is still there");
        assert!(harness.list().unwrap().iter().all(|c| c.name != name));
        until("the run's marker to go", || !markers.join(&name).exists()).await;
        // Nothing of the run went through the database (a commit rewrites its file).
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            written(),
            before,
            "the database was written for a run's cell"
        );
        harness.shutdown().await;
        name
    });
    first.shutdown_timeout(Duration::from_secs(10));
    // As if the daemon had stopped after the delete and before its marker went.
    std::fs::write(markers.join(&name), "process\nhanding out").unwrap();
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let next = open(dir.path(), &fake, spec).await;
        let entries = next.entries_after(0, Some(name.clone())).await.unwrap();
        let kinds = kinds(&entries);
        assert_eq!(
            kinds,
            [
                "cell.create",
                "cell.start",
                "exec.start",
                "exec.exit",
                // (The fake tier's cells do not end with their last process.)
                "cell.kill",
                "cell.end",
                "cell.delete"
            ],
            "the run's cell was ended or deleted twice: {entries:?}"
        );
        assert!(!markers.join(&name).exists(), "the marker stayed");
        next.shutdown().await;
    });
}
