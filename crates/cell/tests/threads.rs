//! The process tier clones a cell from the calling thread, and the clone goes on without the
//! others: from a process with other threads (this test binary has at least two) it refuses,
//! instead of risking an init that waits for ever on a lock another thread held.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

#[test]
fn a_cell_is_not_started_from_a_process_with_other_threads() {
    let dir = tempfile::tempdir().unwrap();
    let registry = warden_cell::Registry::open(dir.path().join("run")).unwrap();
    let store = warden_cell::Store::open(dir.path().join("state")).unwrap();
    let busy = std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_secs(2)));
    let request = warden_cell::RunRequest {
        policy: warden_policy::preset("default").unwrap(),
        name: Some(format!("threads-{}", std::process::id())),
        workspace: None,
        argv: vec!["true".into()],
        env: Vec::new(),
        discard_changes: true,
        from: None,
        serve_exec: false,
        report: None,
        checked: false,
        ready: None,
        signals_from: None,
        release_later: false,
        lines: None,
    };
    let err = warden_cell::run(&registry, &store, request).unwrap_err();
    assert!(
        err.to_string().contains("must be called single-threaded"),
        "{err}"
    );
    // Nothing of the cell is left: its name is free again.
    assert!(registry.list().unwrap().is_empty());
    busy.join().unwrap();
}
