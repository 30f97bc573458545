//! What the `warden` binary asks of the dynamic loader at every start (`build.rs`): each
//! library it loads is a file opened and mapped, its symbols looked up and its constructors run,
//! before `main`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

use std::process::Command;

/// The binary's dynamic section, as `readelf -d` prints it.
fn dynamic_section() -> String {
    let out = Command::new("readelf")
        .args(["-d", env!("CARGO_BIN_EXE_warden")])
        .output()
        .expect("readelf (binutils) runs");
    assert!(out.status.success(), "readelf: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The C library alone (beside the loader itself, which a build without optimisations names for
/// its thread-local storage): the unwinder is linked in, not `libgcc_s.so.1`, and the one
/// function of `libm.so.6` the program calls is its own (`main.rs`). A dependency that calls
/// another function of either library brings that library back, and this fails.
#[test]
#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
fn the_binary_loads_the_c_library_alone() {
    let dynamic = dynamic_section();
    let needed: Vec<&str> = dynamic
        .lines()
        .filter(|line| line.contains("(NEEDED)"))
        .filter_map(|line| line.split('[').nth(1)?.split(']').next())
        .filter(|library| !library.starts_with("ld-linux"))
        .collect();
    assert_eq!(needed, ["libc.so.6"], "{dynamic}");
}

/// Its relative relocations are packed (`DT_RELR`) where the C library reads them, so that the
/// loader reads a few KiB of them rather than half a MiB.
#[test]
#[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
fn the_binarys_relative_relocations_are_packed() {
    let version = Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&version.stdout);
    let Some((major, minor)) = version.trim().strip_prefix("glibc ").and_then(|v| {
        let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        Some((parts.next()?, parts.next()?))
    }) else {
        panic!("no glibc version: {version:?}");
    };
    let dynamic = dynamic_section();
    let packed = dynamic.contains("(RELR)");
    assert_eq!(
        packed,
        (major, minor) >= (2, 36),
        "glibc {major}.{minor}: {dynamic}"
    );
}
