//! The server name of a TLS ClientHello, read from the first bytes a client sends into a tunnel,
//! so that a tunnel opened for one host cannot be used to talk TLS to another.
//!
//! A ClientHello may be split over several TLS records (and a record over several reads): the
//! handshake message is put together from the records' fragments, up to [`MAX_HELLO`] bytes,
//! before it is read. Anything that starts like TLS but is not a well-formed ClientHello is
//! `Malformed`, and the gateway refuses it rather than guess.

/// The largest ClientHello the gateway reads (post-quantum key shares make real ones a few KiB).
pub const MAX_HELLO: usize = 64 * 1024;
/// The most bytes read while looking for it (records in tiny pieces carry 5 bytes of header
/// each); a reader never needs to buffer more.
pub const MAX_INPUT: usize = 2 * MAX_HELLO;

/// What the first bytes of a tunnel say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// Not a TLS handshake (another protocol): nothing to check.
    NotTls,
    /// More bytes are needed to see the whole ClientHello.
    Incomplete,
    /// A ClientHello, with the server name it asks for (if any).
    Tls(Option<String>),
    /// Starts like TLS, but is not a ClientHello the gateway can read (or is larger than
    /// [`MAX_HELLO`]); why.
    Malformed(&'static str),
}

fn u16_at(b: &[u8], i: usize) -> Option<usize> {
    Some(usize::from(*b.get(i)?) << 8 | usize::from(*b.get(i + 1)?))
}

/// Reads the ClientHello at the start of `bytes`, whatever records it is split across.
pub fn client_hello(bytes: &[u8]) -> Hello {
    let Some(&first) = bytes.first() else {
        return Hello::Incomplete;
    };
    if first != 0x16 {
        return Hello::NotTls;
    }
    // The handshake bytes carried by the records seen so far.
    let mut handshake = Vec::new();
    let mut at = 0;
    loop {
        let incomplete = if bytes.len() >= MAX_INPUT {
            Hello::Malformed("the ClientHello is larger than the gateway reads")
        } else {
            Hello::Incomplete
        };
        let Some(header) = bytes.get(at..at + 5) else {
            return incomplete;
        };
        if header[0] != 0x16 {
            return Hello::Malformed("a record inside the ClientHello is not a handshake record");
        }
        if header[1] != 0x03 {
            return Hello::Malformed("the record does not carry a TLS version");
        }
        let length = usize::from(header[3]) << 8 | usize::from(header[4]);
        if length == 0 {
            return Hello::Malformed("an empty handshake record");
        }
        let Some(fragment) = bytes.get(at + 5..at + 5 + length) else {
            return incomplete;
        };
        handshake.extend_from_slice(fragment);
        at += 5 + length;
        if handshake[0] != 1 {
            return Hello::Malformed("the first handshake message is not a ClientHello");
        }
        let Some(message_len) = handshake
            .get(1..4)
            .map(|l| usize::from(l[0]) << 16 | usize::from(l[1]) << 8 | usize::from(l[2]))
        else {
            continue;
        };
        if message_len > MAX_HELLO {
            return Hello::Malformed("the ClientHello is larger than the gateway reads");
        }
        if handshake.len() < 4 + message_len {
            continue;
        }
        return match parse_hello(&handshake[4..4 + message_len]) {
            Some(name) => Hello::Tls(name),
            None => Hello::Malformed("the ClientHello cannot be read"),
        };
    }
}

/// Returns Some(Some(name)) for an SNI, Some(None) for a hello without one, None if malformed.
fn parse_hello(body: &[u8]) -> Option<Option<String>> {
    let mut i = 2 + 32; // client_version, random
    i += 1 + usize::from(*body.get(i)?); // session id
    i += 2 + u16_at(body, i)?; // cipher suites
    i += 1 + usize::from(*body.get(i)?); // compression methods
    if i == body.len() {
        return Some(None); // no extensions at all
    }
    let extensions_end = i + 2 + u16_at(body, i)?;
    if extensions_end != body.len() {
        return None;
    }
    i += 2;
    let mut name = None;
    while i < extensions_end {
        let kind = u16_at(body, i)?;
        let len = u16_at(body, i + 2)?;
        let data = body.get(i + 4..i + 4 + len)?;
        if kind == 0 {
            if name.is_some() {
                return None; // two server_name extensions
            }
            name = Some(server_name(data)?);
        }
        i += 4 + len;
    }
    (i == extensions_end).then_some(name)
}

/// The one host name of a server_name extension: list length, then (type 0, length, name).
fn server_name(data: &[u8]) -> Option<String> {
    let list_len = u16_at(data, 0)?;
    if list_len + 2 != data.len() || *data.get(2)? != 0 {
        return None;
    }
    let name_len = u16_at(data, 3)?;
    if 5 + name_len != data.len() {
        return None; // several names, or trailing bytes
    }
    let name = data.get(5..5 + name_len)?;
    if name.is_empty() || !name.iter().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    Some(String::from_utf8_lossy(name).to_ascii_lowercase())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A ClientHello naming `name`, as one handshake message (no record header).
    fn handshake_with_sni(name: &str) -> Vec<u8> {
        let mut sni = vec![0, 0]; // extension type server_name
        let entry_len = 3 + name.len();
        let ext_len = 2 + entry_len;
        sni.extend_from_slice(&(ext_len as u16).to_be_bytes());
        sni.extend_from_slice(&(entry_len as u16).to_be_bytes());
        sni.push(0);
        sni.extend_from_slice(&(name.len() as u16).to_be_bytes());
        sni.extend_from_slice(name.as_bytes());
        // Padding, as real clients send, to make the hello worth splitting.
        sni.extend_from_slice(&[0, 21, 0, 200]);
        sni.extend_from_slice(&[0u8; 200]);
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
        handshake
    }

    /// `handshake` carried in records of at most `size` bytes each.
    pub(crate) fn in_records(handshake: &[u8], size: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in handshake.chunks(size) {
            out.extend_from_slice(&[0x16, 0x03, 0x01]);
            out.extend_from_slice(&(piece.len() as u16).to_be_bytes());
            out.extend_from_slice(piece);
        }
        out
    }

    pub(crate) fn hello_with_sni(name: &str) -> Vec<u8> {
        in_records(&handshake_with_sni(name), 1 << 14)
    }

    #[test]
    fn reads_the_server_name() {
        let hello = hello_with_sni("Example.COM");
        assert_eq!(client_hello(&hello), Hello::Tls(Some("example.com".into())));
        assert_eq!(client_hello(&hello[..20]), Hello::Incomplete);
        assert_eq!(client_hello(b"SSH-2.0-OpenSSH"), Hello::NotTls);
    }

    #[test]
    fn a_hello_split_across_records_is_put_together() {
        let handshake = handshake_with_sni("denied.example");
        for size in [1, 2, 5, 40, 100] {
            let split = in_records(&handshake, size);
            assert_eq!(
                client_hello(&split),
                Hello::Tls(Some("denied.example".into())),
                "records of {size} bytes"
            );
            // And whatever prefix of it came so far is not taken for a hello without a name.
            for cut in [1, 6, split.len() / 2, split.len() - 1] {
                assert_eq!(
                    client_hello(&split[..cut]),
                    Hello::Incomplete,
                    "cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn malformed_hellos_are_called_so() {
        let handshake = handshake_with_sni("a.example");
        let mut not_handshake = in_records(&handshake, 50);
        not_handshake[55] = 0x17; // the second record is application data
        assert!(matches!(client_hello(&not_handshake), Hello::Malformed(_)));
        let mut server_hello = handshake.clone();
        server_hello[0] = 2;
        assert!(matches!(
            client_hello(&in_records(&server_hello, 1 << 14)),
            Hello::Malformed(_)
        ));
        // The name's length (two bytes before the 9-byte name and the 204 bytes of padding)
        // made longer than the extension.
        let mut overlong_name = handshake.clone();
        let at = overlong_name.len() - 204 - 9 - 2;
        overlong_name[at] = 0x7f;
        assert!(matches!(
            client_hello(&in_records(&overlong_name, 1 << 14)),
            Hello::Malformed(_)
        ));
        // Tiny records without end are not buffered without end.
        let endless = in_records(&[1, 0, 0xff, 0xff], 1).repeat(MAX_INPUT / 20);
        assert!(matches!(client_hello(&endless), Hello::Malformed(_)));
        let mut huge = vec![1, 0x10, 0, 0];
        huge.extend_from_slice(&[0u8; 100]);
        assert!(matches!(
            client_hello(&in_records(&huge, 1 << 14)),
            Hello::Malformed(_)
        ));
    }
}
