//! Where a connection that nftables redirected to the gateway was going.

use std::net::{SocketAddr, TcpStream};

/// Where a redirected connection was going before nftables sent it to the gateway; `ipv6`: the
/// connection's family (its listener's, known once, where each connection's own address was
/// looked up for it).
pub(crate) fn original_destination(conn: &TcpStream, ipv6: bool) -> Option<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    if ipv6 {
        let original = getsockopt(conn, sockopt::Ip6tOriginalDst).ok()?;
        let ip = Ipv6Addr::from(original.sin6_addr.s6_addr);
        Some(SocketAddr::new(
            IpAddr::V6(ip),
            u16::from_be(original.sin6_port),
        ))
    } else {
        let original = getsockopt(conn, sockopt::OriginalDst).ok()?;
        let ip = Ipv4Addr::from(u32::from_be(original.sin_addr.s_addr));
        Some(SocketAddr::new(
            IpAddr::V4(ip),
            u16::from_be(original.sin_port),
        ))
    }
}
