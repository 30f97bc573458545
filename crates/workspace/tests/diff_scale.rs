//! What one diff costs for a directory a cell filled with names. In a file of its own: the bound
//! is the CPU time of this test's process, which other tests running beside it would add to.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::fs;
use std::time::Duration;

use warden_workspace::{DiffOptions, diff};

/// User and system CPU time of this process so far (every thread's, ended ones included, as
/// `/proc/self/stat` sums them), in clock ticks of 10 ms.
fn cpu_time() -> Duration {
    let stat = fs::read_to_string("/proc/self/stat").unwrap();
    // After the command's name in parentheses: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// A cell makes a directory of 60,000 empty files in a second or two. Listing a directory
/// looked each name up among those listed before it, so one diff of it took 10.7 s of CPU (a
/// debug build; 100,000 names held a daemon's diff for 30 s) while the cell stayed frozen; it
/// takes 0.9 s now.
#[test]
fn a_directory_of_many_names_is_listed_in_time_linear_in_its_size() {
    const NAMES: usize = 60_000;
    let root = tempfile::tempdir().unwrap();
    let lower = root.path().join("lower");
    let (upper, below) = (root.path().join("upper"), root.path().join("below"));
    for dir in [&lower, &upper.join("flat"), &below.join("flat")] {
        fs::create_dir_all(dir).unwrap();
    }
    for i in 0..NAMES {
        fs::File::create(upper.join("flat").join(format!("f{i:06}"))).unwrap();
    }
    // The layer below holds a tenth of the names too, and one of its own: each listed once.
    for i in (0..NAMES).step_by(10) {
        fs::File::create(below.join("flat").join(format!("f{i:06}"))).unwrap();
    }
    fs::File::create(below.join("flat").join("g")).unwrap();

    let before = cpu_time();
    let d = diff(&lower, &[upper, below], &DiffOptions::default()).unwrap();
    let spent = cpu_time() - before;

    // `flat`, its names, and the one of the layer below.
    assert_eq!(d.changes.len(), NAMES + 2);
    let mut paths: Vec<&str> = d.changes.iter().map(|c| c.path.as_str()).collect();
    paths.dedup();
    assert_eq!(
        paths.len(),
        NAMES + 2,
        "a name two layers hold is listed once"
    );
    assert!(paths.contains(&"flat/g"));
    eprintln!("diff of {NAMES} names: {spent:?} of CPU");
    assert!(
        spent < Duration::from_secs(5),
        "a diff of {NAMES} names took {spent:?} of CPU"
    );
}
