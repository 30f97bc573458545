//! Each benchmark answers `--help` with its usage (and success, having measured nothing), and an
//! argument it does not know with an error that names the argument and gives the usage.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::process::Command;

const BENCHES: [&str; 7] = [
    env!("CARGO_BIN_EXE_coldstart"),
    env!("CARGO_BIN_EXE_workspace-ops"),
    env!("CARGO_BIN_EXE_egress"),
    env!("CARGO_BIN_EXE_daemon-bench"),
    env!("CARGO_BIN_EXE_gvisor-bench"),
    env!("CARGO_BIN_EXE_order-startup"),
    env!("CARGO_BIN_EXE_bench-report"),
];

#[test]
fn each_benchmark_answers_help_with_its_usage_and_refuses_an_unknown_argument() {
    for bench in BENCHES {
        let help = Command::new(bench).arg("--help").output().unwrap();
        let said = String::from_utf8_lossy(&help.stdout);
        assert!(help.status.success(), "{bench} --help: {help:?}");
        assert!(
            said.contains("--"),
            "{bench} --help printed no usage: {said:?}"
        );
        let wrong = Command::new(bench)
            .arg("--no-such-argument")
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&wrong.stderr);
        assert!(!wrong.status.success(), "{bench} took an unknown argument");
        assert!(
            err.contains("--no-such-argument") && err.lines().count() <= 2,
            "{bench}: {err}"
        );
    }
}
