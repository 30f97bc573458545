//! What the gateway's DNS told the cell, kept for the decisions that come after: the name each
//! handed-out address was resolved from, and the addresses of names looked up for connections.

use std::collections::HashMap;
use std::net::IpAddr;

use crate::host::Host;

/// Addresses the gateway's DNS handed out, with the name each was resolved from (the latest,
/// where names share an address): a redirected connection that names no host is decided by
/// it. Bounded: past [`MAX_ANSWERED`] addresses, the quarter answered longest ago is forgotten
/// (a connection to a forgotten address is decided on the address alone, which only refuses
/// more).
#[derive(Debug, Default)]
pub(crate) struct Answered {
    names: HashMap<IpAddr, (Host, u64)>,
    clock: u64,
}

pub(crate) const MAX_ANSWERED: usize = 4096;

impl Answered {
    pub(crate) fn insert(&mut self, ip: IpAddr, host: &Host) {
        self.clock += 1;
        self.names.insert(ip, (host.clone(), self.clock));
        if self.names.len() > MAX_ANSWERED {
            let mut ages: Vec<u64> = self.names.values().map(|(_, at)| *at).collect();
            let (_, cutoff, _) = ages.select_nth_unstable(MAX_ANSWERED / 4);
            let cutoff = *cutoff;
            self.names.retain(|_, (_, at)| *at > cutoff);
        }
    }

    pub(crate) fn get(&self, ip: IpAddr) -> Option<Host> {
        self.names.get(&ip).map(|(host, _)| host.clone())
    }
}

/// Names the gateway looked up for connections the rules allowed, with the usable addresses
/// the lookup gave: what the cell's DNS answers for names under rules with `dns: connected`.
/// Bounded like [`Answered`].
#[derive(Debug, Default)]
pub(crate) struct LookedUp {
    names: HashMap<String, (Vec<IpAddr>, u64)>,
    clock: u64,
}

impl LookedUp {
    pub(crate) fn insert(&mut self, name: &str, addresses: Vec<IpAddr>) {
        self.clock += 1;
        self.names.insert(name.to_owned(), (addresses, self.clock));
        if self.names.len() > MAX_ANSWERED {
            let mut ages: Vec<u64> = self.names.values().map(|(_, at)| *at).collect();
            let (_, cutoff, _) = ages.select_nth_unstable(MAX_ANSWERED / 4);
            let cutoff = *cutoff;
            self.names.retain(|_, (_, at)| *at > cutoff);
        }
    }

    pub(crate) fn get(&self, name: &str) -> Option<Vec<IpAddr>> {
        self.names.get(name).map(|(addresses, _)| addresses.clone())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn the_answered_addresses_are_bounded_and_the_latest_kept() {
        let mut answered = Answered::default();
        let host = |i: u32| Host::parse(&format!("h{i}.test")).unwrap();
        let ip = |i: u32| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
        for i in 0..(MAX_ANSWERED as u32 * 3) {
            answered.insert(ip(i), &host(i));
            assert!(answered.names.len() <= MAX_ANSWERED);
        }
        let last = MAX_ANSWERED as u32 * 3 - 1;
        assert_eq!(answered.get(ip(last)), Some(host(last)));
        assert_eq!(answered.get(ip(0)), None);
        // An address answered again counts as new.
        answered.insert(ip(last - 100), &host(7));
        assert_eq!(answered.get(ip(last - 100)), Some(host(7)));
    }
}
