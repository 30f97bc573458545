//! Credentials: the caller's secrets, which the cell only ever sees as placeholders. The gateway
//! puts a secret into the header its binding names, only on requests that a rule bound to that
//! credential allows; refuses any request that carries a placeholder elsewhere; and replaces the
//! secret by its placeholder in everything it sends back to the cell.

use std::collections::BTreeMap;
use std::io::{self, Write};

use warden_policy::Credential;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("credential `{name}`: the caller's environment has no {var}")]
    MissingEnv { name: String, var: String },
    #[error("credential `{name}`: reading {path}: {source}")]
    File {
        name: String,
        path: String,
        source: io::Error,
    },
    #[error("credential `{name}` is empty")]
    Empty { name: String },
}

/// One resolved credential.
#[derive(Clone)]
pub struct Secret {
    pub name: String,
    pub placeholder: String,
    pub value: String,
    pub header: String,
    pub format: String,
    /// The environment variable the cell gets the placeholder in.
    pub env: Option<String>,
    /// The placeholder is also swapped in request bodies (see `Credential::in_body`).
    pub in_body: bool,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the value.
        f.debug_struct("Secret")
            .field("name", &self.name)
            .field("placeholder", &self.placeholder)
            .finish_non_exhaustive()
    }
}

/// The credentials of one cell.
#[derive(Debug, Clone, Default)]
pub struct Secrets {
    pub all: Vec<Secret>,
}

impl Secrets {
    /// Reads every credential from the caller's environment or files and gives each a random
    /// placeholder.
    pub fn load(credentials: &BTreeMap<String, Credential>) -> Result<Self, SecretError> {
        let mut all = Vec::new();
        for (name, credential) in credentials {
            let value = match (&credential.from_env, &credential.from_file) {
                (Some(var), _) => std::env::var(var).map_err(|_| SecretError::MissingEnv {
                    name: name.clone(),
                    var: var.clone(),
                })?,
                (None, Some(path)) => std::fs::read_to_string(path)
                    .map_err(|source| SecretError::File {
                        name: name.clone(),
                        path: path.display().to_string(),
                        source,
                    })?
                    .trim_end_matches(['\n', '\r'])
                    .to_owned(),
                (None, None) => String::new(),
            };
            if value.is_empty() {
                return Err(SecretError::Empty { name: name.clone() });
            }
            all.push(Secret {
                name: name.clone(),
                placeholder: placeholder_for(&value).map_err(|source| SecretError::File {
                    name: name.clone(),
                    path: "/dev/urandom".to_owned(),
                    source,
                })?,
                value,
                header: credential.header.clone(),
                format: credential.format.clone(),
                env: credential.from_env.clone(),
                in_body: credential.in_body,
            });
        }
        Ok(Self { all })
    }

    pub fn get(&self, name: &str) -> Option<&Secret> {
        self.all.iter().find(|s| s.name == name)
    }

    /// `bytes` with every secret replaced by its placeholder: for whatever the gateway writes
    /// from bytes that may hold a secret (a record, a refusal) other than through a [`Replacer`].
    pub fn scrubbed(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut scrubber = Replacer::scrubbing(&mut out, self);
        // Writing to a vector cannot fail.
        let _ = scrubber
            .write_all(bytes)
            .and_then(|()| scrubber.finish().map(drop));
        out
    }

    /// `text` with every secret replaced by its placeholder.
    pub fn scrubbed_text(&self, text: &str) -> String {
        String::from_utf8_lossy(&self.scrubbed(text.as_bytes())).into_owned()
    }

    /// The credential whose placeholder appears in `bytes`, if any.
    pub fn placeholder_in(&self, bytes: &[u8]) -> Option<&Secret> {
        self.all
            .iter()
            .find(|s| contains(bytes, s.placeholder.as_bytes()))
    }
}

/// A random placeholder exactly as long as the secret, so that replacing one by the other in
/// a response never changes its length (and so its Content-Length or chunk sizes).
fn placeholder_for(secret: &str) -> io::Result<String> {
    use std::io::Read as _;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut random = std::fs::File::open("/dev/urandom")?;
    let mut out = String::with_capacity(secret.len());
    let mut byte = [0u8; 1];
    while out.len() < secret.len() {
        random.read_exact(&mut byte)?;
        // Rejection sampling keeps every character equally likely.
        if usize::from(byte[0]) < 252 {
            out.push(char::from(ALPHABET[usize::from(byte[0]) % ALPHABET.len()]));
        }
    }
    Ok(out)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// Why a request body was stopped: it carries the placeholder of credential `.0` toward a
/// destination that credential is not bound to.
#[derive(Debug, thiserror::Error)]
#[error(
    "the request body carries the placeholder of credential `{0}` to a destination that credential is not bound to"
)]
pub struct PlaceholderInBody(pub String);

/// A writer that lets a request body through only while it carries no placeholder of a
/// credential other than `bound` (also one split across writes): the write that would complete
/// one fails with [`PlaceholderInBody`] and passes nothing on, so the upstream is left with an
/// unfinished request.
pub struct PlaceholderGuard<W: Write> {
    inner: W,
    watched: Vec<(String, Vec<u8>)>,
    /// Bytes of the last writes that could begin a placeholder the next write completes.
    tail: Vec<u8>,
    keep: usize,
}

impl<W: Write> PlaceholderGuard<W> {
    pub fn new(inner: W, secrets: &Secrets, bound: Option<&str>) -> Self {
        let watched = secrets
            .all
            .iter()
            .filter(|s| Some(s.name.as_str()) != bound && !s.placeholder.is_empty())
            .map(|s| (s.name.clone(), s.placeholder.clone().into_bytes()))
            .collect::<Vec<_>>();
        let keep = watched.iter().map(|(_, p)| p.len() - 1).max().unwrap_or(0);
        Self {
            inner,
            watched,
            tail: Vec::new(),
            keep,
        }
    }
}

impl<W: Write> Write for PlaceholderGuard<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.watched.is_empty() {
            return self.inner.write(buf);
        }
        let mut window = std::mem::take(&mut self.tail);
        window.extend_from_slice(buf);
        if let Some((name, _)) = self.watched.iter().find(|(_, p)| contains(&window, p)) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                PlaceholderInBody(name.clone()),
            ));
        }
        self.inner.write_all(buf)?;
        self.tail = window.split_off(window.len().saturating_sub(self.keep));
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A writer that replaces byte strings by others of the same length, also across write
/// boundaries: the last bytes that could start one are held back until the next write or
/// `finish`. `scrubbing` puts placeholders in place of every secret (responses to the cell);
/// `injecting` puts one secret in place of its placeholder (a request body it is bound to).
pub struct Replacer<W: Write> {
    inner: W,
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
    held: Vec<u8>,
}

impl<W: Write> Replacer<W> {
    pub fn injecting(inner: W, secret: &Secret) -> Self {
        Self {
            inner,
            pairs: vec![(
                secret.placeholder.clone().into_bytes(),
                secret.value.clone().into_bytes(),
            )],
            held: Vec::new(),
        }
    }

    pub fn scrubbing(inner: W, secrets: &Secrets) -> Self {
        let pairs = secrets
            .all
            .iter()
            .map(|s| {
                (
                    s.value.clone().into_bytes(),
                    s.placeholder.clone().into_bytes(),
                )
            })
            .collect();
        Self {
            inner,
            pairs,
            held: Vec::new(),
        }
    }

    fn keep_back(&self) -> usize {
        self.pairs
            .iter()
            .map(|(secret, _)| secret.len().saturating_sub(1))
            .max()
            .unwrap_or(0)
    }

    fn scrub(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        for (secret, placeholder) in &self.pairs {
            if secret.is_empty() {
                continue;
            }
            let mut replaced = Vec::with_capacity(out.len());
            let mut i = 0;
            while i < out.len() {
                if out[i..].starts_with(secret) {
                    replaced.extend_from_slice(placeholder);
                    i += secret.len();
                } else {
                    replaced.push(out[i]);
                    i += 1;
                }
            }
            out = replaced;
        }
        out
    }

    /// Writes what is held back.
    pub fn finish(mut self) -> io::Result<W> {
        let held = std::mem::take(&mut self.held);
        let rest = self.scrub(&held);
        self.inner.write_all(&rest)?;
        self.inner.flush()?;
        Ok(self.inner)
    }
}

impl<W: Write> Write for Replacer<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.held.extend_from_slice(buf);
        let keep = self.keep_back();
        if self.held.len() > keep {
            // Only bytes that cannot be the start of a secret split across writes go out.
            let mut cut = self.held.len() - keep;
            let scrubbed_all = self.scrub(&self.held);
            if scrubbed_all == self.held {
                // No secret anywhere in what is held: emit all but the tail.
                let out: Vec<u8> = self.held.drain(..cut).collect();
                self.inner.write_all(&out)?;
            } else {
                // A secret is in there: scrub, then keep back the tail of the scrubbed bytes.
                cut = scrubbed_all.len().saturating_sub(keep);
                self.inner.write_all(&scrubbed_all[..cut])?;
                self.held = scrubbed_all[cut..].to_vec();
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secrets() -> Secrets {
        Secrets {
            all: vec![Secret {
                name: "api".into(),
                placeholder: "PLACEHOLDER!".into(),
                value: "s3cr3t-value".into(),
                header: "Authorization".into(),
                format: "Bearer {}".into(),
                env: None,
                in_body: true,
            }],
        }
    }

    #[test]
    fn an_unbound_placeholder_stops_a_body_even_split_across_writes() {
        let secrets = secrets();
        let placeholder = secrets.all[0].placeholder.clone();
        let (head, tail) = placeholder.split_at(placeholder.len() / 2);
        let mut sent = Vec::new();
        let mut guard = PlaceholderGuard::new(&mut sent, &secrets, None);
        guard.write_all(b"user=agent&password=").unwrap();
        guard.write_all(head.as_bytes()).unwrap();
        let err = guard.write_all(tail.as_bytes()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
        assert!(err.to_string().contains("`api`"), "{err}");
        assert!(
            !contains(&sent, placeholder.as_bytes()),
            "the placeholder went out whole"
        );
        // Bound to this destination, the same bytes pass.
        let mut sent = Vec::new();
        let mut guard = PlaceholderGuard::new(&mut sent, &secrets, Some("api"));
        guard.write_all(placeholder.as_bytes()).unwrap();
        assert_eq!(sent, placeholder.as_bytes());
    }

    #[test]
    fn a_bound_body_gets_the_secret_in_place_of_its_placeholder_across_writes() {
        let secrets = secrets();
        let text = b"{\"token\": \"PLACEHOLDER!\", \"again\": \"PLACEHOLDER!\"}";
        for split in 1..text.len() {
            let mut injector = Replacer::injecting(Vec::new(), &secrets.all[0]);
            injector.write_all(&text[..split]).unwrap();
            injector.write_all(&text[split..]).unwrap();
            let out = injector.finish().unwrap();
            assert_eq!(
                out, b"{\"token\": \"s3cr3t-value\", \"again\": \"s3cr3t-value\"}",
                "split at {split}"
            );
            assert_eq!(out.len(), text.len(), "the length never changes");
        }
    }

    #[test]
    fn secrets_never_pass_even_split_across_writes() {
        let text = b"token=s3cr3t-value; again s3cr3t-value end";
        for split in 1..text.len() {
            let mut scrubber = Replacer::scrubbing(Vec::new(), &secrets());
            scrubber.write_all(&text[..split]).unwrap();
            scrubber.write_all(&text[split..]).unwrap();
            let out = String::from_utf8(scrubber.finish().unwrap()).unwrap();
            assert_eq!(
                out, "token=PLACEHOLDER!; again PLACEHOLDER! end",
                "split at {split}"
            );
        }
    }
}
