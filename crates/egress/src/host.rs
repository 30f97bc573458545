//! Destination hosts as the cell writes them, normalized or refused: one spelling per host, so
//! that rules cannot be dodged with case, a trailing dot, userinfo or odd IP notations.

use std::net::IpAddr;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    Name(String),
    Ip(IpAddr),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error("`{0}` carries user information (`user@host`), which the gateway refuses")]
    UserInfo(String),
    #[error("`{0}` is not a valid host name")]
    Invalid(String),
    #[error(
        "`{0}` is an IP address in a non-canonical notation (decimal, octal or hex); write it as dotted decimal"
    )]
    NumericForm(String),
}

impl Host {
    /// Parses the host part of a request target (no port).
    pub fn parse(raw: &str) -> Result<Self, HostError> {
        if raw.contains('@') {
            return Err(HostError::UserInfo(raw.to_owned()));
        }
        let trimmed = raw
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .unwrap_or(raw);
        if let Ok(ip) = trimmed.parse::<IpAddr>() {
            // `::ffff:a.b.c.d` is the IPv4 address a.b.c.d: one spelling, so that a rule
            // naming the IPv4 address also decides its mapped form.
            return Ok(Self::Ip(ip.to_canonical()));
        }
        let name = trimmed
            .strip_suffix('.')
            .unwrap_or(trimmed)
            .to_ascii_lowercase();
        let labels_ok = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if !labels_ok {
            return Err(HostError::Invalid(raw.to_owned()));
        }
        // inet_aton would read `2130706433`, `0x7f.1` or `0177.0.0.1` as 127.0.0.1.
        let numeric = name
            .split('.')
            .all(|l| l.bytes().all(|b| b.is_ascii_hexdigit() || b == b'x'))
            && name
                .split('.')
                .any(|l| l.bytes().all(|b| b.is_ascii_digit()) || l.starts_with("0x"));
        if numeric
            && name
                .split('.')
                .next_back()
                .is_some_and(|l| l.bytes().next().is_some_and(|b| b.is_ascii_digit()))
        {
            return Err(HostError::NumericForm(raw.to_owned()));
        }
        Ok(Self::Name(name))
    }

    pub fn as_text(&self) -> String {
        match self {
            Self::Name(name) => name.clone(),
            Self::Ip(ip) => ip.to_string(),
        }
    }
}

/// Splits `host:port` (with `[v6]:port`); the port defaults to `default`.
pub fn split_authority(authority: &str, default: u16) -> Result<(Host, u16), HostError> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (inside, after) = rest
            .split_once(']')
            .ok_or_else(|| HostError::Invalid(authority.to_owned()))?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(HostError::Invalid(authority.to_owned())),
        };
        (format!("[{inside}]"), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (authority.to_owned(), None),
        }
    };
    let port = match port {
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| HostError::Invalid(authority.to_owned()))?,
        None => default,
    };
    Ok((Host::parse(&host)?, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_spelling_per_host() {
        assert_eq!(Host::parse("PyPI.org."), Ok(Host::Name("pypi.org".into())));
        assert_eq!(
            Host::parse("127.0.0.1"),
            Ok(Host::Ip("127.0.0.1".parse().unwrap()))
        );
        assert_eq!(Host::parse("[::1]"), Ok(Host::Ip("::1".parse().unwrap())));
        assert_eq!(
            Host::parse("[::ffff:198.51.100.7]"),
            Ok(Host::Ip("198.51.100.7".parse().unwrap()))
        );
        assert_eq!(
            Host::parse("[::FFFF:c633:6407]"),
            Ok(Host::Ip("198.51.100.7".parse().unwrap()))
        );
    }

    #[test]
    fn tricks_are_refused() {
        assert!(matches!(
            Host::parse("allowed.org@denied.org"),
            Err(HostError::UserInfo(_))
        ));
        for form in ["2130706433", "0x7f.1", "0177.0.0.1", "127.1", "0x7f000001"] {
            assert!(
                matches!(Host::parse(form), Err(HostError::NumericForm(_))),
                "{form}"
            );
        }
        assert!(matches!(
            Host::parse("bad_host"),
            Err(HostError::Invalid(_))
        ));
        assert!(Host::parse("a1.example.com").is_ok());
        assert!(Host::parse("cafe.example").is_ok());
    }

    #[test]
    fn authorities_split_with_default_ports() {
        assert_eq!(
            split_authority("x.org:8080", 80),
            Ok((Host::Name("x.org".into()), 8080))
        );
        assert_eq!(
            split_authority("x.org", 443),
            Ok((Host::Name("x.org".into()), 443))
        );
        assert_eq!(
            split_authority("[::1]:22", 80),
            Ok((Host::Ip("::1".parse().unwrap()), 22))
        );
        assert!(split_authority("x.org:0", 80).is_err());
    }
}
