//! What the caller of `warden run` sees at its end. In a test binary of its own: this process
//! becomes the reaper of its descendants' orphans, and reaps whatever is left at the end, which
//! would take the children of tests running beside it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::Read as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::*;

/// `warden run` hands the teardown of its memory to a process that shares it and ends right
/// after it (see `leave_memory_behind`). That process must not hold the run's output open past
/// the run's end: a caller that has waited for the run reads the end of its output at once.
/// Nor may it show the run's arguments once the run has ended (it shares the memory they are
/// in). And it must end: every orphan the runs left is reaped here within seconds.
#[test]
fn a_runs_output_ends_with_it_and_nothing_it_left_lives_on() {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
    let rounds = 20;
    for round in 0..rounds {
        // A word only this run's arguments hold: once the run has ended, no process may show it.
        let marker = format!("marker-{}-{round}", std::process::id());
        let mut child = warden()
            .args([
                "run",
                "--policy",
                &direct_policy(),
                "--",
                "echo",
                "out",
                &marker,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (mut stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let status = child.wait().unwrap();
        let showing = processes_whose_command_line(|cmdline| cmdline.contains(&marker));
        rustix::fs::fcntl_setfl(&stdout, rustix::fs::OFlags::NONBLOCK).unwrap();
        rustix::fs::fcntl_setfl(&stderr, rustix::fs::OFlags::NONBLOCK).unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let read = stdout.read_to_end(&mut out);
        let read_err = stderr.read_to_end(&mut err);
        let err = String::from_utf8_lossy(&err);
        assert!(status.success(), "round {round}: {status:?} {err}");
        for read in [read, read_err] {
            if let Err(e) = read {
                panic!("round {round}: the run has ended but its output has not: {e}");
            }
        }
        assert_eq!(
            out,
            format!("out {marker}\n").as_bytes(),
            "round {round}: {err}"
        );
        assert_eq!(
            showing,
            Vec::<i32>::new(),
            "round {round}: processes show the ended run's arguments"
        );
    }
    // Orphans (the runs' memory holders among them) come to this process: all end.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut reaped = 0;
    loop {
        match rustix::process::waitpid(None, rustix::process::WaitOptions::NOHANG) {
            Ok(Some(_)) => {
                reaped += 1;
                continue;
            }
            Err(rustix::io::Errno::CHILD) => break,
            Ok(None) => {}
            Err(err) => panic!("waiting for the runs' orphans: {err}"),
        }
        assert!(
            Instant::now() < deadline,
            "a process the runs left still lives after 10 s ({reaped} reaped)"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!("{reaped} orphans of {rounds} runs reaped");
}
