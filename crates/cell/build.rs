//! Builds the two small programs the gVisor tier puts into its cells (see `gvisor-compat/`):
//! a static init and a preloaded compatibility shim. They are compiled with the same `rustc`
//! as the crate and embedded into it, so the `warden` binary stays the only file to install.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let target = std::env::var("TARGET").unwrap_or_default();
    let host = std::env::var("HOST").unwrap_or_default();
    let compat = Path::new("gvisor-compat");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=gvisor-compat");
    if !target.contains("linux") {
        // Only Linux has a gVisor tier: empty stand-ins keep the crate building elsewhere.
        for name in [
            "warden-gvisor-init",
            "warden-gvisor-statx.so",
            "warden-gvisor-statx-ro.so",
        ] {
            if let Err(e) = std::fs::write(out.join(name), b"") {
                panic!("writing {name}: {e}");
            }
        }
        return;
    }
    let run = |source: &str, output: &str, extra: &[&str]| {
        let mut command = Command::new(&rustc);
        command
            .arg("--edition=2024")
            .args([
                "-C",
                "opt-level=s",
                "-C",
                "panic=abort",
                "-C",
                "strip=symbols",
            ])
            .args(extra)
            .arg(compat.join(source))
            .arg("-o")
            .arg(out.join(output));
        if target != host {
            command.args(["--target", &target]);
        }
        command.status()
    };
    let build = |source: &str, output: &str, extra: &[&str]| match run(source, output, extra) {
        Ok(status) if status.success() => {}
        Ok(status) => panic!("building {source} for the gVisor tier: rustc exited with {status}"),
        Err(e) => panic!("building {source} for the gVisor tier: starting rustc: {e}"),
    };
    // Static, without a C library, linked at a fixed address: it runs in images that have no
    // C library of the host's kind, and its start in a sandbox is a few page faults (see its
    // top).
    build(
        "init.rs",
        "warden-gvisor-init",
        &[
            "-C",
            "target-feature=+crt-static",
            "-C",
            "relocation-model=static",
            "-C",
            "link-arg=-nostartfiles",
            "-C",
            "link-arg=-nostdlib",
        ],
    );
    // Loaded by every dynamic program in a cell, where each mapping and page fault is a trip
    // through gVisor's platform: no C start files (no constructors, destructors or their
    // sections to map and run) and its code in the same segment as its read-only data, so it is
    // one segment of code and one of data (four otherwise). `--no-rosegment` is lld's, the
    // linker this toolchain uses; with another, the shim is linked as a plain shared object.
    let lean = [
        "--crate-type=cdylib",
        "-C",
        "link-arg=-nostartfiles",
        "-C",
        "link-arg=-Wl,--no-rosegment",
    ];
    if !run("statx.rs", "warden-gvisor-statx.so", &lean).is_ok_and(|s| s.success()) {
        build(
            "statx.rs",
            "warden-gvisor-statx.so",
            &["--crate-type=cdylib"],
        );
    }
    // The same shim laid out for a C library that leaves a read-only dynamic section as it is
    // (glibc 2.35 and later): every byte it maps from its file is in one read-only segment, and
    // what the loader writes (the two addresses it looks up) is in a segment with no bytes in
    // the file, so no page of the file is ever copied on write. In a gVisor sandbox each page
    // of a file a process first touches, and each page it copies, is a costly fault; see
    // `gvisor-compat/statx.ld`. Where that cannot be linked, the plain layout stands in.
    let script = compat.join("statx.ld");
    let script = std::fs::canonicalize(&script).unwrap_or(script);
    let mut script_arg = std::ffi::OsString::from("link-arg=-Wl,-T,");
    script_arg.push(&script);
    let Some(script_arg) = script_arg.to_str() else {
        panic!("the path of {} is not UTF-8", script.display())
    };
    let one_page = [
        "--crate-type=cdylib",
        "-C",
        "link-arg=-nostartfiles",
        "-C",
        script_arg,
    ];
    if !run("statx.rs", "warden-gvisor-statx-ro.so", &one_page).is_ok_and(|s| s.success())
        && let Err(e) = std::fs::copy(
            out.join("warden-gvisor-statx.so"),
            out.join("warden-gvisor-statx-ro.so"),
        )
    {
        panic!("copying the gVisor statx shim: {e}");
    }
}
