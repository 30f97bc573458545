//! The server name of a TLS ClientHello, read from the first bytes a client sends into a tunnel,
//! so that a tunnel opened for one host cannot be used to talk TLS to another.

/// What the first bytes of a tunnel say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// Not a TLS handshake (another protocol): nothing to check.
    NotTls,
    /// More bytes are needed to see the whole ClientHello.
    Incomplete,
    /// A ClientHello, with the server name it asks for (if any).
    Tls(Option<String>),
}

fn u16_at(b: &[u8], i: usize) -> Option<usize> {
    Some(usize::from(*b.get(i)?) << 8 | usize::from(*b.get(i + 1)?))
}

/// Parses the first TLS record of `bytes`.
pub fn client_hello(bytes: &[u8]) -> Hello {
    if bytes.is_empty() {
        return Hello::Incomplete;
    }
    if bytes[0] != 0x16 {
        return Hello::NotTls;
    }
    let Some(record_len) = u16_at(bytes, 3) else {
        return Hello::Incomplete;
    };
    let Some(record) = bytes.get(5..5 + record_len) else {
        return Hello::Incomplete;
    };
    parse_hello(record).map_or(Hello::Tls(None), Hello::Tls)
}

/// Returns Some(Some(name)) for an SNI, Some(None) for a hello without one, None if malformed.
fn parse_hello(r: &[u8]) -> Option<Option<String>> {
    if *r.first()? != 1 {
        return None; // not a ClientHello
    }
    let mut i = 4 + 2 + 32; // handshake header, client_version, random
    i += 1 + usize::from(*r.get(i)?); // session id
    i += 2 + u16_at(r, i)?; // cipher suites
    i += 1 + usize::from(*r.get(i)?); // compression methods
    let extensions_end = i + 2 + u16_at(r, i)?;
    i += 2;
    while i + 4 <= extensions_end {
        let kind = u16_at(r, i)?;
        let len = u16_at(r, i + 2)?;
        let data = r.get(i + 4..i + 4 + len)?;
        if kind == 0 {
            // server_name: list length, then (type 0, length, name)
            let name_len = u16_at(data, 3)?;
            let name = data.get(5..5 + name_len)?;
            return Some(Some(String::from_utf8_lossy(name).to_ascii_lowercase()));
        }
        i += 4 + len;
    }
    Some(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello_with_sni(name: &str) -> Vec<u8> {
        let mut sni = vec![0, 0]; // extension type server_name
        let entry_len = 3 + name.len();
        let ext_len = 2 + entry_len;
        sni.extend_from_slice(&(ext_len as u16).to_be_bytes());
        sni.extend_from_slice(&(entry_len as u16).to_be_bytes());
        sni.push(0);
        sni.extend_from_slice(&(name.len() as u16).to_be_bytes());
        sni.extend_from_slice(name.as_bytes());
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[0u8; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one cipher suite
        body.extend_from_slice(&[1, 0]); // null compression
        body.extend_from_slice(&(sni.len() as u16).to_be_bytes());
        body.extend_from_slice(&sni);
        let mut handshake = vec![1];
        handshake.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        handshake.extend_from_slice(&body);
        let mut record = vec![0x16, 0x03, 0x01];
        record.extend_from_slice(&(handshake.len() as u16).to_be_bytes());
        record.extend_from_slice(&handshake);
        record
    }

    #[test]
    fn reads_the_server_name() {
        let hello = hello_with_sni("Example.COM");
        assert_eq!(client_hello(&hello), Hello::Tls(Some("example.com".into())));
        assert_eq!(client_hello(&hello[..20]), Hello::Incomplete);
        assert_eq!(client_hello(b"SSH-2.0-OpenSSH"), Hello::NotTls);
    }
}
