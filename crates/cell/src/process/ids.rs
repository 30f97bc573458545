//! User and group id mapping of a cell's user namespace.
//!
//! No id inside a cell maps to host root. Started by root, a cell gets a block of 65536 host ids
//! starting at [`ROOT_MODE_BASE`]; started by an ordinary user, the cell's user maps to that user
//! (the only mapping the kernel lets an unprivileged process write).

use std::fmt::Write as _;

/// First host id of the block that root-started cells use (inside id 0 maps here).
pub const ROOT_MODE_BASE: u32 = 2_000_000_000;
/// Size of that block.
pub const ROOT_MODE_COUNT: u32 = 65536;
/// First of the host uids that own root-started cells' user namespaces, one picked per cell by
/// its name: no process runs as any of them, and none is in a cell's mapping. The kernel counts
/// what is limited per user (inotify instances and watches, fanotify groups and marks) to the
/// namespace's owner too, in the host's namespace: owned by root, every cell's inotify instances
/// were root's, and one cell holding 128 left host root (the warden included) none.
pub const OWNER_BASE: u32 = ROOT_MODE_BASE + ROOT_MODE_COUNT;
/// How many owner uids there are to pick from.
pub const OWNER_COUNT: u32 = 1 << 20;

/// The host uid that owns the user namespace of the root-started cell `name`.
pub fn namespace_owner(name: &str) -> u32 {
    // FNV-1a: stable across builds, spread enough that two cells rarely share an owner.
    let hash = name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    OWNER_BASE + hash % OWNER_COUNT
}

/// One cell's id mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdMapping {
    /// Whether the warden runs as host root (and can map a range).
    pub privileged: bool,
    /// The cell's user and group inside.
    pub inside_uid: u32,
    pub inside_gid: u32,
    /// The caller's host ids (used for the rootless single-id mapping).
    pub host_uid: u32,
    pub host_gid: u32,
}

impl IdMapping {
    /// Text for `/proc/PID/uid_map`.
    pub fn uid_map(&self) -> String {
        self.map(self.inside_uid, self.host_uid)
    }

    /// Text for `/proc/PID/gid_map`.
    pub fn gid_map(&self) -> String {
        self.map(self.inside_gid, self.host_gid)
    }

    fn map(&self, inside: u32, host: u32) -> String {
        let mut out = String::new();
        if self.privileged {
            let _ = writeln!(out, "0 {ROOT_MODE_BASE} {ROOT_MODE_COUNT}");
        } else {
            let _ = writeln!(out, "{inside} {host} 1");
        }
        out
    }

    /// The host uid that the cell's user runs as.
    pub fn host_uid_of_cell_user(&self) -> u32 {
        if self.privileged {
            ROOT_MODE_BASE + self.inside_uid
        } else {
            self.host_uid
        }
    }

    /// The host gid that the cell's group runs as.
    pub fn host_gid_of_cell_group(&self) -> u32 {
        if self.privileged {
            ROOT_MODE_BASE + self.inside_gid
        } else {
            self.host_gid
        }
    }

    /// Whether the inside id the setup code runs as before dropping to the cell user is root
    /// (privileged mode) or already the cell user (rootless).
    pub fn setup_uid(&self) -> u32 {
        if self.privileged { 0 } else { self.inside_uid }
    }

    pub fn setup_gid(&self) -> u32 {
        if self.privileged { 0 } else { self.inside_gid }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_mode_never_maps_host_root() {
        let ids = IdMapping {
            privileged: true,
            inside_uid: 1000,
            inside_gid: 1000,
            host_uid: 0,
            host_gid: 0,
        };
        assert_eq!(
            ids.uid_map(),
            format!("0 {ROOT_MODE_BASE} {ROOT_MODE_COUNT}\n")
        );
        assert_eq!(ids.host_uid_of_cell_user(), ROOT_MODE_BASE + 1000);
    }

    #[test]
    fn namespace_owners_are_outside_every_mapping_and_differ_by_name() {
        for name in ["a", "cell-0a1b2c", "dev"] {
            let owner = namespace_owner(name);
            assert!((OWNER_BASE..OWNER_BASE + OWNER_COUNT).contains(&owner));
            assert!(owner >= ROOT_MODE_BASE + ROOT_MODE_COUNT);
        }
        assert_ne!(namespace_owner("a"), namespace_owner("b"));
    }

    #[test]
    fn rootless_maps_only_the_caller() {
        let ids = IdMapping {
            privileged: false,
            inside_uid: 1000,
            inside_gid: 1000,
            host_uid: 4242,
            host_gid: 4243,
        };
        assert_eq!(ids.uid_map(), "1000 4242 1\n");
        assert_eq!(ids.gid_map(), "1000 4243 1\n");
    }
}
