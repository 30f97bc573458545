//! Reading a policy from YAML, with errors that point at the offending line and column.

use std::path::{Path, PathBuf};

use crate::model::Policy;

/// Why a policy could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot read policy {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}:{line}:{column}: {message}")]
    Syntax {
        origin: String,
        line: u64,
        column: u64,
        message: String,
    },
    #[error("{origin}: {message}")]
    Unlocated { origin: String, message: String },
    #[error("{origin}: {field}: {message}")]
    Invalid {
        origin: String,
        field: &'static str,
        message: String,
    },
    #[error("unknown preset `{name}`; the built-in presets are: {known}")]
    UnknownPreset { name: String, known: String },
}

/// The most of a policy file that is read: far more than any policy needs, and a bound on what
/// a file that never ends (a pipe fed without end) costs.
const MAX_POLICY_BYTES: u64 = 1 << 20;

/// Reads and validates a policy file.
pub fn from_file(path: &Path) -> Result<Policy, PolicyError> {
    let text = read_policy(path).map_err(|source| PolicyError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    from_yaml(&path.display().to_string(), &text)
}

/// A policy file's text: a regular file (or a pipe, as `--policy <(...)` gives) of UTF-8 text,
/// at most `MAX_POLICY_BYTES`; a directory, a device (`/dev/zero` would be read without end) or
/// a socket is refused before it is opened.
fn read_policy(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    use std::os::unix::fs::FileTypeExt as _;
    let unusable = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    let kind = std::fs::metadata(path)?.file_type();
    if kind.is_dir() {
        return Err(unusable(
            "it is a directory; give the path of a YAML policy file".to_owned(),
        ));
    }
    if !kind.is_file() && !kind.is_fifo() {
        return Err(unusable(
            "it is a device or a socket, not a file; give the path of a YAML policy file"
                .to_owned(),
        ));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_POLICY_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_POLICY_BYTES {
        return Err(unusable(format!(
            "it is larger than the {} MiB a policy may be; is it the policy file?",
            MAX_POLICY_BYTES >> 20
        )));
    }
    String::from_utf8(bytes).map_err(|err| {
        unusable(format!(
            "it is not UTF-8 text (from byte offset {} on); a policy is a YAML text file",
            err.utf8_error().valid_up_to()
        ))
    })
}

/// The preset a policy document builds on (its `extends:`), if it parses.
pub fn extended_preset(text: &str) -> Option<String> {
    serde_saphyr::from_str::<Policy>(text).ok()?.extends
}

/// Parses and validates policy text; `origin` names the source in error messages.
pub fn from_yaml(origin: &str, text: &str) -> Result<Policy, PolicyError> {
    // The document alone first: its own mistakes are reported with their line and column.
    let policy: Policy = serde_saphyr::from_str(text).map_err(|err| syntax_error(origin, &err))?;
    let policy = match &policy.extends {
        Some(base) => compose(origin, base, text)?,
        None if policy.remove.is_some() => {
            return Err(PolicyError::Unlocated {
                origin: origin.to_owned(),
                message: "`remove` takes entries out of a preset: it needs `extends: PRESET`"
                    .to_owned(),
            });
        }
        None => policy,
    };
    let policy = match policy.image.is_some() {
        true => own_over_image(origin, text, policy)?,
        false => policy,
    };
    validate(origin, &policy)?;
    Ok(policy)
}

/// With an image as the root: the host directories, links and variables of the presets give
/// way to the image; only what the document names itself stays.
fn own_over_image(origin: &str, text: &str, mut policy: Policy) -> Result<Policy, PolicyError> {
    let document: serde_json::Value =
        serde_saphyr::from_str(text).map_err(|err| syntax_error(origin, &err))?;
    let own = |path: &[&str]| {
        let mut at = &document;
        for key in path {
            at = at.get(key).unwrap_or(&serde_json::Value::Null);
        }
        at.clone()
    };
    // The document was read whole already: these parts of it parse.
    policy.filesystem.read_only =
        serde_json::from_value(own(&["filesystem", "read_only"])).unwrap_or_default();
    policy.filesystem.links =
        serde_json::from_value(own(&["filesystem", "links"])).unwrap_or_default();
    policy
        .process
        .env
        .set
        .retain(|key, _| !own(&["process", "env", "set", key]).is_null());
    Ok(policy)
}

/// Returns the named preset, or an error that lists the known names.
pub fn preset(name: &str) -> Result<Policy, PolicyError> {
    let Some(yaml) = crate::preset::yaml(name) else {
        let known = crate::preset::PRESETS
            .iter()
            .map(|(n, _, _)| *n)
            .collect::<Vec<_>>()
            .join(", ");
        return Err(PolicyError::UnknownPreset {
            name: name.to_owned(),
            known,
        });
    };
    // A daemon resolves the same preset at every create: each is read once per HOME (a
    // preset's `~/` is HOME's).
    type Read = Vec<((String, Option<std::ffi::OsString>), Policy)>;
    static READ: std::sync::Mutex<Read> = std::sync::Mutex::new(Vec::new());
    let key = (name.to_owned(), std::env::var_os("HOME"));
    let known = |read: &Read| read.iter().find(|(k, _)| *k == key).map(|(_, p)| p.clone());
    if let Some(policy) = READ.lock().ok().and_then(|read| known(&read)) {
        return Ok(policy);
    }
    let origin = format!("preset {name}");
    let policy = match yaml.trim() {
        // The empty document (the default preset): the model's own defaults, which is what the
        // YAML parser makes of it too (a test holds the two equal), without the parser's first
        // run in a new process (0.13 ms).
        "version: 1" => {
            let policy = Policy::default();
            validate(&origin, &policy)?;
            policy
        }
        _ => from_yaml(&origin, yaml)?,
    };
    if let Ok(mut read) = READ.lock()
        && read.len() < 64
    {
        read.push((key, policy.clone()));
    }
    Ok(policy)
}

/// The policy a document with `extends: base` means: the preset's, with the document's lists
/// appended to the preset's lists (an entry already there is not repeated), the document's
/// other values in place of the preset's, and then what `remove` names taken out (list entries
/// it matches, map keys it names).
fn compose(origin: &str, base: &str, text: &str) -> Result<Policy, PolicyError> {
    let unlocated = |message: String| PolicyError::Unlocated {
        origin: origin.to_owned(),
        message,
    };
    let base_policy = preset(base)?;
    let mut merged = serde_json::to_value(&base_policy)
        .map_err(|e| unlocated(format!("reading preset {base}: {e}")))?;
    let mut document: serde_json::Value =
        serde_saphyr::from_str(text).map_err(|err| syntax_error(origin, &err))?;
    let remove = document.as_object_mut().and_then(|doc| {
        doc.remove("extends");
        doc.remove("remove")
    });
    merge(&mut merged, document);
    if let Some(remove) = remove {
        subtract(&mut merged, &remove, "").map_err(unlocated)?;
    }
    serde_json::from_value(merged).map_err(|e| {
        unlocated(format!(
            "the document does not compose with preset {base}: {e}"
        ))
    })
}

/// Lays `top` over `base`: maps key by key, lists appended, anything else replaced.
fn merge(base: &mut serde_json::Value, top: serde_json::Value) {
    use serde_json::Value;
    match (base, top) {
        (Value::Object(base), Value::Object(top)) => {
            for (key, value) in top {
                match base.get_mut(&key) {
                    Some(slot) => merge(slot, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (Value::Array(base), Value::Array(top)) => {
            for item in top {
                if !base.contains(&item) {
                    base.push(item);
                }
            }
        }
        (base, top) => *base = top,
    }
}

/// Takes out of `base` what `remove` names; `at` is where in the policy (for errors). An entry
/// of a list of rules matches a rule whose fields it names all agree.
fn subtract(
    base: &mut serde_json::Value,
    remove: &serde_json::Value,
    at: &str,
) -> Result<(), String> {
    use serde_json::Value;
    let place = |key: &str| {
        if at.is_empty() {
            key.to_owned()
        } else {
            format!("{at}.{key}")
        }
    };
    match (base, remove) {
        (Value::Object(base), Value::Object(remove)) => {
            for (key, what) in remove {
                match (base.get_mut(key), what) {
                    (Some(slot), Value::Object(_) | Value::Array(_)) => {
                        subtract(slot, what, &place(key))?;
                    }
                    (Some(_), _) => {
                        base.remove(key);
                    }
                    (None, _) => {
                        return Err(format!(
                            "remove: {} is not in the policy it extends",
                            place(key)
                        ));
                    }
                }
            }
            Ok(())
        }
        (Value::Array(base), Value::Array(remove)) => {
            for what in remove {
                let matches = |item: &Value| match (item, what) {
                    (Value::Object(item), Value::Object(what)) => {
                        what.iter().all(|(k, v)| item.get(k) == Some(v))
                    }
                    (item, what) => item == what,
                };
                let before = base.len();
                base.retain(|item| !matches(item));
                if base.len() == before {
                    return Err(format!(
                        "remove: {what} is not in {at} of the policy it extends"
                    ));
                }
            }
            Ok(())
        }
        (_, _) => Err(format!(
            "remove: {at} is not a list or a map; write the value you want instead"
        )),
    }
}

/// The top-level sections a policy document writes out (`network`, `limits`, ...), as opposed
/// to those it leaves to their defaults; empty for a document that does not parse.
pub fn sections(text: &str) -> Vec<String> {
    let written: Vec<String> =
        serde_saphyr::from_str::<std::collections::BTreeMap<String, serde::de::IgnoredAny>>(text)
            .map(|map| map.into_keys().collect())
            .unwrap_or_default();
    if !written.iter().any(|s| s == "extends") {
        return written;
    }
    // A document that extends a preset writes every section the preset has.
    let mut all: Vec<String> = serde_json::to_value(Policy::default())
        .ok()
        .and_then(|v| v.as_object().map(|o| o.keys().cloned().collect()))
        .unwrap_or_default();
    all.extend(
        written
            .into_iter()
            .filter(|s| s != "extends" && s != "remove"),
    );
    all.sort();
    all.dedup();
    all
}

/// The policy as a document: every section and value written out (`warden policy show`).
pub fn to_yaml(policy: &Policy) -> String {
    serde_saphyr::to_string(policy).unwrap_or_else(|e| format!("# cannot be written: {e}\n"))
}

fn syntax_error(origin: &str, err: &serde_saphyr::Error) -> PolicyError {
    let mut message = first_line(&err.to_string());
    if message == "missing field `version`" {
        message = "the policy has no `version`; write `version: 1` as its first line".to_owned();
    }
    message = in_policy_terms(message);
    match err.location() {
        Some(at) => PolicyError::Syntax {
            origin: origin.to_owned(),
            line: at.line(),
            column: at.column(),
            message,
        },
        None => PolicyError::Unlocated {
            origin: origin.to_owned(),
            message,
        },
    }
}

/// The YAML reader's words where they speak of its own options or of Rust's types, in terms of
/// what to change in the policy.
fn in_policy_terms(message: String) -> String {
    if let Some(rest) = message.strip_prefix("duplicate mapping key: ") {
        let key = rest
            .split(", set DuplicateKeyPolicy")
            .next()
            .unwrap_or(rest);
        return format!("`{key}` is given twice in the same mapping; keep one of them");
    }
    if message.starts_with("multiple YAML documents detected") {
        return "a policy is one YAML document: remove the `---` or `...` and what follows it \
                (or put each policy in a file of its own)"
            .to_owned();
    }
    let whole = |max: &str| format!("expected a whole number from 0 to {max} here");
    match message.as_str() {
        "invalid u8" => whole("255"),
        "invalid u16" => whole("65535"),
        "invalid u32" => whole("4294967295"),
        "invalid u64" => whole("18446744073709551615"),
        "invalid floating point" => "expected a number here (like 2 or 0.5)".to_owned(),
        _ => message,
    }
}

/// The deserializer renders a source snippet after the message; the CLI prints its own context.
fn first_line(rendered: &str) -> String {
    let mut line = rendered.lines().next().unwrap_or(rendered).trim();
    // A leading "error: line L column C: " repeats what the error variant carries, too.
    line = line.strip_prefix("error: ").unwrap_or(line);
    if let Some(rest) = line.strip_prefix("line ")
        && let Some((_, after)) = rest.split_once(": ")
        && rest.split(' ').nth(1) == Some("column")
    {
        line = after;
    }
    // Drop a trailing " at line L column C" that repeats what the error variant carries.
    match line.find(" at line ") {
        Some(cut) => line[..cut].to_owned(),
        None => line.to_owned(),
    }
}

/// What makes a rule's host (its characters checked already) match other than it reads, if
/// anything: the gateway compares `*.domain` with the request's host name as text, after taking
/// its trailing dot off, so a pattern that is not a plain domain (`*.evil.test.`,
/// `*.evil.test:443`) matches no host at all, and a deny rule of it denies nothing; and it takes
/// a CIDR block to its network, so `10.1.2.3/0` is every IPv4 address.
fn host_pattern_problem(host: &str) -> Option<String> {
    let name_ok = |name: &str| {
        !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            })
    };
    if let Some(domain) = host.strip_prefix("*.") {
        if let Some(bare) = domain.strip_suffix('.')
            && name_ok(bare)
        {
            return Some(format!(
                "would match no host (names are compared without their trailing dot); write `*.{bare}`"
            ));
        }
        if !name_ok(domain) {
            return Some(
                "would match no host: after `*.` comes a domain name (letters, digits, `-` and dots; a port goes in `ports`)"
                    .to_owned(),
            );
        }
        return None;
    }
    if host.parse::<std::net::IpAddr>().is_ok() {
        return None;
    }
    if let Some((address, prefix)) = host.split_once('/') {
        let (Ok(address), Ok(prefix)) = (address.parse::<std::net::IpAddr>(), prefix.parse::<u8>())
        else {
            return Some("is not a CIDR block (write it like 10.0.0.0/8)".to_owned());
        };
        let bits: u32 = if address.is_ipv4() { 32 } else { 128 };
        if u32::from(prefix) > bits {
            return Some(format!("has a prefix longer than {bits} bits"));
        }
        let value = match address {
            std::net::IpAddr::V4(v4) => u128::from(u32::from(v4)),
            std::net::IpAddr::V6(v6) => u128::from(v6),
        };
        let host_bits = bits - u32::from(prefix);
        let mask = 1u128.checked_shl(host_bits).map_or(u128::MAX, |m| m - 1);
        if value & mask != 0 {
            let network = value & !mask;
            let network = match address {
                std::net::IpAddr::V4(_) => {
                    std::net::Ipv4Addr::from(u32::try_from(network).unwrap_or(0)).to_string()
                }
                std::net::IpAddr::V6(_) => std::net::Ipv6Addr::from(network).to_string(),
            };
            return Some(format!(
                "names {network}/{prefix}, every address of it, not the one address it shows; write `{network}/{prefix}` (or the address alone)"
            ));
        }
        return None;
    }
    if host.contains(':') || host.contains('/') {
        return Some("is not a host name (a port goes in `ports`, a path in `paths`)".to_owned());
    }
    None
}

/// Cells map 65536 ids; ids above that do not exist inside.
const MAX_INSIDE_ID: u32 = 65535;

/// Checks that need the whole document, or name features that are reserved in the schema but not
/// built yet. Each error says what to write instead.
fn validate(origin: &str, policy: &Policy) -> Result<(), PolicyError> {
    let invalid = |field: &'static str, message: &str| PolicyError::Invalid {
        origin: origin.to_owned(),
        field,
        message: message.to_owned(),
    };
    if let Err(message) = crate::CommandRules::compile(&policy.commands) {
        return Err(invalid("commands", &message));
    }
    if let Some(image) = &policy.image {
        let named = !image.is_empty()
            && image.len() <= 255
            && image
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-:/@".contains(&b));
        if !named {
            return Err(invalid(
                "image",
                &format!(
                    "{image:?} is not an image name (`warden image ls` lists the imported ones)"
                ),
            ));
        }
    }
    // A link is a name of its own: not on, above or below anything the cell mounts.
    let fs = &policy.filesystem;
    let fixed = ["/proc", "/dev", "/sys", "/tmp", "/etc"].map(std::path::Path::new);
    let mounted = fixed
        .into_iter()
        .chain(std::iter::once(fs.workspace.mount.as_path()))
        .chain(fs.read_only.iter().map(|p| p.as_path()))
        .chain(fs.read_write.iter().map(|p| p.as_path()))
        .chain(fs.hidden.iter().map(|p| p.as_path()));
    for other in mounted {
        if let Some(link) = fs
            .links
            .keys()
            .find(|link| link.starts_with(other) || other.starts_with(link))
        {
            return Err(invalid(
                "filesystem.links",
                &format!(
                    "link `{}` would sit on, above or inside `{}`, which the cell mounts; pick a path of its own",
                    link.display(),
                    other.display()
                ),
            ));
        }
    }
    if policy.network.ask.iter().any(|r| r.credential.is_some()) {
        return Err(invalid(
            "network.ask",
            "`ask` rules cannot bind a credential; put the credential on an allow rule",
        ));
    }
    for (list, rules) in [
        ("network.allow", &policy.network.allow),
        ("network.deny", &policy.network.deny),
        ("network.ask", &policy.network.ask),
    ] {
        for rule in rules {
            let host = rule.host.as_str();
            let valid = !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b".-*:/".contains(&b))
                && (!host.contains('*') || (host.starts_with("*.") && !host[2..].contains('*')));
            if !valid {
                return Err(invalid(
                    list,
                    &format!(
                        "host `{host}` must be a host name, `*.domain`, an IP address or a CIDR block"
                    ),
                ));
            }
            if let Some(problem) = host_pattern_problem(host) {
                return Err(invalid(list, &format!("host `{host}` {problem}")));
            }
            if let Some(method) = rule
                .methods
                .iter()
                .find(|m| m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()))
            {
                return Err(invalid(
                    list,
                    &format!("method `{method}` must be an upper-case HTTP method like GET"),
                ));
            }
            if let Some(path) = rule.paths.iter().find(|p| !p.starts_with('/')) {
                return Err(invalid(list, &format!("path `{path}` must start with /")));
            }
            if rule.ports.contains(&0) {
                return Err(invalid(list, "port 0 is not a port"));
            }
        }
    }
    for (name, credential) in &policy.credentials {
        let field = "credentials";
        match (&credential.from_env, &credential.from_file) {
            (Some(_), None) | (None, Some(_)) => {}
            _ => {
                return Err(invalid(
                    field,
                    &format!("`{name}` needs exactly one of from_env or from_file"),
                ));
            }
        }
        if !credential.format.contains("{}") {
            return Err(invalid(
                field,
                &format!("the format of `{name}` must contain {{}} where the secret goes"),
            ));
        }
        let header_ok = !credential.header.is_empty()
            && credential
                .header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !header_ok {
            return Err(invalid(
                field,
                &format!("the header of `{name}` is not a header name"),
            ));
        }
    }
    for rule in policy.network.allow.iter().chain(&policy.network.deny) {
        if let Some(name) = &rule.credential
            && !policy.credentials.contains_key(name)
        {
            return Err(invalid(
                "network",
                &format!(
                    "rule for `{}` names credential `{name}`, which `credentials` does not define",
                    rule.host
                ),
            ));
        }
    }
    if let Some(inference) = &policy.network.inference {
        let field = "network.inference";
        let Some(rest) = inference
            .upstream
            .strip_prefix("http://")
            .or_else(|| inference.upstream.strip_prefix("https://"))
        else {
            return Err(invalid(
                field,
                "upstream must be an http:// or https:// URL (a local model server, or a provider's API)",
            ));
        };
        let authority = rest.split('/').next().unwrap_or("");
        if authority.is_empty() || authority.contains('@') {
            return Err(invalid(
                field,
                "upstream must name a host (and port), without user info",
            ));
        }
        if let Some(name) = &inference.credential {
            match policy.credentials.get(name) {
                None => {
                    return Err(invalid(
                        field,
                        &format!("credential `{name}` is not defined in `credentials`"),
                    ));
                }
                // A model can be asked to write its request back in any form: the secret goes
                // in the header only.
                Some(credential) if credential.in_body => {
                    return Err(invalid(
                        field,
                        &format!(
                            "credential `{name}` has in_body: true, which a model API route may not have (the model could be asked to echo the body)"
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        let name_ok = !inference.name.is_empty()
            && inference
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        if !name_ok {
            return Err(invalid(field, "name must be a host name"));
        }
    }
    for entry in &policy.filesystem.workspace.protect {
        let path = Path::new(entry);
        if entry.is_empty()
            || path.is_absolute()
            || path
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(invalid(
                "filesystem.workspace.protect",
                &format!(
                    "`{entry}` must be a plain path relative to the workspace (no `..`, no leading /)"
                ),
            ));
        }
    }
    if let Some(name) = &policy.process.hostname {
        let valid = !name.is_empty()
            && name.len() <= 63
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !valid {
            return Err(invalid(
                "process.hostname",
                "must be 1-63 letters, digits or dashes",
            ));
        }
    }
    if policy.process.user() > MAX_INSIDE_ID || policy.process.group() > MAX_INSIDE_ID {
        return Err(invalid(
            "process.user",
            &format!("user and group ids inside a cell must be at most {MAX_INSIDE_ID}"),
        ));
    }
    if policy.limits.pids == Some(0) {
        return Err(invalid(
            "limits.pids",
            "must be at least 1 (use null for no limit)",
        ));
    }
    if policy.limits.memory.is_some_and(|m| m.0 < (4 << 20)) {
        return Err(invalid(
            "limits.memory",
            "must be at least 4MiB (use null for no limit)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preset_read_again_is_the_same_preset() {
        for (name, _, _) in crate::preset::PRESETS {
            let fresh = from_yaml("fresh", crate::preset::yaml(name).unwrap()).unwrap();
            // (The default preset is made without the YAML parser: this holds it to the
            // parser's reading.) The first reading is kept, the second is that one.
            assert_eq!(preset(name).unwrap(), fresh, "{name}");
            assert_eq!(preset(name).unwrap(), fresh, "{name}");
        }
        assert!(matches!(
            preset("no-such-preset"),
            Err(PolicyError::UnknownPreset { .. })
        ));
    }

    #[test]
    fn sections_are_those_the_document_writes_out() {
        let text = "version: 1\nnetwork:\n  default: deny\ncommands:\n  default: allow\n";
        assert_eq!(sections(text), ["commands", "network", "version"]);
        assert!(sections("[not, a, map]").is_empty());
    }

    #[test]
    fn unknown_field_reports_line_and_column() {
        let err = from_yaml("p.yaml", "version: 1\nlimits:\n  memroy: 1GiB\n").unwrap_err();
        match err {
            PolicyError::Syntax {
                line,
                column,
                message,
                ..
            } => {
                assert_eq!((line, column), (3, 3), "{message}");
                assert!(message.contains("memroy"), "{message}");
            }
            other => panic!("expected a located error, got {other}"),
        }
    }

    #[test]
    fn bad_size_reports_its_location() {
        let err = from_yaml("p.yaml", "version: 1\nlimits:\n  memory: lots\n").unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("p.yaml:3:"), "{text}");
        assert!(text.contains("not a size"), "{text}");
    }

    #[test]
    fn a_missing_version_says_what_to_write_once() {
        let err = from_yaml("p.yaml", "network:\n  default: deny\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "p.yaml:1:1: the policy has no `version`; write `version: 1` as its first line"
        );
        let err = from_yaml("p.yaml", "version: 1\nlimits:\n  memroy: 1GiB\n")
            .unwrap_err()
            .to_string();
        assert_eq!(err.matches("line").count(), 0, "{err}");
    }

    #[test]
    fn wrong_version_is_refused() {
        let err = from_yaml("p.yaml", "version: 2\n").unwrap_err().to_string();
        assert!(err.contains("unsupported policy version 2"), "{err}");
    }

    #[test]
    fn missing_sections_take_defaults() {
        let policy = from_yaml("p.yaml", "version: 1\nlimits:\n  pids: 64\n").unwrap();
        assert_eq!(policy.limits.pids, Some(64));
        assert_eq!(policy.limits.memory, Policy::default().limits.memory);
        assert_eq!(policy.filesystem, Policy::default().filesystem);
    }

    #[test]
    fn relative_paths_are_refused() {
        let err = from_yaml("p.yaml", "version: 1\nfilesystem:\n  read_only: [usr]\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be absolute"), "{err}");
    }

    #[test]
    fn reserved_features_are_named() {
        assert!(from_yaml("p.yaml", "version: 1\nnetwork:\n  ask: [{host: x.org}]\n").is_ok());
        assert!(
            from_yaml(
                "p.yaml",
                "version: 1\nnetwork:\n  ask: [{host: x.org, methods: [POST], paths: ['/x/**']}]\n",
            )
            .is_ok()
        );
        let err = from_yaml(
            "p.yaml",
            "version: 1\nnetwork:\n  ask: [{host: x.org, credential: api}]\ncredentials:\n  api: {from_env: X}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cannot bind a credential"), "{err}");
        let err = from_yaml("p.yaml", "version: 1\nnetwork:\n  ask: [{host: 'a b'}]\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("network.ask"), "{err}");
        let err = from_yaml(
            "p.yaml",
            "version: 1\nfilesystem:\n  workspace:\n    protect: ['../x']\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("plain path"), "{err}");
    }

    #[test]
    fn inference_routes_are_checked() {
        let ok = "version: 1\nnetwork:\n  inference:\n    upstream: http://127.0.0.1:8000/api\n    credential: k\n    max_tokens: 10\ncredentials:\n  k: { from_env: K }\n";
        let policy = from_yaml("p.yaml", ok).unwrap();
        let inference = policy.network.inference.as_ref().unwrap();
        assert_eq!(inference.name, "inference.warden");
        assert!(policy.network.has_gateway());
        for (bad, says) in [
            ("upstream: ftp://api.openai.com", "http:// or https:// URL"),
            ("upstream: http://", "must name a host"),
            ("upstream: http://u@h", "must name a host"),
            (
                "upstream: http://h\n    credential: nope",
                "credential `nope`",
            ),
            ("upstream: http://h\n    name: 'a b'", "host name"),
        ] {
            let yaml = format!("version: 1\nnetwork:\n  inference:\n    {bad}\n");
            let err = from_yaml("p.yaml", &yaml).unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn credentials_must_be_defined_and_have_one_source() {
        let undefined = "version: 1\nnetwork:\n  allow:\n    - host: x.org\n      credential: gh\n";
        let err = from_yaml("p.yaml", undefined).unwrap_err().to_string();
        assert!(err.contains("names credential `gh`"), "{err}");
        let both = "version: 1\ncredentials:\n  gh: { from_env: A, from_file: /b }\n";
        let err = from_yaml("p.yaml", both).unwrap_err().to_string();
        assert!(
            err.contains("exactly one of from_env or from_file"),
            "{err}"
        );
        let ok = "version: 1\nnetwork:\n  allow:\n    - host: x.org\n      credential: gh\ncredentials:\n  gh: { from_env: GH_TOKEN }\n";
        let policy = from_yaml("p.yaml", ok).unwrap();
        assert_eq!(policy.credentials["gh"].header, "Authorization");
        assert_eq!(policy.credentials["gh"].format, "Bearer {}");
    }

    #[test]
    fn every_preset_is_written_back_as_a_document_that_reads_the_same() {
        for (name, _, _) in crate::PRESETS {
            let policy = crate::preset(name).unwrap();
            let text = to_yaml(&policy);
            let again = from_yaml("shown", &text).unwrap_or_else(|e| panic!("{name}: {e}\n{text}"));
            assert_eq!(again, policy, "{name}:\n{text}");
        }
    }

    #[test]
    fn extends_appends_lists_replaces_values_and_removes_what_it_names() {
        let text = "version: 1\nextends: default\nfilesystem:\n  read_only: [/opt/tools, /usr]\n\
                    limits:\n  memory: 2GiB\n  pids: null\nnetwork:\n  allow:\n    - host: pypi.org\n\
                    remove:\n  filesystem:\n    read_only: [/etc/perl]\n  process:\n    env:\n      set:\n        LANG: x\n";
        let policy = from_yaml("p.yaml", text).unwrap();
        let base = Policy::default();
        let ro = &policy.filesystem.read_only;
        assert_eq!(
            ro.len(),
            base.filesystem.read_only.len(),
            "one added, one removed, /usr kept once"
        );
        assert!(ro.contains(&"/opt/tools".into()) && !ro.contains(&"/etc/perl".into()));
        assert_eq!(
            ro.iter()
                .filter(|p| *p == std::path::Path::new("/usr"))
                .count(),
            1
        );
        assert_eq!(policy.limits.memory, Some(crate::ByteSize(2 << 30)));
        assert_eq!(policy.limits.pids, None);
        assert_eq!(
            policy.limits.output, base.limits.output,
            "what is not written stays"
        );
        assert_eq!(policy.network.allow.len(), 1);
        assert!(!policy.process.env.set.contains_key("LANG"));
        assert!(policy.process.env.set.contains_key("PATH"));
        assert_eq!(policy.extends, None);
    }

    #[test]
    fn extends_errors_name_what_is_wrong() {
        let bad = |text: &str| from_yaml("p.yaml", text).unwrap_err().to_string();
        assert!(bad("version: 1\nextends: nope\n").contains("unknown preset `nope`"));
        let missing = bad(
            "version: 1\nextends: default\nremove:\n  filesystem:\n    read_only: [/not/there]\n",
        );
        assert!(
            missing.contains("/not/there") && missing.contains("filesystem.read_only"),
            "{missing}"
        );
        assert!(bad("version: 1\nremove: {limits: {memory: x}}\n").contains("needs `extends"));
        // The document's own mistakes keep their line and column.
        let typo = bad("version: 1\nextends: default\nlimits:\n  memroy: 1GiB\n");
        assert!(typo.starts_with("p.yaml:4:"), "{typo}");
    }

    #[test]
    fn every_preset_parses() {
        for (name, _, _) in crate::PRESETS {
            preset(name).unwrap();
        }
        assert_eq!(preset("default").unwrap(), Policy::default());
    }

    /// A resolved policy travels as JSON (a cell spec to its tier): it must come back the same.
    #[test]
    fn every_preset_survives_a_json_round_trip() {
        for (name, _, _) in crate::PRESETS {
            let policy = preset(name).unwrap();
            let text = serde_json::to_string(&policy).unwrap();
            let back: Policy = serde_json::from_str(&text).unwrap();
            assert_eq!(back, policy, "{name}: {text}");
        }
        let full = from_yaml(
            "t",
            "version: 1\nlimits: {memory: 64MiB, wall: 90s, disk: 1GiB}\nnetwork:\n  allow: [{host: 10.0.0.1, ports: [80]}]\n  ask: [{host: example.org}]\n",
        )
        .unwrap();
        let back: Policy = serde_json::from_str(&serde_json::to_string(&full).unwrap()).unwrap();
        assert_eq!(back, full);
    }

    /// A host pattern the gateway would match against nothing, or against more than it shows,
    /// is refused with what to write: `*.evil.test.` in a deny list denied no host at all.
    #[test]
    fn host_patterns_that_match_other_than_they_read_are_refused() {
        let refused = |host: &str| {
            let yaml = format!("version: 1\nnetwork:\n  deny: [{{host: \"{host}\"}}]\n");
            from_yaml("p.yaml", &yaml)
                .map(|_| ())
                .map_err(|e| e.to_string())
                .err()
        };
        for (host, says) in [
            ("*.evil.test.", "write `*.evil.test`"),
            ("*.evil.test:443", "would match no host"),
            ("*.evil..test", "would match no host"),
            ("*.evil.test/x", "would match no host"),
            ("10.1.2.3/0", "write `0.0.0.0/0`"),
            ("10.1.2.3/8", "write `10.0.0.0/8`"),
            ("fd00::1/8", "write `fd00::/8`"),
            ("10.0.0.0/33", "longer than 32 bits"),
            ("evil.test:443", "a port goes in `ports`"),
        ] {
            let err = refused(host).unwrap_or_else(|| panic!("{host} was taken"));
            assert!(
                err.contains("network.deny") && err.contains(says),
                "{host}: {err}"
            );
        }
        for host in [
            "*.evil.test",
            "evil.test.",
            "10.0.0.0/8",
            "10.1.2.3/32",
            "0.0.0.0/0",
            "::1",
            "fd00::/8",
            "192.0.2.7",
        ] {
            assert_eq!(refused(host), None, "{host}");
        }
    }

    #[test]
    fn unknown_preset_lists_known_ones() {
        let err = preset("nope").unwrap_err().to_string();
        assert!(
            err.contains("unknown preset `nope`") && err.contains("default"),
            "{err}"
        );
    }
}
