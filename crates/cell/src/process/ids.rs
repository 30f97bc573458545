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

/// Where the search for a free owner of the root-started cell `name` starts.
pub fn namespace_owner(name: &str) -> u32 {
    // FNV-1a: stable across builds, spread over the owners.
    let hash = name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    OWNER_BASE + hash % OWNER_COUNT
}

/// The most owners tried before a cell is refused for want of a free one: every one (each try
/// is one `bind`, about a microsecond), so that a host process squatting names cannot make a
/// cell fail short of holding a million of them.
const OWNER_TRIES: u32 = OWNER_COUNT;

/// An owner uid that no other live cell of this host has, held until this is dropped.
#[derive(Debug)]
pub struct Owner {
    pub uid: u32,
    /// Bound to the owner's abstract name in the warden's network namespace: the kernel frees
    /// the name when the socket closes (the cell's init closes its copy as it starts).
    _held: std::os::unix::net::UnixDatagram,
}

/// Takes an owner uid for the user namespace of the root-started cell `name`, one that no
/// other live cell of this host holds: the kernel counts inotify instances and watches and
/// fanotify groups and marks to the owner in the host's namespace, so two cells with one owner
/// share those limits, and one holding them all leaves the other none. Names share a hash
/// often enough (even odds that two of ~1,200 cells do; a name can be picked to match
/// another's), so the hash is only where the search starts; the owners taken are held
/// as abstract socket names, which every warden process of the host (daemons of any runtime
/// directory, `warden run`) sees and the kernel lets go of with their holder.
pub fn reserve_owner(name: &str) -> std::io::Result<Owner> {
    use std::os::linux::net::SocketAddrExt as _;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    // An odd stride visits every owner once: a run of owners held by others (or squatted by
    // a host process that bound their names) is stepped over, not searched through.
    const STRIDE: u32 = 0x0009_e379;
    let start = namespace_owner(name) - OWNER_BASE;
    for i in 0..OWNER_TRIES {
        let uid = OWNER_BASE + (start.wrapping_add(i.wrapping_mul(STRIDE))) % OWNER_COUNT;
        let address = SocketAddr::from_abstract_name(format!("warden/cell-owner/{uid}"))?;
        match UnixDatagram::bind_addr(&address) {
            Ok(held) => return Ok(Owner { uid, _held: held }),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!(
        "no free owner uid for the cell's user namespace: {OWNER_TRIES} tried, each held by another cell of this host (or a process that bound its name)"
    )))
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
    fn two_cells_whose_names_share_a_hash_get_owners_of_their_own() {
        // FNV-1a of these two is equal modulo 2^20.
        assert_eq!(namespace_owner("victim"), namespace_owner("hog-1444514"));
        let first = reserve_owner("victim").unwrap();
        let second = reserve_owner("hog-1444514").unwrap();
        assert_ne!(first.uid, second.uid);
        assert!((OWNER_BASE..OWNER_BASE + OWNER_COUNT).contains(&second.uid));
        // Let go of, an owner is free again.
        let uid = first.uid;
        drop(first);
        assert_eq!(reserve_owner("victim").unwrap().uid, uid);
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
