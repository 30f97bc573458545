//! The tier boundary holds: no crate above this one names a tier's module. The tiers are
//! private modules (an import of one does not compile); this test also fails on the text of
//! such a path anywhere in the workspace's other crates (sources, tests, benches), so that the
//! boundary cannot be opened again by making a tier public without notice.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::path::{Path, PathBuf};

/// Module paths of the tiers, as another crate would have to write them.
const TIER_PATHS: &[&str] = &[
    "warden_cell::process",
    "warden_cell::linux",
    "warden_cell::gvisor",
    "warden_cell::microvm",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_crate_above_the_cell_crate_names_a_tier_module() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&crates).unwrap().flatten() {
        if entry.file_name() != "cell" {
            rust_files(&entry.path(), &mut files);
        }
    }
    assert!(
        files.len() > 20,
        "the workspace's sources were found: {}",
        files.len()
    );
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        // `use warden_cell::{a, process::b}` as well as `warden_cell::process::b`.
        let flat: String = text.split_whitespace().collect();
        for tier in TIER_PATHS {
            let module = tier.trim_start_matches("warden_cell::");
            let nested = [format!(",{module}::"), format!("{{{module}::")];
            let names = flat.contains(tier)
                || flat.split("warden_cell::{").skip(1).any(|after| {
                    let group = after.split(';').next().unwrap_or_default();
                    nested.iter().any(|n| group.contains(n.as_str()))
                });
            if names {
                found.push(format!("{} names {tier}", file.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the tier boundary is crossed:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_tiers_are_private_modules() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    for line in lib.lines().map(str::trim) {
        assert!(
            !line.starts_with("pub mod process"),
            "the process tier is public: {line}"
        );
    }
    assert!(
        lib.lines().any(|l| l.trim() == "mod process;"),
        "the process tier is a private module"
    );
}
