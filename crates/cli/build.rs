//! Links the `warden` binary with the functions a `warden run` executes placed together at the
//! start of its code (`startup.order`, made by `order-startup`, `bench/src/order.rs`). A process
//! maps the binary's code 64 KiB around each page it first touches, and unmaps every page mapped
//! again at its exit: scattered over the binary's 17 MiB of code, a run's functions had it map
//! 6.3 MiB of it; together, 1.9 MiB (`warden run -- true` 0.29 ms faster, interleaved).
//!
//! It also spares the dynamic loader work at every start: the unwinder is linked in
//! (`libgcc_eh.a`) rather than loaded (`libgcc_s.so.1`, whose constructor asks the CPU's
//! features with `cpuid`, which traps to the hypervisor in a VM), and the relative relocations
//! are packed (`DT_RELR`: 6 KiB for the loader to read where they took 500 KiB) where the C
//! library knows them (glibc 2.36 and later). With `main.rs`'s own `pow`, the binary loads the
//! C library alone: `warden --version` 1.23 against 1.49 ms (`perf stat -r 400`, interleaved).

use std::env;

fn main() {
    println!("cargo:rerun-if-changed=startup.order");
    println!("cargo:rerun-if-env-changed=WARDEN_NO_STARTUP_ORDER");
    // The ordering file and the packing are options of LLD, the linker Rust uses for this
    // target; a linker of one's own (`target.<triple>.linker`, `-C linker`) may not know them.
    let target = env::var("TARGET").unwrap_or_default();
    let own_linker = env::var_os("RUSTC_LINKER").is_some()
        || env::var("CARGO_ENCODED_RUSTFLAGS").is_ok_and(|flags| flags.contains("linker"));
    if target != "x86_64-unknown-linux-gnu" || own_linker {
        return;
    }
    println!("cargo:rustc-link-lib=static:-bundle=gcc_eh");
    if env::var("HOST").is_ok_and(|host| host == target) && glibc_knows_packed_relocations() {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    if env::var_os("WARDEN_NO_STARTUP_ORDER").is_some() {
        return;
    }
    let Some(dir) = env::var_os("CARGO_MANIFEST_DIR") else {
        return;
    };
    let order = std::path::Path::new(&dir).join("startup.order");
    println!(
        "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
        order.display()
    );
    // Names the build no longer has (renamed, inlined) are skipped quietly.
    println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
}

/// Whether this host's C library (the one the binary will load: it is built for this host)
/// reads packed relative relocations: glibc 2.36 and later. An older one refuses to load a
/// binary that has them.
fn glibc_knows_packed_relocations() -> bool {
    let Ok(out) = std::process::Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
    else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut version = text
        .trim()
        .strip_prefix("glibc ")
        .unwrap_or_default()
        .split('.')
        .map(|part| part.parse::<u32>().unwrap_or(0));
    let (major, minor) = (version.next().unwrap_or(0), version.next().unwrap_or(0));
    out.status.success() && (major, minor) >= (2, 36)
}
