//! Links the `warden` binary with the functions a `warden run` executes placed together at the
//! start of its code (`startup.order`, made by `order-startup`, `bench/src/order.rs`). A process
//! maps the binary's code 64 KiB around each page it first touches, and unmaps every page mapped
//! again at its exit: scattered over the binary's 17 MiB of code, a run's functions had it map
//! 6.3 MiB of it; together, 1.9 MiB (`warden run -- true` 0.29 ms faster, interleaved).

use std::env;

fn main() {
    println!("cargo:rerun-if-changed=startup.order");
    println!("cargo:rerun-if-env-changed=WARDEN_NO_STARTUP_ORDER");
    // The ordering file is an option of LLD, the linker Rust uses for this target; a linker of
    // one's own (`target.<triple>.linker`, `-C linker`) may not know it.
    let target = env::var("TARGET").unwrap_or_default();
    let own_linker = env::var_os("RUSTC_LINKER").is_some()
        || env::var("CARGO_ENCODED_RUSTFLAGS").is_ok_and(|flags| flags.contains("linker"));
    if target != "x86_64-unknown-linux-gnu"
        || own_linker
        || env::var_os("WARDEN_NO_STARTUP_ORDER").is_some()
    {
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
