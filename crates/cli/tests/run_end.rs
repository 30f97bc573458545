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
/// in). It also keeps the run's last holds on its cell's namespaces, where the cell has no
/// workspace: those go with it; a cell with a workspace has none left once the run has ended.
/// And it must end: every orphan the runs left is reaped here within seconds.
#[test]
fn a_runs_output_ends_with_it_and_nothing_it_left_lives_on() {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
    let workspace = tempdir();
    for (round, workspace) in [None, Some(workspace.path())].into_iter().enumerate() {
        let mut run = warden();
        run.args(["run", "--policy", &direct_policy()]);
        if let Some(dir) = workspace {
            run.arg("--workspace").arg(dir);
        }
        let mut child = run
            .args(["--", "readlink", "/proc/self/ns/mnt"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut ns = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut ns)
            .unwrap();
        let status = child.wait().unwrap();
        // First a quick look at the run's orphans (its holder, reparented here), while the
        // holder may still live (it takes the run's memory down first).
        let orphans = children_of_this_process();
        assert!(status.success(), "{status:?}");
        let ns = ns.trim().to_owned();
        assert!(ns.starts_with("mnt:["), "{ns:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut look = Some(orphans);
        loop {
            let holders = match look.take() {
                Some(orphans) => {
                    let holders = holding(orphans, &ns);
                    eprintln!("round {round}: right after the run, held by {holders:?}");
                    holders
                }
                None => holding(all_processes(), &ns),
            };
            if holders.is_empty() {
                break;
            }
            assert!(
                workspace.is_none(),
                "round {round}: a cell with a workspace: processes {holders:?} hold its mount \
                 namespace after the run ended"
            );
            assert!(
                Instant::now() < deadline,
                "round {round}: processes {holders:?} hold the cell's mount namespace 10 s after \
                 the run ended"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
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

/// The processes of `pids` that hold the namespace `ns` (as `/proc/PID/ns/*` shows it,
/// `mnt:[N]`): as their own, or by a descriptor.
fn holding(pids: Vec<i32>, ns: &str) -> Vec<i32> {
    let is_it = |link: std::path::PathBuf| {
        std::fs::read_link(link).is_ok_and(|target| target.as_os_str() == ns)
    };
    pids.into_iter()
        .filter(|pid| {
            let by_fd = std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|fds| fds.flatten().any(|fd| is_it(fd.path())))
                .unwrap_or(false);
            by_fd || is_it(format!("/proc/{pid}/ns/mnt").into())
        })
        .collect()
}

fn all_processes() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().to_string_lossy().parse().ok())
        .collect()
}

/// The children of this process's threads (the orphans it reaps among them).
fn children_of_this_process() -> Vec<i32> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|pid| pid.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}
