//! The microVM tier, planned: what it will need of this host (KVM and a VMM), for `warden
//! doctor`. No cell of it can be made yet; `tiers::backend` refuses it with what to use.

use std::path::PathBuf;

use crate::check::{Check, Status};

/// What the planned microVM tier will need: KVM and a VMM.
pub(crate) fn checks() -> Vec<Check> {
    let kvm = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => Check::new(
            "microvm",
            "kvm",
            Status::Ok,
            "/dev/kvm is usable".to_owned(),
            None,
        ),
        Err(err) => Check::new(
            "microvm",
            "kvm",
            Status::Missing,
            format!("/dev/kvm: {err}"),
            Some(
                "enable virtualization and load kvm_intel or kvm_amd; add the user to the kvm group",
            ),
        ),
    };
    let vmm = match which("qemu-system-x86_64")
        .or_else(|| which("firecracker"))
        .or_else(|| which("cloud-hypervisor"))
    {
        Some(path) => Check::new(
            "microvm",
            "vmm",
            Status::Ok,
            path.display().to_string(),
            None,
        ),
        None => Check::new(
            "microvm",
            "vmm",
            Status::Missing,
            "no VMM found".to_owned(),
            Some("apt-get install qemu-system-x86"),
        ),
    };
    vec![kvm, vmm]
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}
