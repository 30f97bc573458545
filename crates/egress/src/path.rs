//! Request targets as the gateway decides on them and forwards them: one spelling per path, so
//! that a `paths` rule cannot be dodged with dot-segments or percent-encoding, and the upstream
//! receives exactly the path that was decided.
//!
//! The path is normalised once: percent-encoded unreserved characters are decoded (`%7E` is
//! `~`), other percent-encodings are written in upper case, and dot-segments are removed as RFC
//! 3986 (5.2.4) says, counting `%2e` as a dot. What servers read in different ways is refused
//! rather than guessed at: an encoded `/` or `\` (`%2f`, `%5c`), a raw `\`, an encoded NUL, an
//! encoded `%` (`%25`, read twice by some servers), a dot-segment that would climb above the
//! root, dot-segments next to empty segments (`//..`, which servers that merge slashes read
//! differently), and segments such as `..;x` that some servers read as `..` with a parameter.

/// A target taken apart: the normalised path (what rules match) and what is forwarded (the
/// same path, then the query as sent; never a fragment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub path: String,
    pub forwarded: String,
}

/// Why a target was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the request path `{shown}` is ambiguous: {why}")]
pub struct PathError {
    shown: String,
    why: &'static str,
}

/// Normalises an origin-form target (`/a/b?q`).
pub fn normalize(target: &str) -> Result<Target, PathError> {
    let refuse = |why| PathError {
        shown: target.chars().take(200).collect(),
        why,
    };
    let without_fragment = target.split('#').next().unwrap_or("");
    let (raw_path, query) = match without_fragment.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (without_fragment, None),
    };
    if !raw_path.starts_with('/') {
        return Err(refuse("it does not start with `/`"));
    }
    if raw_path.contains('\\') {
        return Err(refuse("it contains `\\`, which some servers read as `/`"));
    }
    let mut segments: Vec<String> = Vec::new();
    let mut dots = false;
    let mut empty = false;
    // The first segment is the empty one before the leading `/`.
    for raw in raw_path[1..].split('/') {
        let segment = decode_segment(raw).map_err(refuse)?;
        match segment.as_str() {
            "." => dots = true,
            ".." => {
                dots = true;
                if segments.pop().is_none() {
                    return Err(refuse("a `..` segment climbs above the root"));
                }
            }
            other => {
                if other.starts_with("..;") || other.starts_with(".;") {
                    return Err(refuse(
                        "a dot-segment carries a parameter (`..;`), which some servers read as `..`",
                    ));
                }
                empty |= other.is_empty();
                segments.push(segment);
            }
        }
    }
    if dots && empty {
        return Err(refuse(
            "it mixes dot-segments with empty segments (`//`), which servers that merge slashes read differently",
        ));
    }
    // A trailing dot-segment leaves a directory: `/a/b/..` is `/a/`.
    let trailing = raw_path.ends_with("/.")
        || raw_path.ends_with("/..")
        || raw_path.ends_with("/%2e")
        || raw_path.ends_with("/%2E")
        || raw_path.ends_with("/%2e%2e")
        || raw_path.ends_with("/%2E%2E");
    let mut path = String::with_capacity(raw_path.len());
    for segment in &segments {
        path.push('/');
        path.push_str(segment);
    }
    if path.is_empty() || (trailing && !path.ends_with('/')) {
        path.push('/');
    }
    let forwarded = match query {
        Some(query) => format!("{path}?{query}"),
        None => path.clone(),
    };
    Ok(Target { path, forwarded })
}

/// Decodes the percent-encodings of one segment that stand for unreserved characters, and
/// upper-cases the others; refuses the ones servers read differently.
fn decode_segment(raw: &str) -> Result<String, &'static str> {
    let bytes = raw.as_bytes();
    // Bytes, not chars: a character of several bytes (`é`) goes on as the same bytes, where
    // each byte taken as a char of its own would write it twice encoded (`Ã©`), C1 controls
    // among them.
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte != b'%' {
            out.push(byte);
            i += 1;
            continue;
        }
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .ok_or("a `%` is not followed by two hex digits")?;
        match hex {
            b'/' => return Err("it contains `%2f`, an encoded `/`"),
            b'\\' => return Err("it contains `%5c`, an encoded `\\`"),
            0 => return Err("it contains `%00`, an encoded NUL"),
            b'%' => return Err("it contains `%25`, an encoded `%` that some servers decode again"),
            b if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') => {
                out.push(b);
            }
            b => out.extend_from_slice(format!("%{b:02X}").as_bytes()),
        }
        i += 3;
    }
    // Whole characters of `raw` and ASCII in place of its `%XX`: still UTF-8.
    String::from_utf8(out).map_err(|_| "it is not UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(target: &str) -> String {
        normalize(target).unwrap().path
    }

    #[test]
    fn dot_segments_and_encodings_have_one_spelling() {
        assert_eq!(path("/public/x"), "/public/x");
        assert_eq!(path("/public/../private/x"), "/private/x");
        assert_eq!(path("/public/%2e%2e/private/x"), "/private/x");
        assert_eq!(path("/public/%2E%2e/private/x"), "/private/x");
        assert_eq!(path("/public/./x"), "/public/x");
        assert_eq!(path("/public/%7euser"), "/public/~user");
        assert_eq!(path("/a%20b/%c3%a9"), "/a%20b/%C3%A9");
        // A character of several bytes goes on as its own bytes, not each byte encoded again.
        assert_eq!(path("/caf\u{e9}/x"), "/caf\u{e9}/x");
        assert_eq!(path("/a\u{9b}2K"), "/a\u{9b}2K");
        assert_eq!(path("/a/b/.."), "/a/");
        assert_eq!(path("/a/b/%2e"), "/a/b/");
        assert_eq!(path("/"), "/");
        assert_eq!(path("/a//b"), "/a//b");
        let target = normalize("/public/../private/x?q=1&r=/../y#frag").unwrap();
        assert_eq!(target.forwarded, "/private/x?q=1&r=/../y");
    }

    #[test]
    fn what_servers_read_differently_is_refused() {
        for bad in [
            "/public/..%2fprivate/x",
            "/public/..%2Fprivate/x",
            "/public/..%5cprivate",
            "/public/..\\private",
            "/public/%252e%252e/private",
            "/public/%00",
            "/..",
            "/public/../../etc",
            "/public/..;/private",
            "/public/.;x/private",
            "/public//../private",
            "/public/%zz",
            "public/x",
        ] {
            assert!(normalize(bad).is_err(), "{bad} was accepted");
        }
    }
}
