//! The end-to-end tests' helpers: Warden's test kit (`crates/testkit`), driving this crate's
//! `warden` binary.
#![allow(unused_imports, dead_code)]

pub use warden_testkit::*;

/// The binary cargo built for these tests (the kit finds the same one).
pub const BIN: &str = env!("CARGO_BIN_EXE_warden");
